//! The `vit` binary: a short pretrain then eval on the digits, an image folder converted to
//! HDF5 and trained on, and bad inputs that must be errors naming the file or flag.
use std::path::Path;
use std::process::Command;

use suite_tests::scratch;

fn vit(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_vit")).args(args).output().expect("running vit");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// A folder of two classes of 12x10 PNGs: dark images are class "a", bright ones "b".
fn image_folder(root: &Path, per_class: u8) {
    for (class, base) in [("a", 20u8), ("b", 200u8)] {
        std::fs::create_dir_all(root.join(class)).unwrap();
        for i in 0..per_class {
            let img =
                image::RgbImage::from_fn(12, 10, |x, y| image::Rgb([base + i, base + (x as u8), base + (y as u8)]));
            img.save(root.join(class).join(format!("{i}.png"))).unwrap();
        }
    }
}

#[test]
fn pretrain_then_eval_reports_the_same_accuracy() {
    let dir = scratch("vit-cli", "eval");
    let out = dir.join("run");
    let (ok, text) = vit(&[
        "pretrain",
        "--quiet",
        "--steps",
        "60",
        "--warmup",
        "5",
        "--batch",
        "64",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(ok, "{text}");
    let trained: f64 = text.split("validation top-1 ").nth(1).unwrap().split('%').next().unwrap().parse().unwrap();
    assert!(trained > 15.0, "60 steps lift accuracy above chance (10%): {text}");
    let (ok, text) = vit(&["eval", out.to_str().unwrap()]);
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("297 images: top-1 {trained:.2}%")),
        "eval agrees with training's {trained}: {text}"
    );
    // timm's config.json describes the same model and preprocessing: alone (as a folder timm
    // saved), it evaluates the same.
    let timm: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(timm["model_args"]["embed_dim"], 64, "{timm}");
    assert_eq!(timm["pretrained_cfg"]["mean"], serde_json::json!([0.5]), "{timm}");
    assert_eq!(timm["label_names"][9], "9", "{timm}");
    let timm_only = dir.join("timm");
    std::fs::create_dir_all(&timm_only).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(out.join(file), timm_only.join(file)).unwrap();
    }
    let (ok, text) = vit(&["eval", timm_only.to_str().unwrap()]);
    assert!(ok && text.contains(&format!("297 images: top-1 {trained:.2}%")), "{text}");
    // Flags the embedded digits would ignore are errors naming them.
    let (ok, text) = vit(&["eval", out.to_str().unwrap(), "--val-fraction", "0.5"]);
    assert!(!ok && text.contains("--val-fraction needs --data"), "{text}");
    // A model.json of fewer blocks than the weights hold is named, not evaluated with the
    // blocks it has.
    let config = out.join("model.json");
    let json = std::fs::read_to_string(&config).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&json).unwrap();
    cfg["depth"] = (cfg["depth"].as_i64().unwrap() - 1).into();
    std::fs::write(&config, cfg.to_string()).unwrap();
    let (ok, text) = vit(&["eval", out.to_str().unwrap()]);
    assert!(!ok && text.contains("keys that the model of") && text.contains("model.json"), "{text}");
    std::fs::write(&config, json).unwrap();
    // A weights file with a key missing is named.
    let weights = out.join("model.safetensors");
    let mut tensors = tch::Tensor::read_safetensors(&weights).unwrap();
    tensors.retain(|(name, _)| name != "head.bias");
    tch::Tensor::write_safetensors(&tensors, &weights).unwrap();
    let (ok, text) = vit(&["eval", out.to_str().unwrap()]);
    assert!(!ok && text.contains("missing key head.bias") && text.contains("model.safetensors"), "{text}");
}

/// `vit pretrain` on a tiny ViT for 8x8 inputs, with extra arguments.
fn pretrain_tiny(extra: &[&str]) -> (bool, String) {
    let tiny = "pretrain --quiet --model vit_tiny_patch16_224 --image-size 8 --patch-size 4";
    vit(&tiny.split(' ').chain(extra.iter().copied()).collect::<Vec<_>>())
}

#[test]
fn folder_to_hdf5_and_training_on_both() {
    let dir = scratch("vit-cli", "folder");
    let folder = dir.join("images");
    image_folder(&folder, 8);
    let h5 = dir.join("images.h5");
    let (ok, text) = vit(&["data", "convert", folder.to_str().unwrap(), h5.to_str().unwrap(), "--size", "8"]);
    assert!(ok && text.contains("wrote 16 images"), "{text}");
    for data in [&folder, &h5] {
        let (ok, text) = pretrain_tiny(&[
            "--steps",
            "2",
            "--batch",
            "8",
            "--val-fraction",
            "0.25",
            "--data",
            data.to_str().unwrap(),
        ]);
        assert!(ok, "{}: {text}", data.display());
        assert!(text.contains("12 training / 4 validation images"), "{text}");
    }
    // An HDF5 file's channels were fixed when it was converted: --channels cannot change them.
    let (ok, text) =
        pretrain_tiny(&["--steps", "1", "--batch", "8", "--channels", "1", "--data", h5.to_str().unwrap()]);
    assert!(!ok && text.contains("--channels 1") && text.contains("3-channel images"), "{text}");
    let (ok, text) = pretrain_tiny(&["--steps", "1", "--data", dir.join("missing").to_str().unwrap()]);
    assert!(!ok && text.contains("missing: does not exist"), "{text}");
    // Nothing held out: training says it did not validate (not an accuracy of 0%), eval that
    // it has nothing to evaluate.
    let out = dir.join("unvalidated");
    let args = ["--steps", "1", "--batch", "8", "--val-fraction", "0", "--out", out.to_str().unwrap()];
    let (ok, text) = pretrain_tiny(&[&args[..], &["--data", folder.to_str().unwrap()]].concat());
    assert!(ok && text.contains("not validated") && !text.contains("validation top-1"), "{text}");
    // Starting afresh over that run says that its checkpoint will be replaced.
    let (ok, text) = pretrain_tiny(&[&args[..], &["--data", folder.to_str().unwrap()]].concat());
    assert!(ok && text.contains("holds checkpoint-1; this run starts afresh and replaces it"), "{text}");
    let (ok, text) = vit(&["eval", out.to_str().unwrap(), "--data", folder.to_str().unwrap(), "--val-fraction", "0"]);
    assert!(!ok && text.contains("no images to evaluate"), "{text}");
    // Data whose folders give the labels other names is neither evaluated nor trained on
    // further: label 1 would mean another class.
    let renamed = dir.join("renamed");
    std::fs::create_dir_all(&renamed).unwrap();
    std::fs::rename(folder.join("b"), renamed.join("c")).unwrap();
    std::fs::rename(folder.join("a"), renamed.join("a")).unwrap();
    let renamed_data = ["--data", renamed.to_str().unwrap()];
    let (ok, text) = vit(&[&["eval", out.to_str().unwrap(), "--val-fraction", "0.5"][..], &renamed_data].concat());
    assert!(!ok && text.contains("model.json was trained on 2 classes") && text.contains("label 1 is \"b\""), "{text}");
    let resume = ["--steps", "2", "--batch", "8", "--val-fraction", "0", "--resume", "--out", out.to_str().unwrap()];
    let (ok, text) = pretrain_tiny(&[&resume[..], &renamed_data].concat());
    assert!(!ok && text.contains("cannot resume") && text.contains("\"c\" here"), "{text}");
    std::fs::rename(renamed.join("a"), folder.join("a")).unwrap();
    std::fs::rename(renamed.join("c"), folder.join("b")).unwrap();
    // A corrupt image is named, and the run's --out folder, empty, is removed again.
    std::fs::write(folder.join("b").join("broken.png"), b"not a png").unwrap();
    let failed = dir.join("failed");
    let (ok, text) = pretrain_tiny(&[
        "--steps",
        "3",
        "--batch",
        "16",
        "--val-fraction",
        "0",
        "--data",
        folder.to_str().unwrap(),
        "--out",
        failed.to_str().unwrap(),
    ]);
    assert!(!ok && text.contains("broken.png"), "{text}");
    assert!(!failed.exists(), "an empty {} was left behind", failed.display());
    // A file that is not HDF5 is named.
    let bad = dir.join("bad.h5");
    std::fs::write(&bad, b"not hdf5 at all").unwrap();
    let (ok, text) = vit(&["pretrain", "--quiet", "--data", bad.to_str().unwrap()]);
    assert!(!ok && text.contains("bad.h5"), "{text}");
}

#[test]
fn an_interrupted_conversion_leaves_no_temporary_file() {
    use std::os::unix::process::ExitStatusExt;
    let dir = scratch("vit-cli", "interrupt");
    let folder = dir.join("images");
    image_folder(&folder, 20);
    let out = dir.join("big.h5");
    let mut child = Command::new(env!("CARGO_BIN_EXE_vit"))
        .args(["data", "convert", folder.to_str().unwrap(), out.to_str().unwrap(), "--size", "1024"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let temporary = || {
        std::fs::read_dir(&dir).unwrap().any(|e| e.unwrap().file_name().to_string_lossy().starts_with(".big.h5.tmp-"))
    };
    let start = std::time::Instant::now();
    while !temporary() {
        assert!(child.try_wait().unwrap().is_none(), "the conversion ended before it could be interrupted");
        assert!(start.elapsed().as_secs() < 60, "no temporary file after a minute");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(2), "ends as interrupted: {status:?}");
    assert!(!temporary() && !out.exists(), "an interrupted conversion left a file behind");
}

/// Ctrl-C (SIGINT to the whole foreground process group) of a 2-rank run that checkpoints
/// every step: the job ends as interrupted, its ranks with it, and nothing is left behind: no
/// staging folder beside the checkpoints, nothing in the temporary folder (the spawner's
/// heartbeats included), and `latest` still names a complete checkpoint.
#[test]
fn an_interrupted_multi_rank_run_leaves_nothing_behind() {
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    let dir = scratch("vit-cli", "interrupt-run");
    let (out, tmp) = (dir.join("run"), dir.join("tmp"));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vit"))
        .args(["pretrain", "--quiet", "--nproc", "2", "--steps", "100000", "--batch", "16", "--save-every", "1"])
        .args(["--timeout", "60", "--out", out.to_str().unwrap()])
        .env("TMPDIR", &tmp)
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    // A second commit: the ranks are past start-up, beating, and checkpointing step after step.
    let latest = || std::fs::read_to_string(out.join("latest")).unwrap_or_default();
    while matches!(latest().trim(), "" | "checkpoint-1") {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be interrupted");
        assert!(start.elapsed().as_secs() < 120, "no checkpoint after two minutes");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    // SAFETY: signalling the process group this test created.
    unsafe { libc::killpg(child.id() as i32, libc::SIGINT) };
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGINT), "ends as interrupted: {status:?}");
    // The ranks end with it (they got the same SIGINT).
    // SAFETY: signal 0 only asks whether the group still has members.
    while unsafe { libc::killpg(child.id() as i32, 0) } == 0 {
        assert!(start.elapsed().as_secs() < 180, "ranks still running after the interrupt");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "left in the temporary folder: {left:?}");
    let names: Vec<String> =
        std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(!names.iter().any(|n| n.ends_with(".tmp") || n.contains(".tmp-")), "half-written files: {names:?}");
    let latest = std::fs::read_to_string(out.join("latest")).unwrap();
    assert!(out.join(latest.trim()).join("trainer.json").exists(), "latest names {latest}: {names:?}");
}

#[test]
fn bad_flags_are_named() {
    let (ok, text) = vit(&["pretrain", "--batch", "12x"]);
    assert!(!ok && text.contains("\"12x\" is not a batch size"), "{text}");
    let (ok, text) = vit(&["pretrain", "--zero", "3"]);
    assert!(!ok && text.contains("--zero"), "{text}");
    // Numbers out of range stop the command before it starts, naming the flag.
    for (flag, value) in [
        ("--lr", "nan"),
        ("--mixup", "-1"),
        ("--smoothing", "2"),
        ("--crop-scale", "0"),
        ("--lr-base-batch", "0"),
        ("--nproc", "0"),
        ("--timeout", "inf"),
        ("--channels", "0"),
        ("--save-every", "0"),
    ] {
        let (ok, text) = vit(&["pretrain", &format!("{flag}={value}")]);
        assert!(!ok && text.contains(&format!("invalid value '{value}' for '{flag}")), "{text}");
    }
    // A bad timeout from the environment names the variable (clap names only the flag).
    let out = Command::new(env!("CARGO_BIN_EXE_vit"))
        .args(["pretrain", "--steps", "1"])
        .env("ENGINE_DIST_TIMEOUT", "soon")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && text.contains("the value of ENGINE_DIST_TIMEOUT"), "{text}");
    // A --nproc that a launcher's variables contradict is named, not silently ignored.
    let out = Command::new(env!("CARGO_BIN_EXE_vit"))
        .args(["pretrain", "--nproc", "2", "--steps", "1"])
        .envs([("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1"), ("SLURM_JOB_NODELIST", "localhost")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && text.contains("--nproc 2, but this process is rank 0 of 1"), "{text}");
    let (ok, text) = vit(&["pretrain", "--sequence-parallel", "--steps", "1"]);
    assert!(!ok && text.contains("--sequence-parallel") && text.contains("--tp 2 or more"), "{text}");
    let (ok, text) = vit(&["pretrain", "--pp", "2", "--pp-balance", "speed"]);
    assert!(!ok && text.contains("invalid value 'speed' for '--pp-balance"), "{text}");
    let (ok, text) = vit(&["pretrain", "--batch", "30", "--nproc", "4", "--steps", "1", "--timeout", "30"]);
    assert!(!ok && text.contains("--batch 30 does not split over 4 ranks") && text.contains("rank"), "{text}");
    // Flags that would change nothing at the sizes given are errors, not silently ignored;
    // sizes past counting are errors, not wrapped to 0.
    for (line, needle) in [
        ("--cluster c.json", "--parallel"),
        ("--tp-mode 2.5d --tp-depth 2", "--tp-mode 2.5d splits the model over --tp ranks: it needs --tp 2 or more"),
        ("--sp-mode ring", "--sp-mode ring is how --sp ranks attend: it needs --sp 2 or more"),
        ("--pp 2 --virtual-stages 2", "--virtual-stages 2 needs --schedule interleaved"),
        ("--batch 18014398509481984k", "is more examples than can be counted"),
        ("--pp 4294967296 --tp 4294967296", "is more ranks than can be counted"),
        // --parallel chooses the layout: a layout flag beside it is named even at its default.
        ("--parallel auto --pp 1", "--parallel chooses --pp itself"),
        ("--parallel plan --zero 0", "--parallel chooses --zero itself"),
    ] {
        let (ok, text) = vit(&[&["pretrain", "--steps", "1"][..], &line.split(' ').collect::<Vec<_>>()].concat());
        assert!(!ok && text.contains(needle), "{line}: {text}");
    }
}

#[test]
fn parallel_plan_prints_the_planner_choice_without_training() {
    let dir = scratch("vit-cli", "plan");
    let (ok, text) = vit(&["pretrain", "--parallel", "plan", "--nproc", "8", "--batch", "128"]);
    assert!(ok, "{text}");
    assert!(text.contains("plan (") && text.contains("ms/step") && text.contains("runners-up"), "{text}");
    // 1 MB per device: only pipelined, checkpointed plans fit the digits model.
    let tight = dir.join("cluster.json");
    std::fs::write(&tight, r#"{"memory_bytes": 1e6}"#).unwrap();
    let (ok, text) = vit(&["pretrain", "--parallel", "plan", "--nproc", "8", "--cluster", tight.to_str().unwrap()]);
    assert!(ok, "{text}");
    assert!(text.contains("blocks to checkpoint"), "{text}");
    std::fs::write(&tight, r#"{"memory_bytes": 1e3}"#).unwrap();
    let (ok, text) = vit(&["pretrain", "--parallel", "plan", "--nproc", "8", "--cluster", tight.to_str().unwrap()]);
    assert!(!ok && text.contains("no plan fits") && text.contains("memory_bytes"), "{text}");
    std::fs::write(&tight, r#"{"memory_byte": 1e6}"#).unwrap();
    let (ok, text) = vit(&["pretrain", "--parallel", "plan", "--nproc", "8", "--cluster", tight.to_str().unwrap()]);
    assert!(!ok && text.contains("cluster.json") && text.contains("memory_byte"), "{text}");
    // 16 examples on 3 ranks: only 3 stages of 4 micro-batches of 4 divide them.
    let (ok, text) = vit(&["pretrain", "--parallel", "plan", "--nproc", "3", "--batch", "16"]);
    assert!(ok && text.contains("--pp 3 --micro-batch 4"), "{text}");
}

#[test]
fn parallel_auto_prints_the_plan_then_trains_with_it() {
    let (ok, text) = vit(&[
        "pretrain",
        "--parallel",
        "auto",
        "--nproc",
        "2",
        "--batch",
        "16",
        "--steps",
        "2",
        "--quiet",
        "--timeout",
        "60",
    ]);
    assert!(ok, "{text}");
    let plan = text.find("ms/step").expect("the plan's predicted step time");
    let training = text.find("--parallel auto: training with the plan above").expect("the plan is run");
    let trained = text.find("validation top-1").expect("the run ends");
    assert!(plan < training && training < trained, "{text}");
    assert!(text.contains("link latency and bandwidth measured on this machine"), "{text}");
    let (ok, text) = vit(&["pretrain", "--parallel", "auto", "--nproc", "2", "--zero", "1"]);
    assert!(!ok && text.contains("--parallel chooses --zero itself"), "{text}");
}
