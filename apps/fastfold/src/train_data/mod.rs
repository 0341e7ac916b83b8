//! Training data as users have it, in OpenFold's layout (which FastFold reuses): a folder of
//! mmCIF entries (`<pdb>.cif`) and a folder of alignments with one subfolder per chain
//! (`<pdb>_<chain>/`, holding the `.a3m` and `.sto` MSAs of the search), read into examples
//! of AlphaFold's training-time pipeline.
//!
//! - [`args`]: the command-line flags, parsed into the filters and the pipeline.
//! - [`target`]: an mmCIF chain as a training target (SEQRES, atom37 positions, resolution).
//! - [`layout`]: the chains of the mmCIF and alignment folders that pass the filters.
//! - [`templates`]: the template hits of a chain, filtered by date and against the chain
//!   itself, of which each example draws up to `--max-templates`.
//! - [`transforms`]: block deletion, the crop and the recycling count, keyed by seed, step and rank.
//! - [`example`]: a chain read from the layout, and made one step's cropped example.
//! - [`complexes`]: the complexes of the layout for AlphaFold-Multimer (an entry's protein
//!   chains together), read and drawn over the run as chains are.
//! - [`loader`]: the order of the chains over the run's examples, split among data-parallel
//!   replicas, and their loading ahead on a thread pool.
pub mod args;
pub mod complexes;
pub mod example;
pub mod layout;
pub mod loader;
pub mod target;
pub mod templates;
pub mod transforms;
