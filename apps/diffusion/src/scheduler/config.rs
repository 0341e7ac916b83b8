//! `scheduler_config.json` read ([`SchedulerFile`]: its keys, [`SchedulerConfigFile`], and
//! where they came from) and the validated [`SchedulerConfig`] every scheduler is built from,
//! as one [`SchedulerClass`] reads it.
//!
//! One file serves every class, as in diffusers, where a pipeline's config is handed to
//! `OtherScheduler.from_config`. A key the class reading the file does not have is ignored (as
//! `from_config` ignores it; the one exception diffusers makes, DPM-Solver's Karras sigmas
//! reading `sigma_min`/`sigma_max`, is followed); a key it has is honoured or, for a value
//! naming a feature not implemented here, an error naming the key.
use std::path::{Path, PathBuf};

use super::class::SchedulerClass;
use super::options::{self, FinalSigmas, SolverType};
use super::raw::{quote_non_finite, SchedulerConfigFile};
use crate::error::{Error, Result};

/// What the model predicts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PredictionType {
    /// The added noise.
    Epsilon,
    /// The velocity `sqrt(a) noise - sqrt(1 - a) x0` (SD 2.x 768).
    VPrediction,
    /// The clean sample.
    Sample,
}

/// How inference timesteps are spread over the training ones (Lin et al. 2023, table 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimestepSpacing {
    /// `0, r, 2r, ...` (integer ratio) plus `steps_offset`, descending.
    Leading,
    /// `N - 1, N - 1 - r, ...` (real ratio, rounded).
    Trailing,
    /// Evenly from `N - 1` down to 0.
    Linspace,
}

/// A validated scheduler config with its betas, as one class reads it. Fields a class does not
/// have hold that class-independent default and are not read by its scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// The class it was read for.
    pub class: SchedulerClass,
    /// Diffusion steps of training (`N`).
    pub num_train_timesteps: i64,
    /// One beta per training timestep.
    pub betas: Vec<f64>,
    /// `beta_schedule` names the cosine schedule (DPM-Solver truncates its Karras timesteps
    /// rather than rounding them then).
    pub cosine_schedule: bool,
    /// What the model predicts.
    pub prediction_type: PredictionType,
    /// Inference timestep spacing.
    pub timestep_spacing: TimestepSpacing,
    /// Added to `leading` timesteps.
    pub steps_offset: i64,
    /// DDIM, PNDM: the alpha product before the first step is 1.
    pub set_alpha_to_one: bool,
    /// DDIM: clamp the predicted clean sample to `[-r, r]`.
    pub clip_sample: Option<f64>,
    /// PNDM: PLMS steps only, no Runge-Kutta warm-up.
    pub skip_prk_steps: bool,
    /// DPM-Solver, UniPC: the multistep order.
    pub solver_order: usize,
    /// DPM-Solver, UniPC: the update rule.
    pub solver_type: SolverType,
    /// DPM-Solver, UniPC: lower orders in the last steps.
    pub lower_order_final: bool,
    /// DPM-Solver: first order in the last step.
    pub euler_at_final: bool,
    /// DPM-Solver, UniPC: Karras et al.'s sigmas.
    pub use_karras_sigmas: bool,
    /// Karras sigmas' smallest value (default: the training schedule's).
    pub sigma_min: Option<f64>,
    /// Karras sigmas' largest value (default: the training schedule's).
    pub sigma_max: Option<f64>,
    /// DPM-Solver, UniPC: the sigma after the last step.
    pub final_sigmas: FinalSigmas,
    /// DPM-Solver: the smallest log-SNR a timestep may have.
    pub lambda_min_clipped: f64,
    /// UniPC: predict the clean sample (else the noise).
    pub predict_x0: bool,
    /// UniPC: steps whose corrector is skipped.
    pub disable_corrector: Vec<i64>,
}

impl SchedulerConfig {
    /// Reads `scheduler/scheduler_config.json` of a diffusers model folder for `class`.
    pub fn from_diffusers(model_dir: &Path, class: SchedulerClass) -> Result<SchedulerConfig> {
        Self::from_file(&model_dir.join("scheduler").join("scheduler_config.json"), class)
    }

    /// Reads and validates a scheduler config for `class`; errors name the file and key.
    pub fn from_file(path: &Path, class: SchedulerClass) -> Result<SchedulerConfig> {
        SchedulerFile::read(path)?.config(class)
    }

    /// Validates a parsed config for `class`; the message names the offending key.
    pub fn from_raw(raw: &SchedulerConfigFile, class: SchedulerClass) -> std::result::Result<SchedulerConfig, String> {
        options::check_supported(raw, class)?;
        let prediction_type = match raw.prediction_type.as_str() {
            "epsilon" => PredictionType::Epsilon,
            "v_prediction" => PredictionType::VPrediction,
            "sample" if matches!(class, SchedulerClass::Pndm | SchedulerClass::EulerAncestralDiscrete) => {
                return Err(format!("prediction_type \"sample\" is not supported by diffusers' {class}"));
            }
            "sample" => PredictionType::Sample,
            other => return Err(format!("prediction_type {other:?} is not epsilon, v_prediction or sample")),
        };
        let timestep_spacing = match raw.timestep_spacing.as_deref().unwrap_or(class.default_spacing()) {
            "leading" => TimestepSpacing::Leading,
            "trailing" => TimestepSpacing::Trailing,
            "linspace" => TimestepSpacing::Linspace,
            other => return Err(format!("timestep_spacing {other:?} is not leading, trailing or linspace")),
        };
        let set_alpha_to_one =
            class.has("set_alpha_to_one") && raw.set_alpha_to_one.unwrap_or(class == SchedulerClass::Ddim);
        let clip_sample = class.has("clip_sample") && raw.clip_sample.unwrap_or(true);
        if clip_sample && raw.clip_sample_range <= 0.0 {
            return Err(format!("clip_sample_range is {}, expected positive", raw.clip_sample_range));
        }
        // Added to every inference timestep, which must stay a training timestep.
        if !(0..raw.num_train_timesteps).contains(&raw.steps_offset) {
            return Err(format!(
                "steps_offset {} is outside 0..{} (num_train_timesteps)",
                raw.steps_offset, raw.num_train_timesteps
            ));
        }
        // Karras sigmas run from sigma_max down to sigma_min through their 1/7th powers.
        for (key, value) in [("sigma_min", raw.sigma_min), ("sigma_max", raw.sigma_max)] {
            if let Some(v) = value.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                return Err(format!("{key} is {v}, expected a finite value of at least 0"));
            }
        }
        if let (Some(lo), Some(hi)) = (raw.sigma_min, raw.sigma_max) {
            if lo >= hi {
                return Err(format!("sigma_min {lo} is not below sigma_max {hi}"));
            }
        }
        let solver = options::solver(raw, class)?;
        Ok(SchedulerConfig {
            class,
            num_train_timesteps: raw.num_train_timesteps,
            betas: options::betas(raw)?,
            cosine_schedule: raw.beta_schedule == "squaredcos_cap_v2",
            prediction_type,
            timestep_spacing,
            steps_offset: raw.steps_offset,
            set_alpha_to_one,
            clip_sample: clip_sample.then_some(raw.clip_sample_range),
            skip_prk_steps: class.has("skip_prk_steps") && raw.skip_prk_steps,
            solver_order: solver.order,
            solver_type: solver.kind,
            lower_order_final: raw.lower_order_final,
            euler_at_final: class.has("euler_at_final") && raw.euler_at_final,
            use_karras_sigmas: options::multistep(class) && raw.use_karras_sigmas,
            sigma_min: raw.sigma_min,
            sigma_max: raw.sigma_max,
            final_sigmas: solver.final_sigmas,
            lambda_min_clipped: if class.has("lambda_min_clipped") {
                raw.lambda_min_clipped
            } else {
                f64::NEG_INFINITY
            },
            predict_x0: !class.has("predict_x0") || raw.predict_x0,
            disable_corrector: raw.disable_corrector.clone(),
        })
    }

    /// `prod_{s <= t} (1 - beta_s)` for every training timestep `t`.
    pub fn alphas_cumprod(&self) -> Vec<f64> {
        self.betas
            .iter()
            .scan(1.0, |acc, b| {
                *acc *= 1.0 - b;
                Some(*acc)
            })
            .collect()
    }

    /// diffusers' inference timesteps for `steps` steps, descending. `rounded` gives DDIM's
    /// integer timesteps; unrounded `linspace` values are Euler's fractional ones.
    pub fn spaced_timesteps(&self, steps: usize, rounded: bool) -> Result<Vec<f64>> {
        let n = self.num_train_timesteps;
        if steps == 0 || steps as i64 > n {
            return Err(Error::Invalid(format!("inference steps {steps} must lie in 1..={n} (num_train_timesteps)")));
        }
        let k = steps as i64;
        let t: Vec<f64> = match self.timestep_spacing {
            TimestepSpacing::Linspace => {
                let last = (n - 1) as f64;
                let step = if k > 1 { last / (k - 1) as f64 } else { 0.0 };
                // numpy's linspace ends exactly at its stop; its round is half-to-even.
                let t = (0..k).rev().map(|i| if i == k - 1 { last } else { i as f64 * step });
                t.map(|v| if rounded { v.round_ties_even() } else { v }).collect()
            }
            TimestepSpacing::Leading => {
                let ratio = n / k;
                // The first timestep, (k - 1) r + steps_offset, must stay a training timestep.
                if (k - 1) * ratio + self.steps_offset >= n {
                    return Err(Error::Invalid(format!(
                        "{steps} inference steps with \"leading\" spacing and steps_offset {} would start at \
                         timestep {}, past num_train_timesteps {n}: take fewer steps",
                        self.steps_offset,
                        (k - 1) * ratio + self.steps_offset
                    )));
                }
                (0..k).rev().map(|i| (i * ratio + self.steps_offset) as f64).collect()
            }
            TimestepSpacing::Trailing => {
                // numpy's arange(N, 0, -r): ceil(N / r) values N - i r, rounded, minus one.
                let ratio = n as f64 / k as f64;
                let count = ((0.0 - n as f64) / -ratio).ceil() as i64;
                (0..count).map(|i| (n as f64 - i as f64 * ratio).round_ties_even() - 1.0).collect()
            }
        };
        Ok(t)
    }
}

/// A scheduler config file as read, before a class gives its missing keys their defaults.
#[derive(Clone, Debug)]
pub struct SchedulerFile {
    /// Where it was read from (named in errors).
    pub path: PathBuf,
    /// Its keys.
    pub raw: SchedulerConfigFile,
}

impl SchedulerFile {
    /// Reads `path`; a file that is no valid config of the class it names (or, naming none
    /// this crate has, whose noise schedule is invalid) is an error naming it.
    pub fn read(path: &Path) -> Result<SchedulerFile> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        Self::parse(path, &text)
    }

    /// Parses `text`, the contents of `path` (named in errors), as [`SchedulerFile::read`].
    pub fn parse(path: &Path, text: &str) -> Result<SchedulerFile> {
        let raw = serde_json::from_str(&quote_non_finite(text))
            .map_err(|e| Error::Format { path: path.to_path_buf(), msg: e.to_string() })?;
        let file = SchedulerFile { path: path.to_path_buf(), raw };
        match file.class() {
            Ok(class) => drop(file.config(class)?),
            // The class chosen to read it checks the rest.
            Err(_) => drop(options::betas(&file.raw).map_err(|msg| Error::Format { path: path.to_path_buf(), msg })?),
        }
        Ok(file)
    }

    /// The class the file names in `_class_name`; a missing or unknown one is an error naming
    /// the file and the class.
    pub fn class(&self) -> Result<SchedulerClass> {
        let bad = |msg: String| Error::Format { path: self.path.clone(), msg };
        let name = self.raw.class_name.as_deref().ok_or_else(|| bad("no _class_name".into()))?;
        SchedulerClass::from_class_name(name).ok_or_else(|| {
            let known: Vec<_> = SchedulerClass::ALL.iter().map(|c| c.class_name()).collect();
            bad(format!("_class_name {name:?} is not a scheduler class this crate has ({})", known.join(", ")))
        })
    }

    /// The config as `class` reads it.
    pub fn config(&self, class: SchedulerClass) -> Result<SchedulerConfig> {
        self.config_from(&self.raw, class)
    }

    /// The config as `class` reads the file with `use_karras_sigmas` true (diffusers'
    /// `from_config(config, use_karras_sigmas=True)`).
    pub fn config_karras(&self, class: SchedulerClass) -> Result<SchedulerConfig> {
        self.config_from(&SchedulerConfigFile { use_karras_sigmas: true, ..self.raw.clone() }, class)
    }

    fn config_from(&self, raw: &SchedulerConfigFile, class: SchedulerClass) -> Result<SchedulerConfig> {
        SchedulerConfig::from_raw(raw, class)
            .map_err(|msg| Error::Format { path: self.path.clone(), msg: format!("read as {class}: {msg}") })
    }
}
