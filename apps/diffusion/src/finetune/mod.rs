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
mod gemini_unet;
mod model_folder;
mod objective;

pub use gemini_unet::{gemini_config, GeminiParts, UnetParams};
pub use model_folder::save_model;
pub use objective::{loss, Batch, Draws};

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use data::augment::Rng;
use data::captions::{CaptionedImages, CropMode, Preprocess};
use engine::dist::{ReduceOp, World};
use engine::gemini::{cap_device_memory, parse_bytes, Gemini, Replication};
use engine::job::{JobArgs, OptimizerArgs, Precision, PrecisionArgs, ScheduleArgs, SeedArgs};
use engine::metrics::Metrics;
use engine::optim::{clip_grad_norm, LossScaler, LrSchedule, Optimizer};
use tch::{Device, Kind, Tensor};

use crate::lora::Lora;
use crate::pipeline::StableDiffusion;
use crate::sample::{SampleOptions, Sampler};
use crate::scheduler::{DdpmScheduler, SchedulerClass};
use crate::Result;

/// `diffusion finetune`'s options.
#[derive(clap::Args, Debug, Clone)]
#[command(
    mut_arg("lr", |a| a.default_value("1e-5")),
    mut_arg("weight_decay", |a| a.default_value("1e-2")),
    mut_arg("clip_grad", |a| a.default_value("1.0")),
    mut_arg("metrics", |a| a.default_value("log.jsonl")),
    mut_arg("precision", |a| a.help("Compute precision of the UNet (fp32 masters and optimizer state either way; fp16 with dynamic loss scaling)")),
)]
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
    /// Output directory: `model/` (a diffusers folder), the training log, `samples/`.
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
    /// Images per rank per micro-batch (diffusers' --train-batch-size).
    #[arg(long, visible_alias = "train-batch-size", default_value_t = 1)]
    pub micro_batch: usize,
    /// Recompute each UNet block's activations in backward instead of keeping them.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Micro-batches per optimizer step (diffusers' --gradient-accumulation-steps).
    #[arg(long, visible_alias = "gradient-accumulation-steps", default_value_t = 1)]
    pub grad_accum: usize,
    /// Optimizer steps.
    #[arg(long, default_value_t = 100)]
    pub steps: usize,
    /// The optimizer (AdamW by default, with diffusers' weight decay 1e-2 and clip 1).
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
    /// The learning-rate schedule (constant after warmup by default).
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Min-SNR-gamma loss weighting (Hang et al. 2023; 5 is the usual value).
    #[arg(long)]
    pub snr_gamma: Option<f64>,
    /// Offset noise (adds `offset * N(0, 1)` per image and channel).
    #[arg(long, default_value_t = 0.0)]
    pub noise_offset: f64,
    /// Compute precision.
    #[command(flatten)]
    pub precision: PrecisionArgs,
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
    /// Device, ranks, progress and the log file.
    #[command(flatten)]
    pub job: JobArgs,
    /// The seed of every random draw.
    #[command(flatten)]
    pub seed: SeedArgs,
    /// Write `samples/step-<n>.png` from --sample-prompt every this many steps (0: never).
    #[arg(long, default_value_t = 0)]
    pub sample_every: usize,
    /// The prompt of the periodic samples (default: the first image's caption).
    #[arg(long)]
    pub sample_prompt: Option<String>,
    /// Save `model/` every this many steps as well as at the end (0: at the end only).
    #[arg(long, default_value_t = 0)]
    pub save_every: usize,
}

/// What trains, as [`parallelize`] wired it: the whole UNet under Gemini (ZeRO-3 over the
/// ranks), or LoRA adapters with a replicated tensor optimizer.
pub enum UnetTraining {
    /// The UNet's parameters in Gemini's chunks, each part of the UNet its own module.
    Gemini {
        /// The chunks and their optimizer.
        gemini: Gemini,
        /// Each part's parameter indices.
        parts: Vec<Vec<usize>>,
    },
    /// LoRA adapters over the frozen UNet.
    Lora {
        /// The adapters.
        lora: Lora,
        /// Their optimizer.
        opt: std::cell::RefCell<Box<dyn Optimizer>>,
    },
}

impl UnetTraining {
    fn set_lr(&self, lr: f64) -> Result<()> {
        match self {
            UnetTraining::Gemini { gemini, .. } => gemini.optimizer()?.set_lr(lr),
            UnetTraining::Lora { opt, .. } => opt.borrow_mut().set_lr(lr),
        }
        Ok(())
    }

    /// After each micro-batch's backward: gradients into the chunks or onto the adapters.
    fn after_backward(&self) -> Result<()> {
        match self {
            UnetTraining::Gemini { gemini, .. } => Ok(gemini.finish_backward()?),
            UnetTraining::Lora { lora, .. } => lora.backward(),
        }
    }

    /// Unscales (fp16), clips and steps; returns the gradient norm, or `None` for a step
    /// skipped on overflow.
    fn step(&self, world: &World, scaler: Option<&LossScaler>, max_norm: Option<f64>) -> Result<Option<f64>> {
        let max_norm = max_norm.unwrap_or(f64::INFINITY);
        match self {
            UnetTraining::Gemini { gemini, .. } => {
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
            UnetTraining::Lora { opt, .. } => {
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

impl engine::metrics::Record for StepLog {
    const CSV_HEADER: &'static str = "step,loss,lr,seconds,grad_norm,peak_bytes";

    fn csv_row(&self) -> String {
        let norm = self.grad_norm.map(|n| format!("{n:.6}")).unwrap_or_default();
        let peak = self.peak_bytes.map(|b| b.to_string()).unwrap_or_default();
        format!("{},{:.6},{:.6e},{:.3},{norm},{peak}", self.step, self.loss, self.lr, self.seconds)
    }
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

/// The parallel wiring, applied outside the UNet: with `--lora-rank`, adapters over the frozen
/// UNet (whole on the device in the compute kind) and a replicated optimizer; otherwise the
/// UNet's parameters in Gemini's chunks, sharded over the ranks (ZeRO-3) and placed within
/// `budget` bytes of `device`.
pub fn parallelize(
    sd: &mut StableDiffusion,
    args: &FinetuneArgs,
    world: &World,
    device: Device,
    budget: Option<u64>,
) -> Result<UnetTraining> {
    let (kind, lr, seed) = (args.precision.precision.kind(), args.optimizer.lr, args.seed.seed);
    Ok(match args.lora_rank {
        Some(rank) => {
            sd.unet_vs.set_kind(kind);
            sd.unet_vs.set_device(device);
            let lora = Lora::new(&sd.unet_vs, rank, args.lora_alpha.unwrap_or(rank as f64), seed)?;
            let opt = args.optimizer.build(lora.params(), lr);
            UnetTraining::Lora { lora, opt: std::cell::RefCell::new(opt) }
        }
        None => {
            let UnetParams { params, parts } = UnetParams::of(&sd.unet, &sd.unet_vs)?;
            let replication = (world.size() > 1).then(|| Replication { group: world.group.clone(), shard: true });
            let config = gemini_config(device, budget, args.optimizer.rule(lr), kind, replication);
            UnetTraining::Gemini { gemini: Gemini::new(&params, config)?, parts }
        }
    })
}

/// One rank's fine-tuning run: the pipeline, the data and the UNet's parallel wiring.
pub struct Trainer<'a> {
    args: &'a FinetuneArgs,
    world: &'a World,
    sd: StableDiffusion,
    ddpm: DdpmScheduler,
    training: UnetTraining,
    scaler: Option<LossScaler>,
    data: CaptionedImages,
    preprocess: Preprocess,
    schedule: LrSchedule,
    device: Device,
    step: usize,
}

impl<'a> Trainer<'a> {
    /// Reads the pipeline and the data and wires the UNet for training; bad flags, data or
    /// model files are errors naming them.
    pub fn new(args: &'a FinetuneArgs, world: &'a World) -> anyhow::Result<Trainer<'a>> {
        if args.resolution == 0 || args.micro_batch == 0 || args.grad_accum == 0 || args.steps == 0 {
            bail!("--resolution, --micro-batch, --grad-accum and --steps must be at least 1");
        }
        let device = args.job.launch.device(world)?;
        let budget =
            args.gpu_mem.as_deref().map(|s| parse_bytes(s).with_context(|| format!("--gpu-mem {s}"))).transpose()?;
        if let Some(b) = budget {
            cap_device_memory(device, b)?;
        }
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
        let training = parallelize(&mut sd, args, world, device, budget)?;
        let preprocess = Preprocess {
            resolution: args.resolution,
            crop: if args.center_crop { CropMode::Center } else { CropMode::Random },
            flip: args.random_flip,
        };
        Ok(Trainer {
            args,
            world,
            ddpm,
            training,
            scaler: (args.precision.precision == Precision::Fp16).then(LossScaler::default),
            data,
            preprocess,
            schedule: args.schedule.schedule(args.optimizer.lr, args.steps),
            device,
            sd,
            step: 0,
        })
    }

    /// The UNet's prediction, through Gemini's parts or (LoRA) whole.
    fn unet(&self, x: &Tensor, t: &Tensor, c: &Tensor) -> Result<Tensor> {
        match &self.training {
            UnetTraining::Gemini { gemini, parts } => {
                self.sd.unet.forward_with(x, t, c, &GeminiParts { gemini, parts })
            }
            UnetTraining::Lora { .. } => self.sd.unet.forward(x, t, c),
        }
    }

    /// This rank's micro-batch `micro` of the coming step: preprocessed images, captions and
    /// the random draws, from the seed.
    fn micro_batch(&self, micro: usize) -> Result<(Batch, Draws)> {
        let a = self.args;
        let (rank, ranks, seed, step) = (self.world.rank(), self.world.size(), a.seed.seed, self.step + 1);
        let first = (step - 1) * a.micro_batch * a.grad_accum * ranks + (micro * ranks + rank) * a.micro_batch;
        let indices = batch_indices(self.data.len(), seed, first, a.micro_batch);
        let mut pixels = Vec::with_capacity(a.micro_batch);
        let mut captions = Vec::with_capacity(a.micro_batch);
        for (k, &i) in indices.iter().enumerate() {
            let mut rng = Rng::keyed(seed, step as u64, (first + k) as u64);
            let img = self.data.load(i, self.preprocess, &mut rng)?;
            let r = img.height as i64;
            pixels.push(Tensor::from_slice(&img.pixels).reshape([3, r, r]));
            captions.push(self.data.caption(i).to_string());
        }
        let side = a.resolution as i64 / self.sd.vae_scale();
        let latent = [self.sd.unet.config().in_channels, side, side];
        let draws = Draws::new(seed, step, first, a.micro_batch, latent, self.ddpm.config().num_train_timesteps);
        Ok((Batch { pixels: Tensor::stack(&pixels, 0), captions }, draws))
    }

    /// One optimizer step over `--grad-accum` micro-batches; returns its log record.
    pub fn step(&mut self) -> anyhow::Result<StepLog> {
        let start = Instant::now();
        let lr = self.schedule.at(self.step);
        self.training.set_lr(lr)?;
        if let UnetTraining::Lora { lora, .. } = &self.training {
            lora.apply()?;
        }
        let (a, kind) = (self.args, self.args.precision.precision.kind());
        let unet = |x: &Tensor, t: &Tensor, c: &Tensor| self.unet(x, t, c);
        let mut total = 0.0;
        for micro in 0..a.grad_accum {
            let (batch, draws) = self.micro_batch(micro)?;
            let l = loss(&self.sd, &self.ddpm, &batch, &draws, a.noise_offset, a.snr_gamma, kind, &unet)?;
            total += l.double_value(&[]);
            let l = l.f_div_scalar(a.grad_accum as f64)?;
            let scaled = match &self.scaler {
                Some(s) => s.scale_loss(&l)?,
                None => l,
            };
            engine::autograd::backward(&[&scaled], &[None], false)?;
            self.training.after_backward()?;
        }
        let grad_norm = self.training.step(self.world, self.scaler.as_ref(), a.optimizer.clip_grad)?;
        if let Some(s) = self.scaler.as_mut() {
            s.update(grad_norm.is_some());
        }
        self.step += 1;
        Ok(StepLog {
            step: self.step,
            loss: total / a.grad_accum as f64,
            lr,
            seconds: start.elapsed().as_secs_f64(),
            grad_norm,
            peak_bytes: engine::process::peak_memory(self.device),
        })
    }

    /// Samples `--sample-prompt` (or the first caption) with the current weights: every rank
    /// runs the UNet (its chunks may be sharded); rank 0 writes `samples/step-<n>.png`.
    pub fn sample(&self) -> anyhow::Result<()> {
        let a = self.args;
        let prompt = a.sample_prompt.clone().unwrap_or_else(|| self.data.caption(0).to_string());
        let opts = SampleOptions {
            steps: 20,
            guidance: 7.5,
            negative_prompt: String::new(),
            height: a.resolution as i64,
            width: a.resolution as i64,
            sampler: Sampler::Ddim,
            images_per_prompt: 1,
            seed: a.seed.seed,
        };
        let unet = |x: &Tensor, t: &Tensor, c: &Tensor| self.unet(x, t, c);
        let images = self.sd.sample_with(&[prompt.as_str()], &opts, None, &unet)?;
        if self.world.rank() == 0 {
            let dir = a.out.join("samples");
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            crate::sample::to_image(&images, 0)?.write_png(&dir.join(format!("step-{}.png", self.step)))?;
        }
        Ok(())
    }

    /// Saves `model/` (a diffusers folder) or, with LoRA, the adapters' file under `--out`.
    pub fn save(&self) -> anyhow::Result<()> {
        let rank = self.world.rank();
        match &self.training {
            UnetTraining::Gemini { gemini, .. } => {
                // Every rank takes part in gathering sharded weights.
                let weights = gemini.state_dict()?;
                if rank == 0 {
                    save_model(&self.args.model, &weights, &self.args.out)?;
                }
            }
            UnetTraining::Lora { lora, .. } if rank == 0 => lora.save(&self.args.out)?,
            UnetTraining::Lora { .. } => {}
        }
        Ok(())
    }
}

/// Runs the fine-tuning; rank 0 writes the log, samples and the model. Returns the log.
pub fn run(args: &FinetuneArgs, world: &World) -> anyhow::Result<Vec<StepLog>> {
    let mut trainer = Trainer::new(args, world)?;
    let rank = world.rank();
    let mut metrics = match rank {
        0 => {
            std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
            Some(Metrics::open::<StepLog>(&args.out.join(&args.job.metrics), None)?)
        }
        _ => None,
    };
    let mut log = Vec::new();
    let progress = engine::progress::progress_bar(rank == 0 && !args.job.quiet, args.steps, 0);
    for step in 1..=args.steps {
        let entry = trainer.step()?;
        if let Some(m) = metrics.as_mut() {
            m.write(&entry)?;
        }
        progress.set_message(format!("loss {:.5}  lr {:.2e}  {:.2} s/step", entry.loss, entry.lr, entry.seconds));
        progress.inc(1);
        log.push(entry);
        if args.sample_every > 0 && step % args.sample_every == 0 {
            trainer.sample()?;
        }
        if step == args.steps || (args.save_every > 0 && step % args.save_every == 0) {
            trainer.save()?;
        }
    }
    progress.finish_and_clear();
    Ok(log)
}
