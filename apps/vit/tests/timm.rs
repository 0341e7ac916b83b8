//! Our ViT has timm's parameter names and shapes, loads timm's weights, and computes timm's
//! logits for them (fixtures from tests/fixtures/make_vit_fixtures.py).
use std::collections::BTreeMap;
use std::path::PathBuf;

use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use vit::model::{correct_top_k, Vit, VitConfig};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// libtorch's profiler sees every thread's operators: the test that counts them runs alone.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

/// The small timm model of `tiny_vit.safetensors`.
fn fixture_config() -> VitConfig {
    VitConfig {
        image_size: 16,
        patch_size: 8,
        in_channels: 1,
        num_classes: 5,
        width: 24,
        depth: 2,
        heads: 3,
        mlp_ratio: 4.0,
    }
}

/// timm's `VisionTransformer.forward` op for op on the parameters of `vs` (timm's names): the
/// patch embedding a strided convolution, q, k and v `permute(2, 0, 3, 1, 4)` then `unbind(0)`,
/// the final norm over every token before the class token is taken.
fn timm_forward(vs: &VarStore, cfg: &VitConfig, images: &Tensor) -> Tensor {
    let vars = vs.variables();
    let var = |name: &str| vars.get(name).unwrap_or_else(|| panic!("no parameter {name}")).shallow_clone();
    let (w, p, heads) = (cfg.width, cfg.patch_size, cfg.heads);
    let norm = |x: &Tensor, n: &str| {
        x.layer_norm([w], Some(var(&format!("{n}.weight"))), Some(var(&format!("{n}.bias"))), 1e-6, false)
    };
    let linear = |x: &Tensor, n: &str| x.linear(&var(&format!("{n}.weight")), Some(var(&format!("{n}.bias"))));
    let x =
        images.conv2d(&var("patch_embed.proj.weight"), Some(var("patch_embed.proj.bias")), [p, p], [0, 0], [1, 1], 1);
    let x = x.flatten(2, -1).transpose(1, 2);
    let b = x.size()[0];
    let mut x = Tensor::cat(&[var("cls_token").expand([b, -1, -1], false), x], 1) + var("pos_embed");
    let n = x.size()[1];
    for i in 0..cfg.depth {
        let at = |name: &str| format!("blocks.{i}.{name}");
        let qkv = linear(&norm(&x, &at("norm1")), &at("attn.qkv"));
        let qkv = qkv.reshape([b, n, 3, heads, w / heads]).permute([2, 0, 3, 1, 4]).unbind(0);
        let a =
            Tensor::scaled_dot_product_attention(&qkv[0], &qkv[1], &qkv[2], None::<Tensor>, 0.0, false, None, false);
        x = &x + linear(&a.transpose(1, 2).reshape([b, n, w]), &at("attn.proj"));
        let h = linear(&norm(&x, &at("norm2")), &at("mlp.fc1")).gelu("none");
        x = &x + linear(&h, &at("mlp.fc2"));
    }
    linear(&norm(&x, "norm").select(1, 0), "head")
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
    let _turn = turn();
    let vs = VarStore::new(Device::Cpu);
    let cfg = fixture_config();
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
    let bad = VitConfig { num_classes: 0, ..VitConfig::tiny(16) };
    assert_eq!(bad.validate().unwrap_err(), "classes must be positive, got 0");
    // A ratio that leaves the MLP no feature, or is not a number, would panic in libtorch.
    for ratio in [0.001, f64::NAN, f64::INFINITY, -1.0] {
        let err = VitConfig { mlp_ratio: ratio, ..VitConfig::tiny(16) }.validate().unwrap_err();
        assert!(err.contains("mlp ratio"), "{ratio}: {err}");
    }
}

/// Our forward and backward on timm's weights against timm's ops on the same weights: the
/// logits and every parameter's gradient (fp32, within 1e-5 of each tensor's largest
/// magnitude; the patch embedding's matmul and the convolution sum in other orders).
#[test]
fn gradients_match_timms_ops_for_the_same_weights() {
    let _turn = turn();
    let vs = VarStore::new(Device::Cpu);
    let cfg = fixture_config();
    let model = Vit::new(&vs.root(), cfg);
    let path = fixture("tiny_vit.safetensors");
    data::checkpoint::load_safetensors(&vs, &path).unwrap();
    let file: BTreeMap<String, Tensor> = Tensor::read_safetensors(&path).unwrap().into_iter().collect();
    let images = &file["fixture.input"];
    tch::manual_seed(5);
    let weights = Tensor::randn([images.size()[0], cfg.num_classes], (Kind::Float, Device::Cpu));
    let mut names: Vec<String> = vs.variables().into_keys().collect();
    names.sort();
    let run = |forward: &dyn Fn() -> Tensor| {
        let logits = forward();
        (&logits * &weights).sum(Kind::Float).backward();
        let vars = vs.variables();
        let mut out = vec![("logits".to_string(), logits.detach())];
        for name in &names {
            let mut t = vars[name].shallow_clone();
            out.push((name.clone(), t.grad().copy()));
            t.zero_grad();
        }
        out
    };
    let ours = run(&|| model.forward(images).unwrap());
    let timm = run(&|| timm_forward(&vs, &cfg, images));
    for ((name, a), (_, b)) in ours.iter().zip(&timm) {
        assert_eq!(a.size(), b.size(), "{name}");
        let scale = b.abs().max().double_value(&[]);
        assert!(scale > 0.0, "{name}: timm's is all zeros");
        let d = (a - b).abs().max().double_value(&[]);
        assert!(d <= 1e-5 * scale, "{name}: differs from timm's by {d:e} (largest {scale:e})");
    }
}

/// The step's avoidable kernels stay away (they were half a ViT-B/16 step's non-matmul GPU
/// time): backward hands q, k and v's gradients to the fused projection with one stack per block
/// (on a GPU one copy, and the projection's reshape a view of it), where picking them with
/// `select` zero-filled, copied and added a buffer of the projection's size per view and then
/// cloned the sum into the projection's layout; the patch embedding is a matmul, not a convolution (on a
/// GPU cuDNN converted the NCHW images to NHWC each call). The host's operators, traced on the CPU.
#[test]
fn backward_stacks_q_k_v_gradients_and_the_stem_runs_no_convolution() {
    let _turn = turn();
    let cfg = VitConfig { depth: 3, ..fixture_config() };
    let vs = VarStore::new(Device::Cpu);
    let model = Vit::new(&vs.root(), cfg);
    let images = Tensor::randn([2, cfg.in_channels, cfg.image_size, cfg.image_size], (Kind::Float, Device::Cpu));
    let trace = engine::kernel_trace::KernelTrace::start(false).unwrap();
    model.forward(&images).unwrap().sum(Kind::Float).backward();
    let events = trace.stop(None).unwrap();
    let calls = |name: &str| events.0.iter().filter(|e| e.name == name).count();
    let names = || {
        let mut n: Vec<&str> = events.0.iter().map(|e| e.name.as_str()).collect();
        n.sort_unstable();
        n.dedup();
        n.join(", ")
    };
    assert_eq!(calls("aten::unbind"), cfg.depth as usize, "one unbind of q, k, v per block: {}", names());
    assert_eq!(calls("aten::stack"), cfg.depth as usize, "one stack of their gradients per block: {}", names());
    assert_eq!(calls("aten::select_backward"), 1, "the head's class token alone: {}", names());
    assert_eq!(calls("aten::convolution") + calls("aten::convolution_backward"), 0, "{}", names());
}
