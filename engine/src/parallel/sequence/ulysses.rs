//! All-to-all (DeepSpeed-Ulysses) attention: `[b, h, s/sp, d]` blocks of the sequence become
//! `[b, h/sp, s, d]` blocks of the heads by one all-to-all (q, k and v stacked), each rank runs ordinary
//! attention over the whole sequence for its heads, and one all-to-all takes the output back
//! to sequence blocks. Each all-to-all's backward is the inverse all-to-all, so the backward
//! is exact. Memory per rank: the score matrices of `h/sp` heads, 1/sp of one process's.
use tch::Tensor;

use super::attention::{attention, check_qkv, AttentionMask};
use super::SequenceParallel;
use crate::autograd::collectives::all_to_all;
use crate::error::ensure;
use crate::Result;

/// Ulysses attention over this rank's blocks `q, k, v` `[batch, heads, seq/sp, head_dim]` of
/// the sequence; the heads must divide by the group size. The mask is over the whole sequence.
pub fn ulysses_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    sp: &SequenceParallel,
) -> Result<Tensor> {
    let (_, heads, _, _) = check_qkv(q, k, v, "all-to-all attention")?;
    let Some(g) = sp.active() else { return attention(q, k, v, mask) };
    sp.check_blocks_agree(q, "all-to-all attention")?;
    let n = sp.size();
    ensure!(heads % n == 0, "all-to-all attention: {heads} heads do not divide by the sequence-parallel size {n}");
    // One all-to-all for the three inputs, stacked `[3, b, h, s/sp, d]`: scatter the heads
    // (dim 2), gather the sequence (dim 3).
    let qkv = all_to_all(&Tensor::f_stack(&[q, k, v], 0)?, 2, 3, g)?;
    let out = attention(&qkv.get(0), &qkv.get(1), &qkv.get(2), mask)?;
    all_to_all(&out, 2, 1, g)
}
