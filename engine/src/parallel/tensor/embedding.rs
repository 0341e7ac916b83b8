//! [`VocabParallelEmbedding`]: the embedding table split over the vocabulary. Each rank looks
//! up the ids that fall in its block of rows (the others give zero vectors) and the partial
//! embeddings are summed over the group, or with sequence parallelism reduce-scattered along
//! the sequence, which starts the sequence-split region of a Megatron-SP model.
use tch::{nn, Kind, Tensor};

use super::init::{self, Init};
use super::{dim_index, TensorParallel};
use crate::error::ensure;
use crate::Result;

/// How a [`VocabParallelEmbedding`] is built and wired (default: output replicated, sequence
/// dim 0, seed 0, PyTorch's initialisation).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EmbeddingConfig {
    /// Reduce-scatter the output along dim `sequence_dim` instead of all-reducing it.
    pub sequence_parallel: bool,
    /// The sequence dimension of the output (that of the ids).
    pub sequence_dim: i64,
    /// Seed of the serial-equivalent initialisation.
    pub seed: u64,
    /// The table's initialisation; `None`: PyTorch's `nn.Embedding` (standard normal).
    pub init: Option<Init>,
}

/// An embedding table `[vocab, dim]` whose rows are split over the tensor-parallel group.
#[derive(Debug)]
pub struct VocabParallelEmbedding {
    weight: Tensor,
    vocab: i64,
    dim: i64,
    cfg: EmbeddingConfig,
    tp: TensorParallel,
}

impl VocabParallelEmbedding {
    /// A table of `vocab` rows of width `dim`, this rank holding rows
    /// `rank * vocab/tp .. (rank + 1) * vocab/tp`, as the tp=1 table at `p` would.
    pub fn new(p: &nn::Path, vocab: i64, dim: i64, cfg: EmbeddingConfig, tp: &TensorParallel) -> Result<Self> {
        let name = p.path("weight");
        ensure!(dim > 0, "vocab-parallel embedding {name}: width must be positive, got {dim}");
        tp.partition(vocab, &format!("vocab-parallel embedding {name}: vocabulary size"))?;
        let init = cfg.init.unwrap_or(Init::Normal { std: 1.0 });
        let weight = init::shard(init, cfg.seed, &name, &[vocab, dim], 0, tp.rank(), tp.size())?;
        Ok(VocabParallelEmbedding { weight: p.f_var_copy("weight", &weight)?, vocab, dim, cfg, tp: tp.clone() })
    }

    /// A table holding this rank's rows of the full `weight` `[vocab, dim]`.
    pub fn from_full(p: &nn::Path, weight: &Tensor, cfg: EmbeddingConfig, tp: &TensorParallel) -> Result<Self> {
        let name = p.path("weight");
        let shape = weight.size();
        ensure!(shape.len() == 2, "vocab-parallel embedding {name}: the table is [vocab, dim], got shape {shape:?}");
        let shard = tp.shard_of(weight, 0, &format!("vocab-parallel embedding {name}: vocabulary size"))?;
        Ok(VocabParallelEmbedding {
            weight: p.f_var_copy("weight", &shard)?,
            vocab: shape[0],
            dim: shape[1],
            cfg,
            tp: tp.clone(),
        })
    }

    /// Embeddings `[.., dim]` of integer `ids` (every rank passes the same ids); with sequence
    /// parallelism, this rank's block of dim `sequence_dim`.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        ensure!(
            matches!(ids.kind(), Kind::Int64 | Kind::Int),
            "vocab-parallel embedding: ids must be integers, got {:?}",
            ids.kind()
        );
        if ids.numel() > 0 {
            let (lo, hi) = (ids.f_min()?.int64_value(&[]), ids.f_max()?.int64_value(&[]));
            ensure!(
                lo >= 0 && hi < self.vocab,
                "vocab-parallel embedding: ids range over {lo}..={hi}, outside the vocabulary 0..{}",
                self.vocab
            );
        }
        let rows = self.vocab / self.tp.size();
        let start = self.tp.rank() * rows;
        // Ids outside this rank's rows look up row 0 and are zeroed: their rank adds them.
        let outside = ids.f_lt(start)?.f_logical_or(&ids.f_ge(start + rows)?)?;
        let local = ids.f_sub_scalar(start)?.f_masked_fill(&outside, 0)?;
        let partial = Tensor::f_embedding(&self.weight, &local, -1, false, false)?
            .f_masked_fill(&outside.f_unsqueeze(-1)?, 0.0)?;
        match self.cfg.sequence_parallel {
            true => {
                let d = dim_index(ids, self.cfg.sequence_dim)?;
                let (len, n) = (ids.size()[d], self.tp.size());
                ensure!(
                    len % n == 0,
                    "vocab-parallel embedding: sequence length {len} (dim {d}) does not divide by the \
                     tensor-parallel size {n}"
                );
                self.tp.reduce_scatter(&partial, self.cfg.sequence_dim)
            }
            false => self.tp.reduce_from(&partial),
        }
    }

    /// This rank's rows of the table, `[vocab/tp, dim]` (a trainable leaf).
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    /// The full table `[vocab, dim]` on every rank (no autograd).
    pub fn full_weight(&self) -> Result<Tensor> {
        self.tp.gather_full(&self.weight, 0)
    }

    /// `(vocab, dim)`, full sizes.
    pub fn shape(&self) -> (i64, i64) {
        (self.vocab, self.dim)
    }
}
