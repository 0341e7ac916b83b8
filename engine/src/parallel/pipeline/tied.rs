//! Parameters that more than one pipeline stage holds (tied input and output embeddings, say):
//! each holder computes a partial gradient, and the true gradient is their sum. Each tied
//! parameter gets a sub-group of its holders, made once, and after every step the holders
//! all-reduce its gradient over it, so their copies take identical optimizer steps.
use tch::Tensor;

use crate::dist::{ProcessGroup, ReduceOp};
use crate::error::ensure;
use crate::optim::{clip_to, scaled_grad_norm, Held, Param};
use crate::Result;

/// One tied parameter and the pipeline ranks that hold a copy.
pub struct Tied {
    name: String,
    /// Whether this rank is the first holder, the one whose copy counts in norms.
    first: bool,
    group: Option<ProcessGroup>,
    tensor: Option<Tensor>,
}

impl Tied {
    /// Ties `name` across pipeline ranks `holders` of `pp` (ranks of that group). Every rank of
    /// `pp` must call this, in the same order for every tie (it makes a sub-group); holders pass
    /// their copy of the parameter, the others `None`. The first holder's values are broadcast
    /// to the other copies, so they start equal.
    pub fn new(pp: &ProcessGroup, name: &str, holders: &[usize], tensor: Option<&Tensor>) -> Result<Tied> {
        let holds = holders.contains(&pp.rank());
        ensure!(
            holds == tensor.is_some(),
            "tied parameter {name}: rank {} of group {} {} among the holders {holders:?} but {} a tensor",
            pp.rank(),
            pp.name(),
            if holds { "is" } else { "is not" },
            if tensor.is_some() { "passed" } else { "did not pass" }
        );
        let group = pp.subgroup(holders, &format!("tied-{name}"))?;
        if let (Some(g), Some(t)) = (&group, tensor) {
            g.broadcast(t, 0)?;
        }
        let first = holders.first() == Some(&pp.rank());
        Ok(Tied { name: name.to_string(), first, group, tensor: tensor.map(Tensor::shallow_clone) })
    }

    /// Sums the holders' gradients into each holder's `.grad`; a holder without a gradient
    /// contributes zeros. A no-op on ranks that hold no copy.
    pub fn sum_gradients(&self) -> Result<()> {
        let (Some(group), Some(t)) = (&self.group, &self.tensor) else {
            return Ok(());
        };
        let mut grad = t.grad();
        if !grad.defined() {
            grad = t.f_zeros_like()?;
            crate::autograd::set_grad(t, Some(&grad))?;
        }
        group
            .all_reduce(&grad, ReduceOp::Sum)
            .map_err(|e| crate::Error::invalid(format!("tied parameter {}: {e}", self.name)))
    }

    /// Whether `tensor` is this tie's copy on a holder other than the first: after
    /// [`Tied::sum_gradients`] its gradient repeats the first holder's, so a global norm must
    /// not count it again.
    pub fn is_repeat(&self, tensor: &Tensor) -> bool {
        !self.first && self.tensor.as_ref().is_some_and(|t| t.data_ptr() == tensor.data_ptr())
    }
}

/// [`Tied::sum_gradients`] for each tie, in order.
pub fn sum_tied_gradients(ties: &[Tied]) -> Result<()> {
    ties.iter().try_for_each(Tied::sum_gradients)
}

/// Clips the gradients of a pipeline's parameters to the global norm `max_norm` and returns
/// that norm before clipping. Each pipeline rank holds different parameters, so squares are
/// summed over `pp` (with data parallelism, call after the data-parallel reduction: the norm
/// is then the same on every replica); tied copies count once. Every parameter is clipped.
pub fn clip_grad_norm(params: &[Param], max_norm: f64, pp: &ProcessGroup, ties: &[Tied]) -> Result<f64> {
    let counted: Vec<Param> =
        params.iter().filter(|p| !ties.iter().any(|t| t.is_repeat(&p.tensor))).map(Param::shallow_copy).collect();
    let norm = scaled_grad_norm(&counted, 1.0, Held::Sharded(pp))?;
    clip_to(params, norm, max_norm)?;
    Ok(norm)
}
