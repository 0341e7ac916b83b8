//! The schedulers against diffusers 0.42.1 (`fixtures/schedulers/make_scheduler_fixtures.py`):
//! five configs (epsilon/leading/offset 1, v-prediction/trailing, linear betas/linspace with
//! clip_sample, and the files SD 1.5 and SD 2.1 ship, which name no timestep spacing), each read
//! by every class with that class's defaults, with DDIM and Euler timesteps, 7-step sampling
//! loops driven by the stand-in model `tanh(x) * 0.7 + 0.1 x`, a stochastic DDIM step with given
//! noise, and DDPM's training quantities. Samples within 1e-4; SNR values relatively within 1e-4.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use diffusion::scheduler::{
    DdimScheduler, DdpmScheduler, EulerDiscreteScheduler, PredictionType, Scheduler, SchedulerClass, SchedulerConfig,
    TimestepSpacing,
};
use tch::{Device, Kind, Tensor};

const CONFIGS: [&str; 5] = ["eps_leading", "v_trailing", "linear_linspace", "sd15_pndm", "sd21_ddim"];
const STEPS: usize = 7;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/schedulers")
}

fn reference() -> HashMap<String, Tensor> {
    Tensor::read_safetensors(fixtures().join("reference.safetensors")).unwrap().into_iter().collect()
}

fn config(name: &str, class: SchedulerClass) -> SchedulerConfig {
    SchedulerConfig::from_file(&fixtures().join(name).join("scheduler_config.json"), class).unwrap()
}

fn model(x: &Tensor) -> Tensor {
    x.tanh() * 0.7 + x * 0.1
}

fn max_diff(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.size(), want.size());
    (got.to_kind(Kind::Double) - want.to_kind(Kind::Double)).abs().max().double_value(&[])
}

fn assert_close(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
    let diff = max_diff(got, want);
    assert!(diff <= tol, "{what}: max abs difference {diff} above {tol}");
}

fn assert_rel_close(got: &Tensor, want: &Tensor, tol: f64, what: &str) {
    let (g, w) = (got.to_kind(Kind::Double), want.to_kind(Kind::Double));
    let rel = ((&g - &w).abs() / w.abs().clamp_min(1e-12)).max().double_value(&[]);
    assert!(rel <= tol, "{what}: max relative difference {rel} above {tol}");
}

fn f64s(t: &Tensor) -> Tensor {
    t.to_kind(Kind::Double)
}

#[test]
fn noise_schedules_and_timesteps_match_diffusers() {
    let r = reference();
    for name in CONFIGS {
        let cfg = config(name, SchedulerClass::Ddim);
        let acp = Tensor::from_slice(&cfg.alphas_cumprod());
        assert_close(&acp, &f64s(&r[&format!("{name}.alphas_cumprod")]), 1e-6, &format!("{name} alphas_cumprod"));

        let mut ddim = DdimScheduler::new(cfg.clone());
        ddim.set_timesteps(STEPS).unwrap();
        let want: Vec<i64> = Vec::try_from(&r[&format!("{name}.ddim.timesteps")]).unwrap();
        let want: Vec<f64> = want.into_iter().map(|t| t as f64).collect();
        assert_eq!(ddim.timesteps(), want.as_slice(), "{name} DDIM timesteps");

        let mut euler = EulerDiscreteScheduler::new(config(name, SchedulerClass::EulerDiscrete));
        euler.set_timesteps(STEPS).unwrap();
        let t = Tensor::from_slice(euler.timesteps());
        assert_close(&t, &f64s(&r[&format!("{name}.euler.timesteps")]), 1e-3, &format!("{name} Euler timesteps"));
        let s = Tensor::from_slice(euler.sigmas());
        assert_close(&s, &f64s(&r[&format!("{name}.euler.sigmas")]), 1e-4, &format!("{name} Euler sigmas"));
        let init = r[&format!("{name}.euler.init_noise_sigma")].double_value(&[0]);
        assert!((euler.init_noise_sigma() - init).abs() < 1e-4, "{name} init_noise_sigma {}", euler.init_noise_sigma());
    }
}

#[test]
fn each_class_fills_the_keys_a_file_lacks_with_its_own_defaults() {
    // SD 1.5's and SD 2.1's files name no timestep spacing: DDIM reads `leading`, Euler
    // `linspace`, so SD 1.5's Euler sampling starts from sigma 14.61, not DDIM-spaced 8.4.
    for name in ["sd15_pndm", "sd21_ddim"] {
        assert_eq!(config(name, SchedulerClass::Ddim).timestep_spacing, TimestepSpacing::Leading, "{name}");
        assert_eq!(config(name, SchedulerClass::Ddpm).timestep_spacing, TimestepSpacing::Leading, "{name}");
        assert_eq!(config(name, SchedulerClass::EulerDiscrete).timestep_spacing, TimestepSpacing::Linspace, "{name}");
    }
    let mut euler = EulerDiscreteScheduler::new(config("sd15_pndm", SchedulerClass::EulerDiscrete));
    euler.set_timesteps(50).unwrap();
    assert!((euler.init_noise_sigma() - 14.6146).abs() < 1e-3, "SD 1.5 Euler starts at {}", euler.init_noise_sigma());
    // Keys a file names win over every class's default; absent ones take DDIM's when DDIM reads.
    let sd15 = config("sd15_pndm", SchedulerClass::Ddim);
    assert!(!sd15.set_alpha_to_one && sd15.clip_sample.is_none() && sd15.steps_offset == 1);
    let dir = suite_tests::scratch("diffusion", "sched-defaults");
    let path = dir.join("scheduler_config.json");
    std::fs::write(&path, "{}").unwrap();
    let ddim = SchedulerConfig::from_file(&path, SchedulerClass::Ddim).unwrap();
    assert!(ddim.set_alpha_to_one && ddim.clip_sample == Some(1.0) && ddim.steps_offset == 0);
    let euler = SchedulerConfig::from_file(&path, SchedulerClass::EulerDiscrete).unwrap();
    assert!(!euler.set_alpha_to_one && euler.clip_sample.is_none());
}

#[test]
fn ddim_sampling_matches_diffusers() {
    let r = reference();
    for name in CONFIGS {
        let mut ddim = DdimScheduler::new(config(name, SchedulerClass::Ddim));
        ddim.set_timesteps(STEPS).unwrap();
        let mut x = r["latents"].shallow_clone();
        for i in 0..ddim.timesteps().len() {
            x = ddim.step(&model(&x), i, &x, None).unwrap();
        }
        assert_close(&x, &r[&format!("{name}.ddim.final")], 1e-4, &format!("{name} DDIM 7-step loop"));
        // The loop moved the sample, so the comparison is not vacuous.
        assert!(max_diff(&x, &r["latents"]) > 1e-2);

        let latents = &r["latents"];
        let noise = r["noise"].narrow(0, 0, 1);
        let t = ddim.timesteps()[2] as i64;
        let step = ddim.step_eta(&model(latents), t, latents, 0.5, Some(&noise)).unwrap();
        assert_close(&step.prev_sample, &r[&format!("{name}.ddim.eta")], 1e-4, &format!("{name} DDIM eta 0.5"));
    }
}

#[test]
fn euler_sampling_matches_diffusers() {
    let r = reference();
    for name in CONFIGS {
        let mut euler = EulerDiscreteScheduler::new(config(name, SchedulerClass::EulerDiscrete));
        euler.set_timesteps(STEPS).unwrap();
        let mut x = &r["latents"] * euler.init_noise_sigma();
        for i in 0..euler.timesteps().len() {
            let out = model(&euler.scale_model_input(&x, i).unwrap());
            x = euler.step(&out, i, &x, None).unwrap();
        }
        assert_close(&x, &r[&format!("{name}.euler.final")], 1e-4, &format!("{name} Euler 7-step loop"));
    }
}

#[test]
fn ddpm_training_quantities_match_diffusers() {
    let r = reference();
    let (x0, noise, t) = (&r["x0"], &r["noise"], &r["train_timesteps"]);
    for name in CONFIGS {
        let ddpm = DdpmScheduler::new(config(name, SchedulerClass::Ddpm));
        assert_close(&ddpm.add_noise(x0, noise, t).unwrap(), &r[&format!("{name}.add_noise")], 1e-4, "add_noise");
        let v = ddpm.get_velocity(x0, noise, t).unwrap();
        assert_close(&v, &r[&format!("{name}.velocity")], 1e-4, "get_velocity");
        let target = ddpm.training_target(x0, noise, t).unwrap();
        let want = if ddpm.config().prediction_type == PredictionType::VPrediction { &v } else { noise };
        assert_close(&target, want, 0.0, "training target");
        // diffusers computes 1 - a_t in fp32 (a_0 is within 1e-3 of 1), hence relative 1e-3.
        assert_rel_close(&ddpm.snr(t).unwrap(), &r[&format!("{name}.snr")], 1e-3, "snr");
        let w = ddpm.min_snr_weights(t, 5.0).unwrap();
        assert_rel_close(&w, &r[&format!("{name}.min_snr_weights")], 1e-3, "min-SNR weights");
    }
}

#[test]
fn bad_configs_and_arguments_are_errors() {
    let dir = suite_tests::scratch("diffusion", "sched");
    let path = dir.join("scheduler_config.json");
    for (json, class, key) in [
        (r#"{"beta_schedule": "cosine"}"#, SchedulerClass::Ddim, "beta_schedule"),
        (r#"{"prediction_type": "flow"}"#, SchedulerClass::Ddim, "prediction_type"),
        (r#"{"timestep_spacing": "even"}"#, SchedulerClass::Ddim, "timestep_spacing"),
        // Euler has the key (diffusers' Euler reads Karras sigmas), this crate's Euler not.
        (r#"{"use_karras_sigmas": true}"#, SchedulerClass::EulerDiscrete, "use_karras_sigmas"),
        // serde names the line and column and the expected type, not the key.
        (r#"{"num_train_timesteps": "many"}"#, SchedulerClass::Ddim, "expected i64 at line 1"),
    ] {
        std::fs::write(&path, json).unwrap();
        let err = SchedulerConfig::from_file(&path, class).unwrap_err().to_string();
        assert!(err.contains("scheduler_config.json") && err.contains(key), "{json}: {err}");
    }
    let err =
        SchedulerConfig::from_file(&dir.join("missing.json"), SchedulerClass::EulerDiscrete).unwrap_err().to_string();
    assert!(err.contains("missing.json"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();

    let mut ddim = DdimScheduler::new(config("eps_leading", SchedulerClass::Ddim));
    let x = Tensor::zeros([1, 4, 3, 3], (Kind::Float, Device::Cpu));
    assert!(ddim.step_eta(&x, 10, &x, 0.0, None).unwrap_err().to_string().contains("set_timesteps"));
    assert!(ddim.set_timesteps(0).is_err() && ddim.set_timesteps(1001).is_err());
    ddim.set_timesteps(10).unwrap();
    assert!(ddim.step_eta(&x, 1000, &x, 0.0, None).unwrap_err().to_string().contains("timestep 1000"));
    assert!(ddim.step(&x, 10, &x, None).unwrap_err().to_string().contains("DDIM step 10"));
    let y = Tensor::zeros([1, 4, 3, 2], (Kind::Float, Device::Cpu));
    assert!(ddim.step_eta(&x, 10, &y, 0.0, None).unwrap_err().to_string().contains("shapes"));

    let ddpm = DdpmScheduler::new(config("eps_leading", SchedulerClass::Ddpm));
    let t = Tensor::from_slice(&[3i64, 1000]);
    let z = Tensor::zeros([2, 4], (Kind::Float, Device::Cpu));
    assert!(ddpm.add_noise(&z, &z, &t).unwrap_err().to_string().contains("outside 0..1000"));
    let euler = EulerDiscreteScheduler::new(config("eps_leading", SchedulerClass::EulerDiscrete));
    assert!(euler.scale_model_input(&x, 0).is_err());
}
