//! LayerNorm over the last dimension, one warp per row forward and backward (one block per row
//! past 1,024 elements), and a layer with the parameter names of `torch.nn.LayerNorm`
//! (`weight`, `bias`).
use tch::{nn, Kind, Tensor};

use crate::checks::{ceil_div, dtype, launch_rows, quads, row_kernel_functions, rows_cols, target_rows, with_grad};
use crate::error::ensure;
use crate::kernel::{Args, Kernel};
use crate::{Backend, Result};

pub(crate) static KERNEL: Kernel = Kernel::new(
    "layer_norm",
    include_str!("cuda/layer_norm.cu"),
    row_kernel_functions!(
        plain: ["layer_norm_backward_params", "layer_norm_backward_params_total"],
        rows: ["layer_norm_forward", "layer_norm_backward_input"]
    ),
    &[],
);

const OP: &str = "layer_norm";

/// `(x - mean) / sqrt(var + eps) * weight + bias` over the last dimension of `x`, with
/// `weight` and `bias` of that size. Differentiable in all three.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64, backend: Backend) -> Result<Tensor> {
    let c = *x.size().last().unwrap_or(&0);
    ensure!(
        weight.size() == [c] && bias.size() == [c],
        "{OP}: weight {:?} and bias {:?} must be [{c}], the last dimension of x {:?}",
        weight.size(),
        bias.size(),
        x.size()
    );
    match backend {
        Backend::Torch => Ok(x.f_layer_norm([c], Some(weight), Some(bias), eps, false)?),
        Backend::Fused => fused(x, weight, bias, eps),
    }
}

fn fused(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    // Rows are read where they lie (a transposed MSA or pair, normalised for its column or
    // ending-node attention, without a copy of it first), forward and backward: the view is
    // what the backward keeps, not a copy of it.
    let (x, layout) = match row_layout(x) {
        Some(layout) => (x.shallow_clone(), Some(layout)),
        None => (x.f_contiguous()?, None),
    };
    let (w, b) = (weight.f_contiguous()?, bias.f_contiguous()?);
    let at = target_rows(OP, Some(x.kind()), &[("x", &x), ("weight", &w), ("bias", &b)], &["x"])?;
    let suffix = dtype(OP, "x", &x)?;
    let (rows, cols) = rows_cols(OP, &x)?;
    let y = Tensor::f_empty(x.size(), (x.kind(), x.device()))?;
    let stats = (Kind::Float, x.device());
    let mean = Tensor::f_empty([rows], stats)?;
    let rstd = Tensor::f_empty([rows], stats)?;
    let (inner, inner_stride, outer_stride) = layout.unwrap_or((rows, cols, rows * cols));
    // Vector accesses need every row's start aligned as the base pointer is.
    let rows_aligned = inner_stride % 4 == 0 && outer_stride % 4 == 0;
    if rows > 0 && cols > 0 {
        let vec = quads(cols, &[&x, &w, &b, &y]) && rows_aligned;
        let a = Args::default().tensor(&x).tensor(&w).tensor(&b).tensor(&y).tensor(&mean).tensor(&rstd);
        let a = a.i64(rows).i32(cols as i32).f32(eps as f32).i32(vec.into());
        let mut a = a.i64(inner).i64(inner_stride).i64(outer_stride);
        launch_rows(&KERNEL, "layer_norm_forward", suffix, at, (rows, cols), &mut a)?;
    }
    let saved = vec![x.shallow_clone(), w.shallow_clone(), mean, rstd];
    let outputs = with_grad(OP, &[&x, weight, bias], vec![y], saved, move |grads, saved| {
        let [x, w, mean, rstd] = saved else { unreachable!("four tensors saved") };
        let dy = grads[0].f_contiguous()?;
        // Contiguous whatever x's layout (autograd takes a view's gradient in any strides).
        let dx = Tensor::f_empty(x.size(), (x.kind(), x.device()))?;
        let (dw, db) = if rows > 0 && cols > 0 {
            let vec = quads(cols, &[x, w, &dy, &dx]) && rows_aligned;
            let a = Args::default().tensor(x).tensor(w).tensor(mean).tensor(rstd).tensor(&dy).tensor(&dx);
            let a = a.i64(rows).i32(cols as i32).i32(vec.into());
            let mut a = a.i64(inner).i64(inner_stride).i64(outer_stride);
            launch_rows(&KERNEL, "layer_norm_backward_input", suffix, at, (rows, cols), &mut a)?;
            // Partial column sums over blocks of rows, added up here.
            let per_part = ceil_div(rows, 256).max(1);
            let parts = ceil_div(rows, per_part);
            let dw_parts = Tensor::f_empty([parts, cols], (Kind::Float, x.device()))?;
            let db_parts = dw_parts.f_empty_like()?;
            let mut a = Args::default()
                .tensor(x)
                .tensor(mean)
                .tensor(rstd)
                .tensor(&dy)
                .tensor(&dw_parts)
                .tensor(&db_parts)
                .i32(rows as i32)
                .i32(cols as i32)
                .i32(per_part as i32)
                .i64(inner)
                .i64(inner_stride)
                .i64(outer_stride);
            let grid = (ceil_div(cols, 256) as u32, parts as u32, 1);
            KERNEL.launch(&format!("layer_norm_backward_params_{suffix}"), at, grid, 256, &mut a)?;
            let (dw, db) = (w.f_empty_like()?, w.f_empty_like()?);
            let a = Args::default().tensor(&dw_parts).tensor(&db_parts).tensor(&dw).tensor(&db);
            let mut a = a.i32(parts as i32).i32(cols as i32);
            let grid = (ceil_div(cols, 32) as u32, 1, 1);
            KERNEL.launch(&format!("layer_norm_backward_params_total_{suffix}"), at, grid, 256, &mut a)?;
            (dw, db)
        } else {
            (w.f_zeros_like()?, w.f_zeros_like()?)
        };
        Ok(vec![Some(dx), Some(dw), Some(db)])
    })?;
    Ok(outputs.into_iter().next().expect("one output"))
}

/// Where the rows of `x` [.., cols] start, as the forward kernels' `Rows` take it: `(inner,
/// inner_stride, outer_stride)` in elements, row r at `(r / inner) outer_stride + (r % inner)
/// inner_stride`. `None` unless each row's elements are adjacent and the leading dimensions
/// merge into at most two evenly spaced levels (any transpose of two leading dimensions does).
fn row_layout(x: &Tensor) -> Option<(i64, i64, i64)> {
    let (size, stride) = (x.size(), x.stride());
    let (&cols, lead) = size.split_last()?;
    if cols > 1 && stride[lead.len()] != 1 {
        return None;
    }
    // (size, stride) of each level, innermost first: a dimension continuing the level inside
    // it joins that level.
    let mut levels: Vec<(i64, i64)> = Vec::new();
    for (&n, &s) in lead.iter().zip(&stride).rev() {
        match levels.last_mut() {
            _ if n == 1 => {}
            Some((m, t)) if s == *m * *t => *m *= n,
            _ => levels.push((n, s)),
        }
    }
    match levels[..] {
        [] => Some((1, cols, cols)),
        [(n, s)] => Some((n, s, n * s)),
        [(n, s), (_, outer)] => Some((n, s, outer)),
        _ => None,
    }
}

/// LayerNorm over the last dimension with parameters `weight` (ones) and `bias` (zeros), as
/// `torch.nn.LayerNorm` names them, run by the chosen backend.
#[derive(Debug)]
pub struct LayerNorm {
    /// The scale.
    pub weight: Tensor,
    /// The shift.
    pub bias: Tensor,
    /// Added to the variance.
    pub eps: f64,
    /// Which implementation runs.
    pub backend: Backend,
}

impl LayerNorm {
    /// Creates `weight` and `bias` of size `width` under `p`.
    pub fn new(p: nn::Path, width: i64, eps: f64, backend: Backend) -> LayerNorm {
        LayerNorm {
            weight: p.var("weight", &[width], nn::Init::Const(1.0)),
            bias: p.var("bias", &[width], nn::Init::Const(0.0)),
            eps,
            backend,
        }
    }

    /// The layer applied to `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        layer_norm(x, &self.weight, &self.bias, self.eps, self.backend)
    }
}
