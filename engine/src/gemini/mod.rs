//! Gemini: parameters kept in chunks that move between GPU and CPU memory as training touches
//! them, so a model trains on a GPU smaller than its parameters, gradients and optimizer state
//! need (Colossal-AI's Gemini, after PatrickStar).
//!
//! - [`chunk`]: the layout search and the per-tensor state machine.
//! - [`ChunkManager`]: residency on the compute device within a byte budget, eviction by
//!   farthest next use in the recorded access trace, prefetch along the trace, homes on the
//!   device or in host memory, ZeRO-3 sharding over a data-parallel group.
//! - [`ChunkOptimizer`]: AdamW, LAMB and LARS on the homes where they live (the engine's flat
//!   executors, [`crate::optim::flat`]), per-parameter trust ratios across shards.
//! - [`Gemini`]: runs a model's modules with their chunks resident, placement policies.
//! - [`checkpoint`]: full state dicts and sharded optimizer state.
//! - [`budget`]: `--gpu-mem` parsing and the allocator cap.
pub mod budget;
pub mod checkpoint;
pub mod chunk;
mod manager;
mod optimizer;
mod runtime;

pub use budget::{cap_device_memory, parse_bytes};
pub use chunk::{Layout, Slot, TensorState};
pub use manager::{human, ChunkConfig, ChunkManager, Event, Replication, Tier};
pub use optimizer::ChunkOptimizer;
pub use runtime::{Gemini, GeminiConfig, Placement};

// The type of `GeminiConfig::rule`, where the config's users look for it.
pub use crate::optim::flat::CpuRule;
