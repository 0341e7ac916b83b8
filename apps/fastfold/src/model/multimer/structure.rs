//! AlphaFold-Multimer's structure module (`folding_multimer.py`) under its parameter names:
//! the monomer's module ([`crate::model::structure`], [`Variant::Multimer`]) with the
//! invariant point attention's projections stored per head (`q_scalar_projection`,
//! `k_scalar_projection`, `v_scalar_projection` without biases, `{q,k,v}_point_projection/
//! point_projection`), the backbone update `quat_rigid/rigid` composed onto the frames as
//! rotation matrices, the padding residues' atom37 positions and mask zeroed, and 20 Å per
//! internal unit (`position_scale`, 10 in the monomer).
use std::path::Path;

use crate::model::config::StructureConfig;
use crate::model::keys::STRUCTURE_MODULE;
use crate::model::multimer::Arrays;
use crate::model::scope::Builder;
use crate::model::structure::{StructureModule, Variant};
use crate::model::{ensure, Result};

/// Å per internal unit of Multimer's structure module (its config's `position_scale`).
pub const MULTIMER_POSITION_SCALE: f64 = 20.0;

/// Iterations of Multimer's structure module (its config's `num_layer`, the same in every
/// released model; one shared set of weights, so the arrays cannot show it).
pub const MULTIMER_STRUCTURE_ITERATIONS: i64 = 8;

/// Multimer's structure module over the arrays of `path` (`.npz` or `.safetensors`, under
/// `alphafold/alphafold_iteration/structure_module`), widths read from the arrays, running
/// `iterations` fold iterations (8 in every Multimer model; the arrays cannot show it).
pub fn load_structure_module(path: impl AsRef<Path>, iterations: i64) -> Result<StructureModule> {
    let arrays = Arrays::open(path.as_ref())?;
    structure_module(&arrays, &arrays.shared_builder(), iterations)
}

/// Multimer's structure module built by `b` over `arrays`, widths read from their shapes.
pub(super) fn structure_module(arrays: &Arrays, b: &Builder, iterations: i64) -> Result<StructureModule> {
    ensure!(iterations >= 1, "the structure module needs at least 1 iteration, not {iterations}");
    let ipa = format!("{STRUCTURE_MODULE}/fold_iteration/invariant_point_attention");
    let heads = arrays.size(&format!("{ipa}//trainable_point_weights"), 1, 0)?;
    let points =
        |name: &str| -> Result<i64> { Ok(arrays.size(&format!("{ipa}/{name}/point_projection//weights"), 3, 2)? / 3) };
    let c = StructureConfig {
        c_s: arrays.size(&format!("{STRUCTURE_MODULE}/initial_projection//weights"), 2, 1)?,
        c_z: arrays.size(&format!("{STRUCTURE_MODULE}/pair_layer_norm//scale"), 1, 0)?,
        heads,
        c_ipa: arrays.size(&format!("{ipa}/q_scalar_projection//weights"), 3, 2)?,
        qk_points: points("q_point_projection")?,
        v_points: points("v_point_projection")?,
        layers: iterations,
        c_resnet: arrays.size(
            &format!("{STRUCTURE_MODULE}/fold_iteration/rigid_sidechain/input_projection//weights"),
            2,
            1,
        )?,
        position_scale: MULTIMER_POSITION_SCALE,
    };
    StructureModule::build(b, &c, Variant::Multimer)
}
