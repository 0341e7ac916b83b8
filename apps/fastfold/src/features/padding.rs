//! Residue padding in processed features: AlphaFold's `make_fixed_size` (which ColabFold uses
//! to pad every query to one size) appends residues with zero features and `seq_mask` 0 after
//! the real ones, and ColabFold cuts the outputs back to `seq_length` after the prediction.
//! Here the padding is cut from the inputs instead, before the model runs: every mask of the
//! model keeps a padded residue from changing a real one (checked in `tests/predict.rs`), so
//! the real residues come out the same, and no output (PDB, pLDDT, PAE) covers padding.
use std::path::Path;

use data::{Error, Result};
use tch::{Kind, Tensor};

use super::{Dim, Features, TemplateFeatures, SCHEMA, TEMPLATE_SCHEMA};

impl Features {
    /// The features without the residues padded after the real ones (`seq_mask` 0); the same
    /// features when there is no padding. A mask with holes (a masked residue before a real
    /// one), slices that disagree or a `seq_length` other than the real residues' count are
    /// errors naming the key and `source`.
    pub(super) fn without_residue_padding(self, source: &Path) -> Result<Features> {
        let n = self.seq_mask.size()[1];
        let real = real_residues(&self.seq_mask).map_err(|msg| Error::Format { path: source.to_path_buf(), msg })?;
        if real == n {
            return Ok(self);
        }
        let lengths = Vec::<i64>::try_from(self.seq_length.to_kind(Kind::Int64).to_device(tch::Device::Cpu))
            .map_err(|e| Error::Format { path: source.to_path_buf(), msg: format!("key seq_length: {e}") })?;
        if let Some(&length) = lengths.iter().find(|&&l| l != real) {
            return Err(Error::Format {
                path: source.to_path_buf(),
                msg: format!(
                    "key seq_length: {length}, but seq_mask marks {real} real residues of {n} (the rest padding)"
                ),
            });
        }
        Ok(self.first_residues(real))
    }

    /// Every per-residue tensor narrowed to its first `n` residues.
    fn first_residues(&self, n: i64) -> Features {
        let cut = |t: &Tensor, dims: &[Dim]| match dims.iter().position(|d| *d == Dim::N) {
            Some(k) => t.narrow(k as i64, 0, n).contiguous(),
            None => t.shallow_clone(),
        };
        let named = self.named();
        let mut out = Features::from_array(std::array::from_fn(|i| cut(named[i].1, SCHEMA[i].1)));
        out.templates = self.templates.as_ref().map(|t| {
            let named = t.named();
            TemplateFeatures::from_array(std::array::from_fn(|i| cut(named[i].1, TEMPLATE_SCHEMA[i].1)))
        });
        out
    }
}

/// How many residues `seq_mask` [R, N] marks real (non-zero), when they all come first and
/// every slice agrees; else a message naming the key.
fn real_residues(seq_mask: &Tensor) -> std::result::Result<i64, String> {
    let e = |e: tch::TchError| format!("key seq_mask: {e}");
    let real = seq_mask.f_ne(0.0).and_then(|t| t.f_to_kind(Kind::Int64)).map_err(e)?.to_device(tch::Device::Cpu);
    let rows = Vec::<Vec<i64>>::try_from(real).map_err(e)?;
    let count = |row: &[i64]| row.iter().take_while(|&&m| m != 0).count();
    let first = rows.first().map_or(0, |r| count(r));
    for (r, row) in rows.iter().enumerate() {
        let leading = count(row);
        if let Some(j) = row[leading..].iter().position(|&m| m != 0) {
            return Err(format!(
                "key seq_mask: residue {} is masked (0) but residue {} after it is not (slice {r}); only \
                 padding after the real residues, as AlphaFold's make_fixed_size adds, can be removed",
                leading + 1,
                leading + j + 1
            ));
        }
        if leading != first {
            return Err(format!("key seq_mask: slice 0 has {first} real residues, slice {r} has {leading}"));
        }
    }
    if first == 0 {
        return Err("key seq_mask: every residue is masked (0)".into());
    }
    Ok(first as i64)
}
