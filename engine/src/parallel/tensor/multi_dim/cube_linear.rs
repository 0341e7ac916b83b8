//! The linear layer and classifier head of 3D tensor parallelism. For an input in orientation
//! `o` with batch axis `A` and hidden axis `B` ([`Orientation`]), rank `(i, a, b)` holds block
//! `(a, b * q + i)` of the PyTorch-layout weight `[out, in]` cut into `q x q^2` blocks: output
//! block `a`, piece `i` of input block `b`. The product in three collectives:
//!
//! 1. all-gather the input along the batch over the `A` group: batch block `i` (of `q`), hidden
//!    block `b`;
//! 2. all-gather the weight over the `I` group: `W[out block a, in block b]`;
//! 3. multiply, and reduce-scatter the partial products along the batch over the `B` group,
//!    which sums over the input blocks `b` and leaves batch block `i * q + b`, output block `a`:
//!    the flipped orientation.
//!
//! Backward runs the adjoints (all-gather and reduce-scatter trade places): the output gradient
//! is all-gathered over `B`, the input gradient reduce-scattered over `A` and the weight
//! gradient over `I`; only the local blocks are kept for it (`cube_matmul`).
use tch::{nn, Tensor};

use super::cube::{Axis, Cube, Orientation};
use super::cube_matmul::cube_matmul;
use super::{comm, full_shape, LinearConfig};
use crate::error::ensure;
use crate::parallel::tensor::init;
use crate::parallel::tensor::{vocab_parallel_cross_entropy, TensorParallel};
use crate::Result;

/// A linear layer on the 3D layout, from `orientation` to its flip.
#[derive(Debug)]
pub struct CubeLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    in_features: i64,
    out_features: i64,
    orientation: Orientation,
    cube: Cube,
}

impl CubeLinear {
    /// A layer of `in_features -> out_features` (full sizes) taking inputs in `orientation`,
    /// holding this rank's blocks, initialised as the one-process layer at `p` would be.
    pub fn new(
        p: &nn::Path,
        in_features: i64,
        out_features: i64,
        orientation: Orientation,
        cfg: LinearConfig,
        cube: &Cube,
    ) -> Result<Self> {
        let name = p.path("weight");
        let q = cube.q();
        cube.check_split(in_features, q * q, &format!("3D linear {name}: in_features"))?;
        cube.check_split(out_features, q, &format!("3D linear {name}: out_features"))?;
        let (a, b, i) = Self::coords(cube, orientation);
        let w_init = cfg.weight_init(in_features);
        let weight = init::block(w_init, cfg.seed, &name, &[out_features, in_features], &[q, q * q], &[a, b * q + i])?;
        let bias = match cfg.bias {
            true => {
                let b_init = cfg.bias_init(in_features);
                Some(init::shard(b_init, cfg.seed, &p.path("bias"), &[out_features], 0, a, q)?)
            }
            false => None,
        };
        Self::register(p, &weight, bias.as_ref(), in_features, out_features, orientation, cube)
    }

    /// A layer holding this rank's blocks of the full `weight` `[out, in]` and `bias` `[out]`.
    pub fn from_full(
        p: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        orientation: Orientation,
        cube: &Cube,
    ) -> Result<Self> {
        let name = p.path("weight");
        let (out_features, in_features) = full_shape(weight, bias, &name)?;
        let q = cube.q();
        let piece = cube.check_split(in_features, q * q, &format!("3D linear {name}: in_features"))?;
        let out_q = cube.check_split(out_features, q, &format!("3D linear {name}: out_features"))?;
        let (a, b, i) = Self::coords(cube, orientation);
        let w = weight.f_narrow(0, a * out_q, out_q)?.f_narrow(1, (b * q + i) * piece, piece)?;
        let w = w.f_contiguous()?.detach().copy();
        let bias = bias.map(|t| t.f_narrow(0, a * out_q, out_q).map(|t| t.detach().copy())).transpose()?;
        Self::register(p, &w, bias.as_ref(), in_features, out_features, orientation, cube)
    }

    /// `(a, b, i)`: this rank's batch-axis, hidden-axis and `I` coordinates for `orientation`.
    fn coords(cube: &Cube, orientation: Orientation) -> (i64, i64, i64) {
        (cube.coord(orientation.batch_axis()), cube.coord(orientation.hidden_axis()), cube.coord(Axis::I))
    }

    fn register(
        p: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        in_features: i64,
        out_features: i64,
        orientation: Orientation,
        cube: &Cube,
    ) -> Result<Self> {
        let weight = p.f_var_copy("weight", weight)?;
        let bias = bias.map(|b| p.f_var_copy("bias", b)).transpose()?;
        Ok(CubeLinear { weight, bias, in_features, out_features, orientation, cube: cube.clone() })
    }

    /// `x`: this rank's block `[batch/q^2, .., in/q]` in the layer's input orientation; the
    /// output is the block `[batch/q^2, .., out/q]` of `x W^T + b` in the flipped orientation.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let q = self.cube.q();
        let last = *x.size().last().unwrap_or(&0);
        ensure!(
            x.dim() >= 2 && last == self.in_features / q,
            "3D linear: input block has shape {:?}, expected [batch block, .., {}] (in_features {} over q = {q})",
            x.size(),
            self.in_features / q,
            self.in_features
        );
        let y = cube_matmul(x, &self.weight, &self.cube, self.orientation)?;
        let hidden = self.orientation.hidden_axis();
        match &self.bias {
            Some(b) => {
                // Bias block `a` is added by every rank whose output is in block `a`.
                let b = comm::copy_to(&comm::copy_to(b, self.cube.group(Axis::I))?, self.cube.group(hidden))?;
                Ok(y.f_add(&b)?)
            }
            None => Ok(y),
        }
    }

    /// This rank's block of the weight, `[out/q, in/q^2]` (a trainable leaf).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// This rank's block of the bias, `[out/q]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The orientation the layer takes its input in (its output is in the flipped one).
    pub fn orientation(&self) -> Orientation {
        self.orientation
    }

    /// The full weight `[out, in]` on every rank (no autograd).
    pub fn full_weight(&self) -> Result<Tensor> {
        let (batch, hidden) = (self.orientation.batch_axis(), self.orientation.hidden_axis());
        let w = comm::gather_full(&self.weight, 1, self.cube.group(Axis::I))?;
        let w = comm::gather_full(&w, 1, self.cube.group(hidden))?;
        comm::gather_full(&w, 0, self.cube.group(batch))
    }

    /// The full bias `[out]` on every rank.
    pub fn full_bias(&self) -> Result<Option<Tensor>> {
        let batch = self.orientation.batch_axis();
        self.bias.as_ref().map(|b| comm::gather_full(b, 0, self.cube.group(batch))).transpose()
    }

    /// `(in_features, out_features)`, full sizes.
    pub fn features(&self) -> (i64, i64) {
        (self.in_features, self.out_features)
    }
}

/// The classifier head on the 3D layout: a [`CubeLinear`] to the classes, whose logits stay
/// split over the classes (over the group of the output's hidden axis), and a cross-entropy
/// that never gathers them.
#[derive(Debug)]
pub struct CubeClassifier {
    linear: CubeLinear,
}

impl CubeClassifier {
    /// A head of `hidden -> classes` (full sizes) at `p`, taking inputs in `orientation`.
    pub fn new(
        p: &nn::Path,
        hidden: i64,
        classes: i64,
        orientation: Orientation,
        cfg: LinearConfig,
        cube: &Cube,
    ) -> Result<Self> {
        Ok(CubeClassifier { linear: CubeLinear::new(p, hidden, classes, orientation, cfg, cube)? })
    }

    /// This rank's block of the logits, in the flipped orientation.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.forward(x)
    }

    /// Per-token cross-entropy of this rank's logits block against `targets`, the class ids
    /// of the logits' batch block (`cube.split_batch(targets, orientation.flip())`).
    pub fn cross_entropy(&self, logits: &Tensor, targets: &Tensor, label_smoothing: f64) -> Result<Tensor> {
        let axis = self.linear.orientation.flip().hidden_axis();
        let tp = TensorParallel::new(self.linear.cube.group(axis).clone());
        vocab_parallel_cross_entropy(logits, targets, label_smoothing, &tp)
    }

    /// The linear layer.
    pub fn linear(&self) -> &CubeLinear {
        &self.linear
    }
}
