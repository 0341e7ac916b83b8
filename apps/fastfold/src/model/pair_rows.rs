//! Which rows of the pair representation a rank holds through an inference pass.
//!
//! One process holds them all. Under DAP without autograd each rank holds only its block of
//! the rows from the embedders to the heads: the stacks split the pair by rows at their ends
//! anyway, so the pair embedding, the recycling embedder and the templates make just the
//! rank's rows, the stacks take and return the block, the structure module attends from the
//! rank's query rows and the heads project its rows, gathering only their results (FastFold
//! gathers the pair after each stack, so every rank holds it whole beside the next step's
//! buffers: its issue #115). The padded layout is the stacks' ([`Dap::padded_len`]): rows
//! and columns padded with zeros to a multiple of the ranks, rank `k` holding rows
//! `[k b, (k + 1) b)` of the padded pair, `b` = padded / ranks.
use tch::{Kind, Tensor};

use engine::parallel::dap::Dap;

use crate::model::exec::Exec;
use crate::model::{ensure, Result};

/// The pair rows one rank holds: all `n`, or its block of the padded rows.
#[derive(Clone, Debug)]
pub struct PairRows {
    dap: Dap,
    n: i64,
    padded: i64,
    start: i64,
    real: i64,
    block: i64,
}

impl PairRows {
    /// Every row of an `n`-residue pair, unpadded.
    pub fn whole(n: i64) -> PairRows {
        PairRows { dap: Dap::none(), n, padded: n, start: 0, real: n, block: n }
    }

    /// This rank's block of an `n`-residue pair under `dap` ([`PairRows::whole`] with one
    /// rank).
    pub fn split(dap: &Dap, n: i64) -> PairRows {
        if dap.size() == 1 {
            return Self::whole(n);
        }
        let (start, real, block) = rank_rows(dap, n);
        PairRows { dap: dap.clone(), n, padded: dap.padded_len(n), start, real, block }
    }

    /// The rows a pass under `exec` holds: its block of them under DAP when nothing records
    /// gradients (autograd off, as inside `tch::no_grad` where `predict` runs its passes, and
    /// no training dropout), all of them otherwise: training's backward reads every block.
    /// The same on every rank of the group.
    pub fn for_pass(exec: &Exec, n: i64) -> PairRows {
        match exec.dropout().is_none() && !autograd_records() {
            true => Self::split(exec.dap(), n),
            false => Self::whole(n),
        }
    }

    /// Whether the rank holds only its block.
    pub fn is_split(&self) -> bool {
        self.dap.size() > 1
    }

    /// Residues N.
    pub fn residues(&self) -> i64 {
        self.n
    }

    /// The first real row the rank holds (N on a rank whose block is all padding, so that
    /// `[start, start + real)` is a range of rows either way).
    pub fn start(&self) -> i64 {
        self.start
    }

    /// How many real rows the rank holds (none on a rank whose block is all padding).
    pub fn real(&self) -> i64 {
        self.real
    }

    /// The rows of the rank's block, padding included.
    pub fn block(&self) -> i64 {
        self.block
    }

    /// The shape of the rank's block of a pair of `c` channels: `[block, padded, c]`.
    pub fn block_shape(&self, c: i64) -> [i64; 3] {
        [self.block, self.padded, c]
    }

    /// `real` (the rank's real rows of a pair, `[real, N, c]`, as the embedders make them) in
    /// the rank's block: `(block, view)`, the view the block's real part, which the pass then
    /// updates in place. Whole, both are `real` itself; split, the block is zeros but there.
    pub fn into_block(&self, real: Tensor) -> Result<(Tensor, Tensor)> {
        if !self.is_split() {
            return Ok((real.shallow_clone(), real));
        }
        let block = zero_padded(&real, self.block, self.padded)?;
        drop(real);
        let view = self.real_of(&block)?;
        Ok((block, view))
    }

    /// The pair of the rank's block after the embedders: `block` ([`PairRows::into_block`])
    /// split, where the updates went through the view; whole, `updated` (the stream's tensor:
    /// a new one where autograd records). The other handle is dropped: a stack's layout
    /// switches replace the pair, which a second handle would keep alive through the stacks.
    pub fn embedded(&self, block: Tensor, updated: Tensor) -> Tensor {
        match self.is_split() {
            true => block,
            false => updated,
        }
    }

    /// A recycled pair as this pass reads it: itself, or made whole when the pass holds every
    /// row and the pass before held this rank's ([`PairRows::split`] under `dap`), as
    /// training's last pass follows its recycles run without autograd. A collective then,
    /// which every rank makes alike (the same shapes everywhere).
    pub fn recycled(&self, dap: &Dap, pair: Tensor) -> Result<Tensor> {
        let n = self.n;
        if self.is_split() || pair.size().get(..2) == Some(&[n, n][..]) {
            return Ok(pair);
        }
        let split = PairRows::split(dap, n);
        split.gather(&split.real_of(&pair)?)
    }

    /// The real part of `pair`, a view: `[real, N, c]` of a block, or of a whole `[N, N, c]`
    /// pair (a caller that recycles a whole pair) its rows `[start, start + real)`.
    pub fn real_of(&self, pair: &Tensor) -> Result<Tensor> {
        let size = pair.size();
        ensure!(size.len() == 3, "pair: expected 3 dimensions, found {size:?}");
        let c = size[2];
        let start = match size[..] {
            _ if size == self.block_shape(c) => 0,
            [a, b, _] if a == self.n && b == self.n => self.start(),
            _ => {
                let n = self.n;
                let expected = match self.is_split() {
                    true => format!("{:?} (this rank's rows) or [{n}, {n}, {c}]", self.block_shape(c)),
                    false => format!("[{n}, {n}, {c}]"),
                };
                return Err(crate::model::Error::Invalid(format!("pair: expected shape {expected}, found {size:?}")));
            }
        };
        Ok(pair.f_narrow(0, start, self.real())?.f_narrow(1, 0, self.n)?)
    }

    /// Results per real row, `[real, ...]`, made whole on every rank: `[N, ...]` (a collective:
    /// every rank of the group calls it, with no real rows too).
    pub fn gather(&self, rows: &Tensor) -> Result<Tensor> {
        if !self.is_split() {
            return Ok(rows.shallow_clone());
        }
        let padded = self.padded_rows(rows)?;
        Ok(self.dap.gather(&padded, 0)?.f_narrow(0, 0, self.n)?)
    }

    /// Results per real row, `[real, ...]`, made whole on the host of rank 0: `Some([N, ...])`
    /// there, `None` on the other ranks (a collective: every rank calls it, with no real rows
    /// too). A block at a time ([`Dap::gather_to_host`]): what `--save-outputs` writes, which
    /// [`PairRows::gather`] would hold whole on every rank's device beside the pass's outputs.
    pub fn gather_to_host(&self, rows: &Tensor) -> Result<Option<Tensor>> {
        let padded = self.padded_rows(rows)?;
        let joined = self.dap.gather_to_host(&padded, 0)?;
        Ok(joined.map(|j| j.f_narrow(0, 0, self.n)).transpose()?)
    }

    /// The rank's result rows `rows` ([real, ...]) padded with zeros to its block
    /// (differentiable), as the collectives join blocks.
    fn padded_rows(&self, rows: &Tensor) -> Result<Tensor> {
        let real = self.real;
        ensure!(rows.size().first() == Some(&real), "pair rows: expected {real} rows, found {:?}", rows.size());
        Ok(self.dap.pad_to(rows, 0, self.block)?)
    }

    /// `x + x^T` over the first two dimensions of a square `x` [N, N, c] given as the real rows
    /// this rank holds, `half` ([real, N, c]; whole, all N), without autograd: the same rows of
    /// the sum (the distogram's logits from its half logits). Whole, summed in place a block at
    /// a time ([`symmetrise_in_place`]). Split, a collective: the rows of `x^T` a rank needs are
    /// the columns of its block that every rank holds, which the stacks' all-to-all brings
    /// (`Dap::row_to_col`), so no rank holds more than its block's rows.
    pub fn symmetrised(&self, half: Tensor) -> Result<Tensor> {
        if !self.is_split() {
            symmetrise_in_place(&half, SYMMETRISE_BLOCK)?;
            return Ok(half);
        }
        let block = zero_padded(&half, self.block, self.padded)?;
        drop(half);
        // [padded, block, c]: every row, this rank's columns; transposed, its rows of x^T.
        let columns = self.dap.row_to_col(&block, 0, 1)?;
        let mut sum = block;
        let _ = sum.f_add_(&columns.f_transpose(0, 1)?)?;
        drop(columns);
        Ok(sum.f_narrow(0, 0, self.real)?.f_narrow(1, 0, self.n)?)
    }
}

/// The rows and columns of [`symmetrise_in_place`]'s blocks in [`PairRows::symmetrised`]: each
/// block's sum is a temporary of `SYMMETRISE_BLOCK`² entries (16 MiB of float32 logits at 64
/// bins).
pub const SYMMETRISE_BLOCK: i64 = 256;

/// This rank's rows of `len` rows split over `dap` as the stacks split them (padded with zeros
/// to a multiple of the ranks): `(start, real, block)`, its real rows `[start, start + real)`
/// (`start` at most `len`) in a block of `block` rows. With one rank: `(0, len, len)`.
pub fn rank_rows(dap: &Dap, len: i64) -> (i64, i64, i64) {
    let block = dap.padded_len(len) / dap.size();
    let start = dap.rank() * block;
    (start.min(len), (len - start).clamp(0, block), block)
}

/// `real` ([real rows, N, c]) at the start of a zeroed `[rows, columns, c]` block: what the
/// embedders made of a rank's rows, laid out as the stacks split a stream.
pub fn zero_padded(real: &Tensor, rows: i64, columns: i64) -> Result<Tensor> {
    let size = real.size();
    ensure!(size.len() == 3 && size[0] <= rows && size[1] <= columns, "pad {size:?} to [{rows}, {columns}, _]");
    // constant_pad_nd lists (before, after) pairs from the last dimension backwards.
    Ok(real.f_constant_pad_nd([0, 0, 0, columns - size[1], 0, rows - size[0]])?)
}

/// Whether autograd records operations here (outside `tch::no_grad`): an operation on a tensor
/// that requires gradients makes one that does only then.
fn autograd_records() -> bool {
    let probe = Tensor::ones([1], (Kind::Float, tch::Device::Cpu)).set_requires_grad(true);
    probe.f_mul_scalar(1.0).map_or(true, |t| t.requires_grad())
}

/// `x + x^T` over the first two dimensions of the square `x` [N, N, ...], written into `x`
/// (no autograd) a block of `block` rows and columns at a time, where the plain sum makes a
/// transposed copy and a new tensor beside it: the distogram's logits are half a pair each.
/// Bit for bit the plain sum (each entry is the same single addition).
pub fn symmetrise_in_place(x: &Tensor, block: i64) -> Result<()> {
    let n = x.size()[0];
    ensure!(x.size().get(1) == Some(&n), "symmetrise: expected a square tensor, found {:?}", x.size());
    ensure!(x.kind() != Kind::Bool && block > 0, "symmetrise: a positive block of numbers");
    for a in (0..n).step_by(block as usize) {
        let la = block.min(n - a);
        for c in (a..n).step_by(block as usize) {
            let lc = block.min(n - c);
            let mut upper = x.f_narrow(0, a, la)?.f_narrow(1, c, lc)?;
            let mut lower = x.f_narrow(0, c, lc)?.f_narrow(1, a, la)?;
            let sum = upper.f_add(&lower.f_transpose(0, 1)?)?;
            upper.f_copy_(&sum)?;
            if c != a {
                lower.f_copy_(&sum.f_transpose(0, 1)?)?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symmetrised_in_place_equals_the_plain_sum_bit_for_bit() {
        for (n, block) in [(7, 3), (8, 8), (9, 2), (5, 16)] {
            let x = Tensor::randn([n, n, 4], (Kind::Float, tch::Device::Cpu));
            let want = &x + x.transpose(0, 1);
            symmetrise_in_place(&x, block).unwrap();
            assert!(x.equal(&want), "{n} rows in blocks of {block}");
        }
    }

    #[test]
    fn autograd_records_outside_no_grad_only() {
        assert!(autograd_records());
        assert!(!tch::no_grad(autograd_records));
    }

    #[test]
    fn one_rank_holds_every_row() {
        let rows = PairRows::split(&Dap::none(), 5);
        assert!(!rows.is_split());
        assert_eq!((rows.start(), rows.real(), rows.block_shape(2)), (0, 5, [5, 5, 2]));
        let pair = Tensor::randn([5, 5, 2], (Kind::Float, tch::Device::Cpu));
        assert!(rows.real_of(&pair).unwrap().equal(&pair));
        assert!(rows.real_of(&Tensor::zeros([4, 5, 2], (Kind::Float, tch::Device::Cpu))).is_err());
    }
}
