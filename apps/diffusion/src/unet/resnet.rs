//! The convolutional pieces shared by the UNet and the VAE, with diffusers' names:
//! `ResnetBlock2D` (`norm1`, `conv1`, `time_emb_proj`, `norm2`, `conv2`, `conv_shortcut`) and the
//! stride-2 / nearest-neighbour resamplers (`downsamplers.0.conv`, `upsamplers.0.conv`).
use tch::nn::{self, Module};
use tch::Tensor;

/// A 3x3 convolution with padding 1 (`stride` 1 or 2), diffusers' default.
pub(crate) fn conv3x3(p: nn::Path, cin: i64, cout: i64, stride: i64) -> nn::Conv2D {
    nn::conv2d(p, cin, cout, 3, nn::ConvConfig { padding: 1, stride, ..Default::default() })
}

/// A 1x1 convolution.
pub(crate) fn conv1x1(p: nn::Path, cin: i64, cout: i64) -> nn::Conv2D {
    nn::conv2d(p, cin, cout, 1, Default::default())
}

/// GroupNorm with affine weights.
pub(crate) fn group_norm(p: nn::Path, groups: i64, channels: i64, eps: f64) -> nn::GroupNorm {
    nn::group_norm(p, groups, channels, nn::GroupNormConfig { eps, ..Default::default() })
}

/// Two GroupNorm-SiLU-conv stages with an optional timestep projection added between them and
/// a 1x1 shortcut where the width changes.
#[derive(Debug)]
pub(crate) struct ResnetBlock2D {
    norm1: nn::GroupNorm,
    conv1: nn::Conv2D,
    time_emb_proj: Option<nn::Linear>,
    norm2: nn::GroupNorm,
    conv2: nn::Conv2D,
    conv_shortcut: Option<nn::Conv2D>,
}

impl ResnetBlock2D {
    /// `temb`: the width of the timestep embedding (`None` in the VAE).
    pub(crate) fn new(p: nn::Path, cin: i64, cout: i64, temb: Option<i64>, groups: i64, eps: f64) -> ResnetBlock2D {
        ResnetBlock2D {
            norm1: group_norm(&p / "norm1", groups, cin, eps),
            conv1: conv3x3(&p / "conv1", cin, cout, 1),
            time_emb_proj: temb.map(|t| nn::linear(&p / "time_emb_proj", t, cout, Default::default())),
            norm2: group_norm(&p / "norm2", groups, cout, eps),
            conv2: conv3x3(&p / "conv2", cout, cout, 1),
            conv_shortcut: (cin != cout).then(|| conv1x1(&p / "conv_shortcut", cin, cout)),
        }
    }

    pub(crate) fn forward(&self, x: &Tensor, temb: Option<&Tensor>) -> Tensor {
        let h = self.conv1.forward(&self.norm1.forward(x).silu());
        let h = match (&self.time_emb_proj, temb) {
            (Some(proj), Some(t)) => h + proj.forward(&t.silu()).unsqueeze(-1).unsqueeze(-1),
            _ => h,
        };
        let h = self.conv2.forward(&self.norm2.forward(&h).silu());
        match &self.conv_shortcut {
            Some(c) => c.forward(x) + h,
            None => x + h,
        }
    }
}

/// Halves height and width with a stride-2 3x3 convolution. The UNet pads 1 on every side;
/// the VAE pads only right and bottom (`asymmetric`), as the original LDM autoencoder did.
#[derive(Debug)]
pub(crate) struct Downsample {
    conv: nn::Conv2D,
    asymmetric: bool,
}

impl Downsample {
    pub(crate) fn new(p: nn::Path, channels: i64, asymmetric: bool) -> Downsample {
        let padding = if asymmetric { 0 } else { 1 };
        let cfg = nn::ConvConfig { padding, stride: 2, ..Default::default() };
        Downsample { conv: nn::conv2d(&p / "conv", channels, channels, 3, cfg), asymmetric }
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        if self.asymmetric {
            self.conv.forward(&x.constant_pad_nd([0, 1, 0, 1]))
        } else {
            self.conv.forward(x)
        }
    }
}

/// Doubles height and width (nearest neighbour), then a 3x3 convolution.
#[derive(Debug)]
pub(crate) struct Upsample {
    conv: nn::Conv2D,
}

impl Upsample {
    pub(crate) fn new(p: nn::Path, channels: i64) -> Upsample {
        Upsample { conv: conv3x3(&p / "conv", channels, channels, 1) }
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Tensor {
        let (h, w) = (x.size()[2], x.size()[3]);
        self.conv.forward(&x.upsample_nearest2d([2 * h, 2 * w], None, None))
    }
}
