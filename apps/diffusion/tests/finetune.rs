//! Fine-tuning the tiny pipeline (`fixtures/pipeline`): training under Gemini (chunk homes and
//! optimizer in the host tier, the rayon kernels) gives the same UNet as plain training with
//! the engine's AdamW; the saved folder holds exactly the trained weights and loads back; the
//! command trains, logs (CSV), writes validation images and saves; 2 ranks (ZeRO-3) equal one process with the whole
//! batch; bad inputs are named.
mod common;

use common::{finetune, pipeline, write_images, SMALL_RUN};
use diffusion::finetune::{gemini_config, loss, save_model, Batch, Draws, GeminiParts, UnetParams};
use diffusion::pipeline::StableDiffusion;
use diffusion::scheduler::{DdpmScheduler, SchedulerClass};
use diffusion::unet::Conditioning;
use engine::dist::World;
use engine::gemini::{CpuRule, Event, Gemini, Placement, Replication};
use engine::optim::{AdamW, AdamWConfig, Optimizer};
use suite_tests::{dist_test, TestResult};
use tch::{Device, Kind, Tensor};

/// A large epsilon keeps Adam's update linear in the smallest gradients: with 1e-8 it turns
/// their last-bit rounding (which differs between equally correct summation orders) into
/// full-size steps, and runs could not be compared closely.
const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-2, weight_decay: 1e-2 };
const STEPS: usize = 3;
const IMAGES: usize = 4;

fn load() -> StableDiffusion {
    StableDiffusion::load(&pipeline(), Device::Cpu, Kind::Float).unwrap()
}

/// Images `rows` of a fixed batch of 16x16 images and their draws for `step`.
fn batch(step: usize, rows: std::ops::Range<usize>) -> (Batch, Draws) {
    let mut rng = data::augment::Rng::keyed(5, step as u64, 0);
    let pixels = (rng.normal_tensor(&[IMAGES as i64, 3, 16, 16]) * 0.5).clamp(-1.0, 1.0);
    let captions = ["a photo of a dog", "a red car", "portrait of a cat wearing a hat", "the sea"];
    let n = rows.end - rows.start;
    let b = Batch {
        pixels: pixels.narrow(0, rows.start as i64, n as i64),
        captions: captions[rows.clone()].iter().map(|s| s.to_string()).collect(),
        sizes: vec![],
    };
    (b, Draws::new(9, step, rows.start, n, [4, 8, 8], 1000))
}

/// The UNet's weights after plain training on images `0..IMAGES` with the engine's AdamW.
fn train_plain() -> Vec<(String, Tensor)> {
    let sd = load();
    let ddpm = DdpmScheduler::new(sd.scheduler.config(SchedulerClass::Ddpm).unwrap());
    let mut opt = AdamW::new(UnetParams::of(&sd.unet, &sd.unet_vs).unwrap().params, ADAMW);
    for step in 0..STEPS {
        let (b, d) = batch(step, 0..IMAGES);
        let l =
            loss(&sd, &ddpm, &b, &d, 0.0, Some(5.0), Kind::Float, &|x, t, c| sd.unet.forward_cond(x, t, c)).unwrap();
        l.backward();
        opt.step().unwrap();
        opt.zero_grad();
    }
    opt.params().iter().map(|p| (p.name.clone(), p.tensor.detach().copy())).collect()
}

/// The same under Gemini on images `rows`, the chunks replicated over `group` when given, at
/// most `budget` bytes of chunk payloads resident at a time when given.
fn train_gemini(
    rows: std::ops::Range<usize>,
    group: Option<&World>,
    budget: Option<usize>,
) -> (Gemini, Vec<(String, Tensor)>) {
    let sd = load();
    let ddpm = DdpmScheduler::new(sd.scheduler.config(SchedulerClass::Ddpm).unwrap());
    let UnetParams { params, parts } = UnetParams::of(&sd.unet, &sd.unet_vs).unwrap();
    let replication = group.map(|w| Replication { group: w.group.clone(), shard: true });
    let mut cfg = gemini_config(Device::Cpu, None, CpuRule::AdamW(ADAMW), Kind::Float, replication);
    // Every home, gradient and optimizer state in the host tier (the rayon kernels).
    cfg.placement = Placement::Static { offload: 1.0 };
    if let Some(b) = budget {
        cfg.chunks.budget = b;
    }
    let gemini = Gemini::new(&params, cfg).unwrap();
    for step in 0..STEPS {
        let (b, d) = batch(step, rows.clone());
        let runner = GeminiParts { gemini: &gemini, parts: &parts };
        let unet = |x: &Tensor, t: &Tensor, c: &Conditioning| sd.unet.forward_with(x, t, c, &runner);
        let l = loss(&sd, &ddpm, &b, &d, 0.0, Some(5.0), Kind::Float, &unet).unwrap();
        l.backward();
        gemini.finish_backward().unwrap();
        gemini.step().unwrap();
    }
    let weights = gemini.state_dict().unwrap();
    (gemini, weights)
}

/// Every tensor of `a` within `rtol` of `b`'s largest entry.
fn compare(a: &[(String, Tensor)], b: &[(String, Tensor)], rtol: f64, what: &str) -> anyhow::Result<()> {
    let b: std::collections::HashMap<&str, &Tensor> = b.iter().map(|(k, t)| (k.as_str(), t)).collect();
    anyhow::ensure!(a.len() == b.len(), "{what}: {} tensors against {}", a.len(), b.len());
    for (name, x) in a {
        let y = b.get(name.as_str()).ok_or_else(|| anyhow::anyhow!("{what}: {name} missing"))?;
        let scale = y.abs().max().double_value(&[]).max(1e-3);
        let d = (x - *y).abs().max().double_value(&[]);
        anyhow::ensure!(d <= rtol * scale, "{what}: {name} differs by {d:e} (max |w| {scale:e}, rtol {rtol:e})");
    }
    Ok(())
}

#[test]
fn gemini_training_equals_plain_training_and_saves_what_it_trained() {
    let plain = train_plain();
    let (_, gemini) = train_gemini(0..IMAGES, None, None);
    // fp32: the host kernels and the tensor optimizer round differently in the last bits.
    compare(&gemini, &plain, 1e-5, "Gemini vs plain").unwrap();
    let base = load().unet_vs.variables();
    let moved = plain.iter().filter(|(k, t)| !t.equal(&base[k])).count();
    assert!(moved * 2 > plain.len(), "training moved most tensors ({moved} of {})", plain.len());

    let out = suite_tests::scratch("diffusion-finetune", "save");
    let model = save_model(&pipeline(), &gemini, &out).unwrap();
    let reloaded = StableDiffusion::load(&model, Device::Cpu, Kind::Float).unwrap();
    let vars = reloaded.unet_vs.variables();
    for (name, t) in &gemini {
        assert!(vars[name].equal(t), "{name} reloads unchanged");
    }
    assert!(model.join("tokenizer/vocab.json").is_file() && model.join("vae/config.json").is_file());
    // The base's VAE is only the fp16 variant; the folder has the plain name, which diffusers'
    // from_pretrained finds without variant="fp16".
    assert!(pipeline().join("vae/diffusion_pytorch_model.fp16.safetensors").is_file());
    assert!(!model.join("vae/diffusion_pytorch_model.fp16.safetensors").exists());
    // In fp32, as the UNet beside it: a pipeline loaded as saved runs in one precision.
    let vae = data::checkpoint::read_tensors(&model.join("vae/diffusion_pytorch_model.safetensors")).unwrap();
    assert!(vae.values().all(|t| t.kind() == Kind::Float));
    let leftovers: Vec<_> = std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("model")], "no staging folder left");
}

#[test]
fn the_frozen_text_encoder_and_vae_get_no_gradient() {
    // As diffusers' scripts freeze them (`requires_grad_(False)`): backward stops at the text
    // states, so neither encoder keeps activations for it nor computes weight gradients.
    let mut sd = load();
    let ddpm = DdpmScheduler::new(sd.scheduler.config(SchedulerClass::Ddpm).unwrap());
    let (b, d) = batch(0, 0..2);
    let l = loss(&sd, &ddpm, &b, &d, 0.0, None, Kind::Float, &|x, t, c| sd.unet.forward_cond(x, t, c)).unwrap();
    l.backward();
    let unet_grads = sd.unet_vs.variables().values().filter(|t| t.grad().defined()).count();
    assert!(unet_grads > 0, "the UNet gets gradients");
    let mut frozen = sd.text_encoder_stores().into_iter().map(|vs| vs.variables()).collect::<Vec<_>>();
    frozen.push(sd.vae_vs.variables());
    for vars in frozen {
        for (name, t) in vars {
            assert!(!t.grad().defined(), "{name} got a gradient");
        }
    }
}

#[test]
fn parts_stream_through_a_budget_smaller_than_the_unet() {
    // Each part of the UNet is its own module: a budget of half the chunks' payloads holds
    // the widest part but not the model, so chunks are evicted and reloaded within a step.
    let (probe, _) = train_gemini(0..IMAGES, None, None);
    let (chunks, bytes, widest) = {
        let m = probe.manager().unwrap();
        (m.chunk_count(), m.chunk_bytes(), m.widest_access())
    };
    assert!(widest < chunks, "the widest part needs {widest} of {chunks} chunks");
    let budget = widest.max(chunks / 2) * bytes;
    assert!(budget < chunks * bytes);
    let plain = train_plain();
    let (gemini, streamed) = train_gemini(0..IMAGES, None, Some(budget));
    compare(&streamed, &plain, 1e-5, "Gemini under a budget vs plain").unwrap();
    let m = gemini.manager().unwrap();
    let evictions = m.events().iter().filter(|e| matches!(e, Event::Evict(_))).count();
    assert!(evictions >= STEPS, "chunks were evicted within steps ({evictions} evictions)");
    assert!(m.device_bytes().1 <= budget, "at most {budget} bytes resident, was {}", m.device_bytes().1);
}

dist_test!(two_ranks_equal_one_process, 2, |world| {
    let plain = train_plain();
    let half = IMAGES / 2;
    let rows = world.rank() * half..(world.rank() + 1) * half;
    let (_, sharded) = train_gemini(rows, Some(world), None);
    // Two half-batch means averaged vs one mean, reduce-scattered: reordered sums.
    compare(&sharded, &plain, 1e-5, "2 ranks vs one process")?;
    Ok(()) as TestResult
});

#[test]
fn the_command_trains_logs_validates_and_saves() {
    let dir = suite_tests::scratch("diffusion-finetune", "cli");
    let data = dir.join("images");
    write_images(&data);
    let out = dir.join("run");
    let model = pipeline();
    // Two prompts, two images each after every step; the losses in a CSV; under a cap.
    let validation = ["--validation-prompt", "a red car", "--validation-prompt", "the sea"];
    let every_step = ["--validation-steps", "1", "--num-validation-images", "2"];
    let other = ["--snr-gamma", "5", "--metrics", "log.csv", "--gpu-mem", "1G", "--report-to", "tensorboard"];
    let flags = [&SMALL_RUN[..], &validation, &every_step, &other].concat();
    let (ok, text) = finetune(&model, &data, &out, &flags);
    assert!(ok, "{text}");
    // On the CPU the cap turns on checkpointing only (no half precision there), and says so.
    assert!(text.contains("--gpu-mem 1G: training with --gradient-checkpointing ("), "{text}");
    let csv = std::fs::read_to_string(out.join("log.csv")).unwrap();
    let rows: Vec<Vec<&str>> = csv.lines().map(|l| l.split(',').collect()).collect();
    assert_eq!(rows[0], ["step", "loss", "lr", "seconds", "grad_norm", "peak_bytes"], "{csv}");
    assert_eq!(rows.len(), 3, "a header and a row per step: {csv}");
    for (i, row) in rows[1..].iter().enumerate() {
        assert_eq!(row[0], (i + 1).to_string());
        assert!(row[1].parse::<f64>().is_ok_and(f64::is_finite), "loss of {row:?}");
        assert_eq!(row[2].parse::<f64>().unwrap(), 1e-3, "lr of {row:?}");
    }
    // Two prompts, two images each, after steps 1 and 2; the same seed gives each prompt's
    // images the same starting latents at every step, so they differ only by training.
    let mut written: Vec<String> = std::fs::read_dir(out.join("validation"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    written.sort();
    let expected: Vec<String> = (1..=2).flat_map(|s| (0..4).map(move |i| format!("step-{s}-{i}.png"))).collect();
    assert_eq!(written, expected);
    let image = |name: &str| data::folder::decode(&out.join("validation").join(name), 3).unwrap();
    let (a, b) = (image("step-2-0.png"), image("step-2-1.png"));
    assert_eq!((a.height, a.width), (16, 16));
    assert_ne!(a.pixels, b.pixels, "two images of one prompt differ");
    assert_ne!(image("step-2-0.png").pixels, image("step-2-2.png").pixels, "the prompts' images differ");
    // TensorBoard's own reader finds every step's scalars (the CSV's losses) and every
    // validation image at its step, under diffusers' default --logging-dir.
    let events = suite_tests::read_tensorboard(&out.join("logs/diffusion-finetune"));
    for tag in ["train/loss", "train/lr", "train/step_seconds", "train/grad_norm", "train/peak_memory_gib"] {
        assert_eq!(events.steps(tag), [1, 2], "{tag}: {events:?}");
    }
    for (row, logged) in rows[1..].iter().zip(events.values("train/loss")) {
        assert!(
            (row[1].parse::<f64>().unwrap() - logged).abs() < 1e-5,
            "TensorBoard's loss {logged}, the CSV's {row:?}"
        );
    }
    assert_eq!(events.values("train/lr"), [1e-3f32 as f64; 2]);
    let tags: Vec<&String> = events.images.keys().collect();
    assert_eq!(tags, ["validation/0", "validation/1", "validation/2", "validation/3"]);
    assert!(events.images.values().all(|v| v[..] == [(1, 16, 16), (2, 16, 16)]), "{:?}", events.images);
    let trained = StableDiffusion::load(&out.join("model"), Device::Cpu, Kind::Float).unwrap();
    let base = load();
    let changed = trained.unet_vs.variables().iter().filter(|(k, t)| !t.equal(&base.unet_vs.variables()[*k])).count();
    assert!(changed > 0, "the saved UNet is the trained one");

    // Without activation checkpointing inside the Gemini module (on by default under the cap)
    // the steps are the same.
    let again = dir.join("kept");
    let (ok, text) = finetune(
        &model,
        &data,
        &again,
        &[&SMALL_RUN[..], &["--snr-gamma", "5", "--gpu-mem", "1G", "--gradient-checkpointing", "false"]].concat(),
    );
    assert!(ok && !text.contains("training with"), "{text}");
    let log2: Vec<serde_json::Value> = std::fs::read_to_string(again.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(log2.len(), 2);
    for (a, b) in rows[1..].iter().zip(&log2) {
        let (a, b) = (a[1].parse::<f64>().unwrap(), b["loss"].as_f64().unwrap());
        // The CSV rounds to 6 decimals.
        assert!((a - b).abs() <= 1e-5 * a.abs().max(1e-1), "loss {b} without checkpointing, {a} with");
    }
    let (ok, text) = finetune(&model, &data, &out, &["--resolution", "18"]);
    assert!(!ok && text.contains("--resolution 18") && text.contains("multiple of 4"), "{text}");
    let (ok, text) = finetune(&model, &data, &out, &["--resolution", "16384"]);
    assert!(!ok && text.contains("invalid value '16384' for '--resolution"), "{text}");
    let (ok, text) = finetune(&model, &data, &out, &["--gpu-mem", "4X"]);
    assert!(!ok && text.contains("--gpu-mem 4X"), "{text}");
    let (ok, text) = finetune(&model, &data, &out, &["--kernels", "fused", "--device", "cpu"]);
    assert!(!ok && text.contains("--kernels fused needs a CUDA device"), "{text}");
    let missing = dir.join("nothing");
    let (ok, text) = finetune(&model, &missing, &out, &[]);
    assert!(!ok && text.contains("nothing"), "{text}");
    std::fs::remove_file(data.join("metadata.jsonl")).unwrap();
    let (ok, text) = finetune(&model, &data, &out, &["--resolution", "16"]);
    assert!(!ok && text.contains("img0"), "an image without a caption is named: {text}");
}

/// LoRA adapters (rank 2, alpha 4) after `STEPS` steps on images `0..IMAGES`, over the frozen
/// UNet whole (`chunks` None) or in Gemini's chunks (payloads really freed and refilled) with
/// at most `budget` bytes resident when given; with the chunks and the trained model.
fn train_lora(chunks: Option<Option<usize>>) -> (Option<Gemini>, Vec<(String, Tensor)>, StableDiffusion) {
    use diffusion::lora::Lora;
    let sd = load();
    let ddpm = DdpmScheduler::new(sd.scheduler.config(SchedulerClass::Ddpm).unwrap());
    let lora = Lora::new(&sd.unet, &sd.unet_vs, 2, 4.0, 3, Device::Cpu).unwrap();
    let base = chunks.map(|budget| {
        let UnetParams { params, parts } = UnetParams::of(&sd.unet, &sd.unet_vs).unwrap();
        let mut cfg = gemini_config(Device::Cpu, None, CpuRule::AdamW(ADAMW), Kind::Float, None);
        cfg.chunks.trainable = false;
        cfg.chunks.share_cpu_homes = false;
        cfg.placement = Placement::Static { offload: 1.0 };
        if let Some(b) = budget {
            cfg.chunks.budget = b;
        }
        (Gemini::new(&params, cfg).unwrap(), parts)
    });
    let mut opt = AdamW::new(lora.params(), AdamWConfig { lr: 1e-2, ..ADAMW });
    for step in 0..STEPS {
        let (b, d) = batch(step, 0..IMAGES);
        let l = match &base {
            Some((gemini, parts)) => {
                let runner = GeminiParts { gemini, parts };
                loss(&sd, &ddpm, &b, &d, 0.0, None, Kind::Float, &|x, t, c| sd.unet.forward_with(x, t, c, &runner))
            }
            None => loss(&sd, &ddpm, &b, &d, 0.0, None, Kind::Float, &|x, t, c| sd.unet.forward_cond(x, t, c)),
        };
        l.unwrap().backward();
        if let Some((gemini, _)) = &base {
            gemini.finish_backward().unwrap();
            gemini.step().unwrap();
        }
        opt.step().unwrap();
        opt.zero_grad();
    }
    let adapters = lora.params().iter().map(|p| (p.name.clone(), p.tensor.detach().copy())).collect();
    (base.map(|(gemini, _)| gemini), adapters, sd)
}

#[test]
fn lora_starts_at_the_base_model_trains_only_adapters_and_reloads() {
    use diffusion::lora::{Lora, LORA_WEIGHTS};
    let plain = load();
    let ddpm = DdpmScheduler::new(plain.scheduler.config(SchedulerClass::Ddpm).unwrap());
    let (b, d) = batch(0, 0..2);
    let unet_loss = |sd: &StableDiffusion, b: &Batch, d: &Draws| {
        tch::no_grad(|| loss(sd, &ddpm, b, d, 0.0, None, Kind::Float, &|x, t, c| sd.unet.forward_cond(x, t, c)))
            .unwrap()
    };
    let before = unet_loss(&plain, &b, &d);
    let adapted = load();
    let lora = Lora::new(&adapted.unet, &adapted.unet_vs, 2, 4.0, 3, Device::Cpu).unwrap();
    assert!(before.equal(&unet_loss(&adapted, &b, &d)), "zero `up` leaves the model as it was");
    // `down` as peft's "gaussian" init draws it (diffusers' LoRA scripts): normal, std 1/rank.
    let downs: Vec<Tensor> =
        lora.params().iter().filter(|p| p.name.ends_with(".down.weight")).map(|p| p.tensor.flatten(0, -1)).collect();
    let all = Tensor::cat(&downs, 0);
    let (mean, std) = (all.mean(Kind::Float).double_value(&[]), all.std(true).double_value(&[]));
    assert!(mean.abs() < 0.03 && (std - 0.5).abs() < 0.03, "{} values: mean {mean}, std {std}", all.numel());
    assert!(Lora::new(&adapted.unet, &adapted.unet_vs, 0, 1.0, 0, Device::Cpu).is_err());
    drop((lora, adapted));

    let (_, adapters, sd) = train_lora(None);
    // The fixture has 4 transformers (down 1, mid 1, up 2), each with attn1 and attn2.
    assert_eq!(adapters.len(), 2 * 4 * 2 * 4, "down and up of q, k, v and out of every attention");
    assert!(adapters.iter().all(|(_, t)| t.abs().sum(Kind::Float).double_value(&[]) > 0.0), "every adapter trained");
    let base = plain.unet_vs.variables();
    for (name, t) in sd.unet_vs.variables() {
        assert!(t.equal(&base[&name]), "{name}: the UNet's own weights stay as they were");
    }

    let dir = suite_tests::scratch("diffusion", "lora");
    let trained = Lora::new(&plain.unet, &plain.unet_vs, 2, 4.0, 99, Device::Cpu).unwrap();
    let start = dir.join("trained.safetensors");
    let scale_folded: Vec<(String, Tensor)> = adapters
        .iter()
        .map(|(k, t)| (format!("unet.{k}"), if k.ends_with(".up.weight") { t * 2.0 } else { t.shallow_clone() }))
        .collect();
    Tensor::write_safetensors(&scale_folded, &start).unwrap();
    trained.load(&start).unwrap();
    trained.save(&dir).unwrap();
    let file = Tensor::read_safetensors(dir.join(LORA_WEIGHTS)).unwrap();
    assert!(file
        .iter()
        .all(|(k, _)| k.starts_with("unet.") && (k.ends_with(".lora.down.weight") || k.ends_with(".lora.up.weight"))));
    let fresh = load();
    let again = Lora::new(&fresh.unet, &fresh.unet_vs, 2, 4.0, 7, Device::Cpu).unwrap();
    again.load(&dir.join(LORA_WEIGHTS)).unwrap();
    let (b, d) = batch(5, 0..2);
    let diff = (unet_loss(&sd, &b, &d) - unet_loss(&fresh, &b, &d)).abs().double_value(&[]);
    assert!(diff < 1e-6, "reloaded adapters give the same loss (difference {diff})");
}

#[test]
fn lora_over_the_unet_streamed_by_gemini_equals_lora_over_the_whole_unet() {
    let (_, whole, _) = train_lora(None);
    let (probe, _, _) = train_lora(Some(None));
    let probe = probe.unwrap();
    let (chunks, bytes, widest) = {
        let m = probe.manager().unwrap();
        (m.chunk_count(), m.chunk_bytes(), m.widest_access())
    };
    assert!(widest < chunks, "the widest part needs {widest} of {chunks} chunks");
    let budget = widest * bytes;
    let (gemini, streamed, _) = train_lora(Some(Some(budget)));
    // The same computation on the same values: streaming changes where weights live, and
    // with them at most the last bits of a few sums (4e-9 on weights of 3e-3 seen).
    compare(&streamed, &whole, 1e-5, "LoRA over streamed chunks vs the whole UNet").unwrap();
    let gemini = gemini.unwrap();
    let m = gemini.manager().unwrap();
    let loads = m.events().iter().filter(|e| matches!(e, Event::Load(_))).count();
    assert!(loads > STEPS * chunks, "chunks came back within steps for the backward ({loads} loads)");
    assert!(m.device_bytes().1 <= budget, "at most {budget} bytes resident, was {}", m.device_bytes().1);
    assert!(!m.trainable());
    drop(m);
    // Frozen: the homes never change and nothing was stepped.
    let base = load().unet_vs.variables();
    for (name, t) in gemini.state_dict().unwrap() {
        assert!(t.equal(&base[&name]), "{name} stays frozen");
    }
}

#[test]
fn a_lora_file_added_for_sampling_equals_its_weights_merged() {
    use diffusion::lora::{Lora, LORA_WEIGHTS};
    let dir = suite_tests::scratch("diffusion", "lora-file");
    // A file with non-zero adapters on every projection.
    let source = load();
    let lora = Lora::new(&source.unet, &source.unet_vs, 2, 2.0, 4, Device::Cpu).unwrap();
    tch::manual_seed(3);
    for p in lora.params().iter().filter(|p| p.name.ends_with(".up.weight")) {
        tch::no_grad(|| p.tensor.detach().copy_(&(Tensor::randn_like(&p.tensor) * 0.1)));
    }
    lora.save(&dir).unwrap();
    let file = dir.join(LORA_WEIGHTS);
    let tensors = data::checkpoint::read_tensors(&file).unwrap();

    let cfg = source.unet.config().clone();
    tch::manual_seed(5);
    let x = Tensor::randn([1, cfg.in_channels, 8, 8], (Kind::Float, Device::Cpu));
    let t = Tensor::from_slice(&[10i64]);
    let context = Tensor::randn([1, 7, cfg.cross_attention_dim], (Kind::Float, Device::Cpu));
    let output = |sd: &StableDiffusion| tch::no_grad(|| sd.unet.forward(&x, &t, &context)).unwrap();
    let base = output(&load());
    // Added at scale 0.5, against the weights W + 0.5 * up @ down written into the UNet.
    let added = load();
    assert_eq!(Lora::attach_file(&added.unet, &file, 0.5, Device::Cpu).unwrap(), 32);
    let merged = load();
    let vars = merged.unet_vs.variables();
    for (key, down) in tensors.iter().filter(|(k, _)| k.ends_with(".lora.down.weight")) {
        let module = &key["unet.".len()..key.len() - ".lora.down.weight".len()];
        let up = &tensors[&key.replace(".lora.down.", ".lora.up.")];
        let w = &vars[&format!("{module}.weight")];
        tch::no_grad(|| w.detach().copy_(&(w + up.matmul(down) * 0.5)));
    }
    let (ours, theirs) = (output(&added), output(&merged));
    let diff = (&ours - &theirs).abs().max().double_value(&[]);
    assert!(diff < 1e-5, "adapters against merged weights: {diff:e}");
    assert!((&ours - &base).abs().max().double_value(&[]) > 1e-3, "the adapters change the output");
    // Scale 0 is the base model exactly.
    let zero = load();
    Lora::attach_file(&zero.unet, &file, 0.0, Device::Cpu).unwrap();
    assert!(output(&zero).equal(&base));

    // Any subset of the projections; keys that fit nothing are named.
    let write = |name: &str, t: Vec<(String, Tensor)>| {
        let path = dir.join(name);
        Tensor::write_safetensors(&t, &path).unwrap();
        path
    };
    let queries = || -> Vec<(String, Tensor)> {
        let mut q: Vec<(String, Tensor)> =
            tensors.iter().filter(|(k, _)| k.contains(".to_q.")).map(|(k, t)| (k.clone(), t.shallow_clone())).collect();
        q.sort_by(|a, b| a.0.cmp(&b.0));
        q
    };
    assert_eq!(Lora::attach_file(&load().unet, &write("q.safetensors", queries()), 1.0, Device::Cpu).unwrap(), 8);
    let mut stray = queries();
    stray.push((
        "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora.down.weight".into(),
        Tensor::zeros([2, 4], (Kind::Float, Device::Cpu)),
    ));
    let err =
        Lora::attach_file(&load().unet, &write("stray.safetensors", stray), 1.0, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("text_encoder.text_model") && err.contains("stray.safetensors"), "{err}");
    let mut misfit = queries();
    misfit[0].1 = Tensor::zeros([2, 3], (Kind::Float, Device::Cpu));
    let err = Lora::attach_file(&load().unet, &write("misfit.safetensors", misfit), 1.0, Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains(&queries()[0].0) && err.contains("do not fit"), "{err}");
    let half: Vec<(String, Tensor)> = queries().into_iter().filter(|(k, _)| k.ends_with(".lora.down.weight")).collect();
    let err =
        Lora::attach_file(&load().unet, &write("half.safetensors", half), 1.0, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("missing key") && err.contains(".lora.up.weight"), "{err}");
}

/// LoRA files as current diffusers, peft and kohya's tools write them (rank 2, alpha 6: scale
/// 3, recorded in diffusers' header metadata or in kohya's `.alpha` keys) add to the UNet what
/// diffusers' `load_lora_weights` + `fuse_lora` merge into its weights
/// (`fixtures/make_lora_files_fixture.py`); so do their conversions to kohya's naming.
#[test]
fn lora_files_of_every_naming_add_what_diffusers_fuses() {
    use diffusion::lora::Lora;
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora");
    let dir = suite_tests::scratch("diffusion", "lora-namings");
    let cfg = load().unet.config().clone();
    tch::manual_seed(5);
    let x = Tensor::randn([1, cfg.in_channels, 8, 8], (Kind::Float, Device::Cpu));
    let t = Tensor::from_slice(&[10i64]);
    let context = Tensor::randn([1, 7, cfg.cross_attention_dim], (Kind::Float, Device::Cpu));
    let output = |sd: &StableDiffusion| tch::no_grad(|| sd.unet.forward(&x, &t, &context)).unwrap();
    let fused = load();
    let vars = fused.unet_vs.variables();
    for (name, w) in data::checkpoint::read_tensors(&fixtures.join("fused.safetensors")).unwrap() {
        tch::no_grad(|| vars[&name].detach().copy_(&w));
    }
    let want = output(&fused);
    assert!((&want - output(&load())).abs().max().double_value(&[]) > 1e-3, "the adapters change the output");
    for naming in ["diffusers", "peft", "kohya"] {
        let file = fixtures.join(format!("{naming}.safetensors"));
        let kohya = dir.join(format!("{naming}-as-kohya.safetensors"));
        diffusion::single_file::lora_to_kohya(&file, &kohya).unwrap();
        for path in [&file, &kohya] {
            let added = load();
            assert_eq!(Lora::attach_file(&added.unet, path, 1.0, Device::Cpu).unwrap(), 32);
            let diff = (output(&added) - &want).abs().max().double_value(&[]);
            assert!(diff < 1e-5, "{}: {diff:e}", path.display());
        }
    }
}

#[test]
fn the_command_trains_lora_adapters() {
    let dir = suite_tests::scratch("diffusion-finetune", "lora");
    let data = dir.join("images");
    write_images(&data);
    let out = dir.join("run");
    let model = pipeline();
    let (ok, text) = finetune(
        &model,
        &data,
        &out,
        &["--resolution", "16", "--steps", "2", "--lora-rank", "2", "--lr", "1e-3", "--center-crop"],
    );
    assert!(ok, "{text}");
    assert!(out.join(diffusion::lora::LORA_WEIGHTS).is_file());
    assert!(!out.join("model").exists(), "LoRA saves the adapters, not a model folder");
    let (ok, text) = finetune(&model, &data, &out, &["--resolution", "16", "--lora-rank", "0"]);
    assert!(!ok && text.contains("--lora-rank 0"), "{text}");
}

#[test]
fn frozen_parts_run_in_the_compute_precision_within_the_cap() {
    let dir = suite_tests::scratch("diffusion-finetune", "bf16");
    let data = dir.join("images");
    write_images(&data);
    let (model, out) = (pipeline(), dir.join("run"));
    // bf16 under a cap of `cap` into `out`, with `extra` flags.
    let bf16 = |cap: &str, out: &std::path::Path, extra: &[&str]| {
        let common = [
            "--resolution",
            "16",
            "--micro-batch",
            "2",
            "--precision",
            "bf16",
            "--metrics",
            "log.csv",
            "--gpu-mem",
            cap,
        ];
        finetune(&model, &data, out, &[&common[..], extra].concat())
    };
    let validated = ["--steps", "1", "--validation-prompt", "a red car", "--validation-steps", "1"];
    let run = |cap: &str| bf16(cap, &out, &[&validated[..], &["--num-validation-images", "1"]].concat());
    // The frozen text encoder and VAE (bf16) alone are more than 16 KiB: named, with their bytes.
    let (ok, text) = run("16K");
    assert!(!ok, "{text}");
    for needle in ["--gpu-mem 16.0 KiB is too small", "text encoder", "VAE", "KiB"] {
        assert!(text.contains(needle), "{needle:?} in {text}");
    }
    // With room, bf16 trains (the VAE encodes bf16 pixels) and validates (it decodes bf16 latents).
    let (ok, text) = run("1G");
    assert!(ok, "{text}");
    let csv = std::fs::read_to_string(out.join("log.csv")).unwrap();
    let loss: f64 = csv.lines().nth(1).unwrap().split(',').nth(1).unwrap().parse().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "{csv}");
    let image = data::folder::decode(&out.join("validation").join("step-1-0.png"), 3).unwrap();
    assert!(image.pixels.iter().all(|p| p.is_finite()), "a decodable validation image");
    // LoRA in bf16: the frozen UNet's chunks (homes and payloads in bf16) stream under the cap.
    let lora_out = dir.join("lora");
    let (ok, text) = bf16("1G", &lora_out, &["--steps", "2", "--lora-rank", "2"]);
    assert!(ok, "{text}");
    let csv = std::fs::read_to_string(lora_out.join("log.csv")).unwrap();
    assert!(csv.lines().skip(1).all(|l| l.split(',').nth(1).unwrap().parse::<f64>().unwrap().is_finite()), "{csv}");
}
