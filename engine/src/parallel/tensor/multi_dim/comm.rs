//! The collectives of the multi-dimensional layers. Their traffic is counted by the process
//! group itself ([`ProcessGroup::bytes_communicated`], whose conventions the `multi_dim` module
//! docs' formulas follow), so a test reads the world group's counter around a layer. Groups of
//! one rank are skipped here: there is nothing to send. Checkpoint gathers (`full_weight`) are
//! counted too; measure around the forward and backward only.
use tch::Tensor;

use crate::autograd::collectives::{Collective, Pending};
use crate::autograd::function::{apply, Forward};
use crate::dist::ProcessGroup;
use crate::Result;

/// Launches `c` on `x` (no autograd); the result comes from `wait`.
pub(super) fn start(c: Collective, x: &Tensor, g: &ProcessGroup) -> Result<Pending> {
    if g.size() == 1 {
        return Collective::Identity.start(x, g);
    }
    c.start(x, g)
}

/// Runs `c` on `x` (no autograd).
pub(super) fn run(c: Collective, x: &Tensor, g: &ProcessGroup) -> Result<Tensor> {
    start(c, x, g)?.wait()
}

/// In-place broadcast from group rank `root`.
pub(super) fn broadcast(x: &Tensor, root: i64, g: &ProcessGroup) -> Result<()> {
    if g.size() == 1 {
        return Ok(());
    }
    g.broadcast(x, root as usize)
}

/// In-place sum into group rank `root` (other ranks' `x` is left unspecified).
pub(super) fn reduce(x: &Tensor, root: i64, g: &ProcessGroup) -> Result<()> {
    if g.size() == 1 {
        return Ok(());
    }
    g.reduce(x, root as usize, crate::dist::ReduceOp::Sum)
}

/// `forward` on `x` with `backward` as its gradient's collective.
fn differentiable(
    name: &'static str,
    x: &Tensor,
    g: &ProcessGroup,
    forward: Collective,
    backward: Collective,
) -> Result<Tensor> {
    if g.size() == 1 {
        return Ok(x.shallow_clone());
    }
    let bg = g.clone();
    let out = apply(
        name,
        &[x],
        |i| Ok(Forward::outputs(vec![run(forward, &i[0], g)?])),
        move |grads, _| Ok(vec![Some(run(backward, &grads[0], &bg)?)]),
    )?;
    Ok(out.into_iter().next().expect("one output"))
}

/// Identity forward; the gradient is summed over the group (a parameter or activation every
/// rank of `g` holds alike but uses on different data).
pub(super) fn copy_to(x: &Tensor, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("copy_to (multi-dim)", x, g, Collective::Identity, Collective::AllReduce)
}

/// Sum over the group forward, and the gradient summed too: each rank uses the sum on its
/// own block, so every block's use contributes to every rank's input gradient (LayerNorm's
/// statistics over a split hidden dimension).
pub(super) fn all_reduce(x: &Tensor, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("all_reduce (multi-dim)", x, g, Collective::AllReduce, Collective::AllReduce)
}

/// Reduce-scatter along `dim`; the gradient is all-gathered.
pub(super) fn reduce_scatter(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("reduce_scatter (multi-dim)", x, g, Collective::ReduceScatter { dim }, Collective::AllGather { dim })
}

/// All-gather along `dim` into a replicated tensor; the gradient keeps this rank's block.
pub(super) fn gather(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("gather (multi-dim)", x, g, Collective::AllGather { dim }, Collective::Split { dim })
}

/// All-gather along `dim` without autograd (checkpoints).
pub(super) fn gather_full(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    if g.size() == 1 {
        return Ok(x.detach().copy());
    }
    tch::no_grad(|| Collective::AllGather { dim }.start(&x.detach(), g)?.wait())
}
