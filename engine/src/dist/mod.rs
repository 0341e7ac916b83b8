//! The distributed runtime: stores, process groups and their collectives, device meshes,
//! joining a job from a launcher's environment, the local `--nproc` spawner and the ranks'
//! heartbeats.
mod deadline;
mod group;
pub mod heartbeat;
pub mod launch;
pub mod mesh;
pub mod spawn;
mod store;
mod work;

pub use group::{ProcessGroup, ReduceOp};
pub use launch::{init, InitOptions, LaunchEnv, Launcher, World};
pub use mesh::{DeviceMesh, ParallelDims};
pub use spawn::{maybe_relaunch, spawn, SpawnOptions};
pub use store::Store;
pub use work::{Hop, Work};
