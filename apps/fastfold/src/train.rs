//! `fastfold train`: training steps of the whole network on one input and its known structure,
//! or on a data set in OpenFold's layout (`--mmcif-dir`, `--alignment-dir`: each step the next
//! chain, prepared ahead by AlphaFold's training-time pipeline, see [`crate::train_data`]),
//! with AlphaFold's whole monomer training loss ([`crate::loss::total`]) under the weights of
//! the training stage (`--config-preset`, OpenFold's names: `initial_training` or
//! `finetuning`), under dynamic axial parallelism. With AlphaFold-Multimer's parameters it
//! trains on one complex instead ([`crate::train_complex`], [`Trainer::accumulate_complex`]), or
//! on the complexes of a data set in the same layout ([`crate::train_data::complexes`]):
//! Multimer's loss after the chain permutation alignment, on the same layouts of ranks (below):
//! every rank of a DAP group crops the example and samples its MSA alike, from the seed and
//! the example's number.
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
//!
//! The optimiser recipe is AlphaFold's by default ([`TrainArgs`]); `--save-every` writes
//! checkpoints ([`crate::checkpoint`]) and `--resume` continues from the latest, on any number
//! of ranks with the same global batch, so that a resumed run repeats the uninterrupted one.
//! With `--val-mmcif-dir` and `--val-alignment-dir` it validates on held-out chains (complexes,
//! with AlphaFold-Multimer's parameters) every `--val-every` steps and after the last, with the
//! weights' moving average ([`crate::validation`], [`Trainer::evaluate`]): lDDT-Cα and the loss
//! terms in the step's log record.
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context};
use engine::dist::{ProcessGroup, World};
use engine::job::{JobArgs, OptimizerArgs, Precision, PrecisionArgs, ScheduleArgs};
use engine::optim::{clip_grad_norm, Decay, Ema, LrSchedule, MasterWeights, Optimizer, Param};
use engine::parallel::DataParallel;
use tch::{Device, Kind, Tensor};

use crate::checkpoint::{self, Saved, TrainerState};
use crate::complex_crop::CropKind;
use crate::features::Features;
use crate::input::{ChunkArgs, InputArgs};
use crate::jax_random::Key;
use crate::loss::multimer_total::MultimerLossConfig;
use crate::loss::{clamped_fape_at, total_loss, LossConfig, LossInputs, MaskedMsaTarget, StepLoss, TrainingStage};
use crate::model::alphafold::AlphaFold;
use crate::model::dropout::DropoutRates;
use crate::model::keys::MULTIMER_RELATIVE_ENCODING;
use crate::model::multimer::{
    load_multimer_params, network_key, MultimerAlphaFold, MultimerInputs, MULTIMER_STRUCTURE_ITERATIONS,
};
use crate::model::{AttentionKernel, Exec, Params, EVOFORMER, EXTRA_MSA};
use crate::multimer::args::{ModelPreset, MultimerArgs};
use crate::pdb::{read_resolution, Structure};
use crate::train_complex::{complex_losses, ComplexSource, TrainingComplex};
use crate::train_data::args::TrainDataArgs;
use crate::train_data::complexes::{select_complexes, ComplexLoader};
use crate::train_data::layout;
use crate::train_data::loader::{ExampleLoader, Shard};
use crate::train_data::transforms::sample_recycles;
use crate::train_parallel::{mean_over_replicas, ParallelArgs, Ranks};
use crate::train_target::{layout_example, Target};
pub use crate::train_target::{ComplexExample, EvalExample, Example};
use crate::validation::{ValArgs, ValResult, Validation};

/// `fastfold train`'s options. The defaults are AlphaFold's optimiser recipe (supplementary
/// section 1.11.3, OpenFold's `AlphaFoldLRScheduler`): Adam (epsilon 1e-6) at 1e-3 after a
/// linear warm-up of 1000 steps, times 0.95 every 50,000 steps after the first 50,000, the
/// gradient norm clipped to 0.1, and a moving average of the weights (decay 0.999) saved as the
/// parameters; that is `--lr 1e-3 --adam-epsilon 1e-6 --warmup 1000 --decay step --decay-every
/// 50000 --decay-factor 0.95 --decay-after 50000 --clip-grad 0.1 --ema-decay 0.999`.
#[derive(clap::Args, Debug, Clone)]
#[command(
    group(clap::ArgGroup::new("template_source").args(["data_dir", "mmcif_dir", "msas"]).multiple(true)),
    mut_arg("lr", |a| a.help("Peak learning rate (AlphaFold: 1e-3)")),
    mut_arg("warmup", |a| a.default_value("1000").help("Linear warm-up steps from 0 to --lr (AlphaFold: 1000)")),
    mut_arg("decay", |a| a.default_value("step").help("Decay after warm-up (AlphaFold: step)")),
    mut_arg("clip_grad", |a| a.default_value("0.1").help("Gradient-norm clip (AlphaFold: 0.1)")),
    mut_arg("adam_epsilon", |a| a.default_value("1e-6").help("Adam's epsilon (AlphaFold: 1e-6)")),
    mut_arg("metrics", |a| a.default_value("log.jsonl")),
    mut_arg("quiet", |a| a.help("No per-step lines")),
    mut_arg("precision", |a| a.value_parser(Precision::parser(&[Precision::Fp32, Precision::Bf16]))
        .help("Arithmetic precision (bf16: the model's weights and activations; the optimizer, the moving \
               average, the checkpoints and the saved parameters keep fp32 master weights)")),
)]
pub struct TrainArgs {
    /// The sequence (one FASTA record, optional --msa) or processed features.
    #[command(flatten)]
    pub input: InputArgs,
    /// The true structure (PDB) of the query (not with a data set, --data or --mmcif-dir).
    #[arg(long, required_unless_present = "dataset")]
    pub target: Option<PathBuf>,
    /// The chain of --target to read (default: its first chain; not for a complex, whose
    /// records are --target's chains A, B, ...).
    #[arg(long)]
    pub chain: Option<char>,
    /// A complex's saved alignments (AlphaFold-Multimer): the `msas/` folder `fastfold predict`
    /// writes for it (`<out>/<name>/msas`), one folder per entity's first chain (`A/`, `B/`, ...)
    /// with its alignments (and `uniprot_hits.sto` for distinct chains), read as
    /// `--use-precomputed-msas` reads them (default: each chain on its sequence alone). With
    /// --template-mmcif-dir each example draws templates from the hits of those folders
    /// (hmmsearch's `pdb_hits.sto`, else `.hhr` files).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["msa", "features"])]
    pub msas: Option<PathBuf>,
    /// `multimer`: train AlphaFold-Multimer on a complex, the FASTA file's records its chains
    /// `A`, `B`, ... and --target's chains of those letters its true structure (default: what
    /// --params is, by its release name, `params_model_N_multimer_v3.npz`).
    #[arg(long, value_enum)]
    pub model_preset: Option<ModelPreset>,
    /// Initial parameters (`.npz` with AlphaFold's names, or `.safetensors`).
    #[arg(long)]
    pub params: PathBuf,
    /// Output directory: `params.npz` (the weights' moving average; `params-raw.npz` the weights
    /// as trained) after the last step, and the training log.
    #[arg(short = 'o', long)]
    pub out: PathBuf,
    /// Optimizer steps (in all, counting those of a resumed run).
    #[arg(long, default_value_t = 1)]
    pub steps: usize,
    /// Write a checkpoint (`checkpoint-<step>/` under --out: the weights, the optimizer's and the
    /// average's state, the step) every this many steps and after the last; the newest is kept.
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub save_every: Option<usize>,
    /// Continue the run under --out from its latest checkpoint up to --steps, on any number of
    /// ranks with the same global batch, appending to its log.
    #[arg(long)]
    pub resume: bool,
    /// The optimizer (AlphaFold: Adam, no weight decay).
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
    /// The learning-rate schedule (AlphaFold's by default).
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Decay of the exponential moving average of the weights, updated after every step
    /// (AlphaFold: 0.999; 0: none). The saved `params.npz` holds the average, as AlphaFold's
    /// released weights do, and `params-raw.npz` the weights as trained.
    #[arg(long, default_value_t = 0.999, value_parser = engine::parse::share)]
    pub ema_decay: f64,
    /// The training stage whose loss weights apply (OpenFold's presets, supplementary Table 4):
    /// `finetuning` adds the structural violations (weight 1), experimentally resolved (0.01)
    /// and, with the aligned-error head, predicted aligned error (0.1).
    #[arg(long, value_enum, default_value_t = TrainingStage::InitialTraining)]
    pub config_preset: TrainingStage,
    /// The target's resolution in Å (default: its header's `REMARK 2`, else 0): pLDDT,
    /// experimentally resolved and aligned error train only between 0.1 and 3 Å.
    #[arg(long, value_parser = engine::parse::non_negative)]
    pub resolution: Option<f64>,
    /// Arithmetic precision.
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// Recompute each Evoformer and extra-MSA block's activations in backward instead of
    /// keeping them (AlphaFold's training does): the same gradients in much less memory, for
    /// about one more forward's compute.
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Train without dropout (AlphaFold's `deterministic`). By default the stacks drop as
    /// AlphaFold's training does (the row attention 0.15, the triangle updates 0.25), with
    /// masks drawn from the seed and each example's number; validation never drops.
    #[arg(long)]
    pub no_dropout: bool,
    /// Recycling passes before the one that is trained, for one monomer example (with a data
    /// set, and for a complex, they are drawn per example, as AlphaFold draws them: see
    /// --max-recycles).
    #[arg(long, default_value_t = 0, value_parser = engine::parse::count(0..=crate::input::MAX_RECYCLES))]
    pub recycles: usize,
    /// Training data in OpenFold's layout, in place of one input and --target.
    #[command(flatten)]
    pub data: TrainDataArgs,
    /// Periodic validation on held-out chains.
    #[command(flatten)]
    pub val: ValArgs,
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
    let t = &l.structure_terms;
    let structure = [&t.backbone_fape, &t.sidechain_fape, &t.chi_loss, &t.angle_norm_loss, &l.violation];
    let terms = StepLoss::of(&l.total, structure, clamped, &l.heads);
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
    /// The validation after this step, when one was due ([`crate::validation`]).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub val: Option<ValResult>,
}

impl engine::metrics::Record for StepLog {
    const CSV_HEADER: &'static str = "step,loss,fape,clamped,sidechain_fape,chi,angle_norm,violation,distogram,\
        masked_msa,plddt,experimentally_resolved,aligned_error,grad_norm,seconds,lr,peak_bytes,recycles,example,data_seconds,val_chains,val_lddt_ca,val_loss";

    fn csv_row(&self) -> String {
        let l = &self.losses;
        let terms = [l.sidechain_fape, l.chi, l.angle_norm, l.violation, l.distogram, l.masked_msa, l.plddt];
        let cells: Vec<String> = terms.iter().chain([&l.experimentally_resolved]).map(|x| format!("{x:.6}")).collect();
        let pae = l.aligned_error.map(|x| format!("{x:.6}")).unwrap_or_default();
        let peak = self.peak_bytes.map(|b| b.to_string()).unwrap_or_default();
        let (step, clamped) = (self.step, u8::from(l.clamped));
        format!(
            "{step},{:.6},{:.6},{clamped},{},{pae},{:.6},{:.3},{:.6e},{peak},{},{},{},{}",
            l.loss,
            l.fape,
            cells.join(","),
            self.grad_norm,
            self.seconds,
            self.lr,
            self.recycles,
            self.example.as_deref().unwrap_or(""),
            self.data_seconds.map(|s| format!("{s:.3}")).unwrap_or_default(),
            self.val
                .as_ref()
                .map(|v| format!("{},{:.6},{:.6}", v.val_chains, v.val_lddt_ca, v.val_loss))
                .unwrap_or_else(|| ",,".to_string())
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
        scalars.extend(self.val.iter().flat_map(ValResult::scalars));
        scalars
    }
}

/// The network a trainer trains, by its parameters: AlphaFold-Multimer's when they hold its
/// relative chain encoding, else the monomer's.
enum Network {
    Monomer(Box<AlphaFold>),
    Multimer(Box<MultimerAlphaFold>),
}

/// A trainer over one parameter store.
pub struct Trainer {
    model: Network,
    params: Params,
    kind: Kind,
    /// fp32 copies of `params` in a lower precision: what the optimizer and the average update.
    masters: Option<MasterWeights>,
    optimizer: Box<dyn Optimizer>,
    stacks: Vec<Tensor>,
    clip: Option<f64>,
    schedule: LrSchedule,
    ema: Option<Ema>,
    loss: LossConfig,
    /// The loss of complexes (AlphaFold-Multimer's parameters).
    multimer_loss: MultimerLossConfig,
    seed: u64,
    /// Training dropout's rates (`None`: off), drawn from the example's key
    /// ([`Trainer::with_dropout`]).
    dropout: Option<DropoutRates>,
    steps: u64,
    /// Averages the gradients over the data-parallel replicas (none for one group).
    replicas: Option<(DataParallel, ProcessGroup)>,
    /// The examples of the step under way and the loss terms of those trained so far.
    step_terms: (usize, Vec<StepLoss>),
}

/// The saved parameters under `--out`: the moving average when there is one, else the weights.
pub const PARAMS: &str = "params.npz";
/// The weights as trained under `--out`, beside the moving average in [`PARAMS`].
pub const RAW_PARAMS: &str = "params-raw.npz";

impl Trainer {
    /// `optimizer` (AlphaFold's: Adam without weight decay, clip 0.1) over every array of
    /// `params` (moved to `device`), at its learning rate throughout, with the initial-training
    /// loss and seed 0, without a moving average ([`Trainer::with_schedule`],
    /// [`Trainer::with_loss`] and [`Trainer::with_ema`] set them), in one process or one DAP
    /// group.
    pub fn new(params: &Params, device: Device, optimizer: &OptimizerArgs) -> anyhow::Result<Trainer> {
        Trainer::on_ranks(params, device, optimizer, &Ranks::one())
    }

    /// [`Trainer::new`] with the model's weights and activations in `kind`: below fp32, the
    /// optimizer (and the average) update fp32 master weights, copied into the model after each
    /// step, and the checkpoints and saved parameters hold the masters.
    pub fn new_in(params: &Params, device: Device, kind: Kind, optimizer: &OptimizerArgs) -> anyhow::Result<Trainer> {
        Trainer::on_ranks_in(params, device, kind, optimizer, &Ranks::one())
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
        Trainer::on_ranks_in(params, device, Kind::Float, optimizer, ranks)
    }

    /// [`Trainer::on_ranks`] in `kind` ([`Trainer::new_in`]): below fp32 the replicas average
    /// the model's gradients in its kind, and each copies the average into its fp32 masters (its
    /// share of them under ZeRO-1, whose step then gathers the updated masters).
    pub fn on_ranks_in(
        params: &Params,
        device: Device,
        kind: Kind,
        optimizer: &OptimizerArgs,
        ranks: &Ranks,
    ) -> anyhow::Result<Trainer> {
        let params = params.to_kind(kind)?.to_device(device, true)?;
        let model = match params.get(MULTIMER_RELATIVE_ENCODING) {
            Ok(_) => {
                Network::Multimer(Box::new(MultimerAlphaFold::from_params(&params, MULTIMER_STRUCTURE_ITERATIONS)?))
            }
            Err(_) => Network::Monomer(Box::new(AlphaFold::new(&params)?)),
        };
        let is_stack = |k: &str| k.starts_with(&format!("{EVOFORMER}/")) || k.starts_with(&format!("{EXTRA_MSA}/"));
        let stacks = params.iter().filter(|(k, _)| is_stack(k)).map(|(_, t)| t.shallow_clone()).collect();
        let list: Vec<Param> = params.iter().map(|(k, t)| Param::new(k, t)).collect();
        let replicas = ranks.gradient_sync(&list)?.zip(ranks.data.clone());
        let (masters, trained) = match kind {
            Kind::Float => (None, list),
            _ => {
                let masters = MasterWeights::new(list)?;
                let trained = masters.master();
                (Some(masters), trained)
            }
        };
        let (clip, lr) = (optimizer.clip_grad, optimizer.lr);
        let optimizer = ranks.optimizer(trained, |list| optimizer.build(list, optimizer.lr))?;
        let schedule = LrSchedule { peak: lr, floor: lr, warmup: 0, total: 1, decay: Decay::Constant };
        let loss = LossConfig::initial_training();
        Ok(Trainer {
            model,
            params,
            kind,
            masters,
            optimizer,
            stacks,
            clip,
            schedule,
            ema: None,
            loss,
            multimer_loss: MultimerLossConfig::default(),
            seed: 0,
            dropout: None,
            steps: 0,
            replicas,
            step_terms: (0, Vec::new()),
        })
    }

    /// The same trainer with the learning rate of step `s` (counted from 0) `schedule.at(s)`.
    pub fn with_schedule(self, schedule: LrSchedule) -> Trainer {
        Trainer { schedule, ..self }
    }

    /// The same trainer keeping a moving average of the weights with `decay` (0: none), from
    /// their values now, updated after every step.
    pub fn with_ema(self, decay: f64) -> anyhow::Result<Trainer> {
        let ema = (decay > 0.0).then(|| Ema::new(self.optimizer.params(), decay)).transpose()?;
        Ok(Trainer { ema, ..self })
    }

    /// The same trainer with `loss`'s weights, backbone FAPE clamped in the examples its
    /// fraction draws from `seed` (by their numbers in the run: in one process, example n in
    /// step n).
    pub fn with_loss(self, loss: LossConfig, seed: u64) -> Trainer {
        Trainer { loss, seed, ..self }
    }

    /// The same trainer with AlphaFold's training dropout on or off (off in a new trainer;
    /// `fastfold train` turns it on unless `--no-dropout`). Its masks are drawn from the key of
    /// the trainer's seed and the example's number (every pass of the training forward, as
    /// AlphaFold trains; validation never drops).
    pub fn with_dropout(self, on: bool) -> Trainer {
        Trainer { dropout: on.then_some(DropoutRates::ALPHAFOLD), ..self }
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
    /// the gradients are zeroed, the learning rate set from the schedule, and
    /// [`Trainer::accumulate`] takes them one at a time, so that only one is in memory while it
    /// trains.
    pub fn begin_step(&mut self, count: usize) -> anyhow::Result<()> {
        anyhow::ensure!(count >= 1, "a step without examples");
        self.optimizer.zero_grad();
        self.optimizer.set_lr(self.schedule.at(self.steps as usize));
        self.step_terms = (count, Vec::with_capacity(count));
        Ok(())
    }

    /// Forward (the last of the example's `recycles + 1` passes with autograd), loss
    /// (backbone FAPE clamped or not as its number draws) and backward of its share of the
    /// step's mean, added to the gradients. The step's last example's backward launches the
    /// average over the replicas bucket by bucket as its gradients arrive.
    pub fn accumulate(&mut self, e: &Example, exec: &Exec) -> anyhow::Result<Losses> {
        self.next_example()?;
        let Network::Monomer(model) = &self.model else {
            bail!("these are AlphaFold-Multimer's parameters: they train on a complex (Trainer::accumulate_complex)")
        };
        let exec = exec.clone().with_dropout(self.dropout);
        let pass = model.predict(e.features, e.recycles, self.kind, &exec, Some(self.example_key(e.number)))?;
        let clamped = clamped_fape_at(self.seed, e.number, self.loss.clamped_fape_fraction);
        let losses = losses(&pass, e.features, e.recycles, e.target, &self.loss, clamped)?;
        self.backward_share(losses)
    }

    /// [`Trainer::accumulate`] for a complex, with AlphaFold-Multimer's parameters: the
    /// training forward ([`MultimerAlphaFold::train_forward`]: the example's recycles without
    /// gradients, then the trained pass, each sampling its MSA inside the network from a key
    /// drawn from the seed and the example's number) and Multimer's loss after the chain
    /// permutation alignment ([`crate::loss::multimer_total`]).
    pub fn accumulate_complex(&mut self, e: &ComplexExample, exec: &Exec) -> anyhow::Result<Losses> {
        self.next_example()?;
        let Network::Multimer(model) = &self.model else {
            bail!("a complex trains AlphaFold-Multimer's parameters; these are a monomer model's")
        };
        let exec = exec.clone().with_dropout(self.dropout);
        let (pass, sampled) = model.train_forward(e.features, e.recycles, self.example_key(e.number), &exec)?;
        let l = complex_losses(&pass, &sampled, e.features, e.target, &self.multimer_loss)?;
        self.backward_share(Losses { total: l.total, terms: l.terms })
    }

    /// The key AlphaFold-Multimer's network samples example `number`'s MSA from: the run's key
    /// (`network_key`, as predict draws from a seed) folded with the number, so that each
    /// example samples its own rows and masks, the same on every rank and in every run. The
    /// training dropout's keys derive from it too (the monomer's as well).
    fn example_key(&self, number: u64) -> Key {
        network_key(self.seed).fold_in(number as u32)
    }

    /// [`Trainer::accumulate_complex`] on example `number` of `complex` (its crop for that
    /// number, [`TrainingComplex::cropped`], under the trainer's seed) with `recycles` passes
    /// before the trained one; returns the crop made.
    pub fn accumulate_cropped(
        &mut self,
        complex: &TrainingComplex,
        recycles: usize,
        number: u64,
        exec: &Exec,
    ) -> anyhow::Result<CropKind> {
        let seed = self.seed;
        let (_, kind) = complex.with_example(seed, recycles, number, |e| self.accumulate_complex(e, exec))?;
        Ok(kind)
    }

    /// [`Trainer::backward`] for one complex.
    pub fn backward_complex(
        &mut self,
        features: &MultimerInputs,
        target: &Target,
        recycles: usize,
        exec: &Exec,
    ) -> anyhow::Result<Losses> {
        let example = ComplexExample { features, target, recycles, number: self.steps + 1 };
        self.begin_step(1)?;
        let losses = self.accumulate_complex(&example, exec)?;
        self.reduce_gradients(exec)?;
        Ok(losses)
    }

    /// Before an example's forward: an error past the step's count; the replicas average the
    /// gradients in the step's last example's backward.
    fn next_example(&self) -> anyhow::Result<()> {
        let (count, done) = (self.step_terms.0, self.step_terms.1.len());
        anyhow::ensure!(done < count, "example {} of a step of {count}", done + 1);
        if let Some((ddp, _)) = &self.replicas {
            ddp.set_sync(done + 1 == count)?;
        }
        Ok(())
    }

    /// Backward of the example's share of the step's mean loss, its terms kept for the step's
    /// log.
    fn backward_share(&mut self, losses: Losses) -> anyhow::Result<Losses> {
        let count = self.step_terms.0;
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

    /// Ends the step: [`Trainer::reduce_gradients`], clipping, Adam at the schedule's learning
    /// rate (on the fp32 masters below fp32), the moving average's update. Returns the mean of
    /// the losses over the step's examples on every replica and the gradient norm before
    /// clipping.
    pub fn finish_step(&mut self, exec: &Exec) -> anyhow::Result<(StepLoss, f64)> {
        self.reduce_gradients(exec)?;
        if let Some(masters) = &self.masters {
            masters.gradients_to_master()?;
        }
        let norm = clip_grad_norm(self.optimizer.params(), self.clip.unwrap_or(f64::INFINITY), None)?;
        self.optimizer.step()?;
        if let Some(masters) = &self.masters {
            masters.weights_to_model()?;
        }
        if let Some(ema) = &mut self.ema {
            ema.update()?;
        }
        self.steps += 1;
        let terms = std::mem::take(&mut self.step_terms.1);
        let mean = mean_over_replicas(&terms, self.replicas.as_ref().map(|(_, g)| g))?;
        Ok((mean, norm))
    }

    /// Runs `f` with the weights that evaluation uses in the model: the moving average when one
    /// is kept (rounded into the model below fp32), the weights as trained again afterwards.
    pub fn with_evaluated_weights<T>(&self, f: impl FnOnce() -> T) -> anyhow::Result<T> {
        let Some(ema) = &self.ema else { return Ok(f()) };
        let out = ema.with_average(|| -> anyhow::Result<T> {
            if let Some(masters) = &self.masters {
                masters.weights_to_model()?;
            }
            Ok(f())
        })??;
        if let Some(masters) = &self.masters {
            masters.weights_to_model()?;
        }
        Ok(out)
    }

    /// lDDT-Cα of the last of the example's `recycles + 1` passes against its target, and the
    /// loss terms, without gradients, with the weights in the model now (see
    /// [`Trainer::with_evaluated_weights`]). A chain: the monomer's forward and loss, backbone
    /// FAPE clamped. A complex: the forward and loss that train it
    /// ([`Trainer::accumulate_complex`]: every recycle run, the MSA sampled from the key of the
    /// trainer's seed and the example's number), lDDT-Cα over all its chains against the truth
    /// as the chain permutation alignment laid it out.
    pub fn evaluate(&self, example: &EvalExample, exec: &Exec) -> anyhow::Result<(f64, StepLoss)> {
        tch::no_grad(|| match (&self.model, example) {
            // Without gradients a pass under DAP keeps the rank's rows of the pair logits: the
            // losses read them whole.
            (Network::Monomer(model), EvalExample::Chain(e)) => {
                let pass = model.predict(e.features, e.recycles, self.kind, exec, None)?.with_whole_heads()?;
                let losses = losses(&pass, e.features, e.recycles, e.target, &self.loss, true)?;
                let lddt = crate::loss::lddt_ca(&pass.structure.atom37, &e.target.truth)?.double_value(&[]);
                Ok((lddt, losses.terms))
            }
            (Network::Multimer(model), EvalExample::Complex(e)) => {
                let (pass, sampled) = model.train_forward(e.features, e.recycles, self.example_key(e.number), exec)?;
                let pass = pass.with_whole_heads()?;
                let l = complex_losses(&pass, &sampled, e.features, e.target, &self.multimer_loss)?;
                Ok((l.lddt_ca(&pass, e.target)?, l.terms))
            }
            (Network::Monomer(_), EvalExample::Complex(_)) => {
                bail!("a complex is evaluated with AlphaFold-Multimer's parameters; these are a monomer model's")
            }
            (Network::Multimer(_), EvalExample::Chain(_)) => {
                bail!("these are AlphaFold-Multimer's parameters: they evaluate complexes, not a monomer's chain")
            }
        })
    }

    /// The parameters being trained, in the model's precision.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The weights in fp32 under AlphaFold's names (the masters below fp32): what checkpoints
    /// and the saved parameters hold.
    pub fn weights(&self) -> anyhow::Result<Params> {
        let mut weights = self.params.to_kind(Kind::Float)?;
        for p in self.masters.iter().flat_map(MasterWeights::master) {
            weights.set(&p.name, p.tensor.detach())?;
        }
        Ok(weights)
    }

    /// The learning rate of the last step (before the first, the optimizer's).
    pub fn lr(&self) -> f64 {
        self.optimizer.lr()
    }

    /// The moving average of the weights, if one is kept.
    pub fn ema(&self) -> Option<&Ema> {
        self.ema.as_ref()
    }

    /// Steps taken (a resumed trainer counts the checkpoint's).
    pub fn steps(&self) -> usize {
        self.steps as usize
    }

    /// This rank's optimizer state (its shard under ZeRO-1), for a checkpoint.
    pub fn optimizer_state(&self) -> Vec<(String, Tensor)> {
        self.optimizer.state()
    }

    /// The moving average's state (the same on every rank), for a checkpoint.
    pub fn ema_state(&self) -> Vec<(String, Tensor)> {
        self.ema.iter().flat_map(Ema::state).collect()
    }

    /// Continues from `saved`: its weights, the optimizer's and the average's state, its step.
    pub fn resume(&mut self, saved: &Saved) -> anyhow::Result<()> {
        // Into the masters below fp32 (the model then gets them rounded), else the weights.
        let weights: Vec<(String, Tensor)> = match &self.masters {
            Some(masters) => masters.master().into_iter().map(|p| (p.name, p.tensor)).collect(),
            None => self.params.iter().map(|(k, t)| (k.to_string(), t.shallow_clone())).collect(),
        };
        saved.load_weights(&weights)?;
        if let Some(masters) = &self.masters {
            masters.weights_to_model()?;
        }
        let mut state = saved.read_state()?;
        let file = || format!("the state files of {}", saved.dir.display());
        self.optimizer.load_state(&mut state).with_context(file)?;
        if let Some(ema) = &mut self.ema {
            ema.load_state(&mut state).with_context(file)?;
        }
        self.steps = saved.state.step as u64;
        Ok(())
    }

    /// Writes the parameters under AlphaFold's names to `out`: [`PARAMS`] holds the moving
    /// average when one is kept (what evaluation and `predict` use, as for AlphaFold's released
    /// weights), and then [`RAW_PARAMS`] the weights as trained; else [`PARAMS`] the weights.
    pub fn save(&self, out: &Path) -> anyhow::Result<()> {
        match &self.ema {
            Some(ema) => {
                ema.with_average(|| -> anyhow::Result<()> { Ok(self.weights()?.save(out.join(PARAMS))?) })??;
                self.weights()?.save(out.join(RAW_PARAMS))?;
            }
            None => self.weights()?.save(out.join(PARAMS))?,
        }
        Ok(())
    }
}

/// Runs `args.steps` steps; rank 0 writes the log and the final parameters. Returns the log.
pub fn run(args: &TrainArgs, world: &World) -> anyhow::Result<Vec<StepLog>> {
    if args.steps == 0 {
        bail!("--steps must be at least 1");
    }
    if args.ema_decay == 1.0 {
        bail!("--ema-decay 1 would keep the initial weights as the average: use one below 1 (0: none)");
    }
    if args.chunk.attention == AttentionKernel::Flash {
        bail!("--attention flash is for predictions: training makes each attention's logits whole (its backward reads them)");
    }
    let ranks = args.parallel.ranks(world)?;
    let shard = ranks.shard;
    let (device, exec, backend) = args.chunk.setup_with(&args.job.launch, world, ranks.dap.clone())?;
    if args.chunk.gpu_mem.is_some() && device == Device::Cpu {
        // On a GPU it caps the process; training plans no chunks from it (the inference
        // profile is not a training step's), so on the CPU it would change nothing.
        bail!(
            "--gpu-mem caps a GPU's memory, and this run is on the CPU: give --chunk-size to bound training's memory"
        );
    }
    let exec = exec.with_checkpointed_blocks(args.gradient_checkpointing);
    kernels::install_optimizer_steps(backend);
    let multimer = MultimerArgs { model_preset: args.model_preset, ..Default::default() }.check(&args.params)?;
    if multimer {
        check_complex_args(args, world)?;
    }
    let params = match multimer {
        true => load_multimer_params(&args.params),
        false => Params::load_model(&args.params),
    }
    .map(|p| p.with_kernels(backend))
    .with_context(|| format!("--params {}", args.params.display()))?;
    let preset = match multimer {
        true => None,
        false => args.input.preset(&params, &args.params)?,
    };
    let (loss, kind) = (args.config_preset.loss(), args.precision.precision.kind());
    let schedule = args.schedule.schedule(args.optimizer.lr, args.steps)?;
    let trainer = Trainer::on_ranks_in(&params, device, kind, &args.optimizer, &ranks)?;
    let trainer = trainer.with_schedule(schedule).with_loss(loss, args.input.seed.seed);
    let mut trainer = trainer.with_ema(args.ema_decay)?.with_dropout(!args.no_dropout);
    match args.resume {
        true => resume(args, world, &ranks, &mut trainer)?,
        false => note_fresh_start(args, world),
    }
    let first = trainer.steps() + 1;
    let (input, seed) = (&args.input, args.input.seed.seed);
    let pipeline = args.data.pipeline(args.config_preset, input.max_msa_clusters, input.max_extra_msa, seed)?;
    let validation = match multimer {
        true => Validation::open_complexes(&args.val, &args.data, seed, device)?,
        false => Validation::open(&args.val, &args.data, &pipeline, device)?,
    };
    if let (0, Some(v), false) = (world.rank(), &validation, args.job.quiet) {
        println!("{} validation {}, {} recycles", v.len(), v.what(), args.val.val_recycles);
    }
    let mut examples = match multimer {
        true => Examples::complex(args, device, world, shard, first as u64)?,
        false => Examples::open(args, preset, device, world, shard, first as u64)?,
    };
    let mut log = Vec::new();
    let mut metrics = match world.rank() {
        0 => {
            std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
            let resumed = args.resume.then_some(first - 1);
            Some(args.job.open_metrics::<StepLog>(&args.out, resumed, "fastfold-train")?)
        }
        _ => None,
    };
    for step in first..=args.steps {
        let start = Instant::now();
        let (mut names, mut recycles, mut data_seconds) = (Vec::new(), None, None);
        trainer.begin_step(shard.accumulation as usize)?;
        // One example in memory at a time, however many the step accumulates.
        for k in 0..shard.accumulation {
            let number = shard.example(step as u64, k);
            let loaded;
            let example = match &mut examples {
                // One complex draws each example's recycles as a data set's complexes do
                // (`ComplexLoader`): from the seed and the number, the same on every rank.
                Examples::Complex(c) => {
                    let drawn = sample_recycles(seed, number, args.data.max_recycles);
                    recycles.get_or_insert(drawn);
                    trainer.accumulate_cropped(c, drawn, number, &exec)?;
                    continue;
                }
                Examples::ComplexDrawingTemplates(source, resolution) => {
                    let drawn = sample_recycles(seed, number, args.data.max_recycles);
                    recycles.get_or_insert(drawn);
                    let c = source.training(*resolution, args.data.crop_size, (seed, number), device)?;
                    trainer.accumulate_cropped(&c, drawn, number, &exec)?;
                    continue;
                }
                Examples::Complexes { loader } => {
                    let waited = Instant::now();
                    let loaded = loader.next_complex()?;
                    *data_seconds.get_or_insert(0.0) += waited.elapsed().as_secs_f64();
                    let c = loaded.training(args.data.crop_size, device)?;
                    recycles.get_or_insert(loaded.recycles);
                    let crop = trainer.accumulate_cropped(&c, loaded.recycles, number, &exec)?;
                    names.push(match crop {
                        CropKind::Whole => loaded.name,
                        kind => format!("{}, {} crop", loaded.name, format!("{kind:?}").to_lowercase()),
                    });
                    continue;
                }
                Examples::One(one) => Example { features: &one.0, target: &one.1, recycles: args.recycles, number },
                Examples::Layout { loader } => {
                    let waited = Instant::now();
                    let prepared = loader.next_example()?;
                    *data_seconds.get_or_insert(0.0) += waited.elapsed().as_secs_f64();
                    loaded = layout_example(&prepared, device)?;
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
        let lr = trainer.lr();
        // Every rank validates, so that the model's collectives meet: see crate::validation.
        let val = match &validation {
            Some(v) if v.due(step, args.steps) => {
                Some(trainer.with_evaluated_weights(|| v.run(|e| trainer.evaluate(e, &exec)))??)
            }
            _ => None,
        };
        let losses = terms;
        let entry = StepLog { step, example, recycles, data_seconds, losses, grad_norm, seconds, lr, peak_bytes, val };
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
            if let (Some(v), Some(set)) = (&entry.val, &validation) {
                println!(
                    "validation after step {step}: {} {}  lDDT-Ca {:.4}  loss {:.4}  fape {:.4}  distogram {:.4}",
                    v.val_chains,
                    set.what(),
                    v.val_lddt_ca,
                    v.val_loss,
                    v.val_fape,
                    v.val_distogram
                );
            }
        }
        log.push(entry);
        if args.save_every.is_some_and(|every| step % every == 0 || step == args.steps) {
            let save = |path: &Path| Ok(trainer.weights()?.save(path)?);
            // Under ZeRO-1 every rank writes its shard of the optimizer's state; else rank 0 all.
            let mut state = match ranks.zero > 0 || world.rank() == 0 {
                true => trainer.optimizer_state(),
                false => vec![],
            };
            if world.rank() == 0 {
                state.extend(trainer.ema_state());
            }
            checkpoint::save(&args.out, world, &trainer_state(args, &ranks, step), save, &state)?;
        }
    }
    if world.rank() == 0 {
        trainer.save(&args.out)?;
    }
    Ok(log)
}

/// Says (on rank 0) when a fresh run writes where a run was checkpointed: its first checkpoint
/// replaces that one.
fn note_fresh_start(args: &TrainArgs, world: &World) {
    if let (0, Ok(Some(dir))) = (world.rank(), data::checkpoint_folders::latest(&args.out)) {
        eprintln!("note: {} holds a checkpoint; this run starts afresh (--resume continues it)", dir.display());
    }
}

/// What a checkpoint of step `step` records of the run.
fn trainer_state(args: &TrainArgs, ranks: &Ranks, step: usize) -> TrainerState {
    let shard = ranks.shard;
    TrainerState {
        step,
        seed: args.input.seed.seed,
        optimizer: args.optimizer.optimizer.name().to_string(),
        ema_decay: args.ema_decay,
        global_batch: (shard.replicas * shard.accumulation) as usize,
    }
}

/// Continues `trainer` from the latest checkpoint under `--out` (said on rank 0); one made
/// with another seed, optimizer, average or global batch, or past `--steps`, is an error
/// naming it.
fn resume(args: &TrainArgs, world: &World, ranks: &Ranks, trainer: &mut Trainer) -> anyhow::Result<()> {
    let saved = checkpoint::latest(&args.out)?;
    saved.state.check_matches(&trainer_state(args, ranks, saved.state.step))?;
    if saved.state.step > args.steps {
        bail!("{} is at step {}, past --steps {}", saved.dir.display(), saved.state.step, args.steps);
    }
    trainer.resume(&saved)?;
    if world.rank() == 0 && !args.job.quiet {
        println!("resuming from {} (step {})", saved.dir.display(), saved.state.step);
    }
    Ok(())
}

/// Where each step's example comes from.
enum Examples {
    /// One input and its --target, every step.
    One(Box<(Features, Target)>),
    /// A data set in OpenFold's layout, each step's example prepared ahead.
    Layout { loader: ExampleLoader },
    /// A complex (the FASTA file's records) and its --target, every step (cropped per example
    /// with --crop-size).
    Complex(Box<TrainingComplex>),
    /// The same drawing its templates per example (--template-mmcif-dir): each example's
    /// features made anew from the complex read once, at the target's resolution.
    ComplexDrawingTemplates(Box<ComplexSource>, f64),
    /// A data set of complexes in OpenFold's layout, each step's complexes read ahead (and
    /// cropped per example with --crop-size).
    Complexes { loader: ComplexLoader },
}

impl Examples {
    /// The complexes of the data set (--data, or --mmcif-dir and --alignment-dir; said on rank
    /// 0), this replica's examples from step `first` read ahead ([`ComplexLoader`]), else the
    /// complex of the FASTA file's records and --target's chains (see
    /// [`TrainingComplex::read`]), with --template-mmcif-dir drawing each example's templates
    /// from the hits of its --msas folders ([`ComplexSource::with_templates`]; said on rank 0).
    /// --crop-size crops each example (the whole complex trains without it). Template flags
    /// that would do nothing here are refused by name.
    fn complex(args: &TrainArgs, device: Device, world: &World, shard: Shard, first: u64) -> anyhow::Result<Examples> {
        if let Some(files) = args.data.files()? {
            let selection = select_complexes(&files.mmcif_dir, &files.alignment_dir, &args.data.filters()?)?;
            say_selection(args, world, selection.chains.len(), "complexes", &selection.excluded, &files.alignment_dir);
            let (draws, span) = ((args.input.seed.seed, args.data.max_recycles), (first, args.steps as u64));
            let (sampling, workers) = (args.data.chain_sampling, args.data.loader_workers);
            let templates = args.data.template_sampling()?;
            let loader = ComplexLoader::from_step(selection.chains, sampling, templates, draws, span, shard, workers)?;
            return Ok(Examples::Complexes { loader });
        }
        let (Some(fasta), Some(target_path)) = (&args.input.fasta, &args.target) else {
            bail!("training AlphaFold-Multimer takes a FASTA file of the complex's chains and its --target structure")
        };
        let resolution = resolution(args, target_path, world)?;
        let (msas, crop) = (args.msas.as_deref(), args.data.crop_size);
        let d = &args.data;
        match (d.one_complex_template_sampling()?, msas) {
            (Some(sampling), Some(msas)) => {
                let source = ComplexSource::read(fasta, Some(msas), target_path)?.with_templates(sampling, msas)?;
                if world.rank() == 0 && !args.job.quiet {
                    let files: Vec<String> = source
                        .template_files()
                        .iter()
                        .map(|(id, f)| format!("chain {id}: {} hit files", f.len()))
                        .collect();
                    println!("templates drawn per example from the hits of --msas ({})", files.join(", "));
                }
                Ok(Examples::ComplexDrawingTemplates(Box::new(source), resolution))
            }
            (Some(_), None) => bail!(
                "--template-mmcif-dir: one complex's template hits are read from its saved alignments' folders; \
                 give --msas (or --max-templates 0)"
            ),
            (None, _) => {
                let ignored = [
                    ("--max-template-date", d.max_template_date.is_some()),
                    ("--obsolete-pdbs-path", d.obsolete_pdbs_path.is_some()),
                    ("--kalign-binary-path", d.kalign_binary_path.is_some()),
                ];
                if let Some((flag, _)) = ignored.iter().find(|(_, given)| *given) {
                    bail!("{flag}: one complex draws no templates without --template-mmcif-dir (and --max-templates above 0)")
                }
                let complex = TrainingComplex::read(fasta, msas, target_path, resolution, crop, device)?;
                Ok(Examples::Complex(Box::new(complex)))
            }
        }
    }

    /// The examples `args` name from step `first` on: with --mmcif-dir the layout's chains that
    /// pass the filters (said on rank 0), else the one input (MSA sizes from `preset` unless
    /// given) and --target.
    fn open(
        args: &TrainArgs,
        preset: Option<crate::preset::Preset>,
        device: Device,
        world: &World,
        shard: Shard,
        first: u64,
    ) -> anyhow::Result<Examples> {
        if let Some(files) = args.data.files()? {
            let (mmcif_dir, alignment_dir) = (&files.mmcif_dir, &files.alignment_dir);
            let selection = layout::select(mmcif_dir, alignment_dir, &args.data.filters()?)?;
            say_selection(args, world, selection.chains.len(), "chains", &selection.excluded, alignment_dir);
            let (input, seed) = (&args.input, args.input.seed.seed);
            let pipeline = args.data.pipeline(args.config_preset, input.max_msa_clusters, input.max_extra_msa, seed)?;
            // The ranks of a DAP group train the same examples: together they are one
            // data-parallel replica, their group's share of the stream.
            let (steps, workers) = (args.steps as u64, args.data.loader_workers);
            let sampling = args.data.chain_sampling;
            let loader = ExampleLoader::from_step(selection.chains, pipeline, sampling, first, steps, shard, workers)?;
            return Ok(Examples::Layout { loader });
        }
        if let Some(msas) = &args.msas {
            bail!(
                "--msas {}: a complex's alignments, for AlphaFold-Multimer's parameters (a monomer takes --msa)",
                msas.display()
            )
        }
        let Some(target_path) = &args.target else {
            bail!("--target (or a data set: --data, or --mmcif-dir and --alignment-dir) is required")
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

/// Says on rank 0 how many training `what` (chains, complexes) of `alignment_dir` train and
/// how many each filter left out.
fn say_selection(
    args: &TrainArgs,
    world: &World,
    count: usize,
    what: &str,
    excluded: &[(String, usize)],
    alignment_dir: &Path,
) {
    if world.rank() == 0 && !args.job.quiet {
        let left: Vec<String> = excluded.iter().map(|(why, n)| format!("{n} {why}")).collect();
        let left = if left.is_empty() { String::new() } else { format!(" (left out: {})", left.join(", ")) };
        println!("{count} training {what} in {}{left}", alignment_dir.display());
    }
}

/// What training a complex does not support yet, refused by flag (rather than ignored). Said
/// on rank 0: the loss weights are AlphaFold-Multimer's whatever `--config-preset` says.
fn check_complex_args(args: &TrainArgs, world: &World) -> anyhow::Result<()> {
    let not_yet =
        |flag: &str, what: &str| anyhow::anyhow!("{flag}: {what} is not supported yet for AlphaFold-Multimer");
    let given = [
        ("--msa", args.input.msa.is_some(), "one MSA (a complex takes its chains' alignments with --msas)"),
        ("--features", args.input.features.is_some(), "processed features (give the FASTA file)"),
        ("--preset", args.input.preset.is_some(), "a monomer preset"),
        ("--max-msa-clusters", args.input.max_msa_clusters.is_some(), "another MSA sample size (v2.3's: 508)"),
        ("--max-extra-msa", args.input.max_extra_msa.is_some(), "another extra-MSA size (v2.3's: 2048)"),
        ("--chain", args.chain.is_some(), "one chain of --target (a complex reads chains A, B, ...)"),
    ];
    if let Some((flag, _, what)) = given.iter().find(|(_, g, _)| *g) {
        return Err(not_yet(flag, what));
    }
    if args.recycles > 0 {
        bail!(
            "--recycles {}: a complex draws each example's recycles from 0 to --max-recycles (as a data set \
             does); give --max-recycles N (0: none)",
            args.recycles
        );
    }
    if world.rank() == 0 && !args.job.quiet {
        println!(
            "a complex trains with AlphaFold-Multimer's loss weights (its config's), whatever --config-preset says"
        );
    }
    Ok(())
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
