//! What the fine-tuning test files share: the tiny pipeline, a captioned image folder and the
//! command.
#![allow(dead_code)]
use std::path::{Path, PathBuf};
use std::process::Command;

/// The tiny diffusers pipeline folder (`fixtures/pipeline`).
pub fn pipeline() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/pipeline")
}

/// Three 20x24 images with captions in `metadata.jsonl`.
pub fn write_images(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let mut meta = String::new();
    for i in 0..3 {
        let mut rng = data::augment::Rng::keyed(1, i, 0);
        let pixels: Vec<f32> = (0..3 * 20 * 24).map(|_| rng.uniform() as f32).collect();
        data::images::Image::new(3, 20, 24, pixels).write_png(&dir.join(format!("img{i}.png"))).unwrap();
        meta.push_str(&format!("{{\"file_name\": \"img{i}.png\", \"text\": \"picture number {i}\"}}\n"));
    }
    std::fs::write(dir.join("metadata.jsonl"), meta).unwrap();
}

/// Two steps of two 16 px images each, at learning rate 1e-3, flipped at random: the runs
/// that check what the command writes.
pub const SMALL_RUN: [&str; 9] =
    ["--resolution", "16", "--steps", "2", "--micro-batch", "2", "--lr", "1e-3", "--random-flip"];

/// Runs `diffusion finetune --model <model> --data <data> <flags> -o <out>`: whether it
/// succeeded, and its output.
pub fn finetune(model: &Path, data: &Path, out: &Path, flags: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_diffusion"))
        .arg("finetune")
        .arg("--model")
        .arg(model)
        .arg("--data")
        .arg(data)
        .args(flags)
        .arg("-o")
        .arg(out)
        .output()
        .unwrap();
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}
