//! Gemini's step leaves the chunks' gradient accumulators as they are (no clearing pass): the
//! first gradient a parameter gets after a step overwrites its spent one, and the end of each
//! backward zeroes the parts no gradient reached (`engine/src/gemini/manager/gradients.rs`).
//! These runs match plain training that clears its gradients (the engine's tensor optimizers,
//! `zero_grad` after each step) only if nothing reads a spent gradient: the second block is
//! skipped by the data in every micro-batch of some steps and in one of two micro-batches of
//! others (its parameters step as AdamW does with a zero gradient, or accumulate over the
//! micro-batches that ran it); the clipping norm, read at the step or during a planned backward,
//! equals plain training's; after a step skipped for an overflow (its gradients inf), a step
//! that skips the block reads zeros there; and the same over 2 ranks, replicated and ZeRO-3
//! sharded (chunks no rank's data reached are not reduced at all).
use std::collections::HashMap;

use engine::dist::ProcessGroup;
use engine::gemini::{Gemini, GeminiConfig, Placement, Replication, StepPlan};
use engine::optim::{clip_grad_norm, LossScaler};
use suite_tests::dist_test;
use suite_tests::gemini_model::*;
use tch::{Device, Kind, Tensor};

/// Whether micro-batch `mb` of `mbs` in step `step` runs the second block: steps 0, 4, 8 in
/// every micro-batch, steps 1, 5, 9 in none, steps 2, 6 in the first only, steps 3, 7 in the
/// last only (with one micro-batch: every step but 1, 5, 9).
fn second(step: i64, mb: i64, mbs: i64) -> bool {
    match step % 4 {
        0 => true,
        1 => false,
        2 => mb == 0,
        _ => mb == mbs - 1,
    }
}

/// How a run treats its gradients.
#[derive(Clone, Copy, Debug)]
struct Run {
    micro_batches: i64,
    clip: Option<f64>,
    /// Loss scale (unscaled before clipping and stepping, as under fp16).
    scale: Option<f64>,
    /// A step whose scaled loss overflows (its gradients are inf): skipped.
    overflow: Option<i64>,
    /// Gemini plans each step before its last backward (`early.rs`).
    plan: bool,
}

impl Run {
    /// The factor step `step`'s losses are multiplied by before backward.
    fn factor(&self, step: i64) -> f64 {
        match self.overflow == Some(step) {
            true => f64::INFINITY,
            false => self.scale.unwrap_or(1.0) / self.micro_batches as f64,
        }
    }

    /// Rows of this rank's micro-batch `mb` when the batch is split over `ranks`.
    fn rows(&self, rank: i64, ranks: i64, mb: i64) -> std::ops::Range<i64> {
        let per = BATCH / ranks / self.micro_batches;
        let first = rank * BATCH / ranks + mb * per;
        first..first + per
    }
}

/// Plain training of the whole batch as `ranks` ranks split it (each rank's micro-batches
/// weighted as the group's average weighs them). Returns the weights and each step's norm
/// (None: skipped).
fn plain(rule: Rule, run: Run, ranks: i64) -> (Vec<Tensor>, Vec<Option<f64>>) {
    let ps = parameters();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    let mut opt = tensor_optimizer(rule, ps);
    let mut norms = vec![];
    for step in 0..STEPS {
        for rank in 0..ranks {
            for mb in 0..run.micro_batches {
                let l = branch_loss(
                    step,
                    run.rows(rank, ranks, mb),
                    second(step, mb, run.micro_batches),
                    &|range, x, f| f(x, &tensors[range]),
                );
                (l * (run.factor(step) / ranks as f64)).backward();
            }
        }
        if let Some(scale) = run.scale {
            let mut scaler = LossScaler::default();
            scaler.scale = scale;
            if !scaler.unscale(opt.params(), None).unwrap() {
                opt.zero_grad();
                norms.push(None);
                continue;
            }
        }
        norms.push(run.clip.map(|max| clip_grad_norm(opt.params(), max, None).unwrap()));
        opt.step().unwrap();
        opt.zero_grad();
    }
    (opt.params().iter().map(|p| p.tensor.detach().copy()).collect(), norms)
}

/// The same under Gemini, this rank's share of each batch: host homes under a budget that
/// evicts every step alone, half of them offloaded over a group.
fn gemini(rule: Rule, run: Run, group: Option<(ProcessGroup, bool)>) -> (Vec<Tensor>, Vec<Option<f64>>) {
    let ps = parameters();
    let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
    let (rank, ranks) = group.as_ref().map_or((0, 1), |(g, _)| (g.rank() as i64, g.size() as i64));
    let (budget, placement) = match group {
        None => (TIGHT, Placement::Static { offload: 1.0 }),
        Some(_) => (1 << 20, Placement::Static { offload: 0.5 }),
    };
    let replication = group.map(|(group, shard)| Replication { group, shard });
    let g = Gemini::new(&ps, GeminiConfig { replication, ..config(Device::Cpu, budget, placement, rule, Kind::Float) })
        .unwrap();
    let scaler = run.scale.map(|scale| {
        let mut s = LossScaler::default();
        s.scale = scale;
        s
    });
    let mut norms = vec![];
    for step in 0..STEPS {
        for mb in 0..run.micro_batches {
            if run.plan && mb == run.micro_batches - 1 {
                g.plan_step(StepPlan { loss_scale: run.scale, norm: run.clip.is_some() }).unwrap();
            }
            let l =
                branch_loss(step, run.rows(rank, ranks, mb), second(step, mb, run.micro_batches), &|range, x, f| {
                    let params: Vec<usize> = range.clone().collect();
                    g.run(&params, x, |x| f(x, &tensors[range])).unwrap()
                });
            (l * run.factor(step)).backward();
            g.finish_backward().unwrap();
        }
        let norm = match (&scaler, run.clip) {
            (None, None) => None,
            (s, clip) => match g.unscale_and_clip(s.as_ref(), clip).unwrap() {
                Some(norm) => clip.map(|_| norm),
                None => {
                    g.skip_step().unwrap();
                    norms.push(None);
                    continue;
                }
            },
        };
        norms.push(norm);
        g.step().unwrap();
    }
    let state: HashMap<String, Tensor> = g.state_dict().unwrap().into_iter().collect();
    (parameters().iter().map(|p| state[&p.name].shallow_clone()).collect(), norms)
}

fn assert_norms(a: &[Option<f64>], b: &[Option<f64>], what: &str) {
    assert_eq!(a.len(), b.len());
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        match (x, y) {
            (Some(x), Some(y)) => assert!((x - y).abs() <= 1e-5 * y, "{what}, step {step}: norm {x} against {y}"),
            _ => assert_eq!(x.is_some(), y.is_some(), "{what}, step {step}: skipped on one side only"),
        }
    }
}

#[test]
fn parameters_the_data_skips_step_with_a_zero_gradient() {
    for rule in [Rule::AdamW, Rule::Lamb] {
        for micro_batches in [1, 2] {
            for plan in [false, true] {
                let run = Run { micro_batches, clip: Some(0.5), scale: None, overflow: None, plan };
                let (reference, reference_norms) = plain(rule, run, 1);
                let (trained, norms) = gemini(rule, run, None);
                let what = format!("{rule:?}, {run:?}");
                assert_norms(&norms, &reference_norms, &what);
                assert!(norms.iter().all(|n| n.is_some_and(|n| n > 0.5)), "{what}: every step clips: {norms:?}");
                assert_same(&trained, &reference, &what);
            }
        }
    }
    // Stepped outright during backward (no norm): the chunks that complete step early, the
    // others (the skipped block's) at the step, reading zeros.
    let run = Run { micro_batches: 2, clip: None, scale: None, overflow: None, plan: true };
    assert_same(&gemini(Rule::AdamW, run, None).0, &plain(Rule::AdamW, run, 1).0, &format!("{run:?}"));
}

#[test]
fn after_a_skipped_overflow_the_gradients_are_the_next_steps() {
    // Step 4 overflows with the second block run, so its accumulators hold inf; step 5 skips
    // the block: its norm must read zeros there, not the skipped step's inf.
    for plan in [false, true] {
        let run = Run { micro_batches: 1, clip: Some(0.5), scale: Some(1024.0), overflow: Some(4), plan };
        let (reference, reference_norms) = plain(Rule::AdamW, run, 1);
        let (trained, norms) = gemini(Rule::AdamW, run, None);
        assert!(norms[4].is_none() && norms[5].is_some_and(f64::is_finite), "{norms:?}");
        assert_norms(&norms, &reference_norms, &format!("{run:?}"));
        assert_same(&trained, &reference, &format!("{run:?}"));
    }
}

dist_test!(chunks_no_rank_used_step_with_a_zero_gradient_on_2_ranks, 2, |world| {
    let run = Run { micro_batches: 2, clip: Some(0.5), scale: None, overflow: None, plan: false };
    let (reference, reference_norms) = plain(Rule::AdamW, run, 2);
    for shard in [false, true] {
        let (trained, norms) = gemini(Rule::AdamW, run, Some((world.group.clone(), shard)));
        let what = format!("2 ranks, shard {shard}");
        assert_norms(&norms, &reference_norms, &what);
        assert_same(&trained, &reference, &what);
    }
    Ok(())
});
