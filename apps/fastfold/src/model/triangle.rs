//! The pair side of an Evoformer block: triangle multiplicative updates (supplementary
//! Algorithms 11 and 12) and triangle self-attention (13 and 14).
//!
//! Under DAP the "outgoing" and "starting node" operations take a row-split pair
//! [r/N, r, c_z] (mask [r/N, r]) and the "incoming" and "ending node" ones a col-split pair
//! [r, r/N, c_z] (mask [r, r/N]); the result has the layout of the input.
use kernels::Backend;
use tch::Tensor;

use crate::model::attention::Attention;
use crate::model::exec::{ChunkOp, Exec};
use crate::model::layers::{chunked_along, narrow, LayerNorm, Linear, Stream};
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
    pub fn update(&self, pair: &mut Stream, mask: &Tensor, exec: &Exec) -> Result<()> {
        let dap = exec.dap();
        let chunk = exec.chunk_for(ChunkOp::TriangleMultiplication);
        let z = pair.get();
        // The sum over k needs the other endpoint's projections whole, one matrix per channel
        // as bmm reads it. Each chunk of pair rows is laid out channel-first as it is made
        // ([n, N, c] to [c, n, N], while the chunk is still in cache) and written into the
        // whole [c, N, N]; bmm reads that transposed, as a view. Laying the whole projection
        // out afterwards (a [N, N, c] to [c, N, N] copy reading one float per cache line)
        // cost as much as half the product at 600 residues; einsum would copy it again for
        // every chunk.
        //
        // Under DAP the projection is gathered from the ranks along dim 0, where the group's
        // all-gather puts the blocks: each rank's block is laid out with its own endpoint
        // first ([j, c, k] outgoing, [i, c, k] incoming), so that neither the block nor the
        // gathered whole is copied again; bmm reads the gathered [c, .., ..] as a view.
        let dim = chunk_dim(self.direction);
        // The chunks' [n, N, c] laid out as rows of the projection, the dim they join on, and
        // the permutation that reads the (gathered) whole: outgoing as [c, k, j], incoming as
        // [c, i, k].
        let (layout, join, read): ([i64; 3], i64, [i64; 3]) = match (dap.size() > 1, self.direction) {
            (false, _) => ([2, 0, 1], 1, [0, 2, 1]),                  // [c, n, N]
            (true, Direction::Outgoing) => ([0, 2, 1], 0, [1, 2, 0]), // [n (j), c, N (k)]
            (true, Direction::Incoming) => ([1, 2, 0], 2, [1, 0, 2]), // [N (i), c, n (k)]
        };
        let rows = chunked_along(join, z.size()[0], chunk, |start, n| {
            let projected = {
                let x = self.layer_norm_input.forward(&narrow(z, 0, start, n)?)?;
                let m = narrow(mask, 0, start, n)?.f_unsqueeze(-1)?;
                gated(&x, &self.right_projection, &x, &self.right_gate, Some(&m), self.kernels)?
            };
            Ok(projected.f_permute(layout)?.f_contiguous()?)
        })?;
        // One rank: the gather is the identity.
        let right = dap.all_gather(&rows, 0)?.f_permute(read)?;
        drop(rows);
        pair.add_chunked(dim, chunk, |z, start, n| {
            let x = self.layer_norm_input.forward(&narrow(z, dim, start, n)?)?;
            let m = narrow(mask, dim, start, n)?.f_unsqueeze(-1)?;
            let left = gated(&x, &self.left_projection, &x, &self.left_gate, Some(&m), self.kernels)?;
            // Outgoing: [c, i, k] x [c, k, j] (`ikc,jkc->ijc`); incoming: [c, i, k] x [c, k, j]
            // with the whole projection on the left (`kjc,kic->ijc`). Either way [c, i, j].
            let prod = match self.direction {
                Direction::Outgoing => left.f_permute([2, 0, 1])?.f_bmm(&right)?,
                Direction::Incoming => right.f_bmm(&left.f_permute([2, 0, 1])?)?,
            };
            drop(left);
            let normed = self.center_layer_norm.forward(&prod.f_permute([1, 2, 0])?)?;
            drop(prod);
            gated(&normed, &self.output_projection, &x, &self.gating_linear, None, self.kernels)
        })
    }
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
