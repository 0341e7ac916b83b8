//! Dynamic axial parallelism (DAP, FastFold, Cheng et al. 2022): the Evoformer's MSA
//! `[seq, res, c]` and pair `[res, res, c]` activations are split along one axis across the
//! ranks of a group, and switched to the other axis by an all-to-all when an operation needs
//! the split axis whole (row attention needs every residue, column attention every sequence).
//!
//! Layout vocabulary: a tensor is *row-split* when dim `row_dim` holds this rank's block and
//! *col-split* when dim `col_dim` does. Every operation here is differentiable with its adjoint
//! in backward (the engine's differentiable collectives), and with a group of one (or none)
//! every operation is the identity, so one model code path serves N = 1 and N > 1.
//!
//! Sizes that the group size does not divide are padded ([`Dap::pad_to`]); the model masks the
//! padding (masked keys get zero attention weight, masked rows add nothing to sums) and cuts it
//! off at the end.
use tch::Tensor;

use crate::autograd::collectives::{self, AsyncCollective};
use crate::dist::{ProcessGroup, ReduceOp};
use crate::error::ensure;
use crate::Result;

/// The DAP context: the group the axial split runs over, or none for one process.
#[derive(Clone, Debug, Default)]
pub struct Dap {
    group: Option<ProcessGroup>,
}

/// An all-to-all in flight (or, with one rank, a tensor already there).
#[must_use = "the switched tensor comes from wait()"]
pub enum DapPending {
    /// Nothing to communicate.
    Ready(Tensor),
    /// The collective launched; its gradient's collective is launched and waited in mirror
    /// order in backward.
    InFlight(AsyncCollective),
}

impl DapPending {
    /// Waits for the communication and returns the switched tensor.
    pub fn wait(self) -> Result<Tensor> {
        match self {
            DapPending::Ready(t) => Ok(t),
            DapPending::InFlight(a) => a.wait(),
        }
    }
}

impl Dap {
    /// No parallelism: every operation is the identity.
    pub fn none() -> Dap {
        Dap { group: None }
    }

    /// DAP over `group` (a group of one behaves as [`Dap::none`]).
    pub fn new(group: ProcessGroup) -> Dap {
        Dap { group: Some(group) }
    }

    /// The group, when it has more than one rank.
    fn active(&self) -> Option<&ProcessGroup> {
        self.group.as_ref().filter(|g| g.size() > 1)
    }

    /// Number of ranks sharing the axes (1 without a group).
    pub fn size(&self) -> i64 {
        self.group.as_ref().map_or(1, |g| g.size() as i64)
    }

    /// This rank's index in the group (0 without a group).
    pub fn rank(&self) -> i64 {
        self.group.as_ref().map_or(0, |g| g.rank() as i64)
    }

    /// `len` rounded up to a multiple of the group size.
    pub fn padded_len(&self, len: i64) -> i64 {
        let n = self.size();
        (len + n - 1) / n * n
    }

    /// Pads dim `dim` of `x` with zeros at the end up to `len` (differentiable; the gradient
    /// drops the padding).
    pub fn pad_to(&self, x: &Tensor, dim: i64, len: i64) -> Result<Tensor> {
        let rank = x.dim() as i64;
        let d = if dim < 0 { dim + rank } else { dim };
        ensure!((0..rank).contains(&d), "pad_to: dim {dim} is out of range for {rank} dimensions");
        let size = x.size()[d as usize];
        ensure!(len >= size, "pad_to: dim {d} has size {size}, more than the target {len}");
        if len == size {
            return Ok(x.shallow_clone());
        }
        // constant_pad_nd lists (before, after) pairs from the last dimension backwards.
        let mut pad = vec![0i64; 2 * (rank - d) as usize];
        let last = pad.len() - 1;
        pad[last] = len - size;
        Ok(x.f_constant_pad_nd(pad)?)
    }

    /// This rank's block of dim `dim`, without autograd communication (for masks and other
    /// tensors every rank holds whole and that need no gradient).
    pub fn local(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        if self.active().is_none() {
            return Ok(x.shallow_clone());
        }
        let size = x.size()[dim_index(x, dim)?];
        let n = self.size();
        ensure!(size % n == 0, "dap local: dim {dim} of size {size} does not divide by {n} ranks");
        Ok(x.f_narrow(dim, self.rank() * (size / n), size / n)?)
    }

    /// Scatter: a tensor every rank holds whole becomes this rank's block of `dim`. Backward
    /// all-gathers the gradient (the adjoint of taking a block of one logical tensor).
    pub fn scatter(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        match self.active() {
            Some(g) => collectives::split(x, dim, g),
            None => Ok(x.shallow_clone()),
        }
    }

    /// Gather: the blocks of `dim` become the whole tensor on every rank. Backward keeps this
    /// rank's block of the gradient.
    pub fn gather(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        match self.active() {
            Some(g) => collectives::gather(x, dim, g),
            None => Ok(x.shallow_clone()),
        }
    }

    /// All-gather of a tensor each rank then uses differently (a pair bias or a projection that
    /// every rank needs whole): backward sums the ranks' gradients and keeps this rank's block
    /// (reduce-scatter).
    pub fn all_gather(&self, x: &Tensor, dim: i64) -> Result<Tensor> {
        match self.active() {
            Some(g) => collectives::all_gather(x, dim, g),
            None => Ok(x.shallow_clone()),
        }
    }

    /// Row-split to col-split: an all-to-all that gathers `row_dim` and scatters `col_dim`.
    pub fn row_to_col(&self, x: &Tensor, row_dim: i64, col_dim: i64) -> Result<Tensor> {
        match self.active() {
            Some(g) => collectives::all_to_all(x, col_dim, row_dim, g),
            None => Ok(x.shallow_clone()),
        }
    }

    /// Col-split to row-split: the inverse of [`Dap::row_to_col`].
    pub fn col_to_row(&self, x: &Tensor, row_dim: i64, col_dim: i64) -> Result<Tensor> {
        match self.active() {
            Some(g) => collectives::all_to_all(x, row_dim, col_dim, g),
            None => Ok(x.shallow_clone()),
        }
    }

    /// [`Dap::col_to_row`] launched now and waited later, so work placed between launch and
    /// wait overlaps the communication (FastFold's "duality async": in backward the gradient's
    /// all-to-all is launched at the wait and waited at the launch).
    pub fn col_to_row_async(&self, x: &Tensor, row_dim: i64, col_dim: i64) -> Result<DapPending> {
        match self.active() {
            Some(g) => Ok(DapPending::InFlight(collectives::all_to_all_async(x, row_dim, col_dim, g)?)),
            None => Ok(DapPending::Ready(x.shallow_clone())),
        }
    }

    /// Sums the gradients of parameters every rank holds a replica of. Each rank's backward
    /// covers only its block of the activations, so a parameter's full gradient is the sum
    /// over ranks. Tensors without a gradient are skipped.
    pub fn reduce_gradients<'a>(&self, params: impl IntoIterator<Item = &'a Tensor>) -> Result<()> {
        let Some(g) = self.active() else { return Ok(()) };
        for p in params {
            let grad = p.grad();
            if grad.defined() {
                g.all_reduce(&grad, ReduceOp::Sum)?;
            }
        }
        Ok(())
    }
}

fn dim_index(x: &Tensor, dim: i64) -> Result<usize> {
    let rank = x.dim() as i64;
    let d = if dim < 0 { dim + rank } else { dim };
    ensure!((0..rank).contains(&d), "dimension {dim} is out of range for a tensor of {rank} dimensions");
    Ok(d as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn pad_to_appends_zeros_on_one_dim() {
        let x = Tensor::ones([2, 3], (Kind::Float, Device::Cpu));
        let y = Dap::none().pad_to(&x, 1, 5).unwrap();
        assert_eq!(y.size(), [2, 5]);
        assert_eq!(y.sum(Kind::Float).double_value(&[]), 6.0);
        assert_eq!(y.narrow(1, 3, 2).abs().sum(Kind::Float).double_value(&[]), 0.0);
        assert!(Dap::none().pad_to(&x, 1, 2).is_err());
    }

    #[test]
    fn one_rank_is_the_identity() {
        let dap = Dap::none();
        assert_eq!((dap.size(), dap.rank(), dap.padded_len(7)), (1, 0, 7));
        let x = Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([2, 3]);
        for y in [dap.scatter(&x, 0).unwrap(), dap.gather(&x, 1).unwrap(), dap.row_to_col(&x, 0, 1).unwrap()] {
            assert!(y.equal(&x));
        }
        assert!(dap.col_to_row_async(&x, 0, 1).unwrap().wait().unwrap().equal(&x));
    }
}
