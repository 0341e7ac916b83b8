//! Pipeline parallelism on a ViT of fixed depth: for each schedule and micro-batch count, the
//! training step's time beside one process without a pipeline (run in the same invocation),
//! each stage's peak memory, and the measured idle fraction beside the simulator's, fed with
//! the costs this run measured, and the textbook formula.
//!
//! `cargo bench -p vit --bench pipeline -- [--pp 2] [--device cpu|cuda] [--batch 32]
//! [--micro-batches 2,8] [--depth 8 --width 192 --heads 3 --image-size 32 --patch-size 4]`
//! (`scripts/bench-pipeline.sh`). Two jobs are spawned on this machine: one process (pp=1),
//! then `--pp` ranks (Gloo on CPU, NCCL on CUDA) that run every case in turn.
//!
//! Fairness: the same model (same seed), the same global batch per step and the same intra-op
//! thread budget: each pipeline rank has `--threads` threads and the one process `pp x
//! --threads`; the one process runs the global batch in one pass (no micro-batches: what it
//! would do given the memory). The one process also runs with `--threads` threads, the
//! pipeline's per-rank share, as a second reference: on a machine busy with other work, more
//! OpenMP threads than free cores slow a step down many times, and that row shows it. A step is forward, backward and an AdamW update of the rank's
//! parameters, with fresh gradients each step. The parts are cut into stages by parameter
//! bytes, as `vit pretrain --pp` does.
//!
//! Measured idle: over the timed steps and every rank, the time blocked on a peer (receives,
//! shape headers, the step's final flush of its sends) over the time inside the pipeline's
//! step (the optimizer's update is outside it); a rank finishing its step early waits at the
//! start of the next, so in steady state this is the bubble. Simulated idle: the schedule's
//! action lists run by the simulator with each rank's measured mean forward, backward and
//! weight-pass times and the measured one-way time of an activation between neighbouring
//! ranks. Posting: the share of the step spent posting sends and receives (on Gloo, a post
//! can wait for the transport thread reading the same connection), which the simulator does not
//! model; the rest of the step is computing. Peak memory: on CPU the engine's host allocator counter (bytes held by tensors in
//! the rank's process: weights, gradients, AdamW state, activations, message buffers), on
//! CUDA the caching allocator's peak allocated bytes; both over the timed steps. On CUDA the
//! step time comes from unmeasured steps (measuring synchronizes after each action) and the
//! idle fractions from as many measured steps after them.
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use clap::Parser;
use engine::dist::{self, InitOptions, SpawnOptions, World};
use engine::optim::{params_of, AdamW, AdamWConfig, Optimizer, Param};
use engine::parallel::pipeline::{
    assign, simulate_ranks, split, textbook_bubble, Balance, Costs, FnLayer, Layer, Pipeline, Schedule, ScheduleKind,
    StepStats,
};
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use vit::model::{Vit, VitConfig};

/// Set in the ranks' environment: the folder their results go to.
const OUT_ENV: &str = "BENCH_VIT_PIPELINE_OUT";
/// Round trips timed for the hop time.
const HOP_ROUNDS: usize = 20;

#[derive(Parser, Clone, Debug)]
#[command(about = "ViT pipeline schedules against one process: step time, memory, idle fractions")]
struct Args {
    /// Pipeline ranks.
    #[arg(long, default_value_t = 2)]
    pp: usize,
    /// Schedules to run (interleaved with --virtual-stages chunks per rank).
    #[arg(long, value_enum, value_delimiter = ',', default_values = ["gpipe", "1f1b", "interleaved", "zb"])]
    schedules: Vec<ScheduleKind>,
    /// Chunks per rank for the interleaved schedule.
    #[arg(long, default_value_t = 2)]
    virtual_stages: usize,
    /// Micro-batch counts per step (default: pp and 4 x pp).
    #[arg(long, value_delimiter = ',')]
    micro_batches: Vec<usize>,
    /// Images per step (the global batch; every micro-batch count must divide it).
    #[arg(long, default_value_t = 32)]
    batch: i64,
    /// Transformer blocks.
    #[arg(long, default_value_t = 8)]
    depth: i64,
    /// Embedding width.
    #[arg(long, default_value_t = 192)]
    width: i64,
    /// Attention heads.
    #[arg(long, default_value_t = 3)]
    heads: i64,
    /// Input side in pixels.
    #[arg(long, default_value_t = 32)]
    image_size: i64,
    /// Patch side in pixels.
    #[arg(long, default_value_t = 4)]
    patch_size: i64,
    /// Classes.
    #[arg(long, default_value_t = 10)]
    classes: i64,
    /// Untimed steps per case.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed steps per case.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Intra-op threads per pipeline rank (the one process gets pp times as many).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// cpu (Gloo) or cuda (NCCL; one GPU per rank where there are enough).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

impl Args {
    fn config(&self) -> anyhow::Result<VitConfig> {
        let cfg = VitConfig {
            image_size: self.image_size,
            patch_size: self.patch_size,
            in_channels: 3,
            num_classes: self.classes,
            width: self.width,
            depth: self.depth,
            heads: self.heads,
            mlp_ratio: 4.0,
        };
        cfg.validate().map_err(anyhow::Error::msg).context("invalid model configuration")?;
        Ok(cfg)
    }

    fn micro_batches(&self) -> Vec<usize> {
        match self.micro_batches.is_empty() {
            true => vec![self.pp, 4 * self.pp],
            false => self.micro_batches.clone(),
        }
    }

    /// The cases a job of `p` ranks runs: one process runs the whole batch once.
    fn cases(&self, p: usize) -> Vec<Case> {
        if p == 1 {
            let one = |threads| Case { pipelined: false, kind: ScheduleKind::GPipe, micro: 1, v: 1, threads };
            return vec![one(self.pp * self.threads), one(self.threads)];
        }
        let mut cases = Vec::new();
        for &micro in &self.micro_batches() {
            for &kind in &self.schedules {
                let v = if kind == ScheduleKind::Interleaved { self.virtual_stages } else { 1 };
                cases.push(Case { pipelined: true, kind, micro, v, threads: self.threads });
            }
        }
        cases
    }

    fn validate(&self) -> anyhow::Result<()> {
        self.config()?;
        ensure!(self.pp >= 2, "--pp {}: the pipeline needs 2 or more ranks (pp=1 runs beside it)", self.pp);
        ensure!(self.threads >= 1 && self.steps >= 1, "--threads and --steps must be positive");
        for m in self.micro_batches() {
            ensure!(m >= 1 && self.batch % m as i64 == 0, "--micro-batches {m} does not divide --batch {}", self.batch);
        }
        for case in self.cases(self.pp) {
            Schedule::new(case.kind, self.pp, case.micro, case.v)
                .with_context(|| format!("--schedules {} with {} micro-batches", case.label(), case.micro))?;
        }
        let parts = self.depth as usize + 2;
        ensure!(
            self.pp * self.virtual_stages <= parts || !self.schedules.contains(&ScheduleKind::Interleaved),
            "--pp {} x --virtual-stages {} stages: the model has only {parts} parts (stem, blocks, head)",
            self.pp,
            self.virtual_stages
        );
        Ok(())
    }
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
struct Case {
    /// Whether the case runs the pipeline (else one process runs the whole model).
    pipelined: bool,
    kind: ScheduleKind,
    micro: usize,
    v: usize,
    /// Intra-op threads of each rank.
    threads: usize,
}

impl Case {
    fn label(&self) -> String {
        match (self.pipelined, self.kind) {
            (false, _) => format!("pp=1, {} thread(s)", self.threads),
            (true, ScheduleKind::Interleaved) => format!("interleaved v={}", self.v),
            (true, kind) => kind.name().into(),
        }
    }
}

/// What one rank measured in one case.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Measured {
    /// Seconds per training step (rank 0's, between barriers).
    step: f64,
    /// Summed over the measured steps: wall time inside the pipeline's step, waiting, and
    /// posting sends and receives.
    wall: f64,
    waiting: f64,
    posting: f64,
    /// Mean seconds per forward, backward and weight pass of a chunk.
    forward: f64,
    backward: f64,
    weight: f64,
    /// One-way seconds of an activation between neighbouring ranks.
    hop: f64,
    /// Peak bytes (see the module comment).
    peak_bytes: u64,
    /// Most micro-batch chunks held at once.
    in_flight: usize,
}

fn rank_main(args: &Args, out: &Path) -> anyhow::Result<()> {
    let world = dist::init(&InitOptions::default())?;
    let p = world.size();
    let device = match args.device.as_str() {
        "cuda" => engine::device::DeviceKind::Cuda.device(world.env.local_rank, world.env.local_world_size)?,
        _ => {
            engine::host_memory::track()?;
            Device::Cpu
        }
    };
    let mut results = Vec::new();
    for case in args.cases(p) {
        tch::set_num_threads(i32::try_from(case.threads)?);
        let measured =
            run_case(args, &world, case, device).with_context(|| format!("{} m={}", case.label(), case.micro))?;
        if world.rank() == 0 {
            eprintln!("[pp={p}] {} m={}: {:.1} ms per step", case.label(), case.micro, measured.step * 1e3);
        }
        results.push(measured);
    }
    let path = out.join(format!("pp{p}-rank{}.json", world.rank()));
    std::fs::write(&path, serde_json::to_string(&results)?).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

fn run_case(args: &Args, world: &World, case: Case, device: Device) -> anyhow::Result<Measured> {
    let (p, rank) = (world.size(), world.rank());
    let cfg = args.config()?;
    let chunks = {
        tch::manual_seed(0);
        let vs = VarStore::new(device);
        let model = Vit::new(&vs.root(), cfg);
        let params = params_of(&vs);
        let layers: Vec<Box<dyn Layer>> = model
            .into_parts()
            .into_iter()
            .map(|part| {
                let own = params.iter().filter(|q| part.owns(&q.name)).map(Param::shallow_copy).collect();
                Box::new(FnLayer::new(own, move |x: &Tensor, _: &[Param]| {
                    part.forward(x).map_err(|e| engine::Error::invalid(format!("{e:#}")))
                })) as Box<dyn Layer>
            })
            .collect();
        let cut = split(&layers, p * case.v, Balance::ParameterBytes)?;
        // The other stages' layers, and with the store their weights, are dropped here.
        assign(layers, &cut, rank, p)?
    };
    let mut pipe = Pipeline::new(&world.group, chunks, Schedule::new(case.kind, p, case.micro, case.v)?, device)?;
    let mut opt = AdamW::new(pipe.params(), AdamWConfig::default());
    tch::manual_seed(1);
    let rows = args.batch / case.micro as i64;
    let size = args.image_size;
    let images = Tensor::randn([args.batch, 3, size, size], (Kind::Float, device));
    let labels = Tensor::randint(args.classes, [args.batch], (Kind::Int64, device));
    let inputs: Vec<Tensor> = (0..case.micro as i64).map(|i| images.narrow(0, i * rows, rows)).collect();
    let mut loss = |i: usize, logits: &Tensor| -> engine::Result<Tensor> {
        Ok(logits.cross_entropy_for_logits(&labels.narrow(0, i as i64 * rows, rows)))
    };
    let mut step = |pipe: &mut Pipeline, stats: Option<&mut StepStats>| -> anyhow::Result<()> {
        opt.zero_grad();
        pipe.step(&inputs, &mut loss)?;
        opt.step()?;
        if let Some(total) = stats {
            total.accumulate(pipe.last_stats().context("a measured step has stats")?);
        }
        Ok(())
    };
    for _ in 0..args.warmup {
        step(&mut pipe, None)?;
    }
    let tokens = cfg.num_patches() + 1;
    let hop = pipe.hop_time(&Tensor::zeros([rows, tokens, cfg.width], (Kind::Float, device)), HOP_ROUNDS)?;
    let settle = || -> anyhow::Result<()> {
        if let Device::Cuda(d) = device {
            engine::cuda::synchronize(d)?;
        }
        Ok(())
    };
    settle()?;
    match device {
        Device::Cuda(d) => engine::cuda::reset_peak_stats(d)?,
        _ => engine::host_memory::reset_peak()?,
    }
    // On CPU measuring reads a clock per action, so the measured steps are the timed ones;
    // on CUDA it synchronizes, so they come after.
    let separate = device.is_cuda();
    let mut total = StepStats::default();
    pipe.measure(!separate);
    world.group.barrier()?;
    let start = Instant::now();
    for _ in 0..args.steps {
        step(&mut pipe, (!separate).then_some(&mut total))?;
    }
    settle()?;
    world.group.barrier()?;
    let seconds = start.elapsed().as_secs_f64() / args.steps as f64;
    if separate {
        pipe.measure(true);
        for _ in 0..args.steps {
            step(&mut pipe, Some(&mut total))?;
        }
        world.group.barrier()?;
    }
    let peak_bytes = match device {
        Device::Cuda(d) => engine::cuda::memory_stats(d)?.peak_allocated.max(0) as u64,
        _ => engine::host_memory::stats()?.peak.max(0) as u64,
    };
    let costs = total.costs(hop);
    Ok(Measured {
        step: seconds,
        wall: total.wall,
        waiting: total.waiting,
        posting: total.posting.seconds,
        forward: costs.forward,
        backward: costs.input_grad,
        weight: costs.weight_grad,
        hop,
        peak_bytes,
        in_flight: pipe.peak_in_flight(),
    })
}

/// Runs a job of `p` ranks of this program, its results written to `out`.
fn job(p: usize, out: &Path) -> anyhow::Result<()> {
    dist::spawn(&SpawnOptions {
        nproc: p,
        program: std::env::current_exe()?,
        args: std::env::args_os().skip(1).collect(),
        env: vec![(OUT_ENV.into(), out.display().to_string())],
        echo: true,
        heartbeat: None,
    })?;
    Ok(())
}

fn read(out: &Path, p: usize, rank: usize) -> anyhow::Result<Vec<Measured>> {
    let path = out.join(format!("pp{p}-rank{rank}.json"));
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn mib(bytes: u64) -> String {
    format!("{:.0}", bytes as f64 / (1u64 << 20) as f64)
}

/// Values per stage joined with " / ".
fn per_stage<T>(ranks: &[Vec<Measured>], i: usize, f: impl Fn(&Measured) -> T) -> Vec<T> {
    ranks.iter().map(|r| f(&r[i])).collect()
}

fn join(values: &[String]) -> String {
    values.join(" / ")
}

/// `one`: the one process's measurements, with the pipeline's whole thread budget and then
/// with one rank's share; `ranks`: each pipeline rank's, case by case.
fn table(args: &Args, one: &[Measured], ranks: &[Vec<Measured>]) -> anyhow::Result<String> {
    ensure!(one.len() == 2, "the pp=1 job wrote {} results, expected 2", one.len());
    let p = args.pp;
    let cfg = args.config()?;
    let memory = match args.device.as_str() {
        "cuda" => "CUDA caching allocator's peak allocated",
        _ => "host allocator counter's peak: tensor bytes held by the rank",
    };
    let mut s = format!(
        "\nViT depth {} width {} heads {} ({} px images, {} px patches, {} tokens), batch {} per step, fp32 on {}; \
         pp={p} ranks x {} intra-op thread(s) against one process with {} thread(s) (and with {}); {} warm-up and {} timed \
         steps per case; memory: {memory} (MiB per stage, rank 0 first)\n\n",
        cfg.depth,
        cfg.width,
        cfg.heads,
        cfg.image_size,
        cfg.patch_size,
        cfg.num_patches() + 1,
        args.batch,
        if args.device == "cuda" { "CUDA (NCCL)" } else { "CPU (Gloo)" },
        args.threads,
        p * args.threads,
        args.threads,
        args.warmup,
        args.steps,
    );
    s.push_str(
        "| schedule | micro-batches | step (ms) | speed-up over pp=1, same threads in all | over pp=1, one rank's \
         threads | peak memory per stage (MiB) | in flight per stage | measured idle | posting | simulated idle \
         (measured costs) | textbook bubble |\n|---|---:|---:|---:|---:|---|---|---:|---:|---:|---:|\n",
    );
    let (budget, share) = (one[0].step, one[1].step);
    for (case, m) in args.cases(1).iter().zip(one) {
        s.push_str(&format!(
            "| {} | 1 | {:.1} | {:.2} | {:.2} | {} | 1 | - | - | - | - |\n",
            case.label(),
            m.step * 1e3,
            budget / m.step,
            share / m.step,
            mib(m.peak_bytes)
        ));
    }
    let mut costs_table = String::from(
        "\nMeasured mean costs per stage (ms; rank 0 first) and the one-way time of an activation between \
         neighbouring ranks:\n\n| schedule | micro-batches | forward | backward | weight pass | hop |\n|---|---:|---|---|---|---:|\n",
    );
    for (i, case) in args.cases(p).iter().enumerate() {
        let schedule = Schedule::new(case.kind, p, case.micro, case.v)?;
        let rank_costs: Vec<Costs> = per_stage(ranks, i, |m| Costs {
            forward: m.forward,
            input_grad: m.backward,
            weight_grad: m.weight,
            hop: m.hop,
        });
        let simulated = simulate_ranks(&schedule, &rank_costs)?.bubble;
        let sum = |f: fn(&Measured) -> f64| per_stage(ranks, i, f).iter().sum::<f64>();
        let (waiting, posting, wall) = (sum(|m| m.waiting), sum(|m| m.posting), sum(|m| m.wall));
        let step = ranks[0][i].step;
        s.push_str(&format!(
            "| {} | {} | {:.1} | {:.2} | {:.2} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
            case.label(),
            case.micro,
            step * 1e3,
            budget / step,
            share / step,
            join(&per_stage(ranks, i, |m| mib(m.peak_bytes))),
            join(&per_stage(ranks, i, |m| m.in_flight.to_string())),
            waiting / wall,
            posting / wall,
            simulated,
            textbook_bubble(case.kind, p, case.micro, case.v),
        ));
        let ms = |f: fn(&Measured) -> f64| join(&per_stage(ranks, i, |m| format!("{:.2}", f(m) * 1e3)));
        costs_table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.3} |\n",
            case.label(),
            case.micro,
            ms(|m| m.forward),
            ms(|m| m.backward),
            if case.kind == ScheduleKind::ZeroBubbleH1 { ms(|m| m.weight) } else { "-".into() },
            ranks[0][i].hop * 1e3
        ));
    }
    s.push_str(&costs_table);
    Ok(s)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Ok(out) = std::env::var(OUT_ENV) {
        return rank_main(&args, &PathBuf::from(out));
    }
    args.validate()?;
    if args.device == "cuda" {
        let gpus = engine::cuda::device_count();
        if gpus == 0 {
            bail!("--device cuda, but libtorch sees no CUDA device");
        }
        if gpus < args.pp {
            eprintln!(
                "[bench] {} ranks share {gpus} GPU(s): NCCL may refuse two ranks on one device (it wants one GPU per \
                 rank); if it does, the error below says so",
                args.pp
            );
        }
    }
    let out = std::env::temp_dir().join(format!("bench-vit-pipeline-{}", std::process::id()));
    std::fs::create_dir_all(&out)?;
    let result = (|| -> anyhow::Result<String> {
        eprintln!("[bench] one process (pp=1)");
        job(1, &out).context("the one-process job (pp=1)")?;
        eprintln!("[bench] {} pipeline ranks", args.pp);
        job(args.pp, &out).with_context(|| {
            format!("the pipeline job (pp={}{})", args.pp, if args.device == "cuda" { ", NCCL" } else { ", Gloo" })
        })?;
        let one = read(&out, 1, 0)?;
        let ranks = (0..args.pp).map(|r| read(&out, args.pp, r)).collect::<anyhow::Result<Vec<_>>>()?;
        table(&args, &one, &ranks)
    })();
    let _ = std::fs::remove_dir_all(&out);
    match result {
        Ok(table) => {
            println!("{table}");
            Ok(())
        }
        Err(e) if args.device == "cuda" => {
            println!("\nNo table: the CUDA run failed ({e:#}). NCCL runs one rank per GPU; on a machine with fewer GPUs than --pp it may refuse.");
            Err(e)
        }
        Err(e) => Err(e),
    }
}
