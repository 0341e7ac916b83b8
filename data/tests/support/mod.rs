//! What the data crate's file tests share: the mutations' generator.
/// A small deterministic generator for the mutations.
pub struct Lcg(pub u64);

impl Lcg {
    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n.max(1)
    }
}
