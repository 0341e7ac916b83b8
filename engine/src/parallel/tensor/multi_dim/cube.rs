//! The process cube of 3D tensor parallelism (Agarwal et al.'s 3D matrix product, as
//! Colossal-AI's 3D mode uses it) and how activations lie on it.
//!
//! Rank layout: `q^3` ranks, `rank = i * q^2 + j * q + l`. Each rank has a group along each
//! axis (the `q` ranks that differ from it in that coordinate only): [`Cube::group`] with
//! [`Axis::I`] (the weight group, Colossal-AI's `PARALLEL_3D_WEIGHT`), [`Axis::J`] and
//! [`Axis::L`] (the input and output groups, `PARALLEL_3D_INPUT` / `PARALLEL_3D_OUTPUT`,
//! which trade places after every linear layer: Colossal-AI's `swap_in_out_group`).
//!
//! Activation layout: a `[batch, .., hidden]` tensor is cut into `q^2` blocks along the batch
//! and `q` along the hidden (last) dimension. With [`Orientation::Normal`] rank `(i, j, l)`
//! holds batch block `i * q + j` and hidden block `l`; with [`Orientation::Swapped`] batch
//! block `i * q + l` and hidden block `j`. A linear layer turns one orientation into the other.
use tch::Tensor;

use super::comm;
use crate::dist::{DeviceMesh, ProcessGroup};
use crate::error::ensure;
use crate::parallel::tensor::{dim_index, TpMode};
use crate::Result;

/// An axis of the cube.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Axis {
    /// The first coordinate: weights are gathered along it.
    I,
    /// The second coordinate.
    J,
    /// The third coordinate.
    L,
}

/// Which of the cube's axes an activation's batch and hidden blocks follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Orientation {
    /// Batch block `i * q + j`, hidden block `l`.
    Normal,
    /// Batch block `i * q + l`, hidden block `j`.
    Swapped,
}

impl Orientation {
    /// The other orientation: that of a linear layer's output.
    pub fn flip(self) -> Orientation {
        match self {
            Orientation::Normal => Orientation::Swapped,
            Orientation::Swapped => Orientation::Normal,
        }
    }

    /// The axis whose coordinate picks the batch block within an `I` block.
    pub fn batch_axis(self) -> Axis {
        match self {
            Orientation::Normal => Axis::J,
            Orientation::Swapped => Axis::L,
        }
    }

    /// The axis whose coordinate picks the hidden block.
    pub fn hidden_axis(self) -> Axis {
        self.flip().batch_axis()
    }
}

/// This rank's place on a `q x q x q` cube and its group along each axis.
#[derive(Clone, Debug)]
pub struct Cube {
    q: i64,
    coords: [i64; 3],
    groups: [ProcessGroup; 3],
}

impl Cube {
    /// 3D tensor parallelism over every rank of `world`, whose size must be a cube `q^3`.
    pub fn new(world: &ProcessGroup) -> Result<Cube> {
        let qs = TpMode::ThreeD.side(world.size(), 1)?;
        let q = qs as i64;
        let mesh = DeviceMesh::new(world, &[("i", qs), ("j", qs), ("l", qs)])?;
        let group = |axis: &str| mesh.group(axis).cloned().expect("the mesh has this axis");
        let coord = |axis: &str| mesh.coord(axis).expect("the mesh has this axis") as i64;
        Ok(Cube { q, coords: [coord("i"), coord("j"), coord("l")], groups: [group("i"), group("j"), group("l")] })
    }

    /// The cube's side `q`.
    pub fn q(&self) -> i64 {
        self.q
    }

    /// This rank's coordinate along `axis`.
    pub fn coord(&self, axis: Axis) -> i64 {
        self.coords[axis as usize]
    }

    /// The `q` ranks that differ from this one only along `axis`, indexed by that coordinate.
    pub fn group(&self, axis: Axis) -> &ProcessGroup {
        &self.groups[axis as usize]
    }

    /// `len / parts`, an error naming `what` unless `parts` divides `len`.
    pub(super) fn check_split(&self, len: i64, parts: i64, what: &str) -> Result<i64> {
        ensure!(len > 0, "{what} must be positive, got {len}");
        ensure!(len % parts == 0, "{what} {len} does not divide into {parts} blocks (q = {})", self.q);
        Ok(len / parts)
    }

    /// The number of batch blocks (`q^2`) and which one this rank holds in `orientation`.
    pub fn batch_block(&self, orientation: Orientation) -> (i64, i64) {
        (self.q * self.q, self.coord(Axis::I) * self.q + self.coord(orientation.batch_axis()))
    }

    /// This rank's batch block (dim 0) of a tensor every rank holds whole (targets, masks).
    pub fn split_batch(&self, x: &Tensor, orientation: Orientation) -> Result<Tensor> {
        ensure!(x.dim() >= 1, "3D layout: a scalar has no batch dimension to split");
        let (parts, index) = self.batch_block(orientation);
        let len = self.check_split(x.size()[0], parts, "3D layout: batch size")?;
        Ok(x.f_narrow(0, index * len, len)?)
    }

    /// This rank's block of a whole `[batch, .., hidden]` tensor in `orientation` (a
    /// differentiable slice, no communication).
    pub fn split_input(&self, x: &Tensor, orientation: Orientation) -> Result<Tensor> {
        ensure!(x.dim() >= 2, "3D layout: an activation needs batch and hidden dimensions, got {:?}", x.size());
        let last = dim_index(x, -1)?;
        let width = self.check_split(x.size()[last], self.q, "3D layout: hidden size")?;
        let h = self.coord(orientation.hidden_axis());
        Ok(self.split_batch(x, orientation)?.f_narrow(-1, h * width, width)?)
    }

    /// The whole tensor from every rank's block in `orientation`, replicated; the gradient
    /// keeps this rank's block (the inverse of [`Cube::split_input`]).
    pub fn gather_output(&self, y: &Tensor, orientation: Orientation) -> Result<Tensor> {
        ensure!(y.dim() >= 2, "3D layout: an activation needs batch and hidden dimensions, got {:?}", y.size());
        let y = comm::gather(y, -1, self.group(orientation.hidden_axis()))?;
        let y = comm::gather(&y, 0, self.group(orientation.batch_axis()))?;
        comm::gather(&y, 0, self.group(Axis::I))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A linear layer's output lies on the other two axes than its input, and two layers
    /// bring an activation back (fc1 then fc2 of an MLP leave the residual's layout).
    #[test]
    fn orientations_trade_the_batch_and_hidden_axes() {
        for o in [Orientation::Normal, Orientation::Swapped] {
            assert_ne!(o.batch_axis(), o.hidden_axis());
            assert_eq!(o.flip().batch_axis(), o.hidden_axis());
            assert_eq!(o.flip().hidden_axis(), o.batch_axis());
            assert_eq!(o.flip().flip(), o);
            assert!(![o.batch_axis(), o.hidden_axis()].contains(&Axis::I), "I always splits the batch first");
        }
        assert_eq!((Orientation::Normal.batch_axis(), Orientation::Normal.hidden_axis()), (Axis::J, Axis::L));
    }
}
