//! The embedded default data set: 1,797 8x8 handwritten digits (see `assets/README.md`), with
//! a fixed train/validation split.
use crate::images::InMemory;

const RAW: &[u8] = include_bytes!("../assets/digits.u8");
const RECORD: usize = 65;
/// Images in the data set.
pub const LEN: usize = 1797;
/// Images held out for validation by [`split`].
pub const VALIDATION: usize = 297;

/// All 1,797 digits.
pub fn load() -> InMemory {
    debug_assert_eq!(RAW.len(), LEN * RECORD);
    let pixels: Vec<f32> = RAW.chunks(RECORD).flat_map(|r| r[..64].iter().map(|&p| p as f32 / 16.0)).collect();
    let labels: Vec<i64> = RAW.chunks(RECORD).map(|r| r[64] as i64).collect();
    InMemory { shape: [1, 8, 8], pixels, labels, classes: (0..10).map(|d| d.to_string()).collect() }
}

/// The fixed split: a seeded permutation (the same on every machine and in every run), the
/// first 1,500 for training and the last 297 for validation.
pub fn split() -> (InMemory, InMemory) {
    let all = load();
    let order: Vec<usize> = permutation(LEN, 0x5eed).into_iter().map(|i| i as usize).collect();
    let (train, val) = order.split_at(LEN - VALIDATION);
    (all.select(train), all.select(val))
}

/// A permutation of `0..n` from a small fixed PRNG (splitmix64 with Fisher-Yates), so the
/// result does not depend on libtorch's generator or its version.
pub fn permutation(n: usize, seed: u64) -> Vec<i64> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    let mut v: Vec<i64> = (0..n as i64).collect();
    for i in (1..n).rev() {
        let j = (next() % (i as u64 + 1)) as usize;
        v.swap(i, j);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::Dataset;

    #[test]
    fn all_digits_with_every_class() {
        let d = load();
        assert_eq!(d.len(), 1797);
        assert_eq!(d.pixels.len(), 1797 * 64);
        let mut counts = [0usize; 10];
        d.labels.iter().for_each(|&l| counts[l as usize] += 1);
        assert!(counts.iter().all(|c| (174..=183).contains(c)), "{counts:?}");
        assert_eq!(d.pixels.iter().copied().fold(f32::MIN, f32::max), 1.0);
        assert_eq!(d.pixels.iter().copied().fold(f32::MAX, f32::min), 0.0);
        // The first record of the UCI file is a 0.
        assert_eq!(d.labels[0], 0);
    }

    #[test]
    fn the_split_is_fixed_and_disjoint() {
        let (train, val) = split();
        assert_eq!((train.len(), val.len()), (1500, 297));
        let (train2, _) = split();
        assert_eq!(train.labels, train2.labels);
        let mut all: Vec<i64> = permutation(LEN, 0x5eed);
        all.sort();
        assert_eq!(all, (0..LEN as i64).collect::<Vec<_>>());
        assert_ne!(permutation(10, 1), permutation(10, 2));
    }
}
