//! The crate's error type.

/// Everything that can go wrong compiling, loading or launching a kernel.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// NVRTC (CUDA's run-time compiler library) was not found or is unusable.
    #[error("NVRTC could not be loaded: {0}")]
    Nvrtc(String),
    /// A kernel source did not compile.
    #[error("compiling kernel {kernel} for {arch} with NVRTC {version} failed:\n{log}")]
    Compile {
        /// The kernel's name.
        kernel: &'static str,
        /// The virtual architecture (`compute_90`).
        arch: String,
        /// NVRTC's version, `major.minor`.
        version: String,
        /// NVRTC's log.
        log: String,
    },
    /// The CPU emulator (tests without a GPU) could not build, load or run a kernel.
    #[error("kernel emulator: {0}")]
    Emulator(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {context}: {message}")]
    Driver {
        /// What was being done.
        context: String,
        /// The driver's error name.
        message: String,
    },
    /// Arguments a kernel cannot take (device, dtype, shape), or a backend that cannot run here.
    #[error("{0}")]
    Invalid(String),
    /// An engine call failed (streams, autograd).
    #[error(transparent)]
    Engine(#[from] engine::Error),
    /// A tch call failed.
    #[error(transparent)]
    Tch(#[from] tch::TchError),
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// An [`Error::Invalid`] from anything printable.
    pub fn invalid(message: impl Into<String>) -> Self {
        Error::Invalid(message.into())
    }

    /// An [`Error::Driver`] from a cudarc driver error.
    pub(crate) fn driver(context: impl Into<String>, err: cudarc::driver::DriverError) -> Self {
        let message = err.error_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{err:?}"));
        Error::Driver { context: context.into(), message }
    }
}

/// The error as an engine error, for autograd backwards (which return engine results).
impl From<Error> for engine::Error {
    fn from(e: Error) -> Self {
        match e {
            Error::Engine(e) => e,
            other => engine::Error::invalid(other.to_string()),
        }
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
