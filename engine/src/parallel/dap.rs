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

use super::axis::{dim_index, Axis};
use crate::autograd::collectives::{self, AsyncCollective};
use crate::dist::ProcessGroup;
use crate::error::ensure;
use crate::Result;

/// The tag of [`Dap::gather_to_host`]'s point-to-point messages.
const TAG_TO_HOST: i32 = 0x4854; // "HT"

/// The DAP context: the group the axial split runs over, or none for one process.
#[derive(Clone, Debug, Default)]
pub struct Dap(Axis);

/// The axis' group, size, rank and differentiable mappings ([`Axis`]).
impl std::ops::Deref for Dap {
    type Target = Axis;

    fn deref(&self) -> &Axis {
        &self.0
    }
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
        Dap(Axis::none())
    }

    /// DAP over `group` (a group of one behaves as [`Dap::none`]).
    pub fn new(group: ProcessGroup) -> Dap {
        Dap(Axis::new(group))
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

    /// The ranks' blocks of dim 0 of `x` (every rank's of one shape) joined in rank order on
    /// the host of rank `root`: `Some` there, `None` on the others (a collective: every rank
    /// calls it). Each block crosses on its own into one buffer on the root's device and on to
    /// the host, so no rank's device holds more than its own block and one more: what writing a
    /// tensor the ranks hold in blocks to a file takes, where gathering it whole on the devices
    /// would hold all of it on each. No autograd. With one rank, `x` on the host.
    pub fn gather_to_host(&self, x: &Tensor, root: usize) -> Result<Option<Tensor>> {
        let host = tch::Device::Cpu;
        let Some(g) = self.active() else { return Ok(Some(x.f_to_device(host)?)) };
        ensure!(root < g.size(), "gather_to_host: root {root} outside a group of {}", g.size());
        ensure!(x.dim() > 0, "gather_to_host: a tensor with a dimension to join along");
        let x = x.f_detach()?;
        if g.rank() != root {
            g.send(&x, root, TAG_TO_HOST)?;
            return Ok(None);
        }
        let mut shape = x.size();
        let block = shape[0];
        shape[0] = block * g.size() as i64;
        let joined = Tensor::f_empty(shape, (x.kind(), host))?;
        let inbox = x.f_empty_like()?;
        for k in 0..g.size() {
            let part = match k == root {
                true => &x,
                false => {
                    g.recv(&inbox, k, TAG_TO_HOST)?;
                    &inbox
                }
            };
            joined.f_narrow(0, k as i64 * block, block)?.f_copy_(part)?;
        }
        Ok(Some(joined))
    }

    /// Sums the gradients of parameters every rank holds a replica of. Each rank's backward
    /// covers only its block of the activations, so a parameter's full gradient is the sum
    /// over ranks. One all-reduce for all of them, the same on every rank even where a rank
    /// has no gradient for some (zeros in the sum; none where no rank has one).
    pub fn reduce_gradients<'a>(&self, params: impl IntoIterator<Item = &'a Tensor>) -> Result<()> {
        let Some(g) = self.active() else { return Ok(()) };
        let params: Vec<Tensor> = params.into_iter().map(Tensor::shallow_clone).collect();
        crate::parallel::data::reduce_gradients(&params, g, 1.0)
    }
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
