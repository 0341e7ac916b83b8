//! AdamW (Loshchilov & Hutter): Adam with weight decay applied to the weights directly.
use tch::Tensor;

use super::{state_for, Optimizer, Param};
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
    step: i32,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

impl AdamW {
    /// AdamW over `params`.
    pub fn new(params: Vec<Param>, cfg: AdamWConfig) -> AdamW {
        let n = params.len();
        AdamW { params, cfg, step: 0, m: (0..n).map(|_| None).collect(), v: (0..n).map(|_| None).collect() }
    }
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        self.step += 1;
        let AdamWConfig { lr, betas: (b1, b2), eps, weight_decay } = self.cfg;
        let (bc1, bc2) = (1.0 - b1.powi(self.step), 1.0 - b2.powi(self.step));
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
                let m = state_for(&mut self.m[i], &w)?;
                let _ = m.f_mul_scalar_(b1)?.f_add_(&g.f_mul_scalar(1.0 - b1)?)?;
                let v = state_for(&mut self.v[i], &w)?;
                let _ = v.f_mul_scalar_(b2)?.f_addcmul_(&g, &g.f_mul_scalar(1.0 - b2)?)?;
                let denom = v.f_sqrt()?.f_div_scalar(bc2.sqrt())?.f_add_scalar(eps)?;
                let m = self.m[i].as_ref().expect("created above");
                let _ = w.f_sub_(&m.f_div(&denom)?.f_mul_scalar(lr / bc1)?)?;
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
        super::bytes_of(&self.m) + super::bytes_of(&self.v)
    }
}
