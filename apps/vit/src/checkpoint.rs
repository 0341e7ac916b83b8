//! Training checkpoints under `--out`: `checkpoint-<step>/` holds the model (`model.safetensors`,
//! fp32, full tensors under timm's names at any `--tp` and `--pp`), the optimizer state by parameter
//! name (`optimizer-rank<r>.safetensors`, one per ZeRO shard; one file when the state is
//! replicated) and `trainer.json` (the step, the loss scaler, and the settings a resume
//! must agree with). [`data::checkpoint_folders`] stages and commits the folder and switches
//! `latest`, so a crash at any instant leaves `latest` naming a complete checkpoint.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use data::checkpoint_folders;
use engine::dist::World;
use engine::optim::StateDict;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::model::VitConfig;

/// What `trainer.json` records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: usize,
    /// Ranks of the run.
    pub world_size: usize,
    /// ZeRO stage.
    pub zero: u8,
    /// Tensor-parallel ranks (checkpoints from before `--tp` existed were made at 1).
    #[serde(default = "one")]
    pub tp: usize,
    /// Pipeline stages (checkpoints from before `--pp` existed were made at 1).
    #[serde(default = "one")]
    pub pp: usize,
    /// Optimizer name.
    pub optimizer: String,
    /// Global batch.
    pub global_batch: usize,
    /// Seed of the run.
    pub seed: u64,
    /// fp32, bf16 or fp16.
    pub precision: String,
    /// The fp16 loss scale.
    pub loss_scale: f64,
    /// Clean steps since the loss scale last changed.
    pub clean_steps: usize,
    /// The model's architecture.
    pub model: VitConfig,
    /// Class names by label (absent in checkpoints from before they were saved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub classes: Option<Vec<String>>,
}

impl TrainerState {
    /// Errors naming the first setting in which `self` (the checkpoint) and `run` differ.
    pub fn check_matches(&self, run: &TrainerState) -> anyhow::Result<()> {
        // The number of ranks, the ZeRO stage, --tp and --pp may change: weights and optimizer state
        // are stored whole by parameter name, and each rank takes (and slices) its own.
        let pairs = [
            ("--optimizer", self.optimizer.clone(), run.optimizer.clone()),
            ("--batch", self.global_batch.to_string(), run.global_batch.to_string()),
            ("--seed", self.seed.to_string(), run.seed.to_string()),
            ("--precision", self.precision.clone(), run.precision.clone()),
        ];
        for (what, saved, now) in pairs {
            if saved != now {
                bail!("cannot resume: the checkpoint was trained with {what} {saved}, this run has {now}");
            }
        }
        // Every architecture number that differs, in one sentence (another --model changes
        // several at once).
        let differ: Vec<_> =
            model_settings(&self.model).into_iter().zip(model_settings(&run.model)).filter(|(a, b)| a != b).collect();
        if !differ.is_empty() {
            let saved = and_list(differ.iter().map(|((what, saved), _)| format!("{what} {saved}")));
            let now = and_list(differ.iter().map(|(_, (_, now))| now.clone()));
            bail!("cannot resume: the checkpoint was trained with {saved}, this run has {now}");
        }
        if let (Some(saved), Some(now)) = (&self.classes, &run.classes) {
            crate::model::check_classes(saved, now, "cannot resume: the checkpoint", "--data")?;
        }
        Ok(())
    }
}

fn one() -> usize {
    1
}

/// The numbers of a model as a resume names them: the flags that set them, or what sets them
/// (`--model` the architecture, the data the channels and classes).
fn model_settings(c: &VitConfig) -> [(&'static str, String); 8] {
    let VitConfig { image_size, patch_size, in_channels, num_classes, width, depth, heads, mlp_ratio } = *c;
    [
        ("--image-size", image_size.to_string()),
        ("--patch-size", patch_size.to_string()),
        ("data channels", in_channels.to_string()),
        ("data classes", num_classes.to_string()),
        ("--model width", width.to_string()),
        ("--model depth", depth.to_string()),
        ("--model heads", heads.to_string()),
        ("--model mlp ratio", mlp_ratio.to_string()),
    ]
}

/// `a`, `a and b`, `a, b and c`.
fn and_list(items: impl Iterator<Item = String>) -> String {
    let mut items: Vec<String> = items.collect();
    match items.pop() {
        Some(last) if !items.is_empty() => format!("{} and {last}", items.join(", ")),
        last => last.unwrap_or_default(),
    }
}

/// The start of the optimizer state's files, one per rank that holds a part of it.
const OPTIMIZER_PREFIX: &str = "optimizer-rank";

fn optimizer_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("{OPTIMIZER_PREFIX}{rank}.safetensors"))
}

/// Writes a checkpoint of step `state.step` under `out` (every rank calls this), committed by
/// [`data::checkpoint_folders`]: a crash at any instant leaves `latest` naming a complete
/// checkpoint. Only the newest checkpoint is kept. Rank 0 writes `model` (full tensors);
/// each rank given `optimizer` state writes it to its own file (the caller picks the ranks so
/// that every entry is written once).
pub fn save(
    out: &Path,
    world: &World,
    state: &TrainerState,
    model: &[(String, Tensor)],
    optimizer: Option<&[(String, Tensor)]>,
) -> anyhow::Result<()> {
    let barrier = || -> anyhow::Result<()> { Ok(world.group.barrier()?) };
    checkpoint_folders::save_from_ranks(out, state.step, world.rank(), Some(1), barrier, |dir| {
        if let Some(entries) = optimizer {
            data::checkpoint::save_tensors(entries, &optimizer_file(dir, world.rank()))?;
        }
        if world.rank() == 0 {
            data::checkpoint::save_tensors(model, &dir.join("model.safetensors"))?;
            checkpoint_folders::write_trainer_state(dir, state)?;
        }
        Ok(())
    })
}

/// A checkpoint found under `--out`.
pub struct Saved {
    /// Its folder.
    pub dir: PathBuf,
    /// Its `trainer.json`.
    pub state: TrainerState,
}

/// The checkpoint `out/latest` points to.
pub fn latest(out: &Path) -> anyhow::Result<Saved> {
    let dir = checkpoint_folders::latest(out)?.with_context(|| {
        format!(
            "--resume: no checkpoint to resume from ({} is missing)",
            out.join(checkpoint_folders::LATEST).display()
        )
    })?;
    let state = checkpoint_folders::read_trainer_state(&dir, "a vit pretrain trainer state")?;
    Ok(Saved { dir, state })
}

impl Saved {
    /// Copies the saved weights into `model` (names and shapes checked).
    pub fn load_model(&self, model: &[(String, Tensor)]) -> anyhow::Result<()> {
        let path = self.dir.join("model.safetensors");
        let mut file = data::checkpoint::read_tensors(&path)?;
        data::checkpoint::copy_into(model, &mut file, &path)?;
        Ok(())
    }

    /// Every rank's saved optimizer state in one dictionary by name (full tensors), so a run on
    /// another number of ranks or another ZeRO stage takes its own parameters' entries wherever
    /// they were saved. Checked complete against the model's `weights`: every ViT weight has a
    /// gradient at every step, so each has every slot the files hold, and a missing entry is a
    /// lost or damaged file (an error naming it), not a parameter that starts afresh.
    pub fn read_optimizer(&self, weights: &[(String, Tensor)]) -> anyhow::Result<StateDict> {
        let dict: StateDict = checkpoint_folders::read_rank_files(&self.dir, OPTIMIZER_PREFIX)?;
        let names: std::collections::HashSet<&str> = weights.iter().map(|(n, _)| n.as_str()).collect();
        let slots: std::collections::BTreeSet<&str> = dict
            .keys()
            .filter_map(|k| k.rsplit_once('.'))
            .filter(|(name, _)| names.contains(name))
            .map(|(_, slot)| slot)
            .collect();
        for (name, _) in weights {
            if let Some(slot) = slots.iter().find(|s| !dict.contains_key(&format!("{name}.{s}"))) {
                bail!(
                    "{}: the optimizer state has no {name}.{slot} (a missing or damaged optimizer-rank file?)",
                    self.dir.display()
                );
            }
        }
        Ok(dict)
    }
}
