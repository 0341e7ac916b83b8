//! LayerNorm and the embedding on the 2D/2.5D layout ([`Grid`]).
//!
//! - [`GridLayerNorm`]: the hidden dimension is split along the grid's rows, so a token's mean
//!   and variance are sums all-reduced over the row group; rank `(.., col)` holds block `col`
//!   of the weight and bias, used by every row and depth layer on its own batch block, so
//!   their gradients are summed over the column and depth groups.
//! - [`GridEmbedding`]: the table `[vocab, dim]` cut into `q x q` blocks, rank `(.., row,
//!   col)` holding vocabulary block `row` and hidden block `col`. Each rank looks up its depth
//!   layer's ids in its vocabulary block (ids outside it give zeros); reduce-scattering the
//!   partial embeddings along the batch over the column group sums the vocabulary blocks and
//!   leaves each rank its batch block. The table is shared by the depth layers.
use tch::{nn, Kind, Tensor};

use super::grid::Grid;
use super::{comm, normalise_split_hidden};
use crate::error::ensure;
use crate::parallel::tensor::init::{self, Init};
use crate::Result;

/// LayerNorm over a hidden dimension split along the grid's rows.
#[derive(Debug)]
pub struct GridLayerNorm {
    weight: Tensor,
    bias: Tensor,
    width: i64,
    eps: f64,
    grid: Grid,
}

impl GridLayerNorm {
    /// LayerNorm over `width` features (full size) with PyTorch's initialisation.
    pub fn new(p: &nn::Path, width: i64, eps: f64, grid: &Grid) -> Result<Self> {
        let weight = init::full(Init::Ones, 0, &p.path("weight"), &[width])?;
        let bias = init::full(Init::Zeros, 0, &p.path("bias"), &[width])?;
        Self::from_full(p, &weight, &bias, eps, grid)
    }

    /// LayerNorm holding this rank's blocks of the full `weight` and `bias` `[width]`.
    pub fn from_full(p: &nn::Path, weight: &Tensor, bias: &Tensor, eps: f64, grid: &Grid) -> Result<Self> {
        ensure!(
            weight.dim() == 1 && bias.size() == weight.size(),
            "2D layer norm {}: weight {:?} and bias {:?} must be one and the same width",
            p.path("weight"),
            weight.size(),
            bias.size()
        );
        let width = weight.size()[0];
        let block = grid.check_split(width, grid.q(), &format!("2D layer norm {}: width", p.path("weight")))?;
        let (_, _, c) = grid.coords();
        let shard = |t: &Tensor| t.f_narrow(0, c * block, block).map(|t| t.detach().copy());
        Ok(GridLayerNorm {
            weight: p.f_var_copy("weight", &shard(weight)?)?,
            bias: p.f_var_copy("bias", &shard(bias)?)?,
            width,
            eps,
            grid: grid.clone(),
        })
    }

    /// Normalises this rank's block `[.., width/q]` over the whole hidden dimension.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let block = self.width / self.grid.q();
        let last = *x.size().last().unwrap_or(&0);
        ensure!(
            last == block,
            "2D layer norm: input block has {last} features, expected {block} (width {} over q = {})",
            self.width,
            self.grid.q()
        );
        let normed = normalise_split_hidden(x, self.width, self.eps, self.grid.row_group())?;
        let shared = |t: &Tensor| comm::copy_to(&comm::copy_to(t, self.grid.col_group())?, self.grid.depth_group());
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

/// An embedding table on the 2D/2.5D layout.
#[derive(Debug)]
pub struct GridEmbedding {
    weight: Tensor,
    vocab: i64,
    dim: i64,
    grid: Grid,
}

impl GridEmbedding {
    /// A table of `vocab` rows of width `dim` (full sizes) holding this rank's block, drawn as
    /// the one-process table at `p` would be (`init`: `None` is PyTorch's standard normal).
    pub fn new(p: &nn::Path, vocab: i64, dim: i64, seed: u64, init: Option<Init>, grid: &Grid) -> Result<Self> {
        let name = p.path("weight");
        let q = grid.q();
        grid.check_split(vocab, q, &format!("2D embedding {name}: vocabulary size"))?;
        grid.check_split(dim, q, &format!("2D embedding {name}: width"))?;
        let (_, r, c) = grid.coords();
        let init = init.unwrap_or(Init::Normal { std: 1.0 });
        let weight = init::block(init, seed, &name, &[vocab, dim], &[q, q], &[r, c])?;
        Ok(GridEmbedding { weight: p.f_var_copy("weight", &weight)?, vocab, dim, grid: grid.clone() })
    }

    /// A table holding this rank's block of the full `weight` `[vocab, dim]`.
    pub fn from_full(p: &nn::Path, weight: &Tensor, grid: &Grid) -> Result<Self> {
        let name = p.path("weight");
        let shape = weight.size();
        ensure!(shape.len() == 2, "2D embedding {name}: the table is [vocab, dim], got shape {shape:?}");
        let q = grid.q();
        let rows = grid.check_split(shape[0], q, &format!("2D embedding {name}: vocabulary size"))?;
        let cols = grid.check_split(shape[1], q, &format!("2D embedding {name}: width"))?;
        let (_, r, c) = grid.coords();
        let block = weight.f_narrow(0, r * rows, rows)?.f_narrow(1, c * cols, cols)?.f_contiguous()?.detach().copy();
        Ok(GridEmbedding {
            weight: p.f_var_copy("weight", &block)?,
            vocab: shape[0],
            dim: shape[1],
            grid: grid.clone(),
        })
    }

    /// Embeddings of the whole batch's `ids` `[batch, ..]` (the same on every rank): this
    /// rank's block `[batch/(d q), .., dim/q]` in the layout of [`Grid::split_input`].
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        ensure!(
            matches!(ids.kind(), Kind::Int64 | Kind::Int) && ids.dim() >= 1,
            "2D embedding: ids must be integers with a batch dimension, got {:?} of shape {:?}",
            ids.kind(),
            ids.size()
        );
        let (lo, hi) = (ids.f_min()?.int64_value(&[]), ids.f_max()?.int64_value(&[]));
        ensure!(
            lo >= 0 && hi < self.vocab,
            "2D embedding: ids range over {lo}..={hi}, outside the vocabulary 0..{}",
            self.vocab
        );
        let (q, d) = (self.grid.q(), self.grid.depth());
        let per_layer = self.grid.check_split(ids.size()[0], q * d, "2D embedding: batch size")? * q;
        let (dep, r, _) = self.grid.coords();
        let ids = ids.f_narrow(0, dep * per_layer, per_layer)?;
        let rows = self.vocab / q;
        let start = r * rows;
        let outside = ids.f_lt(start)?.f_logical_or(&ids.f_ge(start + rows)?)?;
        let local = ids.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
        let table = comm::copy_to(&self.weight, self.grid.depth_group())?;
        let partial =
            Tensor::f_embedding(&table, &local, -1, false, false)?.f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?;
        comm::reduce_scatter(&partial, 0, self.grid.col_group())
    }

    /// This rank's block of the table, `[vocab/q, dim/q]` (a trainable leaf).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The full table `[vocab, dim]` on every rank (no autograd).
    pub fn full_weight(&self) -> Result<Tensor> {
        let w = comm::gather_full(&self.weight, 0, self.grid.col_group())?;
        comm::gather_full(&w, 1, self.grid.row_group())
    }

    /// `(vocab, dim)`, full sizes.
    pub fn shape(&self) -> (i64, i64) {
        (self.vocab, self.dim)
    }
}
