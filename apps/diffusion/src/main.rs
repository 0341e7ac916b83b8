//! `diffusion`: Stable Diffusion fine-tuning on small GPUs (Gemini offload) and sampling.
use clap::Parser;
use diffusion::finetune::{self, FinetuneArgs};
use diffusion::sample::{self, SampleArgs};
use diffusion::single_file::{self as single, Base, Configs};
use std::path::PathBuf;

#[derive(Parser)]
#[command(version, about = "Stable Diffusion sampling and fine-tuning")]
enum Cli {
    /// Text-to-image from a diffusers pipeline folder (DDIM, Euler, Euler ancestral, PNDM,
    /// DPM-Solver++ 2M, UniPC; classifier-free guidance).
    Sample(Box<SampleArgs>),
    /// Fine-tune the UNet on captioned images under Gemini (`--gpu-mem` caps device memory).
    Finetune(Box<FinetuneArgs>),
    /// Convert between an original single-file checkpoint (A1111, ComfyUI) and a diffusers
    /// folder, either way, or a diffusers LoRA file to kohya's layout.
    Convert(Box<ConvertArgs>),
    /// Print libtorch's version, CUDA devices, threads and the launcher's view of the job.
    Env,
}

fn main() -> std::process::ExitCode {
    engine::failure::exit_code(run())
}

fn run() -> anyhow::Result<()> {
    engine::process::keep_freed_memory();
    data::temporaries::remove_on_interrupt();
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
        Cli::Convert(args) => args.run()?,
        Cli::Env => print!("{}", engine::process::report()),
    }
    Ok(())
}

#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("input").required(true).args(["checkpoint", "from_diffusers", "lora"]))]
struct ConvertArgs {
    /// A single-file checkpoint (`.safetensors`, SD 1.x, 2.x or XL) to convert into a diffusers folder.
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// The shipped configs to use for `--checkpoint` (default: sd1 for a CLIP text encoder,
    /// sd2-v for an OpenCLIP one, as diffusers assumes; SD 2.x 512 models need sd2-base).
    #[arg(long, value_enum, conflicts_with = "config_from")]
    base: Option<Base>,
    /// A diffusers folder of the same architecture whose configs, tokenizer and scheduler
    /// `--checkpoint` uses instead of the shipped ones.
    #[arg(long)]
    config_from: Option<PathBuf>,
    /// A diffusers folder to convert into one single-file checkpoint.
    #[arg(long)]
    from_diffusers: Option<PathBuf>,
    /// With `--from-diffusers`: store floating-point tensors as fp16.
    #[arg(long)]
    half: bool,
    /// A LoRA file (`pytorch_lora_weights.safetensors`, diffusers' or peft's naming) to convert
    /// into kohya's layout.
    #[arg(long)]
    lora: Option<PathBuf>,
    /// What to write: the diffusers folder or the `.safetensors` file (neither may exist).
    #[arg(short = 'o', long)]
    out: PathBuf,
}

impl ConvertArgs {
    fn run(&self) -> anyhow::Result<()> {
        let out = &self.out;
        // Checked here: clap did not enforce `requires` on these flags beside the required group.
        if self.checkpoint.is_none() && (self.base.is_some() || self.config_from.is_some()) {
            anyhow::bail!("--base and --config-from go with --checkpoint");
        }
        if self.from_diffusers.is_none() && self.half {
            anyhow::bail!("--half goes with --from-diffusers");
        }
        if let Some(checkpoint) = &self.checkpoint {
            let configs = match &self.config_from {
                Some(dir) => Configs::Folder(dir.clone()),
                None => Configs::Shipped(self.base),
            };
            let done = single::to_diffusers(checkpoint, &configs, out)?;
            let from = done
                .base
                .map_or_else(|| "the --config-from folder".to_string(), |b| format!("the {} configs", b.name()));
            println!("wrote {} tensors to {} with {from}", done.tensors, out.display());
        } else if let Some(folder) = &self.from_diffusers {
            let n = single::to_single_file(folder, out, self.half)?;
            println!("wrote {n} tensors to {}", out.display());
        } else if let Some(lora) = &self.lora {
            let n = single::lora_to_kohya(lora, out)?;
            println!("wrote {n} kohya adapters to {}", out.display());
        }
        Ok(())
    }
}
