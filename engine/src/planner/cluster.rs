//! The machines a plan runs on (`--cluster cluster.json`): devices per node, each device's
//! memory and peak FLOP/s, and the bandwidth and latency of links within and between nodes.
use std::path::Path;

use crate::{Error, Result};

/// A homogeneous cluster. Every key of `cluster.json` is optional; missing keys take
/// [`Cluster::default`]'s values.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Cluster {
    /// Nodes.
    pub nodes: usize,
    /// Devices (ranks) per node.
    pub devices_per_node: usize,
    /// Memory per device, bytes.
    pub memory_bytes: f64,
    /// Sustained matmul FLOP/s per device.
    pub peak_flops: f64,
    /// Bytes/s of one device's link to the others in its node.
    pub intra_node_bandwidth: f64,
    /// Bytes/s of one device's link to other nodes.
    pub inter_node_bandwidth: f64,
    /// Seconds each collective step or point-to-point message starts with.
    pub latency_s: f64,
    /// Seconds each collective call costs beyond its steps when many are in flight at once
    /// (handing it to the backend, waiting for it): what ZeRO's broadcast per tensor adds up to.
    pub collective_s: f64,
    /// Seconds one blocking collective call costs when the ranks compute between calls: every
    /// peer has to arrive, and on ranks sharing cores be scheduled again, before any proceeds.
    /// What tensor parallelism's collectives inside every layer and a pipeline's sends cost
    /// beyond their bytes; on CPU ranks sharing cores it is several times the links' latency.
    pub sync_s: f64,
    /// Bytes/s of a link for a collective between computations (tensor parallelism's inside
    /// the layers): on CPU ranks sharing cores well below `intra_node_bandwidth`, each chunk of
    /// the transfer waiting for its peer to be scheduled. Never above the link's own.
    pub interleaved_bandwidth: f64,
    /// Seconds each tensor operation costs beyond its FLOPs and bytes (dispatch, autograd's
    /// bookkeeping, a kernel launch): what dominates the step of a small model.
    pub op_overhead_s: f64,
    /// Bytes/s one device reads and writes its memory at: the optimizer's element-wise passes.
    pub memory_bandwidth: f64,
    /// Cores a node's ranks compute on, when they share them (CPU ranks of one machine): ranks
    /// that together run more threads than this are slowed by as much. 0: each device its own.
    pub cores_per_node: usize,
    /// How many times slower a rank computes while every rank of its node computes, beyond
    /// sharing cores: the memory bandwidth and caches they share (1: not at all).
    pub co_run_slowdown: f64,
}

impl Default for Cluster {
    /// One node of 8 CPU ranks sharing this class of machine: 4 GiB and 50 GFLOP/s per rank,
    /// shared-memory links of 5 GB/s and 20 us (Gloo over loopback), 50 us per collective call
    /// in flight and 100 us per blocking one, 10 us per operation and 10 GB/s of memory
    /// bandwidth per rank, cores and memory not shared; assumed figures, not a calibration of
    /// the machine at hand.
    fn default() -> Cluster {
        Cluster {
            nodes: 1,
            devices_per_node: 8,
            memory_bytes: 4.0 * (1u64 << 30) as f64,
            peak_flops: 50e9,
            intra_node_bandwidth: 5e9,
            inter_node_bandwidth: 1.25e9,
            latency_s: 20e-6,
            collective_s: 50e-6,
            sync_s: 100e-6,
            interleaved_bandwidth: 5e9,
            op_overhead_s: 10e-6,
            memory_bandwidth: 10e9,
            cores_per_node: 0,
            co_run_slowdown: 1.0,
        }
    }
}

impl Cluster {
    /// Reads `path`; the error names the file and the key or value that is wrong.
    pub fn load(path: &Path) -> Result<Cluster> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
        let bad = |e: String| Error::invalid(format!("{}: {e}", path.display()));
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        // serde would read a list as the fields in order (`[]`: every default).
        if !value.is_object() {
            return Err(bad("not a JSON object of cluster keys".into()));
        }
        let c: Cluster = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
        c.validate().map_err(|e| Error::invalid(format!("{}: {e}", path.display())))?;
        Ok(c)
    }

    /// Checks every number is usable; the error names the key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.nodes == 0 || self.devices_per_node == 0 {
            return Err("nodes and devices_per_node must be at least 1".into());
        }
        let positive = [
            ("memory_bytes", self.memory_bytes),
            ("peak_flops", self.peak_flops),
            ("intra_node_bandwidth", self.intra_node_bandwidth),
            ("inter_node_bandwidth", self.inter_node_bandwidth),
            ("memory_bandwidth", self.memory_bandwidth),
            ("interleaved_bandwidth", self.interleaved_bandwidth),
        ];
        for (key, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{key} must be a positive number, got {v}"));
            }
        }
        // A second per message is no cluster's link: a unit mistake (microseconds given).
        if !(self.latency_s.is_finite() && (0.0..1.0).contains(&self.latency_s)) {
            return Err(format!("latency_s must be at least 0 and under 1 second, got {}", self.latency_s));
        }
        let seconds =
            [("collective_s", self.collective_s), ("sync_s", self.sync_s), ("op_overhead_s", self.op_overhead_s)];
        for (key, v) in seconds {
            if !(v.is_finite() && (0.0..1.0).contains(&v)) {
                return Err(format!("{key} must be at least 0 and under 1 second, got {v}"));
            }
        }
        if !(self.co_run_slowdown.is_finite() && self.co_run_slowdown >= 1.0) {
            return Err(format!("co_run_slowdown must be a number of at least 1, got {}", self.co_run_slowdown));
        }
        Ok(())
    }

    /// All devices.
    pub fn devices(&self) -> usize {
        self.nodes * self.devices_per_node
    }

    /// Bandwidth of a group of `size` ranks `stride` apart (ranks are numbered node by node):
    /// within a node when the group spans no more than one node's devices.
    pub fn bandwidth(&self, size: usize, stride: usize) -> f64 {
        if size * stride <= self.devices_per_node {
            self.intra_node_bandwidth
        } else {
            self.inter_node_bandwidth
        }
    }

    /// Bytes/s of a collective between computations over a group of `size` ranks `stride`
    /// apart.
    pub fn interleaved(&self, size: usize, stride: usize) -> f64 {
        self.interleaved_bandwidth.min(self.bandwidth(size, stride))
    }

    /// Bytes each rank sends in a ring all-reduce of `bytes` over `size` ranks: a
    /// reduce-scatter and an all-gather, each `size - 1` steps of `bytes / size`.
    pub fn ring_all_reduce_traffic(bytes: f64, size: usize) -> f64 {
        let n = size as f64;
        2.0 * (n - 1.0) / n * bytes
    }

    /// Seconds of a ring all-reduce of `bytes` over `size` ranks `stride` apart.
    pub fn all_reduce(&self, bytes: f64, size: usize, stride: usize) -> f64 {
        if size <= 1 {
            return 0.0;
        }
        let n = size as f64;
        2.0 * (n - 1.0) * (self.latency_s + bytes / n / self.bandwidth(size, stride))
    }

    /// Seconds of a ring all-gather (or reduce-scatter) whose whole result is `bytes`.
    pub fn all_gather(&self, bytes: f64, size: usize, stride: usize) -> f64 {
        if size <= 1 {
            return 0.0;
        }
        let n = size as f64;
        (n - 1.0) * (self.latency_s + bytes / n / self.bandwidth(size, stride))
    }

    /// Seconds to send `bytes` from one rank to another `stride` apart (a pipeline's send is
    /// posted without waiting, and its peer waits on a receive: the links' latency and the
    /// bytes).
    pub fn send(&self, bytes: f64, stride: usize) -> f64 {
        self.latency_s + bytes / self.bandwidth(2, stride)
    }

    /// How many times slower each rank computes when `busy` of every `devices_per_node`
    /// (a share, 0 to 1) compute at once: [`Cluster::core_sharing`], and the memory they
    /// share in proportion to `busy`.
    pub fn contention(&self, busy: f64) -> f64 {
        self.core_sharing(busy) * (1.0 + (self.co_run_slowdown - 1.0) * busy)
    }

    /// How many times slower each rank computes when `busy` of every `devices_per_node` (a
    /// share, 0 to 1) compute at once on shared cores: their threads over the cores, at least
    /// 1. Each rank runs the cores' share its calibration ran with (at least one thread).
    pub fn core_sharing(&self, busy: f64) -> f64 {
        if self.cores_per_node == 0 {
            return 1.0;
        }
        let threads = (self.cores_per_node / self.devices_per_node).max(1) as f64;
        (busy * self.devices_per_node as f64 * threads / self.cores_per_node as f64).max(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_keys_default_and_unknown_keys_are_named() {
        let dir = std::env::temp_dir().join(format!("cluster-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.json");
        std::fs::write(&good, r#"{"devices_per_node": 4, "peak_flops": 1e12}"#).unwrap();
        let c = Cluster::load(&good).unwrap();
        assert_eq!((c.devices_per_node, c.peak_flops, c.nodes), (4, 1e12, 1));
        let bad = dir.join("bad.json");
        std::fs::write(&bad, r#"{"peak_flop": 1e12}"#).unwrap();
        let e = Cluster::load(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.json") && e.contains("peak_flop"), "{e}");
        std::fs::write(&bad, r#"{"memory_bytes": -1}"#).unwrap();
        let e = Cluster::load(&bad).unwrap_err().to_string();
        assert!(e.contains("memory_bytes"), "{e}");
        std::fs::write(&bad, "[]").unwrap();
        let e = Cluster::load(&bad).unwrap_err().to_string();
        assert!(e.contains("not a JSON object"), "{e}");
        std::fs::write(&bad, r#"{"latency_s": 20}"#).unwrap();
        let e = Cluster::load(&bad).unwrap_err().to_string();
        assert!(e.contains("latency_s must be at least 0 and under 1 second"), "{e}");
        std::fs::write(&bad, r#"{"sync_s": 100}"#).unwrap();
        let e = Cluster::load(&bad).unwrap_err().to_string();
        assert!(e.contains("sync_s must be at least 0 and under 1 second"), "{e}");
        std::fs::write(&bad, r#"{"co_run_slowdown": 0.5}"#).unwrap();
        let e = Cluster::load(&bad).unwrap_err().to_string();
        assert!(e.contains("co_run_slowdown must be a number of at least 1"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn groups_within_a_node_use_the_faster_link() {
        let c = Cluster { nodes: 2, devices_per_node: 4, ..Cluster::default() };
        assert_eq!(c.bandwidth(4, 1), c.intra_node_bandwidth);
        assert_eq!(c.bandwidth(2, 4), c.inter_node_bandwidth);
        assert_eq!(c.all_reduce(1e6, 1, 1), 0.0);
    }
}
