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

/// A LoRA adapter on one projection, as peft's `lora.Linear` adds it: `scale * up(down(x))`
/// beside the frozen layer's own output. `down` [rank, in] and `up` [out, rank] stay fp32
/// masters; they run in the input's kind.
#[derive(Debug)]
pub struct Adapter {
    /// [rank, in].
    pub down: Tensor,
    /// [out, rank].
    pub up: Tensor,
    /// `alpha / rank`.
    pub scale: f64,
}

impl Adapter {
    fn forward(&self, x: &Tensor) -> Tensor {
        let kind = x.kind();
        x.matmul(&self.down.to_kind(kind).tr()).matmul(&self.up.to_kind(kind).tr()) * self.scale
    }
}

/// The projections in diffusers' order and module names.
pub const PROJECTIONS: [&str; 4] = ["to_q", "to_k", "to_v", "to_out.0"];

/// Attention of queries from `x` over keys and values from a context (or `x` itself).
#[derive(Debug)]
pub struct Attention {
    /// Module path (`down_blocks.1.attentions.0.transformer_blocks.0.attn1`).
    name: String,
    to_q: nn::Linear,
    to_k: nn::Linear,
    to_v: nn::Linear,
    to_out: nn::Linear,
    /// LoRA adapters on the projections, in [`PROJECTIONS`] order.
    adapters: [Option<Adapter>; 4],
    heads: i64,
}

impl Attention {
    /// `query_dim`-wide queries over `context_dim`-wide context, `heads` of `head_dim`;
    /// `qkv_bias`: whether `to_q/to_k/to_v` have biases (the UNet's do not, the VAE's do).
    pub fn new(p: nn::Path, query_dim: i64, context_dim: i64, heads: i64, head_dim: i64, qkv_bias: bool) -> Attention {
        let inner = heads * head_dim;
        let cfg = nn::LinearConfig { bias: qkv_bias, ..Default::default() };
        Attention {
            name: p.components().collect::<Vec<_>>().join("."),
            adapters: Default::default(),
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
        let q = self.project(0, x);
        let (k, v) = (self.project(1, context), self.project(2, context));
        self.project(3, &multi_head(&q, &k, &v, self.heads))
    }

    /// Projection `i` of [`PROJECTIONS`].
    fn layer(&self, i: usize) -> &nn::Linear {
        [&self.to_q, &self.to_k, &self.to_v, &self.to_out][i]
    }

    /// Projection `i` applied to `x`, with its adapter when it has one.
    fn project(&self, i: usize, x: &Tensor) -> Tensor {
        match &self.adapters[i] {
            Some(a) => self.layer(i).forward(x) + a.forward(x),
            None => self.layer(i).forward(x),
        }
    }

    /// Projection `i`'s module path (`...attn1.to_q`), as LoRA files name it.
    pub fn projection(&self, i: usize) -> String {
        format!("{}.{}", self.name, PROJECTIONS[i])
    }

    /// Projection `i`'s weight [out, in] (see [`PROJECTIONS`]).
    pub fn weight(&self, i: usize) -> &Tensor {
        &self.layer(i).ws
    }

    /// Puts `adapter` on projection `i` (see [`PROJECTIONS`]).
    pub fn adapt(&mut self, i: usize, adapter: Adapter) {
        self.adapters[i] = Some(adapter);
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
