//! DDPM's training quantities (Ho et al. 2020; diffusers' `DDPMScheduler` and
//! `training_utils.compute_snr`): noising a clean sample at per-example timesteps, the
//! v-prediction target (Salimans & Ho 2022), and the SNR and min-SNR-gamma loss weights
//! (Hang et al. 2023).
use tch::{Kind, Tensor};

use super::{same_shape, PredictionType, SchedulerConfig};
use crate::error::{Error, Result};

/// The training-side schedule.
#[derive(Clone, Debug)]
pub struct DdpmScheduler {
    cfg: SchedulerConfig,
    alphas_cumprod: Vec<f64>,
}

impl DdpmScheduler {
    /// The schedule of `cfg`.
    pub fn new(cfg: SchedulerConfig) -> DdpmScheduler {
        let alphas_cumprod = cfg.alphas_cumprod();
        DdpmScheduler { cfg, alphas_cumprod }
    }

    /// The config.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// `alphas_cumprod` per training timestep.
    pub fn alphas_cumprod(&self) -> &[f64] {
        &self.alphas_cumprod
    }

    /// `f(alphas_cumprod[t])` per entry of the int64 timesteps `[b]`, as a float tensor on their
    /// device; out-of-range timesteps are an error.
    fn per_timestep(&self, timesteps: &Tensor, f: impl Fn(f64) -> f64) -> Result<Tensor> {
        let n = self.cfg.num_train_timesteps;
        if timesteps.dim() != 1 || timesteps.kind() != Kind::Int64 {
            return Err(Error::Invalid(format!(
                "timesteps must be int64 [batch], got {:?} {:?}",
                timesteps.kind(),
                timesteps.size()
            )));
        }
        if timesteps.numel() > 0 {
            let (lo, hi) = (timesteps.f_min()?.int64_value(&[]), timesteps.f_max()?.int64_value(&[]));
            if lo < 0 || hi >= n {
                return Err(Error::Invalid(format!("timesteps span {lo}..={hi}, outside 0..{n}")));
            }
        }
        let table: Vec<f64> = self.alphas_cumprod.iter().map(|a| f(*a)).collect();
        let table = Tensor::from_slice(&table).f_to_device(timesteps.device())?;
        Ok(table.f_index_select(0, timesteps)?)
    }

    /// `per_timestep` shaped `[b, 1, ...]` to broadcast over `like` (`[b, ...]`), in its kind.
    fn coefficient(&self, timesteps: &Tensor, like: &Tensor, f: impl Fn(f64) -> f64) -> Result<Tensor> {
        let b = timesteps.size().first().copied().unwrap_or(0);
        if like.dim() == 0 || like.size()[0] != b {
            return Err(Error::Invalid(format!("samples {:?} do not have one row per timestep ({b})", like.size())));
        }
        let mut shape = vec![b];
        shape.resize(like.dim(), 1);
        Ok(self.per_timestep(timesteps, f)?.f_to_kind(like.kind())?.f_view(shape.as_slice())?)
    }

    /// `sqrt(a_t) x0 + sqrt(1 - a_t) noise`, the forward process at `timesteps` (`[b]`).
    pub fn add_noise(&self, x0: &Tensor, noise: &Tensor, timesteps: &Tensor) -> Result<Tensor> {
        same_shape(x0, noise, "add_noise samples and noise")?;
        let a = self.coefficient(timesteps, x0, f64::sqrt)?;
        let s = self.coefficient(timesteps, x0, |a| (1.0 - a).sqrt())?;
        Ok(x0 * a + noise * s)
    }

    /// The velocity `sqrt(a_t) noise - sqrt(1 - a_t) x0`, v-prediction's target.
    pub fn get_velocity(&self, x0: &Tensor, noise: &Tensor, timesteps: &Tensor) -> Result<Tensor> {
        same_shape(x0, noise, "get_velocity samples and noise")?;
        let a = self.coefficient(timesteps, x0, f64::sqrt)?;
        let s = self.coefficient(timesteps, x0, |a| (1.0 - a).sqrt())?;
        Ok(noise * a - x0 * s)
    }

    /// What the model is trained to output under the config's prediction type.
    pub fn training_target(&self, x0: &Tensor, noise: &Tensor, timesteps: &Tensor) -> Result<Tensor> {
        match self.cfg.prediction_type {
            PredictionType::Epsilon => Ok(noise.shallow_clone()),
            PredictionType::VPrediction => self.get_velocity(x0, noise, timesteps),
            PredictionType::Sample => Ok(x0.shallow_clone()),
        }
    }

    /// Signal-to-noise ratio `a_t / (1 - a_t)` per timestep, fp32 `[b]`.
    pub fn snr(&self, timesteps: &Tensor) -> Result<Tensor> {
        Ok(self.per_timestep(timesteps, |a| a / (1.0 - a))?.f_to_kind(Kind::Float)?)
    }

    /// Min-SNR-gamma loss weights per example, fp32 `[b]`: `min(snr, gamma) / snr` for epsilon
    /// targets, `min(snr, gamma) / (snr + 1)` for v targets, `min(snr, gamma)` for sample targets.
    pub fn min_snr_weights(&self, timesteps: &Tensor, gamma: f64) -> Result<Tensor> {
        if gamma <= 0.0 {
            return Err(Error::Invalid(format!("min-SNR gamma is {gamma}, expected positive")));
        }
        let kind = self.cfg.prediction_type;
        let w = self.per_timestep(timesteps, |a| {
            let snr = a / (1.0 - a);
            let clipped = snr.min(gamma);
            match kind {
                PredictionType::Epsilon => clipped / snr,
                PredictionType::VPrediction => clipped / (snr + 1.0),
                PredictionType::Sample => clipped,
            }
        })?;
        Ok(w.f_to_kind(Kind::Float)?)
    }
}
