//! What the pipeline takes per entity and what it gives: the UniProt alignment for pairing
//! (`_all_seq_msa_features`), the template hits as Multimer's features read them, and the
//! complex's features by AlphaFold's names with numpy's dtypes.
use std::collections::HashSet;
use std::path::Path;

use data::a3m::Msa;
use tch::Tensor;

use super::grid::Grid;
use super::species::species_id;
use crate::features::RawFeatures;
use crate::residue_constants::{hhblits_aa_to_id, map_hhblits_aatype_to_our_aatype, ATOM_TYPE_NUM};
use crate::search::templates::TemplateHitFeatures;

/// UniProt rows kept for pairing (`DataPipeline`'s `max_uniprot_hits`).
pub const MAX_UNIPROT_HITS: usize = 50_000;

/// A chain's UniProt alignment as pairing reads it: its first [`MAX_UNIPROT_HITS`] rows,
/// duplicates dropped (`make_msa_features`), each row's species from its description.
#[derive(Clone, Debug, PartialEq)]
pub struct PairingMsa {
    /// [S, N] MSA classes (`restypes` order with X and gap).
    pub msa: Grid<i32>,
    /// [S, N] deletion counts.
    pub deletion_matrix: Grid<f32>,
    /// `[S]` species codes, `""` where none; the query's (row 0) is always `""`, as AlphaFold
    /// names the query `chain_<id>`.
    pub species: Vec<String>,
}

impl PairingMsa {
    /// The alignment `msa` of `sequence` read from `source` (named in errors).
    pub fn new(sequence: &str, msa: &Msa, source: &Path) -> data::Result<PairingMsa> {
        let keep = msa.len().min(MAX_UNIPROT_HITS);
        let truncated = Msa {
            sequences: msa.sequences[..keep].to_vec(),
            deletion_matrix: msa.deletion_matrix[..keep].to_vec(),
            descriptions: msa.descriptions[..keep].to_vec(),
        };
        // The monomer features' checks and classes; their duplicate rule picks the same rows.
        let raw = RawFeatures::new(sequence, Some((&truncated, source)))?;
        let mut seen = HashSet::new();
        let mut species: Vec<String> = truncated
            .sequences
            .iter()
            .zip(&truncated.descriptions)
            .filter(|(s, _)| seen.insert(s.as_str()))
            .map(|(_, d)| species_id(d).to_string())
            .collect();
        species[0].clear();
        let n = raw.seq_length;
        Ok(PairingMsa {
            msa: Grid::from_rows(raw.msa.iter().map(|r| r.iter().map(|&k| k as i32).collect()), n),
            deletion_matrix: Grid::from_rows(raw.deletion_matrix, n),
            species,
        })
    }
}

/// What the pipeline needs of one entity: the monomer pipeline's raw features (sequence, merged
/// MSA, template hits) and, for a complex of several entities, the UniProt alignment.
#[derive(Clone, Debug)]
pub struct EntityInput {
    /// The monomer features.
    pub raw: RawFeatures,
    /// The UniProt alignment (heteromers only).
    pub pairing: Option<PairingMsa>,
}

impl EntityInput {
    /// Each entity of `complex` (read from `fasta`, named in errors) on its sequence alone, as
    /// `run_alphafold.py` runs without a search: a one-row MSA, no templates and, for a complex
    /// of several entities, the query row as its UniProt alignment (paired across chains).
    pub fn single_sequences(complex: &super::Complex, fasta: &Path) -> anyhow::Result<Vec<EntityInput>> {
        use anyhow::Context;
        let pair = !complex.is_homomer_or_monomer();
        complex
            .entity_representatives()
            .into_iter()
            .map(|chain| {
                let what = || format!("chain {} ({})", chain.id, chain.record);
                let raw = RawFeatures::new(&chain.sequence, None).with_context(what)?;
                let pairing = match pair {
                    true => {
                        let alone = Msa::single(&chain.sequence, &chain.description);
                        Some(PairingMsa::new(&chain.sequence, &alone, fasta).with_context(what)?)
                    }
                    false => None,
                };
                Ok(EntityInput { raw, pairing })
            })
            .collect()
    }
}

/// A chain's template features, T templates of N residues: [T, N] residue types (`restypes`
/// with X and gap), [T, N * 37 * 3] positions, [T, N * 37] masks.
#[derive(Clone, Debug, PartialEq)]
pub struct Templates {
    /// Residue types.
    pub aatype: Grid<i64>,
    /// Atom positions (Å).
    pub positions: Grid<f32>,
    /// Atom masks.
    pub masks: Grid<f32>,
}

impl Templates {
    /// The hits' features as `convert_monomer_features` gives them; without hits (or without a
    /// template search), Multimer's one all-zero template (`HmmsearchHitFeaturizer`), whose
    /// residue types read as 0.
    pub fn of_hits(hits: Option<&[TemplateHitFeatures]>, n: usize) -> Templates {
        let to_ours = map_hhblits_aatype_to_our_aatype();
        match hits {
            Some(hits) if !hits.is_empty() => Templates {
                aatype: Grid::from_rows(
                    hits.iter().map(|h| {
                        h.sequence.chars().map(|c| to_ours[hhblits_aa_to_id(c).unwrap_or(20)] as i64).collect()
                    }),
                    n,
                ),
                positions: Grid::from_rows(
                    hits.iter().map(|h| h.positions.iter().flatten().flatten().copied().collect()),
                    n * ATOM_TYPE_NUM * 3,
                ),
                masks: Grid::from_rows(
                    hits.iter().map(|h| h.masks.iter().flatten().copied().collect()),
                    n * ATOM_TYPE_NUM,
                ),
            },
            _ => Templates {
                aatype: Grid::filled(1, n, 0),
                positions: Grid::filled(1, n * ATOM_TYPE_NUM * 3, 0.0),
                masks: Grid::filled(1, n * ATOM_TYPE_NUM, 0.0),
            },
        }
    }

    /// Number of templates.
    pub fn len(&self) -> usize {
        self.aatype.rows
    }

    /// Whether there is none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The first `n` templates, padded with zero templates to `n`.
    pub fn fixed(&self, n: usize) -> Templates {
        Templates {
            aatype: self.aatype.head(n).pad_rows(n, 0),
            positions: self.positions.head(n).pad_rows(n, 0.0),
            masks: self.masks.head(n).pad_rows(n, 0.0),
        }
    }

    /// The templates of chains side by side (template t of each chain joined along residues).
    pub fn join(parts: &[&Templates]) -> Templates {
        let each = |f: fn(&Templates) -> &Grid<f32>| Grid::hstack(&parts.iter().map(|t| f(t)).collect::<Vec<_>>());
        Templates {
            aatype: Grid::hstack(&parts.iter().map(|t| &t.aatype).collect::<Vec<_>>()),
            positions: each(|t| &t.positions),
            masks: each(|t| &t.masks),
        }
    }
}

/// An array's values in its numpy dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    /// int32.
    I32(Vec<i32>),
    /// int64.
    I64(Vec<i64>),
    /// float32.
    F32(Vec<f32>),
    /// float64.
    F64(Vec<f64>),
}

/// One feature: its shape and values (row-major).
#[derive(Clone, Debug, PartialEq)]
pub struct Array {
    /// The shape (empty for a scalar).
    pub shape: Vec<usize>,
    /// The values.
    pub values: Values,
}

impl Array {
    /// The array as a tensor of its dtype.
    pub fn tensor(&self) -> Tensor {
        let shape: Vec<i64> = self.shape.iter().map(|&d| d as i64).collect();
        match &self.values {
            Values::I32(v) => Tensor::from_slice(v),
            Values::I64(v) => Tensor::from_slice(v),
            Values::F32(v) => Tensor::from_slice(v),
            Values::F64(v) => Tensor::from_slice(v),
        }
        .reshape(shape)
    }
}

/// The complex's features, as `pipeline_multimer.DataPipeline.process` returns them: the
/// inputs of AlphaFold-Multimer's model, by its names, in alphabetical order.
#[derive(Clone, Debug, PartialEq)]
pub struct MultimerFeatures {
    /// (name, array).
    pub arrays: Vec<(&'static str, Array)>,
}

impl MultimerFeatures {
    /// The feature named `name`.
    pub fn get(&self, name: &str) -> Option<&Array> {
        self.arrays.iter().find(|(n, _)| *n == name).map(|(_, a)| a)
    }

    /// Every feature as a tensor, by name.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        self.arrays.iter().map(|(n, a)| (n.to_string(), a.tensor())).collect()
    }

    /// Writes the features to `path` as `.npz` (whole or not at all), as `numpy.savez` of
    /// AlphaFold's dictionary would.
    pub fn save_npz(&self, path: &Path) -> data::Result<()> {
        data::checkpoint::save_npz(&self.tensors(), path)
    }
}
