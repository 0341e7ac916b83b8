//! LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2): Adam's
//! bias-corrected update plus weight decay, scaled per parameter by the trust ratio
//! ||w|| / ||r||.
use super::moments::AdamMoments;
use super::{norm, trust_ratio, Optimizer, Param};
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
    moments: AdamMoments,
}

impl Lamb {
    /// LAMB over `params`.
    pub fn new(params: Vec<Param>, cfg: LambConfig) -> Lamb {
        let moments = AdamMoments::new(params.len(), cfg.betas, cfg.eps);
        Lamb { params, cfg, moments }
    }
}

impl Optimizer for Lamb {
    fn step(&mut self) -> Result<()> {
        self.moments.next_step();
        let LambConfig { lr, weight_decay, .. } = self.cfg;
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                let g = p.tensor.grad();
                if !g.defined() {
                    continue;
                }
                let mut w = p.tensor.shallow_clone();
                // r = m_hat / (sqrt(v_hat) + eps) + wd * w, scaled by ||w|| / ||r||.
                let mut r = self.moments.direction(i, &g)?;
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
        self.moments.bytes()
    }

    fn state(&self) -> Vec<(String, tch::Tensor)> {
        self.moments.state(&self.params)
    }

    fn load_state(&mut self, state: &mut super::StateDict) -> Result<()> {
        self.moments.load_state(&self.params, state)
    }
}
