//! Text-to-image sampling as diffusers' `StableDiffusionPipeline.__call__` (and
//! `StableDiffusionXLPipeline.__call__`: both text encoders, the pooled projection, size/crop
//! time ids, zeros as the negative when none is given) does it: prompts and negative prompts
//! through the text encoder, initial latents scaled by the sampler's initial
//! sigma, one loop for every [`Scheduler`] with classifier-free guidance (conditional and
//! unconditional halves through the UNet as one batch; guidance 1 runs the conditional half
//! alone), and the VAE decoder. Every random draw (initial latents, ancestral samplers' step
//! noise) comes from the seed through [`data::augment::Rng`], so an image is the same on any
//! device.
use engine::job::{DeviceArgs, PrecisionArgs, SeedArgs};
use tch::{Kind, Tensor};

use crate::pipeline::{SizeConditioning, StableDiffusion};
use crate::scheduler::{self, Scheduler, SchedulerClass, SchedulerFile};
use crate::unet::Conditioning;
use crate::{Error, Result};

/// A UNet forward: (sample, timesteps, conditioning) to the prediction.
pub type UNetCall<'a> = &'a dyn Fn(&Tensor, &Tensor, &Conditioning) -> Result<Tensor>;

/// The largest image side in pixels that `sample` and `finetune` take (their flags' upper
/// bound): far past what the models were trained at, and small enough that a mistyped size is
/// an error naming the flag, not an allocation that aborts the process.
pub const MAX_SIDE: u64 = 4096;

/// Keys of the seeded draws: initial latents, and each step's noise.
const LATENTS_KEY: u64 = 0x5d_1f_f5_10;
const STEP_NOISE_KEY: u64 = 0x5d_1f_f5_11;

/// Which sampler runs the loop: a diffusers scheduler class reading the pipeline's
/// `scheduler_config.json` as its `from_config` does (keys the file lacks take the class's
/// defaults).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Sampler {
    /// DDIM, deterministic (eta 0): `DDIMScheduler`.
    Ddim,
    /// Euler: `EulerDiscreteScheduler`.
    Euler,
    /// Euler ancestral (fresh noise each step): `EulerAncestralDiscreteScheduler`.
    #[value(name = "euler-ancestral")]
    EulerAncestral,
    /// PNDM, SD 1.x's default: `PNDMScheduler`.
    Pndm,
    /// DPM-Solver++ 2M: `DPMSolverMultistepScheduler` (its file's Karras setting).
    #[value(name = "dpm++2m")]
    DpmSolver,
    /// DPM-Solver++ 2M with Karras sigmas: `DPMSolverMultistepScheduler` with
    /// `use_karras_sigmas=True`.
    #[value(name = "dpm++2m-karras")]
    DpmSolverKarras,
    /// UniPC: `UniPCMultistepScheduler`.
    #[value(name = "unipc")]
    UniPc,
}

impl Sampler {
    /// The diffusers class it reads the config as.
    pub fn class(self) -> SchedulerClass {
        match self {
            Sampler::Ddim => SchedulerClass::Ddim,
            Sampler::Euler => SchedulerClass::EulerDiscrete,
            Sampler::EulerAncestral => SchedulerClass::EulerAncestralDiscrete,
            Sampler::Pndm => SchedulerClass::Pndm,
            Sampler::DpmSolver | Sampler::DpmSolverKarras => SchedulerClass::DpmSolverMultistep,
            Sampler::UniPc => SchedulerClass::UniPcMultistep,
        }
    }

    /// The sampler of a pipeline whose `scheduler_config.json` names `class`, if it is one.
    pub fn from_class(class: SchedulerClass) -> Option<Sampler> {
        Some(match class {
            SchedulerClass::Ddim => Sampler::Ddim,
            SchedulerClass::EulerDiscrete => Sampler::Euler,
            SchedulerClass::EulerAncestralDiscrete => Sampler::EulerAncestral,
            SchedulerClass::Pndm => Sampler::Pndm,
            SchedulerClass::DpmSolverMultistep => Sampler::DpmSolver,
            SchedulerClass::UniPcMultistep => Sampler::UniPc,
            SchedulerClass::Ddpm => return None,
        })
    }

    /// The pipeline's own sampler: the class its scheduler config names in `_class_name` (PNDM
    /// for SD 1.5, DDIM for SD 2.1); a class without a sampler here is an error naming the file
    /// and the class.
    pub fn default_for(file: &SchedulerFile) -> Result<Sampler> {
        let class = file.class()?;
        Sampler::from_class(class).ok_or_else(|| Error::Format {
            path: file.path.clone(),
            msg: format!("_class_name {class} is not a sampler `diffusion sample` runs; choose one with --scheduler"),
        })
    }

    /// The scheduler reading `file`, as `Class.from_config(file)` in diffusers
    /// (`use_karras_sigmas=True` added for `dpm++2m-karras`).
    pub fn scheduler(self, file: &SchedulerFile) -> Result<Box<dyn Scheduler>> {
        let cfg = match self {
            Sampler::DpmSolverKarras => file.config_karras(self.class())?,
            _ => file.config(self.class())?,
        };
        scheduler::build(cfg)
    }
}

/// The randomness of a run given rather than drawn from the seed (as diffusers' `latents=`
/// argument), e.g. to compare with a reference that drew its own.
#[derive(Clone, Copy, Debug, Default)]
pub struct GivenNoise<'a> {
    /// The initial latents, unscaled (`[images, channels, h, w]`).
    pub latents: Option<&'a Tensor>,
    /// The noise of each step of an ancestral sampler, each the latents' shape.
    pub steps: Option<&'a [Tensor]>,
}

/// What to sample.
#[derive(Clone, Debug)]
pub struct SampleOptions {
    /// Denoising steps.
    pub steps: usize,
    /// Classifier-free guidance scale (1: none).
    pub guidance: f64,
    /// The negative prompt of every image. `None` is diffusers' `negative_prompt=None`: "" for
    /// SD 1.x/2.x, zeros for SDXL under `force_zeros_for_empty_prompt`.
    pub negative_prompt: Option<String>,
    /// Image height in pixels.
    pub height: i64,
    /// Image width in pixels.
    pub width: i64,
    /// The sampler.
    pub sampler: Sampler,
    /// Images per prompt.
    pub images_per_prompt: usize,
    /// Seed of the initial latents and of ancestral samplers' step noise.
    pub seed: u64,
    /// SDXL's size and crop conditioning (`None`: diffusers' defaults for the image size);
    /// unused by SD 1.x/2.x.
    pub size_conditioning: Option<SizeConditioning>,
    /// SDXL's size and crop conditioning of guidance's negative half (diffusers'
    /// `negative_original_size`, `negative_crops_coords_top_left`, `negative_target_size`;
    /// `None`: the same as the positive half's).
    pub negative_size_conditioning: Option<SizeConditioning>,
}

impl StableDiffusion {
    /// The initial latents of `count` images for `opts` (standard normal, from the seed, the
    /// same on every device).
    pub fn initial_latents(&self, count: usize, opts: &SampleOptions) -> Result<Tensor> {
        self.check_size(opts)?;
        let scale = self.vae_scale();
        let shape = [count as i64, self.unet.config().in_channels, opts.height / scale, opts.width / scale];
        let mut rng = data::augment::Rng::keyed(opts.seed, LATENTS_KEY, 0);
        Ok(rng.normal_tensor(&shape).f_to_device(self.device())?)
    }

    fn check_size(&self, opts: &SampleOptions) -> Result<()> {
        let m = self.size_multiple();
        for (flag, v) in [("--height", opts.height), ("--width", opts.width)] {
            if v <= 0 || v % m != 0 {
                return Err(Error::Invalid(format!("{flag} {v}: this model needs a positive multiple of {m} pixels")));
            }
            // The flags are bounded already; this catches library callers and a default side
            // from a config's `sample_size`.
            if v as u64 > MAX_SIDE {
                return Err(Error::Invalid(format!("{flag} {v}: at most {MAX_SIDE} pixels")));
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
        self.sample_with(prompts, opts, latents, &|x, t, c| self.unet.forward_cond(x, t, c))
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
        self.sample_given(prompts, opts, GivenNoise { latents, steps: None }, unet)
    }

    /// [`StableDiffusion::sample_with`] with the initial latents and ancestral step noise
    /// that `given` holds taken instead of drawn from the seed.
    pub fn sample_given(
        &self,
        prompts: &[&str],
        opts: &SampleOptions,
        given: GivenNoise,
        unet: UNetCall,
    ) -> Result<Tensor> {
        self.check_size(opts)?;
        if prompts.is_empty() {
            return Err(Error::Invalid("no prompt given".into()));
        }
        let n = opts.images_per_prompt;
        let expanded: Vec<&str> = prompts.iter().flat_map(|p| std::iter::repeat_n(*p, n)).collect();
        let count = expanded.len();
        let sizes = [opts.size_conditioning.unwrap_or(SizeConditioning::uncropped(opts.height, opts.width))];
        let negative_sizes = [opts.negative_size_conditioning.unwrap_or(sizes[0])];
        let cond = self.encode(&expanded, &sizes)?;
        let context = match (opts.guidance > 1.0, &opts.negative_prompt) {
            (false, _) => cond,
            // SDXL's zeroed negative: zero text states and pooled embedding, the negative
            // sizes' time ids.
            (true, None) if self.is_xl() && self.force_zeros_for_empty_prompt => {
                let negative = Conditioning {
                    context: cond.context.f_zeros_like()?,
                    text_time: match &cond.text_time {
                        Some(t) => Some(crate::unet::TextTime {
                            text_embeds: t.text_embeds.f_zeros_like()?,
                            time_ids: SizeConditioning::tensor(&vec![negative_sizes[0]; count], self.device())?,
                        }),
                        None => None,
                    },
                };
                Conditioning::cat(&[&negative, &cond])?
            }
            (true, negative) => {
                let negative = vec![negative.as_deref().unwrap_or(""); count];
                Conditioning::cat(&[&self.encode(&negative, &negative_sizes)?, &cond])?
            }
        };
        let want = self.initial_latents(count, opts)?;
        let latents = match given.latents {
            Some(l) if l.size() != want.size() => {
                return Err(Error::Invalid(format!("latents have shape {:?}, expected {:?}", l.size(), want.size())))
            }
            Some(l) => l.f_to_device(self.device())?,
            None => want,
        };
        let latents = tch::no_grad(|| self.denoise(latents, &context, opts, given.steps, unet))?;
        let latents = latents.f_div_scalar(self.vae.scaling_factor())?.f_to_kind(self.vae_kind())?;
        let images = tch::no_grad(|| self.vae.decode(&latents))?.f_to_kind(Kind::Float)?;
        Ok(images.f_div_scalar(2.0)?.f_add_scalar(0.5)?.f_clamp(0.0, 1.0)?)
    }

    /// The sampling loop from `latents` (fp32) to the final latents, the model's output guided
    /// as `uncond + guidance (cond - uncond)` when `context` holds both halves.
    fn denoise(
        &self,
        latents: Tensor,
        context: &Conditioning,
        opts: &SampleOptions,
        step_noise: Option<&[Tensor]>,
        unet: UNetCall,
    ) -> Result<Tensor> {
        let (device, kind, guided) = (self.device(), self.kind(), opts.guidance > 1.0);
        let context = &context.to_kind(kind)?;
        let predict = |x: &Tensor, t: f64| -> Result<Tensor> {
            let input = if guided { Tensor::f_cat(&[x, x], 0)? } else { x.shallow_clone() };
            // The UNet embeds timesteps in fp32 whatever their kind.
            let t = Tensor::from(t as f32).f_to_device(device)?;
            let out = unet(&input.f_to_kind(kind)?, &t, context)?.f_to_kind(Kind::Float)?;
            if !guided {
                return Ok(out);
            }
            let halves = out.f_chunk(2, 0)?;
            Ok(halves[0].f_add(&halves[1].f_sub(&halves[0])?.f_mul_scalar(opts.guidance)?)?)
        };
        let mut s = opts.sampler.scheduler(&self.scheduler)?;
        s.set_timesteps(opts.steps)?;
        let timesteps = s.timesteps().to_vec();
        if let Some(given) = step_noise.filter(|n| s.needs_noise() && n.len() < timesteps.len()) {
            return Err(Error::Invalid(format!("{} step noises given, {} steps to run", given.len(), timesteps.len())));
        }
        let mut x = latents.f_to_kind(Kind::Float)?.f_mul_scalar(s.init_noise_sigma())?;
        for (i, &t) in timesteps.iter().enumerate() {
            let out = predict(&s.scale_model_input(&x, i)?, t)?;
            let noise = match (s.needs_noise(), step_noise) {
                (false, _) => None,
                (true, Some(given)) => Some(given[i].f_to_device(device)?.f_to_kind(Kind::Float)?),
                (true, None) => {
                    let mut rng = data::augment::Rng::keyed(opts.seed, STEP_NOISE_KEY, i as u64);
                    Some(rng.normal_tensor(&x.size()).f_to_device(device)?)
                }
            };
            x = s.step(&out, i, &x, noise.as_ref())?;
        }
        Ok(x)
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
    /// What the images should not show (default: none; SD 1.x/2.x encode "", SDXL uses zeros
    /// where `model_index.json` sets `force_zeros_for_empty_prompt`, as diffusers).
    #[arg(long)]
    pub negative_prompt: Option<String>,
    /// Denoising steps.
    #[arg(long, default_value_t = 30)]
    pub steps: usize,
    /// The sampler (default: the pipeline's own, the class `_class_name` names in
    /// `scheduler/scheduler_config.json`: PNDM for SD 1.5, DDIM for SD 2.1). Each reads that
    /// file with its own class's defaults for the keys it lacks, as diffusers' `from_config`.
    #[arg(long, value_enum)]
    pub scheduler: Option<Sampler>,
    /// Classifier-free guidance scale (1 turns guidance off).
    #[arg(long, default_value_t = 7.5, value_parser = engine::parse::finite)]
    pub guidance: f64,
    /// Seed of the initial latents (and Euler ancestral's step noise): the same seed gives the
    /// same image.
    #[command(flatten)]
    pub seed: SeedArgs,
    /// Image side in pixels, 1 to 4096 (default: the UNet's sample size times the VAE's scale).
    #[arg(long, value_parser = side())]
    pub size: Option<i64>,
    /// Image height (default --size).
    #[arg(long, value_parser = side())]
    pub height: Option<i64>,
    /// Image width (default --size).
    #[arg(long, value_parser = side())]
    pub width: Option<i64>,
    /// Images per prompt.
    #[arg(long, default_value_t = 1)]
    pub num_images: usize,
    /// SDXL: the original size conditioning, HEIGHT,WIDTH (default: the image size).
    #[arg(long, value_parser = parse_pair)]
    pub original_size: Option<(i64, i64)>,
    /// SDXL: the crop top-left conditioning, TOP,LEFT.
    #[arg(long, value_parser = parse_pair, default_value = "0,0")]
    pub crops_coords_top_left: (i64, i64),
    /// SDXL: the target size conditioning, HEIGHT,WIDTH (default: the image size).
    #[arg(long, value_parser = parse_pair)]
    pub target_size: Option<(i64, i64)>,
    /// SDXL: the original size conditioning of guidance's negative half, HEIGHT,WIDTH (with
    /// --negative-target-size; without both the negative half takes the positive's sizes).
    #[arg(long, value_parser = parse_pair, requires = "negative_target_size")]
    pub negative_original_size: Option<(i64, i64)>,
    /// SDXL: the crop top-left conditioning of guidance's negative half, TOP,LEFT.
    #[arg(long, value_parser = parse_pair, default_value = "0,0")]
    pub negative_crops_coords_top_left: (i64, i64),
    /// SDXL: the target size conditioning of guidance's negative half, HEIGHT,WIDTH (with
    /// --negative-original-size).
    #[arg(long, value_parser = parse_pair, requires = "negative_original_size")]
    pub negative_target_size: Option<(i64, i64)>,
    /// LoRA adapters to add to the UNet: a `pytorch_lora_weights.safetensors` as `diffusion
    /// finetune --lora-rank`, diffusers' LoRA training scripts or peft save it, or a kohya
    /// file, each at the scale its metadata or `.alpha` keys give.
    #[arg(long)]
    pub lora: Option<std::path::PathBuf>,
    /// How much of the LoRA adapters to add (diffusers' LoRA scale).
    #[arg(long, default_value_t = 1.0, requires = "lora", value_parser = engine::parse::finite)]
    pub lora_scale: f64,
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

/// An image side flag: 1 to [`MAX_SIDE`] pixels, refused in words as `finetune --resolution` is.
fn side() -> impl clap::builder::TypedValueParser<Value = i64> {
    use clap::builder::TypedValueParser;
    engine::parse::count(1..=MAX_SIDE).map(|n| n as i64)
}

/// `A,B` as two integers (a size or a crop corner, height or top first).
fn parse_pair(s: &str) -> std::result::Result<(i64, i64), String> {
    let parse = |v: &str| v.trim().parse::<i64>().ok().filter(|&x| x >= 0);
    match s.split_once(',').map(|(a, b)| (parse(a), parse(b))) {
        Some((Some(a), Some(b))) => Ok((a, b)),
        _ => Err(format!("{s:?} is not two non-negative integers A,B")),
    }
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
    let device = args.device.device.device(0, 1)?;
    let sd = StableDiffusion::load(&args.model, device, args.precision.precision.kind())
        .with_context(|| format!("--model {}", args.model.display()))?;
    eprintln!("text encoder: {}", sd.text_encoder.key_layout());
    if let Some(file) = &args.lora {
        let adapted = crate::lora::Lora::attach_file(&sd.unet, file, args.lora_scale, device)
            .with_context(|| format!("--lora {}", file.display()))?;
        eprintln!("LoRA: {adapted} projections adapted from {} (scale {})", file.display(), args.lora_scale);
    }
    let sampler = match args.scheduler {
        Some(s) => s,
        None => Sampler::default_for(&sd.scheduler).context("--scheduler not given")?,
    };
    let name = clap::ValueEnum::to_possible_value(&sampler).map(|v| v.get_name().to_owned()).unwrap_or_default();
    eprintln!("scheduler: {name} ({})", sampler.class());
    let default_side = sd.unet.config().source.sample_size.map_or(512, |s| s * sd.vae_scale());
    let side = args.size.unwrap_or(default_side);
    let (height, width) = (args.height.unwrap_or(side), args.width.unwrap_or(side));
    let negative_sizes = match (args.negative_original_size, args.negative_target_size) {
        (Some(original), Some(target)) => {
            Some(SizeConditioning { original, crop_top_left: args.negative_crops_coords_top_left, target })
        }
        _ => None,
    };
    let xl_flags = args.original_size.is_some()
        || args.target_size.is_some()
        || args.crops_coords_top_left != (0, 0)
        || negative_sizes.is_some()
        || args.negative_crops_coords_top_left != (0, 0);
    if xl_flags && !sd.is_xl() {
        anyhow::bail!(
            "--original-size, --crops-coords-top-left, --target-size and their --negative-* forms condition SDXL pipelines only"
        );
    }
    if args.negative_crops_coords_top_left != (0, 0) && negative_sizes.is_none() {
        anyhow::bail!(
            "--negative-crops-coords-top-left needs --negative-original-size and --negative-target-size \
             (diffusers uses negative size conditioning only when both sizes are given)"
        );
    }
    let opts = SampleOptions {
        steps: args.steps,
        guidance: args.guidance,
        negative_prompt: args.negative_prompt.clone(),
        height,
        width,
        sampler,
        images_per_prompt: args.num_images,
        seed: args.seed.seed,
        size_conditioning: Some(SizeConditioning {
            original: args.original_size.unwrap_or((height, width)),
            crop_top_left: args.crops_coords_top_left,
            target: args.target_size.unwrap_or((height, width)),
        }),
        negative_size_conditioning: negative_sizes,
    };
    let prompts: Vec<&str> = args.prompt.iter().map(String::as_str).collect();
    // As diffusers, say what CLIP's length truncates rather than drop it silently.
    let negative = args.negative_prompt.iter().map(|p| ("the negative prompt".to_string(), p.as_str()));
    let named = prompts.iter().enumerate().map(|(i, p)| (format!("prompt {}", i + 1), *p));
    for (what, text) in named.chain(negative) {
        let (tokens, kept) = sd.tokenizer.token_count(text);
        if tokens > kept {
            eprintln!(
                "warning: {what} has {tokens} tokens; CLIP reads the first {kept}, the last {} are dropped",
                tokens - kept
            );
        }
    }
    let start = std::time::Instant::now();
    let images = sd.sample(&prompts, &opts, None)?;
    // NaN pixels would be written as black: say so instead of writing them.
    if !bool::try_from(images.f_isfinite()?.f_all()?)? {
        anyhow::bail!(
            "sampling gave NaN or infinite pixels (from the weights, the LoRA file or the scheduler's settings); \
             no image written"
        );
    }
    let count = images.size()[0] as usize;
    let seconds = start.elapsed().as_secs_f64() / count as f64;
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let named = (0..count)
        .map(|i| Ok((output_path(&args.out, i, count), to_image(&images, i as i64)?)))
        .collect::<Result<Vec<_>>>()?;
    data::images::write_pngs(&named)?;
    let written = named.into_iter().map(|(path, _)| path).collect();
    Ok((written, seconds))
}
