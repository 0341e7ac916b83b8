//! The cost model: for one [`Plan`] (a parallel layout, a ZeRO stage and the blocks to
//! checkpoint), a device's step time and peak memory, from the model's [`LayerProfile`]s and
//! the [`Cluster`].
//!
//! Time: each pipeline stage's compute is its FLOPs over the device's peak; communication
//! follows the layout's collectives (ring all-reduces of 1D tensor parallelism per row-parallel
//! output forward and column-parallel input gradient backward; the operand broadcasts of the
//! 2D/2.5D/3D matmuls and their norms' statistics; sequence parallelism's exchange of queries,
//! keys, values and outputs; activations sent between stages), each collective inside the
//! model a blocking call between computations ([`Cluster::sync_s`]: on ranks sharing cores
//! far more than the links' latency) and its bytes, and the stages' micro-batches are laid out by the pipeline
//! simulator ([`crate::parallel::pipeline::simulate`]) under 1F1B, so the bubble is the
//! runtime's own; then the gradients are all-reduced over the data and sequence-parallel group,
//! and under ZeRO every parameter is broadcast from its owner after the step (as
//! [`crate::parallel::zero`] does: an all-gather's bytes plus a collective's own cost per tensor).
//! Checkpointed blocks run their forward again in the backward.
//!
//! A layer timed on the device ([`LayerProfile::measured`]) is priced from its measurement
//! (a fixed part and a part per sample, the latter split as its FLOPs are). Otherwise, beside
//! FLOPs and bytes, what dominates when they are small: every tensor operation costs the
//! device's per-operation overhead ([`Cluster::op_overhead_s`], forward and twice in
//! backward), the gradients are reduced one DDP bucket at a time, the optimizer's update runs
//! its element-wise operations per parameter tensor at the device's memory bandwidth, and
//! ranks sharing a machine's cores slow one another ([`Cluster::contention`]).
//!
//! Memory: parameters, gradients and the optimizer's two moments (sharded by ZeRO stage over
//! the gradient group), plus per micro-batch in flight each layer's input and, unless the layer
//! is checkpointed, what it saves for backward; the largest workspace on top, and while a
//! checkpointed block recomputes its activations in the backward, those beside what the
//! layers before it keep (the backward has freed the later layers' by then, so with the first
//! k blocks checkpointed the recomputation rarely sets the peak); under a pipeline, the
//! runtime's receive buffers (an activation in and a gradient back per micro-batch in flight,
//! and one posted ahead) and what the step's sends keep until its end (every micro-batch's
//! output and input gradient). Gradient accumulation runs the micro-batches one after
//! another, so only one is in flight without a pipeline.
use std::collections::BTreeSet;
use std::fmt;

use super::cluster::Cluster;
use super::profile::LayerProfile;
use crate::parallel::pipeline::{simulate, split_costs, Costs, Schedule, ScheduleKind, Simulation};
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
            "dp {} x tp {}{mode} x sp {} x pp {}, {} micro-batch{}, ZeRO-{}, {} blocks checkpointed",
            self.dp,
            self.tp,
            self.sp,
            self.pp,
            self.micro_batches,
            if self.micro_batches == 1 { "" } else { "es" },
            self.zero,
            self.checkpoint.len()
        )
    }
}

/// A model to plan for: its layers traced at one sample each, the global batch, and what its
/// optimizer holds and runs.
#[derive(Clone, Debug)]
pub struct Model {
    /// The layers in running order, each profiled for a batch of one sample.
    pub layers: Vec<LayerProfile>,
    /// Samples per optimizer step over all ranks.
    pub global_batch: usize,
    /// Bytes of optimizer state per parameter byte (2 for Adam's or LAMB's two moments).
    pub optimizer_state_ratio: f64,
    /// Element-wise tensor operations the optimizer's update runs per parameter tensor (each
    /// reading two of the tensor's arrays and writing one); 0 for a multi-tensor kernel.
    pub optimizer_ops_per_tensor: f64,
    /// Bytes of gradient the optimizer's step holds per byte of the parameters it updates: 1
    /// where it steps the model's own gradients; below fp32, the fp32 masters' (2 in bf16),
    /// into which the model's move after the backward (`optim::MasterWeights`). Where the
    /// activations are few, that step is the peak.
    pub step_grad_ratio: f64,
}

/// The modelled cost of a plan on one device (the busiest stage), with what it is made of.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    /// Seconds per optimizer step.
    pub step_s: f64,
    /// Seconds of it the busiest stage computes (FLOPs at the device's rate, recomputation
    /// included).
    pub compute_s: f64,
    /// Seconds of it spent in collectives and sends (the gradients' reduction included).
    pub communication_s: f64,
    /// Seconds of it the busiest stage's operations cost beyond their arithmetic.
    pub overhead_s: f64,
    /// Seconds of it the busiest stage waits for the others (the pipeline's bubble).
    pub bubble_s: f64,
    /// Seconds of the optimizer's update.
    pub optimizer_s: f64,
    /// The pipeline's idle fraction.
    pub bubble: f64,
    /// Peak bytes on the fullest device.
    pub memory_bytes: f64,
    /// Of which parameters.
    pub param_bytes: f64,
    /// Of which gradients.
    pub grad_bytes: f64,
    /// Of which optimizer state.
    pub optimizer_bytes: f64,
    /// Of which activations kept for backward and the largest temporaries.
    pub activation_bytes: f64,
    /// Whether the peak is the optimizer's step (the masters' gradients beside the state, the
    /// activations gone) rather than the forward and backward.
    pub peak_in_step: bool,
}

impl Estimate {
    /// Parameters, gradients and optimizer state: what the step holds whatever the batch.
    pub fn state_bytes(&self) -> f64 {
        self.param_bytes + self.grad_bytes + self.optimizer_bytes
    }
}

/// One stage's costs per micro-batch and what it holds.
#[derive(Default)]
struct Stage {
    /// Seconds of the forward's arithmetic, operations' overhead and collectives.
    forward: [f64; 3],
    /// Seconds of the backward's collectives (its arithmetic and overheads are twice the
    /// forward's).
    backward_comm: f64,
    /// Seconds to send an activation to the next stage (and a gradient back).
    send: f64,
    /// Bytes of the pipeline runtime's receive buffers of one micro-batch: the activation
    /// coming in and the gradient coming back (reused once its backward is done, kept from
    /// step to step).
    buffers: f64,
    /// Seconds of recomputed forwards in the backward (arithmetic, overhead, collectives).
    recompute: [f64; 3],
    /// Activation bytes a micro-batch in flight keeps.
    activations: f64,
    /// Bytes on top while one micro-batch computes: the largest temporary, and how far a
    /// checkpointed block's recomputation (its activations beside the layers' before it) rises
    /// above the whole micro-batch's activations.
    transient: f64,
    params: f64,
    tensors: f64,
}

/// Models `plan` for `model` on `cluster`. Errors only where the pipeline cannot be built
/// (more stages than layers); callers check divisibility first.
pub fn estimate(model: &Model, cluster: &Cluster, plan: &Plan) -> Result<Estimate> {
    let (tp, sp, m) = (plan.tp, plan.sp, plan.micro_batches as f64);
    let micro = model.global_batch as f64 / (plan.dp * plan.micro_batches) as f64;
    let group = (plan.dp * sp) as f64;
    let multi_dim = tp > 1 && plan.tp_mode != TpMode::OneD;
    let t = tp as f64;
    // The share of a quantity one device holds: 1D splits only its split part; the grids and
    // sequence parallelism split everything that scales with the tokens.
    let shard = |whole: f64, split: f64| if multi_dim { whole / t } else { whole - split + split / t };
    let flops_of = |l: &LayerProfile| shard(l.forward_flops, l.split_flops) * micro / sp as f64;
    let split = split_costs(model.layers.iter().map(flops_of).collect(), plan.pp, "flops")?;
    // Ranks sharing cores compute together but for the pipeline's idle share.
    let busy = m / (m + plan.pp as f64 - 1.0);
    let slow = cluster.contention(busy);

    let stages: Vec<Stage> = split
        .ranges
        .iter()
        .map(|range| {
            let mut s = Stage::default();
            let mut recompute_peak: f64 = 0.0;
            let mut workspace: f64 = 0.0;
            for i in range.clone() {
                let l = &model.layers[i];
                let (arithmetic, overhead) = match l.measured {
                    // A third of the measured forward and backward is the forward. This rank
                    // computes its share of each sample's products (at the calibrated rate; what
                    // the measurement holds beyond them is element-wise work) and of the rest
                    // as much as the layout splits of the activations: 1D tensor parallelism
                    // repeats the norms and residuals on every rank.
                    Some(t) => {
                        let whole = t.per_sample_s * micro;
                        let products = (3.0 * l.forward_flops * micro / cluster.peak_flops).min(whole);
                        let of = |all: f64, split: f64| if all > 0.0 { shard(all, split) / all } else { 1.0 };
                        let flop_share = of(l.forward_flops, l.split_flops);
                        let byte_share =
                            if l.saved_bytes > 0.0 { of(l.saved_bytes, l.split_saved_bytes) } else { flop_share };
                        let mine = (products * flop_share + (whole - products) * byte_share) / sp as f64;
                        (mine / 3.0 * slow, t.fixed_s / 3.0 * slow)
                    }
                    None => (flops_of(l) / cluster.peak_flops * slow, l.ops * cluster.op_overhead_s * slow),
                };
                let (comm, comm_back) = layer_communication(l, plan, cluster, micro);
                s.forward[0] += arithmetic;
                s.forward[1] += overhead;
                s.forward[2] += comm;
                s.backward_comm += comm_back;
                let saved = shard(l.saved_bytes, l.split_saved_bytes) * micro / sp as f64;
                s.activations += shard_input(l, multi_dim, t) * micro / sp as f64;
                if plan.checkpoint.contains(&i) {
                    s.recompute[0] += arithmetic;
                    s.recompute[1] += overhead;
                    s.recompute[2] += comm;
                    // Its backward runs after the later layers' (whose activations are freed):
                    // what this layer and the ones before it keep, and its recomputed ones.
                    recompute_peak = recompute_peak.max(s.activations + saved);
                } else {
                    s.activations += saved;
                }
                workspace = workspace.max(l.workspace_bytes * micro / (sp as f64 * if multi_dim { t } else { 1.0 }));
                s.params += shard(l.param_bytes, l.split_param_bytes);
                s.tensors += l.param_tensors;
            }
            if plan.pp > 1 {
                let last = &model.layers[range.end - 1];
                let out = last.output_bytes * micro / (sp * tp) as f64;
                s.send = cluster.send(out, plan.dp * sp * tp);
                let incoming = if range.start > 0 {
                    shard_input(&model.layers[range.start], multi_dim, t) * micro / sp as f64
                } else {
                    0.0
                };
                let returning =
                    if range.end < model.layers.len() { last.output_bytes * micro / sp as f64 } else { 0.0 };
                s.buffers = incoming + returning;
            }
            s.transient = workspace + (recompute_peak - s.activations).max(0.0);
            s
        })
        .collect();
    // A backward computes twice its forward (each product's input and weight gradients), runs
    // its own collectives and the recomputation, and sends one gradient back where the forward
    // sent one activation on.
    let backward =
        |s: &Stage| 2.0 * (s.forward[0] + s.forward[1]) + s.backward_comm + s.recompute.iter().sum::<f64>() + s.send;
    let worst_fwd = stages.iter().map(|s| s.forward.iter().sum::<f64>() + s.send).fold(0.0, f64::max);
    let worst_bwd = stages.iter().map(backward).fold(0.0, f64::max);
    let sim = match plan.pp {
        // Accumulation runs the micro-batches one after another: nothing to lay out.
        1 => Simulation { makespan: m * (worst_fwd + worst_bwd), bubble: 0.0, peak_in_flight: vec![1] },
        pp => {
            let schedule = Schedule::new(ScheduleKind::OneFOneB, pp, plan.micro_batches, 1)?;
            // The sends are charged inside the forward and backward costs above, so no separate hop.
            let costs = Costs { forward: worst_fwd, input_grad: worst_bwd, weight_grad: 0.0, hop: 0.0 };
            simulate(&schedule, costs)?
        }
    };

    let mut worst = Estimate {
        step_s: 0.0,
        compute_s: 0.0,
        communication_s: 0.0,
        overhead_s: 0.0,
        bubble_s: 0.0,
        optimizer_s: 0.0,
        bubble: sim.bubble,
        memory_bytes: 0.0,
        param_bytes: 0.0,
        grad_bytes: 0.0,
        optimizer_bytes: 0.0,
        activation_bytes: 0.0,
        peak_in_step: false,
    };
    for (i, s) in stages.iter().enumerate() {
        let grads = if plan.zero >= 2 { s.params / group } else { s.params };
        let owned = if plan.zero >= 1 { group } else { 1.0 };
        let optimizer = model.optimizer_state_ratio * s.params / owned;
        // A receive buffer per micro-batch in flight, and one posted ahead of the compute; and
        // what the stage sends (its output forward, its input's gradient back: the same sizes),
        // kept by every send of the step until its end, since Gloo ends a send only when it is
        // waited for (on NCCL the runtime ends them as they complete, and this over-counts).
        let in_flight = sim.peak_in_flight[i] as f64;
        let activations = s.activations * in_flight + s.transient + s.buffers * (in_flight + 1.0 + m);
        let training = s.params + grads + optimizer + activations;
        // At the step the gradients of what this rank updates are the step's (the others'
        // stay as the backward left them: ZeRO-1 keeps them all).
        let step_grads = grads - s.params / owned + model.step_grad_ratio * s.params / owned;
        let stepping = s.params + step_grads + optimizer;
        let (memory, peak_in_step) = if stepping > training { (stepping, true) } else { (training, false) };
        if memory > worst.memory_bytes {
            let (grads, activations) = if peak_in_step { (step_grads, 0.0) } else { (grads, activations) };
            (worst.memory_bytes, worst.param_bytes, worst.grad_bytes) = (memory, s.params, grads);
            (worst.optimizer_bytes, worst.activation_bytes, worst.peak_in_step) =
                (optimizer, activations, peak_in_step);
        }
        // The gradients' reduction: one blocking all-reduce per DDP bucket of 25 MiB, and the
        // step's loss averaged over the ranks (the trainers log it every step).
        let buckets = (s.params / BUCKET_BYTES).ceil().max(1.0);
        let reducing = plan.dp * sp;
        let mut sync = if reducing > 1 {
            Cluster::ring_all_reduce_traffic(s.params, reducing) / cluster.bandwidth(reducing, tp)
                + buckets * cluster.sync_s
        } else {
            0.0
        };
        if plan.ranks() > 1 {
            sync += cluster.sync_s;
        }
        if plan.zero >= 1 && plan.dp * sp > 1 {
            // The engine's ZeRO broadcasts every parameter from its owner after the step (one
            // collective per tensor, all in flight): the bytes of an all-gather, and a call's
            // cost per tensor. ZeRO-2's reduce of each gradient to its owner is priced as the
            // all-reduce above (no cheaper).
            sync += cluster.all_gather(s.params, plan.dp * sp, tp) + s.tensors * cluster.collective_s;
        }
        // Each rank updates what it owns: every operation reads two arrays and writes one.
        let ops = model.optimizer_ops_per_tensor;
        let update =
            ops * (s.tensors / owned * cluster.op_overhead_s + 3.0 * s.params / owned / cluster.memory_bandwidth);
        let optimizer_s = update * cluster.contention(1.0);
        let [arithmetic, overhead] = [0, 1].map(|k| m * (3.0 * s.forward[k] + s.recompute[k]));
        let comm = m * (s.forward[2] + s.backward_comm + s.recompute[2] + 2.0 * s.send);
        let busy = arithmetic + overhead + comm;
        let step = sim.makespan + sync + optimizer_s;
        if step > worst.step_s {
            worst.step_s = step;
            (worst.compute_s, worst.overhead_s, worst.communication_s) = (arithmetic, overhead, comm + sync);
            worst.bubble_s = (sim.makespan - busy).max(0.0);
            worst.optimizer_s = optimizer_s;
        }
    }
    Ok(worst)
}

/// DDP's gradient bucket (PyTorch's and the engine's default).
const BUCKET_BYTES: f64 = (25u64 << 20) as f64;

/// The layer's input bytes per sample on one device: the 1D layout replicates the stream.
fn shard_input(l: &LayerProfile, multi_dim: bool, t: f64) -> f64 {
    if multi_dim {
        l.input_bytes / t
    } else {
        l.input_bytes
    }
}

/// Seconds of one forward of `l` and of its backward spent in the layout's collectives, for
/// `micro` samples. Each collective is a blocking call between computations
/// ([`Cluster::sync_s`]) and its bytes over the link.
fn layer_communication(l: &LayerProfile, plan: &Plan, cluster: &Cluster, micro: f64) -> (f64, f64) {
    let (tp, sp) = (plan.tp, plan.sp);
    let per_device = micro / sp as f64;
    let (mut forward, mut backward) = (0.0, 0.0);
    if tp > 1 {
        let link = cluster.interleaved(tp, 1);
        match plan.tp_mode {
            TpMode::OneD => {
                // The row-parallel outputs' all-reduces forward; as many backward, of the
                // column-parallel inputs' gradients, of the same bytes.
                let bytes = Cluster::ring_all_reduce_traffic(l.tp_allreduce_bytes * per_device, tp);
                let seconds = bytes / link + l.tp_allreduces * cluster.sync_s;
                (forward, backward) = (seconds, seconds);
            }
            mode => {
                // Each matmul's operands cross the grid: SUMMA broadcasts an activation block
                // along rows and a weight block along columns (1/q of each per device) in q
                // steps, two collectives each; the 2.5D layers divide the activations once more
                // by their depth; the cube gathers both over q ranks of its q^3 (1/q^2 each) and
                // reduce-scatters the output, three collectives. Each norm all-reduces its
                // mean and variance across the width. The backward runs two products per
                // matmul (and the norms' gradients): twice the forward's.
                let q = mode.side(tp, plan.tp_depth).unwrap_or(tp) as f64;
                let acts = (l.matmul_operand_bytes - l.split_param_bytes) * per_device;
                let weights = l.split_param_bytes;
                let (bytes, per_matmul) = match mode {
                    TpMode::TwoD => ((acts + weights) / q, 2.0 * q),
                    TpMode::TwoHalfD => ((acts / plan.tp_depth as f64 + weights) / q, 2.0 * q),
                    _ => (3.0 * (acts + weights) / (q * q), 3.0),
                };
                let calls = l.matmuls * per_matmul + 2.0 * l.norms;
                forward = bytes / link + calls * cluster.sync_s;
                backward = 2.0 * forward;
            }
        }
    }
    if sp > 1 {
        // Queries, keys and values in, outputs back: four thirds of the fused projection,
        // and the same again for their gradients.
        let chunk = l.attention_qkv_bytes * 4.0 / 3.0 * per_device / if tp > 1 { tp as f64 } else { 1.0 };
        let seconds = cluster.all_gather(chunk, sp, tp);
        forward += seconds;
        backward += seconds;
    }
    (forward, backward)
}
