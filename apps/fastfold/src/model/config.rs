//! Sizes of every module: the Evoformer and extra-MSA stacks, the embedders and heads, the
//! template embedding and the structure module. Defaults are AlphaFold 2's monomer model
//! (`alphafold/model/config.py`, `model_1`); each `infer` reads the sizes back from the
//! parameter shapes of a store.
//!
//! Where each size of AlphaFold's `config.py` comes from:
//!
//! | from | sizes |
//! |---|---|
//! | parameter shapes (`infer`) | every channel, head and block count; relative-position, recycling, distogram, lDDT, masked-MSA, experimentally-resolved and PAE bins; whether templates, torsion-angle rows and the PAE head exist; from which arrays exist, AlphaFold-Multimer's block order and v3's fused triangle projections |
//! | the preset ([`PresetSizes`], from [`crate::preset::Preset::sizes`]) | the structure module's iterations (`num_layer`, 8) and position scale (10): one shared set of weights, so no shape shows them |
//! | the preset's feature sizes ([`crate::preset::Preset`]) | MSA clusters (512, or 508 with templates) and extra-MSA rows (5120 or 1024) |
//! | constants beside their module, the same in every released monomer model | distogram bin edges (2.3125-21.6875 Å), recycled-distance bins (3.25-20.75 Å), template distogram bins (3.25-50.75 Å), the PAE head's largest error (31 Å), the masks' epsilons |
//! | the command line | recycling passes (`--num-recycle`, 3), chunking, precision |
//!
//! The sizes sit below the modules (they read only [`crate::model::keys`]), so every module,
//! the store and the model can take them without an import cycle.
use std::collections::BTreeMap;

use tch::Tensor;

use crate::model::keys::{
    EMBEDDINGS, EVOFORMER, EXTRA_MSA, FUSED_TRIANGLE_PROJECTION, ITERATION, MULTIMER_RELATIVE_ENCODING, PAIR_STACK,
    SINGLE_TEMPLATE, STRUCTURE_MODULE, TEMPLATE_EMBEDDING,
};
use crate::model::{ensure, Error, Result};

/// Channel, head and block counts of the two stacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvoformerConfig {
    /// MSA channels (`msa_channel`, 256).
    pub c_m: i64,
    /// Pair channels (`pair_channel`, 128).
    pub c_z: i64,
    /// Extra-MSA channels (`extra_msa_channel`, 64).
    pub c_e: i64,
    /// Heads of MSA row and column attention (8).
    pub msa_heads: i64,
    /// Channels per head of MSA attention (`c_m / msa_heads` = 32).
    pub msa_head_dim: i64,
    /// Heads of the extra stack's row and global column attention (8).
    pub extra_heads: i64,
    /// Channels per head in the extra stack (`c_e / extra_heads` = 8).
    pub extra_head_dim: i64,
    /// Heads of triangle attention (4).
    pub pair_heads: i64,
    /// Channels per head of triangle attention (`c_z / pair_heads` = 32).
    pub pair_head_dim: i64,
    /// Intermediate channels of triangle multiplication (128).
    pub tri_mul_channels: i64,
    /// Projection channels of the outer product mean (32).
    pub opm_channels: i64,
    /// Hidden width of the MSA and pair transitions over their input width (4).
    pub transition_factor: i64,
    /// Evoformer blocks (48).
    pub num_blocks: i64,
    /// Extra-MSA blocks (4).
    pub num_extra_blocks: i64,
    /// Whether each Evoformer block starts with the outer product mean (AlphaFold-Multimer's
    /// block order, `outer_product_mean.first`) rather than running it after the MSA
    /// transition (the monomer's, Algorithm 6).
    pub outer_product_mean_first: bool,
    /// Whether the triangle multiplications store their left and right projections and gates
    /// fused (`projection`, `gate` [c_z, 2c]: AlphaFold-Multimer v3's files,
    /// `fuse_projection_weights`) rather than as four layers.
    pub fused_triangle_projections: bool,
}

impl Default for EvoformerConfig {
    fn default() -> Self {
        EvoformerConfig {
            c_m: 256,
            c_z: 128,
            c_e: 64,
            msa_heads: 8,
            msa_head_dim: 32,
            extra_heads: 8,
            extra_head_dim: 8,
            pair_heads: 4,
            pair_head_dim: 32,
            tri_mul_channels: 128,
            opm_channels: 32,
            transition_factor: 4,
            num_blocks: 48,
            num_extra_blocks: 4,
            outer_product_mean_first: false,
            fused_triangle_projections: false,
        }
    }
}

impl EvoformerConfig {
    /// A few-thousand-parameter model for tests: every channel and head count differs, so a
    /// transposed weight shows up as a shape error.
    pub fn tiny() -> Self {
        EvoformerConfig {
            c_m: 12,
            c_z: 10,
            c_e: 6,
            msa_heads: 2,
            msa_head_dim: 5,
            extra_heads: 2,
            extra_head_dim: 3,
            pair_heads: 3,
            pair_head_dim: 4,
            tri_mul_channels: 7,
            opm_channels: 4,
            transition_factor: 2,
            num_blocks: 2,
            num_extra_blocks: 1,
            outer_product_mean_first: false,
            fused_triangle_projections: false,
        }
    }

    /// Reads the sizes from the shapes of AlphaFold-named arrays (stacked along a leading
    /// block dimension). Each size comes from one array that determines it; the model's
    /// constructors then check every array against the result. The block order is
    /// AlphaFold-Multimer's when the arrays have its relative encoding.
    pub fn infer(arrays: &BTreeMap<String, Tensor>) -> Result<Self> {
        let dims = |key: String, rank: usize| dims(arrays, key, rank);
        let e = |m: &str| format!("{EVOFORMER}/{m}");
        let row = dims(e("msa_row_attention_with_pair_bias/attention//query_w"), 4)?;
        let z = dims(e("msa_row_attention_with_pair_bias/feat_2d_norm//scale"), 2)?;
        let tri = dims(e("triangle_attention_starting_node/attention//query_w"), 4)?;
        // Multimer v3 fuses the left and right projections into one of twice the width.
        let fused = arrays.contains_key(FUSED_TRIANGLE_PROJECTION);
        let tri_mul_channels = match fused {
            true => dims(e("triangle_multiplication_outgoing/projection//weights"), 3)?[2] / 2,
            false => dims(e("triangle_multiplication_outgoing/left_projection//weights"), 3)?[2],
        };
        let opm = dims(e("outer_product_mean/left_projection//weights"), 3)?;
        let tr = dims(e("msa_transition/transition1//weights"), 3)?;
        let (c_m, c_z) = (row[1], z[1]);
        if c_m == 0 || tr[2] % c_m != 0 {
            return Err(Error::Invalid(format!(
                "parameter {}: width {} is not a multiple of the MSA channels {c_m}",
                e("msa_transition/transition1//weights"),
                tr[2]
            )));
        }
        let extra_key = format!("{EXTRA_MSA}/msa_row_attention_with_pair_bias/attention//query_w");
        let (num_extra_blocks, c_e, extra_heads, extra_head_dim) = match arrays.contains_key(&extra_key) {
            true => {
                let x = dims(extra_key, 4)?;
                (x[0], x[1], x[2], x[3])
            }
            false => (0, 0, 0, 0),
        };
        Ok(EvoformerConfig {
            c_m,
            c_z,
            c_e,
            msa_heads: row[2],
            msa_head_dim: row[3],
            extra_heads,
            extra_head_dim,
            pair_heads: tri[2],
            pair_head_dim: tri[3],
            tri_mul_channels,
            opm_channels: opm[2],
            transition_factor: tr[2] / c_m,
            num_blocks: row[0],
            num_extra_blocks,
            outer_product_mean_first: arrays.contains_key(MULTIMER_RELATIVE_ENCODING),
            fused_triangle_projections: fused,
        })
    }
}

/// Sizes of the input, recycling and extra-MSA embedders and of the output heads around the
/// stacks. Defaults are AlphaFold 2's `model_1_ptm` (`alphafold/model/config.py`);
/// [`ModelConfig::infer`] reads them back from the shapes of a store.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Single-representation channels (`seq_channel`, 384), read by the lDDT and
    /// experimentally-resolved heads.
    pub c_s: i64,
    /// Channels of `target_feat` (22: 21 residue types and the gap/unknown flag).
    pub target_feat: i64,
    /// Channels of `msa_feat` (49: 23-class one-hot, deletion flags and values, profile).
    pub msa_feat: i64,
    /// Largest relative position told apart (`max_relative_feature`, 32; `2k + 1` bins).
    pub max_relative_feature: i64,
    /// Distance bins of the recycled pseudo-beta positions (`prev_pos.num_bins`, 15).
    pub recycle_bins: i64,
    /// Distogram bins (64).
    pub distogram_bins: i64,
    /// lDDT bins (50).
    pub lddt_bins: i64,
    /// Hidden channels of the lDDT head (128).
    pub lddt_channels: i64,
    /// Classes of the masked-MSA head (23).
    pub masked_msa_classes: i64,
    /// Atoms of the experimentally-resolved head (atom37, 37).
    pub resolved_atoms: i64,
    /// Bins of the predicted-aligned-error head (64), in `_ptm` parameter sets only.
    pub aligned_error_bins: Option<i64>,
    /// The template embedding, in parameter sets that have one (`model_1`, `model_2`).
    pub templates: Option<TemplateConfig>,
    /// The structure module.
    pub structure: StructureConfig,
}

impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            c_s: 384,
            target_feat: 22,
            msa_feat: 49,
            max_relative_feature: 32,
            recycle_bins: 15,
            distogram_bins: 64,
            lddt_bins: 50,
            lddt_channels: 128,
            masked_msa_classes: 23,
            resolved_atoms: 37,
            aligned_error_bins: Some(64),
            templates: Some(TemplateConfig::default()),
            structure: StructureConfig::default(),
        }
    }
}

impl ModelConfig {
    /// Small widths for tests (none equal to a width of [`EvoformerConfig::tiny`], so a
    /// transposed weight shows up as a shape error); the feature and bin counts stay
    /// AlphaFold's, since they carry meaning (bin edges, residue classes).
    pub fn tiny() -> Self {
        ModelConfig {
            c_s: 9,
            lddt_channels: 11,
            templates: None,
            structure: StructureConfig::tiny(),
            ..ModelConfig::default()
        }
    }

    /// Reads the sizes from the shapes of AlphaFold-named arrays; the aligned-error head is
    /// optional. The modules' constructors then check every array against the result.
    pub fn infer(arrays: &BTreeMap<String, Tensor>) -> Result<Self> {
        let dims = |key: String| dims(arrays, key, 2);
        let e = |m: &str| format!("{EMBEDDINGS}/{m}//weights");
        let h = |m: &str| format!("{ITERATION}/{m}//weights");
        let rel = dims(e("pair_activiations"))?[0];
        if rel % 2 != 1 {
            return Err(Error::Invalid(format!(
                "parameter {}: {rel} relative-position bins, expected an odd number (2k + 1)",
                e("pair_activiations")
            )));
        }
        let pae_key = h("predicted_aligned_error_head/logits");
        let aligned_error_bins = match arrays.contains_key(&pae_key) {
            true => Some(dims(pae_key)?[1]),
            false => None,
        };
        let lddt = dims(h("predicted_lddt_head/act_0"))?;
        Ok(ModelConfig {
            c_s: dims(e("single_activations"))?[1],
            target_feat: dims(e("preprocess_1d"))?[0],
            msa_feat: dims(e("preprocess_msa"))?[0],
            max_relative_feature: rel / 2,
            recycle_bins: dims(e("prev_pos_linear"))?[0],
            distogram_bins: dims(h("distogram_head/half_logits"))?[1],
            lddt_bins: dims(h("predicted_lddt_head/logits"))?[1],
            lddt_channels: lddt[1],
            masked_msa_classes: dims(h("masked_msa_head/logits"))?[1],
            resolved_atoms: dims(h("experimentally_resolved_head/logits"))?[1],
            aligned_error_bins,
            templates: TemplateConfig::infer(arrays)?,
            structure: StructureConfig::infer(arrays)?,
        })
    }
}

/// Sizes of the template embedding (AlphaFold's `model_1`/`model_2` values as the default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateConfig {
    /// Template pair channels (64).
    pub c_t: i64,
    /// Blocks of the template pair stack (2).
    pub blocks: i64,
    /// Heads of the triangle attentions (4) and their width (16).
    pub pair_heads: i64,
    /// Width per head of the triangle attentions.
    pub pair_head_dim: i64,
    /// Intermediate channels of the triangle multiplications (64).
    pub tri_mul_channels: i64,
    /// Hidden width factor of the pair transition (2).
    pub transition_factor: i64,
    /// Heads of the pointwise attention (4).
    pub attention_heads: i64,
    /// Width per head of the pointwise attention (16).
    pub attention_head_dim: i64,
    /// Whether the torsion-angle features join the MSA (`embed_torsion_angles`).
    pub torsion_angles: bool,
}

impl Default for TemplateConfig {
    fn default() -> Self {
        TemplateConfig {
            c_t: 64,
            blocks: 2,
            pair_heads: 4,
            pair_head_dim: 16,
            tri_mul_channels: 64,
            transition_factor: 2,
            attention_heads: 4,
            attention_head_dim: 16,
            torsion_angles: true,
        }
    }
}

impl TemplateConfig {
    /// Small widths for tests.
    pub fn tiny() -> Self {
        TemplateConfig {
            c_t: 6,
            blocks: 1,
            pair_heads: 2,
            pair_head_dim: 3,
            tri_mul_channels: 5,
            transition_factor: 2,
            attention_heads: 2,
            attention_head_dim: 4,
            torsion_angles: true,
        }
    }

    /// Reads the sizes from the shapes of AlphaFold-named arrays; `None` when the arrays have
    /// no template embedding.
    pub fn infer(arrays: &BTreeMap<String, Tensor>) -> Result<Option<Self>> {
        let key = |m: &str, n: &str| format!("{m}//{n}");
        let embedding = key(&format!("{SINGLE_TEMPLATE}/embedding2d"), "weights");
        if !arrays.contains_key(&embedding) {
            return Ok(None);
        }
        let e = dims(arrays, embedding, 2)?;
        let dims = |k: String, rank: usize| dims(arrays, k, rank);
        let att = dims(key(&format!("{PAIR_STACK}/triangle_attention_starting_node/attention"), "query_w"), 4)?;
        let tri = dims(key(&format!("{PAIR_STACK}/triangle_multiplication_outgoing/left_projection"), "weights"), 3)?;
        let tr = dims(key(&format!("{PAIR_STACK}/pair_transition/transition1"), "weights"), 3)?;
        let point = dims(key(&format!("{TEMPLATE_EMBEDDING}/attention"), "query_w"), 3)?;
        let c_t = e[1];
        ensure!(c_t > 0 && tr[2] % c_t == 0, "template pair transition width {} is not a multiple of {c_t}", tr[2]);
        Ok(Some(TemplateConfig {
            c_t,
            blocks: att[0],
            pair_heads: att[2],
            pair_head_dim: att[3],
            tri_mul_channels: tri[2],
            transition_factor: tr[2] / c_t,
            attention_heads: point[1],
            attention_head_dim: point[2],
            torsion_angles: arrays.contains_key(&key(&format!("{EMBEDDINGS}/template_single_embedding"), "weights")),
        }))
    }
}

/// The sizes AlphaFold's config sets per preset that no parameter shape shows. AlphaFold's
/// values (the default) are the same for all ten released monomer models; tests and
/// experiments override them (`fastfold predict --structure-iterations`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PresetSizes {
    /// Iterations of the structure module's shared fold iteration (`num_layer`, 8).
    pub structure_iterations: i64,
    /// Å per unit of the structure module's internal positions (`position_scale`, 10).
    pub position_scale: f64,
}

impl Default for PresetSizes {
    fn default() -> Self {
        PresetSizes { structure_iterations: 8, position_scale: 10.0 }
    }
}

/// Sizes of the structure module (AlphaFold's values as the default).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StructureConfig {
    /// Single channels (384).
    pub c_s: i64,
    /// Pair channels (128).
    pub c_z: i64,
    /// IPA heads (12).
    pub heads: i64,
    /// Scalar query/key/value channels per head (16).
    pub c_ipa: i64,
    /// Query/key points per head (4).
    pub qk_points: i64,
    /// Value points per head (8).
    pub v_points: i64,
    /// Iterations of the shared fold iteration (8; from the preset: see [`PresetSizes`]).
    pub layers: i64,
    /// Channels of the angle resnet (128).
    pub c_resnet: i64,
    /// nm per Å inside the module, inverted (10; from the preset: see [`PresetSizes`]).
    pub position_scale: f64,
}

impl Eq for StructureConfig {}

impl Default for StructureConfig {
    fn default() -> Self {
        let preset = PresetSizes::default();
        StructureConfig {
            c_s: 384,
            c_z: 128,
            heads: 12,
            c_ipa: 16,
            qk_points: 4,
            v_points: 8,
            layers: preset.structure_iterations,
            c_resnet: 128,
            position_scale: preset.position_scale,
        }
    }
}

impl StructureConfig {
    /// Small widths for tests (AlphaFold's 8 iterations: the count is not in the arrays), matching
    /// [`crate::model::ModelConfig::tiny`] and
    /// [`crate::model::EvoformerConfig::tiny`].
    pub fn tiny() -> Self {
        StructureConfig {
            c_s: 9,
            c_z: 10,
            heads: 2,
            c_ipa: 3,
            qk_points: 2,
            v_points: 3,
            c_resnet: 5,
            ..StructureConfig::default()
        }
    }

    /// Reads the sizes from the shapes of AlphaFold-named arrays; the iteration count and
    /// position scale, which the shared weights do not record, are [`PresetSizes`]'s defaults
    /// until [`StructureConfig::with_preset`] sets them.
    pub fn infer(arrays: &BTreeMap<String, Tensor>) -> Result<Self> {
        let dims = |m: &str, name: &str, rank: usize| dims(arrays, format!("{STRUCTURE_MODULE}/{m}//{name}"), rank);
        let ipa = "fold_iteration/invariant_point_attention";
        let heads = dims(ipa, "trainable_point_weights", 1)?[0];
        ensure!(heads > 0, "parameter {STRUCTURE_MODULE}/{ipa}//trainable_point_weights: no heads");
        let q = dims(&format!("{ipa}/q_scalar"), "weights", 2)?;
        let qp = dims(&format!("{ipa}/q_point_local"), "weights", 2)?;
        let kvp = dims(&format!("{ipa}/kv_point_local"), "weights", 2)?;
        let qk_points = qp[1] / (3 * heads);
        Ok(StructureConfig {
            c_s: q[0],
            c_z: dims(&format!("{ipa}/attention_2d"), "weights", 2)?[0],
            heads,
            c_ipa: q[1] / heads,
            qk_points,
            v_points: kvp[1] / (3 * heads) - qk_points,
            c_resnet: dims("fold_iteration/rigid_sidechain/input_projection", "weights", 2)?[1],
            ..StructureConfig::default().with_preset(&PresetSizes::default())
        })
    }

    /// The same sizes with the preset's iteration count and position scale.
    pub fn with_preset(self, preset: &PresetSizes) -> Self {
        StructureConfig { layers: preset.structure_iterations, position_scale: preset.position_scale, ..self }
    }
}

/// The shape of the array under `key`, which must have `rank` dimensions: the one lookup of
/// every `infer`, so a missing or mis-ranked array is reported the same way for each module.
fn dims(arrays: &BTreeMap<String, Tensor>, key: String, rank: usize) -> Result<Vec<i64>> {
    let t = arrays.get(&key).ok_or_else(|| Error::Missing { key: key.clone(), file: None })?;
    let found = t.size();
    ensure!(found.len() == rank, "parameter {key}: expected {rank} dimensions, found shape {found:?}");
    Ok(found)
}
