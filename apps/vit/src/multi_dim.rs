//! `--tp-mode 2d|2.5d|3d`: the ViT on the engine's multi-dimensional layers
//! ([`engine::parallel::tensor::multi_dim`]). Every layer is split, the stem and the head too:
//! the patch embedding is a linear layer on the flattened patches (timm's strided convolution
//! in the same order), the class and position tokens and every norm hold their block of the
//! width, the classifier its block of the classes. The activations are split along the batch
//! and the width (2D/2.5D: batch block per grid row and depth layer, width block per column;
//! 3D: see [`Orientation`]), so each rank attends over its examples with its share of the
//! heads: `qkv`'s rows are regrouped by head as in 1D, and `q` must divide the heads.
//!
//! The logits are gathered whole (the head is small), so the loss is the one process's on
//! every rank, and the layers' own collectives make every rank's gradient that of its block
//! of the one-process parameter. A batch must divide into the layout's batch blocks:
//! evaluation pads its chunks with blank images and drops their logits.
//!
//! In 3D the residual stream stays in [`Orientation::Normal`]: `qkv` and `fc1` take it and
//! give the swapped orientation, `proj` and `fc2` flip it back; the patch embedding therefore
//! takes its patches swapped, and the head's logits come out swapped.
use anyhow::bail;
use engine::dist::ProcessGroup;
use engine::parallel::tensor::multi_dim::{
    Axis as CubeAxis, Cube, CubeLayerNorm, CubeLinear, Grid, GridLayerNorm, GridLinear, LinearConfig, Orientation,
};
use engine::parallel::tensor::{Init, TpMode};
use engine::parallel::Axis;
use tch::nn;
use tch::Tensor;

use crate::model::{Head, Layer, Layers, Stem, VitConfig};
use crate::placement::Placement;

/// The grid (2D, 2.5D) or the cube (3D) over the tensor-parallel group.
#[derive(Clone, Debug)]
enum Shape {
    /// 2D (`depth` 1) or 2.5D.
    Grid(Grid),
    /// 3D.
    Cube(Cube),
}

/// The ViT's layers on a grid or cube.
#[derive(Clone, Debug)]
pub struct MultiDim {
    shape: Shape,
}

/// LayerNorm's eps in timm's ViT.
const EPS: f64 = 1e-6;

/// Weights start at zero: [`crate::tensor_parallel::Sharding::build`] copies the serial
/// model's slices over them.
const ZEROS: LinearConfig =
    LinearConfig { bias: true, seed: 0, weight_init: Some(Init::Zeros), bias_init: Some(Init::Zeros) };

impl MultiDim {
    /// `mode` over `tp` (`depth` layers for 2.5D), whose sizes [`crate::layout::Layout`] has
    /// checked against the model.
    pub fn new(tp: &ProcessGroup, mode: TpMode, depth: i64) -> anyhow::Result<MultiDim> {
        let shape = match mode {
            TpMode::TwoD => Shape::Grid(Grid::two_d(tp)?),
            TpMode::TwoHalfD => Shape::Grid(Grid::two_p5_d(tp, depth)?),
            TpMode::ThreeD => Shape::Cube(Cube::new(tp)?),
            TpMode::OneD => bail!("--tp-mode 1d is Megatron's layout, not a multi-dimensional one"),
        };
        Ok(MultiDim { shape })
    }

    /// The side `q` of the grid or cube.
    fn q(&self) -> i64 {
        match &self.shape {
            Shape::Grid(g) => g.q(),
            Shape::Cube(c) => c.q(),
        }
    }

    /// Into how many blocks the batch is cut (each rank's examples are one block).
    pub fn batch_blocks(&self) -> i64 {
        match &self.shape {
            Shape::Grid(g) => g.batch_block().0,
            Shape::Cube(c) => c.batch_block(Orientation::Normal).0,
        }
    }

    /// A linear layer taking `orientation` (3D; the grid has one layout).
    fn linear(
        &self,
        p: &nn::Path,
        inputs: i64,
        outputs: i64,
        orientation: Orientation,
    ) -> anyhow::Result<Box<dyn Layer>> {
        Ok(match &self.shape {
            Shape::Grid(g) => Box::new(GridLinear::new(p, inputs, outputs, ZEROS, g)?),
            Shape::Cube(c) => Box::new(CubeLinear::new(p, inputs, outputs, orientation, ZEROS, c)?),
        })
    }

    /// LayerNorm on the residual stream.
    fn layer_norm(&self, p: &nn::Path, width: i64) -> anyhow::Result<Box<dyn Layer>> {
        Ok(match &self.shape {
            Shape::Grid(g) => Box::new(GridLayerNorm::new(p, width, EPS, g)?),
            Shape::Cube(c) => Box::new(CubeLayerNorm::new(p, width, EPS, Orientation::Normal, c)?),
        })
    }

    /// The groups over which a block of the stream's width is used on different examples:
    /// the parameters holding it (tokens, norms, biases) sum their gradients over them.
    fn width_sharers(&self) -> Vec<Axis> {
        match &self.shape {
            Shape::Grid(g) => vec![Axis::new(g.col_group().clone()), Axis::new(g.depth_group().clone())],
            Shape::Cube(c) => vec![
                Axis::new(c.group(CubeAxis::I).clone()),
                Axis::new(c.group(Orientation::Normal.batch_axis()).clone()),
            ],
        }
    }

    /// This rank's block of a whole `[batch, .., width]` tensor taken in `orientation`.
    fn split_input(&self, x: &Tensor, orientation: Orientation) -> anyhow::Result<Tensor> {
        Ok(match &self.shape {
            Shape::Grid(g) => g.split_input(x)?,
            Shape::Cube(c) => c.split_input(x, orientation)?,
        })
    }

    /// The whole tensor from every rank's block in `orientation`.
    fn gather_output(&self, y: &Tensor, orientation: Orientation) -> anyhow::Result<Tensor> {
        Ok(match &self.shape {
            Shape::Grid(g) => g.gather_output(y)?,
            Shape::Cube(c) => c.gather_output(y, orientation)?,
        })
    }

    /// Where parameter `name`'s shard lies in the full tensor (every parameter is split).
    pub(crate) fn placement(&self, name: &str) -> Option<Placement> {
        let layer = name.strip_prefix("blocks.").and_then(|r| r.split_once('.')).map_or(name, |(_, l)| l);
        let (module, leaf) = layer.rsplit_once('.').unwrap_or(("", layer));
        // The orientation a linear layer takes (3D).
        let linear = match module {
            "patch_embed.proj" | "attn.proj" | "mlp.fc2" => Some(Orientation::Swapped),
            "attn.qkv" | "mlp.fc1" | "head" => Some(Orientation::Normal),
            _ => None,
        };
        let parameter = match module {
            "" => matches!(leaf, "cls_token" | "pos_embed"),
            "norm1" | "norm2" | "norm" => true,
            _ => linear.is_some(),
        };
        if !parameter || !(module.is_empty() || matches!(leaf, "weight" | "bias")) {
            // Not a parameter (an optimizer's counter, such as `step`).
            return None;
        }
        let heads = (module == "attn.qkv").then(|| self.q());
        let flatten = name == "patch_embed.proj.weight";
        let (cuts, copies) = match (&self.shape, linear, leaf) {
            // Grid: weight block (col, row) of [out, in], bias and width blocks `col`.
            (Shape::Grid(g), Some(_), "weight") => {
                (vec![(0, g.row_group().clone()), (1, g.col_group().clone())], g.depth())
            }
            (Shape::Grid(g), _, _) => (vec![(-1, g.row_group().clone())], g.q() * g.depth()),
            // Cube, input orientation `o` with batch axis A, hidden axis B: weight block
            // (a, b q + i) of [out, in] cut q x q^2; bias block a; width blocks by the stream's
            // hidden axis.
            (Shape::Cube(c), Some(o), "weight") => (
                vec![
                    (0, c.group(o.batch_axis()).clone()),
                    (1, c.group(o.hidden_axis()).clone()),
                    (1, c.group(CubeAxis::I).clone()),
                ],
                1,
            ),
            (Shape::Cube(c), Some(o), _) => (vec![(0, c.group(o.batch_axis()).clone())], c.q() * c.q()),
            (Shape::Cube(c), None, _) => {
                (vec![(-1, c.group(Orientation::Normal.hidden_axis()).clone())], c.q() * c.q())
            }
        };
        Some(Placement { heads, flatten, cuts, copies: copies as usize })
    }
}

impl Layers for MultiDim {
    fn parts(&self) -> i64 {
        self.q()
    }

    fn column(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        self.linear(&p, inputs, outputs, Orientation::Normal)
    }

    fn row(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        self.linear(&p, inputs, outputs, Orientation::Swapped)
    }

    fn norm(&self, p: nn::Path, width: i64) -> anyhow::Result<Box<dyn Layer>> {
        self.layer_norm(&p, width)
    }

    fn stem(&self, p: &nn::Path, cfg: &VitConfig) -> anyhow::Result<Box<dyn Stem>> {
        let q = self.q();
        let patch = cfg.in_channels * cfg.patch_size * cfg.patch_size;
        let proj = self.linear(&(p / "patch_embed" / "proj"), patch, cfg.width, Orientation::Swapped)?;
        let block = cfg.width / q;
        let cls_token = p.var("cls_token", &[1, 1, block], nn::Init::Const(0.0));
        let pos_embed = p.var("pos_embed", &[1, cfg.num_patches() + 1, block], nn::Init::Const(0.0));
        Ok(Box::new(MultiStem { layout: self.clone(), proj, cls_token, pos_embed, patch_size: cfg.patch_size }))
    }

    fn head(&self, p: &nn::Path, cfg: &VitConfig) -> anyhow::Result<Box<dyn Head>> {
        let norm = self.layer_norm(&(p / "norm"), cfg.width)?;
        let head = self.linear(&(p / "head"), cfg.width, cfg.num_classes, Orientation::Normal)?;
        Ok(Box::new(MultiHead { layout: self.clone(), norm, head }))
    }
}

/// The stem on the grid or cube: patches flattened in the convolution's order, this rank's
/// block of them through the split patch embedding, its width block of the class and position
/// tokens.
#[derive(Debug)]
struct MultiStem {
    layout: MultiDim,
    proj: Box<dyn Layer>,
    cls_token: Tensor,
    pos_embed: Tensor,
    patch_size: i64,
}

impl Stem for MultiStem {
    fn forward(&self, images: &Tensor) -> anyhow::Result<Tensor> {
        let b = images.size4()?.0;
        // Training micro-batches divide into the batch blocks (checked up front), and
        // evaluation pads its chunks to whole blocks (`crate::train::evaluate`): the stem and
        // the head may run on different pipeline stages, so neither pads for the other.
        let blocks = self.layout.batch_blocks();
        if b % blocks != 0 {
            bail!("a batch of {b} images does not split into the layout's {blocks} batch blocks");
        }
        // A patch's pixels in the order of the convolution weight's [c, p, p].
        let patches = crate::model::patches(images, self.patch_size)?;
        let x = self.proj.forward(&self.layout.split_input(&patches, Orientation::Swapped)?)?;
        let mut shared = (self.cls_token.shallow_clone(), self.pos_embed.shallow_clone());
        for axis in self.layout.width_sharers() {
            shared = (axis.copy_to(&shared.0)?, axis.copy_to(&shared.1)?);
        }
        let cls = shared.0.f_expand([x.size()[0], -1, -1], false)?.f_to_kind(x.kind())?;
        Ok(Tensor::f_cat(&[cls, x], 1)?.f_add(&shared.1)?)
    }
}

/// The head on the grid or cube: the split norm and classifier on the class token, the
/// logits gathered whole.
#[derive(Debug)]
struct MultiHead {
    layout: MultiDim,
    norm: Box<dyn Layer>,
    head: Box<dyn Layer>,
}

impl Head for MultiHead {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        let logits = self.head.forward(&self.norm.forward(x)?.f_select(1, 0)?)?;
        self.layout.gather_output(&logits, Orientation::Swapped)
    }
}

impl Layer for GridLinear {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(GridLinear::forward(self, x)?)
    }
}

impl Layer for CubeLinear {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(CubeLinear::forward(self, x)?)
    }
}

impl Layer for GridLayerNorm {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(GridLayerNorm::forward(self, x)?)
    }
}

impl Layer for CubeLayerNorm {
    fn forward(&self, x: &Tensor) -> anyhow::Result<Tensor> {
        Ok(CubeLayerNorm::forward(self, x)?)
    }
}
