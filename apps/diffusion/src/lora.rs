//! LoRA (Hu et al. 2021) on the UNet's attention projections (`to_q`, `to_k`, `to_v`,
//! `to_out.0` of every `attn1` and `attn2`, as diffusers' LoRA training targets them): each
//! projection's output gains `(alpha / rank) * up(down(x))` beside the frozen layer's, as
//! peft's `lora.Linear` computes it, with `down` [rank, in] and `up` [out, rank] trainable.
//! The UNet's weights are only read, so the frozen UNet may live anywhere: whole on the
//! device, or in Gemini's chunks streamed under `--gpu-mem`. `up` starts at zero: the model
//! starts as the base model.
//!
//! Saved as diffusers saves LoRA weights (`pytorch_lora_weights.safetensors`, keys
//! `unet.<module>.lora.down.weight` / `lora.up.weight`), with the scale folded into `up` so
//! the file means the same at diffusers' default scale 1.
use std::collections::HashMap;
use std::path::Path;

use engine::optim::Param;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::attention::{Adapter, PROJECTIONS};
use crate::lora_file::LoraFile;
use crate::unet::UNet2DConditionModel;
use crate::{Error, Result};

/// The file diffusers writes and reads.
pub const LORA_WEIGHTS: &str = "pytorch_lora_weights.safetensors";

/// One adapted projection's trainable tensors (shared with the attention module's adapter).
struct Named {
    /// Module path, e.g. `down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q`.
    module: String,
    /// [rank, in].
    down: Tensor,
    /// [out, rank].
    up: Tensor,
}

/// The adapters of one UNet.
pub struct Lora {
    adapters: Vec<Named>,
    scale: f64,
}

impl Lora {
    /// Adapters of `rank` (scale `alpha / rank`), fp32 on `device`, on every attention
    /// projection of `unet`, whose variables `vs` holds; every UNet variable stops requiring a
    /// gradient. `down` is drawn from `seed` (normal with std 1/rank, peft's "gaussian" init,
    /// which diffusers' LoRA training scripts ask for; one stream per projection in name
    /// order), `up` is zero.
    pub fn new(
        unet: &UNet2DConditionModel,
        vs: &VarStore,
        rank: i64,
        alpha: f64,
        seed: u64,
        device: Device,
    ) -> Result<Lora> {
        if rank < 1 {
            return Err(Error::Invalid(format!("--lora-rank {rank}: must be at least 1")));
        }
        for t in vs.variables().values() {
            let _ = t.set_requires_grad(false);
        }
        // (module, in, out) of every projection.
        let mut found: Vec<(String, i64, i64)> = vec![];
        unet.visit_attentions(&mut |a| {
            for i in 0..PROJECTIONS.len() {
                let size = a.weight(i).size();
                found.push((a.projection(i), size[1], size[0]));
            }
        })?;
        if found.is_empty() {
            return Err(Error::Invalid("the UNet has no attention projections to adapt".into()));
        }
        found.sort();
        let mut adapters = vec![];
        for (k, (name, inp, out)) in found.into_iter().enumerate() {
            let mut rng = data::augment::Rng::keyed(seed, k as u64, 0x10_4a);
            let std = 1.0 / rank as f64;
            let values: Vec<f32> = (0..rank * inp).map(|_| (rng.normal() * std) as f32).collect();
            adapters.push(Named {
                module: name,
                down: Tensor::from_slice(&values).reshape([rank, inp]).to_device(device).set_requires_grad(true),
                up: Tensor::zeros([out, rank], (Kind::Float, device)).set_requires_grad(true),
            });
        }
        let scale = alpha / rank as f64;
        let by_module: HashMap<&str, &Named> = adapters.iter().map(|n| (n.module.as_str(), n)).collect();
        unet.visit_attentions(&mut |a| {
            for i in 0..PROJECTIONS.len() {
                let n = by_module[a.projection(i).as_str()];
                a.adapt(i, Adapter { down: n.down.shallow_clone(), up: n.up.shallow_clone(), scale });
            }
        })?;
        Ok(Lora { adapters, scale })
    }

    /// The trainable tensors, named `<module>.lora.down.weight` / `.lora.up.weight`.
    pub fn params(&self) -> Vec<Param> {
        self.adapters
            .iter()
            .flat_map(|a| {
                [
                    Param::new(format!("{}.lora.down.weight", a.module), &a.down),
                    Param::new(format!("{}.lora.up.weight", a.module), &a.up),
                ]
            })
            .collect()
    }

    /// Bytes of the adapters (fp32).
    pub fn bytes(&self) -> usize {
        self.adapters.iter().map(|a| (a.down.numel() + a.up.numel()) * 4).sum()
    }

    /// The file's tensors: diffusers' keys, scale folded into `up`.
    fn named(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = vec![];
        for a in &self.adapters {
            out.push((format!("unet.{}.lora.down.weight", a.module), a.down.detach().copy()));
            out.push((format!("unet.{}.lora.up.weight", a.module), a.up.detach().f_mul_scalar(self.scale)?));
        }
        Ok(out)
    }

    /// Writes `dir/pytorch_lora_weights.safetensors` (atomically).
    pub fn save(&self, dir: &Path) -> Result<()> {
        Ok(data::checkpoint::save_tensors(&self.named()?, &dir.join(LORA_WEIGHTS))?)
    }

    /// Adds the adapters of a LoRA file (diffusers', peft's or kohya's naming, each at the
    /// scale its loaders apply: see [`crate::lora_file`]), times `multiplier` (diffusers' LoRA
    /// scale), to the attention projections of `unet` it names, on `device`; for sampling. Any
    /// rank, any subset of the projections; a key that names no projection, a missing half or
    /// a shape that does not fit is an error naming the file and key. Returns the projections
    /// adapted.
    pub fn attach_file(unet: &UNet2DConditionModel, path: &Path, multiplier: f64, device: Device) -> Result<usize> {
        let mut file = LoraFile::read(path)?;
        let bad = |msg: String| Error::Format { path: path.to_path_buf(), msg };
        let mut adapted = 0;
        let mut failure = None;
        unet.visit_attentions(&mut |a| {
            for i in 0..PROJECTIONS.len() {
                match take_adapter(&mut file, a, i, multiplier, device) {
                    _ if failure.is_some() => return,
                    Ok(Some(adapter)) => {
                        a.adapt(i, adapter);
                        adapted += 1;
                    }
                    Ok(None) => {}
                    Err(msg) => failure = Some(bad(msg)),
                }
            }
        })?;
        if let Some(e) = failure {
            return Err(e);
        }
        if let Some(a) = file.into_rest().into_values().next() {
            return Err(bad(format!(
                "key {} names no attention projection of the UNet (only UNet attention LoRA is read)",
                a.down_key
            )));
        }
        Ok(adapted)
    }

    /// Reads adapters saved by [`Lora::save`] (or by diffusers) into these adapters; a missing
    /// or mis-shaped key, or a key no adapter has, is an error naming the file and key.
    pub fn load(&self, path: &Path) -> Result<()> {
        let mut file: HashMap<String, Tensor> = data::checkpoint::read_tensors(path)?;
        let bad = |msg: String| Error::Format { path: path.to_path_buf(), msg };
        tch::no_grad(|| -> Result<()> {
            for a in &self.adapters {
                for (which, t, scale) in [("down", &a.down, 1.0), ("up", &a.up, 1.0 / self.scale)] {
                    let key = format!("unet.{}.lora.{which}.weight", a.module);
                    let v = file.remove(&key).ok_or_else(|| bad(format!("missing key {key}")))?;
                    if v.size() != t.size() {
                        return Err(bad(format!("key {key}: shape {:?}, expected {:?}", v.size(), t.size())));
                    }
                    data::checkpoint::floating(&key, &v).map_err(bad)?;
                    t.detach().f_copy_(&v.f_to_kind(Kind::Float)?.f_mul_scalar(scale)?)?;
                }
            }
            Ok(())
        })?;
        if let Some(k) = file.keys().min() {
            return Err(bad(format!("key {k} matches no adapter")));
        }
        Ok(())
    }
}

/// Projection `i` of `a`'s adapter from a LoRA file (taken out of it), scaled by
/// `multiplier`; `None` where the file does not adapt it; the message of what does not fit.
fn take_adapter(
    file: &mut LoraFile,
    a: &crate::attention::Attention,
    i: usize,
    multiplier: f64,
    device: Device,
) -> std::result::Result<Option<Adapter>, String> {
    let Some(found) = file.take(&a.projection(i)) else { return Ok(None) };
    let (out, inp) = (a.weight(i).size()[0], a.weight(i).size()[1]);
    let rank = found.down.size()[0];
    if found.down.size() != [rank, inp] || found.up.size() != [out, rank] {
        return Err(format!(
            "keys {} {:?} and {} {:?} do not fit the projection's [{out}, {inp}] weight",
            found.down_key,
            found.down.size(),
            found.up_key,
            found.up.size()
        ));
    }
    Ok(Some(Adapter { down: found.down.to_device(device), up: found.up.to_device(device) * multiplier, scale: 1.0 }))
}
