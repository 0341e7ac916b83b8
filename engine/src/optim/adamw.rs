//! AdamW (Loshchilov & Hutter): Adam with weight decay applied to the weights directly.
use super::adam::{Adam, AdamMoments};
use super::elementwise::{Elementwise, Scalar};
use super::fused::{self, Rule};
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

impl AdamWConfig {
    /// The scalars of step `step` for a parameter (`adapt`: whether it decays).
    pub(crate) fn at<S: Scalar>(&self, step: i32, adapt: bool) -> AdamWStep<S> {
        AdamWStep {
            adam: Adam::new(self.betas, self.eps, step),
            decay: (adapt && self.weight_decay != 0.0).then(|| S::from_f64(1.0 - self.lr * self.weight_decay)),
            lr: S::from_f64(self.lr),
        }
    }
}

/// One AdamW step of one parameter: the rule every executor runs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWStep<S> {
    pub(crate) adam: Adam<S>,
    /// `1 - lr wd`, where the parameter decays.
    decay: Option<S>,
    lr: S,
}

impl<S: Scalar> AdamWStep<S> {
    /// `w = w (1 - lr wd) - lr direction(m, v)`, from moments already updated.
    #[inline(always)]
    pub(crate) fn update<T>(&self, w: &mut T, m: &T, v: &T) -> std::result::Result<(), T::Error>
    where
        T: Elementwise<Scalar = S>,
    {
        if let Some(d) = self.decay {
            w.scale_(d)?;
        }
        w.sub_(&self.adam.direction(m, v)?.scale(self.lr)?)
    }

    /// The moments from gradient `g`, then the update.
    #[inline(always)]
    pub(crate) fn step<T>(&self, w: &mut T, m: &mut T, v: &mut T, g: &T) -> std::result::Result<(), T::Error>
    where
        T: Elementwise<Scalar = S>,
    {
        self.adam.moments(m, v, g)?;
        self.update(w, m, v)
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
        let moments = AdamMoments::new(params.len());
        AdamW { params, cfg, moments }
    }
}

impl Optimizer for AdamW {
    fn step(&mut self) -> Result<()> {
        let step = self.moments.next_step();
        if fused::try_step(Rule::AdamW(self.cfg), &self.params, self.moments.slots(), [true, true], step)? {
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
                rule.update(&mut p.tensor.shallow_clone(), m, v)?;
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
