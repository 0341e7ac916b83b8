//! The UNet against diffusers: outputs of two tiny random models (SD1-style conv projections
//! in float32; SD2-style linear projections and per-block heads as the fp16 variant) for fixed
//! inputs, written by `tests/fixtures/make_fixtures.py`. Also: checkpointed gradients equal
//! plain ones, a saved UNet reloads to the same outputs, and bad folders are named errors.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use diffusion::unet::UNet2DConditionModel;
use diffusion::weights::ComponentFiles;
use suite_tests::assert_close;
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/unet").join(name)
}

fn reference(name: &str) -> HashMap<String, Tensor> {
    data::checkpoint::read_tensors(&fixture(&format!("{name}_reference.safetensors"))).unwrap()
}

fn load(name: &str) -> (tch::nn::VarStore, UNet2DConditionModel) {
    let files = ComponentFiles::in_pipeline(&fixture(name), "unet", "UNet2DConditionModel").unwrap();
    UNet2DConditionModel::load(&files, Device::Cpu).unwrap()
}

/// A fresh folder under the system temp dir for one test.
fn scratch(test: &str) -> suite_tests::Scratch {
    suite_tests::scratch("diffusion-unet", test)
}

fn check_against_diffusers(name: &str) {
    let (_vs, unet) = load(name);
    let r = reference(name);
    let out = tch::no_grad(|| unet.forward(&r["sample"], &r["timesteps"], &r["encoder_hidden_states"])).unwrap();
    assert_close(&out, &r["out"], 0.0, 1e-4, &format!("{name} output, timesteps [3, 917]"));
    let t = Tensor::from(250.0f64);
    let out = tch::no_grad(|| unet.forward(&r["sample"], &t, &r["encoder_hidden_states"])).unwrap();
    assert_close(&out, &r["out_t250"], 0.0, 1e-4, &format!("{name} output, scalar timestep 250"));
}

#[test]
fn sd1_style_unet_matches_diffusers() {
    check_against_diffusers("sd1");
}

#[test]
fn sd2_style_unet_from_fp16_variant_matches_diffusers() {
    let files = ComponentFiles::in_dir(&fixture("sd2").join("unet")).unwrap();
    assert!(files.weights.ends_with("diffusion_pytorch_model.fp16.safetensors"), "{:?}", files.weights);
    let (_vs, unet) = load("sd2");
    assert_eq!(unet.config().heads, vec![2, 4]);
    assert!(unet.config().use_linear_projection);
    check_against_diffusers("sd2");
}

#[test]
fn checkpointed_gradients_equal_plain_ones() {
    let r = reference("sd1");
    let mut grads = Vec::new();
    for checkpointing in [false, true] {
        let (vs, mut unet) = load("sd1");
        unet.set_gradient_checkpointing(checkpointing);
        let sample = r["sample"].copy().set_requires_grad(true);
        let out = unet.forward(&sample, &r["timesteps"], &r["encoder_hidden_states"]).unwrap();
        assert_close(&out.detach(), &r["out"], 0.0, 1e-4, "checkpointed forward");
        // A weighted sum, so every output element gets a different gradient.
        let w = Tensor::linspace(-1.0, 1.0, out.numel() as i64, (Kind::Float, Device::Cpu)).reshape(out.size());
        (out * w).sum(Kind::Float).backward();
        let mut g: Vec<(String, Tensor)> = vs.variables().into_iter().map(|(k, v)| (k, v.grad().copy())).collect();
        g.push(("sample".into(), sample.grad().copy()));
        g.sort_by(|a, b| a.0.cmp(&b.0));
        grads.push(g);
    }
    assert_eq!(grads[0].len(), grads[1].len());
    for ((name, plain), (_, ckpt)) in grads[0].iter().zip(&grads[1]) {
        assert!(plain.defined() && ckpt.defined(), "{name} has no gradient");
        assert_close(ckpt, plain, 1e-4, 1e-5, &format!("gradient of {name}"));
    }
}

#[test]
fn saved_unet_reloads_with_same_outputs() {
    let dir = scratch("save");
    let (vs, unet) = load("sd1");
    unet.save(&vs, &dir).unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["_class_name"], "UNet2DConditionModel");
    assert_eq!(config["cross_attention_dim"], 16);
    let (_vs2, again) = UNet2DConditionModel::load(&ComponentFiles::in_dir(&dir).unwrap(), Device::Cpu).unwrap();
    let r = reference("sd1");
    let out = tch::no_grad(|| again.forward(&r["sample"], &r["timesteps"], &r["encoder_hidden_states"])).unwrap();
    assert_close(&out, &r["out"], 0.0, 1e-4, "reloaded output");
}

/// Copies the sd1 pipeline to `dir`, changing its weights with `edit`; returns the load error.
fn load_error(test: &str, edit: impl FnOnce(&mut HashMap<String, Tensor>)) -> String {
    let dir = scratch(test);
    std::fs::create_dir_all(dir.join("unet")).unwrap();
    for f in ["model_index.json", "unet/config.json"] {
        std::fs::copy(fixture("sd1").join(f), dir.join(f)).unwrap();
    }
    let weights = "unet/diffusion_pytorch_model.safetensors";
    let mut tensors = data::checkpoint::read_tensors(&fixture("sd1").join(weights)).unwrap();
    edit(&mut tensors);
    let named: Vec<(String, Tensor)> = tensors.into_iter().collect();
    data::checkpoint::save_tensors(&named, &dir.join(weights)).unwrap();
    let files = ComponentFiles::in_pipeline(&dir, "unet", "UNet2DConditionModel").unwrap();
    let err = UNet2DConditionModel::load(&files, Device::Cpu).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    err
}

#[test]
fn bad_weights_are_errors_naming_file_and_key() {
    let key = "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight";
    let err = load_error("missing", |t| {
        t.remove(key);
    });
    assert!(
        err.contains("diffusion_pytorch_model.safetensors") && err.contains(&format!("missing key {key}")),
        "{err}"
    );
    let err = load_error("shape", |t| {
        t.insert(key.into(), Tensor::zeros([8, 15], (Kind::Float, Device::Cpu)));
    });
    assert!(err.contains(&format!("key {key} has shape [8, 15], expected [8, 16]")), "{err}");
    let err = load_error("extra", |t| {
        t.insert("class_embedding.linear_1.weight".into(), Tensor::zeros([2], (Kind::Float, Device::Cpu)));
    });
    assert!(err.contains("1 unexpected keys: class_embedding.linear_1.weight"), "{err}");
}

#[test]
fn bad_folders_and_configs_are_named_errors() {
    let dir = scratch("folders");
    let err = ComponentFiles::in_pipeline(&dir, "unet", "UNet2DConditionModel").unwrap_err().to_string();
    assert!(err.contains("model_index.json"), "{err}");
    std::fs::write(dir.join("model_index.json"), r#"{"unet": ["diffusers", "UNet2DModel"]}"#).unwrap();
    let err = ComponentFiles::in_pipeline(&dir, "unet", "UNet2DConditionModel").unwrap_err().to_string();
    assert!(err.contains("key \"unet\" is [\"diffusers\",\"UNet2DModel\"]"), "{err}");
    std::fs::write(dir.join("model_index.json"), r#"{"unet": ["diffusers", "UNet2DConditionModel"]}"#).unwrap();
    std::fs::create_dir_all(dir.join("unet")).unwrap();
    let err = ComponentFiles::in_pipeline(&dir, "unet", "UNet2DConditionModel").unwrap_err().to_string();
    assert!(err.contains("unet/config.json: missing"), "{err}");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("sd1").join("unet/config.json")).unwrap()).unwrap();
    std::fs::write(dir.join("unet/config.json"), config.to_string()).unwrap();
    let err = ComponentFiles::in_pipeline(&dir, "unet", "UNet2DConditionModel").unwrap_err().to_string();
    assert!(
        err.contains(
            "diffusion_pytorch_model.safetensors: missing, and so are diffusion_pytorch_model.safetensors.index.json"
        ),
        "{err}"
    );
    // A PyTorch pickle is named, not taken for nothing.
    std::fs::write(dir.join("unet/diffusion_pytorch_model.bin"), b"pickle").unwrap();
    let err = ComponentFiles::in_pipeline(&dir, "unet", "UNet2DConditionModel").unwrap_err().to_string();
    assert!(err.contains("diffusion_pytorch_model.bin is there, a PyTorch pickle"), "{err}");
    std::fs::remove_file(dir.join("unet/diffusion_pytorch_model.bin")).unwrap();
    std::fs::copy(
        fixture("sd1").join("unet/diffusion_pytorch_model.safetensors"),
        dir.join("unet/diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    config["class_embed_type"] = "timestep".into();
    std::fs::write(dir.join("unet/config.json"), config.to_string()).unwrap();
    let files = ComponentFiles::in_pipeline(&dir, "unet", "UNet2DConditionModel").unwrap();
    let err = UNet2DConditionModel::load(&files, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("config.json: class_embed_type = \"timestep\" is not supported"), "{err}");
}

#[test]
fn bad_input_shapes_are_errors() {
    let (_vs, unet) = load("sd1");
    let r = reference("sd1");
    let (x, t, ctx) = (&r["sample"], &r["timesteps"], &r["encoder_hidden_states"]);
    let err = unet.forward(&x.narrow(1, 0, 3), t, ctx).unwrap_err().to_string();
    assert!(err.contains("sample has shape [2, 3, 8, 8], expected [batch, 4, H, W]"), "{err}");
    let err = unet.forward(&x.narrow(3, 0, 7), t, ctx).unwrap_err().to_string();
    assert!(err.contains("multiples of 2"), "{err}");
    let err = unet.forward(x, t, &ctx.narrow(2, 0, 8)).unwrap_err().to_string();
    assert!(err.contains("encoder_hidden_states have shape [2, 5, 8], expected [2, tokens, 16]"), "{err}");
    let err = unet.forward(x, &Tensor::from_slice(&[1.0f32, 2.0, 3.0]), ctx).unwrap_err().to_string();
    assert!(err.contains("timesteps have shape [3]"), "{err}");
}
