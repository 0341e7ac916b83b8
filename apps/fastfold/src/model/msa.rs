//! The MSA side of an Evoformer block: row attention with pair bias (supplementary
//! Algorithm 7), column attention (8), global column attention of the extra-MSA stack (19),
//! the transition (9, also the pair transition, 15) and the outer product mean (10).
//!
//! Under DAP the MSA `[seq, res, c]` is row-split (a block of sequences per rank) for row
//! attention and col-split (a block of residues) for everything after it; the pair
//! `[res, res, c_z]` is row-split. With one rank "split" means whole.
use engine::parallel::dap::Dap;
use tch::Tensor;

use crate::model::attention::{Attention, GlobalAttention};
use crate::model::exec::{ChunkOp, Exec};
use crate::model::layers::{chunked_along, narrow, LayerNorm, Linear, Stream};
use crate::model::scope::{Init, Scope};
use crate::model::Result;

/// The per-head pair bias `einsum('qkc,ch->hqk', LN(pair), weights)` of this rank's pair
/// rows [h, r/N, r], normalised and projected `chunk` rows at a time (no whole normalised pair),
/// all-gathered along the query axis (each rank uses the whole bias on its own rows, so
/// backward sums the ranks' gradients). The triangle attentions take it of the pair or its
/// transpose.
pub(crate) fn pair_bias(
    norm: &LayerNorm,
    pair: &Tensor,
    weights: &Tensor,
    dap: &Dap,
    chunk: Option<i64>,
) -> Result<Tensor> {
    let local = chunked_along(1, pair.size()[0], chunk, |start, n| {
        let x = norm.forward(&narrow(pair, 0, start, n)?)?;
        Ok(Tensor::f_einsum("qkc,ch->hqk", &[&x, weights], None::<&[i64]>)?)
    })?;
    Ok(dap.all_gather(&local, 1)?)
}

/// MSA row attention with pair bias (`msa_row_attention_with_pair_bias`).
pub struct MsaRowAttentionWithPairBias {
    query_norm: LayerNorm,
    feat_2d_norm: LayerNorm,
    feat_2d_weights: Tensor,
    attention: Attention,
}

impl MsaRowAttentionWithPairBias {
    /// MSA width `c`, pair width `c_z`.
    pub fn new(p: &Scope, c: i64, c_z: i64, heads: i64, head_dim: i64) -> Result<Self> {
        Ok(MsaRowAttentionWithPairBias {
            query_norm: LayerNorm::new(&p.sub("query_norm"), c)?,
            feat_2d_norm: LayerNorm::new(&p.sub("feat_2d_norm"), c_z)?,
            feat_2d_weights: p.param("feat_2d_weights", &[c_z, heads], Init::Weight { fan_in: c_z })?,
            attention: Attention::new(&p.sub("attention"), c, heads, head_dim)?,
        })
    }

    /// Adds the update of row-split `msa` [s/N, r, c] (mask [s/N, r]) given row-split `pair`
    /// [r/N, r, c_z]; chunks over sequences (and the bias over pair rows). The composition of
    /// [`Self::bias`] and [`Self::update_biased`].
    pub fn update(&self, msa: &mut Stream, mask: &Tensor, pair: &Tensor, exec: &Exec) -> Result<()> {
        let bias = self.bias(pair, exec)?;
        self.update_biased(msa, mask, &bias, exec)
    }

    /// The whole pair bias [heads, r, r] from row-split `pair` [r/N, r, c_z], pair rows a chunk
    /// at a time: all the update reads of the pair, so that the pair may leave the device
    /// while the MSA is updated.
    pub fn bias(&self, pair: &Tensor, exec: &Exec) -> Result<Tensor> {
        let chunk = exec.chunk_for(ChunkOp::MsaRowAttention);
        pair_bias(&self.feat_2d_norm, pair, &self.feat_2d_weights, exec.dap(), chunk)
    }

    /// Adds the update of row-split `msa` (mask [s/N, r]) given the pair's [`Self::bias`];
    /// chunks over sequences.
    pub fn update_biased(&self, msa: &mut Stream, mask: &Tensor, bias: &Tensor, exec: &Exec) -> Result<()> {
        msa.add_chunked(0, exec.chunk_for(ChunkOp::MsaRowAttention), |m, start, n| {
            let x = self.query_norm.forward(&narrow(m, 0, start, n)?)?;
            self.attention.forward(&x, &narrow(mask, 0, start, n)?, Some(bias), None)
        })
    }
}

/// MSA column attention (`msa_column_attention`).
pub struct MsaColumnAttention {
    query_norm: LayerNorm,
    attention: Attention,
}

impl MsaColumnAttention {
    /// MSA width `c`.
    pub fn new(p: &Scope, c: i64, heads: i64, head_dim: i64) -> Result<Self> {
        Ok(MsaColumnAttention {
            query_norm: LayerNorm::new(&p.sub("query_norm"), c)?,
            attention: Attention::new(&p.sub("attention"), c, heads, head_dim)?,
        })
    }

    /// Adds the update of col-split `msa` [s, r/N, c] (mask [s, r/N]); chunks over residues.
    pub fn update(&self, msa: &mut Stream, mask: &Tensor, exec: &Exec) -> Result<()> {
        msa.add_chunked(1, exec.chunk_for(ChunkOp::MsaColumnAttention), |m, start, n| {
            let x = self.query_norm.forward(&narrow(m, 1, start, n)?.f_transpose(0, 1)?)?;
            let out = self.attention.forward(&x, &narrow(mask, 1, start, n)?.f_transpose(0, 1)?, None, None)?;
            Ok(out.f_transpose(0, 1)?)
        })
    }
}

/// MSA column global attention of the extra-MSA stack (`msa_column_global_attention`).
pub struct MsaColumnGlobalAttention {
    query_norm: LayerNorm,
    attention: GlobalAttention,
}

impl MsaColumnGlobalAttention {
    /// Extra-MSA width `c`.
    pub fn new(p: &Scope, c: i64, heads: i64, head_dim: i64) -> Result<Self> {
        Ok(MsaColumnGlobalAttention {
            query_norm: LayerNorm::new(&p.sub("query_norm"), c)?,
            attention: GlobalAttention::new(&p.sub("attention"), c, heads, head_dim)?,
        })
    }

    /// Adds the update of col-split `msa` [s, r/N, c] (mask [s, r/N]); chunks over residues.
    pub fn update(&self, msa: &mut Stream, mask: &Tensor, exec: &Exec) -> Result<()> {
        msa.add_chunked(1, exec.chunk_for(ChunkOp::MsaColumnAttention), |m, start, n| {
            let x = self.query_norm.forward(&narrow(m, 1, start, n)?.f_transpose(0, 1)?)?;
            let out = self.attention.forward(&x, &narrow(mask, 1, start, n)?.f_transpose(0, 1)?, None)?;
            Ok(out.f_transpose(0, 1)?)
        })
    }
}

/// LayerNorm, widening linear, ReLU, narrowing linear (`msa_transition`, `pair_transition`).
pub struct Transition {
    input_layer_norm: LayerNorm,
    transition1: Linear,
    transition2: Linear,
}

impl Transition {
    /// Width `c`, hidden width `factor * c`.
    pub fn new(p: &Scope, c: i64, factor: i64) -> Result<Self> {
        Ok(Transition {
            input_layer_norm: LayerNorm::new(&p.sub("input_layer_norm"), c)?,
            transition1: Linear::new(&p.sub("transition1"), c, factor * c, true)?,
            transition2: Linear::new(&p.sub("transition2"), factor * c, c, true)?,
        })
    }

    /// Adds the update of `x` (any layout: it is pointwise) as operation `op` (the MSA or the
    /// pair transition); chunks over dim 0.
    pub fn update(&self, x: &mut Stream, op: ChunkOp, exec: &Exec) -> Result<()> {
        x.add_chunked(0, exec.chunk_for(op), |x, start, n| {
            let mut h = self.transition1.forward(&self.input_layer_norm.forward(&narrow(x, 0, start, n)?)?)?;
            h = if h.requires_grad() { h.f_relu()? } else { h.f_relu_()? };
            self.transition2.forward(&h)
        })
    }
}

/// Outer product mean (`outer_product_mean`): the MSA's update of the pair.
pub struct OuterProductMean {
    layer_norm_input: LayerNorm,
    left_projection: Linear,
    right_projection: Linear,
    output_w: Tensor,
    output_b: Tensor,
    channels: i64,
    c_z: i64,
}

impl OuterProductMean {
    /// MSA width `c_m`, projection width `channels`, pair width `c_z`.
    pub fn new(p: &Scope, c_m: i64, channels: i64, c_z: i64) -> Result<Self> {
        Ok(OuterProductMean {
            layer_norm_input: LayerNorm::new(&p.sub("layer_norm_input"), c_m)?,
            left_projection: Linear::new(&p.sub("left_projection"), c_m, channels, true)?,
            right_projection: Linear::new(&p.sub("right_projection"), c_m, channels, true)?,
            output_w: p.param("output_w", &[channels, channels, c_z], Init::Weight { fan_in: channels * channels })?,
            output_b: p.param("output_b", &[c_z], Init::Small)?,
            channels,
            c_z,
        })
    }

    /// Adds the row-split pair update [r/N, r, c_z] from col-split `msa` [s, r/N, c_m] with
    /// its mask [s, r/N] and the whole mask [s, r] to `pair`: out[i, j] = W·vec(Σ_s a_si ⊗
    /// b_sj) + b, over (1e-3 + Σ_s mask_si mask_sj). Chunks over i; added in place, also over
    /// s ([`ChunkOp::OuterProductMeanSequences`]): the sum over sequences splits into batches,
    /// and W and the division are linear, so each batch's products are projected, divided and
    /// added alone (the bias with the first), and the MSA is never normalised or projected
    /// whole. An `msa` on another device than the pair (the host, where an offloading stack
    /// keeps it: [`crate::model::exec::ChunkPlan::offloading`]) reaches the pair's a batch at
    /// a time.
    pub fn update(
        &self,
        pair: &mut Stream,
        msa: &Tensor,
        mask: &Tensor,
        mask_full: &Tensor,
        exec: &Exec,
    ) -> Result<()> {
        let s = msa.size()[0];
        let records = msa.requires_grad() || self.output_w.requires_grad();
        let batch = match pair.adds_in_place() && !records {
            true => exec.chunk_for(ChunkOp::OuterProductMeanSequences).map_or(s, |c| c.clamp(1, s.max(1))),
            false => s,
        };
        let norm = Tensor::f_einsum("si,sj->ij", &[mask, mask_full], None::<&[i64]>)?;
        let w = self.output_w.f_reshape([self.channels * self.channels, self.c_z])?;
        let device = pair.get().device();
        let mut first = 0;
        loop {
            let k = batch.min(s - first);
            let x = self.layer_norm_input.forward(&narrow(msa, 0, first, k)?.f_to_device(device)?)?;
            let m = narrow(mask, 0, first, k)?.f_unsqueeze(-1)?;
            let masked = |y: Tensor| -> Result<Tensor> {
                let mut y = y;
                Ok(if y.requires_grad() { y.f_mul(&m)? } else { y.f_mul_(&m)? })
            };
            let left = masked(self.left_projection.forward(&x)?)?;
            let right = exec.dap().all_gather(&masked(self.right_projection.forward(&x)?)?, 1)?;
            drop(x);
            let with_bias = first == 0;
            pair.add_chunked(0, exec.chunk_for(ChunkOp::OuterProductMean), |_, start, n| {
                let l = narrow(&left, 1, start, n)?;
                let outer = Tensor::f_einsum("sic,sje->ijce", &[&l, &right], None::<&[i64]>)?;
                let r = outer.size()[1];
                // The product comes out of bmm laid out [i, c, j, e]: flattening (c, e) copies it.
                let flat = outer.f_reshape([n, r, self.channels * self.channels])?;
                drop(outer);
                let mut y = flat.f_matmul(&w)?;
                drop(flat);
                let lean = !y.requires_grad();
                if with_bias {
                    y = if lean { y.f_add_(&self.output_b)? } else { y.f_add(&self.output_b)? };
                }
                let divisor = narrow(&norm, 0, start, n)?.f_add_scalar(1e-3)?.f_unsqueeze(-1)?;
                Ok(if lean { y.f_div_(&divisor)? } else { y.f_div(&divisor)? })
            })?;
            first += k;
            if first >= s {
                return Ok(());
            }
        }
    }
}
