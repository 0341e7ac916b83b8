//! `fastfold`: AlphaFold 2 structure prediction with dynamic axial parallelism.
use std::path::PathBuf;

use clap::Parser;
use fastfold::predict::{self, PredictArgs};
use fastfold::train::{self, TrainArgs};

#[derive(Parser)]
#[command(version, about = "AlphaFold 2 structure prediction with dynamic axial parallelism")]
enum Cli {
    /// Predict structures with one or several models: unrelaxed PDBs, confidence JSON, the
    /// ranking and timings, optionally the raw outputs.
    Predict(Box<PredictArgs>),
    /// Train on one query and its known structure (AlphaFold's whole training loss, Adam).
    Train(Box<TrainArgs>),
    /// Convert AlphaFold parameters between .npz and .safetensors (by the file extensions).
    Convert {
        /// The parameter file to read.
        input: PathBuf,
        /// The file to write.
        output: PathBuf,
    },
    /// Print libtorch's version, CUDA devices, threads and the launcher's view of the job.
    Env,
}

fastfold::process_allocator!();

fn main() -> std::process::ExitCode {
    engine::failure::exit_code(run())
}

fn run() -> anyhow::Result<()> {
    data::temporaries::remove_on_interrupt();
    match Cli::parse() {
        Cli::Predict(args) => {
            let Some(world) = args.launch.launch_or_join()? else { return Ok(()) };
            for p in predict::run(&args, &world)? {
                if world.rank() != 0 {
                    continue;
                }
                let mut ptm = p.ptm.map(|t| format!("  pTM {t:.3}")).unwrap_or_default();
                ptm += &p.iptm.map(|t| format!("  ipTM {t:.3}")).unwrap_or_default();
                // In the unit that reads (a small query's peak is MiB, not "0.00 GiB").
                let human = |b: u64| engine::gemini::human(b as usize);
                let peak = match (p.planned_bytes, p.peak_bytes) {
                    (Some(plan), Some(b)) => Some(format!("  peak memory {} (planned {})", human(b), human(plan))),
                    (Some(plan), None) => Some(format!("  peak memory not measured (planned {})", human(plan))),
                    (None, b) => b.map(|b| format!("  peak memory {}", human(b))),
                };
                println!(
                    "{} {}: {} residues, {} recycles in {:.2} s{}  mean pLDDT {:.2}{ptm}",
                    p.name,
                    p.model,
                    p.residues,
                    p.recycles,
                    p.seconds,
                    peak.unwrap_or_default(),
                    p.mean_plddt
                );
            }
        }
        Cli::Train(args) => {
            let Some(world) = args.job.launch.launch_or_join()? else { return Ok(()) };
            let log = train::run(&args, &world)?;
            if let (0, Some(last)) = (world.rank(), log.last()) {
                println!("final loss {:.4}; parameters in {}", last.losses.loss, args.out.join("params.npz").display());
            }
        }
        Cli::Convert { input, output } => {
            let done = fastfold::model::params::convert(&input, &output)?;
            println!("wrote {} arrays to {}", done.arrays, output.display());
            if done.widened > 0 {
                println!("{} bfloat16 arrays written as float32 (.npz has no bfloat16)", done.widened);
            }
        }
        Cli::Env => print!("{}", engine::process::report()),
    }
    Ok(())
}
