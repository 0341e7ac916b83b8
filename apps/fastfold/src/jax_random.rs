//! JAX's random numbers, bit for bit: the counter-based Threefry-2x32 generator
//! (Salmon et al. 2011, "Parallel random numbers: as easy as 1, 2, 3") and the way JAX derives
//! keys and draws from it (`jax.random.PRNGKey`, `split`, `fold_in`, `bits`, `uniform`), in
//! JAX's default configuration: 32-bit integers (no `jax_enable_x64`) and the partitionable
//! Threefry (`jax_threefry_partitionable`, the default since JAX 0.5), whose draws depend on
//! each element's index alone.
//!
//! AlphaFold-Multimer samples and masks the MSA inside the network from keys made so
//! (`modules_multimer.py`, `utils.padding_consistent_rng`), so a seed given to `fastfold
//! predict` draws what it draws in DeepMind's code. `tests/jax_random.rs` checks every function
//! against JAX's own output (`tests/fixtures/make_jax_random.py`).

/// The Threefry-2x32 rotation constants, the first four rounds of every eight, then the next.
const ROTATIONS: [[u32; 4]; 2] = [[13, 15, 26, 6], [17, 29, 16, 24]];

/// Threefry's key-schedule parity constant.
const PARITY: u32 = 0x1BD1_1BDA;

/// The Threefry-2x32 block cipher with 20 rounds: `counter` encrypted under `key`.
pub fn threefry2x32(key: [u32; 2], counter: [u32; 2]) -> [u32; 2] {
    let ks = [key[0], key[1], key[0] ^ key[1] ^ PARITY];
    let mut x = [counter[0].wrapping_add(ks[0]), counter[1].wrapping_add(ks[1])];
    // Five groups of four rounds, each followed by a key injection (the key words rotated
    // by one per group, and the group's number added).
    for group in 0..5u32 {
        for &r in &ROTATIONS[group as usize % 2] {
            x[0] = x[0].wrapping_add(x[1]);
            x[1] = x[1].rotate_left(r) ^ x[0];
        }
        let g = group as usize;
        x[0] = x[0].wrapping_add(ks[(g + 1) % 3]);
        x[1] = x[1].wrapping_add(ks[(g + 2) % 3]).wrapping_add(group + 1);
    }
    x
}

/// A JAX PRNG key: two 32-bit words (the raw `uint32[2]` of `jax.random.PRNGKey`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key(pub [u32; 2]);

impl Key {
    /// `jax.random.PRNGKey(seed)` with 32-bit integers: the seed's low 32 bits, its high word
    /// zero (JAX converts a Python int to int32 first, so a seed from 2^32 on wraps, and -1 is
    /// `[0, 0xffffffff]`).
    pub fn from_seed(seed: i64) -> Key {
        Key([0, seed as u32])
    }

    /// The block at flat index `i` of an array of draws: the counter is the index as a 64-bit
    /// number, high word first (JAX's `iota_2x32_shape`).
    fn block(self, i: u64) -> [u32; 2] {
        threefry2x32(self.0, [(i >> 32) as u32, i as u32])
    }

    /// `jax.random.split(key, n)`: `n` new keys, key `i` the block at index `i`.
    pub fn split(self, n: usize) -> Vec<Key> {
        (0..n as u64).map(|i| Key(self.block(i))).collect()
    }

    /// `jax.random.fold_in(key, data)`: the key for `data` (the data's 64-bit seed, `[0, data]`,
    /// hashed as a two-element count array: its halves are the counter's two words).
    pub fn fold_in(self, data: u32) -> Key {
        Key(threefry2x32(self.0, [0, data]))
    }

    /// `jax.random.bits(key, (n,))` (32-bit): element `i` is the exclusive-or of the block at
    /// index `i`'s two words. A draw of any shape is the same over its row-major flat index.
    pub fn bits(self, n: usize) -> Vec<u32> {
        (0..n as u64).map(|i| self.block(i)).map(|[a, b]| a ^ b).collect()
    }

    /// `jax.random.uniform(key, (n,), float32)` in [0, 1): each element's 23 high bits as the
    /// mantissa of a float in [1, 2), less 1.
    pub fn uniform(self, n: usize) -> Vec<f32> {
        self.bits(n).into_iter().map(unit_float).collect()
    }

    /// Element `i` of [`Key::uniform`]'s draws (of any length past `i`): each draw depends on
    /// its index alone, so a large draw can be made in parallel pieces.
    pub fn uniform_at(self, i: u64) -> f32 {
        let [a, b] = self.block(i);
        unit_float(a ^ b)
    }

    /// `utils.padding_consistent_rng(jax.random.uniform)(key, shape)` of AlphaFold: each
    /// element drawn alone (shape `()`) from the key folded in with each of its indices in turn,
    /// so an element's draw does not depend on the array's size (padding leaves it alone).
    /// Row-major over `shape`.
    pub fn padding_consistent_uniform(self, shape: &[usize]) -> Vec<f32> {
        let mut keys = vec![self];
        for &d in shape {
            keys = keys.iter().flat_map(|k| (0..d as u32).map(move |i| k.fold_in(i))).collect();
        }
        keys.into_iter().map(|k| unit_float(k.bits(1)[0])).collect()
    }
}

/// A uniform float in [0, 1) from 32 random bits, as JAX makes it.
fn unit_float(bits: u32) -> f32 {
    f32::from_bits((bits >> 9) | 1.0f32.to_bits()) - 1.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threefry_matches_the_published_known_answers() {
        // Random123's known-answer tests for Threefry-2x32 with 20 rounds (kat_vectors).
        assert_eq!(threefry2x32([0, 0], [0, 0]), [0x6b20_0159, 0x99ba_4efe]);
        assert_eq!(threefry2x32([u32::MAX, u32::MAX], [u32::MAX, u32::MAX]), [0x1cb9_96fc, 0xbb00_2be7]);
        assert_eq!(threefry2x32([0x1319_8a2e, 0x0370_7344], [0x243f_6a88, 0x85a3_08d3]), [0xc492_3a9c, 0x483d_f7a0]);
    }

    #[test]
    fn a_draw_is_its_elements_drawn_alone() {
        let key = Key::from_seed(3).fold_in(7);
        let whole = key.uniform(1000);
        assert!(whole.iter().enumerate().all(|(i, &u)| key.uniform_at(i as u64) == u));
    }

    #[test]
    fn seeds_wrap_to_32_bits() {
        assert_eq!(Key::from_seed(42), Key([0, 42]));
        assert_eq!(Key::from_seed((1 << 33) + 5), Key([0, 5]));
        assert_eq!(Key::from_seed(-1), Key([0, u32::MAX]));
    }
}
