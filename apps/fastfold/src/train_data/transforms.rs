//! The random parts of AlphaFold's training-time pipeline that its eval pipeline lacks, as
//! pure functions of their draws: MSA block deletion (supplementary Algorithm 1), the
//! contiguous crop (`random_crop_to_size`, applied to the features and the ground truth
//! alike) and the number of recycling passes of a step.
//!
//! Every draw comes from a [`Rng`] keyed by the run's seed, what it is for, the step and the
//! data-parallel rank ([`keyed`]): one run gives one sequence of examples on any machine, and
//! replicas that train on different examples draw differently. The recycling count is drawn
//! without the rank, so every rank of a step runs the same number of passes (OpenFold draws it
//! from a generator all ranks share).
use crate::features::rng::Rng;
use crate::features::RawFeatures;
use crate::pdb::Structure;

/// What a keyed draw is for: each has its own stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Draw {
    /// The blocks of MSA rows deleted.
    BlockDeletion = 1,
    /// The crop's first residue.
    Crop = 2,
    /// The recycling passes of a step (rank-independent).
    Recycles = 3,
    /// The seed of the feature pipeline's MSA sampling and masking.
    Features = 4,
    /// The order of the examples in an epoch (keyed by the epoch in place of the step).
    Shuffle = 5,
    /// The templates of an example: the order of the top hits and how many are kept.
    Templates = 6,
    /// Whether the chain a place of the epochs' order names is taken (keyed by the place in
    /// place of the step): OpenFold's stochastic filter.
    Accept = 7,
}

/// The generator of draw `what` at `step` on data-parallel rank `rank` of a run seeded `seed`.
pub fn keyed(seed: u64, what: Draw, step: u64, rank: u64) -> Rng {
    let base = Rng::new(seed, what as u64).next_u64();
    Rng::new(base ^ rank.wrapping_mul(0xA24B_AED4_963E_E407), step)
}

/// AlphaFold's `block_delete_msa` settings (supplementary section 1.2.6; OpenFold's
/// `block_delete_msa` config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockDeletion {
    /// Rows per block, as a fraction of the MSA's rows (floored).
    pub msa_fraction_per_block: f64,
    /// Draw the number of blocks uniformly in 0..=num_blocks rather than take num_blocks.
    pub randomize_num_blocks: bool,
    /// Blocks deleted.
    pub num_blocks: usize,
}

impl Default for BlockDeletion {
    /// AlphaFold's: 5 blocks of 30% of the rows each.
    fn default() -> Self {
        BlockDeletion { msa_fraction_per_block: 0.3, randomize_num_blocks: false, num_blocks: 5 }
    }
}

/// The rows deleted by blocks of `block` rows starting at `starts`, clipped to the MSA's
/// `num_seq` rows, the query (row 0) excepted; sorted.
pub fn deleted_rows(num_seq: usize, starts: &[usize], block: usize) -> Vec<usize> {
    let mut rows: Vec<usize> =
        starts.iter().flat_map(|&s| (s..s + block).map(|r| r.min(num_seq - 1))).filter(|&r| r != 0).collect();
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// The rows `block_delete_msa` keeps of an MSA of `num_seq` rows: the query, then every row
/// outside the deleted blocks, in order. Block starts are uniform over the rows.
pub fn block_deletion_keep(num_seq: usize, cfg: &BlockDeletion, rng: &mut Rng) -> Vec<usize> {
    if num_seq == 0 {
        return Vec::new();
    }
    let block = (num_seq as f64 * cfg.msa_fraction_per_block).floor() as usize;
    let blocks = match cfg.randomize_num_blocks {
        true => rng.below(cfg.num_blocks + 1),
        false => cfg.num_blocks,
    };
    let starts: Vec<usize> = (0..blocks).map(|_| rng.below(num_seq)).collect();
    let deleted = deleted_rows(num_seq, &starts, block);
    (0..num_seq).filter(|r| deleted.binary_search(r).is_err()).collect()
}

/// `raw` with its MSA (and deletion matrix) reduced to the rows `keep`.
pub fn keep_msa_rows(raw: &RawFeatures, keep: &[usize]) -> RawFeatures {
    RawFeatures {
        msa: keep.iter().map(|&r| raw.msa[r].clone()).collect(),
        deletion_matrix: keep.iter().map(|&r| raw.deletion_matrix[r].clone()).collect(),
        num_alignments: keep.len(),
        ..raw.clone()
    }
}

/// The first residue of a contiguous crop of `crop_size` residues out of `num_res`, uniform
/// over the crops that fit (0 when the chain is no longer than the crop), as AlphaFold's
/// `random_crop_to_size` draws it for a monomer.
pub fn crop_start(num_res: usize, crop_size: usize, rng: &mut Rng) -> usize {
    match num_res.checked_sub(crop_size) {
        Some(slack) if slack > 0 => rng.below(slack + 1),
        _ => 0,
    }
}

/// Residues `start..start + len` of a structure, every per-residue field alike.
pub fn crop_structure(s: &Structure, start: usize, len: usize) -> Structure {
    select_residues(s, &(start..start + len).collect::<Vec<_>>())
}

/// Residues `keep` of a structure (indices, in the order given), every per-residue field
/// alike.
pub fn select_residues(s: &Structure, keep: &[usize]) -> Structure {
    Structure {
        aatype: keep.iter().map(|&i| s.aatype[i]).collect(),
        residue_index: keep.iter().map(|&i| s.residue_index[i]).collect(),
        positions: keep.iter().map(|&i| s.positions[i]).collect(),
        mask: keep.iter().map(|&i| s.mask[i]).collect(),
        b_factors: keep.iter().map(|&i| s.b_factors[i]).collect(),
    }
}

/// The recycling passes before the trained one at `step`: uniform in `0..=max` (AlphaFold
/// trains with `max` 3), the same on every rank.
pub fn sample_recycles(seed: u64, step: u64, max: usize) -> usize {
    keyed(seed, Draw::Recycles, step, 0).below(max + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deleted_rows_are_the_clipped_blocks_but_the_query() {
        // Blocks of 6 at 0, 3 and 17 of 20 rows: 0..9 and 17..20 (clipped), less row 0.
        let rows = deleted_rows(20, &[0, 3, 17], 6);
        assert_eq!(rows, [1, 2, 3, 4, 5, 6, 7, 8, 17, 18, 19]);
        assert!(deleted_rows(3, &[1, 2], 0).is_empty(), "a block of 0 rows deletes nothing");
    }

    #[test]
    fn block_deletion_keeps_the_query_and_deletes_whole_blocks() {
        let cfg = BlockDeletion::default();
        for step in 0..50 {
            let keep = block_deletion_keep(100, &cfg, &mut keyed(7, Draw::BlockDeletion, step, 0));
            assert_eq!(keep[0], 0, "the query stays");
            assert!(keep.windows(2).all(|w| w[0] < w[1]), "rows stay in order");
            // Some rows go (a block at the last row takes that row alone), never the query;
            // the deleted rows are at most 5 runs, one per block.
            let deleted: Vec<usize> = (0..100).filter(|r| !keep.contains(r)).collect();
            assert!((1..=99).contains(&deleted.len()), "{}", deleted.len());
            let runs = 1 + deleted.windows(2).filter(|w| w[1] != w[0] + 1).count();
            assert!(runs <= 5, "{runs} runs: {deleted:?}");
        }
        // The same draws give the same rows; the step and the rank change them.
        let keep = |step, rank| block_deletion_keep(100, &cfg, &mut keyed(7, Draw::BlockDeletion, step, rank));
        assert_eq!(keep(3, 0), keep(3, 0));
        assert_ne!(keep(3, 0), keep(4, 0));
        assert_ne!(keep(3, 0), keep(3, 1));
        let one = block_deletion_keep(1, &cfg, &mut keyed(7, Draw::BlockDeletion, 0, 0));
        assert_eq!(one, [0], "the query alone stays");
    }

    #[test]
    fn crop_starts_cover_every_fitting_window() {
        let starts: std::collections::BTreeSet<usize> =
            (0..400).map(|step| crop_start(10, 7, &mut keyed(1, Draw::Crop, step, 0))).collect();
        assert_eq!(starts.into_iter().collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(crop_start(5, 7, &mut keyed(1, Draw::Crop, 0, 0)), 0, "short chains are not cropped");
        assert_eq!(crop_start(7, 7, &mut keyed(1, Draw::Crop, 0, 0)), 0);
    }

    #[test]
    fn recycles_are_uniform_and_rank_free() {
        let mut counts = [0; 4];
        for step in 0..4000 {
            counts[sample_recycles(5, step, 3)] += 1;
        }
        assert!(counts.iter().all(|&c| (900..1100).contains(&c)), "{counts:?}");
        assert_eq!(sample_recycles(5, 9, 0), 0);
        let seq = |seed| (0..20).map(|s| sample_recycles(seed, s, 3)).collect::<Vec<_>>();
        assert_eq!(seq(5), seq(5));
        assert_ne!(seq(5), seq(6));
    }
}
