//! The rules over flat fp32 buffers in host memory, stepped in place without going through
//! tensors: the arithmetic is done in f32 in the tensor optimizers' order, with the scalars
//! (bias corrections, `lr * ratio`) computed in f64 and cast to f32 as torch does for a float
//! tensor times a double scalar.
//!
//! Work is split into fixed blocks of [`BLOCK`] elements run in parallel with rayon. Norms are
//! f64 sums of squares per block, added in block order, so results do not depend on the number
//! of threads. LAMB's first half computes its update for the sums of squares and its second
//! half computes it again rather than storing it. AdamW runs as one fused pass per segment
//! (`vector.rs`): gradient factors, the rule, clearing the gradient and the half-precision
//! copy of the weights in one read and one write of each buffer.
use rayon::prelude::*;

use super::half::Half;
use super::vector::{self, Pass};
use super::{CpuRule, Segment};
use crate::optim::lamb::LambStep;
use crate::optim::lars::LarsStep;

/// Elements per parallel block (a fixed partition keeps reductions deterministic). 2^18 was
/// tried on the 2-core machine: no steadier gain over gigabytes than its run-to-run noise.
pub const BLOCK: usize = 1 << 14;

/// An optimizer stepping flat fp32 buffers in place, with its state in flat buffers alongside.
#[derive(Debug)]
pub struct HostOptimizer {
    rule: CpuRule,
    step: i32,
    segments: Vec<Segment>,
    len: usize,
    /// Adam's first moment (`exp_avg`), or LARS's momentum buffer (empty without momentum).
    m: Vec<f32>,
    /// Adam's second moment (`exp_avg_sq`); empty for LARS.
    v: Vec<f32>,
}

/// What a step does beside the rule (see [`HostOptimizer::step_with`]); the default is
/// nothing.
#[derive(Debug, Default)]
pub struct StepExtras<'a> {
    /// Factors the gradients are multiplied by before the rule reads them, in order, each
    /// product rounded to `f32` (loss-scale unscaling, then the clipping coefficient): the
    /// same values as scaling the gradient buffer in place by each, without the passes.
    pub grad_factors: &'a [f64],
    /// Where to write the new weights in half precision too (the buffer a GPU's compute copy
    /// is uploaded from), of the weights' length.
    pub half_out: Option<(Half, &'a mut [u16])>,
    /// Leave the gradients as they are instead of clearing them in the pass (where the next
    /// gradient overwrites the buffer rather than adding to it).
    pub keep_gradients: bool,
}

/// The sum of squares of `x` in f64: per-block sums added in block order, so the result does not
/// depend on the thread count.
pub fn sum_squares(x: &[f32]) -> f64 {
    sum_squares_scaled(x, &[])
}

/// The sum of squares of `x` multiplied by `factors` in order (each product rounded to `f32`,
/// as [`StepExtras::grad_factors`]), reading `x` once and writing nothing: the norm of
/// gradients that are unscaled in the update's own pass.
pub fn sum_squares_scaled(x: &[f32], factors: &[f64]) -> f64 {
    let factors: Vec<f32> = factors.iter().map(|&f| f as f32).collect();
    let partials: Vec<f64> = x.par_chunks(BLOCK).map(|b| vector::block_sum_squares(b, &factors)).collect();
    partials.iter().sum()
}

/// Multiplies `g` by `factors` in order, in place (the rules whose passes do not take them).
fn scale_in_place(g: &mut [f32], factors: &[f64]) {
    for &f in factors {
        let f = f as f32;
        g.par_chunks_mut(BLOCK).for_each(|b| b.iter_mut().for_each(|x| *x *= f));
    }
}

impl HostOptimizer {
    /// An optimizer for buffers of `len` elements holding `segments` (in bounds, not
    /// overlapping; elements outside every segment are left alone). State is zero-initialised.
    ///
    /// # Panics
    /// If a segment is out of bounds or two overlap.
    pub fn new(rule: CpuRule, segments: Vec<Segment>, len: usize) -> HostOptimizer {
        let mut sorted: Vec<&Segment> = segments.iter().collect();
        sorted.sort_by_key(|s| s.offset);
        let mut end = 0;
        for s in sorted {
            assert!(s.offset >= end, "segment {} overlaps the one before it", s.name);
            end = s.offset + s.len;
            assert!(end <= len, "segment {} ends at {end}, past the buffer's {len}", s.name);
        }
        let slots = rule.state_slots().len();
        let buffer = |slot: usize| if slot < slots { vec![0.0; len] } else { Vec::new() };
        HostOptimizer { rule, step: 0, segments, len, m: buffer(0), v: buffer(1) }
    }

    /// The rule and its hyper-parameters.
    pub fn rule(&self) -> &CpuRule {
        &self.rule
    }

    /// The segments stepped.
    pub fn segments(&self) -> &[Segment] {
        &self.segments
    }

    /// Steps taken so far.
    pub fn steps(&self) -> i32 {
        self.step
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        self.rule.lr()
    }

    /// Sets the learning rate (for schedules).
    pub fn set_lr(&mut self, lr: f64) {
        self.rule.set_lr(lr);
    }

    /// Bytes of optimizer state (moments or momentum buffer).
    pub fn state_bytes(&self) -> usize {
        (self.m.len() + self.v.len()) * std::mem::size_of::<f32>()
    }

    /// One step over weights `w` with gradients `g` (both the buffer's length), in place on `w`,
    /// with each segment's norms taken over this buffer, clearing `g`: [`HostOptimizer::prepare`]
    /// then [`HostOptimizer::finish`].
    ///
    /// # Panics
    /// If `w` or `g` is not the buffer's length.
    pub fn step(&mut self, w: &mut [f32], g: &mut [f32]) {
        self.step_with(w, g, StepExtras::default());
    }

    /// [`HostOptimizer::step`] with the gradient factors and half-precision copy of `extras`
    /// (for AdamW all in the update's one pass).
    ///
    /// # Panics
    /// If `w`, `g` or the half buffer is not the buffer's length.
    pub fn step_with(&mut self, w: &mut [f32], g: &mut [f32], extras: StepExtras) {
        if !self.fuses_factors() {
            scale_in_place(g, extras.grad_factors);
        }
        let factors = if self.fuses_factors() { extras.grad_factors } else { &[] };
        let sums = self.prepare(w, g);
        self.finish_with(w, g, &sums, StepExtras { grad_factors: factors, ..extras });
    }

    /// Whether [`HostOptimizer::finish_with`] applies gradient factors in its pass (AdamW,
    /// whose first half reads no gradient). For the other rules multiply the gradients before
    /// [`HostOptimizer::prepare`], which reads them.
    pub fn fuses_factors(&self) -> bool {
        matches!(self.rule, CpuRule::AdamW(_))
    }

    /// First half of a step: advances the step count, updates the moments (LAMB) and returns
    /// per segment the sums of squares the trust ratio needs (LAMB: weights and update; LARS:
    /// weights and gradient; zeros otherwise). When a parameter is split across buffers (shards
    /// on several ranks), add the sums of all its pieces before [`HostOptimizer::finish`].
    ///
    /// # Panics
    /// If `w` or `g` is not the buffer's length.
    pub fn prepare(&mut self, w: &[f32], g: &[f32]) -> Vec<[f64; 2]> {
        assert_eq!(w.len(), self.len, "weights: wrong length");
        assert_eq!(g.len(), self.len, "gradients: wrong length");
        self.step += 1;
        let HostOptimizer { rule, step, segments, m, v, .. } = self;
        segments
            .iter()
            .map(|s| {
                let r = s.range();
                let (w, g) = (&w[r.clone()], &g[r.clone()]);
                match *rule {
                    CpuRule::AdamW(_) => [0.0; 2],
                    CpuRule::Lamb(c) => {
                        lamb_prepare(&c.at(*step, s.adapt), s.adapt, w, &mut m[r.clone()], &mut v[r], g)
                    }
                    CpuRule::Lars(_) if s.adapt => [sum_squares(w), sum_squares(g)],
                    CpuRule::Lars(_) => [0.0; 2],
                }
            })
            .collect()
    }

    /// Second half of a step: the update of `w` (and AdamW's and LARS's state), with the whole
    /// parameters' sums of squares (one pair per segment, as [`HostOptimizer::prepare`]
    /// returned them, summed over pieces). Clears `g` for the next accumulation, in the same
    /// pass that reads it: a separate zeroing pass would stream the whole buffer through memory
    /// once more.
    ///
    /// # Panics
    /// If `w`, `g` or `sums` has the wrong length.
    pub fn finish(&mut self, w: &mut [f32], g: &mut [f32], sums: &[[f64; 2]]) {
        self.finish_with(w, g, sums, StepExtras::default());
    }

    /// [`HostOptimizer::finish`] with `extras`: AdamW applies the gradient factors in its pass
    /// (the other rules panic on factors: see [`HostOptimizer::fuses_factors`]); the half
    /// copy covers the segments (padding between them is left as it is).
    ///
    /// # Panics
    /// If a buffer or `sums` has the wrong length, or factors are given to a rule that does
    /// not fuse them.
    pub fn finish_with(&mut self, w: &mut [f32], g: &mut [f32], sums: &[[f64; 2]], extras: StepExtras) {
        assert_eq!(w.len(), self.len, "weights: wrong length");
        assert_eq!(g.len(), self.len, "gradients: wrong length");
        assert_eq!(sums.len(), self.segments.len(), "one pair of sums per segment");
        assert!(
            self.fuses_factors() || extras.grad_factors.is_empty(),
            "{:?} reads the gradients before this pass: scale them before prepare",
            self.rule
        );
        let factors: Vec<f32> = extras.grad_factors.iter().map(|&f| f as f32).collect();
        let (mut half, clear) = (extras.half_out, !extras.keep_gradients);
        if let Some((_, out)) = &half {
            assert_eq!(out.len(), self.len, "half-precision copy: wrong length");
        }
        let HostOptimizer { rule, step, segments, m, v, .. } = self;
        for (s, sums) in segments.iter().zip(sums) {
            let r = s.range();
            let (w, g) = (&mut w[r.clone()], &mut g[r.clone()]);
            let norms = s.adapt.then(|| (sums[0].sqrt(), sums[1].sqrt()));
            let half = half.as_mut().map(|(kind, out)| (*kind, &mut out[r.clone()]));
            match *rule {
                CpuRule::AdamW(c) => {
                    let pass = Pass { factors: &factors, clear, half };
                    vector::adamw(&c.at(*step, s.adapt), w, &mut m[r.clone()], &mut v[r], g, pass);
                }
                CpuRule::Lamb(c) => {
                    let (m, v) = (&m[r.clone()], &v[r]);
                    lamb_finish(&c.at(*step, s.adapt), norms, w, (m, v), (g, clear), half)
                }
                CpuRule::Lars(c) => {
                    let buf = if m.is_empty() { None } else { Some(&mut m[r]) };
                    lars(&c.at(norms), *step == 1, w, buf, (g, clear));
                    if let Some((kind, out)) = half {
                        vector::to_half(kind, w, out);
                    }
                }
            }
        }
        // Padding between segments holds no gradient; clear it too, so all of `g` is zero.
        if !clear {
            return;
        }
        let mut end = 0;
        let mut starts: Vec<(usize, usize)> = segments.iter().map(|s| (s.offset, s.len)).collect();
        starts.sort_unstable();
        for (offset, len) in starts.into_iter().chain([(g.len(), 0)]) {
            g[end..offset].fill(0.0);
            end = offset + len;
        }
    }

    /// The state buffers: Adam's first and second moments (`exp_avg`, `exp_avg_sq`), or LARS's
    /// momentum buffer and nothing; empty where the rule keeps none.
    pub fn state(&self) -> (&[f32], &[f32]) {
        (&self.m, &self.v)
    }

    /// Restores the step count and state buffers saved from [`HostOptimizer::state`] and
    /// [`HostOptimizer::steps`].
    ///
    /// # Panics
    /// If a buffer's length differs from this optimizer's.
    pub fn load_state(&mut self, step: i32, m: &[f32], v: &[f32]) {
        assert_eq!((m.len(), v.len()), (self.m.len(), self.v.len()), "state buffers: wrong length");
        self.step = step;
        self.m.copy_from_slice(m);
        self.v.copy_from_slice(v);
    }
}

/// LAMB's first pass on a segment: the moments, and for an adapted segment the sums of squares
/// of `w` and the update `r` (per block, added in block order).
fn lamb_prepare(rule: &LambStep<f32>, adapt: bool, w: &[f32], m: &mut [f32], v: &mut [f32], g: &[f32]) -> [f64; 2] {
    let partials: Vec<(f64, f64)> = w
        .par_chunks(BLOCK)
        .zip(m.par_chunks_mut(BLOCK))
        .zip(v.par_chunks_mut(BLOCK))
        .zip(g.par_chunks(BLOCK))
        .map(|(((w, m), v), g)| {
            let (mut sw, mut sr) = (0f64, 0f64);
            for (((w, m), v), g) in w.iter().zip(m).zip(v).zip(g) {
                let Ok(()) = rule.adam.moments(m, v, g);
                if adapt {
                    let Ok(r) = rule.update(w, m, v);
                    let r = f64::from(r);
                    sw += f64::from(*w) * f64::from(*w);
                    sr += r * r;
                }
            }
            (sw, sr)
        })
        .collect();
    let (sw, sr) = partials.iter().fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
    [sw, sr]
}

/// LAMB's second pass: `w -= r * (lr * ratio)`, the ratio from the whole parameter's norms;
/// clears the gradient (read by the first pass) and writes the half copy, if asked, in the
/// same pass.
fn lamb_finish(
    rule: &LambStep<f32>,
    norms: Option<(f64, f64)>,
    w: &mut [f32],
    (m, v): (&[f32], &[f32]),
    (g, clear): (&mut [f32], bool),
    half: Option<(Half, &mut [u16])>,
) {
    let scale = rule.scale(norms);
    let block = |w: &mut [f32], m: &[f32], v: &[f32], g: &mut [f32]| {
        for ((w, m), v) in w.iter_mut().zip(m).zip(v) {
            let Ok(r) = rule.update(w, m, v);
            let Ok(()) = rule.apply(w, &r, scale);
        }
        if clear {
            g.fill(0.0);
        }
    };
    let blocks = w.par_chunks_mut(BLOCK).zip(m.par_chunks(BLOCK)).zip(v.par_chunks(BLOCK)).zip(g.par_chunks_mut(BLOCK));
    match half {
        None => blocks.for_each(|(((w, m), v), g)| block(w, m, v, g)),
        Some((kind, out)) => blocks.zip(out.par_chunks_mut(BLOCK)).for_each(|((((w, m), v), g), out)| {
            block(w, m, v, g);
            vector::write_half(kind, w, out);
        }),
    }
}

/// One LARS update on a segment (`first`: the momentum buffer's first step), clearing its
/// gradient if `clear`.
fn lars(rule: &LarsStep<f32>, first: bool, w: &mut [f32], buf: Option<&mut [f32]>, (g, clear): (&mut [f32], bool)) {
    match buf {
        None => w.par_chunks_mut(BLOCK).zip(g.par_chunks_mut(BLOCK)).for_each(|(w, g)| {
            for (w, g) in w.iter_mut().zip(g) {
                let Ok(()) = rule.step(w, None, g);
                if clear {
                    *g = 0.0;
                }
            }
        }),
        Some(buf) => {
            w.par_chunks_mut(BLOCK).zip(buf.par_chunks_mut(BLOCK)).zip(g.par_chunks_mut(BLOCK)).for_each(
                |((w, b), g)| {
                    for ((w, b), g) in w.iter_mut().zip(b).zip(g) {
                        let Ok(()) = rule.step(w, Some((b, first)), g);
                        if clear {
                            *g = 0.0;
                        }
                    }
                },
            );
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use tch::Tensor;

    use super::*;
    use crate::autograd::set_grad;
    use crate::optim::{AdamW, AdamWConfig, Lamb, LambConfig, Lars, LarsConfig, Optimizer, Param};

    /// Largest allowed relative difference from the tensor optimizers, as measured by
    /// [`rel_diff`]. Observed: about 2e-7 for AdamW and LAMB, 6e-8 for LARS (1-3 ulps of the
    /// segment's largest weight; torch's kernels may fuse multiply-adds, and its f32 norms round
    /// differently from these f64 ones).
    const TOL: f64 = 1e-6;

    /// Name, shape, adapt, starts at zero. `w1` spans two blocks; `zero` hits ratio = 1.
    const SHAPES: [(&str, &[i64], bool, bool); 4] = [
        ("w1", &[600, 500], true, false),
        ("b1", &[100], false, false),
        ("zero", &[16, 32], true, true),
        ("w2", &[7, 13], true, false),
    ];
    /// Padding between segments, which must be left alone.
    const GAP: usize = 5;

    /// `n` standard normal values from a generator of this test's own (Box-Muller over
    /// splitmix64): tests run in parallel threads, and torch's global generator would be
    /// reseeded and drawn from by the others in between.
    pub(in crate::optim::flat) fn randn(n: usize, seed: i64) -> Vec<f32> {
        let mut state = (seed as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x6a09_e667_f3bc_c908;
        let mut uniform = move || {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let (u1, u2) = (uniform().max(f64::MIN_POSITIVE), uniform());
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
            })
            .collect()
    }

    /// Segments, their shapes, the buffer length and starting weights.
    fn layout() -> (Vec<Segment>, Vec<Vec<i64>>, usize, Vec<f32>) {
        let (mut segments, mut shapes, mut offset) = (Vec::new(), Vec::new(), 0);
        for (name, shape, adapt, _) in SHAPES {
            let len = shape.iter().product::<i64>() as usize;
            segments.push(Segment { name: name.into(), offset, len, adapt });
            shapes.push(shape.to_vec());
            offset += len + GAP;
        }
        let mut w = randn(offset, 1);
        for (s, (.., zero)) in segments.iter().zip(SHAPES) {
            if zero {
                w[s.range()].fill(0.0);
            }
        }
        (segments, shapes, offset, w)
    }

    /// max |a - b| / max |b| over a segment. Elementwise relative differences are not a fair
    /// measure here: where a step nearly cancels a weight (w - lr r close to 0), a 1-ulp
    /// difference in an intermediate of size |w| shows as a large relative difference in the
    /// tiny result (up to 4e-5 seen), though both sides are equally accurate.
    fn rel_diff(a: &[f32], b: &[f32]) -> f64 {
        let diff = a.iter().zip(b).map(|(&a, &b)| (f64::from(a) - f64::from(b)).abs()).fold(0.0, f64::max);
        let scale = b.iter().map(|&b| f64::from(b).abs()).fold(0.0, f64::max);
        diff / scale.max(f64::MIN_POSITIVE)
    }

    /// Five steps of `rule` on the flat buffer and of the tensor optimizer `make` builds, from the
    /// same weights with the same gradients; returns the largest relative difference seen.
    fn compare(rule: CpuRule, make: impl FnOnce(Vec<Param>) -> Box<dyn Optimizer>) -> anyhow::Result<f64> {
        let (segments, shapes, len, mut w) = layout();
        let params: Vec<Param> = segments
            .iter()
            .zip(&shapes)
            .map(|(s, shape)| {
                let t = Tensor::from_slice(&w[s.range()]).reshape(shape.as_slice()).set_requires_grad(true);
                Param::new(s.name.clone(), &t).with_adapt(s.adapt)
            })
            .collect();
        let mut reference = make(params);
        let mut cpu = HostOptimizer::new(rule, segments.clone(), len);
        let w0 = w.clone();
        let mut worst = 0f64;
        for step in 0..5 {
            let g = randn(len, 100 + step);
            for (p, s) in reference.params().iter().zip(&segments) {
                set_grad(&p.tensor, Some(&Tensor::from_slice(&g[s.range()]).reshape(p.tensor.size())))?;
            }
            reference.step()?;
            let mut g = g;
            cpu.step(&mut w, &mut g);
            assert!(g.iter().all(|&x| x == 0.0), "step {step}: the gradient buffer is cleared");
            for (p, s) in reference.params().iter().zip(&segments) {
                let expected = Vec::<f32>::try_from(p.tensor.detach().flatten(0, -1))?;
                let d = rel_diff(&w[s.range()], &expected);
                assert!(d <= TOL, "step {step}, {}: relative difference {d:e} > {TOL:e}", s.name);
                worst = worst.max(d);
            }
        }
        for (s, next) in segments.iter().zip(segments.iter().skip(1)) {
            let gap = s.offset + s.len..next.offset;
            assert_eq!(w[gap.clone()], w0[gap], "padding after {} changed", s.name);
        }
        assert_eq!(cpu.steps(), 5);
        Ok(worst)
    }

    #[test]
    fn adamw_matches_tensor_adamw() -> anyhow::Result<()> {
        let cfg = AdamWConfig { lr: 1e-2, weight_decay: 0.1, ..AdamWConfig::default() };
        let d = compare(CpuRule::AdamW(cfg), |p| Box::new(AdamW::new(p, cfg)))?;
        eprintln!("adamw: max relative difference {d:e}");
        Ok(())
    }

    #[test]
    fn lamb_matches_tensor_lamb() -> anyhow::Result<()> {
        let cfg = LambConfig { lr: 1e-2, weight_decay: 0.1, ..LambConfig::default() };
        let d = compare(CpuRule::Lamb(cfg), |p| Box::new(Lamb::new(p, cfg)))?;
        eprintln!("lamb: max relative difference {d:e}");
        Ok(())
    }

    #[test]
    fn lars_matches_tensor_lars() -> anyhow::Result<()> {
        let cfg = LarsConfig { lr: 0.5, weight_decay: 1e-3, ..LarsConfig::default() };
        let d = compare(CpuRule::Lars(cfg), |p| Box::new(Lars::new(p, cfg)))?;
        eprintln!("lars: max relative difference {d:e}");
        let cfg = LarsConfig { momentum: 0.0, ..cfg };
        let d = compare(CpuRule::Lars(cfg), |p| Box::new(Lars::new(p, cfg)))?;
        eprintln!("lars without momentum: max relative difference {d:e}");
        Ok(())
    }

    #[test]
    fn results_do_not_depend_on_thread_count() {
        let (segments, _, len, w0) = layout();
        let rules = [
            CpuRule::AdamW(AdamWConfig::default()),
            CpuRule::Lamb(LambConfig::default()),
            CpuRule::Lars(LarsConfig { weight_decay: 1e-3, ..LarsConfig::default() }),
        ];
        let run = |threads: usize, rule: CpuRule| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("thread pool");
            pool.install(|| {
                let mut cpu = HostOptimizer::new(rule, segments.clone(), len);
                let mut w = w0.clone();
                for step in 0..3 {
                    cpu.step(&mut w, &mut randn(len, 200 + step));
                }
                (w, sum_squares(&randn(5 * BLOCK + 3, 7)))
            })
        };
        for rule in rules {
            let ((w1, s1), (w2, s2)) = (run(1, rule), run(2, rule));
            let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&w1), bits(&w2), "{rule:?}");
            assert_eq!(s1.to_bits(), s2.to_bits());
        }
    }

    #[test]
    fn extras_equal_the_passes_they_replace() {
        // Gradient factors and the half copy inside the step give, bit for bit, what scaling
        // the gradients in place, stepping and converting the weights afterwards gave; kept
        // gradients are left as they were.
        let (segments, _, len, w0) = layout();
        let factors = [1.0 / 4096.0, 0.3];
        let rules = [
            CpuRule::AdamW(AdamWConfig { weight_decay: 0.1, ..AdamWConfig::default() }),
            CpuRule::Lamb(LambConfig::default()),
            CpuRule::Lars(LarsConfig { weight_decay: 1e-3, ..LarsConfig::default() }),
        ];
        let bits = |w: &[f32]| w.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for rule in rules {
            let (mut fused, mut passes) =
                (HostOptimizer::new(rule, segments.clone(), len), HostOptimizer::new(rule, segments.clone(), len));
            let (mut wf, mut wp) = (w0.clone(), w0.clone());
            for step in 0..3 {
                let g = randn(len, 300 + step).iter().map(|x| x * 4096.0).collect::<Vec<f32>>();
                let (mut gf, mut gp) = (g.clone(), g.clone());
                let mut half = vec![0u16; len];
                let keep = step == 1;
                let extras = StepExtras {
                    grad_factors: &factors,
                    half_out: Some((Half::Bf16, &mut half)),
                    keep_gradients: keep,
                };
                fused.step_with(&mut wf, &mut gf, extras);
                for f in factors {
                    gp.iter_mut().for_each(|x| *x *= f as f32);
                }
                let scaled = gp.clone();
                passes.step(&mut wp, &mut gp);
                assert_eq!(bits(&wf), bits(&wp), "{rule:?} step {step}: weights");
                assert_eq!(bits(fused.state().0), bits(passes.state().0), "{rule:?} step {step}: state");
                for s in &segments {
                    for i in s.range() {
                        assert_eq!(half[i], Half::Bf16.from_f32(wp[i]), "{rule:?} step {step}: half copy of {i}");
                    }
                }
                match keep {
                    // AdamW's pass reads the factors in; the others scale the buffer first.
                    true if fused.fuses_factors() => assert_eq!(bits(&gf), bits(&g), "{rule:?}: gradients kept"),
                    true => assert_eq!(bits(&gf), bits(&scaled), "{rule:?}: scaled gradients kept"),
                    false => assert!(gf.iter().all(|&x| x == 0.0), "{rule:?}: gradients cleared"),
                }
            }
        }
    }

    #[test]
    fn sum_squares_and_state_bytes() {
        let x = randn(3 * BLOCK + 11, 3);
        let exact: f64 = x.iter().map(|&e| f64::from(e) * f64::from(e)).sum();
        assert!((sum_squares(&x) - exact).abs() <= 1e-12 * exact);
        let seg = vec![Segment { name: "p".into(), offset: 0, len: 10, adapt: true }];
        assert_eq!(HostOptimizer::new(CpuRule::AdamW(AdamWConfig::default()), seg.clone(), 10).state_bytes(), 80);
        let lars = LarsConfig { momentum: 0.0, ..LarsConfig::default() };
        let mut o = HostOptimizer::new(CpuRule::Lars(lars), seg, 10);
        assert_eq!(o.state_bytes(), 0);
        o.set_lr(0.25);
        assert_eq!(o.lr(), 0.25);
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn overlapping_segments_panic() {
        let s = |offset| Segment { name: "p".into(), offset, len: 4, adapt: true };
        HostOptimizer::new(CpuRule::Lamb(LambConfig::default()), vec![s(0), s(2)], 8);
    }
}
