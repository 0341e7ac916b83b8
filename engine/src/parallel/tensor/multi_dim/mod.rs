//! Multi-dimensional tensor parallelism, Colossal-AI's 2D (Optimus, Xu et al. 2021), 2.5D
//! (Tesseract, Wang et al. 2021) and 3D (Bian et al. 2021) modes: weights *and* activations
//! are split over the ranks, so nothing is replicated and the traffic per rank falls with
//! the number of ranks, where 1D (Megatron) replicates the activations and all-reduces them
//! whole.
//!
//! - [`Grid`]: 2D on `q x q` ranks and 2.5D on `q x q x d` ([`Grid::two_d`],
//!   [`Grid::two_p5_d`]), with [`GridLinear`] (SUMMA), [`GridLayerNorm`], [`GridEmbedding`]
//!   and [`GridClassifier`].
//! - [`Cube`]: 3D on `q^3` ranks, with [`CubeLinear`], [`CubeLayerNorm`], [`CubeEmbedding`]
//!   and [`CubeClassifier`]. Activations come in two [`Orientation`]s; each linear layer
//!   flips it.
//!
//! Each mode's layout helpers (`split_input`, `split_batch`, `gather_output`) say where a
//! whole tensor's blocks live. Parameters keep the one-process names and PyTorch layouts and
//! are drawn block by block from the serial-equivalent generator ([`super::init`]), so every
//! shard is exactly the slice of the one-process parameter built from the same seed, and
//! `full_weight` / `from_full` move checkpoints between layouts.
//!
//! Communication per linear layer, forward and backward, input `[b, s, h]` (`N = b s`
//! tokens), weight `h -> h'`, no bias, in elements handed to collectives per rank (times the
//! element size, what [`ProcessGroup::bytes_communicated`](crate::dist::ProcessGroup::bytes_communicated)
//! counts; the tests and `benches/tensor_parallel.rs` check these numbers):
//!
//! | mode | ranks `p` | elements per rank |
//! |---|---|---|
//! | 1D (column, then row) | any | `N h` (column, backward) or `N h'` (row, forward): one all-reduce of an activation |
//! | 2D | `q^2` | `3 (N h + h h') / q` |
//! | 2.5D | `q^2 d` | `3 N h / (d q) + 3 h h' / q + h h' / q^2` (the last: the weight gradient summed over depth) |
//! | 3D | `q^3` | `(3 N h + 2 N h' + 3 h h') / q^2` (input and weight gathered again in backward) |
//!
//! A bias adds `h'/q` (2D), `2 h'/q` (2.5D, 3D) for summing its gradient.
mod comm;
mod cube;
mod cube_layers;
mod cube_linear;
mod cube_matmul;
mod grid;
mod grid_layers;
mod grid_linear;
mod summa;

pub use cube::{Axis, Cube, Orientation};
pub use cube_layers::{CubeEmbedding, CubeLayerNorm};
pub use cube_linear::{CubeClassifier, CubeLinear};
pub use grid::Grid;
pub use grid_layers::{GridEmbedding, GridLayerNorm};
pub use grid_linear::{GridClassifier, GridLinear};

use tch::Tensor;

use super::init::Init;
use crate::error::ensure;
use crate::Result;

/// How a multi-dimensional linear layer is built (default: with bias, seed 0, PyTorch's
/// `nn.Linear` initialisation).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinearConfig {
    /// Whether the layer has a bias.
    pub bias: bool,
    /// Seed of the serial-equivalent initialisation.
    pub seed: u64,
    /// The weight's initialisation; `None`: PyTorch's (uniform, bound `1/sqrt(in_features)`).
    pub weight_init: Option<Init>,
    /// The bias's initialisation; `None`: PyTorch's.
    pub bias_init: Option<Init>,
}

impl Default for LinearConfig {
    fn default() -> Self {
        LinearConfig { bias: true, seed: 0, weight_init: None, bias_init: None }
    }
}

impl LinearConfig {
    fn weight_init(&self, in_features: i64) -> Init {
        self.weight_init.unwrap_or(Init::Uniform { bound: 1.0 / (in_features as f64).sqrt() })
    }

    fn bias_init(&self, in_features: i64) -> Init {
        self.bias_init.unwrap_or(Init::Uniform { bound: 1.0 / (in_features as f64).sqrt() })
    }
}

/// `(out, in)` of a full linear weight, checked against its bias.
/// `x` (this rank's block of the hidden dimension, `width` in all) normalised over the whole
/// hidden dimension: mean and variance sums all-reduced over `hidden`, the group that splits
/// it (differentiably). The affine part is the caller's: its parameters are shared differently
/// in each layout. Computed in fp32 and returned in `x`'s dtype, as libtorch's LayerNorm does
/// for bf16 and fp16 inputs.
fn normalise_split_hidden(x: &Tensor, width: i64, eps: f64, hidden: &crate::dist::ProcessGroup) -> Result<Tensor> {
    let sum_last = |t: &Tensor| t.f_sum_dim_intlist(&[-1i64][..], true, tch::Kind::Float);
    let x32 = x.f_to_kind(tch::Kind::Float)?;
    let mean = comm::all_reduce(&sum_last(&x32)?, hidden)?.f_div_scalar(width as f64)?;
    let centred = x32.f_sub(&mean)?;
    let var = comm::all_reduce(&sum_last(&centred.f_square()?)?, hidden)?.f_div_scalar(width as f64)?;
    Ok(centred.f_mul(&var.f_add_scalar(eps)?.f_rsqrt()?)?.f_to_kind(x.kind())?)
}

fn full_shape(weight: &Tensor, bias: Option<&Tensor>, name: &str) -> Result<(i64, i64)> {
    let shape = weight.size();
    ensure!(shape.len() == 2, "{name}: a linear weight is [out_features, in_features], got shape {shape:?}");
    if let Some(b) = bias {
        ensure!(b.size() == [shape[0]], "{name}: bias has shape {:?}, expected [{}]", b.size(), shape[0]);
    }
    Ok((shape[0], shape[1]))
}
