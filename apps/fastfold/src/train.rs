//! `fastfold train`: training steps of the whole network on one input and its known structure,
//! with AlphaFold's distogram loss and backbone FAPE, under dynamic axial parallelism.
//!
//! The loss is AlphaFold's two main terms with its weights: `0.5 * FAPE` over the backbone
//! frames of every structure-module iteration (clamped at 10 Å, in units of 10 Å; the other
//! half of AlphaFold's structure weight is its side-chain FAPE) plus `0.3 * distogram` (the
//! cross-entropy of the distogram against the true pseudo-beta distances). Gradients flow
//! through the last recycling pass only, as in AlphaFold.
//!
//! Under DAP every rank computes the embedders, structure module and heads on whole tensors
//! and the stacks on its block: the stacks' parameter gradients are summed over the ranks
//! ([`engine::parallel::dap::Dap::reduce_gradients`]); every other gradient is already whole
//! on every rank.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use engine::dist::World;
use engine::job::{JobArgs, OptimizerArgs};
use engine::optim::{clip_grad_norm, Optimizer, Param};
use tch::{Device, Kind, Tensor};

use crate::features::Features;
use crate::ground_truth::GroundTruth;
use crate::input::{ChunkArgs, InputArgs};
use crate::loss::heads::distogram_loss;
use crate::loss::structure::{backbone_fape, StructureLossConfig};
use crate::model::alphafold::{AlphaFold, Pass};
use crate::model::{Exec, Params, EVOFORMER, EXTRA_MSA};
use crate::pdb::Structure;
use crate::residue_constants::{RESNAMES, UNK_RESTYPE_INDEX};

/// Weight of the backbone FAPE (half of AlphaFold's structure-module weight of 1).
pub const FAPE_WEIGHT: f64 = 0.5;
/// Weight of the distogram loss (AlphaFold's `distogram.weight`).
pub const DISTOGRAM_WEIGHT: f64 = 0.3;

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
    /// The true structure (PDB) of the query.
    #[arg(long)]
    pub target: PathBuf,
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
    /// Recycling passes before the one that is trained (AlphaFold samples 0..=3).
    #[arg(long, default_value_t = 0, value_parser = engine::parse::count(0..=crate::input::MAX_RECYCLES))]
    pub recycles: usize,
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
}

impl Target {
    /// From a structure whose residue types must be the features' (`aatype` [N]).
    pub fn new(s: &Structure, aatype: &Tensor, source: &str) -> anyhow::Result<Target> {
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
        // Without them a loss term is 0 and training would go on, silently, without it.
        if truth.backbone()?.1.sum(Kind::Float).double_value(&[]) == 0.0 {
            bail!("{source}: no residue has the N, CA and C atoms that backbone FAPE needs");
        }
        if truth.pseudo_beta_mask.sum(Kind::Float).double_value(&[]) == 0.0 {
            bail!("{source}: no residue has the CB atom (CA for glycine) that the distogram loss needs");
        }
        Ok(Target { truth })
    }
}

/// The loss terms of one pass.
pub struct Losses {
    /// The weighted sum.
    pub total: Tensor,
    /// Backbone FAPE, averaged over the structure module's iterations.
    pub fape: f64,
    /// Distogram cross-entropy.
    pub distogram: f64,
}

/// The loss of `pass` against `target`, in fp32.
pub fn losses(pass: &Pass, target: &Target) -> anyhow::Result<Losses> {
    let clamped = backbone_fape(&pass.structure, &target.truth, true, &StructureLossConfig::default())?;
    let fape = clamped.mean(Kind::Float);
    let distogram = distogram_loss(
        &pass.heads.distogram.to_kind(Kind::Float),
        &target.truth.pseudo_beta,
        &target.truth.pseudo_beta_mask,
    )?;
    let total = &fape * FAPE_WEIGHT + &distogram * DISTOGRAM_WEIGHT;
    Ok(Losses { fape: fape.double_value(&[]), distogram: distogram.double_value(&[]), total })
}

/// One step's record.
#[derive(Debug, serde::Serialize)]
pub struct StepLog {
    /// 1-based step.
    pub step: usize,
    /// Weighted loss.
    pub loss: f64,
    /// Backbone FAPE.
    pub fape: f64,
    /// Distogram loss.
    pub distogram: f64,
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
    const CSV_HEADER: &'static str = "step,loss,fape,distogram,grad_norm,seconds,lr,peak_bytes";

    fn csv_row(&self) -> String {
        let s = self;
        let peak = s.peak_bytes.map(|b| b.to_string()).unwrap_or_default();
        format!(
            "{},{:.6},{:.6},{:.6},{:.6},{:.3},{:.6e},{peak}",
            s.step, s.loss, s.fape, s.distogram, s.grad_norm, s.seconds, s.lr
        )
    }

    fn step(&self) -> usize {
        self.step
    }

    fn scalars(&self) -> Vec<(&'static str, f64)> {
        let mut scalars = vec![
            ("train/loss", self.loss),
            ("train/fape", self.fape),
            ("train/distogram", self.distogram),
            ("train/grad_norm", self.grad_norm),
            ("train/step_seconds", self.seconds),
            ("train/lr", self.lr),
        ];
        scalars.extend(self.peak_bytes.map(|b| ("train/peak_memory_gib", engine::metrics::gib(b))));
        scalars
    }
}

/// A trainer over one parameter store.
pub struct Trainer {
    model: AlphaFold,
    params: Params,
    optimizer: Box<dyn Optimizer>,
    stacks: Vec<Tensor>,
    clip: Option<f64>,
}

impl Trainer {
    /// `optimizer` (AlphaFold's: Adam without weight decay, clip 0.1) over every array of
    /// `params` (moved to `device`).
    pub fn new(params: &Params, device: Device, optimizer: &OptimizerArgs) -> anyhow::Result<Trainer> {
        let params = params.to_device(device, true)?;
        let model = AlphaFold::new(&params)?;
        let is_stack = |k: &str| k.starts_with(&format!("{EVOFORMER}/")) || k.starts_with(&format!("{EXTRA_MSA}/"));
        let stacks = params.iter().filter(|(k, _)| is_stack(k)).map(|(_, t)| t.shallow_clone()).collect();
        let list = params.iter().map(|(k, t)| Param::new(k, t)).collect();
        let (clip, optimizer) = (optimizer.clip_grad, optimizer.build(list, optimizer.lr));
        Ok(Trainer { model, params, optimizer, stacks, clip })
    }

    /// The gradients of one pass on `features` and `target` in the parameters' `.grad()`:
    /// forward (the last of `recycles + 1` passes with autograd), loss, backward, and the DAP
    /// sum of the stacks' gradients.
    pub fn backward(
        &mut self,
        features: &Features,
        target: &Target,
        recycles: usize,
        exec: &Exec,
    ) -> anyhow::Result<Losses> {
        self.optimizer.zero_grad();
        let pass = self.model.predict(features, recycles, Kind::Float, exec)?;
        let losses = losses(&pass, target)?;
        engine::autograd::backward(&[&losses.total], &[None], false)?;
        exec.dap().reduce_gradients(&self.stacks)?;
        Ok(losses)
    }

    /// One step: [`Trainer::backward`], clipping, Adam. Returns the losses and the gradient
    /// norm before clipping.
    pub fn step(
        &mut self,
        features: &Features,
        target: &Target,
        recycles: usize,
        exec: &Exec,
    ) -> anyhow::Result<(Losses, f64)> {
        let losses = self.backward(features, target, recycles, exec)?;
        let norm = clip_grad_norm(self.optimizer.params(), self.clip.unwrap_or(f64::INFINITY), None)?;
        self.optimizer.step()?;
        Ok((losses, norm))
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
    let (device, exec, backend) = args.chunk.setup(&args.job.launch, world)?;
    kernels::install_optimizer_steps(backend);
    let params = Params::load_model(&args.params)
        .with_context(|| format!("--params {}", args.params.display()))?
        .with_kernels(backend);
    let preset = args.input.preset(&params, &args.params)?;
    let mut inputs = args.input.load(args.recycles, preset, device)?;
    if inputs.len() != 1 {
        bail!("training takes one query, the input has {}", inputs.len());
    }
    let (_, features) = inputs.remove(0);
    let aatype = features.aatype.get(0);
    let structure = Structure::read(&args.target, args.chain)?;
    let target = Target::new(&structure, &aatype, &args.target.display().to_string())?;
    let mut trainer = Trainer::new(&params, device, &args.optimizer)?;
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
        let (losses, grad_norm) = trainer.step(&features, &target, args.recycles, &exec)?;
        let entry = StepLog {
            step,
            loss: losses.total.double_value(&[]),
            fape: losses.fape,
            distogram: losses.distogram,
            grad_norm,
            seconds: start.elapsed().as_secs_f64(),
            lr: args.optimizer.lr,
            peak_bytes: engine::process::peak_memory(device),
        };
        // Every rank holds the same loss (DAP gathers before the loss), so all stop together.
        if !entry.loss.is_finite() {
            bail!("step {step}: the loss is {}; lower --lr or use --clip-grad (no parameters written)", entry.loss);
        }
        if let Some(m) = metrics.as_mut() {
            m.write(&entry)?;
        }
        if world.rank() == 0 && !args.job.quiet {
            println!(
                "step {step}/{}  loss {:.4}  fape {:.4}  distogram {:.4}  grad norm {:.3}  {:.2} s",
                args.steps, entry.loss, entry.fape, entry.distogram, entry.grad_norm, entry.seconds
            );
        }
        log.push(entry);
    }
    if world.rank() == 0 {
        trainer.params().save(args.out.join("params.npz"))?;
    }
    Ok(log)
}
