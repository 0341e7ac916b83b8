//! The UNet's levels: `CrossAttnDownBlock2D` / `DownBlock2D` (resnets, optional transformers,
//! a downsampler except at the deepest level), `UNetMidBlock2DCrossAttn` (resnet, transformer,
//! resnet) and `CrossAttnUpBlock2D` / `UpBlock2D` (one more resnet than a down block, each
//! taking a skip connection from the down path, then an upsampler except at the top).
use tch::Tensor;

use super::resnet::{Downsample, ResnetBlock2D, Upsample};
use super::transformer::Transformer2D;
use crate::config::UNetConfig;

/// Settings shared by every block of one UNet.
pub(crate) struct Shared {
    pub temb: i64,
    pub groups: i64,
    pub eps: f64,
    pub context: i64,
    pub linear: bool,
}

impl Shared {
    pub(crate) fn new(cfg: &UNetConfig) -> Shared {
        Shared {
            temb: 4 * cfg.block_out_channels[0],
            groups: cfg.norm_num_groups,
            eps: cfg.norm_eps,
            context: cfg.cross_attention_dim,
            linear: cfg.use_linear_projection,
        }
    }

    fn resnet(&self, p: tch::nn::Path, cin: i64, cout: i64) -> ResnetBlock2D {
        ResnetBlock2D::new(p, cin, cout, Some(self.temb), self.groups, self.eps)
    }

    fn transformer(&self, p: tch::nn::Path, dim: i64, attention: Attention) -> Transformer2D {
        Transformer2D::new(p, dim, attention.depth, attention.heads, self.context, self.groups, self.linear)
    }
}

/// The transformers of a cross-attention block: heads, and layers in each (SDXL's
/// `transformer_layers_per_block`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Attention {
    pub heads: i64,
    pub depth: i64,
}

/// One level of the down path.
#[derive(Debug)]
pub(crate) struct DownBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2D>,
    downsampler: Option<Downsample>,
}

impl DownBlock {
    /// `attention`: `Some` for a cross-attention block.
    pub(crate) fn new(
        p: tch::nn::Path,
        s: &Shared,
        cin: i64,
        cout: i64,
        layers: i64,
        attention: Option<Attention>,
        last: bool,
    ) -> DownBlock {
        DownBlock {
            resnets: (0..layers).map(|j| s.resnet(&p / "resnets" / j, if j == 0 { cin } else { cout }, cout)).collect(),
            attentions: attention
                .map_or(vec![], |a| (0..layers).map(|j| s.transformer(&p / "attentions" / j, cout, a)).collect()),
            downsampler: (!last).then(|| Downsample::new(&p / "downsamplers" / 0, cout, false)),
        }
    }

    /// The block's output and the skip states it leaves for the up path, in order.
    /// Calls `f` on every attention module of the block's transformers, in order.
    pub(crate) fn visit_attentions(&mut self, f: &mut dyn FnMut(&mut crate::attention::Attention)) {
        self.attentions.iter_mut().for_each(|a| a.visit_attentions(f));
    }

    pub(crate) fn forward(&self, x: &Tensor, temb: &Tensor, context: &Tensor) -> Vec<Tensor> {
        let mut skips = Vec::new();
        let mut h = x.shallow_clone();
        for (j, resnet) in self.resnets.iter().enumerate() {
            h = resnet.forward(&h, Some(temb));
            if let Some(attn) = self.attentions.get(j) {
                h = attn.forward(&h, context);
            }
            skips.push(h.shallow_clone());
        }
        if let Some(down) = &self.downsampler {
            h = down.forward(&h);
            skips.push(h.shallow_clone());
        }
        skips
    }
}

/// The bottom of the UNet.
#[derive(Debug)]
pub(crate) struct MidBlock {
    resnets: [ResnetBlock2D; 2],
    attention: Transformer2D,
}

impl MidBlock {
    pub(crate) fn new(p: tch::nn::Path, s: &Shared, channels: i64, attention: Attention) -> MidBlock {
        MidBlock {
            resnets: [
                s.resnet(&p / "resnets" / 0, channels, channels),
                s.resnet(&p / "resnets" / 1, channels, channels),
            ],
            attention: s.transformer(&p / "attentions" / 0, channels, attention),
        }
    }

    /// Calls `f` on every attention module of the block's transformers, in order.
    pub(crate) fn visit_attentions(&mut self, f: &mut dyn FnMut(&mut crate::attention::Attention)) {
        self.attention.visit_attentions(f);
    }

    pub(crate) fn forward(&self, x: &Tensor, temb: &Tensor, context: &Tensor) -> Tensor {
        let h = self.resnets[0].forward(x, Some(temb));
        let h = self.attention.forward(&h, context);
        self.resnets[1].forward(&h, Some(temb))
    }
}

/// One level of the up path.
#[derive(Debug)]
pub(crate) struct UpBlock {
    resnets: Vec<ResnetBlock2D>,
    attentions: Vec<Transformer2D>,
    upsampler: Option<Upsample>,
}

/// Widths of an up block's inputs: the block below's output, this level's width, and the
/// width of the level under it (the skip states of the down path's last layer).
pub(crate) struct UpWidths {
    pub prev: i64,
    pub out: i64,
    pub skip_in: i64,
}

impl UpBlock {
    pub(crate) fn new(
        p: tch::nn::Path,
        s: &Shared,
        w: UpWidths,
        layers: i64,
        attention: Option<Attention>,
        last: bool,
    ) -> UpBlock {
        let resnet = |j: i64| {
            let skip = if j == layers - 1 { w.skip_in } else { w.out };
            let cin = if j == 0 { w.prev } else { w.out };
            s.resnet(&p / "resnets" / j, cin + skip, w.out)
        };
        UpBlock {
            resnets: (0..layers).map(resnet).collect(),
            attentions: attention
                .map_or(vec![], |a| (0..layers).map(|j| s.transformer(&p / "attentions" / j, w.out, a)).collect()),
            upsampler: (!last).then(|| Upsample::new(&p / "upsamplers" / 0, w.out)),
        }
    }

    /// Skip connections a forward consumes.
    pub(crate) fn layers(&self) -> usize {
        self.resnets.len()
    }

    /// `skips`: this block's skip states in the order they are consumed (the down path's last
    /// state first).
    /// Calls `f` on every attention module of the block's transformers, in order.
    pub(crate) fn visit_attentions(&mut self, f: &mut dyn FnMut(&mut crate::attention::Attention)) {
        self.attentions.iter_mut().for_each(|a| a.visit_attentions(f));
    }

    pub(crate) fn forward(&self, x: &Tensor, skips: &[Tensor], temb: &Tensor, context: &Tensor) -> Tensor {
        let mut h = x.shallow_clone();
        for (j, (resnet, skip)) in self.resnets.iter().zip(skips).enumerate() {
            h = resnet.forward(&Tensor::cat(&[&h, skip], 1), Some(temb));
            if let Some(attn) = self.attentions.get(j) {
                h = attn.forward(&h, context);
            }
        }
        match &self.upsampler {
            Some(up) => up.forward(&h),
            None => h,
        }
    }
}
