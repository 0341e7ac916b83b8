//! AlphaFold-Multimer's structure-module loss (DeepMind's `folding_multimer.StructureModule.loss`,
//! v2.3; Evans et al. 2021), on a ground truth whose chains already stand in the prediction's
//! order. What differs from the monomer's ([`super::structure`]):
//!
//! - backbone FAPE is split by chain pairs: frames and points of one chain (`intra_chain_fape`:
//!   clamped at 10 Å, in units of 10 Å) and of different chains (`interface_fape`: clamped at
//!   1000 Å, in units of 20 Å), each averaged over the iterations and the two added; there is
//!   no clamped/unclamped draw;
//! - every FAPE measures distances as `sqrt(max(d^2, 1e-8))` and averages over the pairs it
//!   counts (`all_atom_multimer.frame_aligned_point_error`);
//! - side-chain FAPE's atoms are masked by the alternative naming's resolved atoms whatever the
//!   naming chosen (`compute_atom14_gt` returns that mask; kept for parity);
//! - the structural-violation term is always in the loss (weight 1), its clashes counting
//!   peptide-bond neighbours within a chain only.
//!
//! The chi and angle-norm terms are the monomer's.
use tch::{Kind, Tensor};

use super::structure::{angle_norm_loss, flat_frames, supervised_chi_loss, RenamedTruth};
use super::violations::{find_structural_violations, ViolationConfig};
use crate::geometry::Rigid;
use crate::ground_truth::{GroundTruth, RIGID_GROUPS};
use crate::model::structure::StructureOutput;
use crate::model::{ensure, Result};

/// One FAPE's clamp and unit, Å.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FapeScale {
    /// Errors beyond this are clamped (`atom_clamp_distance`).
    pub clamp: f64,
    /// Errors are divided by this (`loss_unit_distance`).
    pub unit: f64,
}

/// Multimer's structure-module loss settings (`heads.structure_module` of the multimer config).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MultimerStructureLossConfig {
    /// Backbone FAPE within chains (10, 10).
    pub intra_chain: FapeScale,
    /// Backbone FAPE between chains (1000, 20).
    pub interface: FapeScale,
    /// Side-chain FAPE (10, 10).
    pub sidechain: FapeScale,
    /// Side-chain FAPE's share of the FAPE weight (`sidechain.weight_frac`, 0.5).
    pub weight_frac: f64,
    /// The chi loss's weight (0.5).
    pub chi_weight: f64,
    /// The angle-norm loss's weight (0.01).
    pub angle_norm_weight: f64,
    /// The structural-violation term's weight (`structural_violation_loss_weight`, 1).
    pub violation_weight: f64,
    /// The violation checks' tolerances.
    pub violation: ViolationConfig,
}

impl Default for MultimerStructureLossConfig {
    /// AlphaFold-Multimer v2.3's values (`model/config.py`, `CONFIG_MULTIMER`).
    fn default() -> Self {
        MultimerStructureLossConfig {
            intra_chain: FapeScale { clamp: 10.0, unit: 10.0 },
            interface: FapeScale { clamp: 1000.0, unit: 20.0 },
            sidechain: FapeScale { clamp: 10.0, unit: 10.0 },
            weight_frac: 0.5,
            chi_weight: 0.5,
            angle_norm_weight: 0.01,
            violation_weight: 1.0,
            violation: ViolationConfig::default(),
        }
    }
}

/// The loss and its terms (scalars), under DeepMind's names.
#[derive(Debug)]
pub struct MultimerStructureLoss {
    /// The weighted sum, violations included (`loss`).
    pub loss: Tensor,
    /// The last iteration's intra-chain plus interface FAPE (`fape`).
    pub fape: Tensor,
    /// Intra-chain plus interface FAPE, each averaged over the iterations (`bb_loss`).
    pub backbone: Tensor,
    /// Its intra-chain part (`intra_chain_bb_loss`).
    pub intra_chain: Tensor,
    /// Its interface part (`interface_bb_loss`).
    pub interface: Tensor,
    /// Side-chain FAPE (`sidechain_fape`).
    pub sidechain_fape: Tensor,
    /// The chi loss (`chi_loss`).
    pub chi_loss: Tensor,
    /// The angle-norm loss (`angle_norm_loss`).
    pub angle_norm_loss: Tensor,
    /// The structural-violation term before its weight.
    pub violation: Tensor,
    /// 1 for the residues whose ground truth was renamed `[N]`.
    pub alt_naming_is_better: Tensor,
}

/// The structure-module loss of `out` against `truth` for a complex of chains `asym_id` `[N]`,
/// residues numbered `residue_index` `[N]` (from 0 in each chain), real where `seq_mask` `[N]`.
pub fn multimer_structure_loss(
    out: &StructureOutput,
    truth: &GroundTruth,
    seq_mask: &Tensor,
    residue_index: &Tensor,
    asym_id: &Tensor,
    cfg: &MultimerStructureLossConfig,
) -> Result<MultimerStructureLoss> {
    let n = truth.aatype.size()[0];
    ensure!(asym_id.size() == [n], "asym_id: expected [{n}], found {:?}", asym_id.size());
    let chain = asym_id.f_to_kind(Kind::Int64)?;
    let same_chain = chain.f_unsqueeze(1)?.f_eq_tensor(&chain.f_unsqueeze(0)?)?.f_to_kind(Kind::Float)?;
    let pred = Rigid { rot: out.rotations.f_to_kind(Kind::Float)?, trans: out.translations.f_to_kind(Kind::Float)? };
    let (frames, mask) = truth.backbone()?;
    // [layers]: the truth broadcasts against the iterations.
    let backbone_fape = |pairs: &Tensor, scale: FapeScale| {
        fape(&pred, &frames, &mask, &pred.trans, &frames.trans, &mask, Some(pairs), scale)
    };
    let intra = backbone_fape(&same_chain, cfg.intra_chain)?;
    let interface = backbone_fape(&same_chain.f_rsub_scalar(1.0)?, cfg.interface)?;
    let layers = intra.size()[0];
    let last = |t: &Tensor| t.f_select(0, layers - 1);
    let fape_last = last(&intra)?.f_add(&last(&interface)?)?;
    let (intra_mean, interface_mean) = (intra.f_mean(Kind::Float)?, interface.f_mean(Kind::Float)?);
    let backbone = intra_mean.f_add(&interface_mean)?;

    let renamed = RenamedTruth::new(truth, &out.atom14)?;
    let sidechain = sidechain_fape(out, truth, &renamed, cfg.sidechain)?;
    let chi = supervised_chi_loss(&out.angles, truth)?;
    let angle_norm = angle_norm_loss(&out.unnormalized_angles, seq_mask)?;
    let violations =
        find_structural_violations(&out.atom14, &truth.aatype, residue_index, Some(asym_id), &cfg.violation)?;
    let violation = violations.loss()?;
    let loss = backbone
        .f_mul_scalar(1.0 - cfg.weight_frac)?
        .f_add(&sidechain.f_mul_scalar(cfg.weight_frac)?)?
        .f_add(&chi.f_mul_scalar(cfg.chi_weight)?)?
        .f_add(&angle_norm.f_mul_scalar(cfg.angle_norm_weight)?)?
        .f_add(&violation.f_mul_scalar(cfg.violation_weight)?)?;
    Ok(MultimerStructureLoss {
        loss,
        fape: fape_last,
        backbone,
        intra_chain: intra_mean,
        interface: interface_mean,
        sidechain_fape: sidechain,
        chi_loss: chi,
        angle_norm_loss: angle_norm,
        violation,
        alt_naming_is_better: renamed.alt_naming_is_better,
    })
}

/// Side-chain FAPE: the last iteration's atom14 positions seen from its rigid-group frames,
/// against the renamed truth's (the ambiguous group's alternative frame where the alternative
/// naming was chosen), over the resolved frames and the alternative naming's resolved atoms.
fn sidechain_fape(
    out: &StructureOutput,
    truth: &GroundTruth,
    renamed: &RenamedTruth,
    scale: FapeScale,
) -> Result<Tensor> {
    let n = truth.aatype.size()[0];
    fape(
        &flat_frames(&out.frames)?,
        &renamed.flat_frames(truth)?,
        &truth.rigidgroups_gt_exists.f_reshape([n * RIGID_GROUPS])?,
        &out.atom14.f_reshape([-1, 3])?,
        &renamed.atom14_positions.f_reshape([-1, 3])?,
        &truth.atom14_alt_gt_exists.f_reshape([-1])?,
        None,
        scale,
    )
}

/// Multimer's frame-aligned point error (`all_atom_multimer.frame_aligned_point_error`): the
/// points seen from every frame, predicted against true, at distance `sqrt(max(d^2, 1e-8))`,
/// clamped, over the pairs of resolved frames and points (and of `pairs` [frames, points] when
/// given), averaged: `sum / (1e-4 + pairs counted)`. Leading dimensions of the prediction (the
/// iterations) broadcast against the truth.
#[allow(clippy::too_many_arguments)]
fn fape(
    pred_frames: &Rigid,
    true_frames: &Rigid,
    frame_mask: &Tensor,
    pred_positions: &Tensor,
    true_positions: &Tensor,
    position_mask: &Tensor,
    pairs: Option<&Tensor>,
    scale: FapeScale,
) -> Result<Tensor> {
    const EPS: f64 = 1e-4;
    let diff = pred_frames.in_every_frame(pred_positions).f_sub(&true_frames.in_every_frame(true_positions))?;
    let squared = diff.f_square()?.f_sum_dim_intlist(-1, false, Kind::Float)?;
    let distance = squared.f_clamp_min(EPS * EPS)?.f_sqrt()?.f_clamp_max(scale.clamp)?;
    let mut mask = frame_mask.f_unsqueeze(-1)?.f_mul(&position_mask.f_unsqueeze(-2)?)?;
    if let Some(pairs) = pairs {
        mask = mask.f_mul(pairs)?;
    }
    let dims: &[i64] = &[-1, -2];
    let total = distance.f_div_scalar(scale.unit)?.f_mul(&mask)?.f_sum_dim_intlist(dims, false, Kind::Float)?;
    Ok(total.f_div(&mask.f_sum(Kind::Float)?.f_add_scalar(EPS)?)?)
}
