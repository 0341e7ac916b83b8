//! Leaving out the MSA rows whose work AlphaFold throws away. AlphaFold's processed features
//! pad the MSA to 512 clusters and the extra MSA to 5,120 (or 1,024) rows with fully-masked
//! rows, and the stacks spend nearly all their time on them; these selections run the stacks
//! on the rows that matter and give back AlphaFold's padded outputs unchanged.
//!
//! Why a fully-masked row (mask 0 at every residue) changes no other row:
//!
//! - row attention and the transitions work within a row;
//! - as a key of column attention (full or global) it gets the bias -1e9, whose softmax
//!   weight is exactly 0 in fp32 and bf16, and global attention's query mean multiplies it by
//!   its mask, as long as the column has an unmasked row at all;
//! - the outer product mean multiplies it by its mask, and its normaliser counts it as 0.
//!
//! So the pair, and every unmasked row, come out of a stack the same without those rows.
//!
//! - **Extra MSA.** Only the pair leaves the stack, so its masked rows are left out entirely
//!   ([`unmasked_rows`]). A column masked in every row changes nothing either: the
//!   pair hears about it only through the outer product mean, which masks it.
//! - **Main MSA.** The masked-MSA head reads every row of the MSA's own (padded) rows, so a
//!   masked row's output is kept. Rows entering the stack with the same activations and mask
//!   leave it the same (every step treats a row as a function of itself, the pair and the
//!   unmasked rows), and AlphaFold's padding rows are all alike (zero features, no recycled
//!   first row; checked on the features, not assumed: equal features embed alike); so one of
//!   them runs and stands in for the others ([`MsaRows::new`]). The
//!   template rows after the MSA's own are read by nothing once the stack ends, so their
//!   masked rows (padding templates) are left out. One case is left as it is: a residue
//!   column masked in every row (residue padding, which AlphaFold's inference never makes),
//!   where column attention averages uniformly over all rows, so the row count matters.
//! - **Templates.** Padding templates (template mask 0) go through the template pair stack
//!   for nothing: the pointwise attention weighs them 0. They are left out of it
//!   ([`unmasked_rows`]); their MSA rows are masked rows like any other.
//!
//! AlphaFold-Multimer's network ([`crate::model::multimer::MultimerAlphaFold`]) leaves out the
//! same rows after sampling its MSA: the masked extra rows, one stand-in for the masked
//! centres (a sampled padding row is the one-hot of class 0 with zero deletions and profile,
//! the same in every copy), the padding templates' MSA rows. Not the padding templates
//! themselves: Multimer averages the template embeddings over every template.
use tch::{Kind, Tensor};

use crate::model::{ensure, Result};

/// Per row of `mask` [rows] or [rows, ...]: whether any entry is unmasked.
fn rows_with_unmasked(mask: &Tensor) -> Result<Vec<bool>> {
    let per_row = match mask.dim() {
        1 => mask.f_unsqueeze(1)?,
        _ => mask.f_flatten(1, -1)?,
    };
    let any = per_row.f_ne(0.0)?.f_any_dim(1, false)?.f_to_kind(Kind::Int64)?.f_to_device(tch::Device::Cpu)?;
    Ok(Vec::<i64>::try_from(&any)?.into_iter().map(|x| x != 0).collect())
}

/// How many rows of `mask` `[rows]` or [rows, ...] have an unmasked entry.
pub fn count_unmasked_rows(mask: &Tensor) -> Result<i64> {
    Ok(rows_with_unmasked(mask)?.into_iter().filter(|&u| u).count() as i64)
}

/// The indices of the rows of `mask` `[rows]` or [rows, ...] with an unmasked entry, or `None`
/// when that is every row: the extra-MSA rows that run through the extra-MSA stack, and the
/// templates that run through the template pair stack (the pointwise attention gives a masked
/// template weight exactly 0, and with no real template the update is 0).
pub fn unmasked_rows(mask: &Tensor) -> Result<Option<Tensor>> {
    let unmasked = rows_with_unmasked(mask)?;
    if unmasked.iter().all(|&u| u) {
        return Ok(None);
    }
    let rows: Vec<i64> = (0..unmasked.len() as i64).filter(|&i| unmasked[i as usize]).collect();
    Ok(Some(Tensor::from_slice(&rows).f_to_device(mask.device())?))
}

/// Rows `rows` (increasing) of `t` [R, ...]: `t` itself when they are all of its rows, else a
/// copy of them.
pub(crate) fn select_rows(t: &Tensor, rows: &[i64]) -> Result<Tensor> {
    if rows.len() as i64 == t.size()[0] {
        return Ok(t.shallow_clone());
    }
    Ok(t.f_index_select(0, &Tensor::from_slice(rows).f_to_device(t.device())?)?)
}

/// Which rows of the main MSA run through the Evoformer, and where each row the heads read
/// (the MSA's own, `0..needed`) comes from afterwards. Chosen before the rows are embedded, so
/// that only those that run are made (under DAP, only a rank's block of them).
pub struct MsaRows {
    /// Indices of the rows that run, in order (increasing: the MSA's own, then template rows).
    kept: Vec<i64>,
    /// For each of rows `0..needed`, its row among the kept ones; `None`: the same index.
    restore: Option<Vec<i64>>,
    /// Rows read after the stack.
    needed: i64,
}

impl MsaRows {
    /// All `rows` run; rows `0..needed` are read afterwards.
    pub fn all(rows: i64, needed: i64) -> Self {
        MsaRows { kept: (0..rows).collect(), restore: None, needed }
    }

    /// The selection for an MSA whose rows have `mask` [S, N] (template rows included), of
    /// which rows `0..needed` are read after the stack (the MSA's own; the rest are template
    /// rows), `content` [>= needed, ...] those rows' inputs: masked rows whose inputs are equal
    /// enter the stack alike. Row 0, which is recycled, always runs.
    pub fn new(content: &Tensor, mask: &Tensor, needed: i64) -> Result<Self> {
        let rows = mask.size()[0];
        ensure!(
            (1..=rows).contains(&needed) && content.size().first().is_some_and(|&c| c >= needed),
            "MSA rows: {needed} read after the stack, of {rows} rows with inputs for {:?}",
            content.size().first()
        );
        let unmasked = rows_with_unmasked(mask)?;
        let every_column_read = bool::try_from(mask.f_ne(0.0)?.f_any_dim(0, false)?.f_all()?)?;
        if unmasked.iter().all(|&u| u) || !every_column_read {
            return Ok(MsaRows::all(rows, needed));
        }
        // The masked rows the heads read.
        let masked: Vec<i64> = (1..needed).filter(|&i| !unmasked[i as usize]).collect();
        // A masked row equal to the first (the stand-in) is a copy: it does not run.
        let mut copy = vec![false; rows as usize];
        if let [first, rest @ ..] = masked.as_slice() {
            let index = Tensor::from_slice(rest).f_to_device(content.device())?;
            let first_row = content.f_select(0, *first)?.f_unsqueeze(0)?;
            let same = content.f_index_select(0, &index)?.f_eq_tensor(&first_row)?;
            // Flattened per row by hand: a reshape to [0, -1] fails when no row is left.
            let same = same.f_flatten(1, -1)?.f_all_dim(1, false)?;
            let same = Vec::<i64>::try_from(&same.f_to_kind(Kind::Int64)?.f_to_device(tch::Device::Cpu)?)?;
            for (&i, s) in rest.iter().zip(same) {
                copy[i as usize] = s != 0;
            }
        }
        let (mut kept, mut restore, mut stand_in_at) = (Vec::new(), Vec::with_capacity(needed as usize), 0);
        for i in 0..rows {
            let at = kept.len() as i64;
            if i >= needed {
                // A template row: nothing reads it after the stack, so only its effect counts.
                if unmasked[i as usize] {
                    kept.push(i);
                }
            } else if copy[i as usize] {
                restore.push(stand_in_at);
            } else {
                if masked.first() == Some(&i) {
                    stand_in_at = at;
                }
                restore.push(at);
                kept.push(i);
            }
        }
        // Every own row ran where it was (only template rows left out): nothing to restore.
        let moved = restore.iter().zip(0..).any(|(&r, i)| r != i);
        Ok(MsaRows { kept, restore: moved.then_some(restore), needed })
    }

    /// [`MsaRows::new`] with `drop` (else [`MsaRows::all`]).
    pub fn choose(drop: bool, content: &Tensor, mask: &Tensor, needed: i64) -> Result<Self> {
        match drop {
            true => MsaRows::new(content, mask, needed),
            false => Ok(MsaRows::all(mask.size()[0], needed)),
        }
    }

    /// The rows that run, in order: indices into the input's rows.
    pub fn kept(&self) -> &[i64] {
        &self.kept
    }

    /// How many of the rows that run are the MSA's own (they come first): the rows the heads
    /// read of the stack's output.
    pub fn own_kept(&self) -> i64 {
        self.kept.iter().filter(|&&i| i < self.needed).count() as i64
    }

    /// The rows of `t` [S, ...] that run.
    pub fn select(&self, t: &Tensor) -> Result<Tensor> {
        select_rows(t, &self.kept)
    }

    /// Rows `0..needed` of the input's numbering from the stack's output `t` [at least
    /// [`MsaRows::own_kept`], ...], wherever the stack left it (an offloading stack: on the
    /// host).
    pub fn restore(&self, t: &Tensor) -> Result<Tensor> {
        Ok(match &self.restore {
            Some(restore) => t.f_index_select(0, &Tensor::from_slice(restore).f_to_device(t.device())?)?,
            None => t.f_narrow(0, 0, self.needed)?,
        })
    }
}
