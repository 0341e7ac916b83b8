//! `vit pretrain`: data-parallel ViT training with LAMB, LARS or AdamW, linear warmup then
//! cosine decay, gradient accumulation, ZeRO 1/2, mixed precision, mixup and label smoothing,
//! tensor parallelism (`--tp`, 1D/2D/2.5D/3D) and sequence parallelism (`--sp`), combined with
//! data parallelism over the rest of the ranks, pipeline parallelism (`--pp`, see
//! [`crate::pipeline_parallel`]), checkpoints with exact resume at any layout.
//!
//! One step: each rank runs `accumulation` micro-batches forward and backward (gradients
//! synchronised only on the last, as the buckets fill), then optional unscaling (fp16), global
//! gradient clipping, and the optimizer step (on fp32 master weights for bf16/fp16 or
//! `--offload-optimizer`); the data-parallel wiring is the engine's
//! [`engine::parallel::parallelize`] over the data-parallel group (with the sequence ranks),
//! after [`crate::tensor_parallel`] has split the model over the tensor- and
//! sequence-parallel groups. Every random draw (data order, crops, mixup) is keyed by
//! the seed and the step or example, so a resumed run repeats the uninterrupted one exactly.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use data::augment::{Mixup, Rng, Transform};
use data::loader::{make_batch, Batch, BatchSpec, Loader};
use data::{Dataset, DistributedSampler};
use engine::dist::{ProcessGroup, ReduceOp, World};
use engine::job::{JobArgs, OptimizerArgs, PrecisionArgs, ScheduleArgs, SeedArgs};
use engine::metrics::Metrics;
use engine::optim::{scale_lr, LrSchedule};
use engine::parallel::{parallelize, ParallelPlan, Parallelized};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::batch::{parse_batch, BatchPlan};
use crate::checkpoint::{self, TrainerState};
use crate::datasets::{probe, DataArgs, Splits, Transforms};
use crate::metrics::Record;
use crate::model::{correct_top_k, Vit, VitConfig};
use crate::model_file::ModelFile;
use crate::pipeline_parallel::{self, Model, PipelineArgs, SchedulePick};
use crate::plan::PlannerMode;
use crate::tensor_parallel::{ParallelArgs, Sharding};

/// Keys mixup's draws apart from the other streams of the same seed.
const MIXUP_STREAM: u64 = 0x6d69_7875_7000;

/// Options of `vit pretrain`.
#[derive(clap::Args, Clone, Debug)]
#[command(
    mut_arg("optimizer", |a| a.default_value("lamb")),
    mut_arg("lr", |a| a.default_value("3e-2").help("Peak learning rate, reached at the end of warmup (the default suits LAMB on the embedded digits)")),
    mut_arg("weight_decay", |a| a.default_value("0.05")),
    mut_arg("warmup", |a| a.default_value("50")),
    mut_arg("decay", |a| a.default_value("cosine")),
    mut_arg("min_lr_ratio", |a| a.default_value("0.01")),
)]
pub struct PretrainArgs {
    #[command(flatten)]
    pub data: DataArgs,
    /// Model: a preset (`digits`, the small ViT for the embedded 8x8 digits, the default
    /// without --data; or a timm name such as vit_tiny_patch16_224, the default with it).
    /// Channels and classes follow the data.
    #[arg(long)]
    pub model: Option<String>,
    /// Input side in pixels (default: the model's).
    #[arg(long)]
    pub image_size: Option<i64>,
    /// Patch side in pixels (default: the model's).
    #[arg(long, visible_alias = "patch")]
    pub patch_size: Option<i64>,
    /// Global batch: examples per optimizer step over all ranks and accumulation steps (a k
    /// suffix multiplies by 1024: 32k).
    #[arg(long, default_value = "128", value_parser = parse_batch)]
    pub batch: usize,
    /// Examples per forward/backward on one rank (default: the largest divisor of the per-rank
    /// batch up to 256); the rest of the per-rank batch is gradient accumulation.
    #[arg(long, value_parser = engine::job::count(1..))]
    pub micro_batch: Option<usize>,
    /// The optimizer and its hyper-parameters.
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
    /// Scale --lr linearly by --batch / this batch (the linear scaling rule; off by default).
    #[arg(long, value_parser = engine::job::count(1..))]
    pub lr_base_batch: Option<usize>,
    /// The learning-rate schedule.
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Epochs (passes over the training set).
    #[arg(long, default_value_t = 60, value_parser = engine::job::count(1..))]
    pub epochs: usize,
    /// Optimizer steps, overriding --epochs.
    #[arg(long, value_parser = engine::job::count(1..))]
    pub steps: Option<usize>,
    /// Mixup's Beta(alpha, alpha); 0 turns mixup off.
    #[arg(long, default_value_t = 0.0, value_parser = engine::job::non_negative)]
    pub mixup: f64,
    /// Label smoothing.
    #[arg(long, default_value_t = 0.1, value_parser = engine::job::share)]
    pub smoothing: f64,
    /// Smallest area share of the random resized crop (default 0.7 for the digits, 0.08 for
    /// photos as torchvision).
    #[arg(long, value_parser = engine::job::positive_share)]
    pub crop_scale: Option<f64>,
    /// Arithmetic precision (bf16 and fp16 keep fp32 master weights and optimizer state).
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// Tensor and sequence parallelism (--tp, --tp-mode, --tp-depth, --sequence-parallel,
    /// --sp, --sp-mode).
    #[command(flatten)]
    pub parallel: ParallelArgs,
    /// What runs the blocks' LayerNorms: fused (a CUDA kernel compiled at run time) or torch
    /// (libtorch's); by default fused on CUDA, torch elsewhere. The tensor-parallel layouts
    /// (--tp above 1) use libtorch's.
    #[arg(long, value_enum)]
    pub kernels: Option<kernels::Backend>,
    /// Pipeline parallelism: --pp, --schedule, --virtual-stages.
    #[command(flatten)]
    pub pipeline: PipelineArgs,
    /// Activation checkpointing (timm's set_grad_checkpointing): each transformer block keeps
    /// only its input between forward and backward and is recomputed in backward (about one
    /// more forward of compute for much less activation memory); under --pp, each stage's
    /// blocks. Not with --schedule zb, whose separate weight pass needs the blocks' graphs.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Checkpoint only the first this many transformer blocks (the rest keep their
    /// activations): less recomputation than --gradient-checkpointing for some of its memory
    /// saving; under --pp each block stays as set wherever its stage is.
    #[arg(long, conflicts_with = "gradient_checkpointing")]
    pub checkpoint_blocks: Option<usize>,
    /// `plan`: print the automatic planner's layout, ZeRO stage and checkpointed blocks for
    /// --nproc, --batch and the model (on --cluster), with predicted time and memory and the
    /// runners-up, and exit without training. `auto`: print the plan and train with it (the
    /// plan sets --tp, --tp-mode, --tp-depth, --sp, --pp, --micro-batch, --zero and
    /// --checkpoint-blocks; giving any of those, or --gradient-checkpointing,
    /// --sequence-parallel, --sp-mode, --schedule or --virtual-stages, beside it is an error
    /// naming the flag).
    #[arg(long = "parallel", value_enum)]
    pub planner: Option<crate::plan::PlannerMode>,
    /// The cluster the planner models (`cluster.json`: nodes, devices_per_node, memory_bytes,
    /// peak_flops, intra_node_bandwidth, inter_node_bandwidth, latency_s; missing keys default).
    #[arg(long, requires = "planner")]
    pub cluster: Option<PathBuf>,
    /// ZeRO stage: 0 (plain data parallel), 1 (sharded optimizer state), 2 (and gradients).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub zero: u8,
    /// Keep the fp32 master weights and optimizer state in CPU memory (with --device cuda).
    #[arg(long)]
    pub offload_optimizer: bool,
    /// The argument ids given on the command line, not defaulted (`main` sets them from
    /// clap's matches): `--parallel` refuses a layout flag given even at its default value.
    #[arg(skip)]
    pub given: Vec<String>,
    /// Device, ranks, progress and the metrics file.
    #[command(flatten)]
    pub job: JobArgs,
    /// The seed of the initial weights, the data order and the augmentations.
    #[command(flatten)]
    pub seed: SeedArgs,
    /// Directory for checkpoints, metrics and the final model (written by rank 0).
    #[arg(short = 'o', long)]
    pub out: Option<PathBuf>,
    /// Continue the run saved under --out from its latest checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Checkpoint every this many steps (default: at each epoch end).
    #[arg(long, value_parser = engine::job::count(1..))]
    pub save_every: Option<usize>,
    /// Stop after this many steps in total (checkpointing first when --out is given) while the
    /// schedule still follows --steps/--epochs: for time-limited jobs continued with --resume.
    #[arg(long, value_parser = engine::job::count(1..))]
    pub stop_after: Option<usize>,
    /// Decode and augmentation threads per rank (default: the cores available to the rank).
    #[arg(long, default_value_t = engine::process::cores_per_rank())]
    pub workers: usize,
}

/// What a run ended with.
pub struct Trained {
    /// The model (the model's precision; under --tp this rank's slices, under --pp its stages'
    /// weights, the others empty; see `weights` for full fp32 tensors).
    pub vs: VarStore,
    /// The fp32 weights by name (master weights under mixed precision).
    pub weights: Vec<(String, Tensor)>,
    /// Mean loss of each step taken by this invocation, by step number (1-based).
    pub losses: Vec<(usize, f64)>,
    /// Validation top-1 accuracy at the last epoch's end, in [0, 1] (`None` without a
    /// validation set, or when no epoch ended).
    pub val_top1: Option<f64>,
    /// Validation top-5 accuracy at the last epoch's end.
    pub val_top5: Option<f64>,
    /// Wall time of the training loop.
    pub seconds: f64,
}

/// The architecture named by `--model` and `--image-size`, fitted to the data.
pub fn model_config(
    name: Option<&str>,
    image_size: Option<i64>,
    patch_size: Option<i64>,
    embedded: bool,
    data: &dyn Dataset,
) -> anyhow::Result<VitConfig> {
    let name = name.unwrap_or(if embedded { "digits" } else { "vit_tiny_patch16_224" });
    let mut cfg = VitConfig::preset(name)
        .with_context(|| format!("--model {name}: not a known model ({})", VitConfig::preset_names().join(", ")))?;
    cfg.image_size = image_size.unwrap_or(cfg.image_size);
    cfg.patch_size = patch_size.unwrap_or(cfg.patch_size);
    cfg.in_channels = data.channels() as i64;
    cfg.num_classes = data.classes().len() as i64;
    cfg.validate().map_err(|e| anyhow::anyhow!("model {name}: {e}"))?;
    Ok(cfg)
}

/// A batch as model input `[n, c, h, w]` and labels.
pub(crate) fn to_tensors(batch: &Batch, device: Device, kind: Kind) -> anyhow::Result<(Tensor, Tensor)> {
    let shape: Vec<i64> = batch.shape.iter().map(|&d| d as i64).collect();
    let images = Tensor::f_from_slice(&batch.pixels)?.f_view(shape.as_slice())?.f_to_device(device)?.f_to_kind(kind)?;
    Ok((images, Tensor::f_from_slice(&batch.labels)?.f_to_device(device)?))
}

/// `images` `[n, c, h, w]` with blank images appended up to a multiple of `blocks` (the batch
/// blocks of `--tp-mode 2d|2.5d|3d`, see [`Sharding::batch_blocks`]): for evaluation chunks,
/// whose logits past the first `n` rows are then dropped.
pub(crate) fn pad_to_blocks(images: &Tensor, blocks: usize) -> anyhow::Result<Tensor> {
    let (n, blocks) = (images.size()[0], blocks as i64);
    let missing = (blocks - n % blocks) % blocks;
    if missing == 0 {
        return Ok(images.shallow_clone());
    }
    let mut shape = images.size();
    shape[0] = missing;
    let blank = Tensor::f_zeros(&shape, (images.kind(), images.device()))?;
    Ok(Tensor::f_cat(&[images.shallow_clone(), blank], 0)?)
}

/// Top-1 and top-5 accuracy on `set`, each rank evaluating every N-th example and the counts
/// summed over the group; `blocks`: what every batch the model takes must divide by (chunks
/// are padded to it).
pub fn evaluate(
    model: &Vit,
    set: &Arc<dyn Dataset>,
    transform: &Transform,
    group: &ProcessGroup,
    blocks: usize,
    device: Device,
    kind: Kind,
) -> anyhow::Result<(f64, f64)> {
    let mine: Vec<usize> = (group.rank()..set.len()).step_by(group.size()).collect();
    let mut counts = [0i64; 2];
    for chunk in mine.chunks(256) {
        // Each batch of the evaluation is progress (the spawner's heartbeat).
        engine::dist::heartbeat::beat();
        let batch = make_batch(set.as_ref(), transform, 0, &BatchSpec { indices: chunk.to_vec(), epoch: 0 })?;
        let (images, labels) = to_tensors(&batch, device, kind)?;
        let padded = pad_to_blocks(&images, blocks)?;
        let logits = tch::no_grad(|| model.forward(&padded))?.f_narrow(0, 0, images.size()[0])?;
        counts[0] += correct_top_k(&logits, &labels, 1);
        counts[1] += correct_top_k(&logits, &labels, 5);
    }
    let counts = Tensor::from_slice(&counts);
    group.all_reduce(&counts, ReduceOp::Sum)?;
    let n = set.len() as f64;
    Ok((counts.int64_value(&[0]) as f64 / n, counts.int64_value(&[1]) as f64 / n))
}

/// Soft-target cross-entropy: mean over the batch of -sum(target * log_softmax(logits)).
pub(crate) fn soft_cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    -(logits.log_softmax(1, Kind::Float) * targets).sum_dim_intlist(1, false, Kind::Float).mean(Kind::Float)
}

/// A step's outcome: its log record (without validation figures) and whether it ended an
/// epoch.
pub struct StepOutcome {
    /// Step, epoch (1-based), loss over the global batch, learning rate, images/s, applied.
    pub record: Record,
    /// Whether the step ended an epoch (the trainer then evaluates).
    pub epoch_end: bool,
}

/// One rank's `vit pretrain` run: the data, the model and its data-parallel wiring, and the
/// position in the schedule.
pub struct Trainer<'a> {
    args: &'a PretrainArgs,
    world: &'a World,
    cfg: VitConfig,
    plan: BatchPlan,
    splits: Splits,
    transforms: Transforms,
    sampler: DistributedSampler,
    steps_per_epoch: usize,
    total: usize,
    schedule: LrSchedule,
    device: Device,
    kind: Kind,
    /// The data-parallel group (the world without tensor parallelism).
    dp: ProcessGroup,
    /// The blocks' split over the tensor-parallel group.
    sharding: Sharding,
    vs: VarStore,
    model: Model,
    parallel: Parallelized,
    loader: Option<Loader>,
    step: usize,
}

impl<'a> Trainer<'a> {
    /// The data, the model (the same initial weights on every rank from the seed) and its
    /// parallel wiring; an impossible batch split or an unknown model is an error naming it.
    pub fn new(args: &'a PretrainArgs, world: &'a World) -> anyhow::Result<Trainer<'a>> {
        let mesh = pipeline_parallel::mesh(world, &args.pipeline, &args.parallel)?;
        let checkpointing = args.gradient_checkpointing || args.checkpoint_blocks.is_some_and(|k| k > 0);
        if checkpointing && args.pipeline.schedule == Some(SchedulePick::Zb) {
            // ZB-H1 runs each layer's graph twice (input gradients, later weight gradients);
            // a checkpointed block has no graph to keep and would add its weight gradients twice.
            let flag = if args.gradient_checkpointing { "--gradient-checkpointing" } else { "--checkpoint-blocks" };
            bail!("{flag} with --schedule zb: the zero-bubble weight pass needs each block's graph; use gpipe, 1f1b or interleaved");
        }
        let (dp, ranks) = (mesh.data.clone(), mesh.data.size());
        let plan = BatchPlan::new(args.batch, ranks, args.micro_batch, 256).map_err(anyhow::Error::msg)?;
        if args.resume && args.out.is_none() {
            bail!("--resume needs --out (the folder of the run to continue)");
        }
        // Starting afresh over a saved run replaces its checkpoint at the first save: say so.
        if let (Some(out), false, 0) = (&args.out, args.resume, world.rank()) {
            if let Ok(Some(dir)) = data::checkpoint_folders::latest(out) {
                eprintln!(
                    "note: {} holds {}; this run starts afresh and replaces it (--resume continues it)",
                    out.display(),
                    dir.file_name().map_or(dir.display().to_string(), |n| n.to_string_lossy().into_owned())
                );
            }
        }
        let splits = args.data.splits()?;
        let named = |p: Option<&PathBuf>| p.map_or("the embedded digits".to_string(), |p| p.display().to_string());
        probe(splits.train.as_ref(), &format!("the training set ({})", named(args.data.data.as_ref())))?;
        if !splits.val.is_empty() {
            let val_source = named(args.data.val_data.as_ref().or(args.data.data.as_ref()));
            probe(splits.val.as_ref(), &format!("the validation set ({val_source})"))?;
        }
        let cfg = model_config(
            args.model.as_deref(),
            args.image_size,
            args.patch_size,
            splits.embedded,
            splits.train.as_ref(),
        )?;
        let sharding = Sharding::new(&mesh, &args.parallel, &cfg)?;
        sharding.check_batch(plan.micro)?;
        let crop_scale = args.crop_scale.unwrap_or(if splits.embedded { 0.7 } else { 0.08 });
        let transforms =
            Transforms::new(cfg.image_size as usize, cfg.in_channels as usize, splits.embedded, crop_scale);
        let device = args.job.launch.device(world)?;
        if sharding.active() && args.kernels == Some(kernels::Backend::Fused) {
            bail!(
                "--kernels fused covers the serial model's LayerNorms; with --tp {} --sp {} the layers are libtorch's",
                args.parallel.tp,
                args.parallel.sp
            );
        }
        let backend = kernels::Backend::resolve(args.kernels, device)?;
        kernels::install_optimizer_steps(backend);
        let kind = args.precision.precision.kind();
        let seed = args.seed.seed;
        let sampler = DistributedSampler {
            len: splits.train.len(),
            ranks,
            rank: dp.rank(),
            shuffle: true,
            seed,
            drop_last: true,
        };
        let steps_per_epoch = sampler.per_rank() / (plan.micro * plan.accumulation);
        if steps_per_epoch == 0 {
            bail!("--batch {} exceeds the {} training images", plan.global, splits.train.len());
        }
        let total = args.steps.unwrap_or(args.epochs * steps_per_epoch);
        let peak = args.lr_base_batch.map_or(args.optimizer.lr, |base| scale_lr(args.optimizer.lr, plan.global, base));
        let schedule = args.schedule.schedule(peak, total);

        // The model, on every rank from the same seed (DataParallel also broadcasts rank 0's).
        // Under tensor parallelism each rank builds the serial model as one process would and
        // keeps its slices, so every layout starts from the same weights.
        tch::manual_seed(seed as i64);
        let mut vs = VarStore::new(device);
        let mut model = match sharding.active() {
            false => Vit::with_kernels(&vs.root(), cfg, backend),
            true => {
                let serial = VarStore::new(device);
                let _ = Vit::new(&serial.root(), cfg);
                sharding.build(&serial, &vs)?
            }
        };
        if kind != Kind::Float {
            vs.set_kind(kind);
        }
        match args.checkpoint_blocks {
            Some(k) if k > cfg.depth as usize => {
                bail!("--checkpoint-blocks {k}: the model has {} blocks", cfg.depth)
            }
            Some(k) => model.set_checkpointed_blocks(k),
            None => model.set_gradient_checkpointing(args.gradient_checkpointing),
        }
        let (model, params) = Model::place(
            model,
            &vs,
            &sharding,
            mesh.pipeline.as_ref(),
            &args.pipeline,
            (plan.accumulation, plan.micro),
            &world.group,
            device,
            world.rank() == 0,
        )?;
        let layout = ParallelPlan {
            zero: args.zero,
            compute: kind,
            offload_optimizer: args.offload_optimizer,
            device,
            ..ParallelPlan::default()
        };
        let optimizer = args.optimizer.clone();
        let parallel = model.wire(parallelize(params, sharding.grads(), &layout, move |ps| optimizer.build(ps, peak))?);
        Ok(Trainer {
            args,
            world,
            cfg,
            plan,
            splits,
            transforms,
            sampler,
            steps_per_epoch,
            total,
            schedule,
            device,
            kind,
            dp,
            sharding,
            vs,
            model,
            parallel,
            loader: None,
            step: 0,
        })
    }

    /// The settings a checkpoint records and a resume must agree with, at `step`.
    fn state(&self, step: usize) -> TrainerState {
        let scaler = self.parallel.scaler();
        TrainerState {
            step,
            world_size: self.world.size(),
            zero: self.args.zero,
            tp: self.sharding.size() as usize,
            pp: self.args.pipeline.pp,
            optimizer: self.args.optimizer.optimizer.name().to_string(),
            global_batch: self.plan.global,
            seed: self.args.seed.seed,
            precision: self.args.precision.precision.name().to_string(),
            loss_scale: scaler.map_or(1.0, |s| s.scale),
            clean_steps: scaler.map_or(0, |s| s.clean_steps()),
            model: self.cfg,
            classes: Some(self.splits.train.classes().to_vec()),
        }
    }

    /// Continues from the latest checkpoint under `--out`: weights, optimizer state, loss
    /// scaler and step, on any number of ranks, ZeRO stage and --tp; a checkpoint made with
    /// other settings (optimizer, batch, seed, precision, model) is an error naming the setting.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        let out = self.args.out.as_deref().context("--resume needs --out")?;
        let saved = checkpoint::latest(out)?;
        saved.state.check_matches(&self.state(saved.state.step))?;
        // Full fp32 buffers (gathered from their owners under ZeRO and from the tensor-parallel
        // group), filled from the file, then sliced again for this rank.
        let full = self.sharding.gather_all(&self.parallel.full_weights()?)?;
        saved.load_model(&full)?;
        self.parallel.load_full_weights(&self.sharding.shard_all(&full)?)?;
        let mut state = saved.read_optimizer(&full)?;
        self.sharding.shard_state(&mut state)?;
        self.parallel
            .optimizer_mut()
            .load_state(&mut state)
            .with_context(|| format!("loading the optimizer state of {}", saved.dir.display()))?;
        if let Some(s) = self.parallel.scaler_mut() {
            s.resume(saved.state.loss_scale, saved.state.clean_steps);
        }
        self.step = saved.state.step;
        // Past the end, the loop would not run and the command would end as if it had trained.
        if self.step > self.total {
            bail!(
                "{} is at step {}, past this run's {} steps (--steps / --epochs)",
                saved.dir.display(),
                self.step,
                self.total
            );
        }
        if let Some(stop) = self.args.stop_after.filter(|&s| s < self.step) {
            bail!("--stop-after {stop} is before {}'s step {}", saved.dir.display(), self.step);
        }
        if self.world.rank() == 0 {
            println!("resuming from {} (step {})", saved.dir.display(), self.step);
        }
        Ok(())
    }

    /// Steps completed.
    pub fn steps_done(&self) -> usize {
        self.step
    }

    /// Where this invocation stops: `--steps`/`--epochs`, or earlier at `--stop-after`.
    pub fn end(&self) -> usize {
        self.args.stop_after.map_or(self.total, |s| s.min(self.total))
    }

    /// The micro-batches of epoch `epoch` from step `within` of it on, for this rank.
    fn start_loader(&mut self, epoch: usize, within: usize) -> anyhow::Result<()> {
        let (plan, per_rank_step) = (self.plan, self.plan.micro * self.plan.accumulation);
        let indices = self.sampler.indices(epoch as u64);
        let specs = (within..self.steps_per_epoch)
            .flat_map(|s| (0..plan.accumulation).map(move |m| s * per_rank_step + m * plan.micro))
            .map(|from| BatchSpec {
                indices: indices[from..from + plan.micro].iter().map(|&i| i as usize).collect(),
                epoch: epoch as u64,
            })
            .collect();
        let (set, t) = (self.splits.train.clone(), self.transforms.train.clone());
        self.loader = Some(Loader::new(set, t, self.args.seed.seed, specs, self.args.workers, 2)?);
        Ok(())
    }

    /// One optimizer step: every micro-batch forward and backward, then the update.
    pub fn step(&mut self) -> anyhow::Result<StepOutcome> {
        engine::dist::heartbeat::beat();
        let step = self.step;
        let (epoch, within) = (step / self.steps_per_epoch, step % self.steps_per_epoch);
        if self.loader.is_none() || within == 0 {
            self.start_loader(epoch, within)?;
        }
        let started = Instant::now();
        let lr = self.schedule.at(step);
        // Draws are keyed by the data-parallel rank: a tensor-parallel group shares its batch.
        let (seed, rank, accumulation) = (self.args.seed.seed, self.dp.rank(), self.plan.accumulation);
        let mixup = Mixup { alpha: self.args.mixup, smoothing: self.args.smoothing };
        let classes = self.cfg.num_classes as usize;
        let mut loss_sum = 0.0;
        // A pipeline takes the step's micro-batches together.
        let mut queued = Vec::new();
        for m in 0..accumulation {
            // Each micro-batch is progress: a step of many accumulated micro-batches has no
            // collective until its last, and must not look stalled to the spawner.
            engine::dist::heartbeat::beat();
            let loader = self.loader.as_mut().context("the data loader")?;
            let mut batch = loader.next().context("the data loader stopped early")??;
            let mut rng = Rng::keyed(seed ^ MIXUP_STREAM, step as u64, (rank * accumulation + m) as u64);
            let targets = mixup.apply(&mut batch.pixels, &batch.labels, classes, &mut rng);
            let (images, _) = to_tensors(&batch, self.device, self.kind)?;
            let targets = Tensor::f_from_slice(&targets)?.f_view([-1, classes as i64])?.f_to_device(self.device)?;
            let Model::Whole(model) = &self.model else {
                queued.push((images, targets));
                continue;
            };
            let loss = soft_cross_entropy(&model.forward(&images)?, &targets) / accumulation as f64;
            self.parallel.backward(&loss, m + 1 == accumulation)?;
            loss_sum += loss.f_double_value(&[])?;
        }
        let loss = match &mut self.model {
            Model::Whole(_) => Some(loss_sum),
            Model::Stages(stages) => stages.forward_backward(&self.parallel, &queued)?,
        };
        let applied = self.parallel.step(lr, self.args.optimizer.clip_grad)?.applied;
        // The mean over the ranks that hold a loss (under --pp, the last stage's).
        let loss = Tensor::from_slice(&[loss.unwrap_or(0.0), loss.map_or(0.0, |_| 1.0)]);
        self.world.group.all_reduce(&loss, ReduceOp::Sum)?;
        let loss = loss.double_value(&[0]) / loss.double_value(&[1]);
        if !loss.is_finite() && self.parallel.scaler().is_none() {
            bail!("step {}: the loss is {loss}; lower --lr or use --clip-grad", step + 1);
        }
        self.step += 1;
        let record = Record {
            step: self.step,
            epoch: epoch + 1,
            loss,
            lr,
            images_per_s: self.plan.global as f64 / started.elapsed().as_secs_f64(),
            applied,
            val_top1: None,
            val_top5: None,
        };
        Ok(StepOutcome { record, epoch_end: within + 1 == self.steps_per_epoch || self.step == self.end() })
    }

    /// Top-1 and top-5 accuracy on the validation set (`None` without one).
    pub fn evaluate(&self) -> anyhow::Result<Option<(f64, f64)>> {
        if self.splits.val.is_empty() {
            return Ok(None);
        }
        let (val, t) = (&self.splits.val, &self.transforms.eval);
        Ok(Some(match &self.model {
            Model::Whole(model) => {
                evaluate(model, val, t, &self.dp, self.sharding.batch_blocks(), self.device, self.kind)?
            }
            Model::Stages(stages) => {
                let counts_here = stages.holds_loss() && self.sharding.leads();
                let (dp, world, blocks) = (&self.dp, &self.world.group, self.sharding.batch_blocks());
                stages.evaluate(val, t, dp, world, counts_here, blocks, self.device, self.kind)?
            }
        }))
    }

    /// Whether the step just taken is due a checkpoint (`--save-every`, else each epoch's end;
    /// the last step and `--stop-after`).
    fn save_due(&self) -> bool {
        let every = self.args.save_every.unwrap_or(self.steps_per_epoch);
        self.args.out.is_some()
            && (self.step.is_multiple_of(every) || self.step == self.total || Some(self.step) == self.args.stop_after)
    }

    /// Writes a checkpoint of the current step under `--out` (every rank calls this).
    pub fn save(&self) -> anyhow::Result<()> {
        let out = self.args.out.as_deref().context("saving needs --out")?;
        let weights = self.full_weights()?;
        let optimizer = self.sharding.gather_state(&self.parallel.optimizer().state())?;
        let writes = self.sharding.writes_optimizer(self.args.zero > 0);
        checkpoint::save(out, self.world, &self.state(self.step), &weights, writes.then_some(&optimizer[..]))
    }

    /// Every weight in fp32 by timm name, full tensors on every rank (a collective).
    pub fn full_weights(&self) -> anyhow::Result<Vec<(String, Tensor)>> {
        let local = self.sharding.gather_all(&self.parallel.full_weights()?)?;
        match &self.model {
            Model::Whole(_) => Ok(local),
            Model::Stages(stages) => stages.gather(&local),
        }
    }

    /// Rank 0 writes the final `model.safetensors`, `model.json` and timm's `config.json` under
    /// `--out` (every rank
    /// calls this: the weights are gathered first).
    fn save_model(&self) -> anyhow::Result<()> {
        let weights = self.full_weights()?;
        if let (Some(dir), 0) = (&self.args.out, self.world.rank()) {
            let path = dir.join("model.safetensors");
            data::checkpoint::save_tensors(&weights, &path)?;
            let normalize = self.transforms.eval.normalize();
            let file = ModelFile {
                config: self.cfg,
                label_names: Some(self.splits.train.classes().to_vec()),
                mean: Some(ModelFile::decimals(&normalize.mean)),
                std: Some(ModelFile::decimals(&normalize.std)),
            };
            file.write(dir)?;
            println!("saved {}, model.json and timm's config.json", path.display());
        }
        Ok(())
    }

    /// The metrics file under `--out` (rank 0), kept up to the resumed step.
    fn open_metrics(&self) -> anyhow::Result<Option<Metrics>> {
        match (&self.args.out, self.world.rank()) {
            (Some(dir), 0) => {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
                let path = dir.join(&self.args.job.metrics);
                Ok(Some(Metrics::open::<Record>(&path, self.args.resume.then_some(self.step))?))
            }
            _ => Ok(None),
        }
    }

    fn announce(&self) {
        let (plan, ranks, dp, tp) = (self.plan, self.world.size(), self.dp.size(), self.sharding.size());
        let (sp, pp) = (self.sharding.sp_size(), self.args.pipeline.pp);
        println!(
            "vit pretrain: {} training / {} validation images, {ranks} rank(s) = {pp} pipeline x {dp} data x {sp} sequence x {tp} tensor parallel, global batch {} = {dp} x {} micro-batch x {} accumulation, {} steps ({}/epoch), {:?}, {:?}, ZeRO {}",
            self.splits.train.len(),
            self.splits.val.len(),
            plan.global,
            plan.micro,
            plan.accumulation,
            self.total,
            self.steps_per_epoch,
            self.args.optimizer.optimizer,
            self.args.precision.precision,
            self.args.zero
        );
        if self.args.offload_optimizer && self.device == Device::Cpu {
            println!(
                "note: --offload-optimizer keeps the optimizer state in CPU memory, where a CPU run has it already"
            );
        }
    }
}

/// Runs `vit pretrain` as one rank of `world`. Under `--parallel auto` the planner's plan for
/// the world's ranks fills in the layout flags first (rank 0 prints it), and the run is then
/// the manual flags' run.
pub fn pretrain(args: &PretrainArgs, world: &World) -> anyhow::Result<Trained> {
    let planned;
    let args = match args.planner {
        None => args,
        Some(PlannerMode::Plan) => bail!("--parallel plan prints the plan without training; use --parallel auto"),
        Some(PlannerMode::Auto) => {
            let (applied, _, text) = crate::plan::apply(args, world)?;
            if world.rank() == 0 {
                println!("{text}--parallel auto: training with the plan above");
            }
            planned = applied;
            &planned
        }
    };
    let mut trainer = Trainer::new(args, world)?;
    if args.resume {
        trainer.resume()?;
    }
    let rank = world.rank();
    let mut metrics = trainer.open_metrics()?;
    if rank == 0 {
        trainer.announce();
    }
    let (start_step, end, total) = (trainer.steps_done(), trainer.end(), trainer.total);
    let progress = engine::progress::progress_bar(rank == 0 && !args.job.quiet, total, start_step);
    let start = Instant::now();
    let mut losses = vec![];
    let (mut val_top1, mut val_top5) = (None, None);
    while trainer.steps_done() < end {
        let StepOutcome { mut record, epoch_end } = trainer.step()?;
        let s = &mut record;
        losses.push((s.step, s.loss));
        if let Some((top1, top5)) = if epoch_end { trainer.evaluate()? } else { None } {
            (s.val_top1, s.val_top5) = (Some(top1), Some(top5));
            (val_top1, val_top5) = (s.val_top1, s.val_top5);
            if rank == 0 {
                progress.suspend(|| {
                    println!(
                        "epoch {:>3}  step {:>6}/{total}  loss {:.4}  lr {:.2e}  val top-1 {:.2}%  top-5 {:.2}%  {:.1} s",
                        s.epoch,
                        s.step,
                        s.loss,
                        s.lr,
                        100.0 * top1,
                        100.0 * top5,
                        start.elapsed().as_secs_f64()
                    )
                });
            }
        }
        if let Some(m) = metrics.as_mut() {
            m.write(&record)?;
        }
        progress.set_message(format!("loss {:.4}  {:.0} img/s", record.loss, record.images_per_s));
        progress.inc(1);
        if trainer.save_due() {
            trainer.save()?;
        }
    }
    progress.finish_and_clear();
    trainer.loader = None;
    let seconds = start.elapsed().as_secs_f64();
    trainer.save_model()?;
    world.group.barrier()?;
    let weights = trainer.full_weights()?;
    Ok(Trained { vs: trainer.vs, weights, losses, val_top1, val_top5, seconds })
}
