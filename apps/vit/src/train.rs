//! `vit pretrain`: data-parallel ViT training with LAMB, LARS or AdamW, linear warmup then
//! cosine decay, gradient accumulation, ZeRO 1/2, mixed precision, mixup and label smoothing,
//! checkpoints with exact resume.
//!
//! One step: each rank runs `accumulation` micro-batches forward and backward (gradients
//! synchronised only on the last, as the buckets fill), then optional unscaling (fp16), global
//! gradient clipping, and the optimizer step (on fp32 master weights for bf16/fp16 or
//! `--offload-optimizer`). Every random draw (data order, crops, mixup) is keyed by the seed and
//! the step or example, so a resumed run repeats the uninterrupted one exactly.
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use data::augment::{Mixup, Rng, Transform};
use data::loader::{make_batch, Batch, BatchSpec, Loader};
use data::{Dataset, DistributedSampler};
use engine::dist::{ProcessGroup, ReduceOp, World};
use engine::optim::{
    clip_grad_norm, params_of, scale_lr, AdamW, AdamWConfig, Decay, Lamb, LambConfig, Lars, LarsConfig, LossScaler,
    LrSchedule, MasterWeights, Optimizer, Param,
};
use engine::parallel::{partition, DataParallel, DataParallelConfig, ZeroOptimizer};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::batch::{parse_batch, BatchPlan};
use crate::checkpoint::{self, TrainerState};
use crate::datasets::{probe, DataArgs, Transforms};
use crate::metrics::{Metrics, Record};
use crate::model::{correct_top_k, Vit, VitConfig};

/// Keys mixup's draws apart from the other streams of the same seed.
const MIXUP_STREAM: u64 = 0x6d69_7875_7000;

/// Which optimizer steps the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerKind {
    /// LAMB (layer-wise adaptive Adam), the large-batch default.
    Lamb,
    /// LARS (layer-wise adaptive SGD with momentum).
    Lars,
    /// AdamW.
    Adamw,
}

/// How the learning rate falls after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DecayKind {
    /// Half a cosine down to the floor.
    Cosine,
    /// A straight line down to the floor.
    Linear,
}

pub use engine::runtime::DeviceKind;

/// Arithmetic precision of the model's weights and activations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    /// 32-bit floats throughout.
    Fp32,
    /// bfloat16 model, fp32 master weights and optimizer.
    Bf16,
    /// float16 model with dynamic loss scaling, fp32 master weights and optimizer.
    Fp16,
}

impl Precision {
    fn kind(self) -> Kind {
        match self {
            Precision::Fp32 => Kind::Float,
            Precision::Bf16 => Kind::BFloat16,
            Precision::Fp16 => Kind::Half,
        }
    }
}

/// Options of `vit pretrain`.
#[derive(clap::Args, Clone, Debug)]
pub struct PretrainArgs {
    #[command(flatten)]
    pub data: DataArgs,
    /// Model: a timm name (vit_tiny_patch16_224, vit_base_patch32_224, ...) or `digits`, the
    /// small ViT for the embedded 8x8 digits (the default without --data; vit_tiny_patch16_224
    /// with it). Channels and classes follow the data.
    #[arg(long)]
    pub model: Option<String>,
    /// Input side in pixels (default: the model's).
    #[arg(long)]
    pub image_size: Option<i64>,
    /// Patch side in pixels (default: the model's).
    #[arg(long)]
    pub patch_size: Option<i64>,
    /// Global batch: examples per optimizer step over all ranks and accumulation steps (a k
    /// suffix multiplies by 1024: 32k).
    #[arg(long, default_value = "128", value_parser = parse_batch)]
    pub batch: usize,
    /// Examples per forward/backward on one rank (default: the largest divisor of the per-rank
    /// batch up to 256); the rest of the per-rank batch is gradient accumulation.
    #[arg(long)]
    pub micro_batch: Option<usize>,
    /// Optimizer.
    #[arg(long, value_enum, default_value_t = OptimizerKind::Lamb)]
    pub optimizer: OptimizerKind,
    /// Peak learning rate, reached at the end of warmup (the default suits LAMB on the
    /// embedded digits).
    #[arg(long, default_value_t = 3e-2)]
    pub lr: f64,
    /// Scale --lr linearly by --batch / this batch (the linear scaling rule; off by default).
    #[arg(long)]
    pub lr_base_batch: Option<usize>,
    /// Decay after warmup.
    #[arg(long, value_enum, default_value_t = DecayKind::Cosine)]
    pub decay: DecayKind,
    /// Final learning rate as a share of the peak.
    #[arg(long, default_value_t = 0.01)]
    pub min_lr_ratio: f64,
    /// Weight decay (not applied to biases and norm weights).
    #[arg(long, default_value_t = 0.05)]
    pub weight_decay: f64,
    /// Linear warmup steps.
    #[arg(long, default_value_t = 50)]
    pub warmup: usize,
    /// Epochs (passes over the training set).
    #[arg(long, default_value_t = 60)]
    pub epochs: usize,
    /// Optimizer steps, overriding --epochs.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Clip the global gradient norm to this value.
    #[arg(long)]
    pub clip_grad: Option<f64>,
    /// Mixup's Beta(alpha, alpha); 0 turns mixup off.
    #[arg(long, default_value_t = 0.0)]
    pub mixup: f64,
    /// Label smoothing.
    #[arg(long, default_value_t = 0.1)]
    pub smoothing: f64,
    /// Smallest area share of the random resized crop (default 0.7 for the digits, 0.08 for
    /// photos as torchvision).
    #[arg(long)]
    pub crop_scale: Option<f64>,
    /// Arithmetic precision.
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    pub precision: Precision,
    /// ZeRO stage: 0 (plain data parallel), 1 (sharded optimizer state), 2 (and gradients).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=2))]
    pub zero: u8,
    /// Keep the fp32 master weights and optimizer state in CPU memory (with --device cuda).
    #[arg(long)]
    pub offload_optimizer: bool,
    /// Device (cuda: each rank its local GPU).
    #[arg(long, default_value_t = DeviceKind::Cpu)]
    pub device: DeviceKind,
    /// Local ranks to spawn (under torchrun, Slurm or mpirun the launcher decides).
    #[arg(long, default_value_t = 1)]
    pub nproc: usize,
    /// Seed of the initial weights, the data order and the augmentations.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Directory for checkpoints, metrics and the final model (written by rank 0).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run saved under --out from its latest checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Checkpoint every this many steps (default: at each epoch end).
    #[arg(long)]
    pub save_every: Option<usize>,
    /// Stop after this many steps in total (checkpointing first when --out is given) while the
    /// schedule still follows --steps/--epochs: for time-limited jobs continued with --resume.
    #[arg(long)]
    pub stop_after: Option<usize>,
    /// Metrics file name under --out (`.csv` for CSV, else JSON lines).
    #[arg(long, default_value = "metrics.jsonl")]
    pub metrics: String,
    /// Decode and augmentation threads per rank.
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Rendezvous and collective timeout in seconds.
    #[arg(long, default_value_t = 300.0)]
    pub timeout: f64,
    /// No progress bar.
    #[arg(long)]
    pub quiet: bool,
}

impl PretrainArgs {
    /// The rendezvous and collective timeout.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout)
    }
}

/// What a run ended with.
pub struct Trained {
    /// The model (the model's precision; see `weights` for fp32).
    pub vs: VarStore,
    /// The fp32 weights by name (master weights under mixed precision).
    pub weights: Vec<(String, Tensor)>,
    /// Mean loss of each step taken by this invocation, by step number (1-based).
    pub losses: Vec<(usize, f64)>,
    /// Validation top-1 accuracy after the last step, in [0, 1].
    pub val_top1: f64,
    /// Validation top-5 accuracy after the last step.
    pub val_top5: f64,
    /// Wall time of the training loop.
    pub seconds: f64,
}

/// The model used for the 8x8 digits: 2x2 patches, 16 tokens plus the class token.
pub fn digits_config() -> VitConfig {
    VitConfig {
        image_size: 8,
        patch_size: 2,
        in_channels: 1,
        num_classes: 10,
        width: 64,
        depth: 4,
        heads: 4,
        mlp_ratio: 2.0,
    }
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
    let mut cfg = match name {
        "digits" => digits_config(),
        _ => VitConfig::from_timm_name(name).with_context(|| {
            format!("--model {name}: not a known model (digits, or vit_{{tiny,small,base,large}}_patch{{16,32}}_224)")
        })?,
    };
    cfg.image_size = image_size.unwrap_or(cfg.image_size);
    cfg.patch_size = patch_size.unwrap_or(cfg.patch_size);
    cfg.in_channels = data.channels() as i64;
    cfg.num_classes = data.classes().len() as i64;
    cfg.validate().map_err(|e| anyhow::anyhow!("model {name}: {e}"))?;
    Ok(cfg)
}

pub(crate) fn make_optimizer(kind: OptimizerKind, params: Vec<Param>, lr: f64, wd: f64) -> Box<dyn Optimizer> {
    match kind {
        OptimizerKind::Lamb => Box::new(Lamb::new(params, LambConfig { lr, weight_decay: wd, ..Default::default() })),
        OptimizerKind::Lars => Box::new(Lars::new(params, LarsConfig { lr, weight_decay: wd, ..Default::default() })),
        OptimizerKind::Adamw => {
            Box::new(AdamW::new(params, AdamWConfig { lr, weight_decay: wd, ..Default::default() }))
        }
    }
}

/// A batch as model input `[n, c, h, w]` and labels.
pub(crate) fn to_tensors(batch: &Batch, device: Device, kind: Kind) -> anyhow::Result<(Tensor, Tensor)> {
    let shape: Vec<i64> = batch.shape.iter().map(|&d| d as i64).collect();
    let images = Tensor::f_from_slice(&batch.pixels)?.f_view(shape.as_slice())?.f_to_device(device)?.f_to_kind(kind)?;
    Ok((images, Tensor::f_from_slice(&batch.labels)?.f_to_device(device)?))
}

/// Top-1 and top-5 accuracy on `set`, each rank evaluating every N-th example and the counts
/// summed over the group.
pub fn evaluate(
    model: &Vit,
    set: &Arc<dyn Dataset>,
    transform: &Transform,
    group: &ProcessGroup,
    device: Device,
    kind: Kind,
) -> anyhow::Result<(f64, f64)> {
    let mine: Vec<usize> = (group.rank()..set.len()).step_by(group.size()).collect();
    let mut counts = [0i64; 2];
    for chunk in mine.chunks(256) {
        let batch = make_batch(set.as_ref(), transform, 0, &BatchSpec { indices: chunk.to_vec(), epoch: 0 })?;
        let (images, labels) = to_tensors(&batch, device, kind)?;
        let logits = tch::no_grad(|| model.forward(&images));
        counts[0] += correct_top_k(&logits, &labels, 1);
        counts[1] += correct_top_k(&logits, &labels, 5);
    }
    let counts = Tensor::from_slice(&counts);
    group.all_reduce(&counts, ReduceOp::Sum)?;
    let n = set.len() as f64;
    Ok((counts.int64_value(&[0]) as f64 / n, counts.int64_value(&[1]) as f64 / n))
}

/// Soft-target cross-entropy: mean over the batch of -sum(target * log_softmax(logits)).
fn soft_cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    -(logits.log_softmax(1, Kind::Float) * targets).sum_dim_intlist(1, false, Kind::Float).mean(Kind::Float)
}

/// Runs `vit pretrain` as one rank of `world`.
pub fn pretrain(args: &PretrainArgs, world: &World) -> anyhow::Result<Trained> {
    let (rank, ranks) = (world.rank(), world.size());
    let group = &world.group;
    let plan = BatchPlan::new(args.batch, ranks, args.micro_batch, 256).map_err(anyhow::Error::msg)?;
    if args.resume && args.out.is_none() {
        bail!("--resume needs --out (the folder of the run to continue)");
    }
    let splits = args.data.splits()?;
    probe(splits.train.as_ref(), "the training set")?;
    if !splits.val.is_empty() {
        probe(splits.val.as_ref(), "the validation set")?;
    }
    let cfg =
        model_config(args.model.as_deref(), args.image_size, args.patch_size, splits.embedded, splits.train.as_ref())?;
    let crop_scale = args.crop_scale.unwrap_or(if splits.embedded { 0.7 } else { 0.08 });
    let transforms = Transforms::new(cfg.image_size as usize, cfg.in_channels as usize, splits.embedded, crop_scale);
    let device = args.device.device(world.env.local_rank)?;
    let kind = args.precision.kind();

    let sampler =
        DistributedSampler { len: splits.train.len(), ranks, rank, shuffle: true, seed: args.seed, drop_last: true };
    let per_rank_step = plan.micro * plan.accumulation;
    let steps_per_epoch = sampler.per_rank() / per_rank_step;
    if steps_per_epoch == 0 {
        bail!("--batch {} exceeds the {} training images", plan.global, splits.train.len());
    }
    let total = args.steps.unwrap_or(args.epochs * steps_per_epoch);
    let peak = args.lr_base_batch.map_or(args.lr, |base| scale_lr(args.lr, plan.global, base));
    let decay = match args.decay {
        DecayKind::Cosine => Decay::Cosine,
        DecayKind::Linear => Decay::Linear,
    };
    let schedule = LrSchedule { peak, floor: peak * args.min_lr_ratio, warmup: args.warmup, total, decay };

    // The model, on every rank from the same seed (DataParallel also broadcasts rank 0's).
    tch::manual_seed(args.seed as i64);
    let mut vs = VarStore::new(device);
    let model = Vit::new(&vs.root(), cfg);
    if kind != Kind::Float {
        vs.set_kind(kind);
    }
    let params = params_of(&vs);
    let master = match (kind, args.offload_optimizer) {
        (Kind::Float, false) => None,
        (_, offload) => Some(MasterWeights::on(params_of(&vs), if offload { Device::Cpu } else { device })?),
    };
    let owners = partition(&params, ranks);
    let ddp_cfg = DataParallelConfig::default();
    let ddp = match args.zero {
        2 => DataParallel::new_sharded(&params, group, ddp_cfg, owners.clone())?,
        _ => DataParallel::new(&params, group, ddp_cfg)?,
    };
    let opt_params = master.as_ref().map_or(params, |m| m.master());
    // Master copies were made before DataParallel's broadcast: take rank 0's weights too.
    if master.is_some() {
        tch::no_grad(|| opt_params.iter().try_for_each(|p| group.broadcast(&p.tensor, 0)))?;
    }
    let weights: Vec<(String, Tensor)> =
        opt_params.iter().map(|p| (p.name.clone(), p.tensor.shallow_clone())).collect();
    let (okind, lr, wd) = (args.optimizer, peak, args.weight_decay);
    let mut opt: Box<dyn Optimizer> = match args.zero {
        0 => make_optimizer(okind, opt_params, lr, wd),
        _ => Box::new(ZeroOptimizer::new(opt_params, owners, group, |ps| make_optimizer(okind, ps, lr, wd))?),
    };
    let mut scaler = (args.precision == Precision::Fp16).then(LossScaler::default);

    let run_state = |step: usize, scaler: &Option<LossScaler>| TrainerState {
        step,
        world_size: ranks,
        zero: args.zero,
        optimizer: format!("{:?}", args.optimizer).to_lowercase(),
        global_batch: plan.global,
        seed: args.seed,
        precision: format!("{:?}", args.precision).to_lowercase(),
        loss_scale: scaler.as_ref().map_or(1.0, |s| s.scale),
        clean_steps: scaler.as_ref().map_or(0, |s| s.clean_steps()),
        model: cfg,
    };
    let mut start_step = 0;
    if args.resume {
        let out = args.out.as_deref().expect("checked above");
        let saved = checkpoint::latest(out)?;
        saved.state.check_matches(&run_state(saved.state.step, &scaler))?;
        saved.load_model(&weights)?;
        saved.load_optimizer(world, opt.as_mut())?;
        if let Some(m) = &master {
            m.weights_to_model()?;
        }
        if let Some(s) = scaler.as_mut() {
            s.resume(saved.state.loss_scale, saved.state.clean_steps);
        }
        start_step = saved.state.step;
        if rank == 0 {
            println!("resuming from {} (step {start_step})", saved.dir.display());
        }
    }
    let mut metrics = match (&args.out, rank) {
        (Some(dir), 0) => {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
            Some(Metrics::open(&dir.join(&args.metrics), args.resume.then_some(start_step))?)
        }
        _ => None,
    };
    if rank == 0 {
        println!(
            "vit pretrain: {} training / {} validation images, {ranks} rank(s), global batch {} = {ranks} x {} micro-batch x {} accumulation, {total} steps ({steps_per_epoch}/epoch), {:?}, {:?}, ZeRO {}",
            splits.train.len(),
            splits.val.len(),
            plan.global,
            plan.micro,
            plan.accumulation,
            args.optimizer,
            args.precision,
            args.zero
        );
    }
    let progress = engine::runtime::progress_bar(rank == 0 && !args.quiet, total, start_step);
    let mixup = Mixup { alpha: args.mixup, smoothing: args.smoothing };
    let classes = cfg.num_classes as usize;
    let save_every = args.save_every.unwrap_or(steps_per_epoch);

    let start = Instant::now();
    let mut losses = vec![];
    let (mut val_top1, mut val_top5) = (0.0, 0.0);
    let mut loader: Option<Loader> = None;
    let end = args.stop_after.map_or(total, |s| s.min(total));
    for step in start_step..end {
        let (epoch, within) = (step / steps_per_epoch, step % steps_per_epoch);
        if loader.is_none() || within == 0 {
            let indices = sampler.indices(epoch as u64);
            let specs = (within..steps_per_epoch)
                .flat_map(|s| (0..plan.accumulation).map(move |m| s * per_rank_step + m * plan.micro))
                .map(|from| BatchSpec {
                    indices: indices[from..from + plan.micro].iter().map(|&i| i as usize).collect(),
                    epoch: epoch as u64,
                })
                .collect();
            let (set, t) = (splits.train.clone(), transforms.train.clone());
            loader = Some(Loader::new(set, t, args.seed, specs, args.workers, 2)?);
        }
        let step_start = Instant::now();
        let lr_now = schedule.at(step);
        opt.set_lr(lr_now);
        let mut loss_sum = 0.0;
        for m in 0..plan.accumulation {
            let batch = loader.as_mut().expect("created above").next().context("the data loader stopped early")??;
            let mut batch = batch;
            let mut rng = Rng::keyed(args.seed ^ MIXUP_STREAM, step as u64, (rank * plan.accumulation + m) as u64);
            let targets = mixup.apply(&mut batch.pixels, &batch.labels, classes, &mut rng);
            let (images, _) = to_tensors(&batch, device, kind)?;
            let targets = Tensor::f_from_slice(&targets)?.f_view([-1, classes as i64])?.f_to_device(device)?;
            ddp.set_sync(m + 1 == plan.accumulation)?;
            let loss = soft_cross_entropy(&model.forward(&images), &targets) / plan.accumulation as f64;
            let scaled = match &scaler {
                Some(s) => s.scale_loss(&loss)?,
                None => loss.shallow_clone(),
            };
            engine::autograd::backward(&[&scaled], &[None], false)?;
            loss_sum += loss.f_double_value(&[])?;
        }
        ddp.finish_gradients()?;
        if let Some(m) = &master {
            m.gradients_to_master()?;
        }
        let finite = match &scaler {
            Some(s) => s.unscale(opt.params(), Some(group))?,
            None => true,
        };
        if finite {
            if let Some(max) = args.clip_grad {
                clip_grad_norm(opt.params(), max, (args.zero == 2).then_some(group))?;
            }
            opt.step()?;
        }
        opt.zero_grad();
        if let Some(s) = scaler.as_mut() {
            s.update(finite);
        }
        if let Some(m) = &master {
            m.weights_to_model()?;
        }

        let loss = Tensor::from_slice(&[loss_sum]);
        group.all_reduce(&loss, ReduceOp::Avg)?;
        let loss = loss.double_value(&[0]);
        if !loss.is_finite() && scaler.is_none() {
            bail!("step {}: the loss is {loss}; lower --lr or use --clip-grad", step + 1);
        }
        losses.push((step + 1, loss));
        let images_per_s = plan.global as f64 / step_start.elapsed().as_secs_f64();
        let epoch_end = within + 1 == steps_per_epoch || step + 1 == end;
        let (mut top1, mut top5) = (None, None);
        if epoch_end && !splits.val.is_empty() {
            (val_top1, val_top5) = evaluate(&model, &splits.val, &transforms.eval, group, device, kind)?;
            (top1, top5) = (Some(val_top1), Some(val_top5));
            if rank == 0 {
                progress.suspend(|| {
                    println!(
                        "epoch {:>3}  step {:>6}/{total}  loss {loss:.4}  lr {lr_now:.2e}  val top-1 {:.2}%  top-5 {:.2}%  {:.1} s",
                        epoch + 1,
                        step + 1,
                        100.0 * val_top1,
                        100.0 * val_top5,
                        start.elapsed().as_secs_f64()
                    )
                });
            }
        }
        if let Some(m) = metrics.as_mut() {
            let applied = finite;
            m.write(&Record {
                step: step + 1,
                epoch: epoch + 1,
                loss,
                lr: lr_now,
                images_per_s,
                applied,
                val_top1: top1,
                val_top5: top5,
            })?;
        }
        progress.set_message(format!("loss {loss:.4}  {images_per_s:.0} img/s"));
        progress.inc(1);
        if let Some(out) = &args.out {
            if (step + 1) % save_every == 0 || step + 1 == total || Some(step + 1) == args.stop_after {
                checkpoint::save(out, world, &run_state(step + 1, &scaler), &weights, opt.as_ref())?;
            }
        }
    }
    progress.finish_and_clear();
    drop(loader);
    let seconds = start.elapsed().as_secs_f64();
    if let (Some(dir), 0) = (&args.out, rank) {
        let path = dir.join("model.safetensors");
        data::checkpoint::save_tensors(&weights, &path)?;
        let json = serde_json::to_string_pretty(&cfg)?;
        data::write_atomic::<anyhow::Error>(&dir.join("model.json"), |w| {
            Ok(std::io::Write::write_all(w, json.as_bytes())?)
        })?;
        println!("saved {} and model.json", path.display());
    }
    group.barrier()?;
    Ok(Trained { vs, weights, losses, val_top1, val_top5, seconds })
}
