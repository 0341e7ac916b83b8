//! Where `vit pretrain` and `vit eval` get their images: the embedded digits, a folder of
//! class subfolders, or an HDF5 file, with a fixed validation hold-out when no separate
//! validation set is given; and the transforms that suit each.
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use data::augment::{Normalize, Transform};
use data::{digits, Dataset, Hdf5Images, ImageFolder, Subset};

/// Which images to use.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct DataArgs {
    /// Training images: a folder with one subfolder per class, or an HDF5 file (`.h5`/`.hdf5`,
    /// see `vit data convert`). Without it, the embedded 8x8 digits.
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Validation images in the same forms; without it a fixed share of --data is held out.
    #[arg(long)]
    pub val_data: Option<PathBuf>,
    /// Share of --data held out for validation when --val-data is not given (default 0.1).
    #[arg(long, value_parser = engine::parse::share, conflicts_with = "val_data")]
    pub val_fraction: Option<f64>,
    /// Colour channels to decode image folders to, 1 or 3 (default 3).
    #[arg(long, value_parser = engine::parse::count(1..=3))]
    pub channels: Option<usize>,
}

/// Training and validation sets.
pub struct Splits {
    /// Training examples.
    pub train: Arc<dyn Dataset>,
    /// Validation examples.
    pub val: Arc<dyn Dataset>,
    /// Whether this is the embedded default (8x8 digits).
    pub embedded: bool,
}

/// Opens a folder (decoded to `channels`, 3 by default) or an HDF5 data set (whose channels
/// were fixed when it was converted: another `channels` is an error); the error names the path.
pub fn open(path: &Path, channels: Option<usize>) -> anyhow::Result<Arc<dyn Dataset>> {
    if !path.exists() {
        bail!("{}: does not exist", path.display());
    }
    Ok(if data::h5::is_hdf5_path(path) {
        let h5 = Hdf5Images::open(path)?;
        if let Some(c) = channels.filter(|&c| c != h5.channels()) {
            bail!(
                "--channels {c}: {} holds {}-channel images (fixed when it was converted)",
                path.display(),
                h5.channels()
            );
        }
        Arc::new(h5)
    } else if path.is_dir() {
        Arc::new(ImageFolder::open(path, channels.unwrap_or(3))?)
    } else {
        bail!("{}: neither a folder of class subfolders nor an .h5/.hdf5 file", path.display())
    })
}

impl DataArgs {
    /// The training and validation sets these arguments name.
    pub fn splits(&self) -> anyhow::Result<Splits> {
        let Some(path) = &self.data else {
            // The digits are 1-channel with a fixed split: these flags would be ignored.
            for (flag, given) in [
                ("--val-data", self.val_data.is_some()),
                ("--val-fraction", self.val_fraction.is_some()),
                ("--channels", self.channels.is_some()),
            ] {
                if given {
                    bail!("{flag} needs --data (the embedded digits have one channel and a fixed split)");
                }
            }
            let (train, val) = digits::split();
            return Ok(Splits { train: Arc::new(train), val: Arc::new(val), embedded: true });
        };
        let channels = self.channels;
        let all = open(path, channels)?;
        if let Some(val_path) = &self.val_data {
            let val = open(val_path, channels)?;
            if val.classes() != all.classes() || val.channels() != all.channels() {
                bail!(
                    "--val-data {} has classes {:?} and {} channels; --data {} has {:?} and {}",
                    val_path.display(),
                    val.classes(),
                    val.channels(),
                    path.display(),
                    all.classes(),
                    all.channels()
                );
            }
            return Ok(Splits { train: all, val, embedded: false });
        }
        let fraction = self.val_fraction.unwrap_or(0.1);
        if fraction >= 1.0 {
            bail!("--val-fraction {fraction}: some of --data must stay for training");
        }
        let held = ((all.len() as f64 * fraction).round() as usize).min(all.len().saturating_sub(1));
        let order: Vec<usize> = digits::permutation(all.len(), 0x5eed).into_iter().map(|i| i as usize).collect();
        let (train, val) = order.split_at(all.len() - held);
        Ok(Splits {
            train: Arc::new(Subset::new(all.clone(), train.to_vec())),
            val: Arc::new(Subset::new(all, val.to_vec())),
            embedded: false,
        })
    }
}

/// How images are prepared for a model of `size` pixels.
#[derive(Clone, Debug)]
pub struct Transforms {
    /// For training (random geometry).
    pub train: Transform,
    /// For evaluation (deterministic).
    pub eval: Transform,
}

impl Transforms {
    /// The digits: small random crops (no flips: a mirrored digit is another glyph), pixels to
    /// [-1, 1]. Photos: torchvision's random resized crop and flips, ImageNet statistics (grey
    /// images use the mean of the channels' statistics).
    pub fn new(size: usize, channels: usize, embedded: bool, crop_scale: f64) -> Transforms {
        let normalize = if embedded {
            Normalize::symmetric()
        } else if channels == 3 {
            Normalize::imagenet()
        } else {
            Normalize { mean: vec![0.449], std: vec![0.226] }
        };
        let train = Transform::Train {
            size,
            scale: (crop_scale, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
            hflip: !embedded,
            normalize: normalize.clone(),
        };
        Transforms { train, eval: Transform::Eval { size, normalize } }
    }
}

/// Checks a data set exists and can be decoded at index 0, naming the path on failure.
pub fn probe(set: &dyn Dataset, what: &str) -> anyhow::Result<()> {
    if set.is_empty() {
        bail!("{what} has no images");
    }
    set.get(0).with_context(|| format!("reading the first image of {what}"))?;
    Ok(())
}
