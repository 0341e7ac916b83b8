//! Stable Diffusion XL against diffusers on the tiny SDXL-shaped pipeline of
//! `fixtures/sdxl` (written by `fixtures/make_sdxl_fixture.py`, references in
//! `fixtures/sdxl_reference.safetensors`): the UNet with its text-time embedding and per-block
//! transformer depth, both text encoders (penultimate states, pooled projection), the prompt
//! conditioning and a 3-step Euler loop of `StableDiffusionXLPipeline`, and one fine-tuning step
//! of `train_text_to_image_sdxl.py` under Gemini and one LoRA step of
//! `train_text_to_image_lora_sdxl.py` (peft's adapters; references by
//! `fixtures/make_sdxl_lora_fixture.py`); the command fine-tunes (full and LoRA) and samples;
//! single files convert both ways; folders that do not fit together are named errors.
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{finetune, write_images, SMALL_RUN};
use diffusion::finetune::{gemini_config, loss, Batch, Draws, GeminiParts, UnetParams};
use diffusion::pipeline::{SizeConditioning, StableDiffusion};
use diffusion::sample::{GivenNoise, SampleOptions, Sampler};
use diffusion::scheduler::{DdpmScheduler, SchedulerClass};
use diffusion::unet::{Conditioning, TextTime};
use engine::gemini::{CpuRule, Event, Gemini, Placement};
use engine::optim::AdamWConfig;
use suite_tests::assert_close;
use tch::{Device, Kind, Tensor};

const PROMPTS: [&str; 2] = ["a photo of an astronaut riding a horse", "portrait of a cat wearing a hat"];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn folder() -> PathBuf {
    fixtures().join("sdxl")
}

fn reference() -> HashMap<String, Tensor> {
    data::checkpoint::read_tensors(&fixtures().join("sdxl_reference.safetensors")).unwrap()
}

fn load() -> StableDiffusion {
    StableDiffusion::load(&folder(), Device::Cpu, Kind::Float).unwrap()
}

/// A fresh folder under the system temp dir for one test.
fn scratch(test: &str) -> suite_tests::Scratch {
    suite_tests::scratch("diffusion-sdxl", test)
}

fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[test]
fn unet_with_text_time_embedding_and_deep_transformers_matches_diffusers() {
    let sd = load();
    let cfg = sd.unet.config();
    assert_eq!((cfg.down_depth.clone(), cfg.up_depth.clone()), (vec![1, 1, 2], vec![2, 1, 1]));
    let r = reference();
    let cond = Conditioning {
        context: r["unet_context"].shallow_clone(),
        text_time: Some(TextTime {
            text_embeds: r["unet_text_embeds"].shallow_clone(),
            time_ids: r["unet_time_ids"].shallow_clone(),
        }),
    };
    let out = tch::no_grad(|| sd.unet.forward_cond(&r["unet_sample"], &r["unet_timesteps"], &cond)).unwrap();
    assert_close(&out, &r["unet_out"], 0.0, 1e-4, "SDXL UNet output");
    // Without the added conditions the text-time UNet refuses, rather than dropping them.
    let err = sd.unet.forward(&r["unet_sample"], &r["unet_timesteps"], &r["unet_context"]).unwrap_err().to_string();
    assert!(err.contains("needs text_embeds and time_ids"), "{err}");
    let short = Conditioning {
        context: r["unet_context"].shallow_clone(),
        text_time: Some(TextTime {
            text_embeds: r["unet_text_embeds"].narrow(1, 0, 8),
            time_ids: r["unet_time_ids"].shallow_clone(),
        }),
    };
    let err = sd.unet.forward_cond(&r["unet_sample"], &r["unet_timesteps"], &short).unwrap_err().to_string();
    assert!(err.contains("projection_class_embeddings_input_dim 36"), "{err}");
}

#[test]
fn both_text_encoders_and_the_prompt_conditioning_match_transformers() {
    let sd = load();
    let r = reference();
    let second = sd.text_encoder_2.as_ref().expect("SDXL has text_encoder_2");
    let (ids_1, _) = sd.tokenizer.encode_batch(&PROMPTS, Device::Cpu).unwrap();
    let (ids_2, _) = second.tokenizer.encode_batch(&PROMPTS, Device::Cpu).unwrap();
    assert!(ids_1.equal(&r["text_1_ids"].to_kind(Kind::Int64)), "tokenizer ids");
    // tokenizer_2 pads with "!" (id 0), as SDXL's.
    assert!(ids_2.equal(&r["text_2_ids"].to_kind(Kind::Int64)), "tokenizer_2 ids");
    assert_eq!(ids_2.int64_value(&[0, 76]), 0);
    tch::no_grad(|| {
        let (last_1, pen_1) = sd.text_encoder.forward_penultimate(&ids_1).unwrap();
        assert_close(&last_1, &r["text_1_last"], 0.0, 1e-5, "encoder 1 last_hidden_state");
        assert_close(&pen_1, &r["text_1_penultimate"], 0.0, 1e-5, "encoder 1 hidden_states[-2]");
        let (last_2, pen_2) = second.model.forward_penultimate(&ids_2).unwrap();
        assert_close(&pen_2, &r["text_2_penultimate"], 0.0, 1e-5, "encoder 2 hidden_states[-2]");
        let pooled = second.model.text_embeds(&ids_2, &last_2).unwrap();
        assert_close(&pooled, &r["text_2_pooled"], 0.0, 1e-5, "encoder 2 text_embeds");
        assert!(sd.text_encoder.text_embeds(&ids_1, &last_1).is_err(), "encoder 1 has no projection");
    });
    let cond = sd.encode(&PROMPTS, &[SizeConditioning::uncropped(16, 16)]).unwrap();
    assert_close(&cond.context, &r["embeds_zero_prompt"], 0.0, 1e-5, "encode_prompt's prompt_embeds");
    let tt = cond.text_time.unwrap();
    assert_close(&tt.text_embeds, &r["embeds_zero_pooled"], 0.0, 1e-5, "encode_prompt's pooled_prompt_embeds");
    assert_eq!(Vec::<f32>::try_from(tt.time_ids.get(1)).unwrap(), [16.0, 16.0, 0.0, 0.0, 16.0, 16.0]);
    let negative = sd.encode(&["blurry, low quality"; 2], &[SizeConditioning::uncropped(16, 16)]).unwrap();
    assert_close(&negative.context, &r["embeds_neg_negative"], 0.0, 1e-5, "negative_prompt_embeds");
    let pooled = &negative.text_time.unwrap().text_embeds;
    assert_close(pooled, &r["embeds_neg_negative_pooled"], 0.0, 1e-5, "negative_pooled_prompt_embeds");
    assert_eq!(r["embeds_zero_negative"].abs().max().double_value(&[]), 0.0, "diffusers zeroes the empty negative");
}

#[test]
fn euler_sampling_equals_the_sdxl_pipeline() {
    let sd = load();
    assert!(sd.force_zeros_for_empty_prompt);
    let r = reference();
    let runs = [
        ("zero", None, None),
        (
            "neg",
            Some("blurry, low quality".to_string()),
            Some(SizeConditioning { original: (32, 24), crop_top_left: (2, 4), target: (16, 16) }),
        ),
    ];
    for (name, negative_prompt, size_conditioning) in runs {
        let opts = SampleOptions {
            steps: 3,
            guidance: 5.0,
            negative_prompt,
            height: 16,
            width: 16,
            sampler: Sampler::default_for(&sd.scheduler).unwrap(),
            images_per_prompt: 1,
            seed: 0,
            size_conditioning,
            negative_size_conditioning: None,
        };
        assert_eq!(opts.sampler, Sampler::Euler);
        let given = GivenNoise { latents: Some(&r["sample_latents"]), steps: None };
        let unet = |x: &Tensor, t: &Tensor, c: &Conditioning| sd.unet.forward_cond(x, t, c);
        let images = sd.sample_given(&PROMPTS, &opts, given, &unet).unwrap();
        let theirs = r[&format!("sample_{name}_images")].permute([0, 3, 1, 2]);
        let d = (&images - &theirs).abs().max().double_value(&[]);
        // fp32 on both sides.
        assert!(d < 1e-4, "{name}: images differ from diffusers' by {d}");
    }
    // The two runs' conditioning differ, so the comparison above tells them apart.
    let (a, b) = (&r["sample_zero_images"], &r["sample_neg_images"]);
    assert!((a - b).abs().max().double_value(&[]) > 1e-3);
}

#[test]
fn negative_size_conditioning_equals_the_sdxl_pipeline() {
    let sd = load();
    let r = reference();
    let theirs = data::checkpoint::read_tensors(&fixtures().join("sdxl_negative_size_reference.safetensors")).unwrap();
    let sizes = SizeConditioning { original: (32, 24), crop_top_left: (2, 4), target: (16, 16) };
    let negative = SizeConditioning { original: (12, 20), crop_top_left: (1, 3), target: (8, 8) };
    let unet = |x: &Tensor, t: &Tensor, c: &Conditioning| sd.unet.forward_cond(x, t, c);
    let sample = |prompts: &[&str], negative_prompt: Option<&str>, latents: &Tensor| {
        let opts = SampleOptions {
            steps: 3,
            guidance: 5.0,
            negative_prompt: negative_prompt.map(str::to_string),
            height: 16,
            width: 16,
            sampler: Sampler::Euler,
            images_per_prompt: 1,
            seed: 0,
            size_conditioning: Some(sizes),
            negative_size_conditioning: Some(negative),
        };
        sd.sample_given(prompts, &opts, GivenNoise { latents: Some(latents), steps: None }, &unet).unwrap()
    };
    // With a negative prompt, and with the zeroed negative of force_zeros_for_empty_prompt.
    let first = r["sample_latents"].narrow(0, 0, 1);
    for (name, negative_prompt) in [("negsize", Some("blurry, low quality")), ("negsize_zero", None)] {
        let images = sample(&PROMPTS[..1], negative_prompt, &first);
        let d =
            (&images - theirs[&format!("sample_{name}_images")].permute([0, 3, 1, 2])).abs().max().double_value(&[]);
        assert!(d < 1e-4, "{name}: images differ from diffusers' by {d}");
    }
    // The negative sizes matter: without them that image is the reference's `sample_neg`.
    let without = (&theirs["sample_negsize_images"] - r["sample_neg_images"].narrow(0, 0, 1)).abs();
    assert!(without.max().double_value(&[]) > 1e-3);
    // Every negative row takes the negative sizes (diffusers alternates the rows; see the
    // fixture script): two prompts together are each prompt alone.
    let both = sample(&PROMPTS, Some("blurry, low quality"), &r["sample_latents"]);
    let second = sample(&PROMPTS[1..], Some("blurry, low quality"), &r["sample_latents"].narrow(0, 1, 1));
    let d = (both.narrow(0, 1, 1) - second).abs().max().double_value(&[]);
    assert!(d < 1e-5, "the second prompt in a batch against alone: {d}");
}

/// The fine-tuning step's inputs from the reference: pixels, captions, time ids and draws.
fn training_batch(r: &HashMap<String, Tensor>) -> (Batch, Draws) {
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("sdxl_train.json")).unwrap()).unwrap();
    let captions = meta["captions"].as_array().unwrap().iter().map(|c| c.as_str().unwrap().to_string()).collect();
    let ids: Vec<f32> = Vec::try_from(r["train_time_ids"].flatten(0, -1)).unwrap();
    let sizes = ids
        .chunks(6)
        .map(|v| {
            let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
            SizeConditioning { original: (v[0], v[1]), crop_top_left: (v[2], v[3]), target: (v[4], v[5]) }
        })
        .collect();
    let batch = Batch { pixels: r["train_pixels"].shallow_clone(), captions, sizes };
    let draws = Draws {
        posterior: r["train_posterior"].shallow_clone(),
        noise: r["train_noise"].shallow_clone(),
        offset: Tensor::zeros([2, 4, 1, 1], (Kind::Float, Device::Cpu)),
        timesteps: r["train_timesteps"].to_kind(Kind::Int64),
    };
    (batch, draws)
}

/// The reference batch's training loss with the UNet's parts run through `gemini`'s chunks,
/// after its backward and Gemini's step.
fn step_through_gemini(
    sd: &StableDiffusion,
    r: &HashMap<String, Tensor>,
    gemini: &Gemini,
    parts: &[Vec<usize>],
) -> Tensor {
    let ddpm = DdpmScheduler::new(sd.scheduler.config(SchedulerClass::Ddpm).unwrap());
    let (batch, draws) = training_batch(r);
    let runner = GeminiParts { gemini, parts };
    let unet = |x: &Tensor, t: &Tensor, c: &Conditioning| sd.unet.forward_with(x, t, c, &runner);
    let l = loss(sd, &ddpm, &batch, &draws, 0.0, None, Kind::Float, &unet).unwrap();
    l.backward();
    gemini.finish_backward().unwrap();
    gemini.step().unwrap();
    l
}

#[test]
fn a_training_step_under_gemini_equals_train_text_to_image_sdxl() {
    let r = reference();
    let sd = load();
    let UnetParams { params, parts } = UnetParams::of(&sd.unet, &sd.unet_vs).unwrap();
    let adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-2, weight_decay: 1e-2 };
    let mut cfg = gemini_config(Device::Cpu, None, CpuRule::AdamW(adamw), Kind::Float, None);
    cfg.placement = Placement::Static { offload: 1.0 };
    let gemini = Gemini::new(&params, cfg).unwrap();
    let l = step_through_gemini(&sd, &r, &gemini, &parts);
    assert_close(&l.reshape([1]), &r["train_loss"], 1e-5, 0.0, "SDXL training loss");
    let after: HashMap<String, Tensor> = gemini.state_dict().unwrap().into_iter().collect();
    let before = load().unet_vs.variables();
    for (key, theirs) in r.iter().filter_map(|(k, v)| k.strip_prefix("train_after.").map(|n| (n, v))) {
        let ours = &after[key];
        assert!(!ours.equal(&before[key]), "{key} moved");
        // One AdamW step of lr 1e-3 moves each weight by at most about 1e-3.
        assert_close(ours, theirs, 0.0, 2e-6, &format!("{key} after one AdamW step"));
    }
}

#[test]
fn a_lora_step_over_the_unet_streamed_by_gemini_equals_train_text_to_image_lora_sdxl() {
    use diffusion::lora::{Lora, LORA_WEIGHTS};
    use engine::optim::{AdamW, Optimizer};
    let r = reference();
    let peft = data::checkpoint::read_tensors(&fixtures().join("sdxl_lora_reference.safetensors")).unwrap();
    let stage = |prefix: &str| -> Vec<(String, Tensor)> {
        let mut v: Vec<(String, Tensor)> = peft
            .iter()
            .filter_map(|(k, t)| k.strip_prefix(prefix).map(|n| (n.to_string(), t.shallow_clone())))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let sd = load();
    // Rank 2, alpha 4 (scale 2), starting from peft's adapters (their file layout: scale folded
    // into `up`).
    let lora = Lora::new(&sd.unet, &sd.unet_vs, 2, 4.0, 0, Device::Cpu).unwrap();
    let before = stage("before.");
    assert_eq!(before.len(), 2 * 136, "peft adapts 136 projections of the tiny SDXL UNet");
    assert_eq!(lora.params().len(), before.len(), "we adapt the modules peft adapts");
    let dir = scratch("lora-step");
    let start = dir.join("start.safetensors");
    Tensor::write_safetensors(&before, &start).unwrap();
    lora.load(&start).unwrap();
    let adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-2, weight_decay: 1e-2 };
    let mut opt = AdamW::new(lora.params(), adamw);
    // The frozen UNet in Gemini's chunks with room for its widest part only: parts stream in
    // for the forward and again for the backward, whose input gradients need the frozen weights.
    let frozen = || {
        let mut cfg = gemini_config(Device::Cpu, None, CpuRule::AdamW(adamw), Kind::Float, None);
        cfg.chunks.trainable = false;
        cfg.chunks.share_cpu_homes = false;
        cfg.chunks.search = (1 << 10, 1 << 14, 1 << 10);
        cfg.placement = Placement::Static { offload: 1.0 };
        cfg
    };
    let (chunks, budget) = {
        // Counted on a second copy: chunking takes the parameters' memory.
        let other = load();
        other.unet_vs.variables().values().for_each(|t| drop(t.set_requires_grad(false)));
        let UnetParams { params, parts } = UnetParams::of(&other.unet, &other.unet_vs).unwrap();
        let probe = Gemini::new(&params, frozen()).unwrap();
        let m = probe.manager().unwrap();
        let widest = parts.iter().map(|p| m.chunks_of(p).len()).max().unwrap();
        (m.chunk_count(), widest * m.chunk_bytes())
    };
    let UnetParams { params, parts } = UnetParams::of(&sd.unet, &sd.unet_vs).unwrap();
    let mut cfg = frozen();
    cfg.chunks.budget = budget;
    let base = Gemini::new(&params, cfg).unwrap();
    let l = step_through_gemini(&sd, &r, &base, &parts);
    assert_close(&l.reshape([1]), &peft["loss"], 1e-5, 0.0, "SDXL LoRA training loss");
    {
        let m = base.manager().unwrap();
        let evictions = m.events().iter().filter(|e| matches!(e, Event::Evict(_))).count();
        assert!(evictions > chunks, "{chunks} chunks, {evictions} evictions: the UNet streamed forward and backward");
        assert!(m.device_bytes().1 <= budget, "at most {budget} bytes resident, was {}", m.device_bytes().1);
    }
    opt.step().unwrap();
    lora.save(&dir).unwrap();
    let ours = data::checkpoint::read_tensors(&dir.join(LORA_WEIGHTS)).unwrap();
    let after = stage("after.");
    let mut moved = 0;
    for (key, theirs) in &after {
        let start = &before.iter().find(|(k, _)| k == key).unwrap().1;
        moved += usize::from(!theirs.equal(start));
        // One AdamW step of lr 1e-3 moves each value by at most about 1e-3 (2e-3 in `up`, which
        // carries the scale 2).
        assert_close(&ours[key], theirs, 0.0, 4e-6, &format!("{key} after one AdamW step"));
    }
    assert_eq!(moved, after.len(), "every adapter moved");
}

/// A component's tensors under transformers 4's prefixed names, whichever layout its file has.
fn component_tensors(folder: &Path, component: &str, file: &str) -> HashMap<String, Tensor> {
    let tensors = data::checkpoint::read_tensors(&folder.join(component).join(file)).unwrap();
    let prefixed = !component.starts_with("text_encoder") || tensors.keys().any(|k| k.starts_with("text_model."));
    tensors
        .into_iter()
        .map(
            |(k, t)| {
                if prefixed || k.starts_with("text_projection.") {
                    (k, t)
                } else {
                    (format!("text_model.{k}"), t)
                }
            },
        )
        .collect()
}

#[test]
fn sdxl_single_files_convert_both_ways() {
    use diffusion::single_file::{to_diffusers, to_single_file, Configs};
    let dir = scratch("single-file");
    let file = dir.join("sdxl.safetensors");
    to_single_file(&folder(), &file, false).unwrap();
    let single = data::checkpoint::read_tensors(&file).unwrap();
    // Stability's layout: the text-time embedding as `label_emb`, CLIP ViT-L under embedder 0 in
    // transformers' names, OpenCLIP under embedder 1 with fused projections and `text_projection`
    // [width, dim] applied as `x @ p`.
    for key in [
        "model.diffusion_model.label_emb.0.0.weight",
        "model.diffusion_model.label_emb.0.2.bias",
        "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn2.to_k.weight",
        "first_stage_model.decoder.mid.attn_1.q.weight",
        "conditioner.embedders.0.transformer.text_model.encoder.layers.1.self_attn.q_proj.weight",
        "conditioner.embedders.1.model.transformer.resblocks.1.attn.in_proj_weight",
        "conditioner.embedders.1.model.ln_final.weight",
    ] {
        assert!(single.contains_key(key), "{key} missing");
    }
    assert_eq!(single["conditioner.embedders.1.model.text_projection"].size(), [24, 12]);
    let back = dir.join("back");
    to_diffusers(&file, &Configs::Folder(folder()), &back).unwrap();
    for (component, name) in [
        ("unet", "diffusion_pytorch_model.safetensors"),
        ("vae", "diffusion_pytorch_model.safetensors"),
        ("text_encoder", "model.safetensors"),
        ("text_encoder_2", "model.safetensors"),
    ] {
        let (theirs, ours) = (component_tensors(&folder(), component, name), component_tensors(&back, component, name));
        let wanted: Vec<&String> = theirs.keys().filter(|k| !k.ends_with("position_ids")).collect();
        assert_eq!(ours.len(), wanted.len(), "{component}: tensors");
        for k in wanted {
            assert!(ours[k].equal(&theirs[k]), "{component}: {k} differs after the round trip");
        }
    }
    assert!(back.join("tokenizer_2").is_dir() && back.join("text_encoder_2/config.json").is_file());
    StableDiffusion::load(&back, Device::Cpu, Kind::Float).unwrap();
    // SDXL's configs are not shipped: without a donor folder the error says what to give.
    let err = to_diffusers(&file, &Configs::Shipped(None), &dir.join("no-configs")).unwrap_err().to_string();
    assert!(err.contains("SDXL") && err.contains("--config-from"), "{err}");
    assert!(!dir.join("no-configs").exists());
}

/// Runs `diffusion finetune` on the SDXL folder with `extra` flags; returns the scratch folder
/// and the output folder in it.
fn finetune_run(test: &str, extra: &[&str]) -> (suite_tests::Scratch, PathBuf) {
    let dir = scratch(test);
    let data = dir.join("images");
    write_images(&data);
    let out = dir.join("run");
    let model = folder();
    let (ok, text) = finetune(&model, &data, &out, &[&SMALL_RUN[..], &["--metrics", "log.csv"], extra].concat());
    assert!(ok, "{text}");
    let csv = std::fs::read_to_string(out.join("log.csv")).unwrap();
    let losses: Vec<f64> = csv.lines().skip(1).map(|l| l.split(',').nth(1).unwrap().parse().unwrap()).collect();
    assert!(losses.len() == 2 && losses.iter().all(|l| l.is_finite() && *l > 0.0), "{csv}");
    (dir, out)
}

#[test]
fn the_command_fine_tunes_sdxl_fully_and_with_lora() {
    let (_full, out) = finetune_run("full", &["--validation-prompt", "a red car", "--gpu-mem", "1G"]);
    let model = out.join("model");
    let tuned = StableDiffusion::load(&model, Device::Cpu, Kind::Float).unwrap();
    assert!(tuned.is_xl() && model.join("text_encoder_2/model.safetensors").is_file());
    let base = load().unet_vs.variables();
    let moved = tuned.unet_vs.variables().iter().filter(|(k, t)| !t.equal(&base[*k])).count();
    assert!(moved * 2 > base.len(), "training moved most tensors ({moved} of {})", base.len());
    assert!(out.join("validation/step-2-0.png").is_file());

    let (_lora, out) = finetune_run("lora", &["--lora-rank", "2"]);
    let files: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
    let adapters = files.iter().find(|f| f.to_string_lossy().ends_with(".safetensors"));
    let adapters = out.join(adapters.unwrap_or_else(|| panic!("no adapter file in {files:?}")));
    let keys = data::checkpoint::read_tensors(&adapters).unwrap();
    // Adapters on the SDXL-only depths: the second transformer layer of the deepest blocks.
    assert!(keys.keys().any(|k| k.contains("mid_block.attentions.0.transformer_blocks.1.attn2")), "{:?}", keys.keys());
}

#[test]
fn the_sample_command_takes_size_conditioning_and_folders_that_do_not_fit_are_named() {
    let dir = scratch("cli");
    let png = dir.join("xl.png");
    let run = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_diffusion")).arg("sample").args(args).output().unwrap();
        (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
    };
    let model = folder();
    let (ok, text) = run(&[
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "a red car",
        "--steps",
        "2",
        "--original-size",
        "32,24",
        "--crops-coords-top-left",
        "2,4",
        "--target-size",
        "16,16",
        "-o",
        png.to_str().unwrap(),
    ]);
    assert!(ok && png.is_file(), "{text}");
    let (ok, text) =
        run(&["--model", model.to_str().unwrap(), "--prompt", "x", "--original-size", "32", "-o", "y.png"]);
    assert!(!ok && text.contains("not two non-negative integers"), "{text}");
    // The prompt and `flags` into `png`.
    let sample = |flags: &[&str]| {
        run(&[&["--model", model.to_str().unwrap(), "--prompt", "a red car"], flags, &["-o", png.to_str().unwrap()]]
            .concat())
    };
    let (ok, text) = sample(&[
        "--steps",
        "2",
        "--negative-original-size",
        "12,20",
        "--negative-crops-coords-top-left",
        "1,3",
        "--negative-target-size",
        "8,8",
    ]);
    assert!(ok, "{text}");
    // diffusers takes negative sizes only as a pair; a lone one is refused rather than ignored.
    let (ok, text) = sample(&["--negative-target-size", "8,8"]);
    assert!(!ok && text.contains("--negative-original-size"), "{text}");
    let (ok, text) = sample(&["--negative-crops-coords-top-left", "1,3"]);
    assert!(!ok && text.contains("needs --negative-original-size and --negative-target-size"), "{text}");

    // model_index.json without text_encoder_2 for a text-time UNet.
    let broken = dir.join("no_encoder_2");
    copy_tree(&folder(), &broken);
    let index = broken.join("model_index.json");
    let mut json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("text_encoder_2");
    std::fs::write(&index, json.to_string()).unwrap();
    let err = StableDiffusion::load(&broken, Device::Cpu, Kind::Float).err().unwrap().to_string();
    assert!(err.contains("unet/config.json") && err.contains("no text_encoder_2"), "{err}");
    // add_embedding's input width that does not fit encoder 2's projection.
    let broken = dir.join("wrong_projection");
    copy_tree(&folder(), &broken);
    let config = broken.join("unet/config.json");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("\"projection_class_embeddings_input_dim\": 36", "\"projection_class_embeddings_input_dim\": 40");
    std::fs::write(&config, text).unwrap();
    let err = StableDiffusion::load(&broken, Device::Cpu, Kind::Float).err().unwrap().to_string();
    assert!(err.contains("add_embedding.linear_1.weight has shape [32, 36], expected [32, 40]"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
