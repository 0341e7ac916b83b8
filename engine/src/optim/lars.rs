//! LARS (You et al. 2017, "Large Batch Training of Convolutional Networks"): SGD with
//! momentum whose step is scaled per parameter by
//! trust_coefficient * ||w|| / (||g|| + wd ||w|| + eps).
use tch::Tensor;

use super::{norm, state_for, Optimizer, Param};
use crate::Result;

/// LARS's hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LarsConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum (0: none).
    pub momentum: f64,
    /// Weight decay added to the gradient (adapted parameters only).
    pub weight_decay: f64,
    /// The trust coefficient (eta).
    pub trust_coefficient: f64,
    /// Added to the trust ratio's denominator.
    pub eps: f64,
}

impl Default for LarsConfig {
    /// timm's defaults, with momentum 0.9.
    fn default() -> Self {
        LarsConfig { lr: 1.0, momentum: 0.9, weight_decay: 0.0, trust_coefficient: 0.001, eps: 1e-8 }
    }
}

/// The LARS optimizer.
#[derive(Debug)]
pub struct Lars {
    params: Vec<Param>,
    cfg: LarsConfig,
    momentum: Vec<Option<Tensor>>,
}

impl Lars {
    /// LARS over `params`.
    pub fn new(params: Vec<Param>, cfg: LarsConfig) -> Lars {
        let n = params.len();
        Lars { params, cfg, momentum: (0..n).map(|_| None).collect() }
    }
}

impl Optimizer for Lars {
    fn step(&mut self) -> Result<()> {
        let LarsConfig { lr, momentum, weight_decay, trust_coefficient, eps } = self.cfg;
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                let g = p.tensor.grad();
                if !g.defined() {
                    continue;
                }
                let mut w = p.tensor.shallow_clone();
                let mut d = g.shallow_clone();
                if p.adapt {
                    let (wn, gn) = (norm(&w)?, norm(&g)?);
                    // Where either norm is zero the ratio is 1, as in LAMB.
                    let ratio = if wn > 0.0 && gn > 0.0 {
                        trust_coefficient * wn / (gn + weight_decay * wn + eps)
                    } else {
                        1.0
                    };
                    d = g.f_add(&w.f_mul_scalar(weight_decay)?)?.f_mul_scalar(ratio)?;
                }
                if momentum != 0.0 {
                    let first = self.momentum[i].is_none();
                    let buf = state_for(&mut self.momentum[i], &w)?;
                    if first {
                        buf.f_copy_(&d)?;
                    } else {
                        let _ = buf.f_mul_scalar_(momentum)?.f_add_(&d)?;
                    }
                    d = buf.shallow_clone();
                }
                let _ = w.f_sub_(&d.f_mul_scalar(lr)?)?;
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
        super::bytes_of(&self.momentum)
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        super::slots_to_state(&self.params, "momentum_buffer", &self.momentum)
    }

    fn load_state(&mut self, state: &mut super::StateDict) -> Result<()> {
        super::slots_from_state(&self.params, "momentum_buffer", &mut self.momentum, state)
    }
}
