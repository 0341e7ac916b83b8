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

/// Runs `diffusion finetune args`: whether it succeeded, and its output.
pub fn finetune(args: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_diffusion")).arg("finetune").args(args).output().unwrap();
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}
