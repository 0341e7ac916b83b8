//! `fastfold`: AlphaFold 2 structure prediction with dynamic axial parallelism (DAP): input
//! features, homology search, residue tables, the model, confidence measures, losses and PDB output.
pub mod checkpoint;
pub mod confidence;
pub mod features;
pub mod geometry;
pub mod ground_truth;
pub mod input;
pub mod jax_random;
pub mod loss;
pub mod memory;
pub mod model;
pub mod models;
pub mod multimer;
pub mod pdb;
pub mod plots;
pub mod predict;
pub mod preset;
pub mod profile;
pub mod query_folder;
pub mod ranking;
pub mod residue_constants;
pub mod search;
pub mod train;
pub mod train_data;
pub mod train_parallel;
pub mod train_target;
pub mod validation;
