//! Step time of each pipeline schedule on 2 local ranks (Gloo, CPU, one thread per rank), side
//! by side with `torch.distributed.pipelining` on the same model, sizes and micro-batches run
//! in the same invocation (`benches/pipeline_baseline.py`), and the ratio ours / PyTorch's.
//! Beside them, the simulator's predicted step time relative to 1F1B, to compare the shape.
//!
//! `cargo bench -p engine --bench pipeline`. The model: 8 layers of `tanh(x W + b)`, width
//! 1024, a batch of 256 rows in 8 micro-batches; forward and backward only (no optimizer).
//! PyTorch has no one-chunk ZB-H1; its row is left empty.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::Context;
use engine::dist::{self, InitOptions, SpawnOptions};
use engine::optim::Param;
use engine::parallel::pipeline::{
    assign, simulate, split, Balance, Costs, FnLayer, Layer, Pipeline, Schedule, ScheduleKind,
};
use tch::{Device, Kind, Tensor};

const RANKS: usize = 2;
const LAYERS: usize = 8;
const WIDTH: i64 = 1024;
const BATCH: i64 = 256;
const MICRO: usize = 8;
const WARMUP: usize = 2;
const STEPS: usize = 5;
const OUT_ENV: &str = "BENCH_PIPELINE_OUT";

fn schedules() -> [(ScheduleKind, usize); 4] {
    [
        (ScheduleKind::GPipe, 1),
        (ScheduleKind::OneFOneB, 1),
        (ScheduleKind::Interleaved, 2),
        (ScheduleKind::ZeroBubbleH1, 1),
    ]
}

fn layers() -> Vec<Box<dyn Layer>> {
    (0..LAYERS)
        .map(|i| {
            tch::manual_seed(i as i64);
            let w = (Tensor::randn([WIDTH, WIDTH], (Kind::Float, Device::Cpu)) / (WIDTH as f64).sqrt())
                .set_requires_grad(true);
            let b = Tensor::zeros([WIDTH], (Kind::Float, Device::Cpu)).set_requires_grad(true);
            let params = vec![Param::new(format!("l{i}.w"), &w), Param::new(format!("l{i}.b"), &b)];
            Box::new(FnLayer::new(params, |x: &Tensor, p: &[Param]| {
                Ok(x.f_matmul(&p[0].tensor)?.f_add(&p[1].tensor)?.f_tanh()?)
            })) as Box<dyn Layer>
        })
        .collect()
}

/// Seconds per step of each schedule, measured on rank 0 between barriers.
fn rank_main(out: PathBuf) -> anyhow::Result<()> {
    tch::set_num_threads(1);
    let world = dist::init(&InitOptions::default())?;
    let g = &world.group;
    let rows = BATCH / MICRO as i64;
    tch::manual_seed(100);
    let x = Tensor::randn([BATCH, WIDTH], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([BATCH, WIDTH], (Kind::Float, Device::Cpu));
    let inputs: Vec<Tensor> = (0..MICRO as i64).map(|i| x.narrow(0, i * rows, rows)).collect();
    let mut results = BTreeMap::new();
    for (kind, v) in schedules() {
        let model = layers();
        let cut = split(&model, RANKS * v, Balance::Count)?;
        let chunks = assign(model, &cut, g.rank(), RANKS)?;
        let mut pipe = Pipeline::new(g, chunks, Schedule::new(kind, RANKS, MICRO, v)?, Device::Cpu)?;
        let params = pipe.params();
        let mut loss = |i: usize, out: &Tensor| -> engine::Result<Tensor> {
            Ok((out - y.narrow(0, i as i64 * rows, rows)).f_square()?.f_mean(Kind::Float)?)
        };
        let mut run = |pipe: &mut Pipeline| -> anyhow::Result<()> {
            for p in &params {
                engine::autograd::set_grad(&p.tensor, None)?;
            }
            pipe.step(&inputs, &mut loss)?;
            Ok(())
        };
        for _ in 0..WARMUP {
            run(&mut pipe)?;
        }
        g.barrier()?;
        let start = Instant::now();
        for _ in 0..STEPS {
            run(&mut pipe)?;
        }
        g.barrier()?;
        results.insert(kind.name().to_string(), start.elapsed().as_secs_f64() / STEPS as f64);
    }
    if world.rank() == 0 {
        std::fs::write(&out, serde_json::to_string(&results)?)?;
    }
    Ok(())
}

fn read(path: &PathBuf) -> anyhow::Result<BTreeMap<String, f64>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn main() -> anyhow::Result<()> {
    if let Ok(out) = std::env::var(OUT_ENV) {
        return rank_main(out.into());
    }
    let dir = std::env::temp_dir().join(format!("bench-pipeline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let (ours_path, theirs_path) = (dir.join("ours.json"), dir.join("torch.json"));
    dist::spawn(&SpawnOptions {
        nproc: RANKS,
        program: std::env::current_exe()?,
        args: vec![],
        env: vec![(OUT_ENV.into(), ours_path.display().to_string())],
        echo: true,
        heartbeat: None,
    })?;

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/pipeline_baseline.py");
    // It writes its figures to a file, beside ours.
    engine::baseline::run(
        Command::new(engine::baseline::python()?)
            .arg(&script)
            .arg(&theirs_path)
            .args([LAYERS, WIDTH as usize, BATCH as usize, MICRO, WARMUP, STEPS].map(|n| n.to_string())),
        "the PyTorch baseline",
    )?;

    let (ours, theirs) = (read(&ours_path)?, read(&theirs_path)?);
    let predicted = |kind: ScheduleKind, v: usize| -> anyhow::Result<f64> {
        // A chunk holds 1/v of a rank's layers.
        let unit = 1.0 / v as f64;
        let costs = Costs { forward: unit, input_grad: unit, weight_grad: unit, hop: 0.0 };
        Ok(simulate(&Schedule::new(kind, RANKS, MICRO, v)?, costs)?.makespan)
    };
    let one_f_one_b = predicted(ScheduleKind::OneFOneB, 1)?;
    println!("\nstep time, {RANKS} ranks, Gloo on loopback, CPU float32, {LAYERS} layers of width {WIDTH}, batch {BATCH} in {MICRO} micro-batches (ms)");
    println!("| schedule | engine | torch.distributed.pipelining | ratio | simulated / 1f1b | measured / 1f1b |");
    println!("|---|---:|---:|---:|---:|---:|");
    let ours_1f1b = ours.get("1f1b").copied().unwrap_or(f64::NAN);
    for (kind, v) in schedules() {
        let name = kind.name();
        let mine = ours.get(name).copied().unwrap_or(f64::NAN);
        let base = theirs.get(name).copied().unwrap_or(f64::NAN);
        println!(
            "| {name} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} |",
            mine * 1e3,
            base * 1e3,
            mine / base,
            predicted(kind, v)? / one_f_one_b,
            mine / ours_1f1b
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
