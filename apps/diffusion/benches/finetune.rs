//! Stable Diffusion UNet fine-tuning steps (noise-prediction loss, backward, AdamW) with the
//! SD 1.x or (`--arch sdxl`) SDXL architecture and random weights: ours under Gemini with `--cap` as the memory budget
//! (and, on a GPU, the allocator's cap), ours uncapped, and diffusers' `UNet2DConditionModel`
//! in PyTorch eager (`benches/finetune_baseline.py`, fp32 weights under autocast, uncapped) in
//! the same run; seconds per step, peak memory and the ratios.
//!
//! `cargo bench -p diffusion --bench finetune -- --device cuda --cap 4G --resolution 512
//! --batch 1 --precision fp16 --gradient-checkpointing` is the issue's measurement;
//! `scripts/bench-diffusion.sh` sets up diffusers and runs it. Each configuration runs in its
//! own process, so every peak (the allocator's on a GPU, the resident set on the CPU) is its own;
//! on a GPU each also reports the card's peak use through its run, as `nvidia-smi` counts it
//! (`engine::process::CardPeak`; what `--gpu-mem` caps).
//! SDXL's steps add its pooled text and size/crop time ids (random, as the text states).
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{ensure, Context};
use clap::Parser;
use diffusion::config::{UNetConfig, UNetConfigFile};
use diffusion::finetune::{gemini_config, GeminiParts, UnetParams};
use diffusion::unet::{Conditioning, TextTime, UNet2DConditionModel};
use engine::device::DeviceKind;
use engine::gemini::{cap_process_memory, parse_bytes, CpuRule, Gemini, StepPlan};
use engine::job::Precision;
use engine::optim::{AdamW, AdamWConfig, LossScaler, Optimizer, Param};
use tch::{Device, Kind, Tensor};

const BASELINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/finetune_baseline.py");
/// Tokens of CLIP's text states.
const TOKENS: i64 = 77;

/// Which UNet is trained.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Arch {
    /// SD 1.x: widths 320,640,1280,1280, one transformer layer per block, CLIP ViT-L text (768).
    Sd15,
    /// SDXL: widths 320,640,1280, transformer layers 1,2,10, both encoders' text (2048), the
    /// text-time embedding.
    Sdxl,
}

#[derive(Parser, Debug, Clone)]
#[command(about = "SD UNet fine-tuning steps: ours under a memory cap, uncapped, and diffusers eager")]
struct Args {
    /// Where to run.
    #[arg(long, default_value_t = DeviceKind::Cpu)]
    device: DeviceKind,
    /// Gemini's budget and the GPU allocator's cap, e.g. 4G.
    #[arg(long, default_value = "4G")]
    cap: String,
    /// Image side in pixels (the latents are 1/8 of it).
    #[arg(long, default_value_t = 512)]
    resolution: i64,
    /// Images per step.
    #[arg(long, default_value_t = 1)]
    batch: i64,
    /// Compute precision (fp32 masters either way).
    #[arg(long, value_enum, default_value_t = Precision::Fp32)]
    precision: Precision,
    /// Recompute each block's activations in backward (both sides).
    #[arg(long)]
    gradient_checkpointing: bool,
    /// The architecture.
    #[arg(long, value_enum, default_value_t = Arch::Sd15)]
    arch: Arch,
    /// Widths of the resolution levels (default: the architecture's); smaller for a CPU check.
    #[arg(long, value_delimiter = ',')]
    block_out_channels: Option<Vec<i64>>,
    /// Transformer layers per block (default: the architecture's; SDXL 1,2,10); fewer for a
    /// CPU check.
    #[arg(long, value_delimiter = ',')]
    transformer_depth: Option<Vec<i64>>,
    /// Timed steps (after `--warmup` untimed ones).
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Untimed steps first (Gemini's first step also records its trace and places homes).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Skip diffusers.
    #[arg(long)]
    no_baseline: bool,
    /// Step Gemini's chunks only after backward, not as their gradients complete during it
    /// (`Gemini::plan_step`, which `diffusion finetune` takes).
    #[arg(long)]
    no_overlap: bool,
    /// The optimizer's steps on the device, as `diffusion finetune --kernels` (default: fused
    /// on CUDA, which update the homes in place).
    #[arg(long, value_enum)]
    kernels: Option<kernels::Backend>,
    /// After the timed steps, profile one more step of ours under the cap: its kernels and
    /// copies summed by name (on a GPU; the host's operators on the CPU) in a table, under a
    /// line with the step's wall time and the time the device was busy, and its Chrome trace
    /// written to this folder (`finetune-capped.json`).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Internal: run one configuration of ours and print its JSON line.
    #[arg(long, hide = true, value_parser = ["capped", "uncapped", "plain"])]
    run: Option<String>,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// What one configuration measured.
struct Measured {
    seconds_per_step: f64,
    peak_bytes: Option<u64>,
    /// On a GPU, the card's peak use through the run, as `nvidia-smi` counts it (the CUDA
    /// context, libraries and the allocator's reserve: what `--gpu-mem` caps).
    card_peak_bytes: Option<u64>,
    /// The UNet's parameter count (ours only).
    parameters: Option<u64>,
}

/// SDXL base 1.0's `unet/config.json` (the keys that differ from diffusers' defaults).
const SDXL: &str = r#"{
    "block_out_channels": [320, 640, 1280], "attention_head_dim": [5, 10, 20],
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "transformer_layers_per_block": [1, 2, 10], "cross_attention_dim": 2048, "use_linear_projection": true,
    "addition_embed_type": "text_time", "addition_time_embed_dim": 256,
    "projection_class_embeddings_input_dim": 2816, "sample_size": 128
}"#;

fn config(args: &Args) -> anyhow::Result<UNetConfigFile> {
    // diffusers' defaults are SD 1.x's UNet but for the text width (CLIP ViT-L/14: 768).
    let mut file: UNetConfigFile = match args.arch {
        Arch::Sd15 => serde_json::from_str(r#"{"cross_attention_dim": 768, "sample_size": 64}"#)?,
        Arch::Sdxl => serde_json::from_str(SDXL)?,
    };
    if let Some(widths) = &args.block_out_channels {
        file.block_out_channels = widths.clone();
    }
    if let Some(depth) = &args.transformer_depth {
        file.transformer_layers_per_block = serde_json::json!(depth);
    }
    Ok(file)
}

fn sync(device: Device) -> anyhow::Result<()> {
    if let Device::Cuda(d) = device {
        engine::cuda::synchronize(d)?;
    }
    Ok(())
}

/// How one configuration of ours trains.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Under Gemini with the budget and allocator cap.
    Capped,
    /// Under Gemini without a budget.
    Uncapped,
    /// Without Gemini: the model's own tensors and the engine's tensor AdamW (fp32 only), to
    /// tell the model's cost from Gemini's.
    Plain,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Capped => "capped",
            Mode::Uncapped => "uncapped",
            Mode::Plain => "plain",
        }
    }
}

/// Trains as `mode` says.
fn ours(args: &Args, mode: Mode) -> anyhow::Result<Measured> {
    let capped = mode == Mode::Capped;
    let device = args.device.device(0, 1)?;
    // From before anything is on the card, so that the context and libraries count.
    let card = match device {
        Device::Cuda(d) => Some(engine::process::CardPeak::start(d)?),
        _ => None,
    };
    kernels::install_optimizer_steps(kernels::Backend::resolve(args.kernels, device)?);
    let cap = parse_bytes(&args.cap).context("--cap")?;
    let file = config(args)?;
    let cfg = UNetConfig::new(&file, Path::new("<benchmark config>"))?;
    tch::manual_seed(0);
    let mut vs = tch::nn::VarStore::new(Device::Cpu);
    let mut unet = UNet2DConditionModel::new(&vs.root(), &cfg);
    unet.set_gradient_checkpointing(args.gradient_checkpointing);
    let UnetParams { params, parts } = UnetParams::of(&unet, &vs)?;
    let parameters = params.iter().map(|p| p.tensor.numel() as u64).sum();
    // The cap is the process's: on a GPU the allocator (Gemini's budget) gets what the CUDA
    // context and libraries leave of it.
    let mut budget = cap;
    if capped {
        if let Some(split) = cap_process_memory(device, cap, true)? {
            eprintln!("{split}");
            budget = split.allocator;
        }
    }
    let kind = args.precision.kind();
    let rule = CpuRule::AdamW(AdamWConfig::default());
    let (gemini, mut plain) = if mode == Mode::Plain {
        ensure!(args.precision == Precision::Fp32, "the plain configuration is fp32 only");
        vs.set_device(device);
        (None, Some(AdamW::new(params.iter().map(Param::shallow_copy).collect(), AdamWConfig::default())))
    } else {
        (Some(Gemini::new(&params, gemini_config(device, capped.then_some(budget), rule, kind, None))?), None)
    };
    let mut scaler = (args.precision == Precision::Fp16).then(LossScaler::default);
    let side = args.resolution / 8;
    let opts = (Kind::Float, device);
    // Seconds in each phase of the timed steps: forward, backward, finish_backward, optimizer.
    let mut phases = [0.0f64; 4];
    let mut step = |i: usize, phases: &mut [f64; 4]| -> anyhow::Result<()> {
        let mut lap = Instant::now();
        let mut mark = |k: usize| -> anyhow::Result<()> {
            sync(device)?;
            phases[k] += lap.elapsed().as_secs_f64();
            lap = Instant::now();
            Ok(())
        };
        tch::manual_seed(i as i64 + 1);
        let noisy = Tensor::f_randn([args.batch, 4, side, side], opts)?;
        let noise = Tensor::f_randn([args.batch, 4, side, side], opts)?;
        let context = Tensor::f_randn([args.batch, TOKENS, file.cross_attention_dim], opts)?.f_to_kind(kind)?;
        let t = Tensor::f_randint(1000, [args.batch], (Kind::Int64, device))?;
        let text_time = match &cfg.text_time {
            Some(tt) => {
                let r = args.resolution as f32;
                let ids = Tensor::from_slice(&[r, r, 0.0, 0.0, r, r]).f_to_device(device)?;
                Some(TextTime {
                    text_embeds: Tensor::f_randn([args.batch, tt.pooled_dim(6)], opts)?.f_to_kind(kind)?,
                    time_ids: ids.f_unsqueeze(0)?.f_expand([args.batch, 6], false)?,
                })
            }
            None => None,
        };
        let cond = Conditioning { context, text_time };
        if let (Some(gemini), false) = (&gemini, args.no_overlap) {
            gemini.plan_step(StepPlan { loss_scale: scaler.as_ref().map(|s| s.scale), norm: false })?;
        }
        let pred = match &gemini {
            Some(gemini) => {
                unet.forward_with(&noisy.f_to_kind(kind)?, &t, &cond, &GeminiParts { gemini, parts: &parts })?
            }
            None => unet.forward_cond(&noisy, &t, &cond)?,
        };
        let loss = pred.f_to_kind(Kind::Float)?.f_mse_loss(&noise, tch::Reduction::Mean)?;
        mark(0)?;
        match &scaler {
            Some(s) => s.scale_loss(&loss)?.backward(),
            None => loss.backward(),
        }
        mark(1)?;
        let Some(gemini) = &gemini else {
            let opt = plain.as_mut().expect("plain without Gemini");
            opt.step()?;
            opt.zero_grad();
            return mark(3);
        };
        gemini.finish_backward()?;
        mark(2)?;
        let finite = match &scaler {
            Some(s) => gemini.unscale(s)?,
            None => true,
        };
        if finite {
            gemini.step()?;
        } else {
            gemini.skip_step()?;
        }
        if let Some(s) = scaler.as_mut() {
            s.update(finite);
        }
        mark(3)
    };
    for i in 0..args.warmup {
        step(i, &mut [0.0; 4])?;
    }
    let start = Instant::now();
    for i in 0..args.steps {
        step(args.warmup + i, &mut phases)?;
    }
    let seconds_per_step = start.elapsed().as_secs_f64() / args.steps.max(1) as f64;
    let n = args.steps.max(1) as f64;
    if let (Some(dir), Mode::Capped) = (&args.trace, mode) {
        std::fs::create_dir_all(dir)?;
        let title = format!("ours, Gemini, cap {}, one step, traced", args.cap);
        let chrome = dir.join("finetune-capped.json");
        let at = args.warmup + args.steps;
        let table = engine::kernel_trace::table_of(device.is_cuda(), &chrome, &title, 30, || {
            step(at, &mut [0.0; 4])?;
            if let Device::Cuda(d) = device {
                engine::cuda::synchronize(d)?;
            }
            anyhow::Ok(())
        })?;
        eprintln!("{table}");
    }
    eprintln!(
        "ours ({}): forward {:.3} s, backward {:.3} s, finish_backward {:.3} s, optimizer {:.3} s per step",
        mode.name(),
        phases[0] / n,
        phases[1] / n,
        phases[2] / n,
        phases[3] / n
    );
    Ok(Measured {
        seconds_per_step,
        peak_bytes: engine::process::peak_memory(device),
        card_peak_bytes: card.map(engine::process::CardPeak::finish).transpose()?,
        parameters: Some(parameters),
    })
}

/// Runs this program again for one configuration of ours.
fn child(which: &str) -> anyhow::Result<Measured> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(&exe);
    cmd.args(std::env::args().skip(1).filter(|a| a != "--bench")).args(["--run", which]);
    parse_child(cmd, &format!("ours ({which})"))
}

/// Runs `cmd` and reads the figures it prints last.
fn parse_child(mut cmd: Command, what: &str) -> anyhow::Result<Measured> {
    let json = engine::baseline::last_json(&engine::baseline::run(&mut cmd, what)?, what)?;
    Ok(Measured {
        seconds_per_step: engine::baseline::number(&json, "seconds_per_step")?,
        peak_bytes: json["peak_bytes"].as_u64(),
        card_peak_bytes: json["card_peak_bytes"].as_u64(),
        parameters: json["parameters"].as_u64(),
    })
}

fn diffusers(args: &Args, config_path: &Path) -> anyhow::Result<Measured> {
    let mut cmd = Command::new(engine::baseline::python()?);
    cmd.arg(BASELINE)
        .arg(config_path)
        .args(["--device", if args.device.resolve() == DeviceKind::Cpu { "cpu" } else { "cuda" }])
        .args(["--resolution", &args.resolution.to_string(), "--batch", &args.batch.to_string()])
        .args(["--precision", &format!("{:?}", args.precision).to_lowercase()])
        .args(["--steps", &args.steps.to_string(), "--warmup", &args.warmup.to_string()]);
    if args.gradient_checkpointing {
        cmd.arg("--gradient-checkpointing");
    }
    parse_child(cmd, BASELINE)
}

fn gib(bytes: Option<u64>) -> String {
    bytes.map_or("-".into(), |b| format!("{:.2}", b as f64 / f64::from(1u32 << 30)))
}

/// A table row's figures: seconds per step, the peak and the card's peak.
fn cells(m: &Measured) -> String {
    format!("{:.3} | {} | {}", m.seconds_per_step, gib(m.peak_bytes), gib(m.card_peak_bytes))
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(which) = &args.run {
        let mode = [Mode::Capped, Mode::Uncapped, Mode::Plain].into_iter().find(|m| m.name() == which);
        let m = ours(&args, mode.context("--run")?)?;
        let json = serde_json::json!({
            "seconds_per_step": m.seconds_per_step,
            "peak_bytes": m.peak_bytes,
            "card_peak_bytes": m.card_peak_bytes,
            "parameters": m.parameters,
        });
        println!("{json}");
        return Ok(());
    }
    if args.device == DeviceKind::Cuda && !engine::cuda::is_available() {
        anyhow::bail!("diffusion finetune bench: --device cuda, but no CUDA device is visible (--device cpu checks the program on the CPU)");
    }
    let cfg = config(&args)?;
    // The first run reports the parameter count for the header.
    let capped = child("capped")?;
    println!(
        "{} UNet fine-tuning step: {:.0}M parameters (widths {:?}, transformer layers {}), {} px, batch {}, {:?} compute over fp32 masters, AdamW, {}gradient checkpointing, on {}",
        match args.arch {
            Arch::Sd15 => "SD 1.x",
            Arch::Sdxl => "SDXL",
        },
        capped.parameters.unwrap_or(0) as f64 / 1e6,
        cfg.block_out_channels,
        cfg.transformer_layers_per_block,
        args.resolution,
        args.batch,
        args.precision,
        if args.gradient_checkpointing { "" } else { "no " },
        args.device
    );
    if args.device.resolve() == DeviceKind::Cpu {
        println!("(on the CPU the cap is Gemini's own accounting; peaks are each process's resident set)");
    }
    println!("| | s/step | peak GiB | card peak GiB |\n|---|---|---|---|");
    println!("| ours, Gemini, cap {} | {} |", args.cap, cells(&capped));
    let uncapped = child("uncapped")?;
    println!("| ours, Gemini, uncapped | {} |", cells(&uncapped));
    println!("capped / uncapped step time: {:.2}", capped.seconds_per_step / uncapped.seconds_per_step);
    if args.precision == Precision::Fp32 {
        let plain = child("plain")?;
        println!("| ours, no Gemini (tensor AdamW) | {} |", cells(&plain));
    }
    if args.no_baseline {
        return Ok(());
    }
    let dir: PathBuf = std::env::temp_dir().join(format!("diffusion-bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let config_path = dir.join("config.json");
    std::fs::write(&config_path, serde_json::to_string_pretty(&cfg)?)?;
    let eager = diffusers(&args, &config_path);
    let _ = std::fs::remove_dir_all(&dir);
    let eager = eager?;
    println!("| diffusers eager, uncapped | {} |", cells(&eager));
    println!(
        "diffusers / ours step time: {:.2} (ours capped), {:.2} (ours uncapped)",
        eager.seconds_per_step / capped.seconds_per_step,
        eager.seconds_per_step / uncapped.seconds_per_step
    );
    Ok(())
}
