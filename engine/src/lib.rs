//! The parallel engine: process groups and collectives over PyTorch's c10d (Gloo for CPU
//! tensors, NCCL for CUDA tensors), launching and joining multi-process jobs, autograd
//! extensions (custom functions, gradient hooks, differentiable and asynchronous collectives,
//! activation checkpointing), optimizers and schedules, Gemini, and CUDA utilities; and what
//! every job command shares: its flags ([`job`]) and their numbers' parsers ([`parse`]),
//! device ([`device`]), progress bar ([`progress`]), training log ([`metrics`]) and process
//! facts ([`process`]); and how every benchmark runs its baseline ([`baseline`]). Tensors are
//! tch's; the few libtorch internals tch does not expose go through one small C++ bridge
//! (`csrc/`).
#![warn(missing_docs)]

pub mod autograd;
pub mod baseline;
pub mod cuda;
pub mod device;
pub mod dist;
mod error;
pub mod failure;
mod ffi;
pub mod fp32_matmul;
pub mod gemini;
pub mod host_memory;
pub mod job;
pub mod kernel_trace;
pub mod metrics;
pub mod optim;
pub mod parallel;
pub mod parse;
pub mod planner;
pub mod process;
pub mod progress;
pub mod random;
pub mod storage;

pub use error::{Error, Result};
