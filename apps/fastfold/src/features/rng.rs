//! The pipeline's random numbers: SplitMix64, small, fast and the same on every platform, so
//! a seed gives the same features on any machine and device (libtorch's generators differ
//! between CPU and CUDA).

/// A SplitMix64 generator (Steele, Lea and Flood 2014).
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator for stream `stream` of `seed` (streams of one seed are independent).
    pub fn new(seed: u64, stream: u64) -> Rng {
        let mut base = Rng { state: seed };
        let mixed = base.next_u64() ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03);
        Rng { state: mixed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in 0..n (n > 0), by Lemire's multiply-shift.
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Shuffles `v` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }

    /// An index drawn with probability proportional to `weights` (which sum to about 1).
    pub fn categorical(&mut self, weights: &[f64]) -> usize {
        let total: f64 = weights.iter().sum();
        let mut u = self.uniform() * total;
        for (i, &w) in weights.iter().enumerate() {
            if u < w {
                return i;
            }
            u -= w;
        }
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(0)
    }
}
