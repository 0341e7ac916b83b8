//! The Euler discrete sampler (Karras et al. 2022, algorithm 2 without churn) as diffusers'
//! `EulerDiscreteScheduler`: sigmas `sqrt((1 - a) / a)` interpolated linearly at the inference
//! timesteps, then 0; inputs are scaled by `1 / sqrt(sigma^2 + 1)`. Steps are addressed by their
//! index in [`EulerDiscreteScheduler::timesteps`] rather than diffusers' hidden step counter.
use tch::{Kind, Tensor};

use super::{same_shape, PredictionType, SchedulerConfig, TimestepSpacing};
use crate::error::{Error, Result};

/// One step's results.
#[derive(Debug)]
pub struct EulerStep {
    /// The sample at the next (lower) sigma.
    pub prev_sample: Tensor,
    /// The predicted clean sample.
    pub pred_original_sample: Tensor,
}

/// Euler discrete (see the module docs).
#[derive(Clone, Debug)]
pub struct EulerDiscreteScheduler {
    cfg: SchedulerConfig,
    /// `sqrt((1 - a_t) / a_t)` per training timestep.
    train_sigmas: Vec<f64>,
    timesteps: Vec<f64>,
    sigmas: Vec<f64>,
}

impl EulerDiscreteScheduler {
    /// A scheduler of `cfg`; call [`EulerDiscreteScheduler::set_timesteps`] before stepping.
    pub fn new(cfg: SchedulerConfig) -> EulerDiscreteScheduler {
        let train_sigmas = cfg.alphas_cumprod().iter().map(|a| ((1.0 - a) / a).sqrt()).collect();
        EulerDiscreteScheduler { cfg, train_sigmas, timesteps: Vec::new(), sigmas: Vec::new() }
    }

    /// The config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Spaces `steps` inference timesteps and their sigmas (plus a final 0).
    pub fn set_timesteps(&mut self, steps: usize) -> Result<()> {
        let timesteps = self.cfg.spaced_timesteps(steps, false)?;
        let last = self.train_sigmas.len() - 1;
        let mut sigmas: Vec<f64> = timesteps
            .iter()
            .map(|&t| {
                // numpy's interp: linear between neighbours, clamped at the ends.
                let t = t.clamp(0.0, last as f64);
                let lo = (t.floor() as usize).min(last);
                let hi = (lo + 1).min(last);
                let w = t - lo as f64;
                self.train_sigmas[lo] * (1.0 - w) + self.train_sigmas[hi] * w
            })
            .collect();
        sigmas.push(0.0);
        self.timesteps = timesteps;
        self.sigmas = sigmas;
        Ok(())
    }

    /// The inference timesteps (what the UNet is given), descending.
    pub fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    /// One sigma per timestep, then 0.
    pub fn sigmas(&self) -> &[f64] {
        &self.sigmas
    }

    /// The initial noise's standard deviation: the largest sigma, or `sqrt(max^2 + 1)` under
    /// `leading` spacing.
    pub fn init_noise_sigma(&self) -> f64 {
        let max = self.sigmas.iter().copied().fold(0.0, f64::max);
        match self.cfg.timestep_spacing {
            TimestepSpacing::Linspace | TimestepSpacing::Trailing => max,
            TimestepSpacing::Leading => (max * max + 1.0).sqrt(),
        }
    }

    fn sigma(&self, index: usize) -> Result<f64> {
        if index >= self.timesteps.len() {
            return Err(Error::Invalid(format!(
                "Euler step index {index} outside the {} inference steps (set_timesteps first)",
                self.timesteps.len()
            )));
        }
        Ok(self.sigmas[index])
    }

    /// The UNet's input at step `index`: `sample / sqrt(sigma^2 + 1)`.
    pub fn scale_model_input(&self, sample: &Tensor, index: usize) -> Result<Tensor> {
        let sigma = self.sigma(index)?;
        Ok(sample / (sigma * sigma + 1.0).sqrt())
    }

    /// One Euler step from sigma `index` to sigma `index + 1`, computed in fp32 and returned in
    /// the model output's kind.
    pub fn step(&self, model_output: &Tensor, index: usize, sample: &Tensor) -> Result<EulerStep> {
        let sigma = self.sigma(index)?;
        same_shape(model_output, sample, "Euler model output and sample")?;
        let x = sample.f_to_kind(Kind::Float)?;
        let out = model_output.f_to_kind(Kind::Float)?;
        let x0 = match self.cfg.prediction_type {
            PredictionType::Epsilon => &x - &out * sigma,
            PredictionType::VPrediction => &out * (-sigma / (sigma * sigma + 1.0).sqrt()) + &x / (sigma * sigma + 1.0),
            PredictionType::Sample => out,
        };
        let derivative = (&x - &x0) / sigma;
        let prev = x + derivative * (self.sigmas[index + 1] - sigma);
        Ok(EulerStep { prev_sample: prev.f_to_kind(model_output.kind())?, pred_original_sample: x0 })
    }
}
