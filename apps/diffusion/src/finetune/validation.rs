//! Validation images during fine-tuning, as diffusers' `log_validation`: each
//! `--validation-prompt` through `diffusion sample`'s pipeline with the weights being trained
//! (the EMA weights with `--use-ema`), the pipeline's own sampler (DDIM where `diffusion
//! sample` has no sampler of the pipeline's class, e.g. `DDPMScheduler`), 20 steps, guidance 7.5, the
//! run's seed (the same starting latents every time, so the images show the training's
//! progress); written as `validation/step-<n>-<i>.png` under `--out`, prompt by prompt, and
//! with `--report-to tensorboard` logged as images `validation/<i>` at step n.
use std::path::{Path, PathBuf};

use anyhow::Context;
use engine::metrics::LoggedImage;

use crate::pipeline::StableDiffusion;
use crate::sample::{to_image, SampleOptions, Sampler, UNetCall};

/// What to draw.
pub struct Validation<'a> {
    /// The prompts.
    pub prompts: &'a [String],
    /// Images per prompt.
    pub images_per_prompt: usize,
    /// Side of the square images, pixels.
    pub resolution: usize,
    /// Seed of the starting latents.
    pub seed: u64,
}

impl Validation<'_> {
    /// Samples every prompt with `unet` (every rank runs it: its chunks may be sharded); when
    /// `write` (rank 0), writes `out/validation/step-<step>-<i>.png` and returns the paths.
    pub fn run(
        &self,
        sd: &StableDiffusion,
        unet: UNetCall,
        step: usize,
        out: &Path,
        write: bool,
    ) -> anyhow::Result<Vec<PathBuf>> {
        let opts = SampleOptions {
            steps: 20,
            guidance: 7.5,
            negative_prompt: None,
            height: self.resolution as i64,
            width: self.resolution as i64,
            sampler: sd.scheduler.class().ok().and_then(Sampler::from_class).unwrap_or(Sampler::Ddim),
            images_per_prompt: self.images_per_prompt,
            seed: self.seed,
            size_conditioning: None,
            negative_size_conditioning: None,
        };
        let dir = out.join("validation");
        if write {
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut named = vec![];
        for (p, prompt) in self.prompts.iter().enumerate() {
            let images = sd.sample_with(&[prompt.as_str()], &opts, None, unet)?;
            if !write {
                continue;
            }
            for j in 0..self.images_per_prompt {
                let path = dir.join(format!("step-{step}-{}.png", p * self.images_per_prompt + j));
                named.push((path, to_image(&images, j as i64)?));
            }
        }
        data::images::write_pngs(&named)?;
        Ok(named.into_iter().map(|(path, _)| path).collect())
    }
}

/// The validation images `written` (square, `resolution` pixels, RGB) as TensorBoard images:
/// tag `validation/<i>` for `step-<n>-<i>.png`, the PNG file's bytes.
pub fn tensorboard_images(written: &[PathBuf], resolution: usize) -> anyhow::Result<Vec<LoggedImage>> {
    written
        .iter()
        .enumerate()
        .map(|(i, path)| {
            let png = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
            let side = resolution as u32;
            Ok(LoggedImage { tag: format!("validation/{i}"), png, height: side, width: side, channels: 3 })
        })
        .collect()
}
