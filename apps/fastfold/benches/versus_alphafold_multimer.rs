//! `fastfold`'s AlphaFold-Multimer against DeepMind's (JAX, the `alphafold` package of
//! alphafold-colabfold) on the same complex features and the same random full-size
//! `params_model_1_multimer_v3` parameters, in one run, on the CPU or (`--device cuda`) a GPU:
//! seconds per prediction (`recycles + 1` passes, every one run), peak memory (resident on the
//! CPU; the card's use on a GPU, see `common`), the ratio AlphaFold / ours, and how far apart
//! the two sides' atoms are.
//!
//! `bash scripts/bench-fastfold-multimer.sh [--residues 300,300] [--msa-rows 1024]
//! [--blocks 48] [--extra-blocks 4] [--recycles 3]`.
//! A heterodimer of two distinct chains (`--residues`, one length a chain) with a synthetic
//! MSA of `--msa-rows` rows a chain (the query's residues each changed with probability 0.3,
//! a gap with 0.05, by a fixed hash; no rows paired across chains) goes through our
//! AlphaFold-Multimer pipeline (equal to DeepMind's, `tests/multimer_features.rs`) into
//! `features.npz`. `benches/alphafold_multimer_baseline.py` draws the parameters with haiku's
//! initialisers at `model_1_multimer_v3`'s sizes (with `--blocks` Evoformer and
//! `--extra-blocks` extra-MSA blocks; output layers random rather than zero), writes them, and
//! times DeepMind's v2.3 recycling from seed `--seed`, its second prediction (the first
//! compiles). Ours then runs in a fresh process on those files (so that each side's peak memory
//! is its own), the second of two predictions timed likewise, from the same seed (with
//! `--chunk-size`, ours in chunks as `fastfold predict --chunk-size` runs); with `--once` each
//! side's one prediction is timed, AlphaFold's pass compiled ahead of it. Both in fp32, v3's
//! sampling sizes (508 MSA rows, 2048 extra).
mod common;
#[path = "common/synthetic_msa.rs"]
mod synthetic_msa;

use std::ffi::OsStr;
use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Context};
use clap::Parser;
use common::{cells, AlphaFoldAtoms, Figures, OurDevice, Sides, TABLE_HEAD};
use data::a3m::Msa;
use data::fasta::FastaRecord;
use engine::parallel::dap::Dap;
use fastfold::features::RawFeatures;
use fastfold::model::multimer::{network_key, MultimerAlphaFold, MultimerInputs, MULTIMER_STRUCTURE_ITERATIONS};
use fastfold::model::recycling::Recycling;
use fastfold::model::AttentionKernel;
use fastfold::model::Exec;
use fastfold::multimer::{Complex, EntityInput, PairingMsa};
use synthetic_msa::synthetic_msa;
use tch::{Device, Kind, Tensor};

const BASELINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/alphafold_multimer_baseline.py");
const PARAMS: &str = "params_model_1_multimer_v3.npz";

#[derive(Parser)]
struct Args {
    /// Each chain's length, comma-separated (two or more distinct chains).
    #[arg(long, value_delimiter = ',', default_value = "300,300")]
    residues: Vec<usize>,
    /// Synthetic MSA rows a chain, the query's included.
    #[arg(long, default_value_t = 1024)]
    msa_rows: usize,
    /// Evoformer blocks (48 in the release).
    #[arg(long, default_value_t = 48)]
    blocks: usize,
    /// Extra-MSA blocks (4 in the release).
    #[arg(long, default_value_t = 4)]
    extra_blocks: usize,
    /// Recycling passes after the first, every one run (AlphaFold-Multimer v3's default 3).
    #[arg(long, default_value_t = 3)]
    recycles: usize,
    /// The seed of the network's key (MSA sampling and masking on each pass).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Our side's chunk size (`fastfold predict --chunk-size`; default none, every operation
    /// whole). AlphaFold's side runs its inference config's `subbatch_size` 4 either way.
    #[arg(long)]
    chunk_size: Option<i64>,
    /// Keep the features, parameters and AlphaFold's positions in this folder (default: a
    /// temporary one, removed), so that `--ours <folder>` reruns our side alone on them.
    #[arg(long)]
    keep: Option<std::path::PathBuf>,
    /// Time one prediction a side instead of the second of two, so that a full-size run with
    /// recycles takes half as long: AlphaFold's side compiles its pass ahead of the prediction
    /// (`jit(...).lower(...).compile()`, its seconds added to the first-call figure only), and
    /// ours runs once.
    #[arg(long)]
    once: bool,
    /// Our side runs every padding row through the stacks, as DeepMind's does (by default it
    /// leaves the fully-masked rows out, which changes no output).
    #[arg(long)]
    every_row: bool,
    /// With `--ours <folder>`: our side in fp32 and in float64 (the same parameters widened),
    /// each against AlphaFold's atoms and against each other. DeepMind's code runs in fp32
    /// only, so this says whether a difference between the sides is fp32's rounding: if so,
    /// ours in fp32 lies about as far from ours in float64 as from AlphaFold's.
    #[arg(long, requires = "ours")]
    float64: bool,
    #[command(flatten)]
    sides: Sides,
}

// Our side allocates as the `fastfold` binary does.
fastfold::process_allocator!();

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let (Some(dir), true) = (&args.sides.ours, args.float64) {
        return rounding(dir, &args);
    }
    if let Some(dir) = &args.sides.ours {
        let (f, diff) = ours(dir, &args, Exec::new(Dap::none(), args.chunk_size))?;
        f.print_ours(&[diff.to_string()]);
        return Ok(());
    }
    ensure!(args.residues.len() >= 2, "--residues: give two or more chain lengths");
    let temp = std::env::temp_dir().join(format!("versus-alphafold-multimer-{}", std::process::id()));
    let dir = args.keep.clone().unwrap_or(temp);
    let result = compare(&args, &dir);
    if args.keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (theirs, first, mine, diff, msa_rows) = result?;
    let lengths: Vec<String> = args.residues.iter().map(ToString::to_string).collect();
    println!(
        "model_1_multimer_v3 sizes ({} Evoformer blocks, {} extra-MSA blocks), random parameters, chains {}, \
         {} MSA rows in the features, {} passes, fp32, {}",
        args.blocks,
        args.extra_blocks,
        lengths.join("+"),
        msa_rows,
        args.recycles + 1,
        args.sides.place()
    );
    println!("\n{TABLE_HEAD}");
    println!("| {} | {} | {diff:.2e} |", lengths.join(" + "), cells(&theirs, first, &mine));
    Ok(())
}

/// A chain's sequence: residues cycling through the 20 amino acids, shifted by the chain.
fn sequence(chain: usize, n: usize) -> String {
    let letters = b"ARNDCQEGHILKMFPSTWYV";
    (0..n).map(|i| letters[(i * 7 + i / 3 + 5 * chain) % 20] as char).collect()
}

/// The complex's features from our AlphaFold-Multimer pipeline, written to `dir/features.npz`;
/// the rows of their MSA.
fn write_features(args: &Args, dir: &Path) -> anyhow::Result<i64> {
    let fasta = dir.join("complex.fasta");
    let records: Vec<FastaRecord> = args
        .residues
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            let name = ((b'A' + k as u8) as char).to_string();
            FastaRecord { description: name.clone(), name, sequence: sequence(k, n) }
        })
        .collect();
    let complex = Complex::new(&records, &fasta)?;
    let entities = complex
        .entity_representatives()
        .into_iter()
        .map(|chain| {
            let k = records.iter().position(|r| r.sequence == chain.sequence).context("a chain of no record")?;
            let msa = synthetic_msa(&chain.sequence, args.msa_rows.max(1), k);
            let raw = RawFeatures::new(&chain.sequence, Some((&msa, &fasta)))?;
            let alone = Msa::single(&chain.sequence, &chain.description);
            Ok(EntityInput { raw, pairing: Some(PairingMsa::new(&chain.sequence, &alone, &fasta)?) })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let features = fastfold::multimer::features(&complex, &entities)?;
    features.save_npz(&dir.join("features.npz"))?;
    Ok(features.get("msa").context("no msa")?.tensor().size()[0])
}

/// AlphaFold's figures (and its first, compiling, call's seconds), ours, the largest atom
/// difference and the features' MSA rows.
fn compare(args: &Args, dir: &Path) -> anyhow::Result<(Figures, f64, Figures, f64, i64)> {
    std::fs::create_dir_all(dir)?;
    let msa_rows = write_features(args, dir)?;
    let features = dir.join("features.npz");
    let sizes = [args.blocks, args.extra_blocks, args.recycles].map(|n| n.to_string());
    let seed = args.seed.to_string();
    let flags = ["--blocks", &sizes[0], "--extra-blocks", &sizes[1], "--recycles", &sizes[2], "--seed", &seed];
    let once = args.once.then_some("--once");
    let baseline: Vec<&OsStr> = ["--features".as_ref(), features.as_os_str()]
        .into_iter()
        .chain(flags.map(OsStr::new))
        .chain(once.map(OsStr::new))
        .chain(["--out".as_ref(), dir.as_os_str()])
        .collect();
    let (theirs, first) = Figures::alphafold(&args.sides, BASELINE, &baseline)?;
    let chunk = args.chunk_size.map(|c| c.to_string());
    let ours_flags: Vec<String> = flags[4..]
        .iter()
        .copied()
        .chain(chunk.iter().flat_map(|c| ["--chunk-size", c.as_str()]))
        .chain(once)
        .map(ToString::to_string)
        .collect();
    let (mine, more) = Figures::ours(dir, &args.sides, &ours_flags)?;
    let diff: f64 = more.first().context("our side printed no atom difference")?.parse()?;
    Ok((theirs, first, mine, diff, msa_rows))
}

/// Our prediction on the parameters and features in `dir`, timed on its second run (its only
/// one with `--once`), and the
/// largest difference of its atoms from AlphaFold's (`positions.npz`), over AlphaFold's mask.
fn ours(dir: &Path, args: &Args, exec: Exec) -> anyhow::Result<(Figures, f64)> {
    let on = OurDevice::start(&args.sides)?;
    let side = Side::load(dir, args, on.device, None)?;
    let mut seconds = 0.0;
    let mut atoms = None;
    for _ in 0..if args.once { 1 } else { 2 } {
        let start = Instant::now();
        atoms = Some(side.predict(args, &exec)?);
        on.synchronize()?;
        seconds = start.elapsed().as_secs_f64();
    }
    let theirs = AlphaFoldAtoms::read(dir)?;
    let diff = theirs.distance(&atoms.context("no prediction")?.to_device(Device::Cpu), None);
    Ok((Figures { seconds, peak_bytes: on.peak_bytes()? }, diff))
}

/// Our network and the features of `dir`.
struct Side {
    net: MultimerAlphaFold,
    inputs: MultimerInputs,
}

impl Side {
    /// On `device`, the parameters converted to `kind` (else as written).
    fn load(dir: &Path, args: &Args, device: Device, kind: Option<Kind>) -> anyhow::Result<Self> {
        // The kernels `fastfold predict` runs there by default (fused on a GPU).
        let kernels = (kernels::Backend::default_for(device), AttentionKernel::Logits);
        let net = MultimerAlphaFold::load_on(dir.join(PARAMS), MULTIMER_STRUCTURE_ITERATIONS, device, kind, kernels)?
            .drop_masked_rows(!args.every_row);
        let arrays: std::collections::HashMap<String, Tensor> =
            Tensor::read_npz(dir.join("features.npz"))?.into_iter().collect();
        let inputs = MultimerInputs::from_named(|n| arrays.get(n).map(|t| t.to_device(device)), "features.npz")?;
        Ok(Side { net, inputs })
    }

    /// The final atoms, every recycle run.
    fn predict(&self, args: &Args, exec: &Exec) -> anyhow::Result<Tensor> {
        let recycling = Recycling { max: args.recycles, early_stop_tolerance: 0.0 };
        let (pass, done) = tch::no_grad(|| self.net.predict(&self.inputs, recycling, network_key(args.seed), exec))?;
        ensure!(done == args.recycles, "recycling stopped after {done} of {} recycles", args.recycles);
        ensure!(bool::try_from(pass.structure.atom37.isfinite().all())?, "non-finite positions");
        Ok(pass.structure.atom37)
    }
}

/// `--ours <folder> --float64`: our atoms in fp32 and in float64, each against AlphaFold's and
/// against each other.
fn rounding(dir: &Path, args: &Args) -> anyhow::Result<()> {
    let exec = Exec::new(Dap::none(), args.chunk_size);
    let single = Side::load(dir, args, Device::Cpu, Some(Kind::Float))?.predict(args, &exec)?;
    let double = Side::load(dir, args, Device::Cpu, Some(Kind::Double))?.predict(args, &exec)?;
    let theirs = AlphaFoldAtoms::read(dir)?;
    println!("largest atom differences over AlphaFold's atom mask (Å):");
    println!("| ours fp32 - AlphaFold | ours float64 - AlphaFold | ours fp32 - ours float64 |");
    println!("|---:|---:|---:|");
    let (a, b, c) =
        (theirs.distance(&single, None), theirs.distance(&double, None), theirs.distance(&single, Some(&double)));
    println!("| {a:.2e} | {b:.2e} | {c:.2e} |");
    Ok(())
}
