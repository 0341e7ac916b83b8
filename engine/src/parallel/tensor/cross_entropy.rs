//! Cross-entropy over logits split along the vocabulary (or classes), without gathering them:
//! the softmax's normaliser and the target's logit are reduced over the tensor-parallel group,
//! so each rank holds `[tokens, vocab/tp]` and the communication is two numbers per token.
//!
//! Composed of differentiable operations (a max, exps and sums, and Megatron's `reduce_from`
//! for the sums over ranks), so the backward is exact: `softmax - onehot` on each rank's block
//! (with label smoothing, `softmax - (1 - e) onehot - e / vocab`).
use tch::{Kind, Tensor};

use super::TensorParallel;
use crate::dist::ReduceOp;
use crate::error::ensure;
use crate::Result;

/// Targets equal to this are ignored (loss 0, no gradient), as with PyTorch's default.
pub const IGNORE_INDEX: i64 = -100;

/// Per-token cross-entropy of `logits` `[.., vocab/tp]` (this rank's block of the vocabulary,
/// blocks in rank order) against global class ids `targets` `[..]` (the same on every rank;
/// [`IGNORE_INDEX`] marks tokens to skip). `label_smoothing` in `[0, 1)` mixes the one-hot
/// target with the uniform distribution, as PyTorch's `cross_entropy` does. The result is
/// replicated, shaped like `targets`, in fp32; PyTorch's `mean` reduction is its sum over the
/// number of targets that are not ignored.
pub fn vocab_parallel_cross_entropy(
    logits: &Tensor,
    targets: &Tensor,
    label_smoothing: f64,
    tp: &TensorParallel,
) -> Result<Tensor> {
    let shape = logits.size();
    ensure!(!shape.is_empty(), "vocab-parallel cross-entropy: logits must have a vocabulary dimension");
    let (tokens, local) = (&shape[..shape.len() - 1], shape[shape.len() - 1]);
    ensure!(
        targets.size() == tokens,
        "vocab-parallel cross-entropy: targets have shape {:?}, expected {tokens:?} (the logits' {shape:?} without \
         the vocabulary)",
        targets.size()
    );
    ensure!(
        targets.kind() == Kind::Int64,
        "vocab-parallel cross-entropy: targets must be int64, got {:?}",
        targets.kind()
    );
    ensure!(
        (0.0..1.0).contains(&label_smoothing),
        "vocab-parallel cross-entropy: label smoothing must be in [0, 1), got {label_smoothing}"
    );
    let vocab = local * tp.size();
    let ignored = targets.f_eq(IGNORE_INDEX)?;
    if targets.numel() > 0 {
        let kept = targets.f_masked_select(&ignored.f_logical_not()?)?;
        if kept.numel() > 0 {
            let (lo, hi) = (kept.f_min()?.int64_value(&[]), kept.f_max()?.int64_value(&[]));
            ensure!(
                lo >= 0 && hi < vocab,
                "vocab-parallel cross-entropy: targets range over {lo}..={hi}, outside the vocabulary 0..{vocab} \
                 ({local} per rank x {} ranks; {IGNORE_INDEX} is ignored)",
                tp.size()
            );
        }
    }
    let logits = logits.f_to_kind(Kind::Float)?;
    // The max over the whole vocabulary keeps exp() finite; it is a constant shift of every
    // logit of a token, so it needs no gradient.
    let max = logits.detach().f_amax([-1], true)?;
    tp.all_reduce_(&max, ReduceOp::Max)?;
    let shifted = logits.f_sub(&max)?;
    let start = tp.rank() * local;
    let mine = targets.f_ge(start)?.f_logical_and(&targets.f_lt(start + local)?)?;
    let index = targets.f_sub_scalar(start)?.f_masked_fill(&mine.f_logical_not()?, 0)?.f_unsqueeze(-1)?;
    let picked = shifted.f_gather(-1, &index, false)?.f_squeeze_dim(-1)?.f_masked_fill(&mine.f_logical_not()?, 0.0)?;
    let sum_exp = shifted.f_exp()?.f_sum_dim_intlist(&[-1i64][..], false, Kind::Float)?;
    // One all-reduce for every per-token sum the loss needs.
    let mut parts = vec![sum_exp, picked];
    if label_smoothing > 0.0 {
        parts.push(shifted.f_sum_dim_intlist(&[-1i64][..], false, Kind::Float)?);
    }
    let sums = tp.reduce_from(&Tensor::f_stack(&parts, 0)?)?;
    let log_z = sums.get(0).f_log()?;
    let mut loss = log_z.f_sub(&sums.get(1))?;
    if label_smoothing > 0.0 {
        let uniform = log_z.f_sub(&sums.get(2).f_div_scalar(vocab as f64)?)?;
        loss = loss.f_mul_scalar(1.0 - label_smoothing)?.f_add(&uniform.f_mul_scalar(label_smoothing)?)?;
    }
    Ok(loss.f_masked_fill(&ignored, 0.0)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Reduction};

    /// One process: equals PyTorch's cross-entropy, values and gradients, with an ignored
    /// target and label smoothing, and with logits far from zero (the max shift keeps it finite).
    #[test]
    fn one_process_equals_pytorch() {
        let logits = Tensor::randn([6, 10], (Kind::Float, Device::Cpu)) * 20.0 + 500.0;
        let targets = Tensor::from_slice(&[3i64, 0, IGNORE_INDEX, 9, 9, 1]);
        for smoothing in [0.0, 0.2] {
            let a = logits.detach().copy().set_requires_grad(true);
            let want = a.cross_entropy_loss::<Tensor>(&targets, None, Reduction::Mean, IGNORE_INDEX, smoothing);
            want.backward();
            let b = logits.detach().copy().set_requires_grad(true);
            let got = vocab_parallel_cross_entropy(&b, &targets, smoothing, &TensorParallel::none()).unwrap();
            let got = got.sum(Kind::Float) / 5.0;
            got.backward();
            assert!(got.allclose(&want, 1e-5, 1e-5, false), "loss {got:?} vs {want:?}");
            assert!(b.grad().allclose(&a.grad(), 1e-5, 1e-6, false), "gradient, smoothing {smoothing}");
        }
        let err = vocab_parallel_cross_entropy(&logits, &targets.narrow(0, 0, 3), 0.0, &TensorParallel::none())
            .unwrap_err()
            .to_string();
        assert!(err.contains("targets have shape [3], expected [6]"), "{err}");
    }
}
