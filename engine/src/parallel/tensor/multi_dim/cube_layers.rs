//! LayerNorm and the embedding on the 3D layout ([`Cube`]).
//!
//! - [`CubeLayerNorm`]: in orientation `o` the hidden dimension is split over the group of
//!   `o`'s hidden axis, so a token's mean and variance are sums all-reduced over that group;
//!   the weight and bias blocks are used by the ranks of the other two axes on their own batch
//!   blocks, so their gradients are summed over those groups.
//! - [`CubeEmbedding`]: the table `[vocab, dim]` cut into `q^2` vocabulary blocks and `q`
//!   hidden blocks; for output orientation `o` (batch axis `A`, hidden axis `B`) rank
//!   `(i, a, b)` holds vocabulary block `i * q + a` and hidden block `b`, so no two ranks hold
//!   the same entry. Each rank looks up the whole batch's ids in its vocabulary block, and
//!   reduce-scattering along the batch over the `I` group, then the `A` group, sums the
//!   vocabulary blocks and leaves each rank its batch block.
use tch::{nn, Kind, Tensor};

use super::cube::{Axis, Cube, Orientation};
use super::{comm, normalise_split_hidden};
use crate::error::ensure;
use crate::parallel::tensor::init::{self, Init};
use crate::Result;

/// LayerNorm over a hidden dimension split over the cube.
#[derive(Debug)]
pub struct CubeLayerNorm {
    weight: Tensor,
    bias: Tensor,
    width: i64,
    eps: f64,
    orientation: Orientation,
    cube: Cube,
}

impl CubeLayerNorm {
    /// LayerNorm over `width` features (full size) for inputs in `orientation`, with
    /// PyTorch's initialisation.
    pub fn new(p: &nn::Path, width: i64, eps: f64, orientation: Orientation, cube: &Cube) -> Result<Self> {
        let weight = init::full(Init::Ones, 0, &p.path("weight"), &[width])?;
        let bias = init::full(Init::Zeros, 0, &p.path("bias"), &[width])?;
        Self::from_full(p, &weight, &bias, eps, orientation, cube)
    }

    /// LayerNorm holding this rank's blocks of the full `weight` and `bias` `[width]`.
    pub fn from_full(
        p: &nn::Path,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
        orientation: Orientation,
        cube: &Cube,
    ) -> Result<Self> {
        ensure!(
            weight.dim() == 1 && bias.size() == weight.size(),
            "3D layer norm {}: weight {:?} and bias {:?} must be one and the same width",
            p.path("weight"),
            weight.size(),
            bias.size()
        );
        let width = weight.size()[0];
        let block = cube.check_split(width, cube.q(), &format!("3D layer norm {}: width", p.path("weight")))?;
        let h = cube.coord(orientation.hidden_axis());
        let shard = |t: &Tensor| t.f_narrow(0, h * block, block).map(|t| t.detach().copy());
        Ok(CubeLayerNorm {
            weight: p.f_var_copy("weight", &shard(weight)?)?,
            bias: p.f_var_copy("bias", &shard(bias)?)?,
            width,
            eps,
            orientation,
            cube: cube.clone(),
        })
    }

    /// Normalises this rank's block `[.., width/q]` over the whole hidden dimension; the
    /// output keeps the input's orientation.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let block = self.width / self.cube.q();
        let last = *x.size().last().unwrap_or(&0);
        ensure!(
            last == block,
            "3D layer norm: input block has {last} features, expected {block} (width {} over q = {})",
            self.width,
            self.cube.q()
        );
        let hidden = self.cube.group(self.orientation.hidden_axis());
        let normed = normalise_split_hidden(x, self.width, self.eps, hidden)?;
        let batch = self.cube.group(self.orientation.batch_axis());
        let shared = |t: &Tensor| comm::copy_to(&comm::copy_to(t, self.cube.group(Axis::I))?, batch);
        Ok(normed.f_mul(&shared(&self.weight)?)?.f_add(&shared(&self.bias)?)?)
    }

    /// This rank's block of the weight `[width/q]`.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// This rank's block of the bias `[width/q]`.
    pub fn bias(&self) -> &Tensor {
        &self.bias
    }
}

/// An embedding table on the 3D layout.
#[derive(Debug)]
pub struct CubeEmbedding {
    weight: Tensor,
    vocab: i64,
    dim: i64,
    orientation: Orientation,
    cube: Cube,
}

impl CubeEmbedding {
    /// A table of `vocab` rows of width `dim` (full sizes) whose output is in `orientation`,
    /// drawn as the one-process table at `p` would be (`init`: `None` is a standard normal).
    pub fn new(
        p: &nn::Path,
        vocab: i64,
        dim: i64,
        seed: u64,
        init: Option<Init>,
        orientation: Orientation,
        cube: &Cube,
    ) -> Result<Self> {
        let name = p.path("weight");
        let q = cube.q();
        cube.check_split(vocab, q * q, &format!("3D embedding {name}: vocabulary size"))?;
        cube.check_split(dim, q, &format!("3D embedding {name}: width"))?;
        let (row, col) = Self::block_of(cube, orientation);
        let init = init.unwrap_or(Init::Normal { std: 1.0 });
        let weight = init::block(init, seed, &name, &[vocab, dim], &[q * q, q], &[row, col])?;
        Ok(CubeEmbedding { weight: p.f_var_copy("weight", &weight)?, vocab, dim, orientation, cube: cube.clone() })
    }

    /// A table holding this rank's block of the full `weight` `[vocab, dim]`.
    pub fn from_full(p: &nn::Path, weight: &Tensor, orientation: Orientation, cube: &Cube) -> Result<Self> {
        let name = p.path("weight");
        let shape = weight.size();
        ensure!(shape.len() == 2, "3D embedding {name}: the table is [vocab, dim], got shape {shape:?}");
        let q = cube.q();
        let rows = cube.check_split(shape[0], q * q, &format!("3D embedding {name}: vocabulary size"))?;
        let cols = cube.check_split(shape[1], q, &format!("3D embedding {name}: width"))?;
        let (row, col) = Self::block_of(cube, orientation);
        let block = weight.f_narrow(0, row * rows, rows)?.f_narrow(1, col * cols, cols)?.f_contiguous()?;
        Ok(CubeEmbedding {
            weight: p.f_var_copy("weight", &block.detach().copy())?,
            vocab: shape[0],
            dim: shape[1],
            orientation,
            cube: cube.clone(),
        })
    }

    /// (vocabulary block of `q^2`, hidden block of `q`) held by this rank.
    fn block_of(cube: &Cube, orientation: Orientation) -> (i64, i64) {
        let (i, a) = (cube.coord(Axis::I), cube.coord(orientation.batch_axis()));
        (i * cube.q() + a, cube.coord(orientation.hidden_axis()))
    }

    /// Embeddings of the whole batch's `ids` `[batch, ..]` (the same on every rank): this
    /// rank's block `[batch/q^2, .., dim/q]` in the table's orientation.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        ensure!(
            matches!(ids.kind(), Kind::Int64 | Kind::Int) && ids.dim() >= 1,
            "3D embedding: ids must be integers with a batch dimension, got {:?} of shape {:?}",
            ids.kind(),
            ids.size()
        );
        let (lo, hi) = (ids.f_min()?.int64_value(&[]), ids.f_max()?.int64_value(&[]));
        ensure!(
            lo >= 0 && hi < self.vocab,
            "3D embedding: ids range over {lo}..={hi}, outside the vocabulary 0..{}",
            self.vocab
        );
        let q = self.cube.q();
        self.cube.check_split(ids.size()[0], q * q, "3D embedding: batch size")?;
        let rows = self.vocab / (q * q);
        let start = Self::block_of(&self.cube, self.orientation).0 * rows;
        let outside = ids.f_lt(start)?.f_logical_or(&ids.f_ge(start + rows)?)?;
        let local = ids.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
        let partial = Tensor::f_embedding(&self.weight, &local, -1, false, false)?
            .f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?;
        let block = comm::reduce_scatter(&partial, 0, self.cube.group(Axis::I))?;
        comm::reduce_scatter(&block, 0, self.cube.group(self.orientation.batch_axis()))
    }

    /// This rank's block of the table, `[vocab/q^2, dim/q]` (a trainable leaf).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The full table `[vocab, dim]` on every rank (no autograd).
    pub fn full_weight(&self) -> Result<Tensor> {
        let w = comm::gather_full(&self.weight, 0, self.cube.group(self.orientation.batch_axis()))?;
        let w = comm::gather_full(&w, 0, self.cube.group(Axis::I))?;
        comm::gather_full(&w, 1, self.cube.group(self.orientation.hidden_axis()))
    }

    /// `(vocab, dim)`, full sizes.
    pub fn shape(&self) -> (i64, i64) {
        (self.vocab, self.dim)
    }
}
