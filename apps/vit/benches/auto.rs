//! The automatic planner against the manual layouts: for `vit pretrain` on `--nproc` ranks (CPU
//! ranks, or with `--device cuda` a GPU each), every layout vit can run that the planner says
//! fits (dp/tp/sp/pp sizes, tensor-parallel mode and ZeRO stage; for each, the micro-batches
//! and checkpointed blocks the planner prices fastest, and the `--parallel auto` plan itself;
//! on one rank, where ZeRO means nothing, the accumulation steps and checkpointed blocks
//! instead: [`vit::plan::compared`]) trains a few steps in one job, and each prints the planner's predicted step time and peak
//! memory per device beside the measured ones (the model's error), then the `--parallel auto`
//! plan's measured step time over the best manual layout's.
//!
//! `--repeat-digits N` trains on the embedded digits repeated to N images (an HDF5 file in the
//! temporary folder, removed at the end): for batches larger than the digits' 1,500.
//!
//! `cargo bench -p vit --bench auto -- [--nproc 4] [--batch 32] [--warmup-steps 3]
//! [--measured-steps 20] [--threads 1] [--cluster cluster.json] [any vit pretrain flag: --model,
//! --image-size, --patch-size, ...]` (`scripts/bench-auto.sh`).
//!
//! Every layout runs through `vit::train::Trainer`, the path `vit pretrain` takes, built from
//! the same layout `--parallel auto` trains with ([`vit::layout::Layout::from_plan`]). Step time: the median
//! of the measured steps (after the warm-up steps) on rank 0; each step ends in an all-reduce
//! of the loss, so the ranks leave it together. Peak memory: the engine's host allocator
//! counter on the CPU, the caching allocator's on a GPU (bytes held by tensors: weights,
//! gradients, optimizer state, activations, message buffers) over the measured steps, the
//! largest over the ranks. The prediction is for the cluster given with --cluster, else for
//! the default one with this machine's figures (on a GPU, the GPU's, in the run's
//! `--precision`) and link latency and bandwidth measured by the ranks first, as
//! `--parallel auto` does; `--memory-mib` sets its devices' memory, and the cluster line
//! printed is the cluster priced.
use std::time::Instant;

use anyhow::Context;
use clap::Parser;
use engine::dist::{self, InitOptions, ReduceOp, SpawnOptions, World};
use engine::planner::{Estimate, Plan};
use tch::{Device, Tensor};
use vit::args::PretrainArgs;
use vit::layout::Layout;
use vit::plan::{choose, compared, Choice};
use vit::train::Trainer;

/// Set in the ranks' environment: the file rank 0 writes the table to.
const OUT_ENV: &str = "BENCH_VIT_AUTO_OUT";
/// Set in the ranks' environment with --repeat-digits: the repeated digits' HDF5 file.
const DATA_ENV: &str = "BENCH_VIT_AUTO_DATA";

/// Writes the embedded digits' training images repeated to `count` images to `path`.
fn repeat_digits(path: &std::path::Path, count: usize) -> anyhow::Result<()> {
    let digits = vit::datasets::DataArgs::default().splits()?.train;
    let [c, h, w] = {
        let (image, _) = digits.get(0)?;
        [image.channels, image.height, image.width]
    };
    let examples = (0..count).map(|i| digits.get(i % digits.len()));
    data::h5::write_hdf5(path, [c, h, w], digits.classes(), count, examples)?;
    Ok(())
}

#[derive(Parser, Clone, Debug)]
#[command(
    about = "Every ViT layout that fits: predicted against measured step time and memory, and --parallel auto",
    mut_arg("nproc", |a| a.default_value("4"))
)]
struct Args {
    /// Steps run before the measured ones (each layout).
    #[arg(long, default_value_t = 3)]
    warmup_steps: usize,
    /// Steps measured (each layout): 20 medians steady within a few percent on a shared
    /// 2-core machine, where 5 moved by tens of percent.
    #[arg(long, default_value_t = 20)]
    measured_steps: usize,
    /// Intra-op threads per rank.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Train on the embedded digits repeated to this many images (for large --batch).
    #[arg(long)]
    repeat_digits: Option<usize>,
    /// Memory per device the planner plans for, MiB, with the machine's measured figures
    /// otherwise (where --cluster would assume them all).
    #[arg(long)]
    memory_mib: Option<f64>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
    /// The model, batch, ranks (--nproc) and cluster, as `vit pretrain` takes them.
    #[command(flatten)]
    pretrain: PretrainArgs,
}

/// One layout's figures.
struct Row {
    plan: Plan,
    predicted: Estimate,
    /// Median step seconds.
    step_s: f64,
    /// Peak bytes on the fullest rank.
    peak_bytes: f64,
    /// The last step's loss (a sanity check that every layout trains the same model).
    loss: f64,
}

/// The plans to run ([`vit::plan::compared`]: the planner's choice among them), with their
/// estimates and where the cluster's figures come from (a collective: the ranks measure the
/// machine together unless --cluster is given). The cluster line describes the cluster priced,
/// `--memory-mib` included.
fn layouts(args: &PretrainArgs, memory_mib: Option<f64>, world: &World, device: Device) -> anyhow::Result<Layouts> {
    let nproc = world.size();
    let memory = memory_mib.map(|mib| mib * (1u64 << 20) as f64);
    let (cluster, line) = vit::plan::cluster_with_memory(args, nproc, Some(&world.group), device, memory)?;
    let Choice { cfg, model, solution } = choose(args, nproc, &cluster, device, Some(&world.group))?;
    let cases = compared(&cfg, &model, &cluster, nproc, args.batch, &solution.best.plan)?;
    Ok(Layouts { cases, auto: solution.best.plan, cluster: line, depth: cfg.depth as usize })
}

/// What [`layouts`] found.
struct Layouts {
    /// The plans to run, with their estimates.
    cases: Vec<(Plan, Estimate)>,
    /// The planner's choice.
    auto: Plan,
    /// Where the cluster's figures come from.
    cluster: String,
    /// The model's blocks.
    depth: usize,
}

/// The peak a layout is measured by: the host allocator's on the CPU, the caching allocator's
/// bytes in tensors on a GPU (what the planner's memory model counts, either way).
struct Peak {
    device: Device,
}

impl Peak {
    fn reset(&self) -> anyhow::Result<()> {
        match self.device {
            Device::Cuda(d) => engine::cuda::reset_peak_stats(d)?,
            _ => engine::host_memory::reset_peak()?,
        }
        Ok(())
    }

    fn bytes(&self) -> anyhow::Result<f64> {
        Ok(match self.device {
            Device::Cuda(d) => engine::cuda::memory_stats(d)?.peak_allocated as f64,
            _ => engine::host_memory::stats()?.peak as f64,
        })
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn rank_main(args: &Args, out: &std::path::Path) -> anyhow::Result<()> {
    let world = dist::init(&InitOptions::default())?;
    engine::host_memory::track()?;
    tch::set_num_threads(i32::try_from(args.threads)?);
    let mut pretrain = args.pretrain.clone();
    if let Ok(path) = std::env::var(DATA_ENV) {
        pretrain.data.data = Some(path.into());
    }
    let device = pretrain.job.launch.device.device.device(world.rank(), world.size())?;
    let memory = Peak { device };
    let Layouts { cases, auto, cluster, depth } = layouts(&pretrain, args.memory_mib, &world, device)?;
    if world.rank() == 0 {
        eprintln!("[bench] {} layouts fit; the planner's choice: {auto}\n[bench] {cluster}", cases.len());
    }
    let mut rows = Vec::new();
    for (i, (plan, predicted)) in cases.into_iter().enumerate() {
        let mut run = pretrain.clone();
        run.layout.planner = None;
        run.steps = Some(args.warmup_steps + args.measured_steps);
        run.job.quiet = true;
        let layout = Layout::from_plan(&plan, run.batch, depth)?;
        let mut trainer = Trainer::new(&run, layout, &world).with_context(|| format!("{plan}"))?;
        for _ in 0..args.warmup_steps {
            trainer.step()?;
        }
        memory.reset()?;
        let mut times = Vec::new();
        let mut loss = f64::NAN;
        for _ in 0..args.measured_steps {
            let start = Instant::now();
            loss = trainer.step()?.record.loss;
            times.push(start.elapsed().as_secs_f64());
        }
        let peak = Tensor::from_slice(&[memory.bytes()?]);
        world.group.all_reduce(&peak, ReduceOp::Max)?;
        drop(trainer);
        let row = Row { plan, predicted, step_s: median(times), peak_bytes: peak.double_value(&[0]), loss };
        if world.rank() == 0 {
            eprintln!("[bench] {:>3}: {:.2} ms  {}", i + 1, row.step_s * 1e3, row.plan);
        }
        rows.push(row);
    }
    if world.rank() == 0 {
        let text = cluster + &table(args, world.size(), &rows, &auto)?;
        std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

fn mib(bytes: f64) -> f64 {
    bytes / (1u64 << 20) as f64
}

/// The prediction's error relative to the measurement, in percent.
fn error(predicted: f64, measured: f64) -> f64 {
    100.0 * (predicted / measured - 1.0)
}

fn table(args: &Args, nproc: usize, rows: &[Row], auto: &Plan) -> anyhow::Result<String> {
    let a = &args.pretrain;
    let mut s = format!(
        "\nViT on {nproc} {} ({} thread(s) each), global batch {}, {} layouts that the planner says fit; \
         median of {} steps after {} warm-up steps\n\n\
         | layout | predicted step (ms) | measured step (ms) | time error | predicted memory (MiB) | measured peak \
         (MiB) | memory error | loss |\n|---|---|---|---|---|---|---|---|\n",
        match a.job.launch.device.device.resolve() {
            engine::device::DeviceKind::Cuda => "GPU rank(s)",
            _ => "CPU ranks",
        },
        args.threads,
        a.batch,
        rows.len(),
        args.measured_steps,
        args.warmup_steps
    );
    for r in rows {
        let mark = if &r.plan == auto { " (auto)" } else { "" };
        s += &format!(
            "| {}{mark} | {:.3} | {:.2} | {:+.0}% | {:.2} | {:.2} | {:+.0}% | {:.4} |\n",
            r.plan,
            r.predicted.step_s * 1e3,
            r.step_s * 1e3,
            error(r.predicted.step_s, r.step_s),
            mib(r.predicted.memory_bytes),
            mib(r.peak_bytes),
            error(r.predicted.memory_bytes, r.peak_bytes),
            r.loss
        );
    }
    let best = rows.iter().min_by(|x, y| x.step_s.total_cmp(&y.step_s)).context("no layout ran")?;
    let chosen = rows.iter().find(|r| &r.plan == auto).context("the auto plan is not among the layouts")?;
    // Where the auto plan's measured time ranks it among the layouts.
    let place = rows.iter().filter(|r| r.step_s < chosen.step_s).count() + 1;
    let abs_errors = |f: fn(&Row) -> f64| median(rows.iter().map(f).collect());
    s += &format!(
        "\nmedian |time error| {:.0}%, median |memory error| {:.0}%\n\
         auto plan: {auto}: {:.2} ms measured, place {place} of {} by measured time\n\
         best manual layout: {}: {:.2} ms\nauto / best manual step time: {:.3}\n",
        abs_errors(|r| error(r.predicted.step_s, r.step_s).abs()),
        abs_errors(|r| error(r.predicted.memory_bytes, r.peak_bytes).abs()),
        chosen.step_s * 1e3,
        rows.len(),
        best.plan,
        best.step_s * 1e3,
        chosen.step_s / best.step_s
    );
    Ok(s)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Ok(out) = std::env::var(OUT_ENV) {
        return rank_main(&args, std::path::Path::new(&out));
    }
    anyhow::ensure!(args.measured_steps >= 1 && args.threads >= 1, "--measured-steps and --threads must be positive");
    let nproc = args.pretrain.job.launch.nproc;
    let out = std::env::temp_dir().join(format!("bench-vit-auto-{}.md", std::process::id()));
    let mut env = vec![(OUT_ENV.into(), out.display().to_string())];
    let data = std::env::temp_dir().join(format!("bench-vit-auto-{}.h5", std::process::id()));
    if let Some(count) = args.repeat_digits {
        repeat_digits(&data, count)?;
        env.push((DATA_ENV.into(), data.display().to_string()));
    }
    let spawned = dist::spawn(&SpawnOptions {
        nproc,
        program: std::env::current_exe()?,
        args: std::env::args_os().skip(1).collect(),
        env,
        echo: true,
        heartbeat: None,
    });
    let table = std::fs::read_to_string(&out);
    let _ = std::fs::remove_file(&out);
    let _ = std::fs::remove_file(&data);
    spawned?;
    print!("{}", table.with_context(|| format!("reading {}", out.display()))?);
    Ok(())
}
