//! 1D (Megatron) tensor parallelism for the ViT, applied from outside the model: the serial
//! model is built as one process would build it, and [`Sharding::build`] makes the same model
//! with each block's linear layers split over the tensor-parallel group and fills it with this
//! rank's slices of the serial weights, so a run at any `--tp` starts from the tp=1 weights.
//!
//! The layout (Megatron's for a transformer block): `attn.qkv` and `mlp.fc1` are column
//! parallel (each rank computes its heads' queries, keys and values, and its block of the
//! hidden features), `attn.proj` and `mlp.fc2` are row parallel (partial products summed over
//! the group). Everything else (patch embedding, class and position tokens, the norms, the
//! classifier head, the row layers' biases) is replicated; those parameters get the same
//! gradient on every rank of the group, because the column layers' `copy_to` sums the
//! gradient of their input over the group in backward, so they need no synchronisation.
//!
//! timm's fused `qkv` stacks all heads' queries, then all keys, then all values; a rank needs
//! the q, k and v rows of its own heads, so the rows are regrouped by head before slicing (and
//! back after gathering): see [`Sharding::shard`].
//!
//! With `--sequence-parallel` (Megatron-SP, within the tensor-parallel group) the residual
//! stream between the blocks' column and row layers (the norms, the residual additions) holds
//! this rank's block of the tokens instead of all of them: the column layers all-gather the
//! tokens, the row layers reduce-scatter them, and the blocks' norms sum their parameters'
//! gradients over the group. The stream is split after the embeddings and gathered before
//! the final norm, so the class token and the head see every token as in one process.
//! (`--sp N`, a separate axis of ring or Ulysses attention, is not wired into `vit`.)
//!
//! Checkpoints hold full tensors under timm's names: [`Sharding::gather`] makes them from the
//! shards and [`Sharding::shard`] slices them again at any tp, for weights and for optimizer
//! state (`{param}.{slot}`) alike.
use anyhow::{bail, Context};
use clap::ValueEnum;
use engine::dist::{ParallelDims, ProcessGroup, World};
use engine::optim::{params_of, Param, StateDict};
use engine::parallel::tensor::{
    ColumnConfig, ColumnParallelLinear, Init, LayerNorm, RowConfig, RowParallelLinear, TensorParallel,
};
use tch::nn::{self, VarStore};
use tch::Tensor;

use crate::model::{Layer, Layers, Region, Vit, VitConfig};

/// `--tp-mode`: how weights are split over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TpMode {
    /// Megatron's column/row split of each linear layer.
    #[value(name = "1d")]
    OneD,
    /// A 2D grid of blocks (Optimus); not available yet.
    #[value(name = "2d")]
    TwoD,
    /// 2.5D (Tesseract); not available yet.
    #[value(name = "2.5d")]
    TwoPointFiveD,
    /// 3D; not available yet.
    #[value(name = "3d")]
    ThreeD,
}

/// Checks that `tp` ranks can split `cfg`: its heads (and with them the width, a multiple of
/// the heads) and the MLP's hidden features must divide by `tp`. The error names the numbers.
pub fn check(cfg: &VitConfig, tp: i64) -> Result<(), String> {
    let hidden = cfg.mlp_hidden();
    if cfg.heads % tp != 0 {
        return Err(format!(
            "--tp {tp}: the model's {} attention heads (width {}) do not split over {tp} ranks",
            cfg.heads, cfg.width
        ));
    }
    if hidden % tp != 0 {
        return Err(format!("--tp {tp}: the model's MLP width {hidden} does not split over {tp} ranks"));
    }
    Ok(())
}

/// The data-parallel and tensor-parallel groups of `world` for `--tp tp` (tensor-parallel
/// groups are runs of consecutive ranks, see [`ParallelDims`]); with `tp` 1 the data-parallel
/// group is the world itself. `mode` must be `1d`. Errors name the flags and numbers.
pub fn groups(world: &World, tp: usize, mode: TpMode) -> anyhow::Result<(ProcessGroup, TensorParallel)> {
    if mode != TpMode::OneD {
        let name = mode.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string());
        bail!("--tp-mode {name} is not available yet: only 1d (Megatron's column/row split) is implemented");
    }
    let ranks = world.size();
    if tp == 0 || !ranks.is_multiple_of(tp) {
        bail!("--tp {tp} does not divide the job's {ranks} ranks (--nproc or the launcher's world size)");
    }
    if tp == 1 {
        return Ok((world.group.clone(), TensorParallel::none()));
    }
    let mesh = ParallelDims { pp: 1, dp: ranks / tp, sp: 1, tp }.build(&world.group)?;
    let group = |axis: &str| mesh.group(axis).cloned().with_context(|| format!("the mesh has no {axis} axis"));
    Ok((group("dp")?, TensorParallel::new(group("tp")?)))
}

/// How a parameter is split over the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    /// Along dim 0, rows regrouped by head first (`attn.qkv`).
    Heads,
    /// Along dim 0 (`mlp.fc1`'s weight and bias).
    Rows,
    /// Along dim 1 (`attn.proj` and `mlp.fc2`'s weights).
    Columns,
}

/// Where each parameter is split, by its timm name.
fn split_of(name: &str) -> Option<Split> {
    let (_, layer) = name.strip_prefix("blocks.")?.split_once('.')?;
    match layer {
        "attn.qkv.weight" | "attn.qkv.bias" => Some(Split::Heads),
        "mlp.fc1.weight" | "mlp.fc1.bias" => Some(Split::Rows),
        "attn.proj.weight" | "mlp.fc2.weight" => Some(Split::Columns),
        _ => None,
    }
}

/// The ViT's tensor-parallel layout over one group (a group of one: everything whole).
#[derive(Clone, Debug)]
pub struct Sharding {
    tp: TensorParallel,
    sequence_parallel: bool,
}

impl Sharding {
    /// The layout of `cfg` over `tp`, with the tokens split too under `sequence_parallel`; a
    /// model that does not split is an error naming the numbers.
    pub fn new(tp: TensorParallel, cfg: &VitConfig, sequence_parallel: bool) -> anyhow::Result<Sharding> {
        let n = tp.size();
        check(cfg, n).map_err(anyhow::Error::msg)?;
        let tokens = cfg.num_patches() + 1;
        if sequence_parallel && tokens % n != 0 {
            bail!(
                "--sequence-parallel: the model's {tokens} tokens ({} patches and the class token) do not split over \
                 --tp {n} ranks (choose --image-size / --patch-size to fit)",
                tokens - 1
            );
        }
        Ok(Sharding { tp, sequence_parallel: sequence_parallel && n > 1 })
    }

    /// The group's size.
    pub fn size(&self) -> i64 {
        self.tp.size()
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> i64 {
        self.tp.rank()
    }

    /// Whether weights are split (more than one rank).
    pub fn active(&self) -> bool {
        self.tp.active().is_some()
    }

    /// The model of `cfg` under `vs` holding this rank's slices of `serial`'s weights (a model
    /// of the same config built serially, e.g. from the run's seed).
    pub fn build(&self, serial: &VarStore, cfg: VitConfig, vs: &VarStore) -> anyhow::Result<Vit> {
        let layers = TpLayers { tp: self.tp.clone(), sequence_parallel: self.sequence_parallel };
        let model = Vit::build(&vs.root(), cfg, &layers)?;
        let full = serial.variables();
        tch::no_grad(|| -> anyhow::Result<()> {
            for (name, mut local) in vs.variables() {
                let whole = full.get(&name).with_context(|| format!("the serial model has no {name}"))?;
                local.f_copy_(&self.shard(&name, whole)?)?;
            }
            Ok(())
        })?;
        Ok(model)
    }

    /// The trainable parameters of `vs` sorted by name, the split ones marked as shards of the
    /// group (their norms are then the whole parameter's).
    pub fn params(&self, vs: &VarStore) -> Vec<Param> {
        params_of(vs)
            .into_iter()
            .map(|p| {
                let split = split_of(&p.name).is_some();
                p.split_over(self.tp.active().filter(|_| split))
            })
            .collect()
    }

    /// This rank's slice of the full tensor `full` of parameter `name` (itself if unsplit).
    pub fn shard(&self, name: &str, full: &Tensor) -> anyhow::Result<Tensor> {
        let (Some(split), true) = (split_of(name), self.active()) else {
            return Ok(full.shallow_clone());
        };
        let what = format!("{name}: dim");
        Ok(match split {
            Split::Rows => self.tp.shard_of(full, 0, &what)?,
            Split::Columns => self.tp.shard_of(full, 1, &what)?,
            Split::Heads => {
                // [3 * heads * hd, ..] as [3, tp, rows per rank and part, ..] -> [tp, 3, ..]:
                // rank r's contiguous block is then q, k, v of its heads.
                let regrouped = self.regroup(full, true)?;
                self.tp.shard_of(&regrouped, 0, &what)?
            }
        })
    }

    /// The full tensor of parameter `name` from every rank's slice `local` (a collective over
    /// the group: every rank calls it, for the same names in the same order).
    pub fn gather(&self, name: &str, local: &Tensor) -> anyhow::Result<Tensor> {
        let (Some(split), true) = (split_of(name), self.active()) else {
            return Ok(local.shallow_clone());
        };
        Ok(match split {
            Split::Rows => self.tp.gather_full(local, 0)?,
            Split::Columns => self.tp.gather_full(local, 1)?,
            Split::Heads => self.regroup(&self.tp.gather_full(local, 0)?, false)?,
        })
    }

    /// `qkv` rows from timm's order `[3, tp, ..]` into rank order `[tp, 3, ..]` (`to_ranks`),
    /// or back.
    fn regroup(&self, t: &Tensor, to_ranks: bool) -> anyhow::Result<Tensor> {
        let shape = t.size();
        let n = self.tp.size();
        if shape.is_empty() || shape[0] % (3 * n) != 0 {
            bail!(
                "qkv of shape {shape:?}: {} rows do not split into q, k, v over {n} ranks",
                shape.first().unwrap_or(&0)
            );
        }
        let outer = if to_ranks { [3, n] } else { [n, 3] };
        let mut view = vec![outer[0], outer[1], shape[0] / (3 * n)];
        view.extend(&shape[1..]);
        Ok(t.f_reshape(&view)?.f_transpose(0, 1)?.f_contiguous()?.f_reshape(&shape)?)
    }

    /// Full tensors of named parameters from this rank's slices (a collective).
    pub fn gather_all(&self, local: &[(String, Tensor)]) -> anyhow::Result<Vec<(String, Tensor)>> {
        local.iter().map(|(n, t)| Ok((n.clone(), self.gather(n, t)?))).collect()
    }

    /// This rank's slices of named full tensors.
    pub fn shard_all(&self, full: &[(String, Tensor)]) -> anyhow::Result<Vec<(String, Tensor)>> {
        full.iter().map(|(n, t)| Ok((n.clone(), self.shard(n, t)?))).collect()
    }

    /// Optimizer state (`{param}.{slot}` and counters) with the split parameters' slots made
    /// full (a collective).
    pub fn gather_state(&self, local: &[(String, Tensor)]) -> anyhow::Result<Vec<(String, Tensor)>> {
        local.iter().map(|(k, t)| Ok((k.clone(), self.gather(param_of(k), t)?))).collect()
    }

    /// Full optimizer state (as [`Self::gather_state`] made it) sliced for this rank, in place.
    pub fn shard_state(&self, state: &mut StateDict) -> anyhow::Result<()> {
        for (k, t) in state.iter_mut() {
            *t = self.shard(param_of(k), t)?;
        }
        Ok(())
    }
}

/// The parameter an optimizer state key `{param}.{slot}` belongs to (counters: themselves).
fn param_of(key: &str) -> &str {
    key.rsplit_once('.').map_or(key, |(p, _)| p)
}

/// Makes Megatron's layers over the group. Their initial values are zeros and ones:
/// [`Sharding::build`] copies the serial model's slices over them.
struct TpLayers {
    tp: TensorParallel,
    sequence_parallel: bool,
}

/// The sequence dimension of the residual stream `[batch, tokens, width]`.
const TOKENS: i64 = 1;

impl Layers for TpLayers {
    fn parts(&self) -> i64 {
        self.tp.size()
    }

    fn column(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        let cfg = ColumnConfig {
            sequence_parallel: self.sequence_parallel,
            sequence_dim: TOKENS,
            weight_init: Some(Init::Zeros),
            bias_init: Some(Init::Zeros),
            ..Default::default()
        };
        Ok(Box::new(ColumnParallelLinear::new(&p, inputs, outputs, cfg, &self.tp)?))
    }

    fn row(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        let cfg = RowConfig {
            sequence_parallel: self.sequence_parallel,
            sequence_dim: TOKENS,
            weight_init: Some(Init::Zeros),
            bias_init: Some(Init::Zeros),
            ..Default::default()
        };
        Ok(Box::new(RowParallelLinear::new(&p, inputs, outputs, cfg, &self.tp)?))
    }

    fn norm(&self, p: nn::Path, width: i64) -> anyhow::Result<Box<dyn Layer>> {
        match self.sequence_parallel {
            true => Ok(Box::new(LayerNorm::new(&p, width, 1e-6, true, &self.tp)?)),
            false => Ok(Box::new(crate::model::layer_norm(p, width))),
        }
    }

    fn region(&self) -> Box<dyn Region> {
        Box::new(Tokens { tp: self.tp.clone(), split: self.sequence_parallel })
    }
}

/// The residual stream under sequence parallelism: split along the tokens entering the blocks
/// (backward all-gathers), gathered leaving them (backward keeps this rank's block).
#[derive(Debug)]
struct Tokens {
    tp: TensorParallel,
    split: bool,
}

impl Region for Tokens {
    fn enter(&self, x: Tensor) -> anyhow::Result<Tensor> {
        match self.split {
            true => Ok(self.tp.scatter(&x, TOKENS)?),
            false => Ok(x),
        }
    }

    fn leave(&self, x: Tensor) -> anyhow::Result<Tensor> {
        match self.split {
            true => Ok(self.tp.gather(&x, TOKENS)?),
            false => Ok(x),
        }
    }
}

impl Layer for LayerNorm {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(LayerNorm::forward(self, x)?)
    }
}

impl Layer for ColumnParallelLinear {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(ColumnParallelLinear::forward(self, x)?)
    }
}

impl Layer for RowParallelLinear {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(RowParallelLinear::forward(self, x)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_that_do_not_split_name_the_numbers() {
        let digits = VitConfig::digits();
        assert!(check(&digits, 4).is_ok());
        let err = check(&digits, 3).unwrap_err();
        assert!(err.contains("--tp 3: the model's 4 attention heads (width 64) do not split over 3 ranks"), "{err}");
        let odd_mlp = VitConfig { mlp_ratio: 1.5, width: 66, heads: 2, ..digits };
        let err = check(&odd_mlp, 2).unwrap_err();
        assert!(err.contains("--tp 2: the model's MLP width 99 does not split over 2 ranks"), "{err}");
    }

    #[test]
    fn split_parameters_by_name() {
        assert_eq!(split_of("blocks.3.attn.qkv.bias"), Some(Split::Heads));
        assert_eq!(split_of("blocks.0.mlp.fc1.weight"), Some(Split::Rows));
        assert_eq!(split_of("blocks.0.mlp.fc2.weight"), Some(Split::Columns));
        assert_eq!(split_of("blocks.0.mlp.fc2.bias"), None);
        assert_eq!(split_of("head.weight"), None);
        assert_eq!(param_of("blocks.0.mlp.fc1.weight.exp_avg"), "blocks.0.mlp.fc1.weight");
        assert_eq!(param_of("step"), "step");
    }
}
