//! Stable Diffusion in Rust: the models of a diffusers pipeline folder (UNet, VAE), loaded by
//! diffusers' own key names, for fine-tuning and sampling.
use std::path::PathBuf;

pub mod attention;
pub mod config;
pub mod unet;
pub mod vae;
pub mod weights;

/// Errors of the diffusion library; each names the file, key or argument involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file's contents are not what they should be (the message names the key or field).
    #[error("{path}: {msg}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
    /// Arguments that cannot work (input shapes, configurations built in code).
    #[error("{0}")]
    Invalid(String),
    /// Reading or writing a weights file failed.
    #[error(transparent)]
    Data(#[from] data::Error),
    /// The engine failed (e.g. a checkpointed segment).
    #[error(transparent)]
    Engine(#[from] engine::Error),
    /// A tch call failed.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
}

/// The diffusion library's result type.
pub type Result<T> = std::result::Result<T, Error>;
