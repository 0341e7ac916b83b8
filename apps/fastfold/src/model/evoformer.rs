//! The Evoformer block (supplementary Algorithm 6) and stack, also used for the extra-MSA stack
//! (Algorithm 18: global column attention, extra-MSA widths), with dynamic axial parallelism.
//!
//! One block under DAP with N ranks (N = 1: every switch is the identity):
//!
//! | step | MSA layout | pair layout | communication |
//! |---|---|---|---|
//! | row attention with pair bias | rows (seqs) | rows | all-gather of the pair bias |
//! | | row → col | | all-to-all |
//! | column attention, transition | cols (res) | | |
//! | outer product mean | cols | rows | all-gather of the right projection |
//! | | col → row, **async** | | all-to-all launched |
//! | triangle mult. outgoing | | rows | all-gather of the right projection |
//! | triangle mult. incoming | | row → col | all-to-all, all-gather |
//! | triangle attention start | | col → row | all-to-all, all-gather of the bias |
//! | triangle attention end, pair transition | | row → col | all-to-all, all-gather of the bias |
//! | | wait | col → row | all-to-all |
//!
//! The MSA all-to-all that ends the MSA half is launched right after the outer product mean
//! and waited for at the end of the block, so it overlaps the whole pair half, which does not
//! need it (FastFold's duality async; in backward the mirror image overlaps the gradient's
//! all-to-all with the pair half's backward).
//!
//! With [`EvoformerConfig::outer_product_mean_first`] (AlphaFold-Multimer) the outer product
//! mean runs first, on the block's input MSA moved to columns (one more all-to-all under DAP),
//! and the rest of the block is the same. With
//! [`EvoformerConfig::fused_triangle_projections`] (Multimer v3's files) the triangle
//! multiplications read their fused arrays ([`TriangleMultiplication::fused`]).
//!
//! In training ([`Exec::with_dropout`] and a key for the stack), each sub-module's update is
//! dropped before the residual sum as AlphaFold's `EvoformerIteration` drops it
//! ([`crate::model::dropout`]): the stack splits its key once per block (`key, block_key =
//! split(key)`), the block splits its key in ten and hands them to its nine sub-modules in the
//! order they run (the first unused), and each mask is drawn whole and cut to this rank's
//! block, so DAP and the recomputation of a checkpointed block draw the masks one process
//! draws. Without rates or key (inference, `deterministic`) nothing is drawn.
//!
//! With [`Exec::with_checkpointed_blocks`], a block whose inputs require gradients keeps none of
//! its activations and recomputes them in backward (`engine::autograd::checkpoint`, as
//! AlphaFold's training rematerialises each block): its DAP collectives are repeated in the
//! same order on every rank, since every rank's backward reaches the block at the same point.
use std::sync::{Arc, Mutex};

use engine::parallel::dap::{Dap, DapPending};
use tch::{Device, Kind, Tensor};

use crate::jax_random::Key;
use crate::model::config::EvoformerConfig;
use crate::model::dropout::{DropMask, Rates, Shared};
use crate::model::exec::{ChunkOp, Exec, Stage};
use crate::model::keys::{EVOFORMER, EXTRA_MSA};
use crate::model::layers::Stream;
use crate::model::msa::{
    MsaColumnAttention, MsaColumnGlobalAttention, MsaRowAttentionWithPairBias, OuterProductMean, Transition,
};
use crate::model::pair_rows::rank_rows;
use crate::model::params::Params;
use crate::model::scope::{Builder, Scope};
use crate::model::triangle::{Direction, TriangleAttention, TriangleMultiplication};
use crate::model::{ensure, Error, Result};

/// Column attention: full in the Evoformer, global in the extra-MSA stack.
enum ColumnAttention {
    Full(MsaColumnAttention),
    Global(MsaColumnGlobalAttention),
}

/// This rank's blocks of the (padded) masks in the layouts the block's steps use.
pub struct BlockMasks {
    /// MSA mask, row-split [s/N, r].
    pub msa_row: Tensor,
    /// MSA mask, col-split [s, r/N].
    pub msa_col: Tensor,
    /// MSA mask, whole [s, r].
    pub msa_full: Tensor,
    /// Pair mask, row-split [r/N, r].
    pub pair_row: Tensor,
    /// Pair mask, col-split [r, r/N].
    pub pair_col: Tensor,
}

impl BlockMasks {
    /// Another handle on the same masks.
    pub fn shallow_clone(&self) -> BlockMasks {
        BlockMasks {
            msa_row: self.msa_row.shallow_clone(),
            msa_col: self.msa_col.shallow_clone(),
            msa_full: self.msa_full.shallow_clone(),
            pair_row: self.pair_row.shallow_clone(),
            pair_col: self.pair_col.shallow_clone(),
        }
    }

    /// Cuts this rank's blocks from whole masks whose sizes `exec`'s DAP group size divides.
    pub fn new(msa_mask: &Tensor, pair_mask: &Tensor, exec: &Exec) -> Result<Self> {
        let dap = exec.dap();
        Ok(BlockMasks {
            msa_row: dap.local(msa_mask, 0)?,
            msa_col: dap.local(msa_mask, 1)?,
            msa_full: msa_mask.shallow_clone(),
            pair_row: dap.local(pair_mask, 0)?,
            pair_col: dap.local(pair_mask, 1)?,
        })
    }
}

/// What one block drops in training: its key (DeepMind's `safe_key` for the block), the
/// rates and the stack's unpadded sizes (masks are drawn for the unpadded update).
#[derive(Clone, Copy, Debug)]
pub struct BlockDropout {
    /// The block's key.
    pub key: Key,
    /// The sub-modules' rates.
    pub rates: Rates,
    /// Sequences in the block's MSA, before DAP padding.
    pub seqs: i64,
    /// Residues, before DAP padding.
    pub residues: i64,
}

/// One Evoformer (or extra-MSA) block: its modules, shared with the recomputation a
/// checkpointed block leaves to backward (autograd may run it on another thread).
pub struct EvoformerBlock {
    layers: Arc<Mutex<BlockLayers>>,
}

/// The modules of one block.
struct BlockLayers {
    row_attention: MsaRowAttentionWithPairBias,
    column_attention: ColumnAttention,
    msa_transition: Transition,
    outer_product_mean: OuterProductMean,
    tri_mul_out: TriangleMultiplication,
    tri_mul_in: TriangleMultiplication,
    tri_att_start: TriangleAttention,
    tri_att_end: TriangleAttention,
    pair_transition: Transition,
    outer_product_mean_first: bool,
}

impl EvoformerBlock {
    fn new(p: &Scope, cfg: &EvoformerConfig, extra: bool) -> Result<Self> {
        let (c_m, heads, dim) = match extra {
            true => (cfg.c_e, cfg.extra_heads, cfg.extra_head_dim),
            false => (cfg.c_m, cfg.msa_heads, cfg.msa_head_dim),
        };
        let c_z = cfg.c_z;
        let column_attention = match extra {
            true => ColumnAttention::Global(MsaColumnGlobalAttention::new(
                &p.sub("msa_column_global_attention"),
                c_m,
                heads,
                dim,
            )?),
            false => ColumnAttention::Full(MsaColumnAttention::new(&p.sub("msa_column_attention"), c_m, heads, dim)?),
        };
        let tri_att =
            |name: &str, d: Direction| TriangleAttention::new(&p.sub(name), d, c_z, cfg.pair_heads, cfg.pair_head_dim);
        let tri_mul = |name: &str, d: Direction| match cfg.fused_triangle_projections {
            true => TriangleMultiplication::fused(&p.sub(name), d, c_z, cfg.tri_mul_channels),
            false => TriangleMultiplication::new(&p.sub(name), d, c_z, cfg.tri_mul_channels),
        };
        let layers = BlockLayers {
            row_attention: MsaRowAttentionWithPairBias::new(
                &p.sub("msa_row_attention_with_pair_bias"),
                c_m,
                c_z,
                heads,
                dim,
            )?,
            column_attention,
            msa_transition: Transition::new(&p.sub("msa_transition"), c_m, cfg.transition_factor)?,
            outer_product_mean: OuterProductMean::new(&p.sub("outer_product_mean"), c_m, cfg.opm_channels, c_z)?,
            tri_mul_out: tri_mul("triangle_multiplication_outgoing", Direction::Outgoing)?,
            tri_mul_in: tri_mul("triangle_multiplication_incoming", Direction::Incoming)?,
            tri_att_start: tri_att("triangle_attention_starting_node", Direction::Outgoing)?,
            tri_att_end: tri_att("triangle_attention_ending_node", Direction::Incoming)?,
            pair_transition: Transition::new(&p.sub("pair_transition"), c_z, cfg.transition_factor)?,
            outer_product_mean_first: cfg.outer_product_mean_first,
        };
        Ok(EvoformerBlock { layers: Arc::new(Mutex::new(layers)) })
    }

    /// One block on row-split `msa` [s/N, r, c] and row-split `pair` [r/N, r, c_z]; returns
    /// both in the same layouts. `exec`'s chunk sizes bound the batch-like axis of every heavy
    /// step; training dropout as `dropout` says (`None`: none).
    pub fn forward(
        &self,
        msa: &Tensor,
        pair: &Tensor,
        masks: &BlockMasks,
        exec: &Exec,
        dropout: Option<BlockDropout>,
    ) -> Result<(Tensor, Tensor)> {
        let (msa, pair) = (Stream::new(msa.shallow_clone(), false), Stream::new(pair.shallow_clone(), false));
        let (msa, pair) = self.run(msa, pair, masks, exec, dropout)?;
        Ok((msa.into_inner(), pair.into_inner()))
    }

    /// One block on the streams (updated in place where they are owned and nothing records
    /// gradients); checkpointed when `exec` says so and the inputs require gradients (without
    /// them nothing is saved for backward anyway).
    pub(crate) fn run(
        &self,
        msa: Stream,
        pair: Stream,
        masks: &BlockMasks,
        exec: &Exec,
        dropout: Option<BlockDropout>,
    ) -> Result<(Stream, Stream)> {
        if exec.checkpoints_blocks() && (msa.get().requires_grad() || pair.get().requires_grad()) {
            return self.checkpointed(&msa, &pair, masks, exec, dropout);
        }
        self.lock()?.run(msa, pair, masks, exec, dropout)
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, BlockLayers>> {
        self.layers.lock().map_err(|_| Error::Invalid("an Evoformer block panicked earlier".into()))
    }

    /// [`EvoformerBlock::run`] without keeping activations: backward recomputes the block, its
    /// dropout masks drawn again from the same key (the same masks).
    fn checkpointed(
        &self,
        msa: &Stream,
        pair: &Stream,
        masks: &BlockMasks,
        exec: &Exec,
        dropout: Option<BlockDropout>,
    ) -> Result<(Stream, Stream)> {
        let (layers, masks, exec) = (self.layers.clone(), masks.shallow_clone(), exec.clone());
        let mut out = engine::autograd::checkpoint(&[msa.get(), pair.get()], move |x| {
            let layers = layers.lock().map_err(|_| engine::Error::invalid("an Evoformer block panicked earlier"))?;
            let streams = (Stream::new(x[0].shallow_clone(), false), Stream::new(x[1].shallow_clone(), false));
            let (m, z) = layers
                .run(streams.0, streams.1, &masks, &exec, dropout)
                .map_err(|e| engine::Error::invalid(e.to_string()))?;
            Ok(vec![m.into_inner(), z.into_inner()])
        })?;
        let (z, m) = (out.pop(), out.pop());
        let (Some(m), Some(z), true) = (m, z, out.is_empty()) else {
            return Err(Error::Invalid("a checkpointed Evoformer block gave other than its two outputs".into()));
        };
        Ok((Stream::new(m, false), Stream::new(z, false)))
    }
}

/// The masks of one training block, drawn step by step from the block's ten sub-keys.
struct BlockMaskDraws<'a> {
    dropout: Option<BlockDropout>,
    keys: Vec<Key>,
    next: usize,
    exec: &'a Exec,
    msa_width: i64,
    pair_width: i64,
    /// The kind and device the masks are made in (the pair's).
    like: (Kind, Device),
}

impl BlockMaskDraws<'_> {
    /// The mask of the next sub-module at `rate` on the MSA (`msa`) or the pair, shared along
    /// `shared`, in a layout split along `split` (0: rows, 1: columns). Every sub-module takes
    /// its key, whether it drops or not, as DeepMind's `next(sub_keys)` does.
    fn next(
        &mut self,
        rate: impl Fn(&Rates) -> f64,
        msa: bool,
        shared: Shared,
        split: i64,
    ) -> Result<Option<DropMask>> {
        let Some(d) = self.dropout else { return Ok(None) };
        self.next += 1;
        let dap = self.exec.dap();
        let (rows, width) = if msa { (d.seqs, self.msa_width) } else { (d.residues, self.pair_width) };
        let shape = [rows, d.residues, width];
        let padded = [dap.padded_len(rows), dap.padded_len(d.residues), width];
        DropMask::draw(
            self.keys[self.next],
            rate(&d.rates),
            shape,
            shared,
            padded,
            Some(split),
            dap,
            self.like.0,
            self.like.1,
        )
    }
}

/// Where an offloading stack ([`crate::model::exec::ChunkPlan::offloading`]) keeps a block's
/// streams: the MSA on the host but for its own updates, the pair there during them. Only a
/// no-grad, in-place forward moves its streams.
struct Offload {
    device: Device,
}

impl Offload {
    /// The offloading of a block of `exec`'s stage on these streams, if it offloads and both
    /// streams are updated in place.
    fn new(exec: &Exec, msa: &Stream, pair: &Stream) -> Option<Offload> {
        let in_place = msa.adds_in_place() && pair.adds_in_place();
        (exec.offloads() && in_place).then(|| Offload { device: pair.get().device() })
    }

    /// The stream moved to the host (its device memory freed once no one else holds it).
    fn away(&self, s: Stream) -> Result<Stream> {
        s.map(|t| Ok(t.f_to_device(Device::Cpu)?))
    }

    /// The stream moved back to the device.
    fn back(&self, s: Stream) -> Result<Stream> {
        s.map(|t| Ok(t.f_to_device(self.device)?))
    }

    /// What a layout switch of `t` reads: under DAP the collective needs it on the device;
    /// one rank's switch is the identity, which reads it where it is.
    fn for_layout(&self, t: &Tensor, dap: &Dap) -> Result<Tensor> {
        Ok(match dap.size() > 1 {
            true => t.f_to_device(self.device)?,
            false => t.shallow_clone(),
        })
    }

    /// The col-split MSA `cols` (on the device) left on the host in rows and in columns (one
    /// tensor with one rank).
    fn leave(&self, cols: Tensor, dap: &Dap) -> Result<(Tensor, Tensor)> {
        if dap.size() == 1 {
            let host = cols.f_to_device(Device::Cpu)?;
            return Ok((host.shallow_clone(), host));
        }
        let rows = dap.col_to_row(&cols, 0, 1)?.f_to_device(Device::Cpu)?;
        Ok((rows, cols.f_to_device(Device::Cpu)?))
    }
}

impl BlockLayers {
    fn run(
        &self,
        mut msa: Stream,
        mut pair: Stream,
        masks: &BlockMasks,
        exec: &Exec,
        dropout: Option<BlockDropout>,
    ) -> Result<(Stream, Stream)> {
        let dap = exec.dap();
        // DeepMind's `safe_key, *sub_keys = safe_key.split(10)`: the first key goes unused.
        let keys = dropout.map(|d| d.key.split(10)).unwrap_or_default();
        // The pair's kind and device, not a handle on it: an offloading block frees its device
        // memory while the MSA is updated.
        let like = (pair.get().kind(), pair.get().device());
        let mut draws = BlockMaskDraws {
            dropout,
            keys,
            next: 0,
            exec,
            msa_width: msa.get().size()[2],
            pair_width: pair.get().size()[2],
            like,
        };
        // An offloading stack's streams, off the device in turn (see `Offload`).
        let offload = Offload::new(exec, &msa, &pair);
        if self.outer_product_mean_first {
            // AlphaFold-Multimer's order: the outer product mean of the block's input MSA, in
            // the column layout it reads (a copy under DAP; the block's MSA stays in rows).
            let rows = match &offload {
                Some(o) => o.for_layout(msa.get(), dap)?,
                None => msa.get().shallow_clone(),
            };
            let cols = dap.row_to_col(&rows, 0, 1)?;
            drop(rows);
            pair.drop_next(draws.next(|r| r.outer_product_mean, false, Shared::Rows, 0)?);
            self.outer_product_mean.update(&mut pair, &cols, &masks.msa_col, &masks.msa_full, exec)?;
        }
        msa.drop_next(draws.next(|r| r.msa_row_attention, true, Shared::Rows, 0)?);
        match &offload {
            None => self.row_attention.update(&mut msa, &masks.msa_row, pair.get(), exec)?,
            Some(o) => {
                // The pair's bias is all the MSA's updates read of it: the pair waits on the host.
                let bias = self.row_attention.bias(pair.get(), exec)?;
                (pair, msa) = (o.away(pair)?, o.back(msa)?);
                self.row_attention.update_biased(&mut msa, &masks.msa_row, &bias, exec)?;
            }
        }
        let mut msa = msa.map(|m| Ok(dap.row_to_col(m, 0, 1)?))?;
        msa.drop_next(draws.next(|r| r.msa_column_attention, true, Shared::Columns, 1)?);
        match &self.column_attention {
            ColumnAttention::Full(a) => a.update(&mut msa, &masks.msa_col, exec)?,
            ColumnAttention::Global(a) => a.update(&mut msa, &masks.msa_col, exec)?,
        }
        msa.drop_next(draws.next(|r| r.msa_transition, true, Shared::Rows, 1)?);
        self.msa_transition.update(&mut msa, ChunkOp::MsaTransition, exec)?;
        let msa_owned = msa.is_owned();
        let msa = match &offload {
            None => {
                if !self.outer_product_mean_first {
                    pair.drop_next(draws.next(|r| r.outer_product_mean, false, Shared::Rows, 0)?);
                    self.outer_product_mean.update(&mut pair, msa.get(), &masks.msa_col, &masks.msa_full, exec)?;
                }
                // The MSA is done for this block: send it back to rows while the pair half runs.
                dap.col_to_row_async(&msa.into_inner(), 0, 1)?
            }
            Some(o) => {
                // The MSA to the host, in both layouts (the outer product mean reads its
                // columns a batch at a time), and the pair back.
                let (rows, cols) = o.leave(msa.into_inner(), dap)?;
                pair = o.back(pair)?;
                if !self.outer_product_mean_first {
                    pair.drop_next(draws.next(|r| r.outer_product_mean, false, Shared::Rows, 0)?);
                    self.outer_product_mean.update(&mut pair, &cols, &masks.msa_col, &masks.msa_full, exec)?;
                }
                DapPending::Ready(rows)
            }
        };

        pair.drop_next(draws.next(|r| r.triangle_multiplication_outgoing, false, Shared::Rows, 0)?);
        self.tri_mul_out.update(&mut pair, &masks.pair_row, exec)?;
        let mut pair = pair.map(|z| Ok(dap.row_to_col(z, 0, 1)?))?;
        pair.drop_next(draws.next(|r| r.triangle_multiplication_incoming, false, Shared::Rows, 1)?);
        self.tri_mul_in.update(&mut pair, &masks.pair_col, exec)?;
        let mut pair = pair.map(|z| Ok(dap.col_to_row(z, 0, 1)?))?;
        pair.drop_next(draws.next(|r| r.triangle_attention_starting_node, false, Shared::Rows, 0)?);
        self.tri_att_start.update(&mut pair, &masks.pair_row, exec)?;
        let mut pair = pair.map(|z| Ok(dap.row_to_col(z, 0, 1)?))?;
        pair.drop_next(draws.next(|r| r.triangle_attention_ending_node, false, Shared::Columns, 1)?);
        self.tri_att_end.update(&mut pair, &masks.pair_col, exec)?;
        pair.drop_next(draws.next(|r| r.pair_transition, false, Shared::Rows, 1)?);
        self.pair_transition.update(&mut pair, ChunkOp::PairTransition, exec)?;
        let pair = pair.map(|z| Ok(dap.col_to_row(z, 0, 1)?))?;
        Ok((Stream::new(msa.wait()?, msa_owned), pair))
    }
}

/// A stack of blocks whose arrays are stacked along a leading block dimension.
pub struct EvoformerStack {
    blocks: Vec<EvoformerBlock>,
    c_m: i64,
    c_z: i64,
    stage: Stage,
}

impl EvoformerStack {
    /// The Evoformer stack (`evoformer_iteration`) over `params`.
    pub fn main(params: &Params) -> Result<Self> {
        Self::from_params(params, false)
    }

    /// The extra-MSA stack (`extra_msa_stack`) over `params`.
    pub fn extra(params: &Params) -> Result<Self> {
        Self::from_params(params, true)
    }

    fn from_params(params: &Params, extra: bool) -> Result<Self> {
        let builder = params.builder();
        let stack = Self::build(&builder, params.config(), extra)?;
        let prefix = format!("{}/", if extra { EXTRA_MSA } else { EVOFORMER });
        let unused = builder.unused_under(&prefix);
        ensure!(unused.is_empty(), "arrays no module of the stack uses: {unused:?}");
        Ok(stack)
    }

    /// Builds (or, with an initialising builder, creates the arrays of) one stack.
    pub(crate) fn build(builder: &Builder, cfg: &EvoformerConfig, extra: bool) -> Result<Self> {
        let (path, n, c_m) = match extra {
            true => (EXTRA_MSA, cfg.num_extra_blocks, cfg.c_e),
            false => (EVOFORMER, cfg.num_blocks, cfg.c_m),
        };
        ensure!(n > 0, "the stack at {path} has no blocks");
        let blocks =
            (0..n).map(|i| EvoformerBlock::new(&builder.block(path, i, n), cfg, extra)).collect::<Result<_>>()?;
        let stage = if extra { Stage::ExtraMsa } else { Stage::Evoformer };
        Ok(EvoformerStack { blocks, c_m, c_z: cfg.c_z, stage })
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether the stack has no blocks (never, once built).
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// The blocks, in order.
    pub fn blocks(&self) -> &[EvoformerBlock] {
        &self.blocks
    }

    /// Runs every block on whole inputs every rank holds alike: `msa` [s, r, c_m],
    /// `pair` [r, r, c_z], `msa_mask` [s, r], `pair_mask` [r, r] (1 = real, 0 = padding),
    /// and returns the whole `(msa, pair)` on every rank. Under DAP, s and r are padded to
    /// multiples of the group size with masked zeros, split, and the padding removed at the end.
    ///
    /// An input the caller gives up (a [`Stream`] made `owned`) is updated in place without
    /// autograd (the caller's other handles to it, if any, see the updates), so that no second
    /// MSA or pair is ever made; one not owned (`Stream::new(t.shallow_clone(), false)`) is left
    /// as it is.
    ///
    /// With an offloading plan for the stack ([`crate::model::exec::ChunkPlan::offloading`]) and
    /// streams given up, the MSA is returned where the blocks left it: on the host with one
    /// rank (the caller moves what it reads of it), on the device under DAP.
    ///
    /// In training: with `key` and `exec`'s dropout rates, block `i` drops with the second key
    /// of `split(key_i)`, `key_{i+1}` its first (haiku's layer stack over DeepMind's
    /// `safe_key, safe_subkey = safe_key.split()`). Returns the key the chain ends on (`None`
    /// without `key`), which AlphaFold's monomer hands on from the extra-MSA stack to the
    /// Evoformer.
    pub fn forward(
        &self,
        msa: Stream,
        pair: Stream,
        msa_mask: &Tensor,
        pair_mask: &Tensor,
        exec: &Exec,
        key: Option<Key>,
    ) -> Result<(Tensor, Tensor, Option<Key>)> {
        let streams = (StackInput::Whole(msa), StackInput::Whole(pair));
        let (msa, pair, key) = self.run_blocks(streams, msa_mask, pair_mask, exec, key)?;
        let (dap, r) = (exec.dap(), pair_mask.size()[0]);
        let pair = dap.gather(&pair, 0)?.f_narrow(0, 0, r)?.f_narrow(1, 0, r)?;
        Ok((msa.whole()?, pair, key))
    }

    /// [`EvoformerStack::forward`] on this rank's block of the pair's rows, as
    /// [`crate::model::pair_rows::PairRows::split`] lays it out (`[padded / ranks, padded, c_z]`, the padding zeros),
    /// and returning it so: an inference pass under DAP never makes the pair whole between its
    /// stacks ([`crate::model::pair_rows`]). The MSA is given whole or as this rank's block of
    /// its rows (`[padded seqs / ranks, padded residues, c_m]`, the padding zeros), and comes
    /// back as the blocks left it, for the caller to read by rows ([`StackMsa::map_rows`]).
    pub fn forward_pair_rows(
        &self,
        msa: StackInput,
        pair: Stream,
        msa_mask: &Tensor,
        pair_mask: &Tensor,
        exec: &Exec,
    ) -> Result<(StackMsa, Tensor)> {
        let (msa, pair, _) = self.run_blocks((msa, StackInput::Rows(pair)), msa_mask, pair_mask, exec, None)?;
        Ok((msa, pair))
    }

    /// The blocks over the inputs, padded and split under DAP (each given whole, or already as
    /// this rank's rows): the MSA as the blocks left it and this rank's rows of the pair.
    fn run_blocks(
        &self,
        (msa, pair): (StackInput, StackInput),
        msa_mask: &Tensor,
        pair_mask: &Tensor,
        exec: &Exec,
        mut key: Option<Key>,
    ) -> Result<(StackMsa, Tensor, Option<Key>)> {
        let exec = exec.in_stage(self.stage);
        let dap = exec.dap();
        let (s, r) = check_inputs((&msa, &pair), msa_mask, pair_mask, self.c_m, self.c_z, dap)?;
        let (sp, rp) = (dap.padded_len(s), dap.padded_len(r));
        let pad2 = |t: &Tensor, a: i64, b: i64| -> Result<Tensor> { Ok(dap.pad_to(&dap.pad_to(t, 0, a)?, 1, b)?) };
        let kind = msa.get().kind();
        let masks = BlockMasks::new(
            &pad2(&msa_mask.f_to_kind(kind)?, sp, rp)?,
            &pad2(&pair_mask.f_to_kind(kind)?, rp, rp)?,
            &exec,
        )?;
        // Padded or split, the blocks get a copy of their own; the input is dropped here when
        // the caller gave it up.
        let own = |t: Stream, len: i64| -> Result<Stream> {
            let owned = t.is_owned();
            let t = t.into_inner();
            let local = dap.scatter(&pad2(&t, len, rp)?, 0)?;
            let copied = (len, rp) != (t.size()[0], t.size()[1]) || dap.size() > 1;
            Ok(Stream::new(local, owned || copied))
        };
        let take = |input: StackInput, len: i64| -> Result<Stream> {
            match input {
                StackInput::Whole(t) => own(t, len),
                StackInput::Rows(t) => Ok(t),
            }
        };
        let (mut m, mut z) = (take(msa, sp)?, take(pair, rp)?);
        // An offloading stack's MSA waits on the host between its updates from the start.
        let offload = Offload::new(&exec, &m, &z);
        if let Some(o) = &offload {
            m = o.away(m)?;
        }
        let rates = exec.dropout().map(|d| d.evoformer);
        for block in &self.blocks {
            let mut dropout = None;
            if let Some(k) = key {
                let keys = k.split(2);
                key = Some(keys[0]);
                dropout = rates.map(|rates| BlockDropout { key: keys[1], rates, seqs: s, residues: r });
            }
            (m, z) = block.run(m, z, &masks, &exec, dropout)?;
        }
        let m = match &offload {
            Some(o) => o.for_layout(&m.into_inner(), dap)?,
            None => m.into_inner(),
        };
        Ok((StackMsa { local: m, dap: dap.clone(), seqs: s, residues: r }, z.into_inner(), key))
    }
}

/// A stream a stack takes: whole, or this rank's block of its padded rows (the pair as
/// [`crate::model::pair_rows::PairRows::split`] lays it out, the MSA as [`rank_rows`] splits its sequences).
pub enum StackInput {
    Whole(Stream),
    Rows(Stream),
}

impl StackInput {
    fn get(&self) -> &Tensor {
        match self {
            StackInput::Whole(t) | StackInput::Rows(t) => t.get(),
        }
    }
}

/// A stack's MSA as its blocks left it: this rank's block of its padded rows (all of them,
/// unpadded, with one rank).
pub struct StackMsa {
    local: Tensor,
    dap: Dap,
    seqs: i64,
    residues: i64,
}

impl StackMsa {
    /// An MSA [s, r, c_m] every rank already holds whole.
    pub fn from_whole(msa: Tensor) -> StackMsa {
        let size = msa.size();
        StackMsa { seqs: size[0], residues: size[1], local: msa, dap: Dap::none() }
    }

    /// The whole MSA [s, r, c_m] on every rank (a collective under DAP).
    pub fn whole(self) -> Result<Tensor> {
        Ok(self.dap.gather(&self.local, 0)?.f_narrow(0, 0, self.seqs)?.f_narrow(1, 0, self.residues)?)
    }

    /// The MSA's first `seqs` rows, those the caller reads; on `device` (an offloading stack
    /// leaves its MSA on the host: those rows are moved).
    pub fn first_rows(self, seqs: i64, device: Device) -> Result<StackMsa> {
        ensure!(seqs <= self.seqs, "MSA: {seqs} rows read of {}", self.seqs);
        let local = match self.dap.active() {
            Some(_) => self.local,
            None => self.local.f_narrow(0, 0, seqs)?,
        };
        Ok(StackMsa { local: local.f_to_device(device)?, seqs, ..self })
    }

    /// Row 0 [r, c_m], a tensor of its own (recycling it keeps no MSA), on every rank (a
    /// collective under DAP: each rank's first row is gathered, rank 0's is row 0).
    pub fn first_row(&self) -> Result<Tensor> {
        let first = match self.dap.active() {
            Some(_) => {
                self.dap.gather(&self.local.f_narrow(0, 0, 1)?, 0)?.f_select(0, 0)?.f_narrow(0, 0, self.residues)?
            }
            None => self.local.f_select(0, 0)?,
        };
        let mut own = first.f_empty_like()?;
        own.f_copy_(&first)?;
        Ok(own)
    }

    /// `f` of the rows ([s, r, c_m] → [s, r, ...]) on every rank (a collective under DAP: each
    /// rank applies `f` to its block and the results are gathered, so the MSA itself is never
    /// made whole; `f` must treat rows apart).
    pub fn map_rows(&self, f: impl Fn(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        match self.dap.active() {
            Some(_) => {
                let out = f(&self.local.f_narrow(1, 0, self.residues)?)?;
                Ok(self.dap.gather(&out, 0)?.f_narrow(0, 0, self.seqs)?)
            }
            None => f(&self.local),
        }
    }
}

fn check_inputs(
    (msa, pair): (&StackInput, &StackInput),
    msa_mask: &Tensor,
    pair_mask: &Tensor,
    c_m: i64,
    c_z: i64,
    dap: &Dap,
) -> Result<(i64, i64)> {
    let shape_err = |what: &str, expected: String, found: Vec<i64>| {
        Error::Invalid(format!("{what}: expected shape {expected}, found {found:?}"))
    };
    let ms = msa_mask.size();
    if ms.len() != 2 {
        return Err(shape_err("msa mask", "[seqs, residues]".into(), ms));
    }
    let (s, r) = (ms[0], ms[1]);
    if pair_mask.size() != [r, r] {
        return Err(shape_err("pair mask", format!("[{r}, {r}]"), pair_mask.size()));
    }
    let rows_of = |len: i64, c: i64| [rank_rows(dap, len).2, dap.padded_len(r), c];
    for (what, input, whole, rows) in
        [("msa", msa, [s, r, c_m], rows_of(s, c_m)), ("pair", pair, [r, r, c_z], rows_of(r, c_z))]
    {
        match input {
            StackInput::Whole(t) if t.get().size() != whole => {
                return Err(shape_err(what, format!("{whole:?}"), t.get().size()));
            }
            StackInput::Rows(t) if t.get().size() != rows => {
                return Err(shape_err(what, format!("{rows:?} (this rank's rows)"), t.get().size()));
            }
            _ => {}
        }
    }
    Ok((s, r))
}
