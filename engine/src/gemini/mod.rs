//! Gemini: parameters kept in chunks that move between GPU and CPU memory as training touches
//! them, so a model trains on a GPU smaller than its parameters, gradients and optimizer state
//! need (Colossal-AI's Gemini, after PatrickStar).
//!
//! This part has the chunks ([`chunk`]: layout search, per-tensor state machine) and the chunk
//! manager ([`ChunkManager`]: residency on the compute device within a byte budget, eviction
//! by farthest next use in the recorded access trace, prefetch along the trace, home copies on
//! the device or in host memory), and [`Gemini`], which runs a model's modules with their
//! chunks resident in forward and backward and sends gradients into the chunks, where the
//! engine's optimizers step the home copies.
pub mod chunk;
pub mod cpu_optim;
mod manager;
mod runtime;

pub use chunk::{Layout, Slot, TensorState};
pub use manager::{human, ChunkConfig, ChunkManager, Event, Tier};
pub use runtime::Gemini;
