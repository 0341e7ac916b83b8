//! `fastfold predict`: sequences (FASTA, optional A3M alignment) or AlphaFold's processed
//! features to unrelaxed structures, confidence and, optionally, the raw outputs.
//!
//! Every rank runs the same model; with more than one rank the Evoformer and extra-MSA stacks
//! run under dynamic axial parallelism and rank 0 writes the files.
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use engine::dist::World;
use engine::job::{LaunchArgs, Precision, PrecisionArgs};
use tch::{Device, Kind, Tensor};

use crate::confidence::Confidence;
use crate::input::{ChunkArgs, InputArgs};
use crate::model::alphafold::{AlphaFold, Pass};
use crate::model::heads::{DISTOGRAM_FIRST_BREAK, DISTOGRAM_LAST_BREAK};
use crate::model::Params;
use crate::pdb::Structure;

/// `fastfold predict`'s options.
#[derive(clap::Args, Debug, Clone)]
#[command(mut_arg("precision", |a| a.value_parser(Precision::parser(&[Precision::Fp32, Precision::Bf16]))
    .help("Arithmetic precision (bf16: the structure module's geometry stays fp32)")))]
pub struct PredictArgs {
    /// The sequences or features to predict.
    #[command(flatten)]
    pub input: InputArgs,
    /// AlphaFold parameters: `params_model_N[_ptm].npz` (the name gives the preset) or its
    /// `.safetensors` conversion.
    #[arg(long)]
    pub params: PathBuf,
    /// Output directory.
    #[arg(short = 'o', long)]
    pub out: PathBuf,
    /// Recycling iterations after the first (default 3; with --features, all the file has).
    #[arg(long)]
    pub recycles: Option<usize>,
    /// Arithmetic precision.
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// Also write `<name>_outputs.npz` with the raw outputs under AlphaFold's output names.
    #[arg(long)]
    pub save_outputs: bool,
    /// Device, ranks and timeout.
    #[command(flatten)]
    pub launch: LaunchArgs,
    /// Chunking.
    #[command(flatten)]
    pub chunk: ChunkArgs,
}

/// One prediction's summary.
#[derive(Debug)]
pub struct Predicted {
    /// The record (or features file) name.
    pub name: String,
    /// Residues.
    pub residues: i64,
    /// Mean pLDDT.
    pub mean_plddt: f64,
    /// Predicted TM-score, with the aligned-error head.
    pub ptm: Option<f64>,
    /// Wall-clock seconds of the model (features excluded).
    pub seconds: f64,
    /// Peak memory of the process (CPU) or the allocator (GPU) so far.
    pub peak_bytes: Option<u64>,
}

/// Runs the prediction on every input; rank 0 writes the files. Returns the summaries.
pub fn run(args: &PredictArgs, world: &World) -> anyhow::Result<Vec<Predicted>> {
    let (device, dap) = args.chunk.setup(&args.launch, world)?;
    let kind = args.precision.precision.kind();
    let loaded = Params::load_model(&args.params)?;
    let preset = args.input.preset(&loaded, &args.params)?;
    let params = loaded.to_kind(kind)?.to_device(device, false)?;
    let model = AlphaFold::new(&params).with_context(|| format!("parameters {}", args.params.display()))?;
    let default_recycles = match &args.input.features {
        Some(_) => None,
        None => Some(args.recycles.unwrap_or(3)),
    };
    let inputs = args.input.load(default_recycles.unwrap_or(0), preset, device)?;
    if world.rank() == 0 {
        std::fs::create_dir_all(&args.out).with_context(|| format!("creating {}", args.out.display()))?;
    }
    let mut done = Vec::new();
    for (name, features) in inputs {
        let recycles = match default_recycles {
            Some(r) => r,
            None => args.recycles.unwrap_or(features.num_iterations().max(1) as usize - 1),
        };
        let start = Instant::now();
        let pass = tch::no_grad(|| model.predict(&features, recycles, kind, &dap, args.chunk.chunk_size))
            .with_context(|| format!("predicting {name}"))?;
        let seconds = start.elapsed().as_secs_f64();
        let first = features.iteration(0)?;
        let (aatype, residue_index) = (first.aatype.squeeze_dim(0), first.residue_index.squeeze_dim(0));
        let confidence = Confidence::from_logits(&pass.heads.lddt, pass.heads.aligned_error.as_ref())?;
        if world.rank() == 0 {
            write_outputs(args, &name, &pass, &aatype, &residue_index, &confidence)?;
        }
        done.push(Predicted {
            residues: aatype.size()[0],
            name,
            mean_plddt: confidence.mean_plddt,
            ptm: confidence.ptm,
            seconds,
            peak_bytes: engine::process::peak_memory(device),
        });
    }
    Ok(done)
}

/// `<name>_unrelaxed.pdb`, `<name>_confidence.json` and, with `--save-outputs`,
/// `<name>_outputs.npz`.
fn write_outputs(
    args: &PredictArgs,
    name: &str,
    pass: &Pass,
    aatype: &Tensor,
    residue_index: &Tensor,
    confidence: &Confidence,
) -> anyhow::Result<()> {
    let s = &pass.structure;
    let plddt = pass.heads.plddt();
    let pdb = args.out.join(format!("{name}_unrelaxed.pdb"));
    Structure::from_tensors(aatype, residue_index, &s.atom37, &s.atom37_mask, &plddt)?.write(&pdb)?;
    confidence.write(&args.out.join(format!("{name}_confidence.json")))?;
    if args.save_outputs {
        save_outputs(&args.out.join(format!("{name}_outputs.npz")), pass)?;
    }
    Ok(())
}

/// The raw outputs under AlphaFold's output names (its result dictionary flattened with `/`).
pub fn save_outputs(path: &Path, pass: &Pass) -> anyhow::Result<()> {
    let h = &pass.heads;
    let s = &pass.structure;
    let distogram_bins = h.distogram.size()[2];
    let edges =
        Tensor::linspace(DISTOGRAM_FIRST_BREAK, DISTOGRAM_LAST_BREAK, distogram_bins - 1, (Kind::Float, Device::Cpu));
    let mut named: Vec<(String, Tensor)> = vec![
        ("final_atom_positions".into(), s.atom37.shallow_clone()),
        ("final_atom_mask".into(), s.atom37_mask.shallow_clone()),
        ("plddt".into(), h.plddt()),
        ("distogram/logits".into(), h.distogram.shallow_clone()),
        ("distogram/bin_edges".into(), edges),
        ("predicted_lddt/logits".into(), h.lddt.shallow_clone()),
        ("masked_msa/logits".into(), h.masked_msa.shallow_clone()),
        ("experimentally_resolved/logits".into(), h.experimentally_resolved.shallow_clone()),
        ("representations/single".into(), pass.single.shallow_clone()),
        ("representations/pair".into(), pass.recycled.pair.shallow_clone()),
        ("representations/msa_first_row".into(), pass.recycled.msa_first_row.shallow_clone()),
        ("representations/structure_module".into(), s.single.shallow_clone()),
    ];
    if let (Some(logits), Some((pae, max))) = (&h.aligned_error, h.predicted_aligned_error()) {
        named.push(("predicted_aligned_error/logits".into(), logits.shallow_clone()));
        named.push(("predicted_aligned_error".into(), pae));
        named.push(("max_predicted_aligned_error".into(), Tensor::from(max)));
        named.push(("ptm".into(), Tensor::from(h.ptm().unwrap_or(f64::NAN))));
    }
    let named: Vec<(String, Tensor)> = named
        .into_iter()
        .map(|(k, t)| {
            let t = t.detach();
            let t = if t.is_floating_point() { t.to_kind(Kind::Float) } else { t };
            (k, t)
        })
        .collect();
    Ok(data::checkpoint::save_npz(&named, path)?)
}
