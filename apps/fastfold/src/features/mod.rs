//! AlphaFold monomer input features: the raw features of a sequence and its MSA
//! (`alphafold/data/pipeline.py`), and the processed batch the model consumes
//! (`alphafold/model/tf/input_pipeline.py` and `data_transforms.py` under the monomer
//! `data` config), produced here without TensorFlow, or loaded from AlphaFold's own `.npz`.
//!
//! Recycling/ensemble dimension: every tensor of [`Features`] has a leading dimension R, one
//! slice per recycling iteration, as AlphaFold's processed dictionary has
//! (`num_ensemble * (num_recycle + 1)` with `resample_msa_in_recycling`, so each iteration sees
//! a fresh MSA sample). Sequence features repeat across R; MSA features differ.
//! [`Features::iteration`] takes one slice without the leading dimension.
//!
//! Kinds: index features (`aatype`, `residue_index`, `seq_length`, `true_msa`, `extra_msa`,
//! `residx_*`) are int64, everything else float32, whatever the file stored.
mod padding;
mod pipeline;
mod raw_npz;
pub mod rng;

use std::collections::HashMap;
use std::path::Path;

use data::a3m::Msa;
use data::{Error, Result};
use tch::{Device, Kind, Tensor};

use crate::residue_constants::{aatype_of, msa_class_of};
use crate::search::templates::TemplateHitFeatures;

/// Templates in a processed batch (AlphaFold's `max_templates`): fewer hits are padded with
/// empty templates (mask 0), as `make_fixed_size` pads them.
pub const MAX_TEMPLATES: usize = 4;

pub use pipeline::process;

/// Features of one sequence and its alignment before processing, as AlphaFold's data pipeline
/// makes them (`make_sequence_features`, `make_msa_features`), with the MSA already remapped
/// to the `restypes` order (`correct_msa_restypes`).
#[derive(Clone, Debug, PartialEq)]
pub struct RawFeatures {
    /// Residue types `[N]`, 0..=20 (`restypes` order, 20 = X).
    pub aatype: Vec<i64>,
    /// Domain breaks `[N]`: all zero for a single chain.
    pub between_segment_residues: Vec<i64>,
    /// Residue indices `[N]`: 0..N.
    pub residue_index: Vec<i64>,
    /// N.
    pub seq_length: usize,
    /// MSA rows `[S][N]`, classes 0..=21 in `restypes` order (20 = X, 21 = gap); row 0 is the
    /// query.
    pub msa: Vec<Vec<i64>>,
    /// Deletion counts `[S][N]`.
    pub deletion_matrix: Vec<Vec<f32>>,
    /// S, the number of distinct MSA rows.
    pub num_alignments: usize,
    /// Template hits from the template search (best first, at most 20, as AlphaFold's
    /// `TemplateHitFeaturizer` gives them), `None` when no template search ran; the first
    /// [`MAX_TEMPLATES`] become the processed template features.
    pub templates: Option<Vec<TemplateHitFeatures>>,
}

impl RawFeatures {
    /// Raw features of `sequence` (letters of `ACDEFGHIKLMNPQRSTVWYX`, as `data::fasta` gives)
    /// with the alignment `msa` (and the path that names it in errors), or in single-sequence
    /// mode (an MSA of the query alone) when `msa` is `None`. The alignment's query row must
    /// be the sequence (same length, same residue types).
    pub fn new(sequence: &str, msa: Option<(&Msa, &Path)>) -> Result<RawFeatures> {
        let aatype: Vec<i64> = sequence.chars().map(|c| aatype_of(c) as i64).collect();
        let n = aatype.len();
        if n == 0 {
            return Err(Error::Format { path: "<sequence>".into(), msg: "empty sequence".into() });
        }
        let single;
        let (msa, source) = match msa {
            Some(m) => m,
            None => {
                single = Msa::single(sequence, "query");
                (&single, Path::new("<query>"))
            }
        };
        let bad = |msg: String| Error::Format { path: source.to_path_buf(), msg };
        let query = msa.sequences.first().ok_or_else(|| bad("empty alignment".into()))?;
        if query.len() != n {
            return Err(bad(format!("query row has {} columns, the sequence has {n} residues", query.len())));
        }
        if let Some(j) = query.chars().zip(sequence.chars()).position(|(a, b)| aatype_of(a) != aatype_of(b)) {
            return Err(bad(format!("query row differs from the sequence at position {}", j + 1)));
        }
        let mut rows = Vec::with_capacity(msa.len());
        let mut deletions = Vec::with_capacity(msa.len());
        let mut seen = std::collections::HashSet::new();
        for ((seq, del), desc) in msa.sequences.iter().zip(&msa.deletion_matrix).zip(&msa.descriptions) {
            if seq.len() != n || del.len() != n {
                return Err(bad(format!("row {desc:?} has {} columns, the query has {n}", seq.len())));
            }
            if !seen.insert(seq.as_str()) {
                continue;
            }
            let row = seq
                .chars()
                .enumerate()
                .map(|(j, c)| {
                    msa_class_of(c)
                        .map(|k| k as i64)
                        .ok_or_else(|| bad(format!("row {desc:?}, column {}: {c:?} is not an alignment code", j + 1)))
                })
                .collect::<Result<Vec<i64>>>()?;
            rows.push(row);
            deletions.push(del.iter().map(|&d| d as f32).collect());
        }
        Ok(RawFeatures {
            aatype,
            between_segment_residues: vec![0; n],
            residue_index: (0..n as i64).collect(),
            seq_length: n,
            num_alignments: rows.len(),
            msa: rows,
            deletion_matrix: deletions,
            templates: None,
        })
    }
}

/// The `data` settings of AlphaFold's monomer config that shape the processed batch.
#[derive(Clone, Debug, PartialEq)]
pub struct FeatureConfig {
    /// MSA rows sampled as cluster centres (`eval.max_msa_clusters`).
    pub max_msa_clusters: usize,
    /// Remaining rows kept as the extra MSA (`common.max_extra_msa`).
    pub max_extra_msa: usize,
    /// Fraction of MSA entries masked for BERT (`eval.masked_msa_replace_fraction`).
    pub masked_msa_replace_fraction: f64,
    /// A masked entry becomes a uniformly random amino acid with this probability.
    pub uniform_prob: f64,
    /// ... a draw from the column's profile with this probability.
    pub profile_prob: f64,
    /// ... stays itself with this probability (the rest becomes the mask token 22).
    pub same_prob: f64,
    /// Recycling iterations after the first (`common.num_recycle`); R = num_recycle + 1.
    pub num_recycle: usize,
    /// Pad the MSA to `max_msa_clusters` rows and the extra MSA to `max_extra_msa` rows, as
    /// AlphaFold's `make_fixed_size` does. Off, the batch has only the rows there are (the
    /// extra MSA may then have zero rows); padded rows have zero masks either way.
    pub pad_msa: bool,
}

impl Default for FeatureConfig {
    /// AlphaFold's monomer defaults (`model_2` and `model_5` use these sizes; see
    /// [`crate::preset::Preset`] for the others), without padding.
    fn default() -> Self {
        FeatureConfig {
            max_msa_clusters: 512,
            max_extra_msa: 1024,
            masked_msa_replace_fraction: 0.15,
            uniform_prob: 0.1,
            profile_prob: 0.1,
            same_prob: 0.1,
            num_recycle: 3,
            pad_msa: false,
        }
    }
}

/// Dimension names of the feature arrays' shapes (processed and raw).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dim {
    /// Recycling iterations.
    R,
    /// Residues.
    N,
    /// MSA rows (cluster centres).
    S,
    /// Extra MSA rows.
    E,
    /// Templates.
    T,
    /// A fixed size.
    K(i64),
}

/// Every processed feature: AlphaFold's name, shape and kind (the order of [`Features`]).
const SCHEMA: [(&str, &[Dim], Kind); 19] = {
    use Dim::*;
    [
        ("aatype", &[R, N], Kind::Int64),
        ("residue_index", &[R, N], Kind::Int64),
        ("seq_length", &[R], Kind::Int64),
        ("seq_mask", &[R, N], Kind::Float),
        ("target_feat", &[R, N, K(22)], Kind::Float),
        ("msa_feat", &[R, S, N, K(49)], Kind::Float),
        ("msa_mask", &[R, S, N], Kind::Float),
        ("msa_row_mask", &[R, S], Kind::Float),
        ("bert_mask", &[R, S, N], Kind::Float),
        ("true_msa", &[R, S, N], Kind::Int64),
        ("extra_msa", &[R, E, N], Kind::Int64),
        ("extra_has_deletion", &[R, E, N], Kind::Float),
        ("extra_deletion_value", &[R, E, N], Kind::Float),
        ("extra_msa_mask", &[R, E, N], Kind::Float),
        ("extra_msa_row_mask", &[R, E], Kind::Float),
        ("residx_atom14_to_atom37", &[R, N, K(14)], Kind::Int64),
        ("residx_atom37_to_atom14", &[R, N, K(37)], Kind::Int64),
        ("atom14_atom_exists", &[R, N, K(14)], Kind::Float),
        ("atom37_atom_exists", &[R, N, K(37)], Kind::Float),
    ]
};

/// The optional template features: AlphaFold's name, shape and kind (the order of
/// [`TemplateFeatures`]).
const TEMPLATE_SCHEMA: [(&str, &[Dim], Kind); 6] = {
    use Dim::*;
    [
        ("template_aatype", &[R, T, N], Kind::Int64),
        ("template_all_atom_positions", &[R, T, N, K(37), K(3)], Kind::Float),
        ("template_all_atom_masks", &[R, T, N, K(37)], Kind::Float),
        ("template_mask", &[R, T], Kind::Float),
        ("template_pseudo_beta", &[R, T, N, K(3)], Kind::Float),
        ("template_pseudo_beta_mask", &[R, T, N], Kind::Float),
    ]
};

/// Template features of a processed batch (from template search, as AlphaFold's pipeline
/// makes them), T templates; in [`Features`] every tensor has the leading R dimension, in a
/// model batch it does not.
#[derive(Debug)]
pub struct TemplateFeatures {
    /// [R, T, N] residue types 0..=20.
    pub aatype: Tensor,
    /// [R, T, N, 37, 3] Å.
    pub all_atom_positions: Tensor,
    /// [R, T, N, 37].
    pub all_atom_masks: Tensor,
    /// [R, T] 1 for a real template.
    pub mask: Tensor,
    /// [R, T, N, 3] Å.
    pub pseudo_beta: Tensor,
    /// [R, T, N].
    pub pseudo_beta_mask: Tensor,
}

impl TemplateFeatures {
    /// The features by AlphaFold's names, in a fixed order.
    pub fn named(&self) -> [(&'static str, &Tensor); 6] {
        let t = [
            &self.aatype,
            &self.all_atom_positions,
            &self.all_atom_masks,
            &self.mask,
            &self.pseudo_beta,
            &self.pseudo_beta_mask,
        ];
        std::array::from_fn(|i| (TEMPLATE_SCHEMA[i].0, t[i]))
    }

    /// The struct from tensors in [`TemplateFeatures::named`] order.
    pub fn from_array(t: [Tensor; 6]) -> TemplateFeatures {
        let [aatype, all_atom_positions, all_atom_masks, mask, pseudo_beta, pseudo_beta_mask] = t;
        TemplateFeatures { aatype, all_atom_positions, all_atom_masks, mask, pseudo_beta, pseudo_beta_mask }
    }

    /// Every tensor mapped by `f`.
    pub fn map(&self, f: impl Fn(&Tensor) -> Tensor) -> TemplateFeatures {
        TemplateFeatures::from_array(self.named().map(|(_, t)| f(t)))
    }
}

/// The processed batch, by AlphaFold's feature names; every tensor has the leading
/// recycling dimension R (see the module docs). S = MSA rows, E = extra MSA rows.
#[derive(Debug)]
pub struct Features {
    /// [R, N] residue types 0..=20.
    pub aatype: Tensor,
    /// [R, N] 0-based residue indices.
    pub residue_index: Tensor,
    /// `[R]` number of residues.
    pub seq_length: Tensor,
    /// [R, N] ones.
    pub seq_mask: Tensor,
    /// [R, N, 22]: between_segment_residues, then one-hot aatype (21).
    pub target_feat: Tensor,
    /// [R, S, N, 49]: one-hot msa (23, with the mask token) 0..23, has_deletion 23,
    /// deletion_value 24, cluster_profile 25..48, cluster deletion_mean_value 48.
    pub msa_feat: Tensor,
    /// [R, S, N].
    pub msa_mask: Tensor,
    /// [R, S].
    pub msa_row_mask: Tensor,
    /// [R, S, N] 1 where the masked-MSA objective replaced an entry.
    pub bert_mask: Tensor,
    /// [R, S, N] the MSA before masking (classes 0..=21).
    pub true_msa: Tensor,
    /// [R, E, N] classes 0..=21.
    pub extra_msa: Tensor,
    /// [R, E, N].
    pub extra_has_deletion: Tensor,
    /// [R, E, N] 2/pi * atan(d / 3).
    pub extra_deletion_value: Tensor,
    /// [R, E, N].
    pub extra_msa_mask: Tensor,
    /// [R, E].
    pub extra_msa_row_mask: Tensor,
    /// [R, N, 14].
    pub residx_atom14_to_atom37: Tensor,
    /// [R, N, 37].
    pub residx_atom37_to_atom14: Tensor,
    /// [R, N, 14].
    pub atom14_atom_exists: Tensor,
    /// [R, N, 37].
    pub atom37_atom_exists: Tensor,
    /// Template features, when the batch has them (from the template search, or from `.npz`
    /// files of AlphaFold's pipeline).
    pub templates: Option<TemplateFeatures>,
}

/// A dimension as text: its symbol, or its size if fixed.
fn dim_text(d: Dim) -> String {
    match d {
        Dim::R => "R".into(),
        Dim::N => "N".into(),
        Dim::S => "S".into(),
        Dim::E => "E".into(),
        Dim::T => "T".into(),
        Dim::K(k) => k.to_string(),
    }
}

/// A schema shape as text, e.g. `[R, N, 22]`.
fn shape_text(dims: &[Dim]) -> String {
    let parts: Vec<String> = dims.iter().map(|&d| dim_text(d)).collect();
    format!("[{}]", parts.join(", "))
}

/// Takes the tensors of `schema` out of `map`, checking every shape (the symbolic dimensions
/// must agree with `sizes`, which records them) and converting kinds. `source` names the
/// origin in errors.
fn take_checked(
    map: &mut HashMap<String, Tensor>,
    schema: &[(&str, &[Dim], Kind)],
    sizes: &mut HashMap<String, i64>,
    source: &Path,
) -> Result<Vec<Tensor>> {
    let bad = |msg: String| Error::Format { path: source.to_path_buf(), msg };
    let mut out: Vec<Tensor> = Vec::with_capacity(schema.len());
    for &(name, dims, kind) in schema {
        let t =
            map.remove(name).ok_or_else(|| bad(format!("missing key {name} (expected shape {})", shape_text(dims))))?;
        let found = t.size();
        let mut ok = found.len() == dims.len();
        if ok {
            for (d, &f) in dims.iter().zip(&found) {
                match d {
                    Dim::K(k) => ok &= *k == f,
                    sym => ok &= *sizes.entry(dim_text(*sym)).or_insert(f) == f,
                }
            }
        }
        if !ok {
            let expected: Vec<String> = dims
                .iter()
                .map(|d| {
                    let sym = dim_text(*d);
                    sizes.get(&sym).map_or(sym, |v| v.to_string())
                })
                .collect();
            return Err(bad(format!("key {name}: expected shape [{}], found {found:?}", expected.join(", "))));
        }
        // Every size but the extra MSA's must be at least 1: the model takes the query row, a
        // residue, a recycling slice and (when the keys are there) a template.
        if let Some((d, _)) = dims.iter().zip(&found).find(|(d, &f)| f == 0 && !matches!(d, Dim::E)) {
            return Err(bad(format!("key {name}: shape {found:?} has no {}", dim_name(*d))));
        }
        let t = t.f_to_kind(kind).map_err(|e| bad(format!("key {name}: {e}")))?;
        check_values(name, &t).map_err(bad)?;
        out.push(t);
    }
    Ok(out)
}

/// The integer features the model one-hot encodes or looks up, and their classes (values
/// 0..classes): residue types with unknown, MSA classes with gap and mask, template residue
/// types with gap.
const CLASSES: [(&str, i64); 4] = [("aatype", 21), ("true_msa", 23), ("extra_msa", 23), ("template_aatype", 22)];

/// Values the model cannot take, named: non-finite floats, integer classes out of range.
fn check_values(name: &str, t: &Tensor) -> std::result::Result<(), String> {
    if t.numel() == 0 {
        return Ok(());
    }
    let e = |e: tch::TchError| format!("key {name}: {e}");
    if t.is_floating_point() {
        if t.f_isfinite().and_then(|f| f.f_all()).map_err(e)?.int64_value(&[]) == 0 {
            return Err(format!("key {name}: NaN or infinite values"));
        }
    } else if let Some(&(_, classes)) = CLASSES.iter().find(|(n, _)| *n == name) {
        let (lo, hi) = (t.f_min().map_err(e)?.int64_value(&[]), t.f_max().map_err(e)?.int64_value(&[]));
        if lo < 0 || hi >= classes {
            return Err(format!("key {name}: values from {lo} to {hi}, the model takes 0 to {}", classes - 1));
        }
    }
    Ok(())
}

fn dim_name(d: Dim) -> &'static str {
    match d {
        Dim::R => "recycling slice (R)",
        Dim::N => "residue (N)",
        Dim::S => "MSA row (S)",
        Dim::E => "extra MSA row (E)",
        Dim::T => "template (T)",
        Dim::K(_) => "entry",
    }
}

impl Features {
    /// The features by AlphaFold's names, in a fixed order.
    pub fn named(&self) -> [(&'static str, &Tensor); 19] {
        let t = [
            &self.aatype,
            &self.residue_index,
            &self.seq_length,
            &self.seq_mask,
            &self.target_feat,
            &self.msa_feat,
            &self.msa_mask,
            &self.msa_row_mask,
            &self.bert_mask,
            &self.true_msa,
            &self.extra_msa,
            &self.extra_has_deletion,
            &self.extra_deletion_value,
            &self.extra_msa_mask,
            &self.extra_msa_row_mask,
            &self.residx_atom14_to_atom37,
            &self.residx_atom37_to_atom14,
            &self.atom14_atom_exists,
            &self.atom37_atom_exists,
        ];
        std::array::from_fn(|i| (SCHEMA[i].0, t[i]))
    }

    /// The struct from the tensors in [`Features::named`] order.
    fn from_array(t: [Tensor; 19]) -> Features {
        let [aatype, residue_index, seq_length, seq_mask, target_feat, msa_feat, msa_mask, msa_row_mask, bert_mask, true_msa, extra_msa, extra_has_deletion, extra_deletion_value, extra_msa_mask, extra_msa_row_mask, residx_atom14_to_atom37, residx_atom37_to_atom14, atom14_atom_exists, atom37_atom_exists] =
            t;
        Features {
            aatype,
            residue_index,
            seq_length,
            seq_mask,
            target_feat,
            msa_feat,
            msa_mask,
            msa_row_mask,
            bert_mask,
            true_msa,
            extra_msa,
            extra_has_deletion,
            extra_deletion_value,
            extra_msa_mask,
            extra_msa_row_mask,
            residx_atom14_to_atom37,
            residx_atom37_to_atom14,
            atom14_atom_exists,
            atom37_atom_exists,
            templates: None,
        }
    }

    /// Builds the struct from tensors by name, checking every shape against the schema (the
    /// dimensions R, N, S, E must agree across features) and converting kinds. `source` names
    /// the origin in errors. Keys not in the schema are ignored. Residues padded after the
    /// real ones (`seq_mask` 0, as ColabFold pads) are removed.
    fn from_map(mut map: HashMap<String, Tensor>, source: &Path) -> Result<Features> {
        let mut sizes: HashMap<String, i64> = HashMap::new();
        let out = take_checked(&mut map, &SCHEMA, &mut sizes, source)?;
        let bad = |msg: String| Error::Format { path: source.to_path_buf(), msg };
        let all: [Tensor; 19] = out.try_into().map_err(|_| bad("feature count mismatch".into()))?;
        let mut features = Features::from_array(all);
        // Any template key asks for all of them: a file missing one would otherwise lose its
        // templates silently.
        if TEMPLATE_SCHEMA.iter().any(|(name, ..)| map.contains_key(*name)) {
            let t = take_checked(&mut map, &TEMPLATE_SCHEMA, &mut sizes, source)?;
            let t: [Tensor; 6] = t.try_into().map_err(|_| bad("template feature count mismatch".into()))?;
            features.templates = Some(TemplateFeatures::from_array(t));
        }
        features.without_residue_padding(source)
    }

    /// Loads AlphaFold's processed feature dictionary saved with `numpy.savez` under its own
    /// names (the output of `RunModel.process_features`, with the leading recycling
    /// dimension), onto `device`. A missing key or a wrong shape is an error naming the file,
    /// the key, the expected and the found shape; other keys (e.g. `random_crop_to_size_seed`)
    /// are ignored.
    pub fn load_npz(path: &Path, device: Device) -> Result<Features> {
        Features::from_npz_arrays(data::npz::read(path)?, path, device)
    }

    /// [`Features::load_npz`] of arrays already read from `path`.
    pub fn from_npz_arrays(arrays: Vec<(String, Tensor)>, path: &Path, device: Device) -> Result<Features> {
        Features::from_map(arrays.into_iter().map(|(k, t)| (k, t.to_device(device))).collect(), path)
    }

    /// Writes the features to `path` as `.npz` under AlphaFold's names (int64 and float32),
    /// through a synced temporary file renamed into place.
    pub fn save_npz(&self, path: &Path) -> Result<()> {
        let mut named: Vec<(String, Tensor)> =
            self.named().iter().map(|(n, t)| (n.to_string(), t.shallow_clone())).collect();
        if let Some(t) = &self.templates {
            named.extend(t.named().iter().map(|(n, t)| (n.to_string(), t.shallow_clone())));
        }
        data::checkpoint::save_npz(&named, path)
    }

    /// Number of recycling iterations R.
    pub fn num_iterations(&self) -> i64 {
        self.aatype.size()[0]
    }

    /// Iteration `i`'s features: every tensor narrowed to that one slice, so R = 1.
    pub fn iteration(&self, i: i64) -> Result<Features> {
        let r = self.num_iterations();
        if !(0..r).contains(&i) {
            return Err(Error::Format {
                path: "<features>".into(),
                msg: format!("recycling iteration {i} out of range 0..{r}"),
            });
        }
        let mut f = Features::from_array(self.named().map(|(_, t)| t.narrow(0, i, 1)));
        f.templates = self.templates.as_ref().map(|t| t.map(|x| x.narrow(0, i, 1)));
        Ok(f)
    }

    /// Residues `start..start + len` of every per-residue feature (templates included), as
    /// AlphaFold's `random_crop_to_size` crops a training example after its MSA processing:
    /// `seq_length` becomes `len`, `residue_index` keeps the residues' own indices, and
    /// MSA rows and templates are kept whole.
    pub fn crop(&self, start: i64, len: i64) -> Result<Features> {
        let n = self.aatype.size()[1];
        if start < 0 || len < 1 || start + len > n {
            return Err(Error::Format {
                path: "<features>".into(),
                msg: format!("crop of residues {start}..{} outside the {n} residues", start + len),
            });
        }
        let narrow = |t: &Tensor, dims: &[Dim]| match dims.iter().position(|d| *d == Dim::N) {
            Some(axis) => t.narrow(axis as i64, start, len),
            None => t.shallow_clone(),
        };
        let named = self.named();
        let mut f = Features::from_array(std::array::from_fn(|i| narrow(named[i].1, SCHEMA[i].1)));
        f.seq_length = f.seq_length.full_like(len);
        f.templates = self.templates.as_ref().map(|t| {
            let named = t.named();
            TemplateFeatures::from_array(std::array::from_fn(|i| narrow(named[i].1, TEMPLATE_SCHEMA[i].1)))
        });
        Ok(f)
    }

    /// The same features on `device`.
    pub fn to_device(&self, device: Device) -> Features {
        let mut f = Features::from_array(self.named().map(|(_, t)| t.to_device(device)));
        f.templates = self.templates.as_ref().map(|t| t.map(|x| x.to_device(device)));
        f
    }
}
