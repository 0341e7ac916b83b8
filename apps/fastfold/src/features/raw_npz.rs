//! Raw features saved as AlphaFold saves them beside its predictions (`features.pkl`): the
//! numeric arrays of `make_sequence_features` and `make_msa_features` under their names and
//! encodings (one-hot `aatype`, MSA rows in HHblits' alphabet), as `.npz`, so a searched MSA
//! can be inspected or compared with AlphaFold's.
use std::path::Path;

use tch::{Kind, Tensor};

use super::RawFeatures;
use crate::residue_constants::{ID_TO_HHBLITS_AA, RESTYPES_WITH_X, RESTYPES_WITH_X_AND_GAP};

impl RawFeatures {
    /// Writes `features.npz`-style arrays to `path` (whole or not at all).
    pub fn save_npz(&self, path: &Path) -> anyhow::Result<()> {
        let n = self.seq_length as i64;
        let s = self.msa.len() as i64;
        // Our MSA classes (restypes order) back to HHblits' ids, AlphaFold's raw `msa`.
        let to_hhblits: Vec<i32> = RESTYPES_WITH_X_AND_GAP
            .iter()
            .map(|c| ID_TO_HHBLITS_AA.iter().position(|h| h == c).unwrap_or(20) as i32)
            .collect();
        let msa: Vec<i32> = self.msa.iter().flatten().map(|&k| to_hhblits[k as usize]).collect();
        let deletions: Vec<i32> = self.deletion_matrix.iter().flatten().map(|&d| d as i32).collect();
        let ints = |v: &[i64]| Tensor::from_slice(v).to_kind(Kind::Int);
        let onehot = Tensor::from_slice(&self.aatype).one_hot(RESTYPES_WITH_X.len() as i64).to_kind(Kind::Int);
        let mut named = vec![
            ("aatype".to_string(), onehot),
            ("between_segment_residues".to_string(), ints(&self.between_segment_residues)),
            ("residue_index".to_string(), ints(&self.residue_index)),
            ("seq_length".to_string(), ints(&vec![n; n as usize])),
            ("msa".to_string(), Tensor::from_slice(&msa).reshape([s, n])),
            ("deletion_matrix_int".to_string(), Tensor::from_slice(&deletions).reshape([s, n])),
            ("num_alignments".to_string(), ints(&vec![self.num_alignments as i64; n as usize])),
        ];
        if let Some(hits) = &self.templates {
            // AlphaFold's raw template features: one-hot HHblits residue classes, atoms,
            // and each hit's Sum_probs.
            let t = hits.len() as i64;
            let k = crate::residue_constants::ATOM_TYPE_NUM as i64;
            let ids: Vec<i64> = hits
                .iter()
                .flat_map(|h| {
                    h.sequence.chars().map(|c| crate::residue_constants::hhblits_aa_to_id(c).unwrap_or(20) as i64)
                })
                .collect();
            let positions: Vec<f32> =
                hits.iter().flat_map(|h| h.positions.iter().flatten().flatten().copied()).collect();
            let masks: Vec<f32> = hits.iter().flat_map(|h| h.masks.iter().flatten().copied()).collect();
            let probs: Vec<f32> = hits.iter().map(|h| h.sum_probs).collect();
            named.extend([
                (
                    "template_aatype".to_string(),
                    Tensor::from_slice(&ids).reshape([t, n]).one_hot(22).to_kind(Kind::Float),
                ),
                ("template_all_atom_positions".to_string(), Tensor::from_slice(&positions).reshape([t, n, k, 3])),
                ("template_all_atom_masks".to_string(), Tensor::from_slice(&masks).reshape([t, n, k])),
                ("template_sum_probs".to_string(), Tensor::from_slice(&probs).reshape([t, 1])),
            ]);
        }
        Ok(data::checkpoint::save_npz(&named, path)?)
    }
}
