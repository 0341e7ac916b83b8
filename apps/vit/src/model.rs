//! Vision Transformer (Dosovitskiy et al.) with timm's `VisionTransformer` parameter names,
//! so timm's `vit_*` safetensors weights load by name: `patch_embed.proj`, `cls_token`,
//! `pos_embed`, `blocks.{i}.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}`, `norm`, `head`.
//! Class-token pooling, pre-norm blocks, LayerNorm eps 1e-6, exact GELU, as timm's defaults.
//!
//! The model is written once, serially. Its parts come from a [`Layers`] factory: the four
//! linear layers and two norms per block, the stem (patch embedding, class and position
//! tokens), the head (final norm and classifier) and the attention of the blocks' queries,
//! keys and values. [`Serial`] makes timm's modules (the blocks' LayerNorms libtorch's or
//! the fused kernel, as `--kernels` says); `crate::tensor_parallel` makes
//! Megatron's column/row-parallel layers or the 2D/2.5D/3D layers (`crate::multi_dim`), and
//! `crate::sequence_parallel` ring or all-to-all attention, and the same code then computes
//! this rank's share of the heads, the hidden features, the batch or the tokens.
//! [`Vit::into_parts`] gives the model as its parts in running order (the stem, each block,
//! the head; see [`Part`]): the units `crate::pipeline_parallel` cuts into stages.
use std::rc::Rc;
use std::sync::{Arc, Mutex};

use anyhow::Context;
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

/// An error when `data`'s classes are not the `trained` ones in the same order: the labels
/// would then mean other classes, and accuracy or further training would be silently wrong.
pub fn check_classes(trained: &[String], data: &[String], trained_where: &str, data_where: &str) -> anyhow::Result<()> {
    if trained == data {
        return Ok(());
    }
    let first = trained.iter().zip(data).position(|(a, b)| a != b).unwrap_or(trained.len().min(data.len()));
    let name = |names: &[String]| names.get(first).map_or("none".to_string(), |n| format!("{n:?}"));
    anyhow::bail!(
        "{trained_where} was trained on {} classes, {data_where} has {}; label {first} is {} there and {} here",
        trained.len(),
        data.len(),
        name(trained),
        name(data)
    )
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
        let counts = [("channels", c.in_channels), ("classes", c.num_classes), ("depth", c.depth)];
        if let Some((what, n)) = counts.into_iter().find(|(_, n)| *n <= 0) {
            return Err(format!("{what} must be positive, got {n}"));
        }
        if c.mlp_ratio <= 0.0 {
            return Err(format!("mlp ratio must be positive, got {}", c.mlp_ratio));
        }
        if !c.mlp_ratio.is_finite() || c.mlp_hidden() < 1 {
            return Err(format!(
                "mlp ratio {} gives width {} an MLP of {} features",
                c.mlp_ratio,
                c.width,
                c.mlp_hidden()
            ));
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
/// serial or holding a block of its features. `Send`: a checkpointed block may be recomputed
/// on autograd's thread.
pub trait Layer: std::fmt::Debug + Send {
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

impl Layer for kernels::LayerNorm {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(kernels::LayerNorm::forward(self, x)?)
    }
}

/// Makes the model's parts: the blocks' linear layers and norms (`inputs -> outputs` are the whole
/// layer's features), the stem, the head and attention; the defaults are timm's serial modules.
pub trait Layers {
    /// Into which parts the heads and the MLP's hidden features are split (1: whole).
    fn parts(&self) -> i64;
    /// A layer that computes its share of the output features (`attn.qkv`, `mlp.fc1`).
    fn column(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>>;
    /// A layer that takes its share of the input features and yields whole outputs
    /// (`attn.proj`, `mlp.fc2`).
    fn row(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>>;
    /// The MLP's first layer and its GELU (`mlp.fc1`): the column layer, then GELU.
    fn column_gelu(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        Ok(Box::new(Gelu(self.column(p, inputs, outputs)?)))
    }
    /// A block's LayerNorm (`norm1`, `norm2`).
    fn norm(&self, p: nn::Path, width: i64) -> anyhow::Result<Box<dyn Layer>> {
        Ok(Box::new(layer_norm(p, width)))
    }
    /// What the residual stream goes through entering and leaving the blocks.
    fn region(&self) -> Box<dyn Region> {
        Box::new(Whole)
    }
    /// The patch embedding and the class and position tokens (`patch_embed.proj`,
    /// `cls_token`, `pos_embed` under `p`).
    fn stem(&self, p: &nn::Path, cfg: &VitConfig) -> anyhow::Result<Box<dyn Stem>> {
        Ok(Box::new(SerialStem::new(p, cfg)))
    }
    /// The final norm and the classifier (`norm`, `head` under `p`).
    fn head(&self, p: &nn::Path, cfg: &VitConfig) -> anyhow::Result<Box<dyn Head>> {
        Ok(Box::new(SerialHead::new(p, cfg)))
    }
    /// How a block attends over its queries, keys and values.
    fn attention(&self) -> anyhow::Result<Box<dyn Attend>> {
        Ok(Box::new(Sdpa))
    }
}

/// Images `[batch, channels, size, size]` to the residual stream entering the blocks.
pub trait Stem: std::fmt::Debug {
    /// The stream `[batch, tokens, width]` (or this rank's block of it).
    fn forward(&self, images: &Tensor) -> anyhow::Result<Tensor>;
}

/// The residual stream leaving the blocks to logits.
pub trait Head: std::fmt::Debug {
    /// Whole logits `[batch, classes]` on every rank.
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor>;
}

/// Attention over queries, keys and values `[batch, heads, tokens, head_dim]` (this rank's;
/// `Send` as [`Layer`]).
pub trait Attend: std::fmt::Debug + Send {
    /// The attention output in the same layout.
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> anyhow::Result<Tensor>;
}

/// PyTorch's fused attention over every token the rank holds.
#[derive(Debug)]
struct Sdpa;

impl Attend for Sdpa {
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> anyhow::Result<Tensor> {
        Ok(Tensor::f_scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, false, None, false)?)
    }
}

/// timm's stem: a strided convolution, the class token prepended, position embeddings added.
/// The convolution (timm's `patch_embed.proj`, its weight `[width, channels, patch, patch]`)
/// runs as what it is, a linear layer over the flattened non-overlapping patches: one matmul
/// with the bias in its epilogue, where cuDNN's convolution of NCHW images converted the images
/// (and in backward the gradient's input again) to NHWC on every call, added the bias in a
/// kernel of its own and ran a slower implicit GEMM.
#[derive(Debug)]
struct SerialStem {
    patch_embed: nn::Conv2D,
    cls_token: Tensor,
    pos_embed: Tensor,
    patch_size: i64,
}

impl SerialStem {
    fn new(p: &nn::Path, cfg: &VitConfig) -> SerialStem {
        let conv = nn::ConvConfig { stride: cfg.patch_size, ..Default::default() };
        let tokens = cfg.num_patches() + 1;
        // Created in this order (libtorch's generator draws each in turn): the seed's weights.
        let patch_embed = nn::conv2d(p / "patch_embed" / "proj", cfg.in_channels, cfg.width, cfg.patch_size, conv);
        let cls_token = p.var("cls_token", &[1, 1, cfg.width], nn::Init::Randn { mean: 0.0, stdev: 1e-6 });
        let pos_embed = p.var("pos_embed", &[1, tokens, cfg.width], nn::Init::Randn { mean: 0.0, stdev: 0.02 });
        SerialStem { patch_embed, cls_token, pos_embed, patch_size: cfg.patch_size }
    }
}

/// `images` `[b, c, h, w]` as their non-overlapping `p x p` patches, row by row, `[b, patches,
/// c * p * p]`, each patch's pixels in the order of a convolution weight's `[c, p, p]` (rows
/// and columns past the last whole patch dropped, as the strided convolution drops them).
pub(crate) fn patches(images: &Tensor, p: i64) -> anyhow::Result<Tensor> {
    let (b, c, h, w) = images.size4()?;
    let (gh, gw) = (h / p, w / p);
    let images = if h % p != 0 || w % p != 0 {
        images.f_narrow(2, 0, gh * p)?.f_narrow(3, 0, gw * p)?
    } else {
        images.shallow_clone()
    };
    Ok(images.f_reshape([b, c, gh, p, gw, p])?.f_permute([0, 2, 4, 1, 3, 5])?.f_reshape([b, gh * gw, c * p * p])?)
}

impl Stem for SerialStem {
    fn forward(&self, images: &Tensor) -> anyhow::Result<Tensor> {
        let b = images.size()[0];
        let ws = &self.patch_embed.ws;
        let weight = ws.f_reshape([ws.size()[0], -1])?;
        let x = patches(images, self.patch_size)?.f_linear(&weight, self.patch_embed.bs.as_ref())?;
        let cls = self.cls_token.f_expand([b, -1, -1], false)?.f_to_kind(x.kind())?;
        Ok(Tensor::f_cat(&[cls, x], 1)?.f_add(&self.pos_embed)?)
    }
}

/// timm's head: the final norm, then the classifier on the class token.
#[derive(Debug)]
struct SerialHead {
    norm: nn::LayerNorm,
    head: nn::Linear,
}

impl SerialHead {
    fn new(p: &nn::Path, cfg: &VitConfig) -> SerialHead {
        SerialHead { norm: layer_norm(p / "norm", cfg.width), head: linear(p / "head", cfg.width, cfg.num_classes) }
    }
}

impl Head for SerialHead {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        // timm normalises every token and then keeps the class token's; LayerNorm works on
        // each token alone, so normalising the class token alone gives the same logits without
        // a forward and backward over the other tokens, whose outputs nothing reads.
        Ok(Module::forward(&self.head, &Module::forward(&self.norm, &x.f_select(1, 0)?)))
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

/// A layer followed by GELU (the exact, erf form: timm's `nn.GELU`).
#[derive(Debug)]
struct Gelu(Box<dyn Layer>);

impl Layer for Gelu {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(self.0.forward(x)?.f_gelu("none")?)
    }
}

/// `nn.Linear` then GELU with the bias added by the fused `bias_gelu` kernel after a bias-free
/// matmul (the same parameters, named as timm's `mlp.fc1`).
#[derive(Debug)]
struct FusedLinearGelu(nn::Linear);

impl Layer for FusedLinearGelu {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        let bias = self.0.bs.as_ref().expect("timm's fc1 has a bias");
        Ok(kernels::bias_gelu(&x.f_matmul(&self.0.ws.tr())?, bias, kernels::Backend::Fused)?)
    }
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

/// The serial model's layers: timm's `nn.Linear`s, the blocks' LayerNorms and the MLP's
/// bias + GELU run by `kernels` (the same parameters either way), and the default stem, head and
/// attention.
pub struct Serial {
    /// Which implementation runs the blocks' LayerNorms and the MLP's bias + GELU.
    pub kernels: kernels::Backend,
}

impl Layers for Serial {
    fn norm(&self, p: nn::Path, width: i64) -> anyhow::Result<Box<dyn Layer>> {
        Ok(match self.kernels {
            kernels::Backend::Torch => Box::new(layer_norm(p, width)),
            fused => Box::new(kernels::LayerNorm::new(p, width, LAYER_NORM_EPS, fused)),
        })
    }

    fn column_gelu(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        Ok(match self.kernels {
            kernels::Backend::Fused => Box::new(FusedLinearGelu(linear(p, inputs, outputs))),
            kernels::Backend::Torch => Box::new(Gelu(self.column(p, inputs, outputs)?)),
        })
    }

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

/// timm's LayerNorm eps.
const LAYER_NORM_EPS: f64 = 1e-6;

pub(crate) fn layer_norm(p: nn::Path, width: i64) -> nn::LayerNorm {
    nn::layer_norm(p, vec![width], nn::LayerNormConfig { eps: LAYER_NORM_EPS, ..Default::default() })
}

#[derive(Debug)]
struct Attention {
    qkv: Box<dyn Layer>,
    proj: Box<dyn Layer>,
    attend: Box<dyn Attend>,
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
            attend: layers.attention()?,
            heads: cfg.heads / layers.parts(),
            head_dim: width / cfg.heads,
        })
    }

    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        let (h, hd) = (self.heads, self.head_dim);
        // The tokens are the projection's (a sequence-parallel `qkv` gathers them all).
        let qkv = self.qkv.forward(x)?;
        let (b, n, _) = qkv.size3()?;
        // [b, n, 3 * h * hd] -> three [b, h, n, hd], timm's layout of the fused projection:
        // the same strided views of the projection's output as timm's `permute(2, 0, 3, 1, 4)`
        // then `unbind(0)`, but unbound on the `3` axis of [b, n, 3, h, hd] before the
        // transposes. Backward then stacks the three gradients on that axis straight into the
        // projection's [b, n, 3 * h * hd] layout (one copy, and the reshape's backward is a
        // view), where picking q, k and v with `select` zero-filled a [3, b, h, n, hd] buffer
        // per view, copied each gradient in, added the three buffers, and copied the sum back
        // into the projection's layout.
        let [q, k, v]: [Tensor; 3] = qkv
            .f_reshape([b, n, 3, h, hd])?
            .f_unbind(2)?
            .into_iter()
            .map(|t| t.f_transpose(1, 2))
            .collect::<Result<Vec<_>, _>>()?
            .try_into()
            .map_err(|_| anyhow::anyhow!("unbinding q, k and v gave other than three tensors"))?;
        let out = self.attend.forward(&q, &k, &v)?;
        self.proj.forward(&out.f_transpose(1, 2)?.f_reshape([b, n, h * hd])?)
    }
}

/// A pre-norm transformer block's layers.
#[derive(Debug)]
struct BlockLayers {
    norm1: Box<dyn Layer>,
    attn: Attention,
    norm2: Box<dyn Layer>,
    fc1: Box<dyn Layer>,
    fc2: Box<dyn Layer>,
}

impl BlockLayers {
    fn new(p: nn::Path, cfg: &VitConfig, layers: &dyn Layers) -> anyhow::Result<BlockLayers> {
        let hidden = cfg.mlp_hidden();
        Ok(BlockLayers {
            norm1: layers.norm(&p / "norm1", cfg.width)?,
            attn: Attention::new(&p / "attn", cfg, layers)?,
            norm2: layers.norm(&p / "norm2", cfg.width)?,
            fc1: layers.column_gelu(&p / "mlp" / "fc1", cfg.width, hidden)?,
            fc2: layers.row(&p / "mlp" / "fc2", hidden, cfg.width)?,
        })
    }

    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        let x = x + self.attn.forward(&self.norm1.forward(x)?)?;
        let h = self.fc1.forward(&self.norm2.forward(&x)?)?;
        Ok(&x + self.fc2.forward(&h)?)
    }
}

/// A pre-norm transformer block, optionally run under activation checkpointing (timm's
/// `set_grad_checkpointing`): its forward keeps only its input, and backward runs it again to
/// get the activations it needs. The layers are shared with that recomputation, which may run
/// on autograd's thread.
#[derive(Debug)]
pub struct Block {
    layers: Arc<Mutex<BlockLayers>>,
    checkpointing: bool,
}

impl Block {
    fn new(p: nn::Path, cfg: &VitConfig, layers: &dyn Layers) -> anyhow::Result<Block> {
        Ok(Block { layers: Arc::new(Mutex::new(BlockLayers::new(p, cfg, layers)?)), checkpointing: false })
    }

    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        // Without a gradient to its input (evaluation) nothing is saved: run it plainly. A
        // tensor-parallel block's recomputation repeats its collectives, in the same order on
        // every rank of the group (each rank's backward reaches the block at the same point).
        if self.checkpointing && x.requires_grad() {
            let layers = self.layers.clone();
            let mut out = engine::autograd::checkpoint(&[x], move |x| {
                let layers = layers.lock().map_err(|_| engine::Error::invalid("a ViT block panicked earlier"))?;
                Ok(vec![layers.forward(&x[0]).map_err(|e| engine::Error::invalid(format!("{e:#}")))?])
            })?;
            return out.pop().context("the checkpointed block gave no output");
        }
        let layers = self.layers.lock().map_err(|_| anyhow::anyhow!("a ViT block panicked earlier"))?;
        layers.forward(x)
    }
}

/// One of the model's parts in the order they run: the stem, each block, the head. A
/// pipeline cuts the model between parts; the region the blocks see is entered after the stem
/// and left before the head, so running the parts in turn is [`Vit::forward`].
#[derive(Debug)]
pub enum Part {
    /// Images to the residual stream as the blocks hold it (`patch_embed`, `cls_token`,
    /// `pos_embed`).
    Stem(Box<dyn Stem>, Rc<dyn Region>),
    /// Block `i` (`blocks.{i}`).
    Block(i64, Block),
    /// The blocks' residual stream to logits (`norm`, `head`).
    Head(Rc<dyn Region>, Box<dyn Head>),
}

impl Part {
    /// The part applied to its input (images for the stem, the residual stream else).
    pub fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        match self {
            Part::Stem(stem, region) => region.enter(stem.forward(x)?),
            Part::Block(_, b) => b.forward(x),
            Part::Head(region, head) => head.forward(&region.leave(x.shallow_clone())?),
        }
    }

    /// Whether parameter `name` (timm's name) belongs to this part.
    pub fn owns(&self, name: &str) -> bool {
        let first = name.split('.').next().unwrap_or(name);
        match self {
            Part::Stem(..) => matches!(first, "patch_embed" | "cls_token" | "pos_embed"),
            Part::Block(i, _) => {
                name.strip_prefix("blocks.").and_then(|r| r.split_once('.')).map(|(n, _)| n)
                    == Some(i.to_string().as_str())
            }
            Part::Head(..) => matches!(first, "norm" | "head"),
        }
    }

    /// The part's name, for printing a split.
    pub fn name(&self) -> String {
        match self {
            Part::Stem(..) => "stem".to_string(),
            Part::Block(i, _) => format!("blocks.{i}"),
            Part::Head(..) => "head".to_string(),
        }
    }
}

/// A Vision Transformer classifier.
#[derive(Debug)]
pub struct Vit {
    cfg: VitConfig,
    stem: Box<dyn Stem>,
    region: Box<dyn Region>,
    blocks: Vec<Block>,
    head: Box<dyn Head>,
}

impl Vit {
    /// Creates the parameters under `p` (validate the config first).
    pub fn new(p: &nn::Path, cfg: VitConfig) -> Vit {
        Self::with_kernels(p, cfg, kernels::Backend::Torch)
    }

    /// [`Vit::new`] with the blocks' LayerNorms run by `kernels` (the fused kernel needs the
    /// parameters on a CUDA device).
    pub fn with_kernels(p: &nn::Path, cfg: VitConfig, kernels: kernels::Backend) -> Vit {
        Self::build(p, cfg, &Serial { kernels }).expect("serial layers are infallible")
    }

    /// Creates the parameters under `p` with its parts from `layers` (the config validated,
    /// and its heads and MLP width divisible by `layers.parts()`).
    pub fn build(p: &nn::Path, cfg: VitConfig, layers: &dyn Layers) -> anyhow::Result<Vit> {
        // Created in timm's order (libtorch's generator draws each in turn): the seed's weights.
        let stem = layers.stem(p, &cfg)?;
        let blocks =
            (0..cfg.depth).map(|i| Block::new(p / "blocks" / i, &cfg, layers)).collect::<anyhow::Result<_>>()?;
        Ok(Vit { stem, region: layers.region(), blocks, head: layers.head(p, &cfg)?, cfg })
    }

    /// The architecture.
    pub fn config(&self) -> &VitConfig {
        &self.cfg
    }

    /// Runs each block under activation checkpointing (recomputed in backward) or not; the
    /// parts of [`Vit::into_parts`] keep the setting.
    pub fn set_gradient_checkpointing(&mut self, on: bool) {
        self.set_checkpointed_blocks(if on { self.blocks.len() } else { 0 });
    }

    /// Runs the first `first` blocks under activation checkpointing and the rest plainly (a
    /// planner's middle ground between memory and recomputation).
    pub fn set_checkpointed_blocks(&mut self, first: usize) {
        for (i, block) in self.blocks.iter_mut().enumerate() {
            block.checkpointing = i < first;
        }
    }

    /// Logits `[batch, classes]` for images `[batch, channels, size, size]`.
    pub fn forward(&self, images: &Tensor) -> anyhow::Result<Tensor> {
        let mut x = self.region.enter(self.stem.forward(images)?)?;
        for block in &self.blocks {
            x = block.forward(&x)?;
        }
        self.head.forward(&self.region.leave(x)?)
    }

    /// The model's parts in the order they run (running them in turn is [`Vit::forward`]).
    pub fn into_parts(self) -> Vec<Part> {
        let region: Rc<dyn Region> = self.region.into();
        let blocks = self.blocks.into_iter().zip(0..).map(|(b, i)| Part::Block(i, b));
        std::iter::once(Part::Stem(self.stem, region.clone()))
            .chain(blocks)
            .chain([Part::Head(region, self.head)])
            .collect()
    }
}

/// Top-k accuracy counts: how many of `logits`' rows have `labels` among their k best.
pub fn correct_top_k(logits: &Tensor, labels: &Tensor, k: i64) -> i64 {
    let k = k.min(logits.size()[1]);
    let (_, top) = logits.topk(k, 1, true, true);
    top.eq_tensor(&labels.unsqueeze(1)).any_dim(1, false).sum(Kind::Int64).int64_value(&[])
}

/// Soft-target cross-entropy: mean over the batch of -sum(target * log_softmax(logits)).
pub fn soft_cross_entropy(logits: &Tensor, targets: &Tensor) -> Tensor {
    -(logits.log_softmax(1, Kind::Float) * targets).sum_dim_intlist(1, false, Kind::Float).mean(Kind::Float)
}
