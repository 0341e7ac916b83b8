//! Text-to-image sampling as diffusers' `StableDiffusionPipeline.__call__` does it: prompts and
//! negative prompts through the text encoder, initial latents scaled by the sampler's initial
//! sigma, a DDIM or Euler loop with classifier-free guidance (conditional and unconditional
//! halves through the UNet as one batch; guidance 1 runs the conditional half alone), and the
//! VAE decoder.
use engine::job::{DeviceArgs, PrecisionArgs, SeedArgs};
use tch::{Kind, Tensor};

use crate::pipeline::StableDiffusion;
use crate::scheduler::{DdimScheduler, EulerDiscreteScheduler, SchedulerClass};
use crate::{Error, Result};

/// A UNet forward: (sample, timesteps, encoder hidden states) to the prediction.
pub type UNetCall<'a> = &'a dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>;

/// Which sampler runs the loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Sampler {
    /// DDIM, deterministic (eta 0).
    Ddim,
    /// Euler discrete.
    Euler,
}

/// What to sample.
#[derive(Clone, Debug)]
pub struct SampleOptions {
    /// Denoising steps.
    pub steps: usize,
    /// Classifier-free guidance scale (1: none).
    pub guidance: f64,
    /// The negative prompt of every image ("" as diffusers' default).
    pub negative_prompt: String,
    /// Image height in pixels.
    pub height: i64,
    /// Image width in pixels.
    pub width: i64,
    /// The sampler.
    pub sampler: Sampler,
    /// Images per prompt.
    pub images_per_prompt: usize,
    /// Seed of the initial latents.
    pub seed: u64,
}

impl StableDiffusion {
    /// The initial latents of `count` images for `opts` (standard normal, from the seed, the
    /// same on every device).
    pub fn initial_latents(&self, count: usize, opts: &SampleOptions) -> Result<Tensor> {
        self.check_size(opts)?;
        let scale = self.vae_scale();
        let shape = [count as i64, self.unet.config().in_channels, opts.height / scale, opts.width / scale];
        let mut rng = data::augment::Rng::keyed(opts.seed, 0x5d_1f_f5_10, 0);
        Ok(rng.normal_tensor(&shape).f_to_device(self.device())?)
    }

    fn check_size(&self, opts: &SampleOptions) -> Result<()> {
        let m = self.size_multiple();
        for (flag, v) in [("--height", opts.height), ("--width", opts.width)] {
            if v <= 0 || v % m != 0 {
                return Err(Error::Invalid(format!("{flag} {v}: this model needs a positive multiple of {m} pixels")));
            }
        }
        if opts.steps == 0 {
            return Err(Error::Invalid("--steps must be at least 1".into()));
        }
        if opts.images_per_prompt == 0 {
            return Err(Error::Invalid("--num-images must be at least 1".into()));
        }
        Ok(())
    }

    /// Images [prompts * images_per_prompt, 3, height, width] in [0, 1] (fp32): prompt `i`'s
    /// images first. `latents` replaces the seeded initial latents (unscaled, as diffusers'
    /// `latents=` argument).
    pub fn sample(&self, prompts: &[&str], opts: &SampleOptions, latents: Option<&Tensor>) -> Result<Tensor> {
        self.sample_with(prompts, opts, latents, &|x, t, c| self.unet.forward(x, t, c))
    }

    /// [`StableDiffusion::sample`] with the UNet run by `unet` (sample, timesteps, context):
    /// e.g. under Gemini during fine-tuning.
    pub fn sample_with(
        &self,
        prompts: &[&str],
        opts: &SampleOptions,
        latents: Option<&Tensor>,
        unet: UNetCall,
    ) -> Result<Tensor> {
        self.check_size(opts)?;
        if prompts.is_empty() {
            return Err(Error::Invalid("no prompt given".into()));
        }
        let n = opts.images_per_prompt;
        let expanded: Vec<&str> = prompts.iter().flat_map(|p| std::iter::repeat_n(*p, n)).collect();
        let count = expanded.len();
        let kind = self.kind();
        let cond = self.encode_prompts(&expanded)?;
        let guided = opts.guidance > 1.0;
        let context = match guided {
            true => {
                let negative = vec![opts.negative_prompt.as_str(); count];
                Tensor::f_cat(&[self.encode_prompts(&negative)?, cond], 0)?
            }
            false => cond,
        };
        let latents = match latents {
            Some(l) => {
                let want = self.initial_latents(count, opts)?.size();
                if l.size() != want {
                    return Err(Error::Invalid(format!("latents have shape {:?}, expected {want:?}", l.size())));
                }
                l.f_to_device(self.device())?
            }
            None => self.initial_latents(count, opts)?,
        };
        let predict = |x: &Tensor, t: &Tensor| -> Result<Tensor> {
            let input = match guided {
                true => Tensor::f_cat(&[x, x], 0)?,
                false => x.shallow_clone(),
            };
            let out = unet(&input.f_to_kind(kind)?, t, &context)?.f_to_kind(Kind::Float)?;
            if !guided {
                return Ok(out);
            }
            let halves = out.f_chunk(2, 0)?;
            Ok(halves[0].f_add(&halves[1].f_sub(&halves[0])?.f_mul_scalar(opts.guidance)?)?)
        };
        let device = self.device();
        let latents = tch::no_grad(|| -> Result<Tensor> {
            match opts.sampler {
                Sampler::Ddim => {
                    let mut s = DdimScheduler::new(self.scheduler.config(SchedulerClass::Ddim)?);
                    s.set_timesteps(opts.steps)?;
                    let mut x = latents.f_to_kind(Kind::Float)?.f_mul_scalar(s.init_noise_sigma())?;
                    for &t in s.timesteps() {
                        let eps = predict(&x, &Tensor::from(t).f_to_device(device)?)?;
                        x = s.step(&eps, t, &x, 0.0, None)?.prev_sample;
                    }
                    Ok(x)
                }
                Sampler::Euler => {
                    let mut s = EulerDiscreteScheduler::new(self.scheduler.config(SchedulerClass::EulerDiscrete)?);
                    s.set_timesteps(opts.steps)?;
                    let mut x = latents.f_to_kind(Kind::Float)?.f_mul_scalar(s.init_noise_sigma())?;
                    for (i, &t) in s.timesteps().to_vec().iter().enumerate() {
                        let input = s.scale_model_input(&x, i)?;
                        let eps = predict(&input, &Tensor::from(t as f32).f_to_device(device)?)?;
                        x = s.step(&eps, i, &x)?.prev_sample;
                    }
                    Ok(x)
                }
            }
        })?;
        let images = tch::no_grad(|| self.vae.decode(&latents.f_div_scalar(self.vae.scaling_factor())?))?;
        Ok(images.f_div_scalar(2.0)?.f_add_scalar(0.5)?.f_clamp(0.0, 1.0)?)
    }
}

/// Image `i` of a batch [B, 3, H, W] in [0, 1] as an [`data::images::Image`].
pub fn to_image(images: &Tensor, i: i64) -> Result<data::images::Image> {
    let img = images.f_get(i)?.f_to_kind(Kind::Float)?.f_to_device(tch::Device::Cpu)?.f_contiguous()?;
    let s = img.size();
    let pixels = Vec::<f32>::try_from(img.f_flatten(0, -1)?)?;
    Ok(data::images::Image::new(s[0] as usize, s[1] as usize, s[2] as usize, pixels))
}

/// `diffusion sample`'s options.
#[derive(clap::Args, Debug, Clone)]
pub struct SampleArgs {
    /// The diffusers pipeline folder.
    #[arg(long)]
    pub model: std::path::PathBuf,
    /// The prompt (repeat the flag for several).
    #[arg(long, required = true)]
    pub prompt: Vec<String>,
    /// What the images should not show.
    #[arg(long, default_value = "")]
    pub negative_prompt: String,
    /// Denoising steps.
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// The sampler.
    #[arg(long, value_enum, default_value_t = Sampler::Ddim)]
    pub scheduler: Sampler,
    /// Classifier-free guidance scale (1 turns guidance off).
    #[arg(long, default_value_t = 7.5)]
    pub guidance: f64,
    /// Seed of the initial latents: the same seed gives the same image.
    #[command(flatten)]
    pub seed: SeedArgs,
    /// Image side in pixels (default: the UNet's sample size times the VAE's scale).
    #[arg(long)]
    pub size: Option<i64>,
    /// Image height (default --size).
    #[arg(long)]
    pub height: Option<i64>,
    /// Image width (default --size).
    #[arg(long)]
    pub width: Option<i64>,
    /// Images per prompt.
    #[arg(long, default_value_t = 1)]
    pub num_images: usize,
    /// Arithmetic precision of the text encoder and UNet.
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// The device.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// The PNG to write; with several images, `<stem>-<i>.png` beside it.
    #[arg(short = 'o', long)]
    pub out: std::path::PathBuf,
}

/// Where image `i` of `count` goes.
pub fn output_path(out: &std::path::Path, i: usize, count: usize) -> std::path::PathBuf {
    if count == 1 {
        return out.to_path_buf();
    }
    let stem = out.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|| "image".into());
    out.with_file_name(format!("{stem}-{i}.png"))
}

/// Loads the pipeline, samples every image and writes the PNGs; returns their paths and the
/// seconds per image.
pub fn run(args: &SampleArgs) -> anyhow::Result<(Vec<std::path::PathBuf>, f64)> {
    use anyhow::Context;
    let device = args.device.device.device(0)?;
    let sd = StableDiffusion::load(&args.model, device, args.precision.precision.kind())
        .with_context(|| format!("--model {}", args.model.display()))?;
    eprintln!("text encoder: {}", sd.text_encoder.key_layout());
    let default_side = sd.unet.config().source.sample_size.map_or(512, |s| s * sd.vae_scale());
    let side = args.size.unwrap_or(default_side);
    let opts = SampleOptions {
        steps: args.steps,
        guidance: args.guidance,
        negative_prompt: args.negative_prompt.clone(),
        height: args.height.unwrap_or(side),
        width: args.width.unwrap_or(side),
        sampler: args.scheduler,
        images_per_prompt: args.num_images,
        seed: args.seed.seed,
    };
    let prompts: Vec<&str> = args.prompt.iter().map(String::as_str).collect();
    let start = std::time::Instant::now();
    let images = sd.sample(&prompts, &opts, None)?;
    let count = images.size()[0] as usize;
    let seconds = start.elapsed().as_secs_f64() / count as f64;
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut written = Vec::with_capacity(count);
    for i in 0..count {
        let path = output_path(&args.out, i, count);
        to_image(&images, i as i64)?.write_png(&path)?;
        written.push(path);
    }
    Ok((written, seconds))
}
