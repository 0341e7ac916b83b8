//! `fastfold train`'s checkpoints under `--out`: `checkpoint-<step>/` holds the trained weights
//! under AlphaFold's names (`weights.npz`, fp32, loadable by `predict`), the optimizer's state
//! and the weights' moving average by name (`state-rank<r>.safetensors`: the engine's
//! `{param}.{slot}` entries, [`engine::optim::Optimizer::state`] and
//! [`engine::optim::Ema::state`]) and `trainer.json` (the step and the settings a resume must
//! agree with). Every rank holds every weight (DAP splits activations, not parameters), so rank
//! 0 writes them; the state is rank 0's, or under ZeRO-1 each rank's shard, and a resume reads
//! every file's entries as one dictionary, so it may run on any number of ranks.
//! [`data::checkpoint_folders`] stages the folder and commits it by switching `latest`, so a
//! crash at any instant leaves `latest` naming a complete checkpoint; only the newest is kept.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use data::checkpoint_folders;
use engine::dist::World;
use engine::optim::StateDict;
use serde::{Deserialize, Serialize};
use tch::Tensor;

/// The trained weights in a checkpoint folder.
pub const WEIGHTS: &str = "weights.npz";
/// The start of the files of the optimizer's and the moving average's state, one per rank.
const STATE_PREFIX: &str = "state-rank";

/// The optimizer's and the moving average's state of rank `rank` in a checkpoint folder.
pub fn state_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("{STATE_PREFIX}{rank}.safetensors"))
}

/// What `trainer.json` records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: usize,
    /// `--seed`: it draws the steps whose backbone FAPE is clamped, and the features.
    pub seed: u64,
    /// `--optimizer`.
    pub optimizer: String,
    /// `--ema-decay` (0: no average).
    pub ema_decay: f64,
    /// Examples a step (replicas times accumulation): the examples of a step are numbered by it.
    pub global_batch: usize,
}

impl TrainerState {
    /// Errors naming the first setting in which `self` (the checkpoint) and `run` differ. The
    /// number of ranks, the learning rate, the schedule and the loss may change.
    pub fn check_matches(&self, run: &TrainerState) -> anyhow::Result<()> {
        let pairs = [
            ("--seed", self.seed.to_string(), run.seed.to_string()),
            ("--optimizer", self.optimizer.clone(), run.optimizer.clone()),
            ("--ema-decay", self.ema_decay.to_string(), run.ema_decay.to_string()),
            ("a global batch of", self.global_batch.to_string(), run.global_batch.to_string()),
        ];
        for (flag, saved, now) in pairs {
            if saved != now {
                bail!("cannot resume: the checkpoint was trained with {flag} {saved}, this run has {now}");
            }
        }
        Ok(())
    }
}

/// Writes step `state.step`'s checkpoint under `out` (every rank calls this): rank 0 writes
/// `weights` by AlphaFold's names and `trainer.json`, each rank its `entries` of the optimizer's
/// and average's state (none: no file).
pub fn save(
    out: &Path,
    world: &World,
    state: &TrainerState,
    weights: impl FnOnce(&Path) -> anyhow::Result<()>,
    entries: &[(String, Tensor)],
) -> anyhow::Result<()> {
    let barrier = || -> anyhow::Result<()> { Ok(world.group.barrier()?) };
    checkpoint_folders::save_from_ranks(out, state.step, world.rank(), Some(1), barrier, |dir| {
        if !entries.is_empty() {
            data::checkpoint::save_tensors(entries, &state_file(dir, world.rank()))?;
        }
        if world.rank() == 0 {
            weights(&dir.join(WEIGHTS))?;
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

/// The checkpoint `out/latest` names (an error naming `latest` when there is none).
pub fn latest(out: &Path) -> anyhow::Result<Saved> {
    let dir = checkpoint_folders::latest(out)?.with_context(|| {
        format!(
            "--resume: no checkpoint to resume from ({} is missing; --save-every writes them)",
            out.join(checkpoint_folders::LATEST).display()
        )
    })?;
    let state = checkpoint_folders::read_trainer_state(&dir, "a fastfold train trainer state")?;
    Ok(Saved { dir, state })
}

impl Saved {
    /// Copies the saved weights into `weights` (every name and shape checked).
    pub fn load_weights(&self, weights: &[(String, Tensor)]) -> anyhow::Result<()> {
        let path = self.dir.join(WEIGHTS);
        let mut file: std::collections::HashMap<String, Tensor> = data::npz::read(&path)?.into_iter().collect();
        data::checkpoint::copy_into(weights, &mut file, &path)?;
        Ok(())
    }

    /// The optimizer's and the average's state, by entry name: every rank's file in one
    /// dictionary, so that each rank takes its own entries wherever they were saved.
    pub fn read_state(&self) -> anyhow::Result<StateDict> {
        Ok(checkpoint_folders::read_rank_files(&self.dir, STATE_PREFIX)?)
    }
}
