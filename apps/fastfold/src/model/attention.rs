//! AlphaFold's gated multi-head attention (supplementary Algorithm 7's core, `Attention` in
//! `modules.py`) and global attention (Algorithm 19, `GlobalAttention`).
use kernels::Backend;
use tch::Tensor;

use crate::model::layers::{chunked, mask_bias, narrow};
use crate::model::scope::{AttentionKernel, Init, Scope};
use crate::model::Result;

fn einsum(eq: &str, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    Ok(Tensor::f_einsum(eq, &[a, b], None::<&[i64]>)?)
}

/// Gated self-attention along dim 1 of `[batch, len, c]`, optionally biased per head by a
/// `[heads, len, len]` tensor shared across the batch.
pub struct Attention {
    query_w: Tensor,
    key_w: Tensor,
    value_w: Tensor,
    gating_w: Tensor,
    gating_b: Tensor,
    output_w: Tensor,
    output_b: Tensor,
    head_dim: i64,
    kernels: Backend,
    /// Without autograd, the tensor-core attention instead of whole logits.
    flash: bool,
}

impl Attention {
    /// Arrays `query_w`, `key_w`, `value_w`, `gating_w` [c, heads, dim], `gating_b`
    /// [heads, dim], `output_w` [heads, dim, c], `output_b` `[c]`.
    pub fn new(p: &Scope, c: i64, heads: i64, head_dim: i64) -> Result<Self> {
        let w = |name: &str| p.param(name, &[c, heads, head_dim], Init::Weight { fan_in: c });
        Ok(Attention {
            query_w: w("query_w")?,
            key_w: w("key_w")?,
            value_w: w("value_w")?,
            gating_w: w("gating_w")?,
            gating_b: p.param("gating_b", &[heads, head_dim], Init::One)?,
            output_w: p.param("output_w", &[heads, head_dim, c], Init::Weight { fan_in: heads * head_dim })?,
            output_b: p.param("output_b", &[c], Init::Small)?,
            head_dim,
            kernels: p.kernels(),
            flash: p.kernels() == Backend::Fused && p.attention() == AttentionKernel::Flash,
        })
    }

    /// `x` [batch, len, c]; `mask` [batch, len] (1 keeps a key; a dropped one gets AlphaFold's
    /// `1e9 (mask - 1)` bias); `pair_bias` [heads, len, len]. Processes `chunk` batch rows at a
    /// time.
    pub fn forward(&self, x: &Tensor, mask: &Tensor, pair_bias: Option<&Tensor>, chunk: Option<i64>) -> Result<Tensor> {
        chunked(x.size()[0], chunk, |start, n| {
            let x = narrow(x, 0, start, n)?;
            let mask = narrow(mask, 0, start, n)?;
            // Without autograd, the biases and gates are applied in place.
            let lean = !x.requires_grad() && !self.query_w.requires_grad();
            // Inference on the CPU: libtorch's fused kernel. Training keeps the logits whole
            // (libtorch's kernel has no gradient for the bias), in the checkpointed blocks'
            // first forward too, so that their recomputation repeats it exactly.
            match (self.kernels, lean) {
                (Backend::Torch, true) => self.forward_sdpa(&x, &mask, pair_bias),
                _ => self.forward_from_logits(&x, &mask, pair_bias, lean),
            }
        })
    }

    /// [`Attention::forward`] on one chunk through libtorch's scaled-dot-product attention,
    /// the key mask's and the pair's biases its additive mask (the key mask's only where a key
    /// is masked: adding zeros is a pass over the logits for nothing). Without autograd
    /// libtorch runs its fused kernel (on the CPU, flash attention: the logits made and used a
    /// block at a time, never whole, about three times as fast as the composition at the
    /// Evoformer's sizes, `benches/attention_core.py`). Runs without autograd only: the gate
    /// and biases are applied in place.
    fn forward_sdpa(&self, x: &Tensor, mask: &Tensor, pair_bias: Option<&Tensor>) -> Result<Tensor> {
        let q = einsum("bqa,ahc->bhqc", x, &self.query_w)?;
        let k = einsum("bka,ahc->bhkc", x, &self.key_w)?;
        let v = einsum("bka,ahc->bhkc", x, &self.value_w)?;
        let masked = mask.f_min()?.double_value(&[]) < 1.0;
        let bias = match (pair_bias, masked) {
            (Some(b), false) => Some(b.f_unsqueeze(0)?),
            (Some(b), true) => Some(b.f_unsqueeze(0)?.f_add(&mask_bias(mask)?.f_to_kind(b.kind())?)?),
            (None, true) => Some(mask_bias(mask)?.f_to_kind(q.kind())?),
            (None, false) => None,
        };
        let scale = (self.head_dim as f64).powf(-0.5);
        let avg = Tensor::f_scaled_dot_product_attention(&q, &k, &v, bias, 0.0, false, Some(scale), false)?;
        drop((q, k, v));
        let mut avg = avg.f_permute([0, 2, 1, 3])?;
        let gate = einsum("bqa,ahc->bqhc", x, &self.gating_w)?.f_add_(&self.gating_b)?.f_sigmoid_()?;
        let gated = avg.f_mul_(&gate)?;
        drop(gate);
        Ok(einsum("bqhc,hco->bqo", &gated, &self.output_w)?.f_add_(&self.output_b)?)
    }

    /// [`Attention::forward`] on one chunk from the whole logits, softmaxed by the backend's
    /// `attention_softmax` (the fused CUDA kernel, or libtorch's composition), or without
    /// autograd by the tensor-core attention where the module runs it; `lean`: no autograd, so
    /// the scaling, softmax, gate and biases are applied in place.
    ///
    /// Every operand is laid out for its batched product as it is made, so that no product
    /// copies one (the einsums this replaces copied the queries, keys, values and gated values
    /// into the layouts their products needed and gated a strided view: copy and strided
    /// element-wise kernels were 13% and 8% of `predict`'s GPU time at 304 residues on an
    /// H200, not all of them these): the projections are made transposed, `[b, heads * dim,
    /// len]` (each head's `[dim, len]` contiguous), by one product with the weights shared
    /// across the batch; the logits `[b * heads, q, k]` multiply the queries transposed (a
    /// transposed operand is a flag to the BLAS, not a copy); the averaged values come out
    /// transposed, `[b, heads * dim, q]`, like the gate, and the output projection reads them
    /// transposed.
    fn forward_from_logits(&self, x: &Tensor, mask: &Tensor, pair_bias: Option<&Tensor>, lean: bool) -> Result<Tensor> {
        let (b, len) = (x.size()[0], x.size()[1]);
        let (heads, dim) = (self.query_w.size()[1], self.head_dim);
        let scale = (dim as f64).powf(-0.5);
        let mut qt = project_transposed(x, &self.query_w)?;
        qt = if lean { qt.f_mul_scalar_(scale)? } else { qt.f_mul_scalar(scale)? };
        let kt = project_transposed(x, &self.key_w)?;
        let mut avg_t = if lean && self.flash {
            // The tensor-core kernel reads each head's [dim, len] where it lies and writes the
            // averaged values so too: [b, heads * dim, len], as the gate below reads them.
            let vt = project_transposed(x, &self.value_w)?;
            let heads_of = |t: &Tensor| t.f_view([b, heads, dim, len])?.f_transpose(2, 3);
            let (q, k, v) = (heads_of(&qt)?, heads_of(&kt)?, heads_of(&vt)?);
            let avg = kernels::flash_attention(&q, &k, &v, 1.0, Some(mask), pair_bias, self.kernels)?;
            drop((q, k, v, qt, kt, vt));
            avg.f_transpose(2, 3)?.f_reshape([b, heads * dim, len])?
        } else {
            self.average_from_logits(x, (qt, kt), mask, pair_bias, lean)?
        };
        let gate_b = self.gating_b.f_reshape([heads * dim, 1])?;
        let mut gate_t = project_transposed(x, &self.gating_w)?;
        let gated = match lean {
            true => avg_t.f_mul_(&gate_t.f_add_(&gate_b)?.f_sigmoid_()?)?,
            false => avg_t.f_mul(&gate_t.f_add(&gate_b)?.f_sigmoid()?)?,
        };
        drop(gate_t);
        let wo = self.output_w.f_reshape([heads * dim, -1])?;
        let c = wo.size()[1];
        let mut out = gated.f_transpose(1, 2)?.f_bmm(&wo.f_expand([b, heads * dim, c], false)?)?;
        match lean {
            true => Ok(out.f_add_(&self.output_b)?),
            false => Ok(out.f_add(&self.output_b)?),
        }
    }

    /// The heads' averaged values `[b, heads * dim, len]` from the queries and keys `(qt, kt)`
    /// (each `[b, heads * dim, len]`) through the whole logits.
    fn average_from_logits(
        &self,
        x: &Tensor,
        (qt, kt): (Tensor, Tensor),
        mask: &Tensor,
        pair_bias: Option<&Tensor>,
        lean: bool,
    ) -> Result<Tensor> {
        let (b, len) = (x.size()[0], x.size()[1]);
        let (heads, dim) = (self.query_w.size()[1], self.head_dim);
        let per_head = [b * heads, dim, len];
        // One binding: a shadowed one would keep the logits' storage alive to the end.
        let logits =
            qt.f_view(per_head)?.f_transpose(1, 2)?.f_bmm(&kt.f_view(per_head)?)?.f_view([b, heads, len, len])?;
        drop((qt, kt));
        // Without autograd the weights overwrite the logits: the two never live together.
        let weights = match lean {
            true => {
                kernels::attention_softmax_in_place(&logits, 1.0, Some(mask), pair_bias, self.kernels)?;
                logits
            }
            false => {
                let weights = kernels::attention_softmax(&logits, 1.0, Some(mask), pair_bias, self.kernels)?;
                drop(logits);
                weights
            }
        };
        // The values once the logits are gone: the two never live together.
        let vt = project_transposed(x, &self.value_w)?.f_view(per_head)?;
        let weights = weights.f_view([b * heads, len, len])?;
        if lean {
            // The averaged values come out transposed as they are made: `v^T w^T`.
            return Ok(vt.f_bmm(&weights.f_transpose(1, 2)?)?.f_view([b, heads * dim, len])?);
        }
        // With autograd the weights come first, `w v`: the weights' gradient is then made
        // [q, k], as the softmax's backward reads it, where `v^T w^T` made it transposed and
        // the backward copied it (logits-sized, in every attention's backward). The averaged
        // values are laid out transposed afterwards, a copy the size of the values.
        let avg = weights.f_bmm(&vt.f_transpose(1, 2)?)?;
        Ok(avg.f_transpose(1, 2)?.f_reshape([b, heads * dim, len])?)
    }
}

/// `x` [b, len, a] projected by `w` [a, heads, dim], transposed: `[b, heads * dim, len]`, one
/// batched product with `w`'s transpose shared across the batch (a stride-0 batch: no copy).
fn project_transposed(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (b, a) = (x.size()[0], w.size()[0]);
    let wt = w.f_reshape([a, -1])?.f_transpose(0, 1)?;
    let hd = wt.size()[0];
    Ok(wt.f_expand([b, hd, a], false)?.f_bmm(&x.f_transpose(1, 2)?)?)
}

/// Global attention along dim 1 of `[batch, len, c]`: one query per head, the masked mean of
/// the queries' inputs, attends over single-head keys and values; each position gates the
/// result with its own gate.
pub struct GlobalAttention {
    query_w: Tensor,
    key_w: Tensor,
    value_w: Tensor,
    gating_w: Tensor,
    gating_b: Tensor,
    output_w: Tensor,
    output_b: Tensor,
    head_dim: i64,
}

impl GlobalAttention {
    /// As [`Attention::new`], but `key_w` and `value_w` are [c, dim] (shared by the heads).
    pub fn new(p: &Scope, c: i64, heads: i64, head_dim: i64) -> Result<Self> {
        let w = |name: &str| p.param(name, &[c, heads, head_dim], Init::Weight { fan_in: c });
        Ok(GlobalAttention {
            query_w: w("query_w")?,
            key_w: p.param("key_w", &[c, head_dim], Init::Weight { fan_in: c })?,
            value_w: p.param("value_w", &[c, head_dim], Init::Weight { fan_in: c })?,
            gating_w: w("gating_w")?,
            gating_b: p.param("gating_b", &[heads, head_dim], Init::One)?,
            output_w: p.param("output_w", &[heads, head_dim, c], Init::Weight { fan_in: heads * head_dim })?,
            output_b: p.param("output_b", &[c], Init::Small)?,
            head_dim,
        })
    }

    /// `x` [batch, len, c]; `mask` [batch, len]. Processes `chunk` batch rows at a time.
    pub fn forward(&self, x: &Tensor, mask: &Tensor, chunk: Option<i64>) -> Result<Tensor> {
        chunked(x.size()[0], chunk, |start, n| {
            let x = narrow(x, 0, start, n)?;
            let mask = narrow(mask, 0, start, n)?;
            let m = mask.f_unsqueeze(-1)?;
            // AlphaFold's mask_mean with eps 1e-10.
            let q_avg = x
                .f_mul(&m)?
                .f_sum_dim_intlist(1, false, None)?
                .f_div(&mask.f_sum_dim_intlist(1, true, None)?.f_add_scalar(1e-10)?)?;
            let q = einsum("ba,ahc->bhc", &q_avg, &self.query_w)?.f_mul_scalar((self.head_dim as f64).powf(-0.5))?;
            let k = x.f_matmul(&self.key_w)?;
            let v = x.f_matmul(&self.value_w)?;
            let bias = mask.f_sub_scalar(1.0)?.f_mul_scalar(1e9)?.f_unsqueeze(1)?;
            let weights = einsum("bhc,bkc->bhk", &q, &k)?.f_add(&bias)?.f_softmax(-1, None)?;
            let avg = einsum("bhk,bkc->bhc", &weights, &v)?;
            let gate = einsum("bqa,ahc->bqhc", &x, &self.gating_w)?.f_add(&self.gating_b)?.f_sigmoid()?;
            let gated = gate.f_mul(&avg.f_unsqueeze(1)?)?;
            einsum("bqhc,hco->bqo", &gated, &self.output_w)?.f_add(&self.output_b).map_err(Into::into)
        })
    }
}
