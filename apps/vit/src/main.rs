//! `vit`: large-batch Vision Transformer pretraining with LAMB over data parallelism.
//! The training commands arrive with the data-parallel and optimizer work; today the binary
//! reports the runtime it would train on.
use clap::Parser;

#[derive(Parser)]
#[command(version, about = "Large-batch ViT pretraining (runtime report only, for now)")]
enum Cli {
    /// Print libtorch's version, CUDA devices, threads and the launcher's view of the job.
    Env,
}

fn main() -> anyhow::Result<()> {
    let Cli::Env = Cli::parse();
    print!("{}", engine::runtime::report());
    Ok(())
}
