//! Gemini's host optimizer against PyTorch's fastest CPU AdamW and this machine's memory
//! bandwidth, in the same run: a STREAM triad (`a = b + s c`, rayon over every core), our fused
//! AdamW pass over `--params` fp32 parameters in Gemini's chunks (`HostOptimizer`, one per chunk),
//! then `torch.optim.AdamW(fused=True)` over the same sizes in a process of its own
//! (`benches/host_optimizer_baseline.py`), one after the other so that both sides fit, in
//! rounds taking turns (`--rounds`): the ratios are taken within each round, where both sides
//! met the same memory bandwidth, and their median over the rounds reported. A second
//! row times the whole host step of fp16 training with clipping: ours a read of the gradients
//! for the norm and one fused pass (unscale, clip, AdamW, fp16 copy; the gradients are left as
//! they are, the next backward overwrites them: `engine/src/gemini/manager/gradients.rs`);
//! PyTorch's GradScaler unscale, `clip_grad_norm_`, the fused step, the fp16 copy and
//! `zero_grad`; a third row times our step's part after backward when the norm was read during
//! it (`Gemini::plan_step`).
//!
//! `cargo bench -p engine --bench host_optimizer -- [--params 860M] [--steps 5] [--step 1000] [--rounds 3]`
//! (scripts/bench-host-optimizer.sh). Bytes moved are counted per parameter: AdamW reads the
//! weight, gradient and both moments and writes the weight and moments (28 B); the fp16 copy
//! adds 2, the norm's read 4 (and PyTorch's side clearing the gradient 4). The triad counts STREAM's 12 B per
//! element (reads of `b` and `c`, the write of `a`).
use std::process::Command;
use std::time::Instant;

use anyhow::{ensure, Context};
use clap::Parser;
use engine::optim::flat::{sum_squares_scaled, CpuRule, Half, HostOptimizer, Segment, StepExtras};
use engine::optim::AdamWConfig;
use rayon::prelude::*;

const BASELINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/host_optimizer_baseline.py");
/// Gemini's largest chunk for SD (32M elements: `diffusion::finetune::gemini_config`).
const CHUNK: usize = 1 << 25;
/// SD 1.5's UNet.
const SD15_PARAMS: usize = 859_520_964;
/// Host bytes per parameter while our side runs (weight, gradient, two moments, fp16 copy).
const OUR_BYTES: usize = 18;
const LOSS_SCALE: f64 = 1024.0;
const MAX_NORM: f64 = 1.0;

#[derive(Parser, Debug)]
#[command(about = "Gemini's host AdamW beside torch.optim.AdamW(fused=True) and a STREAM triad")]
struct Args {
    /// Parameters: a count, with an optional decimal `K`, `M` or `G` (`860M`). Default: SD
    /// 1.5's UNet (860M) or what half the available memory holds at 18 bytes each, the
    /// smaller.
    #[arg(long, value_parser = count)]
    params: Option<usize>,
    /// Timed steps per row (the median is reported), after one warm-up step.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Our optimizer's step count when timing starts: bias corrections depend on it, and from
    /// step 165 AdamW's first rounds to 1 in f32, so its division drops out (exactly); a
    /// fine-tuning run spends nearly all its steps there. 1: the first steps.
    #[arg(long, default_value_t = 1000)]
    step: i32,
    /// Elements per triad array (three of them).
    #[arg(long, default_value_t = 1 << 27)]
    triad: usize,
    /// Rounds of the triad, ours and PyTorch taking turns: this machine's memory bandwidth
    /// drifts by a third from one minute to the next, so each ratio is taken within a round
    /// and the rounds' median reported.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Skip PyTorch.
    #[arg(long)]
    no_baseline: bool,
    /// cargo bench passes this; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// A count with an optional decimal unit: `860M`, `1.5G`, `4096`.
fn count(text: &str) -> Result<usize, String> {
    let (number, unit) =
        text.trim().split_at(text.trim().find(|c: char| c.is_ascii_alphabetic()).unwrap_or(text.trim().len()));
    let scale = match unit.to_ascii_uppercase().as_str() {
        "" => 1.0,
        "K" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        _ => return Err(format!("{text:?}: expected a count such as 860M, 1.5G or 4096")),
    };
    let value: f64 = number.parse().map_err(|_| format!("{text:?}: expected a count such as 860M, 1.5G or 4096"))?;
    Ok((value * scale).round() as usize)
}

/// Bytes of memory the kernel says are available now.
fn available_bytes() -> anyhow::Result<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:")).context("no MemAvailable in /proc/meminfo")?;
    let kib: usize = line.split_whitespace().nth(1).context("MemAvailable's value")?.parse()?;
    Ok(kib << 10)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

/// The median seconds of `steps` calls of `step` on `state` after a warm-up call; `before`
/// runs untimed before each.
fn timed<S>(steps: usize, state: &mut S, mut before: impl FnMut(&mut S), mut step: impl FnMut(&mut S)) -> f64 {
    let mut times = vec![];
    for i in 0..=steps {
        before(state);
        let start = Instant::now();
        step(state);
        if i > 0 {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    median(times)
}

/// STREAM's triad over `n`-element arrays with every core: GB/s at 12 bytes per element.
fn triad(n: usize, steps: usize) -> f64 {
    let b: Vec<f32> = (0..n).into_par_iter().map(|i| i as f32).collect();
    let c: Vec<f32> = (0..n).into_par_iter().map(|i| (n - i) as f32).collect();
    let mut a = vec![0f32; n];
    let s = std::hint::black_box(3.0f32);
    let seconds = timed(
        steps,
        &mut a,
        |_| {},
        |a| {
            a.par_chunks_mut(1 << 16).zip(b.par_chunks(1 << 16)).zip(c.par_chunks(1 << 16)).for_each(|((a, b), c)| {
                for ((a, b), c) in a.iter_mut().zip(b).zip(c) {
                    *a = b + s * c;
                }
            })
        },
    );
    std::hint::black_box(&a);
    12.0 * n as f64 / seconds / 1e9
}

/// Deterministic values of about `scale` (a hash of the index, cheap to fill gigabytes with).
fn fill(x: &mut [f32], seed: u64, scale: f32) {
    x.par_chunks_mut(1 << 16).enumerate().for_each(|(b, block)| {
        for (i, e) in block.iter_mut().enumerate() {
            let k = ((b << 16) + i) as u64 ^ (seed << 40);
            let h = k.wrapping_mul(0x9e37_79b9_7f4a_7c15).rotate_left(29).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            *e = ((h >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * scale;
        }
    });
}

/// One chunk of ours: its optimizer, weights, gradients and fp16 copy.
struct Chunk {
    opt: HostOptimizer,
    w: Vec<f32>,
    g: Vec<f32>,
    half: Vec<u16>,
}

/// Ours, from step `first`: seconds of plain AdamW, of the whole step under fp16 and clipping,
/// and of that step's part after backward.
fn ours(params: usize, steps: usize, first: i32) -> (f64, f64, f64) {
    let rule = CpuRule::AdamW(AdamWConfig { lr: 1e-3, weight_decay: 0.01, ..AdamWConfig::default() });
    let mut chunks: Vec<Chunk> = (0..params)
        .step_by(CHUNK)
        .enumerate()
        .map(|(c, at)| {
            let n = CHUNK.min(params - at);
            let seg = vec![Segment { name: format!("chunk {c}"), offset: 0, len: n, adapt: true }];
            let (mut w, mut g) = (vec![0f32; n], vec![0f32; n]);
            fill(&mut w, 2 * c as u64, 0.04);
            fill(&mut g, 2 * c as u64 + 1, 2.0 * LOSS_SCALE as f32);
            let mut opt = HostOptimizer::new(rule, seg, n);
            if first > 1 {
                let zeros = vec![0f32; n];
                opt.load_state(first - 1, &zeros, &zeros);
            }
            Chunk { opt, w, g, half: vec![0u16; n] }
        })
        .collect();
    // Plain AdamW: the pass PyTorch's fused step makes (gradients kept).
    let plain = timed(
        steps,
        &mut chunks,
        |_| {},
        |chunks| {
            for ch in chunks.iter_mut() {
                let extras = StepExtras { keep_gradients: true, ..StepExtras::default() };
                ch.opt.step_with(&mut ch.w, &mut ch.g, extras);
            }
        },
    );
    // The whole step of fp16 training with clipping, as Gemini runs it on host chunks; then
    // the part left after backward when the norm was read during it (`Gemini::plan_step`).
    let mut seed = 1000;
    let mut refill = |chunks: &mut Vec<Chunk>| {
        seed += 1;
        for (c, ch) in chunks.iter_mut().enumerate() {
            fill(&mut ch.g, seed * 64 + c as u64, 2.0 * LOSS_SCALE as f32);
        }
    };
    let full = timed(steps, &mut chunks, &mut refill, |chunks| {
        let factors = norm_factors(chunks);
        fused_step(chunks, &factors)
    });
    let mut state = (chunks, vec![]);
    let after_backward = timed(
        steps,
        &mut state,
        |(chunks, factors)| {
            refill(chunks);
            *factors = norm_factors(chunks);
        },
        |(chunks, factors)| fused_step(chunks, factors),
    );
    (plain, full, after_backward)
}

/// The gradients' norm (a read of each, unscaled as it is read) and the factors the fused pass
/// applies: unscaling, then clipping where the norm exceeds [`MAX_NORM`].
fn norm_factors(chunks: &[Chunk]) -> Vec<f64> {
    let unscale = 1.0 / LOSS_SCALE;
    let norm = chunks.iter().map(|ch| sum_squares_scaled(&ch.g, &[unscale])).sum::<f64>().sqrt();
    let coef = MAX_NORM / (norm + 1e-6);
    if coef < 1.0 {
        vec![unscale, coef]
    } else {
        vec![unscale]
    }
}

/// Gemini's fused pass over every chunk: unscale and clip as read, AdamW, the fp16 copy; the
/// gradient kept (Gemini's next backward overwrites it).
fn fused_step(chunks: &mut [Chunk], factors: &[f64]) {
    for ch in chunks {
        let extras =
            StepExtras { grad_factors: factors, half_out: Some((Half::F16, &mut ch.half)), keep_gradients: true };
        ch.opt.step_with(&mut ch.w, &mut ch.g, extras);
    }
}

fn pytorch(params: usize, steps: usize) -> anyhow::Result<(f64, f64, String)> {
    let mut cmd = Command::new(engine::baseline::python()?);
    cmd.arg(BASELINE)
        .args(["--params", &params.to_string(), "--chunk", &CHUNK.to_string(), "--steps", &steps.to_string()])
        .args(["--threads", &rayon::current_num_threads().to_string()])
        .args(["--loss-scale", &LOSS_SCALE.to_string(), "--max-norm", &MAX_NORM.to_string()]);
    let json = engine::baseline::last_json(&engine::baseline::run(&mut cmd, BASELINE)?, BASELINE)?;
    let version = json["torch"].as_str().unwrap_or("?").to_string();
    Ok((engine::baseline::number(&json, "adamw_s")?, engine::baseline::number(&json, "full_step_s")?, version))
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// One round's seconds per step: the triad's GB/s, ours (AdamW, the whole fp16 step, its part
/// after backward) and PyTorch's (AdamW, the whole fp16 step).
struct Round {
    triad: f64,
    ours: [f64; 3],
    torch: Option<[f64; 2]>,
}

impl Round {
    /// PyTorch / ours for AdamW, the whole fp16 step and its part after backward.
    fn ratios(&self) -> Option<[f64; 3]> {
        let ([plain, full, after], [torch_plain, torch_full]) = (self.ours, self.torch?);
        Some([torch_plain / plain, torch_full / full, torch_full / after])
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    ensure!(args.steps > 0, "--steps must be at least 1");
    ensure!(args.rounds > 0, "--rounds must be at least 1");
    ensure!(args.step >= 1, "--step counts from 1");
    let params = match args.params {
        Some(p) => p,
        None => SD15_PARAMS.min(available_bytes()? / 2 / OUR_BYTES),
    };
    ensure!(params > 0, "--params must be more than 0");
    let threads = rayon::current_num_threads();
    println!(
        "host AdamW over {:.0}M fp32 parameters in {} chunks of up to {}M, {threads} threads, ours from step {}, {} rounds; load average {} at the start",
        params as f64 / 1e6,
        params.div_ceil(CHUNK),
        CHUNK >> 20,
        args.step,
        args.rounds,
        load_average()
    );
    let mut rounds = vec![];
    let mut version = String::new();
    for r in 1..=args.rounds {
        let triad = triad(args.triad, args.steps);
        let (plain, full, after_backward) = ours(params, args.steps, args.step);
        let torch = match args.no_baseline {
            true => None,
            false => {
                let (plain, full, v) = pytorch(params, args.steps)?;
                version = v;
                Some([plain, full])
            }
        };
        let round = Round { triad, ours: [plain, full, after_backward], torch };
        print!("round {r}: triad {triad:.1} GB/s; ours {plain:.3} / {full:.3} / {after_backward:.3} s");
        match (round.torch, round.ratios()) {
            (Some([p, f]), Some([a, b, c])) => {
                println!("; PyTorch {p:.3} / {f:.3} s; PyTorch / ours {a:.2}x, {b:.2}x, {c:.2}x")
            }
            _ => println!(),
        }
        rounds.push(round);
    }
    let of_rounds = |f: &dyn Fn(&Round) -> f64| median(rounds.iter().map(f).collect());
    let bandwidth = of_rounds(&|r| r.triad);
    let rate = |bytes: f64, s: f64| bytes * params as f64 / s / 1e9;
    let row = |name: &str, bytes: f64, s: f64| {
        let gbs = rate(bytes, s);
        println!("| {name} | {bytes:.0} | {s:.3} | {gbs:.1} | {:.0}% |", 100.0 * gbs / bandwidth);
    };
    println!("medians of the rounds (STREAM triad, {} M elements per array: {bandwidth:.1} GB/s):", args.triad >> 20);
    println!("| | bytes / param | s / step | GB/s | of triad |\n|---|---:|---:|---:|---:|");
    row("ours, AdamW (one fused pass)", 28.0, of_rounds(&|r| r.ours[0]));
    row("ours, fp16 step: norm read + fused unscale, clip, AdamW, fp16 copy", 34.0, of_rounds(&|r| r.ours[1]));
    row("ours, the same step's part after backward (norm read during it)", 30.0, of_rounds(&|r| r.ours[2]));
    if !args.no_baseline {
        let torch = |i: usize| of_rounds(&|r: &Round| r.torch.map_or(f64::NAN, |t| t[i]));
        row(&format!("torch {version} AdamW(fused=True)"), 28.0, torch(0));
        row("torch fp16 step: unscale_, clip_grad_norm_, fused step, fp16 copy, zero_grad", 58.0, torch(1));
        let ratio = |i: usize| of_rounds(&|r: &Round| r.ratios().map_or(f64::NAN, |x| x[i]));
        println!(
            "PyTorch / ours, the median of the rounds' ratios: AdamW {:.2}x; the whole fp16 step {:.2}x (its part after backward {:.2}x)",
            ratio(0),
            ratio(1),
            ratio(2)
        );
    }
    println!("load average {} at the end", load_average());
    Ok(())
}
