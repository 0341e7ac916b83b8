//! Parallel layouts applied to models written serially: data parallelism so far.
pub mod data;

pub use data::{DataParallel, DataParallelConfig};
