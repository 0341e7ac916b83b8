//! `diffusion convert` against diffusers (fixtures of `fixtures/make_convert_fixtures.py`: tiny
//! random SD 1.x- and SD 2.x-shaped models): a single file converts to the folder diffusers'
//! `from_single_file` makes of it (SD 2.x's fused OpenCLIP attention split, its last layer and
//! contrastive head left out), a folder converts to the single file diffusers' conversion script
//! writes, the round trip is exact, the shipped configs and tokenizer are valid, LoRA adapters
//! convert to kohya's names, and bad input is named.
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use diffusion::config::{read_json, UNetConfig, UNetConfigFile, VaeConfig, VaeConfigFile};
use diffusion::scheduler::{PredictionType, SchedulerFile};
use diffusion::single_file::{lora_to_kohya, to_diffusers, to_single_file, Base, Configs};
use diffusion::tokenizer::ClipTokenizer;
use tch::{Device, Kind, Tensor};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn convert_fixture(v: &str) -> PathBuf {
    fixtures().join("convert").join(v)
}

fn scratch(name: &str) -> suite_tests::Scratch {
    suite_tests::scratch("diffusion-convert", name)
}

fn read(path: &Path) -> HashMap<String, Tensor> {
    data::checkpoint::read_tensors(path).unwrap_or_else(|e| panic!("{e}"))
}

/// The text encoder's tensors under transformers 4's names, whichever layout the file has.
fn text_encoder(folder: &Path) -> HashMap<String, Tensor> {
    read(&folder.join("text_encoder/model.safetensors"))
        .into_iter()
        .map(|(k, t)| if k.starts_with("text_model.") { (k, t) } else { (format!("text_model.{k}"), t) })
        .collect()
}

/// Asserts equal key sets and bit-identical tensors (dtype included); returns the count.
fn assert_same(ours: &HashMap<String, Tensor>, theirs: &HashMap<String, Tensor>, what: &str) -> usize {
    let mut a: Vec<&String> = ours.keys().collect();
    let mut b: Vec<&String> = theirs.keys().collect();
    a.sort();
    b.sort();
    assert_eq!(a, b, "{what}: key sets differ");
    for (k, t) in theirs {
        let o = &ours[k];
        assert_eq!(o.kind(), t.kind(), "{what}: {k} dtype");
        assert!(o.equal(t), "{what}: {k} differs");
    }
    theirs.len()
}

fn component_files(folder: &Path) -> Vec<(&'static str, PathBuf)> {
    vec![
        ("unet", folder.join("unet/diffusion_pytorch_model.safetensors")),
        ("vae", folder.join("vae/diffusion_pytorch_model.safetensors")),
    ]
}

/// Our folder from the single file of `v` equals diffusers' `from_single_file` folder.
fn single_file_converts_as_diffusers_does(v: &str) {
    let out_scratch = scratch(&format!("{v}-to-diffusers"));
    let out = out_scratch.join("model");
    let configs = Configs::Folder(convert_fixture(v).join("configs"));
    let done = to_diffusers(&convert_fixture(v).join("single_file.safetensors"), &configs, &out).unwrap();
    let expected = convert_fixture(v).join("diffusers");
    let mut n = 0;
    for ((name, ours), (_, theirs)) in component_files(&out).into_iter().zip(component_files(&expected)) {
        n += assert_same(&read(&ours), &read(&theirs), name);
    }
    n += assert_same(&text_encoder(&out), &text_encoder(&expected), "text_encoder");
    assert_eq!(done.tensors, n);
    assert!(done.base.is_none());
}

#[test]
fn sd1_single_file_converts_as_diffusers_does() {
    single_file_converts_as_diffusers_does("sd1");
}

#[test]
fn sd2_single_file_converts_as_diffusers_does() {
    single_file_converts_as_diffusers_does("sd2");
    // The file has one OpenCLIP layer more than the encoder diffusers builds.
    let file = read(&convert_fixture("sd2/single_file.safetensors"));
    let layers = |keys: Vec<&String>, pat: &str| {
        keys.iter().filter_map(|k| k.split(pat).nth(1)?.split('.').next()?.parse::<usize>().ok()).max().unwrap() + 1
    };
    let in_file = layers(file.keys().collect(), "resblocks.");
    let te = text_encoder(&convert_fixture("sd2/diffusers"));
    assert_eq!(layers(te.keys().collect(), "encoder.layers."), in_file - 1);
}

/// Our single file from diffusers' folder of `v` equals what diffusers' script writes.
fn folder_converts_as_the_script_does(v: &str) {
    let out_scratch = scratch(&format!("{v}-to-single"));
    let out = out_scratch.join("model.safetensors");
    let n = to_single_file(&convert_fixture(v).join("diffusers"), &out, false).unwrap();
    let theirs = read(&convert_fixture(v).join("script.safetensors"));
    assert_eq!(assert_same(&read(&out), &theirs, "single file"), n);
}

#[test]
fn sd1_folder_converts_as_the_script_does() {
    folder_converts_as_the_script_does("sd1");
}

#[test]
fn sd2_folder_converts_as_the_script_does() {
    folder_converts_as_the_script_does("sd2");
}

/// folder -> single file -> folder gives back every tensor bit for bit.
#[test]
fn folder_to_single_file_and_back_is_exact() {
    for v in ["sd1", "sd2"] {
        let dir = scratch(&format!("{v}-round-trip"));
        let folder = convert_fixture(v).join("diffusers");
        to_single_file(&folder, &dir.join("one.safetensors"), false).unwrap();
        // transformers 5 saved the folder's tokenizer as tokenizer.json alone, which the
        // tokenizer here does not read: the configs come from the folder it was made with.
        let configs = Configs::Folder(convert_fixture(v).join("configs"));
        to_diffusers(&dir.join("one.safetensors"), &configs, &dir.join("back")).unwrap();
        for ((name, ours), (_, theirs)) in component_files(&dir.join("back")).into_iter().zip(component_files(&folder))
        {
            assert_same(&read(&ours), &read(&theirs), name);
        }
        assert_same(&text_encoder(&dir.join("back")), &text_encoder(&folder), "text_encoder");
    }
}

#[test]
fn half_stores_fp16() {
    let out_scratch = scratch("half");
    let out = out_scratch.join("model.safetensors");
    // The SD 1.x fixture folder of the sampling tests stores fp32 text-encoder weights.
    to_single_file(&fixtures().join("pipeline"), &out, true).unwrap();
    let file = read(&out);
    assert!(file.values().all(|t| t.kind() == Kind::Half));
    assert!(file.contains_key("cond_stage_model.transformer.text_model.final_layer_norm.weight"));
}

/// The shipped configs are valid, fit together, and the tokenizer built from the shipped
/// merges gives open_clip's ids (fixture `convert/clip_ids.json`).
#[test]
fn shipped_configs_and_tokenizer() {
    let ids: HashMap<String, Vec<i64>> = read_json(&fixtures().join("convert/clip_ids.json")).unwrap();
    for (base, hidden, prediction, pad) in [
        (Base::Sd1, 768, PredictionType::Epsilon, 49407),
        (Base::Sd2Base, 1024, PredictionType::Epsilon, 0),
        (Base::Sd2V, 1024, PredictionType::VPrediction, 0),
    ] {
        let dir = scratch(base.name());
        base.write_configs(&dir).unwrap();
        let unet_path = dir.join("unet/config.json");
        let unet = UNetConfig::new(&read_json::<UNetConfigFile>(&unet_path).unwrap(), &unet_path).unwrap();
        assert_eq!(unet.cross_attention_dim, hidden, "{}", base.name());
        assert_eq!(unet.use_linear_projection, base.open_clip());
        let vae_path = dir.join("vae/config.json");
        VaeConfig::new(&read_json::<VaeConfigFile>(&vae_path).unwrap(), &vae_path).unwrap();
        let text = diffusion::clip::ClipTextConfig::from_file(&dir.join("text_encoder/config.json")).unwrap();
        assert_eq!(text.hidden_size, hidden);
        assert_eq!(text.num_layers, if base.open_clip() { 23 } else { 12 });
        let scheduler = SchedulerFile::read(&dir.join("scheduler/scheduler_config.json")).unwrap();
        let class = scheduler.class().unwrap();
        assert_eq!(scheduler.config(class).unwrap().prediction_type, prediction, "{}", base.name());
        diffusion::config::check_model_index(&dir.join("model_index.json"), "scheduler", &class.to_string()).unwrap();
        let tok = ClipTokenizer::from_diffusers(&dir).unwrap();
        assert_eq!(tok.vocab_size(), 49408);
        assert_eq!(tok.pad_id(), pad);
        // SD 2.x pads with `!`, a special token split out of the text ("!!" becomes two
        // tokens), so open_clip's ids are compared under SD 1.x's special tokens; the vocabulary
        // and merges are the same files for every base.
        for (prompt, want) in ids.iter().filter(|_| !base.open_clip()) {
            let mut got = tok.encode(prompt).ids;
            got.truncate(want.len());
            assert_eq!(&got, want, "{prompt:?}");
        }
    }
}

#[test]
fn bad_input_is_named_and_nothing_is_written() {
    let dir = scratch("bad");
    let single = convert_fixture("sd2/single_file.safetensors");
    let configs = Configs::Folder(convert_fixture("sd2/configs"));
    let mut tensors: Vec<(String, Tensor)> = Tensor::read_safetensors(&single).unwrap();
    let copy =
        |t: &[(String, Tensor)]| -> Vec<(String, Tensor)> { t.iter().map(|(k, v)| (k.clone(), v.copy())).collect() };
    let save = |name: &str, t: &[(String, Tensor)]| {
        let p = dir.join(name);
        data::checkpoint::save_tensors(t, &p).unwrap();
        p
    };
    let expect_err = |file: &Path, configs: &Configs, needles: &[&str]| {
        let out = dir.join("out");
        let err = to_diffusers(file, configs, &out).unwrap_err().to_string();
        for n in needles {
            assert!(err.contains(n), "{err:?} lacks {n:?}");
        }
        assert!(!out.exists(), "nothing written after {err}");
        let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().flatten().filter(|e| e.path().is_dir()).collect();
        assert!(leftovers.is_empty(), "staging left behind: {leftovers:?}");
    };

    // A fused projection that does not split in three.
    let key = "cond_stage_model.model.transformer.resblocks.0.attn.in_proj_bias";
    let mut odd = copy(&tensors);
    odd.iter_mut().find(|(k, _)| k == key).unwrap().1 = Tensor::zeros([47], (Kind::Half, Device::Cpu));
    expect_err(&save("odd_qkv.safetensors", &odd), &configs, &["odd_qkv.safetensors", key, "query, key and value"]);

    // An unknown OpenCLIP key.
    let mut extra = copy(&tensors);
    extra.push(("cond_stage_model.model.visual.proj".into(), Tensor::zeros([2], (Kind::Half, Device::Cpu))));
    expect_err(
        &save("extra.safetensors", &extra),
        &configs,
        &["extra.safetensors", "cond_stage_model.model.visual.proj"],
    );

    // A key under input_blocks.0 that is not conv_in has no name (its block index once wrapped).
    let mut wrapped = copy(&tensors);
    wrapped
        .push(("model.diffusion_model.input_blocks.0.1.weight".into(), Tensor::zeros([2], (Kind::Half, Device::Cpu))));
    expect_err(
        &save("wrapped.safetensors", &wrapped),
        &configs,
        &["input_blocks.0.1.weight has no diffusers equivalent"],
    );

    // Two keys for one diffusers name (SD 1's text encoder under both of its layouts): named,
    // not a panic of the writer.
    let sd1: Vec<(String, Tensor)> = Tensor::read_safetensors(convert_fixture("sd1/single_file.safetensors")).unwrap();
    let prefixed = "cond_stage_model.transformer.text_model.";
    let (key, t) = sd1
        .iter()
        .find(|(k, _)| k.starts_with(prefixed) && !k.ends_with("position_ids"))
        .map(|(k, t)| (k.clone(), t.copy()))
        .unwrap();
    let alias = key.replace(prefixed, "cond_stage_model.transformer.");
    let mut twice = copy(&sd1);
    twice.push((alias.clone(), t));
    let sd1_configs = Configs::Folder(convert_fixture("sd1/configs"));
    expect_err(&save("twice.safetensors", &twice), &sd1_configs, &[&key, &alias, "both convert to text_encoder's"]);

    // OpenCLIP blocks past the config's layers: only SD 2's last one is dropped, as diffusers
    // drops it; any other is an error, not silently lost.
    let fewer_scratch = scratch("fewer-layers");
    let fewer = fewer_scratch.join("configs");
    assert!(Command::new("cp").arg("-r").arg(convert_fixture("sd2/configs")).arg(&fewer).status().unwrap().success());
    let text_config = fewer.join("text_encoder/config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&text_config).unwrap()).unwrap();
    cfg["num_hidden_layers"] = (cfg["num_hidden_layers"].as_i64().unwrap() - 1).into();
    std::fs::write(&text_config, cfg.to_string()).unwrap();
    expect_err(&single, &Configs::Folder(fewer), &["past the text encoder config's num_hidden_layers"]);

    // A missing UNet key: the converted folder does not load, the key is named.
    let missing = "model.diffusion_model.out.2.weight";
    tensors.retain(|(k, _)| k != missing);
    expect_err(
        &save("missing.safetensors", &tensors),
        &configs,
        &["missing.safetensors", "out/unet", "conv_out.weight"],
    );

    // A base that does not fit the text encoder.
    expect_err(&single, &Configs::Shipped(Some(Base::Sd1)), &["--base sd1", "OpenCLIP"]);

    // Not a safetensors file at all.
    let junk = dir.join("junk.safetensors");
    std::fs::write(&junk, b"not a checkpoint").unwrap();
    expect_err(&junk, &configs, &["junk.safetensors"]);
    // PyTorch's pickles (torch.save's zip archive, the older bare pickle) and a folder are
    // named for what they are, not as safetensors headers of absurd lengths.
    for (name, head) in
        [("zip.ckpt", &b"PK\x03\x04\x00\x00\x08\x00"[..]), ("legacy.ckpt", &b"\x80\x02\x8a\x0al\xfc\x9cF"[..])]
    {
        let pickle = dir.join(name);
        std::fs::write(&pickle, [head, &[0u8; 300][..]].concat()).unwrap();
        expect_err(&pickle, &configs, &[name, "a PyTorch pickle checkpoint", "takes .safetensors files", "save_file"]);
    }
    let folder_given = scratch("folder-given");
    expect_err(&folder_given, &configs, &["folder-given", "is a directory", "--checkpoint takes a single file"]);

    // An existing output is left alone.
    let out = dir.join("exists");
    std::fs::create_dir_all(&out).unwrap();
    let err = to_diffusers(&single, &configs, &out).unwrap_err().to_string();
    assert!(err.contains("exists"), "{err}");
    std::fs::remove_dir_all(&out).unwrap();

    // A donor folder whose config does not parse is named (not the removed staging copy).
    let donor_scratch = scratch("bad-donor");
    let donor = donor_scratch.join("configs");
    assert!(Command::new("cp").arg("-r").arg(convert_fixture("sd2/configs")).arg(&donor).status().unwrap().success());
    std::fs::write(donor.join("unet/config.json"), "{ not json").unwrap();
    expect_err(&single, &Configs::Folder(donor.clone()), &[&donor.join("unet/config.json").display().to_string()]);

    // Back to one file: a VAE key with no single-file name.
    let folder = dir.join("folder");
    to_diffusers(&single, &configs, &folder).unwrap();
    let vae = folder.join("vae/diffusion_pytorch_model.safetensors");
    let mut vt: Vec<(String, Tensor)> = read(&vae).into_iter().collect();
    vt.push(("decoder.extra.weight".into(), Tensor::zeros([2], (Kind::Half, Device::Cpu))));
    data::checkpoint::save_tensors(&vt, &vae).unwrap();
    let target = dir.join("single.safetensors");
    let err = to_single_file(&folder, &target, false).unwrap_err().to_string();
    assert!(err.contains("diffusion_pytorch_model.safetensors") && err.contains("decoder.extra.weight"), "{err}");
    assert!(!target.exists());
    // The single file is safetensors, under a new name: another extension (a `.ckpt` would be
    // unpickled by other tools) or an existing file is refused, and nothing is written.
    for name in ["single.ckpt", "single"] {
        let err = to_single_file(&folder, &dir.join(name), false).unwrap_err().to_string();
        assert!(err.contains(name) && err.contains("name it <name>.safetensors"), "{err}");
        assert!(!dir.join(name).exists());
    }
    std::fs::write(&target, b"keep me").unwrap();
    let err = to_single_file(&folder, &target, false).unwrap_err().to_string();
    assert!(err.contains("single.safetensors exists"), "{err}");
    assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
    std::fs::remove_file(&target).unwrap();
    // An output inside the folder would overwrite what it converts.
    let err = to_single_file(&folder, &folder.join("unet/diffusion_pytorch_model.safetensors"), false).unwrap_err();
    assert!(err.to_string().contains("is inside the folder being converted"), "{err}");
    // A folder that does not load (a UNet weight missing) is named, not renamed into a file
    // that no tool can load back.
    vt.retain(|(k, _)| k != "decoder.extra.weight");
    data::checkpoint::save_tensors(&vt, &vae).unwrap();
    let unet = folder.join("unet/diffusion_pytorch_model.safetensors");
    let ut: Vec<(String, Tensor)> = read(&unet).into_iter().filter(|(k, _)| k != "conv_in.bias").collect();
    data::checkpoint::save_tensors(&ut, &unet).unwrap();
    let err = to_single_file(&folder, &target, false).unwrap_err().to_string();
    assert!(
        err.contains("unet/diffusion_pytorch_model.safetensors") && err.contains("missing key conv_in.bias"),
        "{err}"
    );
    assert!(!target.exists());
}

#[test]
fn lora_converts_to_kohya_names_with_alpha() {
    let dir = scratch("kohya");
    let rank = 2;
    let mut named = vec![];
    let modules = [
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q",
        "up_blocks.1.attentions.0.transformer_blocks.0.attn2.to_out.0",
    ];
    for (i, m) in modules.iter().enumerate() {
        tch::manual_seed(i as i64);
        named.push((format!("unet.{m}.lora.down.weight"), Tensor::randn([rank, 8], (Kind::Float, Device::Cpu))));
        named.push((format!("unet.{m}.lora.up.weight"), Tensor::randn([16, rank], (Kind::Float, Device::Cpu))));
    }
    let lora = dir.join(diffusion::lora::LORA_WEIGHTS);
    data::checkpoint::save_tensors(&named, &lora).unwrap();
    let out = dir.join("kohya.safetensors");
    assert_eq!(lora_to_kohya(&lora, &out).unwrap(), 2);
    let ours: HashMap<String, Tensor> = named.into_iter().collect();
    let kohya = read(&out);
    assert_eq!(kohya.len(), 6);
    for m in modules {
        let k = format!("lora_unet_{}", m.replace('.', "_"));
        let alpha = kohya[&format!("{k}.alpha")].double_value(&[]);
        let (down, up) = (&kohya[&format!("{k}.lora_down.weight")], &kohya[&format!("{k}.lora_up.weight")]);
        // kohya's loaders add (alpha / rank) * up @ down; diffusers' file means up @ down.
        let delta = up.matmul(down) * (alpha / rank as f64);
        let want = ours[&format!("unet.{m}.lora.up.weight")].matmul(&ours[&format!("unet.{m}.lora.down.weight")]);
        assert!(delta.equal(&want), "{k}");
    }

    let half: Vec<(String, Tensor)> =
        read(&lora).into_iter().filter(|(k, _)| !k.ends_with("to_q.lora.up.weight")).collect();
    let broken = dir.join("broken.safetensors");
    data::checkpoint::save_tensors(&half, &broken).unwrap();
    let err = lora_to_kohya(&broken, &dir.join("k2.safetensors")).unwrap_err().to_string();
    assert!(err.contains("broken.safetensors") && err.contains("attn1.to_q.lora.up.weight"), "{err}");
    assert!(!dir.join("k2.safetensors").exists());
    // Only to a new .safetensors file: not over the kohya file written above, nor another name.
    let err = lora_to_kohya(&lora, &out).unwrap_err().to_string();
    assert!(err.contains("kohya.safetensors exists"), "{err}");
    assert_eq!(read(&out).len(), 6, "the existing file is left as it was");
    let err = lora_to_kohya(&lora, &dir.join("kohya.bin")).unwrap_err().to_string();
    assert!(err.contains("kohya.bin") && err.contains(".safetensors"), "{err}");
    assert!(!dir.join("kohya.bin").exists());
}
