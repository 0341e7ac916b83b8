//! Noise schedulers read from a diffusers `scheduler/scheduler_config.json`: the shared noise
//! schedule and timestep spacing here, DDPM's training quantities in [`ddpm`], and the DDIM and
//! Euler discrete samplers in [`ddim`] and [`euler`]. Schedules are computed in f64 from the
//! config; the tensors they touch keep their own device and kind.
pub mod ddim;
pub mod ddpm;
pub mod euler;

pub use ddim::{DdimScheduler, DdimStep};
pub use ddpm::DdpmScheduler;
pub use euler::{EulerDiscreteScheduler, EulerStep};

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tch::Tensor;

use crate::config::read_json;
use crate::error::{Error, Result};

/// `scheduler_config.json` as diffusers writes it, for any scheduler class. Keys whose default
/// differs between classes are `None` when absent and take the default of the class the config
/// is read for ([`SchedulerClass`]), as diffusers' `from_config` does (SD 1.5 ships a PNDM config
/// without `timestep_spacing`: DDIM reads it as `leading`, Euler as `linspace`); keys naming
/// features these schedulers lack must hold their off values.
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct SchedulerConfigFile {
    /// Diffusion steps of training.
    pub num_train_timesteps: i64,
    /// First beta.
    pub beta_start: f64,
    /// Last beta.
    pub beta_end: f64,
    /// `linear`, `scaled_linear` or `squaredcos_cap_v2`.
    pub beta_schedule: String,
    /// Explicit betas (override the schedule).
    pub trained_betas: Option<Vec<f64>>,
    /// `epsilon`, `v_prediction` or `sample`.
    pub prediction_type: String,
    /// `leading`, `trailing` or `linspace` (class default when absent).
    pub timestep_spacing: Option<String>,
    /// Added to `leading` timesteps.
    pub steps_offset: i64,
    /// DDIM: the alpha product before the first step is 1 (else `alphas_cumprod[0]`); class
    /// default when absent.
    pub set_alpha_to_one: Option<bool>,
    /// Clamp the predicted clean sample (DDIM, DDPM); class default when absent.
    pub clip_sample: Option<bool>,
    /// The clamp's bound.
    pub clip_sample_range: f64,
    /// Unsupported when true.
    pub thresholding: bool,
    /// Unsupported when true.
    pub rescale_betas_zero_snr: bool,
    /// Unsupported when true.
    pub use_karras_sigmas: bool,
    /// Unsupported when true.
    pub use_exponential_sigmas: bool,
    /// Unsupported when true.
    pub use_beta_sigmas: bool,
    /// Euler: only `linear`.
    pub interpolation_type: String,
    /// Euler: only `discrete`.
    pub timestep_type: String,
    /// Euler: only `zero`.
    pub final_sigmas_type: String,
}

impl Default for SchedulerConfigFile {
    fn default() -> Self {
        SchedulerConfigFile {
            num_train_timesteps: 1000,
            beta_start: 0.0001,
            beta_end: 0.02,
            beta_schedule: "linear".into(),
            trained_betas: None,
            prediction_type: "epsilon".into(),
            timestep_spacing: None,
            steps_offset: 0,
            set_alpha_to_one: None,
            clip_sample: None,
            clip_sample_range: 1.0,
            thresholding: false,
            rescale_betas_zero_snr: false,
            use_karras_sigmas: false,
            use_exponential_sigmas: false,
            use_beta_sigmas: false,
            interpolation_type: "linear".into(),
            timestep_type: "discrete".into(),
            final_sigmas_type: "zero".into(),
        }
    }
}

/// The diffusers scheduler class a config is read for: the keys a file lacks take this class's
/// `__init__` defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedulerClass {
    /// `DDPMScheduler` (training noise): `leading`, clipping on.
    Ddpm,
    /// `DDIMScheduler`: `leading`, `set_alpha_to_one` and clipping on.
    Ddim,
    /// `EulerDiscreteScheduler`: `linspace`; it has neither clipping nor `set_alpha_to_one`.
    EulerDiscrete,
}

impl SchedulerClass {
    /// diffusers' defaults: (`timestep_spacing`, `set_alpha_to_one`, `clip_sample`); the last two
    /// are off for classes without them.
    fn defaults(self) -> (&'static str, bool, bool) {
        match self {
            SchedulerClass::Ddpm => ("leading", false, true),
            SchedulerClass::Ddim => ("leading", true, true),
            SchedulerClass::EulerDiscrete => ("linspace", false, false),
        }
    }
}

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

/// A validated scheduler config with its betas.
#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Diffusion steps of training (`N`).
    pub num_train_timesteps: i64,
    /// One beta per training timestep.
    pub betas: Vec<f64>,
    /// What the model predicts.
    pub prediction_type: PredictionType,
    /// Inference timestep spacing.
    pub timestep_spacing: TimestepSpacing,
    /// Added to `leading` timesteps.
    pub steps_offset: i64,
    /// DDIM: the alpha product before the first step is 1.
    pub set_alpha_to_one: bool,
    /// DDIM: clamp the predicted clean sample to `[-r, r]`.
    pub clip_sample: Option<f64>,
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
        let (default_spacing, default_alpha_to_one, default_clip) = class.defaults();
        let n = raw.num_train_timesteps;
        if n < 2 {
            return Err(format!("num_train_timesteps is {n}, expected at least 2"));
        }
        let unsupported = [
            ("thresholding", raw.thresholding),
            ("rescale_betas_zero_snr", raw.rescale_betas_zero_snr),
            ("use_karras_sigmas", raw.use_karras_sigmas),
            ("use_exponential_sigmas", raw.use_exponential_sigmas),
            ("use_beta_sigmas", raw.use_beta_sigmas),
        ];
        if let Some((key, _)) = unsupported.iter().find(|(_, on)| *on) {
            return Err(format!("{key} is true; only false is supported"));
        }
        for (key, value, only) in [
            ("interpolation_type", &raw.interpolation_type, "linear"),
            ("timestep_type", &raw.timestep_type, "discrete"),
            ("final_sigmas_type", &raw.final_sigmas_type, "zero"),
        ] {
            if value != only {
                return Err(format!("{key} {value:?} is not supported (only {only:?})"));
            }
        }
        let linspace = |a: f64, b: f64| (0..n).map(move |i| a + (b - a) * i as f64 / (n - 1) as f64);
        let betas: Vec<f64> = match (&raw.trained_betas, raw.beta_schedule.as_str()) {
            (Some(b), _) if b.len() as i64 == n => b.clone(),
            (Some(b), _) => return Err(format!("trained_betas has {} entries, num_train_timesteps is {n}", b.len())),
            (None, "linear") => linspace(raw.beta_start, raw.beta_end).collect(),
            (None, "scaled_linear") => linspace(raw.beta_start.sqrt(), raw.beta_end.sqrt()).map(|b| b * b).collect(),
            (None, "squaredcos_cap_v2") => {
                // Nichol & Dhariwal's cosine schedule, each beta capped at 0.999.
                let abar = |t: f64| ((t + 0.008) / 1.008 * std::f64::consts::FRAC_PI_2).cos().powi(2);
                let n = n as f64;
                (0..raw.num_train_timesteps)
                    .map(|i| (1.0 - abar((i as f64 + 1.0) / n) / abar(i as f64 / n)).min(0.999))
                    .collect()
            }
            (None, other) => {
                return Err(format!("beta_schedule {other:?} is not linear, scaled_linear or squaredcos_cap_v2"))
            }
        };
        if let Some(b) = betas.iter().find(|b| !(**b > 0.0 && **b < 1.0)) {
            return Err(format!("betas must lie in (0, 1), found {b}"));
        }
        let prediction_type = match raw.prediction_type.as_str() {
            "epsilon" => PredictionType::Epsilon,
            "v_prediction" => PredictionType::VPrediction,
            "sample" => PredictionType::Sample,
            other => return Err(format!("prediction_type {other:?} is not epsilon, v_prediction or sample")),
        };
        let timestep_spacing = match raw.timestep_spacing.as_deref().unwrap_or(default_spacing) {
            "leading" => TimestepSpacing::Leading,
            "trailing" => TimestepSpacing::Trailing,
            "linspace" => TimestepSpacing::Linspace,
            other => return Err(format!("timestep_spacing {other:?} is not leading, trailing or linspace")),
        };
        let (set_alpha_to_one, clip_sample) = match class {
            SchedulerClass::EulerDiscrete => (false, false),
            _ => (raw.set_alpha_to_one.unwrap_or(default_alpha_to_one), raw.clip_sample.unwrap_or(default_clip)),
        };
        if clip_sample && raw.clip_sample_range <= 0.0 {
            return Err(format!("clip_sample_range is {}, expected positive", raw.clip_sample_range));
        }
        Ok(SchedulerConfig {
            num_train_timesteps: n,
            betas,
            prediction_type,
            timestep_spacing,
            steps_offset: raw.steps_offset,
            set_alpha_to_one,
            clip_sample: clip_sample.then_some(raw.clip_sample_range),
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
    /// Reads `path`; a file that is no valid config for any of the classes is an error naming it.
    pub fn read(path: &Path) -> Result<SchedulerFile> {
        let file = SchedulerFile { path: path.to_path_buf(), raw: read_json(path)? };
        file.config(SchedulerClass::Ddim)?;
        Ok(file)
    }

    /// The config as `class` reads it.
    pub fn config(&self, class: SchedulerClass) -> Result<SchedulerConfig> {
        SchedulerConfig::from_raw(&self.raw, class).map_err(|msg| Error::Format { path: self.path.clone(), msg })
    }
}

/// Errors unless `a` and `b` have the same shape (`what` names them).
pub(crate) fn same_shape(a: &Tensor, b: &Tensor, what: &str) -> Result<()> {
    if a.size() != b.size() {
        return Err(Error::Invalid(format!("{what}: shapes {:?} and {:?} differ", a.size(), b.size())));
    }
    Ok(())
}
