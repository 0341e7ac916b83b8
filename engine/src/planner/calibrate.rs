//! The machine's own [`Cluster`] figures, measured in about a second on the device the run
//! computes on and in the kind it computes in (`--device`, `--precision`): a matmul's FLOP/s,
//! the time a small tensor operation costs whatever its size, the memory bandwidth of an
//! element-wise pass, the cores (on a CPU) and, over a job's ranks, an all-reduce's latency
//! and bandwidth, what a collective costs among many in flight and what a blocking one costs
//! between computations, and how much slower the ranks compute together than alone.
//! They replace the assumed defaults when no `cluster.json` is given.
//!
//! Each rank measures its device alone, one rank after another: ranks sharing a machine's
//! cores would otherwise measure one another, where the cost model prices that sharing itself
//! ([`Cluster::contention`]); then the ranks run the same work together once, for what sharing
//! costs beyond the cores. Every rank of a job must plan alike, so the ranks agree on one set
//! of figures: the slowest rank's (each an all-reduce of the measured values), which every rank
//! then holds bit for bit.
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::cluster::Cluster;
use crate::dist::{ProcessGroup, ReduceOp};
use crate::Result;

/// Side of the square matmul timed on a CPU (about 0.27 GFLOP a product).
const MATMUL_SIDE: i64 = 512;
/// Side of the square matmul timed on a GPU (about 137 GFLOP a product): a 512-square product
/// is over in tens of microseconds there, and its time is the launch's, not the arithmetic's
/// (an H200 measured 5 TFLOP/s so, where its bf16 products run at hundreds).
const GPU_MATMUL_SIDE: i64 = 4096;
/// Products timed after one untimed.
const MATMUL_REPS: usize = 4;
/// Bytes of the all-reduce whose time gives the bandwidth.
const LARGE_BYTES: i64 = 4 << 20;
/// All-reduces timed per size, the fastest kept (the least disturbed by other work).
const COLLECTIVE_REPS: usize = 5;

/// Operations timed for the per-operation overhead.
const OPS: usize = 400;
/// Elements of each array of the bandwidth's element-wise pass (16 MiB of f32).
const PASS_ELEMENTS: i64 = 4 << 20;

/// Waits for `device`'s queued work (a GPU's; the CPU's is done when it returns).
fn sync(device: Device) -> Result<()> {
    if let Device::Cuda(d) = device {
        crate::cuda::synchronize(d)?;
    }
    Ok(())
}

/// The side of the square matmul [`matmul_flops`] times on `device`.
pub fn matmul_side(device: Device) -> i64 {
    match device {
        Device::Cuda(_) => GPU_MATMUL_SIDE,
        _ => MATMUL_SIDE,
    }
}

/// FLOP/s of a [`matmul_side`]-square matmul of `kind` (the run's precision: bf16 products
/// run on a GPU's tensor cores at many times fp32's rate) on `device` with this process's
/// threads.
pub fn matmul_flops(device: Device, kind: Kind) -> Result<f64> {
    let opts = (kind, device);
    let side = matmul_side(device);
    // Seeded like every draw of the suite, so that none falls inside another job's section.
    let side = [side, side];
    let (a, b) = crate::random::seeded(0, || (Tensor::f_randn(side, opts), Tensor::f_randn(side, opts)));
    let (a, b) = (a?, b?);
    let _ = a.f_matmul(&b)?;
    sync(device)?;
    let start = Instant::now();
    for _ in 0..MATMUL_REPS {
        let _ = a.f_matmul(&b)?;
    }
    sync(device)?;
    let flops = 2.0 * (side[0] as f64).powi(3) * MATMUL_REPS as f64;
    Ok(flops / start.elapsed().as_secs_f64())
}

/// Seconds one operation on a tiny tensor takes on `device` with autograd recording it (a
/// training step's dispatch, bookkeeping and launch, without arithmetic to speak of): a chain
/// of `OPS` element-wise operations on tensors of `kind` (the run's), after one untimed chain.
pub fn op_overhead(device: Device, kind: Kind) -> Result<f64> {
    let x = Tensor::f_ones([8], (kind, device))?.set_requires_grad(true);
    let chain = || -> Result<f64> {
        sync(device)?;
        let start = Instant::now();
        let mut y = x.shallow_clone();
        for i in 0..OPS {
            y = if i % 2 == 0 { y.f_mul_scalar(1.0)? } else { y.f_add_scalar(0.0)? };
        }
        sync(device)?;
        Ok(start.elapsed().as_secs_f64() / OPS as f64)
    };
    chain()?;
    chain()
}

/// Bytes/s of an element-wise pass over `PASS_ELEMENTS`-element f32 arrays on `device`
/// (`a = b + c` into an existing `a`, STREAM's add: two arrays read, one written), the fastest
/// of a few. f32 whatever the run's precision: the optimizer's passes, which this prices, run
/// over fp32 masters and moments.
pub fn memory_bandwidth(device: Device) -> Result<f64> {
    let opts = (Kind::Float, device);
    let (b, c) = (Tensor::f_ones([PASS_ELEMENTS], opts)?, Tensor::f_ones([PASS_ELEMENTS], opts)?);
    let a = Tensor::f_zeros([PASS_ELEMENTS], opts)?;
    let mut best = f64::INFINITY;
    for _ in 0..MATMUL_REPS {
        sync(device)?;
        let start = Instant::now();
        let _ = b.f_add_out(&a, &c)?;
        sync(device)?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(3.0 * PASS_ELEMENTS as f64 * 4.0 / best)
}

/// The fastest of `COLLECTIVE_REPS` all-reduces of `t` over `group`, in seconds. On a GPU
/// NCCL's wait only orders the compute stream after the collective, so the host waits for the
/// device before reading the clock.
fn time_all_reduce(group: &ProcessGroup, t: &Tensor) -> Result<f64> {
    let finished = || -> Result<()> {
        group.all_reduce(t, ReduceOp::Sum)?;
        if let Device::Cuda(d) = t.device() {
            crate::cuda::synchronize(d)?;
        }
        Ok(())
    };
    finished()?;
    let mut best = f64::INFINITY;
    for _ in 0..COLLECTIVE_REPS {
        group.barrier()?;
        let start = Instant::now();
        finished()?;
        best = best.min(start.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Broadcasts of one element issued together, for the time each collective call costs (as
/// many as a small model's parameter tensors, which ZeRO broadcasts together).
const IN_FLIGHT: usize = 64;

/// Seconds per call of [`IN_FLIGHT`] one-element broadcasts from rank 0 issued together and
/// then waited for (as ZeRO's broadcast of every parameter is), the fastest of a few rounds.
fn time_broadcasts(group: &ProcessGroup, device: Device) -> Result<f64> {
    let tensors =
        (0..IN_FLIGHT).map(|_| Tensor::f_zeros([1], (Kind::Float, device))).collect::<tch::Result<Vec<_>>>()?;
    let mut best = f64::INFINITY;
    for _ in 0..COLLECTIVE_REPS {
        group.barrier()?;
        let start = Instant::now();
        let works = tensors.iter().map(|t| group.broadcast_async(t, 0)).collect::<Result<Vec<_>>>()?;
        for w in works {
            w.wait()?;
        }
        sync(device)?;
        best = best.min(start.elapsed().as_secs_f64() / IN_FLIGHT as f64);
    }
    Ok(best)
}

/// Side of the products computed between the interleaved collectives: about 0.2 ms of a CPU
/// core for [`WORK_PRODUCTS`] of them, a layer's work on a small model.
const WORK_SIDE: i64 = 128;
/// Products between two collectives.
const WORK_PRODUCTS: usize = 4;
/// Collectives timed interleaved with the work.
const INTERLEAVED: usize = 40;

/// Elements of the larger all-reduce timed between computations (256 KiB of f32: a small
/// model's activations, which tensor parallelism all-reduces inside its layers).
const INTERLEAVED_ELEMENTS: i64 = 64 << 10;

/// Seconds one blocking all-reduce of `elements` f32 over `group` costs when every rank
/// computes between calls (as tensor parallelism does inside each layer): the same work timed
/// with and without the collectives, the median difference of [`ROUNDS`] rounds.
fn time_interleaved(group: &ProcessGroup, device: Device, elements: i64) -> Result<f64> {
    let a = crate::random::seeded(0, || Tensor::f_randn([WORK_SIDE, WORK_SIDE], (Kind::Float, device)))?;
    let x = Tensor::f_zeros([elements], (Kind::Float, device))?;
    let run = |collectives: bool| -> Result<f64> {
        group.barrier()?;
        let start = Instant::now();
        for _ in 0..INTERLEAVED {
            for _ in 0..WORK_PRODUCTS {
                let _ = a.f_matmul(&a)?;
            }
            if collectives {
                group.all_reduce(&x, ReduceOp::Sum)?;
            }
            sync(device)?;
        }
        Ok(start.elapsed().as_secs_f64() / INTERLEAVED as f64)
    };
    run(true)?;
    let mut extra = (0..ROUNDS).map(|_| Ok(run(true)? - run(false)?)).collect::<Result<Vec<f64>>>()?;
    extra.sort_by(f64::total_cmp);
    Ok(extra[ROUNDS / 2].max(0.0))
}

/// Rounds of the interleaved timing, the median kept (a shared machine's other work disturbs
/// single rounds either way).
const ROUNDS: usize = 5;

/// What `group`'s links cost ([`links`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Links {
    /// Seconds each ring step starts with.
    pub latency_s: f64,
    /// Bytes/s of a link.
    pub bandwidth: f64,
    /// Seconds each of many small collectives in flight costs.
    pub collective_s: f64,
    /// Seconds a blocking collective costs between computations.
    pub sync_s: f64,
    /// Bytes/s of a link for collectives between computations.
    pub interleaved_bandwidth: f64,
}

/// Latency and bandwidth of `group`'s links, from all-reduces of one element and of
/// `LARGE_BYTES` read through the ring model the cost model prices them with:
/// `2 (n - 1) (latency + bytes / n / bandwidth)`, the time each call costs among many small
/// collectives in flight, and a blocking call's between computations (at least the latency
/// model's own). `None` for one rank (no link to measure).
pub fn links(group: &ProcessGroup, device: Device) -> Result<Option<Links>> {
    let n = group.size();
    if n < 2 {
        return Ok(None);
    }
    let small = Tensor::f_zeros([1], (Kind::Float, device))?;
    let large = Tensor::f_zeros([LARGE_BYTES / 4], (Kind::Float, device))?;
    let times = [
        time_all_reduce(group, &small)?,
        time_all_reduce(group, &large)?,
        time_broadcasts(group, device)?,
        time_interleaved(group, device, 1)?,
        time_interleaved(group, device, INTERLEAVED_ELEMENTS)?,
    ];
    let times = Tensor::from_slice(&times).f_to_device(device)?;
    group.all_reduce(&times, ReduceOp::Max)?;
    let (t_small, t_large) = (times.double_value(&[0]), times.double_value(&[1]));
    let steps = 2.0 * (n - 1) as f64;
    let latency = t_small / steps;
    // A large transfer no slower than a small one (timer noise): the bytes cost nothing
    // measurable, so take the large time alone as the bound.
    let transfer = if t_large > t_small { t_large - t_small } else { t_large };
    let bandwidth = steps * LARGE_BYTES as f64 / n as f64 / transfer;
    let sync_s = times.double_value(&[3]).max(steps * latency);
    // The larger all-reduce's time beyond the one-element one, read through the same ring model
    // (no faster than the idle link).
    let bytes = steps * (INTERLEAVED_ELEMENTS * 4) as f64 / n as f64;
    let interleaved_bandwidth = match times.double_value(&[4]) - sync_s {
        extra if extra > 0.0 => (bytes / extra).min(bandwidth),
        _ => bandwidth,
    };
    Ok(Some(Links {
        latency_s: latency,
        bandwidth,
        collective_s: times.double_value(&[2]),
        sync_s,
        interleaved_bandwidth,
    }))
}

/// This device's figures (matmul FLOP/s and seconds per operation in `kind`, memory bytes/s),
/// measured with the ranks of `group` taking turns, so that each measures its device alone;
/// and, with a group, how many times longer the same measurements (a training step's mix of
/// products, small operations and element-wise passes) take when every rank runs them at once.
fn device_figures(group: Option<&ProcessGroup>, device: Device, kind: Kind) -> Result<([f64; 3], f64)> {
    let measure = || -> Result<([f64; 3], f64)> {
        let start = Instant::now();
        let figures = [matmul_flops(device, kind)?, op_overhead(device, kind)?, memory_bandwidth(device)?];
        Ok((figures, start.elapsed().as_secs_f64()))
    };
    let Some(g) = group else { return Ok((measure()?.0, 1.0)) };
    let mut mine = None;
    for turn in 0..g.size() {
        g.barrier()?;
        if turn == g.rank() {
            mine = Some(measure()?);
        }
    }
    g.barrier()?;
    let (_, together) = measure()?;
    let (figures, alone) = mine.expect("every rank has its turn");
    Ok((figures, together / alone))
}

/// `base` with the figures measured on `device` (the one the run computes on: a GPU's, not the
/// host's) in `kind` (the run's precision): the matmul FLOP/s, the per-operation
/// overhead and the memory bandwidth (the slowest rank's, with `group`), on a CPU the cores the
/// ranks share, and over `group`'s ranks the intra-node link's latency and bandwidth (the
/// inter-node link stays `base`'s: one node's ranks cannot measure it). A collective when
/// `group` is given: every rank calls it and gets the same figures.
pub fn calibrated(base: Cluster, group: Option<&ProcessGroup>, device: Device, kind: Kind) -> Result<Cluster> {
    let ([flops, overhead, bandwidth], together) = device_figures(group, device, kind)?;
    // The slowest rank's figures: the least FLOP/s and bandwidth, the most overhead and
    // slowdown together.
    let figures = Tensor::from_slice(&[flops, -overhead, bandwidth, -together]).f_to_device(device)?;
    let mut cluster = base;
    if let Some(g) = group {
        g.all_reduce(&figures, ReduceOp::Min)?;
        if let Some(l) = links(g, device)? {
            (cluster.latency_s, cluster.intra_node_bandwidth, cluster.collective_s) =
                (l.latency_s, l.bandwidth, l.collective_s);
            (cluster.sync_s, cluster.interleaved_bandwidth) = (l.sync_s, l.interleaved_bandwidth);
        }
    }
    cluster.peak_flops = figures.double_value(&[0]);
    cluster.op_overhead_s = -figures.double_value(&[1]);
    cluster.memory_bandwidth = figures.double_value(&[2]);
    if device == Device::Cpu {
        cluster.cores_per_node = std::thread::available_parallelism().map_or(1, |n| n.get());
        // What the ranks lose together beyond sharing the cores, which the cost model prices
        // itself (the group's ranks are the node's: one machine calibrates).
        cluster.co_run_slowdown = (-figures.double_value(&[3]) / cluster.core_sharing(1.0)).max(1.0);
    }
    Ok(cluster)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_measures_the_matmul_and_keeps_the_links() {
        let base = Cluster::default();
        let c = calibrated(base.clone(), None, Device::Cpu, Kind::Float).unwrap();
        assert!(c.peak_flops.is_finite() && c.peak_flops > 0.0, "{c:?}");
        assert!(c.op_overhead_s > 0.0 && c.op_overhead_s < 1e-2, "{c:?}");
        assert!(c.memory_bandwidth.is_finite() && c.memory_bandwidth > 0.0, "{c:?}");
        assert!(c.cores_per_node >= 1, "{c:?}");
        assert_eq!(
            (c.latency_s, c.intra_node_bandwidth, c.memory_bytes),
            (base.latency_s, base.intra_node_bandwidth, base.memory_bytes)
        );
    }

    #[test]
    fn the_matmul_is_timed_in_the_runs_kind_and_large_enough_on_a_gpu() {
        assert_eq!((matmul_side(Device::Cpu), matmul_side(Device::Cuda(0))), (MATMUL_SIDE, GPU_MATMUL_SIDE));
        // bf16 runs bf16 products: a figure of its own (on the CPU, usually not faster).
        let c = calibrated(Cluster::default(), None, Device::Cpu, Kind::BFloat16).unwrap();
        assert!(c.peak_flops.is_finite() && c.peak_flops > 0.0 && c.op_overhead_s > 0.0, "{c:?}");
    }
}
