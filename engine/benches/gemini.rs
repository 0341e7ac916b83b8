//! Gemini under a GPU memory cap, side by side with plain training in the same run: for GPT-style
//! models of growing width, whether plain training (parameters, gradients and AdamW state all on
//! the GPU) fits under the cap and whether Gemini (auto placement, budget = the cap) does, with
//! step times and peak allocated memory; then Gemini's step time under the cap relative to plain
//! training of the same model without a cap.
//!
//! `cargo bench -p engine --bench gemini -- [--cap 4G] [--depth 8] [--widths 1024,2048,...]`
//! (scripts/bench-gemini.sh sets things up). Needs a CUDA device; `--device cpu` runs the same
//! program with Gemini's own accounting as the only cap, to check the program itself.
use std::panic::AssertUnwindSafe;
use std::time::Instant;

use anyhow::{bail, Context};
use engine::gemini::{cap_device_memory, parse_bytes, ChunkConfig, CpuRule, Gemini, GeminiConfig, Placement};
use engine::optim::{AdamW, AdamWConfig, Optimizer, Param};
use tch::{Device, Kind, Tensor};

const SEQ: i64 = 256;
const BATCH: i64 = 4;
const STEPS: usize = 3;

struct Args {
    cap: u64,
    depth: i64,
    widths: Vec<i64>,
    device: Device,
    /// Whether `--device` was given: an explicit `cuda` without a GPU is an error, the default
    /// only a notice (a plain `cargo bench` on a CPU machine).
    device_given: bool,
}

fn args() -> anyhow::Result<Args> {
    let mut a = Args {
        cap: 4 << 30,
        depth: 8,
        widths: vec![1024, 1536, 2048, 2560, 3072, 4096],
        device: Device::Cuda(0),
        device_given: false,
    };
    let mut it = std::env::args().skip(1).filter(|s| s != "--bench");
    while let Some(flag) = it.next() {
        let mut value = || it.next().with_context(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--cap" => a.cap = parse_bytes(&value()?)?,
            "--depth" => a.depth = value()?.parse().context("--depth")?,
            "--widths" => {
                a.widths = value()?.split(',').map(str::parse).collect::<Result<_, _>>().context("--widths")?
            }
            "--device" => {
                a.device = match value()?.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda(0),
                    other => bail!("--device {other}: expected cpu or cuda"),
                };
                a.device_given = true;
            }
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(a)
}

/// Parameters of `depth` pre-norm blocks of width `w`, in execution order, on the host.
fn parameters(w: i64, depth: i64) -> Vec<Param> {
    let mut ps = vec![];
    for b in 0..depth {
        for (name, shape) in [
            ("ln1", vec![w]),
            ("qkv", vec![3 * w, w]),
            ("proj", vec![w, w]),
            ("ln2", vec![w]),
            ("fc1", vec![4 * w, w]),
            ("fc2", vec![w, 4 * w]),
        ] {
            let t = if shape.len() == 1 {
                Tensor::ones(&shape, (Kind::Float, Device::Cpu))
            } else {
                Tensor::randn(&shape, (Kind::Float, Device::Cpu)) * (1.0 / (shape[1] as f64).sqrt())
            };
            ps.push(Param::new(format!("blocks.{b}.{name}"), &t.set_requires_grad(true)));
        }
    }
    ps
}

fn block(x: &Tensor, p: &[Tensor], heads: i64) -> Tensor {
    let (b, t, w) = x.size3().expect("[batch, seq, width]");
    let h = x.layer_norm([w], Some(&p[0]), None, 1e-5, false);
    let qkv = h.linear::<Tensor>(&p[1], None).reshape([b, t, 3, heads, w / heads]).permute([2, 0, 3, 1, 4]);
    let a = Tensor::scaled_dot_product_attention(
        &qkv.get(0),
        &qkv.get(1),
        &qkv.get(2),
        None::<Tensor>,
        0.0,
        true,
        None,
        false,
    );
    let x = x + a.transpose(1, 2).reshape([b, t, w]).linear::<Tensor>(&p[2], None);
    let h = x.layer_norm([w], Some(&p[3]), None, 1e-5, false);
    &x + h.linear::<Tensor>(&p[4], None).gelu("tanh").linear::<Tensor>(&p[5], None)
}

struct Outcome {
    seconds_per_step: f64,
    peak: i64,
}

fn peak_and_reset(device: Device) -> i64 {
    match device {
        Device::Cuda(d) => {
            let peak = engine::cuda::memory_stats(d).map(|s| s.peak_allocated).unwrap_or(0);
            let _ = engine::cuda::empty_cache();
            let _ = engine::cuda::reset_peak_stats(d);
            peak
        }
        _ => 0,
    }
}

fn synchronize(device: Device) {
    if let Device::Cuda(d) = device {
        let _ = engine::cuda::synchronize(d);
    }
}

/// Seconds per step of `STEPS` steps of `step` (after one warm-up step), each ended by a
/// device synchronisation.
fn seconds_per_step(device: Device, mut step: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut elapsed = 0.0;
    for i in 0..STEPS + 1 {
        let start = Instant::now();
        step()?;
        synchronize(device);
        if i > 0 {
            elapsed += start.elapsed().as_secs_f64();
        }
    }
    Ok(elapsed / STEPS as f64)
}

/// Runs `run`, catching a panic (tch panics on CUDA's out-of-memory) as an error with the
/// panic's message, and reads the peak memory.
fn measure(device: Device, run: impl FnOnce() -> anyhow::Result<f64>) -> anyhow::Result<Outcome> {
    let result = std::panic::catch_unwind(AssertUnwindSafe(run));
    let peak = peak_and_reset(device);
    match result {
        Ok(Ok(s)) => Ok(Outcome { seconds_per_step: s, peak }),
        Ok(Err(e)) => Err(e),
        Err(payload) => bail!("{}", engine::failure::panic_message(&*payload)),
    }
}

/// A run's cells in the table: its step time and peak, or why there are none. Out of memory
/// is the expected failure and reads "OOM"; any other failure reads "failed", and its cause is
/// printed under the row.
fn cells(outcome: &anyhow::Result<Outcome>) -> (String, String, Option<String>) {
    match outcome {
        Ok(o) => (format!("{:.3}", o.seconds_per_step), format!("{:.2} GiB", gib(o.peak)), None),
        Err(e) => {
            let cause = format!("{e:#}");
            if cause.to_lowercase().contains("out of memory") {
                ("OOM".into(), "-".into(), None)
            } else {
                // The first line: a libtorch error goes on with its C++ backtrace.
                ("failed".into(), "-".into(), Some(cause.lines().next().unwrap_or_default().to_string()))
            }
        }
    }
}

/// Trains plainly on `device`; `Err` when it does not fit (out of memory).
fn plain(w: i64, depth: i64, device: Device) -> anyhow::Result<Outcome> {
    measure(device, || {
        let ps: Vec<Param> = parameters(w, depth)
            .into_iter()
            .map(|p| Param::new(&p.name, &p.tensor.detach().to_device(device).set_requires_grad(true)))
            .collect();
        let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
        let mut opt = AdamW::new(ps, AdamWConfig::default());
        seconds_per_step(device, || {
            let mut x = Tensor::randn([BATCH, SEQ, w], (Kind::Float, device));
            for b in tensors.chunks(6) {
                x = block(&x, b, w / 64);
            }
            x.square().mean(Kind::Float).backward();
            opt.step()?;
            opt.zero_grad();
            Ok(())
        })
    })
}

/// Trains under Gemini with a budget of `cap` bytes.
fn gemini(w: i64, depth: i64, device: Device, cap: u64) -> anyhow::Result<Outcome> {
    measure(device, || {
        let ps = parameters(w, depth);
        let tensors: Vec<Tensor> = ps.iter().map(|p| p.tensor.shallow_clone()).collect();
        let cfg = GeminiConfig {
            chunks: ChunkConfig {
                device,
                budget: cap as usize,
                search: (1 << 22, 1 << 26, 1 << 22),
                home_buffers: 0,
                compute: Kind::Float,
                share_cpu_homes: true,
                trainable: true,
            },
            placement: Placement::Auto,
            prefetch: 2,
            rule: CpuRule::AdamW(AdamWConfig::default()),
            replication: None,
        };
        let g = Gemini::new(&ps, cfg)?;
        seconds_per_step(device, || {
            let mut x = Tensor::randn([BATCH, SEQ, w], (Kind::Float, device));
            for (i, b) in tensors.chunks(6).enumerate() {
                let idx: Vec<usize> = (6 * i..6 * i + 6).collect();
                x = g.run(&idx, &x, |x| block(x, b, w / 64))?;
            }
            x.square().mean(Kind::Float).backward();
            g.finish_backward()?;
            g.step()?;
            Ok(())
        })
    })
}

fn gib(bytes: i64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

fn main() -> anyhow::Result<()> {
    let a = args()?;
    if let Device::Cuda(_) = a.device {
        if !engine::cuda::is_available() {
            let message = "gemini bench: no CUDA device (pass --device cpu to check the program on the CPU)";
            if a.device_given {
                bail!("{message}");
            }
            println!("{message}");
            return Ok(());
        }
    }
    // Panics inside the runs are expected (tch's out of memory): `measure` reports them.
    std::panic::set_hook(Box::new(|_| {}));
    println!("cap {:.2} GiB, depth {}, batch {BATCH} x {SEQ} tokens, AdamW fp32", gib(a.cap as i64), a.depth);
    println!(
        "{:>6} {:>10} {:>14} {:>14} {:>14} {:>14}",
        "width", "params", "plain s/step", "plain peak", "gemini s/step", "gemini peak"
    );
    cap_device_memory(a.device, a.cap)?;
    let mut largest = (None, None);
    for &w in &a.widths {
        let params = 12 * w * w * a.depth;
        let p = plain(w, a.depth, a.device);
        let g = gemini(w, a.depth, a.device, a.cap);
        let ((ps, pp, p_why), (gs, gp, g_why)) = (cells(&p), cells(&g));
        println!("{w:>6} {:>9.0}M {ps:>14} {pp:>14} {gs:>14} {gp:>14}", params as f64 / 1e6);
        for why in [p_why, g_why].into_iter().flatten() {
            println!("        ({why})");
        }
        if p.is_ok() {
            largest.0 = Some(w);
        }
        if let Ok(o) = &g {
            largest.1 = Some((w, o.seconds_per_step));
        }
    }
    println!("largest width under the cap: plain {:?}, gemini {:?}", largest.0, largest.1.map(|l| l.0));
    if let (Some((w, capped)), Device::Cuda(d)) = (largest.1, a.device) {
        engine::cuda::set_memory_fraction(1.0, d)?;
        match plain(w, a.depth, a.device) {
            Ok(o) => println!(
                "width {w}: gemini under the cap {capped:.3} s/step, plain uncapped {:.3} s/step (peak {:.2} GiB): ratio {:.2}",
                o.seconds_per_step,
                gib(o.peak),
                capped / o.seconds_per_step
            ),
            Err(e) => println!(
                "width {w}: plain training failed even uncapped ({})",
                format!("{e:#}").lines().next().unwrap_or_default()
            ),
        }
    }
    Ok(())
}
