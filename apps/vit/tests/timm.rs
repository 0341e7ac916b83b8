//! Our ViT has timm's parameter names and shapes, loads timm's weights, and computes timm's
//! logits for them (fixtures from tests/fixtures/make_vit_fixtures.py).
use std::collections::BTreeMap;
use std::path::PathBuf;

use tch::nn::VarStore;
use tch::{Device, Tensor};
use vit::model::{correct_top_k, Vit, VitConfig};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

#[test]
fn parameter_names_and_shapes_are_timms() {
    let text = std::fs::read_to_string(fixture("vit_tiny_patch16_224_keys.json")).unwrap();
    let want: BTreeMap<String, Vec<i64>> = serde_json::from_str(&text).unwrap();
    let vs = VarStore::new(Device::Cpu);
    let cfg = VitConfig::from_timm_name("vit_tiny_patch16_224").unwrap();
    let _ = Vit::new(&vs.root(), cfg);
    let ours: BTreeMap<String, Vec<i64>> = vs.variables().into_iter().map(|(k, v)| (k, v.size())).collect();
    assert_eq!(ours, want);
}

#[test]
fn logits_match_timm_for_the_same_weights() {
    let vs = VarStore::new(Device::Cpu);
    let cfg = VitConfig {
        image_size: 16,
        patch_size: 8,
        in_channels: 1,
        num_classes: 5,
        width: 24,
        depth: 2,
        heads: 3,
        mlp_ratio: 4.0,
    };
    let model = Vit::new(&vs.root(), cfg);
    let path = fixture("tiny_vit.safetensors");
    let unused = data::checkpoint::load_safetensors(&vs, &path).unwrap();
    assert_eq!(unused, vec!["fixture.input".to_string(), "fixture.logits".to_string()], "every weight is used");
    let file: BTreeMap<String, Tensor> = Tensor::read_safetensors(&path).unwrap().into_iter().collect();
    let logits = tch::no_grad(|| model.forward(&file["fixture.input"])).unwrap();
    let diff = (&logits - &file["fixture.logits"]).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "max abs difference from timm {diff:e}");
    let labels = file["fixture.logits"].argmax(1, false);
    assert_eq!(correct_top_k(&logits, &labels, 1), 3);
}

#[test]
fn presets_and_bad_configs() {
    assert_eq!(VitConfig::from_timm_name("vit_base_patch32_224"), Some(VitConfig::base(32)));
    assert_eq!(VitConfig::from_timm_name("vit_huge_patch14_224"), None);
    let bad = VitConfig { image_size: 30, ..VitConfig::tiny(16) };
    assert!(bad.validate().unwrap_err().contains("image size 30 is not a positive multiple of patch size 16"));
    let bad = VitConfig { heads: 5, ..VitConfig::tiny(16) };
    assert!(bad.validate().unwrap_err().contains("width 192 does not split into 5 heads"));
    // A ratio that leaves the MLP no feature, or is not a number, would panic in libtorch.
    for ratio in [0.001, f64::NAN, f64::INFINITY, -1.0] {
        let err = VitConfig { mlp_ratio: ratio, ..VitConfig::tiny(16) }.validate().unwrap_err();
        assert!(err.contains("mlp ratio"), "{ratio}: {err}");
    }
}
