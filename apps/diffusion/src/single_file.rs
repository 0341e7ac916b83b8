//! Original Stable Diffusion 1.x checkpoints in one file (`v1-5-pruned-emaonly.safetensors`:
//! `model.diffusion_model.*` for the UNet, `first_stage_model.*` for the VAE,
//! `cond_stage_model.transformer.*` for the CLIP text encoder, in the latent-diffusion code's
//! names) converted into a diffusers folder, whose loaders then check every key and shape.
//!
//! A single file holds no configuration and no tokenizer: they come from a diffusers folder of
//! the same architecture (`--config-from`, e.g. the configs and tokenizer of SD 1.5's
//! diffusers repository). The UNet's key arithmetic (which `input_blocks.i` is which down
//! block's resnet, attention or downsampler) follows from its config's `layers_per_block`.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::Tensor;

use crate::config::{read_json, UNetConfigFile};
use crate::{Error, Result};

const UNET: &str = "model.diffusion_model.";
const VAE: &str = "first_stage_model.";
const TEXT: &str = "cond_stage_model.transformer.";

/// Resnet parts: latent-diffusion name → diffusers name.
fn resnet_part(rest: &str) -> String {
    const PARTS: [(&str, &str); 6] = [
        ("in_layers.0.", "norm1."),
        ("in_layers.2.", "conv1."),
        ("emb_layers.1.", "time_emb_proj."),
        ("out_layers.0.", "norm2."),
        ("out_layers.3.", "conv2."),
        ("skip_connection.", "conv_shortcut."),
    ];
    PARTS.iter().find_map(|(a, b)| rest.strip_prefix(a).map(|r| format!("{b}{r}"))).unwrap_or_else(|| rest.to_string())
}

/// `(index, rest)` of `<index>.<rest>`.
fn split_index(s: &str) -> Option<(usize, &str)> {
    let (i, rest) = s.split_once('.')?;
    Some((i.parse().ok()?, rest))
}

/// The diffusers name of a UNet key (without the `model.diffusion_model.` prefix).
pub fn unet_key(key: &str, layers_per_block: usize) -> Option<String> {
    let per = layers_per_block + 1;
    if let Some(r) = key.strip_prefix("time_embed.0.") {
        return Some(format!("time_embedding.linear_1.{r}"));
    }
    if let Some(r) = key.strip_prefix("time_embed.2.") {
        return Some(format!("time_embedding.linear_2.{r}"));
    }
    if let Some(r) = key.strip_prefix("input_blocks.0.0.") {
        return Some(format!("conv_in.{r}"));
    }
    if let Some(r) = key.strip_prefix("out.0.") {
        return Some(format!("conv_norm_out.{r}"));
    }
    if let Some(r) = key.strip_prefix("out.2.") {
        return Some(format!("conv_out.{r}"));
    }
    if let Some(s) = key.strip_prefix("input_blocks.") {
        let (i, s) = split_index(s)?;
        let (part, rest) = split_index(s)?;
        let (block, layer) = ((i - 1) / per, (i - 1) % per);
        return match (layer == layers_per_block, part) {
            (true, 0) => rest.strip_prefix("op.").map(|r| format!("down_blocks.{block}.downsamplers.0.conv.{r}")),
            (false, 0) => Some(format!("down_blocks.{block}.resnets.{layer}.{}", resnet_part(rest))),
            (false, 1) => Some(format!("down_blocks.{block}.attentions.{layer}.{rest}")),
            _ => None,
        };
    }
    if let Some(s) = key.strip_prefix("middle_block.") {
        let (part, rest) = split_index(s)?;
        return match part {
            0 | 2 => Some(format!("mid_block.resnets.{}.{}", part / 2, resnet_part(rest))),
            1 => Some(format!("mid_block.attentions.0.{rest}")),
            _ => None,
        };
    }
    if let Some(s) = key.strip_prefix("output_blocks.") {
        let (i, s) = split_index(s)?;
        let (part, rest) = split_index(s)?;
        let (block, layer) = (i / per, i % per);
        return match part {
            0 => Some(format!("up_blocks.{block}.resnets.{layer}.{}", resnet_part(rest))),
            // An upsampler sits at 1 in blocks without attention, at 2 after an attention.
            1 | 2 if rest.starts_with("conv.") => Some(format!("up_blocks.{block}.upsamplers.0.{rest}")),
            1 => Some(format!("up_blocks.{block}.attentions.{layer}.{rest}")),
            _ => None,
        };
    }
    None
}

/// The diffusers name of a VAE key (without `first_stage_model.`); `levels` is the number of
/// resolution levels (the decoder's `up.i` run deepest first).
pub fn vae_key(key: &str, levels: usize) -> Option<String> {
    let (side, rest) = key.split_once('.')?;
    if side != "encoder" && side != "decoder" {
        return matches!(side, "quant_conv" | "post_quant_conv").then(|| key.to_string());
    }
    let resnet = |r: &str| r.replace("nin_shortcut.", "conv_shortcut.");
    let mapped = if let Some(r) = rest.strip_prefix("norm_out.") {
        format!("conv_norm_out.{r}")
    } else if rest.starts_with("conv_in.") || rest.starts_with("conv_out.") {
        rest.to_string()
    } else if let Some(r) = rest.strip_prefix("mid.block_1.") {
        format!("mid_block.resnets.0.{}", resnet(r))
    } else if let Some(r) = rest.strip_prefix("mid.block_2.") {
        format!("mid_block.resnets.1.{}", resnet(r))
    } else if let Some(r) = rest.strip_prefix("mid.attn_1.") {
        let (part, tail) = r.split_once('.')?;
        let name = match part {
            "norm" => "group_norm",
            "q" => "to_q",
            "k" => "to_k",
            "v" => "to_v",
            "proj_out" => "to_out.0",
            _ => return None,
        };
        format!("mid_block.attentions.0.{name}.{tail}")
    } else {
        let (dir, s) =
            if let Some(s) = rest.strip_prefix("down.") { ("down", s) } else { ("up", rest.strip_prefix("up.")?) };
        let (i, s) = split_index(s)?;
        let level = if dir == "down" { i } else { levels.checked_sub(1 + i)? };
        let blocks = format!("{dir}_blocks.{level}");
        if let Some(s) = s.strip_prefix("block.") {
            let (j, r) = split_index(s)?;
            format!("{blocks}.resnets.{j}.{}", resnet(r))
        } else if let Some(r) = s.strip_prefix("downsample.").or_else(|| s.strip_prefix("upsample.")) {
            format!("{blocks}.{dir}samplers.0.{r}")
        } else {
            return None;
        }
    };
    Some(format!("{side}.{mapped}"))
}

/// Converts the single file `checkpoint` into the diffusers folder `out` (written through a
/// staging folder): weights from the file, configs, tokenizer and scheduler from `configs` (a
/// diffusers folder of the same architecture). Every key of the file must convert: one that
/// does not is an error naming it. Returns the number of tensors written.
pub fn convert(checkpoint: &Path, configs: &Path, out: &Path) -> Result<usize> {
    let bad = |msg: String| Error::Format { path: checkpoint.to_path_buf(), msg };
    let file = data::checkpoint::read_tensors(checkpoint)?;
    if !file.keys().any(|k| k.starts_with(UNET)) {
        return Err(bad(format!("no {UNET}* keys: not an original Stable Diffusion checkpoint")));
    }
    let unet_cfg: UNetConfigFile = read_json(&configs.join("unet").join("config.json"))?;
    let vae_cfg: crate::config::VaeConfigFile = read_json(&configs.join("vae").join("config.json"))?;
    let (lpb, levels) = (unet_cfg.layers_per_block as usize, vae_cfg.block_out_channels.len());
    let mut parts: HashMap<&str, Vec<(String, Tensor)>> = HashMap::new();
    for (key, t) in file {
        // EMA copies and the training code's schedule buffers (`betas`, `alphas_cumprod`, ...,
        // top-level names) are not weights of the pipeline.
        if key.starts_with("model_ema.") || !key.contains('.') {
            continue;
        }
        let converted = if let Some(k) = key.strip_prefix(UNET) {
            unet_key(k, lpb).map(|n| ("unet", n, t))
        } else if let Some(k) = key.strip_prefix(VAE) {
            // The mid-block attention's projections are stored as 1x1 convolutions.
            let t = if k.contains(".attn_1.") && t.dim() == 4 { t.flatten(1, -1) } else { t };
            vae_key(k, levels).map(|n| ("vae", n, t))
        } else if let Some(k) = key.strip_prefix(TEXT) {
            if k.ends_with("position_ids") {
                continue;
            }
            let name = if k.starts_with("text_model.") { k.to_string() } else { format!("text_model.{k}") };
            Some(("text_encoder", name, t))
        } else {
            None
        };
        let (component, name, t) = converted.ok_or_else(|| bad(format!("key {key} has no diffusers equivalent")))?;
        parts.entry(component).or_default().push((name, t));
    }
    let staging = out.with_file_name(format!(
        ".{}.staging-{}",
        out.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let io = |path: PathBuf| move |source| Error::Io { path, source };
    let _ = std::fs::remove_dir_all(&staging);
    let result = (|| -> Result<usize> {
        let mut count = 0;
        for (component, file_name) in
            [("unet", crate::weights::WEIGHTS), ("vae", crate::weights::WEIGHTS), ("text_encoder", "model.safetensors")]
        {
            let tensors = parts.remove(component).unwrap_or_default();
            if tensors.is_empty() {
                return Err(bad(format!("no {component} weights")));
            }
            let dir = staging.join(component);
            std::fs::create_dir_all(&dir).map_err(io(dir.clone()))?;
            std::fs::copy(configs.join(component).join("config.json"), dir.join("config.json"))
                .map_err(io(configs.join(component).join("config.json")))?;
            count += tensors.len();
            data::checkpoint::save_tensors(&tensors, &dir.join(file_name))?;
        }
        for dir in ["tokenizer", "scheduler"] {
            let (from, to) = (configs.join(dir), staging.join(dir));
            std::fs::create_dir_all(&to).map_err(io(to.clone()))?;
            for entry in std::fs::read_dir(&from).map_err(io(from.clone()))? {
                let entry = entry.map_err(io(from.clone()))?;
                std::fs::copy(entry.path(), to.join(entry.file_name())).map_err(io(entry.path()))?;
            }
        }
        std::fs::copy(configs.join("model_index.json"), staging.join("model_index.json"))
            .map_err(io(configs.join("model_index.json")))?;
        if out.exists() {
            return Err(Error::Invalid(format!("{} exists; convert into a new folder", out.display())));
        }
        std::fs::rename(&staging, out).map_err(io(out.to_path_buf()))?;
        Ok(count)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}
