//! `fastfold predict`: sequences (FASTA, with an MSA searched for in AlphaFold's databases
//! or given as A3M) or AlphaFold's processed features to unrelaxed structures, confidence and, optionally, the raw outputs, as
//! `run_alphafold.py` lays them out: one folder per query, every model of a `--params`
//! directory in turn on the same features, ranked by confidence, with the steps' timings.
//!
//! With AlphaFold-Multimer's parameters the FASTA file's records are one complex
//! (`complex`). Every rank runs the same model; with more than one rank the Evoformer and extra-MSA stacks
//! run under dynamic axial parallelism and rank 0 writes the files; rank 0 also runs the
//! homology search, and the other ranks read the alignments it saved.
use std::path::{Path, PathBuf};
use std::time::Instant;

use std::io::Write;

use anyhow::{bail, Context};
use clap::builder::TypedValueParser;
use engine::dist::World;
use engine::job::{LaunchArgs, Precision, PrecisionArgs};
use tch::{Device, Kind, Tensor};

use crate::confidence::Confidence;
use crate::features::Features;
use crate::input::{ChunkArgs, InputArgs, Query, ReadQuery};
use crate::memory;
use crate::model::alphafold::{AlphaFold, Pass, WholeOutputs};
use crate::model::config::ModelConfig;
use crate::model::heads::{DISTOGRAM_FIRST_BREAK, DISTOGRAM_LAST_BREAK, MAX_ERROR_BIN};
use crate::model::recycling::Recycling;
use crate::model::{Exec, Params};
use crate::models::{self, ModelChoice, ModelFile};
use crate::pdb::Structure;
use crate::plots::{self, ModelConfidence};
use crate::preset::Preset;
use crate::query_folder::QueryFolder;
use crate::ranking::{Ranking, Timings};
use crate::search::{Mode, SearchArgs};

mod complex;

/// `fastfold predict`'s options.
#[derive(clap::Args, Debug, Clone)]
#[command(mut_arg("precision", |a| a.value_parser(Precision::parser(&[Precision::Fp32, Precision::Bf16]))
    .help("Arithmetic precision (bf16: the structure module's geometry stays fp32)")))]
pub struct PredictArgs {
    /// The sequences or features to predict.
    #[command(flatten)]
    pub input: InputArgs,
    /// Homology search for the FASTA records' MSAs.
    #[command(flatten)]
    pub search: SearchArgs,
    /// AlphaFold parameters: one file, `params_model_N[_ptm].npz` (the name gives the preset)
    /// or its `.safetensors` conversion, or a directory of such files (see --models).
    #[arg(long)]
    pub params: PathBuf,
    /// With a --params directory, the models to run in turn, comma-separated: numbers 1 to 5
    /// (the `_ptm` set where the directory has one; of Multimer's, every release there) or
    /// names (`model_1`, `model_3_ptm`, `model_1_multimer_v3`); default: every number the
    /// directory has.
    #[arg(long, value_delimiter = ',')]
    pub models: Option<Vec<ModelChoice>>,
    /// Output directory: one folder per query, named by its FASTA record (or features file).
    #[arg(short = 'o', long)]
    pub out: PathBuf,
    /// Recycling passes after the first, at most (default 3; with --features, all the file
    /// has; AlphaFold-Multimer's 20).
    #[arg(long = "num-recycle", visible_alias = "recycles", value_parser = engine::parse::count(0..=crate::input::MAX_RECYCLES))]
    pub recycles: Option<usize>,
    /// Stop recycling after a pass whose CA-CA distance matrix changed by less than this (RMS,
    /// Å) from the pass before, as ColabFold's flag of this name; 0 runs every pass (default 0;
    /// AlphaFold-Multimer's 0.5).
    #[arg(long, value_parser = engine::parse::non_negative)]
    pub recycle_early_stop_tolerance: Option<f64>,
    /// Structure-module iterations (default: the preset's, 8 for every AlphaFold model; the
    /// parameters cannot show it).
    #[arg(long, value_parser = engine::parse::count(1..=1000).try_map(i64::try_from))]
    pub structure_iterations: Option<i64>,
    /// Arithmetic precision.
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// Also write `<model>_outputs.npz` with the raw outputs under AlphaFold's output names.
    #[arg(long)]
    pub save_outputs: bool,
    /// Write no plots (by default each query gets ColabFold's `<name>_pae.png`,
    /// `<name>_plddt.png` and `<name>_coverage.png`).
    #[arg(long)]
    pub no_plots: bool,
    /// Device, ranks and timeout.
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Chunking.
    #[command(flatten)]
    pub chunk: ChunkArgs,
    /// AlphaFold-Multimer: its parameters (or `--model-preset multimer`) run the FASTA file's
    /// records as one complex.
    #[command(flatten)]
    pub multimer: crate::multimer::args::MultimerArgs,
}

/// One prediction's summary.
#[derive(Debug)]
pub struct Predicted {
    /// The query: the record (or features file) name, also its output folder.
    pub name: String,
    /// The model (parameter set) name.
    pub model: String,
    /// Residues.
    pub residues: i64,
    /// Mean pLDDT.
    pub mean_plddt: f64,
    /// Predicted TM-score, with the aligned-error head.
    pub ptm: Option<f64>,
    /// The interface's predicted TM-score (AlphaFold-Multimer's ipTM), for complexes.
    pub iptm: Option<f64>,
    /// Recycling passes run after the first (fewer than asked when recycling stopped early).
    pub recycles: usize,
    /// Wall-clock seconds of the model (features excluded).
    pub seconds: f64,
    /// Peak memory of the process (CPU) or the allocator (GPU) so far; with a memory plan on
    /// the CPU, the peak of the bytes libtorch allocated during this prediction.
    pub peak_bytes: Option<u64>,
    /// With a memory budget: the planned peak (parameters, features and the pass's peak).
    pub planned_bytes: Option<u64>,
}

/// One parameter set, loaded.
struct Model {
    name: String,
    preset: Option<Preset>,
    net: AlphaFold,
    /// The sizes the memory profile needs beside the stacks'.
    config: ModelConfig,
    /// Bytes of the parameters on the device.
    param_bytes: u64,
}

impl Model {
    fn load(
        args: &PredictArgs,
        file: &ModelFile,
        several: bool,
        kind: Kind,
        device: Device,
        backend: kernels::Backend,
    ) -> anyhow::Result<Model> {
        if several && args.input.preset.is_some() {
            bail!("--preset names one preset, but --params {} gives several models", args.params.display());
        }
        let loaded = Params::load_model(&file.path)?;
        let preset = args.input.preset(&loaded, &file.path)?;
        let mut sizes = preset.map(Preset::sizes).unwrap_or_default();
        if let Some(n) = args.structure_iterations {
            sizes.structure_iterations = n;
        }
        let params =
            loaded.to_kind(kind)?.to_device(device, false)?.with_kernels(backend).with_attention(args.chunk.attention);
        let net =
            AlphaFold::with_preset(&params, &sizes).with_context(|| format!("parameters {}", file.path.display()))?;
        let config = params.model_config()?;
        let param_bytes = memory::bytes_of(params.iter().map(|(_, t)| t));
        Ok(Model { name: file.name.clone(), preset, net, config, param_bytes })
    }
}

/// Runs every model on every input in turn; rank 0 writes each query's folder, replacing the
/// files of an earlier run there only once every model has run (see [`QueryFolder`]).
/// Returns the summaries, query by query, model by model.
pub fn run(args: &PredictArgs, world: &World) -> anyhow::Result<Vec<Predicted>> {
    let multimer = args.multimer.check(&args.params)?;
    let out_existed = args.out.exists();
    let result = match multimer {
        true => complex::run(args, world),
        false => Runner::new(args, world).and_then(|runner| runner.run_all()),
    };
    if result.is_err() && !out_existed {
        // An output folder made for a failed run, left empty (`remove_dir` removes only that).
        let _ = std::fs::remove_dir(&args.out);
    }
    result
}

/// The queries: with a search, rank 0 searches (saving the alignments under each query's
/// folder) while the other ranks wait, then read what it saved.
fn read_inputs(args: &PredictArgs, world: &World, device: Device) -> anyhow::Result<Vec<ReadQuery>> {
    let out = args.out.as_path();
    let mode = if world.rank() == 0 { Mode::Search } else { Mode::ReadSaved };
    if args.search.requested() {
        args.input.check_searchable()?;
    }
    let search = args.search.search(mode)?;
    let several = world.size() > 1 && search.is_some();
    if several && mode == Mode::ReadSaved {
        world.group.barrier().context("waiting for rank 0's homology search")?;
    }
    let queries = args.input.read(device, search.as_ref().map(|s| (s, out, mode)))?;
    if mode == Mode::Search && several {
        world.group.barrier().context("telling the other ranks the homology search is done")?;
    }
    Ok(queries)
}

/// What every prediction of one run shares: the checked options, the device, the execution
/// context (DAP and chunk size) and the models.
struct Runner<'a> {
    args: &'a PredictArgs,
    world: &'a World,
    device: Device,
    exec: Exec,
    kind: Kind,
    models: Vec<Model>,
}

impl<'a> Runner<'a> {
    fn new(args: &'a PredictArgs, world: &'a World) -> anyhow::Result<Self> {
        let (device, exec, backend) = args.chunk.setup(&args.launch, world)?;
        if args.chunk.gpu_mem.is_some() && device == Device::Cpu {
            // The CPU's measured peak: every allocation libtorch makes from here on, counted.
            engine::host_memory::track()?;
        }
        let kind = args.precision.precision.kind();
        let files = models::resolve(&args.params, args.models.as_deref())?;
        let models = files
            .iter()
            .map(|f| Model::load(args, f, files.len() > 1, kind, device, backend))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(Runner { args, world, device, exec, kind, models })
    }

    /// Every input in turn, every model on it; the summaries, query by query, model by model.
    fn run_all(&self) -> anyhow::Result<Vec<Predicted>> {
        let queries = read_inputs(self.args, self.world, self.device)?;
        let mut done = Vec::new();
        for q in &queries {
            self.predict_query(q, &mut done)?;
        }
        Ok(done)
    }

    /// Every model on one query, each summary pushed to `done`; rank 0 writes the query's raw
    /// features and the models' files to a staging folder, moved into the query's folder at
    /// the end (and removed on an error), with the query's own reading and search time as
    /// its `features` step.
    fn predict_query(&self, read: &ReadQuery, done: &mut Vec<Predicted>) -> anyhow::Result<()> {
        let (name, query) = (read.name.as_str(), &read.query);
        let folder = match self.world.rank() {
            0 => Some(QueryFolder::open(&self.args.out, name)?),
            _ => None,
        };
        let staging = folder.as_ref().map_or(PathBuf::new(), |f| f.staging.clone());
        if let (Some(_), Query::Raw(raw)) = (&folder, query) {
            raw.save_npz(&staging.join("features.npz"))?;
        }
        let mut timings = Timings::default();
        timings.add("features", read.seconds);
        let mut scores = Vec::new();
        let mut confidences = Vec::new();
        for model in &self.models {
            let (p, confidence) = self.predict(model, name, query, &staging, &mut timings)?;
            scores.push((p.model.clone(), p.mean_plddt));
            confidences.push((p.model.clone(), confidence));
            done.push(p);
        }
        let Some(folder) = folder else { return Ok(()) };
        let ranking = Ranking::new(&scores);
        write_ranking(&staging, &ranking, &timings)?;
        if !self.args.no_plots {
            write_plots(&staging, name, query, &ranking, &confidences)?;
        }
        folder.commit()
    }

    /// `model` on `query`: its features processed for the model's preset, the prediction, and
    /// (rank 0) its files in `dir`; the steps' times go to `timings`.
    fn predict(
        &self,
        model: &Model,
        name: &str,
        query: &Query,
        dir: &Path,
        timings: &mut Timings,
    ) -> anyhow::Result<(Predicted, Confidence)> {
        let args = self.args;
        let start = Instant::now();
        // Features processed here get the slices the recycles need; a processed file has its own.
        let processed_recycles = match query {
            Query::Raw(_) => Some(args.recycles.unwrap_or(3)),
            Query::Processed(_) => None,
        };
        let features = args.input.process(query, processed_recycles.unwrap_or(0), model.preset, self.device, name)?;
        // On a GPU the features stay on the host, each pass's slice moved over as it starts
        // (`AlphaFold::batch`): the device holds one slice, not every recycle's.
        let features = match self.device {
            Device::Cpu => features,
            _ => features.to_device(Device::Cpu),
        };
        timings.add(format!("process_features_{}", model.name), start.elapsed().as_secs_f64());
        let recycling = Recycling {
            max: self.max_recycles(&features, processed_recycles)?,
            early_stop_tolerance: args.recycle_early_stop_tolerance.unwrap_or(0.0),
        };
        let (exec, planned_bytes) = self.plan(model, name, &features)?;
        let planned = planned_bytes.is_some();
        start_peak(planned, self.device)?;
        let start = Instant::now();
        let (pass, recycles) = tch::no_grad(|| model.net.predict_recycling(&features, recycling, self.kind, &exec))
            .with_context(|| format!("predicting {name} with {}", model.name))?;
        // The model's peak, before the confidence measures and the files.
        let peak_bytes = measured_peak(planned, self.device)?;
        let seconds = start.elapsed().as_secs_f64();
        timings.add(format!("predict_and_compile_{}", model.name), seconds);
        let first = features.iteration(0)?;
        let (aatype, residue_index) = (first.aatype.squeeze_dim(0), first.residue_index.squeeze_dim(0));
        // Collectives under DAP: every rank computes its rows' measures and gathers, rank 0 writes.
        let confidence =
            Confidence::from_logits(&pass.heads.lddt, pass.heads.aligned_error.as_ref(), &pass.heads.rows)?;
        let whole = if args.save_outputs { pass.whole_on_host()? } else { None };
        if self.world.rank() == 0 {
            let outputs = ModelOutputs {
                pass: &pass,
                recycles,
                confidence: &confidence,
                iptm: None,
                ranking_confidence: confidence.mean_plddt,
                whole,
            };
            write_outputs(args, dir, &model.name, &outputs, &aatype, &residue_index)?;
        }
        let predicted = Predicted {
            residues: aatype.size()[0],
            name: name.to_string(),
            model: model.name.clone(),
            mean_plddt: confidence.mean_plddt,
            ptm: confidence.ptm,
            iptm: None,
            recycles,
            seconds,
            peak_bytes,
            planned_bytes,
        };
        Ok((predicted, confidence))
    }

    /// The execution context of `model` on `features`: with a memory budget, each chunked
    /// operation's size from the inference memory profile ([`memory::plan`]), and the planned
    /// peak (said on stderr by rank 0); otherwise the run's.
    fn plan(&self, model: &Model, name: &str, features: &Features) -> anyhow::Result<(Exec, Option<u64>)> {
        let Some(budget) = self.args.chunk.budget(self.device)? else { return Ok((self.exec.clone(), None)) };
        let on = (self.kind, self.device, self.exec.dap().size());
        let (plan, sizes) = memory::plan_prediction(&model.net, &model.config, model.param_bytes, features, on, budget)
            .map_err(|e| anyhow::anyhow!("{name} with {}: {e} (--gpu-mem)", model.name))?;
        if self.world.rank() == 0 {
            say_plan(&format!("{name} {}", model.name), budget, &sizes, &plan);
        }
        Ok((Exec::planned(self.exec.dap().clone(), plan.chunks.clone()), Some(plan.peak())))
    }

    /// The most recycles to run on `features`: `--num-recycle` (default 3) when processed here,
    /// else `--num-recycle` if the file has the slices, by default all it has.
    fn max_recycles(&self, features: &Features, processed_recycles: Option<usize>) -> anyhow::Result<usize> {
        let available = features.num_iterations().max(1) as usize;
        Ok(match (processed_recycles, self.args.recycles) {
            (Some(r), _) => r,
            (None, Some(r)) if r >= available => bail!(
                "--num-recycle {r} needs {} recycling slices of features, but --features {} has {available}",
                r + 1,
                self.args.input.features.as_deref().unwrap_or(Path::new("")).display()
            ),
            (None, r) => r.unwrap_or(available - 1),
        })
    }
}

/// Starts measuring a prediction's peak: with a memory plan on the CPU, the peak of the bytes
/// libtorch allocates (what the plan predicts; counted since `engine::host_memory::track`).
fn start_peak(planned: bool, device: Device) -> anyhow::Result<()> {
    if planned && device == Device::Cpu {
        engine::host_memory::reset_peak()?;
    }
    Ok(())
}

/// The prediction's peak since [`start_peak`]: with a plan on the CPU libtorch's bytes,
/// otherwise the device's (or the process's) peak.
fn measured_peak(planned: bool, device: Device) -> anyhow::Result<Option<u64>> {
    Ok(match (planned, device) {
        (true, Device::Cpu) => Some(engine::host_memory::stats()?.peak.max(0) as u64),
        _ => engine::process::peak_memory(device),
    })
}

/// A memory plan said on stderr: for what, the budget, the sizes, the planned peak and its
/// parts, the chunks.
fn say_plan(what: &str, budget: u64, sizes: &memory::Sizes, plan: &memory::Plan) {
    let human = |b: u64| engine::gemini::human(b as usize);
    let per_rank = match sizes.ranks {
        1 => String::new(),
        r => format!(" per rank of {r}"),
    };
    eprintln!(
        "{what}: memory plan for {}{per_rank} ({} residues, {} MSA rows, {} extra rows, {} templates): planned peak \
         {} ({} parameters and features, the pass's peak in {}); chunks: {}",
        human(budget),
        sizes.residues,
        sizes.msa_rows,
        sizes.extra_rows,
        sizes.templates,
        human(plan.peak()),
        human(plan.fixed),
        plan.pass.at,
        plan.describe()
    );
}

/// `ranked_<i>.pdb` (the models' PDBs, best first), `ranking_debug.json` and `timings.json`.
fn write_ranking(dir: &Path, ranking: &Ranking, timings: &Timings) -> anyhow::Result<()> {
    for (i, model) in ranking.order.iter().enumerate() {
        let from = dir.join(format!("{model}_unrelaxed.pdb"));
        let text = std::fs::read(&from).with_context(|| format!("reading {}", from.display()))?;
        let to = dir.join(format!("ranked_{i}.pdb"));
        data::write_atomic(&to, |w| -> anyhow::Result<()> { Ok(w.write_all(&text)?) })
            .with_context(|| format!("writing {}", to.display()))?;
    }
    ranking.write(&dir.join("ranking_debug.json"))?;
    timings.write(&dir.join("timings.json"))
}

/// ColabFold's plots of query `name` in its folder `dir` ([`crate::plots`]): the models in
/// their ranking's order, the MSA of raw features (a processed features file has no MSA to
/// show: no coverage plot). One chain: monomer models.
fn write_plots(
    dir: &Path,
    name: &str,
    query: &Query,
    ranking: &Ranking,
    confidences: &[(String, Confidence)],
) -> anyhow::Result<()> {
    let ranked: Vec<ModelConfidence> = ranking
        .order
        .iter()
        .filter_map(|m| confidences.iter().find(|(name, _)| name == m))
        .map(|(_, c)| ModelConfidence { plddt: &c.plddt, pae: c.pae.as_deref() })
        .collect();
    let residues = ranked.first().map_or(0, |m| m.plddt.len());
    let msa = match query {
        Query::Raw(raw) => Some(&raw.msa[..raw.num_alignments.min(raw.msa.len())]),
        Query::Processed(_) => None,
    };
    plots::write(dir, name, &ranked, msa, &[residues]).with_context(|| format!("plotting {name}"))?;
    Ok(())
}

/// What one model's prediction gives to write: the last pass, the recycles run and the
/// confidence measures.
pub struct ModelOutputs<'a> {
    /// The last recycling pass.
    pub pass: &'a Pass,
    /// Recycling passes run after the first.
    pub recycles: usize,
    /// pLDDT, and PAE and pTM with the aligned-error head.
    pub confidence: &'a Confidence,
    /// AlphaFold-Multimer's ipTM (complexes only).
    pub iptm: Option<f64>,
    /// What the prediction is ranked by: mean pLDDT (monomer models) or `0.8 ipTM + 0.2 pTM`.
    pub ranking_confidence: f64,
    /// The pass's pair and logits whole on the host, with `--save-outputs` (under DAP each
    /// rank's pass holds its rows: [`Pass::whole_on_host`], a collective every rank calls
    /// before rank 0 writes).
    pub whole: Option<WholeOutputs>,
}

/// `<model>_unrelaxed.pdb`, `<model>_confidence.json` and, with `--save-outputs`,
/// `<model>_outputs.npz` in the query's folder `dir`.
fn write_outputs(
    args: &PredictArgs,
    dir: &Path,
    model: &str,
    outputs: &ModelOutputs,
    aatype: &Tensor,
    residue_index: &Tensor,
) -> anyhow::Result<()> {
    let s = &outputs.pass.structure;
    let plddt = outputs.pass.heads.plddt();
    let pdb = dir.join(format!("{model}_unrelaxed.pdb"));
    Structure::from_tensors(aatype, residue_index, &s.atom37, &s.atom37_mask, &plddt)?.write(&pdb)?;
    outputs.confidence.write(&dir.join(format!("{model}_confidence.json")))?;
    if args.save_outputs {
        save_outputs(&dir.join(format!("{model}_outputs.npz")), outputs)?;
    }
    Ok(())
}

/// The raw outputs under AlphaFold's names: the result dictionary of its `RunModel.predict`
/// (as `run_alphafold.py` saves it in `result_<model>.pkl`) flattened with `/`, the
/// entries this model computes. The structure module's atoms under `structure_module/`;
/// beside the heads' logits, the confidence measures `get_confidence_metrics` adds
/// (`plddt`, `ranking_confidence`: mean pLDDT for monomer models, `0.8 ipTM + 0.2 pTM` for
/// Multimer; with the aligned-error head `aligned_confidence_probs`,
/// `predicted_aligned_error`, `max_predicted_aligned_error` and `ptm`; Multimer's `iptm`),
/// and `num_recycles`, the recycles run.
pub fn save_outputs(path: &Path, outputs: &ModelOutputs) -> anyhow::Result<()> {
    let (pass, confidence) = (outputs.pass, outputs.confidence);
    let whole = outputs.whole.as_ref().context("the outputs hold no whole pair to save")?;
    // The pair and every logit are on the host (`Pass::whole_on_host`): the file's float32
    // copies and the aligned-error probabilities are made there, not beside the pass on a GPU.
    let (pair, h) = (whole.pair.shallow_clone(), &whole.heads);
    let s = &pass.structure;
    let distogram_bins = h.distogram.size()[2];
    let edges =
        Tensor::linspace(DISTOGRAM_FIRST_BREAK, DISTOGRAM_LAST_BREAK, distogram_bins - 1, (Kind::Float, Device::Cpu));
    let mut named: Vec<(String, Tensor)> = vec![
        ("structure_module/final_atom_positions".into(), s.atom37.shallow_clone()),
        ("structure_module/final_atom_mask".into(), s.atom37_mask.shallow_clone()),
        ("plddt".into(), h.plddt()),
        ("ranking_confidence".into(), Tensor::from(outputs.ranking_confidence)),
        ("num_recycles".into(), Tensor::from(outputs.recycles as i64)),
        ("distogram/logits".into(), h.distogram.shallow_clone()),
        ("distogram/bin_edges".into(), edges),
        ("predicted_lddt/logits".into(), h.lddt.shallow_clone()),
        ("masked_msa/logits".into(), h.masked_msa.shallow_clone()),
        ("experimentally_resolved/logits".into(), h.experimentally_resolved.shallow_clone()),
        ("representations/single".into(), pass.single.shallow_clone()),
        ("representations/pair".into(), pair),
        ("representations/msa_first_row".into(), pass.recycled.msa_first_row.shallow_clone()),
        ("representations/structure_module".into(), s.single.shallow_clone()),
    ];
    if let (Some(logits), Some((pae, max))) = (&h.aligned_error, h.predicted_aligned_error()?) {
        let bins = logits.size().last().copied().unwrap_or(2);
        let breaks = Tensor::linspace(0.0, MAX_ERROR_BIN, bins - 1, (Kind::Float, Device::Cpu));
        named.push(("predicted_aligned_error/logits".into(), logits.shallow_clone()));
        named.push(("predicted_aligned_error/breaks".into(), breaks));
        let probs = logits.softmax(-1, Kind::Float);
        named.push(("aligned_confidence_probs".into(), probs));
        named.push(("predicted_aligned_error".into(), pae));
        named.push(("max_predicted_aligned_error".into(), Tensor::from(max)));
        named.push(("ptm".into(), Tensor::from(confidence.ptm.unwrap_or(f64::NAN))));
    }
    if let Some(iptm) = outputs.iptm {
        named.push(("iptm".into(), Tensor::from(iptm)));
    }
    let named: Vec<(String, Tensor)> = named
        .into_iter()
        .map(|(k, t)| {
            // On the host first: a device would hold float32 copies of the pair beside the
            // pass's outputs.
            let t = t.detach().to_device(Device::Cpu);
            let t = if t.is_floating_point() { t.to_kind(Kind::Float) } else { t };
            (k, t)
        })
        .collect();
    Ok(data::checkpoint::save_npz(&named, path)?)
}
