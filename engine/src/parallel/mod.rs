//! Parallel layouts applied to models written serially: data parallelism and ZeRO, tensor
//! parallelism ([`tensor`]), sequence-parallel attention ([`sequence`]), pipeline parallelism
//! ([`pipeline`]), FastFold's DAP, and [`parallelize()`], the one step a trainer applies to
//! wire them around its model.
mod axis;
pub mod dap;
pub mod data;
pub mod parallelize;
pub mod pipeline;
pub mod sequence;
pub mod tensor;
pub mod zero;

pub use axis::Axis;
pub use data::{average_gradients, DataParallel, DataParallelConfig, GradientBytes};
pub use parallelize::{parallelize, ParallelPlan, Parallelized, Stepped};
pub use zero::{partition, ZeroOptimizer};
