//! Structural violations (supplementary 1.9.11; AlphaFold's `find_structural_violations`,
//! `structural_violation_loss` and `compute_violation_metrics` with `all_atom`'s checks): how
//! far a predicted structure's atom14 positions break stereochemistry, as flat-bottom losses
//! that are zero inside a tolerance.
//!
//! - Between residues: the C-N peptide bond's length (to proline a little longer) and the
//!   CA-C-N and C-N-CA angles across it, beyond `violation_tolerance_factor` standard
//!   deviations, for consecutive residue numbers.
//! - Clashes between atoms of different residues closer than the sum of their van der Waals
//!   radii less `clash_overlap_tolerance` (except the peptide bond's C and N, and two
//!   cysteines' SG, a disulfide bridge).
//! - Within a residue: every two atoms' distance outside the bounds of
//!   [`crate::residue_constants::bounds::atom14_dists_bounds`] (bonds and angles within
//!   tolerance, other pairs no closer than their radii allow).
//!
//! The loss, added to the structure module's in fine-tuning: the three between-residue means
//! plus the clash and within-residue losses summed over atoms and divided by the number of
//! atoms the residue types have.
use tch::{Kind, Tensor};

use crate::model::{ensure, Result};
use crate::residue_constants::bounds::{
    atom14_dists_bounds, van_der_waals_radius, BETWEEN_RES_BOND_LENGTH_C_N, BETWEEN_RES_BOND_LENGTH_STDDEV_C_N,
    BETWEEN_RES_COS_ANGLES_CA_C_N, BETWEEN_RES_COS_ANGLES_C_N_CA, CA_CA,
};
use crate::residue_constants::{aatype_of, Tables, ATOM_TYPES, RESTYPE_NAME_TO_ATOM14_NAMES};

/// The violation checks' tolerances (AlphaFold's `heads.structure_module` config).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ViolationConfig {
    /// Standard deviations a bond length or angle may be off (`violation_tolerance_factor`, 12).
    pub violation_tolerance_factor: f64,
    /// How far (Å) two atoms may overlap their van der Waals radii (`clash_overlap_tolerance`,
    /// 1.5).
    pub clash_overlap_tolerance: f64,
}

impl Default for ViolationConfig {
    /// AlphaFold's values.
    fn default() -> Self {
        ViolationConfig { violation_tolerance_factor: 12.0, clash_overlap_tolerance: 1.5 }
    }
}

/// Violations of the peptide bond between consecutive residues (`between_residue_bond_loss`).
#[derive(Debug)]
pub struct BondViolations {
    /// Mean flat-bottom loss of the C-N bond length (`bonds_c_n_loss_mean`).
    pub c_n_loss_mean: Tensor,
    /// Mean loss of the CA-C-N angle's cosine (`angles_ca_c_n_loss_mean`).
    pub ca_c_n_loss_mean: Tensor,
    /// Mean loss of the C-N-CA angle's cosine (`angles_c_n_ca_loss_mean`).
    pub c_n_ca_loss_mean: Tensor,
    /// The three losses of each bond, half to each of its residues `[N]`
    /// (`connections_per_residue_loss_sum`; AlphaFold leaves the masks out of this sum).
    pub per_residue_loss_sum: Tensor,
    /// 1 for the residues of a bond beyond the tolerance `[N]`
    /// (`connections_per_residue_violation_mask`).
    pub per_residue_violation_mask: Tensor,
}

/// Clashes between atoms of different residues (`between_residue_clash_loss`).
#[derive(Debug)]
pub struct Clashes {
    /// The overlap beyond the tolerance, averaged over the pairs checked (`clashes_mean_loss`).
    pub mean_loss: Tensor,
    /// Each atom's summed overlap [N, 14] (`clashes_per_atom_loss_sum`).
    pub per_atom_loss_sum: Tensor,
    /// 1 for the atoms in a clash [N, 14] (`clashes_per_atom_clash_mask`).
    pub per_atom_clash_mask: Tensor,
}

/// Violations of the distance bounds within residues (`within_residue_violations`).
#[derive(Debug)]
pub struct WithinResidue {
    /// Each atom's summed distance outside its bounds [N, 14] (`per_atom_loss_sum`).
    pub per_atom_loss_sum: Tensor,
    /// 1 for the atoms with a distance outside its bounds [N, 14] (`per_atom_violations`).
    pub per_atom_violations: Tensor,
}

/// Every check of a structure (`find_structural_violations`).
#[derive(Debug)]
pub struct Violations {
    /// Between consecutive residues.
    pub bonds: BondViolations,
    /// Between atoms of different residues.
    pub clashes: Clashes,
    /// Within residues.
    pub within: WithinResidue,
    /// 1 for the residues with any violation `[N]` (`total_per_residue_violations_mask`).
    pub per_residue_violations_mask: Tensor,
    /// 1 for the atom14 slots the residue types have [N, 14], the atoms checked.
    pub atom14_atom_exists: Tensor,
}

/// The fractions of residues with violations (`compute_violation_metrics`; no gradient).
#[derive(Debug)]
pub struct ViolationMetrics {
    /// Of consecutive Cα pairs, the fraction more than 1.5 Å beyond the trans distance
    /// (`violations_extreme_ca_ca_distance`).
    pub extreme_ca_ca_distance: Tensor,
    /// Residues with a peptide-bond violation (`violations_between_residue_bond`).
    pub between_residue_bond: Tensor,
    /// Residues with a clash (`violations_between_residue_clash`).
    pub between_residue_clash: Tensor,
    /// Residues with a within-residue violation (`violations_within_residue`).
    pub within_residue: Tensor,
    /// Residues with any violation (`violations_per_residue`).
    pub per_residue: Tensor,
}

/// The atom14 slots of the backbone atoms.
const N: i64 = 0;
const CA: i64 = 1;
const C: i64 = 2;

/// `sqrt(eps + sum(x^2))` over the last dimension.
fn norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(x.f_square()?.f_sum_dim_intlist(-1, false, Kind::Float)?.f_add_scalar(eps)?.f_sqrt()?)
}

/// `sum(mask * value) / (sum(mask) + eps)`.
fn masked_mean(value: &Tensor, mask: &Tensor, eps: f64) -> Result<Tensor> {
    Ok(value.f_mul(mask)?.f_sum(Kind::Float)?.f_div(&mask.f_sum(Kind::Float)?.f_add_scalar(eps)?)?)
}

/// Per bond [N - 1] to per residue [N]: the mean of the bonds on either side, each bond
/// counted half (`mean`), or the larger (`max`).
fn to_residues(x: &Tensor, max: bool) -> Result<Tensor> {
    let zero = Tensor::f_zeros([1], (x.kind(), x.device()))?;
    let (before, after) = (Tensor::f_cat(&[x, &zero], 0)?, Tensor::f_cat(&[&zero, x], 0)?);
    Ok(if max { before.f_maximum(&after)? } else { before.f_add(&after)?.f_mul_scalar(0.5)? })
}

/// The flat-bottom loss of `value` against `target`, `relu(sqrt(1e-6 + (value - target)^2) -
/// tolerance)`, and whether the error passes the tolerance (before any mask).
fn flat_bottom(value: &Tensor, target: &Tensor, tolerance: &Tensor) -> Result<(Tensor, Tensor)> {
    let error = value.f_sub(target)?.f_square()?.f_add_scalar(1e-6)?.f_sqrt()?;
    Ok((error.f_sub(tolerance)?.f_relu()?, error.f_gt_tensor(tolerance)?.f_to_kind(Kind::Float)?))
}

/// The peptide bond's checks (`between_residue_bond_loss`): `positions` [N, 14, 3], `exists`
/// [N, 14], `residue_index` `[N]` (a bond only where consecutive numbers follow), `aatype` `[N]`.
/// A single residue has no bonds: the means are 0.
pub fn between_residue_bonds(
    positions: &Tensor,
    exists: &Tensor,
    residue_index: &Tensor,
    aatype: &Tensor,
    tolerance_factor: f64,
) -> Result<BondViolations> {
    let n = positions.size()[0];
    let this = |slot: i64| positions.f_narrow(0, 0, n - 1)?.f_select(1, slot);
    let next = |slot: i64| positions.f_narrow(0, 1, n - 1)?.f_select(1, slot);
    let this_mask = |slot: i64| exists.f_narrow(0, 0, n - 1)?.f_select(1, slot);
    let next_mask = |slot: i64| exists.f_narrow(0, 1, n - 1)?.f_select(1, slot);
    let (this_ca, this_c, next_n, next_ca) = (this(CA)?, this(C)?, next(N)?, next(CA)?);
    let index = residue_index.f_to_kind(Kind::Float)?;
    let no_gap =
        index.f_narrow(0, 1, n - 1)?.f_sub(&index.f_narrow(0, 0, n - 1)?)?.f_eq(1.0)?.f_to_kind(Kind::Float)?;
    let constant = |v: f64| Tensor::f_full([n - 1], v, (Kind::Float, positions.device()));

    // The C-N bond, a little longer to proline.
    let c_n_length = norm(&this_c.f_sub(&next_n)?, 1e-6)?;
    let pro = aatype_of('P') as i64;
    let next_is_pro = aatype.f_narrow(0, 1, n - 1)?.f_eq(pro)?.f_to_kind(Kind::Float)?;
    let pick = |v: [f64; 2]| -> Result<Tensor> {
        Ok(next_is_pro.f_rsub_scalar(1.0)?.f_mul_scalar(v[0])?.f_add(&next_is_pro.f_mul_scalar(v[1])?)?)
    };
    let (length, stddev) = (pick(BETWEEN_RES_BOND_LENGTH_C_N)?, pick(BETWEEN_RES_BOND_LENGTH_STDDEV_C_N)?);
    let (c_n_loss, c_n_violation) = flat_bottom(&c_n_length, &length, &stddev.f_mul_scalar(tolerance_factor)?)?;
    let c_n_mask = this_mask(C)?.f_mul(&next_mask(N)?)?.f_mul(&no_gap)?;

    // The angles at C and at N, by their cosines.
    let unit = |from: &Tensor, to: &Tensor, length: &Tensor| -> Result<Tensor> {
        Ok(to.f_sub(from)?.f_div(&length.f_unsqueeze(-1)?)?)
    };
    let c_ca = unit(&this_c, &this_ca, &norm(&this_ca.f_sub(&this_c)?, 1e-6)?)?;
    let c_n = unit(&this_c, &next_n, &c_n_length)?;
    let n_ca = unit(&next_n, &next_ca, &norm(&next_n.f_sub(&next_ca)?, 1e-6)?)?;
    let cosine = |a: &Tensor, b: &Tensor| a.f_mul(b)?.f_sum_dim_intlist(-1, false, Kind::Float);
    // AlphaFold's tolerance for the CA-C-N angle is the C-N length's standard deviation.
    let (ca_c_n_loss, ca_c_n_violation) = flat_bottom(
        &cosine(&c_ca, &c_n)?,
        &constant(BETWEEN_RES_COS_ANGLES_CA_C_N[0])?,
        &constant(tolerance_factor * BETWEEN_RES_BOND_LENGTH_STDDEV_C_N[0])?,
    )?;
    let ca_c_n_mask = this_mask(CA)?.f_mul(&c_n_mask)?;
    let (c_n_ca_loss, c_n_ca_violation) = flat_bottom(
        &cosine(&c_n.f_neg()?, &n_ca)?,
        &constant(BETWEEN_RES_COS_ANGLES_C_N_CA[0])?,
        &constant(tolerance_factor * BETWEEN_RES_COS_ANGLES_C_N_CA[1])?,
    )?;
    let c_n_ca_mask = c_n_mask.f_mul(&next_mask(CA)?)?;

    let per_bond = c_n_loss.f_add(&ca_c_n_loss)?.f_add(&c_n_ca_loss)?;
    let violation = c_n_violation
        .f_mul(&c_n_mask)?
        .f_maximum(&ca_c_n_violation.f_mul(&ca_c_n_mask)?)?
        .f_maximum(&c_n_ca_violation.f_mul(&c_n_ca_mask)?)?;
    Ok(BondViolations {
        c_n_loss_mean: masked_mean(&c_n_loss, &c_n_mask, 1e-6)?,
        ca_c_n_loss_mean: masked_mean(&ca_c_n_loss, &ca_c_n_mask, 1e-6)?,
        c_n_ca_loss_mean: masked_mean(&c_n_ca_loss, &c_n_ca_mask, 1e-6)?,
        per_residue_loss_sum: to_residues(&per_bond, false)?,
        per_residue_violation_mask: to_residues(&violation, true)?,
    })
}

/// Distances `sqrt(1e-10 + |a - b|^2)` between points `a` [..., 1, 3] and `b` [1, ..., 3]
/// broadcast against each other.
fn distances(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    norm(&a.f_sub(b)?, 1e-10)
}

/// The larger of a [N, N, 14, 14] mask's maxima over the first residue and atom and over the
/// second: per atom [N, 14], whether it takes part in any flagged pair.
fn per_atom_max(pairs: &Tensor, first: &[i64], second: &[i64]) -> Result<Tensor> {
    Ok(pairs.f_amax(first, false)?.f_maximum(&pairs.f_amax(second, false)?)?)
}

/// Clashes between atoms of different residues (`between_residue_clash_loss`): `positions`
/// [N, 14, 3], `exists` and van der Waals `radius` [N, 14], `residue_index` `[N]`; in a complex,
/// `asym_id` `[N]` (Multimer's `all_atom_multimer` version), so that only residues of one chain
/// are peptide-bond neighbours. Pairs are taken once in numbering order, as AlphaFold takes
/// them: in a complex, whose chains are each numbered from 0, two residues of different chains
/// with the same number are never checked (Multimer's own rule, kept for parity).
pub fn between_residue_clashes(
    positions: &Tensor,
    exists: &Tensor,
    radius: &Tensor,
    residue_index: &Tensor,
    asym_id: Option<&Tensor>,
    overlap_tolerance: f64,
) -> Result<Clashes> {
    let opts = (Kind::Float, positions.device());
    let pair = |x: &Tensor| -> Result<(Tensor, Tensor)> {
        Ok((x.f_unsqueeze(1)?.f_unsqueeze(3)?, x.f_unsqueeze(0)?.f_unsqueeze(2)?))
        // [N,1,14,1], [1,N,1,14]
    };
    let dists = distances(&positions.f_unsqueeze(1)?.f_unsqueeze(3)?, &positions.f_unsqueeze(0)?.f_unsqueeze(2)?)?;
    let (ei, ej) = pair(exists)?;
    let index = residue_index.f_to_kind(Kind::Int64)?;
    let (ri, rj) = (index.f_view([-1, 1, 1, 1])?, index.f_view([1, -1, 1, 1])?);
    // Each pair of residues once, in numbering order; atoms of one residue are not clashes.
    let mut mask = ei.f_mul(&ej)?.f_mul(&ri.f_lt_tensor(&rj)?.f_to_kind(Kind::Float)?)?;
    // Neither is the peptide bond's C of one residue and N of the next, nor two cysteines' SG.
    let one_hot = |slot: usize| -> Result<Tensor> {
        let mut v = [0f32; 14];
        v[slot] = 1.0;
        Ok(Tensor::f_from_slice(&v)?.f_to_device(opts.1)?)
    };
    let mut neighbours = ri.f_add_scalar(1)?.f_eq_tensor(&rj)?.f_to_kind(Kind::Float)?;
    if let Some(asym_id) = asym_id {
        let chain = asym_id.f_to_kind(Kind::Int64)?;
        let same = chain.f_view([-1, 1, 1, 1])?.f_eq_tensor(&chain.f_view([1, -1, 1, 1])?)?;
        neighbours = neighbours.f_mul(&same.f_to_kind(Kind::Float)?)?;
    }
    let c_n = neighbours
        .f_mul(&one_hot(C as usize)?.f_view([1, 1, 14, 1])?)?
        .f_mul(&one_hot(N as usize)?.f_view([1, 1, 1, 14])?)?;
    mask = mask.f_mul(&c_n.f_rsub_scalar(1.0)?)?;
    let sg = RESTYPE_NAME_TO_ATOM14_NAMES[aatype_of('C')].iter().position(|&a| a == "SG").unwrap_or(5);
    let sg = one_hot(sg)?;
    let disulfide = sg.f_view([1, 1, 14, 1])?.f_mul(&sg.f_view([1, 1, 1, 14])?)?;
    mask = mask.f_mul(&disulfide.f_rsub_scalar(1.0)?)?;

    let (radius_i, radius_j) = pair(radius)?;
    let lower = mask.f_mul(&radius_i.f_add(&radius_j)?)?;
    let error = mask.f_mul(&lower.f_sub_scalar(overlap_tolerance)?.f_sub(&dists)?.f_relu()?)?;
    let clash = mask.f_mul(&dists.f_lt_tensor(&lower.f_sub_scalar(overlap_tolerance)?)?.f_to_kind(Kind::Float)?)?;
    Ok(Clashes {
        mean_loss: error.f_sum(Kind::Float)?.f_div(&mask.f_sum(Kind::Float)?.f_add_scalar(1e-6)?)?,
        per_atom_loss_sum: error
            .f_sum_dim_intlist([0, 2].as_slice(), false, Kind::Float)?
            .f_add(&error.f_sum_dim_intlist([1, 3].as_slice(), false, Kind::Float)?)?,
        per_atom_clash_mask: per_atom_max(&clash, &[0, 2], &[1, 3])?,
    })
}

/// Distances within residues outside their bounds (`within_residue_violations`): `positions`
/// [N, 14, 3], `exists` [N, 14], `lower` and `upper` bounds [N, 14, 14].
pub fn within_residue_violations(
    positions: &Tensor,
    exists: &Tensor,
    lower: &Tensor,
    upper: &Tensor,
) -> Result<WithinResidue> {
    let eye = Tensor::f_eye(14, (Kind::Float, positions.device()))?;
    let mask =
        eye.f_rsub_scalar(1.0)?.f_unsqueeze(0)?.f_mul(&exists.f_unsqueeze(2)?.f_mul(&exists.f_unsqueeze(1)?)?)?;
    let dists = distances(&positions.f_unsqueeze(2)?, &positions.f_unsqueeze(1)?)?;
    let too_close = lower.f_sub(&dists)?.f_relu()?;
    let too_far = dists.f_sub(upper)?.f_relu()?;
    let loss = mask.f_mul(&too_close.f_add(&too_far)?)?;
    let outside = dists.f_lt_tensor(lower)?.f_logical_or(&dists.f_gt_tensor(upper)?)?;
    let violations = mask.f_mul(&outside.f_to_kind(Kind::Float)?)?;
    Ok(WithinResidue {
        per_atom_loss_sum: loss.f_sum_dim_intlist(1, false, Kind::Float)?.f_add(&loss.f_sum_dim_intlist(
            2,
            false,
            Kind::Float,
        )?)?,
        per_atom_violations: violations.f_amax(1, false)?.f_maximum(&violations.f_amax(2, false)?)?,
    })
}

/// Every check of predicted atom14 `positions` [N, 14, 3] of residue types `aatype` `[N]`
/// numbered `residue_index` `[N]` (`find_structural_violations`), of a complex's chains
/// `asym_id` `[N]` when given (see [`between_residue_clashes`]). The atoms checked are those the
/// residue types have, resolved in the truth or not.
pub fn find_structural_violations(
    positions: &Tensor,
    aatype: &Tensor,
    residue_index: &Tensor,
    asym_id: Option<&Tensor>,
    cfg: &ViolationConfig,
) -> Result<Violations> {
    let n = aatype.size()[0];
    ensure!(positions.size() == [n, 14, 3], "atom14 positions: expected [{n}, 14, 3], found {:?}", positions.size());
    ensure!(residue_index.size() == [n], "residue_index: expected [{n}], found {:?}", residue_index.size());
    let device = positions.device();
    let positions = positions.f_to_kind(Kind::Float)?;
    let aatype = aatype.f_to_kind(Kind::Int64)?;
    let tables = Tables::new(device);
    let exists = tables.atom14_mask.f_index_select(0, &aatype)?;
    let bonds = between_residue_bonds(&positions, &exists, residue_index, &aatype, cfg.violation_tolerance_factor)?;

    // Each atom's radius by the element of its atom37 name.
    let radii: Vec<f32> = ATOM_TYPES.iter().map(|a| van_der_waals_radius(a).unwrap_or(0.0) as f32).collect();
    let radii = Tensor::f_from_slice(&radii)?.f_to_device(device)?;
    let radius = exists.f_mul(&radii.f_index(&[Some(tables.atom14_to_atom37.f_index_select(0, &aatype)?)])?)?;
    let tolerance = cfg.clash_overlap_tolerance;
    let clashes = between_residue_clashes(&positions, &exists, &radius, residue_index, asym_id, tolerance)?;

    let bounds = atom14_dists_bounds(cfg.clash_overlap_tolerance, cfg.violation_tolerance_factor);
    let table = |b: &[[[f32; 14]; 14]]| -> Result<Tensor> {
        let flat: Vec<f32> = b.iter().flatten().flatten().copied().collect();
        Ok(Tensor::f_from_slice(&flat)?.f_view([-1, 14, 14])?.f_to_device(device)?.f_index_select(0, &aatype)?)
    };
    let within = within_residue_violations(&positions, &exists, &table(&bounds.lower)?, &table(&bounds.upper)?)?;

    let per_residue_violations_mask = bonds
        .per_residue_violation_mask
        .f_maximum(&clashes.per_atom_clash_mask.f_amax(-1, false)?)?
        .f_maximum(&within.per_atom_violations.f_amax(-1, false)?)?;
    Ok(Violations { bonds, clashes, within, per_residue_violations_mask, atom14_atom_exists: exists })
}

impl Violations {
    /// The violation loss (`structural_violation_loss`, before its weight): the three
    /// peptide-bond means plus the clash and within-residue losses of every atom divided by
    /// the number of atoms checked.
    pub fn loss(&self) -> Result<Tensor> {
        let b = &self.bonds;
        let atoms = self.atom14_atom_exists.f_sum(Kind::Float)?.f_add_scalar(1e-6)?;
        let per_atom = self.clashes.per_atom_loss_sum.f_add(&self.within.per_atom_loss_sum)?.f_sum(Kind::Float)?;
        Ok(b.c_n_loss_mean.f_add(&b.ca_c_n_loss_mean)?.f_add(&b.c_n_ca_loss_mean)?.f_add(&per_atom.f_div(&atoms)?)?)
    }

    /// The fractions of the residues of `seq_mask` `[N]` with each kind of violation, and of
    /// consecutive Cα pairs of `positions` [N, 14, 3] (numbered `residue_index`) stretched
    /// beyond 1.5 Å more than the trans distance (`compute_violation_metrics`).
    pub fn metrics(&self, positions: &Tensor, residue_index: &Tensor, seq_mask: &Tensor) -> Result<ViolationMetrics> {
        tch::no_grad(|| {
            let n = positions.size()[0].max(1);
            let ca = positions.f_detach()?.f_to_kind(Kind::Float)?.f_select(1, CA)?;
            let ca_exists = self.atom14_atom_exists.f_select(1, CA)?;
            let index = residue_index.f_to_kind(Kind::Float)?;
            let step =
                |x: &Tensor| -> Result<(Tensor, Tensor)> { Ok((x.f_narrow(0, 0, n - 1)?, x.f_narrow(0, 1, n - 1)?)) };
            let ((ca0, ca1), (m0, m1), (i0, i1)) = (step(&ca)?, step(&ca_exists)?, step(&index)?);
            let no_gap = i1.f_sub(&i0)?.f_eq(1.0)?.f_to_kind(Kind::Float)?;
            let stretched = norm(&ca0.f_sub(&ca1)?, 1e-6)?.f_sub_scalar(CA_CA)?.f_gt(1.5)?.f_to_kind(Kind::Float)?;
            let seq_mask = seq_mask.f_to_kind(Kind::Float)?;
            let fraction = |value: &Tensor| masked_mean(value, &seq_mask, 1e-10);
            Ok(ViolationMetrics {
                extreme_ca_ca_distance: masked_mean(&stretched, &m0.f_mul(&m1)?.f_mul(&no_gap)?, 1e-10)?,
                between_residue_bond: fraction(&self.bonds.per_residue_violation_mask)?,
                between_residue_clash: fraction(&self.clashes.per_atom_clash_mask.f_amax(-1, false)?)?,
                within_residue: fraction(&self.within.per_atom_violations.f_amax(-1, false)?)?,
                per_residue: fraction(&self.per_residue_violations_mask)?,
            })
        })
    }
}
