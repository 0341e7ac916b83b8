//! Each rank's peak memory of one inference pass under dynamic axial parallelism, by rank
//! count: whether the per-rank peak falls as ranks are added (FastFold's users report that
//! there it does not, their issue #115). On the CPU with Gloo, every rank counting libtorch's
//! allocations (`engine::host_memory`) from the moment its recycled inputs exist, as
//! `tests/memory.rs` measures a pass; the largest rank's peak is what a device must hold. At
//! AlphaFold's widths (model_1_ptm) with two Evoformer blocks and one extra-MSA block: every
//! block's peak is the same, so the stacks' depth does not change the pass's.
//!
//! `cargo bench -p fastfold --bench dap_memory -- --residues 256 --ranks 1,2,4`
//!
//! Run without `--nproc`, it runs itself once per rank count and prints the table; each run
//! prints its largest rank's peak beside the memory profile's for a rank of that many
//! (`fastfold::memory::pass_peak` with `Sizes::ranks`).
use std::process::Command;

use clap::Parser;
use engine::dist::ReduceOp;
use engine::job::LaunchArgs;
use engine::parallel::dap::Dap;
use fastfold::memory::{self, AttentionLogits, Sizes};
use fastfold::model::alphafold::{AlphaFold, Batch};
use fastfold::model::exec::ChunkPlan;
use fastfold::model::pair_rows::PairRows;
use fastfold::model::{EvoformerConfig, Exec, ModelConfig, Params, Recycled};
use tch::{Kind, Tensor};

#[derive(Parser, Debug)]
#[command(about = "Per-rank peak memory of an inference pass under DAP, by rank count")]
struct Args {
    /// Residues.
    #[arg(long, default_value_t = 256)]
    residues: i64,
    /// MSA rows (clusters).
    #[arg(long, default_value_t = 64)]
    msa_rows: i64,
    /// Extra-MSA rows.
    #[arg(long, default_value_t = 256)]
    extra_rows: i64,
    /// Rank counts to compare, comma-separated (each must divide nothing: padding is allowed).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    ranks: Vec<usize>,
    /// Chunk size of the memory-heavy steps (default: none).
    #[arg(long)]
    chunk_size: Option<i64>,
    /// The ranks of one run (set by the run over `--ranks`).
    #[command(flatten)]
    launch: LaunchArgs,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if std::env::var_os(RUN_ENV).is_none() {
        return compare(&args);
    }
    let Some(world) = args.launch.launch_or_join()? else { return Ok(()) };
    engine::host_memory::track()?;
    tch::set_num_threads(1);
    let cfg = EvoformerConfig { num_blocks: 2, num_extra_blocks: 1, ..EvoformerConfig::default() };
    let model_cfg = ModelConfig { templates: None, ..ModelConfig::default() };
    let model = AlphaFold::new(&Params::random_model(&cfg, &model_cfg, 0)?)?;
    let (n, s, e) = (args.residues, args.msa_rows, args.extra_rows);
    let batch = Batch::random(n, s, e, Kind::Float);
    let exec = Exec::new(Dap::new(world.group.clone()), args.chunk_size);
    let before = engine::host_memory::stats()?.current;
    let prev = Recycled::zeros(&tch::no_grad(|| PairRows::for_pass(&exec, n)), &cfg, &batch.seq_mask)?;
    engine::host_memory::reset_peak()?;
    let pass = tch::no_grad(|| model.pass(&batch, prev, &exec, None))?;
    let peak = (engine::host_memory::stats()?.peak - before) as f64;
    drop(pass);
    let largest = Tensor::from_slice(&[peak]);
    world.group.all_reduce(&largest, ReduceOp::Max)?;
    if world.rank() == 0 {
        let sizes = Sizes {
            residues: n,
            msa_rows: s,
            extra_rows: e,
            elem: 4,
            templates: 0,
            logits: AttentionLogits::Blocks,
            host_apart: false,
            ranks: world.size() as i64,
        };
        let profiled = memory::pass_peak(&cfg, &model_cfg, sizes, &ChunkPlan::uniform(args.chunk_size));
        println!("{} {} {} {}", world.size(), largest.double_value(&[0]), profiled.bytes, profiled.at);
    }
    Ok(())
}

/// Set in the runs `compare` starts: run as ranks.
const RUN_ENV: &str = "FASTFOLD_DAP_MEMORY_RUN";

/// Runs this benchmark once per rank count and prints the table.
fn compare(args: &Args) -> anyhow::Result<()> {
    let exe = std::env::current_exe()?;
    println!(
        "one inference pass, AlphaFold's widths (2 Evoformer blocks, 1 extra-MSA block), {} residues, {} MSA rows, \
         {} extra rows, fp32, CPU (Gloo), chunk {}",
        args.residues,
        args.msa_rows,
        args.extra_rows,
        args.chunk_size.map_or("none".to_string(), |c| c.to_string())
    );
    println!("| ranks | largest rank's peak MiB | of one rank's | profiled MiB (at) | profiled / measured |");
    println!("|---:|---:|---:|---|---:|");
    let mut first = None;
    for &ranks in &args.ranks {
        let mut cmd = Command::new(&exe);
        cmd.env(RUN_ENV, "1").args(["--residues", &args.residues.to_string()]);
        cmd.args(["--msa-rows", &args.msa_rows.to_string(), "--extra-rows", &args.extra_rows.to_string()]);
        cmd.args(["--nproc", &ranks.to_string()]);
        if let Some(c) = args.chunk_size {
            cmd.args(["--chunk-size", &c.to_string()]);
        }
        let out = cmd.output()?;
        anyhow::ensure!(
            out.status.success(),
            "the run on {ranks} ranks failed: {}",
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
        );
        let text = String::from_utf8_lossy(&out.stdout);
        // Under the spawner rank 0's lines come prefixed with "[rank 0] ".
        let line = text.lines().last().unwrap_or("");
        let line = line.strip_prefix("[rank 0] ").unwrap_or(line);
        let fields: Vec<&str> = line.splitn(4, ' ').collect();
        let [_, peak, profiled, at] = fields[..] else {
            anyhow::bail!("the run on {ranks} ranks printed {line:?}, not its peak");
        };
        let (peak, profiled): (f64, f64) = (peak.parse()?, profiled.parse()?);
        let base = *first.get_or_insert(peak);
        let mib = |b: f64| b / (1u64 << 20) as f64;
        println!(
            "| {ranks} | {:.1} | {:.2} | {:.1} ({at}) | {:.3} |",
            mib(peak),
            peak / base,
            mib(profiled),
            profiled / peak
        );
    }
    Ok(())
}
