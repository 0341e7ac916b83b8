//! The process grid of 2D (Optimus: SUMMA on a `q x q` grid) and 2.5D (Tesseract: `d` such
//! grids stacked in depth) tensor parallelism, and how activations lie on it.
//!
//! Rank layout: `rank = dep * q^2 + row * q + col` (the column fastest, so a row's ranks are
//! neighbours). A rank's row group holds the ranks of its row in its depth layer, indexed by
//! column (Colossal-AI's `PARALLEL_2D_ROW` / `PARALLEL_2P5D_ROW`); its column group the ranks
//! of its column, indexed by row (`..._COL`); its depth group the ranks at its `(row, col)`
//! in every layer (`PARALLEL_2P5D_DEP`). 2D is the case `d = 1`.
//!
//! Activation layout: a `[batch, .., hidden]` tensor is cut into `d * q` blocks along the
//! batch and `q` blocks along the hidden (last) dimension; rank `(dep, row, col)` holds batch
//! block `dep * q + row` and hidden block `col`. A weight is cut into `q x q` blocks and
//! replicated over depth, so depth layers are data-parallel replicas of one 2D grid, each
//! with `1/d` of the batch.
use tch::Tensor;

use super::comm;
use crate::dist::{DeviceMesh, ProcessGroup};
use crate::error::ensure;
use crate::parallel::tensor::{dim_index, TpMode};
use crate::Result;

/// This rank's place on a `q x q x d` grid and its row, column and depth groups.
#[derive(Clone, Debug)]
pub struct Grid {
    q: i64,
    depth: i64,
    row: i64,
    col: i64,
    dep: i64,
    row_group: ProcessGroup,
    col_group: ProcessGroup,
    depth_group: ProcessGroup,
}

impl Grid {
    /// 2D tensor parallelism over every rank of `world`, whose size must be a square `q^2`.
    pub fn two_d(world: &ProcessGroup) -> Result<Grid> {
        let q = TpMode::TwoD.side(world.size(), 1)?;
        Self::build(world, q as i64, 1)
    }

    /// 2.5D tensor parallelism with `depth` layers over every rank of `world`, whose size must
    /// be `q^2 * depth`.
    pub fn two_p5_d(world: &ProcessGroup, depth: i64) -> Result<Grid> {
        ensure!(depth >= 1, "2.5D tensor parallelism: depth must be at least 1, got {depth}");
        let q = TpMode::TwoHalfD.side(world.size(), depth as usize)?;
        Self::build(world, q as i64, depth)
    }

    fn build(world: &ProcessGroup, q: i64, depth: i64) -> Result<Grid> {
        let (qs, ds) = (q as usize, depth as usize);
        let mesh = DeviceMesh::new(world, &[("dep", ds), ("row", qs), ("col", qs)])?;
        let group = |axis: &str| mesh.group(axis).cloned().expect("the mesh has this axis");
        let coord = |axis: &str| mesh.coord(axis).expect("the mesh has this axis") as i64;
        Ok(Grid {
            q,
            depth,
            row: coord("row"),
            col: coord("col"),
            dep: coord("dep"),
            // The group along the column axis is the ranks of one row, and vice versa.
            row_group: group("col"),
            col_group: group("row"),
            depth_group: group("dep"),
        })
    }

    /// The grid's side `q`.
    pub fn q(&self) -> i64 {
        self.q
    }

    /// The number of depth layers `d` (1 for 2D).
    pub fn depth(&self) -> i64 {
        self.depth
    }

    /// This rank's `(dep, row, col)`.
    pub fn coords(&self) -> (i64, i64, i64) {
        (self.dep, self.row, self.col)
    }

    /// The ranks of this row (this depth layer), indexed by column.
    pub fn row_group(&self) -> &ProcessGroup {
        &self.row_group
    }

    /// The ranks of this column (this depth layer), indexed by row.
    pub fn col_group(&self) -> &ProcessGroup {
        &self.col_group
    }

    /// The ranks at this `(row, col)` in every depth layer, indexed by layer.
    pub fn depth_group(&self) -> &ProcessGroup {
        &self.depth_group
    }

    /// How many blocks the batch is cut into (`d * q`) and which one this rank holds.
    pub fn batch_block(&self) -> (i64, i64) {
        (self.depth * self.q, self.dep * self.q + self.row)
    }

    /// `q` if it divides `len` (`what`, for the error).
    pub(super) fn check_split(&self, len: i64, parts: i64, what: &str) -> Result<i64> {
        ensure!(len > 0, "{what} must be positive, got {len}");
        ensure!(
            len % parts == 0,
            "{what} {len} does not divide into {parts} blocks (q = {}, depth = {})",
            self.q,
            self.depth
        );
        Ok(len / parts)
    }

    /// This rank's batch block (dim 0) of a tensor every rank holds whole (targets, masks).
    pub fn split_batch(&self, x: &Tensor) -> Result<Tensor> {
        let (parts, index) = self.batch_block();
        ensure!(x.dim() >= 1, "2D/2.5D layout: a scalar has no batch dimension to split");
        let len = self.check_split(x.size()[0], parts, "2D/2.5D layout: batch size")?;
        Ok(x.f_narrow(0, index * len, len)?)
    }

    /// This rank's block of a whole `[batch, .., hidden]` tensor: batch block `dep * q + row`
    /// and hidden block `col` (a differentiable slice, no communication).
    pub fn split_input(&self, x: &Tensor) -> Result<Tensor> {
        ensure!(x.dim() >= 2, "2D/2.5D layout: an activation needs batch and hidden dimensions, got {:?}", x.size());
        let last = dim_index(x, -1)?;
        let width = self.check_split(x.size()[last], self.q, "2D/2.5D layout: hidden size")?;
        Ok(self.split_batch(x)?.f_narrow(-1, self.col * width, width)?)
    }

    /// The whole tensor from every rank's block, replicated on every rank; the gradient keeps
    /// this rank's block (the inverse of [`Grid::split_input`]).
    pub fn gather_output(&self, y: &Tensor) -> Result<Tensor> {
        ensure!(y.dim() >= 2, "2D/2.5D layout: an activation needs batch and hidden dimensions, got {:?}", y.size());
        let y = comm::gather(y, -1, &self.row_group)?;
        let y = comm::gather(&y, 0, &self.col_group)?;
        comm::gather(&y, 0, &self.depth_group)
    }
}
