//! Checkpoints of `diffusion finetune` (`--checkpointing-steps`, `--resume`), in the layout
//! diffusers' script writes where it has one. `checkpoint-<step>/` under `--out` holds:
//!
//! - `unet/` (`config.json`, `diffusion_pytorch_model.safetensors`: the full fp32 UNet, which
//!   diffusers loads), or with `--lora-rank` `lora.safetensors` (the adapters as they train);
//! - `unet_ema/` with `--use-ema` (as `EMAModel.save_pretrained` writes it, [`super::ema`]);
//! - the optimizer state: Gemini's, sharded (`optimizer-<r>-of-<n>.safetensors` and
//!   `optimizer-index.json`, `save_optimizer`), or the adapters' `optimizer.safetensors`;
//! - `trainer.json`: the step, the loss scaler and the settings a resume must agree with.
//!
//! Every other random draw is keyed by the seed, step and image, so the step restores them.
//! [`data::checkpoint_folders`] stages, commits and prunes the folders and keeps `latest`
//! naming a complete one. Everything is stored by parameter name, so a checkpoint resumes on
//! another number of ranks.
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use data::checkpoint_folders;
use serde::{Deserialize, Serialize};
use tch::Tensor;

use super::{Trainer, UnetTraining};
use crate::weights::{CONFIG, WEIGHTS};

/// The adapters' file in a checkpoint (their raw tensors, unlike the scaled
/// `pytorch_lora_weights.safetensors`, so a resume continues bit for bit).
const LORA: &str = "lora.safetensors";
/// The adapters' optimizer state.
const LORA_OPTIMIZER: &str = "optimizer.safetensors";

/// What `trainer.json` records.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainerState {
    /// Optimizer steps completed.
    pub step: usize,
    /// Ranks of the run that saved it.
    pub world_size: usize,
    /// Images per optimizer step over all ranks.
    pub global_batch: usize,
    /// Seed of the run.
    pub seed: u64,
    /// Optimizer name.
    pub optimizer: String,
    /// Peak learning rate (absent in checkpoints written before it was recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    /// fp32, bf16 or fp16.
    pub precision: String,
    /// LoRA's rank, if adapters train.
    pub lora_rank: Option<i64>,
    /// LoRA's alpha, if adapters train.
    pub lora_alpha: Option<f64>,
    /// Whether the EMA weights are kept.
    pub use_ema: bool,
    /// The fp16 loss scale.
    pub loss_scale: f64,
    /// Clean steps since the loss scale last changed.
    pub clean_steps: usize,
}

impl TrainerState {
    /// Errors naming the first setting in which `self` (the checkpoint in `dir`) and `run`
    /// differ. The number of ranks may change; the global batch (the data order) may not.
    pub fn check_matches(&self, run: &TrainerState, dir: &Path) -> anyhow::Result<()> {
        let show = |x: Option<f64>| x.map_or("none".to_string(), |x| x.to_string());
        let pairs = [
            ("--optimizer", self.optimizer.clone(), run.optimizer.clone()),
            // diffusers' resume (accelerate's load_state) keeps the saved optimizer's and
            // scheduler's rates whatever --learning_rate says; a new rate is refused, not
            // silently applied or ignored.
            ("--lr", show(self.lr), show(run.lr.filter(|_| self.lr.is_some()))),
            (
                "a global batch (ranks x --micro-batch x --grad-accum) of",
                self.global_batch.to_string(),
                run.global_batch.to_string(),
            ),
            ("--seed", self.seed.to_string(), run.seed.to_string()),
            ("--precision", self.precision.clone(), run.precision.clone()),
            ("--lora-rank", show(self.lora_rank.map(|r| r as f64)), show(run.lora_rank.map(|r| r as f64))),
            ("--lora-alpha", show(self.lora_alpha), show(run.lora_alpha)),
            ("--use-ema", self.use_ema.to_string(), run.use_ema.to_string()),
        ];
        for (what, saved, now) in pairs {
            if saved != now {
                bail!("cannot resume from {}: it was trained with {what} {saved}, this run has {now}", dir.display());
            }
        }
        Ok(())
    }
}

/// The checkpoint folder `--resume` names: `latest` is the one `out/latest` names (`None` when
/// `out` has none yet), anything else a folder, as given or under `out`. A folder that is not
/// there is an error naming it.
pub fn resume_dir(resume: &str, out: &Path) -> anyhow::Result<Option<PathBuf>> {
    if resume == "latest" {
        return checkpoint_folders::latest(out).context("--resume latest");
    }
    let given = PathBuf::from(resume);
    let under_out = out.join(&given);
    match (given.is_dir(), under_out.is_dir()) {
        (true, _) => Ok(Some(given)),
        (false, true) => Ok(Some(under_out)),
        _ => bail!("--resume {resume}: no checkpoint folder there (nor at {})", under_out.display()),
    }
}

/// `trainer.json` of checkpoint `dir`.
pub fn read_state(dir: &Path) -> anyhow::Result<TrainerState> {
    Ok(checkpoint_folders::read_trainer_state(dir, "a diffusion finetune trainer state")?)
}

impl Trainer<'_> {
    /// The settings a checkpoint records and a resume must agree with, at `step`.
    fn state(&self, step: usize) -> TrainerState {
        let a = self.args;
        TrainerState {
            step,
            world_size: self.world.size(),
            global_batch: a.micro_batch * a.grad_accum * self.world.size(),
            seed: a.seed.seed,
            optimizer: a.optimizer.optimizer.name().to_string(),
            lr: Some(a.optimizer.lr),
            precision: self.precision.name().to_string(),
            lora_rank: a.lora_rank,
            lora_alpha: a.lora_rank.map(|r| a.lora_alpha.unwrap_or(r as f64)),
            use_ema: self.ema.is_some(),
            loss_scale: self.training.scaler().map_or(1.0, |s| s.scale),
            clean_steps: self.training.scaler().map_or(0, |s| s.clean_steps()),
        }
    }

    /// Writes `checkpoint-<step>/` under `--out` (every rank calls this) and keeps at most
    /// `--checkpoints-total-limit` checkpoints.
    pub fn save_checkpoint(&self) -> anyhow::Result<()> {
        let (out, step, rank) = (&self.args.out, self.step, self.world.rank());
        let tmp = checkpoint_folders::staging(out, step);
        // Held until the commit: Ctrl-C before it removes the half-written folder.
        let _staging = (rank == 0).then(|| checkpoint_folders::begin(out, step)).transpose()?;
        self.world.group.barrier()?;
        match &self.training {
            UnetTraining::Gemini { gemini, .. } => {
                // Collective: every rank gathers its shards.
                let weights = gemini.state_dict()?;
                gemini.save_optimizer(&tmp)?;
                if rank == 0 {
                    let unet = tmp.join("unet");
                    std::fs::create_dir_all(&unet).with_context(|| format!("creating {}", unet.display()))?;
                    let config = self.args.model.join("unet").join(CONFIG);
                    std::fs::copy(&config, unet.join(CONFIG))
                        .with_context(|| format!("copying {}", config.display()))?;
                    data::checkpoint::save_tensors(&weights, &unet.join(WEIGHTS))?;
                }
                if let Some(ema) = &self.ema {
                    let weights = ema.weights(gemini)?;
                    if rank == 0 {
                        ema.save(&weights, &self.args.model.join("unet").join(CONFIG), &tmp.join("unet_ema"))?;
                    }
                }
            }
            UnetTraining::Lora { lora, parallel, .. } if rank == 0 => {
                let raw: Vec<(String, Tensor)> = lora.params().into_iter().map(|p| (p.name, p.tensor)).collect();
                data::checkpoint::save_tensors(&raw, &tmp.join(LORA))?;
                data::checkpoint::save_tensors(&parallel.optimizer().state(), &tmp.join(LORA_OPTIMIZER))?;
            }
            UnetTraining::Lora { .. } => {}
        }
        if rank == 0 {
            checkpoint_folders::write_trainer_state(&tmp, &self.state(step))?;
        }
        // Every rank's files are in place before this barrier; rank 0 then commits.
        self.world.group.barrier()?;
        if rank == 0 {
            checkpoint_folders::commit(out, step, self.args.checkpoints_total_limit)?;
        }
        self.world.group.barrier()?;
        Ok(())
    }

    /// Continues from checkpoint `dir` (every rank calls this): weights, optimizer state, EMA,
    /// loss scaler and step. A checkpoint made with other settings is an error naming the
    /// setting, a missing or unreadable file one naming the file.
    pub fn resume(&mut self, dir: &Path) -> anyhow::Result<()> {
        let saved = read_state(dir)?;
        saved.check_matches(&self.state(saved.step), dir)?;
        match &mut self.training {
            UnetTraining::Gemini { gemini, .. } => {
                let path = dir.join("unet").join(WEIGHTS);
                let weights = data::checkpoint::read_tensors(&path)?;
                gemini.load_state_dict(&weights).with_context(|| format!("{}", path.display()))?;
                gemini.load_optimizer(dir).with_context(|| format!("the optimizer state in {}", dir.display()))?;
                if let Some(ema) = self.ema.as_mut() {
                    ema.load(gemini, &dir.join("unet_ema"))?;
                }
            }
            UnetTraining::Lora { lora, parallel, .. } => {
                let path = dir.join(LORA);
                let mut file = data::checkpoint::read_tensors(&path)?;
                let raw: Vec<(String, Tensor)> = lora.params().into_iter().map(|p| (p.name, p.tensor)).collect();
                data::checkpoint::copy_into(&raw, &mut file, &path)?;
                let path = dir.join(LORA_OPTIMIZER);
                let mut state = data::checkpoint::read_tensors(&path)?;
                parallel.optimizer_mut().load_state(&mut state).with_context(|| format!("{}", path.display()))?;
            }
        }
        if let Some(s) = self.training.scaler_mut() {
            s.resume(saved.loss_scale, saved.clean_steps);
        }
        self.step = saved.step;
        if self.world.rank() == 0 {
            eprintln!("resuming from {} (step {})", dir.display(), self.step);
        }
        Ok(())
    }
}
