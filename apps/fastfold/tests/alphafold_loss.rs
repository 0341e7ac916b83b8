//! AlphaFold's training loss against DeepMind's own code (`fixtures/make_alphafold_loss.py`:
//! the heads' `loss` functions and `jax.grad`, on CPU in fp32, random parameters of small
//! widths, one pass of the whole model on a 12-residue chain whose true structure has
//! symmetric side chains, renamed atoms and missing atoms). Each term's value and the
//! gradient of every parameter are compared, and so are the total loss under the
//! initial-training weights (clamped and unclamped backbone FAPE) and the fine-tuning weights
//! (`fixtures/make_alphafold_violations.py`: `AlphaFoldIteration`'s total).
mod common;

use common::loss::{arrays, assert_gradients, assert_term, forward, RESOLUTION};
use fastfold::loss::{
    head_losses, structure_loss, total_loss, HeadLossConfig, LossInputs, MaskedMsaTarget, StructureLoss,
    StructureLossConfig, TrainingStage,
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

/// The total loss under `stage`'s weights, clamped or not, against AlphaFold's
/// `AlphaFoldIteration` total (`total_loss.npz` under `case/`): the total, every term and
/// violation metric, and every parameter's gradient.
fn check_total_loss(case: &str, stage: TrainingStage, clamped: bool) {
    let want = arrays("total_loss.npz");
    let w = |k: &str| want.get(&format!("{case}/{k}"));
    let (params, features, pass, truth) = forward();
    let (true_msa, bert_mask) = (features.true_msa.get(0), features.bert_mask.get(0));
    let (seq_mask, residue_index) = (features.seq_mask.get(0), features.residue_index.get(0));
    let inputs = LossInputs {
        truth: &truth,
        msa: MaskedMsaTarget { true_msa: &true_msa, bert_mask: &bert_mask },
        seq_mask: &seq_mask,
        residue_index: &residue_index,
        resolution: RESOLUTION,
        clamped,
    };
    let cfg = stage.loss();
    let l = total_loss(&pass, &inputs, &cfg).unwrap();
    let (h, s, m) = (&l.heads, &l.structure_terms, &l.violation_metrics);
    let terms = [
        ("loss", Some(&l.total)),
        ("structure_module/loss", Some(&l.structure)),
        ("structure_module/fape", Some(&s.fape)),
        ("structure_module/sidechain_fape", Some(&s.sidechain_fape)),
        ("structure_module/chi_loss", Some(&s.chi_loss)),
        ("structure_module/angle_norm_loss", Some(&s.angle_norm_loss)),
        ("structure_module/violations_extreme_ca_ca_distance", Some(&m.extreme_ca_ca_distance)),
        ("structure_module/violations_between_residue_bond", Some(&m.between_residue_bond)),
        ("structure_module/violations_within_residue", Some(&m.within_residue)),
        ("structure_module/violations_per_residue", Some(&m.per_residue)),
        ("distogram/loss", Some(&h.distogram)),
        ("masked_msa/loss", Some(&h.masked_msa)),
        ("predicted_lddt/loss", Some(&h.plddt)),
        ("experimentally_resolved/loss", Some(&h.experimentally_resolved)),
        ("predicted_aligned_error/loss", h.aligned_error.as_ref()),
    ];
    for (what, got) in terms {
        let got = got.expect("the fixture's parameters have every head");
        match w(what) {
            Some(want) => assert_term(&format!("{case}: {what}"), got, want),
            // AlphaFold builds no head of weight 0: the initial-training terms it leaves out.
            None => {
                assert!(what.starts_with("experimentally") || what.starts_with("predicted_aligned"), "{case}: {what}")
            }
        }
    }
    let weighted = |term: &str, weight: f64| assert_eq!(w(term).is_some(), weight > 0.0, "{case}: {term}");
    weighted("experimentally_resolved/loss", cfg.heads.experimentally_resolved);
    weighted("predicted_aligned_error/loss", cfg.heads.aligned_error);
    l.total.backward();
    assert_gradients(&format!("{case}: total loss"), &params, w("grad").unwrap());
}

#[test]
fn clamped_initial_training_loss_and_gradients_equal_alphafold() {
    check_total_loss("initial_clamped", TrainingStage::InitialTraining, true);
}

#[test]
fn unclamped_initial_training_loss_and_gradients_equal_alphafold() {
    check_total_loss("initial_unclamped", TrainingStage::InitialTraining, false);
}

#[test]
fn finetuning_loss_and_gradients_equal_alphafold() {
    // Violations, experimentally resolved and aligned error weighed in.
    check_total_loss("finetuning", TrainingStage::Finetuning, true);
    let want = arrays("total_loss.npz");
    let structure = |case: &str| want[&format!("{case}/structure_module/loss")].double_value(&[]);
    assert!(structure("finetuning") > structure("initial_clamped") * 2.0, "the violations count in fine-tuning");
}
