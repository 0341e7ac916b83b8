//! AlphaFold-Multimer's MSA features, made inside the network from the sampled MSA
//! (`create_msa_feat` and `create_extra_msa_feature` in `modules_multimer.py`) where the
//! monomer's data pipeline hands them over made: deletion counts enter as `clip(d, 0, 1)` and
//! `arctan(d / 3) · 2/π`.
//!
//! | feature | channels |
//! |---|---|
//! | `msa_feat` ([`msa_feat`]) | MSA one-hot (23), has deletion, deletion value, cluster profile (23), encoded cluster deletion mean: 49 |
//! | extra-MSA feature ([`extra_msa_feat`]) | one-hot (23), has deletion, deletion value: 25, the monomer's layout |
use tch::{Kind, Tensor};

use crate::model::embedders::{self, shape_error, EXTRA_MSA_CLASSES};
use crate::model::{ensure, Result};

/// Channels of [`msa_feat`].
pub const MSA_FEAT: i64 = 2 * EXTRA_MSA_CLASSES + 3;

/// `arctan(d / 3) · 2/π`: deletion counts into [0, 1).
pub fn encode_deletions(deletions: &Tensor) -> Result<Tensor> {
    Ok(deletions.f_div_scalar(3.0)?.f_arctan()?.f_mul_scalar(2.0 / std::f64::consts::PI)?)
}

/// `msa_feat` [S, N, 49] (AlphaFold's `create_msa_feat`) of `msa` [S, N] (classes 0-22),
/// `deletion_matrix` [S, N], `cluster_profile` [S, N, 23] and `cluster_deletion_mean`
/// [S, N], in the kind of `deletion_matrix`.
pub fn msa_feat(
    msa: &Tensor,
    deletion_matrix: &Tensor,
    cluster_profile: &Tensor,
    cluster_deletion_mean: &Tensor,
) -> Result<Tensor> {
    let size = msa.size();
    if size.len() != 2 {
        return Err(shape_error("msa", "[sequences, residues]".into(), size));
    }
    let profile: Vec<i64> = size.iter().copied().chain([EXTRA_MSA_CLASSES]).collect();
    for (what, t, want) in [
        ("deletion_matrix", deletion_matrix, size.clone()),
        ("cluster_profile", cluster_profile, profile),
        ("cluster_deletion_mean", cluster_deletion_mean, size.clone()),
    ] {
        if t.size() != want {
            return Err(shape_error(what, format!("{want:?}"), t.size()));
        }
    }
    let kind = deletion_matrix.kind();
    let one_hot = one_hot(msa, "msa", kind)?;
    Ok(Tensor::f_cat(
        &[
            one_hot,
            deletion_matrix.f_clamp(0.0, 1.0)?.f_unsqueeze(-1)?,
            encode_deletions(deletion_matrix)?.f_unsqueeze(-1)?,
            cluster_profile.f_to_kind(kind)?,
            encode_deletions(&cluster_deletion_mean.f_to_kind(kind)?)?.f_unsqueeze(-1)?,
        ],
        -1,
    )?)
}

/// The extra-MSA feature [S, N, 25] (AlphaFold-Multimer's `create_extra_msa_feature`) of
/// `extra_msa` [S, N] (classes 0-22) and `extra_deletion_matrix` [S, N]: the monomer's
/// [`embedders::extra_msa_feat`] of the deletions' flag and encoding.
pub fn extra_msa_feat(extra_msa: &Tensor, extra_deletion_matrix: &Tensor) -> Result<Tensor> {
    let has_deletion = extra_deletion_matrix.f_clamp(0.0, 1.0)?;
    embedders::extra_msa_feat(extra_msa, &has_deletion, &encode_deletions(extra_deletion_matrix)?)
}

/// The 23-class one-hot of `classes`, in `kind` (an error naming `what` for classes outside
/// [0, 23)).
fn one_hot(classes: &Tensor, what: &str, kind: Kind) -> Result<Tensor> {
    let classes = classes.f_to_kind(Kind::Int64)?;
    if classes.numel() > 0 {
        let (lo, hi) = (classes.f_min()?.int64_value(&[]), classes.f_max()?.int64_value(&[]));
        ensure!(
            lo >= 0 && hi < EXTRA_MSA_CLASSES,
            "{what}: classes must lie in [0, {EXTRA_MSA_CLASSES}), found values from {lo} to {hi}"
        );
    }
    Ok(classes.f_one_hot(EXTRA_MSA_CLASSES)?.f_to_kind(kind)?)
}
