//! What the AlphaFold loss parity tests (`alphafold_loss.rs`, `violations.rs`) share: the
//! fixture of `fixtures/make_alphafold_loss.py` (parameters, features, the true structure),
//! the model's pass on it, and the comparison of a term and of every parameter's gradient with
//! DeepMind's.
use std::collections::HashMap;
use std::path::PathBuf;

use fastfold::features::Features;
use fastfold::ground_truth::GroundTruth;
use fastfold::model::alphafold::{AlphaFold, Pass};
use fastfold::model::{Exec, Params};
use tch::{Device, Kind, Tensor};

/// Largest allowed relative difference of a loss term from AlphaFold's: both sides compute in
/// fp32, summing in different orders through the whole network.
pub const VALUE_TOLERANCE: f64 = 1e-4;

/// Largest allowed difference of a parameter's gradient from AlphaFold's, relative to the
/// largest magnitude of that parameter's gradient: backward sums in yet other orders.
pub const GRAD_TOLERANCE: f64 = 1e-3;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/alphafold_loss").join(name)
}

pub fn arrays(name: &str) -> HashMap<String, Tensor> {
    Tensor::read_npz(fixture(name)).unwrap().into_iter().collect()
}

/// The fixture's parameters (requiring gradients), features, the model's pass on them and
/// the ground truth.
pub fn forward() -> (Params, Features, Pass, GroundTruth) {
    let params = Params::load_model(fixture("params.npz")).unwrap().to_device(Device::Cpu, true).unwrap();
    let features = Features::load_npz(&fixture("features.npz"), Device::Cpu).unwrap();
    let model = AlphaFold::new(&params).unwrap();
    let pass = model.predict(&features, 0, Kind::Float, &Exec::serial(), None).unwrap();
    let t = arrays("truth.npz");
    let truth = GroundTruth::new(&t["aatype"], &t["all_atom_positions"], &t["all_atom_mask"]).unwrap();
    (params, features, pass, truth)
}

/// The resolution the fixture's batch gives (Å), inside the confidence heads' range.
pub const RESOLUTION: f64 = 2.0;

/// Fails unless the scalar `got` is within [`VALUE_TOLERANCE`] of `want`, relatively.
pub fn assert_term(what: &str, got: &Tensor, want: &Tensor) {
    let (got, want) = (got.double_value(&[]), want.double_value(&[]));
    let rel = (got - want).abs() / want.abs();
    eprintln!("{what}: ours {got:.7}, AlphaFold {want:.7}, relative difference {rel:.1e}");
    assert!(rel <= VALUE_TOLERANCE, "{what}: ours {got}, AlphaFold {want} (relative {rel:.2e})");
}

/// Parameters whose gradient is zero in exact arithmetic: each adds the same amount to every
/// logit of a softmax row (a bias on the attention logits per head), which the softmax cancels.
/// Both sides give rounding noise there, which no relative bound fits.
pub const SOFTMAX_SHIFTS: [&str; 2] =
    ["msa_row_attention_with_pair_bias/feat_2d_norm//offset", "invariant_point_attention/attention_2d//bias"];

/// Every parameter's gradient against AlphaFold's (`want`: all of them, flattened in key
/// order): each within [`GRAD_TOLERANCE`] of that parameter's largest AlphaFold gradient, and
/// the [`SOFTMAX_SHIFTS`] below 1e-6 of the largest gradient of any parameter on both sides.
/// A parameter the loss does not reach has no gradient here and a zero one there.
pub fn assert_gradients(what: &str, params: &Params, want: &Tensor) {
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
