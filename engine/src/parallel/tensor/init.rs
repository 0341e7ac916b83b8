//! Serial-equivalent initialisation. A parameter's values are a function of (seed, the
//! parameter's full name, its position in the full tensor) alone, from a counter-based
//! generator (splitmix64 over the element index), so:
//!
//! - a rank computes only its own slice, never the full tensor, and the slice equals the
//!   same slice of the tp=1 parameter built from the same seed;
//! - the layout of the job (tp size, rank) cannot change any value, which is what lets a
//!   tp=N run be checked against one process and a checkpoint move between layouts;
//! - libtorch's global generator is neither read nor advanced.
//!
//! (Megatron reaches the first property by building the full "master weight" on every rank
//! and keeping a slice; the counter makes the full tensor unnecessary.)
use rayon::prelude::*;
use tch::{Device, Kind, Tensor};

use crate::error::ensure;
use crate::Result;

/// How a parameter's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// All zeros.
    Zeros,
    /// All ones.
    Ones,
    /// Normal with mean 0 and standard deviation `std` (Megatron and GPT-2 use 0.02).
    Normal {
        /// Standard deviation.
        std: f64,
    },
    /// Uniform on `[-bound, bound)` (PyTorch's `nn.Linear` uses `1/sqrt(in_features)` for
    /// weight and bias).
    Uniform {
        /// Half-width of the interval.
        bound: f64,
    },
}

/// Block `rank` of `parts` along dim `dim` of the full parameter `name` of shape `full`, drawn
/// with `init` from `seed`. With `parts == 1` this is the whole parameter.
pub fn shard(init: Init, seed: u64, name: &str, full: &[i64], dim: usize, rank: i64, parts: i64) -> Result<Tensor> {
    ensure!(dim < full.len(), "init of {name}: dim {dim} is out of range for shape {full:?}");
    ensure!(full.iter().all(|&s| s > 0), "init of {name}: shape {full:?} has an empty dimension");
    ensure!(
        parts > 0 && full[dim] % parts == 0 && (0..parts).contains(&rank),
        "init of {name}: dim {dim} of size {} does not split into {parts} blocks (block {rank})",
        full[dim]
    );
    let block = full[dim] / parts;
    let mut shape = full.to_vec();
    shape[dim] = block;
    let opts = (Kind::Float, Device::Cpu);
    let values = match init {
        Init::Zeros => return Ok(Tensor::f_zeros(&shape, opts)?),
        Init::Ones => return Ok(Tensor::f_ones(&shape, opts)?),
        Init::Normal { std } => draw(seed, name, full, dim, rank * block, block, |s, i| (std * normal(s, i)) as f32),
        Init::Uniform { bound } => {
            draw(seed, name, full, dim, rank * block, block, |s, i| (bound * (2.0 * uniform(s, i) - 1.0)) as f32)
        }
    };
    Ok(Tensor::f_from_slice(&values)?.f_reshape(&shape)?)
}

/// Block `index[d]` of `parts[d]` along every dim `d` of the full parameter `name` of shape
/// `full` (a block of a grid of blocks, as 2D and 3D tensor parallelism hold weights), drawn
/// with `init` from `seed`: the same values as that slice of [`full`].
pub fn block(init: Init, seed: u64, name: &str, full: &[i64], parts: &[i64], index: &[i64]) -> Result<Tensor> {
    ensure!(
        parts.len() == full.len() && index.len() == full.len(),
        "init of {name}: {} block counts and {} block indices for shape {full:?}",
        parts.len(),
        index.len()
    );
    ensure!(full.iter().all(|&s| s > 0), "init of {name}: shape {full:?} has an empty dimension");
    for d in 0..full.len() {
        ensure!(
            parts[d] > 0 && full[d] % parts[d] == 0 && (0..parts[d]).contains(&index[d]),
            "init of {name}: dim {d} of size {} does not split into {} blocks (block {})",
            full[d],
            parts[d],
            index[d]
        );
    }
    let shape: Vec<i64> = full.iter().zip(parts).map(|(f, p)| f / p).collect();
    let start: Vec<i64> = shape.iter().zip(index).map(|(s, i)| s * i).collect();
    let opts = (Kind::Float, Device::Cpu);
    let value: Box<dyn Fn(u64, u64) -> f32 + Sync> = match init {
        Init::Zeros => return Ok(Tensor::f_zeros(&shape, opts)?),
        Init::Ones => return Ok(Tensor::f_ones(&shape, opts)?),
        Init::Normal { std } => Box::new(move |s, i| (std * normal(s, i)) as f32),
        Init::Uniform { bound } => Box::new(move |s, i| (bound * (2.0 * uniform(s, i) - 1.0)) as f32),
    };
    let stream = stream_of(seed, name);
    let count: i64 = shape.iter().product();
    let values: Vec<f32> = (0..count)
        .into_par_iter()
        .map(|local| {
            // Row-major position in the block, then in the full tensor.
            let (mut rest, mut index) = (local, 0i64);
            let mut stride: i64 = count;
            for d in 0..full.len() {
                stride /= shape[d];
                let at = rest / stride;
                rest %= stride;
                index = index * full[d] + start[d] + at;
            }
            value(stream, index as u64)
        })
        .collect();
    Ok(Tensor::f_from_slice(&values)?.f_reshape(&shape)?)
}

/// The whole parameter (the tp=1 values).
pub fn full(init: Init, seed: u64, name: &str, shape: &[i64]) -> Result<Tensor> {
    shard(init, seed, name, shape, 0, 0, 1)
}

/// Values at the full-tensor positions of rows `start..start + len` of dim `dim`, in the
/// block's row-major order.
pub(super) fn draw<T: Send>(
    seed: u64,
    name: &str,
    full: &[i64],
    dim: usize,
    start: i64,
    len: i64,
    value: impl Fn(u64, u64) -> T + Sync,
) -> Vec<T> {
    let stream = stream_of(seed, name);
    let outer: i64 = full[..dim].iter().product();
    let inner: i64 = full[dim + 1..].iter().product();
    let count = (outer * len * inner) as usize;
    (0..count)
        .into_par_iter()
        .map(|local| {
            let local = local as i64;
            let (o, rest) = (local / (len * inner), local % (len * inner));
            let (row, k) = (rest / inner, rest % inner);
            let index = (o * full[dim] + start + row) * inner + k;
            value(stream, index as u64)
        })
        .collect()
}

/// A generator stream per (seed, name): FNV-1a of the name mixed into the seed.
fn stream_of(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(seed ^ mix(h))
}

/// splitmix64's output function: a bijection of u64 that scrambles every bit.
pub(super) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The `i`-th uniform on `[0, 1)` of `stream` (53 random bits).
pub(super) fn uniform(stream: u64, i: u64) -> f64 {
    let z = mix(stream.wrapping_add(i.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15)));
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The `i`-th standard normal of `stream` (Box-Muller on uniforms `2i` and `2i + 1`).
fn normal(stream: u64, i: u64) -> f64 {
    let u1 = 1.0 - uniform(stream, 2 * i); // (0, 1]: the log is finite
    let u2 = uniform(stream, 2 * i + 1);
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_are_slices_of_the_full_tensor() {
        for init in [Init::Normal { std: 0.5 }, Init::Uniform { bound: 0.3 }] {
            let whole = full(init, 7, "layer.weight", &[6, 4, 3]).unwrap();
            for dim in 0..3 {
                let n = [3, 2, 3][dim];
                for r in 0..n {
                    let s = shard(init, 7, "layer.weight", &[6, 4, 3], dim, r, n).unwrap();
                    let b = whole.size()[dim] / n;
                    assert!(s.equal(&whole.narrow(dim as i64, r * b, b)), "{init:?} dim {dim} block {r}");
                }
            }
        }
    }

    #[test]
    fn grid_blocks_are_slices_of_the_full_tensor() {
        let init = Init::Normal { std: 1.0 };
        let whole = full(init, 3, "w", &[6, 4, 2]).unwrap();
        for (a, b) in [(0, 0), (1, 1), (2, 0), (0, 1)] {
            let got = block(init, 3, "w", &[6, 4, 2], &[3, 2, 1], &[a, b, 0]).unwrap();
            assert!(got.equal(&whole.narrow(0, 2 * a, 2).narrow(1, 2 * b, 2)), "block ({a}, {b})");
        }
        let err = block(init, 3, "w", &[6, 4], &[4, 1], &[0, 0]).unwrap_err().to_string();
        assert!(err.contains("dim 0 of size 6 does not split into 4 blocks"), "{err}");
    }

    #[test]
    fn names_and_seeds_give_different_streams_with_the_right_moments() {
        let a = full(Init::Normal { std: 2.0 }, 1, "a", &[200, 100]).unwrap();
        let b = full(Init::Normal { std: 2.0 }, 1, "b", &[200, 100]).unwrap();
        let c = full(Init::Normal { std: 2.0 }, 2, "a", &[200, 100]).unwrap();
        assert!(!a.equal(&b) && !a.equal(&c));
        let (mean, std) = (a.mean(Kind::Double).double_value(&[]), a.std(true).double_value(&[]));
        assert!(mean.abs() < 0.05 && (std - 2.0).abs() < 0.05, "mean {mean} std {std}");
        let u = full(Init::Uniform { bound: 0.5 }, 3, "u", &[20000]).unwrap();
        let (lo, hi) = (u.min().double_value(&[]), u.max().double_value(&[]));
        assert!((-0.5..-0.49).contains(&lo) && (0.49..0.5).contains(&hi), "range {lo}..{hi}");
    }

    #[test]
    fn uneven_splits_are_errors_naming_the_sizes() {
        let err = shard(Init::Zeros, 0, "w", &[10, 4], 0, 0, 4).unwrap_err().to_string();
        assert!(err.contains("dim 0 of size 10 does not split into 4 blocks"), "{err}");
    }
}
