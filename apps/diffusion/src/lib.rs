//! Stable Diffusion: the CLIP text side (tokenizer and text encoder), the noise schedulers,
//! and the models and recipes built on them.
pub mod clip;
pub mod error;
pub mod scheduler;
pub mod tokenizer;

pub use error::{Error, Result};
