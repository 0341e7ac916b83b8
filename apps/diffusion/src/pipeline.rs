//! A Stable Diffusion pipeline folder as diffusers lays it out (`model_index.json`,
//! `tokenizer/`, `text_encoder/`, `unet/`, `vae/`, `scheduler/`), loaded whole, with the
//! components checked against each other.
use std::path::{Path, PathBuf};

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::clip::ClipTextModel;
use crate::config::check_model_index;
use crate::scheduler::SchedulerFile;
use crate::tokenizer::ClipTokenizer;
use crate::unet::UNet2DConditionModel;
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
        let (mut unet_vs, unet) =
            UNet2DConditionModel::load(&ComponentFiles::in_pipeline(root, "unet", "UNet2DConditionModel")?, device)?;
        let (vae_vs, vae) = AutoencoderKL::load(&ComponentFiles::in_pipeline(root, "vae", "AutoencoderKL")?, device)?;
        let scheduler = SchedulerFile::read(&root.join("scheduler").join("scheduler_config.json"))?;
        let (hidden, cross) = (text_encoder.config().hidden_size, unet.config().cross_attention_dim);
        if hidden != cross {
            return Err(Error::Format {
                path: root.join("unet").join("config.json"),
                msg: format!("cross_attention_dim is {cross}, but the text encoder's hidden_size is {hidden}"),
            });
        }
        let (latent, input) = (vae.config().latent_channels, unet.config().in_channels);
        if latent != input {
            return Err(Error::Format {
                path: root.join("unet").join("config.json"),
                msg: format!("in_channels is {input}, but the VAE's latent_channels is {latent}"),
            });
        }
        // The VAE stays in fp32: SD's VAE overflows in fp16 (diffusers' `force_upcast`), and
        // it runs once per image.
        for vs in [&mut text_encoder_vs, &mut unet_vs] {
            vs.set_kind(kind);
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
        })
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

    /// The text encoder's last hidden states [B, 77, hidden] for `prompts` (no attention mask,
    /// as Stable Diffusion's text encoders are run).
    pub fn encode_prompts(&self, prompts: &[&str]) -> Result<Tensor> {
        let (ids, _) = self.tokenizer.encode_batch(prompts, self.device())?;
        tch::no_grad(|| self.text_encoder.forward(&ids, None))
    }
}

/// The kind of `vs`'s weights (fp32 for an empty store).
fn kind_of(vs: &VarStore) -> Kind {
    vs.variables().values().next().map_or(Kind::Float, |t| t.kind())
}
