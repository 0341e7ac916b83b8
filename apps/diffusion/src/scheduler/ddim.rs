//! The DDIM sampler (Song et al. 2021) as diffusers' `DDIMScheduler`: `eta` 0 is the
//! deterministic sampler; the previous timestep is `t - N / steps`, and before the first
//! training timestep the alpha product is 1 (`set_alpha_to_one`) or `alphas_cumprod[0]`.
use tch::Tensor;

use super::{same_shape, PredictionType, Scheduler, SchedulerConfig};
use crate::error::{Error, Result};

/// One step's results.
#[derive(Debug)]
pub struct DdimStep {
    /// The sample at the previous (less noisy) timestep.
    pub prev_sample: Tensor,
    /// The predicted clean sample.
    pub pred_original_sample: Tensor,
}

/// DDIM (see the module docs).
#[derive(Clone, Debug)]
pub struct DdimScheduler {
    cfg: SchedulerConfig,
    alphas_cumprod: Vec<f64>,
    final_alpha_cumprod: f64,
    timesteps: Vec<f64>,
}

impl DdimScheduler {
    /// A scheduler of `cfg`; call [`Scheduler::set_timesteps`] before stepping.
    pub fn new(cfg: SchedulerConfig) -> DdimScheduler {
        let alphas_cumprod = cfg.alphas_cumprod();
        let final_alpha_cumprod = if cfg.set_alpha_to_one { 1.0 } else { alphas_cumprod[0] };
        DdimScheduler { cfg, alphas_cumprod, final_alpha_cumprod, timesteps: Vec::new() }
    }

    /// The config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// One step from timestep `t` back to `t - N / steps`. With `eta > 0` the step adds
    /// `eta`-scaled noise: `noise` when given (shape of `sample`), else fresh normal noise.
    pub fn step_eta(
        &self,
        model_output: &Tensor,
        t: i64,
        sample: &Tensor,
        eta: f64,
        noise: Option<&Tensor>,
    ) -> Result<DdimStep> {
        if self.timesteps.is_empty() {
            return Err(Error::Invalid("DDIM step before set_timesteps".into()));
        }
        let n = self.cfg.num_train_timesteps;
        if !(0..n).contains(&t) {
            return Err(Error::Invalid(format!("timestep {t} outside 0..{n}")));
        }
        if eta < 0.0 {
            return Err(Error::Invalid(format!("eta is {eta}, expected >= 0")));
        }
        same_shape(model_output, sample, "DDIM model output and sample")?;
        let prev_t = t - n / self.timesteps.len() as i64;
        let a_t = self.alphas_cumprod[t as usize];
        let a_prev = if prev_t >= 0 { self.alphas_cumprod[prev_t as usize] } else { self.final_alpha_cumprod };
        let b_t = 1.0 - a_t;
        let (mut x0, eps) = match self.cfg.prediction_type {
            PredictionType::Epsilon => {
                ((sample - model_output * b_t.sqrt()) / a_t.sqrt(), model_output.shallow_clone())
            }
            PredictionType::Sample => (model_output.shallow_clone(), (sample - model_output * a_t.sqrt()) / b_t.sqrt()),
            PredictionType::VPrediction => {
                (sample * a_t.sqrt() - model_output * b_t.sqrt(), model_output * a_t.sqrt() + sample * b_t.sqrt())
            }
        };
        if let Some(r) = self.cfg.clip_sample {
            x0 = x0.f_clamp(-r, r)?;
        }
        let variance = (1.0 - a_prev) / b_t * (1.0 - a_t / a_prev);
        let std = eta * variance.sqrt();
        let mut prev = &x0 * a_prev.sqrt() + eps * (1.0 - a_prev - std * std).max(0.0).sqrt();
        if eta > 0.0 {
            let noise = match noise {
                Some(z) => {
                    same_shape(z, sample, "DDIM noise and sample")?;
                    z.shallow_clone()
                }
                None => model_output.f_randn_like()?,
            };
            let noise = noise.f_to_kind(prev.kind())? * std;
            prev += noise;
        }
        Ok(DdimStep { prev_sample: prev, pred_original_sample: x0 })
    }
}

impl Scheduler for DdimScheduler {
    /// Spaces `steps` inference timesteps per the config.
    fn set_timesteps(&mut self, steps: usize) -> Result<()> {
        self.timesteps = self.cfg.spaced_timesteps(steps, true)?;
        Ok(())
    }

    /// The inference timesteps, descending.
    fn timesteps(&self) -> &[f64] {
        &self.timesteps
    }

    /// The deterministic step (eta 0) from `timesteps()[index]`.
    fn step(
        &mut self,
        model_output: &Tensor,
        index: usize,
        sample: &Tensor,
        _noise: Option<&Tensor>,
    ) -> Result<Tensor> {
        let t = *self.timesteps.get(index).ok_or_else(|| {
            Error::Invalid(format!("DDIM step {index} outside the {} inference steps", self.timesteps.len()))
        })?;
        Ok(self.step_eta(model_output, t as i64, sample, 0.0, None)?.prev_sample)
    }
}
