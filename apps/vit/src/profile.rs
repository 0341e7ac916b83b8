//! The ViT's parts (see [`crate::model::Part`]) traced symbolically for the planner: the same
//! ops as `model.rs` runs, on shapes alone, one sample per batch (every cost but the parameters
//! grows linearly with the batch). `tests/profile.rs` checks a block's predicted parameter and
//! activation bytes against a block built and run on the CPU.
use engine::planner::{LayerProfile, Model, Recorder, Shard};

use crate::model::VitConfig;

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
