//! `fastfold train`: training steps of the whole network on one input and its known structure,
//! or on a data set in OpenFold's layout (`--mmcif-dir`, `--alignment-dir`: each step the next
//! chain, prepared ahead by AlphaFold's training-time pipeline, see [`crate::train_data`]),
//! with AlphaFold's whole monomer training loss ([`crate::loss::total`]) under the weights of
//! the training stage (`--config-preset`, OpenFold's names: `initial_training` or
//! `finetuning`), under dynamic axial parallelism.
//!
//! Backbone FAPE is clamped in 90% of the examples, drawn from the seed and the example's
//! number in the run ([`crate::loss::clamped_fape_at`]; in one process without accumulation,
//! the step number), the same on every rank that trains it. The confidence terms (pLDDT,
//! experimentally resolved, aligned error) train only on structures solved at 0.1 to 3 Å:
//! the resolution comes from `--resolution` or the target's header (with a data set, from the
//! mmCIF entry). Gradients flow through the last recycling pass only, as in AlphaFold.
//!
//! Under DAP every rank computes the embedders, structure module and heads on whole tensors
//! and the stacks on its block: the stacks' parameter gradients are summed over the ranks
//! ([`engine::parallel::dap::Dap::reduce_gradients`]); every other gradient is already whole
//! on every rank. With several DAP groups (`--dap`), each trains its own examples and the
//! gradients are averaged over the groups ([`crate::train_parallel`]); each step trains
//! `--accumulation` examples per group, and its log holds the mean over all of them.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use engine::dist::{ProcessGroup, World};
use engine::job::{JobArgs, OptimizerArgs};
use engine::optim::{clip_grad_norm, Optimizer, Param};
use engine::parallel::DataParallel;
use tch::{Device, Kind, Tensor};

use crate::features::Features;
use crate::ground_truth::GroundTruth;
use crate::input::{ChunkArgs, InputArgs};
use crate::loss::{clamped_fape_at, total_loss, LossConfig, LossInputs, MaskedMsaTarget, TrainingStage};
use crate::model::alphafold::AlphaFold;
use crate::model::{Exec, Params, EVOFORMER, EXTRA_MSA};
use crate::pdb::{read_resolution, Structure};
use crate::residue_constants::{RESNAMES, UNK_RESTYPE_INDEX};
use crate::train_data::args::TrainDataArgs;
use crate::train_data::example::Prepared;
use crate::train_data::layout;
use crate::train_data::loader::{ExampleLoader, Shard};
use crate::train_parallel::{mean_over_replicas, ParallelArgs, Ranks};

/// `fastfold train`'s options.
#[derive(clap::Args, Debug, Clone)]
#[command(
    mut_arg("lr", |a| a.help("Learning rate (AlphaFold: 1e-3)")),
    mut_arg("clip_grad", |a| a.default_value("0.1").help("Gradient-norm clip (AlphaFold: 0.1)")),
    mut_arg("metrics", |a| a.default_value("log.jsonl")),
    mut_arg("quiet", |a| a.help("No per-step lines")),
)]
pub struct TrainArgs {
    /// The sequence (one FASTA record, optional --msa) or processed features.
    #[command(flatten)]
    pub input: InputArgs,
    /// The true structure (PDB) of the query (not with --mmcif-dir).
    #[arg(long, required_unless_present = "mmcif_dir")]
    pub target: Option<PathBuf>,
    /// The chain of --target to read (default: its first chain).
    #[arg(long)]
    pub chain: Option<char>,
    /// Initial parameters (`.npz` with AlphaFold's names, or `.safetensors`).
    #[arg(long)]
    pub params: PathBuf,
    /// Output directory: `params.npz` after the last step and the training log.
    #[arg(short = 'o', long)]
    pub out: PathBuf,
    /// Optimizer steps.
    #[arg(long, default_value_t = 1)]
    pub steps: usize,
    /// The optimizer (AlphaFold: Adam, no weight decay).
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
    /// The training stage whose loss weights apply (OpenFold's presets, supplementary Table 4):
    /// `finetuning` adds the structural violations (weight 1), experimentally resolved (0.01)
    /// and, with the aligned-error head, predicted aligned error (0.1).
    #[arg(long, value_enum, default_value_t = TrainingStage::InitialTraining)]
    pub config_preset: TrainingStage,
    /// The target's resolution in Å (default: its header's `REMARK 2`, else 0): pLDDT,
    /// experimentally resolved and aligned error train only between 0.1 and 3 Å.
    #[arg(long, value_parser = engine::parse::non_negative)]
    pub resolution: Option<f64>,
    /// Recycling passes before the one that is trained (with --mmcif-dir they are drawn per
    /// step, as AlphaFold draws them: see --max-recycles).
    #[arg(long, default_value_t = 0, value_parser = engine::parse::count(0..=crate::input::MAX_RECYCLES))]
    pub recycles: usize,
    /// Training data in OpenFold's layout, in place of one input and --target.
    #[command(flatten)]
    pub data: TrainDataArgs,
    /// DAP groups, data-parallel replicas, accumulation and ZeRO.
    #[command(flatten)]
    pub parallel: ParallelArgs,
    /// Device, ranks, progress and the training log.
    #[command(flatten)]
    pub job: JobArgs,
    /// Chunking.
    #[command(flatten)]
    pub chunk: ChunkArgs,
}

/// The true structure in the layouts the losses read.
pub struct Target {
    /// The ground truth, as AlphaFold computes it from the structure.
    pub truth: GroundTruth,
    /// The structure's resolution (Å; 0, the default, for none: no confidence terms).
    pub resolution: f64,
}

impl Target {
    /// From a structure whose residue types must be the features' (`aatype` [N]), with the
    /// atoms backbone FAPE and the distogram need (else an error: one example without them
    /// would train on without those terms, silently).
    pub fn new(s: &Structure, aatype: &Tensor, source: &str) -> anyhow::Result<Target> {
        let target = Target::of_crop(s, aatype, source)?;
        // Without them a loss term is 0 and training would go on, silently, without it.
        if target.truth.backbone()?.1.sum(Kind::Float).double_value(&[]) == 0.0 {
            bail!("{source}: no residue has the N, CA and C atoms that backbone FAPE needs");
        }
        if target.truth.pseudo_beta_mask.sum(Kind::Float).double_value(&[]) == 0.0 {
            bail!("{source}: no residue has the CB atom (CA for glycine) that the distogram loss needs");
        }
        Ok(target)
    }

    /// As [`Target::new`], but the structure may lack those atoms: a data set's crop can fall
    /// on residues that were never observed, and trains that step with those terms at 0, as
    /// AlphaFold's masked losses give them.
    pub fn of_crop(s: &Structure, aatype: &Tensor, source: &str) -> anyhow::Result<Target> {
        let n = aatype.size()[0];
        let ours: Vec<i64> = Vec::try_from(aatype.to_device(Device::Cpu))?;
        if s.aatype.len() as i64 != n {
            bail!("{source}: {} residues, the input has {n}", s.aatype.len());
        }
        // An unknown residue on either side matches: the input's X is any residue, and the
        // structure's is a modified one (SEP, a D-amino acid) whose parent the input names, as
        // AlphaFold's mmCIF reader maps it.
        let unknown = |a: usize| a == UNK_RESTYPE_INDEX;
        if let Some(i) = (0..n as usize)
            .find(|&i| s.aatype[i] != ours[i] as usize && !unknown(ours[i] as usize) && !unknown(s.aatype[i]))
        {
            let name = |a: usize| RESNAMES.get(a).copied().unwrap_or("?");
            bail!(
                "{source}: residue {} is {} in the structure, {} in the input",
                i + 1,
                name(s.aatype[i]),
                name(ours[i] as usize)
            );
        }
        let device = aatype.device();
        let flat: Vec<f32> = s.positions.iter().flatten().flatten().copied().collect();
        let positions = Tensor::from_slice(&flat).view([n, 37, 3]).to_device(device);
        let flat: Vec<f32> = s.mask.iter().flatten().copied().collect();
        let mask = Tensor::from_slice(&flat).view([n, 37]).to_device(device);
        let truth = GroundTruth::new(aatype, &positions, &mask).with_context(|| source.to_string())?;
        Ok(Target { truth, resolution: 0.0 })
    }
}

/// One step's loss terms (AlphaFold's names in the comments), as the log records them.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StepLoss {
    /// The weighted total.
    pub loss: f64,
    /// Backbone FAPE averaged over the structure module's iterations, clamped or not.
    pub fape: f64,
    /// Whether backbone FAPE was clamped in this step.
    pub clamped: bool,
    /// Side-chain FAPE (`sidechain_fape`).
    pub sidechain_fape: f64,
    /// The chi loss (`chi_loss`).
    pub chi: f64,
    /// The angle-norm loss (`angle_norm_loss`).
    pub angle_norm: f64,
    /// The structural-violation loss before its weight.
    pub violation: f64,
    /// Distogram cross-entropy.
    pub distogram: f64,
    /// Masked-MSA cross-entropy.
    pub masked_msa: f64,
    /// pLDDT cross-entropy (0 outside the resolution range).
    pub plddt: f64,
    /// Experimentally-resolved cross-entropy (0 outside the resolution range).
    pub experimentally_resolved: f64,
    /// Aligned-error cross-entropy, with the aligned-error head.
    pub aligned_error: Option<f64>,
}

/// The loss of one pass and its terms.
pub struct Losses {
    /// The weighted sum, for backward.
    pub total: Tensor,
    /// Every term's value.
    pub terms: StepLoss,
}

/// The loss of the last pass on `features` (`recycles` passes before it) against `target`,
/// with `cfg`'s weights, backbone FAPE clamped or not.
fn losses(
    pass: &crate::model::alphafold::Pass,
    features: &Features,
    recycles: usize,
    target: &Target,
    cfg: &LossConfig,
    clamped: bool,
) -> anyhow::Result<Losses> {
    let slice = |t: &Tensor| t.get(recycles as i64);
    let (true_msa, bert_mask) = (slice(&features.true_msa), slice(&features.bert_mask));
    let (seq_mask, residue_index) = (slice(&features.seq_mask), slice(&features.residue_index));
    let inputs = LossInputs {
        truth: &target.truth,
        msa: MaskedMsaTarget { true_msa: &true_msa, bert_mask: &bert_mask },
        seq_mask: &seq_mask,
        residue_index: &residue_index,
        resolution: target.resolution,
        clamped,
    };
    let l = total_loss(pass, &inputs, cfg)?;
    let v = |t: &Tensor| t.double_value(&[]);
    let (s, h) = (&l.structure_terms, &l.heads);
    let terms = StepLoss {
        loss: v(&l.total),
        fape: v(&s.backbone_fape),
        clamped,
        sidechain_fape: v(&s.sidechain_fape),
        chi: v(&s.chi_loss),
        angle_norm: v(&s.angle_norm_loss),
        violation: v(&l.violation),
        distogram: v(&h.distogram),
        masked_msa: v(&h.masked_msa),
        plddt: v(&h.plddt),
        experimentally_resolved: v(&h.experimentally_resolved),
        aligned_error: h.aligned_error.as_ref().map(v),
    };
    Ok(Losses { total: l.total, terms })
}

/// One step's record.
#[derive(Debug, serde::Serialize)]
pub struct StepLog {
    /// 1-based step.
    pub step: usize,
    /// The chain trained on (`<pdb>_<chain>`, with --mmcif-dir) and its crop's residues
    /// (1-based, inclusive); with accumulation rank 0's chains of the step, joined by `; `.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub example: Option<String>,
    /// Recycling passes before the trained one (of rank 0's first example of the step).
    pub recycles: usize,
    /// Seconds the step waited for its examples on rank 0 (with --mmcif-dir): near 0 while
    /// the loader keeps ahead of training.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub data_seconds: Option<f64>,
    /// The loss and its terms: the mean over the step's examples on every group.
    #[serde(flatten)]
    pub losses: StepLoss,
    /// Gradient norm before clipping.
    pub grad_norm: f64,
    /// Seconds of the step.
    pub seconds: f64,
    /// Learning rate of the step.
    pub lr: f64,
    /// Peak memory so far (allocator on a GPU, resident set on the CPU), bytes.
    pub peak_bytes: Option<u64>,
}

impl engine::metrics::Record for StepLog {
    const CSV_HEADER: &'static str = "step,loss,fape,clamped,sidechain_fape,chi,angle_norm,violation,distogram,\
        masked_msa,plddt,experimentally_resolved,aligned_error,grad_norm,seconds,lr,peak_bytes,recycles,example,data_seconds";

    fn csv_row(&self) -> String {
        let l = &self.losses;
        let terms = [l.sidechain_fape, l.chi, l.angle_norm, l.violation, l.distogram, l.masked_msa, l.plddt];
        let cells: Vec<String> = terms.iter().chain([&l.experimentally_resolved]).map(|x| format!("{x:.6}")).collect();
        let pae = l.aligned_error.map(|x| format!("{x:.6}")).unwrap_or_default();
        let peak = self.peak_bytes.map(|b| b.to_string()).unwrap_or_default();
        let (step, clamped) = (self.step, u8::from(l.clamped));
        format!(
            "{step},{:.6},{:.6},{clamped},{},{pae},{:.6},{:.3},{:.6e},{peak},{},{},{}",
            l.loss,
            l.fape,
            cells.join(","),
            self.grad_norm,
            self.seconds,
            self.lr,
            self.recycles,
            self.example.as_deref().unwrap_or(""),
            self.data_seconds.map(|s| format!("{s:.3}")).unwrap_or_default()
        )
    }

    fn step(&self) -> usize {
        self.step
    }

    fn scalars(&self) -> Vec<(&'static str, f64)> {
        let l = &self.losses;
        let mut scalars = vec![
            ("train/loss", l.loss),
            ("train/fape", l.fape),
            ("train/sidechain_fape", l.sidechain_fape),
            ("train/chi", l.chi),
            ("train/angle_norm", l.angle_norm),
            ("train/violation", l.violation),
            ("train/distogram", l.distogram),
            ("train/masked_msa", l.masked_msa),
            ("train/plddt", l.plddt),
            ("train/experimentally_resolved", l.experimentally_resolved),
            ("train/grad_norm", self.grad_norm),
            ("train/step_seconds", self.seconds),
            ("train/lr", self.lr),
        ];
        scalars.extend(l.aligned_error.map(|x| ("train/aligned_error", x)));
        scalars.extend(self.data_seconds.map(|s| ("train/data_seconds", s)));
        scalars.extend(self.peak_bytes.map(|b| ("train/peak_memory_gib", engine::metrics::gib(b))));
        scalars
    }
}

/// One example of a step, as [`Trainer::step`] trains it.
#[derive(Clone, Copy)]
pub struct Example<'a> {
    /// Its features.
    pub features: &'a Features,
    /// Its true structure.
    pub target: &'a Target,
    /// Recycling passes before the trained one.
    pub recycles: usize,
    /// Its number in the run's stream of examples (1-based, [`Shard::example`]): backbone
    /// FAPE's clamping is drawn from it, so that it is the same whichever rank trains it.
    pub number: u64,
}

/// A trainer over one parameter store.
pub struct Trainer {
    model: AlphaFold,
    params: Params,
    optimizer: Box<dyn Optimizer>,
    stacks: Vec<Tensor>,
    clip: Option<f64>,
    loss: LossConfig,
    seed: u64,
    steps: u64,
    /// Averages the gradients over the data-parallel replicas (none for one group).
    replicas: Option<(DataParallel, ProcessGroup)>,
    /// The examples of the step under way and the loss terms of those trained so far.
    step_terms: (usize, Vec<StepLoss>),
}

impl Trainer {
    /// `optimizer` (AlphaFold's: Adam without weight decay, clip 0.1) over every array of
    /// `params` (moved to `device`), with the initial-training loss and seed 0
    /// ([`Trainer::with_loss`] sets them), in one process or one DAP group.
    pub fn new(params: &Params, device: Device, optimizer: &OptimizerArgs) -> anyhow::Result<Trainer> {
        Trainer::on_ranks(params, device, optimizer, &Ranks::one())
    }

    /// As [`Trainer::new`], on this rank of `ranks`: its gradients averaged with the other
    /// replicas' (a collective: every rank of the job builds its trainer together), its
    /// optimizer sharded over them under ZeRO-1.
    pub fn on_ranks(
        params: &Params,
        device: Device,
        optimizer: &OptimizerArgs,
        ranks: &Ranks,
    ) -> anyhow::Result<Trainer> {
        let params = params.to_device(device, true)?;
        let model = AlphaFold::new(&params)?;
        let is_stack = |k: &str| k.starts_with(&format!("{EVOFORMER}/")) || k.starts_with(&format!("{EXTRA_MSA}/"));
        let stacks = params.iter().filter(|(k, _)| is_stack(k)).map(|(_, t)| t.shallow_clone()).collect();
        let list: Vec<Param> = params.iter().map(|(k, t)| Param::new(k, t)).collect();
        let replicas = ranks.gradient_sync(&list)?.zip(ranks.data.clone());
        let clip = optimizer.clip_grad;
        let optimizer = ranks.optimizer(list, |list| optimizer.build(list, optimizer.lr))?;
        let loss = LossConfig::initial_training();
        Ok(Trainer {
            model,
            params,
            optimizer,
            stacks,
            clip,
            loss,
            seed: 0,
            steps: 0,
            replicas,
            step_terms: (0, Vec::new()),
        })
    }

    /// The same trainer with `loss`'s weights, backbone FAPE clamped in the examples its
    /// fraction draws from `seed` (by their numbers in the run: in one process, example n in
    /// step n).
    pub fn with_loss(self, loss: LossConfig, seed: u64) -> Trainer {
        Trainer { loss, seed, ..self }
    }

    /// The gradients of one pass on `features` and `target` in the parameters' `.grad()`, as
    /// the next step's only example ([`Trainer::gradients`]).
    pub fn backward(
        &mut self,
        features: &Features,
        target: &Target,
        recycles: usize,
        exec: &Exec,
    ) -> anyhow::Result<Losses> {
        let example = Example { features, target, recycles, number: self.steps + 1 };
        let mut losses = self.gradients(&[example], exec)?;
        losses.pop().context("one example, one loss")
    }

    /// The gradients of one step's `examples` (this rank's) in the parameters' `.grad()`,
    /// averaged with the other replicas' and summed over DAP ([`Trainer::begin_step`],
    /// [`Trainer::accumulate`] on each, [`Trainer::reduce_gradients`]).
    pub fn gradients(&mut self, examples: &[Example], exec: &Exec) -> anyhow::Result<Vec<Losses>> {
        self.begin_step(examples.len())?;
        let losses = examples.iter().map(|e| self.accumulate(e, exec)).collect::<anyhow::Result<Vec<_>>>()?;
        self.reduce_gradients(exec)?;
        Ok(losses)
    }

    /// One step on `examples`, all in memory at once (see [`Trainer::finish_step`]).
    pub fn step(&mut self, examples: &[Example], exec: &Exec) -> anyhow::Result<(StepLoss, f64)> {
        self.begin_step(examples.len())?;
        for e in examples {
            self.accumulate(e, exec)?;
        }
        self.finish_step(exec)
    }

    /// Starts a step of `count` examples on this rank (every rank of the job passes as many):
    /// the gradients are zeroed, and [`Trainer::accumulate`] takes them one at a time, so that
    /// only one is in memory while it trains.
    pub fn begin_step(&mut self, count: usize) -> anyhow::Result<()> {
        anyhow::ensure!(count >= 1, "a step without examples");
        self.optimizer.zero_grad();
        self.step_terms = (count, Vec::with_capacity(count));
        Ok(())
    }

    /// Forward (the last of the example's `recycles + 1` passes with autograd), loss
    /// (backbone FAPE clamped or not as its number draws) and backward of its share of the
    /// step's mean, added to the gradients. The step's last example's backward launches the
    /// average over the replicas bucket by bucket as its gradients arrive.
    pub fn accumulate(&mut self, e: &Example, exec: &Exec) -> anyhow::Result<Losses> {
        let (count, done) = (self.step_terms.0, self.step_terms.1.len());
        anyhow::ensure!(done < count, "example {} of a step of {count}", done + 1);
        if let Some((ddp, _)) = &self.replicas {
            ddp.set_sync(done + 1 == count)?;
        }
        let pass = self.model.predict(e.features, e.recycles, Kind::Float, exec)?;
        let clamped = clamped_fape_at(self.seed, e.number, self.loss.clamped_fape_fraction);
        let losses = losses(&pass, e.features, e.recycles, e.target, &self.loss, clamped)?;
        let share = if count == 1 { losses.total.shallow_clone() } else { &losses.total / count as f64 };
        engine::autograd::backward(&[&share], &[None], false)?;
        self.step_terms.1.push(losses.terms.clone());
        Ok(losses)
    }

    /// After the step's examples: waits for the average over the replicas and sums the
    /// stacks' gradients over the DAP ranks (both sums, so their order does not matter).
    pub fn reduce_gradients(&mut self, exec: &Exec) -> anyhow::Result<()> {
        let (count, done) = (self.step_terms.0, self.step_terms.1.len());
        anyhow::ensure!(done == count, "{done} of the step's {count} examples trained");
        if let Some((ddp, _)) = &self.replicas {
            ddp.finish_gradients()?;
        }
        exec.dap().reduce_gradients(&self.stacks)?;
        Ok(())
    }

    /// Ends the step: [`Trainer::reduce_gradients`], clipping, Adam. Returns the mean of the
    /// losses over the step's examples on every replica and the gradient norm before
    /// clipping.
    pub fn finish_step(&mut self, exec: &Exec) -> anyhow::Result<(StepLoss, f64)> {
        self.reduce_gradients(exec)?;
        let norm = clip_grad_norm(self.optimizer.params(), self.clip.unwrap_or(f64::INFINITY), None)?;
        self.optimizer.step()?;
        self.steps += 1;
        let terms = std::mem::take(&mut self.step_terms.1);
        let mean = mean_over_replicas(&terms, self.replicas.as_ref().map(|(_, g)| g))?;
        Ok((mean, norm))
    }

    /// The parameters being trained.
    pub fn params(&self) -> &Params {
        &self.params
    }
}

/// Runs `args.steps` steps; rank 0 writes the log and the final parameters. Returns the log.
pub fn run(args: &TrainArgs, world: &World) -> anyhow::Result<Vec<StepLog>> {
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    let ranks = args.parallel.ranks(world)?;
    let shard = ranks.shard;
    let (device, exec, backend) = args.chunk.setup_with(&args.job.launch, world, ranks.dap.clone())?;
    kernels::install_optimizer_steps(backend);
    let params = Params::load_model(&args.params)
        .with_context(|| format!("--params {}", args.params.display()))?
        .with_kernels(backend);
    let preset = args.input.preset(&params, &args.params)?;
    let mut examples = Examples::open(args, preset, device, world, shard)?;
    let loss = args.config_preset.loss();
    let trainer = Trainer::on_ranks(&params, device, &args.optimizer, &ranks)?;
    let mut trainer = trainer.with_loss(loss, args.input.seed.seed);
    let mut log = Vec::new();
    let mut metrics = match world.rank() {
        0 => {
            std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
            Some(args.job.open_metrics::<StepLog>(&args.out, None, "fastfold-train")?)
        }
        _ => None,
    };
    for step in 1..=args.steps {
        let start = Instant::now();
        let (mut names, mut recycles, mut data_seconds) = (Vec::new(), None, None);
        trainer.begin_step(shard.accumulation as usize)?;
        // One example in memory at a time, however many the step accumulates.
        for k in 0..shard.accumulation {
            let number = shard.example(step as u64, k);
            let loaded;
            let example = match &mut examples {
                Examples::One(one) => Example { features: &one.0, target: &one.1, recycles: args.recycles, number },
                Examples::Layout { loader } => {
                    let waited = Instant::now();
                    let prepared = loader.next_example()?;
                    *data_seconds.get_or_insert(0.0) += waited.elapsed().as_secs_f64();
                    loaded = layout_example(prepared, device)?;
                    names.push(loaded.3.clone());
                    Example { features: &loaded.0, target: &loaded.1, recycles: loaded.2, number }
                }
            };
            recycles.get_or_insert(example.recycles);
            trainer.accumulate(&example, &exec)?;
        }
        let (terms, grad_norm) = trainer.finish_step(&exec)?;
        let example = (!names.is_empty()).then(|| names.join("; "));
        let recycles = recycles.unwrap_or(args.recycles);
        let seconds = start.elapsed().as_secs_f64() - data_seconds.unwrap_or(0.0);
        let peak_bytes = engine::process::peak_memory(device);
        let lr = args.optimizer.lr;
        let entry =
            StepLog { step, example, recycles, data_seconds, losses: terms, grad_norm, seconds, lr, peak_bytes };
        let l = &entry.losses;
        // Every rank holds the same mean loss (DAP gathers before the loss, the replicas
        // average it), so all stop together.
        if !l.loss.is_finite() {
            bail!("step {step}: the loss is {}; lower --lr or use --clip-grad (no parameters written)", l.loss);
        }
        if let Some(m) = metrics.as_mut() {
            m.write(&entry)?;
        }
        if world.rank() == 0 && !args.job.quiet {
            let clamp = if l.clamped { "" } else { " (unclamped)" };
            let on = entry.example.as_deref().map(|e| format!("  {e}, {recycles} recycles")).unwrap_or_default();
            println!(
                "step {step}/{}{on}  loss {:.4}  fape {:.4}{clamp}  distogram {:.4}  masked msa {:.4}  violation {:.4}  \
                 grad norm {:.3}  {:.2} s",
                args.steps, l.loss, l.fape, l.distogram, l.masked_msa, l.violation, entry.grad_norm, entry.seconds
            );
        }
        log.push(entry);
    }
    if world.rank() == 0 {
        trainer.params().save(args.out.join("params.npz"))?;
    }
    Ok(log)
}

/// Where each step's example comes from.
enum Examples {
    /// One input and its --target, every step.
    One(Box<(Features, Target)>),
    /// A data set in OpenFold's layout, each step's example prepared ahead.
    Layout { loader: ExampleLoader },
}

impl Examples {
    /// The examples `args` name: with --mmcif-dir the layout's chains that pass the filters
    /// (said on rank 0), else the one input (MSA sizes from `preset` unless given) and --target.
    fn open(
        args: &TrainArgs,
        preset: Option<crate::preset::Preset>,
        device: Device,
        world: &World,
        shard: Shard,
    ) -> anyhow::Result<Examples> {
        if let (Some(mmcif_dir), Some(alignment_dir)) = (&args.data.mmcif_dir, &args.data.alignment_dir) {
            let selection = layout::select(mmcif_dir, alignment_dir, &args.data.filters()?)?;
            if world.rank() == 0 && !args.job.quiet {
                let left: Vec<String> = selection.excluded.iter().map(|(why, n)| format!("{n} {why}")).collect();
                let left = if left.is_empty() { String::new() } else { format!(" (left out: {})", left.join(", ")) };
                println!("{} training chains in {}{left}", selection.chains.len(), alignment_dir.display());
            }
            let (input, seed) = (&args.input, args.input.seed.seed);
            let pipeline = args.data.pipeline(args.config_preset, input.max_msa_clusters, input.max_extra_msa, seed);
            // The ranks of a DAP group train the same examples: together they are one
            // data-parallel replica, their group's share of the stream.
            let loader =
                ExampleLoader::new(selection.chains, pipeline, args.steps as u64, shard, args.data.loader_workers)?;
            return Ok(Examples::Layout { loader });
        }
        let Some(target_path) = &args.target else {
            bail!("--target (or --mmcif-dir and --alignment-dir) is required")
        };
        let mut inputs = args.input.load(args.recycles, preset, device)?;
        if inputs.len() != 1 {
            bail!("training takes one query, the input has {}", inputs.len());
        }
        let (_, features) = inputs.remove(0);
        let aatype = features.aatype.get(0);
        let structure = Structure::read(target_path, args.chain)?;
        let mut target = Target::new(&structure, &aatype, &target_path.display().to_string())?;
        target.resolution = resolution(args, target_path, world)?;
        Ok(Examples::One(Box::new((features, target))))
    }
}

/// A prepared example on `device` with its target: (features, target, recycles, the chain
/// and its crop as the log names them).
pub fn layout_example(p: Prepared, device: Device) -> anyhow::Result<(Features, Target, usize, String)> {
    let features = p.features.to_device(device);
    let len = p.structure.aatype.len();
    let name = format!("{} {}-{}", p.name, p.crop_start + 1, p.crop_start + len);
    let mut target = Target::of_crop(&p.structure, &features.aatype.get(0), &name)?;
    target.resolution = p.resolution;
    Ok((features, target, p.recycles, name))
}

/// The target's resolution: `--resolution`, else its header's, else 0 (said on rank 0: the
/// confidence terms are then off).
fn resolution(args: &TrainArgs, target: &std::path::Path, world: &World) -> anyhow::Result<f64> {
    if let Some(r) = args.resolution {
        return Ok(r);
    }
    if let Some(r) = read_resolution(target)? {
        return Ok(r);
    }
    if world.rank() == 0 && !args.job.quiet {
        println!(
            "{}: no resolution in its header; pLDDT, experimentally resolved and aligned error are not trained \
             (--resolution gives one)",
            target.display()
        );
    }
    Ok(0.0)
}
