//! AlphaFold's structural-violation checks against DeepMind's own code
//! (`fixtures/make_alphafold_violations.py`): the stereo-chemical table and the within-residue
//! bounds made from it (`load_stereo_chemical_props` reading the package's
//! `stereo_chemical_props.txt`, `make_atom14_dists_bounds`), and `find_structural_violations`,
//! `compute_violation_metrics` and the violation loss with its gradient, on the fixture
//! network's prediction (the gradient of every parameter) and on perturbed positions of
//! another sequence with cysteines, prolines, an unknown residue and a gap in the numbering
//! (the gradient of the positions).
mod common;

use std::collections::HashMap;

use common::loss::{arrays, assert_gradients, assert_term, forward, GRAD_TOLERANCE};
use fastfold::loss::{find_structural_violations, ViolationConfig, Violations};
use fastfold::residue_constants::bounds::{atom14_dists_bounds, bond_angles, bonds, virtual_bonds, Bond};
use fastfold::residue_constants::{RESTYPE_NAME_TO_ATOM14_NAMES, RESTYPE_NUM};
use tch::{Kind, Tensor};

/// Largest allowed difference of an array from AlphaFold's, relative to its largest
/// magnitude (at least 1): the same fp32 arithmetic, summed in other orders.
const ARRAY_TOLERANCE: f64 = 1e-5;

/// Every residue type's entries of one table as (residue type, atom14 slots, two values).
fn rows<T>(
    entries: impl Fn(usize) -> Vec<T>,
    atoms: impl Fn(&T) -> Vec<&'static str>,
    values: impl Fn(&T) -> [f64; 2],
) -> Vec<(i64, Vec<i64>, [f64; 2])> {
    let mut out = Vec::new();
    for (r, names) in RESTYPE_NAME_TO_ATOM14_NAMES.iter().take(RESTYPE_NUM).enumerate() {
        let slot = |name: &str| names.iter().position(|&n| n == name).unwrap() as i64;
        for e in entries(r) {
            out.push((r as i64, atoms(&e).into_iter().map(slot).collect(), values(&e)));
        }
    }
    out
}

/// `rows` against the fixture's `<prefix>_residue`, `_atoms` and `_values`: the same entries
/// in the same order, values within 1e-12 (both f64 from the same decimal text).
fn assert_table(prefix: &str, ours: &[(i64, Vec<i64>, [f64; 2])], want: &HashMap<String, Tensor>) {
    let residue = Vec::<i64>::try_from(&want[&format!("{prefix}_residue")]).unwrap();
    let atoms = &want[&format!("{prefix}_atoms")];
    let values = &want[&format!("{prefix}_values")];
    assert_eq!(ours.len(), residue.len(), "{prefix}: number of entries");
    for (i, (r, slots, v)) in ours.iter().enumerate() {
        let theirs: Vec<i64> = Vec::try_from(atoms.get(i as i64)).unwrap();
        assert_eq!((*r, slots), (residue[i], &theirs), "{prefix} {i}: residue type and atoms");
        for (k, x) in v.iter().enumerate() {
            let y = values.double_value(&[i as i64, k as i64]);
            assert!((x - y).abs() <= 1e-12, "{prefix} {i} ({r}, {slots:?}): value {k} is {x}, AlphaFold's {y}");
        }
    }
}

#[test]
fn stereo_chemical_table_and_bounds_equal_alphafold() {
    let want = arrays("stereo_chemistry.npz");
    let bond = |b: &Bond| b.atoms.to_vec();
    let values = |b: &Bond| [b.length, b.stddev];
    assert_table("bond", &rows(bonds, bond, values), &want);
    assert_table("virtual_bond", &rows(virtual_bonds, bond, values), &want);
    assert_table("angle", &rows(bond_angles, |a| a.atoms.to_vec(), |a| [a.angle, a.stddev]), &want);
    let cfg = ViolationConfig::default();
    let bounds = atom14_dists_bounds(cfg.clash_overlap_tolerance, cfg.violation_tolerance_factor);
    for (name, table) in [("lower_bound", &bounds.lower), ("upper_bound", &bounds.upper), ("stddev", &bounds.stddev)] {
        let flat: Vec<f32> = table.iter().flatten().flatten().copied().collect();
        let ours = Tensor::from_slice(&flat).view([21, 14, 14]);
        // The upper bounds of non-bonded pairs are 1e10, the scale of the comparison.
        common::assert_close(name, &ours, &want[name], 1e-7);
        let bonded = want[name].ne(0.0).logical_and(&want[name].lt(1e9));
        common::assert_close(
            &format!("{name} (bonded pairs)"),
            &ours.masked_select(&bonded),
            &want[name].masked_select(&bonded),
            1e-6,
        );
    }
}

/// Every array of `find_structural_violations` and `compute_violation_metrics` and the loss
/// against the fixture's under `case/`.
fn assert_violations(
    case: &str,
    v: &Violations,
    positions: &Tensor,
    residue_index: &Tensor,
    want: &HashMap<String, Tensor>,
) {
    let w = |k: &str| &want[&format!("{case}/{k}")];
    let arrays: [(&str, &Tensor); 7] = [
        ("connections_per_residue_loss_sum", &v.bonds.per_residue_loss_sum),
        ("connections_per_residue_violation_mask", &v.bonds.per_residue_violation_mask),
        ("clashes_per_atom_loss_sum", &v.clashes.per_atom_loss_sum),
        ("clashes_per_atom_clash_mask", &v.clashes.per_atom_clash_mask),
        ("per_atom_loss_sum", &v.within.per_atom_loss_sum),
        ("per_atom_violations", &v.within.per_atom_violations),
        ("total_per_residue_violations_mask", &v.per_residue_violations_mask),
    ];
    for (name, got) in arrays {
        // Masks exactly; losses within fp32 summation noise.
        let tolerance = if name.contains("mask") || name.contains("violations") { 0.0 } else { ARRAY_TOLERANCE };
        common::assert_close(&format!("{case}: {name}"), got, w(name), tolerance);
    }
    let seq_mask = v.atom14_atom_exists.ones_like().select(1, 0);
    let m = v.metrics(positions, residue_index, &seq_mask).unwrap();
    let scalars = [
        ("bonds_c_n_loss_mean", &v.bonds.c_n_loss_mean),
        ("angles_ca_c_n_loss_mean", &v.bonds.ca_c_n_loss_mean),
        ("angles_c_n_ca_loss_mean", &v.bonds.c_n_ca_loss_mean),
        ("violations_extreme_ca_ca_distance", &m.extreme_ca_ca_distance),
        ("violations_between_residue_bond", &m.between_residue_bond),
        ("violations_within_residue", &m.within_residue),
        ("violations_per_residue", &m.per_residue),
    ];
    for (name, got) in scalars {
        assert_term(&format!("{case}: {name}"), got, w(name));
    }
    // The clash terms are zero in the model's case (its residues are far apart): compared
    // absolutely there.
    for (name, got) in
        [("clashes_mean_loss", &v.clashes.mean_loss), ("violations_between_residue_clash", &m.between_residue_clash)]
    {
        match w(name).double_value(&[]) {
            0.0 => common::assert_close(&format!("{case}: {name}"), got, w(name), ARRAY_TOLERANCE),
            _ => assert_term(&format!("{case}: {name}"), got, w(name)),
        }
    }
    assert_term(&format!("{case}: loss"), &v.loss().unwrap(), w("loss"));
}

#[test]
fn violations_of_perturbed_positions_and_their_gradient_equal_alphafold() {
    let want = arrays("violations.npz");
    let w = |k: &str| &want[&format!("synthetic/{k}")];
    let positions = w("positions").set_requires_grad(true);
    let (aatype, residue_index) = (w("aatype"), w("residue_index"));
    let v = find_structural_violations(&positions, aatype, residue_index, None, &ViolationConfig::default()).unwrap();
    assert_violations("synthetic", &v, &positions, residue_index, &want);
    v.loss().unwrap().backward();
    let (ours, theirs) = (positions.grad(), w("grad_positions"));
    let scale = theirs.abs().max().double_value(&[]);
    let diff = (&ours - theirs).abs().max().double_value(&[]);
    eprintln!("synthetic: positions' gradient: max difference {diff:.2e}, largest {scale:.2e}");
    assert!(diff <= GRAD_TOLERANCE * scale, "positions' gradient differs by {diff:.3e} (largest {scale:.3e})");
    // What the case covers: clashes, stretched Cα pairs, and residues without a bond
    // violation (the unknown residue 9, which has no atoms).
    assert!(w("clashes_mean_loss").double_value(&[]) > 0.0);
    assert!(w("violations_extreme_ca_ca_distance").double_value(&[]) > 0.0);
    assert_eq!(w("connections_per_residue_violation_mask").double_value(&[9]), 0.0);
}

#[test]
fn violations_of_the_prediction_and_every_parameter_gradient_equal_alphafold() {
    let want = arrays("violations.npz");
    let (params, features, pass, _) = forward();
    let (aatype, residue_index) = (features.aatype.get(0), features.residue_index.get(0));
    let positions = &pass.structure.atom14;
    let v = find_structural_violations(positions, &aatype, &residue_index, None, &ViolationConfig::default()).unwrap();
    assert_violations("model", &v, positions, &residue_index, &want);
    // The checks are of the residue types' atoms, resolved in the truth or not.
    common::assert_close("atom14_atom_exists", &v.atom14_atom_exists, &features.atom14_atom_exists.get(0), 0.0);
    v.loss().unwrap().backward();
    assert_gradients("violation loss", &params, &want["model/grad"]);
    assert!(
        v.within.per_atom_loss_sum.sum(Kind::Float).double_value(&[]) > 0.0,
        "the case has a within-residue violation"
    );
}
