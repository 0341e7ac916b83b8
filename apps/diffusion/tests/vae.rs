//! The VAE against diffusers: encoder moments, a posterior sample for given noise and the
//! decoded image of two tiny random `AutoencoderKL`s (fp16 variants; one stored with the
//! pre-0.14 attention names `query/key/value/proj_attn` as 1x1 convolutions), written by
//! `tests/fixtures/make_fixtures.py`.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use diffusion::vae::AutoencoderKL;
use diffusion::weights::ComponentFiles;
use suite_tests::assert_close;
use tch::{Device, Kind, Tensor};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vae").join(name)
}

fn reference(name: &str) -> HashMap<String, Tensor> {
    data::checkpoint::read_tensors(&fixture(&format!("{name}_reference.safetensors"))).unwrap()
}

fn load(name: &str) -> (tch::nn::VarStore, AutoencoderKL) {
    let files = ComponentFiles::in_pipeline(&fixture(name), "vae", "AutoencoderKL").unwrap();
    AutoencoderKL::load(&files, Device::Cpu).unwrap()
}

fn check_against_diffusers(name: &str, vae: &AutoencoderKL) {
    let r = reference(name);
    tch::no_grad(|| {
        let posterior = vae.encode(&r["image"]).unwrap();
        assert_close(&posterior.mean, &r["mean"], 0.0, 1e-4, &format!("{name} posterior mean"));
        assert_close(&posterior.logvar, &r["logvar"], 0.0, 1e-4, &format!("{name} posterior logvar"));
        let latents = posterior.sample_with(&r["noise"]).unwrap();
        assert_close(&latents, &r["latents"], 0.0, 1e-4, &format!("{name} posterior sample"));
        let decoded = vae.decode(&r["latents"]).unwrap();
        assert_close(&decoded, &r["decoded"], 0.0, 1e-4, &format!("{name} decoded image"));
    });
}

#[test]
fn vae_matches_diffusers() {
    let (_vs, vae) = load("kl");
    assert_eq!(vae.scaling_factor(), 0.18215);
    check_against_diffusers("kl", &vae);
}

#[test]
fn old_attention_names_load_and_match_diffusers() {
    let (_vs, vae) = load("old_names");
    check_against_diffusers("old_names", &vae);
}

#[test]
fn saved_vae_uses_current_names_and_reloads() {
    let dir = suite_tests::scratch("diffusion-vae", "save");
    let (vs, vae) = load("old_names");
    vae.save(&vs, &dir).unwrap();
    let saved = data::checkpoint::read_tensors(&dir.join("diffusion_pytorch_model.safetensors")).unwrap();
    let q = &saved["decoder.mid_block.attentions.0.to_q.weight"];
    assert_eq!(q.size(), [8, 8]);
    assert_eq!(q.kind(), Kind::Float);
    assert!(!saved.keys().any(|k| k.contains(".query.")), "old names written back");
    let (_vs2, again) = AutoencoderKL::load(&ComponentFiles::in_dir(&dir).unwrap(), Device::Cpu).unwrap();
    check_against_diffusers("old_names", &again);
}

#[test]
fn posterior_sampling_and_bad_shapes() {
    let (_vs, vae) = load("kl");
    let r = reference("kl");
    let posterior = tch::no_grad(|| vae.encode(&r["image"])).unwrap();
    tch::manual_seed(3);
    let a = posterior.sample();
    tch::manual_seed(3);
    let noise = Tensor::randn(posterior.mean.size(), (Kind::Float, Device::Cpu));
    assert_close(&a, &posterior.sample_with(&noise).unwrap(), 0.0, 1e-6, "seeded sample");
    let err = posterior.sample_with(&noise.narrow(1, 0, 2)).unwrap_err().to_string();
    assert!(err.contains("noise has shape [1, 2, 4, 4], expected [1, 4, 4, 4]"), "{err}");
    let err = vae.encode(&r["image"].narrow(3, 0, 7)).unwrap_err().to_string();
    assert!(err.contains("VAE images have shape [1, 3, 8, 7]"), "{err}");
    let err = vae.decode(&r["image"]).unwrap_err().to_string();
    assert!(err.contains("VAE latents have shape [1, 3, 8, 8], expected [batch, 4, H, W]"), "{err}");
}
