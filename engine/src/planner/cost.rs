//! The cost model: for one [`Plan`] (a parallel layout, a ZeRO stage and the blocks to
//! checkpoint), a device's step time and peak memory, from the model's [`LayerProfile`]s and
//! the [`Cluster`].
//!
//! Time: each pipeline stage's compute is its FLOPs over the device's peak; communication
//! follows the layout's collectives (ring all-reduces of 1D tensor parallelism per row-parallel
//! output forward and column-parallel input gradient backward; the operand broadcasts of the
//! 2D/2.5D/3D matmuls; sequence parallelism's exchange of queries, keys, values and outputs;
//! activations sent between stages), and the stages' micro-batches are laid out by the pipeline
//! simulator ([`crate::parallel::pipeline::simulate`]) under 1F1B, so the bubble is the
//! runtime's own; then the gradients are all-reduced over the data and sequence-parallel group,
//! and under ZeRO every parameter is broadcast from its owner after the step (as
//! [`crate::parallel::zero`] does: an all-gather's bytes plus a latency per tensor).
//! Checkpointed blocks run their forward again in the backward.
//!
//! Memory: parameters, gradients and the optimizer's two moments (sharded by ZeRO stage over
//! the gradient group), plus per micro-batch in flight each layer's input and, unless the layer
//! is checkpointed, what it saves for backward; the largest workspace and one checkpointed
//! block's recomputed activations on top.
use std::collections::BTreeSet;
use std::fmt;

use super::cluster::Cluster;
use super::profile::LayerProfile;
use crate::parallel::pipeline::{simulate, split_costs, Costs, Schedule, ScheduleKind};
use crate::parallel::tensor::TpMode;
use crate::Result;

/// One way to run a training step.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Plan {
    /// Data-parallel replicas.
    pub dp: usize,
    /// Tensor-parallel group size.
    pub tp: usize,
    /// How the tensor-parallel group shards (ignored at `tp = 1`).
    pub tp_mode: TpMode,
    /// The grid's layers under 2.5D (1 otherwise).
    pub tp_depth: usize,
    /// Sequence-parallel group size.
    pub sp: usize,
    /// Pipeline stages.
    pub pp: usize,
    /// Micro-batches per step and data-parallel rank.
    pub micro_batches: usize,
    /// ZeRO stage (0, 1, 2).
    pub zero: u8,
    /// Indices (into the model's layers) of the blocks whose activations are recomputed.
    pub checkpoint: BTreeSet<usize>,
}

impl Plan {
    /// Ranks the plan uses.
    pub fn ranks(&self) -> usize {
        self.dp * self.tp * self.sp * self.pp
    }

    /// The `vit pretrain` flags that run this layout (`--micro-batch` for `global_batch`;
    /// `--checkpoint-blocks` counts the checkpointed blocks, which vit takes as the model's
    /// first ones: the sets its planner admits).
    pub fn flags(&self, global_batch: usize) -> String {
        let mut f = format!("--nproc {}", self.ranks());
        if self.tp > 1 {
            f += &format!(" --tp {} --tp-mode {}", self.tp, self.tp_mode.name());
            if self.tp_mode == TpMode::TwoHalfD {
                f += &format!(" --tp-depth {}", self.tp_depth);
            }
        }
        if self.sp > 1 {
            f += &format!(" --sp {}", self.sp);
        }
        if self.pp > 1 {
            f += &format!(" --pp {} --micro-batch {}", self.pp, global_batch / (self.dp * self.micro_batches));
        }
        if self.zero > 0 {
            f += &format!(" --zero {}", self.zero);
        }
        if !self.checkpoint.is_empty() {
            f += &format!(" --checkpoint-blocks {}", self.checkpoint.len());
        }
        f
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match (self.tp, self.tp_mode) {
            (1, _) => String::new(),
            (_, TpMode::TwoHalfD) => format!(" (2.5d depth {})", self.tp_depth),
            (_, mode) => format!(" ({})", mode.name()),
        };
        write!(
            f,
            "dp {} x tp {}{mode} x sp {} x pp {}, {} micro-batches, ZeRO-{}, {} blocks checkpointed",
            self.dp,
            self.tp,
            self.sp,
            self.pp,
            self.micro_batches,
            self.zero,
            self.checkpoint.len()
        )
    }
}

/// A model to plan for: its layers traced at one sample each, and the global batch.
#[derive(Clone, Debug)]
pub struct Model {
    /// The layers in running order, each profiled for a batch of one sample.
    pub layers: Vec<LayerProfile>,
    /// Samples per optimizer step over all ranks.
    pub global_batch: usize,
    /// Bytes of optimizer state per parameter byte (2 for Adam's or LAMB's two moments).
    pub optimizer_state_ratio: f64,
}

/// The modelled cost of a plan on one device (the busiest stage).
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// Seconds per optimizer step.
    pub step_s: f64,
    /// Seconds of it the busiest stage computes.
    pub compute_s: f64,
    /// Seconds of it spent in collectives and sends.
    pub communication_s: f64,
    /// The pipeline's idle fraction.
    pub bubble: f64,
    /// Peak bytes on the fullest device.
    pub memory_bytes: f64,
    /// Of which parameters, gradients and optimizer state.
    pub state_bytes: f64,
}

/// Models `plan` for `model` on `cluster`. Errors only where the pipeline cannot be built
/// (more stages than layers); callers check divisibility first.
pub fn estimate(model: &Model, cluster: &Cluster, plan: &Plan) -> Result<Estimate> {
    let (tp, sp) = (plan.tp, plan.sp);
    let micro = model.global_batch as f64 / (plan.dp * plan.micro_batches) as f64;
    let group = (plan.dp * sp) as f64;
    let multi_dim = tp > 1 && plan.tp_mode != TpMode::OneD;
    let t = tp as f64;
    // The share of a quantity one device holds: 1D splits only its split part; the grids and
    // sequence parallelism split everything that scales with the tokens.
    let shard = |whole: f64, split: f64| if multi_dim { whole / t } else { whole - split + split / t };
    let flops_of = |l: &LayerProfile| shard(l.forward_flops, l.split_flops) * micro / sp as f64;
    let split = split_costs(model.layers.iter().map(flops_of).collect(), plan.pp, "flops")?;

    let mut worst_fwd: f64 = 0.0;
    let mut worst_bwd: f64 = 0.0;
    let mut compute_worst: f64 = 0.0;
    let mut comm_worst: f64 = 0.0;
    let mut stage_memory = Vec::new();
    let mut stage_params = Vec::new();
    let mut stage_tensors = Vec::new();
    for range in &split.ranges {
        let layers = &model.layers[range.clone()];
        let (mut fwd, mut comm_fwd, mut recompute, mut params, mut act, mut work) = (0.0, 0.0, 0.0, 0.0, 0.0, 0f64);
        let mut tensors = 0.0;
        let mut recompute_peak: f64 = 0.0;
        for (i, l) in range.clone().zip(layers) {
            let flops = flops_of(l);
            fwd += flops / cluster.peak_flops;
            let comm = layer_communication(l, plan, cluster, micro);
            comm_fwd += comm;
            let saved = shard(l.saved_bytes, l.split_saved_bytes) * micro / sp as f64;
            let input = shard_input(l, multi_dim, t) * micro / sp as f64;
            act += input;
            if plan.checkpoint.contains(&i) {
                recompute += flops / cluster.peak_flops + comm;
                recompute_peak = recompute_peak.max(saved);
            } else {
                act += saved;
            }
            work = work.max(l.workspace_bytes * micro / (sp as f64 * if multi_dim { t } else { 1.0 }));
            params += shard(l.param_bytes, l.split_param_bytes);
            tensors += l.param_tensors;
        }
        let last = &layers[layers.len() - 1];
        let send = if plan.pp > 1 {
            cluster.send(last.output_bytes * micro / (sp * tp) as f64, plan.dp * sp * tp)
        } else {
            0.0
        };
        worst_fwd = worst_fwd.max(fwd + comm_fwd + send);
        worst_bwd = worst_bwd.max(2.0 * fwd + 2.0 * comm_fwd + recompute + send);
        compute_worst = compute_worst.max(3.0 * fwd + recompute);
        comm_worst = comm_worst.max(3.0 * comm_fwd + 2.0 * send);
        stage_memory.push((act, work + recompute_peak));
        stage_params.push(params);
        stage_tensors.push(tensors);
    }
    let schedule = Schedule::new(ScheduleKind::OneFOneB, plan.pp, plan.micro_batches, 1)?;
    // The sends are charged inside the forward and backward costs above, so no separate hop.
    let sim = simulate(&schedule, Costs { forward: worst_fwd, input_grad: worst_bwd, weight_grad: 0.0, hop: 0.0 })?;

    let mut memory: f64 = 0.0;
    let mut state_worst: f64 = 0.0;
    let mut sync_worst: f64 = 0.0;
    for (s, (((act, extra), params), tensors)) in stage_memory.iter().zip(&stage_params).zip(&stage_tensors).enumerate()
    {
        let grads = if plan.zero >= 2 { params / group } else { *params };
        let optimizer = model.optimizer_state_ratio * params / if plan.zero >= 1 { group } else { 1.0 };
        let state = params + grads + optimizer;
        let in_flight = sim.peak_in_flight[s] as f64;
        memory = memory.max(state + act * in_flight + extra);
        state_worst = state_worst.max(state);
        let mut sync = cluster.all_reduce(*params, plan.dp * sp, tp);
        if plan.zero >= 1 && plan.dp * sp > 1 {
            // The engine's ZeRO broadcasts every parameter from its owner after the step (one
            // collective per tensor, all in flight): the bytes of an all-gather, and a latency
            // per tensor. ZeRO-2's reduce of each gradient to its owner is priced as the
            // all-reduce above (no cheaper).
            sync += cluster.all_gather(*params, plan.dp * sp, tp) + tensors * cluster.latency_s;
        }
        sync_worst = sync_worst.max(sync);
    }
    let m = plan.micro_batches as f64;
    Ok(Estimate {
        step_s: sim.makespan + sync_worst,
        compute_s: m * compute_worst,
        communication_s: m * comm_worst + sync_worst,
        bubble: sim.bubble,
        memory_bytes: memory,
        state_bytes: state_worst,
    })
}

/// The layer's input bytes per sample on one device: the 1D layout replicates the stream.
fn shard_input(l: &LayerProfile, multi_dim: bool, t: f64) -> f64 {
    if multi_dim {
        l.input_bytes / t
    } else {
        l.input_bytes
    }
}

/// Seconds of one forward of `l` spent in the layout's collectives, for `micro` samples (the
/// backward moves twice as much).
fn layer_communication(l: &LayerProfile, plan: &Plan, cluster: &Cluster, micro: f64) -> f64 {
    let (tp, sp) = (plan.tp, plan.sp);
    let per_device = micro / sp as f64;
    let mut seconds = 0.0;
    if tp > 1 {
        seconds += match plan.tp_mode {
            TpMode::OneD => cluster.all_reduce(l.tp_allreduce_bytes * per_device, tp, 1),
            mode => {
                // Each matmul's operands cross the grid: SUMMA broadcasts an activation block
                // along rows and a weight block along columns (1/q of each per device); the
                // 2.5D layers divide the activations once more by their depth; the cube gathers
                // both over q ranks of its q^3 (1/q^2 each) and reduce-scatters the output.
                let q = mode.side(tp, plan.tp_depth).unwrap_or(tp) as f64;
                let acts = (l.matmul_operand_bytes - l.split_param_bytes) * per_device;
                let weights = l.split_param_bytes;
                let (bytes, steps) = match mode {
                    TpMode::TwoD => ((acts + weights) / q, 2.0 * q),
                    TpMode::TwoHalfD => ((acts / plan.tp_depth as f64 + weights) / q, 2.0 * q),
                    _ => (3.0 * (acts + weights) / (q * q), 3.0 * q),
                };
                bytes / cluster.bandwidth(tp, 1) + steps * cluster.latency_s
            }
        };
    }
    if sp > 1 {
        // Queries, keys and values in, outputs back: four thirds of the fused projection.
        let chunk = l.attention_qkv_bytes * 4.0 / 3.0 * per_device / if tp > 1 { tp as f64 } else { 1.0 };
        seconds += cluster.all_gather(chunk, sp, tp);
    }
    seconds
}
