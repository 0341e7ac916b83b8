//! The rules over flat fp32 buffers, each holding several parameters (Gemini's chunk homes, or
//! this rank's shard of one): [`HostOptimizer`] steps slices in host memory with multi-threaded
//! kernels, [`DeviceOptimizer`] steps tensors where they live with one torch operation per step
//! of the rule. Both run the rules' shared arithmetic with the same rounding, so host and device
//! chunks train alike, and both give the tensor optimizers' results ([`crate::optim::AdamW`],
//! [`crate::optim::Lamb`], [`crate::optim::Lars`]) to within rounding.
//!
//! A step has two halves, so that a parameter split over several buffers (shards on several
//! ranks) gets one trust ratio: `prepare` updates the moments and returns per segment the
//! sums of squares its trust ratio needs, and `finish`, given the sums added over every piece of
//! the parameter, updates the weights. Weight decay and the trust ratio apply only to segments
//! marked `adapt`.
mod device;
mod half;
mod host;
mod isa;
mod vector;

pub use device::DeviceOptimizer;
pub use half::Half;
pub use host::{sum_squares, sum_squares_scaled, HostOptimizer, StepExtras, BLOCK};

use super::{AdamWConfig, LambConfig, LarsConfig};

/// A parameter's place in a flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// The parameter's name (its module path).
    pub name: String,
    /// First element in the buffer.
    pub offset: usize,
    /// Number of elements.
    pub len: usize,
    /// Whether weight decay and the trust ratio apply.
    pub adapt: bool,
}

impl Segment {
    pub(crate) fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.len
    }
}

/// The update rule and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CpuRule {
    /// AdamW (see [`crate::optim::AdamW`]).
    AdamW(AdamWConfig),
    /// LAMB (see [`crate::optim::Lamb`]).
    Lamb(LambConfig),
    /// LARS (see [`crate::optim::Lars`]).
    Lars(LarsConfig),
}

impl CpuRule {
    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            CpuRule::AdamW(c) => c.lr,
            CpuRule::Lamb(c) => c.lr,
            CpuRule::Lars(c) => c.lr,
        }
    }

    /// Sets the learning rate.
    pub fn set_lr(&mut self, lr: f64) {
        match self {
            CpuRule::AdamW(c) => c.lr = lr,
            CpuRule::Lamb(c) => c.lr = lr,
            CpuRule::Lars(c) => c.lr = lr,
        }
    }

    /// The state buffers the rule keeps per element, by their PyTorch names: the executors
    /// keep the first as `m`, the second as `v`.
    pub fn state_slots(&self) -> &'static [&'static str] {
        match self {
            CpuRule::AdamW(_) | CpuRule::Lamb(_) => &["exp_avg", "exp_avg_sq"],
            CpuRule::Lars(c) if c.momentum != 0.0 => &["momentum_buffer"],
            CpuRule::Lars(_) => &[],
        }
    }
}
