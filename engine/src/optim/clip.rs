//! Global gradient-norm clipping and loss-scale unscaling, correct under data parallelism and
//! ZeRO, with one device-to-host transfer per call: the per-tensor work (scaling, squares)
//! stays on the device, the squares are summed there, and only that one number crosses.
use tch::{Device, Kind, Tensor};

use super::Param;
use crate::dist::{ProcessGroup, ReduceOp};
use crate::Result;

/// How the gradients a rank holds relate to the other ranks' (what their norm is reduced
/// over).
#[derive(Clone, Copy)]
pub enum Held<'a> {
    /// Only this process.
    Local,
    /// Every rank holds the same gradients (data parallelism after the all-reduce, ZeRO-1
    /// without master shards). Reduced with a max, which leaves equal values exact and makes
    /// every rank take the same decision even if they somehow differed.
    Replicated(&'a ProcessGroup),
    /// Each rank holds a disjoint part (ZeRO-2, or sharded master weights): squares are summed.
    Sharded(&'a ProcessGroup),
}

/// Multiplies every gradient by `scale` (skipped when 1), then returns the L2 norm of all
/// gradients together, reduced as `held` says: one fused reduction and one host sync (and
/// before it one sum over the tensor-parallel group of the shards' squares, where parameters
/// are split: see `Param::split_over`). A gradient holding inf or NaN makes the norm
/// non-finite (squares cannot cancel).
pub fn scaled_grad_norm(params: &[Param], scale: f64, held: Held) -> Result<f64> {
    reduce_square_sum(local_square_sum(params, scale)?, held)
}

/// The first half of [`scaled_grad_norm`]: scales the gradients and sums their squares on this
/// rank (tensor-parallel shards summed over their group), `[1]` f64 on the host.
pub(crate) fn local_square_sum(params: &[Param], scale: f64) -> Result<Tensor> {
    // Whole parameters and tensor-parallel shards are summed apart: a shard's squares are
    // summed over its group (each shard once), a whole parameter's counted once as it is.
    let (whole, split): (Vec<&Param>, Vec<&Param>) = params.iter().partition(|p| p.split_over.is_none());
    let mut sum = sum_of_squares(&whole, scale)?;
    if let Some(group) = split.first().and_then(|p| p.split_over.as_ref()) {
        crate::error::ensure!(
            split.iter().all(|p| p.split_over.as_ref().map(|g| g.global_ranks()) == Some(group.global_ranks())),
            "gradient norm: the tensor-parallel shards are split over different groups"
        );
        let shards = sum_of_squares(&split, scale)?;
        group.all_reduce(&shards, ReduceOp::Sum)?;
        sum = sum.f_add(&shards)?;
    }
    Ok(sum)
}

/// The second half of [`scaled_grad_norm`]: a rank's sum of squares (`[1]` f64 on the host)
/// reduced as `held` says, and its square root.
pub(crate) fn reduce_square_sum(sum: Tensor, held: Held) -> Result<f64> {
    match held {
        Held::Local => {}
        Held::Replicated(g) => g.all_reduce(&sum, ReduceOp::Max)?,
        Held::Sharded(g) => g.all_reduce(&sum, ReduceOp::Sum)?,
    }
    Ok(sum.f_double_value(&[0])?.sqrt())
}

/// The coefficient [`clip_to`] scales gradients by for a global `norm`, or None when it would
/// leave them as they are (a norm within `max_norm`, or a non-finite one).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Option<f64> {
    let coef = max_norm / (norm + 1e-6);
    (norm.is_finite() && coef < 1.0).then_some(coef)
}

/// Elements taken to f64 at a time by [`square_sum`]: a 32 MiB copy. A Gemini chunk's gradient
/// (up to 32M elements, on a GPU whose budget the placement has planned to the last block)
/// would otherwise take an f64 copy of 256 MiB, and its squares as much again.
const SQUARE_SLICE: i64 = 1 << 22;

/// The sum of the squares of `t` in f64, a 0-d tensor where `t` lives, over slices of at most
/// [`SQUARE_SLICE`] elements (each slice's dot product with itself: no second copy for the
/// squares), so that the f64 memory stays small whatever the tensor's size.
pub(crate) fn square_sum(t: &Tensor) -> Result<Tensor> {
    let flat = t.f_reshape([-1])?;
    let n = flat.numel() as i64;
    let slice = |at: i64, len: i64| -> Result<Tensor> {
        let x = flat.f_narrow(0, at, len)?.f_to_kind(Kind::Double)?;
        Ok(x.f_dot(&x)?)
    };
    let mut sum = slice(0, SQUARE_SLICE.min(n))?;
    for at in (SQUARE_SLICE..n).step_by(SQUARE_SLICE as usize) {
        sum = sum.f_add(&slice(at, SQUARE_SLICE.min(n - at))?)?;
    }
    Ok(sum)
}

/// Multiplies the gradients of `params` by `scale` (skipped when 1) and returns the sum of
/// their squares, `[1]` in f64 on the host.
fn sum_of_squares(params: &[&Param], scale: f64) -> Result<Tensor> {
    let grads: Vec<(Tensor, usize)> =
        params.iter().map(|p| (p.tensor.grad(), p.copies)).filter(|(g, _)| g.defined()).collect();
    let mut squares: Vec<Tensor> = Vec::with_capacity(grads.len());
    tch::no_grad(|| -> Result<()> {
        for (g, copies) in &grads {
            if scale != 1.0 {
                let _ = g.shallow_clone().f_mul_scalar_(scale)?;
            }
            let square = square_sum(g)?;
            // A shard on several ranks of its group counts once in the group's sum.
            squares.push(if *copies > 1 { square.f_div_scalar(*copies as f64)? } else { square });
        }
        Ok(())
    })?;
    // Per device one sum (normally one device); the transfer to the host is the only sync.
    let mut sum = Tensor::f_zeros([1], (Kind::Double, Device::Cpu))?;
    let mut devices: Vec<Device> = Vec::new();
    for t in &squares {
        if !devices.contains(&t.device()) {
            devices.push(t.device());
        }
    }
    for d in devices {
        let on: Vec<&Tensor> = squares.iter().filter(|t| t.device() == d).collect();
        sum = sum.f_add(&Tensor::f_stack(&on, 0)?.f_sum(Kind::Double)?.f_to_device(Device::Cpu)?)?;
    }
    Ok(sum)
}

/// Scales every gradient so that the global `norm` (from [`scaled_grad_norm`]) becomes at most
/// `max_norm`, as `torch.nn.utils.clip_grad_norm_` does; a non-finite norm clips nothing.
pub fn clip_to(params: &[Param], norm: f64, max_norm: f64) -> Result<()> {
    if let Some(coef) = clip_coefficient(norm, max_norm) {
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
    Ok(())
}

/// Scales every gradient so that the norm of all gradients together is at most `max_norm`,
/// and returns that norm before clipping (as `torch.nn.utils.clip_grad_norm_`). `sharded` is
/// the group over which the gradients are partitioned (ZeRO-2: each rank holds the gradients
/// of the parameters it owns), so the squares are summed across it; with replicated
/// gradients (plain data parallelism, ZeRO-1) pass `None`. A non-finite norm is returned
/// without clipping.
pub fn clip_grad_norm(params: &[Param], max_norm: f64, sharded: Option<&ProcessGroup>) -> Result<f64> {
    let norm = scaled_grad_norm(params, 1.0, sharded.map_or(Held::Local, Held::Sharded))?;
    clip_to(params, norm, max_norm)?;
    Ok(norm)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Tensor;

    #[test]
    fn squares_are_summed_in_slices_to_the_whole_sum() {
        // Two whole slices and a partial one, values whose squares an f32 sum would round.
        let n = 2 * SQUARE_SLICE + 5;
        let t = (Tensor::arange(n, (Kind::Float, tch::Device::Cpu)) * 1e-3 + 1.0).reshape([n, 1]);
        let exact: f64 = (0..n).map(|i| (i as f32 * 1e-3 + 1.0) as f64).map(|x| x * x).sum();
        let got = square_sum(&t).unwrap().double_value(&[]);
        assert!((got - exact).abs() <= 1e-12 * exact, "{got} against {exact}");
        assert_eq!(square_sum(&Tensor::zeros([0, 3], (Kind::Float, tch::Device::Cpu))).unwrap().double_value(&[]), 0.0);
        // An f64 tensor is read, not squared in place.
        let d = Tensor::from_slice(&[3.0f64, 4.0]);
        assert_eq!(square_sum(&d).unwrap().double_value(&[]), 25.0);
        assert_eq!(Vec::<f64>::try_from(&d).unwrap(), [3.0, 4.0]);
    }

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
