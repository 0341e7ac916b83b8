//! Raw features saved as AlphaFold saves them beside its predictions (`features.pkl`): the
//! numeric arrays of `make_sequence_features` and `make_msa_features` under their names and
//! encodings (one-hot `aatype`, MSA rows in HHblits' alphabet), as `.npz`, so a searched MSA
//! can be inspected or compared with AlphaFold's, and read back (`predict --features`) to
//! predict again without searching, as AlphaFold users rerun from `features.pkl`.
use std::collections::HashMap;
use std::path::Path;

use anyhow::bail;
use tch::{Kind, Tensor};

use super::{take_checked, Dim, RawFeatures};
use crate::residue_constants::{
    map_hhblits_aatype_to_our_aatype, ATOM_TYPE_NUM, ID_TO_HHBLITS_AA, RESTYPES_WITH_X, RESTYPES_WITH_X_AND_GAP,
};
use crate::search::templates::TemplateHitFeatures;

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

/// The raw arrays [`RawFeatures::save_npz`] writes (AlphaFold's `features.pkl`), read in
/// float64 whatever their stored kind.
const RAW_SCHEMA: [(&str, &[Dim], Kind); 5] = {
    use Dim::*;
    [
        ("aatype", &[N, K(RESTYPES_WITH_X.len() as i64)], Kind::Double),
        ("residue_index", &[N], Kind::Double),
        ("between_segment_residues", &[N], Kind::Double),
        ("msa", &[S, N], Kind::Double),
        ("deletion_matrix_int", &[S, N], Kind::Double),
    ]
};

/// The raw template arrays, when a template search ran.
const RAW_TEMPLATE_SCHEMA: [(&str, &[Dim], Kind); 4] = {
    use Dim::*;
    [
        ("template_aatype", &[T, N, K(ID_TO_HHBLITS_AA.len() as i64)], Kind::Double),
        ("template_all_atom_positions", &[T, N, K(ATOM_TYPE_NUM as i64), K(3)], Kind::Double),
        ("template_all_atom_masks", &[T, N, K(ATOM_TYPE_NUM as i64)], Kind::Double),
        ("template_sum_probs", &[T, K(1)], Kind::Double),
    ]
};

impl RawFeatures {
    /// Whether `.npz` arrays are raw features (what [`RawFeatures::save_npz`] writes, with
    /// the raw MSA's `deletion_matrix_int`) rather than processed ones (`msa_feat`).
    pub fn are_raw(names: &[&str]) -> bool {
        names.contains(&"deletion_matrix_int") && !names.contains(&"msa_feat")
    }

    /// Reads the arrays [`RawFeatures::save_npz`] writes, from `path` (named in every error):
    /// one-hot `aatype` [N, 21], `residue_index` and `between_segment_residues` `[N]`, the MSA
    /// [S, N] in HHblits' classes with `deletion_matrix_int`, and the template arrays if any.
    pub fn from_npz_arrays(arrays: Vec<(String, Tensor)>, path: &Path) -> anyhow::Result<RawFeatures> {
        let mut map: HashMap<String, Tensor> = arrays.into_iter().collect();
        let has_templates = map.contains_key("template_aatype");
        // Shapes, sizes and finite values checked as the processed features' are.
        let mut sizes = HashMap::new();
        let [onehot, residue_index, between_segment_residues, hhblits, deletions]: [Tensor; 5] =
            take_checked(&mut map, &RAW_SCHEMA, &mut sizes, path)?.try_into().expect("one tensor per schema entry");
        let n = onehot.size()[0];
        let aatype = one_hot_classes(&onehot, "aatype", path)?;
        let residue_index = integers(&residue_index, "residue_index", path)?;
        let between_segment_residues = integers(&between_segment_residues, "between_segment_residues", path)?;
        let to_ours = map_hhblits_aatype_to_our_aatype();
        let msa = integers(&hhblits, "msa", path)?
            .chunks(n as usize)
            .enumerate()
            .map(|(row, ids)| {
                ids.iter()
                    .map(|&id| match usize::try_from(id).ok().and_then(|id| to_ours.get(id)) {
                        Some(&k) => Ok(k as i64),
                        None => bail!("{}: key msa: row {row} holds {id}, not an HHblits class 0..=21", path.display()),
                    })
                    .collect::<anyhow::Result<Vec<i64>>>()
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        if msa.first() != Some(&aatype) {
            bail!("{}: key msa: row 0 is not the query of aatype", path.display());
        }
        let deletion_matrix: Vec<Vec<f32>> = Vec::<f64>::try_from(deletions.flatten(0, -1))?
            .chunks(n as usize)
            .map(|r| r.iter().map(|&d| d as f32).collect())
            .collect();
        let templates = match has_templates {
            false => None,
            true => {
                let [ids, positions, masks, probs]: [Tensor; 4] =
                    take_checked(&mut map, &RAW_TEMPLATE_SCHEMA, &mut sizes, path)?
                        .try_into()
                        .expect("one tensor per schema entry");
                let t = ids.size()[0];
                let ids = one_hot_classes(&ids.flatten(0, 1), "template_aatype", path)?;
                let positions = Vec::<f64>::try_from(positions.flatten(0, -1))?;
                let masks = Vec::<f64>::try_from(masks.flatten(0, -1))?;
                let probs = Vec::<f64>::try_from(probs.flatten(0, -1))?;
                let (n, k) = (n as usize, ATOM_TYPE_NUM);
                let hits = (0..t as usize)
                    .map(|h| TemplateHitFeatures {
                        sequence: ids[h * n..(h + 1) * n].iter().map(|&id| ID_TO_HHBLITS_AA[id as usize]).collect(),
                        positions: (0..n)
                            .map(|r| {
                                std::array::from_fn(|a| {
                                    std::array::from_fn(|x| positions[((h * n + r) * k + a) * 3 + x] as f32)
                                })
                            })
                            .collect(),
                        masks: (0..n).map(|r| std::array::from_fn(|a| masks[(h * n + r) * k + a] as f32)).collect(),
                        domain_name: format!("template {} of {}", h + 1, path.display()),
                        sum_probs: probs[h] as f32,
                    })
                    .collect();
                Some(hits)
            }
        };
        Ok(RawFeatures {
            aatype,
            between_segment_residues,
            residue_index,
            seq_length: n as usize,
            num_alignments: msa.len(),
            msa,
            deletion_matrix,
            templates,
        })
    }
}

/// The class of each row of a one-hot `[rows, classes]` array; a row that is not one-hot is an
/// error naming `key`.
fn one_hot_classes(onehot: &Tensor, key: &str, path: &Path) -> anyhow::Result<Vec<i64>> {
    let classes = onehot.size()[1] as usize;
    let values = Vec::<f64>::try_from(onehot.flatten(0, -1))?;
    values
        .chunks(classes)
        .enumerate()
        .map(|(i, row)| match row.iter().filter(|&&v| v != 0.0).count() == 1 && row.iter().sum::<f64>() == 1.0 {
            true => Ok(row.iter().position(|&v| v == 1.0).unwrap_or(0) as i64),
            false => bail!("{}: key {key}: row {i} is not one-hot", path.display()),
        })
        .collect()
}

/// A tensor's values (checked finite by the caller) as integers; a fraction is an error
/// naming `key`.
fn integers(t: &Tensor, key: &str, path: &Path) -> anyhow::Result<Vec<i64>> {
    Vec::<f64>::try_from(t.flatten(0, -1))?
        .into_iter()
        .map(|v| match v.fract() == 0.0 {
            true => Ok(v as i64),
            false => bail!("{}: key {key} holds {v}, not an integer", path.display()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_raw_features_read_back_the_same_and_damage_is_named() {
        let msa = data::a3m::Msa {
            sequences: vec!["MKTAY".into(), "MK-AW".into()],
            deletion_matrix: vec![vec![0; 5], vec![0, 2, 0, 0, 1]],
            descriptions: vec!["query".into(), "hit".into()],
        };
        let mut raw = RawFeatures::new("MKTAY", Some((&msa, Path::new("q.a3m")))).unwrap();
        let mut positions = vec![[[0f32; 3]; ATOM_TYPE_NUM]; 5];
        positions[1][1] = [1.5, -2.0, 3.25];
        let mut masks = vec![[0f32; ATOM_TYPE_NUM]; 5];
        masks[1][1] = 1.0;
        let hit = TemplateHitFeatures {
            sequence: "-KTAW".into(),
            positions,
            masks,
            domain_name: "1abc_A".into(),
            sum_probs: 42.5,
        };
        raw.templates = Some(vec![hit.clone()]);
        let dir = suite_tests::scratch("fastfold", "raw-npz");
        let path = dir.join("features.npz");
        raw.save_npz(&path).unwrap();
        let back = RawFeatures::from_npz_arrays(data::npz::read(&path).unwrap(), &path).unwrap();
        assert_eq!((&back.aatype, &back.msa, &back.deletion_matrix), (&raw.aatype, &raw.msa, &raw.deletion_matrix));
        assert_eq!((&back.residue_index, back.seq_length, back.num_alignments), (&raw.residue_index, 5, 2));
        let t = &back.templates.as_ref().unwrap()[0];
        assert_eq!(
            (&t.sequence, &t.positions, &t.masks, t.sum_probs),
            (&hit.sequence, &hit.positions, &hit.masks, 42.5)
        );
        // A damaged array is named.
        let mut arrays = data::npz::read(&path).unwrap();
        for (k, t) in &mut arrays {
            if k == "aatype" {
                *t = t.zeros_like();
            }
        }
        let names: Vec<&str> = arrays.iter().map(|(k, _)| k.as_str()).collect();
        assert!(RawFeatures::are_raw(&names));
        let err = RawFeatures::from_npz_arrays(arrays, &path).unwrap_err().to_string();
        assert!(err.contains("features.npz: key aatype: row 0 is not one-hot"), "{err}");
    }
}
