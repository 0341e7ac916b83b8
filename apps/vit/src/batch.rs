//! Batch arithmetic: `--batch` is the global batch (`32k` = 32,768); each step it is split as
//! world size x micro-batch x accumulation steps. And a batch as the model's input.
use data::loader::Batch;
use tch::{Device, Kind, Tensor};

/// Parses a batch size with an optional `k` (x1024) suffix: `256`, `32k`.
pub fn parse_batch(s: &str) -> Result<usize, String> {
    let t = s.trim().to_ascii_lowercase();
    let (digits, scale) = match t.strip_suffix('k') {
        Some(d) => (d, 1024),
        None => (t.as_str(), 1),
    };
    match digits.parse::<usize>().ok().filter(|&n| n > 0).map(|n| n.checked_mul(scale)) {
        Some(Some(n)) => Ok(n),
        Some(None) => Err(format!("{s:?} is more examples than can be counted")),
        _ => Err(format!("{s:?} is not a batch size (a positive number, optionally with a k suffix)")),
    }
}

/// How a global batch is split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchPlan {
    /// Examples per optimizer step, over all ranks.
    pub global: usize,
    /// Examples per forward/backward on one rank.
    pub micro: usize,
    /// Micro-batches per optimizer step on each rank.
    pub accumulation: usize,
}

impl BatchPlan {
    /// Splits `global` over `world` ranks with micro-batches of `micro` (or, when not given, the
    /// largest divisor of the per-rank batch not above `max_micro`). An impossible split is an
    /// error naming the numbers.
    pub fn new(global: usize, world: usize, micro: Option<usize>, max_micro: usize) -> Result<BatchPlan, String> {
        if !global.is_multiple_of(world) {
            return Err(format!("--batch {global} does not split over {world} ranks"));
        }
        let per_rank = global / world;
        let micro = match micro {
            Some(m) if m == 0 || !per_rank.is_multiple_of(m) => {
                return Err(format!(
                "--micro-batch {m} does not divide the per-rank batch {per_rank} (--batch {global} over {world} ranks)"
            ))
            }
            Some(m) => m,
            None => (1..=per_rank.min(max_micro)).rev().find(|m| per_rank.is_multiple_of(*m)).unwrap_or(1),
        };
        Ok(BatchPlan { global, micro, accumulation: per_rank / micro })
    }
}

/// A batch as model input `[n, c, h, w]` and labels, uploaded without waiting for the device
/// ([`engine::cuda::upload_slice`]: one host copy, into pinned memory).
pub fn to_tensors(batch: &Batch, device: Device, kind: Kind) -> anyhow::Result<(Tensor, Tensor)> {
    let shape: Vec<i64> = batch.shape.iter().map(|&d| d as i64).collect();
    let images = engine::cuda::upload_slice(&batch.pixels, &shape, device)?.f_to_kind(kind)?;
    Ok((images, engine::cuda::upload_slice(&batch.labels, &[batch.labels.len() as i64], device)?))
}

/// Mixup's blend of a batch `[n, ...]` with its reverse, `λ images + (1 - λ) images[n - 1 - i]`
/// (timm's batch mode), where the batch lies (on a GPU, the device: on the host it was a
/// 154 MB pass and copy per micro-batch of 256 images on the training thread); `images` as it
/// is for λ = 1.
pub fn mix(images: &Tensor, lambda: f64) -> anyhow::Result<Tensor> {
    if lambda >= 1.0 {
        return Ok(images.shallow_clone());
    }
    let reversed = images.f_flip([0])?;
    Ok(images.f_mul_scalar(lambda)?.f_add_(&reversed.f_mul_scalar(1.0 - lambda)?)?)
}

/// `images` `[n, c, h, w]` with blank images appended up to a multiple of `blocks` (the batch
/// blocks of `--tp-mode 2d|2.5d|3d`, see [`crate::layout::Layout::batch_blocks`]): for evaluation chunks,
/// whose logits past the first `n` rows are then dropped.
pub fn pad_to_blocks(images: &Tensor, blocks: usize) -> anyhow::Result<Tensor> {
    let (n, blocks) = (images.size()[0], blocks as i64);
    let missing = (blocks - n % blocks) % blocks;
    if missing == 0 {
        return Ok(images.shallow_clone());
    }
    let mut shape = images.size();
    shape[0] = missing;
    let blank = Tensor::f_zeros(&shape, (images.kind(), images.device()))?;
    Ok(Tensor::f_cat(&[images.shallow_clone(), blank], 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixup_blends_each_image_with_its_reverse() {
        let images = Tensor::from_slice(&[1.0f32, 2.0, 10.0, 20.0, 100.0, 200.0]).view([3, 2]);
        let mixed = mix(&images, 0.25).unwrap();
        let want = Tensor::from_slice(&[75.25f32, 150.5, 10.0, 20.0, 25.75, 51.5]).view([3, 2]);
        assert!(mixed.allclose(&want, 1e-6, 1e-6, false), "{mixed}");
        assert!(mix(&images, 1.0).unwrap().equal(&images));
    }

    #[test]
    fn batch_sizes() {
        assert_eq!(parse_batch("32k"), Ok(32768));
        assert_eq!(parse_batch("256"), Ok(256));
        assert!(parse_batch("0").is_err() && parse_batch("k").is_err() && parse_batch("-3").is_err());
    }

    #[test]
    fn plans() {
        assert_eq!(BatchPlan::new(32768, 8, None, 256), Ok(BatchPlan { global: 32768, micro: 256, accumulation: 16 }));
        assert_eq!(BatchPlan::new(96, 2, None, 40), Ok(BatchPlan { global: 96, micro: 24, accumulation: 2 }));
        assert_eq!(BatchPlan::new(32, 1, Some(8), 256), Ok(BatchPlan { global: 32, micro: 8, accumulation: 4 }));
        assert!(BatchPlan::new(30, 4, None, 8).unwrap_err().contains("--batch 30 does not split over 4 ranks"));
        assert!(BatchPlan::new(32, 2, Some(5), 8)
            .unwrap_err()
            .contains("--micro-batch 5 does not divide the per-rank batch 16"));
    }
}
