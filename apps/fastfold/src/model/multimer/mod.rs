//! AlphaFold-Multimer's network (Evans et al. 2021; DeepMind's
//! `alphafold/model/modules_multimer.py`), piece by piece under AlphaFold's parameter names.
//! What differs from the monomer model lives here; what is the same is reused from the
//! monomer's modules.
//!
//! | piece | AlphaFold | here |
//! |---|---|---|
//! | input embedding: `target_feat` one-hot of 21 classes, relative encoding over chains | `EmbeddingsAndEvoformer._relative_encoding`, `preprocess_1d`, `preprocess_msa`, `left_single`, `right_single` | [`relpos`] |
//! | Evoformer block with the outer product mean first | `EvoformerIteration`, `outer_product_mean.first` | [`crate::model::EvoformerConfig::outer_product_mean_first`] |
//! | v3's fused triangle-multiplication projections | `TriangleMultiplication`, `fuse_projection_weights` | [`crate::model::triangle::TriangleMultiplication::fused`] |
//! | ipTM, pTM and the ranking `0.8 ipTM + 0.2 pTM` | `confidence.predicted_tm_score(..., asym_id)` | [`crate::confidence`] |
//!
//! Not yet here: the multimer template embedding, the structure module of
//! `folding_multimer.py`, the assembled model (with in-network MSA sampling); `fastfold
//! predict` refuses multimer parameter files until they are.
pub mod relpos;

pub use relpos::{relative_encoding, ChainIds, MultimerInputEmbedder};
