//! `diffusion`: Stable Diffusion fine-tuning on small GPUs (Gemini offload) and sampling.
//! The fine-tuning and sampling commands arrive with the Gemini and model work; today it
//! reports the runtime it would run on.
use clap::Parser;

#[derive(Parser)]
#[command(version, about = "Stable Diffusion fine-tuning and sampling (runtime report only, for now)")]
enum Cli {
    /// Print libtorch's version, CUDA devices, threads and the launcher's view of the job.
    Env,
}

fn main() -> anyhow::Result<()> {
    let Cli::Env = Cli::parse();
    print!("{}", engine::runtime::report());
    Ok(())
}
