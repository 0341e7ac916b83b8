//! The embedded default data set: 1,797 8x8 handwritten digits (see `assets/README.md`), with
//! a fixed train/validation split.
use tch::{Device, Kind, Tensor};

const RAW: &[u8] = include_bytes!("../assets/digits.u8");
const RECORD: usize = 65;
/// Images in the data set.
pub const LEN: usize = 1797;
/// Images held out for validation by [`split`].
pub const VALIDATION: usize = 297;

/// Images and labels in memory.
#[derive(Debug)]
pub struct InMemory {
    /// `[n, 1, 8, 8]` float pixels in `[0, 1]`.
    pub images: Tensor,
    /// `[n]` int64 class indices.
    pub labels: Tensor,
    /// Class names, indexed by label.
    pub classes: Vec<String>,
}

impl InMemory {
    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.size()[0] as usize
    }

    /// Whether there are no examples.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The examples at `indices`, in that order.
    pub fn select(&self, indices: &[i64]) -> InMemory {
        let idx = Tensor::from_slice(indices);
        InMemory {
            images: self.images.index_select(0, &idx),
            labels: self.labels.index_select(0, &idx),
            classes: self.classes.clone(),
        }
    }
}

/// All 1,797 digits.
pub fn load() -> InMemory {
    debug_assert_eq!(RAW.len(), LEN * RECORD);
    let pixels: Vec<f32> = RAW.chunks(RECORD).flat_map(|r| r[..64].iter().map(|&p| p as f32 / 16.0)).collect();
    let labels: Vec<i64> = RAW.chunks(RECORD).map(|r| r[64] as i64).collect();
    InMemory {
        images: Tensor::from_slice(&pixels).view([LEN as i64, 1, 8, 8]).to_device(Device::Cpu),
        labels: Tensor::from_slice(&labels).to_kind(Kind::Int64),
        classes: (0..10).map(|d| d.to_string()).collect(),
    }
}

/// The fixed split: a seeded permutation (the same on every machine and in every run), the
/// first 1,500 for training and the last 297 for validation.
pub fn split() -> (InMemory, InMemory) {
    let all = load();
    let order = permutation(LEN, 0x5eed);
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

    #[test]
    fn all_digits_with_every_class() {
        let d = load();
        assert_eq!(d.images.size(), vec![1797, 1, 8, 8]);
        assert_eq!(d.len(), 1797);
        let counts = d.labels.bincount::<Tensor>(None, 10);
        assert!(Vec::<i64>::try_from(&counts).unwrap().iter().all(|&c| (174..=183).contains(&c)), "{counts:?}");
        assert_eq!(d.images.max().double_value(&[]), 1.0);
        assert_eq!(d.images.min().double_value(&[]), 0.0);
        // The first record of the UCI file is a 0.
        assert_eq!(d.labels.int64_value(&[0]), 0);
    }

    #[test]
    fn the_split_is_fixed_and_disjoint() {
        let (train, val) = split();
        assert_eq!((train.len(), val.len()), (1500, 297));
        let (train2, _) = split();
        assert!(train.labels.equal(&train2.labels));
        let mut all: Vec<i64> = permutation(LEN, 0x5eed);
        all.sort();
        assert_eq!(all, (0..LEN as i64).collect::<Vec<_>>());
        assert_ne!(permutation(10, 1), permutation(10, 2));
    }
}
