//! Original Stable Diffusion checkpoints in one file (`v1-5-pruned-emaonly.safetensors`,
//! `v2-1_768-ema-pruned.safetensors`, `sd_xl_base_1.0.safetensors`: `model.diffusion_model.*`
//! for the UNet, `first_stage_model.*` for the VAE, and the text encoder as
//! `cond_stage_model.transformer.*` (SD 1.x, OpenAI CLIP in transformers' names) or
//! `cond_stage_model.model.*` (SD 2.x, OpenCLIP, see [`open_clip`]), or SDXL's two as
//! `conditioner.embedders.0.transformer.*` (CLIP ViT-L) and `conditioner.embedders.1.model.*`
//! (OpenCLIP ViT-bigG with its projection)) to a diffusers folder and back.
//!
//! A single file holds no configuration and no tokenizer: they come from the configs shipped
//! for SD 1.x and SD 2.x ([`Base`]), or from a diffusers folder of the same architecture (the
//! only source for SDXL, whose configs are not shipped). The
//! written folder is loaded back before it appears, so a config that does not fit the weights
//! is an error naming the key, not a folder that fails later. The way back writes the key
//! names A1111 and ComfyUI load (those of diffusers' `convert_diffusers_to_original_stable_diffusion.py`).
mod bases;
pub mod keys;
pub mod kohya;
pub mod open_clip;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::{Device, Kind, Tensor};

pub use bases::Base;
pub use keys::{unet_key, unet_ldm_key, vae_key, vae_ldm_is_conv, vae_ldm_key};
pub use kohya::lora_to_kohya;

use crate::clip::ClipTextConfigFile;
use crate::config::{read_json, UNetConfigFile, VaeConfigFile};
use crate::weights::ComponentFiles;
use crate::{Error, Result};

const UNET: &str = "model.diffusion_model.";
const VAE: &str = "first_stage_model.";
const CLIP: &str = "cond_stage_model.transformer.";
const OPEN_CLIP: &str = "cond_stage_model.model.";
const SDXL_CLIP: &str = "conditioner.embedders.0.transformer.";
const SDXL_OPEN_CLIP: &str = "conditioner.embedders.1.model.";

/// Which text encoders a single file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TextEncoders {
    /// SD 1.x: OpenAI CLIP.
    Clip,
    /// SD 2.x: OpenCLIP.
    OpenClip,
    /// SDXL: CLIP ViT-L and OpenCLIP ViT-bigG with its projection.
    Sdxl,
}

/// Where the configuration of a converted folder comes from.
#[derive(Clone, Debug)]
pub enum Configs {
    /// The configs shipped for a release; `None`: SD 1.x for a CLIP text encoder, SD 2.x 768-v
    /// for an OpenCLIP one (as diffusers' single-file loader assumes).
    Shipped(Option<Base>),
    /// A diffusers folder of the same architecture (configs, tokenizer and scheduler copied).
    Folder(PathBuf),
}

/// What [`to_diffusers`] wrote.
#[derive(Clone, Debug)]
pub struct Converted {
    /// Tensors written.
    pub tensors: usize,
    /// The shipped configs used (`None`: those of a folder).
    pub base: Option<Base>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

/// A staging folder beside `out`, removed unless [`commit`] renames it to `out`.
fn staging_for(out: &Path) -> PathBuf {
    let name = out.file_name().unwrap_or_default().to_string_lossy();
    out.with_file_name(format!(".{name}.staging-{}", std::process::id()))
}

/// Checks that `out` names a new `.safetensors` file (what `--from-diffusers` and `--lora`
/// write): another extension would mislead the tools that pick a loader by it (a `.ckpt` is
/// unpickled), and the write renames over whatever is there.
fn check_new_safetensors(out: &Path) -> Result<()> {
    if out.extension().is_none_or(|e| !e.eq_ignore_ascii_case("safetensors")) {
        return Err(Error::Invalid(format!(
            "--out {}: the file is written as safetensors; name it <name>.safetensors",
            out.display()
        )));
    }
    // `symlink_metadata`: a dangling link is there too, and the rename would replace it.
    if out.symlink_metadata().is_ok() {
        return Err(Error::Invalid(format!("--out {} exists; convert into a new file", out.display())));
    }
    Ok(())
}

/// Checks that `checkpoint` is a file and not a PyTorch pickle (`.ckpt`), which would
/// otherwise be named as a safetensors file with an absurd header length.
fn check_single_file(checkpoint: &Path) -> Result<()> {
    use std::io::Read;
    let bad = |msg: &str| Error::Format { path: checkpoint.to_path_buf(), msg: msg.into() };
    if checkpoint.is_dir() {
        return Err(bad("is a directory; --checkpoint takes a single file (.safetensors), --from-diffusers a folder"));
    }
    let mut head = vec![];
    std::fs::File::open(checkpoint).and_then(|f| f.take(9).read_to_end(&mut head)).map_err(io(checkpoint))?;
    // A safetensors file starts with its header's length (little-endian u64, at most 100 MB:
    // the top four bytes are 0), then the header's `{`. torch.save writes a zip archive
    // (`PK\x03\x04`), or before PyTorch 1.6 a pickle: the PROTO opcode 0x80 and its protocol.
    let safetensors = head.len() == 9 && head[4..8] == [0; 4] && head[8] == b'{';
    let zip = head.starts_with(b"PK\x03\x04");
    let pickle = head.first() == Some(&0x80) && head.get(1).is_some_and(|p| (1..=5).contains(p));
    if !safetensors && (zip || pickle) {
        return Err(bad("a PyTorch pickle checkpoint (.ckpt), which is not read (unpickling runs code from the \
             file); --checkpoint takes .safetensors files. Convert it in Python first, e.g. with diffusers' \
             from_single_file and save_pretrained (a diffusers folder), or safetensors' save_file on its state_dict"));
    }
    Ok(())
}

/// Copies the configs, tokenizer and scheduler of the diffusers folder `from` into `to`.
fn copy_configs(from: &Path, to: &Path) -> Result<()> {
    let files = ["model_index.json", "unet/config.json", "vae/config.json", "text_encoder/config.json"];
    // SDXL's second encoder and tokenizer, where the folder has them.
    let second = from.join("text_encoder_2").is_dir();
    let extra = second.then_some("text_encoder_2/config.json");
    for name in files.into_iter().chain(extra) {
        let (src, dst) = (from.join(name), to.join(name));
        std::fs::create_dir_all(dst.parent().unwrap_or(to)).map_err(io(to))?;
        std::fs::copy(&src, &dst).map_err(io(&src))?;
    }
    for dir in ["tokenizer", "scheduler"].into_iter().chain(second.then_some("tokenizer_2")) {
        let (src, dst) = (from.join(dir), to.join(dir));
        std::fs::create_dir_all(&dst).map_err(io(&dst))?;
        for entry in std::fs::read_dir(&src).map_err(io(&src))? {
            let entry = entry.map_err(io(&src))?;
            std::fs::copy(entry.path(), dst.join(entry.file_name())).map_err(io(&entry.path()))?;
        }
    }
    Ok(())
}

/// Converts the single file `checkpoint` into the diffusers folder `out`, which must not exist
/// (written in a staging folder beside it, loaded back, then renamed). Every key of the file
/// must convert: one that does not is an error naming the file and the key.
pub fn to_diffusers(checkpoint: &Path, configs: &Configs, out: &Path) -> Result<Converted> {
    let bad = |msg: String| Error::Format { path: checkpoint.to_path_buf(), msg };
    if out.exists() {
        return Err(Error::Invalid(format!("{} exists; convert into a new folder", out.display())));
    }
    check_single_file(checkpoint)?;
    let file = data::checkpoint::read_tensors(checkpoint)?;
    if !file.keys().any(|k| k.starts_with(UNET)) {
        return Err(bad(format!("no {UNET}* keys: not an original Stable Diffusion checkpoint")));
    }
    let has = |prefix: &str| file.keys().any(|k| k.starts_with(prefix));
    let text = match (has(CLIP), has(OPEN_CLIP), has(SDXL_CLIP) || has(SDXL_OPEN_CLIP)) {
        (true, false, false) => TextEncoders::Clip,
        (false, true, false) => TextEncoders::OpenClip,
        (false, false, true) => TextEncoders::Sdxl,
        (false, false, false) => {
            return Err(bad(format!(
            "no text encoder: neither {CLIP}* (SD 1.x), {OPEN_CLIP}* (SD 2.x) nor conditioner.embedders.* (SDXL) keys"
        )))
        }
        _ => return Err(bad("text encoder keys of more than one Stable Diffusion version".into())),
    };
    let open_clip = text == TextEncoders::OpenClip;
    let base = match configs {
        Configs::Folder(_) => None,
        Configs::Shipped(_) if text == TextEncoders::Sdxl => {
            return Err(bad("an SDXL checkpoint (conditioner.embedders.* keys): SDXL's configs are not shipped; give \
                 --config-from an SDXL diffusers folder"
                .into()))
        }
        Configs::Shipped(Some(b)) if b.open_clip() != open_clip => {
            let found = if open_clip { "an OpenCLIP (SD 2.x)" } else { "a CLIP (SD 1.x)" };
            return Err(bad(format!("--base {}: the file has {found} text encoder", b.name())));
        }
        Configs::Shipped(b) => Some(b.unwrap_or(if open_clip { Base::Sd2V } else { Base::Sd1 })),
    };
    let staging = staging_for(out);
    let _ = std::fs::remove_dir_all(&staging);
    let _live = data::temporaries::Temporary::new(&staging);
    let result = (|| -> Result<usize> {
        // `base` is `None` exactly for a donor folder.
        if let Some(b) = base {
            b.write_configs(&staging)?;
        } else if let Configs::Folder(from) = configs {
            copy_configs(from, &staging)?;
        }
        let n = write_weights(file, text, &staging, checkpoint).map_err(|e| {
            // The configs it reads are copies: name their source, not the removed staging folder.
            let source = match configs {
                Configs::Folder(from) => from.as_path(),
                Configs::Shipped(_) => out,
            };
            Error::Invalid(e.to_string().replace(&staging.display().to_string(), &source.display().to_string()))
        })?;
        crate::pipeline::StableDiffusion::load(&staging, Device::Cpu, Kind::Float).map_err(|e| {
            // Named as the folder would have been: the staging folder is removed.
            let e = e.to_string().replace(&staging.display().to_string(), &out.display().to_string());
            let configs = match base {
                Some(b) => format!("the shipped {} configs", b.name()),
                None => "the --config-from configs".to_string(),
            };
            Error::Invalid(format!("{}: the weights do not fit {configs}: {e}", checkpoint.display()))
        })?;
        data::sync_dir(&staging)?;
        std::fs::rename(&staging, out).map_err(io(out))?;
        data::sync_dir(out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")))?;
        Ok(n)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    Ok(Converted { tensors: result?, base })
}

/// Renames the file's tensors into the folder `dir`'s components (whose configs are there) and
/// writes their weights; returns the number of tensors written.
fn write_weights(file: HashMap<String, Tensor>, text: TextEncoders, dir: &Path, checkpoint: &Path) -> Result<usize> {
    let bad = |msg: String| Error::Format { path: checkpoint.to_path_buf(), msg };
    let unet_cfg: UNetConfigFile = read_json(&dir.join("unet").join("config.json"))?;
    let vae_cfg: VaeConfigFile = read_json(&dir.join("vae").join("config.json"))?;
    let text_cfg: ClipTextConfigFile = read_json(&dir.join("text_encoder").join("config.json"))?;
    let sdxl = text == TextEncoders::Sdxl;
    let text_2_layers = match sdxl {
        true => read_json::<ClipTextConfigFile>(&dir.join("text_encoder_2").join("config.json"))?.num_hidden_layers,
        false => 0,
    } as usize;
    // The OpenAI CLIP encoder's prefix in this file (SD 1.x's or SDXL's first).
    let clip = if sdxl { SDXL_CLIP } else { CLIP };
    let (lpb, levels) = (unet_cfg.layers_per_block as usize, vae_cfg.block_out_channels.len());
    let mut parts: HashMap<&str, Vec<(String, Tensor)>> = HashMap::new();
    // Which file key each converted name came from: two keys for one name are an error (which
    // tensor the folder should hold is not for the converter to guess).
    let mut sources: HashMap<(&str, String), String> = HashMap::new();
    let mut entries: Vec<(String, Tensor)> = file.into_iter().collect();
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    for (key, t) in entries {
        // EMA copies and the training code's schedule buffers (`betas`, `alphas_cumprod`, ...,
        // top-level names) are not weights of the pipeline.
        if key.starts_with("model_ema.") || !key.contains('.') {
            continue;
        }
        let unknown = || bad(format!("key {key} has no diffusers equivalent"));
        let before: Vec<(&str, usize)> = parts.iter().map(|(c, v)| (*c, v.len())).collect();
        if let Some(k) = key.strip_prefix(UNET) {
            parts.entry("unet").or_default().push((unet_key(k, lpb).ok_or_else(unknown)?, t));
        } else if let Some(k) = key.strip_prefix(VAE) {
            // The mid-block attention's projections are stored as 1x1 convolutions.
            let t = if k.contains(".attn_1.") && t.dim() == 4 { t.flatten(1, -1) } else { t };
            parts.entry("vae").or_default().push((vae_key(k, levels).ok_or_else(unknown)?, t));
        } else if let (Some(k), false) = (key.strip_prefix(clip), text == TextEncoders::OpenClip) {
            // Buffers (old files store them, some as corrupted floats): transformers recomputes them.
            if !k.ends_with("position_ids") {
                let name = if k.starts_with("text_model.") { k.to_string() } else { format!("text_model.{k}") };
                parts.entry("text_encoder").or_default().push((name, t));
            }
        } else if let (Some(k), true) = (key.strip_prefix(OPEN_CLIP), text == TextEncoders::OpenClip) {
            let layers = text_cfg.num_hidden_layers as usize;
            open_clip::to_transformers(k, t, layers, false, parts.entry("text_encoder").or_default())
                .map_err(|m| bad(format!("key {key} {m}")))?;
        } else if let (Some(k), true) = (key.strip_prefix(SDXL_OPEN_CLIP), sdxl) {
            open_clip::to_transformers(k, t, text_2_layers, true, parts.entry("text_encoder_2").or_default())
                .map_err(|m| bad(format!("key {key} {m}")))?;
        } else {
            return Err(unknown());
        }
        for (component, tensors) in &parts {
            let had = before.iter().find(|(c, _)| c == component).map_or(0, |(_, n)| *n);
            for (name, _) in &tensors[had..] {
                if let Some(first) = sources.insert((*component, name.clone()), key.clone()) {
                    return Err(bad(format!("keys {first} and {key} both convert to {component}'s {name}")));
                }
            }
        }
    }
    let mut count = 0;
    let components =
        [("unet", crate::weights::WEIGHTS), ("vae", crate::weights::WEIGHTS), ("text_encoder", "model.safetensors")];
    let second = sdxl.then_some(("text_encoder_2", "model.safetensors"));
    for (component, file_name) in components.into_iter().chain(second) {
        let tensors = parts.remove(component).unwrap_or_default();
        if tensors.is_empty() {
            return Err(bad(format!("no {component} weights")));
        }
        count += tensors.len();
        data::checkpoint::save_tensors(&tensors, &dir.join(component).join(file_name))?;
    }
    Ok(count)
}

/// The tensors of a diffusers folder's text encoder `component` under transformers 4's
/// prefixed names (`text_model.…`; a projection stays `text_projection.weight`), whichever
/// layout the file uses.
fn text_encoder_tensors(folder: &Path, component: &str) -> Result<Vec<(String, Tensor)>> {
    let path = ComponentFiles::with_stem(&folder.join(component), crate::weights::TRANSFORMERS_STEM)?.weights;
    let file = crate::weights::read(&path)?;
    let prefixed = file.keys().any(|k| k.starts_with("text_model."));
    let name = |k: String| match prefixed || k.starts_with("text_projection.") {
        true => k,
        false => format!("text_model.{k}"),
    };
    Ok(file.into_iter().map(|(k, t)| (name(k), t)).collect())
}

/// Converts the diffusers folder `folder` into the single file `out` (a new `.safetensors`
/// file, written atomically) in latent-diffusion's names: the UNet, the VAE (attention
/// projections as 1x1 convolutions) and the text encoder, in OpenAI CLIP's names for a
/// `quick_gelu` encoder (SD 1.x) or OpenCLIP's for a `gelu` one (SD 2.x); for SDXL (a UNet
/// with `addition_embed_type`) both encoders under `conditioner.embedders.*`, as Stability's
/// `sd_xl_base_1.0.safetensors`. Tensors keep their precision unless `half`. A key with no
/// single-file name is an error naming the file and the key; so is a folder that does not load (a missing or mis-shaped
/// weight, integers for weights): it is loaded first, as sampling would. Returns the number of
/// tensors written.
pub fn to_single_file(folder: &Path, out: &Path, half: bool) -> Result<usize> {
    // Written over a file of the folder, the output would replace the input it converts.
    let inside = |o: &Path| std::fs::canonicalize(folder).is_ok_and(|f| o.starts_with(f));
    let out_dir = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    if std::fs::canonicalize(out_dir).is_ok_and(|d| inside(&d)) {
        return Err(Error::Invalid(format!(
            "--out {} is inside the folder being converted ({}); write it elsewhere",
            out.display(),
            folder.display()
        )));
    }
    check_new_safetensors(out)?;
    // The renaming below takes any tensor: loading checks every key, shape and kind first.
    drop(crate::pipeline::StableDiffusion::load(folder, Device::Cpu, Kind::Float)?);
    let unet_files = ComponentFiles::in_pipeline(folder, "unet", "UNet2DConditionModel")?;
    let vae_files = ComponentFiles::in_pipeline(folder, "vae", "AutoencoderKL")?;
    let unet_cfg: UNetConfigFile = read_json(&unet_files.config)?;
    let sdxl = unet_cfg.addition_embed_type.is_some();
    let vae_cfg: VaeConfigFile = read_json(&vae_files.config)?;
    let text_cfg_path = folder.join("text_encoder").join("config.json");
    let text_cfg: ClipTextConfigFile = read_json(&text_cfg_path)?;
    let lpb = unet_cfg.layers_per_block as usize;
    let up_attention: Vec<bool> = unet_cfg.up_block_types.iter().map(|t| t.starts_with("CrossAttn")).collect();
    let levels = vae_cfg.block_out_channels.len();
    let mut named: Vec<(String, Tensor)> = vec![];
    for (key, t) in crate::weights::read(&unet_files.weights)? {
        let ldm = unet_ldm_key(&key, lpb, &up_attention).ok_or_else(|| Error::Format {
            path: unet_files.weights.clone(),
            msg: format!("key {key} has no single-file name"),
        })?;
        named.push((format!("{UNET}{ldm}"), t));
    }
    for (key, t) in crate::weights::read(&vae_files.weights)? {
        let ldm = vae_ldm_key(&key, levels).ok_or_else(|| Error::Format {
            path: vae_files.weights.clone(),
            msg: format!("key {key} has no single-file name"),
        })?;
        let t = if vae_ldm_is_conv(&ldm) && t.dim() == 2 { t.unsqueeze(-1).unsqueeze(-1) } else { t };
        named.push((format!("{VAE}{ldm}"), t));
    }
    let text = text_encoder_tensors(folder, "text_encoder")?;
    let text_path = ComponentFiles::with_stem(&folder.join("text_encoder"), crate::weights::TRANSFORMERS_STEM)?.weights;
    if sdxl {
        named.extend(under_prefix(text, SDXL_CLIP));
        let second = text_encoder_tensors(folder, "text_encoder_2")?;
        let path =
            ComponentFiles::with_stem(&folder.join("text_encoder_2"), crate::weights::TRANSFORMERS_STEM)?.weights;
        let converted = open_clip::from_transformers(second).map_err(|msg| Error::Format { path, msg })?;
        named.extend(converted.into_iter().map(|(k, t)| (format!("{SDXL_OPEN_CLIP}{k}"), t)));
        return write_single_file(named, out, half);
    }
    match text_cfg.hidden_act.as_str() {
        "quick_gelu" => named.extend(under_prefix(text, CLIP)),
        "gelu" => {
            let converted =
                open_clip::from_transformers(text).map_err(|msg| Error::Format { path: text_path.clone(), msg })?;
            named.extend(converted.into_iter().map(|(k, t)| (format!("{OPEN_CLIP}{k}"), t)));
        }
        other => {
            return Err(Error::Format {
                path: text_cfg_path,
                msg: format!(
                    "hidden_act {other:?}: neither OpenAI CLIP's quick_gelu (SD 1.x) nor OpenCLIP's gelu (SD 2.x)"
                ),
            })
        }
    }
    write_single_file(named, out, half)
}

/// An OpenAI CLIP encoder's tensors under the file's `prefix`, without the position-id buffer
/// (transformers recomputes it).
fn under_prefix(text: Vec<(String, Tensor)>, prefix: &str) -> impl Iterator<Item = (String, Tensor)> + '_ {
    text.into_iter().filter(|(k, _)| !k.ends_with("position_ids")).map(move |(k, t)| (format!("{prefix}{k}"), t))
}

/// Writes the single file (atomically), in fp16 with `half`; returns the number of tensors.
fn write_single_file(mut named: Vec<(String, Tensor)>, out: &Path, half: bool) -> Result<usize> {
    if half {
        named = named
            .into_iter()
            .map(|(k, t)| (k, if t.is_floating_point() { t.to_kind(Kind::Half) } else { t }))
            .collect();
    }
    data::checkpoint::save_tensors(&named, out)?;
    Ok(named.len())
}
