//! An original single-file checkpoint (`fixtures/single_file.safetensors`, the tiny pipeline
//! renamed to latent-diffusion's keys by `fixtures/make_single_file_fixture.py`) converts into
//! a diffusers folder holding exactly the pipeline's weights; unknown keys and files without a
//! UNet are named.
use std::path::{Path, PathBuf};

use diffusion::pipeline::StableDiffusion;
use diffusion::single_file::{to_diffusers, Configs};
use tch::{Device, Kind, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn scratch(name: &str) -> suite_tests::Scratch {
    suite_tests::scratch("diffusion-single", name)
}

#[test]
fn the_single_file_converts_to_the_pipeline() {
    let out_scratch = scratch("ok");
    let out = out_scratch.join("sd");
    let donor = Configs::Folder(fixtures().join("pipeline"));
    let n = to_diffusers(&fixtures().join("single_file.safetensors"), &donor, &out).unwrap().tensors;
    let ours = StableDiffusion::load(&out, Device::Cpu, Kind::Float).unwrap();
    let reference = StableDiffusion::load(&fixtures().join("pipeline"), Device::Cpu, Kind::Float).unwrap();
    let mut compared = 0;
    for (a, b) in [
        (&ours.unet_vs, &reference.unet_vs),
        (&ours.vae_vs, &reference.vae_vs),
        (&ours.text_encoder_vs, &reference.text_encoder_vs),
    ] {
        let (a, b) = (a.variables(), b.variables());
        assert_eq!(a.len(), b.len());
        for (name, t) in &b {
            // The single file stores fp16: compare with the reference rounded the same way.
            let want = t.to_kind(Kind::Half).to_kind(Kind::Float);
            assert!(a[name].equal(&want), "{name} differs after conversion");
            compared += 1;
        }
    }
    assert!(n >= compared, "{n} tensors written, {compared} compared");
}

#[test]
fn unknown_keys_and_files_without_a_unet_are_named() {
    let dir = scratch("bad");
    let mut tensors: Vec<(String, Tensor)> =
        Tensor::read_safetensors(fixtures().join("single_file.safetensors")).unwrap();
    tensors.push(("model.diffusion_model.extra_head.weight".into(), Tensor::zeros([2], (Kind::Float, Device::Cpu))));
    let odd = dir.join("odd.safetensors");
    data::checkpoint::save_tensors(&tensors, &odd).unwrap();
    let donor = Configs::Folder(fixtures().join("pipeline"));
    let err = to_diffusers(&odd, &donor, &dir.join("out")).unwrap_err().to_string();
    assert!(err.contains("odd.safetensors") && err.contains("model.diffusion_model.extra_head.weight"), "{err}");
    assert!(!dir.join("out").exists(), "nothing written after a failure");

    tensors.retain(|(k, _)| !k.starts_with("model.diffusion_model."));
    let vae_only = dir.join("vae_only.safetensors");
    data::checkpoint::save_tensors(&tensors, &vae_only).unwrap();
    let err = to_diffusers(&vae_only, &donor, &dir.join("out")).unwrap_err().to_string();
    assert!(err.contains("vae_only.safetensors") && err.contains("not an original Stable Diffusion"), "{err}");
}
