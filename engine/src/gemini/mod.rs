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
//! - [`ChunkOptimizer`]: AdamW, LAMB and LARS on the homes where they live (the engine's flat
//!   executors, [`crate::optim::flat`]), per-parameter trust ratios across shards; host
//!   chunks' unscaling and clipping fused into AdamW's pass.
//! - `early.rs`: host chunks taken up on rayon's pool during a planned step's backward, as
//!   their gradients complete ([`StepPlan`]).
//! - [`Gemini`] (`training.rs`): runs a model's modules with their chunks resident, moves
//!   gradients into the chunks, and steps.
//! - [`Placement`] (`placement.rs`): where the homes live, static or after a warm-up step.
//! - [`checkpoint`]: full state dicts and sharded optimizer state.
//! - `shadow.rs`: tensors sharded as the homes are (an average of the weights, say), swapped
//!   with the homes and converted to and from full tensors by name.
//! - [`budget`]: `--gpu-mem` parsing, the process's cap split between what the CUDA context
//!   and libraries hold and the allocator's cap, byte counts for messages.
pub mod budget;
pub mod checkpoint;
pub mod chunk;
mod early;
mod manager;
mod optimizer;
mod placement;
mod shadow;
mod training;

pub use budget::{cap_device_memory, cap_process_memory, human, parse_bytes, DeviceSplit};
pub use chunk::{Layout, Slot, TensorState};
pub use early::StepPlan;
pub use manager::{ChunkConfig, ChunkManager, Event, Replication, Tier};
pub use optimizer::ChunkOptimizer;
pub use placement::Placement;
pub use training::{Gemini, GeminiConfig};

// The type of `GeminiConfig::rule`, where the config's users look for it.
pub use crate::optim::flat::CpuRule;
