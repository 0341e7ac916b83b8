//! The engine's error type.

/// Everything that can go wrong in the engine.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error raised inside libtorch or c10d, carried across the C++ bridge.
    #[error("{context}: {message}")]
    Torch {
        /// What the engine was doing.
        context: String,
        /// libtorch's message.
        message: String,
    },
    /// A tch call failed.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
    /// Arguments that cannot work (shapes, sizes, ranks, flags).
    #[error("{0}")]
    Invalid(String),
    /// The launch environment is incomplete or inconsistent.
    #[error("launch environment: {0}")]
    Launch(String),
    /// One or more ranks of a locally spawned job failed.
    #[error("{0}")]
    RankFailed(String),
    /// CUDA is needed and absent.
    #[error("CUDA not available: {0}")]
    CudaUnavailable(String),
    /// An I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What the engine was doing.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

/// The engine's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Invalid`] from anything printable.
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::Invalid(message.into())
    }

    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { context: context.into(), source }
    }
}

/// Returns early with [`Error::Invalid`] unless the condition holds.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::Error::Invalid(format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;
