//! Automatic parallel planning (Colossal-Auto's idea): profile a model's layers symbolically
//! ([`profile`]), model each layout's step time and memory on a [`Cluster`] ([`cost`]), and
//! search the layouts, ZeRO stages and checkpointed blocks for the fastest that fits
//! ([`solve()`]); [`calibrate`] measures the machine's figures when no cluster file is given.
pub mod calibrate;
pub mod cluster;
pub mod cost;
pub mod profile;
pub mod solve;

pub use cluster::Cluster;
pub use cost::{estimate, Estimate, Model, Plan};
pub use profile::{LayerProfile, LayerTime, Recorder, Shard, Sym};
pub use solve::{plans, solve, Ranked, Solution};
