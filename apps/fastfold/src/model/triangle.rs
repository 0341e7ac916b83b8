//! The pair side of an Evoformer block: triangle multiplicative updates (supplementary
//! Algorithms 11 and 12) and triangle self-attention (13 and 14).
//!
//! Under DAP the "outgoing" and "starting node" operations take a row-split pair
//! [r/N, r, c_z] (mask [r/N, r]) and the "incoming" and "ending node" ones a col-split pair
//! [r, r/N, c_z] (mask [r, r/N]); the result has the layout of the input.
use engine::dist::ProcessGroup;
use kernels::Backend;
use tch::Tensor;

use crate::model::attention::Attention;
use crate::model::exec::{ChunkOp, Exec};
use crate::model::layers::{chunked_along, narrow, step, LayerNorm, Linear, Stream};
use crate::model::msa::pair_bias;
use crate::model::scope::{Init, Scope};
use crate::model::Result;

/// Which edges a triangle operation combines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// Outgoing edges / starting node: the pair is row-split.
    Outgoing,
    /// Incoming edges / ending node: the pair is col-split.
    Incoming,
}

/// Triangle multiplicative update (`triangle_multiplication_outgoing` / `_incoming`), with
/// AlphaFold's equations: outgoing `ikc,jkc->ijc`, incoming `kjc,kic->ijc` over the
/// left and right projections.
pub struct TriangleMultiplication {
    direction: Direction,
    layer_norm_input: LayerNorm,
    left_projection: Linear,
    right_projection: Linear,
    left_gate: Linear,
    right_gate: Linear,
    center_layer_norm: LayerNorm,
    output_projection: Linear,
    gating_linear: Linear,
    kernels: Backend,
}

/// `proj(x) * mask * sigmoid(gate(g))` (`mask` [.., 1], or none): the triangle update's gated
/// projections (`g` = `x`) and its output gate. The fused kernel adds both layers' biases,
/// the mask and the gate in one pass after bias-free matmuls.
fn gated(
    x: &Tensor,
    proj: &Linear,
    g: &Tensor,
    gate: &Linear,
    mask: Option<&Tensor>,
    kernels: Backend,
) -> Result<Tensor> {
    if let (Backend::Fused, Some(pb), Some(gb)) = (kernels, proj.bias(), gate.bias()) {
        let mask = mask.map(|m| m.f_squeeze_dim(-1)).transpose()?;
        return Ok(kernels::sigmoid_gate(&proj.matmul(x)?, pb, &gate.matmul(g)?, gb, mask.as_ref(), Backend::Fused)?);
    }
    // Without autograd the mask and the gate are applied in place.
    let mut y = proj.forward(x)?;
    let lean = !y.requires_grad();
    if let Some(m) = mask {
        y = if lean { y.f_mul_(m)? } else { y.f_mul(m)? };
    }
    let mut g = gate.forward(g)?;
    g = if lean { g.f_sigmoid_()? } else { g.f_sigmoid()? };
    Ok(if lean { y.f_mul_(&g)? } else { y.f_mul(&g)? })
}

/// The pair's dimension a direction's operations chunk (and, in place, write): rows for the
/// outgoing edges and the starting node, columns for the incoming edges and the ending node.
fn chunk_dim(direction: Direction) -> i64 {
    match direction {
        Direction::Outgoing => 0,
        Direction::Incoming => 1,
    }
}

impl TriangleMultiplication {
    /// Pair width `c_z`, intermediate width `c`, with AlphaFold 2's and Multimer v1/v2's
    /// arrays: `layer_norm_input`, `left_projection`, `right_projection`, `left_gate`,
    /// `right_gate`, `center_layer_norm`, `output_projection`, `gating_linear`.
    pub fn new(p: &Scope, direction: Direction, c_z: i64, c: i64) -> Result<Self> {
        Ok(TriangleMultiplication {
            direction,
            layer_norm_input: LayerNorm::new(&p.sub("layer_norm_input"), c_z)?,
            left_projection: Linear::new(&p.sub("left_projection"), c_z, c, true)?,
            right_projection: Linear::new(&p.sub("right_projection"), c_z, c, true)?,
            left_gate: Linear::new(&p.sub("left_gate"), c_z, c, true)?,
            right_gate: Linear::new(&p.sub("right_gate"), c_z, c, true)?,
            center_layer_norm: LayerNorm::new(&p.sub("center_layer_norm"), c)?,
            output_projection: Linear::new(&p.sub("output_projection"), c, c_z, true)?,
            gating_linear: Linear::new(&p.sub("gating_linear"), c_z, c_z, true)?,
            kernels: p.kernels(),
        })
    }

    /// As [`TriangleMultiplication::new`], with Multimer v3's arrays
    /// (`fuse_projection_weights`): `left_norm_input`, `projection` and `gate` [c_z, 2c]
    /// holding the left (first `c` outputs) and right layers side by side, `center_norm`,
    /// `output_projection`, `gating_linear`. The same computation: the halves are views.
    pub fn fused(p: &Scope, direction: Direction, c_z: i64, c: i64) -> Result<Self> {
        let projection = Linear::new(&p.sub("projection"), c_z, 2 * c, true)?;
        let gate = Linear::new(&p.sub("gate"), c_z, 2 * c, true)?;
        Ok(TriangleMultiplication {
            direction,
            layer_norm_input: LayerNorm::new(&p.sub("left_norm_input"), c_z)?,
            left_projection: projection.outputs(0, c)?,
            right_projection: projection.outputs(c, c)?,
            left_gate: gate.outputs(0, c)?,
            right_gate: gate.outputs(c, c)?,
            center_layer_norm: LayerNorm::new(&p.sub("center_norm"), c)?,
            output_projection: Linear::new(&p.sub("output_projection"), c, c_z, true)?,
            gating_linear: Linear::new(&p.sub("gating_linear"), c_z, c_z, true)?,
            kernels: p.kernels(),
        })
    }

    /// Adds the update of `pair` (layout per [`Direction`]); chunks over output rows i
    /// (outgoing) or columns j (incoming). The other endpoint's gated projection is made whole
    /// first (normalised and projected in chunks of pair rows); then each chunk normalises its
    /// own rows (columns), projects and gates them, takes the product over k with it and
    /// writes its update, so that only the stream and that projection are whole.
    ///
    /// Under DAP without autograd the projection is never whole: its blocks go around the
    /// ranks instead (`add_by_ring`), so that a rank's peak falls with the ranks.
    pub fn update(&self, pair: &mut Stream, mask: &Tensor, exec: &Exec) -> Result<()> {
        let dap = exec.dap();
        let chunk = exec.chunk_for(ChunkOp::TriangleMultiplication);
        // The sum over k needs the other endpoint's projections whole, one matrix per channel
        // as bmm reads it. Each chunk of pair rows is laid out channel-first as it is made
        // ([n, N, c] to [c, n, N], while the chunk is still in cache) and written into the
        // whole [c, N, N]; bmm reads that transposed, as a view. Laying the whole projection
        // out afterwards (a [N, N, c] to [c, N, N] copy reading one float per cache line)
        // cost as much as half the product at 600 residues; einsum would copy it again for
        // every chunk.
        //
        // Under DAP the projection is gathered from the ranks (or passed around them) along
        // dim 0, where the group's collectives put the blocks: each rank's block is laid out
        // with its own endpoint first ([j, c, k] outgoing, [i, c, k] incoming), so that
        // neither the block nor the gathered whole is copied again; bmm reads the blocks as
        // [c, .., ..] views.
        let dim = chunk_dim(self.direction);
        let blocks = dap.active().is_some();
        let side = if blocks { Side::RightBlock } else { Side::Right };
        let rows = self.projection(pair.get(), mask, side, chunk)?;
        if let Some(group) = dap.active() {
            if pair.adds_in_place() && !rows.requires_grad() {
                return self.add_by_ring(pair, mask, rows, group, chunk);
            }
        }
        // One rank: the gather is the identity. With autograd, backward needs every block
        // anyway (bmm saves its operands), so passing them around would save nothing.
        let right = dap.all_gather(&rows, 0)?.f_permute(self.read_right(blocks))?;
        drop(rows);
        pair.add_chunked(dim, chunk, |z, start, n| {
            let x = self.layer_norm_input.forward(&narrow(z, dim, start, n)?)?;
            let m = narrow(mask, dim, start, n)?.f_unsqueeze(-1)?;
            let left = gated(&x, &self.left_projection, &x, &self.left_gate, Some(&m), self.kernels)?;
            let prod = self.product(&left.f_permute([2, 0, 1])?, &right)?;
            drop(left);
            let normed = self.center_layer_norm.forward(&prod.f_permute([1, 2, 0])?)?;
            drop(prod);
            gated(&normed, &self.output_projection, &x, &self.gating_linear, None, self.kernels)
        })
    }

    /// One side's gated projection of every pair row this rank holds, normalised and projected
    /// `chunk` rows (dim 0) at a time and laid out as the product reads it (see [`Side`]).
    fn projection(&self, z: &Tensor, mask: &Tensor, side: Side, chunk: Option<i64>) -> Result<Tensor> {
        let (proj, gate) = match side {
            Side::Left => (&self.left_projection, &self.left_gate),
            Side::Right | Side::RightBlock => (&self.right_projection, &self.right_gate),
        };
        // A chunk's [n, cols, c] laid out, and the dim the chunks join on.
        let (layout, join): ([i64; 3], i64) = match (side == Side::RightBlock, self.direction) {
            (false, _) => ([2, 0, 1], 1),                  // [c, n, cols]
            (true, Direction::Outgoing) => ([0, 2, 1], 0), // [n (j), c, cols (k)]
            (true, Direction::Incoming) => ([1, 2, 0], 2), // [cols (i), c, n (k)]
        };
        chunked_along(join, z.size()[0], chunk, |start, n| {
            let projected = {
                let x = self.layer_norm_input.forward(&narrow(z, 0, start, n)?)?;
                let m = narrow(mask, 0, start, n)?.f_unsqueeze(-1)?;
                gated(&x, proj, &x, gate, Some(&m), self.kernels)?
            };
            Ok(projected.f_permute(layout)?.f_contiguous()?)
        })
    }

    /// The permutation that reads the right side's [`Self::projection`] (`blocks`: a block
    /// or the blocks gathered) as the product's operand: outgoing `[c, k, j]`, incoming `[c,
    /// i, k]`.
    fn read_right(&self, blocks: bool) -> [i64; 3] {
        match (blocks, self.direction) {
            (false, _) => [0, 2, 1],
            (true, Direction::Outgoing) => [1, 2, 0],
            (true, Direction::Incoming) => [1, 0, 2],
        }
    }

    /// The product over k, `[c, i, j]`, of a left projection `[c, rows, cols]` and a right one
    /// read by [`Self::read_right`]: outgoing `[c, i, k] x [c, k, j]` (`ikc,jkc->ijc`),
    /// incoming `[c, i, k] x [c, k, j]` with the right side on the left (`kjc,kic->ijc`).
    fn product(&self, left: &Tensor, right: &Tensor) -> Result<Tensor> {
        Ok(match self.direction {
            Direction::Outgoing => left.f_bmm(right)?,
            Direction::Incoming => right.f_bmm(left)?,
        })
    }

    /// The update under DAP without autograd, from this rank's right-side block `own`
    /// ([`Self::projection`]) without ever gathering the whole: the blocks go around the ring
    /// of ranks `chunk` of their rows at a time (rank `r` sends to `r + 1`), and each piece
    /// held gives the update of as many of the pair's other-endpoint positions (outgoing
    /// columns j, incoming rows i) for every row this rank holds, written in place before the
    /// next piece arrives. The next transfer overlaps the current piece's arithmetic.
    ///
    /// Writes touch the pair before the sum over k has read all of it, so the left side is
    /// projected whole first (the right side's own block is, being what travels). A rank then
    /// holds its pair block, both sides' projections of it and two pieces in transit: about
    /// 3/N of the pair plus a piece, where gathering holds the whole projection on every rank
    /// (FastFold's issue #115: per-rank memory that does not fall with the ranks). The update
    /// of position (i, j) reads the pair only at (i, j) (its gate) apart from the projections,
    /// and each position is written once, so the order of the pieces does not matter.
    fn add_by_ring(
        &self,
        pair: &mut Stream,
        mask: &Tensor,
        own: Tensor,
        group: &ProcessGroup,
        chunk: Option<i64>,
    ) -> Result<()> {
        let left = self.projection(pair.get(), mask, Side::Left, chunk)?;
        let other = 1 - chunk_dim(self.direction);
        let (ranks, rank) = (group.size() as i64, group.rank() as i64);
        let block = own.size()[0];
        let width = step(block, chunk)?;
        let mut first = 0;
        while first < block {
            let n = width.min(block - first);
            let mut held = own.f_narrow(0, first, n)?;
            for hop in 0..ranks {
                let next = match hop + 1 < ranks {
                    true => Some(group.ring_pass(&held, TAG_RING)?),
                    false => None,
                };
                // At hop t this rank holds the piece of rank r - t's block.
                let source = (rank - hop).rem_euclid(ranks);
                let start = source * block + first;
                let prod = self.product(&left, &held.f_permute(self.read_right(true))?)?;
                let normed = self.center_layer_norm.forward(&prod.f_permute([1, 2, 0])?)?;
                drop(prod);
                let x = self.layer_norm_input.forward(&pair.get().f_narrow(other, start, n)?)?;
                let update = gated(&normed, &self.output_projection, &x, &self.gating_linear, None, self.kernels)?;
                drop((normed, x));
                pair.add_in_place(other, start, n, &update)?;
                if let Some(next) = next {
                    held = next.wait()?;
                }
            }
            first += n;
        }
        Ok(())
    }
}

/// Message tag of [`TriangleMultiplication::add_by_ring`]'s pieces.
const TAG_RING: i32 = 0x544d; // "TM"

/// A projection of a triangle multiplication and its layout.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Side {
    /// The left side, `[c, rows, cols]`: outgoing `[c, i, k]`, incoming `[c, k, j]`.
    Left,
    /// The right side on one rank, as the left (the product reads it transposed, as a view).
    Right,
    /// The right side under DAP, each rank's block with its own endpoint first: outgoing
    /// `[j, c, k]`, incoming `[i, c, k]` (see [`TriangleMultiplication::read_right`]).
    RightBlock,
}

/// Triangle self-attention around the starting node (per row) or ending node (per column)
/// (`triangle_attention_starting_node` / `_ending_node`).
pub struct TriangleAttention {
    direction: Direction,
    query_norm: LayerNorm,
    feat_2d_weights: Tensor,
    attention: Attention,
}

impl TriangleAttention {
    /// Pair width `c_z`. `Outgoing` is the starting node, `Incoming` the ending node.
    pub fn new(p: &Scope, direction: Direction, c_z: i64, heads: i64, head_dim: i64) -> Result<Self> {
        Ok(TriangleAttention {
            direction,
            query_norm: LayerNorm::new(&p.sub("query_norm"), c_z)?,
            feat_2d_weights: p.param("feat_2d_weights", &[c_z, heads], Init::Weight { fan_in: c_z })?,
            attention: Attention::new(&p.sub("attention"), c_z, heads, head_dim)?,
        })
    }

    /// Adds the update of `pair` (layout per [`Direction`]); chunks over the attention's batch
    /// axis (rows for the starting node, columns for the ending node). The bias is made whole
    /// first; each chunk then normalises its own rows of the (transposed) pair.
    pub fn update(&self, pair: &mut Stream, mask: &Tensor, exec: &Exec) -> Result<()> {
        let chunk = exec.chunk_for(ChunkOp::TriangleAttention);
        let dim = chunk_dim(self.direction);
        // The ending node is the starting node of the transposed pair, whose rows this rank holds.
        let rows = |t: &Tensor| -> Result<Tensor> {
            Ok(match self.direction {
                Direction::Outgoing => t.shallow_clone(),
                Direction::Incoming => t.f_transpose(0, 1)?,
            })
        };
        let bias = pair_bias(&self.query_norm, &rows(pair.get())?, &self.feat_2d_weights, exec.dap(), chunk)?;
        let mask = rows(mask)?;
        pair.add_chunked(dim, chunk, |z, start, n| {
            let x = self.query_norm.forward(&rows(&narrow(z, dim, start, n)?)?)?;
            let out = self.attention.forward(&x, &narrow(&mask, 0, start, n)?, Some(&bias), None)?;
            rows(&out)
        })
    }
}
