//! AlphaFold-Multimer's in-network MSA sampling and the assembled network against DeepMind's
//! code (`fixtures/multimer_network/make_multimer_model.py`, fp32 on CPU): the rows
//! `sample_msa` picks, `make_masked_msa`'s masked positions and draws and
//! `nearest_neighbor_clusters`' profiles under the same JAX keys; the whole network with
//! recycling, templates and every head on tiny random parameters of Multimer v3's layout.
mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use fastfold::jax_random::Key;
use fastfold::model::multimer::sampling::msa_profile;
use fastfold::model::multimer::{
    network_key, FullMsa, MaskedMsaConfig, MsaSampling, MultimerAlphaFold, MultimerInputs,
};
use fastfold::model::recycling::Recycling;
use fastfold::model::AttentionKernel;
use fastfold::model::Exec;
use tch::{Kind, Tensor};

/// Largest allowed difference of the clusters' profiles and features, relative to the
/// compared array's largest magnitude (at least 1): fp32 sums in other orders.
const TOLERANCE: f64 = 1e-6;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network").join(name)
}

fn arrays(name: &str) -> HashMap<String, Tensor> {
    Tensor::read_npz(fixture(name)).unwrap().into_iter().collect()
}

fn key(t: &Tensor) -> Key {
    let v = Vec::<i64>::try_from(t).unwrap();
    Key([v[0] as u32, v[1] as u32])
}

fn assert_equal(what: &str, got: &Tensor, want: &Tensor) {
    assert_eq!(got.size(), want.size(), "{what}: shape");
    let (got, want) = (got.to_kind(Kind::Double), want.to_kind(Kind::Double));
    let differ = got.ne_tensor(&want).sum(Kind::Int64).int64_value(&[]);
    assert_eq!(differ, 0, "{what}: {differ} entries differ from AlphaFold's");
}

#[test]
fn msa_sampling_draws_what_alphafold_multimer_draws() {
    let f = arrays("msa_sampling.npz");
    for case in ["a", "b", "c"] {
        let g = |k: &str| &f[&format!("{case}_{k}")];
        let full = FullMsa {
            msa: g("msa"),
            deletion_matrix: g("deletion_matrix"),
            msa_mask: g("msa_mask"),
            bert_mask: g("bert_mask"),
            cluster_bias_mask: g("cluster_bias_mask"),
        };
        let profile = msa_profile(g("msa"), g("msa_mask")).unwrap();
        common::assert_close(&format!("{case} msa_profile"), &profile, g("msa_profile"), TOLERANCE);
        let sampling = MsaSampling {
            num_msa: g("num_msa").int64_value(&[]),
            num_extra_msa: g("num_extra_msa").int64_value(&[]),
            masked: MaskedMsaConfig::default(),
        };
        let s = sampling.sample(&full, key(g("sample_key")), key(g("mask_key"))).unwrap();
        // The rows sampled and the masks drawn: exactly AlphaFold's.
        assert_equal(&format!("{case} true_msa"), &s.true_msa, g("sel_msa"));
        assert_equal(&format!("{case} true_msa (returned)"), &s.true_msa, g("true_msa"));
        assert_equal(&format!("{case} deletion_matrix"), &s.deletion_matrix, g("sel_deletion_matrix"));
        assert_equal(&format!("{case} msa_mask"), &s.msa_mask, g("sel_msa_mask"));
        assert_equal(&format!("{case} extra_msa"), &s.extra_msa, g("extra_msa"));
        assert_equal(&format!("{case} extra_deletion_matrix"), &s.extra_deletion_matrix, g("extra_deletion_matrix"));
        assert_equal(&format!("{case} extra_msa_mask"), &s.extra_msa_mask, g("extra_msa_mask"));
        assert_equal(&format!("{case} masked msa"), &s.msa, g("bert_msa"));
        assert_equal(&format!("{case} bert_mask"), &s.bert_mask, g("bert_mask_out"));
        let replaced = s.bert_mask.sum(Kind::Float).double_value(&[]);
        eprintln!("{case}: {replaced} positions masked");
        common::assert_close(&format!("{case} cluster_profile"), &s.cluster_profile, g("cluster_profile"), TOLERANCE);
        common::assert_close(
            &format!("{case} cluster_deletion_mean"),
            &s.cluster_deletion_mean,
            g("cluster_deletion_mean"),
            TOLERANCE,
        );
        common::assert_close(&format!("{case} msa_feat"), &s.msa_feat().unwrap(), g("msa_feat"), TOLERANCE);
        let (feat, mask) = s.extra_msa_feat(sampling.num_extra_msa).unwrap();
        common::assert_close(&format!("{case} extra_msa_feat"), &feat, g("extra_msa_feat"), TOLERANCE);
        assert_equal(&format!("{case} extra_msa_mask (cropped)"), &mask, g("extra_msa_mask_out"));
    }
}

#[test]
fn another_key_samples_other_rows() {
    let f = arrays("msa_sampling.npz");
    let g = |k: &str| &f[&format!("c_{k}")];
    let full = FullMsa {
        msa: g("msa"),
        deletion_matrix: g("deletion_matrix"),
        msa_mask: g("msa_mask"),
        bert_mask: g("bert_mask"),
        cluster_bias_mask: g("cluster_bias_mask"),
    };
    let sampling = MsaSampling { num_msa: 12, num_extra_msa: 16, masked: MaskedMsaConfig::default() };
    let a = sampling.sample(&full, key(g("sample_key")), key(g("mask_key"))).unwrap();
    let b = sampling.sample(&full, Key::from_seed(5), key(g("mask_key"))).unwrap();
    assert!(!a.true_msa.equal(&b.true_msa), "the sample key picks the rows");
    // The rows cluster_bias_mask keeps come first whatever the key; wholly masked rows last.
    for s in [&a, &b] {
        assert!(s.true_msa.get(0).equal(&g("msa").get(0).to_kind(Kind::Int64)));
        assert!(s.true_msa.get(1).equal(&g("msa").get(5).to_kind(Kind::Int64)));
        let e = s.extra_msa_mask.size()[0];
        assert_eq!(s.extra_msa_mask.narrow(0, e - 2, 2).sum(Kind::Float).double_value(&[]), 0.0);
    }
    let e = sampling
        .sample(
            &FullMsa { cluster_bias_mask: &g("cluster_bias_mask").narrow(0, 0, 3), ..full },
            Key::from_seed(1),
            Key::from_seed(2),
        )
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("cluster_bias_mask") && e.contains("[40]"), "{e}");
}

/// The assembled network's tolerances, absolute: final atom positions within 1e-3 Å, logits
/// within 1e-4; fp32 on both sides, summed in other orders through 2-3 passes of random
/// parameters.
const POSITIONS_TOLERANCE: f64 = 1e-3;
const LOGITS_TOLERANCE: f64 = 1e-4;

fn features(f: &HashMap<String, Tensor>) -> MultimerInputs {
    MultimerInputs::from_named(|name| f.get(name).map(|t| t.shallow_clone()), "the fixture").unwrap()
}

fn assert_within(what: &str, got: &Tensor, want: &Tensor, tolerance: f64) {
    assert_eq!(got.size(), want.size(), "{what}: shape");
    let diff = (got.to_kind(Kind::Double) - want.to_kind(Kind::Double)).abs().max().double_value(&[]);
    eprintln!("{what}: max |ours - AlphaFold| = {diff:.2e}");
    assert!(diff <= tolerance, "{what}: max |ours - AlphaFold| = {diff:.3e} > {tolerance:.0e}");
}

#[test]
fn multimer_network_with_recycling_equals_alphafold_multimer() {
    let f = arrays("model.npz");
    let network = MultimerAlphaFold::load(fixture("model_params.npz")).unwrap().with_sampling(MsaSampling {
        num_msa: 6,
        num_extra_msa: 8,
        masked: MaskedMsaConfig::default(),
    });
    let features = features(&f);
    let key = Key::from_seed(f["seed"].int64_value(&[]));
    for run in ["full", "early"] {
        let g = |k: &str| &f[&format!("{run}_{k}")];
        let recycling = Recycling {
            max: g("num_recycle").int64_value(&[]) as usize,
            early_stop_tolerance: g("tolerance").double_value(&[]),
        };
        let (pass, recycles) = tch::no_grad(|| network.predict(&features, recycling, key, &Exec::serial())).unwrap();
        assert_eq!(recycles as i64, g("num_recycles").int64_value(&[]), "{run}: recycles run");
        let s = &pass.structure;
        assert_within(
            &format!("{run} final atom positions (Å)"),
            &s.atom37,
            g("final_atom_positions"),
            POSITIONS_TOLERANCE,
        );
        assert_equal(&format!("{run} final atom mask"), &s.atom37_mask, g("final_atom_mask"));
        let h = &pass.heads;
        assert_within(&format!("{run} distogram"), &h.distogram, g("distogram"), LOGITS_TOLERANCE);
        assert_within(&format!("{run} masked msa"), &h.masked_msa, g("masked_msa"), LOGITS_TOLERANCE);
        assert_within(&format!("{run} plddt"), &h.lddt, g("predicted_lddt"), LOGITS_TOLERANCE);
        let pae = h.aligned_error.as_ref().unwrap();
        assert_within(&format!("{run} aligned error"), pae, g("predicted_aligned_error"), LOGITS_TOLERANCE);
        assert_within(
            &format!("{run} experimentally resolved"),
            &h.experimentally_resolved,
            g("experimentally_resolved"),
            LOGITS_TOLERANCE,
        );
    }
    // Another key samples other MSA rows and masks, and so folds otherwise: the key is what
    // matched.
    let early = Recycling { max: 3, early_stop_tolerance: 1e9 };
    let other = Key::from_seed(f["seed"].int64_value(&[]) + 1);
    let (pass, _) = tch::no_grad(|| network.predict(&features, early, other, &Exec::serial())).unwrap();
    let d = (&pass.structure.atom37 - &f["early_final_atom_positions"]).abs().max().double_value(&[]);
    assert!(d > 1e-2, "another key moved the atoms by only {d:e} Å");
}

/// The same network on the fused kernels, as a GPU runs it by default (without a GPU on the
/// CPU emulator): with the whole logits within the compositions' tolerances; with the
/// tensor-core attention (`--attention flash`, its products in TF32's 10-bit mantissas) within
/// 0.2 Å and 2e-2, about 1e-3 of the largest coordinate (236 Å: random parameters) and logit
/// (25). Measured: 0.046 Å and 3.8e-3; the emulator with exact f32 products instead of TF32
/// gave 2.5e-4 Å and 8.8e-6, the compositions' figures, so the rest is TF32's rounding; a wrong
/// head, row or layout moves the atoms by ångströms.
#[test]
fn multimer_network_on_cuda_or_the_emulator_equals_alphafold_multimer() {
    let dev = suite_tests::cuda_or_emulator(
        "multimer_network_on_cuda_or_the_emulator_equals_alphafold_multimer",
        kernels::emulator::enable,
    );
    let f = arrays("model.npz");
    let features = features(&f);
    let key = Key::from_seed(f["seed"].int64_value(&[]));
    let g = |k: &str| &f[&format!("early_{k}")];
    let recycling = Recycling {
        max: g("num_recycle").int64_value(&[]) as usize,
        early_stop_tolerance: g("tolerance").double_value(&[]),
    };
    for (attention, positions, logits) in
        [(AttentionKernel::Logits, POSITIONS_TOLERANCE, LOGITS_TOLERANCE), (AttentionKernel::Flash, 0.2, 2e-2)]
    {
        let kernels = (kernels::Backend::Fused, attention);
        let network = MultimerAlphaFold::load_on(fixture("model_params.npz"), 8, dev, None, kernels)
            .unwrap()
            .with_sampling(MsaSampling { num_msa: 6, num_extra_msa: 8, masked: MaskedMsaConfig::default() });
        let (pass, recycles) = tch::no_grad(|| network.predict(&features, recycling, key, &Exec::serial())).unwrap();
        assert_eq!(recycles as i64, g("num_recycles").int64_value(&[]), "{attention:?}: recycles run");
        let cpu = |t: &Tensor| t.to_device(tch::Device::Cpu);
        let what = |name: &str| format!("{attention:?} on {dev:?}: {name}");
        assert_within(
            &what("final atom positions (Å)"),
            &cpu(&pass.structure.atom37),
            g("final_atom_positions"),
            positions,
        );
        assert_within(&what("distogram"), &cpu(&pass.heads.distogram), g("distogram"), logits);
        assert_within(&what("masked msa"), &cpu(&pass.heads.masked_msa), g("masked_msa"), logits);
        assert_within(&what("plddt"), &cpu(&pass.heads.lddt), g("predicted_lddt"), logits);
    }
}

#[test]
fn multimer_network_at_v3_sampling_sizes_equals_alphafold_multimer_run_model() {
    // The pipeline's whole heterodimer (512 MSA rows, 10 real) at v3's num_msa 508 and
    // num_extra_msa 2048, the key derived from the seed as RunModel.predict derives it.
    let f = arrays("model.npz");
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer/heterodimer.npz");
    let pipeline: HashMap<String, Tensor> = Tensor::read_npz(path).unwrap().into_iter().collect();
    let network = MultimerAlphaFold::load(fixture("model_params.npz")).unwrap();
    assert_eq!(network.sampling, MsaSampling::default(), "v3's sizes by default");
    let inputs = features(&pipeline);
    let recycling = Recycling { max: 1, early_stop_tolerance: 0.5 };
    let key = network_key(f["preset_seed"].int64_value(&[]) as u64);
    let (pass, recycles) = tch::no_grad(|| network.predict(&inputs, recycling, key, &Exec::serial())).unwrap();
    assert_eq!(recycles as i64, f["preset_num_recycles"].int64_value(&[]));
    let positions = &f["preset_final_atom_positions"];
    assert_within("v3 sizes: final atom positions (Å)", &pass.structure.atom37, positions, POSITIONS_TOLERANCE);
    assert_within("v3 sizes: plddt", &pass.heads.lddt, &f["preset_predicted_lddt"], LOGITS_TOLERANCE);
    let pae = pass.heads.aligned_error.as_ref().unwrap();
    assert_within("v3 sizes: aligned error", pae, &f["preset_predicted_aligned_error"], LOGITS_TOLERANCE);
}

#[test]
fn multimer_network_errors_name_the_file_and_feature() {
    let e = MultimerAlphaFold::load(fixture("evoformer_block_params.npz")).err().unwrap().to_string();
    assert!(e.contains("evoformer_block_params.npz"), "{e}");
    let f = arrays("model.npz");
    let e = MultimerInputs::from_named(
        |n| if n == "bert_mask" { None } else { f.get(n).map(|t| t.shallow_clone()) },
        "x.npz",
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("x.npz") && e.contains("bert_mask"), "{e}");
}

/// The stacks leave out fully-masked rows (the pipeline's heterodimer pads 10 real MSA rows to
/// 512, so 498 of the 508 centres are padding, and the extra rows all are): every output equals
/// the run of every row within 1e-5 of its largest value (fp32 sums over other row counts),
/// and the run of every row is what DeepMind's code runs (the parity test above checks the
/// dropping run against it).
#[test]
fn leaving_out_masked_rows_changes_no_output() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer/heterodimer.npz");
    let pipeline: HashMap<String, Tensor> = Tensor::read_npz(path).unwrap().into_iter().collect();
    let inputs = features(&pipeline);
    let recycling = Recycling { max: 1, early_stop_tolerance: 0.0 };
    let run = |drop: bool| {
        let network = MultimerAlphaFold::load(fixture("model_params.npz")).unwrap().drop_masked_rows(drop);
        tch::no_grad(|| network.predict(&inputs, recycling, network_key(3), &Exec::serial())).unwrap().0
    };
    let (lean, every) = (run(true), run(false));
    for (what, a, b) in [
        ("atom positions", &lean.structure.atom37, &every.structure.atom37),
        ("pair", &lean.recycled.pair, &every.recycled.pair),
        ("masked msa", &lean.heads.masked_msa, &every.heads.masked_msa),
        ("plddt", &lean.heads.lddt, &every.heads.lddt),
        ("aligned error", lean.heads.aligned_error.as_ref().unwrap(), every.heads.aligned_error.as_ref().unwrap()),
    ] {
        assert_eq!(a.size(), b.size(), "{what}: shape");
        let scale = b.abs().max().double_value(&[]).max(1e-12);
        let d = (a - b).abs().max().double_value(&[]) / scale;
        eprintln!("{what}: {d:.2e} of its largest value");
        assert!(d <= 1e-5, "{what} differs by {d:e} of its largest value with the masked rows left out");
    }
}
