//! Errors of the model: parameters that are missing or mis-shaped, inputs of the wrong shape,
//! and failures of the engine or of libtorch underneath.

/// Everything the model can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A parameter the model needs is not in the store or file.
    #[error("parameter {key} is missing{}", source_note(.file))]
    Missing {
        /// The AlphaFold key.
        key: String,
        /// The file it was looked for in, if any.
        file: Option<String>,
    },
    /// A parameter exists with the wrong shape.
    #[error("parameter {key}: expected shape {expected:?}, found {found:?}{}", source_note(.file))]
    Shape {
        /// The AlphaFold key.
        key: String,
        /// The shape the configuration implies.
        expected: Vec<i64>,
        /// The shape stored.
        found: Vec<i64>,
        /// The file it came from, if any.
        file: Option<String>,
    },
    /// An input tensor or configuration that cannot work.
    #[error("{0}")]
    Invalid(String),
    /// A tensor operation failed.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
    /// A collective or other engine operation failed.
    #[error(transparent)]
    Engine(#[from] engine::Error),
    /// A fused kernel could not run.
    #[error(transparent)]
    Kernels(#[from] kernels::Error),
}

fn source_note(file: &Option<String>) -> String {
    file.as_ref().map(|f| format!(" (in {f})")).unwrap_or_default()
}

/// The model's result type.
pub type Result<T> = std::result::Result<T, Error>;

/// Returns early with [`Error::Invalid`] unless the condition holds.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err($crate::model::Error::Invalid(format!($($fmt)+)));
        }
    };
}
pub(crate) use ensure;
