//! SUMMA (van de Geijn and Watts 1997), the matrix product of 2D and 2.5D tensor parallelism
//! as Optimus uses it. With `X` and `W^T` both cut into `q x q` blocks, rank `(i, j)` computes
//! `Y_ij = sum_k X_ik W^T_kj` in `q` steps: in step `k` the rank in column `k` broadcasts its
//! `X_ik` along row `i`, the rank in row `k` broadcasts its `W^T_kj` along column `j`, and
//! every rank adds one local product. Backward is two more SUMMAs: `dX_ik = sum_j dY_ij W_kj`
//! (broadcast `W` down columns, reduce the partial products along the row into column `k`)
//! and `dW^T_kj = sum_i X_ik^T dY_ij` (broadcast `X` along rows, reduce down the column into
//! row `k`). Only the local blocks are kept for backward: no rank ever holds a gathered row of
//! `X` or column of `W`, which is what 2D parallelism buys over all-gathering them.
use tch::Tensor;

use super::comm;
use super::grid::Grid;
use crate::autograd::function::{apply, Forward};
use crate::Result;

/// `x W^T` for this rank's blocks: `x [.., in/q]` (batch block `row`, features block `col`)
/// and `w [out/q, in/q]`, this rank's block of the PyTorch-layout weight (output block `col`,
/// input block `row`). The result is the `[.., out/q]` block in the layout of `x`.
pub(super) fn summa_linear(x: &Tensor, w: &Tensor, grid: &Grid) -> Result<Tensor> {
    let mut lead = x.size();
    lead.pop();
    let (out_q, in_q) = (w.size()[0], w.size()[1]);
    let x2 = x.f_reshape([-1, in_q])?;
    let (row, col) = (grid.row_group().clone(), grid.col_group().clone());
    let (_, r, c) = grid.coords();
    let q = grid.q();
    let out = apply(
        "2D linear (SUMMA)",
        &[&x2, w],
        |i| {
            let (x, w) = (&i[0], &i[1]);
            let mut y = Tensor::f_zeros([x.size()[0], out_q], (x.kind(), x.device()))?;
            for k in 0..q {
                let a = if c == k { x.shallow_clone() } else { x.f_empty_like()? };
                comm::broadcast(&a, k, grid.row_group())?;
                let b = if r == k { w.shallow_clone() } else { w.f_empty_like()? };
                comm::broadcast(&b, k, grid.col_group())?;
                y = y.f_add(&a.f_matmul(&b.f_tr()?)?)?;
            }
            Ok(Forward { outputs: vec![y], saved: vec![x.shallow_clone(), w.shallow_clone()], ..Forward::default() })
        },
        move |grads, saved| {
            let (dy, x, w) = (&grads[0], &saved[0], &saved[1]);
            let mut dx = None;
            for k in 0..q {
                let b = if r == k { w.shallow_clone() } else { w.f_empty_like()? };
                comm::broadcast(&b, k, &col)?;
                let part = dy.f_matmul(&b)?;
                comm::reduce(&part, k, &row)?;
                if c == k {
                    dx = Some(part);
                }
            }
            let mut dw = None;
            let dy_t = dy.f_tr()?;
            for k in 0..q {
                let a = if c == k { x.shallow_clone() } else { x.f_empty_like()? };
                comm::broadcast(&a, k, &row)?;
                let part = dy_t.f_matmul(&a)?;
                comm::reduce(&part, k, &col)?;
                if r == k {
                    dw = Some(part);
                }
            }
            Ok(vec![dx, dw])
        },
    )?;
    lead.push(out_q);
    Ok(out[0].f_reshape(&lead)?)
}
