//! Tensor parallelism's cost per mode at one layer size, with tp=1 in the same run: an MLP
//! block (`[b, s, h]` -> Linear `h -> 4h` -> GELU -> Linear `4h -> h`, with biases, fp32,
//! CPU and Gloo, one thread per rank), forward and backward of `sum(y)`, for
//!
//! - tp=1: the serial layers (`ColumnParallelLinear` / `RowParallelLinear` with
//!   `TensorParallel::none()`, which are `nn.Linear`);
//! - 1D (Megatron): column then row on 2 and 4 ranks, and with sequence parallelism on 2;
//! - 2D (SUMMA) on a 2 x 2 grid; 3D on a 2 x 2 x 2 cube (`--no-3d` skips its 8 ranks).
//!
//! Per mode it prints the bytes each rank hands to c10d per step, counted by the process
//! group (`ProcessGroup::bytes_communicated`, which sees every sub-group), beside the
//! formula's bytes (the `multi_dim` module docs, and for 1D one all-reduce of the activation
//! forward and one backward); the median step time over `--steps` steps after `--warmup`;
//! and the peak host memory of the busiest rank (`engine::host_memory`, every CPU tensor
//! allocation since the rank started: parameters, input, activations, gradients). Times and
//! memory are also given relative to tp=1.
//!
//! `cargo bench -p engine --bench tensor_parallel [-- --batch 4 --seq 64 --hidden 256]`.
//! Each mode is one spawned job; the program re-enters itself as the ranks (`MODE_ENV`).
//! With more ranks than cores the step times measure the machine's oversubscription as much
//! as the mode: read them beside the byte and memory columns, which do not depend on it.
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context};
use clap::Parser;
use engine::dist::{self, InitOptions, SpawnOptions};
use engine::parallel::tensor::multi_dim::{Cube, CubeLinear, Grid, GridLinear, LinearConfig, Orientation};
use engine::parallel::tensor::{ColumnConfig, ColumnParallelLinear, RowConfig, RowParallelLinear, TensorParallel};
use serde::{Deserialize, Serialize};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

const MODE_ENV: &str = "BENCH_TP_MODE";
const OUT_ENV: &str = "BENCH_TP_OUT";

#[derive(Parser, Debug, Clone)]
#[command(about = "Tensor-parallel MLP: bytes communicated, step time and peak memory per mode")]
struct Args {
    /// Batch size `b` (2D needs a multiple of 2, 3D of 4).
    #[arg(long, default_value_t = 4)]
    batch: i64,
    /// Sequence length `s` (sequence parallelism needs a multiple of 2).
    #[arg(long, default_value_t = 64)]
    seq: i64,
    /// Hidden size `h`; the MLP's inner size is `4h` (3D needs a multiple of 4).
    #[arg(long, default_value_t = 256)]
    hidden: i64,
    /// Untimed steps before measuring.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Timed steps (the median is reported).
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Skip the 3D mode and its 8 ranks.
    #[arg(long)]
    no_3d: bool,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The modes, in table order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Serial,
    OneD(usize),
    SequenceParallel(usize),
    TwoD,
    ThreeD,
}

impl Mode {
    fn all(args: &Args) -> Vec<Mode> {
        let mut modes = vec![Mode::Serial, Mode::OneD(2), Mode::OneD(4), Mode::SequenceParallel(2), Mode::TwoD];
        if !args.no_3d {
            modes.push(Mode::ThreeD);
        }
        modes
    }

    /// The name in the table, also how a rank is told its mode (`MODE_ENV`).
    fn key(self) -> String {
        match self {
            Mode::Serial => "tp=1".into(),
            Mode::OneD(n) => format!("1D tp={n}"),
            Mode::SequenceParallel(n) => format!("1D+SP tp={n}"),
            Mode::TwoD => "2D 2x2".into(),
            Mode::ThreeD => "3D 2x2x2".into(),
        }
    }

    fn parse(key: &str, args: &Args) -> anyhow::Result<Mode> {
        Mode::all(&Args { no_3d: false, ..args.clone() })
            .into_iter()
            .find(|m| m.key() == key)
            .with_context(|| format!("{MODE_ENV}={key:?} names no mode"))
    }

    fn ranks(self) -> usize {
        match self {
            Mode::Serial => 1,
            Mode::OneD(n) | Mode::SequenceParallel(n) => n,
            Mode::TwoD => 4,
            Mode::ThreeD => 8,
        }
    }

    /// Elements each rank hands to collectives per step, forward and backward, by the
    /// formulas (`N = b s` tokens, inner size `f = 4h`, biases included).
    fn formula_elements(self, args: &Args) -> i64 {
        let (n, h) = (args.batch * args.seq, args.hidden);
        let f = 4 * h;
        match self {
            Mode::Serial => 0,
            // Row forward all-reduces its output, column backward its input gradient.
            Mode::OneD(_) => 2 * n * h,
            // Column: all-gather forward, all-gather again and reduce-scatter backward; row:
            // reduce-scatter forward, all-gather backward; the row bias's gradient summed.
            Mode::SequenceParallel(_) => 5 * n * h + h,
            // Per layer `h_in -> h_out`: 3 (N h_in + h_in h_out) / q, bias h_out / q.
            Mode::TwoD => {
                let q = 2;
                (3 * n * h + 3 * h * f + f) / q + (3 * n * f + 3 * f * h + h) / q
            }
            // Per layer: (3 N h_in + 2 N h_out + 3 h_in h_out) / q^2, bias 2 h_out / q.
            Mode::ThreeD => {
                let q = 2;
                (3 * n * h + 2 * n * f + 3 * h * f) / (q * q)
                    + 2 * f / q
                    + (3 * n * f + 2 * n * h + 3 * f * h) / (q * q)
                    + 2 * h / q
            }
        }
    }
}

/// What one rank measured.
#[derive(Serialize, Deserialize)]
struct RankReport {
    /// Wall time of each timed step, seconds.
    step_s: Vec<f64>,
    /// Bytes handed to c10d per step (all groups of this rank).
    bytes_per_step: u64,
    /// Peak host memory in bytes during the timed steps.
    peak_bytes: i64,
}

/// The MLP on one mode's layout.
enum Mlp {
    OneD(ColumnParallelLinear, RowParallelLinear),
    Grid(GridLinear, GridLinear),
    Cube(CubeLinear, CubeLinear),
}

impl Mlp {
    fn forward(&self, x: &Tensor) -> engine::Result<Tensor> {
        match self {
            Mlp::OneD(fc1, fc2) => fc2.forward(&fc1.forward(x)?.f_gelu("none")?),
            Mlp::Grid(fc1, fc2) => fc2.forward(&fc1.forward(x)?.f_gelu("none")?),
            Mlp::Cube(fc1, fc2) => fc2.forward(&fc1.forward(x)?.f_gelu("none")?),
        }
    }
}

/// The MLP and this rank's block of the whole input `x`, for `mode`.
fn build(mode: Mode, vs: &VarStore, world: &dist::World, x: &Tensor, args: &Args) -> anyhow::Result<(Mlp, Tensor)> {
    let (h, f, root) = (args.hidden, 4 * args.hidden, vs.root());
    let one_d = |tp: &TensorParallel, sp: bool| -> engine::Result<Mlp> {
        // Activations are [b, s, h]: the sequence is dim 1.
        let col = ColumnConfig { sequence_parallel: sp, sequence_dim: 1, ..Default::default() };
        let row = RowConfig { sequence_parallel: sp, sequence_dim: 1, ..Default::default() };
        Ok(Mlp::OneD(
            ColumnParallelLinear::new(&(&root / "fc1"), h, f, col, tp)?,
            RowParallelLinear::new(&(&root / "fc2"), f, h, row, tp)?,
        ))
    };
    Ok(match mode {
        Mode::Serial => (one_d(&TensorParallel::none(), false)?, x.shallow_clone()),
        Mode::OneD(_) => (one_d(&TensorParallel::new(world.group.clone()), false)?, x.shallow_clone()),
        Mode::SequenceParallel(_) => {
            let tp = TensorParallel::new(world.group.clone());
            let block = tp.partition(args.seq, "--seq")?;
            (one_d(&tp, true)?, x.f_narrow(1, tp.rank() * block, block)?)
        }
        Mode::TwoD => {
            let grid = Grid::two_d(&world.group)?;
            let cfg = LinearConfig::default();
            let mlp = Mlp::Grid(
                GridLinear::new(&(&root / "fc1"), h, f, cfg, &grid)?,
                GridLinear::new(&(&root / "fc2"), f, h, cfg, &grid)?,
            );
            (mlp, grid.split_input(x)?)
        }
        Mode::ThreeD => {
            let cube = Cube::new(&world.group)?;
            let cfg = LinearConfig::default();
            let (a, b) = (Orientation::Normal, Orientation::Swapped);
            let mlp = Mlp::Cube(
                CubeLinear::new(&(&root / "fc1"), h, f, a, cfg, &cube)?,
                CubeLinear::new(&(&root / "fc2"), f, h, b, cfg, &cube)?,
            );
            (mlp, cube.split_input(x, a)?)
        }
    })
}

/// One rank of `mode`'s job: build, warm up, time `--steps` steps, write its report.
fn rank_main(mode: Mode, out: &Path, args: &Args) -> anyhow::Result<()> {
    // Before anything is allocated, so the peak includes parameters and input.
    engine::host_memory::track()?;
    tch::set_num_threads(1);
    let world = dist::init(&InitOptions::default())?;
    ensure!(world.size() == mode.ranks(), "{} runs on {} ranks, got {}", mode.key(), mode.ranks(), world.size());
    let g = &world.group;
    tch::manual_seed(1);
    let vs = VarStore::new(Device::Cpu);
    let (mlp, x) = {
        let whole = Tensor::f_randn([args.batch, args.seq, args.hidden], (Kind::Float, Device::Cpu))?;
        let (mlp, x) = build(mode, &vs, &world, &whole, args)?;
        // The input requires a gradient, as one coming from earlier layers would: 1D's column
        // layer then all-reduces it in backward.
        (mlp, x.f_contiguous()?.detach().copy().set_requires_grad(true))
    };
    let mut params = vs.trainable_variables();
    params.push(x.shallow_clone());
    let step = || -> anyhow::Result<()> {
        mlp.forward(&x)?.f_sum(Kind::Float)?.f_backward()?;
        for p in &params {
            engine::autograd::set_grad(p, None)?;
        }
        Ok(())
    };
    for _ in 0..args.warmup {
        step()?;
    }
    g.barrier()?;
    g.reset_bytes_communicated();
    engine::host_memory::reset_peak()?;
    let mut step_s = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        g.barrier()?;
        let start = Instant::now();
        step()?;
        step_s.push(start.elapsed().as_secs_f64());
    }
    let report = RankReport {
        step_s,
        bytes_per_step: g.bytes_communicated() / args.steps as u64,
        peak_bytes: engine::host_memory::stats()?.peak,
    };
    let path = out.join(format!("rank{}.json", world.rank()));
    std::fs::write(&path, serde_json::to_string(&report)?).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

/// One row of the table, from every rank's report.
struct Row {
    mode: Mode,
    bytes: u64,
    step_s: f64,
    peak_bytes: i64,
}

fn run_mode(mode: Mode, dir: &Path) -> anyhow::Result<Row> {
    let out = dir.join(mode.key().replace([' ', '=', '+'], "_"));
    std::fs::create_dir_all(&out)?;
    dist::spawn(&SpawnOptions {
        nproc: mode.ranks(),
        program: std::env::current_exe()?,
        args: std::env::args_os().skip(1).collect(),
        env: vec![(MODE_ENV.into(), mode.key()), (OUT_ENV.into(), out.display().to_string())],
        echo: false,
        heartbeat: None,
    })
    .with_context(|| format!("running {}", mode.key()))?;
    let reports = (0..mode.ranks())
        .map(|r| -> anyhow::Result<RankReport> {
            let path = out.join(format!("rank{r}.json"));
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            Ok(serde_json::from_str(&text)?)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let bytes = reports.iter().map(|r| r.bytes_per_step).max().unwrap_or(0);
    if let Some(r) = reports.iter().position(|r| r.bytes_per_step != bytes) {
        bail!("{}: rank {r} counted {} bytes per step, another {bytes}", mode.key(), reports[r].bytes_per_step);
    }
    // Rank 0's median: the collectives keep the ranks in step.
    let mut times = reports[0].step_s.clone();
    times.sort_by(f64::total_cmp);
    Ok(Row {
        mode,
        bytes,
        step_s: times[times.len() / 2],
        peak_bytes: reports.iter().map(|r| r.peak_bytes).max().unwrap_or(0),
    })
}

fn print_table(rows: &[Row], args: &Args) {
    let serial = &rows[0];
    println!(
        "\nMLP h={h} -> 4h -> h, input [b={b}, s={s}, h={h}], fp32, CPU Gloo, forward + backward; \
         median of {steps} steps after {warmup} warm-up; bytes per rank per step",
        h = args.hidden,
        b = args.batch,
        s = args.seq,
        steps = args.steps,
        warmup = args.warmup
    );
    println!("| mode | ranks | bytes measured | bytes formula | measured / formula | step ms | time / tp=1 | peak MiB per rank | memory / tp=1 |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        let formula = row.mode.formula_elements(args) as u64 * 4;
        let agreement =
            if formula == 0 { "-".to_string() } else { format!("{:.3}", row.bytes as f64 / formula as f64) };
        println!(
            "| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} |",
            row.mode.key(),
            row.mode.ranks(),
            row.bytes,
            formula,
            agreement,
            row.step_s * 1e3,
            row.step_s / serial.step_s,
            row.peak_bytes as f64 / (1 << 20) as f64,
            row.peak_bytes as f64 / serial.peak_bytes as f64
        );
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Ok(key) = std::env::var(MODE_ENV) {
        let out = std::env::var(OUT_ENV).with_context(|| format!("{MODE_ENV} is set but {OUT_ENV} is not"))?;
        return rank_main(Mode::parse(&key, &args)?, Path::new(&out), &args);
    }
    let (b, s, h) = (args.batch, args.seq, args.hidden);
    ensure!(b > 0 && s > 0 && h > 0, "--batch, --seq and --hidden must be positive, got {b}, {s}, {h}");
    ensure!(args.steps > 0, "--steps must be at least 1");
    ensure!(
        b % 2 == 0 && s % 2 == 0 && h % 2 == 0,
        "2D and sequence parallelism split --batch, --seq and --hidden in 2: got {b}, {s}, {h}"
    );
    ensure!(
        args.no_3d || (b % 4 == 0 && h % 4 == 0),
        "3D splits --batch and --hidden in 4: got {b} and {h} (or pass --no-3d)"
    );
    let dir: PathBuf = std::env::temp_dir().join(format!("bench-tensor-parallel-{}", std::process::id()));
    let started = Instant::now();
    let rows = Mode::all(&args)
        .into_iter()
        .map(|mode| {
            eprintln!("{} on {} rank(s)...", mode.key(), mode.ranks());
            run_mode(mode, &dir)
        })
        .collect::<anyhow::Result<Vec<_>>>();
    let _ = std::fs::remove_dir_all(&dir);
    print_table(&rows?, &args);
    println!("\n(whole run: {:.0} s)", started.elapsed().as_secs_f64());
    Ok(())
}
