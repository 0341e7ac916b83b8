//! AlphaFold 2's Evoformer (Jumper et al. 2021, supplementary Algorithms 6-19) under
//! AlphaFold's parameter names, with chunked evaluation of the memory-heavy steps and dynamic
//! axial parallelism ([`engine::parallel::dap`]).
pub mod alphafold;
pub mod attention;
pub mod config;
pub mod embedders;
mod error;
pub mod evoformer;
pub mod heads;
pub mod layers;
pub mod msa;
pub mod params;
pub mod structure;
pub mod templates;
pub mod triangle;

pub use config::{EvoformerConfig, ModelConfig};
pub use embedders::{Embedders, Recycled};
pub(crate) use error::ensure;
pub use error::{Error, Result};
pub use evoformer::{BlockMasks, EvoformerBlock, EvoformerStack};
pub use heads::{HeadInputs, HeadOutputs, Heads};
pub use params::{Params, EVOFORMER, EXTRA_MSA};
