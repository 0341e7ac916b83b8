//! AlphaFold's key prefixes, in one table. A key in AlphaFold's parameter files is
//! `<haiku module path>//<array>`; each of our modules is built at one of these roots and
//! appends its own sub-module names (`p.sub("attention")`, [`crate::model::scope`]), so this
//! table and the constructors together are the mapping to AlphaFold's names.
//!
//! | constant | AlphaFold module path | what is under it |
//! |---|---|---|
//! | [`ITERATION`] | `alphafold/alphafold_iteration` | one recycling iteration: the output heads ([`crate::model::heads`]) |
//! | [`EMBEDDINGS`] | `.../alphafold_iteration/evoformer` | haiku's `EmbeddingsAndEvoformer`: the embedders ([`crate::model::embedders`]), `single_activations`, the template torsion-angle embedding (`template_single_embedding`, `template_projection`) |
//! | [`EVOFORMER`] | `.../evoformer/evoformer_iteration` | the Evoformer stack's stacked block ([`crate::model::evoformer`]) |
//! | [`EXTRA_MSA`] | `.../evoformer/extra_msa_stack` | the extra-MSA stack's stacked block |
//! | [`TEMPLATE_ARRAYS`] | `.../evoformer/template_` | not a module: the prefix every template array shares (pair and torsion-angle embeddings) |
//! | [`TEMPLATE_EMBEDDING`] | `.../evoformer/template_embedding` | the template pair embedding; its pointwise `attention` ([`crate::model::templates`]) |
//! | [`SINGLE_TEMPLATE`] | `.../template_embedding/single_template_embedding` | one template's `embedding2d` and `output_layer_norm` |
//! | [`PAIR_STACK`] | `.../single_template_embedding/template_pair_stack/__layer_stack_no_state` | the template pair stack's stacked block |
//! | [`STRUCTURE_MODULE`] | `.../alphafold_iteration/structure_module` | the structure module ([`crate::model::structure`]) |
//!
//! Below a root, the shared layers keep AlphaFold's names:
//!
//! | module | AlphaFold module path (below a block) | arrays |
//! |---|---|---|
//! | [`LayerNorm`](crate::model::layers::LayerNorm) | `query_norm`, `feat_2d_norm`, `input_layer_norm`, `layer_norm_input`, `center_layer_norm` | `scale`, `offset` |
//! | [`Linear`](crate::model::layers::Linear) | `transition1/2`, `left/right_projection`, `left/right_gate`, `output_projection`, `gating_linear` | `weights` [in, out], `bias` |
//! | [`Attention`](crate::model::attention::Attention) | `.../attention` | `query_w`, `key_w`, `value_w`, `gating_w` [c, heads, dim], `gating_b` [heads, dim], `output_w` [heads, dim, c], `output_b` |
//! | [`GlobalAttention`](crate::model::attention::GlobalAttention) | `msa_column_global_attention/attention` | as above, but `key_w`, `value_w` [c, dim] |
//! | pair bias | `msa_row_attention_with_pair_bias`, `triangle_attention_*` | `feat_2d_weights` [c_z, heads] |
//! | [`OuterProductMean`](crate::model::msa::OuterProductMean) | `outer_product_mean` | `output_w` [opm, opm, c_z], `output_b` |
//!
//! The paths are spelled out whole (rather than joined from their parents) so that each reads
//! as it appears in AlphaFold's files; a test checks that each nests in its parent.

/// One recycling iteration, the parent of every head.
pub const ITERATION: &str = "alphafold/alphafold_iteration";
/// The embedders, inside AlphaFold's `EmbeddingsAndEvoformer` (also the parent of the stacks
/// and the template embeddings).
pub const EMBEDDINGS: &str = "alphafold/alphafold_iteration/evoformer";
/// The Evoformer stack's (stacked) block.
pub const EVOFORMER: &str = "alphafold/alphafold_iteration/evoformer/evoformer_iteration";
/// The extra-MSA stack's (stacked) block.
pub const EXTRA_MSA: &str = "alphafold/alphafold_iteration/evoformer/extra_msa_stack";
/// The prefix of every template array (the pair embedding and the torsion-angle embedding),
/// which a loaded store must use whole.
pub const TEMPLATE_ARRAYS: &str = "alphafold/alphafold_iteration/evoformer/template_";
/// The template pair embedding.
pub const TEMPLATE_EMBEDDING: &str = "alphafold/alphafold_iteration/evoformer/template_embedding";
/// The embedding of one template (haiku's `SingleTemplateEmbedding`).
pub const SINGLE_TEMPLATE: &str =
    "alphafold/alphafold_iteration/evoformer/template_embedding/single_template_embedding";
/// The template pair stack's (stacked) block.
pub const PAIR_STACK: &str = "alphafold/alphafold_iteration/evoformer/template_embedding/single_template_embedding/template_pair_stack/__layer_stack_no_state";
/// AlphaFold-Multimer's template pair stack's (stacked) block (`TemplateEmbeddingIteration`).
pub const MULTIMER_TEMPLATE_STACK: &str =
    "alphafold/alphafold_iteration/evoformer/template_embedding/single_template_embedding/template_embedding_iteration";
/// The structure module.
pub const STRUCTURE_MODULE: &str = "alphafold/alphafold_iteration/structure_module";
/// AlphaFold-Multimer's embedding of relative positions within and across chains (haiku names
/// the method `~_relative_encoding`; its one Linear is `position_activations`).
pub const RELATIVE_ENCODING: &str = "alphafold/alphafold_iteration/evoformer/~_relative_encoding";
/// The array only AlphaFold-Multimer's parameters have: the embedding of relative positions
/// within and across chains (haiku names the method `~_relative_encoding`).
pub const MULTIMER_RELATIVE_ENCODING: &str =
    "alphafold/alphafold_iteration/evoformer/~_relative_encoding/position_activations//weights";
/// The array only Multimer v3's parameters have: the Evoformer's fused triangle-multiplication
/// projection (v1 and v2, like the monomer models, have `left_projection` and
/// `right_projection`).
pub const FUSED_TRIANGLE_PROJECTION: &str =
    "alphafold/alphafold_iteration/evoformer/evoformer_iteration/triangle_multiplication_outgoing/projection//weights";

#[cfg(test)]
mod tests {
    use super::*;

    /// Each path is its parent's path and one more module (a typo in the spelled-out paths
    /// would otherwise only show as a missing key).
    #[test]
    fn every_path_nests_in_its_parent() {
        let child = |parent: &str, path: &str, rest: &str| assert_eq!(path, format!("{parent}/{rest}"));
        child(ITERATION, EMBEDDINGS, "evoformer");
        child(ITERATION, STRUCTURE_MODULE, "structure_module");
        child(EMBEDDINGS, EVOFORMER, "evoformer_iteration");
        child(EMBEDDINGS, EXTRA_MSA, "extra_msa_stack");
        child(EMBEDDINGS, TEMPLATE_ARRAYS, "template_");
        child(EMBEDDINGS, TEMPLATE_EMBEDDING, "template_embedding");
        child(TEMPLATE_EMBEDDING, SINGLE_TEMPLATE, "single_template_embedding");
        child(SINGLE_TEMPLATE, PAIR_STACK, "template_pair_stack/__layer_stack_no_state");
        child(SINGLE_TEMPLATE, MULTIMER_TEMPLATE_STACK, "template_embedding_iteration");
        child(EMBEDDINGS, RELATIVE_ENCODING, "~_relative_encoding");
        assert_eq!(MULTIMER_RELATIVE_ENCODING, format!("{RELATIVE_ENCODING}/position_activations//weights"));
        assert!(FUSED_TRIANGLE_PROJECTION.starts_with(&format!("{EVOFORMER}/triangle_multiplication_outgoing/")));
    }
}
