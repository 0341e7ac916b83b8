//! Sampling from a tiny diffusers pipeline folder (`fixtures/pipeline`, made by
//! `fixtures/make_pipeline_fixture.py`): images equal diffusers' `StableDiffusionPipeline`
//! for the same initial latents under DDIM and Euler with guidance, and without guidance;
//! seeds reproduce; the command writes PNGs; bad sizes and missing files are named.
use std::path::{Path, PathBuf};
use std::process::Command;

use diffusion::pipeline::StableDiffusion;
use diffusion::sample::{SampleOptions, Sampler};
use tch::{Device, Kind, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn load() -> StableDiffusion {
    StableDiffusion::load(&fixtures().join("pipeline"), Device::Cpu, Kind::Float).unwrap()
}

fn prompts() -> Vec<String> {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("pipeline_prompts.json")).unwrap()).unwrap()
}

fn options(sampler: Sampler, guidance: f64) -> SampleOptions {
    SampleOptions {
        steps: 4,
        guidance,
        negative_prompt: String::new(),
        height: 16,
        width: 16,
        sampler,
        images_per_prompt: 1,
        seed: 0,
    }
}

#[test]
fn images_equal_diffusers_for_the_same_latents() {
    let sd = load();
    let reference: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(fixtures().join("pipeline_reference.safetensors")).unwrap().into_iter().collect();
    let prompts = prompts();
    let prompts: Vec<&str> = prompts.iter().map(String::as_str).collect();
    for (key, sampler, guidance) in
        [("ddim", Sampler::Ddim, 7.5), ("euler", Sampler::Euler, 7.5), ("ddim_guidance_1", Sampler::Ddim, 1.0)]
    {
        let ours = sd.sample(&prompts, &options(sampler, guidance), Some(&reference["latents"])).unwrap();
        // diffusers returns [B, H, W, 3].
        let theirs = reference[key].permute([0, 3, 1, 2]);
        let d = (&ours - &theirs).abs().max().double_value(&[]);
        // fp32 on both sides; observed 4.8e-7 (DDIM), 1.0e-6 (Euler), 3.6e-7 (no guidance).
        assert!(d < 1e-4, "{key}: images differ from diffusers' by {d}");
    }
}

#[test]
fn seeds_reproduce_and_differ() {
    let sd = load();
    let mut opts = options(Sampler::Euler, 3.0);
    opts.images_per_prompt = 2;
    let a = sd.sample(&["a cat"], &opts, None).unwrap();
    let b = sd.sample(&["a cat"], &opts, None).unwrap();
    assert_eq!(a.size(), [2, 3, 16, 16]);
    assert!(a.equal(&b), "the same seed gives the same images");
    assert!((a.get(0) - a.get(1)).abs().max().double_value(&[]) > 1e-3, "two images per prompt differ");
    opts.seed = 1;
    let c = sd.sample(&["a cat"], &opts, None).unwrap();
    assert!((a - c).abs().max().double_value(&[]) > 1e-3, "another seed gives other images");
}

#[test]
fn bad_sizes_and_missing_files_are_named() {
    let sd = load();
    let mut opts = options(Sampler::Ddim, 7.5);
    opts.height = 18;
    let err = sd.sample(&["x"], &opts, None).unwrap_err().to_string();
    assert!(err.contains("--height 18") && err.contains("multiple of 4"), "{err}");

    let dir = std::env::temp_dir().join(format!("diffusion-sample-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join("broken");
    let status = Command::new("cp").args(["-r"]).arg(fixtures().join("pipeline")).arg(&copy).status().unwrap();
    assert!(status.success());
    std::fs::remove_file(copy.join("vae/diffusion_pytorch_model.fp16.safetensors")).unwrap();
    let err = StableDiffusion::load(&copy, Device::Cpu, Kind::Float).err().unwrap().to_string();
    assert!(err.contains("vae/diffusion_pytorch_model.safetensors") && err.contains("missing"), "{err}");
}

#[test]
fn the_command_writes_pngs() {
    let dir = std::env::temp_dir().join(format!("diffusion-sample-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.join("cat.png");
    let o = Command::new(env!("CARGO_BIN_EXE_diffusion"))
        .args(["sample", "--model"])
        .arg(fixtures().join("pipeline"))
        .args(["--prompt", "a cat", "--steps", "3", "--num-images", "2", "--scheduler", "euler", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{text}");
    for i in 0..2 {
        let path = dir.join(format!("cat-{i}.png"));
        let img = data::folder::decode(&path, 3).unwrap();
        assert_eq!((img.channels, img.height, img.width), (3, 16, 16), "{}", path.display());
    }
    assert!(text.contains("s per image"), "{text}");
}
