//! AlphaFold's training loss against DeepMind's own code (`fixtures/make_alphafold_loss.py`:
//! the heads' `loss` functions and `jax.grad`, on CPU in fp32, random parameters of small
//! widths, one pass of the whole model on a 12-residue chain whose true structure has
//! symmetric side chains, renamed atoms and missing atoms). Each term's value and the
//! gradient of every parameter are compared.
mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use fastfold::features::Features;
use fastfold::ground_truth::GroundTruth;
use fastfold::loss::{
    head_losses, structure_loss, HeadLossConfig, MaskedMsaTarget, StructureLoss, StructureLossConfig,
};
use fastfold::model::alphafold::{AlphaFold, Pass};
use fastfold::model::{Exec, Params};
use tch::{Device, Kind, Tensor};

/// Largest allowed relative difference of a loss term from AlphaFold's: both sides compute in
/// fp32, summing in different orders through the whole network.
const VALUE_TOLERANCE: f64 = 1e-4;

/// Largest allowed difference of a parameter's gradient from AlphaFold's, relative to the
/// largest magnitude of that parameter's gradient: backward sums in yet other orders.
const GRAD_TOLERANCE: f64 = 1e-3;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/alphafold_loss").join(name)
}

fn arrays(name: &str) -> HashMap<String, Tensor> {
    Tensor::read_npz(fixture(name)).unwrap().into_iter().collect()
}

/// The fixture's parameters (requiring gradients), features, the model's pass on them and
/// the ground truth.
fn forward() -> (Params, Features, Pass, GroundTruth) {
    let params = Params::load_model(fixture("params.npz")).unwrap().to_device(Device::Cpu, true).unwrap();
    let features = Features::load_npz(&fixture("features.npz"), Device::Cpu).unwrap();
    let model = AlphaFold::new(&params).unwrap();
    let pass = model.predict(&features, 0, Kind::Float, &Exec::serial()).unwrap();
    let t = arrays("truth.npz");
    let truth = GroundTruth::new(&t["aatype"], &t["all_atom_positions"], &t["all_atom_mask"]).unwrap();
    (params, features, pass, truth)
}

/// The resolution the fixture's batch gives (Å), inside the confidence heads' range.
const RESOLUTION: f64 = 2.0;

/// Fails unless the scalar `got` is within [`VALUE_TOLERANCE`] of `want`, relatively.
fn assert_term(what: &str, got: &Tensor, want: &Tensor) {
    let (got, want) = (got.double_value(&[]), want.double_value(&[]));
    let rel = (got - want).abs() / want.abs();
    eprintln!("{what}: ours {got:.7}, AlphaFold {want:.7}, relative difference {rel:.1e}");
    assert!(rel <= VALUE_TOLERANCE, "{what}: ours {got}, AlphaFold {want} (relative {rel:.2e})");
}

/// Parameters whose gradient is zero in exact arithmetic: each adds the same amount to every
/// logit of a softmax row (a bias on the attention logits per head), which the softmax cancels.
/// Both sides give rounding noise there, which no relative bound fits.
const SOFTMAX_SHIFTS: [&str; 2] =
    ["msa_row_attention_with_pair_bias/feat_2d_norm//offset", "invariant_point_attention/attention_2d//bias"];

/// Every parameter's gradient against AlphaFold's (`want`: all of them, flattened in key
/// order): each within [`GRAD_TOLERANCE`] of that parameter's largest AlphaFold gradient, and
/// the [`SOFTMAX_SHIFTS`] below 1e-6 of the largest gradient of any parameter on both sides.
/// A parameter the loss does not reach has no gradient here and a zero one there.
fn assert_gradients(what: &str, params: &Params, want: &Tensor) {
    let largest = want.abs().max().double_value(&[]);
    let mut offset = 0;
    let (mut worst, mut worst_key, mut compared) = (0.0f64, String::new(), 0);
    for (key, p) in params.iter() {
        let n = p.numel() as i64;
        let theirs = want.narrow(0, offset, n).view(p.size().as_slice()).to_kind(Kind::Double);
        offset += n;
        let g = p.grad();
        let ours = if g.defined() { g.to_kind(Kind::Double) } else { theirs.zeros_like() };
        let scale = theirs.abs().max().double_value(&[]);
        let diff = (&ours - &theirs).abs().max().double_value(&[]);
        if SOFTMAX_SHIFTS.iter().any(|s| key.ends_with(s)) {
            let ours_max = ours.abs().max().double_value(&[]);
            assert!(scale.max(ours_max) < 1e-6 * largest, "{what}: {key}: {ours_max:.2e} and {scale:.2e}, not ~0");
            continue;
        }
        if scale == 0.0 {
            assert_eq!(diff, 0.0, "{what}: {key}: AlphaFold's gradient is 0, ours is not");
            continue;
        }
        compared += 1;
        let rel = diff / scale;
        if rel > worst {
            (worst, worst_key) = (rel, key.to_string());
        }
        assert!(rel <= GRAD_TOLERANCE, "{what}: {key}: max |ours - AlphaFold| = {diff:.3e}, largest {scale:.3e}");
    }
    assert_eq!(offset, want.size()[0], "{what}: the fixture's gradient has another number of values");
    eprintln!("{what}: {compared} nonzero parameter gradients, worst relative difference {worst:.1e} ({worst_key})");
    assert!(compared > 100, "{what}: only {compared} parameters have a gradient");
}

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
