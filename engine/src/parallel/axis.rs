//! One axis of a device mesh as parallel layers see it: the group the axis runs over (none, or
//! a group of one, for one process) and the differentiable mappings every kind of parallelism
//! is composed of. [`super::TensorParallel`], [`super::SequenceParallel`] and [`super::Dap`]
//! are this axis under the names their papers use, each adding its own operations on top; with
//! no group every mapping is the identity, so one model code path serves one process and many.
use tch::Tensor;

use crate::autograd::collectives;
use crate::dist::ProcessGroup;
use crate::error::ensure;
use crate::Result;

/// The group one axis of parallelism runs over, or none for one process.
#[derive(Clone, Debug, Default)]
pub struct Axis {
    group: Option<ProcessGroup>,
}

impl Axis {
    /// No parallelism along this axis: every mapping is the identity.
    pub fn none() -> Axis {
        Axis { group: None }
    }

    /// The axis over `group` (a group of one behaves as [`Axis::none`]).
    pub fn new(group: ProcessGroup) -> Axis {
        Axis { group: Some(group) }
    }

    /// The group, when it has more than one rank.
    pub fn active(&self) -> Option<&ProcessGroup> {
        self.group.as_ref().filter(|g| g.size() > 1)
    }

    /// Number of ranks along the axis (1 without a group).
    pub fn size(&self) -> i64 {
        self.group.as_ref().map_or(1, |g| g.size() as i64)
    }

    /// This rank's index along the axis (0 without a group).
    pub fn rank(&self) -> i64 {
        self.group.as_ref().map_or(0, |g| g.rank() as i64)
    }

    /// Identity forward; backward sums the gradient over the group (Megatron's `copy_to`).
    pub fn copy_to(&self, x: &Tensor) -> Result<Tensor> {
        self.map(x, collectives::copy_to_group)
    }

    /// Sum over the group forward; backward passes the gradient through (`reduce_from`).
    pub fn reduce_from(&self, x: &Tensor) -> Result<Tensor> {
        self.map(x, collectives::reduce_from_group)
    }

    /// This rank's block of dim `dim` of a tensor every rank holds whole; backward all-gathers
    /// the gradient (the adjoint of taking a block of one logical tensor).
    pub fn scatter(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        self.map(x, |x, g| collectives::split(x, dim, g))
    }

    /// The blocks of dim `dim` made whole on every rank, each rank then computing the same
    /// thing; backward keeps this rank's block of the gradient.
    pub fn gather(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        self.map(x, |x, g| collectives::gather(x, dim, g))
    }

    /// The blocks of dim `dim` made whole for a computation that differs per rank (a pair bias,
    /// a column layer's input under sequence parallelism): backward sums the ranks' gradients
    /// and keeps this rank's block (reduce-scatter).
    pub fn all_gather(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        self.map(x, |x, g| collectives::all_gather(x, dim, g))
    }

    /// Partial sums reduced and split along dim `dim` (leaving a row layer under sequence
    /// parallelism); backward all-gathers the gradient.
    pub fn reduce_scatter(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        self.map(x, |x, g| collectives::reduce_scatter(x, dim, g))
    }

    fn map(&self, x: &Tensor, f: impl FnOnce(&Tensor, &ProcessGroup) -> Result<Tensor>) -> Result<Tensor> {
        match self.active() {
            Some(g) => f(x, g),
            None => Ok(x.shallow_clone()),
        }
    }
}

/// `dim` as an index into `x`'s dimensions (negative counts from the end); an error when out of
/// range.
pub(crate) fn dim_index(x: &Tensor, dim: i64) -> Result<usize> {
    let rank = x.dim() as i64;
    let d = if dim < 0 { dim + rank } else { dim };
    ensure!((0..rank).contains(&d), "dimension {dim} is out of range for a tensor of {rank} dimensions");
    Ok(d as usize)
}
