//! The structure module's loss (AlphaFold's `folding.StructureModule.loss`, supplementary
//! 1.9.1-1.9.3): backbone FAPE over every iteration, side-chain FAPE against the ground truth
//! renamed to the prediction's naming of symmetric side chains, the supervised chi loss and
//! the angle-norm loss.
//!
//! `loss = (1 - weight_frac) * mean over iterations of backbone FAPE
//!        + weight_frac * side-chain FAPE + chi_weight * chi loss + angle_norm_weight * angle norm`
//!
//! (the structural-violation term, added in fine-tuning, is [`super::violations`]'s).
use tch::{Kind, Tensor};

use crate::geometry::{fape, Rigid};
use crate::ground_truth::{GroundTruth, RIGID_GROUPS};
use crate::model::structure::StructureOutput;
use crate::model::Result;
use crate::residue_constants::Tables;

/// The structure module's loss settings (AlphaFold's `heads.structure_module` config).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StructureLossConfig {
    /// Backbone FAPE's clamp, Å (`fape.clamp_distance`, 10), in clamped examples.
    pub clamp_distance: f64,
    /// Backbone FAPE's length unit, Å (`fape.loss_unit_distance`, 10).
    pub loss_unit_distance: f64,
    /// Side-chain FAPE's clamp, Å (`sidechain.atom_clamp_distance`, 10), always applied.
    pub atom_clamp_distance: f64,
    /// Side-chain FAPE's length unit, Å (`sidechain.length_scale`, 10).
    pub length_scale: f64,
    /// Side-chain FAPE's share of the FAPE weight (`sidechain.weight_frac`, 0.5).
    pub weight_frac: f64,
    /// The chi loss's weight (`chi_weight`, 0.5).
    pub chi_weight: f64,
    /// The angle-norm loss's weight (`angle_norm_weight`, 0.01).
    pub angle_norm_weight: f64,
}

impl Default for StructureLossConfig {
    /// AlphaFold's monomer values (`model/config.py`).
    fn default() -> Self {
        StructureLossConfig {
            clamp_distance: 10.0,
            loss_unit_distance: 10.0,
            atom_clamp_distance: 10.0,
            length_scale: 10.0,
            weight_frac: 0.5,
            chi_weight: 0.5,
            angle_norm_weight: 0.01,
        }
    }
}

/// The structure module's loss and its terms (scalars).
#[derive(Debug)]
pub struct StructureLoss {
    /// The weighted sum (AlphaFold's `structure_module` `loss`, without violations).
    pub loss: Tensor,
    /// Backbone FAPE of the last iteration (AlphaFold's `fape` metric).
    pub fape: Tensor,
    /// Backbone FAPE averaged over the iterations (the term in the loss).
    pub backbone_fape: Tensor,
    /// Side-chain (all-atom) FAPE (`sidechain_fape`).
    pub sidechain_fape: Tensor,
    /// The supervised chi loss (`chi_loss`).
    pub chi_loss: Tensor,
    /// The angle-norm loss (`angle_norm_loss`).
    pub angle_norm_loss: Tensor,
    /// 1 for the residues whose ground truth was renamed `[N]`.
    pub alt_naming_is_better: Tensor,
}

/// The structure module's loss of `out` against `truth`, with backbone FAPE clamped or not
/// (AlphaFold's `use_clamped_fape`: in training, clamped in 90% of the examples). `seq_mask`
/// `[N]` marks the real residues.
pub fn structure_loss(
    out: &StructureOutput,
    truth: &GroundTruth,
    seq_mask: &Tensor,
    clamped: bool,
    cfg: &StructureLossConfig,
) -> Result<StructureLoss> {
    let per_iteration = backbone_fape(out, truth, clamped, cfg)?;
    let layers = per_iteration.size()[0];
    let fape = per_iteration.f_select(0, layers - 1)?;
    let backbone = per_iteration.f_mean(Kind::Float)?;
    let renamed = RenamedTruth::new(truth, &out.atom14)?;
    let sidechain = sidechain_fape(out, truth, &renamed, cfg)?;
    let chi = supervised_chi_loss(&out.angles, truth)?;
    let angle_norm = angle_norm_loss(&out.unnormalized_angles, seq_mask)?;
    let loss = backbone
        .f_mul_scalar(1.0 - cfg.weight_frac)?
        .f_add(&sidechain.f_mul_scalar(cfg.weight_frac)?)?
        .f_add(&chi.f_mul_scalar(cfg.chi_weight)?)?
        .f_add(&angle_norm.f_mul_scalar(cfg.angle_norm_weight)?)?;
    Ok(StructureLoss {
        loss,
        fape,
        backbone_fape: backbone,
        sidechain_fape: sidechain,
        chi_loss: chi,
        angle_norm_loss: angle_norm,
        alt_naming_is_better: renamed.alt_naming_is_better,
    })
}

/// Backbone FAPE of every iteration `[layers]` (`backbone_loss`): the predicted backbone frames'
/// origins (CA) seen from every predicted frame, against the true ones, over the residues with
/// a true frame; clamped at `clamp_distance` when `clamped`.
pub fn backbone_fape(
    out: &StructureOutput,
    truth: &GroundTruth,
    clamped: bool,
    cfg: &StructureLossConfig,
) -> Result<Tensor> {
    let pred = Rigid { rot: out.rotations.f_to_kind(Kind::Float)?, trans: out.translations.f_to_kind(Kind::Float)? };
    let (frames, mask) = truth.backbone()?;
    let clamp = clamped.then_some(cfg.clamp_distance);
    // The truth broadcasts against the iterations.
    Ok(fape(&pred, &frames, &mask, &pred.trans, &frames.trans, &mask, clamp, cfg.loss_unit_distance))
}

/// The ground truth renamed residue by residue to the naming of symmetric side chains closer to
/// the prediction (`compute_renamed_ground_truth`, Algorithm 26).
#[derive(Debug)]
pub struct RenamedTruth {
    /// 1 for the residues where the alternative naming is closer `[N]`.
    pub alt_naming_is_better: Tensor,
    /// Atom14 positions under the chosen naming [N, 14, 3].
    pub atom14_positions: Tensor,
    /// Their resolved mask [N, 14].
    pub atom14_exists: Tensor,
}

impl RenamedTruth {
    /// Picks, per residue, the naming whose distances from the ambiguous atoms to every
    /// unambiguous resolved atom are closer to the predicted ones (`find_optimal_renaming`),
    /// for predicted atom14 positions `pred` [N, 14, 3]. A choice, so no gradient.
    pub fn new(truth: &GroundTruth, pred: &Tensor) -> Result<RenamedTruth> {
        let alt = tch::no_grad(|| -> Result<Tensor> {
            let pred = pred.f_detach()?.f_to_kind(Kind::Float)?;
            let pred_d = pairwise_atom_distances(&pred)?;
            let error = |x: &Tensor| -> Result<Tensor> {
                let d = pairwise_atom_distances(x)?.f_sub(&pred_d)?;
                Ok(d.f_square()?.f_add_scalar(1e-10)?.f_sqrt()?)
            };
            let (gt_error, alt_error) = (error(&truth.atom14_gt_positions)?, error(&truth.atom14_alt_gt_positions)?);
            // Rows: resolved ambiguous atoms of residue i; columns: resolved unambiguous atoms
            // of every residue j. [N, N, 14, 14]
            let exists = &truth.atom14_gt_exists;
            let ambiguous = &truth.atom14_atom_is_ambiguous;
            let rows = exists.f_mul(ambiguous)?.f_unsqueeze(1)?.f_unsqueeze(-1)?;
            let cols = exists.f_mul(&ambiguous.f_rsub_scalar(1.0)?)?.f_unsqueeze(0)?.f_unsqueeze(2)?;
            let mask = rows.f_mul(&cols)?;
            let dims: &[i64] = &[1, 2, 3];
            let per_residue = gt_error.f_mul(&mask)?.f_sum_dim_intlist(dims, false, Kind::Float)?;
            let alt_per_residue = alt_error.f_mul(&mask)?.f_sum_dim_intlist(dims, false, Kind::Float)?;
            Ok(alt_per_residue.f_lt_tensor(&per_residue)?.f_to_kind(Kind::Float)?)
        })?;
        let blend = |a: &Tensor, b: &Tensor, w: &Tensor| -> Result<Tensor> {
            Ok(a.f_mul(&w.f_rsub_scalar(1.0)?)?.f_add(&b.f_mul(w)?)?)
        };
        let w = alt.f_unsqueeze(-1)?;
        Ok(RenamedTruth {
            atom14_positions: blend(&truth.atom14_gt_positions, &truth.atom14_alt_gt_positions, &w.f_unsqueeze(-1)?)?,
            atom14_exists: blend(&truth.atom14_gt_exists, &truth.atom14_alt_gt_exists, &w)?,
            alt_naming_is_better: alt,
        })
    }
}

impl RenamedTruth {
    /// The truth's rigid-group frames under the chosen naming (the ambiguous group's
    /// alternative frame where the alternative naming was chosen), flattened to [N * 8].
    pub fn flat_frames(&self, truth: &GroundTruth) -> Result<Rigid> {
        let w = self.alt_naming_is_better.f_view([-1, 1, 1, 1])?;
        let pick = |gt: &Tensor, alt: &Tensor, w: &Tensor| -> Result<Tensor> {
            Ok(gt.f_mul(&w.f_rsub_scalar(1.0)?)?.f_add(&alt.f_mul(w)?)?)
        };
        let (gt, alt) = (&truth.rigidgroups_gt_frames, &truth.rigidgroups_alt_gt_frames);
        let frames =
            Rigid { rot: pick(&gt.rot, &alt.rot, &w)?, trans: pick(&gt.trans, &alt.trans, &w.f_squeeze_dim(-1)?)? };
        flat_frames(&frames)
    }
}

/// Frames of any leading shape flattened to one axis.
pub fn flat_frames(r: &Rigid) -> Result<Rigid> {
    Ok(Rigid { rot: r.rot.f_reshape([-1, 3, 3])?, trans: r.trans.f_reshape([-1, 3])? })
}

/// Distances between every atom of every residue and every atom of every residue,
/// `sqrt(d^2 + 1e-10)`: atom14 positions [N, 14, 3] → [N, N, 14, 14].
fn pairwise_atom_distances(x: &Tensor) -> Result<Tensor> {
    let a = x.f_unsqueeze(1)?.f_unsqueeze(3)?; // [N, 1, 14, 1, 3]
    let b = x.f_unsqueeze(0)?.f_unsqueeze(2)?; // [1, N, 1, 14, 3]
    Ok(a.f_sub(&b)?.f_square()?.f_sum_dim_intlist(-1, false, Kind::Float)?.f_add_scalar(1e-10)?.f_sqrt()?)
}

/// Side-chain FAPE (`sidechain_loss`): the last iteration's atom14 positions seen from its
/// eight rigid-group frames per residue, against the renamed truth's positions and frames (the
/// ambiguous group's alternative frame where the alternative naming was chosen), over the
/// resolved frames and atoms, clamped at `atom_clamp_distance`.
pub fn sidechain_fape(
    out: &StructureOutput,
    truth: &GroundTruth,
    renamed: &RenamedTruth,
    cfg: &StructureLossConfig,
) -> Result<Tensor> {
    let n = truth.aatype.size()[0];
    Ok(fape(
        &flat_frames(&out.frames)?,
        &renamed.flat_frames(truth)?,
        &truth.rigidgroups_gt_exists.f_reshape([n * RIGID_GROUPS])?,
        &out.atom14.f_reshape([-1, 3])?,
        &renamed.atom14_positions.f_reshape([-1, 3])?,
        &renamed.atom14_exists.f_reshape([-1])?,
        Some(cfg.atom_clamp_distance),
        cfg.length_scale,
    ))
}

/// The supervised chi loss (`supervised_chi_loss`, Algorithm 27): the squared distance of every
/// iteration's predicted (sin, cos) of the four chi angles (`angles` [layers, N, 7, 2], the
/// last four) from the true ones, or from the true angle turned by π where the chi angle is
/// π-periodic (the symmetric side chains' last chi) and that is closer, averaged over the
/// iterations and the chi angles the truth has.
pub fn supervised_chi_loss(angles: &Tensor, truth: &GroundTruth) -> Result<Tensor> {
    let layers = angles.size()[0];
    let pred = angles.f_to_kind(Kind::Float)?.f_narrow(-2, 3, 4)?; // [L, N, 4, 2]
    let tables = Tables::new(truth.aatype.device());
    let periodic = tables.chi_pi_periodic.f_index_select(0, &truth.aatype)?; // [N, 4]
    let true_chi = &truth.chi_angles_sin_cos;
    let shifted = true_chi.f_mul(&periodic.f_mul_scalar(-2.0)?.f_add_scalar(1.0)?.f_unsqueeze(-1)?)?;
    let error =
        |t: &Tensor| -> Result<Tensor> { Ok(t.f_sub(&pred)?.f_square()?.f_sum_dim_intlist(-1, false, Kind::Float)?) };
    let sq = error(true_chi)?.f_minimum(&error(&shifted)?)?; // [L, N, 4]
    masked_mean(&sq, &truth.chi_mask, layers)
}

/// The angle-norm loss (`angle_norm_loss`): how far the norm of every iteration's unnormalised
/// (sin, cos) pairs (`unnormalized` [layers, N, 7, 2]) is from 1, `|sqrt(s^2 + c^2 + 1e-6) - 1|`,
/// averaged over the iterations, the seven angles and the residues of `seq_mask` `[N]`.
pub fn angle_norm_loss(unnormalized: &Tensor, seq_mask: &Tensor) -> Result<Tensor> {
    let size = unnormalized.size();
    let norm = unnormalized.f_to_kind(Kind::Float)?.f_square()?.f_sum_dim_intlist(-1, false, Kind::Float)?;
    let error = norm.f_add_scalar(1e-6)?.f_sqrt()?.f_sub_scalar(1.0)?.f_abs()?; // [L, N, 7]
    masked_mean(&error, &seq_mask.f_to_kind(Kind::Float)?.f_unsqueeze(-1)?, size[0] * size[2])
}

/// AlphaFold's `utils.mask_mean` of `value` [L, ...] under `mask` (broadcast over the leading
/// dimension and over dimensions of size 1): `sum(mask * value) / (sum(mask) * broadcast +
/// 1e-10)`, `broadcast` the number of values each mask entry stands for.
fn masked_mean(value: &Tensor, mask: &Tensor, broadcast: i64) -> Result<Tensor> {
    let total = value.f_mul(mask)?.f_sum(Kind::Float)?;
    Ok(total.f_div(&mask.f_sum(Kind::Float)?.f_mul_scalar(broadcast as f64)?.f_add_scalar(1e-10)?)?)
}
