//! LoRA files as users have them, for adding to a UNet or converting: three namings of one
//! UNet module's adapter, each read with the scale its own loaders apply, folded into `up`
//! (so that every adapter below means `W + up @ down`):
//!
//! - diffusers' (`unet.<module>.lora.down.weight` / `.lora.up.weight`, as `diffusion
//!   finetune` and diffusers' training scripts save them) and peft's (`unet.<module>.lora_A.weight`
//!   / `.lora_B.weight`, what `save_lora_weights` writes from a peft state dict): scaled by
//!   `lora_alpha / r` of the `lora_adapter_metadata` that current diffusers records in the
//!   file's header (`unet.lora_alpha`, `unet.r`, `unet.use_rslora`), as `load_lora_weights`
//!   builds its peft config from it; a file without it means scale 1, as diffusers reads it;
//! - kohya's (`lora_unet_<module with . as _>.lora_down.weight` / `.lora_up.weight` /
//!   `.alpha`, what `diffusion convert --lora`, sd-scripts, A1111 and ComfyUI use): scaled by
//!   `alpha / rank` (no `.alpha`: 1), as kohya's loaders do.
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use tch::{Kind, Tensor};

use crate::{Error, Result};

/// The header entry in which diffusers records the adapters' peft configuration.
const METADATA: &str = "lora_adapter_metadata";

/// One adapted module: `down` [rank, in] and `up` [out, rank] with the file's scale folded in
/// (fp32), and the keys they came from.
pub struct Adapter {
    pub down_key: String,
    pub up_key: String,
    pub down: Tensor,
    pub up: Tensor,
}

/// The adapters of one LoRA file, by module as the file names it (dotted for diffusers' and
/// peft's names, underscored for kohya's).
pub struct LoraFile {
    pub path: PathBuf,
    adapters: BTreeMap<String, Adapter>,
}

/// The key of the other half of the adapter `key` holds half of, in the same naming.
fn partner(key: &str) -> String {
    for (a, b) in [(".lora.down.", ".lora.up."), (".lora_A.", ".lora_B."), (".lora_down.", ".lora_up.")] {
        if key.contains(a) {
            return key.replace(a, b);
        }
        if key.contains(b) {
            return key.replace(b, a);
        }
    }
    key.to_string()
}

/// Which half of an adapter a key holds.
enum Half {
    Down,
    Up,
    Alpha,
}

/// (module, naming is kohya's, half) of a key; None for a key of no UNet adapter.
fn parse(key: &str) -> Option<(&str, bool, Half)> {
    if let Some(rest) = key.strip_prefix("unet.") {
        for (suffix, half) in [
            (".lora.down.weight", Half::Down),
            (".lora.up.weight", Half::Up),
            (".lora_A.weight", Half::Down),
            (".lora_B.weight", Half::Up),
        ] {
            if let Some(module) = rest.strip_suffix(suffix) {
                return Some((module, false, half));
            }
        }
    }
    let rest = key.strip_prefix("lora_unet_")?;
    for (suffix, half) in [(".lora_down.weight", Half::Down), (".lora_up.weight", Half::Up), (".alpha", Half::Alpha)] {
        if let Some(module) = rest.strip_suffix(suffix) {
            return Some((module, true, half));
        }
    }
    None
}

impl LoraFile {
    /// Reads the file at `path`. A key of no UNet adapter, an adapter missing a half, shapes
    /// whose ranks disagree, non-float weights or a configuration this reader cannot apply
    /// (DoRA, per-module patterns) are errors naming the file and the key or entry.
    pub fn read(path: &Path) -> Result<LoraFile> {
        let bad = |msg: String| Error::Format { path: path.to_path_buf(), msg };
        let config = PeftScale::from_metadata(&data::checkpoint::read_metadata(path)?).map_err(&bad)?;
        // module -> (kohya naming, down, up, alpha), each with its key.
        type Parts = (bool, Option<(String, Tensor)>, Option<(String, Tensor)>, Option<(String, Tensor)>);
        let mut parts: BTreeMap<String, Parts> = BTreeMap::new();
        for (key, t) in data::checkpoint::read_tensors(path)? {
            let (module, kohya, half) = parse(&key).ok_or_else(|| {
                bad(format!(
                    "key {key} is not a UNet adapter's (diffusers' unet.<module>.lora.down.weight, peft's \
                     unet.<module>.lora_A.weight or kohya's lora_unet_<module>.lora_down.weight; only UNet \
                     LoRA is read)"
                ))
            })?;
            if !matches!(half, Half::Alpha) && t.dim() != 2 {
                return Err(bad(format!("key {key}: shape {:?}, expected a matrix", t.size())));
            }
            data::checkpoint::floating(&key, &t).map_err(&bad)?;
            let entry = parts.entry(module.to_string()).or_insert((kohya, None, None, None));
            let slot = match half {
                Half::Down => &mut entry.1,
                Half::Up => &mut entry.2,
                Half::Alpha => &mut entry.3,
            };
            if let Some((other, _)) = slot.replace((key.clone(), t)) {
                return Err(bad(format!("keys {other} and {key} are the same half of one adapter")));
            }
        }
        let mut adapters = BTreeMap::new();
        for (module, (kohya, down, up, alpha)) in parts {
            let (down_key, down, up_key, up) = match (down, up) {
                (Some((dk, d)), Some((uk, u))) => (dk, d, uk, u),
                (Some((key, _)), None) | (None, Some((key, _))) => {
                    return Err(bad(format!("missing key {}", partner(&key))))
                }
                (None, None) => return Err(bad(format!("missing key lora_unet_{module}.lora_down.weight"))),
            };
            let rank = down.size()[0];
            if up.size()[1] != rank {
                return Err(bad(format!(
                    "keys {down_key} {:?} and {up_key} {:?}: the ranks disagree",
                    down.size(),
                    up.size()
                )));
            }
            let scale = match (kohya, alpha) {
                (true, Some((key, alpha))) => {
                    let alpha = match alpha.numel() {
                        1 => alpha.to_kind(Kind::Double).flatten(0, -1).double_value(&[0]),
                        _ => return Err(bad(format!("key {key}: shape {:?}, expected one number", alpha.size()))),
                    };
                    if !alpha.is_finite() {
                        return Err(bad(format!("key {key}: {alpha} is not a finite alpha")));
                    }
                    alpha / rank as f64
                }
                (true, None) => 1.0,
                (false, _) => config.scale(rank).map_err(|msg| bad(format!("{down_key}: {msg}")))?,
            };
            let down = down.to_kind(Kind::Float);
            let up = up.to_kind(Kind::Float) * scale;
            adapters.insert(module, Adapter { down_key, up_key, down, up });
        }
        if adapters.is_empty() {
            return Err(bad("no LoRA adapters in the file".into()));
        }
        Ok(LoraFile { path: path.to_path_buf(), adapters })
    }

    /// Takes the adapter of `module`, a dotted UNet module path (kohya's underscored name of
    /// it matches too).
    pub fn take(&mut self, module: &str) -> Option<Adapter> {
        self.adapters.remove(module).or_else(|| self.adapters.remove(&module.replace('.', "_")))
    }

    /// The adapters not taken, by module as the file names it.
    pub fn into_rest(self) -> BTreeMap<String, Adapter> {
        self.adapters
    }
}

/// The scale peft gives the modules of a diffusers or peft file, from diffusers' metadata.
#[derive(Debug, PartialEq)]
struct PeftScale {
    /// `r` and `lora_alpha` (None without metadata: scale 1).
    base: Option<(f64, f64)>,
    rslora: bool,
}

impl PeftScale {
    fn from_metadata(metadata: &HashMap<String, String>) -> std::result::Result<PeftScale, String> {
        let Some(text) = metadata.get(METADATA) else { return Ok(PeftScale { base: None, rslora: false }) };
        let all: HashMap<String, serde_json::Value> =
            serde_json::from_str(text).map_err(|e| format!("header entry {METADATA}: {e}"))?;
        let entry = |name: &str| all.get(&format!("unet.{name}")).filter(|v| !v.is_null());
        let number = |name: &str| -> std::result::Result<Option<f64>, String> {
            match entry(name) {
                None => Ok(None),
                Some(v) => match v.as_f64().filter(|x| x.is_finite() && *x > 0.0) {
                    Some(x) => Ok(Some(x)),
                    None => Err(format!("{METADATA}: unet.{name} is {v}, not a positive number")),
                },
            }
        };
        // Per-module ranks and alphas are matched by regular expressions in peft; refused
        // rather than matched differently.
        for pattern in ["rank_pattern", "alpha_pattern"] {
            if entry(pattern).is_some_and(|v| v.as_object().is_none_or(|m| !m.is_empty())) {
                return Err(format!("{METADATA}: unet.{pattern} is not empty; per-module patterns are not supported"));
            }
        }
        if entry("use_dora").and_then(|v| v.as_bool()) == Some(true) {
            return Err(format!("{METADATA}: unet.use_dora is true; DoRA adapters are not supported"));
        }
        let (r, alpha) = (number("r")?, number("lora_alpha")?);
        // peft's defaults: r 8, lora_alpha 8.
        let base = (r.is_some() || alpha.is_some()).then(|| (r.unwrap_or(8.0), alpha.unwrap_or(8.0)));
        Ok(PeftScale { base, rslora: entry("use_rslora").and_then(|v| v.as_bool()).unwrap_or(false) })
    }

    /// The scale of an adapter of `rank`, which must be the configured `r`.
    fn scale(&self, rank: i64) -> std::result::Result<f64, String> {
        let Some((r, alpha)) = self.base else { return Ok(1.0) };
        if r != rank as f64 {
            return Err(format!("rank {rank}, but {METADATA} gives r = {r}"));
        }
        Ok(if self.rslora { alpha / r.sqrt() } else { alpha / r })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scale(json: Option<&str>, rank: i64) -> std::result::Result<f64, String> {
        let metadata = json.map(|j| HashMap::from([(METADATA.to_string(), j.to_string())])).unwrap_or_default();
        PeftScale::from_metadata(&metadata)?.scale(rank)
    }

    #[test]
    fn peft_scales_follow_diffusers_metadata() {
        assert_eq!(scale(None, 4), Ok(1.0), "no metadata: diffusers reads alpha = rank");
        assert_eq!(scale(Some(r#"{"unet.r": 4, "unet.lora_alpha": 16}"#), 4), Ok(4.0));
        assert_eq!(scale(Some(r#"{"unet.r": 4, "unet.lora_alpha": 16, "unet.use_rslora": true}"#), 4), Ok(8.0));
        assert_eq!(scale(Some(r#"{"unet.r": 8, "unet.rank_pattern": {}, "unet.alpha_pattern": {}}"#), 8), Ok(1.0));
        let err = |json: &str, rank: i64| scale(Some(json), rank).unwrap_err();
        assert!(err(r#"{"unet.r": 4, "unet.lora_alpha": 16}"#, 2).contains("rank 2, but"));
        assert!(err(r#"{"unet.r": 4, "unet.use_dora": true}"#, 4).contains("DoRA"));
        assert!(err(r#"{"unet.r": 4, "unet.alpha_pattern": {"to_q": 2}}"#, 4).contains("alpha_pattern"));
        assert!(err(r#"{"unet.r": 0}"#, 4).contains("unet.r is 0"));
        assert!(err("not json", 4).contains(METADATA));
    }
}
