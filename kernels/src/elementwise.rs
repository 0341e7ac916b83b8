//! Element-wise fusions after a linear layer whose bias is left out of the matmul:
//! `gelu(x + bias)` and `residual + dropout(x + bias)`.
use tch::{Device, Kind, Tensor};

use crate::checks::{ceil_div, elementwise, grid_blocks, quads, vector_width, with_grad};
use crate::error::ensure;
use crate::kernel::{Args, Kernel};
use crate::launch::Target;
use crate::{Backend, Result};

pub(crate) static KERNEL: Kernel = Kernel::new(
    "elementwise",
    include_str!("cuda/elementwise.cu"),
    &[
        "bias_gelu_forward_f32",
        "bias_gelu_forward_bf16",
        "bias_gelu_forward_f16",
        "bias_gelu_backward_f32",
        "bias_gelu_backward_bf16",
        "bias_gelu_backward_f16",
        "bias_dropout_residual_forward_f32",
        "bias_dropout_residual_forward_bf16",
        "bias_dropout_residual_forward_f16",
        "dropout_backward_f32",
        "dropout_backward_bf16",
        "dropout_backward_f16",
    ],
    &[],
);

pub(crate) fn check_bias(op: &str, x: &Tensor, bias: &Tensor) -> Result<i64> {
    let c = *x.size().last().unwrap_or(&0);
    ensure!(
        bias.size() == [c],
        "{op}: bias is {:?}, expected [{c}] (the last dimension of x {:?})",
        bias.size(),
        x.size()
    );
    Ok(c)
}

/// The bias's gradient: `dx` summed over every dimension but the last (in f32), as `kind`.
/// Where `dx` is of `kind` already, one reduction into it: libtorch's sum of bf16 or f16
/// accumulates in f32 and rounds once, as the f32 sum and a conversion do, in one launch, not
/// two.
pub(crate) fn bias_grad(dx: &Tensor, cols: i64, kind: Kind) -> tch::Result<Tensor> {
    let rows = dx.f_reshape([-1, cols])?;
    match dx.kind() == kind {
        true => rows.f_sum_dim_intlist(0, false, kind),
        false => rows.f_sum_dim_intlist(0, false, Kind::Float)?.f_to_kind(kind),
    }
}

/// Threads per block of the bias + GELU kernels.
const GELU_THREADS: u32 = 256;
/// Vectors each thread of the bias + GELU kernels loads per trip of its grid-stride loop
/// (`GELU_VECTORS` in elementwise.cu).
const GELU_VECTORS: i64 = 4;

/// Launches `bias_gelu_{forward,backward}_{suffix}` over `n` elements moved `width` at a time:
/// enough blocks for each thread's first trip, at most as many as the device holds at once.
fn launch_gelu(function: &str, at: Target, n: i64, width: i64, args: &mut Args) -> Result<()> {
    let needed = ceil_div(n / width, GELU_VECTORS * GELU_THREADS as i64).clamp(1, u32::MAX as i64) as u32;
    let grid = needed.min(KERNEL.resident_blocks(function, at, GELU_THREADS)?.max(1));
    KERNEL.launch(function, at, (grid, 1, 1), GELU_THREADS, args)
}

/// `gelu(x + bias)` (the exact, erf form) with `bias` the size of the last dimension of `x`.
pub fn bias_gelu(x: &Tensor, bias: &Tensor, backend: Backend) -> Result<Tensor> {
    const OP: &str = "bias_gelu";
    check_bias(OP, x, bias)?;
    if backend == Backend::Torch {
        return Ok(x.f_add(bias)?.f_gelu("none")?);
    }
    let x = x.f_contiguous()?;
    let b = bias.f_contiguous()?;
    let (at, suffix, cols, n) = elementwise(OP, &[("x", &x), ("bias", &b)])?;
    let y = x.f_empty_like()?;
    if n > 0 {
        let width = vector_width(cols, &[&x, &b, &y]);
        let mut a = Args::default().tensor(&x).tensor(&b).tensor(&y).i64(n).i32(cols as i32).i32(width as i32);
        launch_gelu(&format!("bias_gelu_forward_{suffix}"), at, n, width, &mut a)?;
    }
    let outputs = with_grad(OP, &[&x, bias], vec![y], vec![x.shallow_clone(), b], move |grads, saved| {
        let [x, b] = saved else { unreachable!("two tensors saved") };
        let dy = grads[0].f_contiguous()?;
        let dx = x.f_empty_like()?;
        if n > 0 {
            let width = vector_width(cols, &[x, b, &dy, &dx]);
            let a = Args::default().tensor(x).tensor(b).tensor(&dy).tensor(&dx);
            let mut a = a.i64(n).i32(cols as i32).i32(width as i32);
            launch_gelu(&format!("bias_gelu_backward_{suffix}"), at, n, width, &mut a)?;
        }
        let db = bias_grad(&dx, cols, b.kind())?;
        Ok(vec![Some(dx), Some(db)])
    })?;
    Ok(outputs.into_iter().next().expect("one output"))
}

/// A dropout keep-mask: 1 (keep) with probability `1 - p`, else 0, one byte per element, drawn
/// from libtorch's generator of `device` (so both backends, and activation checkpointing's
/// recomputation, see the same mask).
pub fn dropout_mask(shape: &[i64], p: f64, device: Device) -> Result<Tensor> {
    ensure!((0.0..1.0).contains(&p), "dropout probability {p} is outside [0, 1)");
    Ok(Tensor::f_empty(shape, (Kind::Uint8, device))?.f_bernoulli_float_(1.0 - p)?)
}

/// `residual + dropout(x + bias)`: with `train` and `p > 0` the elements are kept with
/// probability `1 - p` and scaled by `1 / (1 - p)`; otherwise `residual + x + bias`.
pub fn bias_dropout_residual(
    x: &Tensor,
    bias: &Tensor,
    residual: &Tensor,
    p: f64,
    train: bool,
    backend: Backend,
) -> Result<Tensor> {
    const OP: &str = "bias_dropout_residual";
    check_bias(OP, x, bias)?;
    ensure!(residual.size() == x.size(), "{OP}: residual is {:?}, x is {:?}", residual.size(), x.size());
    let keep = if train && p > 0.0 { Some(dropout_mask(&x.size(), p, x.device())?) } else { None };
    let scale = 1.0 / (1.0 - p);
    if backend == Backend::Torch {
        let v = x.f_add(bias)?;
        let v = match &keep {
            Some(k) => v.f_mul(k)?.f_mul_scalar(scale)?,
            None => v,
        };
        return Ok(residual.f_add(&v)?);
    }
    let x = x.f_contiguous()?;
    let b = bias.f_contiguous()?;
    let r = residual.f_contiguous()?;
    let (at, suffix, cols, n) = elementwise(OP, &[("x", &x), ("bias", &b), ("residual", &r)])?;
    let y = x.f_empty_like()?;
    let grid = (grid_blocks(ceil_div(n, 4)), 1, 1);
    if n > 0 {
        let vec = quads(cols, &[&x, &b, &r, &y, keep.as_ref().unwrap_or(&Tensor::new())]);
        let mut a = Args::default()
            .tensor(&x)
            .tensor(&b)
            .tensor(&r)
            .opt(keep.as_ref())
            .tensor(&y)
            .i64(n)
            .i32(cols as i32)
            .f32(scale as f32)
            .i32(vec.into());
        KERNEL.launch(&format!("bias_dropout_residual_forward_{suffix}"), at, grid, 256, &mut a)?;
    }
    let bias_kind = b.kind();
    let saved: Vec<Tensor> = keep.into_iter().collect();
    let outputs = with_grad(OP, &[&x, bias, residual], vec![y], saved, move |grads, saved| {
        let dy = grads[0].f_contiguous()?;
        let dx = if let (Some(keep), true) = (saved.first(), n > 0) {
            let dx = dy.f_empty_like()?;
            let vec = quads(cols, &[&dy, keep, &dx]);
            let mut a = Args::default().tensor(&dy).tensor(keep).tensor(&dx).i64(n).f32(scale as f32).i32(vec.into());
            KERNEL.launch(&format!("dropout_backward_{suffix}"), at, grid, 256, &mut a)?;
            dx
        } else {
            dy.shallow_clone()
        };
        let db = bias_grad(&dx, cols, bias_kind)?;
        Ok(vec![Some(dx), Some(db), Some(dy)])
    })?;
    Ok(outputs.into_iter().next().expect("one output"))
}
