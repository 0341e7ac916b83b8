//! Ring self-attention. Rank `r` keeps its query block; the key/value blocks go around the
//! ring (rank `r` sends to `r + 1` and receives from `r - 1`), so at step `t` rank `r` holds
//! the block of rank `r - t` and folds it into its output with an online softmax (running row
//! maximum `m`, normaliser `l` and unnormalised output `o`). The next block's transfer is
//! launched before the current block's arithmetic, so communication overlaps computation.
//!
//! Forward keeps `q, k, v`, the output and the rows' log-sum-exp; backward goes around the
//! ring again, recomputing each block's probabilities from the log-sum-exp (no score matrix
//! is stored), accumulating `dq` locally and `dk, dv` in buffers that travel with their
//! key/value block: they hop after every step, `sp` hops in all, the last of which brings
//! each block's gradient home to the rank that owns the block. In backward the key/value
//! transfer overlaps the arithmetic; the gradient buffers' hop cannot (they are what the
//! arithmetic just produced).
//!
//! Under causal masking, blocks wholly in a query block's future are skipped (their transfer
//! still happens: the ring is the same on every rank). With contiguous blocks that leaves the
//! causal work unbalanced (rank `sp - 1` computes `sp` blocks, rank 0 one); a striped or
//! zigzag token order would even it out and is not done here.
use tch::Tensor;

use super::attention::{causal_block, check_qkv, AttentionMask, Causal};
use super::SequenceParallel;
use crate::autograd::function::{apply, Forward};
use crate::dist::{Hop, ProcessGroup};
use crate::Result;

/// Message tags: key/value blocks and their gradients never share a matching queue.
const TAG_KV: i32 = 0x5241; // "RA"
const TAG_DKV: i32 = 0x5242;

/// Ring attention over this rank's blocks `q, k, v` `[batch, heads, seq/sp, head_dim]` of the
/// sequence (see the module docs); the mask is given over the whole sequence.
pub fn ring_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &AttentionMask,
    sp: &SequenceParallel,
) -> Result<Tensor> {
    let (b, _, s, d) = check_qkv(q, k, v, "ring attention")?;
    sp.check_blocks_agree(q, "ring attention")?;
    let ring = Ring {
        group: sp.active().cloned(),
        rank: sp.rank(),
        size: sp.size(),
        block: s,
        scale: 1.0 / (d as f64).sqrt(),
        causal: mask.causal,
        key_bias: mask.key_bias(b, s * sp.size(), q.kind(), q.device())?,
    };
    let forward_ring = ring.shallow_clone();
    let out = apply(
        "ring attention",
        &[q, k, v],
        move |i| forward_ring.forward(&i[0], &i[1], &i[2]),
        move |grads, saved| ring.backward(&grads[0], saved),
    )?;
    Ok(out.into_iter().next().expect("one output"))
}

/// Everything both passes need to know about the ring.
struct Ring {
    group: Option<ProcessGroup>,
    rank: i64,
    size: i64,
    /// Tokens per block.
    block: i64,
    scale: f64,
    causal: bool,
    /// `[batch, 1, 1, whole sequence]` additive key mask.
    key_bias: Option<Tensor>,
}

impl Ring {
    fn shallow_clone(&self) -> Ring {
        Ring { group: self.group.clone(), key_bias: self.key_bias.as_ref().map(Tensor::shallow_clone), ..*self }
    }

    /// Starts passing `t` one step around the ring (`None` with one rank).
    fn pass(&self, t: &Tensor, tag: i32) -> Result<Option<Hop>> {
        self.group.as_ref().map(|g| g.ring_pass(t, tag)).transpose()
    }

    /// The block of keys held at step `step`.
    fn source(&self, step: i64) -> i64 {
        (self.rank - step).rem_euclid(self.size)
    }

    /// Scaled, masked scores of this rank's queries against key block `source`, or `None`
    /// when causality hides the whole block.
    fn scores(&self, q: &Tensor, k: &Tensor, source: i64) -> Result<Option<Tensor>> {
        let s = self.block;
        let mut scores = q.f_matmul(&k.f_transpose(-2, -1)?)?.f_mul_scalar(self.scale)?;
        if self.causal {
            match causal_block(self.rank * s, s, source * s, s, q.device())? {
                Causal::All => {}
                Causal::None => return Ok(None),
                Causal::Some(future) => scores = scores.f_masked_fill(&future, f64::NEG_INFINITY)?,
            }
        }
        if let Some(bias) = &self.key_bias {
            scores = scores.f_add(&bias.f_narrow(-1, source * s, s)?)?;
        }
        Ok(Some(scores))
    }

    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Forward> {
        let rows = [q.size()[0], q.size()[1], q.size()[2], 1];
        let opts = (q.kind(), q.device());
        let mut max = Tensor::f_full(rows, f64::NEG_INFINITY, opts)?;
        let mut norm = Tensor::f_zeros(rows, opts)?;
        let mut out = q.f_zeros_like()?;
        let mut kv = Tensor::f_stack(&[k, v], 0)?;
        for step in 0..self.size {
            let hop = if step + 1 < self.size { self.pass(&kv, TAG_KV)? } else { None };
            if let Some(scores) = self.scores(q, &kv.get(0), self.source(step))? {
                let new_max = max.f_maximum(&scores.f_amax([-1], true)?)?;
                // Rows that have seen only masked keys keep a -inf maximum; shift them by 0 so
                // that exp gives 0 rather than NaN.
                let shift = new_max.f_masked_fill(&new_max.f_eq(f64::NEG_INFINITY)?, 0.0)?;
                let p = scores.f_sub(&shift)?.f_exp()?;
                let decay = max.f_sub(&shift)?.f_exp()?;
                norm = norm.f_mul(&decay)?.f_add(&p.f_sum_dim_intlist(&[-1i64][..], true, q.kind())?)?;
                out = out.f_mul(&decay)?.f_add(&p.f_matmul(&kv.get(1))?)?;
                max = new_max;
            }
            if let Some(hop) = hop {
                kv = hop.wait()?;
            }
        }
        // Queries with no visible key: output 0, and a log-sum-exp of +inf so that backward's
        // recomputed probabilities are 0.
        let empty = norm.f_eq(0.0)?;
        let out = out.f_div(&norm.f_masked_fill(&empty, 1.0)?)?;
        let lse = max.f_add(&norm.f_log()?)?.f_masked_fill(&empty, f64::INFINITY)?;
        Ok(Forward {
            outputs: vec![out.shallow_clone()],
            saved: vec![q.shallow_clone(), k.shallow_clone(), v.shallow_clone(), out, lse],
            ..Forward::default()
        })
    }

    fn backward(&self, grad_out: &Tensor, saved: &[Tensor]) -> Result<Vec<Option<Tensor>>> {
        let [q, k, v, out, lse] = saved else {
            return Err(crate::Error::invalid(format!("ring attention: {} saved tensors, expected 5", saved.len())));
        };
        let grad_out = grad_out.f_contiguous()?;
        // D_i = sum_j P_ij dP_ij = rowsum(dO * O), the softmax backward's correction.
        let correction = grad_out.f_mul(out)?.f_sum_dim_intlist(&[-1i64][..], true, q.kind())?;
        let mut dq = q.f_zeros_like()?;
        let mut kv = Tensor::f_stack(&[k, v], 0)?;
        let mut dkv = kv.f_zeros_like()?;
        for step in 0..self.size {
            let hop = if step + 1 < self.size { self.pass(&kv, TAG_KV)? } else { None };
            if let Some(scores) = self.scores(q, &kv.get(0), self.source(step))? {
                let (kb, vb) = (kv.get(0), kv.get(1));
                let p = scores.f_sub(lse)?.f_exp()?;
                let dp = grad_out.f_matmul(&vb.f_transpose(-2, -1)?)?;
                let ds = p.f_mul(&dp.f_sub(&correction)?)?.f_mul_scalar(self.scale)?;
                dq = dq.f_add(&ds.f_matmul(&kb)?)?;
                let dk = ds.f_transpose(-2, -1)?.f_matmul(q)?;
                let dv = p.f_transpose(-2, -1)?.f_matmul(&grad_out)?;
                dkv = dkv.f_add(&Tensor::f_stack(&[dk, dv], 0)?)?;
            }
            // The gradient buffers travel with their block; the last hop brings them home.
            if let Some(back) = self.pass(&dkv, TAG_DKV)? {
                dkv = back.wait()?;
            }
            if let Some(hop) = hop {
                kv = hop.wait()?;
            }
        }
        Ok(vec![Some(dq), Some(dkv.get(0)), Some(dkv.get(1))])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parallel::sequence::attention;
    use tch::{Device, Kind};

    fn leaf(seed: i64, shape: &[i64]) -> Tensor {
        tch::manual_seed(seed);
        Tensor::randn(shape, (Kind::Double, Device::Cpu)).set_requires_grad(true)
    }

    /// One rank, one block: the online softmax and the hand-written backward equal autograd
    /// through the plain softmax, with causal and padding masks (fp64, 1e-10).
    #[test]
    fn one_block_equals_the_serial_reference() {
        let padding =
            Tensor::from_slice(&[true, true, false, true, false, true, true, true]).view([1, 8]).repeat([2, 1]);
        for (causal, pad) in [(false, false), (true, false), (false, true), (true, true)] {
            let mask = AttentionMask { causal, key_padding: pad.then(|| padding.shallow_clone()) };
            let (q, k, v) = (leaf(1, &[2, 3, 8, 4]), leaf(2, &[2, 3, 8, 4]), leaf(3, &[2, 3, 8, 4]));
            let g = Tensor::randn([2, 3, 8, 4], (Kind::Double, Device::Cpu));
            let got = ring_attention(&q, &k, &v, &mask, &SequenceParallel::none()).unwrap();
            let grads = Tensor::run_backward(&[(&got * &g).sum(Kind::Double)], &[&q, &k, &v], false, false);
            let want = attention(&q, &k, &v, &mask).unwrap();
            let want_grads = Tensor::run_backward(&[(&want * &g).sum(Kind::Double)], &[&q, &k, &v], false, false);
            assert!(got.allclose(&want, 1e-10, 1e-10, false), "output, causal {causal} padding {pad}");
            for (a, b) in grads.iter().zip(&want_grads) {
                assert!(a.allclose(b, 1e-10, 1e-10, false), "gradient, causal {causal} padding {pad}");
            }
        }
    }
}
