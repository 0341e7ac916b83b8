//! The checks behind [`SchedulerConfig::from_raw`](super::SchedulerConfig::from_raw): betas from
//! the schedule keys, the multistep solvers' options, and the keys naming features not
//! implemented here, each refused (naming the key) only by the classes that have it.
use super::class::SchedulerClass;
use super::raw::SchedulerConfigFile;

/// The update rule of a multistep solver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SolverType {
    /// DPM-Solver's second-order midpoint rule (its default).
    Midpoint,
    /// DPM-Solver's second-order Heun rule.
    Heun,
    /// UniPC's `B(h) = h`.
    Bh1,
    /// UniPC's `B(h) = e^h - 1` (its default).
    Bh2,
}

/// The sigma a multistep solver steps to last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalSigmas {
    /// 0: the last step lands on the clean sample.
    Zero,
    /// The training schedule's smallest sigma (UniPC under Karras sigmas: the Karras range's).
    SigmaMin,
}

/// A multistep solver's validated order, rule and final sigma.
pub(crate) struct Solver {
    pub order: usize,
    pub kind: SolverType,
    pub final_sigmas: FinalSigmas,
}

/// Whether `class` is a multistep solver (DPM-Solver or UniPC).
pub(crate) fn multistep(class: SchedulerClass) -> bool {
    matches!(class, SchedulerClass::DpmSolverMultistep | SchedulerClass::UniPcMultistep)
}

/// Errors naming the first key of `class` that asks for a feature not implemented here.
pub(crate) fn check_supported(raw: &SchedulerConfigFile, class: SchedulerClass) -> Result<(), String> {
    let n = raw.num_train_timesteps;
    if n < 2 {
        return Err(format!("num_train_timesteps is {n}, expected at least 2"));
    }
    let flags = [
        ("thresholding", raw.thresholding),
        ("rescale_betas_zero_snr", raw.rescale_betas_zero_snr),
        // Euler reads Karras sigmas in diffusers; this crate's Euler does not.
        ("use_karras_sigmas", raw.use_karras_sigmas && class == SchedulerClass::EulerDiscrete),
        ("use_exponential_sigmas", raw.use_exponential_sigmas),
        ("use_beta_sigmas", raw.use_beta_sigmas),
        ("use_lu_lambdas", raw.use_lu_lambdas),
        ("use_flow_sigmas", raw.use_flow_sigmas),
        ("use_dynamic_shifting", raw.use_dynamic_shifting),
    ];
    if let Some((key, _)) = flags.iter().find(|(key, on)| *on && class.has(key)) {
        return Err(format!("{key} is true; only false is supported"));
    }
    if class == SchedulerClass::EulerDiscrete {
        for (key, value, only) in [
            ("interpolation_type", &raw.interpolation_type, "linear"),
            ("timestep_type", &raw.timestep_type, "discrete"),
            ("final_sigmas_type", &raw.final_sigmas_type, "zero"),
        ] {
            if value != only {
                return Err(format!("{key} {value:?} is not supported (only {only:?})"));
            }
        }
    }
    if class == SchedulerClass::DpmSolverMultistep {
        if let Some(v @ ("learned" | "learned_range")) = raw.variance_type.as_deref() {
            return Err(format!("variance_type {v:?} (a model predicting its variance) is not supported"));
        }
    }
    if class == SchedulerClass::UniPcMultistep {
        if let Some(p) = &raw.solver_p {
            return Err(format!("solver_p {p} is not supported (only null)"));
        }
        if let Some(s) = raw.shift_terminal {
            return Err(format!("shift_terminal {s} is not supported (only null)"));
        }
    }
    Ok(())
}

/// The betas of the schedule keys.
pub(crate) fn betas(raw: &SchedulerConfigFile) -> Result<Vec<f64>, String> {
    let n = raw.num_train_timesteps;
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
    Ok(betas)
}

/// The solver options of a multistep `class` (class defaults for the others, unread).
pub(crate) fn solver(raw: &SchedulerConfigFile, class: SchedulerClass) -> Result<Solver, String> {
    let default = Solver { order: 2, kind: SolverType::Midpoint, final_sigmas: FinalSigmas::Zero };
    if !multistep(class) {
        return Ok(default);
    }
    let final_sigmas = match raw.final_sigmas_type.as_str() {
        "zero" => FinalSigmas::Zero,
        "sigma_min" => FinalSigmas::SigmaMin,
        other => return Err(format!("final_sigmas_type {other:?} is not zero or sigma_min")),
    };
    let order = raw.solver_order;
    let dpm = class == SchedulerClass::DpmSolverMultistep;
    if order < 1 || (dpm && order > 3) {
        let range = if dpm { "1, 2 or 3" } else { "at least 1" };
        return Err(format!("solver_order is {order}, expected {range}"));
    }
    // diffusers maps the other solver's type names onto this one's default.
    let kind = match (dpm, raw.solver_type.as_deref()) {
        (true, None | Some("midpoint" | "logrho" | "bh1" | "bh2")) => SolverType::Midpoint,
        (true, Some("heun")) => SolverType::Heun,
        (false, Some("bh1")) => SolverType::Bh1,
        (false, None | Some("bh2" | "midpoint" | "heun" | "logrho")) => SolverType::Bh2,
        (_, Some(other)) => {
            let known = if dpm { "midpoint or heun" } else { "bh1 or bh2" };
            return Err(format!("solver_type {other:?} is not {known}"));
        }
    };
    if dpm {
        match raw.algorithm_type.as_str() {
            "dpmsolver++" => {}
            // diffusers reads DEIS configs as DPM-Solver++, refusing a final sigma of zero.
            "deis" if final_sigmas == FinalSigmas::SigmaMin => {}
            "deis" => return Err("algorithm_type \"deis\" needs final_sigmas_type \"sigma_min\" in diffusers".into()),
            other => return Err(format!("algorithm_type {other:?} is not supported (only \"dpmsolver++\")")),
        }
    } else if !raw.lower_order_final && final_sigmas == FinalSigmas::Zero && order > 1 {
        // A multistep step to sigma 0 extrapolates the model outputs to infinite log-SNR.
        return Err(format!(
            "lower_order_final false with final_sigmas_type \"zero\" and solver_order {order}: the last UniPC \
             step would have order {order} and diverge (diffusers 0.42.1 returns NaN or fails); set \
             lower_order_final true or final_sigmas_type \"sigma_min\""
        ));
    }
    Ok(Solver { order: order as usize, kind, final_sigmas })
}
