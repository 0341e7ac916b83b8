//! The fine-tuning objective of one micro-batch, as diffusers' `train_text_to_image.py` (and
//! `train_text_to_image_sdxl.py`: both encoders' penultimate states, encoder 2's pooled
//! projection and each image's size/crop time ids) computes it: captions through the frozen
//! text encoder, images through the frozen VAE encoder
//! (a posterior sample times the scaling factor), noise (optionally offset) added at uniform
//! timesteps by the DDPM schedule, and the UNet's prediction against the epsilon or velocity
//! target in mean squared error, optionally weighted by min-SNR-gamma. The random draws come
//! from generators keyed by the seed, step and image, so they do not depend on the ranks.
use data::augment::Rng;
use tch::{Kind, Tensor};

use crate::pipeline::{SizeConditioning, StableDiffusion};
use crate::scheduler::DdpmScheduler;
use crate::unet::Conditioning;
use crate::Result;

/// One micro-batch: pixels in [-1, 1] and captions.
pub struct Batch {
    /// [B, 3, R, R].
    pub pixels: Tensor,
    /// One caption per image.
    pub captions: Vec<String>,
    /// SDXL: each image's original size, crop and target size (unused by SD 1.x/2.x).
    pub sizes: Vec<SizeConditioning>,
}

/// The fixed random draws of one micro-batch, from the seed: posterior noise, noise, timesteps.
pub struct Draws {
    /// Standard normal [B, C, h, w] for the posterior sample.
    pub posterior: Tensor,
    /// The noise added [B, C, h, w].
    pub noise: Tensor,
    /// Per-image offset noise [B, C, 1, 1] (scaled by `noise_offset`).
    pub offset: Tensor,
    /// Timesteps `[B]` in [0, T).
    pub timesteps: Tensor,
}

impl Draws {
    /// The draws of images `first..first + count` of step `step` (`latent` = [C, h, w]).
    pub fn new(seed: u64, step: usize, first: usize, count: usize, latent: [i64; 3], train_steps: i64) -> Draws {
        let mut parts: [Vec<Tensor>; 4] = Default::default();
        for i in first..first + count {
            let mut rng = Rng::keyed(seed, step as u64, 0x7e57_0000 + i as u64);
            parts[0].push(rng.normal_tensor(&latent));
            parts[1].push(rng.normal_tensor(&latent));
            parts[2].push(rng.normal_tensor(&[latent[0], 1, 1]));
            parts[3].push(Tensor::from((rng.uniform() * train_steps as f64) as i64 % train_steps));
        }
        let [a, b, c, d] = parts.map(|p| Tensor::stack(&p, 0));
        Draws { posterior: a, noise: b, offset: c, timesteps: d }
    }
}

/// The training loss of one micro-batch: `unet` maps (noisy latents in the compute kind,
/// timesteps, text states) to its prediction. Returns the fp32 scalar.
#[allow(clippy::too_many_arguments)]
pub fn loss(
    sd: &StableDiffusion,
    ddpm: &DdpmScheduler,
    batch: &Batch,
    draws: &Draws,
    noise_offset: f64,
    snr_gamma: Option<f64>,
    kind: Kind,
    unet: &dyn Fn(&Tensor, &Tensor, &Conditioning) -> Result<Tensor>,
) -> Result<Tensor> {
    let device = sd.device();
    let captions: Vec<&str> = batch.captions.iter().map(String::as_str).collect();
    let context = sd.encode(&captions, &batch.sizes)?.to_kind(kind)?;
    // The frozen VAE encodes in its own kind (the compute kind under `finetune`, as diffusers'
    // `weight_dtype`); the noise arithmetic and the target are fp32 from there.
    let latents = tch::no_grad(|| -> Result<Tensor> {
        let posterior = sd.vae.encode(&batch.pixels.f_to_device(device)?.f_to_kind(sd.vae_kind())?)?;
        let sample = posterior.sample_with(&draws.posterior.f_to_device(device)?)?;
        Ok(sample.f_mul_scalar(sd.vae.scaling_factor())?.f_to_kind(Kind::Float)?)
    })?;
    let mut noise = draws.noise.f_to_device(device)?;
    if noise_offset != 0.0 {
        noise = noise.f_add(&draws.offset.f_to_device(device)?.f_mul_scalar(noise_offset)?)?;
    }
    let t = draws.timesteps.f_to_device(device)?;
    let noisy = ddpm.add_noise(&latents, &noise, &t)?;
    let target = ddpm.training_target(&latents, &noise, &t)?;
    let pred = unet(&noisy.f_to_kind(kind)?, &t, &context)?.f_to_kind(Kind::Float)?;
    let per_image = pred.f_sub(&target)?.f_square()?.f_mean_dim([1, 2, 3].as_slice(), false, Kind::Float)?;
    Ok(match snr_gamma {
        Some(g) => per_image.f_mul(&ddpm.min_snr_weights(&t, g)?)?.f_mean(Kind::Float)?,
        None => per_image.f_mean(Kind::Float)?,
    })
}
