//! `diffusion finetune`'s checkpoints and what they carry, on the tiny pipeline: a run stopped
//! after 4 of 6 steps and resumed from `latest` repeats the uninterrupted run bit for bit on
//! the CPU (every loss, the weights and the EMA weights), and so does one whose first 4 steps
//! ran on 2 ranks (losses within 1e-5); `--checkpoints-total-limit` keeps the newest and
//! `latest` names one of them; the EMA equals diffusers' EMAModel (fixture) and, in a run, the
//! average of the run's weights by EMAModel's formula; caption dropout is keyed by the seed,
//! step and image; LoRA adapters resume bit for bit after a kill during a save; a `--resume`
//! folder that is missing, dangling or corrupt is named, and so are flags that cannot work.
mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use common::{finetune, pipeline, write_images};
use diffusion::finetune::drops_caption;
use diffusion::finetune::ema::{self, EmaConfig};
use tch::Tensor;

/// The flags of every run here: 16-pixel images, 2 per step, EMA with a decay it reaches.
const FLAGS: [&str; 11] = [
    "--resolution",
    "16",
    "--lr",
    "1e-3",
    "--random-flip",
    "--caption-dropout",
    "0.5",
    "--use-ema",
    "--ema-decay",
    "0.9",
    "--quiet",
];

fn scratch(name: &str) -> suite_tests::Scratch {
    suite_tests::scratch("diffusion-ckpt", name)
}

/// The image folder every run trains on.
fn images() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = scratch("images").until_exit();
        write_images(&dir);
        dir
    })
}

/// Runs `finetune` on the images into `out` with [`FLAGS`] and `extra`; panics with its output
/// when it fails.
fn run(out: &Path, extra: &[&str]) -> String {
    let args = [&FLAGS[..], extra].concat();
    let (ok, text) = finetune(&pipeline(), images(), out, &args);
    assert!(ok, "finetune {args:?} failed: {text}");
    text
}

/// `--checkpointing-steps 2`, and `--steps` `steps`.
fn every_2(steps: &'static str) -> [&'static str; 4] {
    ["--checkpointing-steps", "2", "--steps", steps]
}

/// The uninterrupted run: 6 steps on one rank, 2 images per step, the 2 newest checkpoints.
fn reference() -> &'static Path {
    static OUT: OnceLock<PathBuf> = OnceLock::new();
    OUT.get_or_init(|| {
        let out = scratch("reference").until_exit();
        run(&out, &[&every_2("6")[..], &["--micro-batch", "2", "--checkpoints-total-limit", "2"]].concat());
        out
    })
}

fn losses(out: &Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64().unwrap())
        .collect()
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).into_iter().collect()
}

/// Every tensor of the files `a` and `b` (under two run folders) equal bit for bit.
fn assert_same_tensors(a: &Path, b: &Path, file: &str) {
    let (x, y) = (tensors(&a.join(file)), tensors(&b.join(file)));
    assert_eq!(x.len(), y.len(), "{file}");
    for (name, t) in &x {
        assert!(t.equal(&y[name]), "{file}: {name} differs between {} and {}", a.display(), b.display());
    }
}

/// The checkpoint folders under `out` and the one `latest` names.
fn checkpoints(out: &Path) -> (Vec<String>, String) {
    let mut names: Vec<String> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("checkpoint"))
        .collect();
    names.sort();
    let latest = std::fs::read_to_string(out.join("latest")).unwrap();
    assert!(out.join(&latest).join("trainer.json").is_file(), "latest names a complete checkpoint: {latest}");
    (names, latest)
}

const UNET: &str = "unet/diffusion_pytorch_model.safetensors";
const UNET_EMA: &str = "unet_ema/diffusion_pytorch_model.safetensors";
const MODEL: &str = "model/unet/diffusion_pytorch_model.safetensors";

#[test]
fn a_resumed_run_repeats_the_uninterrupted_one_bit_for_bit() {
    let full = reference();
    assert_eq!(checkpoints(full), (vec!["checkpoint-4".into(), "checkpoint-6".into()], "checkpoint-6".into()));

    let out = scratch("resumed");
    run(&out, &[&every_2("4")[..], &["--micro-batch", "2", "--checkpoints-total-limit", "2"]].concat());
    assert_eq!(checkpoints(&out), (vec!["checkpoint-2".into(), "checkpoint-4".into()], "checkpoint-4".into()));
    let text = run(
        &out,
        &[&every_2("6")[..], &["--micro-batch", "2", "--checkpoints-total-limit", "2", "--resume", "latest"]].concat(),
    );
    assert!(text.contains("resuming from") && text.contains("(step 4)"), "{text}");
    assert_eq!(checkpoints(&out).0, ["checkpoint-4", "checkpoint-6"]);

    let (ours, theirs) = (losses(&out), losses(full));
    assert_eq!(ours.len(), 6, "the log reads as one run of 6 steps");
    assert_eq!(ours, theirs, "every loss bit for bit");
    let (a, b) = (out.join("checkpoint-6"), full.join("checkpoint-6"));
    assert_same_tensors(&a, &b, UNET);
    assert_same_tensors(&a, &b, UNET_EMA);
    assert_same_tensors(&out, full, MODEL);
    // The final UNet is the EMA's, as diffusers' script saves it.
    let (model, ema) = (tensors(&out.join(MODEL)), tensors(&a.join(UNET_EMA)));
    assert!(model.iter().all(|(k, t)| t.equal(&ema[k])));
    let trained = tensors(&a.join(UNET));
    assert!(model.iter().any(|(k, t)| !t.equal(&trained[k])), "the EMA is not the trained weights");

    // A resume at another learning rate is refused: diffusers' keeps the saved rate whatever
    // the flag says.
    let (model, data) = (pipeline(), images());
    let mut args: Vec<&str> = FLAGS.iter().map(|f| if *f == "1e-3" { "5e-3" } else { f }).collect();
    args.extend(every_2("8"));
    args.extend(["--micro-batch", "2", "--resume", "latest"]);
    let (ok, text) = finetune(&model, data, &out, &args);
    assert!(!ok && text.contains("it was trained with --lr 0.001, this run has 0.005"), "{text}");
}

#[test]
fn a_checkpoint_from_two_ranks_resumes_on_one() {
    let out = scratch("ranks");
    run(&out, &[&every_2("4")[..], &["--micro-batch", "1", "--nproc", "2"]].concat());
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("checkpoint-4/trainer.json")).unwrap()).unwrap();
    assert_eq!((state["world_size"].as_u64(), state["global_batch"].as_u64()), (Some(2), Some(2)));
    let shards: Vec<_> = ["optimizer-00000-of-00002.safetensors", "optimizer-00001-of-00002.safetensors"]
        .iter()
        .map(|f| out.join("checkpoint-4").join(f))
        .collect();
    assert!(shards.iter().all(|p| p.is_file()), "each rank saved its optimizer shard");

    // The global batch must stay: 1 rank with 1 image is another data order.
    let (model, data) = (pipeline(), images());
    let mut args = FLAGS.to_vec();
    args.extend(every_2("6"));
    args.extend(["--resume", "latest"]);
    let (ok, text) = finetune(&model, data, &out, &args);
    assert!(!ok && text.contains("global batch") && text.contains("checkpoint-4"), "{text}");

    run(&out, &[&every_2("6")[..], &["--micro-batch", "2", "--resume", "latest"]].concat());
    let (ours, theirs) = (losses(&out), losses(reference()));
    assert_eq!(ours.len(), 6);
    // 2 ranks' gradients are summed in another order than one rank's: the last bits differ.
    for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {}: loss {a} resumed from 2 ranks, {b} on one", step + 1);
    }
}

#[test]
fn lora_adapters_resume_bit_for_bit_and_two_ranks_equal_one() {
    let (model, data) = (pipeline(), images());
    let lora = |out: &Path, extra: &[&str]| {
        let mut args = vec!["--resolution", "16", "--lr", "1e-2", "--lora-rank", "2", "--quiet"];
        args.extend(every_2("6"));
        args.extend(extra);
        let (ok, text) = finetune(&model, data, out, &args);
        assert!(ok, "finetune {args:?} failed: {text}");
    };
    let (full, resumed, ranks) = (scratch("lora-full"), scratch("lora-resumed"), scratch("lora-ranks"));
    let one = ["--micro-batch", "2"];
    lora(&full, &one);
    // Two ranks of one image each: the frozen UNet's chunks sharded over them (each gathers a
    // chunk to use it), the adapters' gradients averaged; the same run as one rank of two.
    lora(&ranks, &["--micro-batch", "1", "--nproc", "2"]);
    let (ours, theirs) = (losses(&ranks), losses(&full));
    assert_eq!(ours.len(), 6);
    for (step, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        assert!((a - b).abs() <= 1e-5 * b.abs(), "step {}: loss {a} on 2 ranks, {b} on one", step + 1);
    }
    // What a kill while step 6's checkpoint is being written leaves: the log's rows past step
    // 4, the staging folder, `latest` still naming step 4 (and no final adapters yet).
    lora(&resumed, &one);
    std::fs::rename(resumed.join("checkpoint-6"), resumed.join("checkpoint-6.tmp")).unwrap();
    std::fs::write(resumed.join("latest"), "checkpoint-4").unwrap();
    std::fs::remove_file(resumed.join(diffusion::lora::LORA_WEIGHTS)).unwrap();
    lora(&resumed, &["--micro-batch", "2", "--resume", "latest"]);
    assert_eq!(
        checkpoints(&resumed),
        (vec!["checkpoint-2".into(), "checkpoint-4".into(), "checkpoint-6".into()], "checkpoint-6".into())
    );
    assert_eq!(losses(&resumed), losses(&full), "every loss bit for bit");
    assert_same_tensors(&resumed.join("checkpoint-6"), &full.join("checkpoint-6"), "lora.safetensors");
    assert_same_tensors(&resumed.join("checkpoint-6"), &full.join("checkpoint-6"), "optimizer.safetensors");
    assert_same_tensors(&resumed, &full, diffusion::lora::LORA_WEIGHTS);
}

#[test]
fn the_ema_is_diffusers_ema_model() {
    let fixture = tensors(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/ema.safetensors"));
    let expected = |key: &str| Vec::<f64>::try_from(&fixture[key]).unwrap();
    let config = EmaConfig::diffusers(0.9999);
    let ours: Vec<f64> = (1..=40).map(|s| config.decay_at(s)).collect();
    assert_eq!(ours, expected("decay.default"));
    let warm = EmaConfig { use_ema_warmup: true, power: 3.0 / 4.0, update_after_step: 2, min_decay: 0.1, ..config };
    let ours: Vec<f64> = (1..=40).map(|s| warm.decay_at(s)).collect();
    for (a, b) in ours.iter().zip(expected("decay.warmup")) {
        assert!((a - b).abs() <= 1e-15, "warm-up decay {a}, diffusers {b}");
    }

    let config = EmaConfig::diffusers(0.9);
    for p in 0..2 {
        let shadow = fixture[&format!("weights.0.{p}")].copy();
        for k in 1..=12 {
            ema::update(&shadow, &fixture[&format!("weights.{k}.{p}")], config.decay_at(k)).unwrap();
            assert!(shadow.equal(&fixture[&format!("shadow.{k}.{p}")]), "parameter {p} after step {k}");
        }
    }
}

#[test]
fn the_ema_of_a_run_is_the_average_of_its_weights() {
    let out = scratch("ema");
    let text = run(&out, &["--steps", "3", "--micro-batch", "1", "--checkpointing-steps", "1", "--resume", "latest"]);
    assert!(text.contains("no checkpoint under") && text.contains("starting a new run"), "{text}");
    let base = diffusion::pipeline::StableDiffusion::load(&pipeline(), tch::Device::Cpu, tch::Kind::Float).unwrap();
    let config = EmaConfig::diffusers(0.9);
    let shadow: HashMap<String, Tensor> = base.unet_vs.variables().iter().map(|(k, t)| (k.clone(), t.copy())).collect();
    for step in 1..=3 {
        let weights = tensors(&out.join(format!("checkpoint-{step}")).join(UNET));
        for (name, s) in &shadow {
            ema::update(s, &weights[name], config.decay_at(step)).unwrap();
        }
        let saved = out.join(format!("checkpoint-{step}/unet_ema"));
        let settings: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(saved.join("config.json")).unwrap()).unwrap();
        assert_eq!(settings["optimization_step"].as_u64(), Some(step as u64));
        assert_eq!(settings["decay"].as_f64(), Some(0.9));
        assert!(settings["cross_attention_dim"].is_number(), "the UNet's config is kept: {settings}");
        let ema = tensors(&saved.join("diffusion_pytorch_model.safetensors"));
        for (name, s) in &shadow {
            assert!(ema[name].equal(s), "step {step}: {name} is EMAModel's average");
        }
    }
}

#[test]
fn caption_dropout_is_keyed_by_seed_step_and_image() {
    let draws = |seed, p| (0..2000).map(|i| drops_caption(seed, 1 + i / 50, i % 50, p)).collect::<Vec<bool>>();
    assert_eq!(draws(3, 0.3), draws(3, 0.3), "the same seed drops the same captions");
    assert_ne!(draws(3, 0.3), draws(4, 0.3), "another seed drops others");
    let dropped = draws(3, 0.3).iter().filter(|d| **d).count();
    assert!((500..700).contains(&dropped), "about 30% dropped: {dropped} of 2000");
    assert!(draws(3, 0.0).iter().all(|d| !d) && draws(3, 1.0).iter().all(|d| *d));
}

#[test]
fn bad_resume_folders_are_named() {
    let out = scratch("bad");
    let (model, data) = (pipeline(), images());
    let try_resume = |resume: &str| {
        let mut args = FLAGS.to_vec();
        args.extend(["--steps", "6", "--micro-batch", "2", "--resume", resume]);
        let (ok, text) = finetune(&model, data, &out, &args);
        assert!(!ok, "--resume {resume} should fail: {text}");
        text
    };
    for (flags, named) in [
        (&["--caption-dropout", "1.5"][..], "--caption-dropout 1.5"),
        (&["--use-ema", "--lora-rank", "2"], "--lora-rank"),
        (&["--checkpoints-total-limit", "0"], "--checkpoints-total-limit 0"),
        (&["--validation-steps", "5"], "--validation-steps needs --validation-prompt"),
        // Numbers that would train to NaN weights (and save them) are refused by flag.
        (&["--lr", "nan"], "--lr"),
        (&["--noise-offset", "nan"], "--noise-offset"),
        (&["--snr-gamma", "0"], "--snr-gamma"),
        (&["--lora-rank", "2", "--lora-alpha", "0"], "--lora-alpha"),
        // Flags that mean nothing without their partner.
        (&["--lora-alpha", "4"], "--lora-rank"),
        (&["--num-validation-images", "3"], "--validation-prompt"),
        // Counts of nothing, refused by flag.
        (&["--steps", "0"], "'0' for '--steps <STEPS>': must be at least 1"),
        (&["--micro-batch", "0"], "'0' for '--micro-batch <MICRO_BATCH>': must be at least 1"),
        (&["--grad-accum", "0"], "'0' for '--grad-accum <GRAD_ACCUM>': must be at least 1"),
        (&["--num-validation-images", "0"], "'0' for '--num-validation-images <NUM_VALIDATION_IMAGES>'"),
    ] {
        let (ok, text) = finetune(&model, data, &out, flags);
        assert!(!ok && text.contains(named), "{flags:?}: {text}");
    }
    // A checkpoint past --steps is named, not a run that ends at once as if it trained.
    let reference_checkpoint = reference().join("checkpoint-6");
    let mut args = FLAGS.to_vec();
    args.extend(["--steps", "4", "--micro-batch", "2", "--resume", reference_checkpoint.to_str().unwrap()]);
    let (ok, text) = finetune(&model, data, &out, &args);
    assert!(!ok && text.contains("is at step 6, past --steps 4"), "{text}");
    let text = try_resume("/nonexistent/checkpoint-4");
    assert!(text.contains("--resume /nonexistent/checkpoint-4"), "{text}");

    std::fs::write(out.join("latest"), "checkpoint-8").unwrap();
    let text = try_resume("latest");
    assert!(text.contains("latest") && text.contains("checkpoint-8"), "a dangling latest is named: {text}");

    // A copy of a real checkpoint, then broken a file at a time.
    let copy = out.join("checkpoint-6");
    std::fs::create_dir_all(copy.join("unet")).unwrap();
    for entry in std::fs::read_dir(reference().join("checkpoint-6")).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, copy.join(path.file_name().unwrap())).unwrap();
        }
    }
    std::fs::write(out.join("latest"), "checkpoint-6").unwrap();
    let text = try_resume("latest");
    assert!(text.contains("checkpoint-6/unet/diffusion_pytorch_model.safetensors"), "a missing file is named: {text}");
    std::fs::write(copy.join("trainer.json"), "{ not json").unwrap();
    let text = try_resume(copy.to_str().unwrap());
    assert!(text.contains("checkpoint-6/trainer.json"), "a corrupt file is named: {text}");
}
