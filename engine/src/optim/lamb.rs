//! LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2): Adam's
//! bias-corrected update plus weight decay, scaled per parameter by the trust ratio
//! ||w|| / ||r||.
use tch::Tensor;

use super::{norm, state_for, trust_ratio, Optimizer, Param};
use crate::Result;

/// LAMB's hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LambConfig {
    /// Learning rate.
    pub lr: f64,
    /// Moment decay rates.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Weight decay added to the update (adapted parameters only).
    pub weight_decay: f64,
}

impl Default for LambConfig {
    /// The paper's (and timm's) defaults.
    fn default() -> Self {
        LambConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-6, weight_decay: 0.01 }
    }
}

/// The LAMB optimizer.
#[derive(Debug)]
pub struct Lamb {
    params: Vec<Param>,
    cfg: LambConfig,
    step: i32,
    m: Vec<Option<Tensor>>,
    v: Vec<Option<Tensor>>,
}

impl Lamb {
    /// LAMB over `params`.
    pub fn new(params: Vec<Param>, cfg: LambConfig) -> Lamb {
        let n = params.len();
        Lamb { params, cfg, step: 0, m: (0..n).map(|_| None).collect(), v: (0..n).map(|_| None).collect() }
    }
}

impl Optimizer for Lamb {
    fn step(&mut self) -> Result<()> {
        self.step += 1;
        let LambConfig { lr, betas: (b1, b2), eps, weight_decay } = self.cfg;
        let (bc1, bc2) = (1.0 - b1.powi(self.step), 1.0 - b2.powi(self.step));
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                let g = p.tensor.grad();
                if !g.defined() {
                    continue;
                }
                let mut w = p.tensor.shallow_clone();
                let m = state_for(&mut self.m[i], &w)?;
                let _ = m.f_mul_scalar_(b1)?.f_add_(&g.f_mul_scalar(1.0 - b1)?)?;
                let v = state_for(&mut self.v[i], &w)?;
                let _ = v.f_mul_scalar_(b2)?.f_addcmul_(&g, &g.f_mul_scalar(1.0 - b2)?)?;
                // r = m_hat / (sqrt(v_hat) + eps) + wd * w
                let denom = v.f_sqrt()?.f_div_scalar(bc2.sqrt())?.f_add_scalar(eps)?;
                let m = self.m[i].as_ref().expect("created above");
                let mut r = m.f_div_scalar(bc1)?.f_div(&denom)?;
                let mut ratio = 1.0;
                if p.adapt {
                    if weight_decay != 0.0 {
                        r = r.f_add(&w.f_mul_scalar(weight_decay)?)?;
                    }
                    ratio = trust_ratio(norm(&w)?, norm(&r)?);
                }
                let _ = w.f_sub_(&r.f_mul_scalar(lr * ratio)?)?;
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
