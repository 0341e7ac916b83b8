//! `diffusion finetune`: Stable Diffusion UNet fine-tuning under Gemini, as diffusers'
//! `train_text_to_image.py` (and `train_dreambooth.py` with an instance prompt) trains: images
//! through the frozen VAE encoder (a sample of the posterior times the scaling factor), noise
//! added at uniform timesteps by the DDPM schedule, the UNet's prediction against the epsilon
//! or velocity target (the scheduler config's prediction type), mean squared error optionally
//! weighted by min-SNR-gamma, AdamW or LAMB; captions optionally dropped to "" (`--caption-dropout`),
//! an EMA of the weights (`ema.rs`), validation images (`validation.rs`), checkpoints and
//! resume (`checkpoint.rs`).
//!
//! The UNet's parameters live in Gemini's chunks: fp32 masters, gradients and optimizer state
//! in host or device memory as the placement decides under `--gpu-mem` (the device's
//! allocator is capped at what the CUDA context and libraries leave of it, measured at start;
//! Gemini's budget is what the frozen text encoder and VAE,
//! resident in the compute kind, leave of it: `resident.rs`), compute copies in the
//! `--precision` kind; with `--nproc`
//! each rank holds 1/N of every chunk (ZeRO-3) and the gradients are averaged. Each part of the
//! UNet (time embedding, `conv_in`, every down, mid and up block, the head) is one Gemini
//! module: only its chunks need be resident while it runs forward or backward.
//!
//! With `--lora-rank` only LoRA adapters train ([`crate::lora`]): the frozen UNet lives in
//! Gemini's chunks as the trained one does (sharded over the ranks, streamed part by part
//! within the budget) but with no gradients and no optimizer state; the adapters train as the
//! engine trains a replicated model ([`engine::parallel::parallelize()`], without ZeRO): in fp32
//! on the device with their AdamW/LAMB state, their gradients averaged over the ranks in DDP's
//! buckets during backward, then unscaled, clipped and stepped by its step.
//!
//! Random draws (batch order, crops, flips, caption dropout, posterior samples, noise,
//! timesteps) come from generators keyed by the seed, step and example, so a run is the same
//! on any device and any number of ranks, and a resumed run needs no generator state.
mod args;
mod checkpoint;
pub mod ema;
mod gemini_unet;
mod model_folder;
mod objective;
mod resident;
mod validation;

pub use args::FinetuneArgs;
pub use checkpoint::TrainerState;
pub use gemini_unet::{gemini_config, GeminiParts, UnetParams};
pub use model_folder::save_model;
pub use objective::{loss, Batch, Draws};

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use data::augment::Rng;
use data::captions::{CaptionedImages, CropMode, Preprocess};
use engine::dist::{ReduceOp, World};
use engine::gemini::{cap_process_memory, human, parse_bytes, Gemini, Replication, StepPlan};
use engine::job::Precision;
use engine::optim::{LossScaler, LrSchedule};
use engine::parallel::{ParallelPlan, Parallelized};
use tch::{Device, Kind, Tensor};

use crate::lora::Lora;
use crate::pipeline::{SizeConditioning, StableDiffusion};
use crate::scheduler::{DdpmScheduler, SchedulerClass};
use crate::unet::Conditioning;
use crate::Result;
use ema::{Ema, EmaConfig};
use validation::Validation;

/// What trains, as [`parallelize`] wired it: the whole UNet under Gemini (ZeRO-3 over the
/// ranks), or LoRA adapters trained data-parallel by the engine ([`Parallelized`]) over the
/// frozen UNet in Gemini's chunks. Either keeps the fp16 loss scaler its step unscales by.
pub enum UnetTraining {
    /// The UNet's parameters in Gemini's chunks, each part of the UNet its own module.
    Gemini {
        /// The chunks and their optimizer.
        gemini: Gemini,
        /// Each part's parameter indices.
        parts: Vec<Vec<usize>>,
        /// The fp16 loss scaler.
        scaler: Option<LossScaler>,
    },
    /// LoRA adapters over the frozen UNet.
    Lora {
        /// The adapters.
        lora: Lora,
        /// The adapters wired for data-parallel training: their gradients' reduction, their
        /// optimizer and the fp16 loss scaler.
        parallel: Parallelized,
        /// The frozen UNet's chunks (`trainable: false`).
        base: Gemini,
        /// Each part's parameter indices.
        parts: Vec<Vec<usize>>,
    },
}

impl UnetTraining {
    /// Gemini's chunks of the UNet (trained or frozen) and each part's parameters.
    fn runner(&self) -> GeminiParts<'_> {
        match self {
            UnetTraining::Gemini { gemini, parts, .. } | UnetTraining::Lora { base: gemini, parts, .. } => {
                GeminiParts { gemini, parts }
            }
        }
    }

    /// The fp16 loss scaler.
    fn scaler(&self) -> Option<&LossScaler> {
        match self {
            UnetTraining::Gemini { scaler, .. } => scaler.as_ref(),
            UnetTraining::Lora { parallel, .. } => parallel.scaler(),
        }
    }

    /// The fp16 loss scaler, to restore its state.
    fn scaler_mut(&mut self) -> Option<&mut LossScaler> {
        match self {
            UnetTraining::Gemini { scaler, .. } => scaler.as_mut(),
            UnetTraining::Lora { parallel, .. } => parallel.scaler_mut(),
        }
    }

    /// Backward of one micro-batch's `loss` (already divided by the accumulation count; `last`:
    /// the step's last micro-batch), loss-scaled under fp16; the gradients then go into the
    /// chunks (during the last one's backward host chunks start on the step as their gradients
    /// complete: [`Gemini::plan_step`]), or onto the adapters (reduced over the ranks during the
    /// last one's backward; a rank whose backward leaves an adapter without a gradient adds
    /// zeros).
    fn backward(&self, loss: &Tensor, last: bool) -> Result<()> {
        let chunks = match self {
            UnetTraining::Gemini { gemini, scaler, .. } => {
                if last {
                    // The step always takes the norm (it is logged, and clipped to).
                    gemini.plan_step(StepPlan { loss_scale: scaler.as_ref().map(|s| s.scale), norm: true })?;
                }
                let scaled = match scaler {
                    Some(s) => s.scale_loss(loss)?,
                    None => loss.shallow_clone(),
                };
                engine::autograd::backward(&[&scaled], &[None], false)?;
                gemini
            }
            UnetTraining::Lora { parallel, base, .. } => {
                parallel.backward(loss, last)?;
                base
            }
        };
        Ok(chunks.finish_backward()?)
    }

    /// Unscales (fp16), clips and steps at `lr`, then moves the loss scale; returns the
    /// gradient norm, or `None` for a step skipped on overflow.
    fn step(&mut self, lr: f64, max_norm: Option<f64>) -> Result<Option<f64>> {
        // Every step's norm is logged: without a clip, an infinite one, which clips nothing.
        let max_norm = max_norm.unwrap_or(f64::INFINITY);
        match self {
            UnetTraining::Gemini { gemini, scaler, .. } => {
                gemini.optimizer()?.set_lr(lr);
                // Unscaling, the overflow check and the clipping norm: one reduction.
                let norm = gemini.unscale_and_clip(scaler.as_ref(), Some(max_norm))?;
                match norm {
                    Some(_) => gemini.step()?,
                    None => gemini.skip_step()?,
                }
                if let Some(s) = scaler {
                    s.update(norm.is_some());
                }
                Ok(norm)
            }
            UnetTraining::Lora { parallel, base, .. } => {
                // The frozen chunks' step only frees their payloads.
                base.step()?;
                let stepped = parallel.step(lr, Some(max_norm))?;
                Ok(stepped.grad_norm.filter(|_| stepped.applied))
            }
        }
    }
}

/// One step's record.
#[derive(Debug, serde::Serialize)]
pub struct StepLog {
    /// 1-based step.
    pub step: usize,
    /// Mean loss of the step's global batch (every rank's micro-batches).
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

    fn step(&self) -> usize {
        self.step
    }

    fn scalars(&self) -> Vec<(&'static str, f64)> {
        let mut scalars = vec![("train/loss", self.loss), ("train/lr", self.lr), ("train/step_seconds", self.seconds)];
        scalars.extend(self.grad_norm.map(|n| ("train/grad_norm", n)));
        scalars.extend(self.peak_bytes.map(|b| ("train/peak_memory_gib", engine::metrics::gib(b))));
        scalars
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

/// Keys caption dropout's draws apart from the crops' (which use the seed itself).
const CAPTION_DROPOUT_KEY: u64 = 0xca97_10d0;

/// Whether `--caption-dropout p` replaces the caption of image `example` (its place in the
/// run's sequence of images) at step `step` by "": a draw keyed by the seed, step and image, so
/// it is the same on any number of ranks and after a resume.
pub fn drops_caption(seed: u64, step: usize, example: usize, p: f64) -> bool {
    p > 0.0 && Rng::keyed(seed ^ CAPTION_DROPOUT_KEY, step as u64, example as u64).uniform() < p
}

/// The parallel wiring, applied outside the UNet: its parameters in Gemini's chunks, sharded
/// over the ranks (ZeRO-3) and placed within what `cap` bytes of `device` leave after the
/// `resident` parts, computing in `precision` ([`FinetuneArgs::precision_on`] the device);
/// trained, or with `--lora-rank` frozen under adapters (resident too) trained data-parallel.
pub fn parallelize(
    sd: &mut StableDiffusion,
    args: &FinetuneArgs,
    world: &World,
    (device, precision): (Device, Precision),
    cap: Option<u64>,
    mut resident: Vec<resident::Part>,
) -> anyhow::Result<UnetTraining> {
    let (kind, lr, seed) = (precision.kind(), args.optimizer.lr, args.seed.seed);
    let UnetParams { params, parts } = UnetParams::of(&sd.unet, &sd.unet_vs)?;
    let replication = (world.size() > 1).then(|| Replication { group: world.group.clone(), shard: true });
    let rule = args.optimizer.rule(lr);
    let lora = match args.lora_rank {
        Some(rank) => {
            let lora = Lora::new(&sd.unet, &sd.unet_vs, rank, args.lora_alpha.unwrap_or(rank as f64), seed, device)?;
            // Weights, gradients and the optimizer's state.
            resident.push(("LoRA adapters", (2 + rule.state_slots().len()) * lora.bytes()));
            Some(lora)
        }
        None => None,
    };
    let budget = cap.map(|cap| resident::budget_after(cap, &resident)).transpose()?;
    let mut config = gemini_config(device, budget, rule, kind, replication);
    config.chunks.trainable = lora.is_none();
    let gemini = Gemini::new(&params, config)?;
    Ok(match lora {
        Some(lora) => {
            // The UNet computes in `kind` (fp16: a loss scaler), the adapters stay in fp32 (no
            // masters); every rank steps all of them.
            let plan = ParallelPlan { zero: 0, compute: kind, device, ..ParallelPlan::default() };
            let build = |ps| args.optimizer.build(ps, lr);
            let parallel = engine::parallel::parallelize(lora.params(), &world.group, &plan, build)?;
            UnetTraining::Lora { lora, parallel, base: gemini, parts }
        }
        None => {
            let scaler = (precision == Precision::Fp16).then(LossScaler::default);
            UnetTraining::Gemini { gemini, parts, scaler }
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
    data: CaptionedImages,
    preprocess: Preprocess,
    schedule: LrSchedule,
    device: Device,
    /// The average of the UNet's weights (`--use-ema`).
    ema: Option<Ema>,
    /// The compute precision ([`FinetuneArgs::precision_on`] the device).
    precision: Precision,
    /// The frozen parts resident on the device and their bytes (what an out-of-memory step's
    /// error names).
    resident: Vec<resident::Part>,
    step: usize,
}

impl<'a> Trainer<'a> {
    /// Reads the pipeline and the data and wires the UNet for training; bad flags, data or
    /// model files are errors naming them.
    pub fn new(args: &'a FinetuneArgs, world: &'a World) -> anyhow::Result<Trainer<'a>> {
        args.check()?;
        let device = args.job.launch.device(world)?;
        kernels::install_optimizer_steps(kernels::Backend::resolve(args.kernels, device)?);
        let cap =
            args.gpu_mem.as_deref().map(|s| parse_bytes(s).with_context(|| format!("--gpu-mem {s}"))).transpose()?;
        // On a GPU the cap is the whole process's: what the CUDA context and libraries hold is
        // measured and the allocator (the resident parts, Gemini's chunks, activations) gets
        // the rest.
        let cap = match cap {
            Some(b) => {
                match cap_process_memory(device, b, true).with_context(|| format!("--gpu-mem {}", human(b as usize)))? {
                    Some(split) => {
                        if world.rank() == 0 {
                            eprintln!("{split}");
                        }
                        Some(split.allocator)
                    }
                    None => Some(b),
                }
            }
            None => None,
        };
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
        // The frozen parts compute in the training precision, as diffusers' `weight_dtype`.
        let precision = args.precision_on(device);
        if let (0, Some(chosen)) = (world.rank(), args.cap_defaults(device)) {
            eprintln!("{chosen}");
        }
        let kind = precision.kind();
        let mut resident = Vec::new();
        let names = ["text encoder", "text encoder 2"];
        for (name, vs) in names.into_iter().zip(sd.text_encoder_stores()) {
            vs.set_kind(kind);
            vs.set_device(device);
            resident.push((name, resident::bytes_of(vs)));
        }
        // As diffusers' SDXL script, which keeps SDXL's VAE in fp32: it overflows in fp16.
        if sd.text_encoder_2.is_none() {
            sd.vae_vs.set_kind(kind);
        }
        sd.vae_vs.set_device(device);
        resident.push(("VAE", resident::bytes_of(&sd.vae_vs)));
        let multiple = sd.size_multiple() as usize;
        if !args.resolution.is_multiple_of(multiple) {
            bail!("--resolution {}: this model needs a multiple of {multiple} pixels", args.resolution);
        }
        sd.unet.set_gradient_checkpointing(args.checkpointing());
        let ddpm = DdpmScheduler::new(sd.scheduler.config(SchedulerClass::Ddpm)?);
        let training = parallelize(&mut sd, args, world, (device, precision), cap, resident.clone())?;
        let ema = match (&training, args.use_ema) {
            (UnetTraining::Gemini { gemini, .. }, true) => {
                Some(Ema::new(gemini, EmaConfig::diffusers(args.ema_decay))?)
            }
            _ => None,
        };
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
            data,
            preprocess,
            schedule: args.schedule.schedule(args.optimizer.lr, args.steps)?,
            device,
            sd,
            ema,
            precision,
            resident,
            step: 0,
        })
    }

    /// The UNet's prediction, part by part through Gemini's chunks.
    fn unet(&self, x: &Tensor, t: &Tensor, c: &Conditioning) -> Result<Tensor> {
        self.sd.unet.forward_with(x, t, c, &self.training.runner())
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
        let mut sizes = Vec::with_capacity(a.micro_batch);
        for (k, &i) in indices.iter().enumerate() {
            let mut rng = Rng::keyed(seed, step as u64, (first + k) as u64);
            let (img, geometry) = self.data.load_with_geometry(i, self.preprocess, &mut rng)?;
            let r = img.height as i64;
            pixels.push(Tensor::from_slice(&img.pixels).reshape([3, r, r]));
            // As train_text_to_image_sdxl.py: the image's size before resizing, the crop's
            // corner, the training resolution.
            let pair = |(a, b): (usize, usize)| (a as i64, b as i64);
            sizes.push(SizeConditioning {
                original: pair(geometry.original),
                crop_top_left: pair(geometry.crop_top_left),
                target: (r, r),
            });
            let dropped = drops_caption(seed, step, first + k, a.caption_dropout);
            captions.push(if dropped { String::new() } else { self.data.caption(i).to_string() });
        }
        let side = a.resolution as i64 / self.sd.vae_scale();
        let latent = [self.sd.unet.config().in_channels, side, side];
        let draws = Draws::new(seed, step, first, a.micro_batch, latent, self.ddpm.config().num_train_timesteps);
        Ok((Batch { pixels: Tensor::stack(&pixels, 0), captions, sizes }, draws))
    }

    /// One optimizer step over `--grad-accum` micro-batches; returns its log record.
    pub fn step(&mut self) -> anyhow::Result<StepLog> {
        let start = Instant::now();
        let lr = self.schedule.at(self.step);
        let (a, kind) = (self.args, self.precision.kind());
        let unet = |x: &Tensor, t: &Tensor, c: &Conditioning| self.unet(x, t, c);
        let mut total = 0.0;
        for micro in 0..a.grad_accum {
            // Each micro-batch is progress (the spawner's heartbeat; Gemini's chunk accesses
            // count too, within it).
            engine::dist::heartbeat::beat();
            let (batch, draws) = self.micro_batch(micro)?;
            let l = loss(&self.sd, &self.ddpm, &batch, &draws, a.noise_offset, a.snr_gamma, kind, &unet)?;
            total += l.double_value(&[]);
            self.training.backward(&l.f_div_scalar(a.grad_accum as f64)?, micro + 1 == a.grad_accum)?;
        }
        let grad_norm = self.training.step(lr, a.optimizer.clip_grad)?;
        // As diffusers' script: the average moves after every step, a skipped one too.
        if let (Some(ema), UnetTraining::Gemini { gemini, .. }) = (self.ema.as_mut(), &self.training) {
            ema.step(gemini)?;
        }
        self.step += 1;
        // The loss of the whole global batch, the same on any number of ranks.
        let loss = Tensor::from_slice(&[total / a.grad_accum as f64]);
        self.world.group.all_reduce(&loss, ReduceOp::Avg)?;
        Ok(StepLog {
            step: self.step,
            loss: loss.f_double_value(&[0])?,
            lr,
            seconds: start.elapsed().as_secs_f64(),
            grad_norm,
            peak_bytes: engine::process::peak_memory(self.device),
        })
    }

    /// Writes the validation images of the current step (every rank runs the UNet; rank 0
    /// writes), with the EMA weights swapped in under `--use-ema` as diffusers' script does.
    pub fn validate(&self) -> anyhow::Result<Vec<PathBuf>> {
        let a = self.args;
        let validation = Validation {
            prompts: &a.validation_prompts,
            images_per_prompt: a.num_validation_images,
            resolution: a.resolution,
            seed: a.seed.seed,
        };
        let swapped = match (&self.ema, &self.training) {
            (Some(ema), UnetTraining::Gemini { gemini, .. }) => Some((ema, gemini)),
            _ => None,
        };
        if let Some((ema, gemini)) = swapped {
            ema.swap(gemini)?;
        }
        let unet = |x: &Tensor, t: &Tensor, c: &Conditioning| self.unet(x, t, c);
        let written = validation.run(&self.sd, &unet, self.step, &a.out, self.world.rank() == 0);
        // The trained weights come back even when sampling failed.
        if let Some((ema, gemini)) = swapped {
            ema.swap(gemini)?;
        }
        // Sampling's accesses are not a training step's: the next step starts at the beginning
        // of the recorded trace, so its prefetches follow it.
        self.training.runner().gemini.manager()?.end_step();
        written
    }

    /// Saves `model/` (a diffusers folder; its UNet the EMA weights under `--use-ema`, as
    /// diffusers' script saves) or, with LoRA, the adapters' file under `--out`.
    pub fn save(&self) -> anyhow::Result<()> {
        let rank = self.world.rank();
        match &self.training {
            UnetTraining::Gemini { gemini, .. } => {
                // Every rank takes part in gathering sharded weights.
                let weights = match &self.ema {
                    Some(ema) => ema.weights(gemini)?,
                    None => gemini.state_dict()?,
                };
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

/// Runs the fine-tuning (from `--resume`'s checkpoint when given); rank 0 writes the log,
/// validation images, checkpoints and the model. Returns the log of the steps this run took.
pub fn run(args: &FinetuneArgs, world: &World) -> anyhow::Result<Vec<StepLog>> {
    let mut trainer = Trainer::new(args, world)?;
    let rank = world.rank();
    if let Some(resume) = &args.resume {
        match checkpoint::resume_dir(resume, &args.out)? {
            Some(dir) => {
                trainer.resume(&dir)?;
                // Past the end the loop would not run, and the run would end as if it trained.
                if trainer.step > args.steps {
                    bail!("{} is at step {}, past --steps {}", dir.display(), trainer.step, args.steps);
                }
            }
            None if rank == 0 => {
                eprintln!("--resume latest: no checkpoint under {}; starting a new run", args.out.display())
            }
            None => {}
        }
    }
    let first = trainer.step + 1;
    let mut metrics = match rank {
        0 => {
            std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
            let resumed = (first > 1).then_some(first - 1);
            Some(args.job.open_metrics::<StepLog>(&args.out, resumed, "diffusion-finetune")?)
        }
        _ => None,
    };
    let mut log = Vec::new();
    let progress = engine::progress::progress_bar(rank == 0 && !args.job.quiet, args.steps, first - 1);
    let every = |n: usize, step: usize| n > 0 && step.is_multiple_of(n);
    for step in first..=args.steps {
        // A step that does not fit names the cap it ran under and what would make it fit.
        let entry = trainer.step().map_err(|e| match &args.gpu_mem {
            Some(cap) if resident::is_out_of_memory(&e) => {
                let kind = trainer.precision.kind();
                let hint = resident::out_of_memory_hint(&trainer.resident, kind, args.checkpointing());
                e.context(format!("step {step} ran out of the device memory --gpu-mem {cap} allows: {hint}"))
            }
            Some(cap) => e.context(format!("step {step} under --gpu-mem {cap}")),
            None => e.context(format!("step {step}")),
        })?;
        if let Some(m) = metrics.as_mut() {
            m.write(&entry)?;
        }
        progress.set_message(format!("loss {:.5}  lr {:.2e}  {:.2} s/step", entry.loss, entry.lr, entry.seconds));
        progress.inc(1);
        log.push(entry);
        if every(args.checkpointing_steps, step) {
            trainer.save_checkpoint()?;
        }
        let validation_due = step == args.steps || args.validation_steps.is_some_and(|n| every(n, step));
        if !args.validation_prompts.is_empty() && validation_due {
            let written = trainer.validate()?;
            if let Some(m) = metrics.as_mut() {
                m.images(step, &validation::tensorboard_images(&written, args.resolution)?)?;
            }
        }
        if step == args.steps || every(args.save_every, step) {
            trainer.save()?;
        }
    }
    progress.finish_and_clear();
    if first > args.steps {
        // As diffusers' script: a run resumed at its end still writes the final model.
        if rank == 0 {
            eprintln!("resumed at step {}: --steps {} leaves nothing to train", first - 1, args.steps);
        }
        trainer.save()?;
    }
    Ok(log)
}
