//! The linear layer and classifier head of 2D and 2.5D tensor parallelism. The weight keeps
//! PyTorch's `[out_features, in_features]` layout and name; rank `(dep, row, col)` holds block
//! `(col, row)` of it (output block `col`, input block `row`: block `(row, col)` of `W^T`, the
//! matrix SUMMA multiplies by) in every depth layer, and the bias's block `col`.
use tch::{nn, Tensor};

use super::grid::Grid;
use super::summa::summa_linear;
use super::{comm, full_shape, LinearConfig};
use crate::error::ensure;
use crate::parallel::tensor::init;
use crate::parallel::tensor::{vocab_parallel_cross_entropy, TensorParallel};
use crate::Result;

/// A linear layer on the 2D/2.5D layout: input and output cut as [`Grid::split_input`] says.
#[derive(Debug)]
pub struct GridLinear {
    weight: Tensor,
    bias: Option<Tensor>,
    in_features: i64,
    out_features: i64,
    grid: Grid,
}

impl GridLinear {
    /// A layer of `in_features -> out_features` (full sizes) holding this rank's blocks,
    /// initialised as the one-process layer at path `p` would be.
    pub fn new(p: &nn::Path, in_features: i64, out_features: i64, cfg: LinearConfig, grid: &Grid) -> Result<Self> {
        let name = p.path("weight");
        let q = grid.q();
        grid.check_split(in_features, q, &format!("2D linear {name}: in_features"))?;
        grid.check_split(out_features, q, &format!("2D linear {name}: out_features"))?;
        let (_, r, c) = grid.coords();
        let w_init = cfg.weight_init(in_features);
        let weight = init::block(w_init, cfg.seed, &name, &[out_features, in_features], &[q, q], &[c, r])?;
        let bias = match cfg.bias {
            true => {
                let b_init = cfg.bias_init(in_features);
                Some(init::shard(b_init, cfg.seed, &p.path("bias"), &[out_features], 0, c, q)?)
            }
            false => None,
        };
        Self::register(p, &weight, bias.as_ref(), in_features, out_features, grid)
    }

    /// A layer holding this rank's blocks of the full `weight` `[out, in]` and `bias` `[out]`.
    pub fn from_full(p: &nn::Path, weight: &Tensor, bias: Option<&Tensor>, grid: &Grid) -> Result<Self> {
        let name = p.path("weight");
        let (out_features, in_features) = full_shape(weight, bias, &name)?;
        let q = grid.q();
        let in_q = grid.check_split(in_features, q, &format!("2D linear {name}: in_features"))?;
        let out_q = grid.check_split(out_features, q, &format!("2D linear {name}: out_features"))?;
        let (_, r, c) = grid.coords();
        let w = weight.f_narrow(0, c * out_q, out_q)?.f_narrow(1, r * in_q, in_q)?.f_contiguous()?.detach().copy();
        let b = bias.map(|b| b.f_narrow(0, c * out_q, out_q).map(|b| b.detach().copy())).transpose()?;
        Self::register(p, &w, b.as_ref(), in_features, out_features, grid)
    }

    fn register(
        p: &nn::Path,
        weight: &Tensor,
        bias: Option<&Tensor>,
        in_features: i64,
        out_features: i64,
        grid: &Grid,
    ) -> Result<Self> {
        let weight = p.f_var_copy("weight", weight)?;
        let bias = bias.map(|b| p.f_var_copy("bias", b)).transpose()?;
        Ok(GridLinear { weight, bias, in_features, out_features, grid: grid.clone() })
    }

    /// `x`: this rank's block `[batch/(d q), .., in/q]`; the output is its block
    /// `[batch/(d q), .., out/q]` of `x W^T + b`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let q = self.grid.q();
        let last = *x.size().last().unwrap_or(&0);
        ensure!(
            x.dim() >= 2 && last == self.in_features / q,
            "2D linear: input block has shape {:?}, expected [batch block, .., {}] (in_features {} over q = {q})",
            x.size(),
            self.in_features / q,
            self.in_features
        );
        // Depth layers share the weight and see different batches: their gradients add up.
        let w = comm::copy_to(&self.weight, self.grid.depth_group())?;
        let y = summa_linear(x, &w, &self.grid)?;
        match &self.bias {
            Some(b) => {
                // Every row of the grid adds the bias to its own batch block.
                let b = comm::copy_to(&comm::copy_to(b, self.grid.col_group())?, self.grid.depth_group())?;
                Ok(y.f_add(&b)?)
            }
            None => Ok(y),
        }
    }

    /// This rank's block of the weight, `[out/q, in/q]` (a trainable leaf).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// This rank's block of the bias, `[out/q]`.
    pub fn bias(&self) -> Option<&Tensor> {
        self.bias.as_ref()
    }

    /// The full weight `[out, in]` on every rank (no autograd).
    pub fn full_weight(&self) -> Result<Tensor> {
        let w = comm::gather_full(&self.weight, 0, self.grid.row_group())?;
        comm::gather_full(&w, 1, self.grid.col_group())
    }

    /// The full bias `[out]` on every rank.
    pub fn full_bias(&self) -> Result<Option<Tensor>> {
        self.bias.as_ref().map(|b| comm::gather_full(b, 0, self.grid.row_group())).transpose()
    }

    /// `(in_features, out_features)`, full sizes.
    pub fn features(&self) -> (i64, i64) {
        (self.in_features, self.out_features)
    }
}

/// The classifier head on the 2D/2.5D layout: a [`GridLinear`] to the classes, whose logits
/// stay split over the classes along the grid's rows, and a cross-entropy that never gathers
/// them (the row group is its tensor-parallel group).
#[derive(Debug)]
pub struct GridClassifier {
    linear: GridLinear,
}

impl GridClassifier {
    /// A head of `hidden -> classes` (full sizes) at path `p`.
    pub fn new(p: &nn::Path, hidden: i64, classes: i64, cfg: LinearConfig, grid: &Grid) -> Result<Self> {
        Ok(GridClassifier { linear: GridLinear::new(p, hidden, classes, cfg, grid)? })
    }

    /// A head from the full `weight` `[classes, hidden]` and `bias`.
    pub fn from_full(p: &nn::Path, weight: &Tensor, bias: Option<&Tensor>, grid: &Grid) -> Result<Self> {
        Ok(GridClassifier { linear: GridLinear::from_full(p, weight, bias, grid)? })
    }

    /// This rank's block of the logits, `[batch/(d q), .., classes/q]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.forward(x)
    }

    /// Per-token cross-entropy of this rank's logits block against `targets`, the class ids
    /// of this rank's batch block ([`Grid::split_batch`]); the same on every rank of a row.
    pub fn cross_entropy(&self, logits: &Tensor, targets: &Tensor, label_smoothing: f64) -> Result<Tensor> {
        let tp = TensorParallel::new(self.linear.grid.row_group().clone());
        vocab_parallel_cross_entropy(logits, targets, label_smoothing, &tp)
    }

    /// The linear layer.
    pub fn linear(&self) -> &GridLinear {
        &self.linear
    }
}
