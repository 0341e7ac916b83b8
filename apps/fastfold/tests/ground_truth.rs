//! The ground truth of AlphaFold's losses against DeepMind's own functions on the same true
//! structure (`fixtures/make_alphafold_loss.py`: `atom37_to_frames`, `atom37_to_torsion_angles`,
//! `atom37_to_atom14`, the renaming of `get_alt_atom14`, `pseudo_beta_fn`), on a 12-residue
//! chain with ASP, GLU, PHE and TYR side chains (three of them with their ambiguous atoms
//! swapped), glycine, an unknown residue and missing atoms (an O, a lysine's side-chain end,
//! one of PHE's ambiguous atoms, a serine's N, a whole residue).
mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use fastfold::geometry::Rigid;
use fastfold::ground_truth::GroundTruth;
use tch::{Kind, Tensor};

/// Largest allowed difference from AlphaFold, relative to the array's largest magnitude (at
/// least 1): the same fp32 arithmetic in the same order, but coordinates of ~20 Å.
const TOLERANCE: f64 = 1e-5;

fn truth() -> HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/alphafold_loss/truth.npz");
    Tensor::read_npz(path).unwrap().into_iter().collect()
}

/// Frames [N, 8] as AlphaFold's flat 12 (rotation row by row, then translation) [N, 8, 12].
fn flat12(r: &Rigid) -> Tensor {
    let s = r.rot.size();
    Tensor::cat(&[r.rot.reshape([s[0], s[1], 9]), r.trans.shallow_clone()], -1)
}

#[test]
fn ground_truth_equals_alphafold() {
    let t = truth();
    let gt = GroundTruth::new(&t["aatype"], &t["all_atom_positions"], &t["all_atom_mask"]).unwrap();
    let check = |what: &str, got: &Tensor| common::assert_close(what, got, &t[what], TOLERANCE);
    check("atom14_gt_positions", &gt.atom14_gt_positions);
    check("atom14_gt_exists", &gt.atom14_gt_exists);
    check("atom14_alt_gt_positions", &gt.atom14_alt_gt_positions);
    check("atom14_alt_gt_exists", &gt.atom14_alt_gt_exists);
    check("atom14_atom_is_ambiguous", &gt.atom14_atom_is_ambiguous);
    check("rigidgroups_gt_frames", &flat12(&gt.rigidgroups_gt_frames));
    check("rigidgroups_alt_gt_frames", &flat12(&gt.rigidgroups_alt_gt_frames));
    check("rigidgroups_gt_exists", &gt.rigidgroups_gt_exists);
    check("rigidgroups_group_exists", &gt.rigidgroups_group_exists);
    check("rigidgroups_group_is_ambiguous", &gt.rigidgroups_group_is_ambiguous);
    // Undefined angles too (mask 0): the same arithmetic gives the same values.
    check("chi_angles_sin_cos", &gt.chi_angles_sin_cos);
    check("chi_mask", &gt.chi_mask);
    check("pseudo_beta", &gt.pseudo_beta);
    check("pseudo_beta_mask", &gt.pseudo_beta_mask);
    let (_, backbone_mask) = gt.backbone().unwrap();
    check("backbone_affine_mask", &backbone_mask);
}

#[test]
fn the_fixture_covers_missing_and_ambiguous_atoms() {
    // What the parity above rests on: the cases are in the structure, so a formula that
    // ignored a mask or a swap could not agree with AlphaFold by accident.
    let t = truth();
    let gt = GroundTruth::new(&t["aatype"], &t["all_atom_positions"], &t["all_atom_mask"]).unwrap();
    let at = |x: &Tensor, idx: &[i64]| x.double_value(idx);
    // PHE 4 lacks CE1 (atom14 slot 8): under the other naming CE2's slot (9) is the one absent.
    assert_eq!((at(&gt.atom14_gt_exists, &[4, 8]), at(&gt.atom14_gt_exists, &[4, 9])), (0.0, 1.0));
    assert_eq!((at(&gt.atom14_alt_gt_exists, &[4, 8]), at(&gt.atom14_alt_gt_exists, &[4, 9])), (1.0, 0.0));
    // SER 9 lacks N: no backbone frame; TRP 10 is unresolved: nothing; LYS 1 lacks CD: chi1
    // but no chi2.
    let (_, backbone_mask) = gt.backbone().unwrap();
    assert_eq!(at(&backbone_mask, &[9]), 0.0);
    assert_eq!(gt.rigidgroups_gt_exists.get(10).sum(Kind::Float).double_value(&[]), 0.0);
    assert_eq!(at(&gt.pseudo_beta_mask, &[10]), 0.0);
    assert_eq!((at(&gt.chi_mask, &[1, 0]), at(&gt.chi_mask, &[1, 1])), (1.0, 0.0));
    // The alternative frame of ASP 2's chi2 group is its frame turned about x: y and z flip.
    let rot = |r: &Rigid| r.rot.get(2).get(5);
    let (a, b) = (rot(&gt.rigidgroups_gt_frames), rot(&gt.rigidgroups_alt_gt_frames));
    let flip = Tensor::from_slice(&[1f32, -1.0, -1.0]);
    assert!((a * &flip - b).abs().max().double_value(&[]) < 1e-6);
}
