//! `vit pretrain`: data-parallel ViT training with LAMB, LARS or AdamW, linear warmup then
//! cosine decay, gradient accumulation, ZeRO 1/2, mixed precision, mixup and label smoothing,
//! tensor parallelism (`--tp`, 1D/2D/2.5D/3D) and sequence parallelism (`--sp`), combined with
//! data parallelism over the rest of the ranks, pipeline parallelism (`--pp`, see
//! [`crate::pipeline_parallel`]), checkpoints with exact resume at any layout.
//!
//! The job's layout ([`crate::layout::Layout`], from the flags or the planner) is decided
//! before the trainer exists; [`crate::parallelize`] applies it to the serial model. One
//! step: each rank runs `accumulation` micro-batches forward and backward (gradients
//! synchronised only on the last, as the buckets fill), then optional unscaling (fp16), global
//! gradient clipping, and the optimizer step (on fp32 master weights for bf16/fp16 or
//! `--offload-optimizer`). Every random draw (data order, crops, mixup) is keyed by the seed
//! and the step or example, so a resumed run repeats the uninterrupted one exactly.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use data::augment::{Mixup, Rng};
use data::loader::{BatchSpec, Loader};
use data::DistributedSampler;
use engine::dist::{ProcessGroup, ReduceOp, World};
use engine::job::ReportTo;
use engine::metrics::Metrics;
use engine::optim::{scale_lr, LrSchedule};
use engine::parallel::Parallelized;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::args::PretrainArgs;
use crate::batch::to_tensors;
use crate::checkpoint::{self, TrainerState};
use crate::datasets::{probe, DataArgs, Splits, Transforms};
use crate::eval::evaluate;
use crate::layout::Layout;
use crate::mesh::Mesh;
use crate::metrics::Record;
use crate::model::{soft_cross_entropy, VitConfig};
use crate::model_file::ModelFile;
use crate::parallelize::{parallelize, Compute, Parallel};
use crate::pipeline_parallel::Model;
use crate::tensor_parallel::Sharding;

/// Keys mixup's draws apart from the other streams of the same seed.
const MIXUP_STREAM: u64 = 0x6d69_7875_7000;

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

/// A step's outcome: its log record (without validation figures) and whether it ended an
/// epoch.
pub struct StepOutcome {
    /// Step, epoch (1-based), loss over the global batch, learning rate, images/s, applied.
    pub record: Record,
    /// Whether the step ended an epoch (the trainer then evaluates).
    pub epoch_end: bool,
}

/// A run's training data: the splits, their transforms, this replica's sampler and the steps
/// per epoch it makes of them.
struct TrainingData {
    splits: Splits,
    transforms: Transforms,
    sampler: DistributedSampler,
    steps_per_epoch: usize,
}

impl TrainingData {
    /// `args`' data sets, each checked to hold images (a set that holds none is named).
    fn splits(args: &DataArgs) -> anyhow::Result<Splits> {
        let splits = args.splits()?;
        let named = |p: Option<&PathBuf>| p.map_or("the embedded digits".to_string(), |p| p.display().to_string());
        probe(splits.train.as_ref(), &format!("the training set ({})", named(args.data.as_ref())))?;
        if !splits.val.is_empty() {
            let val_source = named(args.val_data.as_ref().or(args.data.as_ref()));
            probe(splits.val.as_ref(), &format!("the validation set ({val_source})"))?;
        }
        Ok(splits)
    }

    /// `splits` prepared for `cfg`, sampled for this replica of the data-parallel group `dp`
    /// in `layout`'s global batches; a batch larger than the training set is an error.
    fn new(
        args: &PretrainArgs,
        splits: Splits,
        cfg: &VitConfig,
        layout: &Layout,
        dp: &ProcessGroup,
    ) -> anyhow::Result<TrainingData> {
        let crop_scale = args.crop_scale.unwrap_or(if splits.embedded { 0.7 } else { 0.08 });
        let transforms =
            Transforms::new(cfg.image_size as usize, cfg.in_channels as usize, splits.embedded, crop_scale);
        let sampler = DistributedSampler {
            len: splits.train.len(),
            ranks: dp.size(),
            rank: dp.rank(),
            shuffle: true,
            seed: args.seed.seed,
            drop_last: true,
        };
        let plan = layout.batch;
        let steps_per_epoch = sampler.per_rank() / (plan.micro * plan.accumulation);
        if steps_per_epoch == 0 {
            bail!("--batch {} exceeds the {} training images", plan.global, splits.train.len());
        }
        Ok(TrainingData { splits, transforms, sampler, steps_per_epoch })
    }
}

/// One rank's `vit pretrain` run: the data, the model laid out by the job's layout, and the
/// position in the schedule.
pub struct Trainer<'a> {
    args: &'a PretrainArgs,
    world: &'a World,
    layout: Layout,
    cfg: VitConfig,
    data: TrainingData,
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
    /// The data, the model laid out on `world` as `layout` says (the same initial weights on
    /// every rank from the seed) and the learning-rate schedule; a model or data set the
    /// layout cannot split is an error naming the numbers.
    pub fn new(args: &'a PretrainArgs, layout: Layout, world: &'a World) -> anyhow::Result<Trainer<'a>> {
        check_out(args, world.rank())?;
        let splits = TrainingData::splits(&args.data)?;
        let cfg = args.model_config(&splits)?;
        layout.check(&cfg)?;
        let mesh = Mesh::new(world, &layout)?;
        let data = TrainingData::new(args, splits, &cfg, &layout, &mesh.data)?;
        let total = args.steps.unwrap_or(args.epochs * data.steps_per_epoch);
        let global = layout.batch.global;
        let peak = args.lr_base_batch.map_or(args.optimizer.lr, |base| scale_lr(args.optimizer.lr, global, base));
        let schedule = args.schedule.schedule(peak, total)?;
        let compute = Compute {
            device: args.job.launch.device(world)?,
            kind: args.precision.precision.kind(),
            kernels: args.kernels,
            seed: args.seed.seed,
            offload_optimizer: args.offload_optimizer,
        };
        let optimizer = args.optimizer.clone();
        let build = move |ps| optimizer.build(ps, peak);
        let Parallel { sharding, vs, model, parallel } = parallelize(cfg, &layout, &mesh, world, &compute, build)?;
        Ok(Trainer {
            args,
            world,
            layout,
            cfg,
            data,
            total,
            schedule,
            device: compute.device,
            kind: compute.kind,
            dp: mesh.data,
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
            zero: self.layout.zero,
            tp: self.layout.tp,
            pp: self.layout.pp,
            optimizer: self.args.optimizer.optimizer.name().to_string(),
            global_batch: self.layout.batch.global,
            seed: self.args.seed.seed,
            precision: self.args.precision.precision.name().to_string(),
            loss_scale: scaler.map_or(1.0, |s| s.scale),
            clean_steps: scaler.map_or(0, |s| s.clean_steps()),
            model: self.cfg,
            classes: Some(self.data.splits.train.classes().to_vec()),
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
        let plan = self.layout.batch;
        let per_rank_step = plan.micro * plan.accumulation;
        let indices = self.data.sampler.indices(epoch as u64);
        let specs = (within..self.data.steps_per_epoch)
            .flat_map(|s| (0..plan.accumulation).map(move |m| s * per_rank_step + m * plan.micro))
            .map(|from| BatchSpec {
                indices: indices[from..from + plan.micro].iter().map(|&i| i as usize).collect(),
                epoch: epoch as u64,
            })
            .collect();
        let (set, t) = (self.data.splits.train.clone(), self.data.transforms.train.clone());
        self.loader = Some(Loader::new(set, t, self.args.seed.seed, specs, self.args.workers, 2)?);
        Ok(())
    }

    /// One optimizer step: every micro-batch forward and backward, then the update.
    pub fn step(&mut self) -> anyhow::Result<StepOutcome> {
        engine::dist::heartbeat::beat();
        let step = self.step;
        let (epoch, within) = (step / self.data.steps_per_epoch, step % self.data.steps_per_epoch);
        if self.loader.is_none() || within == 0 {
            self.start_loader(epoch, within)?;
        }
        let started = Instant::now();
        let lr = self.schedule.at(step);
        // Draws are keyed by the data-parallel rank: a tensor-parallel group shares its batch.
        let (seed, rank, accumulation) = (self.args.seed.seed, self.dp.rank(), self.layout.batch.accumulation);
        let mixup = Mixup { alpha: self.args.mixup, smoothing: self.args.smoothing };
        let classes = self.cfg.num_classes as usize;
        // The micro-batches' losses summed where they are, in f64 (what reading each would add
        // on the host), and read once after the last: reading one waits for the device to
        // finish it, and the next micro-batch's work would queue only then.
        let mut loss_sum: Option<Tensor> = None;
        // A pipeline takes the step's micro-batches together.
        let mut queued = Vec::new();
        for m in 0..accumulation {
            // Each micro-batch is progress: a step of many accumulated micro-batches has no
            // collective until its last, and must not look stalled to the spawner.
            engine::dist::heartbeat::beat();
            let loader = self.loader.as_mut().context("the data loader")?;
            let batch = loader.next().context("the data loader stopped early")??;
            let mut rng = Rng::keyed(seed ^ MIXUP_STREAM, step as u64, (rank * accumulation + m) as u64);
            let (targets, lambda) = mixup.targets(&batch.labels, classes, &mut rng);
            // Blended in fp32 on the device, then cast to the run's kind.
            let (images, _) = to_tensors(&batch, self.device, Kind::Float)?;
            let images = crate::batch::mix(&images, lambda)?.f_to_kind(self.kind)?;
            let rows = (targets.len() / classes) as i64;
            let targets = engine::cuda::upload_slice(&targets, &[rows, classes as i64], self.device)?;
            let Model::Whole(model) = &self.model else {
                queued.push((images, targets));
                continue;
            };
            let loss = soft_cross_entropy(&model.forward(&images)?, &targets) / accumulation as f64;
            self.parallel.backward(&loss, m + 1 == accumulation)?;
            let loss = loss.f_detach()?.f_to_kind(Kind::Double)?;
            loss_sum = Some(match loss_sum {
                Some(sum) => sum.f_add(&loss)?,
                None => loss,
            });
        }
        let loss = match &mut self.model {
            Model::Whole(_) => Some(loss_sum.context("a step of no micro-batches")?.f_double_value(&[])?),
            Model::Stages(stages) => stages.forward_backward(&self.parallel, &queued)?,
        };
        let stepped = self.parallel.step(lr, self.args.optimizer.clip_grad)?;
        // The mean over the ranks that hold a loss (under --pp, the last stage's).
        let loss = Tensor::from_slice(&[loss.unwrap_or(0.0), loss.map_or(0.0, |_| 1.0)]);
        self.world.group.all_reduce(&loss, ReduceOp::Sum)?;
        let loss = loss.double_value(&[0]) / loss.double_value(&[1]);
        if !loss.is_finite() && self.parallel.scaler().is_none() {
            bail!("step {}: the loss is {loss}; lower --lr or use --clip-grad", step + 1);
        }
        self.step += 1;
        let seconds = started.elapsed().as_secs_f64();
        let record = Record {
            step: self.step,
            epoch: epoch + 1,
            loss,
            lr,
            images_per_s: self.layout.batch.global as f64 / seconds,
            applied: stepped.applied,
            val_top1: None,
            val_top5: None,
            seconds,
            grad_norm: stepped.grad_norm,
            peak_bytes: engine::process::peak_memory(self.device),
        };
        Ok(StepOutcome { record, epoch_end: within + 1 == self.data.steps_per_epoch || self.step == self.end() })
    }

    /// Top-1 and top-5 accuracy on the validation set (`None` without one).
    pub fn evaluate(&self) -> anyhow::Result<Option<(f64, f64)>> {
        if self.data.splits.val.is_empty() {
            return Ok(None);
        }
        let (val, t, blocks) = (&self.data.splits.val, &self.data.transforms.eval, self.layout.batch_blocks());
        Ok(Some(match &self.model {
            Model::Whole(model) => evaluate(model, val, t, &self.dp, blocks, self.device, self.kind)?,
            Model::Stages(stages) => {
                let counts_here = stages.holds_loss() && self.sharding.leads();
                let (dp, world) = (&self.dp, &self.world.group);
                stages.evaluate(val, t, dp, world, counts_here, blocks, self.device, self.kind)?
            }
        }))
    }

    /// Whether the step just taken is due a checkpoint (`--save-every`, else each epoch's end;
    /// the last step and `--stop-after`).
    fn save_due(&self) -> bool {
        let every = self.args.save_every.unwrap_or(self.data.steps_per_epoch);
        self.args.out.is_some()
            && (self.step.is_multiple_of(every) || self.step == self.total || Some(self.step) == self.args.stop_after)
    }

    /// Writes a checkpoint of the current step under `--out` (every rank calls this).
    pub fn save(&self) -> anyhow::Result<()> {
        let out = self.args.out.as_deref().context("saving needs --out")?;
        let weights = self.full_weights()?;
        let optimizer = self.sharding.gather_state(&self.parallel.optimizer().state())?;
        let writes = self.sharding.writes_optimizer(self.layout.zero > 0);
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
            let normalize = self.data.transforms.eval.normalize();
            let file = ModelFile {
                config: self.cfg,
                label_names: Some(self.data.splits.train.classes().to_vec()),
                mean: Some(ModelFile::decimals(&normalize.mean)),
                std: Some(ModelFile::decimals(&normalize.std)),
            };
            file.write(dir)?;
            println!("saved {}, model.json and timm's config.json", path.display());
        }
        Ok(())
    }

    /// The training log under `--out` (rank 0), kept up to the resumed step: the metrics file
    /// and, with `--report-to tensorboard`, TensorBoard's files.
    fn open_metrics(&self) -> anyhow::Result<Option<Metrics>> {
        match (&self.args.out, self.world.rank()) {
            (Some(dir), 0) => {
                std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
                let resumed = self.args.resume.then_some(self.step);
                Ok(Some(self.args.job.open_metrics::<Record>(dir, resumed, "vit-pretrain")?))
            }
            _ => Ok(None),
        }
    }

    fn announce(&self) {
        let (plan, ranks, dp, tp) = (self.layout.batch, self.world.size(), self.dp.size(), self.layout.tp);
        let (sp, pp) = (self.layout.sp, self.layout.pp);
        println!(
            "vit pretrain: {} training / {} validation images, {ranks} rank(s) = {pp} pipeline x {dp} data x {sp} sequence x {tp} tensor parallel, global batch {} = {dp} x {} micro-batch x {} accumulation, {} steps ({}/epoch), {:?}, {:?}, ZeRO {}",
            self.data.splits.train.len(),
            self.data.splits.val.len(),
            plan.global,
            plan.micro,
            plan.accumulation,
            self.total,
            self.data.steps_per_epoch,
            self.args.optimizer.optimizer,
            self.args.precision.precision,
            self.layout.zero
        );
        if self.args.offload_optimizer && self.device == Device::Cpu {
            println!(
                "note: --offload-optimizer keeps the optimizer state in CPU memory, where a CPU run has it already"
            );
        }
    }
}

/// Runs `vit pretrain` as one rank of `world`, in the layout of the flags or, under
/// `--parallel auto`, of the planner's plan for the world's ranks (rank 0 prints it). A run
/// that fails removes the `--out` folder it created (rank 0 creates it) if nothing was
/// written there, so that a typo in a flag leaves no empty run behind.
pub fn pretrain(args: &PretrainArgs, world: &World) -> anyhow::Result<Trained> {
    let created = args.out.as_ref().filter(|out| world.rank() == 0 && out.symlink_metadata().is_err());
    let result = run(args, world);
    if let (Err(_), Some(out)) = (&result, created) {
        // `remove_dir` removes only an empty folder.
        let _ = std::fs::remove_dir(out);
    }
    result
}

fn run(args: &PretrainArgs, world: &World) -> anyhow::Result<Trained> {
    let layout = crate::plan::layout(args, world)?;
    let mut trainer = Trainer::new(args, layout, world)?;
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

/// Errors on `--resume` without `--out`; says (on rank 0) when a fresh run will replace the
/// run saved under `--out`, which happens at its first save.
fn check_out(args: &PretrainArgs, rank: usize) -> anyhow::Result<()> {
    if args.resume && args.out.is_none() {
        bail!("--resume needs --out (the folder of the run to continue)");
    }
    if args.job.report_to == ReportTo::Tensorboard && args.out.is_none() {
        bail!("--report-to tensorboard needs --out (the logs go under it, in --logging-dir)");
    }
    if let (Some(out), false, 0) = (&args.out, args.resume, rank) {
        if let Ok(Some(dir)) = data::checkpoint_folders::latest(out) {
            eprintln!(
                "note: {} holds {}; this run starts afresh and replaces it (--resume continues it)",
                out.display(),
                dir.file_name().map_or(dir.display().to_string(), |n| n.to_string_lossy().into_owned())
            );
        }
    }
    Ok(())
}
