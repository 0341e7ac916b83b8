//! The optimizers replay trajectories recorded from independent implementations
//! (torch.optim.AdamW, timm's Lamb and Lars; tests/fixtures/make_optim_fixtures.py) and must
//! land on the same parameters after every step (fp32, within 1e-6 relative + 1e-7 absolute),
//! also across a save and load of their state halfway.
use std::collections::BTreeMap;

use engine::optim::{AdamW, AdamWConfig, Lamb, LambConfig, Lars, LarsConfig, Optimizer, Param};
use serde_json::Value;
use tch::{Kind, Tensor};

type Values = BTreeMap<String, Vec<f32>>;

struct Fixture {
    shapes: BTreeMap<String, Vec<i64>>,
    init: Values,
    grads: Vec<Values>,
    configs: Value,
    after_step: BTreeMap<String, Vec<Values>>,
}

fn load() -> Fixture {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/optim.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let values = |v: &Value| -> Values {
        v.as_object()
            .unwrap()
            .iter()
            .map(|(k, xs)| (k.clone(), xs.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()))
            .collect()
    };
    Fixture {
        shapes: v["shapes"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, s)| (k.clone(), s.as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect()))
            .collect(),
        init: values(&v["init"]),
        grads: v["grads"].as_array().unwrap().iter().map(values).collect(),
        configs: v["configs"].clone(),
        after_step: v["after_step"]
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, steps)| (k.clone(), steps.as_array().unwrap().iter().map(values).collect()))
            .collect(),
    }
}

fn tensor(values: &[f32], shape: &[i64]) -> Tensor {
    Tensor::from_slice(values).reshape(shape)
}

/// Parameters from the fixture. The fixture decays "z", a vector, so it is marked adapted
/// explicitly; "b" keeps the default rule for a bias (not adapted).
fn params(f: &Fixture) -> Vec<Param> {
    f.init
        .iter()
        .map(|(k, v)| {
            let p = Param::new(k, &tensor(v, &f.shapes[k]).set_requires_grad(true));
            if k == "z" {
                p.with_adapt(true)
            } else {
                p
            }
        })
        .collect()
}

/// Replays the fixture's steps; halfway, the optimizer is replaced by a fresh one loaded from
/// its checkpointed state, which must continue the same trajectory.
fn replay<O: Optimizer>(f: &Fixture, name: &str, make: impl Fn(Vec<Param>) -> O) {
    let mut opt = make(params(f));
    let adapt: Vec<_> = opt.params().iter().map(|p| (p.name.clone(), p.adapt)).collect();
    assert_eq!(adapt, [("b".to_string(), false), ("w".to_string(), true), ("z".to_string(), true)]);
    for (step, (grads, want)) in f.grads.iter().zip(&f.after_step[name]).enumerate() {
        if step == f.grads.len() / 2 {
            let mut state: engine::optim::StateDict = opt.state().into_iter().map(|(k, t)| (k, t.copy())).collect();
            assert!(!state.is_empty(), "{name} has state after {step} steps");
            // A checkpoint whose slots hold integers (a damaged or foreign file) is refused.
            let mut ints: engine::optim::StateDict = state
                .iter()
                .map(|(k, t)| (k.clone(), if t.dim() > 0 { t.to_kind(Kind::Int64) } else { t.shallow_clone() }))
                .collect();
            let fresh = make(opt.params().iter().map(|p| p.shallow_copy()).collect()).load_state(&mut ints);
            let err = fresh.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains("holds Int64 values, expected floating point"), "{name}: {err}");
            let same = opt.params().iter().map(|p| p.shallow_copy());
            opt = make(same.collect());
            opt.load_state(&mut state).unwrap();
            assert!(state.is_empty(), "{name}: unused state entries {:?}", state.keys().collect::<Vec<_>>());
        }
        opt.zero_grad();
        // Backward of <p, g> leaves exactly g in p.grad.
        for p in opt.params() {
            let g = tensor(&grads[&p.name], &f.shapes[&p.name]);
            (&p.tensor * g).sum(Kind::Float).backward();
        }
        opt.step().unwrap();
        for p in opt.params() {
            let expected = tensor(&want[&p.name], &f.shapes[&p.name]);
            let diff = (&p.tensor - &expected).abs();
            let worst = (&diff - (expected.abs() * 1e-6 + 1e-7)).max().double_value(&[]);
            let max = diff.max().double_value(&[]);
            assert!(worst <= 0.0, "{name}, step {step}, parameter {}: max difference {max:e}", p.name);
        }
    }
}

#[test]
fn biases_and_vectors_are_not_adapted_by_default() {
    let w = Tensor::zeros([2, 2], (Kind::Float, tch::Device::Cpu));
    let b = Tensor::zeros([2], (Kind::Float, tch::Device::Cpu));
    assert!(Param::new("w", &w).adapt && !Param::new("b", &b).adapt);
}

/// A number of the fixture's optimizer configuration.
fn num(config: &Value, key: &str) -> f64 {
    config[key].as_f64().unwrap_or_else(|| panic!("fixture config has no number {key}"))
}

fn betas(config: &Value) -> (f64, f64) {
    (config["betas"][0].as_f64().unwrap(), config["betas"][1].as_f64().unwrap())
}

#[test]
fn adamw_matches_torch_optim() {
    let f = load();
    let c = &f.configs["adamw"];
    let cfg =
        AdamWConfig { lr: num(c, "lr"), betas: betas(c), eps: num(c, "eps"), weight_decay: num(c, "weight_decay") };
    replay(&f, "adamw", |ps| AdamW::new(ps, cfg));
}

#[test]
fn lamb_matches_timm() {
    let f = load();
    let c = &f.configs["lamb"];
    let cfg =
        LambConfig { lr: num(c, "lr"), betas: betas(c), eps: num(c, "eps"), weight_decay: num(c, "weight_decay") };
    replay(&f, "lamb", |ps| Lamb::new(ps, cfg));
}

#[test]
fn lars_matches_timm() {
    let f = load();
    let c = &f.configs["lars"];
    let cfg = LarsConfig {
        lr: num(c, "lr"),
        momentum: num(c, "momentum"),
        weight_decay: num(c, "weight_decay"),
        trust_coefficient: num(c, "trust_coeff"),
        eps: num(c, "eps"),
    };
    replay(&f, "lars", |ps| Lars::new(ps, cfg));
}
