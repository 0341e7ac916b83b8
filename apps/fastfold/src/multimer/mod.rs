//! AlphaFold-Multimer's input: a FASTA file with several records as one complex
//! ([`complex`]), the model presets and their defaults ([`preset`]), the options that ask for
//! a multimer run ([`args`]), the per-chain searches ([`search`]) and the feature pipeline that turns each entity's searches into the complex's
//! features ([`pipeline`]), equal to DeepMind's `pipeline_multimer.py`, `msa_pairing.py` and
//! `feature_processing.py` on the same alignments and templates (`tests/multimer_features.rs`).
//! The network is not here yet: `fastfold predict` refuses a multimer run, saying so.
pub mod args;
pub mod complex;
pub mod features;
pub mod grid;
pub mod pairing;
pub mod pipeline;
pub mod preset;
pub mod search;
pub mod species;

pub use complex::{Chain, Complex};
pub use features::{EntityInput, MultimerFeatures, PairingMsa};
pub use pipeline::features;
