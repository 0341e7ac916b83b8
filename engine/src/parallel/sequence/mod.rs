//! Sequence parallelism for attention: the sequence is split over the ranks of a group, each
//! rank holding a contiguous block of the tokens, and attention is computed without any rank
//! holding the whole sequence's activations.
//!
//! - [`ring_attention`] (Li et al. 2021, "Sequence Parallelism: Long Sequence Training from
//!   System Perspective", the seed paper's ring self-attention; computed blockwise with an
//!   online softmax as in Liu et al. 2023, "Ring Attention"): queries stay; key/value blocks
//!   travel around the ring by point-to-point send/recv, and in backward the key/value
//!   gradients travel with them and arrive home after the last step. No rank holds more than
//!   one `[block, block]` score matrix, and backward recomputes scores from the saved
//!   log-sum-exp instead of storing them.
//! - [`ulysses_attention`] (DeepSpeed-Ulysses, Jacobs et al. 2023): an all-to-all trades the
//!   sequence split for a head split, each rank attends over the whole sequence for `heads/sp`
//!   heads, and a second all-to-all trades back. Exact backward through the differentiable
//!   all-to-all and ordinary autograd.
//!
//! Both take `q, k, v` shaped `[batch, heads, seq/sp, head_dim]` (this rank's block of the
//! sequence, blocks in rank order) and return the attention output in the same layout; with
//! [`SequenceParallel::none`] and whole sequences they are ordinary attention, and
//! [`attention`] is the serial reference (softmax of scaled dot products) they are tested
//! against. Masks ([`AttentionMask`]) are given over the whole sequence on every rank.
mod attention;
mod ring;
mod ulysses;

pub use attention::{attention, AttentionMask};
pub use ring::ring_attention;
pub use ulysses::ulysses_attention;

use tch::{Kind, Tensor};

use super::axis::Axis;
use crate::dist::ProcessGroup;
use crate::Result;

/// The sequence-parallel context: the group the sequence is split over, or none.
#[derive(Clone, Debug, Default)]
pub struct SequenceParallel(Axis);

/// The axis' group, size, rank and differentiable mappings ([`Axis`]).
impl std::ops::Deref for SequenceParallel {
    type Target = Axis;

    fn deref(&self) -> &Axis {
        &self.0
    }
}

impl SequenceParallel {
    /// One process holds the whole sequence.
    pub fn none() -> SequenceParallel {
        SequenceParallel(Axis::none())
    }

    /// The sequence split over `group` (a group of one behaves as [`SequenceParallel::none`]).
    pub fn new(group: ProcessGroup) -> SequenceParallel {
        SequenceParallel(Axis::new(group))
    }

    /// Checks that every rank holds a block of the same shape, with one small all-gather of the
    /// shapes: a sequence that does not split evenly would otherwise reach the transport as
    /// messages of different sizes, which Gloo answers by aborting the process (and a ring
    /// rank whose messages happen to fit would compute garbage). The error, the same on every
    /// rank, names each rank's shape.
    pub(crate) fn check_blocks_agree(&self, x: &Tensor, what: &str) -> Result<()> {
        let Some(g) = self.active() else { return Ok(()) };
        let shape = Tensor::f_from_slice(&x.size())?.f_to_device(x.device())?;
        let all = g.all_gather(&shape)?.f_to_device(tch::Device::Cpu)?.f_to_kind(Kind::Int64)?;
        let all: Vec<i64> = Vec::<i64>::try_from(&all)?;
        let rank_shapes: Vec<&[i64]> = all.chunks(x.dim()).collect();
        if rank_shapes.iter().all(|s| *s == rank_shapes[0]) {
            return Ok(());
        }
        let listed: Vec<String> = rank_shapes.iter().enumerate().map(|(r, s)| format!("rank {r} {s:?}")).collect();
        Err(crate::Error::invalid(format!(
            "{what}: the ranks hold blocks of different shapes ({}); the sequence must split evenly over the \
             {} ranks",
            listed.join(", "),
            g.size()
        )))
    }
}
