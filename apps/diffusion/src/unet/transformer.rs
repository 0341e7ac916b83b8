//! diffusers' `Transformer2DModel` for continuous inputs, as the SD UNet uses it: GroupNorm,
//! `proj_in` (1x1 conv in SD1, linear in SD2 and SDXL), `depth` `BasicTransformerBlock`s (one
//! in SD 1.x/2.x, up to 10 in SDXL; each self-attention, cross-attention on the text states,
//! GEGLU feed-forward, each pre-LayerNorm and residual),
//! `proj_out`, and a residual around the whole.
use tch::nn::{self, Module};
use tch::Tensor;

use super::resnet::{conv1x1, group_norm};
use crate::attention::Attention;

/// `ff.net.0.proj` to twice the inner width, the first half gated by GELU of the second
/// (`GEGLU`), then `ff.net.2` back.
#[derive(Debug)]
struct FeedForward {
    proj: nn::Linear,
    out: nn::Linear,
}

impl FeedForward {
    fn new(p: nn::Path, dim: i64) -> FeedForward {
        let inner = 4 * dim;
        FeedForward {
            proj: nn::linear(&p / "net" / 0 / "proj", dim, 2 * inner, Default::default()),
            out: nn::linear(&p / "net" / 2, inner, dim, Default::default()),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let h = self.proj.forward(x).chunk(2, -1);
        self.out.forward(&(&h[0] * h[1].gelu("none")))
    }
}

#[derive(Debug)]
struct BasicTransformerBlock {
    norm1: nn::LayerNorm,
    attn1: Attention,
    norm2: nn::LayerNorm,
    attn2: Attention,
    norm3: nn::LayerNorm,
    ff: FeedForward,
}

impl BasicTransformerBlock {
    fn new(p: nn::Path, dim: i64, heads: i64, context_dim: i64) -> BasicTransformerBlock {
        let ln = |name: &str| nn::layer_norm(&p / name, vec![dim], Default::default());
        let head_dim = dim / heads;
        BasicTransformerBlock {
            norm1: ln("norm1"),
            attn1: Attention::new(&p / "attn1", dim, dim, heads, head_dim, false),
            norm2: ln("norm2"),
            attn2: Attention::new(&p / "attn2", dim, context_dim, heads, head_dim, false),
            norm3: ln("norm3"),
            ff: FeedForward::new(&p / "ff", dim),
        }
    }

    fn visit_attentions(&mut self, f: &mut dyn FnMut(&mut Attention)) {
        f(&mut self.attn1);
        f(&mut self.attn2);
    }

    fn forward(&self, x: &Tensor, context: &Tensor) -> Tensor {
        let x = x + self.attn1.forward(&self.norm1.forward(x), None);
        let x = &x + self.attn2.forward(&self.norm2.forward(&x), Some(context));
        &x + self.ff.forward(&self.norm3.forward(&x))
    }
}

/// `proj_in` / `proj_out`: 1x1 convolutions on `[B, C, H, W]` (SD1) or linear layers on
/// `[B, HW, C]` tokens (SD2).
#[derive(Debug)]
enum Projection {
    Conv(nn::Conv2D),
    Linear(nn::Linear),
}

impl Projection {
    fn new(p: nn::Path, dim: i64, linear: bool) -> Projection {
        if linear {
            Projection::Linear(nn::linear(p, dim, dim, Default::default()))
        } else {
            Projection::Conv(conv1x1(p, dim, dim))
        }
    }
}

/// A spatial transformer over a feature map, conditioned on encoder hidden states.
#[derive(Debug)]
pub(crate) struct Transformer2D {
    norm: nn::GroupNorm,
    proj_in: Projection,
    blocks: Vec<BasicTransformerBlock>,
    proj_out: Projection,
}

impl Transformer2D {
    pub(crate) fn new(
        p: nn::Path,
        dim: i64,
        depth: i64,
        heads: i64,
        context_dim: i64,
        groups: i64,
        linear: bool,
    ) -> Transformer2D {
        Transformer2D {
            // diffusers fixes this GroupNorm's epsilon at 1e-6, whatever the UNet's norm_eps.
            norm: group_norm(&p / "norm", groups, dim, 1e-6),
            proj_in: Projection::new(&p / "proj_in", dim, linear),
            blocks: (0..depth)
                .map(|i| BasicTransformerBlock::new(&p / "transformer_blocks" / i, dim, heads, context_dim))
                .collect(),
            proj_out: Projection::new(&p / "proj_out", dim, linear),
        }
    }

    /// Calls `f` on every attention module, in order.
    pub(crate) fn visit_attentions(&mut self, f: &mut dyn FnMut(&mut Attention)) {
        self.blocks.iter_mut().for_each(|b| b.visit_attentions(f));
    }

    pub(crate) fn forward(&self, x: &Tensor, context: &Tensor) -> Tensor {
        let (b, c, h, w) = (x.size()[0], x.size()[1], x.size()[2], x.size()[3]);
        let to_tokens = |t: &Tensor| t.permute([0, 2, 3, 1]).reshape([b, h * w, c]);
        let to_map = |t: &Tensor| t.reshape([b, h, w, c]).permute([0, 3, 1, 2]);
        let normed = self.norm.forward(x);
        let tokens = match &self.proj_in {
            Projection::Conv(conv) => to_tokens(&conv.forward(&normed)),
            Projection::Linear(lin) => lin.forward(&to_tokens(&normed)),
        };
        let tokens = self.blocks.iter().fold(tokens, |t, block| block.forward(&t, context));
        let out = match &self.proj_out {
            Projection::Conv(conv) => conv.forward(&to_map(&tokens)),
            Projection::Linear(lin) => to_map(&lin.forward(&tokens)),
        };
        out + x
    }
}
