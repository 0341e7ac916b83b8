//! Fused GPU kernels: CUDA C compiled at run time by NVRTC (through cudarc; no CUDA toolkit at
//! build time), cached on disk by source hash and architecture, and launched on libtorch's
//! current CUDA stream on the tensors' own memory. Every operation has a libtorch composition
//! beside it ([`Backend::Torch`]): the path on the CPU, and the reference the kernels are tested
//! against.
//!
//! - [`attention_softmax`]: Evoformer attention's scale + mask + pair bias + softmax (and
//!   [`attention_softmax_in_place`], over its logits, for inference);
//! - [`memory_efficient_attention`]: the whole attention with mask and pair bias, without
//!   materialising the weights;
//! - [`flash_attention`]: the same forward on tensor cores, for inference;
//! - [`layer_norm`] (and the [`LayerNorm`] layer);
//! - [`bias_gelu`] and [`bias_dropout_residual`];
//! - [`sigmoid_gate`]: triangle multiplication's gated projections, the output gates;
//! - [`adamw_step`], [`lamb_step`] and [`lars_step`]: one launch updates every parameter
//!   (multi-tensor).
//!
//! Forward and backward for f32, bf16 and f16 (the optimizers: f32).
mod attention;
mod cache;
mod checks;
mod elementwise;
pub mod emulator;
mod error;
mod flash;
mod gate;
mod kernel;
mod launch;
mod layer_norm;
mod memory_efficient;
mod nvrtc;
mod optim;

pub use attention::{attention_softmax, attention_softmax_in_place};
pub use cache::CACHE_ENV;
pub use elementwise::{bias_dropout_residual, bias_gelu, dropout_mask};
pub use error::{Error, Result};
pub use flash::flash_attention;
pub use gate::sigmoid_gate;
pub use kernel::Kernel;
pub use layer_norm::{layer_norm, LayerNorm};
pub use memory_efficient::memory_efficient_attention;
pub use nvrtc::{nvrtc, Nvrtc, NVRTC_ENV};
pub use optim::{adamw_step, install_optimizer_steps, lamb_step, lars_step, LarsTensors, MultiTensor, OptimTensors};

use tch::Device;

/// Every kernel source, for the compile checks.
pub const ALL: &[&Kernel] = &[
    &attention::KERNEL,
    &memory_efficient::KERNEL,
    &flash::KERNEL,
    &layer_norm::KERNEL,
    &elementwise::KERNEL,
    &gate::KERNEL,
    &optim::KERNEL,
];

/// Which implementation an operation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// The fused CUDA kernels (CUDA tensors only).
    Fused,
    /// The libtorch composition (any device).
    Torch,
}

impl Backend {
    /// The default for a device: fused on CUDA, the composition elsewhere.
    pub fn default_for(device: Device) -> Backend {
        match device {
            Device::Cuda(_) => Backend::Fused,
            _ => Backend::Torch,
        }
    }

    /// The backend for `--kernels` (`None`: the device's default); fused on a non-CUDA device
    /// is an error naming the flag (but for the CPU while the emulator is on: tests).
    pub fn resolve(choice: Option<Backend>, device: Device) -> Result<Backend> {
        match (choice, device) {
            (None, d) => Ok(Backend::default_for(d)),
            (Some(Backend::Torch), _) => Ok(Backend::Torch),
            (Some(Backend::Fused), d) if launch::Target::of(d).is_some() => Ok(Backend::Fused),
            (Some(Backend::Fused), d) => Err(Error::invalid(format!(
                "--kernels fused needs a CUDA device; this run is on {d:?} (use --kernels torch)"
            ))),
        }
    }
}
