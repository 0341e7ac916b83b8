//! Sigmoid gates with their biases, `mask * (x + x_bias) * sigmoid(gate + gate_bias)`: the
//! gated projections of the triangle multiplicative update (AlphaFold's left and right
//! projections, masked by the pair mask and gated) and, without a mask, the Evoformer modules'
//! output gates. The linear layers run their matmuls without bias; this adds both biases, the
//! mask and the gate in one kernel forward and one backward, where the composition runs five
//! operations and keeps their intermediates.
use tch::Tensor;

use crate::checks::{elementwise, grid_blocks, with_grad};
use crate::elementwise::{bias_grad, check_bias};
use crate::error::ensure;
use crate::kernel::{Args, Kernel};
use crate::{Backend, Result};

pub(crate) static KERNEL: Kernel = Kernel::new(
    "gate",
    include_str!("cuda/gate.cu"),
    &[
        "sigmoid_gate_forward_f32",
        "sigmoid_gate_forward_bf16",
        "sigmoid_gate_forward_f16",
        "sigmoid_gate_backward_f32",
        "sigmoid_gate_backward_bf16",
        "sigmoid_gate_backward_f16",
    ],
    &[],
);

const OP: &str = "sigmoid_gate";

/// `mask * (x + x_bias) * sigmoid(gate + gate_bias)` with `x` and `gate` of one shape, the biases
/// the size of their last dimension, and `mask` (optional) the shape of `x` without its last
/// dimension. Differentiable in `x`, `gate` and both biases; the mask is data (no gradient).
pub fn sigmoid_gate(
    x: &Tensor,
    x_bias: &Tensor,
    gate: &Tensor,
    gate_bias: &Tensor,
    mask: Option<&Tensor>,
    backend: Backend,
) -> Result<Tensor> {
    ensure!(gate.size() == x.size(), "{OP}: gate is {:?}, x is {:?}", gate.size(), x.size());
    check_bias(OP, x, x_bias)?;
    check_bias(OP, gate, gate_bias)?;
    let shape = x.size();
    let rows_shape = &shape[..shape.len().saturating_sub(1)];
    if let Some(m) = mask {
        ensure!(
            m.size() == rows_shape,
            "{OP}: mask is {:?}, expected {rows_shape:?} (x {shape:?} without its last dimension)",
            m.size()
        );
    }
    if backend == Backend::Torch {
        let y = x.f_add(x_bias)?.f_mul(&gate.f_add(gate_bias)?.f_sigmoid()?)?;
        return Ok(match mask {
            Some(m) => y.f_mul(&m.f_unsqueeze(-1)?)?,
            None => y,
        });
    }
    let [x, xb, g, gb] = [x, x_bias, gate, gate_bias].map(Tensor::contiguous);
    let m = mask.map(|m| m.to_kind(x.kind()).contiguous());
    let mut named = vec![("x", &x), ("x_bias", &xb), ("gate", &g), ("gate_bias", &gb)];
    if let Some(m) = &m {
        named.push(("mask", m));
    }
    let (at, suffix, cols, n) = elementwise(OP, &named)?;
    let y = x.f_empty_like()?;
    if n > 0 {
        let mut a = Args::default()
            .tensor(&x)
            .tensor(&xb)
            .tensor(&g)
            .tensor(&gb)
            .opt(m.as_ref())
            .tensor(&y)
            .i64(n)
            .i32(cols as i32);
        KERNEL.launch(&format!("sigmoid_gate_forward_{suffix}"), at, (grid_blocks(n), 1, 1), 256, &mut a)?;
    }
    let bias_kind = xb.kind();
    let mut saved = vec![x.shallow_clone(), xb.shallow_clone(), g.shallow_clone(), gb.shallow_clone()];
    saved.extend(m);
    let outputs = with_grad(OP, &[&x, &xb, &g, &gb], vec![y], saved, move |grads, saved| {
        let [x, xb, g, gb, rest @ ..] = saved else { unreachable!("four tensors saved, then the mask") };
        let dy = grads[0].f_contiguous()?;
        let (dx, dg) = (x.f_empty_like()?, g.f_empty_like()?);
        if n > 0 {
            let mut a = Args::default()
                .tensor(x)
                .tensor(xb)
                .tensor(g)
                .tensor(gb)
                .opt(rest.first())
                .tensor(&dy)
                .tensor(&dx)
                .tensor(&dg)
                .i64(n)
                .i32(cols as i32);
            KERNEL.launch(&format!("sigmoid_gate_backward_{suffix}"), at, (grid_blocks(n), 1, 1), 256, &mut a)?;
        }
        let (dxb, dgb) = (bias_grad(&dx, cols, bias_kind)?, bias_grad(&dg, cols, bias_kind)?);
        Ok(vec![Some(dx), Some(dxb), Some(dg), Some(dgb)])
    })?;
    Ok(outputs.into_iter().next().expect("one output"))
}
