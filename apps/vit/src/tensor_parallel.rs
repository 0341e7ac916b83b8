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
use clap::ValueEnum;
use engine::dist::{ParallelDims, ProcessGroup, World};
use engine::optim::{params_of, Param, StateDict};
use engine::parallel::sequence::SequenceParallel;
use engine::parallel::tensor::{
    ColumnConfig, ColumnParallelLinear, Init, LayerNorm, RowConfig, RowParallelLinear, TensorParallel,
};
use tch::nn::{self, VarStore};
use tch::Tensor;

use crate::model::{Layer, Layers, Region, Serial, Vit, VitConfig};
use crate::multi_dim::MultiDim;
use crate::sequence_parallel::{SpLayers, SpMode};

/// `--tp-mode`: how weights are split over the tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TpMode {
    /// Megatron's column/row split of each linear layer.
    #[value(name = "1d")]
    OneD,
    /// SUMMA on a q x q grid (Optimus): --tp must be a square.
    #[value(name = "2d")]
    TwoD,
    /// q x q grids stacked --tp-depth deep (Tesseract): --tp must be q x q x depth.
    #[value(name = "2.5d")]
    TwoPointFiveD,
    /// A q x q x q cube: --tp must be a cube.
    #[value(name = "3d")]
    ThreeD,
}

impl TpMode {
    /// The flag value, for messages.
    pub fn name(self) -> String {
        self.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string())
    }
}

/// The flags of `vit pretrain` that lay the model over the ranks (beside data parallelism).
#[derive(clap::Args, Clone, Debug)]
pub struct ParallelArgs {
    /// Tensor-parallel ranks: the model's layers are split over groups of this many
    /// consecutive ranks (its heads and widths must divide as --tp-mode needs), and the job's
    /// ranks over --tp x --sp are the data-parallel replicas (--batch and ZeRO are over those).
    #[arg(long, default_value_t = 1, value_parser = engine::job::count(1..))]
    pub tp: usize,
    /// How --tp splits the model: 1d (Megatron's column/row split of the blocks' linear
    /// layers), 2d (a q x q grid, --tp = q^2), 2.5d (q x q x --tp-depth), 3d (a q x q x q cube,
    /// --tp = q^3); 2d, 2.5d and 3d split every layer, the activations' batch and width too.
    #[arg(long, value_enum, default_value = "1d")]
    pub tp_mode: TpMode,
    /// Depth d of --tp-mode 2.5d (--tp = q x q x d).
    #[arg(long, default_value_t = 1, value_parser = engine::job::count(1..))]
    pub tp_depth: usize,
    /// Megatron's sequence parallelism within the --tp group (1d): the norms and residual
    /// stream between the split layers hold 1/tp of the tokens (the tokens, patches plus the
    /// class token, must divide by --tp).
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Sequence-parallel ranks: the tokens (patches plus the class token, which must divide
    /// by it) are split over groups of this many ranks, attention runs as --sp-mode says.
    #[arg(long, default_value_t = 1, value_parser = engine::job::count(1..))]
    pub sp: usize,
    /// Attention over the --sp group: ulysses (the default: all-to-alls between token and
    /// head splits hand about 4 N h / sp elements per rank per layer forward, falling with
    /// --sp, where the ring passes 2 N h (sp - 1) / sp; the heads per --tp rank must divide by
    /// --sp) or ring (keys and values passed around the ring: any head count, and one score
    /// block of (N / sp)^2 at a time, for sequences too long for whole score matrices).
    #[arg(long, value_enum, default_value = "ulysses")]
    pub sp_mode: SpMode,
}

/// The groups of a job's ranks under [`ParallelArgs`] and `--pp`: `pp x dp x sp x tp`
/// (tensor-parallel groups are runs of consecutive ranks, sequence-parallel groups next, then
/// the data replicas, then the pipeline stages; see [`ParallelDims`]). Under a pipeline every
/// group but `pipeline` lies within one stage.
#[derive(Clone, Debug)]
pub struct Mesh {
    /// The data-parallel replicas: they split the batch.
    pub data: ProcessGroup,
    /// What gradients are averaged over (and ZeRO shards the optimizer over): the data
    /// replicas and the sequence ranks together (the sequence ranks' gradients are partial).
    pub grads: ProcessGroup,
    /// The tensor-parallel group (none for one rank).
    pub tp: Option<ProcessGroup>,
    /// The sequence-parallel group (none for one rank).
    pub sp: Option<ProcessGroup>,
    /// The pipeline group: the ranks at this rank's place in every stage (none for one stage).
    pub pipeline: Option<ProcessGroup>,
}

impl Mesh {
    /// The groups for `args` and `pp` pipeline stages over `world`; sizes that do not fit are
    /// errors naming the flags and numbers.
    pub fn new(world: &World, args: &ParallelArgs, pp: usize) -> anyhow::Result<Mesh> {
        let (ranks, tp, sp) = (world.size(), args.tp, args.sp);
        let Some(replica) = pp.checked_mul(tp).and_then(|r| r.checked_mul(sp)) else {
            bail!("--pp {pp} x --tp {tp} x --sp {sp} is more ranks than can be counted");
        };
        // Modes that would change nothing at their sizes are errors, not silently ignored.
        if tp == 1 && args.tp_mode != TpMode::OneD {
            bail!("--tp-mode {} splits the model over --tp ranks: it needs --tp 2 or more", args.tp_mode.name());
        }
        if sp == 1 && args.sp_mode != SpMode::Ulysses {
            bail!("--sp-mode ring is how --sp ranks attend: it needs --sp 2 or more");
        }
        if replica == 0 || !ranks.is_multiple_of(replica) {
            let mut sizes = vec![format!("--tp {tp}")];
            if pp != 1 {
                sizes.insert(0, format!("--pp {pp}"));
            }
            if sp != 1 {
                sizes.push(format!("--sp {sp}"));
            }
            let sizes = match pp {
                1 => sizes.join(" x "),
                _ => format!("{} = {replica} ranks per replica", sizes.join(" x ")),
            };
            bail!("{sizes} does not divide the job's {ranks} ranks (--nproc or the launcher's world size)");
        }
        if args.tp_depth != 1 && args.tp_mode != TpMode::TwoPointFiveD {
            bail!("--tp-depth {} is for --tp-mode 2.5d, not {}", args.tp_depth, args.tp_mode.name());
        }
        if replica == 1 {
            let g = world.group.clone();
            return Ok(Mesh { data: g.clone(), grads: g, tp: None, sp: None, pipeline: None });
        }
        let dp = ranks / replica;
        let mesh = ParallelDims { pp, dp, sp, tp }.build(&world.group)?;
        let group = |axis: &str| mesh.group(axis).cloned().with_context(|| format!("no {axis} axis"));
        let data = group("dp")?;
        let grads = match sp {
            1 => data.clone(),
            // The ranks of this rank's stage at its tensor-parallel index:
            // `((stage * dp + d) * sp + s) * tp + t`.
            _ => {
                let mut mine = None;
                for (stage, t) in (0..pp).flat_map(|stage| (0..tp).map(move |t| (stage, t))) {
                    let members: Vec<usize> = (0..dp * sp).map(|i| (stage * dp * sp + i) * tp + t).collect();
                    mine = world.group.subgroup(&members, &format!("dp_sp{}", stage * tp + t))?.or(mine);
                }
                mine.context("this rank is in no data x sequence group")?
            }
        };
        let (tp, sp, pipeline) = (group("tp")?, group("sp")?, group("pp")?);
        let several = |g: ProcessGroup| (g.size() > 1).then_some(g);
        Ok(Mesh { data, grads, tp: several(tp), sp: several(sp), pipeline: several(pipeline) })
    }
}

/// Checks that `tp` ranks can split `cfg` in 1D: its heads (and with them the width, a
/// multiple of the heads) and the MLP's hidden features must divide by `tp`. The error names
/// the numbers.
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

/// Where a parameter's shard lies in the full tensor: the cuts made in turn, each along a
/// dimension (negative: from the end) into as many blocks as its group has ranks, the block
/// being the rank's index in that group.
#[derive(Clone, Debug)]
pub(crate) struct Placement {
    /// `qkv`: rows regrouped by head into this many blocks (timm's `[3, n, ..]` to `[n, 3, ..]`)
    /// before the cuts.
    pub heads: Option<i64>,
    /// The patch embedding's convolution weight `[out, c, p, p]`, cut as a matrix `[out, c p p]`.
    pub flatten: bool,
    /// `(dim, group)` per cut, outermost first.
    pub cuts: Vec<(i64, ProcessGroup)>,
    /// How many ranks of the tensor-parallel group hold this same shard.
    pub copies: usize,
}

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
    /// The layout of `cfg` over `mesh` as `args` ask; a model that does not split is an error
    /// naming the numbers.
    pub fn new(mesh: &Mesh, args: &ParallelArgs, cfg: &VitConfig) -> anyhow::Result<Sharding> {
        let n = args.tp as i64;
        let tokens = cfg.num_patches() + 1;
        if args.sequence_parallel && n < 2 {
            bail!("--sequence-parallel splits the tokens over the tensor-parallel ranks: it needs --tp 2 or more");
        }
        if args.sequence_parallel && args.tp_mode != TpMode::OneD {
            bail!("--sequence-parallel is Megatron's, for --tp-mode 1d (2d, 2.5d and 3d split the batch instead)");
        }
        if args.sequence_parallel && tokens % n != 0 {
            bail!(
                "--sequence-parallel: the model's {tokens} tokens ({} patches and the class token) do not split over \
                 --tp {n} ranks (choose --image-size / --patch-size to fit)",
                tokens - 1
            );
        }
        let mode = match (&mesh.tp, args.tp_mode) {
            (None, _) => Mode::Whole,
            (Some(g), TpMode::OneD) => {
                check(cfg, n).map_err(anyhow::Error::msg)?;
                Mode::OneD { tp: TensorParallel::new(g.clone()), sequence_parallel: args.sequence_parallel }
            }
            (Some(g), mode) => {
                let depth = i64::try_from(args.tp_depth)
                    .map_err(|_| anyhow::anyhow!("--tp-depth {}: too deep", args.tp_depth))?;
                Mode::Multi(MultiDim::new(g, mode, depth, cfg)?)
            }
        };
        let sp = args.sp as i64;
        if sp > 1 {
            if matches!(mode, Mode::Multi(_)) {
                bail!(
                    "--sp {sp} with --tp-mode {}: sequence parallelism combines with --tp-mode 1d only (2d, 2.5d \
                     and 3d split the batch over the grid already)",
                    args.tp_mode.name()
                );
            }
            if args.sequence_parallel {
                bail!("--sp {sp} with --sequence-parallel: choose one way to split the tokens");
            }
            if tokens % sp != 0 {
                bail!(
                    "--sp {sp}: the model's {tokens} tokens ({} patches and the class token) do not split over {sp} \
                     ranks (choose --image-size / --patch-size to fit)",
                    tokens - 1
                );
            }
            let heads = cfg.heads / n;
            if args.sp_mode == SpMode::Ulysses && heads % sp != 0 {
                bail!(
                    "--sp {sp} --sp-mode ulysses: the {heads} attention heads per tensor-parallel rank ({} over --tp \
                     {n}) do not split over {sp} ranks (use --sp-mode ring)",
                    cfg.heads
                );
            }
        }
        Ok(Sharding {
            mode,
            tp: mesh.tp.clone(),
            sp: mesh.sp.clone().map_or_else(SequenceParallel::none, SequenceParallel::new),
            sp_mode: args.sp_mode,
            grads: mesh.grads.clone(),
            cfg: *cfg,
        })
    }

    /// Checks that a micro-batch of `micro` examples splits as the layout needs (2D, 2.5D and
    /// 3D cut it over the grid or cube); the error names the numbers.
    pub fn check_batch(&self, micro: usize) -> anyhow::Result<()> {
        let blocks = self.batch_blocks();
        if !micro.is_multiple_of(blocks) {
            bail!(
                "--tp {}: a micro-batch of {micro} examples per data-parallel rank does not split into the \
                 layout's {blocks} batch blocks (choose --batch / --micro-batch to fit)",
                self.size()
            );
        }
        Ok(())
    }

    /// Into how many blocks a batch is cut over the tensor-parallel group (2D, 2.5D and 3D
    /// split it; 1 otherwise): every batch the model takes must divide by it.
    pub fn batch_blocks(&self) -> usize {
        match &self.mode {
            Mode::Multi(m) => m.batch_blocks() as usize,
            _ => 1,
        }
    }

    /// The tensor-parallel group's size.
    pub fn size(&self) -> i64 {
        self.tp.as_ref().map_or(1, |g| g.size() as i64)
    }

    /// This rank's index in the tensor-parallel group.
    pub fn rank(&self) -> i64 {
        self.tp.as_ref().map_or(0, |g| g.rank() as i64)
    }

    /// The sequence-parallel group's size.
    pub fn sp_size(&self) -> i64 {
        self.sp.size()
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

    /// Whether anything is split or parallel beyond data parallelism.
    pub fn active(&self) -> bool {
        !matches!(self.mode, Mode::Whole) || self.sp.active().is_some()
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
