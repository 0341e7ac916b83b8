//! LoRA adapters from diffusers' layout (`pytorch_lora_weights.safetensors`, as `diffusion
//! finetune --lora-rank` saves them: `unet.<module>.lora.down.weight` and `.lora.up.weight`,
//! the scale folded into `up`), or peft's, to kohya's, which A1111 and ComfyUI load:
//! `lora_unet_<module with . as _>.lora_down.weight`, `.lora_up.weight` and `.alpha`. kohya's
//! loaders scale `up @ down` by `alpha / rank`; with the scale already in `up`, alpha is the rank.
use std::path::Path;

use tch::Tensor;

use crate::lora_file::LoraFile;
use crate::Result;

/// Converts the LoRA file `lora` (diffusers', peft's or kohya's naming, read at its own scale:
/// see [`crate::lora_file`]) into the kohya file `out` (a new `.safetensors` file, written
/// atomically). Returns the number of adapted modules. A key outside the UNet's adapters, an
/// adapter missing its `down` or `up`, or ranks that disagree are errors naming the file and
/// key.
pub fn lora_to_kohya(lora: &Path, out: &Path) -> Result<usize> {
    super::check_new_safetensors(out)?;
    let adapters = LoraFile::read(lora)?.into_rest();
    let mut named = vec![];
    for (module, a) in &adapters {
        // The scale is in `up` already: alpha is the rank.
        let name = format!("lora_unet_{}", module.replace('.', "_"));
        named.push((format!("{name}.alpha"), Tensor::from(a.down.size()[0] as f32)));
        named.push((format!("{name}.lora_down.weight"), a.down.shallow_clone()));
        named.push((format!("{name}.lora_up.weight"), a.up.shallow_clone()));
    }
    data::checkpoint::save_tensors(&named, out)?;
    Ok(adapters.len())
}
