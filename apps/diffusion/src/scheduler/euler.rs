//! The Euler discrete sampler (Karras et al. 2022, algorithm 2 without churn) as diffusers'
//! `EulerDiscreteScheduler`: sigmas `sqrt((1 - a) / a)` interpolated linearly at the inference
//! timesteps, then 0; inputs are scaled by `1 / sqrt(sigma^2 + 1)`. Steps are addressed by their
//! index in [`Scheduler::timesteps`] rather than diffusers' hidden step counter.
use tch::{Kind, Tensor};

use super::sigmas::{interp, train_sigmas};
use super::{same_shape, PredictionType, Scheduler, SchedulerConfig, TimestepSpacing};
use crate::error::{Error, Result};

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
    /// A scheduler of `cfg`; call [`Scheduler::set_timesteps`] before stepping.
    pub fn new(cfg: SchedulerConfig) -> EulerDiscreteScheduler {
        let train_sigmas = train_sigmas(&cfg);
        EulerDiscreteScheduler { cfg, train_sigmas, timesteps: Vec::new(), sigmas: Vec::new() }
    }

    /// The config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// The sigma of step `index`, which must be one of the inference steps.
    pub(crate) fn sigma(&self, index: usize) -> Result<f64> {
        if index >= self.timesteps.len() {
            return Err(Error::Invalid(format!(
                "Euler step index {index} outside the {} inference steps (set_timesteps first)",
                self.timesteps.len()
            )));
        }
        Ok(self.sigmas[index])
    }

    /// The clean sample (fp32) the model's output on `x` (fp32) implies at `sigma`, as the
    /// Karras-scaled denoiser `c_skip x + c_out F`.
    pub(crate) fn denoised(&self, model_output: &Tensor, x: &Tensor, sigma: f64) -> Result<Tensor> {
        same_shape(model_output, x, "Euler model output and sample")?;
        let out = model_output.f_to_kind(Kind::Float)?;
        Ok(match self.cfg.prediction_type {
            PredictionType::Epsilon => x - &out * sigma,
            PredictionType::VPrediction => &out * (-sigma / (sigma * sigma + 1.0).sqrt()) + x / (sigma * sigma + 1.0),
            PredictionType::Sample => out,
        })
    }
}

impl Scheduler for EulerDiscreteScheduler {
    /// Spaces `steps` inference timesteps and their sigmas (plus a final 0).
    fn set_timesteps(&mut self, steps: usize) -> Result<()> {
        let timesteps = self.cfg.spaced_timesteps(steps, false)?;
        let mut sigmas: Vec<f64> = timesteps.iter().map(|&t| interp(&self.train_sigmas, t)).collect();
        sigmas.push(0.0);
        self.timesteps = timesteps;
        self.sigmas = sigmas;
        Ok(())
    }

    /// The inference timesteps (what the UNet is given), descending.
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    /// One sigma per timestep, then 0.
    fn sigmas(&self) -> &[f64] {
        &self.sigmas
    }

    /// The largest sigma, or `sqrt(max^2 + 1)` under `leading` spacing.
    fn init_noise_sigma(&self) -> f64 {
        let max = self.sigmas.iter().copied().fold(0.0, f64::max);
        match self.cfg.timestep_spacing {
            TimestepSpacing::Linspace | TimestepSpacing::Trailing => max,
            TimestepSpacing::Leading => (max * max + 1.0).sqrt(),
        }
    }

    /// `sample / sqrt(sigma^2 + 1)`.
    fn scale_model_input(&self, sample: &Tensor, index: usize) -> Result<Tensor> {
        let sigma = self.sigma(index)?;
        Ok(sample / (sigma * sigma + 1.0).sqrt())
    }

    /// One Euler step from sigma `index` to sigma `index + 1`, computed in fp32 and returned in
    /// the model output's kind.
    fn step(
        &mut self,
        model_output: &Tensor,
        index: usize,
        sample: &Tensor,
        _noise: Option<&Tensor>,
    ) -> Result<Tensor> {
        let sigma = self.sigma(index)?;
        let x = sample.f_to_kind(Kind::Float)?;
        let x0 = self.denoised(model_output, &x, sigma)?;
        let derivative = (&x - x0) / sigma;
        let prev = x + derivative * (self.sigmas[index + 1] - sigma);
        Ok(prev.f_to_kind(model_output.kind())?)
    }
}
