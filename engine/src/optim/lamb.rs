//! LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning", Algorithm 2): Adam's
//! bias-corrected update plus weight decay, scaled per parameter by the trust ratio
//! ||w|| / ||r||.
use super::adam::{Adam, AdamMoments};
use super::elementwise::{Elementwise, Scalar};
use super::fused::{self, Rule};
use super::{norms, Optimizer, Param};
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

impl LambConfig {
    /// The scalars of step `step` for a parameter (`adapt`: whether it decays).
    pub(crate) fn at<S: Scalar>(&self, step: i32, adapt: bool) -> LambStep<S> {
        LambStep {
            adam: Adam::new(self.betas, self.eps, step),
            decay: (adapt && self.weight_decay != 0.0).then(|| S::from_f64(self.weight_decay)),
            lr: self.lr,
        }
    }
}

/// ||w|| / ||r||, or 1 where either norm is zero (the LAMB/LARS convention).
fn trust_ratio(w_norm: f64, r_norm: f64) -> f64 {
    if w_norm > 0.0 && r_norm > 0.0 {
        w_norm / r_norm
    } else {
        1.0
    }
}

/// One LAMB step of one parameter: the rule every executor runs. The update `r` is computed
/// from moments already updated; its scale needs the norms of the whole parameter, which each
/// executor takes its own way (a tensor's norm, or sums of squares added over shards).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LambStep<S> {
    pub(crate) adam: Adam<S>,
    /// The weight decay, where the parameter decays.
    decay: Option<S>,
    lr: f64,
}

impl<S: Scalar> LambStep<S> {
    /// `r = m_hat / (sqrt(v_hat) + eps) + wd w`.
    #[inline(always)]
    pub(crate) fn update<T>(&self, w: &T, m: &T, v: &T) -> std::result::Result<T, T::Error>
    where
        T: Elementwise<Scalar = S>,
    {
        let r = self.adam.direction(m, v)?;
        match self.decay {
            Some(wd) => r.add(&w.scale(wd)?),
            None => Ok(r),
        }
    }

    /// What `r` is multiplied by: `lr`, times the trust ratio of the norms `(||w||, ||r||)` of
    /// an adapted parameter.
    pub(crate) fn scale(&self, norms: Option<(f64, f64)>) -> S {
        S::from_f64(self.lr * norms.map_or(1.0, |(w, r)| trust_ratio(w, r)))
    }

    /// `w = w - r scale`.
    #[inline(always)]
    pub(crate) fn apply<T>(&self, w: &mut T, r: &T, scale: S) -> std::result::Result<(), T::Error>
    where
        T: Elementwise<Scalar = S>,
    {
        w.sub_(&r.scale(scale)?)
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
        let moments = AdamMoments::new(params.len());
        Lamb { params, cfg, moments }
    }
}

impl Optimizer for Lamb {
    fn step(&mut self) -> Result<()> {
        let step = self.moments.next_step();
        if fused::try_step(Rule::Lamb(self.cfg), &self.params, self.moments.slots(), [true, true], step)? {
            return Ok(());
        }
        tch::no_grad(|| -> Result<()> {
            for (i, p) in self.params.iter().enumerate() {
                let g = p.tensor.grad();
                if !g.defined() {
                    continue;
                }
                let rule = self.cfg.at::<f64>(step, p.adapt);
                let (m, v) = self.moments.update(i, &rule.adam, &g)?;
                let mut w = p.tensor.shallow_clone();
                let r = rule.update(&w, m, v)?;
                let norms = if p.adapt { Some(norms(p, &w, &r)?) } else { None };
                rule.apply(&mut w, &r, rule.scale(norms))?;
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
