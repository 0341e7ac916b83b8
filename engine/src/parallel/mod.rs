//! Parallel layouts applied to models written serially: data parallelism and ZeRO so far.
pub mod dap;
pub mod data;
pub mod zero;

pub use data::{DataParallel, DataParallelConfig};
pub use zero::{partition, ZeroOptimizer};
