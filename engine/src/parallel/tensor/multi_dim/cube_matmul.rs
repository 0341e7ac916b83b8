//! The product of 3D tensor parallelism as one autograd function. Composing the differentiable
//! all-gathers with `linear` would be exact too, but autograd would then keep the gathered
//! input and weight (`q` times the local blocks) for backward, giving back much of the memory
//! 3D parallelism saves. As Colossal-AI does (and as the 1D `gathered_linear` does for the
//! sequence), this keeps only the local blocks and gathers them again in backward, overlapping
//! the input's gather with the input gradient's product and the input gradient's
//! reduce-scatter with the weight gradient's product.
use tch::Tensor;

use super::comm;
use super::cube::{Axis, Cube, Orientation};
use crate::autograd::collectives::Collective;
use crate::autograd::function::{apply, Forward};
use crate::Result;

/// `reduce_scatter_B(all_gather_A(x) all_gather_I(w)^T)` along the batch (dim 0) for input
/// orientation `o` with batch axis `A` and hidden axis `B`: `x [.., in/q]` this rank's block,
/// `w [out/q, in/q^2]` its weight block. Gradients: `x` gets the reduce-scatter over `A` of
/// `dY W`, `w` the reduce-scatter over `I` of `dY^T X`, where `dY` is the output gradient
/// all-gathered over `B` and `X`, `W` are gathered again.
pub(super) fn cube_matmul(x: &Tensor, w: &Tensor, cube: &Cube, o: Orientation) -> Result<Tensor> {
    let (ga, gb, gi) = (cube.group(o.batch_axis()), cube.group(o.hidden_axis()), cube.group(Axis::I));
    let gather_rows = Collective::AllGather { dim: 0 };
    let gather_in = Collective::AllGather { dim: 1 };
    let (bga, bgb, bgi) = (ga.clone(), gb.clone(), gi.clone());
    let out = apply(
        "3D linear",
        &[x, w],
        |i| {
            let xg = comm::run(gather_rows, &i[0], ga)?;
            let wg = comm::run(gather_in, &i[1], gi)?;
            let y = comm::run(Collective::ReduceScatter { dim: 0 }, &xg.f_linear(&wg, None::<Tensor>)?, gb)?;
            Ok(Forward {
                outputs: vec![y],
                saved: vec![i[0].shallow_clone(), i[1].shallow_clone()],
                ..Forward::default()
            })
        },
        move |grads, saved| {
            let (x, w) = (&saved[0], &saved[1]);
            let dy = comm::run(gather_rows, &grads[0], &bgb)?;
            let x_gather = comm::start(gather_rows, x, &bga)?;
            let wg = comm::run(gather_in, w, &bgi)?;
            let dx_full = dy.f_matmul(&wg)?;
            let xg = x_gather.wait()?;
            let dx_scatter = comm::start(Collective::ReduceScatter { dim: 0 }, &dx_full, &bga)?;
            let (out_q, in_q) = (wg.size()[0], wg.size()[1]);
            let dw_full = dy.f_reshape([-1, out_q])?.f_tr()?.f_matmul(&xg.f_reshape([-1, in_q])?)?;
            let dw = comm::run(Collective::ReduceScatter { dim: 1 }, &dw_full, &bgi)?;
            Ok(vec![Some(dx_scatter.wait()?), Some(dw)])
        },
    )?;
    Ok(out.into_iter().next().expect("one output"))
}
