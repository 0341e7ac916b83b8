//! `vit bench`: training throughput (images per second) of our ViT against a PyTorch eager
//! implementation of the same network (`benches/vit_baseline.py`), measured in the same
//! invocation with the same intra-op thread count, and their ratio.
//!
//! Each side runs the same training step on one fixed synthetic batch (random images, random
//! labels): forward, fp32 cross-entropy, backward, one AdamW step (lr 1e-3, weight decay 0.01
//! on parameters of two or more dimensions, PyTorch's other defaults), and clearing the
//! gradients (`set_to_none`, as `torch.optim.Optimizer.zero_grad` does by default). Ours runs
//! `engine::optim::AdamW`, PyTorch's `torch.optim.AdamW` with its default `foreach` choice (a
//! per-tensor loop on CPU, multi-tensor kernels on CUDA). After `--warmup` untimed steps, steps
//! run until `--seconds` have passed (or `--steps` have run), then the device is synchronised
//! once and the rate is steps x batch over the time to that point.
//!
//! `--compiled-baseline` adds a third side, the same PyTorch model under `torch.compile`
//! (inductor; forward and backward compiled during at least three warm-up steps, the optimizer
//! eager). Where torch.compile cannot run (no Triton or no C compiler on the machine), the
//! table says so and why instead of a figure.
//!
//! `--trace DIR` profiles one more step of ours after the timing (`engine::kernel_trace`): its
//! kernels on a GPU (the host's operators on the CPU) summed by name in a table after the
//! throughput's, the GPU's busy time beside the step's wall time, and its Chrome trace in
//! `DIR/vit-step.json`.
//!
//! Precision (`--precision`):
//! - `fp32`: everything in float32 on both sides.
//! - `bf16`: bf16 weights and activations with fp32 master weights: the backward's bf16
//!   gradients are copied into fp32 masters ([`MasterWeights`]), AdamW updates the masters, and
//!   they are rounded back into the model. The baseline does the same by default
//!   (`--baseline-bf16 master`), so both sides run the same arithmetic. `--baseline-bf16
//!   autocast` compares instead against `torch.autocast(dtype=bfloat16)` over fp32 weights,
//!   the usual PyTorch recipe; it keeps the layer norms, the residual stream and the weights
//!   in fp32 (casting them to bf16 for each matmul), so it moves more bytes per step than we
//!   do and that ratio flatters us.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use engine::device::DeviceKind;
use engine::job::{DeviceArgs, Precision, PrecisionArgs};
use engine::optim::{params_of, AdamW, AdamWConfig, MasterWeights, Optimizer, Param};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::batch::parse_batch;
use crate::model::{Vit, VitConfig};

/// The baseline script, beside this crate's sources.
const BASELINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/vit_baseline.py");
/// The PyTorch side's bf16 recipe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum BaselineBf16 {
    /// The same as ours: a bf16 model with fp32 master weights.
    Master,
    /// `torch.autocast(dtype=bfloat16)` over fp32 weights.
    Autocast,
}

/// Options of `vit bench`.
#[derive(clap::Args, Clone, Debug)]
#[command(mut_arg("precision", |a| a.value_parser(Precision::parser(&[Precision::Fp32, Precision::Bf16]))))]
pub struct BenchArgs {
    /// A preset (`digits`, or timm's `vit_{tiny,small,base,large}_patch{16,32}_224`) or
    /// `custom`, which takes `--width --depth --heads --patch-size` (and `--mlp-ratio`).
    #[arg(long, default_value = "vit_tiny_patch16_224")]
    pub model: String,
    /// Embedding width (`--model custom`).
    #[arg(long)]
    pub width: Option<i64>,
    /// Transformer blocks (`--model custom`).
    #[arg(long)]
    pub depth: Option<i64>,
    /// Attention heads (`--model custom`).
    #[arg(long)]
    pub heads: Option<i64>,
    /// MLP hidden width over embedding width (`--model custom`; default 4).
    #[arg(long)]
    pub mlp_ratio: Option<f64>,
    /// Patch side in pixels (`--model custom`).
    #[arg(long, visible_alias = "patch")]
    pub patch_size: Option<i64>,
    /// Input height and width in pixels (default 224).
    #[arg(long)]
    pub image_size: Option<i64>,
    /// Input channels.
    #[arg(long, default_value_t = 3)]
    pub channels: i64,
    /// Output classes (default: the preset's 1000, or 10 for `custom`).
    #[arg(long)]
    pub classes: Option<i64>,
    /// Images per training step (a k suffix multiplies by 1024).
    #[arg(long, default_value = "8", value_parser = parse_batch)]
    pub batch: usize,
    /// Untimed steps before measuring.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Measure each side for about this many seconds.
    #[arg(long, default_value_t = 10.0)]
    pub seconds: f64,
    /// Measure exactly this many steps instead of `--seconds`.
    #[arg(long)]
    pub steps: Option<usize>,
    /// Intra-op CPU threads on both sides (default: torch's current count).
    #[arg(long)]
    pub threads: Option<usize>,
    /// The device.
    #[command(flatten)]
    pub device: DeviceArgs,
    /// Precision regime (see the module docs).
    #[command(flatten)]
    pub precision: PrecisionArgs,
    /// The PyTorch side's recipe under `--precision bf16`.
    #[arg(long, value_enum, default_value_t = BaselineBf16::Master)]
    pub baseline_bf16: BaselineBf16,
    /// Measure ours only; skip the PyTorch baseline.
    #[arg(long)]
    pub no_baseline: bool,
    /// Also measure the baseline under torch.compile (compiling takes a minute or more).
    #[arg(long, conflicts_with = "no_baseline")]
    pub compiled_baseline: bool,
    /// Our LayerNorms, bias + GELU and optimizer step: fused CUDA kernels or libtorch's
    /// compositions (default: fused on CUDA, as `vit pretrain` runs; the baseline is eager).
    #[arg(long, value_enum)]
    pub kernels: Option<kernels::Backend>,
    /// After timing, profile one step of ours: its kernels (on a GPU; the host's operators on
    /// the CPU) summed by name in a table, and its Chrome trace written to this folder
    /// (`vit-step.json`).
    #[arg(long)]
    pub trace: Option<PathBuf>,
}

/// One side's measurement.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Throughput {
    /// Training images per second.
    pub images_per_s: f64,
    /// Steps timed.
    pub steps: usize,
    /// Seconds they took.
    pub seconds: f64,
    /// Most bytes the CUDA caching allocator held in tensors (CUDA only).
    pub peak_memory_bytes: Option<i64>,
}

/// Both sides' measurements and what they ran.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchReport {
    /// The preset name, or `custom` with its dimensions.
    pub model: String,
    /// The architecture measured.
    pub config: VitConfig,
    /// Intra-op threads.
    pub threads: usize,
    /// Ours.
    pub ours: Throughput,
    /// PyTorch's, unless `--no-baseline`.
    pub baseline: Option<Throughput>,
    /// PyTorch's under torch.compile with `--compiled-baseline`, or why it could not run.
    pub compiled: Option<Result<Throughput, String>>,
    /// With `--trace`, the table of one profiled step of ours.
    pub trace: Option<String>,
}

impl BenchArgs {
    /// The architecture and a label for it; an error (listing the presets) for a bad name or
    /// inconsistent numbers.
    pub fn config(&self) -> anyhow::Result<(String, VitConfig)> {
        let arch = [
            ("--width", self.width.is_some()),
            ("--depth", self.depth.is_some()),
            ("--heads", self.heads.is_some()),
            ("--mlp-ratio", self.mlp_ratio.is_some()),
            ("--patch-size", self.patch_size.is_some()),
        ];
        // Named by flag here: the configuration's own check names its fields.
        let sizes = [
            ("--width", self.width),
            ("--depth", self.depth),
            ("--heads", self.heads),
            ("--patch-size", self.patch_size),
            ("--image-size", self.image_size),
            ("--channels", Some(self.channels)),
            ("--classes", self.classes),
        ];
        if let Some((flag, Some(n))) = sizes.iter().find(|(_, n)| n.is_some_and(|n| n <= 0)) {
            bail!("{flag} must be positive, got {n}");
        }
        if let Some(ratio) = self.mlp_ratio.filter(|r| !(r.is_finite() && *r > 0.0)) {
            bail!("--mlp-ratio must be a positive number, got {ratio}");
        }
        let (label, mut cfg) = if self.model == "custom" {
            let missing: Vec<&str> = [
                ("--width", self.width),
                ("--depth", self.depth),
                ("--heads", self.heads),
                ("--patch-size", self.patch_size),
            ]
            .iter()
            .filter(|(_, v)| v.is_none())
            .map(|(flag, _)| *flag)
            .collect();
            ensure!(missing.is_empty(), "--model custom needs {}", missing.join(", "));
            let cfg = VitConfig {
                image_size: 224,
                patch_size: self.patch_size.unwrap_or_default(),
                in_channels: 3,
                num_classes: 10,
                width: self.width.unwrap_or_default(),
                depth: self.depth.unwrap_or_default(),
                heads: self.heads.unwrap_or_default(),
                mlp_ratio: self.mlp_ratio.unwrap_or(4.0),
            };
            let label = format!("custom w{} d{} h{} p{}", cfg.width, cfg.depth, cfg.heads, cfg.patch_size);
            (label, cfg)
        } else {
            let cfg = VitConfig::preset(&self.model).with_context(|| {
                format!("unknown model {:?}; valid: {}, custom", self.model, VitConfig::preset_names().join(", "))
            })?;
            if let Some((flag, _)) = arch.iter().find(|(_, given)| *given) {
                bail!("{flag} applies to --model custom only (the preset {} fixes it)", self.model);
            }
            (self.model.clone(), cfg)
        };
        cfg.image_size = self.image_size.unwrap_or(cfg.image_size);
        cfg.in_channels = self.channels;
        cfg.num_classes = self.classes.unwrap_or(cfg.num_classes);
        cfg.validate().map_err(anyhow::Error::msg).context("invalid model configuration")?;
        ensure!(self.batch > 0, "--batch must be positive, not {}", self.batch);
        ensure!(
            self.seconds.is_finite() && self.seconds >= 0.0,
            "--seconds must be a non-negative number, not {}",
            self.seconds
        );
        ensure!(self.steps != Some(0), "--steps must be positive");
        Ok((label, cfg))
    }
}

/// Runs the benchmark and prints the table.
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let report = bench(args)?;
    print!("{}", table(args, &report));
    Ok(())
}

/// Measures ours, then (unless `--no-baseline`) the PyTorch baseline with the same settings.
pub fn bench(args: &BenchArgs) -> anyhow::Result<BenchReport> {
    let (model, config) = args.config()?;
    let device = args.device.device.device(0, 1)?;
    let threads = match args.threads {
        Some(0) => bail!("--threads must be positive"),
        // libtorch would start them all (and the run would crawl or hang starting them).
        Some(n) if n > 1024 => bail!("--threads {n}: at most 1024"),
        Some(n) => n,
        None => tch::get_num_threads().max(1) as usize,
    };
    tch::set_num_threads(threads as i32);

    // Before the long part, so that a missing interpreter fails at once.
    let python = (!args.no_baseline).then(baseline_python).transpose()?;

    let backend = kernels::Backend::resolve(args.kernels, device)?;
    kernels::install_optimizer_steps(backend);
    eprintln!("[bench] ours: {model}, kernels {backend:?}, {threads} threads, about {} s", args.seconds);
    let (ours, trace) = measure_ours(&config, args, device, backend).context("measuring our ViT")?;
    if device.is_cuda() {
        // Hand our cached blocks back so that the baseline's process finds the memory free.
        engine::cuda::empty_cache()?;
    }
    let (baseline, compiled) = match python {
        None => (None, None),
        Some(python) => {
            eprintln!("[bench] PyTorch eager: {BASELINE}");
            let measured = measure_baseline(&python, &config, args, threads, false);
            let eager = measured.context("measuring the PyTorch baseline")?;
            let compiled = args.compiled_baseline.then(|| {
                eprintln!("[bench] PyTorch torch.compile: {BASELINE} --compile");
                measure_baseline(&python, &config, args, threads, true).map_err(|e| format!("{e:#}"))
            });
            (Some(eager), compiled)
        }
    };
    Ok(BenchReport { model, config, threads, ours, baseline, compiled, trace })
}

/// The model, optimizer and precision machinery of our side.
struct Trainer {
    model: Vit,
    /// The model's own parameters (bf16 under `--precision bf16`).
    params: Vec<Param>,
    master: Option<MasterWeights>,
    opt: AdamW,
}

impl Trainer {
    fn new(
        cfg: &VitConfig,
        precision: Precision,
        device: Device,
        backend: kernels::Backend,
    ) -> anyhow::Result<Trainer> {
        let (mut vs, model) = engine::random::seeded(0, || {
            let vs = VarStore::new(device);
            let model = Vit::with_kernels(&vs.root(), *cfg, backend);
            (vs, model)
        });
        let (params, master, opt) = match precision {
            Precision::Fp32 => {
                let params = params_of(&vs);
                let opt = AdamW::new(params_of(&vs), AdamWConfig::default());
                (params, None, opt)
            }
            Precision::Bf16 => {
                // Casts every variable in place (set_data), so `model` computes in bf16.
                vs.bfloat16();
                let master = MasterWeights::new(params_of(&vs))?;
                let opt = AdamW::new(master.master(), AdamWConfig::default());
                (params_of(&vs), Some(master), opt)
            }
            Precision::Fp16 => bail!("--precision fp16: vit bench measures fp32 and bf16"),
        };
        Ok(Trainer { model, params, master, opt })
    }

    /// One forward, backward and optimizer step; gradients are left cleared.
    fn step(&mut self, images: &Tensor, labels: &Tensor) -> anyhow::Result<()> {
        let logits = self.model.forward(images)?;
        // at::cross_entropy_loss, the op F.cross_entropy calls.
        let loss = logits.f_to_kind(Kind::Float)?.f_cross_entropy_loss::<Tensor>(
            labels,
            None,
            tch::Reduction::Mean,
            -100,
            0.0,
        )?;
        engine::autograd::backward(&[&loss], &[None], false)?;
        match &self.master {
            None => {
                self.opt.step()?;
                // set_to_none, as torch's zero_grad: the next backward then takes its gradient
                // buffers as they are instead of adding them into zeroed ones.
                for p in &self.params {
                    engine::autograd::set_grad(&p.tensor, None)?;
                }
            }
            Some(master) => {
                master.gradients_to_master()?;
                self.opt.step()?;
                master.weights_to_model()?; // also clears the model's gradients
            }
        }
        Ok(())
    }
}

fn synchronize(device: Device) -> anyhow::Result<()> {
    if let Device::Cuda(i) = device {
        engine::cuda::synchronize(i)?;
    }
    Ok(())
}

fn measure_ours(
    cfg: &VitConfig,
    args: &BenchArgs,
    device: Device,
    backend: kernels::Backend,
) -> anyhow::Result<(Throughput, Option<String>)> {
    let mut trainer = Trainer::new(cfg, args.precision.precision, device, backend)?;
    let kind = args.precision.precision.kind();
    let (b, c, s) = (args.batch as i64, cfg.in_channels, cfg.image_size);
    let images = Tensor::f_randn([b, c, s, s], (kind, device))?;
    let labels = Tensor::f_randint(cfg.num_classes, [b], (Kind::Int64, device))?;

    if let Device::Cuda(i) = device {
        engine::cuda::reset_peak_stats(i)?;
    }
    for _ in 0..args.warmup {
        trainer.step(&images, &labels)?;
    }
    synchronize(device)?;
    let start = Instant::now();
    let mut steps = 0;
    loop {
        trainer.step(&images, &labels)?;
        steps += 1;
        if done(args, steps, start) {
            break;
        }
    }
    // On CUDA the loop stops once the host has queued `--seconds` of steps; the time includes
    // waiting for them, so the rate is right however far ahead the host ran.
    synchronize(device)?;
    let seconds = start.elapsed().as_secs_f64();
    let peak_memory_bytes = match device {
        Device::Cuda(i) => Some(engine::cuda::memory_stats(i)?.peak_allocated),
        _ => None,
    };
    let trace = match &args.trace {
        Some(dir) => {
            std::fs::create_dir_all(dir).with_context(|| format!("--trace {}", dir.display()))?;
            let chrome = dir.join("vit-step.json");
            Some(engine::kernel_trace::table_of(device.is_cuda(), &chrome, "ours, one step, traced", 25, || {
                trainer.step(&images, &labels)?;
                synchronize(device)
            })?)
        }
        None => None,
    };
    let throughput =
        Throughput { images_per_s: (steps as i64 * b) as f64 / seconds, steps, seconds, peak_memory_bytes };
    Ok((throughput, trace))
}

/// Whether the timed loop has run `--steps` steps, or else for `--seconds`; the baseline
/// stops by the same rule.
fn done(args: &BenchArgs, steps: usize, start: Instant) -> bool {
    match args.steps {
        Some(n) => steps >= n,
        None => start.elapsed().as_secs_f64() >= args.seconds,
    }
}

/// The baseline's command line for the same settings (`compile`: under torch.compile, which
/// compiles during its warm-up, so that takes at least three steps).
fn baseline_args(cfg: &VitConfig, args: &BenchArgs, threads: usize, compile: bool) -> Vec<String> {
    // PyTorch's defaults, which AdamWConfig::default() repeats; passed to be explicit.
    let adamw = AdamWConfig::default();
    let mut a: Vec<String> = [
        ("--width", cfg.width.to_string()),
        ("--depth", cfg.depth.to_string()),
        ("--heads", cfg.heads.to_string()),
        ("--mlp-ratio", cfg.mlp_ratio.to_string()),
        ("--patch", cfg.patch_size.to_string()),
        ("--image-size", cfg.image_size.to_string()),
        ("--channels", cfg.in_channels.to_string()),
        ("--classes", cfg.num_classes.to_string()),
        ("--batch", args.batch.to_string()),
        ("--warmup", if compile { args.warmup.max(3) } else { args.warmup }.to_string()),
        ("--seconds", args.seconds.to_string()),
        ("--threads", threads.to_string()),
        ("--lr", adamw.lr.to_string()),
        ("--weight-decay", adamw.weight_decay.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_string(), v])
    .collect();
    if let Some(n) = args.steps {
        a.extend(["--steps".into(), n.to_string()]);
    }
    let device = args.device.device.resolve().to_string();
    let precision = args.precision.precision.name();
    let bf16 = match args.baseline_bf16 {
        BaselineBf16::Master => "master",
        BaselineBf16::Autocast => "autocast",
    };
    a.extend(["--device", device.as_str(), "--precision", precision, "--bf16", bf16].map(String::from));
    if compile {
        a.push("--compile".into());
    }
    a
}

/// The baseline's interpreter, once its script is known to exist.
fn baseline_python() -> anyhow::Result<String> {
    ensure!(Path::new(BASELINE).is_file(), "the baseline script {BASELINE} is missing");
    engine::baseline::python()
}

/// The variables that point inductor at its cache and Python at its temporary folder (where
/// inductor keeps its precompiled headers whatever the cache).
const INDUCTOR_CACHE: &str = "TORCHINDUCTOR_CACHE_DIR";
const PYTHON_TMPDIR: &str = "TMPDIR";

/// The baseline's process. Under torch.compile, everything inductor writes goes to a folder of
/// its own, which `measure_baseline` empties before the run and removes after it. Inductor's
/// default cache (`/tmp/torchinductor_$USER`) is shared by every checkout, and by every
/// machine that shares `/tmp`; its keys leave out the CPU's vector instructions. A graph cached
/// under AVX-512 and reloaded under AVX2 crashed the baseline here (a bus error; heap
/// corruption the other way round, with `ATEN_CPU_CAPABILITY` choosing), and CI failed
/// building a graph that this machine had cached. Each run pays for its compile, which the
/// warm-up keeps out of the timing. Returns the command and that folder.
fn baseline_command(
    python: &str,
    cfg: &VitConfig,
    args: &BenchArgs,
    threads: usize,
    compile: bool,
) -> (Command, Option<PathBuf>) {
    let mut command = Command::new(python);
    command.arg(BASELINE).args(baseline_args(cfg, args, threads, compile));
    let private = compile.then(|| std::env::temp_dir().join(format!("vit-bench-inductor-{}", std::process::id())));
    if let Some(private) = &private {
        command.env(INDUCTOR_CACHE, private.join("cache")).env(PYTHON_TMPDIR, private);
    }
    (command, private)
}

fn measure_baseline(
    python: &str,
    cfg: &VitConfig,
    args: &BenchArgs,
    threads: usize,
    compile: bool,
) -> anyhow::Result<Throughput> {
    let (mut command, private) = baseline_command(python, cfg, args, threads, compile);
    // A folder that is not there is what removing wants: an earlier process with this id may
    // have left one, and this run's is not needed after it.
    let remove = || {
        if let Some(private) = &private {
            let _ = std::fs::remove_dir_all(private);
        }
    };
    remove();
    if let Some(private) = &private {
        // Python takes a TMPDIR that does not exist for /tmp, silently.
        std::fs::create_dir_all(private).with_context(|| format!("creating {}", private.display()))?;
    }
    let stdout = engine::baseline::run(&mut command, BASELINE);
    remove();
    let json = engine::baseline::last_json(&stdout?, BASELINE)?;
    let number = |key: &str| engine::baseline::number(&json, key);
    Ok(Throughput {
        images_per_s: number("images_per_s")?,
        steps: number("steps")? as usize,
        seconds: number("seconds")?,
        peak_memory_bytes: json["peak_memory_bytes"].as_i64(),
    })
}

fn mib(bytes: Option<i64>) -> String {
    bytes.map_or_else(|| "-".into(), |b| format!("{:.0}", b as f64 / (1 << 20) as f64))
}

/// The report as a Markdown table with a line of details under it.
fn table(args: &BenchArgs, r: &BenchReport) -> String {
    let device = args.device.device.resolve().to_string();
    let precision = match (args.precision.precision, args.baseline_bf16) {
        (Precision::Bf16, BaselineBf16::Master) => "bf16 + fp32 master weights (both)".to_string(),
        (Precision::Bf16, BaselineBf16::Autocast) => {
            "bf16 + fp32 master weights (ours) vs torch.autocast bf16 (PyTorch)".to_string()
        }
        (other, _) => other.name().to_string(),
    };
    let cuda = args.device.device.resolve() == DeviceKind::Cuda;
    let mut s =
        format!("\nViT training throughput: forward + backward + AdamW step, synthetic data, {device}, {precision}\n");
    s += "| model | image | batch | threads | ours img/s | PyTorch img/s | ours/PyTorch |";
    s += if cuda { " ours peak MiB | PyTorch peak MiB |\n" } else { "\n" };
    s += "|---|---:|---:|---:|---:|---:|---:|";
    s += if cuda { "---:|---:|\n" } else { "\n" };
    let (theirs, ratio) = match &r.baseline {
        Some(b) => (format!("{:.2}", b.images_per_s), format!("{:.2}", r.ours.images_per_s / b.images_per_s)),
        None => ("-".into(), "-".into()),
    };
    s += &format!(
        "| {} | {} | {} | {} | {:.2} | {theirs} | {ratio} |",
        r.model, r.config.image_size, args.batch, r.threads, r.ours.images_per_s
    );
    if cuda {
        let theirs_peak = r.baseline.and_then(|b| b.peak_memory_bytes);
        s += &format!(" {} | {} |", mib(r.ours.peak_memory_bytes), mib(theirs_peak));
    }
    match &r.compiled {
        Some(Ok(c)) => {
            s += &format!(
                "\n| {} (PyTorch torch.compile) | {} | {} | {} | {:.2} | {:.2} | {:.2} |",
                r.model,
                r.config.image_size,
                args.batch,
                r.threads,
                r.ours.images_per_s,
                c.images_per_s,
                r.ours.images_per_s / c.images_per_s
            );
            if cuda {
                s += &format!(" {} | {} |", mib(r.ours.peak_memory_bytes), mib(c.peak_memory_bytes));
            }
        }
        Some(Err(why)) => s += &format!("\ntorch.compile baseline not measured: {why}"),
        None => {}
    }
    s += &format!("\ntimed: ours {} steps in {:.2} s", r.ours.steps, r.ours.seconds);
    if let Some(b) = &r.baseline {
        s += &format!(", PyTorch {} steps in {:.2} s", b.steps, b.seconds);
    }
    if let Some(Ok(c)) = &r.compiled {
        s += &format!(", torch.compile {} steps in {:.2} s", c.steps, c.seconds);
    }
    if let Some(trace) = &r.trace {
        s += &format!("\n\n{trace}");
    }
    s + "\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: BenchArgs,
    }

    fn parse(flags: &[&str]) -> BenchArgs {
        Cli::try_parse_from(std::iter::once("bench").chain(flags.iter().copied())).expect("flags parse").args
    }

    const TINY: &[&str] = &[
        "--model",
        "custom",
        "--width",
        "16",
        "--depth",
        "1",
        "--heads",
        "2",
        "--patch-size",
        "4",
        "--image-size",
        "8",
        "--classes",
        "3",
        "--batch",
        "2",
        "--warmup",
        "1",
        "--steps",
        "2",
    ];

    #[test]
    fn presets_and_custom_resolve() {
        let (label, cfg) = parse(&["--image-size", "32"]).config().unwrap();
        assert_eq!(label, "vit_tiny_patch16_224");
        assert_eq!(cfg, VitConfig { image_size: 32, ..VitConfig::tiny(16) });
        let (label, cfg) = parse(TINY).config().unwrap();
        assert_eq!(label, "custom w16 d1 h2 p4");
        assert_eq!((cfg.width, cfg.num_classes, cfg.mlp_ratio), (16, 3, 4.0));
        for name in VitConfig::preset_names() {
            assert!(VitConfig::preset(&name).is_some(), "{name}");
        }
        let (label, cfg) = parse(&["--model", "digits", "--channels", "1"]).config().unwrap();
        assert_eq!((label.as_str(), cfg), ("digits", VitConfig::digits()));
    }

    #[test]
    fn bad_flags_are_errors_that_say_what_to_do() {
        let err = |flags: &[&str]| format!("{:#}", parse(flags).config().unwrap_err());
        let unknown = err(&["--model", "vit_huge_patch14_224"]);
        assert!(unknown.contains("vit_base_patch16_224") && unknown.contains("custom"), "{unknown}");
        assert_eq!(err(&["--model", "custom", "--width", "8"]), "--model custom needs --depth, --heads, --patch-size");
        assert!(err(&["--width", "8"]).contains("custom only"));
        assert!(err(&["--image-size", "100"]).contains("multiple of patch size"));
        // Each flag of the architecture is named with its value, not the whole configuration.
        assert_eq!(err(&["--classes", "0"]), "--classes must be positive, got 0");
        assert_eq!(err(&["--channels", "0"]), "--channels must be positive, got 0");
        assert_eq!(err(&["--image-size=-8"]), "--image-size must be positive, got -8");
        let custom = ["--model", "custom", "--width", "16", "--heads", "2", "--patch-size", "4"];
        assert_eq!(err(&[&custom[..], &["--depth", "0"]].concat()), "--depth must be positive, got 0");
        let ratio = err(&[&custom[..], &["--depth", "1", "--mlp-ratio", "0"]].concat());
        assert_eq!(ratio, "--mlp-ratio must be a positive number, got 0");
        let zero = Cli::try_parse_from(["bench", "--batch", "0"]).err().unwrap().to_string();
        assert!(zero.contains("--batch") && zero.contains("not a batch size"), "{zero}");
        assert_eq!(parse(&["--batch", "2k"]).batch, 2048);
    }

    #[test]
    fn every_side_trains_a_tiny_vit() {
        let mut args = parse(TINY);
        args.no_baseline = std::env::var_os("SUITE_PYTHON").is_none();
        // torch.compile on the CPU: inductor's C++ (about 30 s here, the first time).
        args.compiled_baseline = !args.no_baseline;
        let traces = std::env::temp_dir().join(format!("vit-bench-trace-{}", std::process::id()));
        args.trace = Some(traces.clone());
        let report = bench(&args).unwrap();
        assert_eq!(report.ours.steps, 2);
        assert!(report.ours.images_per_s > 0.0);
        let text = table(&args, &report);
        assert!(text.contains("| custom w16 d1 h2 p4 | 8 | 2 |"), "{text}");
        assert!(
            text.contains("ours, one step, traced") && text.contains("| operator | calls | ms | share |"),
            "{text}"
        );
        assert!(traces.join("vit-step.json").is_file(), "the step's Chrome trace");
        std::fs::remove_dir_all(&traces).unwrap();
        if let Some(b) = report.baseline {
            assert_eq!(b.steps, 2);
            assert!(b.images_per_s > 0.0);
            let compiled = report.compiled.expect("asked for").unwrap();
            assert_eq!(compiled.steps, 2);
            assert!(text.contains("| custom w16 d1 h2 p4 (PyTorch torch.compile) | 8 | 2 |"), "{text}");
        }
    }

    #[test]
    fn a_compiled_baseline_that_cannot_run_is_reported_not_fatal() {
        let args = parse(TINY);
        let (model, config) = args.config().unwrap();
        let side = Throughput { images_per_s: 10.0, steps: 2, seconds: 0.4, peak_memory_bytes: None };
        let why = "vit_baseline.py failed (exit status: 1): BackendCompilerFailed: no C compiler".to_string();
        let report = BenchReport {
            model,
            config,
            threads: 1,
            ours: side,
            baseline: Some(side),
            compiled: Some(Err(why)),
            trace: None,
        };
        let text = table(&args, &report);
        assert!(
            text.contains("torch.compile baseline not measured: vit_baseline.py failed (exit status: 1)"),
            "{text}"
        );
        assert!(!text.contains("(PyTorch torch.compile) |"), "{text}");
    }

    #[test]
    fn a_compiled_baseline_builds_in_a_folder_of_its_own() {
        let args = parse(TINY);
        let (_, cfg) = args.config().unwrap();
        let env = |compile, key| {
            let (command, _) = baseline_command("python3", &cfg, &args, 1, compile);
            let found = command.get_envs().find(|(k, _)| *k == key).and_then(|(_, v)| v);
            found.map(PathBuf::from)
        };
        assert_eq!((env(false, INDUCTOR_CACHE), env(false, PYTHON_TMPDIR)), (None, None));
        let private = env(true, PYTHON_TMPDIR).expect("torch.compile's run has a temporary folder of its own");
        assert!(private.starts_with(std::env::temp_dir()) && private != std::env::temp_dir(), "{}", private.display());
        assert!(private.to_string_lossy().contains(&std::process::id().to_string()), "{}", private.display());
        let cache = env(true, INDUCTOR_CACHE).expect("and a cache");
        assert!(cache.starts_with(&private), "{} outside {}", cache.display(), private.display());
    }

    #[test]
    fn a_step_updates_the_weights_and_leaves_no_gradients() {
        let (_, cfg) = parse(TINY).config().unwrap();
        for (precision, kind) in [(Precision::Fp32, Kind::Float), (Precision::Bf16, Kind::BFloat16)] {
            let mut trainer = Trainer::new(&cfg, precision, Device::Cpu, kernels::Backend::Torch).unwrap();
            let images = Tensor::randn([2, 3, 8, 8], (kind, Device::Cpu));
            let labels = Tensor::from_slice(&[0i64, 2]);
            // The weights AdamW updates: the model's in fp32, the fp32 masters under bf16 (a
            // step of lr = 1e-3 on a norm weight of 1 rounds away in bf16).
            let updated: Vec<Tensor> = trainer.opt.params().iter().map(|p| p.tensor.shallow_clone()).collect();
            let before: Vec<Tensor> = updated.iter().map(|t| t.detach().copy()).collect();
            trainer.step(&images, &labels).unwrap();
            for ((p, now), then) in trainer.params.iter().zip(&updated).zip(&before) {
                assert_eq!((p.tensor.kind(), now.kind()), (kind, Kind::Float), "{}", p.name);
                assert!(!p.tensor.grad().defined(), "{} keeps a gradient", p.name);
                assert!(!now.equal(then), "{} did not move ({precision:?})", p.name);
            }
        }
    }

    #[test]
    fn bf16_with_master_weights_trains() {
        let mut args = parse(TINY);
        args.precision.precision = Precision::Bf16;
        args.no_baseline = true;
        let report = bench(&args).unwrap();
        assert!(report.ours.images_per_s > 0.0);
    }
}
