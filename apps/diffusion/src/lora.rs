//! LoRA (Hu et al. 2021) on the UNet's attention projections (`to_q`, `to_k`, `to_v`,
//! `to_out.0` of every `attn1` and `attn2`, as diffusers' LoRA training targets them): each
//! weight becomes `W0 + (alpha / rank) * up @ down` with `down` [rank, in] and `up` [out, rank]
//! trainable and `W0` frozen.
//!
//! The adapted weight is written into the UNet's own weight before each forward, and after
//! backward the adapters' gradients come from the weight's by the chain rule
//! (`d up = s * dW @ down^T`, `d down = s * up^T @ dW`), so the UNet runs unchanged. `up` starts
//! at zero: the model starts as the base model.
//!
//! Saved as diffusers saves LoRA weights (`pytorch_lora_weights.safetensors`, keys
//! `unet.<module>.lora.down.weight` / `lora.up.weight`), with the scale folded into `up` so
//! the file means the same at diffusers' default scale 1.
use std::collections::HashMap;
use std::path::Path;

use engine::optim::Param;
use tch::nn::VarStore;
use tch::{Kind, Tensor};

use crate::{Error, Result};

/// The file diffusers writes and reads.
pub const LORA_WEIGHTS: &str = "pytorch_lora_weights.safetensors";

const TARGETS: [&str; 4] = [".to_q.weight", ".to_k.weight", ".to_v.weight", ".to_out.0.weight"];

/// One adapted weight.
struct Adapter {
    /// Module path, e.g. `down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q`.
    module: String,
    /// The UNet's weight [out, in] (written before each forward).
    weight: Tensor,
    /// The frozen base weight, fp32.
    base: Tensor,
    /// [rank, in], trainable.
    down: Tensor,
    /// [out, rank], trainable.
    up: Tensor,
}

/// The adapters of one UNet.
pub struct Lora {
    adapters: Vec<Adapter>,
    scale: f64,
}

impl Lora {
    /// Adapters of `rank` (scale `alpha / rank`) on every attention projection of the UNet in
    /// `vs`; every UNet variable stops being trained (the adapted weights keep their gradients
    /// for the chain rule). `down` is drawn from `seed` (uniform in ±1/sqrt(in), as peft's
    /// Kaiming init), `up` is zero.
    pub fn new(vs: &VarStore, rank: i64, alpha: f64, seed: u64) -> Result<Lora> {
        if rank < 1 {
            return Err(Error::Invalid(format!("--lora-rank {rank}: must be at least 1")));
        }
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        let mut adapters = vec![];
        for (name, t) in vars {
            let target = (name.contains(".attn1.") || name.contains(".attn2."))
                && TARGETS.iter().any(|suffix| name.ends_with(suffix));
            let _ = t.set_requires_grad(target);
            if !target {
                continue;
            }
            let (out, inp) = (t.size()[0], t.size()[1]);
            let mut rng = data::augment::Rng::keyed(seed, adapters.len() as u64, 0x10_4a);
            let bound = 1.0 / (inp as f64).sqrt();
            let values: Vec<f32> = (0..rank * inp).map(|_| rng.range(-bound, bound) as f32).collect();
            let device = t.device();
            adapters.push(Adapter {
                module: name.trim_end_matches(".weight").to_string(),
                base: t.detach().f_to_kind(Kind::Float)?.copy(),
                down: Tensor::from_slice(&values).reshape([rank, inp]).to_device(device).set_requires_grad(true),
                up: Tensor::zeros([out, rank], (Kind::Float, device)).set_requires_grad(true),
                weight: t,
            });
        }
        if adapters.is_empty() {
            return Err(Error::Invalid("the UNet has no attention projections to adapt".into()));
        }
        Ok(Lora { adapters, scale: alpha / rank as f64 })
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

    /// Writes `W0 + s * up @ down` into every adapted weight (call before each forward).
    pub fn apply(&self) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for a in &self.adapters {
                let w = a.base.f_add(&a.up.f_matmul(&a.down)?.f_mul_scalar(self.scale)?)?;
                a.weight.detach().f_copy_(&w.f_to_kind(a.weight.kind())?)?;
            }
            Ok(())
        })
    }

    /// Moves the adapted weights' gradients onto the adapters (accumulating, as autograd does)
    /// and clears them (call after each backward).
    pub fn backward(&self) -> Result<()> {
        tch::no_grad(|| -> Result<()> {
            for a in &self.adapters {
                let mut gw = a.weight.grad();
                if !gw.defined() {
                    continue;
                }
                let g = gw.f_to_kind(Kind::Float)?.f_mul_scalar(self.scale)?;
                let d_up = g.f_matmul(&a.down.f_transpose(0, 1)?)?;
                let d_down = a.up.f_transpose(0, 1)?.f_matmul(&g)?;
                for (p, d) in [(&a.up, d_up), (&a.down, d_down)] {
                    let mut acc = p.grad();
                    match acc.defined() {
                        true => {
                            let _ = acc.f_add_(&d)?;
                        }
                        false => engine::autograd::set_grad(p, Some(&d))?,
                    }
                }
                let _ = gw.f_zero_()?;
            }
            Ok(())
        })
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
                    t.detach().f_copy_(&v.f_to_kind(Kind::Float)?.f_mul_scalar(scale)?)?;
                }
            }
            Ok(())
        })?;
        if let Some(k) = file.keys().min() {
            return Err(bad(format!("key {k} matches no adapter")));
        }
        self.apply()
    }
}
