//! AlphaFold's training loss against DeepMind's own code (`fixtures/make_alphafold_loss.py`:
//! the heads' `loss` functions and `jax.grad`, on CPU in fp32, random parameters of small
//! widths, one pass of the whole model on a 12-residue chain whose true structure has
//! symmetric side chains, renamed atoms and missing atoms). Each term's value and the
//! gradient of every parameter are compared.
mod common;

use common::loss::{arrays, assert_gradients, assert_term, forward, RESOLUTION};
use fastfold::loss::{
    head_losses, structure_loss, HeadLossConfig, MaskedMsaTarget, StructureLoss, StructureLossConfig,
};

fn check_structure_loss(name: &str, clamped: bool) {
    let want = arrays("structure_loss.npz");
    let w = |k: &str| &want[&format!("{name}/{k}")];
    let (params, features, pass, truth) = forward();
    let seq_mask = features.seq_mask.get(0);
    let l: StructureLoss =
        structure_loss(&pass.structure, &truth, &seq_mask, clamped, &StructureLossConfig::default()).unwrap();
    common::assert_close(
        &format!("{name}: alt_naming_is_better"),
        &l.alt_naming_is_better,
        w("alt_naming_is_better"),
        0.0,
    );
    for (what, got) in [
        ("fape", &l.fape),
        ("backbone_fape", &l.backbone_fape),
        ("sidechain_fape", &l.sidechain_fape),
        ("chi_loss", &l.chi_loss),
        ("angle_norm_loss", &l.angle_norm_loss),
        ("loss", &l.loss),
    ] {
        assert_term(&format!("{name}: {what}"), got, w(what));
    }
    l.loss.backward();
    assert_gradients(&format!("{name}: structure-module loss"), &params, w("grad"));
}

#[test]
fn clamped_structure_loss_and_gradients_equal_alphafold() {
    check_structure_loss("clamped", true);
}

#[test]
fn unclamped_structure_loss_and_gradients_equal_alphafold() {
    check_structure_loss("unclamped", false);
}

#[test]
fn head_losses_and_gradients_equal_alphafold() {
    let want = arrays("head_losses.npz");
    let (params, features, pass, truth) = forward();
    let (true_msa, bert_mask) = (features.true_msa.get(0), features.bert_mask.get(0));
    let msa = MaskedMsaTarget { true_msa: &true_msa, bert_mask: &bert_mask };
    let cfg = HeadLossConfig::default();
    let l = head_losses(&pass.heads, &pass.structure, &msa, &truth, RESOLUTION, &cfg).unwrap();
    let pae = l.aligned_error.as_ref().expect("the fixture's parameters have the aligned-error head");
    for (what, got) in [
        ("distogram", &l.distogram),
        ("masked_msa", &l.masked_msa),
        ("predicted_lddt", &l.plddt),
        ("experimentally_resolved", &l.experimentally_resolved),
        ("predicted_aligned_error", pae),
    ] {
        assert_term(&format!("{what}/loss"), got, &want[&format!("{what}/loss")]);
    }
    assert_term("weighted sum", &l.loss, &want["loss"]);
    l.loss.backward();
    assert_gradients("heads' loss", &params, &want["grad"]);
}

#[test]
fn the_fixture_renames_swapped_side_chains_and_clamps() {
    // What the parity rests on: AlphaFold renamed the side chains whose atoms the fixture
    // swapped (GLU 3, TYR 6), and the clamp changes backbone FAPE.
    let want = arrays("structure_loss.npz");
    let alt = &want["clamped/alt_naming_is_better"];
    assert_eq!((alt.double_value(&[3]), alt.double_value(&[6])), (1.0, 1.0));
    let (c, u) = (want["clamped/backbone_fape"].double_value(&[]), want["unclamped/backbone_fape"].double_value(&[]));
    assert!(u > c * 1.2, "clamped {c}, unclamped {u}");
}
