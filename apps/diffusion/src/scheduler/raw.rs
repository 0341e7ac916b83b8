//! `scheduler_config.json`'s keys as diffusers writes them, for any of the classes
//! ([`SchedulerConfigFile`], read by serde as it stands), before [`super::config`] validates
//! them for the class that reads the file ([`super::options`] holds the checks). Python's
//! `json` writes non-finite numbers bare; `quote_non_finite` makes such a file strict JSON.
use serde::{Deserialize, Deserializer};

/// `scheduler_config.json` as diffusers writes it, for any of the classes. Keys whose default
/// differs between classes are `None` when absent and take the default of the class the file
/// is read for. Keys diffusers only reads when a rejected feature is on
/// (`dynamic_thresholding_ratio`, `sample_max_value`, `flow_shift`, `time_shift_type`) are not
/// kept.
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct SchedulerConfigFile {
    /// The diffusers class that wrote the file (`PNDMScheduler` for SD 1.5).
    #[serde(rename = "_class_name")]
    pub class_name: Option<String>,
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
    /// DDIM, PNDM: the alpha product before the first step is 1 (else `alphas_cumprod[0]`).
    pub set_alpha_to_one: Option<bool>,
    /// DDIM, DDPM: clamp the predicted clean sample.
    pub clip_sample: Option<bool>,
    /// The clamp's bound.
    pub clip_sample_range: f64,
    /// Unsupported when true.
    pub thresholding: bool,
    /// Unsupported when true.
    pub rescale_betas_zero_snr: bool,
    /// DPM-Solver, UniPC: Karras et al.'s sigmas (unsupported by Euler here).
    pub use_karras_sigmas: bool,
    /// Unsupported when true.
    pub use_exponential_sigmas: bool,
    /// Unsupported when true.
    pub use_beta_sigmas: bool,
    /// DPM-Solver: unsupported when true.
    pub use_lu_lambdas: bool,
    /// DPM-Solver, UniPC: unsupported when true.
    pub use_flow_sigmas: bool,
    /// DPM-Solver, UniPC: unsupported when true.
    pub use_dynamic_shifting: bool,
    /// Euler: only `linear`.
    pub interpolation_type: String,
    /// Euler: only `discrete`.
    pub timestep_type: String,
    /// `zero` or `sigma_min` (DPM-Solver, UniPC; Euler: only `zero`).
    pub final_sigmas_type: String,
    /// Karras sigmas' range (class keys of Euler and UniPC; DPM-Solver reads them too when a
    /// file holds them, as diffusers' `from_config` keeps them in its config).
    pub sigma_min: Option<f64>,
    /// See `sigma_min`.
    pub sigma_max: Option<f64>,
    /// PNDM: PLMS steps only (else a Runge-Kutta warm-up first).
    pub skip_prk_steps: bool,
    /// DPM-Solver (1 to 3), UniPC (1 or more).
    pub solver_order: i64,
    /// DPM-Solver: `dpmsolver++` (`deis` reads as it, as in diffusers).
    pub algorithm_type: String,
    /// DPM-Solver `midpoint` or `heun`; UniPC `bh1` or `bh2` (class default when absent).
    pub solver_type: Option<String>,
    /// DPM-Solver, UniPC: lower orders in the last steps.
    pub lower_order_final: bool,
    /// DPM-Solver: first order in the last step.
    pub euler_at_final: bool,
    /// DPM-Solver: timesteps whose log-SNR lies below this are not used (JSON's `-Infinity`
    /// as Python writes it is read).
    #[serde(deserialize_with = "number_or_infinity")]
    pub lambda_min_clipped: f64,
    /// DDPM: ignored (training only); DPM-Solver: `learned` and `learned_range` unsupported.
    pub variance_type: Option<String>,
    /// UniPC: predict the clean sample (else the noise).
    pub predict_x0: bool,
    /// UniPC: steps whose corrector is skipped.
    pub disable_corrector: Vec<i64>,
    /// UniPC: another scheduler as the predictor; unsupported unless null.
    pub solver_p: Option<serde_json::Value>,
    /// UniPC: unsupported unless null.
    pub shift_terminal: Option<f64>,
}

impl Default for SchedulerConfigFile {
    fn default() -> Self {
        SchedulerConfigFile {
            class_name: None,
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
            use_lu_lambdas: false,
            use_flow_sigmas: false,
            use_dynamic_shifting: false,
            interpolation_type: "linear".into(),
            timestep_type: "discrete".into(),
            final_sigmas_type: "zero".into(),
            sigma_min: None,
            sigma_max: None,
            skip_prk_steps: false,
            solver_order: 2,
            algorithm_type: "dpmsolver++".into(),
            solver_type: None,
            lower_order_final: true,
            euler_at_final: false,
            lambda_min_clipped: f64::NEG_INFINITY,
            variance_type: None,
            predict_x0: true,
            disable_corrector: Vec::new(),
            solver_p: None,
            shift_terminal: None,
        }
    }
}

/// A number, or one of the non-finite values Python's `json` writes (`Infinity`, `-Infinity`,
/// `NaN`), which [`quote_non_finite`] has turned into strings.
fn number_or_infinity<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<f64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Number {
        Finite(f64),
        Named(String),
    }
    match Number::deserialize(d)? {
        Number::Finite(x) => Ok(x),
        Number::Named(s) => match s.as_str() {
            "Infinity" => Ok(f64::INFINITY),
            "-Infinity" => Ok(f64::NEG_INFINITY),
            "NaN" => Ok(f64::NAN),
            _ => Err(serde::de::Error::custom(format!("expected a number, found {s:?}"))),
        },
    }
}

/// `text` with the bare `Infinity`, `-Infinity` and `NaN` that Python's `json` writes (diffusers
/// saves DPM-Solver's `lambda_min_clipped` as `-Infinity`) quoted, so strict JSON reads it.
pub(crate) fn quote_non_finite(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    let (mut in_string, mut escaped) = (false, false);
    let mut rest = text;
    while let Some(c) = rest.chars().next() {
        if !in_string {
            if let Some(word) = ["-Infinity", "Infinity", "NaN"].into_iter().find(|w| rest.starts_with(w)) {
                out.push('"');
                out.push_str(word);
                out.push('"');
                rest = &rest[word.len()..];
                continue;
            }
        }
        match (in_string, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, false, '"') => in_string = !in_string,
            _ => {}
        }
        out.push(c);
        rest = &rest[c.len_utf8()..];
    }
    out
}
