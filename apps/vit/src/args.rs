//! The options of `vit pretrain`: the data, the model, the optimizer and its schedule, the
//! parallel layout's flags ([`LayoutArgs`]), the job, checkpoints.
use std::path::PathBuf;

use anyhow::Context;
use engine::job::{JobArgs, OptimizerArgs, PrecisionArgs, ScheduleArgs, SeedArgs};

use crate::batch::parse_batch;
use crate::datasets::{DataArgs, Splits};
use crate::layout::LayoutArgs;
use crate::model::VitConfig;

/// Options of `vit pretrain`.
#[derive(clap::Args, Clone, Debug)]
#[command(
    mut_arg("optimizer", |a| a.default_value("lamb")),
    mut_arg("lr", |a| a.default_value("3e-2").help("Peak learning rate, reached at the end of warmup (the default suits LAMB on the embedded digits)")),
    mut_arg("weight_decay", |a| a.default_value("0.05")),
    mut_arg("warmup", |a| a.default_value("50")),
    mut_arg("decay", |a| a.default_value("cosine")),
    mut_arg("min_lr_ratio", |a| a.default_value("0.01")),
)]
pub struct PretrainArgs {
    #[command(flatten)]
    pub data: DataArgs,
    /// Model: a preset (`digits`, the small ViT for the embedded 8x8 digits, the default
    /// without --data; or a timm name such as vit_tiny_patch16_224, the default with it).
    /// Channels and classes follow the data.
    #[arg(long)]
    pub model: Option<String>,
    /// Input side in pixels (default: the model's).
    #[arg(long)]
    pub image_size: Option<i64>,
    /// Patch side in pixels (default: the model's).
    #[arg(long, visible_alias = "patch")]
    pub patch_size: Option<i64>,
    /// Global batch: examples per optimizer step over all ranks and accumulation steps (a k
    /// suffix multiplies by 1024: 32k).
    #[arg(long, default_value = "128", value_parser = parse_batch)]
    pub batch: usize,
    /// The optimizer and its hyper-parameters.
    #[command(flatten)]
    pub optimizer: OptimizerArgs,
    /// Scale --lr linearly by --batch / this batch (the linear scaling rule; off by default).
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub lr_base_batch: Option<usize>,
    /// The learning-rate schedule.
    #[command(flatten)]
    pub schedule: ScheduleArgs,
    /// Epochs (passes over the training set).
    #[arg(long, default_value_t = 60, value_parser = engine::parse::count(1..))]
    pub epochs: usize,
    /// Optimizer steps, overriding --epochs.
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub steps: Option<usize>,
    /// Mixup's Beta(alpha, alpha); 0 turns mixup off.
    #[arg(long, default_value_t = 0.0, value_parser = engine::parse::non_negative)]
    pub mixup: f64,
    /// Label smoothing.
    #[arg(long, default_value_t = 0.1, value_parser = engine::parse::share)]
    pub smoothing: f64,
    /// Smallest area share of the random resized crop (default 0.7 for the digits, 0.08 for
    /// photos as torchvision).
    #[arg(long, value_parser = engine::parse::positive_share)]
    pub crop_scale: Option<f64>,
    /// Arithmetic precision (bf16 and fp16 keep fp32 master weights and optimizer state).
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// The parallel layout: --micro-batch, --tp, --tp-mode, --tp-depth, --sequence-parallel,
    /// --sp, --sp-mode, --pp, --schedule, --virtual-stages, --pp-balance, --zero,
    /// --gradient-checkpointing, --checkpoint-blocks, or --parallel plan|auto (and --cluster).
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// What runs the blocks' LayerNorms: fused (a CUDA kernel compiled at run time) or torch
    /// (libtorch's); by default fused on CUDA, torch elsewhere. The tensor-parallel layouts
    /// (--tp above 1) use libtorch's.
    #[arg(long, value_enum)]
    pub kernels: Option<kernels::Backend>,
    /// Keep the fp32 master weights and optimizer state in CPU memory (with --device cuda).
    #[arg(long)]
    pub offload_optimizer: bool,
    /// Device, ranks, progress and the metrics file.
    #[command(flatten)]
    pub job: JobArgs,
    /// The seed of the initial weights, the data order and the augmentations.
    #[command(flatten)]
    pub seed: SeedArgs,
    /// Directory for checkpoints, metrics and the final model (written by rank 0).
    #[arg(short = 'o', long)]
    pub out: Option<PathBuf>,
    /// Continue the run saved under --out from its latest checkpoint.
    #[arg(long)]
    pub resume: bool,
    /// Checkpoint every this many steps (default: at each epoch end).
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub save_every: Option<usize>,
    /// Stop after this many steps in total (checkpointing first when --out is given) while the
    /// schedule still follows --steps/--epochs: for time-limited jobs continued with --resume.
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub stop_after: Option<usize>,
    /// Decode and augmentation threads per rank (default: the cores available to the rank).
    #[arg(long, default_value_t = engine::process::cores_per_rank())]
    pub workers: usize,
}

impl PretrainArgs {
    /// The architecture named by `--model`, `--image-size` and `--patch-size`, fitted to the
    /// data (`splits`: its channels and classes).
    pub fn model_config(&self, splits: &Splits) -> anyhow::Result<VitConfig> {
        let name = self.model.as_deref().unwrap_or(if splits.embedded { "digits" } else { "vit_tiny_patch16_224" });
        let mut cfg = VitConfig::preset(name)
            .with_context(|| format!("--model {name}: not a known model ({})", VitConfig::preset_names().join(", ")))?;
        cfg.image_size = self.image_size.unwrap_or(cfg.image_size);
        cfg.patch_size = self.patch_size.unwrap_or(cfg.patch_size);
        let data = splits.train.as_ref();
        cfg.in_channels = data.channels() as i64;
        cfg.num_classes = data.classes().len() as i64;
        cfg.validate().map_err(|e| anyhow::anyhow!("model {name}: {e}"))?;
        Ok(cfg)
    }
}
