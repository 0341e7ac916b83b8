//! The ViT's parts (see [`crate::model::Part`]) traced symbolically for the planner: the same
//! ops as `model.rs` runs, on shapes alone, one sample per batch (every cost but the parameters
//! grows linearly with the batch). `tests/profile.rs` checks a block's predicted parameter and
//! activation bytes against a block built and run on the CPU. [`timed`] measures the parts'
//! forward and backward on the device, which the planner prices a calibrated machine's steps
//! from.
use engine::dist::{ProcessGroup, ReduceOp};
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

/// The planner's model: the parts at one sample, with LAMB's or Adam's two moments per weight
/// and an update of `optimizer_ops` element-wise operations per parameter tensor.
pub fn planner_model(cfg: &VitConfig, global_batch: usize, optimizer_ops: f64) -> Model {
    Model {
        layers: profile(cfg, 1, 4),
        global_batch,
        optimizer_state_ratio: 2.0,
        optimizer_ops_per_tensor: optimizer_ops,
    }
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

/// Samples of the larger timed micro-batch: about a GFLOP of a block's forward and backward
/// (tens of milliseconds on a CPU core, so that the per-sample part stands out of the timer's
/// noise), from 2 (a large model's block, timed in a second or so) to 64.
fn timed_samples(cfg: &VitConfig) -> usize {
    let per_sample = 3.0 * block(cfg, "blocks.0", 1, 4).forward_flops;
    (1e9 / per_sample).clamp(2.0, 64.0) as usize
}

/// The stem's, one block's (the blocks are alike) and the head's forward and backward timed on
/// `device` with this process's threads, at micro-batches of one sample and of a few
/// (`timed_samples`), as fixed and per-sample seconds. With `group` (a collective) the ranks
/// take turns, each timing its device alone (ranks sharing cores would otherwise time one
/// another: the cost model prices that sharing itself), and every rank keeps the slowest's.
pub fn timed(cfg: &VitConfig, device: Device, group: Option<&ProcessGroup>) -> anyhow::Result<[LayerTime; 3]> {
    let n = timed_samples(cfg);
    let measure = || -> anyhow::Result<Vec<f64>> {
        // Weights and inputs drawn in one seeded section: a draw outside one could fall between
        // another job's seed and its weights.
        let (vs, model, inputs) = engine::random::seeded(0, || -> anyhow::Result<_> {
            let vs = VarStore::new(device);
            let model = Vit::new(&vs.root(), *cfg);
            let image = |samples: i64| [samples, cfg.in_channels, cfg.image_size, cfg.image_size];
            let inputs = [1, n as i64].map(|samples| Tensor::f_rand(image(samples), (Kind::Float, device)));
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
