//! Adam's bias-corrected moment estimates, the core AdamW and LAMB share: the per-step scalars
//! and the arithmetic every executor runs, and the tensor optimizers' per-parameter moments.
use tch::Tensor;

use super::elementwise::{Elementwise, Scalar};
use super::state::{bytes_of, counter_from_state, slots_from_state, slots_to_state, state_for};
use super::{Param, StateDict};
use crate::Result;

/// One step's scalars, each computed in f64 and converted once (see [`Scalar`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Adam<S> {
    b1: S,
    one_minus_b1: S,
    b2: S,
    one_minus_b2: S,
    bc1: S,
    sqrt_bc2: S,
    eps: S,
    /// `bc1` and `sqrt_bc2` are exactly 1 (see [`Adam::direction`]).
    bc1_is_one: bool,
    bc2_is_one: bool,
}

impl<S: Scalar> Adam<S> {
    /// The scalars of step `step` (counted from 1, for the bias corrections).
    pub(crate) fn new(betas: (f64, f64), eps: f64, step: i32) -> Adam<S> {
        let (b1, b2) = betas;
        let (bc1, sqrt_bc2) = (S::from_f64(1.0 - b1.powi(step)), S::from_f64((1.0 - b2.powi(step)).sqrt()));
        Adam {
            b1: S::from_f64(b1),
            one_minus_b1: S::from_f64(1.0 - b1),
            b2: S::from_f64(b2),
            one_minus_b2: S::from_f64(1.0 - b2),
            bc1,
            sqrt_bc2,
            eps: S::from_f64(eps),
            bc1_is_one: bc1.is_one(),
            bc2_is_one: sqrt_bc2.is_one(),
        }
    }

    /// Updates the moments with gradient `g`: `m = m b1 + g (1 - b1)`,
    /// `v = v b2 + g (g (1 - b2))`, each operation rounded.
    #[inline(always)]
    pub(crate) fn moments<T>(&self, m: &mut T, v: &mut T, g: &T) -> std::result::Result<(), T::Error>
    where
        T: Elementwise<Scalar = S>,
    {
        m.scale_add_(self.b1, &g.scale(self.one_minus_b1)?)?;
        v.scale_add_(self.b2, &g.mul(&g.scale(self.one_minus_b2)?)?)
    }

    /// The update direction `(m / bc1) / (sqrt(v) / sqrt(bc2) + eps)`. A bias correction that
    /// is exactly 1 in `S` (in f32 with PyTorch's betas the first from step 165 on, where
    /// `1 - 0.9^t` rounds to 1, the second from step 16,628) is not divided by: `x / 1` is `x`,
    /// so the result is the same bit for bit, one division (the costliest operation of the
    /// host's pass) fewer.
    #[inline(always)]
    pub(crate) fn direction<T>(&self, m: &T, v: &T) -> std::result::Result<T, T::Error>
    where
        T: Elementwise<Scalar = S>,
    {
        let m_hat = match self.bc1_is_one {
            true => m.share(),
            false => m.div_scalar(self.bc1)?,
        };
        let root = v.sqrt()?;
        let v_hat = match self.bc2_is_one {
            true => root,
            false => root.div_scalar(self.sqrt_bc2)?,
        };
        m_hat.div(&v_hat.add_scalar(self.eps)?)
    }
}

impl Adam<f64> {
    /// [`Adam::moments`] with torch.optim's kernel for `v`: `addcmul_`, which may round its
    /// multiply-add once (it does on CUDA and on CPUs with FMA). The tensor optimizers keep it,
    /// one kernel where the exact form takes two; the flat executors cannot, as they must equal
    /// the host kernels bit for bit.
    pub(crate) fn moments_addcmul(&self, m: &mut Tensor, v: &mut Tensor, g: &Tensor) -> Result<()> {
        m.scale_add_(self.b1, &g.scale(self.one_minus_b1)?)?;
        let _ = v.f_mul_scalar_(self.b2)?.f_addcmul_(g, &g.scale(self.one_minus_b2)?)?;
        Ok(())
    }
}

/// The tensor optimizers' first and second moments of each parameter's gradient, and the step
/// count.
#[derive(Debug)]
pub(crate) struct AdamMoments {
    step: i32,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

impl AdamMoments {
    pub(crate) fn new(params: usize) -> AdamMoments {
        AdamMoments { step: 0, m: (0..params).map(|_| None).collect(), v: (0..params).map(|_| None).collect() }
    }

    /// Starts a step and returns its number (bias correction counts steps).
    pub(crate) fn next_step(&mut self) -> i32 {
        self.step += 1;
        self.step
    }

    /// Both moments' slots, one per parameter (for a multi-tensor step).
    pub(crate) fn slots(&mut self) -> [&mut [Option<Tensor>]; 2] {
        [&mut self.m, &mut self.v]
    }

    /// Updates parameter `i`'s moments (zero before its first gradient) with gradient `g`.
    pub(crate) fn update(&mut self, i: usize, adam: &Adam<f64>, g: &Tensor) -> Result<(&Tensor, &Tensor)> {
        let m = state_for(&mut self.m[i], g)?;
        let v = state_for(&mut self.v[i], g)?;
        adam.moments_addcmul(m, v, g)?;
        Ok((m, v))
    }

    /// `{param}.exp_avg`, `{param}.exp_avg_sq` (PyTorch's names) and `step`.
    pub(crate) fn state(&self, params: &[Param]) -> Vec<(String, Tensor)> {
        let mut out = slots_to_state(params, "exp_avg", &self.m);
        out.extend(slots_to_state(params, "exp_avg_sq", &self.v));
        out.push(("step".into(), Tensor::from_slice(&[self.step as i64])));
        out
    }

    pub(crate) fn load_state(&mut self, params: &[Param], dict: &mut StateDict) -> Result<()> {
        slots_from_state(params, "exp_avg", &mut self.m, dict)?;
        slots_from_state(params, "exp_avg_sq", &mut self.v, dict)?;
        self.step = counter_from_state(dict, "step")? as i32;
        Ok(())
    }

    pub(crate) fn bytes(&self) -> usize {
        bytes_of(&self.m) + bytes_of(&self.v)
    }
}
