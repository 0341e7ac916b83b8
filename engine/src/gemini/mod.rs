//! Gemini: parameters kept in chunks that move between GPU and CPU memory as training touches
//! them, so a model trains on a GPU smaller than its parameters, gradients and optimizer state
//! need (Colossal-AI's Gemini, after PatrickStar).
//!
//! - [`chunk`]: the layout search and the per-tensor state machine.
//! - [`ChunkManager`]: residency on the compute device within a byte budget, eviction by
//!   farthest next use in the recorded access trace, prefetch along the trace, homes on the
//!   device or in host memory, ZeRO-3 sharding over a data-parallel group.
//! - [`ChunkOptimizer`]: AdamW, LAMB and LARS on the homes where they live ([`cpu_optim`] on
//!   the host, [`tensor_optim`] on the device), per-parameter trust ratios across shards.
//! - [`Gemini`]: runs a model's modules with their chunks resident, placement policies.
//! - [`checkpoint`]: full state dicts and sharded optimizer state.
//! - [`budget`]: `--gpu-mem` parsing and the allocator cap.
pub mod budget;
pub mod checkpoint;
pub mod chunk;
pub mod cpu_optim;
mod manager;
mod optimizer;
mod runtime;
pub mod tensor_optim;

pub use budget::{cap_device_memory, parse_bytes};
pub use chunk::{Layout, Slot, TensorState};
pub use cpu_optim::CpuRule;
pub use manager::{human, ChunkConfig, ChunkManager, Event, Replication, Tier};
pub use optimizer::ChunkOptimizer;
pub use runtime::{Gemini, GeminiConfig, Placement};
