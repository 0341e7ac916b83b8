//! AdamW (Loshchilov & Hutter): Adam with weight decay applied to the weights directly.
use super::moments::AdamMoments;
use super::{Optimizer, Param};
use crate::Result;

/// AdamW's hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// Moment decay rates.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay (adapted parameters only).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    /// PyTorch's defaults.
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.01 }
    }
}

/// The AdamW optimizer.
#[derive(Debug)]
pub struct AdamW {
    params: Vec<Param>,
    cfg: AdamWConfig,
    moments: AdamMoments,
}

impl AdamW {
    /// AdamW over `params`.
    pub fn new(params: Vec<Param>, cfg: AdamWConfig) -> AdamW {
        let moments = AdamMoments::new(params.len(), cfg.betas, cfg.eps);
        AdamW { params, cfg, moments }
    }
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        self.moments.next_step();
        let AdamWConfig { lr, weight_decay, .. } = self.cfg;
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                let g = p.tensor.grad();
                if !g.defined() {
                    continue;
                }
                let mut w = p.tensor.shallow_clone();
                if p.adapt && weight_decay != 0.0 {
                    let _ = w.f_mul_scalar_(1.0 - lr * weight_decay)?;
                }
                let _ = w.f_sub_(&self.moments.direction(i, &g)?.f_mul_scalar(lr)?)?;
            }
            Ok(())
        })
    }

    fn lr(&self) -> f64 {
        self.cfg.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    fn params(&self) -> &[Param] {
        &self.params
    }

    fn state_bytes(&self) -> usize {
        self.moments.bytes()
    }

    fn state(&self) -> Vec<(String, tch::Tensor)> {
        self.moments.state(&self.params)
    }

    fn load_state(&mut self, state: &mut super::StateDict) -> Result<()> {
        self.moments.load_state(&self.params, state)
    }
}
