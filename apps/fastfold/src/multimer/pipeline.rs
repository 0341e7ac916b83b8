//! AlphaFold-Multimer's feature pipeline after the searches (`pipeline_multimer.py`,
//! `feature_processing.pair_and_merge`, `msa_pairing.py`): each chain's monomer features
//! converted (`convert_monomer_features`, `process_unmerged_features`), numbered
//! (`add_assembly_features`); for a heteromer the UniProt rows paired across chains and the
//! paired rows removed from each chain's own MSA; each chain's MSA cropped (at most
//! [`MSA_CROP_SIZE`] rows, half of them paired) and its templates to [`MAX_TEMPLATES`];
//! copies of an entity joined along residues (their MSAs side by side), entities arranged
//! block-diagonally (gap outside each block), under the paired rows; `cluster_bias_mask` (the
//! rows the model always keeps as cluster centres), `bert_mask` (the entries the masked-MSA
//! loss may use), the masks; the MSA padded to [`MIN_MSA_ROWS`] rows.
//!
//! Everything is kept in the `restypes` order (AlphaFold pairs in HHblits' order and converts at
//! the end; the gap is 21 in both and the rest only compared for equality, so the result is
//! the same), and the padding rows after the conversion are 0, as AlphaFold's are.
use anyhow::bail;

use super::complex::Complex;
use super::features::{Array, EntityInput, MultimerFeatures, Templates, Values};
use super::grid::Grid;
use super::pairing::{paired_rows, unpaired_rows};
use crate::residue_constants::{restype_atom37_mask, ATOM_TYPE_NUM};

/// Rows each chain's MSA is cropped to (`feature_processing.MSA_CROP_SIZE`); at most half of
/// them paired.
pub const MSA_CROP_SIZE: usize = 2048;
/// Templates per chain (`feature_processing.MAX_TEMPLATES`): the first kept, fewer padded.
pub const MAX_TEMPLATES: usize = 4;
/// The MSA is padded to at least this many rows (`pipeline_multimer.pad_msa`), so that the
/// model's extra MSA is never empty.
pub const MIN_MSA_ROWS: usize = 512;
/// The gap class (`MSA_GAP_IDX`), also what fills the MSA outside each entity's block.
const GAP: i32 = 21;

/// One chain, or chains joined: the per-residue features and the MSA blocks.
#[derive(Clone, Debug)]
struct Part {
    aatype: Vec<i32>,
    residue_index: Vec<i32>,
    asym_id: Vec<f64>,
    sym_id: Vec<f64>,
    entity_id: Vec<f64>,
    deletion_mean: Vec<f32>,
    /// The chain's own MSA (unpaired) and its deletions.
    msa: Grid<i32>,
    deletion_matrix: Grid<f32>,
    /// The paired rows (heteromers).
    paired: Option<(Grid<i32>, Grid<f32>)>,
    templates: Templates,
    /// Templates kept (the first chain's, once joined).
    num_templates: usize,
}

impl Part {
    /// Chain `asym_id` of entity `entity_id` (copy `sym_id`) from its entity's features.
    fn chain(input: &EntityInput, entity_id: usize, sym_id: usize, asym_id: usize) -> Part {
        let raw = &input.raw;
        let n = raw.seq_length;
        let deletion_matrix = Grid::from_rows(raw.deletion_matrix.iter().cloned(), n);
        // numpy's float32 mean: a float32 sum divided by the row count in float64.
        let rows = deletion_matrix.rows as f64;
        let deletion_mean = (0..n)
            .map(|j| (f64::from(deletion_matrix.iter_rows().fold(0f32, |s, r| s + r[j])) / rows) as f32)
            .collect();
        let templates = Templates::of_hits(raw.templates.as_deref(), n);
        Part {
            aatype: raw.aatype.iter().map(|&a| a as i32).collect(),
            residue_index: raw.residue_index.iter().map(|&i| i as i32).collect(),
            asym_id: vec![asym_id as f64; n],
            sym_id: vec![sym_id as f64; n],
            entity_id: vec![entity_id as f64; n],
            deletion_mean,
            msa: Grid::from_rows(raw.msa.iter().map(|r| r.iter().map(|&k| k as i32).collect()), n),
            deletion_matrix,
            paired: None,
            num_templates: templates.len(),
            templates,
        }
    }

    /// `_crop_single_chain`: the paired rows to half of `crop`, the chain's own rows to what
    /// the paired rows that are not all gap leave of it; templates to [`MAX_TEMPLATES`].
    fn crop(&mut self, crop: usize) {
        let mut own = crop;
        if let Some((msa, deletions)) = &mut self.paired {
            let keep = msa.rows.min(crop / 2);
            (*msa, *deletions) = (msa.head(keep), deletions.head(keep));
            let filled = msa.iter_rows().filter(|r| r.iter().any(|&k| k != GAP)).count();
            own = crop.saturating_sub(filled);
        }
        (self.msa, self.deletion_matrix) = (self.msa.head(own), self.deletion_matrix.head(own));
        // Cropped to the first four, then padded to four (`_pad_templates`).
        self.num_templates = self.templates.len().min(MAX_TEMPLATES);
        self.templates = self.templates.fixed(MAX_TEMPLATES);
    }

    /// The parts side by side (`_merge_features_from_multiple_chains`): per-residue features
    /// joined; the MSAs joined along residues (`dense`, copies of one entity) or block-diagonal
    /// with gaps (entities); the paired rows joined along residues; the first part's template
    /// count.
    fn join(parts: &[Part], dense: bool) -> Part {
        let cat = |f: fn(&Part) -> &Vec<f64>| parts.iter().flat_map(|p| f(p).iter().copied()).collect();
        let msas: Vec<&Grid<i32>> = parts.iter().map(|p| &p.msa).collect();
        let deletions: Vec<&Grid<f32>> = parts.iter().map(|p| &p.deletion_matrix).collect();
        let (msa, deletion_matrix) = match dense {
            true => (Grid::hstack(&msas), Grid::hstack(&deletions)),
            false => (Grid::block_diag(&msas, GAP), Grid::block_diag(&deletions, 0.0)),
        };
        let paired = parts.iter().map(|p| p.paired.as_ref()).collect::<Option<Vec<_>>>().map(|pairs| {
            let msas: Vec<&Grid<i32>> = pairs.iter().map(|(m, _)| m).collect();
            let deletions: Vec<&Grid<f32>> = pairs.iter().map(|(_, d)| d).collect();
            (Grid::hstack(&msas), Grid::hstack(&deletions))
        });
        Part {
            aatype: parts.iter().flat_map(|p| p.aatype.iter().copied()).collect(),
            residue_index: parts.iter().flat_map(|p| p.residue_index.iter().copied()).collect(),
            asym_id: cat(|p| &p.asym_id),
            sym_id: cat(|p| &p.sym_id),
            entity_id: cat(|p| &p.entity_id),
            deletion_mean: parts.iter().flat_map(|p| p.deletion_mean.iter().copied()).collect(),
            msa,
            deletion_matrix,
            paired,
            templates: Templates::join(&parts.iter().map(|p| &p.templates).collect::<Vec<_>>()),
            num_templates: parts[0].num_templates,
        }
    }
}

/// The features of `complex` from `inputs`, one per entity in entity order (the monomer
/// features of its sequence and, for a heteromer, its UniProt alignment), as
/// `pipeline_multimer.DataPipeline.process` makes them.
pub fn features(complex: &Complex, inputs: &[EntityInput]) -> anyhow::Result<MultimerFeatures> {
    features_with_crop(complex, inputs, MSA_CROP_SIZE)
}

/// [`features`] with another MSA crop size than AlphaFold's [`MSA_CROP_SIZE`].
pub fn features_with_crop(complex: &Complex, inputs: &[EntityInput], crop: usize) -> anyhow::Result<MultimerFeatures> {
    let entities = complex.entity_representatives();
    if inputs.len() != entities.len() {
        bail!("{} entities in the complex, features for {}", entities.len(), inputs.len());
    }
    let pair = !complex.is_homomer_or_monomer();
    for (chain, input) in entities.iter().zip(inputs) {
        if input.raw.seq_length != chain.sequence.chars().count() {
            bail!(
                "chain {} ({}): features of {} residues for {}",
                chain.id,
                chain.record,
                input.raw.seq_length,
                chain.sequence.len()
            );
        }
        if pair && input.pairing.is_none() {
            bail!(
                "chain {} ({}): no UniProt alignment to pair its rows with the other chains'",
                chain.id,
                chain.record
            );
        }
    }
    let order = complex.assembly_order();
    let mut chains: Vec<Part> =
        order.iter().map(|c| Part::chain(&inputs[c.entity_id - 1], c.entity_id, c.sym_id, c.asym_id)).collect();
    if pair {
        let pairing: Vec<_> =
            order.iter().map(|c| inputs[c.entity_id - 1].pairing.as_ref().expect("checked")).collect();
        let msas: Vec<&Grid<i32>> = pairing.iter().map(|p| &p.msa).collect();
        let species: Vec<&[String]> = pairing.iter().map(|p| p.species.as_slice()).collect();
        let rows = paired_rows(&msas, &species);
        for (c, (chain, p)) in chains.iter_mut().zip(&pairing).enumerate() {
            // The gap row (`pad_features`) stands for a chain without the species.
            let gap = p.msa.rows;
            let pick: Vec<usize> = rows.iter().map(|r| r[c].unwrap_or(gap)).collect();
            let msa = p.msa.pad_rows(gap + 1, GAP).select(&pick);
            let deletions = p.deletion_matrix.pad_rows(gap + 1, 0.0).select(&pick);
            let own = unpaired_rows(&chain.msa, &msa);
            (chain.msa, chain.deletion_matrix) = (chain.msa.select(&own), chain.deletion_matrix.select(&own));
            chain.paired = Some((msa, deletions));
        }
    }
    for chain in &mut chains {
        chain.crop(crop);
    }
    // Copies of an entity side by side, then the entities block-diagonally.
    let groups: Vec<Part> = (1..=complex.num_entities())
        .map(|e| Part::join(&chains.iter().filter(|c| c.entity_id[0] == e as f64).cloned().collect::<Vec<_>>(), true))
        .collect();
    let merged = Part::join(&groups, false);
    let ones = |p: &Part| Grid::filled(p.msa.rows, p.msa.cols, 1f32);
    let own_bert = Grid::block_diag(&groups.iter().map(ones).collect::<Vec<_>>().iter().collect::<Vec<_>>(), 0.0);
    let (msa, deletion_matrix, bert_mask, cluster_bias_mask) = match &merged.paired {
        Some((paired, paired_deletions)) => {
            let mut bias = vec![0f64; paired.rows + merged.msa.rows];
            bias[0] = 1.0;
            (
                Grid::vstack(&[paired, &merged.msa]),
                Grid::vstack(&[paired_deletions, &merged.deletion_matrix]),
                Grid::vstack(&[&Grid::filled(paired.rows, paired.cols, 1.0), &own_bert]),
                bias,
            )
        }
        None => {
            // The first row of each entity's block: its query.
            let bias = groups.iter().flat_map(|g| (0..g.msa.rows).map(|i| f64::from(u8::from(i == 0)))).collect();
            (merged.msa.clone(), merged.deletion_matrix.clone(), own_bert, bias)
        }
    };
    Ok(assemble(&merged, complex.chains.len(), msa, deletion_matrix, bert_mask, cluster_bias_mask))
}

/// The final dictionary (`process_final`, then `pad_msa`), AlphaFold's names and dtypes.
fn assemble(
    merged: &Part,
    num_chains: usize,
    msa: Grid<i32>,
    deletion_matrix: Grid<f32>,
    bert_mask: Grid<f32>,
    cluster_bias_mask: Vec<f64>,
) -> MultimerFeatures {
    let n = merged.aatype.len();
    let rows = msa.rows;
    let padded = rows.max(MIN_MSA_ROWS);
    let atom_mask = restype_atom37_mask();
    let array = |shape: &[usize], values: Values| Array { shape: shape.to_vec(), values };
    let msa_mask = Grid::filled(rows, n, 1f32).pad_rows(padded, 0.0);
    let mut bias = cluster_bias_mask;
    bias.resize(padded, 0.0);
    let t = merged.templates.len();
    let mut arrays = vec![
        ("aatype", array(&[n], Values::I32(merged.aatype.clone()))),
        (
            "all_atom_mask",
            array(
                &[n, ATOM_TYPE_NUM],
                Values::I32(merged.aatype.iter().flat_map(|&a| atom_mask[a as usize].map(|m| m as i32)).collect()),
            ),
        ),
        ("all_atom_positions", array(&[n, ATOM_TYPE_NUM, 3], Values::F64(vec![0.0; n * ATOM_TYPE_NUM * 3]))),
        ("assembly_num_chains", array(&[], Values::I64(vec![num_chains as i64]))),
        ("asym_id", array(&[n], Values::F64(merged.asym_id.clone()))),
        ("bert_mask", array(&[padded, n], Values::F32(bert_mask.pad_rows(padded, 0.0).data))),
        ("cluster_bias_mask", array(&[padded], Values::F64(bias))),
        ("deletion_matrix", array(&[padded, n], Values::F32(deletion_matrix.pad_rows(padded, 0.0).data))),
        ("deletion_mean", array(&[n], Values::F32(merged.deletion_mean.clone()))),
        ("entity_id", array(&[n], Values::F64(merged.entity_id.clone()))),
        ("entity_mask", array(&[n], Values::I32(vec![1; n]))),
        ("msa", array(&[padded, n], Values::I32(msa.pad_rows(padded, 0).data))),
        ("msa_mask", array(&[padded, n], Values::F32(msa_mask.data))),
        ("num_alignments", array(&[], Values::I32(vec![rows as i32]))),
        ("num_templates", array(&[], Values::I32(vec![merged.num_templates as i32]))),
        ("residue_index", array(&[n], Values::I32(merged.residue_index.clone()))),
        ("seq_length", array(&[], Values::I32(vec![n as i32]))),
        ("seq_mask", array(&[n], Values::F32(vec![1.0; n]))),
        ("sym_id", array(&[n], Values::F64(merged.sym_id.clone()))),
        ("template_aatype", array(&[t, n], Values::I64(merged.templates.aatype.data.clone()))),
        ("template_all_atom_mask", array(&[t, n, ATOM_TYPE_NUM], Values::F32(merged.templates.masks.data.clone()))),
        (
            "template_all_atom_positions",
            array(&[t, n, ATOM_TYPE_NUM, 3], Values::F32(merged.templates.positions.data.clone())),
        ),
    ];
    arrays.sort_by_key(|(name, _)| *name);
    MultimerFeatures { arrays }
}
