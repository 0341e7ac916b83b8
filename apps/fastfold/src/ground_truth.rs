//! The ground truth AlphaFold's training losses read, computed from a true structure (residue
//! types, atom37 positions and mask) as AlphaFold computes it: the rigid-group frames
//! (`all_atom.atom37_to_frames`), the chi angles (`atom37_to_torsion_angles`), the atom14
//! positions with their alternative naming for symmetric side chains (`atom37_to_atom14`,
//! `get_alt_atom14`, supplementary Table 3) and the pseudo-beta atoms (`pseudo_beta_fn`).
//!
//! Missing atoms (mask 0) are allowed anywhere: a frame, torsion or atom that needs one is
//! masked out, and its position is zero.
use tch::{Kind, Tensor};

use crate::geometry::Rigid;
use crate::model::embedders::pseudo_beta;
use crate::model::templates::torsion_angles;
use crate::model::{ensure, Result};
use crate::residue_constants::{aatype_of, atom_order, Tables, UNK_RESTYPE_INDEX};

/// Rigid groups per residue (backbone, pre-omega, phi, psi, chi1..chi4).
pub const RIGID_GROUPS: i64 = 8;

/// What the losses compare predictions with, for one chain of `N` residues.
#[derive(Debug)]
pub struct GroundTruth {
    /// Residue types `[N]` (int64, 0..=20).
    pub aatype: Tensor,
    /// True atom37 positions [N, 37, 3] (zero where absent).
    pub all_atom_positions: Tensor,
    /// 1 where the atom was resolved [N, 37].
    pub all_atom_mask: Tensor,
    /// 1 for the atom14 slots the residue type has [N, 14].
    pub atom14_atom_exists: Tensor,
    /// True atom14 positions [N, 14, 3] (zero where absent).
    pub atom14_gt_positions: Tensor,
    /// 1 where the atom14 atom is resolved [N, 14].
    pub atom14_gt_exists: Tensor,
    /// Atom14 positions under the alternative naming (ambiguous atoms swapped) [N, 14, 3].
    pub atom14_alt_gt_positions: Tensor,
    /// Resolved mask under the alternative naming [N, 14].
    pub atom14_alt_gt_exists: Tensor,
    /// 1 for the atoms the alternative naming swaps [N, 14].
    pub atom14_atom_is_ambiguous: Tensor,
    /// The eight rigid-group frames [N, 8] (group 0 is the backbone frame: origin CA, x axis
    /// towards C, N in the xy plane).
    pub rigidgroups_gt_frames: Rigid,
    /// The frames under the alternative naming (the ambiguous chi group turned by 180°) [N, 8].
    pub rigidgroups_alt_gt_frames: Rigid,
    /// 1 where the group exists and its three base atoms are resolved [N, 8].
    pub rigidgroups_gt_exists: Tensor,
    /// 1 where the residue type has the group [N, 8].
    pub rigidgroups_group_exists: Tensor,
    /// 1 for the group the alternative naming turns [N, 8].
    pub rigidgroups_group_is_ambiguous: Tensor,
    /// (sin, cos) of the four chi angles [N, 4, 2].
    pub chi_angles_sin_cos: Tensor,
    /// 1 where the chi angle exists and its four atoms are resolved [N, 4].
    pub chi_mask: Tensor,
    /// Pseudo-beta positions (CB, CA for glycine) [N, 3].
    pub pseudo_beta: Tensor,
    /// 1 where the pseudo-beta atom is resolved `[N]`.
    pub pseudo_beta_mask: Tensor,
}

impl GroundTruth {
    /// From residue types `aatype` `[N]` (integers; above 20 read as unknown), atom37
    /// `positions` [N, 37, 3] and `mask` [N, 37], on their device, in fp32.
    pub fn new(aatype: &Tensor, positions: &Tensor, mask: &Tensor) -> Result<GroundTruth> {
        let n = match aatype.size().as_slice() {
            [n] => *n,
            s => return Err(crate::model::Error::Invalid(format!("aatype: expected shape [residues], found {s:?}"))),
        };
        ensure!(
            positions.size() == [n, 37, 3],
            "all_atom_positions: expected shape [{n}, 37, 3], found {:?}",
            positions.size()
        );
        ensure!(mask.size() == [n, 37], "all_atom_mask: expected shape [{n}, 37], found {:?}", mask.size());
        let tables = Tables::new(aatype.device());
        let aatype = aatype.f_to_kind(Kind::Int64)?.f_clamp(0, UNK_RESTYPE_INDEX as i64)?;
        let mask = mask.f_to_kind(Kind::Float)?;
        // Absent atoms at zero, whatever the input holds there.
        let positions = positions.f_to_kind(Kind::Float)?.f_mul(&mask.f_unsqueeze(-1)?)?;
        let per_residue = |table: &Tensor| table.f_index_select(0, &aatype);

        // atom14: gather by the residue type's atom37 slots, keep the slots it has.
        let exists = per_residue(&tables.atom14_mask)?;
        let to37 = per_residue(&tables.atom14_to_atom37)?; // [N, 14]
        let gt_exists = mask.f_gather(1, &to37, false)?.f_mul(&exists)?;
        let gt_positions = gather_points(&positions, &to37)?.f_mul(&gt_exists.f_unsqueeze(-1)?)?;
        // The alternative naming: each slot takes its swap partner's atom.
        let renaming = per_residue(&tables.atom14_renaming)?;
        let alt_positions = gather_points(&gt_positions, &renaming)?;
        let alt_exists = gt_exists.f_gather(1, &renaming, false)?;

        // Rigid groups: frames from three base atoms each.
        let base = per_residue(&tables.rigidgroup_base_atoms)?.f_reshape([n, 24])?;
        let base_pos = gather_points(&positions, &base)?.f_reshape([n, 8, 3, 3])?;
        let point = |k: i64| base_pos.f_select(2, k);
        let frames = Rigid::from_3_points(&point(0)?, &point(1)?, &point(2)?);
        let group_exists = per_residue(&tables.rigidgroup_mask)?;
        let base_mask = mask.f_gather(1, &base, false)?.f_reshape([n, 8, 3])?;
        let gt_frame_exists = base_mask.f_amin(-1, false)?.f_mul(&group_exists)?;
        // The backbone group is built from C, CA, N (x axis from C to CA); AlphaFold mirrors
        // its x and z axes to the older convention (x from CA to C).
        let device = aatype.device();
        let diag = |d: [f32; 3]| Tensor::from_slice(&d).to_device(device).f_diag_embed(0, -2, -1);
        let group_rot = Tensor::f_stack(
            &(0..RIGID_GROUPS)
                .map(|g| diag(if g == 0 { [-1.0, 1.0, -1.0] } else { [1.0; 3] }))
                .collect::<tch::Result<Vec<_>>>()?,
            0,
        )?;
        let frames = frames.mul_rots(&group_rot);
        // The ambiguous group's alternative frame is turned by 180° about its x axis.
        let ambiguous = per_residue(&tables.rigidgroup_is_ambiguous)?;
        let flip = ambiguous.f_unsqueeze(-1)?.f_mul_scalar(-2.0)?.f_add_scalar(1.0)?; // 1 or -1
        let ones = flip.f_ones_like()?;
        let alt_rot = Tensor::f_cat(&[ones, flip.shallow_clone(), flip], -1)?.f_diag_embed(0, -2, -1)?;
        let alt_frames = frames.mul_rots(&alt_rot);

        let (sin_cos, _, torsion_mask) = torsion_angles(&aatype, &positions, &mask)?;
        let cb = atom_order("CB").unwrap_or(3) as i64;
        let ca = atom_order("CA").unwrap_or(1) as i64;
        let gly = aatype.f_eq(aatype_of('G') as i64)?.f_to_kind(Kind::Float)?;
        let pseudo_beta_mask =
            gly.f_mul(&mask.f_select(1, ca)?)?.f_add(&gly.f_rsub_scalar(1.0)?.f_mul(&mask.f_select(1, cb)?)?)?;
        Ok(GroundTruth {
            pseudo_beta: pseudo_beta(&aatype, &positions)?,
            pseudo_beta_mask,
            chi_angles_sin_cos: sin_cos.f_narrow(-2, 3, 4)?,
            chi_mask: torsion_mask.f_narrow(-1, 3, 4)?,
            atom14_atom_is_ambiguous: per_residue(&tables.atom14_is_ambiguous)?,
            aatype,
            all_atom_positions: positions,
            all_atom_mask: mask,
            atom14_atom_exists: exists,
            atom14_gt_positions: gt_positions,
            atom14_gt_exists: gt_exists,
            atom14_alt_gt_positions: alt_positions,
            atom14_alt_gt_exists: alt_exists,
            rigidgroups_gt_frames: frames,
            rigidgroups_alt_gt_frames: alt_frames,
            rigidgroups_gt_exists: gt_frame_exists,
            rigidgroups_group_exists: group_exists,
            rigidgroups_group_is_ambiguous: ambiguous,
        })
    }

    /// The backbone frames `[N]` (rigid group 0) and their mask `[N]`: 1 where N, CA and C are
    /// resolved (AlphaFold's `backbone_affine_tensor` and `backbone_affine_mask`).
    pub fn backbone(&self) -> Result<(Rigid, Tensor)> {
        let f = &self.rigidgroups_gt_frames;
        let frames = Rigid { rot: f.rot.f_select(1, 0)?, trans: f.trans.f_select(1, 0)? };
        Ok((frames, self.rigidgroups_gt_exists.f_select(1, 0)?))
    }
}

/// `points` [N, A, 3] at per-residue atom indices `idx` [N, K] → [N, K, 3].
fn gather_points(points: &Tensor, idx: &Tensor) -> Result<Tensor> {
    let size = idx.size();
    let idx = idx.f_unsqueeze(-1)?.f_expand([size[0], size[1], 3], false)?;
    Ok(points.f_gather(1, &idx, false)?)
}
