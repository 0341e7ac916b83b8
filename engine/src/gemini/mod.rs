//! Gemini: parameters kept in chunks that move between GPU and CPU memory as training touches
//! them, so a model trains on a GPU smaller than its parameters, gradients and optimizer state
//! need (Colossal-AI's Gemini, after PatrickStar).
//!
//! - [`chunk`]: the layout search and the per-tensor state machine.
//! - [`ChunkManager`] (`manager/`): the chunks, their homes on the device or in host memory
//!   and the byte budget (`mod.rs`); residency: access, eviction by farthest next use in the
//!   recorded access trace, prefetch along the trace (`residency.rs`); gradients accumulated
//!   into the chunks and reduced over a data-parallel group, ZeRO-3 sharded or replicated
//!   (`gradients.rs`).
//! - [`ChunkOptimizer`]: AdamW, LAMB and LARS on the homes where they live ([`cpu_optim`] on
//!   the host, [`tensor_optim`] on the device), per-parameter trust ratios across shards.
//! - [`Gemini`] (`training.rs`): runs a model's modules with their chunks resident, moves
//!   gradients into the chunks, and steps.
//! - [`Placement`] (`placement.rs`): where the homes live, static or after a warm-up step.
//! - [`checkpoint`]: full state dicts and sharded optimizer state.
//! - [`budget`]: `--gpu-mem` parsing, the allocator cap, byte counts for messages.
pub mod budget;
pub mod checkpoint;
pub mod chunk;
pub mod cpu_optim;
mod manager;
mod optimizer;
mod placement;
pub mod tensor_optim;
mod training;

pub use budget::{cap_device_memory, human, parse_bytes};
pub use chunk::{Layout, Slot, TensorState};
pub use cpu_optim::CpuRule;
pub use manager::{ChunkConfig, ChunkManager, Event, Replication, Tier};
pub use optimizer::ChunkOptimizer;
pub use placement::Placement;
pub use training::{Gemini, GeminiConfig};
