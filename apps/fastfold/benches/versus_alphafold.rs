//! `fastfold`'s model against DeepMind's AlphaFold (JAX, the `alphafold` package of
//! alphafold-colabfold) on the same features and the same random full-size `model_1_ptm`
//! parameters, in one run, on the CPU or (`--device cuda`) a GPU: seconds per prediction
//! (`recycles + 1` passes), peak memory (resident on the CPU; the card's use on a GPU, see
//! `common`), and the ratio AlphaFold / ours.
//!
//! `bash scripts/bench-fastfold-alphafold.sh [--residues 40,128,256] [--recycles 3] [--device cuda]`.
//! For each length, `benches/alphafold_baseline.py` makes the query's single-sequence features
//! with AlphaFold's own pipeline and `process_features` (MSA padded to 508 clusters, extra MSA
//! to 5,120 rows), draws the parameters, writes both, and times AlphaFold's second `predict`
//! (its first compiles). Ours then runs in a fresh process on those files (so that each side's
//! peak memory is its own), the second of two predictions timed likewise. Both in fp32.
//! AlphaFold computes every padded row; ours drops the fully masked ones first, which does not
//! change a number (`tests/masked_rows.rs`). The last column is the largest difference of our
//! atoms from AlphaFold's (over its atom mask): on a GPU at `--fp32-matmul ieee` (both sides'
//! strict fp32) a parity check, at the default `tf32` (each side's default there) what the
//! tensor cores' rounding moves. `--attention logits,flash` runs our side once per attention
//! (`fastfold predict --attention`), one row each, beside the same AlphaFold run.
mod common;

use std::ffi::OsStr;
use std::path::Path;
use std::time::Instant;

use anyhow::{ensure, Context};
use clap::Parser;
use common::{cells, AlphaFoldAtoms, Figures, OurDevice, Sides, TABLE_HEAD};
use fastfold::features::Features;
use fastfold::model::alphafold::AlphaFold;
use fastfold::model::{AttentionKernel, Exec, Params};
use tch::Kind;

const BASELINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/alphafold_baseline.py");

#[derive(Parser)]
struct Args {
    /// Query lengths, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "40,128")]
    residues: Vec<usize>,
    /// Recycling passes after the first (AlphaFold's default 3: 4 passes).
    #[arg(long, default_value_t = 3)]
    recycles: usize,
    /// Our side's attentions on a GPU, comma-separated: a row for each beside the same
    /// AlphaFold run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "logits")]
    attention: Vec<AttentionKernel>,
    #[command(flatten)]
    sides: Sides,
}

// Our side allocates as the `fastfold` binary does.
fastfold::process_allocator!();

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(dir) = &args.sides.ours {
        let attention = *args.attention.first().context("--attention names none")?;
        let (figures, diff) = ours(dir, args.recycles, &args.sides, attention)?;
        figures.print_ours(&[diff.to_string()]);
        return Ok(());
    }
    println!(
        "model_1_ptm full sizes, random parameters, single-sequence features processed by AlphaFold, \
         {} passes, fp32, {}",
        args.recycles + 1,
        args.sides.place()
    );
    println!("\n{TABLE_HEAD}");
    for &n in &args.residues {
        let dir = std::env::temp_dir().join(format!("versus-alphafold-{}-{n}", std::process::id()));
        let result = compare(&args, n, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        let (theirs, first, rows) = result?;
        for (attention, mine, diff) in rows {
            let label = match args.attention.len() {
                1 => n.to_string(),
                _ => format!("{n} ({attention:?})"),
            };
            println!("| {label} | {} | {diff:.2e} |", cells(&theirs, first, &mine));
        }
    }
    Ok(())
}

/// AlphaFold's figures (and its first, compiling, call's seconds), and for each of our
/// attentions our figures and the largest atom difference, for `n` residues.
type Compared = (Figures, f64, Vec<(AttentionKernel, Figures, f64)>);

fn compare(args: &Args, n: usize, dir: &Path) -> anyhow::Result<Compared> {
    let (n, recycles) = (n.to_string(), args.recycles.to_string());
    let baseline = ["--residues", &n, "--recycles", &recycles, "--out"].map(OsStr::new);
    let (theirs, first) = Figures::alphafold(&args.sides, BASELINE, &[&baseline[..], &[dir.as_os_str()]].concat())?;
    let mut rows = vec![];
    for &attention in &args.attention {
        let name = format!("{attention:?}").to_lowercase();
        let ours_args = ["--recycles".to_string(), recycles.clone(), "--attention".into(), name];
        let (mine, more) = Figures::ours(dir, &args.sides, &ours_args)?;
        let diff: f64 = more.first().context("our side printed no atom difference")?.parse()?;
        rows.push((attention, mine, diff));
    }
    Ok((theirs, first, rows))
}

/// Our prediction on the parameters and features in `dir`, timed on its second run, and the
/// largest difference of its atoms from AlphaFold's (`positions.npz`), over AlphaFold's mask.
fn ours(dir: &Path, recycles: usize, sides: &Sides, attention: AttentionKernel) -> anyhow::Result<(Figures, f64)> {
    let on = OurDevice::start(sides)?;
    // On a GPU with the fused kernels, as `fastfold predict` runs there.
    let backend = kernels::Backend::resolve(None, on.device)?;
    attention.check(backend, sides.fp32_matmul == engine::fp32_matmul::Fp32Matmul::Ieee)?;
    let params = Params::load_model(dir.join("params.npz"))?.to_device(on.device, false)?;
    let params = params.with_kernels(backend).with_attention(attention);
    let features = Features::load_npz(&dir.join("features.npz"), on.device)?;
    let model = AlphaFold::new(&params)?;
    let mut seconds = 0.0;
    let mut atoms = None;
    for _ in 0..2 {
        let start = Instant::now();
        let pass = tch::no_grad(|| model.predict(&features, recycles, Kind::Float, &Exec::serial(), None))?;
        on.synchronize()?;
        seconds = start.elapsed().as_secs_f64();
        ensure!(bool::try_from(pass.structure.atom37.isfinite().all())?, "non-finite positions");
        atoms = Some(pass.structure.atom37);
    }
    let theirs = AlphaFoldAtoms::read(dir)?;
    let diff = theirs.distance(&atoms.context("no prediction")?.to_device(tch::Device::Cpu), None);
    Ok((Figures { seconds, peak_bytes: on.peak_bytes()? }, diff))
}
