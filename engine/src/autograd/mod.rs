//! Autograd beyond what tch offers: custom functions with Rust backwards, gradient hooks,
//! differentiable (and asynchronous) collectives, and activation checkpointing.
pub mod checkpoint;
pub mod collectives;
pub mod function;
pub mod hooks;

pub use checkpoint::checkpoint;
pub use function::{apply, backward, backward_into, grad, set_grad, Forward};
pub use hooks::register_post_accumulate_grad_hook;
