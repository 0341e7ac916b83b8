//! `--sp N`: the tokens split over a sequence-parallel group, attention by the engine's ring
//! or all-to-all (Ulysses) attention ([`engine::parallel::sequence`]), around any other
//! layers (serial, or 1D tensor parallel: heads over `--tp`, tokens over `--sp`).
//!
//! The stem runs whole on every rank, each rank keeps its block of the tokens (a plain slice:
//! its gradient reaches only that block) through the blocks, and the stream is all-gathered
//! before the head (backward: the ranks' gradients summed, then split). Every rank so computes
//! the same loss, and each parameter's gradient on a rank is its share of the gradient of the
//! sum of the group's losses: summed over the group it is `sp` times the one-process gradient,
//! so averaging gradients over the data replicas and the sequence ranks together (`dp x sp`
//! ranks, `crate::tensor_parallel::Mesh::grads`) gives the one-process data-parallel mean.
use engine::parallel::sequence::{ring_attention, ulysses_attention, AttentionMask, SequenceParallel};
use tch::nn;
use tch::Tensor;

use crate::model::{Attend, Head, Layer, Layers, Region, Stem, VitConfig};

/// `--sp-mode`: how attention crosses the sequence-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SpMode {
    /// Keys and values passed around the ring (blockwise, online softmax).
    Ring,
    /// All-to-all from token blocks to head blocks and back (DeepSpeed-Ulysses).
    Ulysses,
}

/// The tokens dimension of the residual stream `[batch, tokens, width]`.
const TOKENS: i64 = 1;

/// `base`'s layers with the tokens split over `sp` and attention across the group.
pub struct SpLayers {
    base: Box<dyn Layers>,
    sp: SequenceParallel,
    mode: SpMode,
}

impl SpLayers {
    /// `base` with the sequence split over `sp` (whose size divides the tokens).
    pub fn new(base: Box<dyn Layers>, sp: SequenceParallel, mode: SpMode) -> SpLayers {
        SpLayers { base, sp, mode }
    }
}

impl Layers for SpLayers {
    fn parts(&self) -> i64 {
        self.base.parts()
    }
    fn column(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        self.base.column(p, inputs, outputs)
    }
    fn row(&self, p: nn::Path, inputs: i64, outputs: i64) -> anyhow::Result<Box<dyn Layer>> {
        self.base.row(p, inputs, outputs)
    }
    fn norm(&self, p: nn::Path, width: i64) -> anyhow::Result<Box<dyn Layer>> {
        self.base.norm(p, width)
    }
    fn stem(&self, p: &nn::Path, cfg: &VitConfig) -> anyhow::Result<Box<dyn Stem>> {
        self.base.stem(p, cfg)
    }
    fn head(&self, p: &nn::Path, cfg: &VitConfig) -> anyhow::Result<Box<dyn Head>> {
        self.base.head(p, cfg)
    }
    fn region(&self) -> Box<dyn Region> {
        Box::new(TokenBlocks { sp: self.sp.clone() })
    }
    fn attention(&self) -> anyhow::Result<Box<dyn Attend>> {
        Ok(Box::new(SpAttention { sp: self.sp.clone(), mode: self.mode }))
    }
}

/// The residual stream as this rank's block of the tokens.
#[derive(Debug)]
struct TokenBlocks {
    sp: SequenceParallel,
}

impl Region for TokenBlocks {
    fn enter(&self, x: Tensor) -> anyhow::Result<Tensor> {
        let n = x.size()[TOKENS as usize] / self.sp.size();
        Ok(x.f_narrow(TOKENS, self.sp.rank() * n, n)?)
    }

    fn leave(&self, x: Tensor) -> anyhow::Result<Tensor> {
        Ok(self.sp.all_gather(&x, TOKENS)?)
    }
}

/// Attention of this rank's query block over every token.
#[derive(Debug)]
struct SpAttention {
    sp: SequenceParallel,
    mode: SpMode,
}

impl Attend for SpAttention {
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> anyhow::Result<Tensor> {
        let mask = AttentionMask::none();
        Ok(match self.mode {
            SpMode::Ring => ring_attention(q, k, v, &mask, &self.sp)?,
            SpMode::Ulysses => ulysses_attention(q, k, v, &mask, &self.sp)?,
        })
    }
}
