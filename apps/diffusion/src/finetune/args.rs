//! `diffusion finetune`'s flags, named as diffusers' `train_text_to_image.py` names them where
//! it has them (`--checkpointing_steps` there is `--checkpointing-steps` here), and their
//! checks.
use std::path::PathBuf;

use anyhow::bail;
use engine::job::{JobArgs, OptimizerArgs, Precision, ScheduleArgs, SeedArgs};
use tch::Device;

/// `diffusion finetune`'s options.
#[derive(clap::Args, Debug, Clone)]
#[command(
    mut_arg("lr", |a| a.default_value("1e-5")),
    mut_arg("weight_decay", |a| a.default_value("1e-2")),
    mut_arg("clip_grad", |a| a.default_value("1.0")),
    mut_arg("metrics", |a| a.default_value("log.jsonl")),
)]
pub struct FinetuneArgs {
    /// The diffusers pipeline folder to start from.
    #[arg(long, visible_alias = "pretrained-model-name-or-path")]
    pub model: PathBuf,
    /// The image folder (captions in metadata.jsonl or .txt files, or --instance-prompt).
    #[arg(long, visible_aliases = ["train-data-dir", "instance-data-dir"])]
    pub data: PathBuf,
    /// DreamBooth: every image takes this prompt (caption files are not read).
    #[arg(long)]
    pub instance_prompt: Option<String>,
    /// Output directory: `model/` (a diffusers folder), the training log, `validation/`,
    /// `checkpoint-<step>/` and `latest`.
    #[arg(short = 'o', long, visible_alias = "output-dir")]
    pub out: PathBuf,
    /// Training resolution (square, pixels), 1 to 4096.
    #[arg(long, default_value_t = 512, value_parser = engine::parse::count(1..=crate::sample::MAX_SIDE))]
    pub resolution: usize,
    /// Crop the centre square (default: a random square).
    #[arg(long)]
    pub center_crop: bool,
    /// Flip images horizontally at random.
    #[arg(long)]
    pub random_flip: bool,
    /// Images per rank per micro-batch (diffusers' --train-batch-size).
    #[arg(long, visible_alias = "train-batch-size", default_value_t = 1, value_parser = engine::parse::count(1..))]
    pub micro_batch: usize,
    /// Recompute each UNet block's activations in backward instead of keeping them (default:
    /// on under --gpu-mem, off otherwise; `--gradient-checkpointing false` turns it off).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    pub gradient_checkpointing: Option<bool>,
    /// Micro-batches per optimizer step (diffusers' --gradient-accumulation-steps).
    #[arg(long, visible_alias = "gradient-accumulation-steps", default_value_t = 1, value_parser = engine::parse::count(1..))]
    pub grad_accum: usize,
    /// Optimizer steps.
    #[arg(long, visible_alias = "max-train-steps", default_value_t = 100, value_parser = engine::parse::count(1..))]
    pub steps: usize,
    /// The optimizer (AdamW by default, with diffusers' weight decay 1e-2 and clip 1).
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
    /// The learning-rate schedule (constant after warmup by default).
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Min-SNR-gamma loss weighting (Hang et al. 2023; 5 is the usual value).
    #[arg(long, value_parser = engine::parse::positive)]
    pub snr_gamma: Option<f64>,
    /// Offset noise (adds `offset * N(0, 1)` per image and channel).
    #[arg(long, default_value_t = 0.0, value_parser = engine::parse::non_negative)]
    pub noise_offset: f64,
    /// Compute precision of the UNet and the frozen parts (fp32 masters and optimizer state
    /// either way; fp16 with dynamic loss scaling). Default: fp16 under --gpu-mem on a GPU, as
    /// Colossal-AI's Gemini trains by default, else fp32.
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,
    /// Cap on the device memory of the job (e.g. 4G); Gemini places the chunks to fit it.
    #[arg(long)]
    pub gpu_mem: Option<String>,
    /// AdamW over Gemini's chunks on the GPU: the fused multi-tensor kernel or libtorch's
    /// tensor operations (default: fused on CUDA, torch elsewhere).
    #[arg(long, value_enum)]
    pub kernels: Option<kernels::Backend>,
    /// Train LoRA adapters of this rank on the attention projections instead of the whole UNet
    /// (saved as `pytorch_lora_weights.safetensors`).
    #[arg(long)]
    pub lora_rank: Option<i64>,
    /// LoRA's alpha (the update is scaled by alpha / rank; default: the rank).
    #[arg(long, value_parser = engine::parse::positive, requires = "lora_rank")]
    pub lora_alpha: Option<f64>,
    /// Device, ranks, progress and the log file.
    #[command(flatten)]
    pub job: JobArgs,
    /// The seed of every random draw.
    #[command(flatten)]
    pub seed: SeedArgs,
    /// Save `model/` every this many steps as well as at the end (0: at the end only).
    #[arg(long, default_value_t = 0)]
    pub save_every: usize,
    /// Save a checkpoint, `checkpoint-<step>/` under --out, every this many steps (0: never):
    /// the UNet's (or LoRA's) weights, the optimizer state, the EMA weights, the step and the
    /// loss scale.
    #[arg(long, default_value_t = 500)]
    pub checkpointing_steps: usize,
    /// Keep only this many checkpoints, the newest (default: all).
    #[arg(long)]
    pub checkpoints_total_limit: Option<usize>,
    /// Continue from a checkpoint: `latest` (the newest under --out; a new run when there is
    /// none, as in diffusers) or a checkpoint folder (a path, or a name under --out). The
    /// number of ranks may differ if the global batch (ranks x micro-batch x accumulation) does
    /// not.
    #[arg(long, visible_alias = "resume-from-checkpoint", value_name = "latest|DIR")]
    pub resume: Option<String>,
    /// Keep an exponential moving average of the UNet's weights (diffusers' EMAModel), used for
    /// validation images and saved as the final UNet.
    #[arg(long)]
    pub use_ema: bool,
    /// The EMA's decay, reached after the warm-up `(1 + step) / (10 + step)`.
    #[arg(long, default_value_t = 0.9999)]
    pub ema_decay: f64,
    /// Replace each caption by "" with this probability, drawn from the seed, step and image
    /// (diffusers' --proportion-empty-prompts).
    #[arg(long, visible_alias = "proportion-empty-prompts", default_value_t = 0.0)]
    pub caption_dropout: f64,
    /// A validation prompt (repeat the flag for several): images
    /// `validation/step-<n>-<i>.png` every --validation-steps and after the last step.
    #[arg(long = "validation-prompt", visible_alias = "validation-prompts", value_name = "PROMPT")]
    pub validation_prompts: Vec<String>,
    /// Steps between validation images (default: after the last step only).
    #[arg(long)]
    pub validation_steps: Option<usize>,
    /// Validation images per prompt.
    #[arg(long, default_value_t = 4, requires = "validation_prompts", value_parser = engine::parse::count(1..))]
    pub num_validation_images: usize,
}

impl FinetuneArgs {
    /// Whether the UNet's blocks are recomputed in backward: as `--gradient-checkpointing` says,
    /// else under `--gpu-mem` (the activations of SD 1.5 at 512 px alone outgrow a 4 GiB card:
    /// on an H200 fp32 without it ran out in the first backward; recomputation gives the same
    /// gradients).
    pub fn checkpointing(&self) -> bool {
        self.gradient_checkpointing.unwrap_or(self.gpu_mem.is_some())
    }

    /// The compute precision on `device`: as `--precision` says, else fp16 under `--gpu-mem`
    /// on a GPU (Colossal-AI's GeminiPlugin's default: half the device bytes of the frozen
    /// parts, the chunks' compute copies and the activations, on every GPU with tensor cores,
    /// where bf16 needs Ampere), else fp32 (diffusers' default; the CPU gains nothing from
    /// half precision).
    pub fn precision_on(&self, device: Device) -> Precision {
        match (self.precision, &self.gpu_mem) {
            (Some(p), _) => p,
            (None, Some(_)) if device.is_cuda() => Precision::Fp16,
            (None, _) => Precision::Fp32,
        }
    }

    /// What `--gpu-mem` chose that the flags left open, said at start (None when nothing was).
    pub fn cap_defaults(&self, device: Device) -> Option<String> {
        let cap = self.gpu_mem.as_ref()?;
        let mut chosen = vec![];
        if self.precision.is_none() && self.precision_on(device) != Precision::Fp32 {
            chosen.push(format!("--precision {}", self.precision_on(device).name()));
        }
        if self.gradient_checkpointing.is_none() {
            chosen.push("--gradient-checkpointing".to_string());
        }
        (!chosen.is_empty()).then(|| {
            format!(
                "--gpu-mem {cap}: training with {} (the defaults under a cap; give --precision or \
                 --gradient-checkpointing false to change them)",
                chosen.join(" ")
            )
        })
    }

    /// Errors naming the first flag whose value cannot work.
    pub fn check(&self) -> anyhow::Result<()> {
        if !(0.0..=1.0).contains(&self.caption_dropout) {
            bail!("--caption-dropout {}: a probability in [0, 1] is needed", self.caption_dropout);
        }
        if !(0.0..=1.0).contains(&self.ema_decay) {
            bail!("--ema-decay {}: a decay in [0, 1] is needed", self.ema_decay);
        }
        if self.use_ema && self.lora_rank.is_some() {
            bail!("--use-ema averages the whole UNet's weights; it does not combine with --lora-rank");
        }
        if self.checkpoints_total_limit == Some(0) {
            bail!("--checkpoints-total-limit 0: keep at least 1 checkpoint (or leave the flag out)");
        }
        if self.validation_steps == Some(0) {
            bail!("--validation-steps 0: give at least 1 (or leave the flag out)");
        }
        if self.validation_steps.is_some() && self.validation_prompts.is_empty() {
            bail!("--validation-steps needs --validation-prompt");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: FinetuneArgs,
    }

    fn parse(flags: &[&str]) -> FinetuneArgs {
        let base = ["finetune", "--model", "m", "--data", "d", "-o", "o"];
        Cli::try_parse_from(base.iter().chain(flags)).unwrap().args
    }

    #[test]
    fn a_cap_defaults_to_fp16_on_a_gpu_and_checkpointing_unless_told_otherwise() {
        let (gpu, cpu) = (Device::Cuda(0), Device::Cpu);
        let capped = parse(&["--gpu-mem", "4G"]);
        assert_eq!((capped.precision_on(gpu), capped.precision_on(cpu)), (Precision::Fp16, Precision::Fp32));
        assert!(capped.checkpointing());
        let said = capped.cap_defaults(gpu).unwrap();
        assert!(said.contains("--gpu-mem 4G: training with --precision fp16 --gradient-checkpointing"), "{said}");
        assert!(!capped.cap_defaults(cpu).unwrap().contains("with --precision"));
        // What the flags say stands.
        let told = parse(&["--gpu-mem", "4G", "--precision", "fp32", "--gradient-checkpointing", "false"]);
        assert_eq!(told.precision_on(gpu), Precision::Fp32);
        assert!(!told.checkpointing());
        assert_eq!(told.cap_defaults(gpu), None);
        // Uncapped: diffusers' defaults.
        let plain = parse(&[]);
        assert_eq!(plain.precision_on(gpu), Precision::Fp32);
        assert!(!plain.checkpointing() && plain.cap_defaults(gpu).is_none());
        assert!(parse(&["--gradient-checkpointing", "--steps", "2"]).checkpointing());
    }
}
