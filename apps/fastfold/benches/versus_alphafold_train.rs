//! `fastfold train`'s step against DeepMind's AlphaFold training step (JAX, the `alphafold`
//! package of alphafold-colabfold) on the same example, parameters and configuration, in one
//! run, on the CPU: seconds per example of the loss's gradient, peak resident memory, the
//! ratio AlphaFold / ours, and ours on 2 DAP ranks (Gloo) against 1.
//!
//! `bash scripts/bench-fastfold-train.sh [--residues 128,256] [--blocks 48] [--extra-msa 1024]
//! [--dap-residues 128]`. For each length, `benches/train_baseline.py` makes the example (a
//! synthetic 1,200-sequence MSA processed by AlphaFold's `process_features` into 128 clusters
//! and `--extra-msa` extra rows, a random true chain), draws full-width `model_3_ptm`
//! parameters, writes them, and times `jax.value_and_grad` of AlphaFold's total loss (one
//! pass from zero recycled inputs, the initial-training weights, clamped FAPE, remat, no
//! dropout), compiled ahead, its last of `--calls` calls timed. Ours then runs in a fresh
//! process on those files (each side's peak memory its own): [`Trainer::begin_step`] and
//! [`Trainer::accumulate`], the forward, loss and backward of `fastfold train`'s step (0
//! recycles, blocks checkpointed, FAPE clamped), its last of `--calls` timed, and
//! [`Trainer::finish_step`] (the DAP sum, clipping, Adam) timed apart. The DAP row runs ours
//! again as 2 ranks (`--dap-residues`), each with half the cores. All fp32.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{ensure, Context};
use clap::Parser;
use engine::job::{OptimizerArgs, OptimizerKind};
use engine::parallel::dap::Dap;
use fastfold::features::Features;
use fastfold::ground_truth::GroundTruth;
use fastfold::loss::LossConfig;
use fastfold::model::{Exec, Params};
use fastfold::train::{Example, Trainer};
use fastfold::train_target::Target;
use tch::{Device, Kind, Tensor};

const BASELINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/train_baseline.py");

#[derive(Parser)]
struct Args {
    /// Example lengths (the crop), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "128,256")]
    residues: Vec<usize>,
    /// Evoformer blocks on both sides (AlphaFold: 48).
    #[arg(long, default_value_t = 48)]
    blocks: usize,
    /// Extra-MSA rows (AlphaFold's training: 1,024).
    #[arg(long, default_value_t = 1024)]
    extra_msa: usize,
    /// Steps per side and length; the last is timed (the first warms up).
    #[arg(long, default_value_t = 2)]
    calls: usize,
    /// Lengths at which ours also runs on 2 DAP ranks (empty: none).
    #[arg(long, value_delimiter = ',', default_value = "128")]
    dap_residues: Vec<usize>,
    /// The Python with alphafold-colabfold, jax and dm-haiku.
    #[arg(long, env = "ALPHAFOLD_PYTHON", default_value = ".venv-alphafold/bin/python")]
    python: PathBuf,
    /// Internal: run our side on the files in this folder and print its figures.
    #[arg(long, hide = true)]
    ours: Option<PathBuf>,
    /// Internal: our side's ranks (DAP over all of them).
    #[arg(long, hide = true, default_value_t = 1)]
    nproc: usize,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Our figures for one length.
struct Ours {
    /// Forward, loss and backward.
    seconds: f64,
    /// The step's end after it: the DAP ranks' sum of the stacks' gradients, clipping, Adam.
    optimizer_seconds: f64,
    loss: f64,
    /// The largest over the ranks.
    peak_bytes: u64,
}

// Our side allocates as the `fastfold` binary does.
fastfold::process_allocator!();

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(dir) = &args.ours {
        return ours_in_ranks(dir, &args);
    }
    println!(
        "model_3_ptm at full widths, {} Evoformer blocks, 4 extra-MSA blocks, random parameters; 128 MSA clusters \
         and {} extra rows of a synthetic MSA; one pass, initial-training loss, blocks rematerialised; fp32, \
         CPU ({} threads)",
        args.blocks,
        args.extra_msa,
        tch::get_num_threads()
    );
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let mut dap_rows = Vec::new();
    let mut rows = Vec::new();
    for &n in &args.residues {
        let dir = std::env::temp_dir().join(format!("versus-alphafold-train-{}-{n}", std::process::id()));
        let result = compare(&args, n, &dir);
        let _ = std::fs::remove_dir_all(&dir);
        let (theirs, mine, dap) = result?;
        let row = match theirs {
            Some(theirs) => format!(
                "| {n} | {:.1} ({:.0}) | {:.1} (+{:.1}) | {:.2} | {:.0} | {:.0} | {:.4} / {:.4} |",
                theirs.seconds,
                theirs.compile_seconds,
                mine.seconds,
                mine.optimizer_seconds,
                theirs.seconds / mine.seconds,
                mib(theirs.peak_bytes),
                mib(mine.peak_bytes),
                theirs.loss,
                mine.loss
            ),
            None => format!(
                "| {n} | failed | {:.1} (+{:.1}) | - | - | {:.0} | - / {:.4} |",
                mine.seconds,
                mine.optimizer_seconds,
                mib(mine.peak_bytes),
                mine.loss
            ),
        };
        println!("{row}");
        rows.push(row);
        if let Some(two) = dap {
            let row = format!(
                "| {n} | {:.1} | {:.1} | {:.2} | {:.0} | {:.0} |",
                mine.seconds,
                two.seconds,
                mine.seconds / two.seconds,
                mib(mine.peak_bytes),
                mib(two.peak_bytes)
            );
            println!("{row}");
            dap_rows.push(row);
        }
    }
    println!("\n| residues | AlphaFold s (compile s) | ours s (+ optimizer s) | AlphaFold / ours | AlphaFold peak MiB | ours peak MiB | loss AlphaFold / ours (before any step) |");
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    rows.iter().for_each(|r| println!("{r}"));
    if !dap_rows.is_empty() {
        println!("\n| residues | ours 1 rank s | ours DAP 2 ranks s | speed-up | 1 rank peak MiB | per rank peak MiB (max) |");
        println!("|---:|---:|---:|---:|---:|---:|");
        dap_rows.iter().for_each(|r| println!("{r}"));
    }
    Ok(())
}

/// AlphaFold's figures.
struct Theirs {
    seconds: f64,
    compile_seconds: f64,
    loss: f64,
    peak_bytes: u64,
}

/// AlphaFold's figures (none when its side failed after writing the example, e.g. killed
/// for memory: said on stderr), ours, and ours on 2 ranks (at `--dap-residues`) for `n`
/// residues.
fn compare(args: &Args, n: usize, dir: &Path) -> anyhow::Result<(Option<Theirs>, Ours, Option<Ours>)> {
    let theirs = match baseline(args, n, dir) {
        Ok(theirs) => Some(theirs),
        Err(e) if dir.join("truth.npz").exists() => {
            eprintln!("AlphaFold's side failed at {n} residues, ours runs alone: {e:#}");
            None
        }
        Err(e) => return Err(e),
    };
    let mine = run_ours(args, dir, 1)?;
    let dap = match args.dap_residues.contains(&n) {
        true => Some(run_ours(args, dir, 2)?),
        false => None,
    };
    Ok((theirs, mine, dap))
}

/// AlphaFold's side at `n` residues, writing the example into `dir`.
fn baseline(args: &Args, n: usize, dir: &Path) -> anyhow::Result<Theirs> {
    let stdout = engine::baseline::run(
        Command::new(&args.python)
            .arg(BASELINE)
            .args(["--residues", &n.to_string(), "--blocks", &args.blocks.to_string()])
            .args(["--calls", &args.calls.to_string(), "--extra-msa", &args.extra_msa.to_string()])
            .arg("--out")
            .arg(dir),
        BASELINE,
    )?;
    let json = engine::baseline::last_json(&stdout, BASELINE)?;
    let number = |key: &str| engine::baseline::number(&json, key);
    Ok(Theirs {
        seconds: number("seconds")?,
        compile_seconds: number("compile_seconds")?,
        loss: number("loss")?,
        peak_bytes: number("peak_bytes")? as u64,
    })
}

/// Our side in a fresh process (spawning `nproc` ranks), its figures read from rank files.
fn run_ours(args: &Args, dir: &Path, nproc: usize) -> anyhow::Result<Ours> {
    let me = std::env::current_exe()?;
    engine::baseline::run(
        Command::new(me).arg("--ours").arg(dir).args([
            "--calls",
            &args.calls.to_string(),
            "--nproc",
            &nproc.to_string(),
        ]),
        "our side",
    )?;
    let mut figures = Vec::new();
    for rank in 0..nproc {
        let text = std::fs::read_to_string(figures_file(dir, nproc, rank))
            .with_context(|| format!("our side's rank {rank} of {nproc} wrote no figures"))?;
        let f: Vec<f64> = text.split_whitespace().map(str::parse).collect::<Result<_, _>>()?;
        ensure!(f.len() == 4, "short figures: {text}");
        figures.push(f);
    }
    let peak_bytes = figures.iter().map(|f| f[3] as u64).max().unwrap_or(0);
    let f = &figures[0];
    Ok(Ours { seconds: f[0], optimizer_seconds: f[1], loss: f[2], peak_bytes })
}

fn figures_file(dir: &Path, nproc: usize, rank: usize) -> PathBuf {
    dir.join(format!("ours-{nproc}-{rank}.txt"))
}

/// Our side: spawns the ranks when `--nproc` is above 1 (each then runs [`ours`]).
fn ours_in_ranks(dir: &Path, args: &Args) -> anyhow::Result<()> {
    let timeout = std::time::Duration::from_secs(3600);
    if engine::dist::maybe_relaunch(args.nproc, timeout)? {
        return Ok(());
    }
    let world = engine::dist::init(&engine::dist::InitOptions { timeout })?;
    let dap = match world.size() {
        1 => Dap::none(),
        _ => Dap::new(world.group.clone()),
    };
    let f = ours(dir, args.calls, dap)?;
    let line = format!("{} {} {} {}", f.seconds, f.optimizer_seconds, f.loss, f.peak_bytes);
    std::fs::write(figures_file(dir, world.size(), world.rank()), line)?;
    Ok(())
}

/// `fastfold train`'s step on the parameters, features and true structure in `dir`, the last
/// of `calls` timed.
fn ours(dir: &Path, calls: usize, dap: Dap) -> anyhow::Result<Ours> {
    let params = Params::load_model(dir.join("params.npz"))?;
    let features = Features::load_npz(&dir.join("features.npz"), Device::Cpu)?;
    let truth: std::collections::HashMap<String, Tensor> =
        data::npz::read(&dir.join("truth.npz"))?.into_iter().collect();
    let get = |k: &str| truth.get(k).with_context(|| format!("truth.npz: no {k}"));
    let aatype = features.aatype.get(0);
    let truth = GroundTruth::new(
        &aatype,
        &get("all_atom_positions")?.to_kind(Kind::Float),
        &get("all_atom_mask")?.to_kind(Kind::Float),
    )?;
    let target = Target { truth, resolution: 2.0, whole_chains: None };
    let adam = OptimizerArgs {
        optimizer: OptimizerKind::Adamw,
        lr: 1e-3,
        weight_decay: 0.0,
        clip_grad: Some(0.1),
        adam_epsilon: Some(1e-6),
    };
    let ranks = fastfold::train_parallel::Ranks { dap: dap.clone(), ..fastfold::train_parallel::Ranks::one() };
    let trainer = Trainer::on_ranks(&params, Device::Cpu, &adam, &ranks)?;
    // Backbone FAPE clamped in every example, as on AlphaFold's side; no dropout, as
    // AlphaFold's side runs at rate 0 (`fastfold train` drops unless --no-dropout).
    let loss = LossConfig { clamped_fape_fraction: 1.0, ..LossConfig::initial_training() };
    let mut trainer = trainer.with_loss(loss, 0).with_dropout(false);
    let exec = Exec::new(dap, None).with_checkpointed_blocks(true);
    let (mut seconds, mut optimizer_seconds, mut value) = (0.0, 0.0, 0.0);
    for call in 0..calls {
        let start = Instant::now();
        trainer.begin_step(1)?;
        let example = Example { features: &features, target: &target, recycles: 0, number: 1 };
        let losses = trainer.accumulate(&example, &exec)?;
        seconds = start.elapsed().as_secs_f64();
        ensure!(losses.terms.loss.is_finite(), "loss {}", losses.terms.loss);
        // The first call's: the later ones train on the parameters Adam has stepped.
        if call == 0 {
            value = losses.terms.loss;
        }
        let start = Instant::now();
        trainer.finish_step(&exec)?;
        optimizer_seconds = start.elapsed().as_secs_f64();
    }
    let peak_bytes = engine::process::peak_memory(Device::Cpu).context("no peak memory reading")?;
    Ok(Ours { seconds, optimizer_seconds, loss: value, peak_bytes })
}
