//! AlphaFold-Multimer's input embedding (`EmbeddingsAndEvoformer` in `modules_multimer.py`):
//! the monomer's feature projections (`FeatureProjections`: `preprocess_1d`,
//! `preprocess_msa`, `left_single`, `right_single`) on a `target_feat` that is the one-hot of
//! 21 residue classes (no gap flag), and a relative encoding over chains in place of the
//! monomer's relative positions, embedded by `~_relative_encoding/position_activations`.
//!
//! The relative encoding of residues `i`, `j` ([`relative_encoding`], `use_chain_relative`)
//! concatenates three parts, 73 channels with AlphaFold's limits:
//!
//! | part | channels | value |
//! |---|---|---|
//! | relative position | `2·32 + 2` | one-hot of `clip(res_i - res_j + 32, 0, 64)` within a chain (same `asym_id`), else bin 65 ("different chain") |
//! | same entity | 1 | `entity_id_i == entity_id_j` |
//! | relative chain | `2·2 + 2` | one-hot of `clip(sym_i - sym_j + 2, 0, 4)` within an entity, else bin 5 |
//!
//! so copies of one chain (a homomer) are told apart by their `sym_id` and chains of other
//! entities share one bin whatever their order.
use std::path::Path;

use tch::{Kind, Tensor};

use crate::model::embedders::{shape_error, FeatureProjections};
use crate::model::exec::Exec;
use crate::model::keys::{EMBEDDINGS, RELATIVE_ENCODING};
use crate::model::layers::{narrow, Linear};
use crate::model::multimer::Arrays;
use crate::model::pair_rows::PairRows;
use crate::model::scope::Builder;
use crate::model::{ensure, Result};

/// Largest relative position told apart within a chain (`max_relative_idx`, 32 in every
/// multimer model).
pub const MAX_RELATIVE_IDX: i64 = 32;
/// Largest relative chain index told apart within an entity (`max_relative_chain`, 2).
pub const MAX_RELATIVE_CHAIN: i64 = 2;
/// Channels of the relative encoding: positions and the "different chain" bin, the
/// same-entity flag, chains and the "different entity" bin (73).
pub const RELATIVE_FEATURES: i64 = (2 * MAX_RELATIVE_IDX + 2) + 1 + (2 * MAX_RELATIVE_CHAIN + 2);
/// Residue classes of `target_feat` (20 amino acids and unknown; AlphaFold's `aatype`).
pub const TARGET_CLASSES: i64 = 21;

/// Per-residue chain identities of a complex, each `[N]` (any numeric kind), as the multimer
/// input pipeline makes them ([`crate::multimer`]).
pub struct ChainIds<'a> {
    /// Residue number within its chain.
    pub residue_index: &'a Tensor,
    /// The chain (1-based, one per chain of the complex).
    pub asym_id: &'a Tensor,
    /// The distinct sequence the chain is a copy of.
    pub entity_id: &'a Tensor,
    /// Which copy of its entity the chain is (1-based).
    pub sym_id: &'a Tensor,
}

impl ChainIds<'_> {
    /// The residue count, after checking that every id is [N] for the same N.
    fn residues(&self) -> Result<i64> {
        let n = match self.residue_index.size().as_slice() {
            [n] => *n,
            _ => return Err(shape_error("residue_index", "[residues]".into(), self.residue_index.size())),
        };
        for (what, t) in [("asym_id", self.asym_id), ("entity_id", self.entity_id), ("sym_id", self.sym_id)] {
            if t.size() != [n] {
                return Err(shape_error(what, format!("[{n}] (as residue_index)"), t.size()));
            }
        }
        Ok(n)
    }
}

/// The relative encoding [N, N, 73] of `ids` (the module docs' table), of kind `kind`.
pub fn relative_encoding(ids: &ChainIds, kind: Kind) -> Result<Tensor> {
    let n = ids.residues()?;
    relative_encoding_rows(ids, 0, n, kind)
}

/// Rows `[start, start + rows)` of [`relative_encoding`] ([rows, N, 73]).
fn relative_encoding_rows(ids: &ChainIds, start: i64, rows: i64, kind: Kind) -> Result<Tensor> {
    // (rows of `t` as a column [rows, 1], all of `t` as a row [1, N]), as integers.
    let outer = |t: &Tensor| -> Result<(Tensor, Tensor)> {
        let t = t.f_to_kind(Kind::Int64)?;
        Ok((narrow(&t, 0, start, rows)?.f_unsqueeze(1)?, t.f_unsqueeze(0)?))
    };
    // clip(a_i - a_j + k, 0, 2k) where `same`, else the extra bin 2k + 1; one-hot of 2k + 2.
    let clipped = |(a, b): (Tensor, Tensor), k: i64, same: &Tensor| -> Result<Tensor> {
        let bins = a.f_sub(&b)?.f_add_scalar(k)?.f_clamp(0, 2 * k)?;
        let other = bins.f_full_like(2 * k + 1)?;
        Ok(bins.f_where_self(same, &other)?.f_one_hot(2 * k + 2)?.f_to_kind(kind)?)
    };
    let (ai, aj) = outer(ids.asym_id)?;
    let same_chain = ai.f_eq_tensor(&aj)?;
    let (ei, ej) = outer(ids.entity_id)?;
    let same_entity = ei.f_eq_tensor(&ej)?;
    let position = clipped(outer(ids.residue_index)?, MAX_RELATIVE_IDX, &same_chain)?;
    let chain = clipped(outer(ids.sym_id)?, MAX_RELATIVE_CHAIN, &same_entity)?;
    Ok(Tensor::f_cat(&[position, same_entity.f_to_kind(kind)?.f_unsqueeze(-1)?, chain], -1)?)
}

/// The multimer `target_feat`: the one-hot [N, 21] of `aatype` `[N]` (classes 0-20), of kind
/// `kind`.
pub fn target_feat(aatype: &Tensor, kind: Kind) -> Result<Tensor> {
    if aatype.size().len() != 1 {
        return Err(shape_error("aatype", "[residues]".into(), aatype.size()));
    }
    let classes = aatype.f_to_kind(Kind::Int64)?;
    if classes.numel() > 0 {
        let (lo, hi) = (classes.f_min()?.int64_value(&[]), classes.f_max()?.int64_value(&[]));
        ensure!(
            lo >= 0 && hi < TARGET_CLASSES,
            "aatype: classes must lie in [0, {TARGET_CLASSES}), found values from {lo} to {hi}"
        );
    }
    Ok(classes.f_one_hot(TARGET_CLASSES)?.f_to_kind(kind)?)
}

/// AlphaFold-Multimer's input embedder: `aatype`, `msa_feat` and the chain ids to the initial
/// MSA and pair representations.
pub struct MultimerInputEmbedder {
    features: FeatureProjections,
    position_activations: Linear,
}

impl MultimerInputEmbedder {
    /// The embedder over the arrays of an AlphaFold-Multimer parameter file (`.npz` or
    /// `.safetensors`; arrays of other modules are left alone). The widths come from the
    /// shapes; every array of the embedder must be there with the shape they imply, else the
    /// error names the key, the shapes and the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let arrays = Arrays::open(path.as_ref())?;
        Self::from_arrays(&arrays, &arrays.shared_builder())
    }

    /// The embedder built by `b` over `arrays`, its widths read from their shapes.
    pub(super) fn from_arrays(arrays: &Arrays, b: &Builder) -> Result<Self> {
        let width = |module: &str, dim: usize| arrays.size(&format!("{EMBEDDINGS}/{module}//weights"), 2, dim);
        let (c_m, c_z, msa_feat) = (width("preprocess_1d", 1)?, width("left_single", 1)?, width("preprocess_msa", 0)?);
        Self::build(b, msa_feat, c_m, c_z)
    }

    /// Builds (or, with an initialising builder, creates the arrays of) the embedder for
    /// `msa_feat` MSA channels (49), `c_m` MSA and `c_z` pair channels.
    pub(crate) fn build(b: &Builder, msa_feat: i64, c_m: i64, c_z: i64) -> Result<Self> {
        let p = b.root(EMBEDDINGS);
        Ok(MultimerInputEmbedder {
            features: FeatureProjections::build(&p, TARGET_CLASSES, msa_feat, c_m, c_z)?,
            position_activations: Linear::new(
                &b.root(RELATIVE_ENCODING).sub("position_activations"),
                RELATIVE_FEATURES,
                c_z,
                true,
            )?,
        })
    }

    /// `aatype` `[N]`, `msa_feat` [S, N, 49] (of the kind to compute in) and the chain `ids` to
    /// the MSA [S, N, c_m] and pair [N, N, c_z] representations.
    pub fn forward(&self, aatype: &Tensor, msa_feat: &Tensor, ids: &ChainIds) -> Result<(Tensor, Tensor)> {
        self.embed(aatype, msa_feat, ids, &Exec::serial())
    }

    /// [`MultimerInputEmbedder::forward`], the pair made `exec`'s
    /// [`ChunkOp::PairEmbedding`](crate::model::exec::ChunkOp::PairEmbedding) rows at a time
    /// (the relative encoding of those rows only).
    pub fn embed(&self, aatype: &Tensor, msa_feat: &Tensor, ids: &ChainIds, exec: &Exec) -> Result<(Tensor, Tensor)> {
        let msa = self.embed_msa(aatype, msa_feat)?;
        let rows = PairRows::whole(aatype.size().first().copied().unwrap_or(0));
        let pair = self.embed_pair(aatype, msa_feat.kind(), ids, exec, &rows)?;
        Ok((msa, pair))
    }

    /// The MSA representation of [`MultimerInputEmbedder::embed`] alone.
    pub fn embed_msa(&self, aatype: &Tensor, msa_feat: &Tensor) -> Result<Tensor> {
        self.features.embed_msa(&target_feat(aatype, msa_feat.kind())?, msa_feat)
    }

    /// The pair representation of [`MultimerInputEmbedder::embed`] alone, in `kind`: the real
    /// rows `rows` holds ([`PairRows::real`] x N x c_z).
    pub fn embed_pair(
        &self,
        aatype: &Tensor,
        kind: Kind,
        ids: &ChainIds,
        exec: &Exec,
        rows: &PairRows,
    ) -> Result<Tensor> {
        let n = aatype.size().first().copied().unwrap_or(0);
        let ids_n = ids.residues()?;
        ensure!(ids_n == n, "residue_index, asym_id, entity_id, sym_id: {ids_n} residues, aatype has {n}");
        self.features.embed_pair(&target_feat(aatype, kind)?, exec, rows, |start, rows| {
            self.position_activations.forward(&relative_encoding_rows(ids, start, rows, kind)?)
        })
    }
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    fn ids(v: &[i64]) -> Tensor {
        Tensor::from_slice(v)
    }

    /// Two copies of one entity and a chain of another: the bins of a few pairs by hand.
    #[test]
    fn bins_follow_chains_entities_and_copies() {
        let (res, asym, ent, sym) =
            (ids(&[0, 1, 0, 1, 0, 50]), ids(&[1, 1, 2, 2, 3, 3]), ids(&[1, 1, 1, 1, 2, 2]), ids(&[1, 1, 2, 2, 1, 1]));
        let chain = ChainIds { residue_index: &res, asym_id: &asym, entity_id: &ent, sym_id: &sym };
        let f = relative_encoding(&chain, Kind::Float).unwrap();
        assert_eq!(f.size(), [6, 6, RELATIVE_FEATURES]);
        let bin = |i: i64, j: i64, from: i64, len: i64| {
            f.get(i).get(j).narrow(0, from, len).argmax(0, false).int64_value(&[])
        };
        let (pos, chains) = (2 * MAX_RELATIVE_IDX + 2, 2 * MAX_RELATIVE_CHAIN + 2);
        // Within chain 1: offset -1 in bin 31; across chains: the "different chain" bin 65.
        assert_eq!(bin(0, 1, 0, pos), 31);
        assert_eq!(bin(0, 2, 0, pos), 65);
        // Offsets beyond 32 clip: 0 - 50 + 32 < 0.
        assert_eq!(bin(4, 5, 0, pos), 0);
        // Same entity: copies 1 and 2, sym offset -1 in bin 1; other entity: bin 5.
        assert_eq!(f.get(0).get(2).double_value(&[pos]), 1.0);
        assert_eq!(bin(0, 2, pos + 1, chains), 1);
        assert_eq!(f.get(0).get(4).double_value(&[pos]), 0.0);
        assert_eq!(bin(0, 4, pos + 1, chains), 5);
        // Exactly one position bin and one chain bin per pair.
        let count = |from: i64, len: i64| f.narrow(2, from, len).sum(Kind::Float).double_value(&[]);
        assert_eq!((count(0, pos), count(pos + 1, chains)), (36.0, 36.0));
    }

    #[test]
    fn mismatched_ids_and_classes_are_errors_naming_them() {
        let (res, other) =
            (Tensor::arange(4, (Kind::Int64, Device::Cpu)), Tensor::zeros([3], (Kind::Int64, Device::Cpu)));
        let chain = ChainIds { residue_index: &res, asym_id: &res, entity_id: &other, sym_id: &res };
        let e = relative_encoding(&chain, Kind::Float).unwrap_err().to_string();
        assert!(e.contains("entity_id") && e.contains("[3]"), "{e}");
        let e = target_feat(&Tensor::from_slice(&[0i64, 21]), Kind::Float).unwrap_err().to_string();
        assert!(e.contains("aatype") && e.contains("21"), "{e}");
    }
}
