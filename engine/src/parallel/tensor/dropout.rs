//! Dropout whose mask is a function of (key, position in the whole activation), drawn with the
//! same counter-based generator as [`super::init`]. A rank holding a block of the sequence
//! (Megatron-SP's LayerNorm/dropout region) draws exactly the block of the mask one process
//! would draw for the whole activation, and ranks holding a replicated activation draw the
//! same mask without keeping their generators in step. Megatron gets the first property only
//! statistically (a per-rank generator for sequence-parallel regions) and the second by
//! seeding every tensor-parallel rank alike; here both are exact, so a model with dropout is
//! still checked against one process.
//!
//! The mask is drawn on the host (rayon over the elements) and moved to the activation's
//! device: one byte per element of this rank's block, plus the hashing; correct first, and a
//! device kernel for it is not written yet.
use tch::Tensor;

use super::init::{draw, mix, uniform};
use super::{dim_index, TensorParallel};
use crate::error::ensure;
use crate::Result;

/// What makes one dropout mask different from every other: the run's seed, the step (or
/// micro-batch) and the layer's name. Reusing a key reuses the mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DropoutKey<'a> {
    /// The run's seed.
    pub seed: u64,
    /// The training step or micro-batch index.
    pub step: u64,
    /// The dropout site, e.g. its module path.
    pub name: &'a str,
}

/// Zeroes each element of `x` with probability `p` and scales the rest by `1 / (1 - p)`.
/// `sequence_dim`: `x` is this rank's block of that dimension of the whole activation (the
/// sequence-parallel region); `None`: `x` is the whole activation (one process, or replicated
/// over the group). With `p == 0` the input is returned as it is.
pub fn dropout(
    x: &Tensor,
    p: f64,
    key: DropoutKey<'_>,
    sequence_dim: Option<i64>,
    tp: &TensorParallel,
) -> Result<Tensor> {
    ensure!((0.0..1.0).contains(&p), "dropout probability must be in [0, 1), got {p}");
    if p == 0.0 || x.numel() == 0 {
        return Ok(x.shallow_clone());
    }
    let mut full = x.size();
    let (dim, start, len) = match sequence_dim {
        Some(d) => {
            let d = dim_index(x, d)?;
            let len = full[d];
            full[d] = len * tp.size();
            (d, tp.rank() * len, len)
        }
        None if x.dim() == 0 => return Err(crate::Error::invalid("dropout of a scalar")),
        None => (0, 0, full[0]),
    };
    let seed = key.seed ^ mix(key.step.wrapping_add(0x6472_6f70)); // "drop"
    let dropped = draw(seed, key.name, &full, dim, start, len, |s, i| uniform(s, i) < p);
    let dropped = Tensor::f_from_slice(&dropped)?.f_view(x.size().as_slice())?.f_to_device(x.device())?;
    Ok(x.f_masked_fill(&dropped, 0.0)?.f_mul_scalar(1.0 / (1.0 - p))?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    #[test]
    fn drops_about_p_scales_the_rest_and_depends_on_the_key() {
        let x = Tensor::ones([100, 50], (Kind::Float, Device::Cpu));
        let key = DropoutKey { seed: 1, step: 0, name: "block.drop" };
        let none = TensorParallel::none();
        let y = dropout(&x, 0.3, key, None, &none).unwrap();
        let kept = y.ne(0.0).sum(Kind::Float).double_value(&[]) / 5000.0;
        assert!((kept - 0.7).abs() < 0.03, "kept {kept}");
        assert!((y.max().double_value(&[]) - 1.0 / 0.7).abs() < 1e-6);
        assert!(dropout(&x, 0.3, key, None, &none).unwrap().equal(&y), "the same key, the same mask");
        for other in [DropoutKey { step: 1, ..key }, DropoutKey { name: "other", ..key }] {
            assert!(!dropout(&x, 0.3, other, None, &none).unwrap().equal(&y), "{other:?}");
        }
        // A sequence block of one process is the whole activation.
        assert!(dropout(&x, 0.3, key, Some(0), &none).unwrap().equal(&y));
        let err = dropout(&x, 1.0, key, None, &none).unwrap_err().to_string();
        assert!(err.contains("must be in [0, 1), got 1"), "{err}");
    }
}
