//! Sampling from a tiny diffusers pipeline folder (`fixtures/pipeline`, made by
//! `fixtures/make_pipeline_fixture.py`): images equal diffusers' `StableDiffusionPipeline`
//! for the same initial latents under every sampler with guidance (Euler ancestral also fed
//! the step noise diffusers drew), and under DDIM without guidance; `--scheduler` defaults to
//! the class the folder's scheduler config names; seeds reproduce; the command writes PNGs;
//! bad sizes, missing files and unsupported scheduler classes are named.
use std::path::{Path, PathBuf};
use std::process::Command;

use diffusion::pipeline::StableDiffusion;
use diffusion::sample::{GivenNoise, SampleOptions, Sampler};
use diffusion::unet::Conditioning;
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
        negative_prompt: None,
        height: 16,
        width: 16,
        sampler,
        images_per_prompt: 1,
        seed: 0,
        size_conditioning: None,
        negative_size_conditioning: None,
    }
}

#[test]
fn images_equal_diffusers_for_the_same_latents() {
    let sd = load();
    let reference: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(fixtures().join("pipeline_reference.safetensors")).unwrap().into_iter().collect();
    let prompts = prompts();
    let prompts: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let noise: Vec<Tensor> = reference["euler_a_noise"].unbind(0);
    let given = GivenNoise { latents: Some(&reference["latents"]), steps: Some(&noise) };
    let unet = |x: &Tensor, t: &Tensor, c: &Conditioning| sd.unet.forward_cond(x, t, c);
    let mut diffs = Vec::new();
    for (key, sampler, guidance) in [
        ("ddim", Sampler::Ddim, 7.5),
        ("euler", Sampler::Euler, 7.5),
        ("ddim_guidance_1", Sampler::Ddim, 1.0),
        ("euler_a", Sampler::EulerAncestral, 7.5),
        ("pndm", Sampler::Pndm, 7.5),
        ("dpm", Sampler::DpmSolver, 7.5),
        ("dpm_karras", Sampler::DpmSolverKarras, 7.5),
        ("unipc", Sampler::UniPc, 7.5),
    ] {
        let ours = sd.sample_given(&prompts, &options(sampler, guidance), given, &unet).unwrap();
        let d = differs_by(&ours, &reference[key]);
        // fp32 on both sides.
        assert!(d < 1e-4, "{key}: images differ from diffusers' by {d}");
        diffs.push((key, d));
    }
    eprintln!("max abs difference from diffusers' images: {diffs:?}");
}

/// The largest difference of images [B, 3, H, W] from diffusers' [B, H, W, 3].
fn differs_by(ours: &Tensor, theirs: &Tensor) -> f64 {
    (ours - theirs.permute([0, 3, 1, 2])).abs().max().double_value(&[])
}

/// A copy of the tiny pipeline, `pipe` in a scratch folder of its own (returned with it).
fn pipeline_copy(tag: &str) -> (suite_tests::Scratch, PathBuf) {
    let dir = suite_tests::scratch("diffusion-sample", tag);
    let copy = dir.join("pipe");
    let status = Command::new("cp").args(["-r"]).arg(fixtures().join("pipeline")).arg(&copy).status().unwrap();
    assert!(status.success());
    (dir, copy)
}

/// A copy of the tiny pipeline whose scheduler config is `config` (with its scratch folder).
fn pipeline_with_scheduler(tag: &str, config: &str) -> (suite_tests::Scratch, PathBuf) {
    let (dir, copy) = pipeline_copy(tag);
    std::fs::write(copy.join("scheduler/scheduler_config.json"), config).unwrap();
    (dir, copy)
}

#[test]
fn the_scheduler_defaults_to_the_class_the_folder_names() {
    let sd = load();
    assert_eq!(Sampler::default_for(&sd.scheduler).unwrap(), Sampler::Ddim);
    // SD 1.5's own file (PNDM, PLMS only) has the tiny pipeline's schedule.
    let sd15 = std::fs::read_to_string(fixtures().join("schedulers/sd15_pndm/scheduler_config.json")).unwrap();
    let (_pndm, folder) = pipeline_with_scheduler("pndm", &sd15);
    let sd = StableDiffusion::load(&folder, Device::Cpu, Kind::Float).unwrap();
    let sampler = Sampler::default_for(&sd.scheduler).unwrap();
    assert_eq!(sampler, Sampler::Pndm);
    let reference: std::collections::HashMap<String, Tensor> =
        Tensor::read_safetensors(fixtures().join("pipeline_reference.safetensors")).unwrap().into_iter().collect();
    let prompts = prompts();
    let prompts: Vec<&str> = prompts.iter().map(String::as_str).collect();
    let ours = sd.sample(&prompts, &options(sampler, 7.5), Some(&reference["latents"])).unwrap();
    let d = differs_by(&ours, &reference["pndm_plms"]);
    assert!(d < 1e-4, "SD 1.5's PNDM (PLMS) differs from diffusers' by {d}");
    eprintln!("SD 1.5 PNDM (PLMS) image: max abs difference from diffusers {d}");

    let run = |folder: &Path| {
        let o = Command::new(env!("CARGO_BIN_EXE_diffusion"))
            .args(["sample", "--model"])
            .arg(folder)
            .args(["--prompt", "a cat", "--steps", "4", "-o"])
            .arg(folder.with_file_name("cat.png"))
            .output()
            .unwrap();
        (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    };
    let (ok, text) = run(&folder);
    assert!(ok && text.contains("scheduler: pndm (PNDMScheduler)"), "{text}");
    let (_lms, lms) = pipeline_with_scheduler("lms", &sd15.replace("PNDMScheduler", "LMSDiscreteScheduler"));
    let (ok, text) = run(&lms);
    assert!(!ok && text.contains("scheduler/scheduler_config.json") && text.contains("LMSDiscreteScheduler"), "{text}");
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        match entry.file_type().unwrap().is_dir() {
            true => copy_tree(&entry.path(), &to.join(entry.file_name())),
            false => drop(std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap()),
        }
    }
}

/// The fixture pipeline as current diffusers saves it sharded (`save_pretrained(max_shard_size=
/// ...)`, an index per component) and as the fp16 variant only (`variant="fp16"`, the text
/// encoder's `model.fp16.safetensors` included): every component loads, with the weights of the
/// plain folder (rounded to fp16 for the variant). (`fixtures/make_layouts_fixture.py`)
#[test]
fn pipelines_in_every_weight_layout_load_the_same_weights() {
    let plain = load();
    let layouts = fixtures().join("layouts");
    let stores = |sd: &StableDiffusion| {
        [
            ("text_encoder", sd.text_encoder_vs.variables()),
            ("unet", sd.unet_vs.variables()),
            ("vae", sd.vae_vs.variables()),
        ]
    };
    for (layout, half) in [("sharded", false), ("fp16", true)] {
        let sd = StableDiffusion::load(&layouts.join(layout), Device::Cpu, Kind::Float)
            .unwrap_or_else(|e| panic!("{layout}: {e}"));
        for ((component, want), (_, got)) in stores(&plain).into_iter().zip(stores(&sd)) {
            assert_eq!(want.len(), got.len(), "{layout} {component}");
            for (name, w) in want {
                let w = if half { w.to_kind(Kind::Half).to_kind(Kind::Float) } else { w };
                assert!(got[&name].equal(&w), "{layout} {component}: {name}");
            }
        }
    }
    // Plain shards beside an fp16 variant file: the plain weights, as from_pretrained reads them.
    let mixed = suite_tests::scratch("diffusion-sample", "mixed");
    copy_tree(&layouts.join("sharded"), &mixed);
    let variant = "unet/diffusion_pytorch_model.fp16.safetensors";
    std::fs::copy(layouts.join("fp16").join(variant), mixed.join(variant)).unwrap();
    let sd = StableDiffusion::load(&mixed, Device::Cpu, Kind::Float).unwrap();
    let want = plain.unet_vs.variables();
    assert!(sd.unet_vs.variables().iter().all(|(k, t)| t.equal(&want[k])), "the plain shards, not the variant");
    // An index that leaves out a key of its shard, or names one the shard lacks, is named.
    let dir = suite_tests::scratch("diffusion-sample", "sharded");
    copy_tree(&layouts.join("sharded/unet"), &dir);
    let index_path = dir.join("diffusion_pytorch_model.safetensors.index.json");
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
    let read = |index: &serde_json::Value| {
        std::fs::write(&index_path, index.to_string()).unwrap();
        diffusion::weights::read(&index_path).map(|_| ()).unwrap_err().to_string()
    };
    let mut fewer = index.clone();
    fewer["weight_map"].as_object_mut().unwrap().remove("conv_in.bias");
    assert!(read(&fewer).contains("key conv_in.bias of shard"), "{}", read(&fewer));
    let mut more = index.clone();
    let shard = index["weight_map"]["conv_in.bias"].clone();
    more["weight_map"]["conv_in.extra"] = shard;
    assert!(read(&more).contains("key conv_in.extra is not in its shard"), "{}", read(&more));
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

    // Euler ancestral's step noise comes from the seed too: from the same latents the same
    // seed gives the same image, another seed another image.
    let mut opts = options(Sampler::EulerAncestral, 3.0);
    let latents = sd.initial_latents(1, &opts).unwrap();
    let a = sd.sample(&["a cat"], &opts, Some(&latents)).unwrap();
    assert!(a.equal(&sd.sample(&["a cat"], &opts, Some(&latents)).unwrap()));
    opts.seed = 7;
    let b = sd.sample(&["a cat"], &opts, Some(&latents)).unwrap();
    assert!((a - b).abs().max().double_value(&[]) > 1e-4, "the step noise follows the seed");
}

#[test]
fn bad_sizes_and_missing_files_are_named() {
    let sd = load();
    let mut opts = options(Sampler::Ddim, 7.5);
    opts.height = 18;
    let err = sd.sample(&["x"], &opts, None).unwrap_err().to_string();
    assert!(err.contains("--height 18") && err.contains("multiple of 4"), "{err}");
    opts.height = 8192;
    let err = sd.sample(&["x"], &opts, None).unwrap_err().to_string();
    assert!(err.contains("--height 8192: at most 4096 pixels"), "{err}");

    let (_broken, copy) = pipeline_copy("broken");
    std::fs::remove_file(copy.join("vae/diffusion_pytorch_model.fp16.safetensors")).unwrap();
    let err = StableDiffusion::load(&copy, Device::Cpu, Kind::Float).err().unwrap().to_string();
    assert!(err.contains("vae/diffusion_pytorch_model.safetensors") && err.contains("missing"), "{err}");

    // A tokenizer that does not fit its text encoder is named at load, with both files.
    let (_mismatched, copy) = pipeline_copy("mismatched");
    let config = copy.join("tokenizer/tokenizer_config.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    json["model_max_length"] = 200.into();
    std::fs::write(&config, json.to_string()).unwrap();
    let err = StableDiffusion::load(&copy, Device::Cpu, Kind::Float).err().unwrap().to_string();
    assert!(err.contains("tokenizer_config.json: model_max_length 200 exceeds max_position_embeddings"), "{err}");
    assert!(err.contains("text_encoder/config.json"), "{err}");
    std::fs::copy(fixtures().join("pipeline/tokenizer/tokenizer_config.json"), &config).unwrap();
    let vocab = copy.join("tokenizer/vocab.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&vocab).unwrap()).unwrap();
    json["zzz</w>"] = 5000.into();
    std::fs::write(&vocab, json.to_string()).unwrap();
    let err = StableDiffusion::load(&copy, Device::Cpu, Kind::Float).err().unwrap().to_string();
    assert!(err.contains("tokenizer: token ids reach 5000") && err.contains("has vocab_size 606"), "{err}");
}

#[test]
fn the_command_writes_pngs() {
    let dir = suite_tests::scratch("diffusion-sample", "cli");
    let out = dir.join("cat.png");
    let o = Command::new(env!("CARGO_BIN_EXE_diffusion"))
        .args(["sample", "--model"])
        .arg(fixtures().join("pipeline"))
        .args(["--prompt", "a cat", "--steps", "3", "--num-images", "2", "--scheduler", "euler-ancestral", "-o"])
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

    // A set that cannot be written whole is not written at all: with `cat-1.png` a folder,
    // the first image is removed again and the error says which image failed.
    std::fs::remove_file(dir.join("cat-0.png")).unwrap();
    std::fs::remove_file(dir.join("cat-1.png")).unwrap();
    std::fs::create_dir(dir.join("cat-1.png")).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_diffusion"))
        .args(["sample", "--model"])
        .arg(fixtures().join("pipeline"))
        .args(["--prompt", "a cat", "--steps", "1", "--num-images", "2", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && text.contains("writing image 2 of 2")
            && text.contains("the 1 written before it were removed"),
        "{text}"
    );
    assert!(!dir.join("cat-0.png").exists(), "a half set of images was left behind");
}

/// Sizes past `finetune --resolution`'s bound are refused by flag before anything is loaded
/// (a side of 100000 pixels aborted the process allocating the latents).
#[test]
fn sizes_past_the_bound_are_refused_by_flag() {
    let dir = suite_tests::scratch("diffusion-sample", "too-large");
    for (flag, sizes) in [("--size", &["--size", "100000"][..]), ("--width", &["--height", "4", "--width", "400000"])] {
        let o = Command::new(env!("CARGO_BIN_EXE_diffusion"))
            .args(["sample", "--model"])
            .arg(fixtures().join("pipeline"))
            .args(["--prompt", "a cat", "--steps", "1"])
            .args(sizes)
            .arg("-o")
            .arg(dir.join("big.png"))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{text}");
        assert!(text.contains(&format!("for '{flag} <")) && text.contains("must be from 1 to 4096"), "{text}");
    }
}

#[test]
fn the_command_adds_a_lora_file() {
    use diffusion::lora::{Lora, LORA_WEIGHTS};
    let dir = suite_tests::scratch("diffusion-sample", "lora");
    let sd = load();
    let lora = Lora::new(&sd.unet, &sd.unet_vs, 2, 2.0, 4, Device::Cpu).unwrap();
    for p in lora.params().iter().filter(|p| p.name.ends_with(".up.weight")) {
        tch::no_grad(|| p.tensor.detach().copy_(&(Tensor::randn_like(&p.tensor) * 0.5)));
    }
    lora.save(&dir).unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let o = Command::new(env!("CARGO_BIN_EXE_diffusion"))
            .args(["sample", "--model"])
            .arg(fixtures().join("pipeline"))
            .args(["--prompt", "a cat", "--steps", "2", "--scheduler", "euler"])
            .args(extra)
            .arg("-o")
            .arg(&out)
            .output()
            .unwrap();
        let text = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        (o.status.success(), text, out)
    };
    let file = dir.join(LORA_WEIGHTS);
    let file = file.to_str().unwrap();
    let (ok, text, plain) = run("plain.png", &[]);
    assert!(ok, "{text}");
    let (ok, text, none) = run("none.png", &["--lora", file, "--lora-scale", "0"]);
    assert!(ok && text.contains("32 projections adapted"), "{text}");
    let (ok, text, adapted) = run("adapted.png", &["--lora", file]);
    assert!(ok, "{text}");
    let pixels = |p: &Path| data::folder::decode(p, 3).unwrap().pixels;
    assert_eq!(pixels(&plain), pixels(&none), "scale 0 samples the base model");
    assert_ne!(pixels(&plain), pixels(&adapted), "the adapters change the image");
    let (ok, text, _) = run("bad.png", &["--lora", dir.join("missing.safetensors").to_str().unwrap()]);
    assert!(!ok && text.contains("--lora") && text.contains("missing.safetensors"), "{text}");
    // Integer adapters are a damaged file, not values to cast.
    let ints: Vec<(String, Tensor)> =
        Tensor::read_safetensors(file).unwrap().into_iter().map(|(k, t)| (k, t.to_kind(tch::Kind::Int))).collect();
    let int_file = dir.join("ints.safetensors");
    Tensor::write_safetensors(&ints, &int_file).unwrap();
    let (ok, text, _) = run("ints.png", &["--lora", int_file.to_str().unwrap()]);
    assert!(!ok && text.contains("ints.safetensors") && text.contains("holds Int values"), "{text}");
    let (ok, text, _) = run("nan.png", &["--lora", file, "--lora-scale", "nan"]);
    assert!(!ok && text.contains("--lora-scale"), "{text}");
    // Adapters of NaN make NaN pixels: an error, not a black PNG.
    let nans: Vec<(String, Tensor)> =
        Tensor::read_safetensors(file).unwrap().into_iter().map(|(k, t)| (k, t.full_like(f64::NAN))).collect();
    let nan_file = dir.join("nans.safetensors");
    Tensor::write_safetensors(&nans, &nan_file).unwrap();
    let (ok, text, out) = run("nans.png", &["--lora", nan_file.to_str().unwrap()]);
    assert!(!ok && text.contains("NaN or infinite pixels") && !out.exists(), "{text}");
    // A prompt past CLIP's length is truncated, as in diffusers, with a warning saying so.
    let long = ["a cat"; 60].join(" and ");
    let (ok, text, _) = run("long.png", &["--prompt", &long]);
    assert!(ok && text.contains("warning: prompt 2 has") && text.contains("are dropped"), "{text}");
}
