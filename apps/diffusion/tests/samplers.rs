//! PNDM, DPM-Solver++ multistep, Euler ancestral and UniPC against diffusers 0.42.1
//! (`fixtures/schedulers/make_scheduler_fixtures.py` writes `samplers.json` and
//! `samplers.safetensors`): each over the five configs of `schedulers.rs` and option variants
//! over some (the variant's keys added to the file, read as diffusers' `from_config` reads it):
//! integer timesteps exactly, Euler ancestral's within 1e-3 (diffusers' are fp32), sigmas and
//! the sample after every step of a loop driven by the stand-in model `tanh(x) * 0.7 + 0.1 x`
//! within 1e-4 (Euler ancestral fed the noise diffusers drew), the multistep history after the
//! loop; each class's keys equal diffusers' `__init__` keys; bad keys and values are named;
//! `--scheduler`'s default is the class the file names.
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use diffusion::sample::Sampler;
use diffusion::scheduler::{
    self, DpmSolverMultistepScheduler, PndmScheduler, Scheduler, SchedulerClass, SchedulerConfig, SchedulerFile,
    UniPcMultistepScheduler,
};
use serde_json::{Map, Value};
use tch::{Device, Kind, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/schedulers")
}

fn reference() -> HashMap<String, Tensor> {
    Tensor::read_safetensors(fixtures().join("samplers.safetensors")).unwrap().into_iter().collect()
}

fn manifest() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("samplers.json")).unwrap()).unwrap()
}

fn model(x: &Tensor) -> Tensor {
    x.tanh() * 0.7 + x * 0.1
}

fn max_diff(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.size(), want.size());
    (got.to_kind(Kind::Double) - want.to_kind(Kind::Double)).abs().max().double_value(&[])
}

fn f64s(t: &Tensor) -> Vec<f64> {
    Vec::try_from(t.to_kind(Kind::Double).flatten(0, -1)).unwrap()
}

/// The fixture config `name` with `keys` added, as a file at its path.
fn file_with(name: &str, keys: &Map<String, Value>) -> SchedulerFile {
    let path = fixtures().join(name).join("scheduler_config.json");
    let mut json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    json.as_object_mut().unwrap().extend(keys.clone());
    SchedulerFile::parse(&path, &json.to_string()).unwrap()
}

/// Runs every step from the fixture latents; the sample after each.
fn run(s: &mut dyn Scheduler, steps: usize, noise: &Tensor) -> Vec<Tensor> {
    s.set_timesteps(steps).unwrap();
    let mut x = reference()["latents"].shallow_clone() * s.init_noise_sigma();
    let mut states = Vec::new();
    for i in 0..s.timesteps().len() {
        let out = model(&s.scale_model_input(&x, i).unwrap());
        let z = s.needs_noise().then(|| noise.get(i as i64));
        x = s.step(&out, i, &x, z.as_ref()).unwrap();
        states.push(x.shallow_clone());
    }
    states
}

/// Checks one variant on one config; the largest difference of a sample from diffusers'.
fn check(r: &HashMap<String, Tensor>, variant: &Value, name: &str) -> f64 {
    let class = SchedulerClass::from_class_name(variant["class_name"].as_str().unwrap()).unwrap();
    let key = format!("{name}.{}", variant["name"].as_str().unwrap());
    let cfg = file_with(name, variant["keys"].as_object().unwrap()).config(class).unwrap();
    let mut s = scheduler::build(cfg).unwrap();
    let steps = variant["steps"].as_u64().unwrap() as usize;
    let states = run(s.as_mut(), steps, &r["euler_a.noise"]);
    let want_t = f64s(&r[&format!("{key}.timesteps")]);
    if class == SchedulerClass::EulerAncestralDiscrete {
        let d = want_t.iter().zip(s.timesteps()).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(s.timesteps().len() == want_t.len() && d < 1e-3, "{key} timesteps {:?} vs {want_t:?}", s.timesteps());
        let init = r[&format!("{key}.init_noise_sigma")].double_value(&[0]);
        assert!((s.init_noise_sigma() - init).abs() < 1e-4, "{key} init_noise_sigma {}", s.init_noise_sigma());
    } else {
        assert_eq!(s.timesteps(), want_t.as_slice(), "{key} timesteps");
        assert_eq!(s.init_noise_sigma(), 1.0);
    }
    if let Some(want) = r.get(&format!("{key}.sigmas")) {
        let d = max_diff(&Tensor::from_slice(s.sigmas()), want);
        assert!(d < 1e-4, "{key} sigmas {:?} vs {want}: {d}", s.sigmas());
    }
    let want = &r[&format!("{key}.states")];
    assert_eq!(want.size()[0] as usize, states.len(), "{key} steps");
    let mut worst: f64 = 0.0;
    for (i, x) in states.iter().enumerate() {
        let d = max_diff(x, &want.get(i as i64));
        assert!(d <= 1e-4, "{key} step {i}: max abs difference {d}");
        worst = worst.max(d);
    }
    // The loop moved the sample, so the comparison is not vacuous.
    assert!(max_diff(&states[states.len() - 1], &r["latents"]) > 1e-2, "{key}");
    worst
}

#[test]
fn samplers_match_diffusers_step_by_step() {
    let r = reference();
    let mut worst: BTreeMap<String, f64> = BTreeMap::new();
    let mut checked = 0;
    for variant in manifest()["variants"].as_array().unwrap() {
        for name in variant["configs"].as_array().unwrap() {
            let d = check(&r, variant, name.as_str().unwrap());
            let w = worst.entry(variant["name"].as_str().unwrap().to_string()).or_default();
            *w = w.max(d);
            checked += 1;
        }
    }
    assert!(checked >= 50, "{checked} variant runs");
    eprintln!("max abs difference from diffusers per variant: {worst:?}");
}

#[test]
fn multistep_history_matches_diffusers() {
    let r = reference();
    let file = file_with("eps_leading", &Map::new());
    let noise = &r["euler_a.noise"];
    let mut dpm = DpmSolverMultistepScheduler::new(file.config(SchedulerClass::DpmSolverMultistep).unwrap());
    run(&mut dpm, 7, noise);
    let d = max_diff(&Tensor::stack(dpm.model_outputs(), 0), &r["eps_leading.dpm.model_outputs"]);
    assert!(d < 1e-4, "DPM-Solver++ model outputs: {d}");

    let mut unipc = UniPcMultistepScheduler::new(file.config(SchedulerClass::UniPcMultistep).unwrap());
    run(&mut unipc, 7, noise);
    let d = max_diff(&Tensor::stack(unipc.model_outputs(), 0), &r["eps_leading.unipc.model_outputs"]);
    assert!(d < 1e-4, "UniPC model outputs: {d}");
    let d = max_diff(unipc.last_sample().unwrap(), &r["eps_leading.unipc.last_sample"]);
    assert!(d < 1e-4, "UniPC last sample: {d}");

    let mut pndm = PndmScheduler::new(file.config(SchedulerClass::Pndm).unwrap());
    run(&mut pndm, 7, noise);
    let d = max_diff(&Tensor::stack(pndm.ets(), 0), &r["eps_leading.pndm.ets"]);
    assert!(d < 1e-4, "PNDM ets: {d}");

    // set_timesteps starts over: the same run again gives the same samples.
    let (a, b) = (run(&mut unipc, 7, noise), run(&mut unipc, 7, noise));
    assert!(a.iter().zip(&b).all(|(a, b)| a.equal(b)));
}

#[test]
fn each_class_reads_the_keys_diffusers_defines() {
    let keys = manifest()["class_keys"].as_object().unwrap().clone();
    assert_eq!(keys.len(), SchedulerClass::ALL.len());
    for (name, want) in keys {
        let class = SchedulerClass::from_class_name(&name).unwrap();
        let mut want: Vec<&str> = want.as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
        let mut got = class.keys();
        want.sort();
        got.sort();
        assert_eq!(got, want, "{name}");
    }
}

fn config_of(json: &str, class: SchedulerClass) -> Result<SchedulerConfig, String> {
    let path = Path::new("dir/scheduler_config.json");
    SchedulerFile::parse(path, json).and_then(|f| f.config(class)).map_err(|e| e.to_string())
}

#[test]
fn bad_keys_and_values_are_named() {
    use SchedulerClass::*;
    for (class, json, key) in [
        (Pndm, r#"{"prediction_type": "sample"}"#, "prediction_type"),
        (Ddim, r#"{"steps_offset": 5000}"#, "steps_offset 5000 is outside 0..1000"),
        // Karras sigmas from these would be NaN: a black image.
        (DpmSolverMultistep, r#"{"use_karras_sigmas": true, "sigma_max": -1.0}"#, "sigma_max is -1"),
        (DpmSolverMultistep, r#"{"sigma_min": 2.0, "sigma_max": 1.0}"#, "sigma_min 2 is not below sigma_max 1"),
        (EulerAncestralDiscrete, r#"{"prediction_type": "sample"}"#, "prediction_type"),
        (EulerAncestralDiscrete, r#"{"rescale_betas_zero_snr": true}"#, "rescale_betas_zero_snr"),
        (DpmSolverMultistep, r#"{"algorithm_type": "sde-dpmsolver++"}"#, "algorithm_type"),
        (DpmSolverMultistep, r#"{"algorithm_type": "dpmsolver", "final_sigmas_type": "sigma_min"}"#, "algorithm_type"),
        (DpmSolverMultistep, r#"{"algorithm_type": "deis"}"#, "final_sigmas_type"),
        (DpmSolverMultistep, r#"{"solver_order": 4}"#, "solver_order"),
        (DpmSolverMultistep, r#"{"solver_type": "rk4"}"#, "solver_type"),
        (DpmSolverMultistep, r#"{"final_sigmas_type": "sigma_max"}"#, "final_sigmas_type"),
        (DpmSolverMultistep, r#"{"thresholding": true}"#, "thresholding"),
        (DpmSolverMultistep, r#"{"use_lu_lambdas": true}"#, "use_lu_lambdas"),
        (DpmSolverMultistep, r#"{"use_exponential_sigmas": true}"#, "use_exponential_sigmas"),
        (DpmSolverMultistep, r#"{"use_beta_sigmas": true}"#, "use_beta_sigmas"),
        (DpmSolverMultistep, r#"{"use_dynamic_shifting": true}"#, "use_dynamic_shifting"),
        (DpmSolverMultistep, r#"{"variance_type": "learned_range"}"#, "variance_type"),
        (UniPcMultistep, r#"{"solver_order": 0}"#, "solver_order"),
        (UniPcMultistep, r#"{"solver_type": "heun2"}"#, "solver_type"),
        (UniPcMultistep, r#"{"use_flow_sigmas": true}"#, "use_flow_sigmas"),
        (UniPcMultistep, r#"{"solver_p": {"_class_name": "DDIMScheduler"}}"#, "solver_p"),
        (UniPcMultistep, r#"{"shift_terminal": 0.5}"#, "shift_terminal"),
        (UniPcMultistep, r#"{"lower_order_final": false}"#, "lower_order_final"),
        // Strings are not numbers: only bare Infinity is read as one.
        (DpmSolverMultistep, r#"{"lambda_min_clipped": "-Infinity!"}"#, "expected a number"),
        // serde names the line, column and expected type, not the key.
        (UniPcMultistep, r#"{"disable_corrector": [0.5]}"#, "expected i64 at line 1"),
    ] {
        let err = config_of(json, class).unwrap_err();
        assert!(err.contains("scheduler_config.json") && err.contains(key), "{class} {json}: {err}");
    }
    // A key the class lacks is ignored, as diffusers' from_config ignores it.
    for (class, json) in [
        (Ddim, r#"{"use_karras_sigmas": true, "solver_order": 9}"#),
        (Pndm, r#"{"thresholding": true, "rescale_betas_zero_snr": true}"#),
        (EulerAncestralDiscrete, r#"{"use_karras_sigmas": true, "thresholding": true}"#),
    ] {
        config_of(json, class).unwrap_or_else(|e| panic!("{class} {json}: {e}"));
    }
    // Python's json writes DPM-Solver's default clip as a bare -Infinity; a string keeps its text.
    let json = r#"{"lambda_min_clipped": -Infinity, "solver_type": "-Infinity", "_class_name": "NaN"}"#;
    let err = config_of(json, DpmSolverMultistep).unwrap_err();
    assert!(err.contains("solver_type \"-Infinity\""), "{err}");
    let cfg = config_of(r#"{"lambda_min_clipped": -Infinity}"#, DpmSolverMultistep).unwrap();
    assert_eq!(cfg.lambda_min_clipped, f64::NEG_INFINITY);
}

#[test]
fn steps_out_of_order_or_without_noise_are_errors() {
    let file = file_with("sd15_pndm", &Map::new());
    let x = Tensor::zeros([1, 4, 2, 2], (Kind::Float, Device::Cpu));
    for class in [SchedulerClass::DpmSolverMultistep, SchedulerClass::UniPcMultistep, SchedulerClass::Pndm] {
        let mut s = scheduler::build(file.config(class).unwrap()).unwrap();
        let err = s.step(&x, 0, &x, None).unwrap_err().to_string();
        assert!(err.contains("before set_timesteps"), "{class}: {err}");
        s.set_timesteps(5).unwrap();
        let err = s.step(&x, 1, &x, None).unwrap_err().to_string();
        assert!(err.contains("step 1") && err.contains("next of"), "{class}: {err}");
    }
    let mut a = scheduler::build(file.config(SchedulerClass::EulerAncestralDiscrete).unwrap()).unwrap();
    a.set_timesteps(5).unwrap();
    assert!(a.step(&x, 0, &x, None).unwrap_err().to_string().contains("needs noise"));
    let mut prk =
        scheduler::build(file_with("eps_leading", &Map::new()).config(SchedulerClass::Pndm).unwrap()).unwrap();
    let err = prk.set_timesteps(3).unwrap_err().to_string();
    assert!(err.contains("at least 4 steps") && err.contains("skip_prk_steps"), "{err}");
    let ddpm = file.config(SchedulerClass::Ddpm).unwrap();
    assert!(scheduler::build(ddpm).err().unwrap().to_string().contains("DDPMScheduler"));
}

#[test]
fn the_default_sampler_is_the_class_the_file_names() {
    let default = |name: &str| Sampler::default_for(&file_with(name, &Map::new()));
    assert_eq!(default("sd15_pndm").unwrap(), Sampler::Pndm);
    assert_eq!(default("sd21_ddim").unwrap(), Sampler::Ddim);
    for (class, sampler) in [
        ("EulerAncestralDiscreteScheduler", Sampler::EulerAncestral),
        ("DPMSolverMultistepScheduler", Sampler::DpmSolver),
        ("UniPCMultistepScheduler", Sampler::UniPc),
        ("EulerDiscreteScheduler", Sampler::Euler),
    ] {
        let file = SchedulerFile::parse(Path::new("s.json"), &format!(r#"{{"_class_name": "{class}"}}"#)).unwrap();
        assert_eq!(Sampler::default_for(&file).unwrap(), sampler);
        assert_eq!(sampler.class().class_name(), class);
    }
    for (json, words) in [
        (r#"{"_class_name": "LMSDiscreteScheduler"}"#, ["LMSDiscreteScheduler", "not a scheduler class"]),
        (r#"{"_class_name": "DDPMScheduler"}"#, ["DDPMScheduler", "--scheduler"]),
        (r#"{}"#, ["no _class_name", "config.json"]),
    ] {
        let file = SchedulerFile::parse(Path::new("pipe/scheduler/scheduler_config.json"), json).unwrap();
        let err = Sampler::default_for(&file).unwrap_err().to_string();
        assert!(err.contains("pipe/scheduler/scheduler_config.json"), "{err}");
        assert!(words.iter().all(|w| err.contains(w)), "{json}: {err}");
    }
}

#[test]
fn leading_timesteps_past_the_training_range_name_steps_offset() {
    // SD 1.5's schedule (steps_offset 1, leading): 1000 steps would start at timestep 1000.
    let cfg = config_of(r#"{"steps_offset": 1, "timestep_spacing": "leading"}"#, SchedulerClass::Ddim).unwrap();
    let err = cfg.spaced_timesteps(1000, true).unwrap_err().to_string();
    assert!(err.contains("steps_offset 1") && err.contains("timestep 1000"), "{err}");
    assert_eq!(cfg.spaced_timesteps(999, true).unwrap()[0], 999.0);
}
