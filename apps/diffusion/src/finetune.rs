//! `diffusion finetune`: Stable Diffusion UNet fine-tuning under Gemini, as diffusers'
//! `train_text_to_image.py` (and `train_dreambooth.py` with an instance prompt) trains: images
//! through the frozen VAE encoder (a sample of the posterior times the scaling factor), noise
//! added at uniform timesteps by the DDPM schedule, the UNet's prediction against the epsilon
//! or velocity target (the scheduler config's prediction type), mean squared error optionally
//! weighted by min-SNR-gamma, AdamW or LAMB.
//!
//! The UNet's parameters live in Gemini's chunks: fp32 masters, gradients and optimizer state
//! in host or device memory as the placement decides under `--gpu-mem` (the device's
//! allocator is capped there too), compute copies in the `--precision` kind; with `--nproc`
//! each rank holds 1/N of every chunk (ZeRO-3) and the gradients are averaged. Each part of the
//! UNet (time embedding, `conv_in`, every down, mid and up block, the head) is one Gemini
//! module: only its chunks need be resident while it runs forward or backward.
//!
//! With `--lora-rank` only LoRA adapters train ([`crate::lora`]): the frozen UNet stays whole
//! on the device in the compute kind, the adapters and their AdamW/LAMB state in fp32, their
//! gradients averaged over the ranks.
//!
//! Random draws (batch order, crops, flips, posterior samples, noise, timesteps) come from
//! generators keyed by the seed, step and example, so a run is the same on any device and
//! any number of ranks.
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use data::augment::Rng;
use data::captions::{CaptionedImages, CropMode, Preprocess};
use engine::dist::{ReduceOp, World};
use engine::gemini::{
    cap_device_memory, parse_bytes, ChunkConfig, CpuRule, Gemini, GeminiConfig, Placement, Replication,
};
use engine::optim::{clip_grad_norm, AdamW, AdamWConfig, Lamb, LambConfig, LossScaler, Optimizer, Param};
use engine::runtime::DeviceKind;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::lora::Lora;
use crate::pipeline::StableDiffusion;
use crate::sample::{Precision, SampleOptions, Sampler};
use crate::scheduler::{DdpmScheduler, SchedulerClass};
use crate::unet::{PartRunner, UNet2DConditionModel};
use crate::{Error, Result};

/// The optimizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerKind {
    /// AdamW (diffusers' default; weight decay 1e-2).
    Adamw,
    /// LAMB (layer-wise trust ratios, for large batches).
    Lamb,
}

/// `diffusion finetune`'s options.
#[derive(clap::Args, Debug, Clone)]
pub struct FinetuneArgs {
    /// The diffusers pipeline folder to start from.
    #[arg(long)]
    pub model: PathBuf,
    /// The image folder (captions in metadata.jsonl or .txt files, or --instance-prompt).
    #[arg(long)]
    pub data: PathBuf,
    /// DreamBooth: every image takes this prompt (caption files are not read).
    #[arg(long)]
    pub instance_prompt: Option<String>,
    /// Output directory: `model/` (a diffusers folder), `log.jsonl`, `samples/`.
    #[arg(short = 'o', long)]
    pub out: PathBuf,
    /// Training resolution (square, pixels).
    #[arg(long, default_value_t = 512)]
    pub resolution: usize,
    /// Crop the centre square (default: a random square).
    #[arg(long)]
    pub center_crop: bool,
    /// Flip images horizontally at random.
    #[arg(long)]
    pub random_flip: bool,
    /// Images per rank per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Recompute each UNet block's activations in backward instead of keeping them.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub grad_accum: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-5)]
    pub lr: f64,
    /// Linear warm-up steps to the peak learning rate (then constant).
    #[arg(long, default_value_t = 0)]
    pub lr_warmup_steps: usize,
    /// The optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Adamw)]
    pub optimizer: OptimizerKind,
    /// Weight decay.
    #[arg(long, default_value_t = 1e-2)]
    pub weight_decay: f64,
    /// Gradient-norm clip.
    #[arg(long, default_value_t = 1.0)]
    pub max_grad_norm: f64,
    /// Min-SNR-gamma loss weighting (Hang et al. 2023; 5 is the usual value).
    #[arg(long)]
    pub snr_gamma: Option<f64>,
    /// Offset noise (adds `offset * N(0, 1)` per image and channel).
    #[arg(long, default_value_t = 0.0)]
    pub noise_offset: f64,
    /// Compute precision of the UNet (fp32 masters and optimizer state either way; fp16 with
    /// dynamic loss scaling).
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// Cap on the device memory of the job (e.g. 4G); Gemini places the chunks to fit it.
    #[arg(long)]
    pub gpu_mem: Option<String>,
    /// Train LoRA adapters of this rank on the attention projections instead of the whole UNet
    /// (saved as `pytorch_lora_weights.safetensors`).
    #[arg(long)]
    pub lora_rank: Option<i64>,
    /// LoRA's alpha (the update is scaled by alpha / rank; default: the rank).
    #[arg(long)]
    pub lora_alpha: Option<f64>,
    /// Device (cuda: each rank its local GPU).
    #[arg(long, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Local ranks to spawn (under torchrun, Slurm or mpirun the launcher decides).
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// Seed of every random draw.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write `samples/step-<n>.png` from --sample-prompt every this many steps (0: never).
    #[arg(long, default_value_t = 0)]
    pub sample_every: usize,
    /// The prompt of the periodic samples (default: the first image's caption).
    #[arg(long)]
    pub sample_prompt: Option<String>,
    /// Save `model/` every this many steps as well as at the end (0: at the end only).
    #[arg(long, default_value_t = 0)]
    pub save_every: usize,
    /// Rendezvous and collective timeout in seconds.
    #[arg(long, default_value_t = 300.0)]
    pub timeout: f64,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// One micro-batch: pixels in [-1, 1] and captions.
pub struct Batch {
    /// [B, 3, R, R].
    pub pixels: Tensor,
    /// One caption per image.
    pub captions: Vec<String>,
}

/// The fixed random draws of one micro-batch, from the seed: posterior noise, noise, timesteps.
pub struct Draws {
    /// Standard normal [B, C, h, w] for the posterior sample.
    pub posterior: Tensor,
    /// The noise added [B, C, h, w].
    pub noise: Tensor,
    /// Per-image offset noise [B, C, 1, 1] (scaled by `noise_offset`).
    pub offset: Tensor,
    /// Timesteps [B] in [0, T).
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
    unet: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let device = sd.device();
    let captions: Vec<&str> = batch.captions.iter().map(String::as_str).collect();
    let context = sd.encode_prompts(&captions)?.f_to_kind(kind)?;
    let latents = tch::no_grad(|| -> Result<Tensor> {
        let posterior = sd.vae.encode(&batch.pixels.f_to_device(device)?)?;
        Ok(posterior.sample_with(&draws.posterior.f_to_device(device)?)?.f_mul_scalar(sd.vae.scaling_factor())?)
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

/// The UNet's parameters as Gemini registers them, and which of them each part of the UNet
/// uses ([`crate::unet::UNet2DConditionModel::parts`]).
pub struct UnetParams {
    /// Part by part in execution order (so a part's parameters share chunks), by name within a
    /// part: the same order on every rank.
    pub params: Vec<Param>,
    /// Each part's parameter indices into `params`.
    pub parts: Vec<Vec<usize>>,
}

impl UnetParams {
    /// The trainable parameters of `unet`, whose variables `vs` holds at its root, grouped by
    /// part.
    pub fn of(unet: &UNet2DConditionModel, vs: &VarStore) -> Result<UnetParams> {
        let prefixes = unet.parts();
        let part_of = |name: &str| {
            prefixes.iter().position(|part| {
                part.iter().any(|pre| {
                    name.strip_prefix(pre.as_str()).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
                })
            })
        };
        let mut keyed = vec![];
        for p in engine::optim::params_of(vs) {
            let part = part_of(&p.name)
                .ok_or_else(|| Error::Invalid(format!("UNet parameter {} belongs to no part of the model", p.name)))?;
            keyed.push((part, p));
        }
        // Stable: names stay sorted within a part.
        keyed.sort_by_key(|(part, _)| *part);
        let mut parts = vec![vec![]; prefixes.len()];
        for (i, (part, _)) in keyed.iter().enumerate() {
            parts[*part].push(i);
        }
        Ok(UnetParams { params: keyed.into_iter().map(|(_, p)| p).collect(), parts })
    }
}

/// Runs each part of the UNet as its own Gemini module.
pub struct GeminiParts<'a> {
    /// The chunks and optimizer.
    pub gemini: &'a Gemini,
    /// Each part's parameter indices ([`UnetParams::parts`]).
    pub parts: &'a [Vec<usize>],
}

impl PartRunner for GeminiParts<'_> {
    fn run(
        &self,
        part: usize,
        inputs: &[&Tensor],
        f: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        self.gemini.run_many(&self.parts[part], inputs, f)
    }
}

/// Gemini's configuration for the UNet: `budget` bytes on `device` (auto placement) or no
/// budget (every home on the device), compute copies in `compute`.
pub fn gemini_config(
    device: Device,
    budget: Option<u64>,
    rule: CpuRule,
    compute: Kind,
    replication: Option<Replication>,
) -> GeminiConfig {
    GeminiConfig {
        chunks: ChunkConfig {
            device,
            budget: budget.map_or(usize::MAX / 4, |b| b as usize),
            // 16K to 32M elements: a few chunks for tiny models, ~64 MiB fp16 chunks for SD.
            search: (1 << 14, 1 << 25, 1 << 14),
            home_buffers: 0,
            compute,
        },
        placement: match budget {
            Some(_) => Placement::Auto,
            None => Placement::Static { offload: 0.0 },
        },
        // The next parts' chunks load on a side stream while the current part computes (GPU).
        prefetch: 2,
        rule,
        replication,
    }
}

/// What trains: the whole UNet under Gemini, or LoRA adapters with a tensor optimizer.
enum Trainer {
    Gemini { gemini: Gemini, parts: Vec<Vec<usize>> },
    Lora { lora: Lora, opt: std::cell::RefCell<Box<dyn Optimizer>> },
}

impl Trainer {
    fn set_lr(&self, lr: f64) -> Result<()> {
        match self {
            Trainer::Gemini { gemini, .. } => gemini.optimizer()?.set_lr(lr),
            Trainer::Lora { opt, .. } => opt.borrow_mut().set_lr(lr),
        }
        Ok(())
    }

    /// After each micro-batch's backward: gradients into the chunks or onto the adapters.
    fn after_backward(&self) -> Result<()> {
        match self {
            Trainer::Gemini { gemini, .. } => Ok(gemini.finish_backward()?),
            Trainer::Lora { lora, .. } => lora.backward(),
        }
    }

    /// Unscales (fp16), clips and steps; returns the gradient norm, or `None` for a step
    /// skipped on overflow.
    fn step(&self, world: &World, scaler: Option<&LossScaler>, max_norm: f64) -> Result<Option<f64>> {
        match self {
            Trainer::Gemini { gemini, .. } => {
                if let Some(s) = scaler {
                    if !gemini.unscale(s)? {
                        gemini.skip_step()?;
                        return Ok(None);
                    }
                }
                let norm = gemini.clip_grad_norm(max_norm)?;
                gemini.step()?;
                Ok(Some(norm))
            }
            Trainer::Lora { opt, .. } => {
                let mut opt = opt.borrow_mut();
                let group = (world.size() > 1).then_some(&world.group);
                if let Some(g) = group {
                    for p in opt.params() {
                        let mut grad = p.tensor.grad();
                        g.all_reduce(&grad, ReduceOp::Sum)?;
                        let _ = tch::no_grad(|| grad.f_div_scalar_(world.size() as f64))?;
                    }
                }
                let finite = match scaler {
                    Some(s) => s.unscale(opt.params(), group)?,
                    None => true,
                };
                if !finite {
                    opt.zero_grad();
                    return Ok(None);
                }
                let norm = clip_grad_norm(opt.params(), max_norm, None)?;
                opt.step()?;
                opt.zero_grad();
                Ok(Some(norm))
            }
        }
    }
}

/// One step's record.
#[derive(Debug, serde::Serialize)]
pub struct StepLog {
    /// 1-based step.
    pub step: usize,
    /// Mean loss over the micro-batches (this rank's images).
    pub loss: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Seconds of the step.
    pub seconds: f64,
    /// Gradient norm before clipping (none on a skipped fp16 step).
    pub grad_norm: Option<f64>,
    /// Peak memory so far (allocator on a GPU, resident set on the CPU), bytes.
    pub peak_bytes: Option<u64>,
}

/// Copies a file tree (the components that fine-tuning does not change).
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// Writes `out/model/`: the base folder with the UNet replaced by `weights` (fp32, diffusers'
/// names), through a staging folder renamed into place.
pub fn save_model(base: &Path, weights: &[(String, Tensor)], out: &Path) -> Result<PathBuf> {
    let target = out.join("model");
    let staging = out.join(format!(".model.staging-{}", std::process::id()));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let _ = std::fs::remove_dir_all(&staging);
    let result = (|| -> Result<()> {
        for entry in std::fs::read_dir(base).map_err(io(base))? {
            let entry = entry.map_err(io(base))?;
            let name = entry.file_name();
            let to = staging.join(&name);
            if name == "unet" {
                continue;
            }
            match entry.file_type().map_err(io(&entry.path()))?.is_dir() {
                true => copy_tree(&entry.path(), &to).map_err(io(&to))?,
                false => {
                    std::fs::create_dir_all(&staging).map_err(io(&staging))?;
                    std::fs::copy(entry.path(), &to).map_err(io(&to))?;
                }
            }
        }
        let unet = staging.join("unet");
        std::fs::create_dir_all(&unet).map_err(io(&unet))?;
        std::fs::copy(base.join("unet").join("config.json"), unet.join("config.json")).map_err(io(&unet))?;
        data::checkpoint::save_tensors(weights, &unet.join(crate::weights::WEIGHTS))?;
        let old = out.join(format!(".model.old-{}", std::process::id()));
        if target.exists() {
            std::fs::rename(&target, &old).map_err(io(&target))?;
        }
        std::fs::rename(&staging, &target).map_err(io(&target))?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result.map(|()| target)
}

/// The images of step `step`'s micro-batch `micro` for this rank: a shuffled order per epoch
/// from the seed, global batches split across the ranks.
fn batch_indices(len: usize, seed: u64, global_index: usize, count: usize) -> Vec<usize> {
    (global_index..global_index + count)
        .map(|g| {
            let (epoch, pos) = (g / len, g % len);
            let mut order: Vec<usize> = (0..len).collect();
            let mut rng = Rng::keyed(seed, epoch as u64, 0x0bde_5eed);
            for i in (1..len).rev() {
                let j = (rng.uniform() * (i + 1) as f64) as usize;
                order.swap(i, j.min(i));
            }
            order[pos]
        })
        .collect()
}

/// Runs the fine-tuning; rank 0 writes the log, samples and the model. Returns the log.
pub fn run(args: &FinetuneArgs, world: &World) -> anyhow::Result<Vec<StepLog>> {
    if args.resolution == 0 || args.batch == 0 || args.grad_accum == 0 || args.steps == 0 {
        bail!("--resolution, --batch, --grad-accum and --steps must be at least 1");
    }
    let device = args.device.device(world.env.local_rank)?;
    let budget =
        args.gpu_mem.as_deref().map(|s| parse_bytes(s).with_context(|| format!("--gpu-mem {s}"))).transpose()?;
    if let Some(b) = budget {
        cap_device_memory(device, b)?;
    }
    let kind = args.precision.kind();
    let data = CaptionedImages::open(&args.data, args.instance_prompt.as_deref())
        .with_context(|| format!("--data {}", args.data.display()))?;
    if data.is_empty() {
        bail!("--data {}: no images", args.data.display());
    }
    // Everything is read into host memory first: under Gemini the UNet's weights stay there
    // for Gemini to chunk (bringing to the device only what the budget allows), where loading
    // them onto the device would alone fill a 4 GiB cap with SD 1.5's fp32 UNet.
    let mut sd = StableDiffusion::load(&args.model, Device::Cpu, Kind::Float)
        .with_context(|| format!("--model {}", args.model.display()))?;
    if world.rank() == 0 {
        eprintln!("text encoder: {}", sd.text_encoder.key_layout());
    }
    sd.text_encoder_vs.set_device(device);
    sd.vae_vs.set_device(device);
    let multiple = sd.size_multiple() as usize;
    if !args.resolution.is_multiple_of(multiple) {
        bail!("--resolution {}: this model needs a multiple of {multiple} pixels", args.resolution);
    }
    sd.unet.set_gradient_checkpointing(args.gradient_checkpointing);
    let ddpm = DdpmScheduler::new(sd.scheduler.config(SchedulerClass::Ddpm)?);
    let adamw = AdamWConfig { lr: args.lr, weight_decay: args.weight_decay, ..AdamWConfig::default() };
    let lamb = LambConfig { lr: args.lr, weight_decay: args.weight_decay, ..LambConfig::default() };
    let trainer = match args.lora_rank {
        Some(rank) => {
            // The frozen UNet runs whole on the device, in the compute kind.
            sd.unet_vs.set_kind(kind);
            sd.unet_vs.set_device(device);
            let lora = Lora::new(&sd.unet_vs, rank, args.lora_alpha.unwrap_or(rank as f64), args.seed)?;
            let opt: Box<dyn Optimizer> = match args.optimizer {
                OptimizerKind::Adamw => Box::new(AdamW::new(lora.params(), adamw)),
                OptimizerKind::Lamb => Box::new(Lamb::new(lora.params(), lamb)),
            };
            Trainer::Lora { lora, opt: std::cell::RefCell::new(opt) }
        }
        None => {
            let UnetParams { params, parts } = UnetParams::of(&sd.unet, &sd.unet_vs)?;
            let rule = match args.optimizer {
                OptimizerKind::Adamw => CpuRule::AdamW(adamw),
                OptimizerKind::Lamb => CpuRule::Lamb(lamb),
            };
            let replication = (world.size() > 1).then(|| Replication { group: world.group.clone(), shard: true });
            let gemini = Gemini::new(&params, gemini_config(device, budget, rule, kind, replication))?;
            Trainer::Gemini { gemini, parts }
        }
    };
    let mut scaler = (args.precision == Precision::Fp16).then(LossScaler::default);
    let unet = |x: &Tensor, t: &Tensor, c: &Tensor| -> Result<Tensor> {
        match &trainer {
            Trainer::Gemini { gemini, parts } => sd.unet.forward_with(x, t, c, &GeminiParts { gemini, parts }),
            Trainer::Lora { .. } => sd.unet.forward(x, t, c),
        }
    };
    let scale = sd.vae_scale();
    let side = args.resolution as i64 / scale;
    let latent = [sd.unet.config().in_channels, side, side];
    let train_steps = ddpm.config().num_train_timesteps;
    let how = Preprocess {
        resolution: args.resolution,
        crop: if args.center_crop { CropMode::Center } else { CropMode::Random },
        flip: args.random_flip,
    };
    let (rank, ranks) = (world.rank(), world.size());
    let per_step = args.batch * args.grad_accum * ranks;
    let mut file = match rank {
        0 => {
            std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
            Some(std::fs::File::create(args.out.join("log.jsonl")).context("creating log.jsonl")?)
        }
        _ => None,
    };
    let mut log = Vec::new();
    let progress = engine::runtime::progress_bar(rank == 0 && !args.quiet, args.steps, 0);
    for step in 1..=args.steps {
        let start = Instant::now();
        let lr = match args.lr_warmup_steps {
            0 => args.lr,
            w => args.lr * (step.min(w) as f64 / w as f64),
        };
        trainer.set_lr(lr)?;
        if let Trainer::Lora { lora, .. } = &trainer {
            lora.apply()?;
        }
        let mut total = 0.0;
        for micro in 0..args.grad_accum {
            let first = (step - 1) * per_step + (micro * ranks + rank) * args.batch;
            let indices = batch_indices(data.len(), args.seed, first, args.batch);
            let mut pixels = Vec::with_capacity(args.batch);
            let mut captions = Vec::with_capacity(args.batch);
            for (k, &i) in indices.iter().enumerate() {
                let mut rng = Rng::keyed(args.seed, step as u64, (first + k) as u64);
                let img = data.load(i, how, &mut rng)?;
                let r = img.height as i64;
                pixels.push(Tensor::from_slice(&img.pixels).reshape([3, r, r]));
                captions.push(data.caption(i).to_string());
            }
            let batch = Batch { pixels: Tensor::stack(&pixels, 0), captions };
            let draws = Draws::new(args.seed, step, first, args.batch, latent, train_steps);
            let l = loss(&sd, &ddpm, &batch, &draws, args.noise_offset, args.snr_gamma, kind, &unet)?;
            total += l.double_value(&[]);
            let l = l.f_div_scalar(args.grad_accum as f64)?;
            match &scaler {
                Some(s) => s.scale_loss(&l)?.backward(),
                None => l.backward(),
            }
            trainer.after_backward()?;
        }
        let grad_norm = trainer.step(world, scaler.as_ref(), args.max_grad_norm)?;
        let finite = grad_norm.is_some();
        if let Some(s) = scaler.as_mut() {
            s.update(finite);
        }
        let entry = StepLog {
            step,
            loss: total / args.grad_accum as f64,
            lr,
            seconds: start.elapsed().as_secs_f64(),
            grad_norm,
            peak_bytes: engine::runtime::peak_memory(device),
        };
        if let Some(f) = file.as_mut() {
            writeln!(f, "{}", serde_json::to_string(&entry)?)?;
        }
        progress.set_message(format!("loss {:.5}  lr {lr:.2e}  {:.2} s/step", entry.loss, entry.seconds));
        progress.inc(1);
        log.push(entry);
        if args.sample_every > 0 && step % args.sample_every == 0 {
            let prompt = args.sample_prompt.clone().unwrap_or_else(|| data.caption(0).to_string());
            let opts = SampleOptions {
                steps: 20,
                guidance: 7.5,
                negative_prompt: String::new(),
                height: args.resolution as i64,
                width: args.resolution as i64,
                sampler: Sampler::Ddim,
                images_per_prompt: 1,
                seed: args.seed,
            };
            // Every rank runs the UNet (its chunks may be sharded); rank 0 writes the image.
            let images = sd.sample_with(&[prompt.as_str()], &opts, None, &unet)?;
            if rank == 0 {
                let dir = args.out.join("samples");
                std::fs::create_dir_all(&dir)?;
                crate::sample::to_image(&images, 0)?.write_png(&dir.join(format!("step-{step}.png")))?;
            }
        }
        if step == args.steps || (args.save_every > 0 && step % args.save_every == 0) {
            match &trainer {
                Trainer::Gemini { gemini, .. } => {
                    // Every rank takes part in gathering sharded weights.
                    let weights = gemini.state_dict()?;
                    if rank == 0 {
                        save_model(&args.model, &weights, &args.out)?;
                    }
                }
                Trainer::Lora { lora, .. } if rank == 0 => lora.save(&args.out)?,
                Trainer::Lora { .. } => {}
            }
        }
    }
    progress.finish_and_clear();
    Ok(log)
}
