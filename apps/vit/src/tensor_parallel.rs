//! Tensor and sequence parallelism for the ViT, applied from outside the model: the serial
//! model is built as one process would build it, and [`Sharding::build`] makes the same model
//! with its layers split over the tensor-parallel group (and its tokens over the
//! sequence-parallel group) and fills it with this rank's slices of the serial weights, so a
//! run at any layout starts from the tp=1 weights.
//!
//! `--tp-mode 1d` (Megatron's layout of a transformer block): `attn.qkv` and `mlp.fc1` are
//! column parallel (each rank computes its heads' queries, keys and values, and its block of
//! the hidden features), `attn.proj` and `mlp.fc2` are row parallel (partial products summed
//! over the group). Everything else (patch embedding, class and position tokens, the norms,
//! the classifier head, the row layers' biases) is replicated; those parameters get the same
//! gradient on every rank of the group, because the column layers' `copy_to` sums the
//! gradient of their input over the group in backward, so they need no synchronisation.
//! `--tp-mode 2d|2.5d|3d` split every layer, the stem and the head too: see
//! [`crate::multi_dim`].
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
//! `--sp N` is a separate axis, ring or all-to-all attention over the tokens: see
//! [`crate::sequence_parallel`].
//!
//! Checkpoints hold full tensors under timm's names: [`Sharding::gather`] makes them from the
//! shards and [`Sharding::shard`] slices them again at any layout, for weights and for
//! optimizer state (`{param}.{slot}`) alike.
use anyhow::{bail, Context};
use engine::dist::ProcessGroup;
use engine::optim::{params_of, Param, StateDict};
use engine::parallel::sequence::SequenceParallel;
use engine::parallel::tensor::{
    ColumnConfig, ColumnParallelLinear, Init, LayerNorm, RowConfig, RowParallelLinear, TensorParallel, TpMode,
};
use tch::nn::{self, VarStore};
use tch::Tensor;

use crate::layout::Layout;
use crate::mesh::Mesh;
use crate::model::{Layer, Layers, Region, Serial, Vit, VitConfig};
use crate::multi_dim::MultiDim;
use crate::placement::Placement;
use crate::sequence_parallel::{SpLayers, SpMode};

/// How the model is laid out over the tensor-parallel group.
#[derive(Clone, Debug)]
enum Mode {
    /// One rank: everything whole.
    Whole,
    /// Megatron's 1D split, optionally with Megatron-SP.
    OneD { tp: TensorParallel, sequence_parallel: bool },
    /// 2D, 2.5D or 3D.
    Multi(MultiDim),
}

/// How a parameter is split in 1D.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    /// Along dim 0, rows regrouped by head first (`attn.qkv`).
    Heads,
    /// Along dim 0 (`mlp.fc1`'s weight and bias).
    Rows,
    /// Along dim 1 (`attn.proj` and `mlp.fc2`'s weights).
    Columns,
}

/// Where each parameter is split in 1D, by its timm name.
fn split_of(name: &str) -> Option<Split> {
    let (_, layer) = name.strip_prefix("blocks.")?.split_once('.')?;
    match layer {
        "attn.qkv.weight" | "attn.qkv.bias" => Some(Split::Heads),
        "mlp.fc1.weight" | "mlp.fc1.bias" => Some(Split::Rows),
        "attn.proj.weight" | "mlp.fc2.weight" => Some(Split::Columns),
        _ => None,
    }
}

/// The ViT's layout over the tensor- and sequence-parallel groups (groups of one: everything
/// whole).
#[derive(Clone, Debug)]
pub struct Sharding {
    mode: Mode,
    /// The tensor-parallel group, when it has more than one rank.
    tp: Option<ProcessGroup>,
    sp: SequenceParallel,
    sp_mode: SpMode,
    grads: ProcessGroup,
    cfg: VitConfig,
}

impl Sharding {
    /// The layout of `cfg` over `mesh` as `layout` (checked against `cfg`) lays it out.
    pub fn new(mesh: &Mesh, layout: &Layout, cfg: &VitConfig) -> anyhow::Result<Sharding> {
        let mode = match &mesh.tp {
            None => Mode::Whole,
            Some(g) if layout.tp_mode == TpMode::OneD => {
                Mode::OneD { tp: TensorParallel::new(g.clone()), sequence_parallel: layout.sequence_parallel }
            }
            Some(g) => Mode::Multi(MultiDim::new(g, layout.tp_mode, layout.tp_depth as i64)?),
        };
        Ok(Sharding {
            mode,
            tp: mesh.tp.clone(),
            sp: mesh.sp.clone().map_or_else(SequenceParallel::none, SequenceParallel::new),
            sp_mode: layout.sp_mode,
            grads: mesh.grads.clone(),
            cfg: *cfg,
        })
    }

    /// This rank's index in the tensor-parallel group.
    pub fn rank(&self) -> i64 {
        self.tp.as_ref().map_or(0, |g| g.rank() as i64)
    }

    /// Whether this rank is the first of its tensor- and sequence-parallel groups, which all
    /// compute the same logits: where a replica's evaluation counts are taken once.
    pub fn leads(&self) -> bool {
        self.rank() == 0 && self.sp.rank() == 0
    }

    /// What gradients are averaged over and ZeRO shards over (see [`Mesh::grads`]).
    pub fn grads(&self) -> &ProcessGroup {
        &self.grads
    }

    /// Whether this rank writes optimizer state to checkpoints: one copy of each entry, every
    /// shard's owner under ZeRO (`sharded`), else one rank's; a tensor-parallel group holds the
    /// same full entries after [`Self::gather_state`].
    pub fn writes_optimizer(&self, sharded: bool) -> bool {
        (sharded || self.grads.rank() == 0) && self.rank() == 0
    }

    /// The model of `cfg` under `vs` holding this rank's slices of `serial`'s weights (a model
    /// of the same config built serially, e.g. from the run's seed).
    pub fn build(&self, serial: &VarStore, vs: &VarStore) -> anyhow::Result<Vit> {
        let base: Box<dyn Layers> = match &self.mode {
            Mode::Whole => Box::new(Serial { kernels: kernels::Backend::Torch }),
            Mode::OneD { tp, sequence_parallel } => {
                Box::new(TpLayers { tp: tp.clone(), sequence_parallel: *sequence_parallel })
            }
            Mode::Multi(m) => Box::new(m.clone()),
        };
        let model = match self.sp.active() {
            Some(_) => Vit::build(&vs.root(), self.cfg, &SpLayers::new(base, self.sp.clone(), self.sp_mode))?,
            None => Vit::build(&vs.root(), self.cfg, base.as_ref())?,
        };
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

    /// Where parameter `name`'s shard lies (`None`: whole on every rank).
    fn placement(&self, name: &str) -> Option<Placement> {
        match &self.mode {
            Mode::Whole => None,
            Mode::OneD { tp, .. } => {
                let g = tp.active()?.clone();
                let n = g.size() as i64;
                let (heads, dim) = match split_of(name)? {
                    Split::Heads => (Some(n), 0),
                    Split::Rows => (None, 0),
                    Split::Columns => (None, 1),
                };
                Some(Placement { heads, flatten: false, cuts: vec![(dim, g)], copies: 1 })
            }
            Mode::Multi(m) => m.placement(name),
        }
    }

    /// The trainable parameters of `vs` sorted by name, the split ones marked as shards of the
    /// tensor-parallel group (their norms are then the whole parameter's).
    pub fn params(&self, vs: &VarStore) -> Vec<Param> {
        params_of(vs)
            .into_iter()
            .map(|p| match (self.placement(&p.name), &self.tp) {
                (Some(place), Some(g)) => p.split_over(Some(g)).with_copies(place.copies),
                _ => p,
            })
            .collect()
    }

    /// This rank's slice of the full tensor `full` of parameter `name` (itself if unsplit).
    pub fn shard(&self, name: &str, full: &Tensor) -> anyhow::Result<Tensor> {
        let Some(place) = self.placement(name) else {
            return Ok(full.shallow_clone());
        };
        let mut t = full.shallow_clone();
        if place.flatten {
            t = t.f_flatten(1, -1)?;
        }
        if let Some(n) = place.heads {
            t = regroup(&t, n, true)?;
        }
        for (dim, g) in &place.cuts {
            let what = format!("{name}: dim");
            t = TensorParallel::new(g.clone()).shard_of(&t, resolve(&t, *dim), &what)?;
        }
        Ok(t.f_contiguous()?)
    }

    /// The full tensor of parameter `name` from every rank's slice `local` (a collective over
    /// the group: every rank calls it, for the same names in the same order).
    pub fn gather(&self, name: &str, local: &Tensor) -> anyhow::Result<Tensor> {
        let Some(place) = self.placement(name) else {
            return Ok(local.shallow_clone());
        };
        let mut t = local.shallow_clone();
        for (dim, g) in place.cuts.iter().rev() {
            t = TensorParallel::new(g.clone()).gather_full(&t, resolve(&t, *dim))?;
        }
        if let Some(n) = place.heads {
            t = regroup(&t, n, false)?;
        }
        if place.flatten {
            let c = &self.cfg;
            t = t.f_reshape([c.width, c.in_channels, c.patch_size, c.patch_size])?;
        }
        Ok(t)
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

/// `dim` counted from the front (a negative one from the end of `t`'s dimensions).
fn resolve(t: &Tensor, dim: i64) -> i64 {
    if dim < 0 {
        t.dim() as i64 + dim
    } else {
        dim
    }
}

/// `qkv` rows from timm's order `[3, n, ..]` into block order `[n, 3, ..]` (`to_blocks`), or
/// back: block `i` of the result is then q, k, v of the `i`-th share of the heads.
fn regroup(t: &Tensor, n: i64, to_blocks: bool) -> anyhow::Result<Tensor> {
    let shape = t.size();
    if shape.is_empty() || shape[0] % (3 * n) != 0 {
        bail!("qkv of shape {shape:?}: {} rows do not split into q, k, v over {n} blocks", shape.first().unwrap_or(&0));
    }
    let outer = if to_blocks { [3, n] } else { [n, 3] };
    let mut view = vec![outer[0], outer[1], shape[0] / (3 * n)];
    view.extend(&shape[1..]);
    Ok(t.f_reshape(&view)?.f_transpose(0, 1)?.f_contiguous()?.f_reshape(&shape)?)
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
