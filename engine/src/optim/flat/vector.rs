//! The host executor's fused AdamW pass: one read and one write of each buffer per step, the
//! rule's arithmetic run on [`Lanes`] (sixteen `f32` at once, which the compiler turns into
//! vector instructions), with the gradient's scale factors (loss-scale unscaling, the clipping
//! coefficient) applied as it is read and the new weights optionally written out again in half
//! precision (the upload buffer of a GPU's compute copy), so that nothing else streams the
//! buffers through memory.
//!
//! Each [`Lanes`] operation is the `f32` operation on every lane, rounded the same way (Rust
//! fuses no multiply-adds, and vector division and square root are IEEE's, as scalar ones),
//! so the pass gives the per-element loop's results bit for bit. It is compiled once per
//! vector width the CPU may have (AVX-512, AVX2, the baseline: [`isa`]) and the widest one
//! the running CPU has is chosen at run time.
use std::convert::Infallible;

use rayon::prelude::*;

use super::half::{bf16_bits, Half};
use super::isa::{self, Isa, WIDTH};
use super::BLOCK;
use crate::optim::adamw::AdamWStep;
use crate::optim::elementwise::Elementwise;

/// Sixteen `f32` that a rule's arithmetic runs on together (see the module documentation).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lanes([f32; WIDTH]);

impl Lanes {
    #[inline(always)]
    fn load(x: &[f32]) -> Lanes {
        Lanes(std::array::from_fn(|i| x[i]))
    }

    #[inline(always)]
    fn store(self, x: &mut [f32]) {
        x[..WIDTH].copy_from_slice(&self.0);
    }

    #[inline(always)]
    fn map(&self, f: impl Fn(f32) -> f32) -> Lanes {
        Lanes(std::array::from_fn(|i| f(self.0[i])))
    }

    /// Each lane in half precision, fp16 by `I`'s conversion.
    #[inline(always)]
    fn to_half<I: Isa>(self, kind: Half) -> [u16; WIDTH] {
        match kind {
            Half::F16 => I::f16(&self.0),
            Half::Bf16 => isa::portable(&self.0, bf16_bits),
        }
    }

    #[inline(always)]
    fn zip(&self, y: &Lanes, f: impl Fn(f32, f32) -> f32) -> Lanes {
        Lanes(std::array::from_fn(|i| f(self.0[i], y.0[i])))
    }
}

impl Elementwise for Lanes {
    type Scalar = f32;
    type Error = Infallible;

    #[inline(always)]
    fn scale(&self, s: f32) -> Result<Lanes, Infallible> {
        Ok(self.map(|x| x * s))
    }
    #[inline(always)]
    fn div_scalar(&self, s: f32) -> Result<Lanes, Infallible> {
        Ok(self.map(|x| x / s))
    }
    #[inline(always)]
    fn add_scalar(&self, s: f32) -> Result<Lanes, Infallible> {
        Ok(self.map(|x| x + s))
    }
    #[inline(always)]
    fn add(&self, y: &Lanes) -> Result<Lanes, Infallible> {
        Ok(self.zip(y, |a, b| a + b))
    }
    #[inline(always)]
    fn mul(&self, y: &Lanes) -> Result<Lanes, Infallible> {
        Ok(self.zip(y, |a, b| a * b))
    }
    #[inline(always)]
    fn div(&self, y: &Lanes) -> Result<Lanes, Infallible> {
        Ok(self.zip(y, |a, b| a / b))
    }
    #[inline(always)]
    fn sqrt(&self) -> Result<Lanes, Infallible> {
        Ok(self.map(f32::sqrt))
    }
    #[inline(always)]
    fn share(&self) -> Lanes {
        *self
    }
    #[inline(always)]
    fn scale_(&mut self, s: f32) -> Result<(), Infallible> {
        *self = self.map(|x| x * s);
        Ok(())
    }
    #[inline(always)]
    fn scale_add_(&mut self, s: f32, y: &Lanes) -> Result<(), Infallible> {
        *self = self.zip(y, |a, b| a * s + b);
        Ok(())
    }
    #[inline(always)]
    fn sub_(&mut self, y: &Lanes) -> Result<(), Infallible> {
        *self = self.zip(y, |a, b| a - b);
        Ok(())
    }
    #[inline(always)]
    fn assign(&mut self, y: &Lanes) -> Result<(), Infallible> {
        *self = *y;
        Ok(())
    }
}

/// What one fused AdamW pass does beside the rule: the factors the gradient is multiplied by
/// as it is read (in order, each product rounded to `f32` as the in-place passes it replaces
/// round it), whether it clears the gradient afterwards, and where it writes the new weights
/// in half precision.
pub(crate) struct Pass<'a> {
    pub(crate) factors: &'a [f32],
    pub(crate) clear: bool,
    pub(crate) half: Option<(Half, &'a mut [u16])>,
}

/// One AdamW step of a segment in one pass (see [`Pass`]), in parallel blocks of [`BLOCK`].
pub(crate) fn adamw(rule: &AdamWStep<f32>, w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &mut [f32], pass: Pass) {
    let Pass { factors, clear, half } = pass;
    let blocks = w.par_chunks_mut(BLOCK).zip(m.par_chunks_mut(BLOCK)).zip(v.par_chunks_mut(BLOCK));
    let blocks = blocks.zip(g.par_chunks_mut(BLOCK));
    match half {
        None => blocks.for_each(|(((w, m), v), g)| adamw_block(rule, factors, clear, Block { w, m, v, g, half: None })),
        Some((kind, out)) => blocks.zip(out.par_chunks_mut(BLOCK)).for_each(|((((w, m), v), g), out)| {
            adamw_block(rule, factors, clear, Block { w, m, v, g, half: Some((kind, out)) })
        }),
    }
}

/// One block's buffers: weights, moments, gradients (all of the weights' length) and the
/// half-precision copy's.
struct Block<'a> {
    w: &'a mut [f32],
    m: &'a mut [f32],
    v: &'a mut [f32],
    g: &'a mut [f32],
    half: Option<(Half, &'a mut [u16])>,
}

/// Defines `$vis fn $name(args) -> ret` running `$inner::<I>(args)` compiled for AVX-512F or
/// AVX2 with F16C when the CPU has them (the widest first), else for the baseline, `I` naming
/// the set ([`isa`]): `$inner` is `#[inline(always)]`, so each copy is vectorised for its
/// instructions.
macro_rules! widest {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? = $inner:ident) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                widest!(@copy "avx512f", ["avx512f"], avx512, isa::Avx512, ($($arg: $ty),*) $(-> $ret)?, $inner);
                widest!(@copy "avx2,f16c", ["avx2", "f16c"], avx2, isa::Avx2, ($($arg: $ty),*) $(-> $ret)?, $inner);
            }
            $inner::<isa::Baseline>($($arg),*)
        }
    };
    // A copy for one instruction set, returned from when the CPU has it.
    (@copy $features:tt, [$($feature:tt),+], $copy:ident, $isa:ty, ($($arg:ident: $ty:ty),*) $(-> $ret:ty)?, $inner:ident) => {
        #[target_feature(enable = $features)]
        fn $copy($($arg: $ty),*) $(-> $ret)? {
            $inner::<$isa>($($arg),*)
        }
        if $(std::arch::is_x86_feature_detected!($feature))&&+ {
            // SAFETY: the CPU has the instructions this copy was compiled for.
            return unsafe { $copy($($arg),*) };
        }
    };
}

widest! {
    /// One block of the AdamW pass, in the widest vector instructions this CPU has.
    fn adamw_block(rule: &AdamWStep<f32>, factors: &[f32], clear: bool, block: Block) = adamw_lanes
}

/// The block's loop: [`WIDTH`] elements at a time, the rest one by one with the same rule.
#[inline(always)]
fn adamw_lanes<I: Isa>(rule: &AdamWStep<f32>, factors: &[f32], clear: bool, block: Block) {
    // The usual counts of factors (none; unscaling or clipping; both) as arrays of known
    // length, which the compiler unrolls: a loop of unknown length left it shuffling lanes
    // through the rest of the iteration.
    match *factors {
        [] => adamw_loop::<I>(rule, [], clear, block),
        [a] => adamw_loop::<I>(rule, [a], clear, block),
        [a, b] => adamw_loop::<I>(rule, [a, b], clear, block),
        _ => adamw_loop::<I>(rule, factors, clear, block),
    }
}

/// The gradient factors of a pass, applied in order.
trait Factors: Copy {
    fn apply(self, x: &mut f32);
}

impl<const N: usize> Factors for [f32; N] {
    #[inline(always)]
    fn apply(self, x: &mut f32) {
        for f in self {
            *x *= f;
        }
    }
}

impl Factors for &[f32] {
    #[inline(always)]
    fn apply(self, x: &mut f32) {
        for &f in self {
            *x *= f;
        }
    }
}

#[inline(always)]
fn adamw_loop<I: Isa>(rule: &AdamWStep<f32>, factors: impl Factors, clear: bool, block: Block) {
    let Block { w, m, v, g, mut half } = block;
    let n = w.len();
    let (m, v, g) = (&mut m[..n], &mut v[..n], &mut g[..n]);
    let whole = n - n % WIDTH;
    for at in (0..whole).step_by(WIDTH) {
        let r = at..at + WIDTH;
        let mut grad = Lanes::load(&g[r.clone()]);
        grad.0.iter_mut().for_each(|x| factors.apply(x));
        let (mut wl, mut ml, mut vl) =
            (Lanes::load(&w[r.clone()]), Lanes::load(&m[r.clone()]), Lanes::load(&v[r.clone()]));
        let Ok(()) = rule.step(&mut wl, &mut ml, &mut vl, &grad);
        wl.store(&mut w[r.clone()]);
        ml.store(&mut m[r.clone()]);
        vl.store(&mut v[r.clone()]);
        if clear {
            g[r.clone()].fill(0.0);
        }
        if let Some((kind, out)) = half.as_mut() {
            out[r].copy_from_slice(&wl.to_half::<I>(*kind));
        }
    }
    for i in whole..n {
        let mut grad = g[i];
        factors.apply(&mut grad);
        let Ok(()) = rule.step(&mut w[i], &mut m[i], &mut v[i], &grad);
        if clear {
            g[i] = 0.0;
        }
        if let Some((kind, out)) = half.as_mut() {
            out[i] = kind.from_f32(w[i]);
        }
    }
}

widest! {
    /// The sum of the squares of `x` times `factors` (each product rounded to `f32`) in f64:
    /// eight lanes added in a fixed order, so the result does not depend on how blocks are
    /// scheduled.
    pub(crate) fn block_sum_squares(x: &[f32], factors: &[f32]) -> f64 = sum_squares_lanes
}

// `I` unused: the sum needs nothing beyond the compiler's vectorisation for its set.
#[inline(always)]
fn sum_squares_lanes<I: Isa>(x: &[f32], factors: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        let mut e: [f32; 8] = std::array::from_fn(|i| c[i]);
        for &f in factors {
            e = e.map(|x| x * f);
        }
        for (l, &e) in lanes.iter_mut().zip(&e) {
            let e = f64::from(e);
            *l += e * e;
        }
    }
    let mut s: f64 = lanes.iter().sum();
    for &e in rest {
        let mut e = e;
        for &f in factors {
            e *= f;
        }
        let e = f64::from(e);
        s += e * e;
    }
    s
}

/// Writes `w` in half precision into `out` (the rules without a fused pass), in parallel.
pub(crate) fn to_half(kind: Half, w: &[f32], out: &mut [u16]) {
    out.par_chunks_mut(BLOCK).zip(w.par_chunks(BLOCK)).for_each(|(o, w)| write_half(kind, w, o));
}

widest! {
    /// `out = w` in half precision.
    pub(crate) fn write_half(kind: Half, w: &[f32], out: &mut [u16]) = write_half_lanes
}

#[inline(always)]
fn write_half_lanes<I: Isa>(kind: Half, w: &[f32], out: &mut [u16]) {
    assert_eq!(w.len(), out.len(), "half-precision copy: wrong length");
    let whole = w.len() - w.len() % WIDTH;
    for at in (0..whole).step_by(WIDTH) {
        out[at..at + WIDTH].copy_from_slice(&Lanes::load(&w[at..at + WIDTH]).to_half::<I>(kind));
    }
    for i in whole..w.len() {
        out[i] = kind.from_f32(w[i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::flat::half::tests::awkward;
    use crate::optim::flat::host::tests::randn;
    use crate::optim::AdamWConfig;

    #[test]
    fn each_instruction_set_converts_to_fp16_as_the_portable_code() {
        let x = awkward();
        let expected: Vec<u16> = x.iter().map(|&v| Half::F16.from_f32(v)).collect();
        type Convert = fn(&[f32; WIDTH]) -> [u16; WIDTH];
        let convert = |f: Convert| -> Vec<u16> {
            x.chunks_exact(WIDTH).flat_map(|c| f(c.try_into().expect("a chunk of lanes"))).collect()
        };
        let mut sets: Vec<(&str, Convert)> = vec![("baseline", isa::Baseline::f16)];
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
                sets.push(("avx2", isa::Avx2::f16));
            }
            if is_x86_feature_detected!("avx512f") {
                sets.push(("avx512", isa::Avx512::f16));
            }
        }
        for (name, f) in sets {
            for (i, (got, want)) in convert(f).iter().zip(&expected).enumerate() {
                assert_eq!(got, want, "{name}: element {i} ({:e})", x[i]);
            }
        }
        // The dispatched copy, over a length that is not a multiple of the lanes.
        for kind in [Half::F16, Half::Bf16] {
            let mut out = vec![0u16; x.len() - 3];
            write_half(kind, &x[3..], &mut out);
            for (i, (&o, &v)) in out.iter().zip(&x[3..]).enumerate() {
                assert_eq!(o, kind.from_f32(v), "{kind:?} of element {i}");
            }
        }
    }

    #[test]
    fn bias_corrections_of_one_are_skipped_without_changing_a_bit() {
        // The rule against its formula written out with every division, at steps where the
        // corrections are below 1, where the first has rounded to 1 (165 on) and both have
        // (16,628 on).
        let cfg = AdamWConfig { lr: 1e-3, weight_decay: 0.01, ..AdamWConfig::default() };
        let n = 4096;
        let (w0, m0, v0, g) = (randn(n, 5), randn(n, 6), randn(n, 7), randn(n, 8));
        for step in [1, 164, 165, 1000, 16_627, 16_628, 100_000] {
            let (b1, b2) = cfg.betas;
            let bc1 = (1.0 - b1.powi(step)) as f32;
            let sqrt_bc2 = (1.0 - b2.powi(step)).sqrt() as f32;
            assert_eq!((bc1 == 1.0, sqrt_bc2 == 1.0), (step >= 165, step >= 16_628), "step {step}");
            let rule = cfg.at::<f32>(step, true);
            for i in 0..n {
                let (mut w, mut m, mut v) = (w0[i], m0[i], v0[i] * v0[i]);
                let Ok(()) = rule.step(&mut w, &mut m, &mut v, &g[i]);
                let em = m0[i] * b1 as f32 + g[i] * (1.0 - b1) as f32;
                let ev = v0[i] * v0[i] * b2 as f32 + g[i] * (g[i] * (1.0 - b2) as f32);
                let d = (em / bc1) / (ev.sqrt() / sqrt_bc2 + cfg.eps as f32);
                let ew = w0[i] * (1.0 - cfg.lr * cfg.weight_decay) as f32 - d * cfg.lr as f32;
                assert_eq!([w, m, v].map(f32::to_bits), [ew, em, ev].map(f32::to_bits), "step {step}, element {i}");
            }
        }
    }

    #[test]
    fn the_fused_pass_equals_the_scalar_rule_bit_for_bit() {
        // Three blocks and a tail that is not a multiple of the lanes.
        let n = 2 * BLOCK + 3 * WIDTH + 5;
        let factors = [1.0 / 1024.0, 0.37];
        for (decay, clear) in [(0.1, true), (0.0, false)] {
            let cfg = AdamWConfig { lr: 1e-2, weight_decay: decay, ..AdamWConfig::default() };
            let rule = cfg.at::<f32>(3, true);
            let (w0, m0, v0, g0) = (randn(n, 1), randn(n, 2), randn(n, 3), randn(n, 4));
            let v0: Vec<f32> = v0.iter().map(|x| x * x).collect();
            let (mut w, mut m, mut v, mut g) = (w0.clone(), m0.clone(), v0.clone(), g0.clone());
            let mut out = vec![0u16; n];
            let pass = Pass { factors: &factors, clear, half: Some((Half::F16, &mut out)) };
            adamw(&rule, &mut w, &mut m, &mut v, &mut g, pass);
            for i in 0..n {
                let (mut ew, mut em, mut ev) = (w0[i], m0[i], v0[i]);
                let grad = g0[i] * factors[0] * factors[1];
                let Ok(()) = rule.step(&mut ew, &mut em, &mut ev, &grad);
                assert_eq!([w[i], m[i], v[i]].map(f32::to_bits), [ew, em, ev].map(f32::to_bits), "element {i}");
                assert_eq!(out[i], Half::F16.from_f32(ew), "element {i}'s half");
                assert_eq!(g[i], if clear { 0.0 } else { g0[i] }, "element {i}'s gradient");
            }
        }
    }
}
