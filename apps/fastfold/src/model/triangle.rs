//! The pair side of an Evoformer block: triangle multiplicative updates (supplementary
//! Algorithms 11 and 12) and triangle self-attention (13 and 14).
//!
//! Under DAP the "outgoing" and "starting node" operations take a row-split pair
//! [r/N, r, c_z] (mask [r/N, r]) and the "incoming" and "ending node" ones a col-split pair
//! [r, r/N, c_z] (mask [r, r/N]); the result has the layout of the input.
use kernels::Backend;
use tch::Tensor;

use crate::model::attention::Attention;
use crate::model::exec::Exec;
use crate::model::layers::{chunked, LayerNorm, Linear};
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
    let y = proj.forward(x)?;
    let y = match mask {
        Some(m) => y.f_mul(m)?,
        None => y,
    };
    Ok(y.f_mul(&gate.forward(g)?.f_sigmoid()?)?)
}

impl TriangleMultiplication {
    /// Pair width `c_z`, intermediate width `c`.
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

    /// The update of `pair` (layout per [`Direction`]); chunks over output rows i.
    pub fn forward(&self, pair: &Tensor, mask: &Tensor, exec: &Exec) -> Result<Tensor> {
        let dap = exec.dap();
        let x = self.layer_norm_input.forward(pair)?;
        let m = mask.f_unsqueeze(-1)?;
        let left = gated(&x, &self.left_projection, &x, &self.left_gate, Some(&m), self.kernels)?;
        let right = gated(&x, &self.right_projection, &x, &self.right_gate, Some(&m), self.kernels)?;
        // The sum over k needs the other endpoint's projections whole.
        let (right, rows) = match self.direction {
            Direction::Outgoing => (dap.all_gather(&right, 0)?, left.size()[0]),
            Direction::Incoming => (dap.all_gather(&right, 1)?, right.size()[1] * dap.size()),
        };
        chunked(rows, exec.chunk(), |start, n| {
            let prod = match self.direction {
                Direction::Outgoing => {
                    Tensor::f_einsum("ikc,jkc->ijc", &[&left.f_narrow(0, start, n)?, &right], None::<&[i64]>)?
                }
                Direction::Incoming => {
                    Tensor::f_einsum("kjc,kic->ijc", &[&left, &right.f_narrow(1, start, n)?], None::<&[i64]>)?
                }
            };
            let normed = self.center_layer_norm.forward(&prod)?;
            let rows = x.f_narrow(0, start, n)?;
            gated(&normed, &self.output_projection, &rows, &self.gating_linear, None, self.kernels)
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

    /// The update of `pair` (layout per [`Direction`]); chunks over the attention's batch
    /// axis (rows for the starting node, columns for the ending node).
    pub fn forward(&self, pair: &Tensor, mask: &Tensor, exec: &Exec) -> Result<Tensor> {
        // The ending node is the starting node of the transposed pair, whose rows this rank holds.
        let (pair, mask) = match self.direction {
            Direction::Outgoing => (pair.shallow_clone(), mask.shallow_clone()),
            Direction::Incoming => (pair.f_transpose(0, 1)?, mask.f_transpose(0, 1)?),
        };
        let x = self.query_norm.forward(&pair)?;
        let local = Tensor::f_einsum("qkc,ch->hqk", &[&x, &self.feat_2d_weights], None::<&[i64]>)?;
        let bias = exec.dap().all_gather(&local, 1)?;
        let out = self.attention.forward(&x, &mask, Some(&bias), exec.chunk())?;
        Ok(match self.direction {
            Direction::Outgoing => out,
            Direction::Incoming => out.f_transpose(0, 1)?,
        })
    }
}
