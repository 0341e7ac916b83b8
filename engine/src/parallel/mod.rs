//! Parallel layouts applied to models written serially: data parallelism and ZeRO, pipeline
//! parallelism, and
//! [`parallelize`], the one step a trainer applies to wire them around its model.
pub mod dap;
pub mod data;
pub mod parallelize;
pub mod pipeline;
pub mod zero;

pub use data::{DataParallel, DataParallelConfig, GradientBytes};
pub use parallelize::{parallelize, ParallelPlan, Parallelized};
pub use zero::{partition, ZeroOptimizer};
