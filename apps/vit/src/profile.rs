//! The ViT's parts (see [`crate::model::Part`]) traced symbolically for the planner: the same
//! ops as `model.rs` runs, on shapes alone, one sample per batch (every cost but the parameters
//! grows linearly with the batch). `tests/profile.rs` checks a block's predicted parameter and
//! activation bytes against a block built and run on the CPU. [`timed`] measures the parts'
//! forward and backward on the device, which the planner prices a calibrated machine's steps
//! from.
use engine::dist::{ProcessGroup, ReduceOp};
use engine::job::Precision;
use engine::optim::params_of;
use engine::parallel::pipeline::{layer_times, Layer};
use engine::planner::{LayerProfile, LayerTime, Model, Recorder, Shard};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::model::{Vit, VitConfig};
use crate::pipeline_parallel::PartLayer;

/// The stem, each block and the head of `cfg`, profiled for `batch` samples in `elem_bytes`-wide
/// activations (4 for f32).
pub fn profile(cfg: &VitConfig, batch: i64, elem_bytes: usize) -> Vec<LayerProfile> {
    let blocks = (0..cfg.depth).map(|i| block(cfg, &format!("blocks.{i}"), batch, elem_bytes));
    std::iter::once(stem(cfg, batch, elem_bytes)).chain(blocks).chain([head(cfg, batch, elem_bytes)]).collect()
}

/// The planner's model of a run in `precision`: the parts at one sample, with LAMB's or Adam's
/// two moments per weight and an update of `optimizer_ops` element-wise operations per
/// parameter tensor.
///
/// Below fp32 the trainer holds what `vit::parallelize` makes: the weights, their gradients and
/// every activation in the run's kind (bf16: 2 bytes; LayerNorm's statistics and attention's
/// log-sum-exp stay f32, as the profiler records), and beside them fp32 master weights and the
/// fp32 moments, which ZeRO shards together ([`optimizer_state_ratio`]).
pub fn planner_model(cfg: &VitConfig, global_batch: usize, optimizer_ops: f64, precision: Precision) -> Model {
    let elem = precision.kind().elt_size_in_bytes();
    Model {
        layers: profile(cfg, 1, elem),
        global_batch,
        optimizer_state_ratio: optimizer_state_ratio(precision),
        optimizer_ops_per_tensor: optimizer_ops,
        step_grad_ratio: step_grad_ratio(precision),
    }
}

/// Bytes the optimizer's side keeps per byte of the model's weights in `precision`: the two
/// fp32 moments (8 bytes a weight) and, below fp32, the fp32 master (4 more), over the weight's
/// own bytes (4 in fp32: 2; 2 in bf16: 6). The masters' gradients exist only inside the
/// optimizer's step, after the activations are gone ([`step_grad_ratio`]).
pub fn optimizer_state_ratio(precision: Precision) -> f64 {
    let elem = precision.kind().elt_size_in_bytes() as f64;
    let master = if elem < 4.0 { 4.0 } else { 0.0 };
    (8.0 + master) / elem
}

/// Bytes of gradient the optimizer's step holds per byte of the model's weights in
/// `precision`: the model's own in fp32 (1); below it the fp32 masters' (4 bytes a weight over
/// the weight's 2 in bf16), the model's dropped as each moves.
pub fn step_grad_ratio(precision: Precision) -> f64 {
    4.0 / precision.kind().elt_size_in_bytes() as f64
}

/// `model` (the planner's model of `cfg`) with its parts priced from `times` (the stem's, a
/// block's, the head's: [`timed`]).
pub fn with_times(mut model: Model, times: [LayerTime; 3]) -> Model {
    let last = model.layers.len() - 1;
    for (i, layer) in model.layers.iter_mut().enumerate() {
        layer.measured = Some(match i {
            0 => times[0],
            i if i == last => times[2],
            _ => times[1],
        });
    }
    model
}

/// How [`timed`] runs the parts: where and in what kind the run computes, with which kernels,
/// and the device's figures that size the timed micro-batch.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// The device the run computes on.
    pub device: Device,
    /// The run's precision (its weights' and activations' kind).
    pub kind: Kind,
    /// The kernels the run's serial model uses.
    pub backend: kernels::Backend,
    /// The device's calibrated matmul FLOP/s in `kind`.
    pub peak_flops: f64,
    /// The device memory the planner plans for, bytes.
    pub memory_bytes: f64,
}

/// Seconds of a block's arithmetic (at the calibrated rate) the larger timed micro-batch holds
/// on a GPU: enough that its kernels' launches are a small share of its time.
const GPU_TIMED_S: f64 = 0.01;

/// Samples of the larger timed micro-batch. On a CPU, about a GFLOP of a block's forward and
/// backward (tens of milliseconds on a core, so that the per-sample part stands out of the
/// timer's noise), from 2 (a large model's block, timed in a second or so) to 64. On a GPU a
/// micro-batch of a few samples is over in the time its kernels take to launch, whatever their
/// arithmetic, so the per-sample time fitted through 1 and 2 samples is noise (on an H200 it
/// priced ViT-B/16's bf16 step at 141 ms where it ran in 885): there the
/// batch holds `GPU_TIMED_S` (10 ms) of arithmetic at `timing.peak_flops`, up to vit's largest
/// micro-batch and to what a quarter of the device's memory holds of the block's activations
/// and their gradients.
pub fn timed_samples(cfg: &VitConfig, timing: &Timing) -> usize {
    let elem = timing.kind.elt_size_in_bytes();
    let b = block(cfg, "blocks.0", 1, elem);
    let per_sample = 3.0 * b.forward_flops;
    match timing.device {
        Device::Cuda(_) => {
            let by_time = GPU_TIMED_S * timing.peak_flops / per_sample;
            let kept = 2.0 * (b.input_bytes + b.saved_bytes + b.output_bytes) + b.workspace_bytes;
            let by_memory = timing.memory_bytes / 4.0 / kept;
            by_time.min(by_memory).clamp(2.0, crate::layout::MAX_MICRO_BATCH as f64) as usize
        }
        _ => (1e9 / per_sample).clamp(2.0, 64.0) as usize,
    }
}

/// The stem's, one block's (the blocks are alike) and the head's forward and backward timed on
/// `timing.device` in the run's kind and kernels with this process's threads, at micro-batches
/// of one sample and of [`timed_samples`], as fixed and per-sample seconds. With `group` (a
/// collective) the ranks take turns, each timing its device alone (ranks sharing cores would
/// otherwise time one another: the cost model prices that sharing itself), and every rank
/// keeps the slowest's.
pub fn timed(cfg: &VitConfig, timing: &Timing, group: Option<&ProcessGroup>) -> anyhow::Result<[LayerTime; 3]> {
    let n = timed_samples(cfg, timing);
    let Timing { device, kind, backend, .. } = *timing;
    let measure = || -> anyhow::Result<Vec<f64>> {
        // Weights and inputs drawn in one seeded section: a draw outside one could fall between
        // another job's seed and its weights.
        let (vs, model, inputs) = engine::random::seeded(0, || -> anyhow::Result<_> {
            let mut vs = VarStore::new(device);
            let model = Vit::with_kernels(&vs.root(), *cfg, backend);
            if kind != Kind::Float {
                vs.set_kind(kind);
            }
            let image = |samples: i64| [samples, cfg.in_channels, cfg.image_size, cfg.image_size];
            let inputs = [1, n as i64].map(|samples| Tensor::f_rand(image(samples), (kind, device)));
            Ok((vs, model, inputs))
        })?;
        let params = params_of(&vs);
        let mut parts = model.into_parts();
        let head = parts.pop().expect("the head");
        parts.truncate(2);
        let layers: Vec<Box<dyn Layer>> =
            parts.into_iter().chain([head]).map(|p| Box::new(PartLayer::new(p, &params)) as Box<dyn Layer>).collect();
        let mut out = Vec::new();
        for input in inputs {
            out.extend(layer_times(&layers, &input?, 1)?);
        }
        Ok(out)
    };
    let seconds = match group {
        None => measure()?,
        Some(g) => {
            let mut mine = None;
            for turn in 0..g.size() {
                g.barrier()?;
                if turn == g.rank() {
                    mine = Some(measure()?);
                }
            }
            let slowest = Tensor::f_from_slice(&mine.expect("every rank has its turn"))?.f_to_device(device)?;
            g.all_reduce(&slowest, ReduceOp::Max)?;
            Vec::<f64>::try_from(slowest.f_to_device(Device::Cpu)?)?
        }
    };
    let fit = |i: usize| LayerTime::fit(1.0, seconds[i], n as f64, seconds[3 + i]);
    Ok([fit(0), fit(1), fit(2)])
}

fn tokens(cfg: &VitConfig) -> i64 {
    cfg.num_patches() + 1
}

/// Patch convolution, flattened to tokens, the class token prepended, positions added.
fn stem(cfg: &VitConfig, batch: i64, elem_bytes: usize) -> LayerProfile {
    let (mut r, images) = Recorder::new("stem", &[batch, cfg.in_channels, cfg.image_size, cfg.image_size], elem_bytes);
    let patches = r.patch_conv(&images, cfg.width, cfg.patch_size);
    let patches = r.view(&patches, &[batch, cfg.num_patches(), cfg.width]);
    r.param(&[1, 1, cfg.width], false);
    r.param(&[1, tokens(cfg), cfg.width], false);
    let joined = r.copy(&patches, &[batch, tokens(cfg), cfg.width]);
    let out = r.add(&joined);
    r.finish(&out)
}

/// A pre-norm block: `x + proj(attn(qkv(norm1 x)))`, then `+ fc2(gelu(fc1(norm2 x)))`.
pub fn block(cfg: &VitConfig, name: &str, batch: i64, elem_bytes: usize) -> LayerProfile {
    let (n, w) = (tokens(cfg), cfg.width);
    let (mut r, x) = Recorder::new(name, &[batch, n, w], elem_bytes);
    r.checkpointable();
    let h = r.layer_norm(&x);
    let qkv = r.linear(&h, 3 * w, Shard::Column);
    let attended = r.attention(&qkv, batch, cfg.heads, n, w / cfg.heads);
    // The projection's output is a temporary the residual add consumes.
    r.linear(&attended, w, Shard::Row);
    let x = r.add(&x);
    let h = r.layer_norm(&x);
    let hidden = r.linear(&h, cfg.mlp_hidden(), Shard::Column);
    let hidden = r.activation(&hidden);
    r.linear(&hidden, w, Shard::Row);
    let out = r.add(&x);
    r.finish(&out)
}

/// The final norm, the class token's features, the classifier.
fn head(cfg: &VitConfig, batch: i64, elem_bytes: usize) -> LayerProfile {
    let (mut r, x) = Recorder::new("head", &[batch, tokens(cfg), cfg.width], elem_bytes);
    let normed = r.layer_norm(&x);
    let cls = r.view(&normed, &[batch, cfg.width]);
    let logits = r.linear(&cls, cfg.num_classes, Shard::None);
    r.finish(&logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vit_base_forward_is_the_published_17_6_gmacs() {
        // timm / fvcore count ViT-B/16 at 224 px as 17.6 G multiply-adds per image.
        let layers = profile(&VitConfig::base(16), 1, 4);
        let macs: f64 = layers.iter().map(|l| l.forward_flops / 2.0).sum();
        assert!((macs / 17.6e9 - 1.0).abs() < 0.01, "{macs}");
        let params: f64 = layers.iter().map(|l| l.param_bytes / 4.0).sum();
        // timm's vit_base_patch16_224: 86,567,656 parameters.
        assert_eq!(params, 86_567_656.0);
    }
}
