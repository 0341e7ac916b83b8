//! The diffusion library's error type: every error names the file, key or argument involved.
use std::path::PathBuf;

/// Errors of the diffusion library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file's contents are not what they should be (the message names the key or line).
    #[error("{path}: {msg}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong and what was expected.
        msg: String,
    },
    /// Reading a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// A safetensors file could not be read or did not match the model.
    #[error(transparent)]
    Data(#[from] data::Error),
    /// An argument is out of range or inconsistent (the message names it).
    #[error("{0}")]
    Invalid(String),
    /// A libtorch operation failed.
    #[error(transparent)]
    Torch(#[from] tch::TchError),
    /// The engine failed (e.g. a checkpointed segment).
    #[error(transparent)]
    Engine(#[from] engine::Error),
}

/// The diffusion library's result type.
pub type Result<T> = std::result::Result<T, Error>;
