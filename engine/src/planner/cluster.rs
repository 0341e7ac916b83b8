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
    /// Seconds each collective call costs beyond its steps (handing it to the backend, waiting
    /// for it): what many small collectives (ZeRO's broadcast per tensor, tensor parallelism's
    /// per layer) add up to.
    pub collective_s: f64,
    /// Seconds each tensor operation costs beyond its FLOPs and bytes (dispatch, autograd's
    /// bookkeeping, a kernel launch): what dominates the step of a small model.
    pub op_overhead_s: f64,
    /// Bytes/s one device reads and writes its memory at: the optimizer's element-wise passes.
    pub memory_bandwidth: f64,
    /// Cores a node's ranks compute on, when they share them (CPU ranks of one machine): ranks
    /// that together run more threads than this are slowed by as much. 0: each device its own.
    pub cores_per_node: usize,
}

impl Default for Cluster {
    /// One node of 8 CPU ranks sharing this class of machine: 4 GiB and 50 GFLOP/s per rank,
    /// shared-memory links of 5 GB/s and 20 us (Gloo over loopback), 50 us per collective call,
    /// 10 us per operation and
    /// 10 GB/s of memory bandwidth per rank, cores not shared; assumed figures, not a
    /// calibration of the machine at hand.
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
            op_overhead_s: 10e-6,
            memory_bandwidth: 10e9,
            cores_per_node: 0,
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
        if !(self.collective_s.is_finite() && (0.0..1.0).contains(&self.collective_s)) {
            return Err(format!("collective_s must be at least 0 and under 1 second, got {}", self.collective_s));
        }
        if !(self.op_overhead_s.is_finite() && (0.0..1.0).contains(&self.op_overhead_s)) {
            return Err(format!("op_overhead_s must be at least 0 and under 1 second, got {}", self.op_overhead_s));
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

    /// Seconds to send `bytes` from one rank to another `stride` apart.
    pub fn send(&self, bytes: f64, stride: usize) -> f64 {
        self.latency_s + bytes / self.bandwidth(2, stride)
    }

    /// How many times slower each rank computes when `busy` of every `devices_per_node`
    /// (a share, 0 to 1) compute at once on shared cores: their threads over the cores, at
    /// least 1. Each rank runs the cores' share its calibration ran with (at least one thread).
    pub fn contention(&self, busy: f64) -> f64 {
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
