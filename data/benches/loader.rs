//! Images per second of the input pipeline alone (no model): our [`Loader`] against
//! torchvision's `DataLoader` with the same worker count, in one run
//! (`benches/loader_baseline.py`), and the ratio ours / torchvision's.
//!
//! `bash scripts/bench-data.sh [--workers N] [--images N] [--seconds S]`. Both sides read the
//! same synthetic data set, written once into a scratch folder: JPEG files in class
//! subfolders (`--source-size` pixels square) and the same images as an HDF5 file at 256 px
//! (the `vit data convert` layout). Each produces ImageNet-style training batches: random
//! resized crop to 224, horizontal flip, normalisation, float32 `[batch, 3, 224, 224]`.
//! Rows: the JPEG folder; the HDF5 file read directly (positioned reads, no library lock: see
//! `data::h5::Hdf5Images`); the HDF5 file read through the HDF5 library (its global lock), for
//! the difference that makes; torchvision with `ImageFolder` and with an h5py data set.
//!
//! The goal the project set: per 16 cores, at least the ~4,000 images/s one H100 consumes
//! training ViT-B/16; the last column scales the measured rate to 16 workers linearly.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use data::augment::{Normalize, Transform};
use data::folder::ImageFolder;
use data::h5::{convert_folder, Hdf5Images};
use data::images::Dataset;
use data::loader::{BatchSpec, Loader};

const BASELINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/loader_baseline.py");
/// The HDF5 copy's side: what ImageNet pipelines store before a 224 crop.
const STORED: usize = 256;
const CROP: usize = 224;
const CLASSES: usize = 4;

#[derive(Parser)]
struct Args {
    /// Decode threads (ours) and worker processes (torchvision).
    #[arg(long, default_value_t = engine::process::cores_per_rank())]
    workers: usize,
    /// Images in the synthetic data set.
    #[arg(long, default_value_t = 512)]
    images: usize,
    /// Side of the JPEG files in pixels.
    #[arg(long, default_value_t = 320)]
    source_size: u32,
    /// Images per batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// Seconds each row runs for (after one warm-up batch).
    #[arg(long, default_value_t = 8.0)]
    seconds: f64,
    /// The Python with torch, torchvision and h5py (scripts/bench-requirements.txt).
    #[arg(long, env = "SUITE_PYTHON", default_value = ".venv/bin/python")]
    python: PathBuf,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let scratch = std::env::temp_dir().join(format!("loader-bench-{}", std::process::id()));
    let result = run(&args, &scratch);
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

fn run(args: &Args, scratch: &Path) -> anyhow::Result<()> {
    let folder = scratch.join("jpeg");
    let h5 = scratch.join("images.h5");
    write_jpegs(&folder, args.images, args.source_size)?;
    convert_folder(&folder, &h5, STORED, 3)?;
    println!(
        "{} images ({} x {} JPEG; HDF5 at {STORED} px), batches of {} -> {CROP} px crops, {} workers, {} s per row",
        args.images, args.source_size, args.source_size, args.batch, args.workers, args.seconds
    );

    let rows: Vec<(&str, Arc<dyn Dataset>)> = vec![
        ("JPEG folder", Arc::new(ImageFolder::open(&folder, 3)?)),
        ("HDF5, direct reads", Arc::new(Hdf5Images::open(&h5)?)),
        ("HDF5, through the library", Arc::new(Hdf5Images::open(&h5)?.read_through_library()?)),
    ];
    let mut ours = Vec::new();
    for (name, dataset) in rows {
        ours.push((name, images_per_second(args, dataset)?));
    }
    let theirs = baseline(args, &folder, &h5)?;

    println!("\n| source | ours (images/s) | torchvision (images/s) | ours / torchvision | ours per 16 cores |");
    println!("|---|---:|---:|---:|---:|");
    for (name, rate) in &ours {
        let base = match *name {
            "JPEG folder" => Some(theirs.0),
            "HDF5, direct reads" => Some(theirs.1),
            _ => None,
        };
        let (base, ratio) = match base {
            Some(b) => (format!("{b:.0}"), format!("{:.2}", rate / b)),
            None => ("".into(), "".into()),
        };
        println!("| {name} | {rate:.0} | {base} | {ratio} | {:.0} |", rate * 16.0 / args.workers as f64);
    }
    Ok(())
}

/// Writes `n` JPEGs of `side` pixels into `CLASSES` class subfolders: smooth colour gradients
/// with a per-image pattern, so that decoding costs what a photograph of that size costs.
fn write_jpegs(folder: &Path, n: usize, side: u32) -> anyhow::Result<()> {
    for i in 0..n {
        let class = folder.join(format!("class{}", i % CLASSES));
        std::fs::create_dir_all(&class)?;
        let img = image::RgbImage::from_fn(side, side, |x, y| {
            let v = |k: u32| ((x * (k + i as u32 % 7) + y * (3 + k) + (x ^ y) * k) % 256) as u8;
            image::Rgb([v(1), v(2), v(3)])
        });
        let path = class.join(format!("{i:05}.jpg"));
        img.save(&path).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// Our loader's steady rate: batches of `args.batch` in a shuffled order, epoch after epoch,
/// until `args.seconds` have passed after one warm-up batch.
fn images_per_second(args: &Args, dataset: Arc<dyn Dataset>) -> anyhow::Result<f64> {
    let transform = Transform::Train {
        size: CROP,
        scale: (0.08, 1.0),
        ratio: (3.0 / 4.0, 4.0 / 3.0),
        hflip: true,
        normalize: Normalize::imagenet(),
    };
    let n = dataset.len();
    // Enough batches for any rate this machine could reach in the time given.
    let specs: Vec<BatchSpec> = (0..100_000u64)
        .map(|b| {
            let indices = (0..args.batch).map(|j| (b as usize * args.batch + j) * 7919 % n).collect();
            BatchSpec { indices, epoch: b }
        })
        .collect();
    let mut loader = Loader::new(dataset, transform, 0, specs, args.workers, 4)?;
    loader.next().context("no batch")??;
    let (start, mut images) = (Instant::now(), 0);
    while start.elapsed().as_secs_f64() < args.seconds {
        let batch = loader.next().context("the loader stopped")??;
        if batch.shape != [args.batch, 3, CROP, CROP] {
            bail!("batch of shape {:?}", batch.shape);
        }
        images += args.batch;
    }
    Ok(images as f64 / start.elapsed().as_secs_f64())
}

/// torchvision's rates for the JPEG folder and the HDF5 file, in that order.
fn baseline(args: &Args, folder: &Path, h5: &Path) -> anyhow::Result<(f64, f64)> {
    let text = engine::baseline::run(
        Command::new(&args.python)
            .arg(BASELINE)
            .args(["--folder", &folder.to_string_lossy(), "--h5", &h5.to_string_lossy()])
            .args(["--workers", &args.workers.to_string(), "--batch", &args.batch.to_string()])
            .args(["--seconds", &args.seconds.to_string(), "--crop", &CROP.to_string()]),
        BASELINE,
    )?;
    let rate = |key: &str| -> anyhow::Result<f64> {
        let line = text.lines().find(|l| l.starts_with(key)).with_context(|| format!("no {key} in:\n{text}"))?;
        Ok(line[key.len()..].trim().parse()?)
    };
    Ok((rate("folder")?, rate("h5")?))
}
