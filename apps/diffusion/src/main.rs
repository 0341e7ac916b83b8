//! `diffusion`: Stable Diffusion fine-tuning on small GPUs (Gemini offload) and sampling.
use clap::Parser;
use diffusion::sample::{self, SampleArgs};

#[derive(Parser)]
#[command(version, about = "Stable Diffusion sampling and fine-tuning")]
enum Cli {
    /// Text-to-image from a diffusers pipeline folder (DDIM or Euler, classifier-free guidance).
    Sample(SampleArgs),
    /// Print libtorch's version, CUDA devices, threads and the launcher's view of the job.
    Env,
}

fn main() -> anyhow::Result<()> {
    engine::runtime::keep_freed_memory();
    match Cli::parse() {
        Cli::Sample(args) => {
            let (paths, seconds) = sample::run(&args)?;
            for p in &paths {
                println!("wrote {}", p.display());
            }
            println!("{seconds:.2} s per image");
        }
        Cli::Env => print!("{}", engine::runtime::report()),
    }
    Ok(())
}
