//! AlphaFold-Multimer's in-network MSA sampling against DeepMind's code
//! (`fixtures/multimer_network/make_multimer_model.py`, fp32 on CPU): the rows `sample_msa`
//! picks, `make_masked_msa`'s masked positions and draws and `nearest_neighbor_clusters`'
//! profiles under the same JAX keys.
mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use fastfold::jax_random::Key;
use fastfold::model::multimer::sampling::msa_profile;
use fastfold::model::multimer::{FullMsa, MaskedMsaConfig, MsaSampling};
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
