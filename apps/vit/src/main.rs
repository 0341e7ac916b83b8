//! `vit`: large-batch Vision Transformer pretraining with LAMB over data parallelism.
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use vit::{bench, eval, train};

#[derive(Parser)]
#[command(version, about = "Large-batch ViT pretraining with LAMB/LARS over data parallelism and ZeRO")]
enum Cli {
    /// Train a ViT (on the embedded 8x8 digits unless --data is given).
    Pretrain(Box<vit::args::PretrainArgs>),
    /// Top-1 and top-5 accuracy of a trained model.
    Eval(eval::EvalArgs),
    /// Training images/s of a ViT on synthetic input, beside PyTorch eager.
    Bench(bench::BenchArgs),
    /// Data set tools.
    #[command(subcommand)]
    Data(DataCommand),
    /// Print libtorch's version, CUDA devices, threads and the launcher's view of the job.
    Env,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Convert a folder of class subfolders (read as torchvision's ImageFolder reads it: JPEG,
    /// PNG, PPM/PGM, BMP, TIFF, WebP, in subfolders too) into one HDF5 file.
    Convert {
        /// The image folder.
        folder: PathBuf,
        /// The HDF5 file to write.
        out: PathBuf,
        /// Side in pixels every image is resized to (after a centre square crop), 1 to 4096.
        #[arg(long, default_value_t = 224, value_parser = engine::parse::count(1..=4096))]
        size: usize,
        /// Colour channels (1 or 3).
        #[arg(long, default_value_t = 3, value_parser = engine::parse::count(1..=3))]
        channels: usize,
    },
}

fn main() -> std::process::ExitCode {
    engine::failure::exit_code(run())
}

fn run() -> anyhow::Result<()> {
    engine::process::keep_freed_memory();
    data::temporaries::remove_on_interrupt();
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let mut cli = <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let (Cli::Pretrain(args), Some(("pretrain", given))) = (&mut cli, matches.subcommand()) {
        args.layout.given = given
            .ids()
            .filter(|id| given.value_source(id.as_str()) == Some(clap::parser::ValueSource::CommandLine))
            .map(|id| id.to_string())
            .collect();
    }
    match cli {
        Cli::Pretrain(args) => {
            if args.layout.planner == Some(vit::layout::PlannerMode::Plan) {
                print!("{}", vit::plan::run(&args)?);
                return Ok(());
            }
            let Some(world) = args.job.launch.launch_or_join()? else { return Ok(()) };
            let trained = train::pretrain(&args, &world)?;
            if world.rank() == 0 {
                match (trained.val_top1, trained.val_top5) {
                    (Some(top1), Some(top5)) => println!(
                        "validation top-1 {:.2}%  top-5 {:.2}% after {:.1} s",
                        100.0 * top1,
                        100.0 * top5,
                        trained.seconds
                    ),
                    _ => println!(
                        "done after {:.1} s; not validated (no validation set, or no epoch ended)",
                        trained.seconds
                    ),
                }
            }
        }
        Cli::Eval(args) => {
            eval::run(&args)?;
        }
        Cli::Bench(args) => bench::run(&args)?,
        Cli::Data(DataCommand::Convert { folder, out, size, channels }) => {
            let n = data::h5::convert_folder(&folder, &out, size, channels)?;
            println!("wrote {n} images to {}", out.display());
        }
        Cli::Env => print!("{}", engine::process::report()),
    }
    Ok(())
}
