//! An exponential moving average of the UNet's weights, as diffusers' `EMAModel` keeps it for
//! `train_text_to_image.py --use_ema`: it starts at the pretrained weights, moves after every
//! optimizer step by `shadow -= (1 - decay) * (shadow - weights)` (EMAModel.step's fp32
//! arithmetic) with `decay` from [`EmaConfig::decay_at`], is swapped in for validation images,
//! and is the UNet the run saves at the end.
//!
//! The average lives in host memory (diffusers' `--offload_ema`) and is sharded as Gemini's
//! homes are ([`Gemini::home_shards`]): each rank averages its own part of every chunk, so under
//! ZeRO-3 it costs 1/N of the UNet per rank. It is saved as diffusers' `EMAModel.save_pretrained`
//! writes `unet_ema/`: the UNet's config with the EMA's settings and step added, and the
//! averaged weights, full, under the UNet's names.
use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use engine::gemini::Gemini;
use serde_json::Value;
use tch::{Device, Tensor};

use crate::weights::{CONFIG, WEIGHTS};
use crate::Result;

/// `EMAModel`'s settings (diffusers 0.42's names and defaults, which `train_text_to_image.py`
/// keeps but for the decay).
#[derive(Clone, Debug, PartialEq)]
pub struct EmaConfig {
    /// The largest decay.
    pub decay: f64,
    /// The smallest decay once updates start.
    pub min_decay: f64,
    /// Steps before the average starts moving (it copies the weights until then).
    pub update_after_step: usize,
    /// Warm up as `1 - (1 + step / inv_gamma)^-power` instead of `(1 + step) / (10 + step)`.
    pub use_ema_warmup: bool,
    /// The warm-up's inverse multiplicative factor.
    pub inv_gamma: f64,
    /// The warm-up's exponential factor.
    pub power: f64,
}

impl EmaConfig {
    /// `EMAModel(parameters, decay=decay)` with its other defaults.
    pub fn diffusers(decay: f64) -> EmaConfig {
        EmaConfig {
            decay,
            min_decay: 0.0,
            update_after_step: 0,
            use_ema_warmup: false,
            inv_gamma: 1.0,
            power: 2.0 / 3.0,
        }
    }

    /// The decay of optimization step `step` (1 for the first), as `EMAModel.get_decay`.
    pub fn decay_at(&self, step: usize) -> f64 {
        let step = step.saturating_sub(self.update_after_step + 1);
        if step == 0 {
            return 0.0;
        }
        let s = step as f64;
        let warm = match self.use_ema_warmup {
            true => 1.0 - (1.0 + s / self.inv_gamma).powf(-self.power),
            false => (1.0 + s) / (10.0 + s),
        };
        warm.min(self.decay).max(self.min_decay)
    }
}

/// One update of `shadow` towards `weights` in place, with EMAModel.step's arithmetic (the
/// engine's, [`engine::optim::ema::update`]).
pub fn update(shadow: &Tensor, weights: &Tensor, decay: f64) -> Result<()> {
    Ok(engine::optim::ema::update(shadow, weights, decay)?)
}

/// The average of the UNet's weights under Gemini (see the module documentation).
pub struct Ema {
    /// Its settings.
    pub config: EmaConfig,
    /// Updates so far (EMAModel's `optimization_step`).
    pub optimization_step: usize,
    /// This rank's part of every chunk, in host memory.
    shards: Vec<Tensor>,
}

impl Ema {
    /// An average starting at the current weights.
    pub fn new(gemini: &Gemini, config: EmaConfig) -> Result<Ema> {
        Ok(Ema { config, optimization_step: 0, shards: gemini.home_shards()? })
    }

    /// Moves the average towards the weights after an optimizer step.
    pub fn step(&mut self, gemini: &Gemini) -> Result<()> {
        self.optimization_step += 1;
        let decay = self.config.decay_at(self.optimization_step);
        gemini.with_homes(|c, home| {
            let weights = home.f_to_device(Device::Cpu)?;
            update(&self.shards[c], &weights, decay).map_err(|e| engine::Error::invalid(e.to_string()))
        })?;
        Ok(())
    }

    /// The averaged weights, full, by the UNet's names (collective: every rank calls it).
    pub fn weights(&self, gemini: &Gemini) -> Result<Vec<(String, Tensor)>> {
        Ok(gemini.gather_shards(&self.shards)?)
    }

    /// Exchanges the model's weights with the average (call again to exchange them back).
    pub fn swap(&self, gemini: &Gemini) -> Result<()> {
        Ok(gemini.swap_homes(&self.shards)?)
    }

    /// Writes `dir` as `EMAModel.save_pretrained` does: `config.json`, the UNet's (read from
    /// `unet_config`) with the settings and the step added, and the weights `weights` (from
    /// [`Ema::weights`]).
    pub fn save(&self, weights: &[(String, Tensor)], unet_config: &Path, dir: &Path) -> anyhow::Result<()> {
        let text =
            std::fs::read_to_string(unet_config).with_context(|| format!("reading {}", unet_config.display()))?;
        let mut config: serde_json::Map<String, Value> =
            serde_json::from_str(&text).with_context(|| format!("{}: not a JSON object", unet_config.display()))?;
        let c = &self.config;
        for (key, value) in [
            ("decay", Value::from(c.decay)),
            ("min_decay", Value::from(c.min_decay)),
            ("optimization_step", Value::from(self.optimization_step)),
            ("update_after_step", Value::from(c.update_after_step)),
            ("use_ema_warmup", Value::from(c.use_ema_warmup)),
            ("inv_gamma", Value::from(c.inv_gamma)),
            ("power", Value::from(c.power)),
        ] {
            config.insert(key.into(), value);
        }
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let json = serde_json::to_string_pretty(&config)?;
        data::write_atomic::<anyhow::Error>(&dir.join(CONFIG), |w| Ok(std::io::Write::write_all(w, json.as_bytes())?))?;
        data::checkpoint::save_tensors(weights, &dir.join(WEIGHTS))?;
        Ok(())
    }

    /// Reads the average, its settings and step from a folder [`Ema::save`] wrote (as
    /// `EMAModel.from_pretrained` and `load_state_dict`: the saved settings replace these); each
    /// rank takes its own shards, so the number of ranks may differ from the saving run's. A
    /// missing file, key or setting is an error naming it.
    pub fn load(&mut self, gemini: &Gemini, dir: &Path) -> anyhow::Result<()> {
        let path = dir.join(CONFIG);
        let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let config: Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
        let number = |key: &str| {
            config[key].as_f64().with_context(|| format!("{}: no number {key} (EMAModel's settings)", path.display()))
        };
        let optimization_step = number("optimization_step")? as usize;
        let loaded = EmaConfig {
            decay: number("decay")?,
            min_decay: number("min_decay")?,
            update_after_step: number("update_after_step")? as usize,
            use_ema_warmup: config["use_ema_warmup"]
                .as_bool()
                .with_context(|| format!("{}: no use_ema_warmup (EMAModel's settings)", path.display()))?,
            inv_gamma: number("inv_gamma")?,
            power: number("power")?,
        };
        let weights = dir.join(WEIGHTS);
        let named: HashMap<String, Tensor> = data::checkpoint::read_tensors(&weights)?;
        let shards = gemini.cut_shards(&named).with_context(|| format!("{}", weights.display()))?;
        *self = Ema { config: loaded, optimization_step, shards };
        Ok(())
    }
}
