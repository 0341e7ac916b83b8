//! Differentiable collectives. Each is a pair (forward collective, backward collective) where
//! the backward is the adjoint of the forward:
//!
//! | function | forward | backward |
//! |---|---|---|
//! | [`copy_to_group`] | identity | all-reduce (sum) |
//! | [`reduce_from_group`] | all-reduce (sum) | identity |
//! | [`all_gather`] | all-gather along `dim` | reduce-scatter along `dim` |
//! | [`reduce_scatter`] | reduce-scatter along `dim` | all-gather along `dim` |
//! | [`split`] | keep this rank's block of `dim` | all-gather along `dim` |
//! | [`gather`] | all-gather along `dim` | keep this rank's block of `dim` |
//! | [`all_to_all`] | scatter `scatter_dim`, gather `gather_dim` | the inverse all-to-all |
//!
//! `copy_to_group`, `split` and `gather` follow Megatron's convention: a tensor every rank holds
//! identically is one logical tensor, so the adjoint of "replicate" is "sum", the adjoint of
//! "split" is "gather", and the adjoint of "gather into a replicated tensor" is "split".
//! `all_gather` is the adjoint pair to use when what follows the gather differs per rank.
//!
//! The `*_async` forms launch the collective and return an [`AsyncCollective`] whose `wait`
//! happens later, so computation placed between them overlaps the communication. In backward
//! the order mirrors: the gradient collective is launched where the forward waited and waited
//! where the forward launched ("duality async" in FastFold's dynamic axial parallelism).
use std::sync::{Arc, Mutex};

use tch::{Kind, Tensor};

use crate::autograd::function::{apply, Forward};
use crate::dist::{ProcessGroup, ReduceOp, Work};
use crate::error::ensure;
use crate::Result;

/// One collective step, forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// No communication.
    Identity,
    /// Sum over ranks.
    AllReduce,
    /// Concatenate every rank's tensor along `dim`.
    AllGather {
        /// Dimension to concatenate along.
        dim: i64,
    },
    /// Sum over ranks and keep this rank's block of `dim`.
    ReduceScatter {
        /// Dimension to scatter along.
        dim: i64,
    },
    /// Keep this rank's block of `dim` (no communication).
    Split {
        /// Dimension to split.
        dim: i64,
    },
    /// Send block `j` of `scatter_dim` to rank `j`, concatenate what arrives along `gather_dim`.
    AllToAll {
        /// Dimension cut into blocks, one per rank.
        scatter_dim: i64,
        /// Dimension the received blocks are concatenated along.
        gather_dim: i64,
    },
}

/// A collective in flight and how to finish its result.
pub struct Pending {
    work: Option<Work>,
    finish: Box<dyn FnOnce() -> Result<Tensor> + Send>,
}

impl Pending {
    fn ready(t: Tensor) -> Pending {
        Pending { work: None, finish: Box::new(move || Ok(t)) }
    }

    /// Waits for the communication and returns the result.
    pub fn wait(self) -> Result<Tensor> {
        if let Some(w) = self.work {
            w.wait()?;
        }
        (self.finish)()
    }
}

impl Collective {
    /// Launches this collective on `x` (no autograd).
    pub fn start(self, x: &Tensor, g: &ProcessGroup) -> Result<Pending> {
        let n = g.size() as i64;
        match self {
            Collective::Identity => Ok(Pending::ready(x.shallow_clone())),
            Collective::AllReduce => {
                let buf = fresh_copy(x)?;
                let work = g.all_reduce_async(&buf, ReduceOp::Sum)?;
                Ok(Pending { work: Some(work), finish: Box::new(move || Ok(buf)) })
            }
            Collective::AllGather { dim } => {
                let dim = normalize(dim, x)?;
                // Gathered along dim 0: a strided input is copied contiguous here, so that the
                // copy is let go of at the wait (`release`).
                let moved = x.f_movedim([dim], [0])?;
                let copy = (!moved.is_contiguous()).then(|| fresh_copy(&moved)).transpose()?;
                let (buf, work) = g.all_gather_async(copy.as_ref().unwrap_or(&moved))?;
                let finish = move || -> Result<Tensor> {
                    copy.as_ref().map(release).transpose()?;
                    Ok(buf.f_movedim([0], [dim])?)
                };
                Ok(Pending { work: Some(work), finish: Box::new(finish) })
            }
            Collective::ReduceScatter { dim } => {
                let dim = normalize(dim, x)?;
                let size = x.size()[dim as usize];
                ensure!(
                    size % n == 0,
                    "reduce_scatter: dim {dim} of size {size} does not divide by the group size {n}"
                );
                let (buf, work) = g.reduce_scatter_async(&x.f_movedim([dim], [0])?, ReduceOp::Sum)?;
                Ok(Pending { work: Some(work), finish: Box::new(move || Ok(buf.f_movedim([0], [dim])?)) })
            }
            Collective::Split { dim } => {
                let dim = normalize(dim, x)?;
                let size = x.size()[dim as usize];
                ensure!(size % n == 0, "split: dim {dim} of size {size} does not divide by the group size {n}");
                let block = size / n;
                // A copy even where the block is already contiguous (dim 0): a view would keep
                // the whole tensor's memory alive for as long as the block lives (DAP's stacks
                // would hold every rank's whole pair and MSA through their first block).
                Ok(Pending::ready(fresh_copy(&x.f_narrow(dim, g.rank() as i64 * block, block)?)?))
            }
            Collective::AllToAll { scatter_dim, gather_dim } => {
                let s = normalize(scatter_dim, x)?;
                let gd = normalize(gather_dim, x)?;
                let size = x.size()[s as usize];
                ensure!(size % n == 0, "all_to_all: dim {s} of size {size} does not divide by the group size {n}");
                // The group sends dim 0's blocks in rank order: blocks along dim 0 of a
                // contiguous tensor go as they lie, others stacked into that order first. The
                // received blocks joined along dim 0 are the buffer itself. So DAP's switches
                // between row- and col-split copy once each way, not twice.
                let (block, rest) = (size / n, x.size()[1..].to_vec());
                let direct = s == 0 && x.is_contiguous();
                let input = if direct { x.shallow_clone() } else { Tensor::f_stack(&x.f_chunk(n, s)?, 0)? };
                let (buf, work) = g.all_to_all_async(&input)?;
                let finish = move || -> Result<Tensor> {
                    if !direct {
                        release(&input)?;
                    }
                    // [n, block shape]: the block from each rank.
                    let blocks = match direct {
                        true => buf.f_view([[n, block].as_slice(), &rest].concat().as_slice())?,
                        false => buf.shallow_clone(),
                    };
                    Ok(match gd {
                        0 => blocks.f_flatten(0, 1)?,
                        _ => {
                            let joined = Tensor::f_cat(&blocks.f_unbind(0)?, gd)?;
                            drop(blocks);
                            release(&buf)?;
                            joined
                        }
                    })
                };
                Ok(Pending { work: Some(work), finish: Box::new(finish) })
            }
        }
    }
}

fn normalize(dim: i64, x: &Tensor) -> Result<i64> {
    let rank = x.dim() as i64;
    let d = if dim < 0 { dim + rank } else { dim };
    ensure!((0..rank).contains(&d), "dimension {dim} is out of range for a tensor of {rank} dimensions");
    Ok(d)
}

/// Frees the memory of `buffer`, one the engine made for a collective whose wait has returned
/// and that nothing else reads (a stacked send buffer, a received one already joined into the
/// result). Gloo's worker thread holds the collective's tensors and lets go of them a moment
/// after the wait, with more ranks than cores sometimes only after the next allocations, which
/// the peak then counts beside them; the storage is emptied now instead. On the host only: on a
/// GPU the wait orders the compute stream after the communication without blocking the host.
fn release(buffer: &Tensor) -> Result<()> {
    if buffer.device() == tch::Device::Cpu {
        crate::storage::resize_storage(buffer, 0)?;
    }
    Ok(())
}

/// A contiguous copy that a collective may overwrite.
fn fresh_copy(x: &Tensor) -> Result<Tensor> {
    let mut out = Tensor::f_empty(x.size(), (x.kind(), x.device()))?;
    out.f_copy_(x)?;
    Ok(out)
}

/// Applies `forward` to `x` with `backward` as the gradient's collective.
pub fn differentiable(
    name: &'static str,
    x: &Tensor,
    g: &ProcessGroup,
    forward: Collective,
    backward: Collective,
) -> Result<Tensor> {
    let bg = g.clone();
    let out = apply(
        name,
        &[x],
        |i| Ok(Forward::outputs(vec![forward.start(&i[0], g)?.wait()?])),
        move |grads, _| Ok(vec![Some(backward.start(&grads[0], &bg)?.wait()?)]),
    )?;
    Ok(out.into_iter().next().expect("one output"))
}

/// Identity forward; gradients are summed over the group.
pub fn copy_to_group(x: &Tensor, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("copy_to_group", x, g, Collective::Identity, Collective::AllReduce)
}

/// Sum over the group forward; gradients pass through.
pub fn reduce_from_group(x: &Tensor, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("reduce_from_group", x, g, Collective::AllReduce, Collective::Identity)
}

/// All-gather along `dim`; gradients are reduce-scattered.
pub fn all_gather(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("all_gather", x, g, Collective::AllGather { dim }, Collective::ReduceScatter { dim })
}

/// Reduce-scatter along `dim`; gradients are all-gathered.
pub fn reduce_scatter(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("reduce_scatter", x, g, Collective::ReduceScatter { dim }, Collective::AllGather { dim })
}

/// Keeps this rank's block of `dim`; gradients are all-gathered.
pub fn split(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("split", x, g, Collective::Split { dim }, Collective::AllGather { dim })
}

/// All-gathers along `dim` into a replicated tensor; gradients are split.
pub fn gather(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    differentiable("gather", x, g, Collective::AllGather { dim }, Collective::Split { dim })
}

/// All-to-all from `scatter_dim` to `gather_dim`; gradients take the inverse all-to-all.
pub fn all_to_all(x: &Tensor, scatter_dim: i64, gather_dim: i64, g: &ProcessGroup) -> Result<Tensor> {
    differentiable(
        "all_to_all",
        x,
        g,
        Collective::AllToAll { scatter_dim, gather_dim },
        Collective::AllToAll { scatter_dim: gather_dim, gather_dim: scatter_dim },
    )
}

#[derive(Default)]
struct Slots {
    forward: Option<Pending>,
    backward: Option<Pending>,
}

fn take(slots: &Mutex<Slots>, which: fn(&mut Slots) -> &mut Option<Pending>) -> Result<Pending> {
    let mut s = slots.lock().map_err(|_| crate::Error::invalid("async collective state poisoned"))?;
    which(&mut s).take().ok_or_else(|| crate::Error::invalid("async collective: wait without a launch"))
}

fn put(slots: &Mutex<Slots>, which: fn(&mut Slots) -> &mut Option<Pending>, p: Pending) -> Result<()> {
    let mut s = slots.lock().map_err(|_| crate::Error::invalid("async collective state poisoned"))?;
    *which(&mut s) = Some(p);
    Ok(())
}

/// A differentiable collective launched but not yet waited on. The tensor it was started from
/// must not be modified in place before [`AsyncCollective::wait`].
///
/// Two autograd nodes carry it: the launch node (input: the tensor; output: a one-element
/// token) and the wait node (input: the token; output: the result). In backward the wait node
/// runs first and launches the gradient's collective; the launch node runs later (after the
/// backward of whatever was computed between launch and wait) and waits for it.
#[must_use = "an async collective's result comes from wait()"]
pub struct AsyncCollective {
    token: Tensor,
    slots: Arc<Mutex<Slots>>,
    group: ProcessGroup,
    backward: Collective,
}

/// Launches `forward` on `x` now; the result comes from [`AsyncCollective::wait`].
pub fn differentiable_async(
    x: &Tensor,
    g: &ProcessGroup,
    forward: Collective,
    backward: Collective,
) -> Result<AsyncCollective> {
    let slots = Arc::new(Mutex::new(Slots::default()));
    let bslots = slots.clone();
    let token = apply(
        "async collective (launch)",
        &[x],
        |i| {
            put(&slots, |s| &mut s.forward, forward.start(&i[0], g)?)?;
            Ok(Forward::outputs(vec![Tensor::f_zeros([1], (Kind::Float, i[0].device()))?]))
        },
        move |_, _| Ok(vec![Some(take(&bslots, |s| &mut s.backward)?.wait()?)]),
    )?;
    let token = token.into_iter().next().expect("one output");
    Ok(AsyncCollective { token, slots, group: g.clone(), backward })
}

impl AsyncCollective {
    /// Waits for the forward communication and returns the result, connected to the graph.
    pub fn wait(self) -> Result<Tensor> {
        let AsyncCollective { token, slots, group, backward } = self;
        let fslots = slots.clone();
        let out = apply(
            "async collective (wait)",
            &[&token],
            move |_| Ok(Forward::outputs(vec![take(&fslots, |s| &mut s.forward)?.wait()?])),
            move |grads, _| {
                put(&slots, |s| &mut s.backward, backward.start(&grads[0], &group)?)?;
                Ok(vec![Some(Tensor::f_zeros([1], (Kind::Float, grads[0].device()))?)])
            },
        )?;
        Ok(out.into_iter().next().expect("one output"))
    }
}

/// Starts an all-to-all (see [`all_to_all`]) whose result is waited for later.
pub fn all_to_all_async(x: &Tensor, scatter_dim: i64, gather_dim: i64, g: &ProcessGroup) -> Result<AsyncCollective> {
    differentiable_async(
        x,
        g,
        Collective::AllToAll { scatter_dim, gather_dim },
        Collective::AllToAll { scatter_dim: gather_dim, gather_dim: scatter_dim },
    )
}

/// Starts a replicated gather (see [`gather`]) whose result is waited for later.
pub fn gather_async(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<AsyncCollective> {
    differentiable_async(x, g, Collective::AllGather { dim }, Collective::Split { dim })
}

/// Starts an all-gather (see [`all_gather`]) whose result is waited for later.
pub fn all_gather_async(x: &Tensor, dim: i64, g: &ProcessGroup) -> Result<AsyncCollective> {
    differentiable_async(x, g, Collective::AllGather { dim }, Collective::ReduceScatter { dim })
}
