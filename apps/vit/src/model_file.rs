//! The descriptions written beside trained weights (`model.safetensors`), and read back:
//!
//! - `model.json`: the architecture ([`VitConfig`]), the class names by label and the
//!   normalisation the model was trained with, so that `vit eval` and `--resume` prepare and
//!   label images as training did;
//! - `config.json` in timm's Hugging Face Hub layout (`architecture`, `model_args`,
//!   `pretrained_cfg`, `label_names`, as timm's `save_for_hf` writes it), so that
//!   `timm.create_model("local-dir:<folder>")` builds the same model, loads the weights and
//!   resolves the same preprocessing: mean and std, the centre crop of the whole shorter side
//!   (`crop_pct` 1.0) and bilinear resizing.
//!
//! A folder with only timm's `config.json` (a model saved by timm) is read too, where its
//! `model_args` describe a model this crate builds; anything else in them is an error naming
//! the key, never a model silently built otherwise (mean pooling, say, has the same weights).
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use serde_json::{json, Map, Value};

use crate::model::VitConfig;

/// timm's file in a Hub folder.
pub const TIMM_CONFIG: &str = "config.json";
/// This crate's file.
pub const MODEL_JSON: &str = "model.json";

/// `model.json`: the architecture, the class names by label (timm's `label_names`) and the
/// normalisation of training (timm's `mean` and `std`), each absent in older files.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct ModelFile {
    /// The architecture.
    #[serde(flatten)]
    pub config: VitConfig,
    /// Class names in label order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_names: Option<Vec<String>>,
    /// Per-channel means subtracted from pixels in [0, 1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean: Option<Vec<f64>>,
    /// Per-channel standard deviations they are divided by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub std: Option<Vec<f64>>,
}

impl ModelFile {
    /// Writes `model.json` and timm's `config.json` into `dir`, each atomically.
    pub fn write(&self, dir: &Path) -> anyhow::Result<()> {
        for (name, value) in [(MODEL_JSON, serde_json::to_value(self)?), (TIMM_CONFIG, self.timm_config())] {
            let text = serde_json::to_string_pretty(&value)?;
            data::write_atomic::<anyhow::Error>(&dir.join(name), |w| {
                Ok(std::io::Write::write_all(w, text.as_bytes())?)
            })?;
        }
        Ok(())
    }

    /// Reads the description of the weights in `dir`: `model.json`, or else timm's
    /// `config.json`. Returns it and the file it came from.
    pub fn read(dir: &Path) -> anyhow::Result<(ModelFile, PathBuf)> {
        let ours = dir.join(MODEL_JSON);
        let timm = dir.join(TIMM_CONFIG);
        let path = if ours.exists() || !timm.exists() { ours } else { timm };
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let file = match path.ends_with(MODEL_JSON) {
            true => serde_json::from_str(&text).with_context(|| format!("{}: not a model description", path.display())),
            false => serde_json::from_str(&text)
                .map_err(anyhow::Error::from)
                .and_then(|v| from_timm(&v))
                .with_context(|| format!("{}: not a timm ViT this crate builds", path.display())),
        }?;
        file.config.validate().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if let Some(n) =
            file.mean.iter().chain(&file.std).map(Vec::len).find(|&n| n != file.config.in_channels as usize)
        {
            bail!("{}: {n} means or stds for {} channels", path.display(), file.config.in_channels);
        }
        Ok((file, path))
    }

    /// What a timm `config.json` in `dir` asks of preprocessing that `vit eval` does otherwise
    /// (it takes the centre square, resized bilinearly), to be said before evaluating.
    pub fn timm_preprocessing_note(dir: &Path) -> Option<String> {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join(TIMM_CONFIG)).ok()?).ok()?;
        let cfg = v.get("pretrained_cfg")?;
        let crop = cfg.get("crop_pct").and_then(Value::as_f64).unwrap_or(1.0);
        let interpolation = cfg.get("interpolation").and_then(Value::as_str).unwrap_or("bilinear");
        (crop != 1.0 || interpolation != "bilinear").then(|| {
            format!(
                "note: {} asks for crop_pct {crop} and {interpolation} resizing; vit eval takes the centre square, \
                 resized bilinearly (timm's accuracy may differ slightly)",
                dir.join(TIMM_CONFIG).display()
            )
        })
    }

    /// The normalisation of training, when the file records it.
    pub fn normalize(&self) -> Option<data::augment::Normalize> {
        let f32s = |v: &Vec<f64>| v.iter().map(|&x| x as f32).collect();
        Some(data::augment::Normalize { mean: f32s(self.mean.as_ref()?), std: f32s(self.std.as_ref()?) })
    }

    /// `values` as the decimals they were written as (0.485, not 0.48500001430511475, the
    /// nearest f64 to that f32), for the JSON files.
    pub fn decimals(values: &[f32]) -> Vec<f64> {
        values.iter().map(|x| x.to_string().parse().unwrap_or(f64::from(*x))).collect()
    }

    /// timm's `config.json` for this model.
    fn timm_config(&self) -> Value {
        let c = &self.config;
        let mut cfg = json!({
            "architecture": timm_architecture(c),
            "num_classes": c.num_classes,
            "num_features": c.width,
            "global_pool": "token",
            "model_args": {
                "img_size": c.image_size,
                "patch_size": c.patch_size,
                "in_chans": c.in_channels,
                "num_classes": c.num_classes,
                "embed_dim": c.width,
                "depth": c.depth,
                "num_heads": c.heads,
                "mlp_ratio": c.mlp_ratio,
            },
            "pretrained_cfg": {
                "input_size": [c.in_channels, c.image_size, c.image_size],
                "fixed_input_size": true,
                "interpolation": "bilinear",
                "crop_pct": 1.0,
                "crop_mode": "center",
                "num_classes": c.num_classes,
                "first_conv": "patch_embed.proj",
                "classifier": "head",
            },
        });
        if let (Some(mean), Some(std)) = (&self.mean, &self.std) {
            cfg["pretrained_cfg"]["mean"] = json!(mean);
            cfg["pretrained_cfg"]["std"] = json!(std);
        }
        if let Some(names) = &self.label_names {
            cfg["label_names"] = json!(names);
        }
        cfg
    }
}

/// The timm name closest to `c` (its width's size and its patch, else ViT-B/16): with every
/// size in `model_args`, the name only picks timm's defaults for the rest, which are ours.
fn timm_architecture(c: &VitConfig) -> String {
    let size = match c.width {
        192 => "tiny",
        384 => "small",
        1024 => "large",
        _ => "base",
    };
    let patch = if c.patch_size == 32 { 32 } else { 16 };
    format!("vit_{size}_patch{patch}_224")
}

/// `model_args` keys of timm's `VisionTransformer` that change nothing in evaluation (dropout
/// rates), and those whose values must be timm's defaults (which this crate's model is).
const IGNORED_ARGS: [&str; 5] = ["drop_rate", "pos_drop_rate", "proj_drop_rate", "attn_drop_rate", "drop_path_rate"];

/// A [`ModelFile`] from timm's `config.json`.
fn from_timm(v: &Value) -> anyhow::Result<ModelFile> {
    let arch = v["architecture"].as_str().context("no \"architecture\"")?;
    // `vit_base_patch16_224.augreg_in21k`: the tag names the weights, not the architecture.
    let name = arch.split('.').next().unwrap_or(arch);
    let mut config = timm_base(name).with_context(|| {
        format!("architecture {arch:?} is not one of vit_{{tiny,small,base,large}}_patch{{16,32}}_<size>")
    })?;
    let empty = Map::new();
    let args = v.get("model_args").and_then(Value::as_object).unwrap_or(&empty);
    let pretrained = v.get("pretrained_cfg").and_then(Value::as_object).unwrap_or(&empty);
    if let Some(size) = pretrained.get("input_size").and_then(Value::as_array) {
        let dims: Vec<i64> = size.iter().filter_map(Value::as_i64).collect();
        match dims[..] {
            [c, h, w] if h == w => (config.in_channels, config.image_size) = (c, h),
            _ => bail!("pretrained_cfg.input_size {size:?} is not [channels, side, side]"),
        }
    }
    let int = |key: &str, value: &Value| {
        value.as_i64().with_context(|| format!("model_args.{key} is {value}, not an integer"))
    };
    // A side: `n`, or `[n, n]` as timm saves its tuples.
    let side = |key: &str, value: &Value| match value.as_array().map(|a| a.as_slice()) {
        Some([h, w]) if h == w => int(key, h),
        Some(_) => bail!("model_args.{key} is {value}, not a square's side"),
        None => int(key, value),
    };
    for (key, value) in args {
        match key.as_str() {
            "img_size" => config.image_size = side(key, value)?,
            "patch_size" => config.patch_size = side(key, value)?,
            "in_chans" => config.in_channels = int(key, value)?,
            "num_classes" => config.num_classes = int(key, value)?,
            "embed_dim" => config.width = int(key, value)?,
            "depth" => config.depth = int(key, value)?,
            "num_heads" => config.heads = int(key, value)?,
            "mlp_ratio" => config.mlp_ratio = value.as_f64().context("model_args.mlp_ratio is not a number")?,
            k if IGNORED_ARGS.contains(&k) => {}
            "global_pool" if *value == "token" => {}
            "class_token" | "qkv_bias" if *value == true => {}
            "no_embed_class" | "pre_norm" | "fc_norm" | "qk_norm" | "dynamic_img_size" if *value == false => {}
            "fc_norm" | "init_values" if value.is_null() => {}
            "reg_tokens" if *value == 0 => {}
            _ => bail!("model_args.{key} = {value} describes a model this crate does not build"),
        }
    }
    let num_classes = v.get("num_classes").or_else(|| pretrained.get("num_classes"));
    if let (Some(n), false) = (num_classes, args.contains_key("num_classes")) {
        config.num_classes = n.as_i64().with_context(|| format!("num_classes is {n}, not an integer"))?;
    }
    if let Some(pool) = v.get("global_pool").filter(|p| **p != "token") {
        bail!("global_pool {pool}: only class-token pooling (\"token\") is built");
    }
    let floats = |key: &str| -> anyhow::Result<Option<Vec<f64>>> {
        pretrained
            .get(key)
            .map(|v| serde_json::from_value(v.clone()).with_context(|| format!("pretrained_cfg.{key}")))
            .transpose()
    };
    let label_names =
        v.get("label_names").map(|v| serde_json::from_value(v.clone()).context("label_names")).transpose()?;
    Ok(ModelFile { config, label_names, mean: floats("mean")?, std: floats("std")? })
}

/// The preset of a timm name `vit_<size>_patch<p>_<side>` at that side.
fn timm_base(name: &str) -> Option<VitConfig> {
    let (stem, side) = name.rsplit_once('_')?;
    let side: i64 = side.parse().ok()?;
    let mut config = VitConfig::from_timm_name(&format!("{stem}_224"))?;
    config.image_size = side;
    Some(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timm_config_reads_back_as_the_same_model() {
        let file = ModelFile {
            config: VitConfig::digits(),
            label_names: Some((0..10).map(|i| i.to_string()).collect()),
            mean: Some(vec![0.5]),
            std: Some(vec![0.5]),
        };
        let back = from_timm(&file.timm_config()).unwrap();
        assert_eq!(back.config, file.config);
        assert_eq!((back.label_names, back.mean, back.std), (file.label_names, file.mean, file.std));
        // As timm's save_for_hf writes a model of img_size=8: its tuples as lists.
        let saved = json!({
            "architecture": "vit_tiny_patch16_224",
            "num_classes": 10,
            "global_pool": "token",
            "model_args": {"num_classes": 10, "img_size": [8, 8], "patch_size": 2, "in_chans": 1, "global_pool": "token"},
            "pretrained_cfg": {"input_size": [1, 8, 8], "mean": [0.5], "std": [0.5], "crop_pct": 0.9},
        });
        let read = from_timm(&saved).unwrap();
        let want = VitConfig { image_size: 8, patch_size: 2, in_channels: 1, num_classes: 10, ..VitConfig::tiny(16) };
        assert_eq!((read.config, read.mean), (want, Some(vec![0.5])));
    }

    #[test]
    fn timm_configs_of_other_models_are_refused_naming_the_key() {
        let base = |args: Value| json!({"architecture": "vit_base_patch16_224.augreg_in21k", "model_args": args});
        let read = |args: Value| from_timm(&base(args)).map(|f| f.config);
        assert_eq!(read(json!({"drop_path_rate": 0.1})).unwrap(), VitConfig::base(16));
        for (key, value) in [
            ("global_pool", json!("avg")),
            ("class_token", json!(false)),
            ("qkv_bias", json!(false)),
            ("init_values", json!(1e-5)),
            ("reg_tokens", json!(4)),
            ("act_layer", json!("gelu_tanh")),
        ] {
            let err = read(json!({ key: value })).unwrap_err().to_string();
            assert!(err.contains(&format!("model_args.{key}")), "{key}: {err}");
        }
        let err = from_timm(&json!({"architecture": "vit_base_patch16_clip_224"})).unwrap_err().to_string();
        assert!(err.contains("vit_base_patch16_clip_224"), "{err}");
        let err = from_timm(&json!({"architecture": "vit_base_patch16_224", "global_pool": "avg"})).unwrap_err();
        assert!(err.to_string().contains("global_pool"), "{err}");
    }
}
