//! The machine's own [`Cluster`] figures, measured in well under a second: a matmul's FLOP/s
//! and, over a job's ranks, an all-reduce's latency and bandwidth. They replace the assumed
//! defaults when no `cluster.json` is given.
//!
//! Every rank of a job must plan alike, so the ranks agree on one set of figures: the slowest
//! rank's matmul and the slowest rank's collective times (each an all-reduce of the measured
//! values), which every rank then holds bit for bit.
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::cluster::Cluster;
use crate::dist::{ProcessGroup, ReduceOp};
use crate::Result;

/// Side of the square matmul timed (about 0.27 GFLOP a product).
const MATMUL_SIDE: i64 = 512;
/// Products timed after one untimed.
const MATMUL_REPS: usize = 4;
/// Bytes of the all-reduce whose time gives the bandwidth.
const LARGE_BYTES: i64 = 4 << 20;
/// All-reduces timed per size, the fastest kept (the least disturbed by other work).
const COLLECTIVE_REPS: usize = 5;

/// FLOP/s of an fp32 `MATMUL_SIDE`-square matmul on `device` with this process's threads.
pub fn matmul_flops(device: Device) -> Result<f64> {
    let opts = (Kind::Float, device);
    let (a, b) =
        (Tensor::f_randn([MATMUL_SIDE, MATMUL_SIDE], opts)?, Tensor::f_randn([MATMUL_SIDE, MATMUL_SIDE], opts)?);
    let sync = || -> Result<()> {
        if let Device::Cuda(d) = device {
            crate::cuda::synchronize(d)?;
        }
        Ok(())
    };
    let _ = a.f_matmul(&b)?;
    sync()?;
    let start = Instant::now();
    for _ in 0..MATMUL_REPS {
        let _ = a.f_matmul(&b)?;
    }
    sync()?;
    let flops = 2.0 * (MATMUL_SIDE as f64).powi(3) * MATMUL_REPS as f64;
    Ok(flops / start.elapsed().as_secs_f64())
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

/// Latency and bandwidth of `group`'s links, from all-reduces of one element and of
/// `LARGE_BYTES` read through the ring model the cost model prices them with:
/// `2 (n - 1) (latency + bytes / n / bandwidth)`. `None` for one rank (no link to measure).
pub fn links(group: &ProcessGroup, device: Device) -> Result<Option<(f64, f64)>> {
    let n = group.size();
    if n < 2 {
        return Ok(None);
    }
    let small = Tensor::f_zeros([1], (Kind::Float, device))?;
    let large = Tensor::f_zeros([LARGE_BYTES / 4], (Kind::Float, device))?;
    let times =
        Tensor::from_slice(&[time_all_reduce(group, &small)?, time_all_reduce(group, &large)?]).f_to_device(device)?;
    group.all_reduce(&times, ReduceOp::Max)?;
    let (t_small, t_large) = (times.double_value(&[0]), times.double_value(&[1]));
    let steps = 2.0 * (n - 1) as f64;
    let latency = t_small / steps;
    // A large transfer no slower than a small one (timer noise): the bytes cost nothing
    // measurable, so take the large time alone as the bound.
    let transfer = if t_large > t_small { t_large - t_small } else { t_large };
    let bandwidth = steps * LARGE_BYTES as f64 / n as f64 / transfer;
    Ok(Some((latency, bandwidth)))
}

/// `base` with the figures measured on this machine: the matmul FLOP/s (the slowest rank's,
/// with `group`), and over `group`'s ranks the intra-node link's latency and bandwidth (the
/// inter-node link stays `base`'s: one node's ranks cannot measure it). A collective when
/// `group` is given: every rank calls it and gets the same figures.
pub fn calibrated(base: Cluster, group: Option<&ProcessGroup>, device: Device) -> Result<Cluster> {
    let flops = Tensor::from_slice(&[matmul_flops(device)?]).f_to_device(device)?;
    let mut cluster = base;
    if let Some(g) = group {
        g.all_reduce(&flops, ReduceOp::Min)?;
        if let Some((latency, bandwidth)) = links(g, device)? {
            cluster.latency_s = latency;
            cluster.intra_node_bandwidth = bandwidth;
        }
    }
    cluster.peak_flops = flops.double_value(&[0]);
    Ok(cluster)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_process_measures_the_matmul_and_keeps_the_links() {
        let base = Cluster::default();
        let c = calibrated(base.clone(), None, Device::Cpu).unwrap();
        assert!(c.peak_flops.is_finite() && c.peak_flops > 0.0, "{c:?}");
        assert_eq!(
            (c.latency_s, c.intra_node_bandwidth, c.memory_bytes),
            (base.latency_s, base.intra_node_bandwidth, base.memory_bytes)
        );
    }
}
