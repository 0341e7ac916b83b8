//! 1D tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and its sequence-parallel variant
//! (Megatron-SP, Korthikanti et al. 2022).
//!
//! Weights are split over the ranks of a tensor-parallel group: [`ColumnParallelLinear`] splits
//! its output features, [`RowParallelLinear`] its input features, [`VocabParallelEmbedding`]
//! the vocabulary, and [`vocab_parallel_cross_entropy`] takes logits split over the vocabulary
//! without ever gathering them. A column layer followed by a row layer (an MLP, or attention
//! with heads split) communicates once forward and once backward.
//!
//! With `sequence_parallel`, the activations between those pairs (residual stream, LayerNorm,
//! dropout) are split along the sequence instead of replicated, so they take 1/tp of the
//! memory: a column layer all-gathers its input along the sequence (backward: reduce-scatter)
//! and a row layer reduce-scatters its output (backward: all-gather). Replicated parameters
//! that act on sequence blocks (the row layer's bias, [`LayerNorm`]) then see only their
//! block's gradient, so their gradient is summed over the group in backward. [`dropout`]
//! draws its mask by position in the whole activation, so a sequence block's mask is the
//! block of the one-process mask.
//!
//! Initialisation is serial-equivalent ([`init`]): a tp=N shard is exactly the slice of the
//! tp=1 parameter built from the same seed and module path, so a run at tp=N can be checked
//! against one process, and a checkpoint of full tensors ([`ColumnParallelLinear::full_weight`]
//! and friends) loads at any tp through the `from_full` constructors.
//!
//! [`TensorParallel::none`] is the one-process path: every mapping is the identity.
//!
//! [`multi_dim`] holds the 2D, 2.5D and 3D modes, which split the activations too; [`TpMode`]
//! names the four modes and holds their grid arithmetic.
mod cross_entropy;
mod dropout;
mod embedding;
mod gathered_linear;
pub mod init;
mod linear;
mod mode;
pub mod multi_dim;
mod norm;

pub use cross_entropy::{vocab_parallel_cross_entropy, IGNORE_INDEX};
pub use dropout::{dropout, DropoutKey};
pub use embedding::{EmbeddingConfig, VocabParallelEmbedding};
pub use init::Init;
pub use linear::{ColumnConfig, ColumnParallelLinear, RowConfig, RowParallelLinear};
pub use mode::TpMode;
pub use norm::LayerNorm;

use tch::Tensor;

pub(crate) use super::axis::dim_index;
use super::axis::Axis;
use crate::autograd::collectives;
use crate::dist::{ProcessGroup, ReduceOp};
use crate::error::ensure;
use crate::Result;

/// The tensor-parallel context: the group weights are split over, or none for one process.
#[derive(Clone, Debug, Default)]
pub struct TensorParallel(Axis);

/// The axis' group, size, rank and differentiable mappings ([`Axis`]).
impl std::ops::Deref for TensorParallel {
    type Target = Axis;

    fn deref(&self) -> &Axis {
        &self.0
    }
}

impl TensorParallel {
    /// No parallelism: layers hold whole weights and every mapping is the identity.
    pub fn none() -> TensorParallel {
        TensorParallel(Axis::none())
    }

    /// Tensor parallelism over `group` (a group of one behaves as [`TensorParallel::none`]).
    pub fn new(group: ProcessGroup) -> TensorParallel {
        TensorParallel(Axis::new(group))
    }

    /// This rank's share of `len` (of `what`, for the error): `len / size`, an error unless the
    /// group size divides `len`.
    pub fn partition(&self, len: i64, what: &str) -> Result<i64> {
        let n = self.size();
        ensure!(len > 0, "{what} must be positive, got {len}");
        ensure!(len % n == 0, "{what} {len} does not divide by the tensor-parallel size {n}");
        Ok(len / n)
    }

    /// Concatenates every rank's `shard` along `dim`, without autograd (for checkpoints: the
    /// full tensor a tp=1 model would hold).
    pub fn gather_full(&self, shard: &Tensor, dim: i64) -> Result<Tensor> {
        match self.active() {
            Some(g) => tch::no_grad(|| collectives::Collective::AllGather { dim }.start(&shard.detach(), g)?.wait()),
            None => Ok(shard.detach().copy()),
        }
    }

    /// This rank's block of dim `dim` of a full tensor, copied (for `from_full` constructors).
    pub fn shard_of(&self, full: &Tensor, dim: i64, what: &str) -> Result<Tensor> {
        let d = dim_index(full, dim)?;
        let len = full.size()[d];
        let block = self.partition(len, what)?;
        Ok(full.f_narrow(dim, self.rank() * block, block)?.f_contiguous()?.detach().copy())
    }

    /// Sums a tensor's value over the group in place, without autograd.
    pub(crate) fn all_reduce_(&self, x: &Tensor, op: ReduceOp) -> Result<()> {
        match self.active() {
            Some(g) => g.all_reduce(x, op),
            None => Ok(()),
        }
    }
}
