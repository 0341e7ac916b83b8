//! `vit eval`: top-1 and top-5 accuracy of a trained model on a data set.
use std::path::PathBuf;

use std::sync::Arc;

use data::augment::Transform;
use data::loader::{make_batch, BatchSpec};
use data::Dataset;
use engine::dist::{ProcessGroup, ReduceOp};
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::batch::{pad_to_blocks, to_tensors};
use crate::datasets::{DataArgs, Transforms};
use crate::model::{correct_top_k, Vit};
use crate::model_file::ModelFile;

/// Options of `vit eval`.
#[derive(clap::Args, Clone, Debug)]
pub struct EvalArgs {
    /// A `vit pretrain --out` folder (model.json and model.safetensors), or a folder timm saved
    /// (timm's config.json and model.safetensors).
    pub checkpoint: PathBuf,
    /// Images to evaluate: the validation split of these data arguments (all of --val-data if
    /// given; the embedded digits' validation split by default).
    #[command(flatten)]
    pub data: DataArgs,
}

/// The top-1 and top-5 accuracy; prints them.
pub fn run(args: &EvalArgs) -> anyhow::Result<(f64, f64)> {
    let dir = &args.checkpoint;
    let (file, cfg_path) = ModelFile::read(dir)?;
    let cfg = file.config;
    if cfg_path.ends_with(crate::model_file::TIMM_CONFIG) {
        if let Some(note) = ModelFile::timm_preprocessing_note(dir) {
            println!("{note}");
        }
    }
    let splits = args.data.splits()?;
    let val = splits.val;
    if val.is_empty() {
        anyhow::bail!("no images to evaluate: the validation set is empty (--val-fraction 0, or an empty --val-data)");
    }
    if val.channels() as i64 != cfg.in_channels || val.classes().len() as i64 != cfg.num_classes {
        anyhow::bail!(
            "{} takes {} channels and {} classes; the data set has {} and {}",
            cfg_path.display(),
            cfg.in_channels,
            cfg.num_classes,
            val.channels(),
            val.classes().len()
        );
    }
    if let Some(trained) = &file.label_names {
        crate::model::check_classes(trained, val.classes(), &cfg_path.display().to_string(), "the data set")?;
    }
    // The initial draws, which the file's weights replace, in a seeded section all the same: a
    // draw outside one could fall between another job's seed and its weights.
    let (vs, model) = engine::random::seeded(0, || {
        let vs = VarStore::new(Device::Cpu);
        let model = Vit::new(&vs.root(), cfg);
        (vs, model)
    });
    let weights = dir.join("model.safetensors");
    let unused = data::checkpoint::load_safetensors(&vs, &weights)?;
    // Weights the model does not take mean that model.json describes another model (fewer
    // blocks, say): evaluating what it does take would give a silently wrong accuracy.
    if !unused.is_empty() {
        anyhow::bail!(
            "{}: {} keys that the model of {} does not have, e.g. {}",
            weights.display(),
            unused.len(),
            cfg_path.display(),
            unused[0]
        );
    }
    let world = engine::dist::World::single(&engine::dist::InitOptions::default())?;
    // The model's own normalisation (files before it was recorded: what training would use on
    // this data).
    let mut eval = Transforms::new(cfg.image_size as usize, cfg.in_channels as usize, splits.embedded, 1.0).eval;
    if let Some(normalize) = file.normalize() {
        eval = Transform::Eval { size: cfg.image_size as usize, normalize };
    }
    let (top1, top5) = evaluate(&model, &val, &eval, &world.group, 1, Device::Cpu, Kind::Float)?;
    println!("{} images: top-1 {:.2}%  top-5 {:.2}%", val.len(), 100.0 * top1, 100.0 * top5);
    Ok((top1, top5))
}

/// Top-1 and top-5 accuracy on `set`, each rank evaluating every N-th example and the counts
/// summed over the group; `blocks`: what every batch the model takes must divide by (chunks
/// are padded to it).
pub fn evaluate(
    model: &Vit,
    set: &Arc<dyn Dataset>,
    transform: &Transform,
    group: &ProcessGroup,
    blocks: usize,
    device: Device,
    kind: Kind,
) -> anyhow::Result<(f64, f64)> {
    let mine: Vec<usize> = (group.rank()..set.len()).step_by(group.size()).collect();
    let mut counts = [0i64; 2];
    for chunk in mine.chunks(256) {
        // Each batch of the evaluation is progress (the spawner's heartbeat).
        engine::dist::heartbeat::beat();
        let batch = make_batch(set.as_ref(), transform, 0, &BatchSpec { indices: chunk.to_vec(), epoch: 0 })?;
        let (images, labels) = to_tensors(&batch, device, kind)?;
        let padded = pad_to_blocks(&images, blocks)?;
        let logits = tch::no_grad(|| model.forward(&padded))?.f_narrow(0, 0, images.size()[0])?;
        counts[0] += correct_top_k(&logits, &labels, 1);
        counts[1] += correct_top_k(&logits, &labels, 5);
    }
    let counts = Tensor::from_slice(&counts);
    group.all_reduce(&counts, ReduceOp::Sum)?;
    let n = set.len() as f64;
    Ok((counts.int64_value(&[0]) as f64 / n, counts.int64_value(&[1]) as f64 / n))
}
