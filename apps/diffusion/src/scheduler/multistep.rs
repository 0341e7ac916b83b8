//! What the multistep solvers (DPM-Solver++ and UniPC) share: their timesteps and sigmas, the
//! state they keep between steps, and the conversions of a model output to a clean-sample or
//! noise prediction.
use tch::Tensor;

use super::config::{PredictionType, SchedulerConfig, TimestepSpacing};
use super::options::FinalSigmas;
use super::same_shape;
use super::sigmas::{alpha_sigma, interp, karras, sigma_to_t};
use crate::error::{Error, Result};

/// The state a multistep solver keeps between steps, and its schedule.
#[derive(Debug, Default)]
pub(crate) struct Multistep {
    /// One per step, what the model is given.
    pub timesteps: Vec<f64>,
    /// One per step, then the final one.
    pub sigmas: Vec<f64>,
    /// The converted model outputs of the last `solver_order` steps, oldest first.
    pub outputs: Vec<Tensor>,
    /// Steps taken, capped at the order (diffusers' `lower_order_nums`).
    pub lower_order_nums: usize,
    /// The step expected next.
    pub next: usize,
}

impl Multistep {
    /// Spaces `steps` steps per `how` and forgets the history.
    pub fn reset(&mut self, cfg: &SchedulerConfig, train: &[f64], steps: usize, how: MultistepSchedule) -> Result<()> {
        (self.timesteps, self.sigmas) = multistep_schedule(cfg, train, steps, how)?;
        self.outputs.clear();
        self.lower_order_nums = 0;
        self.next = 0;
        Ok(())
    }

    /// Errors unless `index` is the step expected next (they run in order: each builds on the
    /// history) and the model output has the sample's shape.
    pub fn begin(&self, name: &str, index: usize, model_output: &Tensor, sample: &Tensor) -> Result<()> {
        check_next(name, index, self.next, self.timesteps.len())?;
        same_shape(model_output, sample, &format!("{name} model output and sample"))
    }

    /// Adds a step's converted output to the history, keeping the newest `order`.
    pub fn push(&mut self, x: Tensor, order: usize) {
        if self.outputs.len() == order {
            drop(self.outputs.remove(0));
        }
        self.outputs.push(x);
    }

    /// Counts the step as taken.
    pub fn finish(&mut self, order: usize) {
        self.lower_order_nums = (self.lower_order_nums + 1).min(order);
        self.next += 1;
    }
}

/// The multistep solvers' timesteps (DPM-Solver's and UniPC's `set_timesteps`): `steps + 1`
/// points spaced over `0..last` per the config with the final one dropped, descending.
/// `last` is `N` less the timesteps DPM-Solver's `lambda_min_clipped` removes.
pub(crate) fn multistep_timesteps(cfg: &SchedulerConfig, steps: usize, last: i64) -> Result<Vec<f64>> {
    let n = cfg.num_train_timesteps;
    if steps == 0 || steps as i64 > n || last < 1 {
        return Err(Error::Invalid(format!(
            "inference steps {steps} must lie in 1..={n} (num_train_timesteps), with {last} timesteps unclipped"
        )));
    }
    let k = steps as i64;
    Ok(match cfg.timestep_spacing {
        TimestepSpacing::Linspace => {
            // numpy's linspace(0, last - 1, k + 1) ends exactly at its stop; round half to even.
            let step = (last - 1) as f64 / k as f64;
            (1..=k)
                .rev()
                .map(|i| if i == k { (last - 1) as f64 } else { (i as f64 * step).round_ties_even() })
                .collect()
        }
        TimestepSpacing::Leading => {
            let ratio = last / (k + 1);
            (1..=k).rev().map(|i| (i * ratio + cfg.steps_offset) as f64).collect()
        }
        TimestepSpacing::Trailing => {
            // numpy's arange(last, 0, -N / k), rounded, minus one.
            let ratio = n as f64 / k as f64;
            let count = ((0.0 - last as f64) / -ratio).ceil() as i64;
            (0..count).map(|i| (last as f64 - i as f64 * ratio).round_ties_even() - 1.0).collect()
        }
    })
}

/// Where DPM-Solver's and UniPC's schedules differ.
pub(crate) struct MultistepSchedule {
    /// `N` less the timesteps DPM-Solver's `lambda_min_clipped` removes (`N` for UniPC).
    pub last: i64,
    /// Karras timesteps are truncated, not rounded, under the cosine schedule (DPM-Solver).
    pub truncate_cosine: bool,
    /// `final_sigmas_type="sigma_min"` under Karras sigmas is the ramp's own minimum (UniPC),
    /// else the training schedule's.
    pub karras_own_min: bool,
}

/// A multistep solver's timesteps and sigmas (one per step, then the final one): the training
/// sigmas at the spaced timesteps, or Karras et al.'s ramp (over `sigma_min`..`sigma_max`
/// when the config gives them, else the training range) with each timestep the nearest
/// training one.
pub(crate) fn multistep_schedule(
    cfg: &SchedulerConfig,
    train: &[f64],
    steps: usize,
    how: MultistepSchedule,
) -> Result<(Vec<f64>, Vec<f64>)> {
    let mut timesteps = multistep_timesteps(cfg, steps, how.last)?;
    let (mut sigmas, sigma_min) = if cfg.use_karras_sigmas {
        let lo = cfg.sigma_min.unwrap_or(train[0]);
        let hi = cfg.sigma_max.unwrap_or(train[train.len() - 1]);
        let sigmas = karras(lo, hi, steps);
        let log_sigmas: Vec<f64> = train.iter().map(|s| s.ln()).collect();
        // diffusers casts DPM-Solver's unrounded cosine-schedule timesteps, which truncates.
        let truncate = how.truncate_cosine && cfg.cosine_schedule;
        timesteps = sigmas
            .iter()
            .map(|&s| sigma_to_t(s, &log_sigmas))
            .map(|t| if truncate { t.trunc() } else { t.round_ties_even() })
            .collect();
        let min = if how.karras_own_min { sigmas[sigmas.len() - 1] } else { train[0] };
        (sigmas, min)
    } else {
        (timesteps.iter().map(|&t| interp(train, t)).collect(), train[0])
    };
    sigmas.push(match cfg.final_sigmas {
        FinalSigmas::Zero => 0.0,
        FinalSigmas::SigmaMin => sigma_min,
    });
    Ok((timesteps, sigmas))
}

/// The clean sample the model's output implies at `sigma` (DPM-Solver++'s and UniPC's data
/// prediction).
pub(crate) fn clean_sample(kind: PredictionType, out: &Tensor, sample: &Tensor, sigma: f64) -> Tensor {
    let (alpha, sigma) = alpha_sigma(sigma);
    match kind {
        PredictionType::Epsilon => (sample - out * sigma) / alpha,
        PredictionType::Sample => out.shallow_clone(),
        PredictionType::VPrediction => sample * alpha - out * sigma,
    }
}

/// The noise the model's output implies at `sigma` (UniPC's noise prediction).
pub(crate) fn noise(kind: PredictionType, out: &Tensor, sample: &Tensor, sigma: f64) -> Tensor {
    let (alpha, sigma) = alpha_sigma(sigma);
    match kind {
        PredictionType::Epsilon => out.shallow_clone(),
        PredictionType::Sample => (sample - out * alpha) / sigma,
        PredictionType::VPrediction => out * alpha + sample * sigma,
    }
}

/// Errors unless `index` is `next` of `steps` (a multistep method's steps run in order).
pub(crate) fn check_next(name: &str, index: usize, next: usize, steps: usize) -> Result<()> {
    if steps == 0 {
        return Err(Error::Invalid(format!("{name} step before set_timesteps")));
    }
    if index != next || index >= steps {
        return Err(Error::Invalid(format!(
            "{name} step {index}: its steps run in order, and the next of {steps} is {next}"
        )));
    }
    Ok(())
}
