//! Multi-threaded CPU AdamW, LAMB and LARS over flat fp32 buffers: Gemini's fp32 master chunks
//! in host memory, stepped in place without going through tensors.
//!
//! Each rule gives the same results as the engine's tensor optimizers ([`crate::optim::AdamW`],
//! [`crate::optim::Lamb`], [`crate::optim::Lars`]): the elementwise arithmetic is done in f32 in
//! the tensor version's order, with the scalars (bias corrections, `lr * ratio`) computed in f64
//! and cast to f32 as torch does for a float tensor times a double scalar. Weight decay and the
//! trust ratio apply only to segments marked `adapt`.
//!
//! Work is split into fixed blocks of [`BLOCK`] elements run in parallel with rayon. Norms are
//! f64 sums of squares per block, added in block order, so results do not depend on the number
//! of threads. LAMB and LARS take two passes over an adapted segment: the norms, then the
//! update with the segment's trust ratio (LAMB recomputes its update in the second pass rather
//! than storing it).
use rayon::prelude::*;

use crate::optim::{AdamWConfig, LambConfig, LarsConfig};

/// Elements per parallel block (a fixed partition keeps reductions deterministic).
pub const BLOCK: usize = 1 << 14;

/// A parameter's place in a flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The parameter's name (its module path).
    pub name: String,
    /// First element in the buffer.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
    /// Whether weight decay and the trust ratio apply.
    pub adapt: bool,
}

impl Segment {
    pub(super) fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// The update rule and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CpuRule {
    /// AdamW (see [`crate::optim::AdamW`]).
    AdamW(AdamWConfig),
    /// LAMB (see [`crate::optim::Lamb`]).
    Lamb(LambConfig),
    /// LARS (see [`crate::optim::Lars`]).
    Lars(LarsConfig),
}

impl CpuRule {
    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            CpuRule::AdamW(c) => c.lr,
            CpuRule::Lamb(c) => c.lr,
            CpuRule::Lars(c) => c.lr,
        }
    }

    /// Sets the learning rate.
    pub fn set_lr(&mut self, lr: f64) {
        match self {
            CpuRule::AdamW(c) => c.lr = lr,
            CpuRule::Lamb(c) => c.lr = lr,
            CpuRule::Lars(c) => c.lr = lr,
        }
    }

    /// The state buffers the rule keeps per element, by their PyTorch names.
    pub fn state_slots(&self) -> &'static [&'static str] {
        match self {
            CpuRule::AdamW(_) | CpuRule::Lamb(_) => &["exp_avg", "exp_avg_sq"],
            CpuRule::Lars(c) if c.momentum != 0.0 => &["momentum_buffer"],
            CpuRule::Lars(_) => &[],
        }
    }
}

/// An optimizer stepping flat fp32 buffers in place, with its state in flat buffers alongside.
#[derive(Debug)]
pub struct CpuOptimizer {
    rule: CpuRule,
    step: i32,
    segments: Vec<Segment>,
    len: usize,
    /// Adam's first moment (`exp_avg`), or LARS's momentum buffer (empty without momentum).
    m: Vec<f32>,
    /// Adam's second moment (`exp_avg_sq`); empty for LARS.
    v: Vec<f32>,
}

/// The sum of squares of `x` in f64: per-block sums added in block order, so the result does not
/// depend on the thread count.
pub fn sum_squares(x: &[f32]) -> f64 {
    let partials: Vec<f64> = x.par_chunks(BLOCK).map(block_sum_squares).collect();
    partials.iter().sum()
}

/// One block's sum of squares, in eight lanes (so it vectorises) added in a fixed order.
fn block_sum_squares(x: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &e) in lanes.iter_mut().zip(c) {
            *l += f64::from(e) * f64::from(e);
        }
    }
    let mut s: f64 = lanes.iter().sum();
    for &e in rest {
        s += f64::from(e) * f64::from(e);
    }
    s
}

/// The engine's trust ratio: `num / den`, or 1 where either is 0.
pub(super) fn trust_ratio(num: f64, den: f64) -> f64 {
    if num > 0.0 && den > 0.0 {
        num / den
    } else {
        1.0
    }
}

/// Adam's per-step scalars, cast to f32 as torch casts a double scalar for a float tensor.
#[derive(Clone, Copy)]
pub(super) struct Adam {
    pub(super) b1: f32,
    pub(super) one_minus_b1: f32,
    pub(super) b2: f32,
    pub(super) one_minus_b2: f32,
    pub(super) bc1: f32,
    pub(super) sqrt_bc2: f32,
    pub(super) eps: f32,
}

impl Adam {
    pub(super) fn new(betas: (f64, f64), eps: f64, step: i32) -> Adam {
        let (b1, b2) = betas;
        Adam {
            b1: b1 as f32,
            one_minus_b1: (1.0 - b1) as f32,
            b2: b2 as f32,
            one_minus_b2: (1.0 - b2) as f32,
            bc1: (1.0 - b1.powi(step)) as f32,
            sqrt_bc2: (1.0 - b2.powi(step)).sqrt() as f32,
            eps: eps as f32,
        }
    }

    /// Updates the moments with gradient `g` (`m = m b1 + g (1 - b1)`, `v = v b2 + g (g (1 - b2))`).
    #[inline(always)]
    fn moments(&self, m: &mut f32, v: &mut f32, g: f32) {
        *m = *m * self.b1 + g * self.one_minus_b1;
        *v = *v * self.b2 + g * (g * self.one_minus_b2);
    }

    /// `(m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`.
    #[inline(always)]
    fn direction(&self, m: f32, v: f32) -> f32 {
        m / self.bc1 / (v.sqrt() / self.sqrt_bc2 + self.eps)
    }
}

impl CpuOptimizer {
    /// An optimizer for buffers of `len` elements holding `segments` (in bounds, not
    /// overlapping; elements outside every segment are left alone). State is zero-initialised.
    ///
    /// # Panics
    /// If a segment is out of bounds or two overlap.
    pub fn new(rule: CpuRule, segments: Vec<Segment>, len: usize) -> CpuOptimizer {
        let mut sorted: Vec<&Segment> = segments.iter().collect();
        sorted.sort_by_key(|s| s.offset);
        let mut end = 0;
        for s in sorted {
            assert!(s.offset >= end, "segment {} overlaps the one before it", s.name);
            end = s.offset + s.len;
            assert!(end <= len, "segment {} ends at {end}, past the buffer's {len}", s.name);
        }
        let (m, v) = match rule {
            CpuRule::AdamW(_) | CpuRule::Lamb(_) => (vec![0.0; len], vec![0.0; len]),
            CpuRule::Lars(c) if c.momentum != 0.0 => (vec![0.0; len], Vec::new()),
            CpuRule::Lars(_) => (Vec::new(), Vec::new()),
        };
        CpuOptimizer { rule, step: 0, segments, len, m, v }
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
    /// with each segment's norms taken over this buffer: [`CpuOptimizer::prepare`] then
    /// [`CpuOptimizer::finish`].
    ///
    /// # Panics
    /// If `w` or `g` is not the buffer's length.
    pub fn step(&mut self, w: &mut [f32], g: &[f32]) {
        let sums = self.prepare(w, g);
        self.finish(w, g, &sums);
    }

    /// First half of a step: advances the step count, updates the moments (Adam, LAMB) and
    /// returns per segment the sums of squares the trust ratio needs (LAMB: weights and
    /// update; LARS: weights and gradient; zeros otherwise). When a parameter is split across
    /// buffers (shards on several ranks), add the sums of all its pieces before
    /// [`CpuOptimizer::finish`].
    ///
    /// # Panics
    /// If `w` or `g` is not the buffer's length.
    pub fn prepare(&mut self, w: &[f32], g: &[f32]) -> Vec<[f64; 2]> {
        assert_eq!(w.len(), self.len, "weights: wrong length");
        assert_eq!(g.len(), self.len, "gradients: wrong length");
        self.step += 1;
        let CpuOptimizer { rule, step, segments, m, v, .. } = self;
        segments
            .iter()
            .map(|s| {
                let r = s.range();
                let (w, g) = (&w[r.clone()], &g[r.clone()]);
                match *rule {
                    CpuRule::AdamW(_) => [0.0; 2],
                    CpuRule::Lamb(c) => lamb_prepare(&c, *step, s.adapt, w, &mut m[r.clone()], &mut v[r], g),
                    CpuRule::Lars(_) if s.adapt => [sum_squares(w), sum_squares(g)],
                    CpuRule::Lars(_) => [0.0; 2],
                }
            })
            .collect()
    }

    /// Second half of a step: the update of `w`, with the whole parameters' sums of squares
    /// (one per segment, as [`CpuOptimizer::prepare`] returned them, summed over pieces).
    ///
    /// # Panics
    /// If `w`, `g` or `sums` has the wrong length.
    pub fn finish(&mut self, w: &mut [f32], g: &[f32], sums: &[[f64; 2]]) {
        assert_eq!(w.len(), self.len, "weights: wrong length");
        assert_eq!(g.len(), self.len, "gradients: wrong length");
        assert_eq!(sums.len(), self.segments.len(), "one pair of sums per segment");
        let CpuOptimizer { rule, step, segments, m, v, .. } = self;
        for (s, &sums) in segments.iter().zip(sums) {
            let r = s.range();
            let (w, g) = (&mut w[r.clone()], &g[r.clone()]);
            match *rule {
                CpuRule::AdamW(c) => adamw(&c, *step, s.adapt, w, &mut m[r.clone()], &mut v[r], g),
                CpuRule::Lamb(c) => lamb_finish(&c, *step, s.adapt, w, &m[r.clone()], &v[r], sums),
                CpuRule::Lars(c) => {
                    let buf = if m.is_empty() { None } else { Some(&mut m[r]) };
                    lars(&c, *step == 1, s.adapt, w, buf, g, sums)
                }
            }
        }
    }

    /// The state buffers: Adam's first and second moments (`exp_avg`, `exp_avg_sq`), or LARS's
    /// momentum buffer and nothing; empty where the rule keeps none.
    pub fn state(&self) -> (&[f32], &[f32]) {
        (&self.m, &self.v)
    }

    /// Restores the step count and state buffers saved from [`CpuOptimizer::state`] and
    /// [`CpuOptimizer::steps`].
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

/// One AdamW step on a segment.
fn adamw(c: &AdamWConfig, step: i32, adapt: bool, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
    let a = Adam::new(c.betas, c.eps, step);
    let decay = (adapt && c.weight_decay != 0.0).then_some((1.0 - c.lr * c.weight_decay) as f32);
    let lr = c.lr as f32;
    w.par_chunks_mut(BLOCK)
        .zip(m.par_chunks_mut(BLOCK))
        .zip(v.par_chunks_mut(BLOCK))
        .zip(g.par_chunks(BLOCK))
        .for_each(|(((w, m), v), g)| {
            for (((w, m), v), &g) in w.iter_mut().zip(m).zip(v).zip(g) {
                a.moments(m, v, g);
                if let Some(d) = decay {
                    *w *= d;
                }
                *w -= a.direction(*m, *v) * lr;
            }
        });
}

/// LAMB's update direction `r = m_hat / (sqrt(v_hat) + eps) (+ wd * w if adapted)`, from the
/// updated moments.
fn lamb_update(c: &LambConfig, step: i32, adapt: bool) -> impl Fn(f32, f32, f32) -> f32 + Sync {
    let a = Adam::new(c.betas, c.eps, step);
    let wd = (adapt && c.weight_decay != 0.0).then_some(c.weight_decay as f32);
    move |m: f32, v: f32, w: f32| match wd {
        Some(wd) => a.direction(m, v) + w * wd,
        None => a.direction(m, v),
    }
}

/// LAMB's first pass on a segment: the moments, and for an adapted segment the sums of squares
/// of `w` and `r` (per block, added in block order).
fn lamb_prepare(
    c: &LambConfig,
    step: i32,
    adapt: bool,
    w: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    g: &[f32],
) -> [f64; 2] {
    let a = Adam::new(c.betas, c.eps, step);
    let update = lamb_update(c, step, adapt);
    let partials: Vec<(f64, f64)> = w
        .par_chunks(BLOCK)
        .zip(m.par_chunks_mut(BLOCK))
        .zip(v.par_chunks_mut(BLOCK))
        .zip(g.par_chunks(BLOCK))
        .map(|(((w, m), v), g)| {
            let (mut sw, mut sr) = (0f64, 0f64);
            for (((&w, m), v), &g) in w.iter().zip(m).zip(v).zip(g) {
                a.moments(m, v, g);
                if adapt {
                    let r = f64::from(update(*m, *v, w));
                    sw += f64::from(w) * f64::from(w);
                    sr += r * r;
                }
            }
            (sw, sr)
        })
        .collect();
    let (sw, sr) = partials.iter().fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
    [sw, sr]
}

/// LAMB's second pass: `w -= r * (lr * ratio)`, the ratio from the whole parameter's sums.
fn lamb_finish(c: &LambConfig, step: i32, adapt: bool, w: &mut [f32], m: &[f32], v: &[f32], sums: [f64; 2]) {
    let update = lamb_update(c, step, adapt);
    let ratio = if adapt { trust_ratio(sums[0].sqrt(), sums[1].sqrt()) } else { 1.0 };
    let scale = (c.lr * ratio) as f32;
    w.par_chunks_mut(BLOCK).zip(m.par_chunks(BLOCK)).zip(v.par_chunks(BLOCK)).for_each(|((w, m), v)| {
        for ((w, &m), &v) in w.iter_mut().zip(m).zip(v) {
            *w -= update(m, v, *w) * scale;
        }
    });
}

/// One LARS update on a segment, the trust ratio (adapted segments) from the whole parameter's
/// sums of squares of weights and gradients.
fn lars(c: &LarsConfig, first: bool, adapt: bool, w: &mut [f32], buf: Option<&mut [f32]>, g: &[f32], sums: [f64; 2]) {
    // d = (g + wd * w) * ratio for adapted segments, else g.
    let scaled = if adapt {
        let (wn, gn) = (sums[0].sqrt(), sums[1].sqrt());
        let ratio =
            if wn > 0.0 && gn > 0.0 { c.trust_coefficient * wn / (gn + c.weight_decay * wn + c.eps) } else { 1.0 };
        Some((c.weight_decay as f32, ratio as f32))
    } else {
        None
    };
    let d = move |w: f32, g: f32| match scaled {
        Some((wd, ratio)) => (g + w * wd) * ratio,
        None => g,
    };
    let lr = c.lr as f32;
    match buf {
        None => w.par_chunks_mut(BLOCK).zip(g.par_chunks(BLOCK)).for_each(|(w, g)| {
            for (w, &g) in w.iter_mut().zip(g) {
                *w -= d(*w, g) * lr;
            }
        }),
        Some(buf) => {
            let momentum = c.momentum as f32;
            w.par_chunks_mut(BLOCK).zip(buf.par_chunks_mut(BLOCK)).zip(g.par_chunks(BLOCK)).for_each(|((w, b), g)| {
                for ((w, b), &g) in w.iter_mut().zip(b).zip(g) {
                    let d = d(*w, g);
                    *b = if first { d } else { *b * momentum + d };
                    *w -= *b * lr;
                }
            });
        }
    }
}

#[cfg(test)]
pub(super) mod tests {
    use tch::Tensor;

    use super::*;
    use crate::autograd::set_grad;
    use crate::optim::{AdamW, Lamb, Lars, Optimizer, Param};

    /// Largest allowed relative difference from the tensor optimizers, as measured by
    /// [`rel_diff`]. Observed: about 2e-7 for AdamW and LAMB, 6e-8 for LARS (1-3 ulps of the
    /// segment's largest weight; torch's kernels may fuse multiply-adds, and its f32 norms round
    /// differently from these f64 ones).
    const TOL: f64 = 1e-6;

    /// Name, shape, adapt, starts at zero. `w1` spans two blocks; `zero` hits ratio = 1.
    const SHAPES: [(&str, &[i64], bool, bool); 4] = [
        ("w1", &[200, 100], true, false),
        ("b1", &[100], false, false),
        ("zero", &[16, 32], true, true),
        ("w2", &[7, 13], true, false),
    ];
    /// Padding between segments, which must be left alone.
    const GAP: usize = 5;

    /// `n` standard normal values from a generator of this test's own (Box-Muller over
    /// splitmix64): tests run in parallel threads, and torch's global generator would be
    /// reseeded and drawn from by the others in between.
    pub(in crate::gemini) fn randn(n: usize, seed: i64) -> Vec<f32> {
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
            .map(|(s, shape)| Param {
                name: s.name.clone(),
                tensor: Tensor::from_slice(&w[s.range()]).reshape(shape.as_slice()).set_requires_grad(true),
                adapt: s.adapt,
            })
            .collect();
        let mut reference = make(params);
        let mut cpu = CpuOptimizer::new(rule, segments.clone(), len);
        let w0 = w.clone();
        let mut worst = 0f64;
        for step in 0..5 {
            let g = randn(len, 100 + step);
            for (p, s) in reference.params().iter().zip(&segments) {
                set_grad(&p.tensor, Some(&Tensor::from_slice(&g[s.range()]).reshape(p.tensor.size())))?;
            }
            reference.step()?;
            cpu.step(&mut w, &g);
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
                let mut cpu = CpuOptimizer::new(rule, segments.clone(), len);
                let mut w = w0.clone();
                for step in 0..3 {
                    cpu.step(&mut w, &randn(len, 200 + step));
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
    fn sum_squares_and_state_bytes() {
        let x = randn(3 * BLOCK + 11, 3);
        let exact: f64 = x.iter().map(|&e| f64::from(e) * f64::from(e)).sum();
        assert!((sum_squares(&x) - exact).abs() <= 1e-12 * exact);
        let seg = vec![Segment { name: "p".into(), offset: 0, len: 10, adapt: true }];
        assert_eq!(CpuOptimizer::new(CpuRule::AdamW(AdamWConfig::default()), seg.clone(), 10).state_bytes(), 80);
        let lars = LarsConfig { momentum: 0.0, ..LarsConfig::default() };
        let mut o = CpuOptimizer::new(CpuRule::Lars(lars), seg, 10);
        assert_eq!(o.state_bytes(), 0);
        o.set_lr(0.25);
        assert_eq!(o.lr(), 0.25);
    }

    #[test]
    #[should_panic(expected = "overlaps")]
    fn overlapping_segments_panic() {
        let s = |offset| Segment { name: "p".into(), offset, len: 4, adapt: true };
        CpuOptimizer::new(CpuRule::Lamb(LambConfig::default()), vec![s(0), s(2)], 8);
    }
}
