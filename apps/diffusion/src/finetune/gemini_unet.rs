//! The UNet under Gemini: its parameters grouped by the part of the model that uses them, each
//! part run as its own Gemini module, and Gemini's configuration for it.
use engine::gemini::{ChunkConfig, CpuRule, Gemini, GeminiConfig, Placement, Replication};
use engine::optim::Param;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

use crate::unet::{PartRunner, UNet2DConditionModel};
use crate::{Error, Result};

/// The UNet's parameters as Gemini registers them, and which of them each part of the UNet
/// uses ([`crate::unet::UNet2DConditionModel::parts`]).
pub struct UnetParams {
    /// Part by part in execution order (so a part's parameters share chunks), by name within a
    /// part: the same order on every rank.
    pub params: Vec<Param>,
    /// Each part's parameter indices into `params`.
    pub parts: Vec<Vec<usize>>,
}

impl UnetParams {
    /// The parameters of `unet` (trained or frozen), whose variables `vs` holds at its root,
    /// grouped by part. Every one of them decays (biases and norms too), as diffusers' scripts
    /// hand `unet.parameters()` whole to `torch.optim.AdamW`.
    pub fn of(unet: &UNet2DConditionModel, vs: &VarStore) -> Result<UnetParams> {
        let prefixes = unet.parts();
        let part_of = |name: &str| {
            prefixes.iter().position(|part| {
                part.iter().any(|pre| {
                    name.strip_prefix(pre.as_str()).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
                })
            })
        };
        let mut keyed = vec![];
        let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for p in vars.iter().map(|(name, t)| Param::new(name, t)) {
            let part = part_of(&p.name)
                .ok_or_else(|| Error::Invalid(format!("UNet parameter {} belongs to no part of the model", p.name)))?;
            keyed.push((part, p.with_adapt(true)));
        }
        // Stable: names stay sorted within a part.
        keyed.sort_by_key(|(part, _)| *part);
        let mut parts = vec![vec![]; prefixes.len()];
        for (i, (part, _)) in keyed.iter().enumerate() {
            parts[*part].push(i);
        }
        Ok(UnetParams { params: keyed.into_iter().map(|(_, p)| p).collect(), parts })
    }
}

/// Runs each part of the UNet as its own Gemini module.
pub struct GeminiParts<'a> {
    /// The chunks and optimizer.
    pub gemini: &'a Gemini,
    /// Each part's parameter indices ([`UnetParams::parts`]).
    pub parts: &'a [Vec<usize>],
}

impl PartRunner for GeminiParts<'_> {
    fn run(
        &self,
        part: usize,
        inputs: &[&Tensor],
        f: &dyn Fn(&[Tensor]) -> Result<Vec<Tensor>>,
    ) -> Result<Vec<Tensor>> {
        self.gemini.run_many(&self.parts[part], inputs, f)
    }
}

/// Gemini's configuration for the UNet: `budget` bytes on `device` (auto placement) or no
/// budget (every home on the device), compute copies in `compute`.
pub fn gemini_config(
    device: Device,
    budget: Option<u64>,
    rule: CpuRule,
    compute: Kind,
    replication: Option<Replication>,
) -> GeminiConfig {
    GeminiConfig {
        chunks: ChunkConfig {
            device,
            budget: budget.map_or(usize::MAX / 4, |b| b as usize),
            // 16K to 32M elements: a few chunks for tiny models, ~64 MiB fp16 chunks for SD.
            search: (1 << 14, 1 << 25, 1 << 14),
            home_buffers: 0,
            compute,
            share_cpu_homes: true,
            trainable: true,
        },
        placement: match budget {
            Some(_) => Placement::Auto,
            None => Placement::Static { offload: 0.0 },
        },
        // The next parts' chunks load on a side stream while the current part computes (GPU).
        prefetch: 2,
        rule,
        replication,
    }
}
