//! Stable Diffusion: the CLIP text side (tokenizer and text encoder), the noise schedulers,
//! and the models of a diffusers pipeline folder (UNet, VAE) loaded by diffusers' own key
//! names, for fine-tuning and sampling.
pub mod attention;
pub mod clip;
pub mod config;
pub mod error;
pub mod finetune;
pub mod lora;
pub mod lora_file;
pub mod pipeline;
pub mod sample;
pub mod scheduler;
pub mod single_file;
pub mod tokenizer;
pub mod unet;
pub mod vae;
pub mod weights;

pub use error::{Error, Result};
