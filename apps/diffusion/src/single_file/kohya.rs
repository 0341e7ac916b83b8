//! LoRA adapters from diffusers' layout (`pytorch_lora_weights.safetensors`, as
//! `diffusion finetune --lora-rank` saves them: `unet.<module>.lora.down.weight` and
//! `.lora.up.weight`, the scale folded into `up`) to kohya's, which A1111 and ComfyUI load:
//! `lora_unet_<module with . as _>.lora_down.weight`, `.lora_up.weight` and `.alpha`. kohya's
//! loaders scale `up @ down` by `alpha / rank`; with the scale already in `up`, alpha is the rank.
use std::collections::BTreeMap;
use std::path::Path;

use tch::Tensor;

use crate::{Error, Result};

/// Converts the diffusers LoRA file `lora` into the kohya file `out` (written atomically).
/// Returns the number of adapted modules. A key outside the UNet's adapters, an adapter
/// missing its `down` or `up`, or ranks that disagree are errors naming the file and key.
pub fn lora_to_kohya(lora: &Path, out: &Path) -> Result<usize> {
    let bad = |msg: String| Error::Format { path: lora.to_path_buf(), msg };
    let mut modules: BTreeMap<String, [Option<Tensor>; 2]> = BTreeMap::new();
    for (key, t) in data::checkpoint::read_tensors(lora)? {
        let parsed = key.strip_prefix("unet.").and_then(|k| {
            k.strip_suffix(".lora.down.weight")
                .map(|m| (m, 0))
                .or_else(|| k.strip_suffix(".lora.up.weight").map(|m| (m, 1)))
        });
        let (module, which) = parsed.ok_or_else(|| {
            bad(format!("key {key} is not a UNet adapter (unet.<module>.lora.down.weight or .lora.up.weight)"))
        })?;
        if t.dim() != 2 {
            return Err(bad(format!("key {key}: shape {:?}, expected a matrix", t.size())));
        }
        modules.entry(module.to_string()).or_default()[which] = Some(t);
    }
    if modules.is_empty() {
        return Err(bad("no adapters".into()));
    }
    let mut named = vec![];
    for (module, [down, up]) in &modules {
        let missing = |which: &str| bad(format!("key unet.{module}.lora.{which}.weight is missing"));
        let down = down.as_ref().ok_or_else(|| missing("down"))?;
        let up = up.as_ref().ok_or_else(|| missing("up"))?;
        let rank = down.size()[0];
        if up.size()[1] != rank {
            return Err(bad(format!(
                "key unet.{module}.lora.up.weight: shape {:?} does not match the rank {rank} of lora.down.weight",
                up.size()
            )));
        }
        let name = format!("lora_unet_{}", module.replace('.', "_"));
        named.push((format!("{name}.alpha"), Tensor::from(rank as f32)));
        named.push((format!("{name}.lora_down.weight"), down.shallow_clone()));
        named.push((format!("{name}.lora_up.weight"), up.shallow_clone()));
    }
    data::checkpoint::save_tensors(&named, out)?;
    Ok(modules.len())
}
