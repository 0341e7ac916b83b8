//! Vision Transformer (Dosovitskiy et al.) with timm's `VisionTransformer` parameter names,
//! so timm's `vit_*` safetensors weights load by name: `patch_embed.proj`, `cls_token`,
//! `pos_embed`, `blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}`, `norm`, `head`.
//! Class-token pooling, pre-norm blocks, LayerNorm eps 1e-6, exact GELU, as timm's defaults.
use tch::nn::{self, Module};
use tch::{Kind, Tensor};

/// Architecture of a ViT (saved beside trained weights as `model.json`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct VitConfig {
    /// Input height and width in pixels.
    pub image_size: i64,
    /// Patch height and width in pixels.
    pub patch_size: i64,
    /// Input channels.
    pub in_channels: i64,
    /// Output classes.
    pub num_classes: i64,
    /// Embedding width.
    pub width: i64,
    /// Transformer blocks.
    pub depth: i64,
    /// Attention heads.
    pub heads: i64,
    /// MLP hidden width over embedding width.
    pub mlp_ratio: f64,
}

impl VitConfig {
    fn sized(width: i64, depth: i64, heads: i64, patch_size: i64) -> VitConfig {
        VitConfig {
            image_size: 224,
            patch_size,
            in_channels: 3,
            num_classes: 1000,
            width,
            depth,
            heads,
            mlp_ratio: 4.0,
        }
    }

    /// ViT-Ti (timm `vit_tiny_patch{16,32}_224`).
    pub fn tiny(patch_size: i64) -> VitConfig {
        Self::sized(192, 12, 3, patch_size)
    }

    /// ViT-S (timm `vit_small_patch{16,32}_224`).
    pub fn small(patch_size: i64) -> VitConfig {
        Self::sized(384, 12, 6, patch_size)
    }

    /// ViT-B (timm `vit_base_patch{16,32}_224`).
    pub fn base(patch_size: i64) -> VitConfig {
        Self::sized(768, 12, 12, patch_size)
    }

    /// ViT-L (timm `vit_large_patch{16,32}_224`).
    pub fn large(patch_size: i64) -> VitConfig {
        Self::sized(1024, 24, 16, patch_size)
    }

    /// The small ViT of the embedded 8x8 digits: 2x2 patches, 16 tokens plus the class token.
    pub fn digits() -> VitConfig {
        VitConfig {
            image_size: 8,
            patch_size: 2,
            in_channels: 1,
            num_classes: 10,
            width: 64,
            depth: 4,
            heads: 4,
            mlp_ratio: 2.0,
        }
    }

    /// Every preset name [`VitConfig::preset`] knows: `digits` and timm's
    /// `vit_{tiny,small,base,large}_patch{16,32}_224`.
    pub fn preset_names() -> Vec<String> {
        let timm = ["tiny", "small", "base", "large"]
            .iter()
            .flat_map(|s| [16, 32].iter().map(move |p| format!("vit_{s}_patch{p}_224")));
        std::iter::once("digits".to_string()).chain(timm).collect()
    }

    /// A preset by name: `digits` or a timm name such as `vit_base_patch16_224`.
    pub fn preset(name: &str) -> Option<VitConfig> {
        match name {
            "digits" => Some(Self::digits()),
            _ => Self::from_timm_name(name),
        }
    }

    /// A preset by timm's name, e.g. `vit_base_patch16_224`.
    pub fn from_timm_name(name: &str) -> Option<VitConfig> {
        let rest = name.strip_prefix("vit_")?.strip_suffix("_224")?;
        let (size, patch) = rest.split_once("_patch")?;
        let patch: i64 = patch.parse().ok().filter(|p| *p == 16 || *p == 32)?;
        Some(match size {
            "tiny" => Self::tiny(patch),
            "small" => Self::small(patch),
            "base" => Self::base(patch),
            "large" => Self::large(patch),
            _ => return None,
        })
    }

    /// Checks the numbers fit together; the error names them.
    pub fn validate(&self) -> Result<(), String> {
        let c = self;
        if c.image_size <= 0 || c.patch_size <= 0 || c.image_size % c.patch_size != 0 {
            return Err(format!(
                "image size {} is not a positive multiple of patch size {}",
                c.image_size, c.patch_size
            ));
        }
        if c.width <= 0 || c.heads <= 0 || c.width % c.heads != 0 {
            return Err(format!("width {} does not split into {} heads", c.width, c.heads));
        }
        if c.in_channels <= 0 || c.num_classes <= 0 || c.depth <= 0 || c.mlp_ratio <= 0.0 {
            return Err(format!("channels, classes, depth and mlp ratio must be positive: {c:?}"));
        }
        Ok(())
    }

    /// Patches per image.
    pub fn num_patches(&self) -> i64 {
        (self.image_size / self.patch_size).pow(2)
    }
}

fn linear(p: nn::Path, inputs: i64, outputs: i64) -> nn::Linear {
    // timm initialises linear weights with std 0.02 and biases with zeros.
    let cfg = nn::LinearConfig { ws_init: nn::Init::Randn { mean: 0.0, stdev: 0.02 }, ..Default::default() };
    nn::linear(p, inputs, outputs, cfg)
}

fn layer_norm(p: nn::Path, width: i64) -> nn::LayerNorm {
    nn::layer_norm(p, vec![width], nn::LayerNormConfig { eps: 1e-6, ..Default::default() })
}

#[derive(Debug)]
struct Attention {
    qkv: nn::Linear,
    proj: nn::Linear,
    heads: i64,
}

impl Attention {
    fn new(p: nn::Path, width: i64, heads: i64) -> Attention {
        Attention { qkv: linear(&p / "qkv", width, 3 * width), proj: linear(&p / "proj", width, width), heads }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let (b, n, d) = x.size3().expect("[batch, tokens, width]");
        // [b, n, 3 * d] -> [3, b, heads, n, head_dim], timm's layout of the fused projection.
        let qkv = self.qkv.forward(x).reshape([b, n, 3, self.heads, d / self.heads]).permute([2, 0, 3, 1, 4]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let out = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, false, None, false);
        self.proj.forward(&out.transpose(1, 2).reshape([b, n, d]))
    }
}

#[derive(Debug)]
struct Block {
    norm1: nn::LayerNorm,
    attn: Attention,
    norm2: nn::LayerNorm,
    fc1: nn::Linear,
    fc2: nn::Linear,
}

impl Block {
    fn new(p: nn::Path, cfg: &VitConfig) -> Block {
        let hidden = (cfg.width as f64 * cfg.mlp_ratio) as i64;
        Block {
            norm1: layer_norm(&p / "norm1", cfg.width),
            attn: Attention::new(&p / "attn", cfg.width, cfg.heads),
            norm2: layer_norm(&p / "norm2", cfg.width),
            fc1: linear(&p / "mlp" / "fc1", cfg.width, hidden),
            fc2: linear(&p / "mlp" / "fc2", hidden, cfg.width),
        }
    }

    fn forward(&self, x: &Tensor) -> Tensor {
        let x = x + self.attn.forward(&self.norm1.forward(x));
        let h = self.fc1.forward(&self.norm2.forward(&x)).gelu("none");
        &x + self.fc2.forward(&h)
    }
}

/// A Vision Transformer classifier.
#[derive(Debug)]
pub struct Vit {
    cfg: VitConfig,
    patch_embed: nn::Conv2D,
    cls_token: Tensor,
    pos_embed: Tensor,
    blocks: Vec<Block>,
    norm: nn::LayerNorm,
    head: nn::Linear,
}

impl Vit {
    /// Creates the parameters under `p` (validate the config first).
    pub fn new(p: &nn::Path, cfg: VitConfig) -> Vit {
        let conv = nn::ConvConfig { stride: cfg.patch_size, ..Default::default() };
        let tokens = cfg.num_patches() + 1;
        Vit {
            patch_embed: nn::conv2d(p / "patch_embed" / "proj", cfg.in_channels, cfg.width, cfg.patch_size, conv),
            cls_token: p.var("cls_token", &[1, 1, cfg.width], nn::Init::Randn { mean: 0.0, stdev: 1e-6 }),
            pos_embed: p.var("pos_embed", &[1, tokens, cfg.width], nn::Init::Randn { mean: 0.0, stdev: 0.02 }),
            blocks: (0..cfg.depth).map(|i| Block::new(p / "blocks" / i, &cfg)).collect(),
            norm: layer_norm(p / "norm", cfg.width),
            head: linear(p / "head", cfg.width, cfg.num_classes),
            cfg,
        }
    }

    /// The architecture.
    pub fn config(&self) -> &VitConfig {
        &self.cfg
    }

    /// Logits `[batch, classes]` for images `[batch, channels, size, size]`.
    pub fn forward(&self, images: &Tensor) -> Tensor {
        let b = images.size()[0];
        let x = self.patch_embed.forward(images).flatten(2, -1).transpose(1, 2);
        let cls = self.cls_token.expand([b, -1, -1], false).to_kind(x.kind());
        let mut x = Tensor::cat(&[cls, x], 1) + &self.pos_embed;
        for block in &self.blocks {
            x = block.forward(&x);
        }
        self.head.forward(&self.norm.forward(&x).select(1, 0))
    }
}

/// Top-k accuracy counts: how many of `logits`' rows have `labels` among their k best.
pub fn correct_top_k(logits: &Tensor, labels: &Tensor, k: i64) -> i64 {
    let k = k.min(logits.size()[1]);
    let (_, top) = logits.topk(k, 1, true, true);
    top.eq_tensor(&labels.unsqueeze(1)).any_dim(1, false).sum(Kind::Int64).int64_value(&[])
}
