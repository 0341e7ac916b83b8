//! AlphaFold-Multimer's template MSA rows (`template_embedding_1d` in `modules_multimer.py`):
//! per template residue the one-hot of its type (22), `sin` and `cos` of its four chi angles
//! times their masks, and the masks (34 channels), through `template_single_embedding`, ReLU
//! and `template_projection` (under `alphafold/alphafold_iteration/evoformer`, the monomer's
//! names with other widths); the rows' mask is the first chi's. The monomer's rows use all
//! seven torsions and their alternatives ([`crate::model::templates`]); Multimer's only the
//! chis, computed as `all_atom_multimer.compute_chi_angles` does ([`chi_angles`]).
use std::path::Path;

use tch::{Kind, Tensor};

use crate::model::embedders::shape_error;
use crate::model::keys::EMBEDDINGS;
use crate::model::layers::Linear;
use crate::model::multimer::templates::{TemplateBatch, TEMPLATE_CLASSES};
use crate::model::multimer::Arrays;
use crate::model::scope::Builder;
use crate::model::Result;
use crate::residue_constants::Tables;

/// Channels of the rows' features: residue one-hot, chi sines, cosines and masks.
pub const ROW_FEATURES: i64 = TEMPLATE_CLASSES + 3 * 4;
/// `Vec3Array.norm`'s clipping.
const NORM_EPSILON: f64 = 1e-6;

/// The four chi angles [.., N, 4] (radians) and their masks [.., N, 4] of residues `aatype`
/// [.., N] (classes 0-21; the gap, 21, takes `UNK`'s row, as AlphaFold's clipping gather
/// does) with atom37 `positions` [.., N, 37, 3] and `mask` [.., N, 37]: AlphaFold's
/// `dihedral_angle` (`atan2((c2 × c1) · v2, |v2| c1 · c2)`, `c1 = v1 × v2`, `c2 = v3 × v2`)
/// of each chi's four atoms; a chi is masked when its residue type lacks it or an atom is
/// absent.
pub fn chi_angles(aatype: &Tensor, positions: &Tensor, mask: &Tensor) -> Result<(Tensor, Tensor)> {
    let lead = aatype.size();
    let want = |tail: &[i64]| lead.iter().chain(tail).copied().collect::<Vec<i64>>();
    if positions.size() != want(&[37, 3]) {
        return Err(shape_error("template_all_atom_positions", format!("{:?}", want(&[37, 3])), positions.size()));
    }
    if mask.size() != want(&[37]) {
        return Err(shape_error("template_all_atom_mask", format!("{:?}", want(&[37])), mask.size()));
    }
    let kind = positions.kind();
    let tables = Tables::new(positions.device());
    let restype = aatype.f_to_kind(Kind::Int64)?.f_clamp(0, 20)?.f_flatten(0, -1)?;
    let residues = restype.size()[0];
    let indices = tables.chi_angles_atom_indices.f_to_kind(Kind::Int64)?.f_index_select(0, &restype)?; // [R, 4, 4]
    let flat = indices.f_reshape([residues, 16])?;
    let pos = positions.f_reshape([residues, 37, 3])?;
    let atoms = pos.f_gather(1, &flat.f_unsqueeze(-1)?.f_expand([residues, 16, 3], false)?, false)?;
    let atoms = atoms.f_reshape([residues, 4, 4, 3])?;
    let atom = |i: i64| atoms.f_select(2, i);
    let (a, b, c, d) = (atom(0)?, atom(1)?, atom(2)?, atom(3)?);
    let (v1, v2, v3) = (a.f_sub(&b)?, b.f_sub(&c)?, d.f_sub(&c)?);
    let (c1, c2) = (cross(&v1, &v2)?, cross(&v3, &v2)?);
    let c3 = cross(&c2, &c1)?;
    let v2_mag = dot(&v2, &v2)?.f_clamp_min(NORM_EPSILON * NORM_EPSILON)?.f_sqrt()?;
    let angles = dot(&c3, &v2)?.f_atan2(&v2_mag.f_mul(&dot(&c1, &c2)?)?)?;
    let atom_mask = mask.f_to_kind(kind)?.f_reshape([residues, 37])?.f_gather(1, &flat, false)?;
    let atom_mask = atom_mask.f_reshape([residues, 4, 4])?.f_prod_dim_int(-1, false, kind)?;
    let chi_mask = tables.chi_angles_mask.f_to_kind(kind)?.f_index_select(0, &restype)?.f_mul(&atom_mask)?;
    Ok((angles.f_reshape(want(&[4]))?, chi_mask.f_reshape(want(&[4]))?))
}

/// `a · b` over the last dimension (of 3), as `Vec3Array.dot`.
fn dot(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let term = |i: i64| -> Result<Tensor> { Ok(a.f_select(-1, i)?.f_mul(&b.f_select(-1, i)?)?) };
    Ok(term(0)?.f_add(&term(1)?)?.f_add(&term(2)?)?)
}

/// `a × b` over the last dimension (of 3), as `Vec3Array.cross`.
fn cross(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let (ax, ay, az) = (a.f_select(-1, 0)?, a.f_select(-1, 1)?, a.f_select(-1, 2)?);
    let (bx, by, bz) = (b.f_select(-1, 0)?, b.f_select(-1, 1)?, b.f_select(-1, 2)?);
    let x = ay.f_mul(&bz)?.f_sub(&az.f_mul(&by)?)?;
    let y = az.f_mul(&bx)?.f_sub(&ax.f_mul(&bz)?)?;
    let z = ax.f_mul(&by)?.f_sub(&ay.f_mul(&bx)?)?;
    Ok(Tensor::f_stack(&[x, y, z], -1)?)
}

/// The templates' MSA rows (see the module docs).
pub struct MultimerTemplateRows {
    template_single_embedding: Linear,
    template_projection: Linear,
}

impl MultimerTemplateRows {
    /// The rows' layers over the arrays of an AlphaFold-Multimer parameter file, the MSA width
    /// read from `template_projection`; a missing or mis-shaped array is an error naming the
    /// key and the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let arrays = Arrays::open(path.as_ref())?;
        Self::from_arrays(&arrays, &arrays.shared_builder())
    }

    /// The layers built by `b` over `arrays`, the MSA width read from their shapes.
    pub(super) fn from_arrays(arrays: &Arrays, b: &Builder) -> Result<Self> {
        let c_m = arrays.size(&format!("{EMBEDDINGS}/template_projection//weights"), 2, 1)?;
        Self::build(b, c_m)
    }

    /// Builds (or, with an initialising builder, creates the arrays of) the layers for MSA
    /// width `c_m`.
    pub(crate) fn build(b: &Builder, c_m: i64) -> Result<Self> {
        let p = b.root(EMBEDDINGS);
        Ok(MultimerTemplateRows {
            template_single_embedding: Linear::new(&p.sub("template_single_embedding"), ROW_FEATURES, c_m, true)?,
            template_projection: Linear::new(&p.sub("template_projection"), c_m, c_m, true)?,
        })
    }

    /// The rows [T, N, c_m] and their mask [T, N] of `templates`, computed in `kind`.
    pub fn forward(&self, templates: &TemplateBatch, kind: Kind) -> Result<(Tensor, Tensor)> {
        let size = templates.aatype.size();
        if size.len() != 2 {
            return Err(shape_error("template_aatype", "[templates, residues]".into(), size));
        }
        let positions = templates.positions.f_to_kind(kind)?;
        let (angles, mask) = chi_angles(templates.aatype, &positions, templates.mask)?;
        let classes = templates.aatype.f_to_kind(Kind::Int64)?;
        let features = Tensor::f_cat(
            &[
                classes.f_one_hot(TEMPLATE_CLASSES)?.f_to_kind(kind)?,
                angles.f_sin()?.f_mul(&mask)?,
                angles.f_cos()?.f_mul(&mask)?,
                mask.shallow_clone(),
            ],
            -1,
        )?;
        let hidden = self.template_single_embedding.forward(&features)?.f_relu()?;
        Ok((self.template_projection.forward(&hidden)?, mask.f_select(-1, 0)?))
    }
}
