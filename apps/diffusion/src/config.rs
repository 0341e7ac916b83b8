//! diffusers configuration files: `model_index.json` of a pipeline folder and the
//! `config.json` of its `unet` and `vae` components. Each file is mirrored verbatim by a serde
//! struct (keys this crate does not model are kept, so a saved config round-trips), then
//! checked into the validated `UNetConfig` / `VaeConfig` the models are built from. An option
//! this crate does not implement is an error naming its key, never silently ignored.
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{Error, Result};

/// Reads a JSON file into `T`; errors name the file (serde's message names the field).
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|e| Error::Format { path: path.to_path_buf(), msg: e.to_string() })
}

/// Checks that `model_index.json` at `path` lists `component` as diffusers' class `class`
/// (`"unet": ["diffusers", "UNet2DConditionModel"]`).
pub fn check_model_index(path: &Path, component: &str, class: &str) -> Result<()> {
    let index: Map<String, Value> = read_json(path)?;
    let bad = |msg: String| Error::Format { path: path.to_path_buf(), msg };
    let entry = index.get(component).ok_or_else(|| bad(format!("no key {component:?}")))?;
    match entry.as_array().map(|a| a.iter().map(Value::as_str).collect::<Vec<_>>()).as_deref() {
        Some([Some(_), Some(c)]) if *c == class => Ok(()),
        _ => Err(bad(format!("key {component:?} is {entry}, expected [\"diffusers\", \"{class}\"]"))),
    }
}

/// An integer, or one integer per block (`attention_head_dim` of SD1 vs SD2).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PerBlock {
    /// The same value for every block.
    All(i64),
    /// One value per down block.
    Each(Vec<i64>),
}

impl PerBlock {
    fn expand(&self, key: &str, blocks: usize) -> std::result::Result<Vec<i64>, String> {
        match self {
            PerBlock::All(v) => Ok(vec![*v; blocks]),
            PerBlock::Each(v) if v.len() == blocks => Ok(v.clone()),
            PerBlock::Each(v) => Err(format!("{key} has {} entries, expected one per block ({blocks})", v.len())),
        }
    }
}

fn d_true() -> bool {
    true
}
fn d_silu() -> String {
    "silu".into()
}
fn d_one() -> Value {
    Value::from(1)
}
fn d_false() -> Value {
    Value::Bool(false)
}

/// diffusers' `unet/config.json` (`UNet2DConditionModel`, diffusers
/// `models/unets/unet_2d_condition.py`), with diffusers' defaults for absent keys.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UNetConfigFile {
    /// Latent channels in.
    #[serde(default = "UNetConfigFile::d_channels")]
    pub in_channels: i64,
    /// Channels out (the predicted noise).
    #[serde(default = "UNetConfigFile::d_channels")]
    pub out_channels: i64,
    /// Width of each resolution level.
    #[serde(default = "UNetConfigFile::d_block_out_channels")]
    pub block_out_channels: Vec<i64>,
    /// `CrossAttnDownBlock2D` or `DownBlock2D`, one per level.
    #[serde(default = "UNetConfigFile::d_down")]
    pub down_block_types: Vec<String>,
    /// `CrossAttnUpBlock2D` or `UpBlock2D`, one per level, deepest first.
    #[serde(default = "UNetConfigFile::d_up")]
    pub up_block_types: Vec<String>,
    /// Resnets per down block (up blocks have one more).
    #[serde(default = "UNetConfigFile::d_layers")]
    pub layers_per_block: i64,
    /// Despite its name, the number of attention heads per block (diffusers issue 2011).
    #[serde(default = "UNetConfigFile::d_head_dim")]
    pub attention_head_dim: PerBlock,
    /// Heads per block, where a config states them under their right name.
    #[serde(default)]
    pub num_attention_heads: Option<PerBlock>,
    /// Width of the text encoder's hidden states.
    #[serde(default = "UNetConfigFile::d_cross")]
    pub cross_attention_dim: i64,
    /// Linear `proj_in`/`proj_out` in the transformers (SD2) instead of 1x1 convolutions (SD1).
    #[serde(default)]
    pub use_linear_projection: bool,
    /// GroupNorm groups.
    #[serde(default = "UNetConfigFile::d_groups")]
    pub norm_num_groups: i64,
    /// GroupNorm epsilon of the resnets and the output norm.
    #[serde(default = "UNetConfigFile::d_eps")]
    pub norm_eps: f64,
    /// Timestep embedding order `cos, sin` instead of `sin, cos`.
    #[serde(default = "d_true")]
    pub flip_sin_to_cos: bool,
    /// Frequency shift of the timestep embedding.
    #[serde(default)]
    pub freq_shift: f64,
    /// Activation; only `silu` (alias `swish`).
    #[serde(default = "d_silu")]
    pub act_fn: String,
    /// Attention in float32 under half precision; accepted (SDPA keeps softmax in float32).
    #[serde(default)]
    pub upcast_attention: bool,
    /// Transformer layers per down block: one number for all, or one per block (SDXL's
    /// `[1, 2, 10]`); the up blocks take them reversed, the mid block the last.
    #[serde(default = "d_one")]
    pub transformer_layers_per_block: Value,
    /// The up blocks' transformer layers where they are not the down blocks' reversed.
    #[serde(default)]
    pub reverse_transformer_layers_per_block: Option<Vec<i64>>,
    /// `"text_time"` (SDXL): an embedding of the pooled text and the size/crop ids added to
    /// the timestep embedding; absent or null for SD 1.x/2.x.
    #[serde(default)]
    pub addition_embed_type: Option<String>,
    /// Width of the sinusoidal embedding of each of the time ids (SDXL: 256).
    #[serde(default)]
    pub addition_time_embed_dim: Option<i64>,
    /// Input width of `add_embedding`: the pooled text's plus six time ids' embeddings (SDXL:
    /// 1280 + 6 * 256 = 2816).
    #[serde(default)]
    pub projection_class_embeddings_input_dim: Option<i64>,
    /// Cross-attention in place of self-attention; only false.
    #[serde(default = "d_false")]
    pub only_cross_attention: Value,
    /// Two text encoders; only false.
    #[serde(default)]
    pub dual_cross_attention: bool,
    /// Latent height and width the model was trained at.
    #[serde(default)]
    pub sample_size: Option<i64>,
    /// Every other key, kept as written (`_class_name`, options checked by `UNetConfig::new`).
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl UNetConfigFile {
    fn d_channels() -> i64 {
        4
    }
    fn d_block_out_channels() -> Vec<i64> {
        vec![320, 640, 1280, 1280]
    }
    fn d_down() -> Vec<String> {
        ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"].map(String::from).into()
    }
    fn d_up() -> Vec<String> {
        ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"].map(String::from).into()
    }
    fn d_layers() -> i64 {
        2
    }
    fn d_head_dim() -> PerBlock {
        PerBlock::All(8)
    }
    fn d_cross() -> i64 {
        1280
    }
    fn d_groups() -> i64 {
        32
    }
    fn d_eps() -> f64 {
        1e-5
    }
}

/// UNet options whose every other value changes the architecture in ways not implemented
/// here: the key and the values accepted (absent is accepted too).
const UNET_FIXED: &[(&str, &[&str])] = &[
    ("center_input_sample", &["false"]),
    ("class_embed_type", &["null"]),
    ("num_class_embeds", &["null"]),
    ("class_embeddings_concat", &["false"]),
    ("time_cond_proj_dim", &["null"]),
    ("time_embedding_type", &["\"positional\""]),
    ("time_embedding_dim", &["null"]),
    ("time_embedding_act_fn", &["null"]),
    ("timestep_post_act", &["null"]),
    ("encoder_hid_dim", &["null"]),
    ("encoder_hid_dim_type", &["null"]),
    ("mid_block_type", &["\"UNetMidBlock2DCrossAttn\""]),
    ("mid_block_only_cross_attention", &["null", "false"]),
    ("mid_block_scale_factor", &["1"]),
    ("resnet_time_scale_shift", &["\"default\""]),
    ("resnet_skip_time_act", &["false"]),
    ("resnet_out_scale_factor", &["1"]),
    ("cross_attention_norm", &["null"]),
    ("attention_type", &["\"default\""]),
    ("conv_in_kernel", &["3"]),
    ("conv_out_kernel", &["3"]),
    ("downsample_padding", &["1"]),
    ("dropout", &["0"]),
];

/// Checks `other`'s keys against `fixed`; the error names the key, its value and what works.
fn check_fixed(other: &Map<String, Value>, fixed: &[(&str, &[&str])]) -> std::result::Result<(), String> {
    for (key, accepted) in fixed {
        let Some(value) = other.get(*key) else { continue };
        let ok = accepted.iter().any(|a| {
            let a: Value = serde_json::from_str(a).unwrap_or(Value::Null);
            match (a.as_f64(), value.as_f64()) {
                (Some(x), Some(y)) => x == y,
                _ => a == *value,
            }
        });
        if !ok {
            return Err(format!("{key} = {value} is not supported (supported: {})", accepted.join(" or ")));
        }
    }
    Ok(())
}

/// A validated UNet architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct UNetConfig {
    /// Latent channels in.
    pub in_channels: i64,
    /// Channels out.
    pub out_channels: i64,
    /// Width of each resolution level.
    pub block_out_channels: Vec<i64>,
    /// Whether each down block has cross-attention transformers.
    pub down_attention: Vec<bool>,
    /// Whether each up block (deepest first) has cross-attention transformers.
    pub up_attention: Vec<bool>,
    /// Resnets per down block.
    pub layers_per_block: i64,
    /// Attention heads of each down block (up blocks take them reversed, the mid block the last).
    pub heads: Vec<i64>,
    /// Width of the encoder hidden states.
    pub cross_attention_dim: i64,
    /// Linear (SD2) or 1x1-conv (SD1) transformer projections.
    pub use_linear_projection: bool,
    /// GroupNorm groups.
    pub norm_num_groups: i64,
    /// GroupNorm epsilon of resnets and the output norm.
    pub norm_eps: f64,
    /// Timestep embedding order `cos, sin`.
    pub flip_sin_to_cos: bool,
    /// Timestep embedding frequency shift.
    pub freq_shift: f64,
    /// Transformer layers in each down block's transformers (unused for plain blocks).
    pub down_depth: Vec<i64>,
    /// Transformer layers in each up block's transformers, deepest block first.
    pub up_depth: Vec<i64>,
    /// SDXL's added text-time embedding, where the config asks for it.
    pub text_time: Option<TextTimeConfig>,
    /// The file this was read from, written back when the model is saved.
    pub source: UNetConfigFile,
}

/// SDXL's `addition_embed_type = "text_time"`: `add_time_proj` (a sinusoidal embedding of each
/// time id) and `add_embedding` (two linear layers from the pooled text and those embeddings
/// to the timestep embedding's width).
#[derive(Clone, Debug, PartialEq)]
pub struct TextTimeConfig {
    /// Width of each time id's embedding.
    pub time_embed_dim: i64,
    /// Input width of `add_embedding` (pooled text width + time ids * `time_embed_dim`).
    pub input_dim: i64,
}

impl TextTimeConfig {
    /// The pooled text width this config takes with `ids` time ids (SDXL: 6).
    pub fn pooled_dim(&self, ids: i64) -> i64 {
        self.input_dim - ids * self.time_embed_dim
    }
}

/// The transformer depth of each down block from `transformer_layers_per_block` (a number or
/// one per block).
fn depths(value: &Value, n: usize) -> std::result::Result<Vec<i64>, String> {
    let bad = || format!("transformer_layers_per_block = {value} must be a positive integer or one per block ({n})");
    let v: Vec<i64> = match value {
        Value::Array(a) => a.iter().map(|x| x.as_i64().ok_or_else(bad)).collect::<std::result::Result<_, _>>()?,
        v => vec![v.as_i64().ok_or_else(bad)?; n],
    };
    if v.len() != n || v.iter().any(|&d| d <= 0) {
        return Err(bad());
    }
    Ok(v)
}

/// SDXL's text-time options: all three keys or none.
fn text_time(f: &UNetConfigFile) -> std::result::Result<Option<TextTimeConfig>, String> {
    match (f.addition_embed_type.as_deref(), f.addition_time_embed_dim, f.projection_class_embeddings_input_dim) {
        (None, _, _) => Ok(None),
        (Some("text_time"), Some(t), Some(i)) if t > 0 && t % 2 == 0 && i > 6 * t => {
            Ok(Some(TextTimeConfig { time_embed_dim: t, input_dim: i }))
        }
        (Some("text_time"), t, i) => Err(format!(
            "addition_embed_type = \"text_time\" needs an even positive addition_time_embed_dim (found {t:?}) and \
             projection_class_embeddings_input_dim above 6 times it (found {i:?})"
        )),
        (Some(other), _, _) => {
            Err(format!("addition_embed_type = {other:?} is not supported (supported: null or \"text_time\")"))
        }
    }
}

fn block_kinds(types: &[String], key: &str, cross: &str, plain: &str) -> std::result::Result<Vec<bool>, String> {
    types
        .iter()
        .map(|t| match t.as_str() {
            t if t == cross => Ok(true),
            t if t == plain => Ok(false),
            _ => Err(format!("{key} has {t:?}; supported: {cross}, {plain}")),
        })
        .collect()
}

impl UNetConfig {
    /// Checks `file` (read from `path`, named in errors) and derives the architecture.
    pub fn new(file: &UNetConfigFile, path: &Path) -> Result<UNetConfig> {
        Self::check(file).map_err(|msg| Error::Format { path: path.to_path_buf(), msg })
    }

    fn check(f: &UNetConfigFile) -> std::result::Result<UNetConfig, String> {
        check_fixed(&f.other, UNET_FIXED)?;
        if !matches!(f.act_fn.as_str(), "silu" | "swish") {
            return Err(format!("act_fn = {:?} is not supported (supported: \"silu\")", f.act_fn));
        }
        if f.only_cross_attention != Value::Bool(false) {
            return Err(format!(
                "only_cross_attention = {} is not supported (supported: false)",
                f.only_cross_attention
            ));
        }
        if f.dual_cross_attention {
            return Err("dual_cross_attention = true is not supported (supported: false)".into());
        }
        let n = f.block_out_channels.len();
        if n == 0 || f.block_out_channels.iter().any(|&c| c <= 0) {
            return Err(format!("block_out_channels {:?} must be non-empty and positive", f.block_out_channels));
        }
        let down_attention =
            block_kinds(&f.down_block_types, "down_block_types", "CrossAttnDownBlock2D", "DownBlock2D")?;
        let up_attention = block_kinds(&f.up_block_types, "up_block_types", "CrossAttnUpBlock2D", "UpBlock2D")?;
        if down_attention.len() != n || up_attention.len() != n {
            return Err(format!(
                "down_block_types ({}) and up_block_types ({}) must have one entry per block_out_channels ({n})",
                down_attention.len(),
                up_attention.len()
            ));
        }
        let heads = match &f.num_attention_heads {
            Some(h) => h.expand("num_attention_heads", n)?,
            None => f.attention_head_dim.expand("attention_head_dim", n)?,
        };
        let g = f.norm_num_groups;
        for (i, (&c, &h)) in f.block_out_channels.iter().zip(&heads).enumerate() {
            if g <= 0 || c % g != 0 {
                return Err(format!("block_out_channels[{i}] = {c} does not split into norm_num_groups = {g}"));
            }
            if h <= 0 || c % h != 0 {
                return Err(format!("block_out_channels[{i}] = {c} does not split into {h} attention heads"));
            }
        }
        if f.in_channels <= 0 || f.out_channels <= 0 || f.layers_per_block <= 0 || f.cross_attention_dim <= 0 {
            return Err("in_channels, out_channels, layers_per_block and cross_attention_dim must be positive".into());
        }
        let down_depth = depths(&f.transformer_layers_per_block, n)?;
        let up_depth = match &f.reverse_transformer_layers_per_block {
            Some(r) => depths(&Value::from(r.clone()), n)
                .map_err(|e| e.replace("transformer_layers_per_block", "reverse_transformer_layers_per_block"))?,
            None => down_depth.iter().rev().copied().collect(),
        };
        if f.block_out_channels[0] % 2 != 0 {
            return Err(format!(
                "block_out_channels[0] = {} must be even (timestep embedding)",
                f.block_out_channels[0]
            ));
        }
        Ok(UNetConfig {
            in_channels: f.in_channels,
            out_channels: f.out_channels,
            block_out_channels: f.block_out_channels.clone(),
            down_attention,
            up_attention,
            layers_per_block: f.layers_per_block,
            heads,
            cross_attention_dim: f.cross_attention_dim,
            use_linear_projection: f.use_linear_projection,
            norm_num_groups: g,
            norm_eps: f.norm_eps,
            flip_sin_to_cos: f.flip_sin_to_cos,
            freq_shift: f.freq_shift,
            down_depth,
            up_depth,
            text_time: text_time(f)?,
            source: f.clone(),
        })
    }
}

/// diffusers' `vae/config.json` (`AutoencoderKL`, diffusers
/// `models/autoencoders/autoencoder_kl.py`), with diffusers' defaults for absent keys.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VaeConfigFile {
    /// Image channels in.
    #[serde(default = "VaeConfigFile::d_rgb")]
    pub in_channels: i64,
    /// Image channels out.
    #[serde(default = "VaeConfigFile::d_rgb")]
    pub out_channels: i64,
    /// `DownEncoderBlock2D`, one per level.
    #[serde(default = "VaeConfigFile::d_down")]
    pub down_block_types: Vec<String>,
    /// `UpDecoderBlock2D`, one per level.
    #[serde(default = "VaeConfigFile::d_up")]
    pub up_block_types: Vec<String>,
    /// Width of each resolution level.
    #[serde(default = "VaeConfigFile::d_channels")]
    pub block_out_channels: Vec<i64>,
    /// Resnets per encoder block (decoder blocks have one more).
    #[serde(default = "VaeConfigFile::d_layers")]
    pub layers_per_block: i64,
    /// Activation; only `silu`.
    #[serde(default = "d_silu")]
    pub act_fn: String,
    /// Latent channels.
    #[serde(default = "VaeConfigFile::d_latent")]
    pub latent_channels: i64,
    /// GroupNorm groups.
    #[serde(default = "VaeConfigFile::d_groups")]
    pub norm_num_groups: i64,
    /// Image height and width the model was trained at.
    #[serde(default = "VaeConfigFile::d_sample")]
    pub sample_size: i64,
    /// Latents are multiplied by this before the UNet sees them.
    #[serde(default = "VaeConfigFile::d_scaling")]
    pub scaling_factor: f64,
    /// A 1x1 convolution after the encoder.
    #[serde(default = "d_true")]
    pub use_quant_conv: bool,
    /// A 1x1 convolution before the decoder.
    #[serde(default = "d_true")]
    pub use_post_quant_conv: bool,
    /// Self-attention in the mid blocks.
    #[serde(default = "d_true")]
    pub mid_block_add_attention: bool,
    /// Decode in float32 even when the pipeline computes in fp16 (SD and SDXL's VAEs overflow
    /// there), as diffusers' pipelines read it.
    #[serde(default = "d_true")]
    pub force_upcast: bool,
    /// Every other key, kept as written.
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

impl VaeConfigFile {
    fn d_rgb() -> i64 {
        3
    }
    fn d_down() -> Vec<String> {
        vec!["DownEncoderBlock2D".into()]
    }
    fn d_up() -> Vec<String> {
        vec!["UpDecoderBlock2D".into()]
    }
    fn d_channels() -> Vec<i64> {
        vec![64]
    }
    fn d_layers() -> i64 {
        1
    }
    fn d_latent() -> i64 {
        4
    }
    fn d_groups() -> i64 {
        32
    }
    fn d_sample() -> i64 {
        32
    }
    fn d_scaling() -> f64 {
        0.18215
    }
}

/// VAE options not implemented here (SD3/Flux latents shift, spatial norms).
const VAE_FIXED: &[(&str, &[&str])] = &[
    ("shift_factor", &["null", "0"]),
    ("norm_type", &["\"group\""]),
    ("latents_mean", &["null"]),
    ("latents_std", &["null"]),
];

/// A validated VAE architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct VaeConfig {
    /// Image channels in.
    pub in_channels: i64,
    /// Image channels out.
    pub out_channels: i64,
    /// Width of each resolution level.
    pub block_out_channels: Vec<i64>,
    /// Resnets per encoder block.
    pub layers_per_block: i64,
    /// Latent channels.
    pub latent_channels: i64,
    /// GroupNorm groups.
    pub norm_num_groups: i64,
    /// Image size the model was trained at.
    pub sample_size: i64,
    /// Latent scaling factor.
    pub scaling_factor: f64,
    /// Whether `quant_conv` exists.
    pub use_quant_conv: bool,
    /// Whether `post_quant_conv` exists.
    pub use_post_quant_conv: bool,
    /// Whether the mid blocks have attention.
    pub mid_block_add_attention: bool,
    /// Whether decoding must run in float32 whatever the compute kind.
    pub force_upcast: bool,
    /// The file this was read from.
    pub source: VaeConfigFile,
}

impl VaeConfig {
    /// Checks `file` (read from `path`, named in errors) and derives the architecture.
    pub fn new(file: &VaeConfigFile, path: &Path) -> Result<VaeConfig> {
        Self::check(file).map_err(|msg| Error::Format { path: path.to_path_buf(), msg })
    }

    fn check(f: &VaeConfigFile) -> std::result::Result<VaeConfig, String> {
        check_fixed(&f.other, VAE_FIXED)?;
        if !matches!(f.act_fn.as_str(), "silu" | "swish") {
            return Err(format!("act_fn = {:?} is not supported (supported: \"silu\")", f.act_fn));
        }
        let n = f.block_out_channels.len();
        block_kinds(&f.down_block_types, "down_block_types", "DownEncoderBlock2D", "DownEncoderBlock2D")?;
        block_kinds(&f.up_block_types, "up_block_types", "UpDecoderBlock2D", "UpDecoderBlock2D")?;
        if n == 0 || f.down_block_types.len() != n || f.up_block_types.len() != n {
            return Err(format!(
                "down_block_types ({}) and up_block_types ({}) must have one entry per block_out_channels ({n})",
                f.down_block_types.len(),
                f.up_block_types.len()
            ));
        }
        let g = f.norm_num_groups;
        for (i, &c) in f.block_out_channels.iter().enumerate() {
            if g <= 0 || c <= 0 || c % g != 0 {
                return Err(format!("block_out_channels[{i}] = {c} does not split into norm_num_groups = {g}"));
            }
        }
        if f.in_channels <= 0 || f.out_channels <= 0 || f.layers_per_block <= 0 || f.latent_channels <= 0 {
            return Err("in_channels, out_channels, layers_per_block and latent_channels must be positive".into());
        }
        Ok(VaeConfig {
            in_channels: f.in_channels,
            out_channels: f.out_channels,
            block_out_channels: f.block_out_channels.clone(),
            layers_per_block: f.layers_per_block,
            latent_channels: f.latent_channels,
            norm_num_groups: g,
            sample_size: f.sample_size,
            scaling_factor: f.scaling_factor,
            use_quant_conv: f.use_quant_conv,
            use_post_quant_conv: f.use_post_quant_conv,
            mid_block_add_attention: f.mid_block_add_attention,
            force_upcast: f.force_upcast,
            source: f.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unet(json: &str) -> std::result::Result<UNetConfig, String> {
        UNetConfig::check(&serde_json::from_str(json).map_err(|e| e.to_string())?)
    }

    #[test]
    fn defaults_are_sd15_and_unsupported_options_name_their_key() {
        let cfg = unet("{}").unwrap();
        assert_eq!(cfg.heads, vec![8; 4]);
        assert_eq!(cfg.down_attention, vec![true, true, true, false]);
        let sd2 = unet(r#"{"attention_head_dim": [5, 10, 20, 20], "use_linear_projection": true}"#).unwrap();
        assert_eq!(sd2.heads, vec![5, 10, 20, 20]);
        let err = unet(r#"{"class_embed_type": "timestep"}"#).unwrap_err();
        assert!(err.contains("class_embed_type = \"timestep\" is not supported"), "{err}");
        let err = unet(r#"{"attention_head_dim": [5, 10]}"#).unwrap_err();
        assert!(err.contains("attention_head_dim has 2 entries"), "{err}");
        let err = unet(r#"{"down_block_types": ["A", "B", "C", "D"]}"#).unwrap_err();
        assert!(err.contains("down_block_types has \"A\""), "{err}");
        assert!(unet(r#"{"resnet_out_scale_factor": 1.0, "mid_block_only_cross_attention": false}"#).is_ok());
        let err = unet(r#"{"transformer_layers_per_block": [1, 2]}"#).unwrap_err();
        assert!(err.contains("transformer_layers_per_block = [1,2] must be"), "{err}");
        let xl = unet(r#"{"transformer_layers_per_block": [1, 2, 10, 10]}"#).unwrap();
        assert_eq!((xl.down_depth, xl.up_depth), (vec![1, 2, 10, 10], vec![10, 10, 2, 1]));
        assert_eq!(xl.text_time, None);
        let xl = unet(
            r#"{"addition_embed_type": "text_time", "addition_time_embed_dim": 256,
                "projection_class_embeddings_input_dim": 2816}"#,
        )
        .unwrap();
        assert_eq!(xl.text_time.map(|t| t.pooled_dim(6)), Some(1280));
        let err = unet(r#"{"addition_embed_type": "text_time"}"#).unwrap_err();
        assert!(err.contains("needs an even positive addition_time_embed_dim"), "{err}");
        let err = unet(r#"{"addition_embed_type": "image"}"#).unwrap_err();
        assert!(err.contains("addition_embed_type = \"image\" is not supported"), "{err}");
    }
}
