//! Distributed sampling with `torch.utils.data.DistributedSampler`'s semantics: each epoch a
//! permutation seeded by (seed, epoch), padded by wrapping around (or truncated, with
//! `drop_last`) to a multiple of the number of ranks, and rank `r` takes every N-th index
//! starting at `r`.
use crate::digits::permutation;

/// Which indices this rank reads each epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DistributedSampler {
    /// Examples in the data set.
    pub len: usize,
    /// Ranks sharing the data set.
    pub ranks: usize,
    /// This rank.
    pub rank: usize,
    /// Shuffle each epoch.
    pub shuffle: bool,
    /// Base seed, the same on every rank.
    pub seed: u64,
    /// Drop the tail that does not divide evenly instead of padding.
    pub drop_last: bool,
}

impl DistributedSampler {
    /// Examples per rank per epoch.
    pub fn per_rank(&self) -> usize {
        if self.drop_last {
            self.len / self.ranks
        } else {
            self.len.div_ceil(self.ranks)
        }
    }

    /// This rank's indices for `epoch`.
    pub fn indices(&self, epoch: u64) -> Vec<i64> {
        let order = if self.shuffle {
            permutation(self.len, self.seed.wrapping_mul(1_000_003).wrapping_add(epoch))
        } else {
            (0..self.len as i64).collect()
        };
        let total = self.per_rank() * self.ranks;
        let padded: Vec<i64> = order.iter().cycle().take(total).copied().collect();
        padded.into_iter().skip(self.rank).step_by(self.ranks).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(rank: usize, drop_last: bool) -> DistributedSampler {
        DistributedSampler { len: 10, ranks: 3, rank, shuffle: true, seed: 7, drop_last }
    }

    #[test]
    fn ranks_cover_the_data_set_each_epoch() {
        for drop_last in [false, true] {
            let mut seen: Vec<i64> = (0..3).flat_map(|r| sampler(r, drop_last).indices(0)).collect();
            assert_eq!(seen.len(), if drop_last { 9 } else { 12 });
            seen.sort();
            seen.dedup();
            assert_eq!(seen.len(), if drop_last { 9 } else { 10 }, "every example, padding repeats some");
        }
    }

    #[test]
    fn epochs_reshuffle_deterministically() {
        let s = sampler(1, false);
        assert_eq!(s.indices(3), s.indices(3));
        assert_ne!(s.indices(0), s.indices(1));
        let plain = DistributedSampler { shuffle: false, ..s };
        assert_eq!(plain.indices(0), vec![1, 4, 7, 0]);
    }
}
