//! Bus bandwidth of all_reduce and all_to_all on 2 local ranks (Gloo, CPU tensors), 4 KiB to
//! 64 MiB, side by side with the same measurement through PyTorch's `torch.distributed` (the
//! same c10d engine) run in the same invocation, and the ratio ours / PyTorch's.
//!
//! `cargo bench -p engine --bench collectives` (scripts/bench-collectives.sh sets things up).
//! Bus bandwidth follows nccl-tests: all_reduce moves 2 (n-1)/n of the buffer per rank,
//! all_to_all (n-1)/n.
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use engine::dist::{self, InitOptions, ProcessGroup, ReduceOp, SpawnOptions};
use tch::{Device, Kind, Tensor};

const RANKS: usize = 2;
const OUT_ENV: &str = "BENCH_COLLECTIVES_OUT";
/// Measure each size for about this long (after warm-up).
const BUDGET: Duration = Duration::from_millis(400);

fn sizes() -> Vec<i64> {
    (0..8).map(|i| 4096i64 << (2 * i)).collect() // 4 KiB, 16 KiB, ..., 64 MiB
}

/// Seconds per call of `op`, timed on rank 0 after a barrier; every rank runs the same count.
fn time(group: &ProcessGroup, mut op: impl FnMut() -> engine::Result<()>) -> anyhow::Result<f64> {
    for _ in 0..3 {
        op()?;
    }
    // Rank 0 picks the iteration count so that every rank runs the same number of calls.
    group.barrier()?;
    let start = Instant::now();
    op()?;
    let once = start.elapsed().as_secs_f64().max(1e-6);
    let iters = Tensor::from_slice(&[((BUDGET.as_secs_f64() / once) as i64).clamp(5, 2000)]);
    group.broadcast(&iters, 0)?;
    let iters = iters.int64_value(&[0]);
    group.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        op()?;
    }
    Ok(start.elapsed().as_secs_f64() / iters as f64)
}

fn rank_main(out: PathBuf) -> anyhow::Result<()> {
    let world = dist::init(&InitOptions::default())?;
    let g = &world.group;
    let n = g.size() as f64;
    let mut rows = Vec::new();
    for bytes in sizes() {
        let x = Tensor::ones([bytes / 4], (Kind::Float, Device::Cpu));
        let t = time(g, || g.all_reduce(&x, ReduceOp::Sum))?;
        rows.push(("all_reduce", bytes, bytes as f64 * 2.0 * (n - 1.0) / n / t));
        // Into a preallocated output, as the baseline's all_to_all_single does.
        let (y, splits) = (x.empty_like(), vec![bytes / 4 / g.size() as i64; g.size()]);
        let t = time(g, || g.all_to_all_into_async(&y, &x, &splits, &splits)?.wait())?;
        rows.push(("all_to_all", bytes, bytes as f64 * (n - 1.0) / n / t));
    }
    if world.rank() == 0 {
        let json: Vec<_> =
            rows.iter().map(|(op, b, bw)| serde_json::json!({"op": op, "bytes": b, "busbw": bw})).collect();
        std::fs::write(&out, serde_json::to_string(&json)?)?;
    }
    Ok(())
}

type Table = BTreeMap<(String, i64), f64>;

fn read(path: &PathBuf) -> anyhow::Result<Table> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let rows: Vec<serde_json::Value> = serde_json::from_str(&text)?;
    Ok(rows
        .iter()
        .map(|r| {
            (
                (r["op"].as_str().unwrap_or("?").to_string(), r["bytes"].as_i64().unwrap_or(0)),
                r["busbw"].as_f64().unwrap_or(0.0),
            )
        })
        .collect())
}

fn human(bytes: i64) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn main() -> anyhow::Result<()> {
    if let Ok(out) = std::env::var(OUT_ENV) {
        return rank_main(out.into());
    }
    let dir = std::env::temp_dir().join(format!("bench-collectives-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let (ours_path, theirs_path) = (dir.join("ours.json"), dir.join("torch.json"));

    let program = std::env::current_exe()?;
    dist::spawn(&SpawnOptions {
        nproc: RANKS,
        program,
        args: vec![],
        env: vec![(OUT_ENV.into(), ours_path.display().to_string())],
        echo: true,
        heartbeat: None,
    })?;

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("benches/collectives_baseline.py");
    // It writes its figures to a file, beside ours.
    engine::baseline::run(
        Command::new(engine::baseline::python()?)
            .arg(&script)
            .arg(&theirs_path)
            .env("OMP_NUM_THREADS", std::env::var("OMP_NUM_THREADS").unwrap_or_else(|_| "1".into())),
        "the PyTorch baseline",
    )?;

    let (ours, theirs) = (read(&ours_path)?, read(&theirs_path)?);
    println!("\nbus bandwidth, {RANKS} ranks, Gloo on loopback, CPU float32 tensors (GB/s)");
    println!("| op | size | engine | torch.distributed | ratio |");
    println!("|---|---:|---:|---:|---:|");
    for ((op, bytes), bw) in &ours {
        let base = theirs.get(&(op.clone(), *bytes)).copied().unwrap_or(f64::NAN);
        println!("| {op} | {} | {:.3} | {:.3} | {:.2} |", human(*bytes), bw / 1e9, base / 1e9, bw / base);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
