//! LARS (You et al. 2017, "Large Batch Training of Convolutional Networks"): SGD with
//! momentum whose step is scaled per parameter by
//! trust_coefficient * ||w|| / (||g|| + wd ||w|| + eps).
use tch::Tensor;

use super::elementwise::{Elementwise, Scalar};
use super::fused::{self, Rule};
use super::state::{bytes_of, slots_from_state, slots_to_state, state_for};
use super::{norms, Optimizer, Param};
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

impl LarsConfig {
    /// The scalars of a step for a parameter, with the norms `(||w||, ||g||)` of an adapted one
    /// (each executor takes them its own way: a tensor's norm, or sums of squares added over
    /// shards).
    pub(crate) fn at<S: Scalar>(&self, norms: Option<(f64, f64)>) -> LarsStep<S> {
        LarsStep {
            scaled: norms.map(|(w, g)| (S::from_f64(self.weight_decay), S::from_f64(self.trust_ratio(w, g)))),
            momentum: S::from_f64(self.momentum),
            lr: S::from_f64(self.lr),
        }
    }

    /// `trust_coefficient ||w|| / (||g|| + wd ||w|| + eps)`, or 1 where either norm is zero
    /// (as in LAMB).
    fn trust_ratio(&self, w_norm: f64, g_norm: f64) -> f64 {
        if w_norm > 0.0 && g_norm > 0.0 {
            self.trust_coefficient * w_norm / (g_norm + self.weight_decay * w_norm + self.eps)
        } else {
            1.0
        }
    }
}

/// One LARS step of one parameter: the rule every executor runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct LarsStep<S> {
    /// Weight decay and trust ratio, for an adapted parameter.
    scaled: Option<(S, S)>,
    momentum: S,
    lr: S,
}

impl<S: Scalar> LarsStep<S> {
    /// `d = (g + wd w) ratio` (adapted) or `g`; with a momentum buffer (and whether this is its
    /// first step) `buf = d` at first, else `buf = buf momentum + d`, and `d = buf`; then
    /// `w = w - lr d`.
    #[inline(always)]
    pub(crate) fn step<T>(
        &self,
        w: &mut T,
        momentum: Option<(&mut T, bool)>,
        g: &T,
    ) -> std::result::Result<(), T::Error>
    where
        T: Elementwise<Scalar = S>,
    {
        let d = match self.scaled {
            Some((wd, ratio)) => g.add(&w.scale(wd)?)?.scale(ratio)?,
            None => g.share(),
        };
        let step = match momentum {
            Some((buf, first)) => {
                if first {
                    buf.assign(&d)?;
                } else {
                    buf.scale_add_(self.momentum, &d)?;
                }
                buf.scale(self.lr)?
            }
            None => d.scale(self.lr)?,
        };
        w.sub_(&step)
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
        // A multi-tensor step marks every buffer's first step or none: it takes the parameters
        // with a gradient only when their buffers are all new or all running.
        let with_grad = self.params.iter().zip(&self.momentum).filter(|(p, _)| p.tensor.grad().defined());
        let fresh: Vec<bool> = with_grad.map(|(_, b)| b.is_none()).collect();
        if self.cfg.momentum == 0.0 || fresh.iter().all(|&f| f) || fresh.iter().all(|&f| !f) {
            let step = if fresh.first() == Some(&true) { 1 } else { 2 };
            let momentum = self.cfg.momentum != 0.0;
            let mut unused: Vec<Option<Tensor>> = self.params.iter().map(|_| None).collect();
            let slots = [self.momentum.as_mut_slice(), unused.as_mut_slice()];
            if fused::try_step(Rule::Lars(self.cfg), &self.params, slots, [momentum, false], step)? {
                return Ok(());
            }
        }
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                let g = p.tensor.grad();
                if !g.defined() {
                    continue;
                }
                let mut w = p.tensor.shallow_clone();
                let norms = if p.adapt { Some(norms(p, &w, &g)?) } else { None };
                let buf = if self.cfg.momentum != 0.0 {
                    let first = self.momentum[i].is_none();
                    Some((state_for(&mut self.momentum[i], &w)?, first))
                } else {
                    None
                };
                self.cfg.at::<f64>(norms).step(&mut w, buf, &g)?;
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
        bytes_of(&self.momentum)
    }

    fn state(&self) -> Vec<(String, Tensor)> {
        slots_to_state(&self.params, "momentum_buffer", &self.momentum)
    }

    fn load_state(&mut self, state: &mut super::StateDict) -> Result<()> {
        slots_from_state(&self.params, "momentum_buffer", &mut self.momentum, state)
    }
}
