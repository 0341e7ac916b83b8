//! Multi-head attention as diffusers' `Attention` module names it (`to_q`, `to_k`, `to_v`,
//! `to_out.0`), used by the UNet's transformers (self- and cross-attention) and the VAE's mid
//! blocks. The product runs through `Tensor::scaled_dot_product_attention`, which picks the
//! fused kernel on GPUs and keeps the softmax in float32 under half precision.
use tch::nn::{self, Module};
use tch::Tensor;

/// Splits `[batch, tokens, heads * dim]` projections into heads, attends, and merges them back.
pub fn multi_head(q: &Tensor, k: &Tensor, v: &Tensor, heads: i64) -> Tensor {
    let split = |t: &Tensor| {
        let (b, n, c) = (t.size()[0], t.size()[1], t.size()[2]);
        t.reshape([b, n, heads, c / heads]).transpose(1, 2)
    };
    let out =
        Tensor::scaled_dot_product_attention(&split(q), &split(k), &split(v), None::<Tensor>, 0.0, false, None, false);
    let (b, n) = (q.size()[0], q.size()[1]);
    out.transpose(1, 2).reshape([b, n, -1])
}

/// Attention of queries from `x` over keys and values from a context (or `x` itself).
#[derive(Debug)]
pub struct Attention {
    to_q: nn::Linear,
    to_k: nn::Linear,
    to_v: nn::Linear,
    to_out: nn::Linear,
    heads: i64,
}

impl Attention {
    /// `query_dim`-wide queries over `context_dim`-wide context, `heads` of `head_dim`;
    /// `qkv_bias`: whether `to_q/to_k/to_v` have biases (the UNet's do not, the VAE's do).
    pub fn new(p: nn::Path, query_dim: i64, context_dim: i64, heads: i64, head_dim: i64, qkv_bias: bool) -> Attention {
        let inner = heads * head_dim;
        let cfg = nn::LinearConfig { bias: qkv_bias, ..Default::default() };
        Attention {
            to_q: nn::linear(&p / "to_q", query_dim, inner, cfg),
            to_k: nn::linear(&p / "to_k", context_dim, inner, cfg),
            to_v: nn::linear(&p / "to_v", context_dim, inner, cfg),
            to_out: nn::linear(&p / "to_out" / 0, inner, query_dim, Default::default()),
            heads,
        }
    }

    /// `x` `[batch, tokens, query_dim]` attending over `context` `[batch, tokens', context_dim]`
    /// (self-attention where `None`).
    pub fn forward(&self, x: &Tensor, context: Option<&Tensor>) -> Tensor {
        let context = context.unwrap_or(x);
        let q = self.to_q.forward(x);
        let (k, v) = (self.to_k.forward(context), self.to_v.forward(context));
        self.to_out.forward(&multi_head(&q, &k, &v, self.heads))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn multi_head_equals_explicit_softmax() {
        tch::manual_seed(1);
        let opts = (Kind::Float, Device::Cpu);
        let (q, k, v) =
            (Tensor::randn([2, 3, 8], opts), Tensor::randn([2, 5, 8], opts), Tensor::randn([2, 5, 8], opts));
        let got = multi_head(&q, &k, &v, 2);
        // Head 1 by hand: channels 4..8, scaled by 1/sqrt(4).
        let (qh, kh, vh) = (q.narrow(2, 4, 4), k.narrow(2, 4, 4), v.narrow(2, 4, 4));
        let w = (qh.matmul(&kh.transpose(1, 2)) / 2.0).softmax(-1, Kind::Float);
        let want = w.matmul(&vh);
        let diff = (got.narrow(2, 4, 4) - want).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "max difference {diff}");
    }
}
