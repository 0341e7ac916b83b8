//! The diffusers scheduler classes: each one's `__init__` keys (what it reads from a
//! `scheduler_config.json`) and the defaults that differ between them.

/// The diffusers scheduler class a config is read for: the keys a file lacks take this class's
/// `__init__` defaults, and only its own keys are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SchedulerClass {
    /// `DDPMScheduler` (training noise here): `leading`, clipping on.
    Ddpm,
    /// `DDIMScheduler`: `leading`, `set_alpha_to_one` and clipping on.
    Ddim,
    /// `EulerDiscreteScheduler`: `linspace`.
    EulerDiscrete,
    /// `EulerAncestralDiscreteScheduler`: `linspace`.
    EulerAncestralDiscrete,
    /// `PNDMScheduler`: `leading`, `set_alpha_to_one` off, Runge-Kutta warm-up on.
    Pndm,
    /// `DPMSolverMultistepScheduler`: `linspace`, DPM-Solver++ order 2, midpoint.
    DpmSolverMultistep,
    /// `UniPCMultistepScheduler`: `linspace`, order 2, bh2, clean-sample prediction.
    UniPcMultistep,
}

const COMMON: [&str; 5] = ["num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas"];

// Each class's own `__init__` keys, in diffusers' order.
#[rustfmt::skip]
const DDPM_KEYS: &[&str] = &[
    "variance_type", "clip_sample", "prediction_type", "thresholding",
    "dynamic_thresholding_ratio", "clip_sample_range", "sample_max_value", "timestep_spacing",
    "steps_offset", "rescale_betas_zero_snr",
];

#[rustfmt::skip]
const DDIM_KEYS: &[&str] = &[
    "clip_sample", "set_alpha_to_one", "steps_offset", "prediction_type", "thresholding",
    "dynamic_thresholding_ratio", "clip_sample_range", "sample_max_value", "timestep_spacing",
    "rescale_betas_zero_snr",
];

#[rustfmt::skip]
const EULER_DISCRETE_KEYS: &[&str] = &[
    "prediction_type", "interpolation_type", "use_karras_sigmas", "use_exponential_sigmas",
    "use_beta_sigmas", "sigma_min", "sigma_max", "timestep_spacing", "timestep_type",
    "steps_offset", "rescale_betas_zero_snr", "final_sigmas_type",
];

#[rustfmt::skip]
const EULER_ANCESTRAL_DISCRETE_KEYS: &[&str] = &[
    "prediction_type", "timestep_spacing", "steps_offset", "rescale_betas_zero_snr",
];

#[rustfmt::skip]
const PNDM_KEYS: &[&str] = &[
    "skip_prk_steps", "set_alpha_to_one", "prediction_type", "timestep_spacing", "steps_offset",
];

#[rustfmt::skip]
const DPM_SOLVER_MULTISTEP_KEYS: &[&str] = &[
    "solver_order", "prediction_type", "thresholding", "dynamic_thresholding_ratio",
    "sample_max_value", "algorithm_type", "solver_type", "lower_order_final", "euler_at_final",
    "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "use_lu_lambdas",
    "use_flow_sigmas", "flow_shift", "final_sigmas_type", "lambda_min_clipped", "variance_type",
    "timestep_spacing", "steps_offset", "rescale_betas_zero_snr", "use_dynamic_shifting",
    "time_shift_type",
];

#[rustfmt::skip]
const UNIPC_MULTISTEP_KEYS: &[&str] = &[
    "solver_order", "prediction_type", "thresholding", "dynamic_thresholding_ratio",
    "sample_max_value", "predict_x0", "solver_type", "lower_order_final", "disable_corrector",
    "solver_p", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
    "use_flow_sigmas", "flow_shift", "timestep_spacing", "steps_offset", "final_sigmas_type",
    "rescale_betas_zero_snr", "use_dynamic_shifting", "time_shift_type", "sigma_min", "sigma_max",
    "shift_terminal",
];

impl SchedulerClass {
    /// Every class.
    pub const ALL: [SchedulerClass; 7] = [
        SchedulerClass::Ddpm,
        SchedulerClass::Ddim,
        SchedulerClass::EulerDiscrete,
        SchedulerClass::EulerAncestralDiscrete,
        SchedulerClass::Pndm,
        SchedulerClass::DpmSolverMultistep,
        SchedulerClass::UniPcMultistep,
    ];

    /// diffusers' name of the class (`_class_name` in a config file).
    pub fn class_name(self) -> &'static str {
        match self {
            SchedulerClass::Ddpm => "DDPMScheduler",
            SchedulerClass::Ddim => "DDIMScheduler",
            SchedulerClass::EulerDiscrete => "EulerDiscreteScheduler",
            SchedulerClass::EulerAncestralDiscrete => "EulerAncestralDiscreteScheduler",
            SchedulerClass::Pndm => "PNDMScheduler",
            SchedulerClass::DpmSolverMultistep => "DPMSolverMultistepScheduler",
            SchedulerClass::UniPcMultistep => "UniPCMultistepScheduler",
        }
    }

    /// The class diffusers names `name`.
    pub fn from_class_name(name: &str) -> Option<SchedulerClass> {
        Self::ALL.into_iter().find(|c| c.class_name() == name)
    }

    /// The class's `__init__` keys in diffusers 0.42.1 (the schedule's five first): the keys it
    /// reads from a file.
    pub fn keys(self) -> Vec<&'static str> {
        let own = match self {
            SchedulerClass::Ddpm => DDPM_KEYS,
            SchedulerClass::Ddim => DDIM_KEYS,
            SchedulerClass::EulerDiscrete => EULER_DISCRETE_KEYS,
            SchedulerClass::EulerAncestralDiscrete => EULER_ANCESTRAL_DISCRETE_KEYS,
            SchedulerClass::Pndm => PNDM_KEYS,
            SchedulerClass::DpmSolverMultistep => DPM_SOLVER_MULTISTEP_KEYS,
            SchedulerClass::UniPcMultistep => UNIPC_MULTISTEP_KEYS,
        };
        COMMON.iter().chain(own).copied().collect()
    }

    /// Whether `key` is one of the class's `__init__` keys.
    pub fn has(self, key: &str) -> bool {
        COMMON.contains(&key) || self.keys().contains(&key)
    }

    /// diffusers' default `timestep_spacing`.
    pub(crate) fn default_spacing(self) -> &'static str {
        match self {
            SchedulerClass::Ddpm | SchedulerClass::Ddim | SchedulerClass::Pndm => "leading",
            _ => "linspace",
        }
    }
}

impl std::fmt::Display for SchedulerClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.class_name())
    }
}
