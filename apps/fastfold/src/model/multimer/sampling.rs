//! AlphaFold-Multimer's MSA sampling inside the network, once per recycle
//! (`modules_multimer.py`: `make_msa_profile`, `sample_msa`, `make_masked_msa`,
//! `nearest_neighbor_clusters`), drawing JAX's random numbers bit for bit
//! ([`crate::jax_random`]), so a key samples the rows and masks DeepMind's code samples.
//!
//! | step | AlphaFold | here |
//! |---|---|---|
//! | the MSA profile, over every row, before sampling | `make_msa_profile` | [`msa_profile`] |
//! | the cluster centres: rows ordered by Gumbel noise (rows kept by `cluster_bias_mask` first, rows with no unmasked position last), the first `num_msa` kept, the rest the extra MSA | `sample_msa`, `gumbel_argsort_sample_idx` | [`sample_order`] |
//! | BERT masking of the centres: 15% of positions replaced by a draw from uniform, profile, same-residue and mask-token probabilities | `make_masked_msa`, `gumbel_max_sample` | [`make_masked_msa`] |
//! | each extra row's nearest centre, the centres' profiles and mean deletions | `nearest_neighbor_clusters` | [`nearest_neighbor_clusters`] |
//!
//! The draws are made on the CPU in fp32 as JAX makes them (`-log(-log(u + 1e-6) + 1e-6)`
//! Gumbel noise from [`Key::padding_consistent_uniform`]); the clusters' arithmetic runs in
//! libtorch. Rows tied in the sort (rows of no unmasked position, whose values can agree to
//! fp32's rounding at -10^6) keep their order, first index first: XLA's unstable sort leaves
//! their order unspecified (it put them so in the fixture's case); in the pipeline's features
//! such rows are padding of equal content, whose order changes nothing.
use rayon::prelude::*;
use tch::{Device, Kind, Tensor};

use crate::jax_random::Key;
use crate::model::embedders::{shape_error, EXTRA_MSA_CLASSES};
use crate::model::multimer::msa_feat::{extra_msa_feat, msa_feat};
use crate::model::{ensure, Error, Result};

/// Classes of the MSA and its profile (20 amino acids, unknown, gap).
pub const MSA_CLASSES: i64 = 22;

/// Added to the Gumbel noise's uniform draw and to its inner logarithm (`gumbel_noise`).
const GUMBEL_EPSILON: f32 = 1e-6;

/// Added to the BERT replacement probabilities before their logarithm (`make_masked_msa`).
const PROBABILITY_EPSILON: f32 = 1e-6;

/// The BERT masking's fractions (AlphaFold-Multimer's `masked_msa` config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MaskedMsaConfig {
    /// Weight of a uniformly drawn amino acid (0.1).
    pub uniform_prob: f64,
    /// Weight of the MSA profile (0.1).
    pub profile_prob: f64,
    /// Weight of the position's own residue (0.1).
    pub same_prob: f64,
    /// Fraction of positions replaced (0.15).
    pub replace_fraction: f64,
}

impl Default for MaskedMsaConfig {
    fn default() -> Self {
        MaskedMsaConfig { uniform_prob: 0.1, profile_prob: 0.1, same_prob: 0.1, replace_fraction: 0.15 }
    }
}

impl MaskedMsaConfig {
    /// The mask token's weight: what the three others leave (0.7), which must not be negative.
    fn mask_prob(&self) -> Result<f64> {
        let rest = 1.0 - self.profile_prob - self.same_prob - self.uniform_prob;
        if rest.is_nan() || rest < 0.0 {
            return Err(Error::Invalid(format!(
                "masked MSA: uniform_prob {} + profile_prob {} + same_prob {} exceed 1",
                self.uniform_prob, self.profile_prob, self.same_prob
            )));
        }
        Ok(rest)
    }
}

/// How many rows one recycle samples (AlphaFold-Multimer v2.3's `num_msa` 508 and
/// `num_extra_msa` 2048 as the default) and how it masks them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MsaSampling {
    /// Cluster centres, the Evoformer's MSA rows (`num_msa`).
    pub num_msa: i64,
    /// Extra-MSA rows the extra stack reads (`num_extra_msa`); every row not sampled as a
    /// centre still counts in the clusters' profiles.
    pub num_extra_msa: i64,
    /// The BERT masking.
    pub masked: MaskedMsaConfig,
}

impl Default for MsaSampling {
    fn default() -> Self {
        MsaSampling { num_msa: 508, num_extra_msa: 2048, masked: MaskedMsaConfig::default() }
    }
}

/// The MSA as the input pipeline hands it over (AlphaFold-Multimer's features of the same
/// names): `msa` [S, N] classes 0-21, `deletion_matrix`, `msa_mask`, `bert_mask` [S, N],
/// `cluster_bias_mask` `[S]` (1 for rows always kept as centres).
pub struct FullMsa<'a> {
    /// [S, N] classes.
    pub msa: &'a Tensor,
    /// [S, N] deletion counts.
    pub deletion_matrix: &'a Tensor,
    /// [S, N].
    pub msa_mask: &'a Tensor,
    /// [S, N].
    pub bert_mask: &'a Tensor,
    /// `[S]`.
    pub cluster_bias_mask: &'a Tensor,
}

/// One recycle's sample: the cluster centres (BERT-masked), the extra rows, the clusters'
/// profiles; float tensors fp32 on the MSA's device.
pub struct SampledMsa {
    /// [s, N] the centres' classes after masking (0-22, 22 the mask token).
    pub msa: Tensor,
    /// [s, N] the centres' classes before masking.
    pub true_msa: Tensor,
    /// [s, N].
    pub deletion_matrix: Tensor,
    /// [s, N].
    pub msa_mask: Tensor,
    /// [s, N] the positions the masked-MSA head is scored on.
    pub bert_mask: Tensor,
    /// [S - s, N] every row not sampled, best first.
    pub extra_msa: Tensor,
    /// [S - s, N].
    pub extra_deletion_matrix: Tensor,
    /// [S - s, N].
    pub extra_msa_mask: Tensor,
    /// [s, N, 23].
    pub cluster_profile: Tensor,
    /// [s, N].
    pub cluster_deletion_mean: Tensor,
}

impl SampledMsa {
    /// `msa_feat` [s, N, 49] ([`msa_feat`], AlphaFold's `create_msa_feat`).
    pub fn msa_feat(&self) -> Result<Tensor> {
        msa_feat(&self.msa, &self.deletion_matrix, &self.cluster_profile, &self.cluster_deletion_mean)
    }

    /// The extra-MSA feature [E, N, 25] and mask [E, N] of the first `rows` extra rows
    /// (AlphaFold's `create_extra_msa_feature`).
    pub fn extra_msa_feat(&self, rows: i64) -> Result<(Tensor, Tensor)> {
        let e = self.extra_msa.size()[0].min(rows.max(0));
        let feat = extra_msa_feat(&self.extra_msa.f_narrow(0, 0, e)?, &self.extra_deletion_matrix.f_narrow(0, 0, e)?)?;
        Ok((feat, self.extra_msa_mask.f_narrow(0, 0, e)?))
    }
}

impl MsaSampling {
    /// One recycle's sample of `full` (AlphaFold's `sample_msa`, `make_masked_msa`,
    /// `nearest_neighbor_clusters`), the rows drawn with `sample_key` and the masking with
    /// `mask_key`.
    pub fn sample(&self, full: &FullMsa, sample_key: Key, mask_key: Key) -> Result<SampledMsa> {
        ensure!(self.num_msa >= 1, "num_msa must be at least 1, not {}", self.num_msa);
        let (s, _) = check(full)?;
        let device = full.msa.device();
        let msa = full.msa.f_to_kind(Kind::Int64)?;
        let float = |t: &Tensor| t.f_to_kind(Kind::Float);
        let (deletion, mask, bert) = (float(full.deletion_matrix)?, float(full.msa_mask)?, float(full.bert_mask)?);
        let profile = msa_profile(&msa, &mask)?;
        let order = sample_order(sample_key, &mask, &float(full.cluster_bias_mask)?)?;
        let kept = self.num_msa.min(s);
        let rows = |from: i64, len: i64| Tensor::from_slice(&order[from as usize..(from + len) as usize]).to(device);
        let (sel, extra) = (rows(0, kept), rows(kept, s - kept));
        let take = |t: &Tensor, i: &Tensor| t.f_index_select(0, i);
        let true_msa = take(&msa, &sel)?;
        let msa_mask = take(&mask, &sel)?;
        let (masked_msa, positions) = make_masked_msa(mask_key, &true_msa, &msa_mask, &profile, &self.masked)?;
        let deletion_matrix = take(&deletion, &sel)?;
        let (extra_msa, extra_msa_mask) = (take(&msa, &extra)?, take(&mask, &extra)?);
        let extra_deletion_matrix = take(&deletion, &extra)?;
        let (cluster_profile, cluster_deletion_mean) = nearest_neighbor_clusters(
            &masked_msa,
            &msa_mask,
            &deletion_matrix,
            &extra_msa,
            &extra_msa_mask,
            &extra_deletion_matrix,
        )?;
        Ok(SampledMsa {
            bert_mask: take(&bert, &sel)?.f_mul(&positions)?,
            msa: masked_msa,
            true_msa,
            deletion_matrix,
            msa_mask,
            extra_msa,
            extra_deletion_matrix,
            extra_msa_mask,
            cluster_profile,
            cluster_deletion_mean,
        })
    }
}

/// The rows S and residues N of `full`, every shape checked.
fn check(full: &FullMsa) -> Result<(i64, i64)> {
    let size = full.msa.size();
    let (s, n) = match size.as_slice() {
        [s, n] if *s > 0 => (*s, *n),
        _ => return Err(shape_error("msa", "[sequences (at least 1), residues]".into(), size)),
    };
    for (what, t) in
        [("deletion_matrix", full.deletion_matrix), ("msa_mask", full.msa_mask), ("bert_mask", full.bert_mask)]
    {
        if t.size() != [s, n] {
            return Err(shape_error(what, format!("[{s}, {n}]"), t.size()));
        }
    }
    if full.cluster_bias_mask.size() != [s] {
        return Err(shape_error("cluster_bias_mask", format!("[{s}]"), full.cluster_bias_mask.size()));
    }
    Ok((s, n))
}

/// The MSA profile [N, 22] (AlphaFold's `make_msa_profile`): each residue's class frequencies
/// over the unmasked rows of `msa` [S, N] (classes 0-21) under `msa_mask` [S, N].
pub fn msa_profile(msa: &Tensor, msa_mask: &Tensor) -> Result<Tensor> {
    let mask = msa_mask.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?;
    let one_hot = msa.f_to_kind(Kind::Int64)?.f_one_hot(MSA_CLASSES)?.f_to_kind(Kind::Float)?;
    let sum = one_hot.f_mul(&mask)?.f_sum_dim_intlist(0, false, Kind::Float)?;
    Ok(sum.f_div(&mask.f_sum_dim_intlist(0, false, Kind::Float)?.f_add_scalar(1e-10)?)?)
}

/// AlphaFold's `gumbel_noise`: Gumbel(0, 1) draws for `shape`, row-major, from `key`'s
/// padding-consistent uniforms.
pub fn gumbel_noise(key: Key, shape: &[usize]) -> Vec<f32> {
    key.padding_consistent_uniform(shape)
        .into_iter()
        .map(|u| -(-(u + GUMBEL_EPSILON).ln() + GUMBEL_EPSILON).ln())
        .collect()
}

/// The rows of an MSA best first, as `sample_msa` orders them: by
/// `1e6 (min(1, Σ mask) - 1) + 1e6 cluster_bias_mask` plus Gumbel noise from `key`, descending
/// (`msa_mask` [S, N], `cluster_bias_mask` `[S]`).
pub fn sample_order(key: Key, msa_mask: &Tensor, cluster_bias_mask: &Tensor) -> Result<Vec<i64>> {
    let rows = msa_mask.f_to_kind(Kind::Float)?.f_sum_dim_intlist(-1, false, Kind::Float)?.f_clamp(0.0, 1.0)?;
    let rows = to_f32(&rows)?;
    let bias = to_f32(cluster_bias_mask)?;
    ensure!(bias.len() == rows.len(), "cluster_bias_mask: {} rows, the MSA has {}", bias.len(), rows.len());
    let noise = gumbel_noise(key, &[rows.len()]);
    let value: Vec<f32> = rows.iter().zip(&bias).zip(&noise).map(|((r, b), z)| (r - 1.0) * 1e6 + b * 1e6 + z).collect();
    let mut order: Vec<i64> = (0..value.len() as i64).collect();
    // Descending; ties first index first (a stable sort).
    order.sort_by(|&a, &b| value[b as usize].total_cmp(&value[a as usize]));
    Ok(order)
}

/// AlphaFold's `make_masked_msa` on the sampled centres `msa` [s, N] (classes 0-21) and their
/// `msa_mask` [s, N] with the full MSA's `profile` [N, 22]: each unmasked position is replaced
/// with probability `replace_fraction` by a class drawn (Gumbel-max) from `uniform_prob`
/// uniform over the 20 amino acids, `profile_prob` the profile, `same_prob` its own class and
/// the rest the mask token 22. Returns the masked MSA [s, N] (masked-out positions class 0, as
/// AlphaFold multiplies by the mask) and the replaced positions [s, N] (fp32, the mask's values
/// where replaced). `key` splits into the positions' key and the draws' key.
pub fn make_masked_msa(
    key: Key,
    msa: &Tensor,
    msa_mask: &Tensor,
    profile: &Tensor,
    config: &MaskedMsaConfig,
) -> Result<(Tensor, Tensor)> {
    let size = msa.size();
    let (s, n) = match size.as_slice() {
        [s, n] => (*s as usize, *n as usize),
        _ => return Err(shape_error("msa", "[sequences, residues]".into(), size)),
    };
    if msa_mask.size() != size {
        return Err(shape_error("msa_mask", format!("{size:?}"), msa_mask.size()));
    }
    if profile.size() != [n as i64, MSA_CLASSES] {
        return Err(shape_error("msa_profile", format!("[{n}, {MSA_CLASSES}]"), profile.size()));
    }
    let classes = to_i64(msa)?;
    if let Some(c) = classes.iter().find(|&&c| !(0..MSA_CLASSES).contains(&c)) {
        return Err(Error::Invalid(format!("msa: classes must lie in [0, {MSA_CLASSES}), found {c}")));
    }
    let mask = to_f32(msa_mask)?;
    let profile = to_f32(profile)?;
    let mask_prob = config.mask_prob()? as f32;
    let (uniform, profile_w, same) = (config.uniform_prob as f32, config.profile_prob as f32, config.same_prob as f32);
    let replace = config.replace_fraction as f32;
    let keys = key.split(3);
    let classes_out = EXTRA_MSA_CLASSES as usize;
    // Row by row, in parallel: a padding-consistent draw over [s, n, ...] is row i's draw from
    // the key folded in with i, so no row needs the others' keys.
    let rows: Vec<(Vec<i64>, Vec<f32>)> = (0..s)
        .into_par_iter()
        .map(|row| {
            let position_draw = keys[1].fold_in(row as u32).padding_consistent_uniform(&[n]);
            let noise = gumbel_noise(keys[2].fold_in(row as u32), &[n, classes_out]);
            let mut masked = vec![0i64; n];
            let mut positions = vec![0f32; n];
            for r in 0..n {
                let i = row * n + r;
                positions[r] = if position_draw[r] < replace { mask[i] } else { 0.0 };
                // Gumbel-max over the 23 classes' log-probabilities, the first of equal values.
                let mut best = (f32::NEG_INFINITY, 0usize);
                for c in 0..classes_out {
                    let p = match c {
                        22 => mask_prob,
                        _ => {
                            let random_aa = if c < 20 { 0.05f32 } else { 0.0 };
                            let one_hot = if classes[i] == c as i64 { 1.0f32 } else { 0.0 };
                            uniform * random_aa + profile_w * profile[r * MSA_CLASSES as usize + c] + same * one_hot
                        }
                    };
                    let v = (p + PROBABILITY_EPSILON).ln() + noise[r * classes_out + c];
                    if v > best.0 {
                        best = (v, c);
                    }
                }
                let class = if positions[r] != 0.0 { best.1 as i64 } else { classes[i] };
                masked[r] = if mask[i] != 0.0 { class } else { 0 };
            }
            (masked, positions)
        })
        .collect();
    let masked: Vec<i64> = rows.iter().flat_map(|(m, _)| m.iter().copied()).collect();
    let positions: Vec<f32> = rows.iter().flat_map(|(_, p)| p.iter().copied()).collect();
    let device = msa.device();
    let shape = [s as i64, n as i64];
    Ok((
        Tensor::from_slice(&masked).f_reshape(shape)?.f_to(device)?,
        Tensor::from_slice(&positions).f_reshape(shape)?.f_to(device)?,
    ))
}

/// AlphaFold's `nearest_neighbor_clusters`: each extra row assigned to the centres it agrees
/// with most (over unmasked positions, amino acids and unknown only; a softmax at 10^3, so ties
/// share), weighted by the rows' count of shared unmasked positions; each centre's profile
/// [s, N, 23] and mean deletions [s, N] over itself and its assigned rows. `msa` [s, N] (classes
/// 0-22), `extra_msa` [E, N] (0-21), masks and deletions of the same shapes.
pub fn nearest_neighbor_clusters(
    msa: &Tensor,
    msa_mask: &Tensor,
    deletion_matrix: &Tensor,
    extra_msa: &Tensor,
    extra_mask: &Tensor,
    extra_deletion_matrix: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (s, n) = (msa.size()[0], msa.size()[1]);
    let e = extra_msa.size()[0];
    let classes = EXTRA_MSA_CLASSES;
    let one_hot = |m: &Tensor, mask: &Tensor| -> Result<Tensor> {
        let oh = m.f_to_kind(Kind::Int64)?.f_one_hot(classes)?.f_to_kind(Kind::Float)?;
        Ok(oh.f_mul(&mask.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?)?)
    };
    let msa_oh = one_hot(msa, msa_mask)?;
    let extra_oh = one_hot(extra_msa, extra_mask)?;
    // Agreement on the 20 amino acids and unknown; gaps and the mask token weigh 0.
    let weights: Vec<f32> = (0..classes).map(|c| if c < 21 { 1.0 } else { 0.0 }).collect();
    let weights = Tensor::from_slice(&weights).f_to(msa.device())?;
    let flat = |t: &Tensor, rows: i64| t.f_reshape([rows, n * classes]);
    let agreement = flat(&msa_oh.f_mul(&weights)?, s)?.f_matmul(&flat(&extra_oh, e)?.f_tr()?)?;
    let assignment = agreement.f_mul_scalar(1e3)?.f_softmax(0, Kind::Float)?;
    let (mask, extra_mask) = (msa_mask.f_to_kind(Kind::Float)?, extra_mask.f_to_kind(Kind::Float)?);
    let assignment = assignment.f_mul(&mask.f_matmul(&extra_mask.f_tr()?)?)?;
    let count = assignment.f_sum_dim_intlist(-1, false, Kind::Float)?.f_add_scalar(1.0)?;
    let msa_sum = assignment.f_matmul(&flat(&extra_oh, e)?)?.f_reshape([s, n, classes])?.f_add(&msa_oh)?;
    let profile = msa_sum.f_div(&count.f_reshape([s, 1, 1])?)?;
    let deletions = extra_mask.f_mul(&extra_deletion_matrix.f_to_kind(Kind::Float)?)?;
    let del_sum = assignment.f_matmul(&deletions)?.f_add(&deletion_matrix.f_to_kind(Kind::Float)?)?;
    Ok((profile, del_sum.f_div(&count.f_unsqueeze(-1)?)?))
}

fn to_f32(t: &Tensor) -> Result<Vec<f32>> {
    let flat = t.f_to_kind(Kind::Float)?.f_to_device(Device::Cpu)?.f_flatten(0, -1)?.f_contiguous()?;
    Ok(Vec::<f32>::try_from(&flat)?)
}

fn to_i64(t: &Tensor) -> Result<Vec<i64>> {
    let flat = t.f_to_kind(Kind::Int64)?.f_to_device(Device::Cpu)?.f_flatten(0, -1)?.f_contiguous()?;
    Ok(Vec::<i64>::try_from(&flat)?)
}
