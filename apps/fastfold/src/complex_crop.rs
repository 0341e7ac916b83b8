//! Cropping a complex as AlphaFold-Multimer trains on one (its supplement, section 7.2.2; the
//! settings as public multimer training configs set them): each example takes, with
//! probability [`SPATIAL_CROP_PROBABILITY`], the spatial crop ([`spatial_crop`]: the residues
//! whose Cα lies nearest a residue at an interface), else the contiguous crop across chains
//! ([`contiguous_crop`]: a piece of each chain, in a random order of the chains, the pieces
//! summing to the crop size). The kept residues, in the complex's order, crop the features
//! ([`crop_inputs`]) and, with [`select_residues`], a structure alike; in training the loss
//! keeps the whole truth and finds each kept residue in it by its chain and number, so that
//! copies of a chain cropped differently are still compared residue for residue after the
//! chain permutation alignment ([`crate::loss::chain_permutation::align_crop`]). Every draw
//! comes from the run's seed and the example's number, so an example is cropped the same way
//! on any machine.
use tch::Tensor;

use crate::features::rng::Rng;
use crate::model::multimer::MultimerInputs;
use crate::pdb::Structure;
pub use crate::train_data::transforms::select_residues;
use crate::train_data::transforms::{keyed, Draw};

/// How often an example takes the spatial crop rather than the contiguous one (multimer
/// training configs' `spatial_crop_prob`).
pub const SPATIAL_CROP_PROBABILITY: f64 = 0.5;
/// Cα distance (Å) under which a residue with a residue of another chain is at an interface
/// (Uni-Fold's multimer training config, `ca_ca_threshold`; OpenFold's `interface_threshold`).
pub const INTERFACE_DISTANCE: f64 = 10.0;
/// Added per residue number to the distances of the spatial crop, so that ties keep the earlier
/// residue.
const TIE_BREAK: f64 = 1e-3;
/// The Cα atom's place among the 37 atom types.
const CA: usize = 1;

/// How a complex is cropped.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComplexCrop {
    /// Residues kept (a complex no longer than this is kept whole).
    pub size: usize,
    /// The chance of the spatial crop.
    pub spatial_probability: f64,
    /// The interface's Cα distance (Å).
    pub interface_distance: f64,
}

/// Which crop an example took.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CropKind {
    /// None: the complex is no longer than the crop.
    Whole,
    /// [`contiguous_crop`].
    Contiguous,
    /// [`spatial_crop`].
    Spatial,
}

impl ComplexCrop {
    /// A crop of `size` residues with AlphaFold-Multimer's mix (OpenFold's settings).
    pub fn new(size: usize) -> ComplexCrop {
        ComplexCrop { size, spatial_probability: SPATIAL_CROP_PROBABILITY, interface_distance: INTERFACE_DISTANCE }
    }

    /// The residues example `number` of a run seeded `seed` keeps (ascending indices into the
    /// complex) and which crop chose them, for the complex of residues in chains `asym_id`
    /// (each chain's residues consecutive) with true structure `truth` (its Cα atoms place the
    /// spatial crop; with fewer than two resolved, the contiguous crop is taken).
    pub fn residues(&self, asym_id: &[i64], truth: &Structure, seed: u64, number: u64) -> (CropKind, Vec<usize>) {
        let n = asym_id.len();
        if n <= self.size {
            return (CropKind::Whole, (0..n).collect());
        }
        let mut rng = keyed(seed, Draw::Crop, number, 0);
        if rng.uniform() < self.spatial_probability {
            let ca: Vec<Option<[f64; 3]>> = truth
                .positions
                .iter()
                .zip(&truth.mask)
                .map(|(p, m)| (m[CA] > 0.5).then(|| p[CA].map(f64::from)))
                .collect();
            if let Some(keep) = spatial_crop(&ca, asym_id, self.size, self.interface_distance, &mut rng) {
                return (CropKind::Spatial, keep);
            }
        }
        (CropKind::Contiguous, contiguous_crop(&chain_lengths(asym_id), self.size, &mut rng))
    }
}

/// The lengths of the runs of equal ids in `asym_id`: its chains' lengths in order.
pub fn chain_lengths(asym_id: &[i64]) -> Vec<usize> {
    let mut lengths: Vec<usize> = Vec::new();
    for (i, a) in asym_id.iter().enumerate() {
        match i > 0 && asym_id[i - 1] == *a {
            true => *lengths.last_mut().expect("a run under way") += 1,
            false => lengths.push(1),
        }
    }
    lengths
}

/// AlphaFold-Multimer's contiguous crop of chains of `lengths` (laid out one after another) to
/// `size` residues: the chains in a random order, each gives a piece of a length drawn
/// uniformly between what the crop still needs beyond the chains after it could give and what
/// is left of the crop (at most the chain), at a uniform start. The pieces sum to `size` (or to
/// every residue, when there are fewer). Ascending residue indices.
pub fn contiguous_crop(lengths: &[usize], size: usize, rng: &mut Rng) -> Vec<usize> {
    let offsets: Vec<usize> = lengths.iter().scan(0, |at, &len| Some(std::mem::replace(at, *at + len))).collect();
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    rng.shuffle(&mut order);
    let (mut added, mut remaining) = (0usize, lengths.iter().sum::<usize>());
    let mut keep = Vec::with_capacity(size);
    for c in order {
        let len = lengths[c];
        remaining -= len;
        let most = len.min(size - added);
        let least = len.min(size.saturating_sub(added + remaining));
        let take = least + rng.below(most - least + 1);
        let start = rng.below(len - take + 1);
        keep.extend(offsets[c] + start..offsets[c] + start + take);
        added += take;
    }
    keep.sort_unstable();
    keep
}

/// The residues at an interface: those whose Cα (`ca`, `None` where unresolved) lies within
/// `distance` Å of a resolved Cα of another chain (`asym_id`). Ascending.
pub fn interface_residues(ca: &[Option<[f64; 3]>], asym_id: &[i64], distance: f64) -> Vec<usize> {
    let near = |i: usize, j: usize| match (ca[i], ca[j]) {
        (Some(a), Some(b)) => squared(&a, &b) < distance * distance,
        _ => false,
    };
    (0..ca.len()).filter(|&i| (0..ca.len()).any(|j| asym_id[j] != asym_id[i] && near(i, j))).collect()
}

/// AlphaFold-Multimer's spatial crop to `size` residues: a centre drawn uniformly from the
/// [`interface_residues`] (from the resolved residues when no chains touch), then the `size`
/// residues whose Cα lies nearest the centre's (unresolved ones last; ties to the earlier
/// residue). Ascending residue indices; `None` with fewer than two resolved Cα.
pub fn spatial_crop(
    ca: &[Option<[f64; 3]>],
    asym_id: &[i64],
    size: usize,
    distance: f64,
    rng: &mut Rng,
) -> Option<Vec<usize>> {
    let resolved: Vec<usize> = (0..ca.len()).filter(|&i| ca[i].is_some()).collect();
    if resolved.len() < 2 {
        return None;
    }
    let interface = interface_residues(ca, asym_id, distance);
    let candidates = if interface.is_empty() { &resolved } else { &interface };
    let centre = ca[candidates[rng.below(candidates.len())]]?;
    let mut by_distance: Vec<(f64, usize)> = ca
        .iter()
        .enumerate()
        .map(|(i, p)| (p.map_or(f64::INFINITY, |p| squared(&p, &centre).sqrt()) + TIE_BREAK * i as f64, i))
        .collect();
    by_distance.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut keep: Vec<usize> = by_distance.into_iter().take(size).map(|(_, i)| i).collect();
    keep.sort_unstable();
    Some(keep)
}

fn squared(a: &[f64; 3], b: &[f64; 3]) -> f64 {
    (0..3).map(|k| (a[k] - b[k]).powi(2)).sum()
}

/// The features of residues `keep` (indices into the complex): every per-residue array, the
/// MSA's and the templates' residue columns; the MSA's and templates' rows stay.
pub fn crop_inputs(inputs: &MultimerInputs, keep: &[usize]) -> MultimerInputs {
    let index: Vec<i64> = keep.iter().map(|&i| i as i64).collect();
    let index = Tensor::from_slice(&index).to_device(inputs.aatype.device());
    let residues = |t: &Tensor| t.index_select(0, &index);
    let columns = |t: &Tensor| t.index_select(1, &index);
    MultimerInputs {
        aatype: residues(&inputs.aatype),
        residue_index: residues(&inputs.residue_index),
        asym_id: residues(&inputs.asym_id),
        entity_id: residues(&inputs.entity_id),
        sym_id: residues(&inputs.sym_id),
        seq_mask: residues(&inputs.seq_mask),
        msa: columns(&inputs.msa),
        deletion_matrix: columns(&inputs.deletion_matrix),
        msa_mask: columns(&inputs.msa_mask),
        bert_mask: columns(&inputs.bert_mask),
        cluster_bias_mask: inputs.cluster_bias_mask.shallow_clone(),
        template_aatype: inputs.template_aatype.as_ref().map(columns),
        template_all_atom_positions: inputs.template_all_atom_positions.as_ref().map(columns),
        template_all_atom_mask: inputs.template_all_atom_mask.as_ref().map(columns),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The contiguous crop keeps exactly the crop's residues, a contiguous piece of each chain,
    /// whatever the draw; a complex shorter than the crop is kept whole.
    #[test]
    fn contiguous_pieces_sum_to_the_crop() {
        let lengths = [7, 30, 3, 12];
        let offsets = [0, 7, 37, 40, 52];
        for seed in 0..200 {
            let keep = contiguous_crop(&lengths, 20, &mut Rng::new(seed, 9));
            assert_eq!(keep.len(), 20, "seed {seed}: {keep:?}");
            for c in 0..4 {
                let piece: Vec<usize> =
                    keep.iter().copied().filter(|&i| (offsets[c]..offsets[c + 1]).contains(&i)).collect();
                let gaps = piece.windows(2).filter(|w| w[1] != w[0] + 1).count();
                assert_eq!(gaps, 0, "seed {seed}: chain {c}'s piece {piece:?} is not contiguous");
            }
        }
        assert_eq!(contiguous_crop(&[3, 4], 10, &mut Rng::new(1, 9)), (0..7).collect::<Vec<_>>());
        assert_eq!(chain_lengths(&[1, 1, 2, 2, 2, 3]), vec![2, 3, 1]);
    }
}
