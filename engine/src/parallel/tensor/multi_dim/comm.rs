//! The collectives of the multi-dimensional layers, each counted: every call adds the number
//! of elements in the buffer it hands to the communication library to a per-process counter
//! ([`elements_communicated`]), so a test can check a layer's traffic against the formula the
//! docs state (`multi_dim` module docs). Conventions: a broadcast, reduce or all-reduce counts
//! its tensor; an all-gather its gathered output (group size times the input); a
//! reduce-scatter its input. Groups of one rank are skipped, uncounted: there is nothing to
//! send. Checkpoint gathers (`full_weight`) are not layer traffic and go uncounted.
use std::sync::atomic::{AtomicU64, Ordering};

use tch::Tensor;

use crate::autograd::collectives::{Collective, Pending};
use crate::autograd::function::{apply, Forward};
use crate::dist::ProcessGroup;
use crate::Result;

static ELEMENTS: AtomicU64 = AtomicU64::new(0);

/// Elements this process has handed to the multi-dimensional layers' collectives so far
/// (forward and backward). Take the difference around the code to measure.
pub fn elements_communicated() -> u64 {
    ELEMENTS.load(Ordering::Relaxed)
}

fn count(elements: i64) {
    ELEMENTS.fetch_add(elements.max(0) as u64, Ordering::Relaxed);
}

/// Elements a collective moves by the conventions above.
fn volume(c: Collective, x: &Tensor, g: &ProcessGroup) -> i64 {
    let n = x.numel() as i64;
    match c {
        Collective::Identity | Collective::Split { .. } => 0,
        Collective::AllGather { .. } => n * g.size() as i64,
        Collective::AllReduce | Collective::ReduceScatter { .. } | Collective::AllToAll { .. } => n,
    }
}

/// Launches `c` on `x` (no autograd), counted; the result comes from `wait`.
pub(super) fn start(c: Collective, x: &Tensor, g: &ProcessGroup) -> Result<Pending> {
    if g.size() == 1 {
        return Collective::Identity.start(x, g);
    }
    count(volume(c, x, g));
    c.start(x, g)
}

/// Runs `c` on `x` (no autograd), counted.
pub(super) fn run(c: Collective, x: &Tensor, g: &ProcessGroup) -> Result<Tensor> {
    start(c, x, g)?.wait()
}

/// In-place broadcast from group rank `root`, counted.
pub(super) fn broadcast(x: &Tensor, root: i64, g: &ProcessGroup) -> Result<()> {
    if g.size() == 1 {
        return Ok(());
    }
    count(x.numel() as i64);
    g.broadcast(x, root as usize)
}

/// In-place sum into group rank `root`, counted (other ranks' `x` is left unspecified).
pub(super) fn reduce(x: &Tensor, root: i64, g: &ProcessGroup) -> Result<()> {
    if g.size() == 1 {
        return Ok(());
    }
    count(x.numel() as i64);
    g.reduce(x, root as usize, crate::dist::ReduceOp::Sum)
}

/// `forward` on `x` with `backward` as its gradient's collective, both counted.
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
    differentiable("copy_to (counted)", x, g, Collective::Identity, Collective::AllReduce)
}

/// Sum over the group forward, and the gradient summed too: each rank uses the sum on its
/// own block, so every block's use contributes to every rank's input gradient (LayerNorm's
/// statistics over a split hidden dimension).
pub(super) fn all_reduce(x: &Tensor, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("all_reduce (counted)", x, g, Collective::AllReduce, Collective::AllReduce)
}

/// Reduce-scatter along `dim`; the gradient is all-gathered.
pub(super) fn reduce_scatter(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("reduce_scatter (counted)", x, g, Collective::ReduceScatter { dim }, Collective::AllGather { dim })
}

/// All-gather along `dim` into a replicated tensor; the gradient keeps this rank's block.
pub(super) fn gather(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("gather (counted)", x, g, Collective::AllGather { dim }, Collective::Split { dim })
}

/// All-gather along `dim` without autograd and uncounted (checkpoints).
pub(super) fn gather_full(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    if g.size() == 1 {
        return Ok(x.detach().copy());
    }
    tch::no_grad(|| Collective::AllGather { dim }.start(&x.detach(), g)?.wait())
}
