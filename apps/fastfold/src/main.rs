//! `fastfold`: AlphaFold-style structure prediction with dynamic axial parallelism.
//! `predict` and `train` arrive with the model and DAP work; today the binary
//! reports the runtime it would run on.
use clap::Parser;

#[derive(Parser)]
#[command(version, about = "Protein structure prediction (runtime report only, for now)")]
enum Cli {
    /// Print libtorch's version, CUDA devices, threads and the launcher's view of the job.
    Env,
}

fn main() -> anyhow::Result<()> {
    let Cli::Env = Cli::parse();
    print!("{}", engine::runtime::report());
    Ok(())
}
