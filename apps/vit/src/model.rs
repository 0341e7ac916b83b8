//! Vision Transformer (Dosovitskiy et al.) with timm's `VisionTransformer` parameter names,
//! so timm's `vit_*` safetensors weights load by name: `patch_embed.proj`, `cls_token`,
//! `pos_embed`, `blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}`, `norm`, `head`.
//! Class-token pooling, pre-norm blocks, LayerNorm eps 1e-6, exact GELU, as timm's defaults.
//!
//! The model is written once, serially. Its four linear layers per block come from a
//! [`Layers`] factory: [`Serial`] makes `nn::Linear`s; `crate::tensor_parallel` makes
//! Megatron's column/row-parallel layers, and the same code then computes this rank's share of
//! the heads and of the MLP's hidden features. [`Vit::into_parts`] gives the model as its parts
//! in running order (the embedding, each block, the head): the units `crate::pipeline_parallel`
//! cuts into stages.
use std::rc::Rc;

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

    /// The MLP's hidden features (`width * mlp_ratio`).
    pub fn mlp_hidden(&self) -> i64 {
        (self.width as f64 * self.mlp_ratio) as i64
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

/// A layer of a block acting on the last dimension of its input (a linear layer or a norm),
/// serial or holding a block of its features.
pub trait Layer: std::fmt::Debug {
    /// The layer applied to the last dimension of `x`.
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor>;
}

impl Layer for nn::Linear {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(Module::forward(self, x))
    }
}

impl Layer for nn::LayerNorm {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(Module::forward(self, x))
    }
}

/// Makes a block's linear layers (`inputs -> outputs` are the whole layer's features).
pub trait Layers {
    /// Into which parts the heads and the MLP's hidden features are split (1: whole).
    fn parts(&self) -> i64;
    /// A layer that computes its share of the output features (`attn.qkv`, `mlp.fc1`).
    fn column(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>>;
    /// A layer that takes its share of the input features and yields whole outputs
    /// (`attn.proj`, `mlp.fc2`).
    fn row(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>>;
    /// A block's LayerNorm (`norm1`, `norm2`).
    fn norm(&self, p: nn::Path, width: i64) -> anyhow::Result<Box<dyn Layer>> {
        Ok(Box::new(layer_norm(p, width)))
    }
    /// What the residual stream goes through entering and leaving the blocks.
    fn region(&self) -> Box<dyn Region> {
        Box::new(Whole)
    }
}

/// The blocks' view of the residual stream `[batch, tokens, width]`.
pub trait Region: std::fmt::Debug {
    /// The stream entering the first block (sequence parallelism keeps this rank's block of
    /// the tokens).
    fn enter(&self, x: Tensor) -> anyhow::Result<Tensor>;
    /// The stream leaving the last block, whole again.
    fn leave(&self, x: Tensor) -> anyhow::Result<Tensor>;
}

/// The serial model's region: every token everywhere.
#[derive(Debug)]
struct Whole;

impl Region for Whole {
    fn enter(&self, x: Tensor) -> anyhow::Result<Tensor> {
        Ok(x)
    }
    fn leave(&self, x: Tensor) -> anyhow::Result<Tensor> {
        Ok(x)
    }
}

/// The serial model's layers: timm's `nn.Linear`s.
pub struct Serial;

impl Layers for Serial {
    fn parts(&self) -> i64 {
        1
    }
    fn column(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        Ok(Box::new(linear(p, inputs, outputs)))
    }
    fn row(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        Ok(Box::new(linear(p, inputs, outputs)))
    }
}

pub(crate) fn layer_norm(p: nn::Path, width: i64) -> nn::LayerNorm {
    nn::layer_norm(p, vec![width], nn::LayerNormConfig { eps: 1e-6, ..Default::default() })
}

#[derive(Debug)]
struct Attention {
    qkv: Box<dyn Layer>,
    proj: Box<dyn Layer>,
    /// This rank's heads (all of them serially).
    heads: i64,
    head_dim: i64,
}

impl Attention {
    fn new(p: nn::Path, cfg: &VitConfig, layers: &dyn Layers) -> anyhow::Result<Attention> {
        let width = cfg.width;
        Ok(Attention {
            qkv: layers.column(&p / "qkv", width, 3 * width)?,
            proj: layers.row(&p / "proj", width, width)?,
            heads: cfg.heads / layers.parts(),
            head_dim: width / cfg.heads,
        })
    }

    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        let (h, hd) = (self.heads, self.head_dim);
        // The tokens are the projection's (a sequence-parallel `qkv` gathers them all).
        let qkv = self.qkv.forward(x)?;
        let (b, n, _) = qkv.size3()?;
        // [b, n, 3 * h * hd] -> [3, b, h, n, hd], timm's layout of the fused projection.
        let qkv = qkv.f_reshape([b, n, 3, h, hd])?.f_permute([2, 0, 3, 1, 4])?;
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        let out = Tensor::f_scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, false, None, false)?;
        self.proj.forward(&out.f_transpose(1, 2)?.f_reshape([b, n, h * hd])?)
    }
}

/// A pre-norm transformer block.
#[derive(Debug)]
pub struct Block {
    norm1: Box<dyn Layer>,
    attn: Attention,
    norm2: Box<dyn Layer>,
    fc1: Box<dyn Layer>,
    fc2: Box<dyn Layer>,
}

impl Block {
    fn new(p: nn::Path, cfg: &VitConfig, layers: &dyn Layers) -> anyhow::Result<Block> {
        let hidden = cfg.mlp_hidden();
        Ok(Block {
            norm1: layers.norm(&p / "norm1", cfg.width)?,
            attn: Attention::new(&p / "attn", cfg, layers)?,
            norm2: layers.norm(&p / "norm2", cfg.width)?,
            fc1: layers.column(&p / "mlp" / "fc1", cfg.width, hidden)?,
            fc2: layers.row(&p / "mlp" / "fc2", hidden, cfg.width)?,
        })
    }

    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        let x = x + self.attn.forward(&self.norm1.forward(x)?)?;
        let h = self.fc1.forward(&self.norm2.forward(&x)?)?.f_gelu("none")?;
        Ok(&x + self.fc2.forward(&h)?)
    }
}

/// The patch embedding with the class and position tokens: images to the residual stream.
#[derive(Debug)]
pub struct Embedding {
    patch_embed: nn::Conv2D,
    cls_token: Tensor,
    pos_embed: Tensor,
    region: Rc<dyn Region>,
}

impl Embedding {
    fn forward(&self, images: &Tensor) -> anyhow::Result<Tensor> {
        let b = images.size()[0];
        let x = self.patch_embed.forward(images).f_flatten(2, -1)?.f_transpose(1, 2)?;
        let cls = self.cls_token.f_expand([b, -1, -1], false)?.f_to_kind(x.kind())?;
        self.region.enter(Tensor::f_cat(&[cls, x], 1)?.f_add(&self.pos_embed)?)
    }
}

/// The final norm and the classifier on the class token: the residual stream to logits.
#[derive(Debug)]
pub struct Head {
    region: Rc<dyn Region>,
    norm: nn::LayerNorm,
    head: nn::Linear,
}

impl Head {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        let x = self.region.leave(x.shallow_clone())?;
        Ok(Module::forward(&self.head, &Module::forward(&self.norm, &x).f_select(1, 0)?))
    }
}

/// One of the model's parts in the order they run: the embedding, each block, the head. A
/// pipeline cuts the model between parts.
#[derive(Debug)]
pub enum Part {
    /// Images to the residual stream (`patch_embed`, `cls_token`, `pos_embed`).
    Embedding(Embedding),
    /// Block `i` (`blocks.{i}`).
    Block(i64, Block),
    /// The residual stream to logits (`norm`, `head`).
    Head(Head),
}

impl Part {
    /// The part applied to its input (images for the embedding, the residual stream else).
    pub fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        match self {
            Part::Embedding(e) => e.forward(x),
            Part::Block(_, b) => b.forward(x),
            Part::Head(h) => h.forward(x),
        }
    }

    /// Whether parameter `name` (timm's name) belongs to this part.
    pub fn owns(&self, name: &str) -> bool {
        let first = name.split('.').next().unwrap_or(name);
        match self {
            Part::Embedding(_) => matches!(first, "patch_embed" | "cls_token" | "pos_embed"),
            Part::Block(i, _) => {
                name.strip_prefix("blocks.").and_then(|r| r.split_once('.')).map(|(n, _)| n)
                    == Some(i.to_string().as_str())
            }
            Part::Head(_) => matches!(first, "norm" | "head"),
        }
    }

    /// The part's name, for printing a split.
    pub fn name(&self) -> String {
        match self {
            Part::Embedding(_) => "embedding".to_string(),
            Part::Block(i, _) => format!("blocks.{i}"),
            Part::Head(_) => "head".to_string(),
        }
    }
}

/// A Vision Transformer classifier.
#[derive(Debug)]
pub struct Vit {
    cfg: VitConfig,
    embedding: Embedding,
    blocks: Vec<Block>,
    head: Head,
}

impl Vit {
    /// Creates the parameters under `p` (validate the config first).
    pub fn new(p: &nn::Path, cfg: VitConfig) -> Vit {
        Self::build(p, cfg, &Serial).expect("serial layers are infallible")
    }

    /// Creates the parameters under `p` with the blocks' linear layers from `layers` (the
    /// config validated, and its heads and MLP width divisible by `layers.parts()`).
    pub fn build(p: &nn::Path, cfg: VitConfig, layers: &dyn Layers) -> anyhow::Result<Vit> {
        let conv = nn::ConvConfig { stride: cfg.patch_size, ..Default::default() };
        let tokens = cfg.num_patches() + 1;
        let region: Rc<dyn Region> = layers.region().into();
        // Created in this order (libtorch's generator draws each in turn): the seed's weights.
        let embedding = Embedding {
            patch_embed: nn::conv2d(p / "patch_embed" / "proj", cfg.in_channels, cfg.width, cfg.patch_size, conv),
            cls_token: p.var("cls_token", &[1, 1, cfg.width], nn::Init::Randn { mean: 0.0, stdev: 1e-6 }),
            pos_embed: p.var("pos_embed", &[1, tokens, cfg.width], nn::Init::Randn { mean: 0.0, stdev: 0.02 }),
            region: region.clone(),
        };
        let blocks =
            (0..cfg.depth).map(|i| Block::new(p / "blocks" / i, &cfg, layers)).collect::<anyhow::Result<_>>()?;
        let head = Head {
            region,
            norm: layer_norm(p / "norm", cfg.width),
            head: linear(p / "head", cfg.width, cfg.num_classes),
        };
        Ok(Vit { cfg, embedding, blocks, head })
    }

    /// The architecture.
    pub fn config(&self) -> &VitConfig {
        &self.cfg
    }

    /// Logits `[batch, classes]` for images `[batch, channels, size, size]`.
    pub fn forward(&self, images: &Tensor) -> anyhow::Result<Tensor> {
        let mut x = self.embedding.forward(images)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        self.head.forward(&x)
    }

    /// The model's parts in the order they run (running them in turn is [`Vit::forward`]).
    pub fn into_parts(self) -> Vec<Part> {
        let blocks = self.blocks.into_iter().zip(0..).map(|(b, i)| Part::Block(i, b));
        std::iter::once(Part::Embedding(self.embedding)).chain(blocks).chain([Part::Head(self.head)]).collect()
    }
}

/// Top-k accuracy counts: how many of `logits`' rows have `labels` among their k best.
pub fn correct_top_k(logits: &Tensor, labels: &Tensor, k: i64) -> i64 {
    let k = k.min(logits.size()[1]);
    let (_, top) = logits.topk(k, 1, true, true);
    top.eq_tensor(&labels.unsqueeze(1)).any_dim(1, false).sum(Kind::Int64).int64_value(&[])
}
