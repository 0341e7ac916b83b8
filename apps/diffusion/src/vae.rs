//! diffusers' `AutoencoderKL`, Stable Diffusion's image <-> latent autoencoder, with
//! diffusers' parameter names (`encoder.*`, `quant_conv`, `post_quant_conv`, `decoder.*`).
//! Checkpoints saved before diffusers 0.14 name the mid-block attention `query`, `key`,
//! `value`, `proj_attn` (the oldest as 1x1 convolutions); [`AutoencoderKL::load`] renames
//! them to `to_q`, `to_k`, `to_v`, `to_out.0` and reshapes them on load.
use std::path::Path;

use tch::nn::{self, Module, VarStore};
use tch::{Device, Tensor};

use crate::attention::Attention;
use crate::config::{VaeConfig, VaeConfigFile};
use crate::unet::resnet::{conv1x1, conv3x3, group_norm, Downsample, ResnetBlock2D, Upsample};
use crate::weights::{self, ComponentFiles};
use crate::{Error, Result};

/// Every GroupNorm of the VAE uses this epsilon.
const EPS: f64 = 1e-6;

/// The pre-0.14 names of the mid-block attention projections and their current names.
const OLD_ATTENTION_NAMES: &[(&str, &str)] =
    &[("query", "to_q"), ("key", "to_k"), ("value", "to_v"), ("proj_attn", "to_out.0")];

/// The current name of an old-style mid-block attention key, `None` for every other key.
pub fn rename_old_attention_key(key: &str) -> Option<String> {
    let (module, leaf) = key.rsplit_once('.')?;
    let (block, name) = module.rsplit_once('.')?;
    if !block.ends_with("mid_block.attentions.0") {
        return None;
    }
    let (_, new) = OLD_ATTENTION_NAMES.iter().find(|(old, _)| *old == name)?;
    Some(format!("{block}.{new}.{leaf}"))
}

/// Single-head self-attention over the pixels of a feature map, with a residual.
#[derive(Debug)]
struct SpatialAttention {
    group_norm: nn::GroupNorm,
    attn: Attention,
}

impl SpatialAttention {
    fn new(p: nn::Path, channels: i64, groups: i64) -> SpatialAttention {
        SpatialAttention {
            group_norm: group_norm(&p / "group_norm", groups, channels, EPS),
            attn: Attention::new(p, channels, channels, 1, channels, true),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, c, h, w) = (x.size()[0], x.size()[1], x.size()[2], x.size()[3]);
        let tokens = self.group_norm.forward(x).flatten(2, 3).transpose(1, 2);
        let out = self.attn.forward(&tokens, None).transpose(1, 2).reshape([b, c, h, w]);
        out + x
    }
}

/// `UNetMidBlock2D`: resnet, attention, resnet.
#[derive(Debug)]
struct MidBlock {
    resnets: [ResnetBlock2D; 2],
    attention: Option<SpatialAttention>,
}

impl MidBlock {
    fn new(p: nn::Path, channels: i64, cfg: &VaeConfig) -> MidBlock {
        let g = cfg.norm_num_groups;
        let resnet = |j: i64| ResnetBlock2D::new(&p / "resnets" / j, channels, channels, None, g, EPS);
        MidBlock {
            resnets: [resnet(0), resnet(1)],
            attention: cfg.mid_block_add_attention.then(|| SpatialAttention::new(&p / "attentions" / 0, channels, g)),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let mut h = self.resnets[0].forward(x, None);
        if let Some(a) = &self.attention {
            h = a.forward(&h);
        }
        self.resnets[1].forward(&h, None)
    }
}

fn resnets(p: &nn::Path, cin: i64, cout: i64, layers: i64, groups: i64) -> Vec<ResnetBlock2D> {
    (0..layers)
        .map(|j| ResnetBlock2D::new(p / "resnets" / j, if j == 0 { cin } else { cout }, cout, None, groups, EPS))
        .collect()
}

/// Image `[B, in, H, W]` to Gaussian moments `[B, 2 * latent, H/f, W/f]`.
#[derive(Debug)]
struct Encoder {
    conv_in: nn::Conv2D,
    down_blocks: Vec<(Vec<ResnetBlock2D>, Option<Downsample>)>,
    mid_block: MidBlock,
    conv_norm_out: nn::GroupNorm,
    conv_out: nn::Conv2D,
}

impl Encoder {
    fn new(p: nn::Path, cfg: &VaeConfig) -> Encoder {
        let ch = &cfg.block_out_channels;
        let (n, g) = (ch.len(), cfg.norm_num_groups);
        let down_blocks = (0..n)
            .map(|i| {
                let bp = &p / "down_blocks" / i;
                let cin = if i == 0 { ch[0] } else { ch[i - 1] };
                let down = (i + 1 < n).then(|| Downsample::new(&bp / "downsamplers" / 0, ch[i], true));
                (resnets(&bp, cin, ch[i], cfg.layers_per_block, g), down)
            })
            .collect();
        Encoder {
            conv_in: conv3x3(&p / "conv_in", cfg.in_channels, ch[0], 1),
            down_blocks,
            mid_block: MidBlock::new(&p / "mid_block", ch[n - 1], cfg),
            conv_norm_out: group_norm(&p / "conv_norm_out", g, ch[n - 1], EPS),
            conv_out: conv3x3(&p / "conv_out", ch[n - 1], 2 * cfg.latent_channels, 1),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let mut h = self.conv_in.forward(x);
        for (resnets, down) in &self.down_blocks {
            for r in resnets {
                h = r.forward(&h, None);
            }
            if let Some(d) = down {
                h = d.forward(&h);
            }
        }
        let h = self.mid_block.forward(&h);
        self.conv_out.forward(&self.conv_norm_out.forward(&h).silu())
    }
}

/// Latents `[B, latent, h, w]` to an image `[B, out, h*f, w*f]`.
#[derive(Debug)]
struct Decoder {
    conv_in: nn::Conv2D,
    mid_block: MidBlock,
    up_blocks: Vec<(Vec<ResnetBlock2D>, Option<Upsample>)>,
    conv_norm_out: nn::GroupNorm,
    conv_out: nn::Conv2D,
}

impl Decoder {
    fn new(p: nn::Path, cfg: &VaeConfig) -> Decoder {
        let ch = &cfg.block_out_channels;
        let (n, g) = (ch.len(), cfg.norm_num_groups);
        let up_blocks = (0..n)
            .map(|i| {
                let bp = &p / "up_blocks" / i;
                let (level, prev) = (n - 1 - i, ch[(n - i).min(n - 1)]);
                let up = (i + 1 < n).then(|| Upsample::new(&bp / "upsamplers" / 0, ch[level]));
                (resnets(&bp, prev, ch[level], cfg.layers_per_block + 1, g), up)
            })
            .collect();
        Decoder {
            conv_in: conv3x3(&p / "conv_in", cfg.latent_channels, ch[n - 1], 1),
            mid_block: MidBlock::new(&p / "mid_block", ch[n - 1], cfg),
            up_blocks,
            conv_norm_out: group_norm(&p / "conv_norm_out", g, ch[0], EPS),
            conv_out: conv3x3(&p / "conv_out", ch[0], cfg.out_channels, 1),
        }
    }

    fn forward(&self, z: &Tensor) -> Tensor {
        let mut h = self.mid_block.forward(&self.conv_in.forward(z));
        for (resnets, up) in &self.up_blocks {
            for r in resnets {
                h = r.forward(&h, None);
            }
            if let Some(u) = up {
                h = u.forward(&h);
            }
        }
        self.conv_out.forward(&self.conv_norm_out.forward(&h).silu())
    }
}

/// The encoder's posterior: a diagonal Gaussian per latent element.
#[derive(Debug)]
pub struct DiagonalGaussian {
    /// Means.
    pub mean: Tensor,
    /// Log-variances, clamped to [-30, 20] as diffusers does.
    pub logvar: Tensor,
}

impl DiagonalGaussian {
    /// Splits moments `[B, 2C, h, w]` into mean and log-variance along the channels.
    pub fn from_moments(moments: &Tensor) -> DiagonalGaussian {
        let parts = moments.chunk(2, 1);
        DiagonalGaussian { mean: parts[0].shallow_clone(), logvar: parts[1].clamp(-30.0, 20.0) }
    }

    /// Standard deviations.
    pub fn std(&self) -> Tensor {
        (&self.logvar * 0.5).exp()
    }

    /// `mean + std * noise` for standard normal `noise` of the mean's shape (drawn by the
    /// caller, e.g. from its own seeded generator).
    pub fn sample_with(&self, noise: &Tensor) -> Result<Tensor> {
        if noise.size() != self.mean.size() {
            return Err(Error::Invalid(format!("noise has shape {:?}, expected {:?}", noise.size(), self.mean.size())));
        }
        Ok(&self.mean + self.std() * noise.to_kind(self.mean.kind()))
    }

    /// A sample using the default generator of the mean's device (seeded by `tch::manual_seed`).
    pub fn sample(&self) -> Tensor {
        &self.mean + self.std() * self.mean.randn_like()
    }
}

/// The KL-regularised autoencoder of Stable Diffusion.
#[derive(Debug)]
pub struct AutoencoderKL {
    cfg: VaeConfig,
    encoder: Encoder,
    decoder: Decoder,
    quant_conv: Option<nn::Conv2D>,
    post_quant_conv: Option<nn::Conv2D>,
}

impl AutoencoderKL {
    /// Creates the parameters under `p` (the root of a VarStore, for diffusers' key names).
    pub fn new(p: &nn::Path, cfg: &VaeConfig) -> AutoencoderKL {
        let z = 2 * cfg.latent_channels;
        AutoencoderKL {
            encoder: Encoder::new(p / "encoder", cfg),
            decoder: Decoder::new(p / "decoder", cfg),
            quant_conv: cfg.use_quant_conv.then(|| conv1x1(p / "quant_conv", z, z)),
            post_quant_conv: cfg
                .use_post_quant_conv
                .then(|| conv1x1(p / "post_quant_conv", cfg.latent_channels, cfg.latent_channels)),
            cfg: cfg.clone(),
        }
    }

    /// Reads the config and weights of a diffusers `vae` folder into a new VarStore on
    /// `device`, accepting the old attention key names (see the module doc).
    pub fn load(files: &ComponentFiles, device: Device) -> Result<(VarStore, AutoencoderKL)> {
        let file: VaeConfigFile = crate::config::read_json(&files.config)?;
        let cfg = VaeConfig::new(&file, &files.config)?;
        let vs = VarStore::new(device);
        let model = AutoencoderKL::new(&vs.root(), &cfg);
        weights::load_into(&vs, &files.weights, rename_old_attention_key)?;
        Ok((vs, model))
    }

    /// Writes `dir/config.json` and `dir/diffusion_pytorch_model.safetensors` (current key
    /// names, float32) for `vs` holding this model at its root.
    pub fn save(&self, vs: &VarStore, dir: &Path) -> Result<()> {
        weights::save_component(vs, &self.cfg.source, "AutoencoderKL", dir)
    }

    /// The architecture.
    pub fn config(&self) -> &VaeConfig {
        &self.cfg
    }

    /// Multiply encoder samples by this before the UNet, divide latents by it before decoding.
    pub fn scaling_factor(&self) -> f64 {
        self.cfg.scaling_factor
    }

    /// The posterior of images `[B, in_channels, H, W]` (H, W multiples of 2^(levels-1)).
    pub fn encode(&self, images: &Tensor) -> Result<DiagonalGaussian> {
        self.check(images, self.cfg.in_channels, "images")?;
        let moments = self.encoder.forward(images);
        let moments = match &self.quant_conv {
            Some(q) => q.forward(&moments),
            None => moments,
        };
        Ok(DiagonalGaussian::from_moments(&moments))
    }

    /// Images `[B, out_channels, H, W]` from latents `[B, latent_channels, h, w]` (unscaled).
    pub fn decode(&self, latents: &Tensor) -> Result<Tensor> {
        self.check(latents, self.cfg.latent_channels, "latents")?;
        let z = match &self.post_quant_conv {
            Some(q) => q.forward(latents),
            None => latents.shallow_clone(),
        };
        Ok(self.decoder.forward(&z))
    }

    fn check(&self, x: &Tensor, channels: i64, what: &str) -> Result<()> {
        let s = x.size();
        let factor = if what == "images" { 1i64 << (self.cfg.block_out_channels.len() - 1) } else { 1 };
        if s.len() != 4 || s[1] != channels || s[2] % factor != 0 || s[3] % factor != 0 {
            return Err(Error::Invalid(format!(
                "VAE {what} have shape {s:?}, expected [batch, {channels}, H, W] with H and W multiples of {factor}"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_attention_names_map_to_current_ones() {
        let r = |k: &str| rename_old_attention_key(k);
        assert_eq!(
            r("encoder.mid_block.attentions.0.query.weight").as_deref(),
            Some("encoder.mid_block.attentions.0.to_q.weight")
        );
        assert_eq!(
            r("decoder.mid_block.attentions.0.proj_attn.bias").as_deref(),
            Some("decoder.mid_block.attentions.0.to_out.0.bias")
        );
        assert_eq!(r("decoder.mid_block.attentions.0.group_norm.bias"), None);
        assert_eq!(r("decoder.up_blocks.0.resnets.0.conv1.weight"), None);
        assert_eq!(r("key"), None);
    }
}
