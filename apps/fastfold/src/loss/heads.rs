//! The losses of the heads other than the structure module (AlphaFold's `modules.py`, each
//! head's `loss`; supplementary 1.9.6-1.9.10): the distogram, the masked MSA, pLDDT (the
//! binned lDDT of the predicted Cα atoms), experimentally resolved atoms and, with the
//! aligned-error head (pTM models), the predicted aligned error.
//!
//! pLDDT, experimentally resolved and aligned error train only on structures whose resolution
//! lies in AlphaFold's range (0.1 to 3 Å): outside it, as for NMR and distillation examples
//! (resolution 0), the term is multiplied by 0.
use tch::{Kind, Tensor};

use crate::geometry::Rigid;
use crate::ground_truth::GroundTruth;
use crate::model::heads::{HeadOutputs, DISTOGRAM_FIRST_BREAK, DISTOGRAM_LAST_BREAK, MAX_ERROR_BIN};
use crate::model::structure::StructureOutput;
use crate::model::{ensure, Result};
use crate::residue_constants::atom_order;

/// The heads' weights in the total loss and the resolution range of the confidence heads
/// (AlphaFold's `heads` config).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadLossConfig {
    /// `distogram.weight` (0.3).
    pub distogram: f64,
    /// `masked_msa.weight` (2).
    pub masked_msa: f64,
    /// `predicted_lddt.weight` (0.01).
    pub plddt: f64,
    /// `experimentally_resolved.weight` (0.01).
    pub experimentally_resolved: f64,
    /// `predicted_aligned_error.weight` (0.1 in the pTM models' config).
    pub aligned_error: f64,
    /// The resolution range (Å) in which pLDDT, experimentally resolved and aligned error
    /// train (`min_resolution`, `max_resolution`: 0.1, 3).
    pub resolution: (f64, f64),
}

impl Default for HeadLossConfig {
    /// AlphaFold's `model_N_ptm` config (`model/config.py`).
    fn default() -> Self {
        HeadLossConfig {
            distogram: 0.3,
            masked_msa: 2.0,
            plddt: 0.01,
            experimentally_resolved: 0.01,
            aligned_error: 0.1,
            resolution: (0.1, 3.0),
        }
    }
}

/// What the masked-MSA loss compares with: the MSA before masking and where it was masked.
pub struct MaskedMsaTarget<'a> {
    /// The true classes [S, N] (0..=21).
    pub true_msa: &'a Tensor,
    /// 1 where the masked-MSA objective replaced an entry [S, N].
    pub bert_mask: &'a Tensor,
}

/// The heads' losses (scalars) and their weighted sum.
#[derive(Debug)]
pub struct HeadLosses {
    /// `sum(weight * term)` over the terms below.
    pub loss: Tensor,
    /// Distogram cross-entropy.
    pub distogram: Tensor,
    /// Masked-MSA cross-entropy.
    pub masked_msa: Tensor,
    /// pLDDT cross-entropy against the binned Cα lDDT.
    pub plddt: Tensor,
    /// Experimentally-resolved sigmoid cross-entropy.
    pub experimentally_resolved: Tensor,
    /// Aligned-error cross-entropy, with the aligned-error head.
    pub aligned_error: Option<Tensor>,
}

/// Every head's loss for `heads`' logits and the structure module's `structure` output against
/// `truth`, whose structure was solved at `resolution` Å.
pub fn head_losses(
    heads: &HeadOutputs,
    structure: &StructureOutput,
    msa: &MaskedMsaTarget,
    truth: &GroundTruth,
    resolution: f64,
    cfg: &HeadLossConfig,
) -> Result<HeadLosses> {
    ensure!(
        !heads.rows.is_split(),
        "the head losses read the pair logits whole: a pass under DAP without gradients holds the rank's rows \
         (Pass::with_whole_heads)"
    );
    let distogram = distogram_loss(&heads.distogram, &truth.pseudo_beta, &truth.pseudo_beta_mask)?;
    let masked_msa = masked_msa_loss(&heads.masked_msa, msa)?;
    let in_range = resolution_filter(resolution, cfg);
    let plddt = plddt_loss(&heads.lddt, &structure.atom37, truth)?.f_mul_scalar(in_range)?;
    let resolved = experimentally_resolved_loss(&heads.experimentally_resolved, &structure.atom37_mask, truth)?
        .f_mul_scalar(in_range)?;
    let aligned_error = match &heads.aligned_error {
        Some(logits) => Some(aligned_error_loss(logits, structure, truth)?.f_mul_scalar(in_range)?),
        None => None,
    };
    let mut loss = distogram
        .f_mul_scalar(cfg.distogram)?
        .f_add(&masked_msa.f_mul_scalar(cfg.masked_msa)?)?
        .f_add(&plddt.f_mul_scalar(cfg.plddt)?)?
        .f_add(&resolved.f_mul_scalar(cfg.experimentally_resolved)?)?;
    if let Some(pae) = &aligned_error {
        loss = loss.f_add(&pae.f_mul_scalar(cfg.aligned_error)?)?;
    }
    Ok(HeadLosses { loss, distogram, masked_msa, plddt, experimentally_resolved: resolved, aligned_error })
}

/// 1 when `resolution` lies in the confidence heads' range, else 0 (`filter_by_resolution`).
fn resolution_filter(resolution: f64, cfg: &HeadLossConfig) -> f64 {
    let (min, max) = cfg.resolution;
    f64::from(u8::from(resolution >= min && resolution <= max))
}

/// `-sum(one_hot(labels) * log_softmax(logits))` per position: `logits` [..., C], integer
/// `labels` [...] (`softmax_cross_entropy`).
fn softmax_cross_entropy(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let log_p = logits.f_to_kind(Kind::Float)?.f_log_softmax(-1, Kind::Float)?;
    Ok(log_p.f_gather(-1, &labels.f_unsqueeze(-1)?, false)?.f_squeeze_dim(-1)?.f_neg()?)
}

/// `sum(value * mask) / (sum(mask) + eps)` over every entry.
fn masked_average(value: &Tensor, mask: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(value.f_mul(mask)?.f_sum(Kind::Float)?.f_div(&mask.f_sum(Kind::Float)?.f_add_scalar(eps)?)?)
}

/// The distogram loss (1.9.8, `_distogram_log_loss`): cross-entropy of the distogram logits
/// `[N, N, bins]` against the bin of each true distance between the pseudo-beta atoms
/// `positions` [N, 3], bins split by `bins - 1` evenly spaced breaks from 2.3125 to 21.6875 Å
/// (a distance on a break falls below it), averaged over the pairs of resolved atoms (`mask`
/// `[N]`).
pub fn distogram_loss(logits: &Tensor, positions: &Tensor, mask: &Tensor) -> Result<Tensor> {
    let bins = logits.size().last().copied().unwrap_or(2);
    let opts = (Kind::Float, logits.device());
    let breaks = Tensor::f_linspace(DISTOGRAM_FIRST_BREAK, DISTOGRAM_LAST_BREAK, bins - 1, opts)?;
    let d2 = positions.f_unsqueeze(-2)?.f_sub(&positions.f_unsqueeze(-3)?)?.f_square()?.f_sum_dim_intlist(
        -1,
        true,
        Kind::Float,
    )?;
    let true_bins = d2.f_gt_tensor(&breaks.f_square()?)?.f_sum_dim_intlist(-1, false, Kind::Int64)?;
    let errors = softmax_cross_entropy(logits, &true_bins)?;
    let pair_mask = mask.f_unsqueeze(-1)?.f_mul(&mask.f_unsqueeze(-2)?)?;
    masked_average(&errors, &pair_mask, 1e-6)
}

/// The masked-MSA loss (1.9.9): cross-entropy of the logits [S, N, 23] against the true MSA
/// at the masked entries, averaged over them.
pub fn masked_msa_loss(logits: &Tensor, target: &MaskedMsaTarget) -> Result<Tensor> {
    let errors = softmax_cross_entropy(logits, &target.true_msa.f_to_kind(Kind::Int64)?)?;
    masked_average(&errors, &target.bert_mask.f_to_kind(Kind::Float)?, 1e-8)
}

/// AlphaFold's approximate lDDT per residue (`lddt.lddt`, `per_residue`): for each residue,
/// the fraction of 0.5, 1, 2 and 4 Å tests passed by its distances to the other resolved
/// points within `cutoff` Å in the true structure. `predicted`, `truth` [N, 3], `mask` `[N]`.
pub fn lddt_per_residue(predicted: &Tensor, truth: &Tensor, mask: &Tensor, cutoff: f64) -> Result<Tensor> {
    let (scored, score) = lddt_tests(predicted, truth, mask, cutoff)?;
    let norm = scored.f_sum_dim_intlist(-1, false, Kind::Float)?.f_add_scalar(1e-10)?.f_reciprocal()?;
    Ok(norm.f_mul(&scored.f_mul(&score)?.f_sum_dim_intlist(-1, false, Kind::Float)?.f_add_scalar(1e-10)?)?)
}

/// AlphaFold's approximate lDDT of the whole structure (`lddt.lddt`, not `per_residue`): the
/// fraction of all the pairs' tests passed, as [`lddt_per_residue`] scores them (a scalar).
pub fn lddt_global(predicted: &Tensor, truth: &Tensor, mask: &Tensor, cutoff: f64) -> Result<Tensor> {
    let (scored, score) = lddt_tests(predicted, truth, mask, cutoff)?;
    let norm = scored.f_sum(Kind::Float)?.f_add_scalar(1e-10)?.f_reciprocal()?;
    Ok(norm.f_mul(&scored.f_mul(&score)?.f_sum(Kind::Float)?.f_add_scalar(1e-10)?)?)
}

/// lDDT-Cα of a predicted structure (`predicted_atom37` [N, 37, 3]) against `truth`, over
/// the residues with a resolved Cα (15 Å cutoff, AlphaFold's and OpenFold's validation
/// metric `lddt_ca`): a scalar in [0, 1], computed without gradients.
pub fn lddt_ca(predicted_atom37: &Tensor, truth: &GroundTruth) -> Result<Tensor> {
    let ca = atom_order("CA").unwrap_or(1) as i64;
    let mask = truth.all_atom_mask.f_select(1, ca)?.f_to_kind(Kind::Float)?;
    tch::no_grad(|| {
        let predicted = predicted_atom37.f_detach()?.f_to_kind(Kind::Float)?.f_select(1, ca)?;
        lddt_global(&predicted, &truth.all_atom_positions.f_select(1, ca)?.f_to_kind(Kind::Float)?, &mask, 15.0)
    })
}

/// The pairs lDDT scores ([N, N]: 1 for two distinct resolved points within `cutoff` Å in
/// the truth) and each pair's share of the four tests passed ([N, N]).
fn lddt_tests(predicted: &Tensor, truth: &Tensor, mask: &Tensor, cutoff: f64) -> Result<(Tensor, Tensor)> {
    let distances = |x: &Tensor| -> Result<Tensor> {
        let d = x.f_unsqueeze(1)?.f_sub(&x.f_unsqueeze(0)?)?;
        Ok(d.f_square()?.f_sum_dim_intlist(-1, false, Kind::Float)?.f_add_scalar(1e-10)?.f_sqrt()?)
    };
    let (d_true, d_pred) = (distances(truth)?, distances(predicted)?);
    let n = mask.size()[0];
    let not_self = Tensor::f_eye(n, (Kind::Float, mask.device()))?.f_rsub_scalar(1.0)?;
    let scored = d_true
        .f_lt(cutoff)?
        .f_to_kind(Kind::Float)?
        .f_mul(&mask.f_unsqueeze(1)?)?
        .f_mul(&mask.f_unsqueeze(0)?)?
        .f_mul(&not_self)?;
    let l1 = d_true.f_sub(&d_pred)?.f_abs()?;
    let mut score = l1.f_zeros_like()?;
    for threshold in [0.5, 1.0, 2.0, 4.0] {
        score = score.f_add(&l1.f_lt(threshold)?.f_to_kind(Kind::Float)?)?;
    }
    Ok((scored, score.f_mul_scalar(0.25)?))
}

/// The pLDDT loss (1.9.6): cross-entropy of the lDDT logits [N, bins] against the bin of each
/// residue's true lDDT of the predicted Cα atoms (`predicted_atom37` [N, 37, 3]; 15 Å cutoff,
/// no gradient through it), averaged over the residues with a resolved Cα.
pub fn plddt_loss(logits: &Tensor, predicted_atom37: &Tensor, truth: &GroundTruth) -> Result<Tensor> {
    let bins = logits.size().last().copied().unwrap_or(1);
    let ca = atom_order("CA").unwrap_or(1) as i64;
    let mask = truth.all_atom_mask.f_select(1, ca)?;
    let lddt = tch::no_grad(|| {
        let predicted = predicted_atom37.f_detach()?.f_to_kind(Kind::Float)?.f_select(1, ca)?;
        lddt_per_residue(&predicted, &truth.all_atom_positions.f_select(1, ca)?, &mask, 15.0)
    })?;
    let true_bins =
        lddt.f_mul_scalar(bins as f64)?.f_floor()?.f_clamp_max(bins as f64 - 1.0)?.f_to_kind(Kind::Int64)?;
    masked_average(&softmax_cross_entropy(logits, &true_bins)?, &mask, 1e-8)
}

/// The experimentally-resolved loss (1.9.10): sigmoid cross-entropy of the logits [N, 37]
/// against whether each atom was resolved, averaged over the atoms the residue types have
/// (`atom37_exists` [N, 37]).
pub fn experimentally_resolved_loss(logits: &Tensor, atom37_exists: &Tensor, truth: &GroundTruth) -> Result<Tensor> {
    let logits = logits.f_to_kind(Kind::Float)?;
    let labels = &truth.all_atom_mask;
    let log_p = logits.f_log_sigmoid()?;
    let log_not_p = logits.f_neg()?.f_log_sigmoid()?;
    let xent = labels.f_mul(&log_p)?.f_add(&labels.f_rsub_scalar(1.0)?.f_mul(&log_not_p)?)?.f_neg()?;
    masked_average(&xent, &atom37_exists.f_to_kind(Kind::Float)?, 1e-8)
}

/// The aligned-error loss (1.9.7, `PredictedAlignedErrorHead.loss`): cross-entropy of the
/// logits [N, N, bins] against the bin of the error of residue j's Cα seen from residue i's
/// predicted backbone frame (the last iteration's) versus its true frame (no gradient through
/// it), bins split by `bins - 1` breaks from 0 to 31 Å, over the pairs of residues with true
/// frames.
pub fn aligned_error_loss(logits: &Tensor, structure: &StructureOutput, truth: &GroundTruth) -> Result<Tensor> {
    let bins = logits.size().last().copied().unwrap_or(2);
    let (true_frames, mask) = truth.backbone()?;
    let error2 = tch::no_grad(|| -> Result<Tensor> {
        let layers = structure.rotations.size()[0];
        let last =
            |t: &Tensor| -> Result<Tensor> { Ok(t.f_select(0, layers - 1)?.f_detach()?.f_to_kind(Kind::Float)?) };
        let pred = Rigid { rot: last(&structure.rotations)?, trans: last(&structure.translations)? };
        let d = pred.in_every_frame(&pred.trans).f_sub(&true_frames.in_every_frame(&true_frames.trans))?;
        Ok(d.f_square()?.f_sum_dim_intlist(-1, false, Kind::Float)?)
    })?;
    let opts = (Kind::Float, logits.device());
    let breaks = Tensor::f_linspace(0.0, MAX_ERROR_BIN, bins - 1, opts)?;
    let true_bins =
        error2.f_unsqueeze(-1)?.f_gt_tensor(&breaks.f_square()?)?.f_sum_dim_intlist(-1, false, Kind::Int64)?;
    let pair_mask = mask.f_unsqueeze(-1)?.f_mul(&mask.f_unsqueeze(-2)?)?;
    masked_average(&softmax_cross_entropy(logits, &true_bins)?, &pair_mask, 1e-8)
}

#[cfg(test)]
mod tests {
    use tch::Device;

    use super::*;

    #[test]
    fn distogram_loss_is_the_cross_entropy_of_the_true_bins() {
        // Three residues on a line 3 Å and 30 Å apart, 64 bins: pair distances of 0, 3, 27 and
        // 30 Å fall in bins 0, 3 (breaks every 0.3075 Å from 2.3125) and 63 (beyond the last).
        let x = Tensor::from_slice(&[0f32, 0., 0., 3., 0., 0., 30., 0., 0.]).reshape([3, 3]);
        let logits = Tensor::randn([3, 3, 64], (Kind::Float, Device::Cpu));
        let loss = distogram_loss(&logits, &x, &Tensor::ones([3], (Kind::Float, Device::Cpu))).unwrap();
        let bins = [[0i64, 3, 63], [3, 0, 63], [63, 63, 0]];
        let log_p = logits.log_softmax(-1, Kind::Float);
        let mut want = 0.0;
        for (i, row) in bins.iter().enumerate() {
            for (j, &b) in row.iter().enumerate() {
                want -= log_p.double_value(&[i as i64, j as i64, b]);
            }
        }
        want /= 9.0 + 1e-6;
        assert!((loss.double_value(&[]) - want).abs() < 1e-4, "{loss:?} vs {want}");
    }

    #[test]
    fn confidence_terms_train_only_inside_the_resolution_range() {
        let cfg = HeadLossConfig::default();
        assert_eq!(resolution_filter(2.0, &cfg), 1.0);
        assert_eq!(resolution_filter(3.0, &cfg), 1.0);
        assert_eq!(resolution_filter(0.0, &cfg), 0.0, "NMR and distillation examples");
        assert_eq!(resolution_filter(3.5, &cfg), 0.0);
    }

    #[test]
    fn lddt_is_one_for_the_truth_and_counts_passed_tests() {
        let opts = (Kind::Float, Device::Cpu);
        let x = Tensor::from_slice(&[0f32, 0., 0., 3.8, 0., 0., 7.6, 0., 0.]).reshape([3, 3]);
        let mask = Tensor::ones([3], opts);
        let same = lddt_per_residue(&x, &x, &mask, 15.0).unwrap();
        assert!((same - 1.0).abs().max().double_value(&[]) < 1e-6);
        // The last residue moved 1.5 Å along the line: its two distances fail the 0.5 and 1 Å
        // tests and pass 2 and 4 (score 0.5); the others each have one such distance (0.75).
        let moved = x.copy();
        let _ = moved.get(2).get(0).f_add_scalar_(1.5).unwrap();
        let l = lddt_per_residue(&moved, &x, &mask, 15.0).unwrap();
        let want = Tensor::from_slice(&[0.75f32, 0.75, 0.5]);
        assert!((l - want).abs().max().double_value(&[]) < 1e-6);
    }

    #[test]
    fn global_lddt_scores_every_pair_within_the_cutoff_once() {
        // Cα on a line at 0, 3.8, 7.6 and 20 Å: the last is within 15 Å of the third only.
        let x = Tensor::from_slice(&[0f32, 0., 0., 3.8, 0., 0., 7.6, 0., 0., 20., 0., 0.]).reshape([4, 3]);
        let mask = Tensor::ones([4], (Kind::Float, Device::Cpu));
        let same = lddt_global(&x, &x, &mask, 15.0).unwrap().double_value(&[]);
        assert!((same - 1.0).abs() < 1e-6, "{same}");
        // The last moved 1.5 Å out: of the 4 scored pairs (8 ordered) 3 pass every test and
        // (2, 3) half of them, so 3.5 / 4 = 0.875 (the mean of the per-residue scores,
        // (1 + 1 + 2.5 / 3 + 0.5) / 4 = 0.833, weighs residues, not pairs).
        let moved = x.copy();
        let _ = moved.get(3).get(0).f_add_scalar_(1.5).unwrap();
        let l = lddt_global(&moved, &x, &mask, 15.0).unwrap().double_value(&[]);
        assert!((l - 0.875).abs() < 1e-6, "{l}");
        let per = lddt_per_residue(&moved, &x, &mask, 15.0).unwrap().mean(Kind::Float).double_value(&[]);
        assert!((per - (2.0 + 2.5 / 3.0 + 0.5) / 4.0).abs() < 1e-6, "{per}");
        // Unresolved points are not scored: without the moved one the rest is exact.
        let three = Tensor::from_slice(&[1f32, 1., 1., 0.]);
        let l = lddt_global(&moved, &x, &three, 15.0).unwrap().double_value(&[]);
        assert!((l - 1.0).abs() < 1e-6, "{l}");
    }
}
