//! The Euler ancestral sampler as diffusers' `EulerAncestralDiscreteScheduler`: Euler's sigmas
//! and input scaling, and a step that goes deterministically down to `sigma_down` and adds
//! fresh noise of standard deviation `sigma_up`, where `sigma_up^2 + sigma_down^2` is the next
//! sigma squared (Karras et al. 2022's ancestral sampling). The noise is an argument of each
//! step, so a caller decides where it comes from (a seeded generator, or a reference's draws).
use tch::{Kind, Tensor};

use super::euler::EulerDiscreteScheduler;
use super::{same_shape, Scheduler, SchedulerConfig};
use crate::error::{Error, Result};

/// Euler ancestral (see the module docs).
#[derive(Clone, Debug)]
pub struct EulerAncestralDiscreteScheduler {
    /// The schedule, which is Euler's.
    euler: EulerDiscreteScheduler,
}

impl EulerAncestralDiscreteScheduler {
    /// A scheduler of `cfg` (`sample` prediction is refused when `cfg` is read, as diffusers
    /// does not implement it); call [`Scheduler::set_timesteps`] before stepping.
    pub fn new(cfg: SchedulerConfig) -> EulerAncestralDiscreteScheduler {
        EulerAncestralDiscreteScheduler { euler: EulerDiscreteScheduler::new(cfg) }
    }

    /// The config.
    pub fn config(&self) -> &SchedulerConfig {
        self.euler.config()
    }
}

impl Scheduler for EulerAncestralDiscreteScheduler {
    fn set_timesteps(&mut self, steps: usize) -> Result<()> {
        self.euler.set_timesteps(steps)
    }

    fn timesteps(&self) -> &[f64] {
        self.euler.timesteps()
    }

    /// One sigma per timestep, then 0.
    fn sigmas(&self) -> &[f64] {
        self.euler.sigmas()
    }

    fn init_noise_sigma(&self) -> f64 {
        self.euler.init_noise_sigma()
    }

    fn scale_model_input(&self, sample: &Tensor, index: usize) -> Result<Tensor> {
        self.euler.scale_model_input(sample, index)
    }

    fn needs_noise(&self) -> bool {
        true
    }

    /// From sigma `index` down to `sigma_down`, plus `noise * sigma_up`; in fp32, returned in
    /// the model output's kind.
    fn step(&mut self, model_output: &Tensor, index: usize, sample: &Tensor, noise: Option<&Tensor>) -> Result<Tensor> {
        let sigma = self.euler.sigma(index)?;
        let noise = noise.ok_or_else(|| Error::Invalid("an Euler ancestral step needs noise".into()))?;
        same_shape(noise, sample, "Euler ancestral noise and sample")?;
        let x = sample.f_to_kind(Kind::Float)?;
        let x0 = self.euler.denoised(model_output, &x, sigma)?;
        let to = self.euler.sigmas()[index + 1];
        let sigma_up = (to * to * (sigma * sigma - to * to) / (sigma * sigma)).sqrt();
        let sigma_down = (to * to - sigma_up * sigma_up).max(0.0).sqrt();
        let derivative = (&x - x0) / sigma;
        let prev = x + derivative * (sigma_down - sigma) + noise.f_to_kind(Kind::Float)? * sigma_up;
        Ok(prev.f_to_kind(model_output.kind())?)
    }
}
