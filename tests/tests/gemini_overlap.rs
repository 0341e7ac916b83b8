//! Gemini's host optimizer overlapped with backward (`engine/src/gemini/early.rs`) gives the
//! same weights, bit for bit, as the serial step: each host chunk taken up during a planned
//! backward runs the arithmetic the step would have run on it, in the same order within the
//! chunk, and chunks do not share state. Checked over 10 steps of the small transformer with
//! host homes under a budget that evicts every step: stepping during backward (no loss scale,
//! no norm; AdamW, LAMB and LARS), and reading the norm during backward under fp16-style loss
//! scaling and clipping (AdamW's fused pass applies both factors), with the norms equal too and
//! the learning rate changed after each backward, while the tasks hold the optimizers. And bf16
//! payloads loaded from the upload copies the optimizer's pass writes beside the homes train as
//! loads converting the fp32 homes do, bit for bit, and a shadow swapped in (stale copies) is
//! what the model runs with.
use std::collections::HashMap;

use engine::gemini::{Gemini, Placement, StepPlan};
use engine::optim::LossScaler;
use suite_tests::gemini_model::*;
use tch::{Device, Kind, Tensor};

/// How a run treats the gradients before each update.
#[derive(Clone, Copy, Debug)]
struct Treatment {
    loss_scale: Option<f64>,
    clip: Option<f64>,
    /// Set a different learning rate each step, after backward, as a schedule does.
    schedule: bool,
}

/// Trains `STEPS` steps with host homes under a tight budget; `overlap` plans each step before
/// its backward. Returns the weights, the norms, and how many chunks each step took up early.
fn train(rule: Rule, treatment: Treatment, overlap: bool) -> (Vec<Tensor>, Vec<Option<f64>>, Vec<usize>) {
    let ps = parameters();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    let cfg = config(Device::Cpu, TIGHT, Placement::Static { offload: 1.0 }, rule, Kind::Float);
    let g = Gemini::new(&ps, cfg).unwrap();
    let scaler = treatment.loss_scale.map(|scale| {
        let mut s = LossScaler::default();
        s.scale = scale;
        s
    });
    let plan = StepPlan { loss_scale: treatment.loss_scale, norm: treatment.clip.is_some() };
    let (mut norms, mut early) = (vec![], vec![]);
    for step in 0..STEPS {
        if overlap {
            g.plan_step(plan).unwrap();
        }
        let l = gemini_loss(&g, &tensors, Kind::Float, step);
        match &scaler {
            Some(s) => s.scale_loss(&l).unwrap().backward(),
            None => l.backward(),
        }
        g.finish_backward().unwrap();
        if treatment.schedule {
            // Set after backward, while the chunks' tasks may hold their optimizers.
            g.optimizer().unwrap().set_lr(ADAMW.lr * (1.0 + 0.1 * step as f64));
        }
        let norm = match (&scaler, treatment.clip) {
            (None, None) => None,
            (s, clip) => g.unscale_and_clip(s.as_ref(), clip).unwrap(),
        };
        g.step().unwrap();
        norms.push(norm);
        early.push(g.optimizer().unwrap().early_chunks());
    }
    let state: HashMap<String, Tensor> = g.state_dict().unwrap().into_iter().collect();
    (parameters().iter().map(|p| state[&p.name].shallow_clone()).collect(), norms, early)
}

fn assert_bitwise(a: &[Tensor], b: &[Tensor], what: &str) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let (x, y) = (Vec::<f32>::try_from(x.flatten(0, -1)).unwrap(), Vec::<f32>::try_from(y.flatten(0, -1)).unwrap());
        let differ = x.iter().zip(&y).filter(|(p, q)| p.to_bits() != q.to_bits()).count();
        assert_eq!(differ, 0, "{what}: parameter {i} differs in {differ} of {} elements", x.len());
    }
}

#[test]
fn stepping_during_backward_equals_the_serial_step() {
    let treatment = Treatment { loss_scale: None, clip: None, schedule: false };
    for rule in [Rule::AdamW, Rule::Lamb, Rule::Lars] {
        let (serial, _, none) = train(rule, treatment, false);
        let (overlapped, _, early) = train(rule, treatment, true);
        assert!(none.iter().all(|&n| n == 0), "{rule:?}: no chunk is taken up without a plan: {none:?}");
        // The first step records the trace and places the homes: nothing is taken up early.
        assert_eq!(early[0], 0, "{rule:?}: {early:?}");
        assert!(early[1..].iter().all(|&n| n >= 5), "{rule:?}: chunks stepped during backward: {early:?}");
        assert_bitwise(&overlapped, &serial, &format!("{rule:?}, stepped during backward"));
        // And both are plain training.
        assert_same(&overlapped, &train_plain(rule, PLAIN), &format!("{rule:?} against plain training"));
    }
}

#[test]
fn norms_during_backward_with_unscaling_and_clipping_equal_the_serial_step() {
    for treatment in [
        Treatment { loss_scale: Some(1024.0), clip: Some(0.5), schedule: true },
        Treatment { loss_scale: None, clip: Some(0.5), schedule: true },
    ] {
        let (serial, serial_norms, _) = train(Rule::AdamW, treatment, false);
        let (overlapped, norms, early) = train(Rule::AdamW, treatment, true);
        assert!(early[1..].iter().all(|&n| n >= 5), "{treatment:?}: chunks read during backward: {early:?}");
        let bits = |n: &[Option<f64>]| n.iter().map(|n| n.map(f64::to_bits)).collect::<Vec<_>>();
        assert_eq!(bits(&norms), bits(&serial_norms), "{treatment:?}: the norms");
        assert!(norms.iter().all(|n| n.is_some_and(|n| n > 0.5)), "every step clips: {norms:?}");
        assert_bitwise(&overlapped, &serial, &format!("{treatment:?}"));
    }
    // Unscaled and clipped in the fused pass, the weights are clipped plain training's.
    let recipe = Recipe { clip: Some(0.5), micro_batches: 1 };
    let treatment = Treatment { loss_scale: Some(1024.0), clip: Some(0.5), schedule: false };
    let (overlapped, ..) = train(Rule::AdamW, treatment, true);
    assert_same(&overlapped, &train_plain(Rule::AdamW, recipe), "loss-scaled and clipped against plain training");
}

#[test]
fn a_step_planned_without_a_norm_refuses_one_after_chunks_stepped() {
    let ps = parameters();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    let cfg = config(Device::Cpu, TIGHT, Placement::Static { offload: 1.0 }, Rule::AdamW, Kind::Float);
    let g = Gemini::new(&ps, cfg).unwrap();
    for step in 0..2 {
        g.plan_step(StepPlan { loss_scale: None, norm: false }).unwrap();
        gemini_loss(&g, &tensors, Kind::Float, step).backward();
        g.finish_backward().unwrap();
        if step == 1 {
            let err = g.clip_grad_norm(1.0).unwrap_err().to_string();
            assert!(
                err.contains("planned without unscaling or a norm") && err.contains("stepped during backward"),
                "{err}"
            );
        }
        g.step().unwrap();
    }
}

/// Trains `STEPS` steps in bf16 with host homes under a tight budget, loads filled from the
/// upload copies the optimizer writes in its pass; `stale` swaps a shadow in and out after each
/// step (the same weights back, bit for bit), which leaves every upload copy stale, so loads
/// convert the fp32 homes instead. `overlap` plans each step (chunks step during backward).
fn train_bf16(stale: bool, overlap: bool) -> Vec<Tensor> {
    let kind = Kind::BFloat16;
    let ps = parameters();
    let cfg = config(Device::Cpu, TIGHT, Placement::Static { offload: 1.0 }, Rule::AdamW, kind);
    let g = Gemini::new(&ps, cfg).unwrap();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    for step in 0..STEPS {
        if overlap {
            g.plan_step(StepPlan { loss_scale: None, norm: false }).unwrap();
        }
        gemini_loss(&g, &tensors, kind, step).backward();
        g.finish_backward().unwrap();
        g.step().unwrap();
        if stale {
            let shadow = g.home_shards().unwrap();
            g.swap_homes(&shadow).unwrap();
            g.swap_homes(&shadow).unwrap();
        }
    }
    let state: HashMap<String, Tensor> = g.state_dict().unwrap().into_iter().collect();
    parameters().iter().map(|p| state[&p.name].shallow_clone()).collect()
}

#[test]
fn bf16_loads_from_the_upload_copies_equal_loads_converting_the_homes() {
    let converted = train_bf16(true, false);
    assert_bitwise(&train_bf16(false, false), &converted, "bf16, loads from the upload copies");
    assert_bitwise(&train_bf16(false, true), &converted, "bf16, upload copies written during backward");
}

#[test]
fn a_shadow_swapped_in_is_what_the_model_runs_with() {
    // After a swap the upload copies hold the weights swapped out: the next loads must read the
    // homes (the shadow), or the model would run with the old weights.
    let kind = Kind::BFloat16;
    let ps = parameters();
    let cfg = config(Device::Cpu, TIGHT, Placement::Static { offload: 1.0 }, Rule::AdamW, kind);
    let g = Gemini::new(&ps, cfg).unwrap();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    let run = |step: i64| gemini_loss(&g, &tensors, kind, step);
    let mut losses = vec![];
    let mut shadow = vec![];
    for step in 0..3 {
        let l = run(step);
        losses.push(l.double_value(&[]));
        l.backward();
        g.finish_backward().unwrap();
        g.step().unwrap();
        if step == 0 {
            // The weights after the first step.
            shadow = g.home_shards().unwrap();
        }
    }
    // Swapped in, the first step's weights give step 1's loss again.
    g.swap_homes(&shadow).unwrap();
    let again = tch::no_grad(|| run(1)).double_value(&[]);
    assert_eq!(again.to_bits(), losses[1].to_bits(), "loss {again} with the shadow's weights, {} expected", losses[1]);
}
