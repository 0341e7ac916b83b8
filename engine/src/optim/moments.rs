//! Adam's bias-corrected moment estimates, shared by AdamW and LAMB.
use tch::Tensor;

use super::{bytes_of, counter_from_state, slots_from_state, slots_to_state, state_for, Param, StateDict};
use crate::Result;

/// First and second moments of each parameter's gradient.
#[derive(Debug)]
pub(crate) struct AdamMoments {
    betas: (f64, f64),
    eps: f64,
    step: i32,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

impl AdamMoments {
    pub(crate) fn new(params: usize, betas: (f64, f64), eps: f64) -> AdamMoments {
        AdamMoments {
            betas,
            eps,
            step: 0,
            m: (0..params).map(|_| None).collect(),
            v: (0..params).map(|_| None).collect(),
        }
    }

    /// Starts a step (bias correction counts steps).
    pub(crate) fn next_step(&mut self) {
        self.step += 1;
    }

    /// Updates parameter `i`'s moments with gradient `g` and returns m_hat / (sqrt(v_hat) + eps).
    pub(crate) fn direction(&mut self, i: usize, g: &Tensor) -> Result<Tensor> {
        let (b1, b2) = self.betas;
        let (bc1, bc2) = (1.0 - b1.powi(self.step), 1.0 - b2.powi(self.step));
        let m = state_for(&mut self.m[i], g)?;
        let _ = m.f_mul_scalar_(b1)?.f_add_(&g.f_mul_scalar(1.0 - b1)?)?;
        let v = state_for(&mut self.v[i], g)?;
        let _ = v.f_mul_scalar_(b2)?.f_addcmul_(g, &g.f_mul_scalar(1.0 - b2)?)?;
        let denom = v.f_sqrt()?.f_div_scalar(bc2.sqrt())?.f_add_scalar(self.eps)?;
        let m = self.m[i].as_ref().expect("created above");
        Ok(m.f_div_scalar(bc1)?.f_div(&denom)?)
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
