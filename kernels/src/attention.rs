//! Evoformer attention's softmax: `softmax(x * scale + 1e9 (mask - 1) + bias)` over the keys,
//! AlphaFold's masking convention, fused into one kernel forward and one backward.
use tch::{Kind, Tensor};

use crate::checks::{dtype, launch_rows, quads, row_kernel_functions, rows_cols, target, with_grad};
use crate::error::ensure;
use crate::kernel::{Args, Kernel};
use crate::launch::Target;
use crate::{Backend, Result};

pub(crate) static KERNEL: Kernel = Kernel::new(
    "attention_softmax",
    include_str!("cuda/softmax.cu"),
    row_kernel_functions!(plain: [], rows: ["attention_softmax_forward", "attention_softmax_backward"]),
    &[],
);

const OP: &str = "attention_softmax";

/// Attention weights from logits `x` `[batch, heads, queries, keys]`: scaled by `scale`,
/// masked by `mask` `[batch, keys]` (1 keeps a key, 0 drops it: `1e9 (mask - 1)` is added), and
/// biased by `bias` `[heads, queries, keys]` (a pair bias shared across the batch) or
/// `[batch, heads, queries, keys]`; softmax over the keys. Differentiable in `x` and `bias`.
pub fn attention_softmax(
    x: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    bias: Option<&Tensor>,
    backend: Backend,
) -> Result<Tensor> {
    check_shapes(x, mask, bias)?;
    match backend {
        Backend::Torch => composition(x, scale, mask, bias),
        Backend::Fused => fused(x, scale, mask, bias),
    }
}

/// [`attention_softmax`] written over the logits `x` (contiguous, outside autograd): with the
/// fused kernels inference then never holds the logits and the weights together, at the
/// Evoformer's sizes the two largest buffers of an attention. Each row is read whole, by the
/// threads that then write it, before its weights are written, so the result is
/// `attention_softmax`'s bit for bit.
pub fn attention_softmax_in_place(
    x: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    bias: Option<&Tensor>,
    backend: Backend,
) -> Result<()> {
    check_shapes(x, mask, bias)?;
    ensure!(x.is_contiguous(), "{OP}: in place needs contiguous logits, got strides {:?}", x.stride());
    ensure!(
        !x.requires_grad() && !bias.is_some_and(|t| t.requires_grad()),
        "{OP}: in place is for inference; its logits or bias require gradients"
    );
    match backend {
        // The reference computes the weights aside and copies them over: libtorch's
        // inference runs its scaled-dot-product kernel instead (fastfold's `forward_sdpa`).
        Backend::Torch => {
            let mut out = x.shallow_clone();
            out.f_copy_(&composition(x, scale, mask, bias)?)?;
            Ok(())
        }
        Backend::Fused => {
            let (mask, bias) = fused_operands(x, mask, bias)?;
            launch_forward(x, scale, mask.as_ref(), bias.as_ref(), x)?;
            Ok(())
        }
    }
}

fn check_shapes(x: &Tensor, mask: Option<&Tensor>, bias: Option<&Tensor>) -> Result<()> {
    let [b, h, q, k] = x.size()[..] else {
        return Err(crate::Error::invalid(format!(
            "{OP}: x is {:?}, expected [batch, heads, queries, keys]",
            x.size()
        )));
    };
    if let Some(m) = mask {
        ensure!(m.size() == [b, k], "{OP}: mask is {:?}, expected [batch, keys] = [{b}, {k}]", m.size());
    }
    if let Some(bias) = bias {
        let s = bias.size();
        ensure!(
            s == [h, q, k] || s == [b, h, q, k],
            "{OP}: bias is {s:?}, expected [heads, queries, keys] = [{h}, {q}, {k}] or [batch, heads, queries, keys]"
        );
    }
    Ok(())
}

/// The libtorch composition.
fn composition(x: &Tensor, scale: f64, mask: Option<&Tensor>, bias: Option<&Tensor>) -> Result<Tensor> {
    let mut z = x.f_mul_scalar(scale)?;
    if let Some(m) = mask {
        let (b, k) = m.size2()?;
        z = z.f_add(&m.f_to_kind(x.kind())?.f_sub_scalar(1.0)?.f_mul_scalar(1e9)?.f_reshape([b, 1, 1, k])?)?;
    }
    if let Some(bias) = bias {
        z = z.f_add(bias)?;
    }
    Ok(z.f_softmax(-1, None::<Kind>)?)
}

/// The mask in the logits' kind and the bias, contiguous, as the kernels read them.
fn fused_operands(
    x: &Tensor,
    mask: Option<&Tensor>,
    bias: Option<&Tensor>,
) -> Result<(Option<Tensor>, Option<Tensor>)> {
    let mask = mask.map(|m| m.f_to_kind(x.kind())?.f_contiguous()).transpose()?;
    let bias = bias.map(|t| t.f_contiguous()).transpose()?;
    Ok((mask, bias))
}

/// The forward kernel from contiguous `x` into `y` (which may be `x`); where it ran and the
/// kernels' dtype suffix, for the backward.
fn launch_forward(
    x: &Tensor,
    scale: f64,
    mask: Option<&Tensor>,
    bias: Option<&Tensor>,
    y: &Tensor,
) -> Result<(Target, &'static str)> {
    let mut args = vec![("x", x)];
    args.extend(mask.map(|m| ("mask", m)));
    args.extend(bias.map(|t| ("bias", t)));
    let at = target(OP, Some(x.kind()), &args)?;
    let suffix = dtype(OP, "x", x)?;
    let size = x.size();
    let (rows, cols) = rows_cols(OP, x)?;
    let per_batch = size[1] * size[2];
    let bias_rows = bias.map_or(0, |t| t.numel() as i64 / cols.max(1));
    if rows > 0 && cols > 0 {
        let none = Tensor::new();
        let vec = quads(cols, &[x, mask.unwrap_or(&none), bias.unwrap_or(&none), y]);
        let a = Args::default().tensor(x).opt(mask).opt(bias).tensor(y);
        let a = a.i64(rows).i32(cols as i32).i64(per_batch).i64(bias_rows);
        let mut a = a.f32(scale as f32).i32(vec.into());
        launch_rows(&KERNEL, "attention_softmax_forward", suffix, at, (rows, cols), &mut a)?;
    }
    Ok((at, suffix))
}

fn fused(x: &Tensor, scale: f64, mask: Option<&Tensor>, bias: Option<&Tensor>) -> Result<Tensor> {
    let x = x.f_contiguous()?;
    let (mask, bias_c) = fused_operands(&x, mask, bias)?;
    let y = x.f_empty_like()?;
    let (at, suffix) = launch_forward(&x, scale, mask.as_ref(), bias_c.as_ref(), &y)?;
    let (rows, cols) = rows_cols(OP, &x)?;
    // The gradient flows to x and the bias (the mask is a constant).
    let mut inputs = vec![&x];
    inputs.extend(bias);
    let bias_shared = bias.is_some_and(|t| t.dim() == 3);
    let bias_grad = bias.is_some_and(|t| t.requires_grad());
    let n_inputs = inputs.len();
    let outputs = with_grad(OP, &inputs, vec![y.shallow_clone()], vec![y], move |grads, saved| {
        let y = &saved[0];
        let dy = grads[0].f_contiguous()?;
        let dx = y.f_empty_like()?;
        let dlogits = if bias_grad { Some(y.f_empty_like()?) } else { None };
        if rows > 0 && cols > 0 {
            let vec = quads(cols, &[y, &dy, &dx, dlogits.as_ref().unwrap_or(&Tensor::new())]);
            let a = Args::default().tensor(y).tensor(&dy).tensor(&dx).opt(dlogits.as_ref());
            let mut a = a.i64(rows).i32(cols as i32).f32(scale as f32).i32(vec.into());
            launch_rows(&KERNEL, "attention_softmax_backward", suffix, at, (rows, cols), &mut a)?;
        }
        let mut out: Vec<Option<Tensor>> = (0..n_inputs).map(|_| None).collect();
        out[0] = Some(dx);
        if let Some(d) = dlogits {
            // A bias shared across the batch gets the sum of every batch element's gradient.
            out[1] = Some(if bias_shared { d.f_sum_dim_intlist(0, false, None::<Kind>)? } else { d });
        }
        Ok(out)
    })?;
    Ok(outputs.into_iter().next().expect("one output"))
}
