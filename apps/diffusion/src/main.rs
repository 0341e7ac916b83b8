//! `diffusion`: Stable Diffusion fine-tuning on small GPUs (Gemini offload) and sampling.
use clap::Parser;
use diffusion::finetune::{self, FinetuneArgs};
use diffusion::sample::{self, SampleArgs};

#[derive(Parser)]
#[command(version, about = "Stable Diffusion sampling and fine-tuning")]
enum Cli {
    /// Text-to-image from a diffusers pipeline folder (DDIM, Euler, Euler ancestral, PNDM,
    /// DPM-Solver++ 2M, UniPC; classifier-free guidance).
    Sample(SampleArgs),
    /// Fine-tune the UNet on captioned images under Gemini (`--gpu-mem` caps device memory).
    Finetune(Box<FinetuneArgs>),
    /// Convert an original single-file SD 1.x checkpoint into a diffusers folder.
    Convert {
        /// The single-file checkpoint (`.safetensors`).
        #[arg(long)]
        checkpoint: std::path::PathBuf,
        /// A diffusers folder of the same architecture: configs, tokenizer and scheduler.
        #[arg(long)]
        config_from: std::path::PathBuf,
        /// The diffusers folder to write (must not exist).
        #[arg(short = 'o', long)]
        out: std::path::PathBuf,
    },
    /// Print libtorch's version, CUDA devices, threads and the launcher's view of the job.
    Env,
}

fn main() -> anyhow::Result<()> {
    engine::process::keep_freed_memory();
    match Cli::parse() {
        Cli::Sample(args) => {
            let (paths, seconds) = sample::run(&args)?;
            for p in &paths {
                println!("wrote {}", p.display());
            }
            println!("{seconds:.2} s per image");
        }
        Cli::Finetune(args) => {
            let Some(world) = args.job.launch.launch_or_join()? else { return Ok(()) };
            let log = finetune::run(&args, &world)?;
            if let (0, Some(last)) = (world.rank(), log.last()) {
                let saved = match args.lora_rank {
                    Some(_) => args.out.join(diffusion::lora::LORA_WEIGHTS),
                    None => args.out.join("model"),
                };
                println!("final loss {:.5}; saved {}", last.loss, saved.display());
            }
        }
        Cli::Convert { checkpoint, config_from, out } => {
            let n = diffusion::single_file::convert(&checkpoint, &config_from, &out)?;
            println!("wrote {n} tensors to {}", out.display());
        }
        Cli::Env => print!("{}", engine::process::report()),
    }
    Ok(())
}
