//! The solver: every plan for `nproc` ranks, modelled, the fastest that fits in memory chosen.
//!
//! Exhaustive search is exact here and cheap. The layouts are the ordered factorisations of
//! `nproc` into dp x tp x sp x pp (84 for 64 ranks), times a handful of tensor-parallel modes,
//! three ZeRO stages and a few micro-batch counts.
//! Checkpointing is a set of blocks, but the blocks of a model are identical layers, so within a
//! stage only how many are checkpointed changes the cost, and the stage holding the most
//! micro-batches bounds the memory: searching the count per stage (0 to the stage's blocks)
//! covers every set up to cost-equal ones. An integer program would only pay off for a layer
//! graph of unlike layers, which these models are not.
use std::collections::BTreeSet;

use super::cluster::Cluster;
use super::cost::{estimate, Estimate, Model, Plan};
use crate::parallel::pipeline::split_costs;
use crate::parallel::tensor::TpMode;
use crate::{Error, Result};

/// A plan with its modelled cost.
#[derive(Clone, Debug)]
pub struct Ranked {
    /// The plan.
    pub plan: Plan,
    /// Its modelled cost.
    pub estimate: Estimate,
}

/// What the solver found.
#[derive(Clone, Debug)]
pub struct Solution {
    /// The fastest plan that fits.
    pub best: Ranked,
    /// The next fastest that fit, fastest first.
    pub runners_up: Vec<Ranked>,
    /// Plans modelled.
    pub considered: usize,
    /// Of which fit in memory.
    pub fitting: usize,
}

/// `s` seconds in ms under 100 s, else in seconds.
fn seconds(s: f64) -> String {
    match s < 100.0 {
        true => format!("{:.3} ms", s * 1e3),
        false => format!("{s:.1} s"),
    }
}

fn gib(b: f64) -> f64 {
    b / (1u64 << 30) as f64
}

impl Solution {
    /// The chosen plan and the runners-up, a line each with its predicted step time, memory
    /// and bubble and a line of `flags` (the command-line flags that run it; none where it
    /// gives ""), and under the chosen plan what its step time and memory are made of.
    pub fn report(&self, flags: &dyn Fn(&Plan) -> String) -> String {
        let mib = |b: f64| b / (1u64 << 20) as f64;
        let line = |r: &Ranked| {
            let flags = flags(&r.plan);
            let flags = if flags.is_empty() { flags } else { format!("  {:>43}{flags}\n", "") };
            format!(
                "  {:>12}/step  {:>9.2} MiB  bubble {:>4.1}%  {}\n{flags}",
                seconds(r.estimate.step_s),
                mib(r.estimate.memory_bytes),
                100.0 * r.estimate.bubble,
                r.plan,
            )
        };
        let e = &self.best.estimate;
        let mut out = format!("plan ({} of {} plans fit):\n", self.fitting, self.considered) + &line(&self.best);
        out += &format!(
            "  {:>43}step: compute {}, communication {}, bubble {}, optimizer {}, operation overheads {}\n",
            "",
            seconds(e.compute_s),
            seconds(e.communication_s),
            seconds(e.bubble_s),
            seconds(e.optimizer_s),
            seconds(e.overhead_s)
        );
        out += &format!(
            "  {:>43}memory{}: parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} MiB, activations \
             {:.2} MiB\n",
            "",
            if e.peak_in_step { " (at the optimizer's step)" } else { "" },
            mib(e.param_bytes),
            mib(e.grad_bytes),
            mib(e.optimizer_bytes),
            mib(e.activation_bytes)
        );
        if !self.runners_up.is_empty() {
            out += "runners-up:\n";
            for r in &self.runners_up {
                out += &line(r);
            }
        }
        out
    }
}

/// The report without flags.
impl std::fmt::Display for Solution {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.report(&|_| String::new()))
    }
}

/// A pipeline's micro-batches per stage searched at most (the bubble is under 2% there).
const MAX_MICRO_PER_STAGE: usize = 64;

/// Every plan for `nproc` ranks that `valid` accepts (the model's divisibility rules and the
/// checkpoint sets it can run).
pub fn plans(model: &Model, nproc: usize, valid: &dyn Fn(&Plan) -> bool) -> Vec<Plan> {
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = Vec::new();
    for dp in divisors(nproc) {
        if !model.global_batch.is_multiple_of(dp) {
            continue;
        }
        for tp in divisors(nproc / dp) {
            for sp in divisors(nproc / (dp * tp)) {
                let pp = nproc / (dp * tp * sp);
                if pp > model.layers.len() {
                    continue;
                }
                let per_rank = model.global_batch / dp;
                // Micro-batches per step: without a pipeline, gradient accumulation over any
                // count that divides the rank's batch; a pipeline's from pp (the least that
                // fills it) to 64 pp, or else the least above that divides it (a batch of 16
                // on 3 stages runs as 4 micro-batches).
                let micro: Vec<usize> = if pp == 1 {
                    divisors(per_rank).collect()
                } else {
                    let fits: Vec<usize> =
                        (pp..=MAX_MICRO_PER_STAGE * pp).filter(|m| per_rank.is_multiple_of(*m)).collect();
                    match fits.is_empty() {
                        true => (pp..=per_rank).find(|m| per_rank.is_multiple_of(*m)).into_iter().collect(),
                        false => fits,
                    }
                };
                for (tp_mode, tp_depth) in TpMode::for_degree(tp) {
                    for &micro_batches in &micro {
                        for zero in 0..=2u8 {
                            let checkpoint = BTreeSet::new();
                            let base = Plan { dp, tp, tp_mode, tp_depth, sp, pp, micro_batches, zero, checkpoint };
                            // Each checkpoint set is asked too: a model may checkpoint only
                            // some sets (all blocks or none, say).
                            out.extend(checkpoint_choices(model, &base).into_iter().filter(|p| valid(p)));
                        }
                    }
                }
            }
        }
    }
    out
}

/// `base` with 0, 1, ... checkpointed blocks per stage (the first ones of each stage).
fn checkpoint_choices(model: &Model, base: &Plan) -> Vec<Plan> {
    // The same cut the cost model makes: the stages' ranges by forward FLOPs.
    let Ok(split) = split_costs(model.layers.iter().map(|l| l.forward_flops).collect(), base.pp, "flops") else {
        return Vec::new();
    };
    let stage_blocks: Vec<Vec<usize>> =
        split.ranges.iter().map(|r| r.clone().filter(|&i| model.layers[i].checkpointable).collect()).collect();
    let most = stage_blocks.iter().map(Vec::len).max().unwrap_or(0);
    (0..=most)
        .map(|k| {
            let checkpoint = stage_blocks.iter().flat_map(|b| b.iter().take(k).copied()).collect();
            Plan { checkpoint, ..base.clone() }
        })
        .collect()
}

/// The fastest plan for `model` on `nproc` ranks of `cluster` whose peak memory fits the
/// cluster's `memory_bytes`, and the next `runners_up`. Errors: no plan passes `valid`, or
/// none fits (naming the limit and what the leanest plan needs).
pub fn solve(
    model: &Model,
    cluster: &Cluster,
    nproc: usize,
    runners_up: usize,
    valid: &dyn Fn(&Plan) -> bool,
) -> Result<Solution> {
    cluster.validate().map_err(|e| Error::invalid(format!("cluster: {e}")))?;
    let candidates = plans(model, nproc, valid);
    if candidates.is_empty() {
        return Err(Error::invalid(format!(
            "no parallel layout of {nproc} ranks suits this model and a batch of {} (the batch, heads, \
             widths and layers must divide by the group sizes)",
            model.global_batch
        )));
    }
    let mut ranked = Vec::with_capacity(candidates.len());
    for plan in candidates {
        let estimate = estimate(model, cluster, &plan)?;
        ranked.push(Ranked { plan, estimate });
    }
    let considered = ranked.len();
    let (mut fit, rest): (Vec<Ranked>, Vec<Ranked>) =
        ranked.into_iter().partition(|r| r.estimate.memory_bytes <= cluster.memory_bytes);
    if fit.is_empty() {
        let leanest = rest
            .iter()
            .min_by(|a, b| a.estimate.memory_bytes.total_cmp(&b.estimate.memory_bytes))
            .expect("candidates is not empty");
        return Err(Error::invalid(format!(
            "no plan fits the {:.3} GiB per device (cluster memory_bytes = {}): the leanest of {considered}, {}, \
             needs {:.3} GiB",
            gib(cluster.memory_bytes),
            cluster.memory_bytes,
            leanest.plan,
            gib(leanest.estimate.memory_bytes)
        )));
    }
    // Fastest first; among equal times the leaner, then the simpler plan (fewer checkpoints,
    // lower ZeRO stage, by the plan's order).
    fit.sort_by(|a, b| {
        a.estimate
            .step_s
            .total_cmp(&b.estimate.step_s)
            .then(a.estimate.memory_bytes.total_cmp(&b.estimate.memory_bytes))
            .then(a.plan.cmp(&b.plan))
    });
    let fitting = fit.len();
    let mut it = fit.into_iter();
    let best = it.next().expect("fit is not empty");
    Ok(Solution { best, runners_up: it.take(runners_up).collect(), considered, fitting })
}
