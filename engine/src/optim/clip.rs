//! Global gradient-norm clipping, correct under data parallelism and ZeRO.
use tch::Kind;

use super::Param;
use crate::dist::{ProcessGroup, ReduceOp};
use crate::Result;

/// Scales every gradient so that the norm of all gradients together is at most `max_norm`,
/// and returns that norm before clipping (as `torch.nn.utils.clip_grad_norm_`). `sharded` is
/// the group over which the gradients are partitioned (ZeRO-2: each rank holds the gradients
/// of the parameters it owns), so the squares are summed across it; with replicated
/// gradients (plain data parallelism, ZeRO-1) pass `None`. A non-finite norm is returned
/// without clipping.
pub fn clip_grad_norm(params: &[Param], max_norm: f64, sharded: Option<&ProcessGroup>) -> Result<f64> {
    let mut sum = tch::Tensor::f_zeros([1], (Kind::Double, tch::Device::Cpu))?;
    for p in params {
        let g = p.tensor.grad();
        if g.defined() {
            let sq = g.f_to_kind(Kind::Double)?.f_square()?.f_sum(Kind::Double)?.f_to_device(tch::Device::Cpu)?;
            sum = sum.f_add(&sq)?;
        }
    }
    if let Some(group) = sharded {
        group.all_reduce(&sum, ReduceOp::Sum)?;
    }
    let norm = sum.f_double_value(&[0])?.sqrt();
    let coef = max_norm / (norm + 1e-6);
    if norm.is_finite() && coef < 1.0 {
        tch::no_grad(|| -> Result<()> {
            for p in params {
                let mut g = p.tensor.grad();
                if g.defined() {
                    let _ = g.f_mul_scalar_(coef)?;
                }
            }
            Ok(())
        })?;
    }
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    #[test]
    fn clips_to_the_global_norm() {
        let a = Tensor::from_slice(&[3.0f32]).set_requires_grad(true);
        let b = Tensor::from_slice(&[0.0f32, 0.0]).set_requires_grad(true);
        ((&a * 1.0).sum(Kind::Float) + (&b * Tensor::from_slice(&[4.0f32, 0.0])).sum(Kind::Float)).backward();
        let params = [Param::new("a", &a), Param::new("b", &b)];
        // Gradients (1) and (4, 0): norm sqrt(17).
        let norm = clip_grad_norm(&params, 1.0, None).unwrap();
        assert!((norm - 17f64.sqrt()).abs() < 1e-6);
        let clipped = clip_grad_norm(&params, 10.0, None).unwrap();
        assert!((clipped - 1.0).abs() < 1e-5, "after clipping the norm is max_norm: {clipped}");
        assert!((clip_grad_norm(&params, 10.0, None).unwrap() - clipped).abs() < 1e-9, "below max: unchanged");
    }
}
