//! A Stable Diffusion pipeline folder as diffusers lays it out (`model_index.json`,
//! `tokenizer/`, `text_encoder/`, `unet/`, `vae/`, `scheduler/`; SDXL's adds `tokenizer_2/` and
//! `text_encoder_2/`), loaded whole, with the components checked against each other, and the
//! prompts' conditioning as diffusers' pipelines compute it.
use std::path::{Path, PathBuf};

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::clip::ClipTextModel;
use crate::config::{check_model_index, read_json};
use crate::scheduler::SchedulerFile;
use crate::tokenizer::ClipTokenizer;
use crate::unet::{Conditioning, TextTime, UNet2DConditionModel};
use crate::vae::AutoencoderKL;
use crate::weights::ComponentFiles;
use crate::{Error, Result};

/// The components of a text-to-image pipeline, with the stores holding their weights.
pub struct StableDiffusion {
    /// The folder it was read from.
    pub root: PathBuf,
    /// CLIP's tokenizer.
    pub tokenizer: ClipTokenizer,
    /// The CLIP text encoder.
    pub text_encoder: ClipTextModel,
    /// Its weights.
    pub text_encoder_vs: VarStore,
    /// The denoising UNet.
    pub unet: UNet2DConditionModel,
    /// Its weights.
    pub unet_vs: VarStore,
    /// The autoencoder.
    pub vae: AutoencoderKL,
    /// Its weights.
    pub vae_vs: VarStore,
    /// `scheduler/scheduler_config.json`, which each scheduler class reads with its own
    /// defaults for the keys it lacks.
    pub scheduler: SchedulerFile,
    /// SDXL's second text encoder (OpenCLIP ViT-bigG as `CLIPTextModelWithProjection`).
    pub text_encoder_2: Option<SecondEncoder>,
    /// SDXL's `force_zeros_for_empty_prompt` (`model_index.json`, default true): with no
    /// negative prompt, guidance's negative conditioning is zeros rather than the encoded "".
    pub force_zeros_for_empty_prompt: bool,
}

/// SDXL's second tokenizer and text encoder.
pub struct SecondEncoder {
    /// `tokenizer_2/` (SDXL's pads with `!`).
    pub tokenizer: ClipTokenizer,
    /// `text_encoder_2/`, with its `text_projection`.
    pub model: ClipTextModel,
    /// Its weights.
    pub vs: VarStore,
}

/// SDXL's size and crop conditioning (`add_time_ids`): original size, crop top-left and target
/// size, each `(height, width)` in pixels.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SizeConditioning {
    /// The size the image had before resizing (diffusers' `original_size`).
    pub original: (i64, i64),
    /// Top-left corner of the crop (`crops_coords_top_left`).
    pub crop_top_left: (i64, i64),
    /// The size generated (`target_size`).
    pub target: (i64, i64),
}

impl SizeConditioning {
    /// diffusers' defaults for an image of `height` x `width`: original and target that size,
    /// no crop.
    pub fn uncropped(height: i64, width: i64) -> SizeConditioning {
        SizeConditioning { original: (height, width), crop_top_left: (0, 0), target: (height, width) }
    }

    /// The six time ids, in diffusers' order.
    pub fn ids(&self) -> [f32; 6] {
        let (o, c, t) = (self.original, self.crop_top_left, self.target);
        [o.0, o.1, c.0, c.1, t.0, t.1].map(|v| v as f32)
    }

    /// `[rows, 6]` time ids of `sizes`.
    pub fn tensor(sizes: &[SizeConditioning], device: Device) -> Result<Tensor> {
        let flat: Vec<f32> = sizes.iter().flat_map(|s| s.ids()).collect();
        Ok(Tensor::from_slice(&flat).f_reshape([sizes.len() as i64, 6])?.f_to_device(device)?)
    }
}

impl StableDiffusion {
    /// Loads every component of the folder `root` onto `device`, the text encoder's and the
    /// UNet's weights converted to `kind`.
    /// A missing file or key, or components that do not fit together, are errors naming them.
    pub fn load(root: &Path, device: Device, kind: Kind) -> Result<StableDiffusion> {
        let index = root.join("model_index.json");
        if !index.is_file() {
            return Err(Error::Format {
                path: index,
                msg: "missing: a diffusers pipeline folder starts with its model_index.json".into(),
            });
        }
        check_model_index(&index, "text_encoder", "CLIPTextModel")?;
        let tokenizer = ClipTokenizer::from_diffusers(root)?;
        let (mut text_encoder_vs, text_encoder) = ClipTextModel::load(&root.join("text_encoder"), device)?;
        let fits = |t: &ClipTokenizer, tokenizer: &str, model: &ClipTextModel, encoder: &str| {
            let c = model.config();
            let config = root.join(encoder).join("config.json");
            t.check_fits(&root.join(tokenizer), &config, c.vocab_size, c.max_positions)
        };
        fits(&tokenizer, "tokenizer", &text_encoder, "text_encoder")?;
        let entries: serde_json::Map<String, serde_json::Value> = read_json(&index)?;
        // diffusers writes `[null, null]` for a component a pipeline class has but this one lacks.
        let listed = |v: &serde_json::Value| v.as_array().and_then(|a| a.first()).is_some_and(|c| !c.is_null());
        let mut text_encoder_2 = match entries.get("text_encoder_2").is_some_and(listed) {
            true => {
                check_model_index(&index, "text_encoder_2", "CLIPTextModelWithProjection")?;
                let tokenizer = ClipTokenizer::from_dir(&root.join("tokenizer_2"))?;
                let (vs, model) = ClipTextModel::load_with_projection(&root.join("text_encoder_2"), device)?;
                fits(&tokenizer, "tokenizer_2", &model, "text_encoder_2")?;
                Some(SecondEncoder { tokenizer, model, vs })
            }
            false => None,
        };
        let force_zeros_for_empty_prompt = match entries.get("force_zeros_for_empty_prompt") {
            None => true,
            Some(v) => v.as_bool().ok_or_else(|| Error::Format {
                path: index.clone(),
                msg: format!("force_zeros_for_empty_prompt is {v}, expected true or false"),
            })?,
        };
        let (mut unet_vs, unet) =
            UNet2DConditionModel::load(&ComponentFiles::in_pipeline(root, "unet", "UNet2DConditionModel")?, device)?;
        let (mut vae_vs, vae) =
            AutoencoderKL::load(&ComponentFiles::in_pipeline(root, "vae", "AutoencoderKL")?, device)?;
        let scheduler = SchedulerFile::read(&root.join("scheduler").join("scheduler_config.json"))?;
        check_text_fits(root, &text_encoder, text_encoder_2.as_ref(), &unet)?;
        let (latent, input) = (vae.config().latent_channels, unet.config().in_channels);
        if latent != input {
            return Err(Error::Format {
                path: root.join("unet").join("config.json"),
                msg: format!("in_channels is {input}, but the VAE's latent_channels is {latent}"),
            });
        }
        // The VAE stays in fp32 unless its config lifts `force_upcast`: SD's and SDXL's VAEs
        // overflow in fp16, and it runs once per image.
        for vs in [&mut text_encoder_vs, &mut unet_vs] {
            vs.set_kind(kind);
        }
        if let Some(second) = text_encoder_2.as_mut() {
            second.vs.set_kind(kind);
        }
        if !vae.config().force_upcast {
            vae_vs.set_kind(kind);
        }
        Ok(StableDiffusion {
            root: root.to_path_buf(),
            tokenizer,
            text_encoder,
            text_encoder_vs,
            unet,
            unet_vs,
            vae,
            vae_vs,
            scheduler,
            text_encoder_2,
            force_zeros_for_empty_prompt,
        })
    }

    /// Whether this is an SDXL pipeline (two text encoders, size/crop conditioning).
    pub fn is_xl(&self) -> bool {
        self.text_encoder_2.is_some()
    }

    /// Every frozen text encoder's weights (one, or SDXL's two).
    pub fn text_encoder_stores(&mut self) -> Vec<&mut VarStore> {
        let mut stores = vec![&mut self.text_encoder_vs];
        if let Some(second) = self.text_encoder_2.as_mut() {
            stores.push(&mut second.vs);
        }
        stores
    }

    /// The device the pipeline computes on: the text encoder's (under Gemini the UNet's
    /// weights start in host memory and are brought over part by part).
    pub fn device(&self) -> Device {
        self.text_encoder_vs.device()
    }

    /// The UNet's weights' kind.
    pub fn kind(&self) -> Kind {
        kind_of(&self.unet_vs)
    }

    /// The VAE's weights' kind: fp32 for sampling (see [`StableDiffusion::load`]), the compute
    /// kind under `finetune` (diffusers' `weight_dtype`).
    pub fn vae_kind(&self) -> Kind {
        kind_of(&self.vae_vs)
    }

    /// Pixels per latent along each side (2^(VAE levels - 1); 8 for Stable Diffusion).
    pub fn vae_scale(&self) -> i64 {
        1 << (self.vae.config().block_out_channels.len() - 1)
    }

    /// What image sides must be a multiple of: the VAE's scale times the UNet's downsampling.
    pub fn size_multiple(&self) -> i64 {
        self.vae_scale() << (self.unet.config().block_out_channels.len() - 1)
    }

    /// The UNet's conditioning on `prompts` (no attention mask, as Stable Diffusion's text
    /// encoders are run). SD 1.x/2.x: the text encoder's last hidden states `[B, 77, hidden]`.
    /// SDXL, as `StableDiffusionXLPipeline.encode_prompt`: both encoders' penultimate hidden
    /// states (`hidden_states[-2]`, no final norm) concatenated, encoder 2's pooled projection,
    /// and the time ids of `sizes` (one per prompt, or one for all).
    pub fn encode(&self, prompts: &[&str], sizes: &[SizeConditioning]) -> Result<Conditioning> {
        let (ids, _) = self.tokenizer.encode_batch(prompts, self.device())?;
        let Some(second) = &self.text_encoder_2 else {
            return Ok(Conditioning::text(tch::no_grad(|| self.text_encoder.forward(&ids, None))?));
        };
        let (ids_2, _) = second.tokenizer.encode_batch(prompts, second.vs.device())?;
        let sizes = match sizes.len() {
            1 => vec![sizes[0]; prompts.len()],
            n if n == prompts.len() => sizes.to_vec(),
            n => return Err(Error::Invalid(format!("{n} size conditionings for {} prompts", prompts.len()))),
        };
        tch::no_grad(|| {
            let (_, first) = self.text_encoder.forward_penultimate(&ids)?;
            let (last, penultimate) = second.model.forward_penultimate(&ids_2)?;
            let text_embeds = second.model.text_embeds(&ids_2, &last)?;
            let context = Tensor::f_cat(&[first, penultimate.f_to_device(self.device())?], -1)?;
            let time_ids = SizeConditioning::tensor(&sizes, self.device())?;
            Ok(Conditioning {
                context,
                text_time: Some(TextTime { text_embeds: text_embeds.f_to_device(self.device())?, time_ids }),
            })
        })
    }
}

/// Checks the text encoders' widths against the UNet's: `cross_attention_dim` is the hidden
/// size (SDXL: both encoders' together), and SDXL's `add_embedding` takes encoder 2's
/// projection and six time ids.
fn check_text_fits(
    root: &Path,
    first: &ClipTextModel,
    second: Option<&SecondEncoder>,
    unet: &UNet2DConditionModel,
) -> Result<()> {
    let bad = |msg: String| Error::Format { path: root.join("unet").join("config.json"), msg };
    let cfg = unet.config();
    match (second, &cfg.text_time) {
        (None, None) | (Some(_), Some(_)) => {}
        (Some(_), None) => {
            return Err(bad(
                "the pipeline has text_encoder_2 (SDXL), but the UNet has no addition_embed_type \"text_time\"".into(),
            ))
        }
        (None, Some(_)) => {
            return Err(bad(
                "addition_embed_type is \"text_time\" (SDXL), but model_index.json has no text_encoder_2".into()
            ))
        }
    }
    let h1 = first.config().hidden_size;
    let hidden = h1 + second.map_or(0, |s| s.model.config().hidden_size);
    if hidden != cfg.cross_attention_dim {
        let what = match second {
            Some(s) => format!("the text encoders' hidden sizes are {h1} + {}", s.model.config().hidden_size),
            None => format!("the text encoder's hidden_size is {h1}"),
        };
        return Err(bad(format!("cross_attention_dim is {}, but {what}", cfg.cross_attention_dim)));
    }
    if let (Some(s), Some(tt)) = (second, &cfg.text_time) {
        let projection = s.model.config().projection_dim.unwrap_or(0);
        if tt.pooled_dim(6) != projection {
            return Err(bad(format!(
                "projection_class_embeddings_input_dim {} is not text_encoder_2's projection_dim {projection} \
                 + 6 time ids * addition_time_embed_dim {}",
                tt.input_dim, tt.time_embed_dim
            )));
        }
    }
    Ok(())
}

/// The kind of `vs`'s weights (fp32 for an empty store).
fn kind_of(vs: &VarStore) -> Kind {
    vs.variables().values().next().map_or(Kind::Float, |t| t.kind())
}
