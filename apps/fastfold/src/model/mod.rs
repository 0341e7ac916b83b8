//! AlphaFold 2's Evoformer (Jumper et al. 2021, supplementary Algorithms 6-19) under
//! AlphaFold's parameter names, with chunked evaluation of the memory-heavy steps and dynamic
//! axial parallelism ([`engine::parallel::dap`]).
//!
//! The files form layers, and each file imports only from files listed before it, so there is
//! no import cycle:
//!
//! 1. Leaves: `error` ([`Error`]), [`keys`] (AlphaFold's key prefixes), [`scope`] (`Builder`,
//!    [`scope::Scope`], [`scope::Init`]: how a constructor asks for its arrays), [`config`]
//!    (every module's sizes and their inference from shapes, reading only `keys`), [`dropout`]
//!    (training dropout's masks from JAX keys), [`layers`]
//!    (`Linear`, `LayerNorm`, chunking, over `scope`), [`masked_rows`] (which MSA rows the
//!    stacks can leave out), [`exec`] ([`Exec`]: the DAP group and chunk size a forward runs
//!    under), [`pair_rows`] (which of the pair's rows a rank holds through a pass).
//! 2. The store: [`params`] ([`Params`]: the arrays, their files, `Params::builder`), over
//!    `config` and `scope`.
//! 3. Building blocks: [`attention`], then [`triangle`] and [`msa`].
//! 4. Modules: [`embedders`], then [`heads`] and [`templates`] (which reuse embedder
//!    helpers), [`evoformer`], [`structure`]; each builds itself at its `keys` root, from a
//!    `&Params` or a `Builder`. [`multimer`]: AlphaFold-Multimer's own modules (reusing the
//!    embedders' projections), not yet assembled into a model.
//! 5. Assembly: `assemble` (creating and loading a [`Params`]: every module built over the
//!    arrays, and the check that none went unused), [`recycling`] (how many passes run) and
//!    [`alphafold`] (the whole model).
pub mod alphafold;
mod assemble;
pub mod attention;
pub mod config;
pub mod dropout;
pub mod embedders;
mod error;
pub mod evoformer;
pub mod exec;
pub mod heads;
pub mod keys;
pub mod layers;
pub mod masked_rows;
pub mod msa;
pub mod multimer;
pub mod pair_rows;
pub mod params;
pub mod recycling;
pub mod scope;
pub mod structure;
pub mod templates;
pub mod triangle;

pub use config::{EvoformerConfig, ModelConfig, PresetSizes, StructureConfig, TemplateConfig};
pub use embedders::{Embedders, Recycled};
pub(crate) use error::ensure;
pub use error::{Error, Result};
pub use evoformer::{BlockDropout, BlockMasks, EvoformerBlock, EvoformerStack};
pub use exec::Exec;
pub use heads::{HeadInputs, HeadOutputs, Heads};
pub use keys::{EVOFORMER, EXTRA_MSA};
pub use params::Params;
pub use scope::AttentionKernel;
