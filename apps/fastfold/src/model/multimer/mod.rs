//! AlphaFold-Multimer's network (Evans et al. 2021; DeepMind's
//! `alphafold/model/modules_multimer.py`), piece by piece under AlphaFold's parameter names.
//! What differs from the monomer model lives here; what is the same is reused from the
//! monomer's modules.
//!
//! | piece | AlphaFold | here |
//! |---|---|---|
//! | input embedding: `target_feat` one-hot of 21 classes, relative encoding over chains | `EmbeddingsAndEvoformer._relative_encoding`, `preprocess_1d`, `preprocess_msa`, `left_single`, `right_single` | [`relpos`] |
//! | the MSA sampled inside the network on each recycle, with JAX's random draws: cluster centres by Gumbel noise, BERT masking, nearest-neighbour cluster profiles | `sample_msa`, `make_masked_msa`, `nearest_neighbor_clusters`, `make_msa_profile` | [`sampling`] |
//! | `msa_feat` and the extra-MSA feature from the sampled MSA's classes and deletions | `create_msa_feat`, `create_extra_msa_feature` | [`msa_feat`](mod@msa_feat) |
//! | Evoformer block with the outer product mean first | `EvoformerIteration`, `outer_product_mean.first` | [`crate::model::EvoformerConfig::outer_product_mean_first`] |
//! | v3's fused triangle-multiplication projections | `TriangleMultiplication`, `fuse_projection_weights` | [`crate::model::triangle::TriangleMultiplication::fused`] |
//! | the template pair stack's input: each pair feature (unit vectors from backbone frames included) through its own Linear, plus the normalised query | `SingleTemplateEmbedding`'s `construct_input` | [`templates`] |
//! | the whole template embedding: the pair stack (the monomer's blocks in the Evoformer's pair order), `output_layer_norm`, the mean over templates, ReLU, `output_linear` | `TemplateEmbedding`, `TemplateEmbeddingIteration` | [`templates::MultimerTemplates`] |
//! | the templates' MSA rows from their residue types and chi angles | `template_embedding_1d`, `all_atom_multimer.compute_chi_angles` | [`template_rows`] |
//! | ipTM, pTM and the ranking `0.8 ipTM + 0.2 pTM` | `confidence.predicted_tm_score(..., asym_id)` | [`crate::confidence`] |
//! | the structure module: invariant point attention with per-head projections, `QuatRigid`'s backbone update, `position_scale` 20 | `folding_multimer.StructureModule` | [`structure`] |
//! | the whole network over a parameter file (`params_model_N_multimer_v3.npz` layout): each pass's sampling keys, embeddings, recycled state, templates, extra-MSA stack, Evoformer, structure module and every head (distogram, masked MSA, pLDDT, PAE, experimentally resolved); v2.3's recycling loop with its key splits and early stop on the CA distance change | `AlphaFold`, `AlphaFoldIteration`, `EmbeddingsAndEvoformer` | [`alphafold::MultimerAlphaFold`] |
//!
//! `fastfold predict` runs the assembled model on a complex (`predict::complex`); its structure
//! module's loss and the chain permutation alignment are [`crate::loss::multimer`] and
//! [`crate::loss::chain_permutation`]; `fastfold train` trains it on a complex
//! ([`MultimerAlphaFold::train_forward`], [`crate::train_complex`]). Not yet here: GPU runs of the
//! assembled model (it is checked in fp32 on the CPU only, on one rank and under DAP on two,
//! `tests/dap.rs`; bf16 only against fp32, `tests/multimer_input.rs`).
use std::collections::BTreeMap;
use std::path::Path;

use tch::Tensor;

use crate::model::config::EvoformerConfig;
use crate::model::params::{read_arrays, Params};
use crate::model::scope::{Builder, Mode};
use crate::model::{ensure, Error, Result};

pub mod alphafold;
pub mod msa_feat;
pub mod relpos;
pub mod sampling;
pub mod structure;
pub mod template_rows;
pub mod templates;

pub use alphafold::{
    evoformer_key, network_key, sampling_keys, stack_keys, structure_key, MultimerAlphaFold, MultimerInputs,
};
pub use msa_feat::{extra_msa_feat, msa_feat};
pub use relpos::{relative_encoding, ChainIds, MultimerInputEmbedder};
pub use sampling::{FullMsa, MaskedMsaConfig, MsaSampling, SampledMsa};
pub use structure::{load_structure_module, MULTIMER_POSITION_SCALE, MULTIMER_STRUCTURE_ITERATIONS};
pub use template_rows::{chi_angles, MultimerTemplateRows};
pub use templates::{MultimerTemplates, TemplateAtoms, TemplateBatch, TemplatePairEmbedding};

/// AlphaFold-Multimer's parameters from a file (`.npz` or `.safetensors`) as a parameter store,
/// in fp32, for training ([`MultimerAlphaFold::from_params`] builds the network over it, and
/// checks that every array has a user). An error names the file when its arrays are not
/// Multimer's or hold NaN or infinite values.
pub fn load_multimer_params(path: &Path) -> Result<Params> {
    let arrays = Arrays::open(path)?;
    let file = arrays.file;
    let mut map = BTreeMap::new();
    for (name, t) in arrays.arrays {
        let t = t.f_to_kind(tch::Kind::Float)?;
        ensure!(bool::try_from(t.f_isfinite()?.f_all()?)?, "parameter {name} has NaN or infinite values (in {file})");
        map.insert(name, t);
    }
    let config = EvoformerConfig::infer(&map).map_err(|e| Error::Invalid(format!("{file}: {e}")))?;
    ensure!(
        config.outer_product_mean_first,
        "{file} is not an AlphaFold-Multimer parameter file (it has no relative chain encoding)"
    );
    Ok(Params::from_parts(map, config))
}

/// The arrays of a parameter file (`.npz` or `.safetensors`) for building one module over
/// them: `size(key, dim)` reads a width from the shapes (an error naming the key and the
/// file), then `builder()` checks every array the module asks for.
struct Arrays {
    arrays: BTreeMap<String, Tensor>,
    file: String,
}

impl Arrays {
    fn open(path: &Path) -> Result<Arrays> {
        Ok(Arrays { arrays: read_arrays(path)?.into_iter().collect(), file: path.display().to_string() })
    }

    /// The same arrays on `device`, floating-point ones converted to `kind` if given.
    fn into_device(self, device: tch::Device, kind: Option<tch::Kind>) -> Result<Arrays> {
        let to = |t: Tensor| -> Result<Tensor> {
            let t = t.f_to_device(device)?;
            Ok(match kind {
                Some(kind) if t.is_floating_point() => t.f_to_kind(kind)?,
                _ => t,
            })
        };
        let arrays = self.arrays.into_iter().map(|(k, t)| Ok((k, to(t)?))).collect::<Result<_>>()?;
        Ok(Arrays { arrays, file: self.file })
    }

    /// Dimension `dim` of the array `key`, which must have `rank` dimensions.
    fn size(&self, key: &str, rank: usize, dim: usize) -> Result<i64> {
        let file = &self.file;
        let t = self.arrays.get(key).ok_or_else(|| Error::Missing { key: key.into(), file: Some(file.clone()) })?;
        let size = t.size();
        ensure!(size.len() == rank, "parameter {key}: expected {rank} dimensions, found shape {size:?} (in {file})");
        Ok(size[dim])
    }

    /// The element kind of the array `key` (the kind a network over these arrays computes in).
    fn kind(&self, key: &str) -> Result<tch::Kind> {
        let file = &self.file;
        let t = self.arrays.get(key).ok_or_else(|| Error::Missing { key: key.into(), file: Some(file.clone()) })?;
        Ok(t.kind())
    }

    /// Whether the file has the array `key`.
    fn contains(&self, key: &str) -> bool {
        self.arrays.contains_key(key)
    }

    fn builder(self) -> Builder {
        Builder::new(Mode::Load, self.arrays, Some(self.file))
    }

    /// A builder over the same arrays (shared, not copied), for building several modules over
    /// one file and then asking which arrays none of them used.
    fn shared_builder(&self) -> Builder {
        let arrays = self.arrays.iter().map(|(k, t)| (k.clone(), t.shallow_clone())).collect();
        Builder::new(Mode::Load, arrays, Some(self.file.clone()))
    }
}
