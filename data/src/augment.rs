//! Training and evaluation transforms on decoded [`Image`]s: random resized crop, horizontal
//! flip and per-channel normalisation (torchvision's `RandomResizedCrop`, `RandomHorizontalFlip`,
//! `Normalize`), and mixup with label smoothing on batches (timm's `Mixup`).
//!
//! Every random draw comes from an [`Rng`] keyed by (seed, epoch, example), never from a
//! shared generator, so an example is augmented the same way whichever rank or thread
//! decodes it and whether or not the run was resumed.
use crate::folder::resize_square;
use crate::images::Image;

/// A small counter-based generator (splitmix64): cheap to create per example.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for one purpose, keyed by up to three numbers.
    pub fn keyed(seed: u64, a: u64, b: u64) -> Rng {
        let mut r = Rng(seed ^ 0x6a09_e667_f3bc_c908);
        let x = r.next_u64() ^ a.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut r = Rng(x);
        Rng(r.next_u64() ^ b.wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `[lo, hi)`.
    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.uniform()
    }

    /// A standard normal draw (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        // 1 - u keeps the logarithm finite.
        let (u, v) = (1.0 - self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }

    /// A float32 CPU tensor of standard normal draws, in row-major order: the same values for
    /// a seed on every machine and device (libtorch's generators differ between CPU and CUDA
    /// and are shared by every thread of a process).
    pub fn normal_tensor(&mut self, shape: &[i64]) -> tch::Tensor {
        let n: i64 = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| self.normal() as f32).collect();
        tch::Tensor::from_slice(&values).reshape(shape)
    }

    /// Gamma(shape, 1) by Marsaglia and Tsang (shape < 1 through the boost u^(1/shape)).
    fn gamma(&mut self, shape: f64) -> f64 {
        if shape < 1.0 {
            let u = 1.0 - self.uniform();
            return self.gamma(shape + 1.0) * u.powf(1.0 / shape);
        }
        let d = shape - 1.0 / 3.0;
        let c = 1.0 / (9.0 * d).sqrt();
        loop {
            let x = self.normal();
            let v = (1.0 + c * x).powi(3);
            if v <= 0.0 {
                continue;
            }
            let u = 1.0 - self.uniform();
            if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
                return d * v;
            }
        }
    }

    /// Beta(alpha, alpha).
    pub fn beta(&mut self, alpha: f64) -> f64 {
        let (x, y) = (self.gamma(alpha), self.gamma(alpha));
        x / (x + y)
    }
}

/// A crop box in pixel coordinates (fractional: crops may start between pixels).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Crop {
    /// Left edge.
    pub x: f64,
    /// Top edge.
    pub y: f64,
    /// Width.
    pub w: f64,
    /// Height.
    pub h: f64,
}

/// Resamples the `crop` of `img` to `size` x `size` with bilinear interpolation (pixel
/// centres aligned as in `align_corners=False`; samples outside the image take the nearest
/// edge pixel).
pub fn crop_resize(img: &Image, crop: Crop, size: usize) -> Image {
    let (h, w) = (img.height as f64, img.width as f64);
    let coords = |start: f64, len: f64, limit: f64| -> Vec<(usize, usize, f32)> {
        (0..size)
            .map(|o| {
                let s = (start + (o as f64 + 0.5) * len / size as f64 - 0.5).clamp(0.0, limit - 1.0);
                let lo = s.floor();
                (lo as usize, (lo as usize + 1).min(limit as usize - 1), (s - lo) as f32)
            })
            .collect()
    };
    let (ys, xs) = (coords(crop.y, crop.h, h), coords(crop.x, crop.w, w));
    let mut pixels = Vec::with_capacity(img.channels * size * size);
    for c in 0..img.channels {
        for &(y0, y1, fy) in &ys {
            for &(x0, x1, fx) in &xs {
                let top = img.at(c, y0, x0) * (1.0 - fx) + img.at(c, y0, x1) * fx;
                let bottom = img.at(c, y1, x0) * (1.0 - fx) + img.at(c, y1, x1) * fx;
                pixels.push(top * (1.0 - fy) + bottom * fy);
            }
        }
    }
    Image::new(img.channels, size, size, pixels)
}

/// Per-channel `(x - mean) / std`, with one value broadcast to every channel.
#[derive(Clone, Debug, PartialEq)]
pub struct Normalize {
    /// Channel means.
    pub mean: Vec<f32>,
    /// Channel standard deviations.
    pub std: Vec<f32>,
}

impl Normalize {
    /// ImageNet's statistics (timm's and torchvision's defaults for RGB).
    pub fn imagenet() -> Normalize {
        Normalize { mean: vec![0.485, 0.456, 0.406], std: vec![0.229, 0.224, 0.225] }
    }

    /// Maps `[0, 1]` to `[-1, 1]` on every channel.
    pub fn symmetric() -> Normalize {
        Normalize { mean: vec![0.5], std: vec![0.5] }
    }

    fn apply(&self, img: &mut Image) {
        let plane = img.height * img.width;
        for (c, chunk) in img.pixels.chunks_mut(plane).enumerate() {
            let (m, s) = (self.mean[c.min(self.mean.len() - 1)], self.std[c.min(self.std.len() - 1)]);
            chunk.iter_mut().for_each(|p| *p = (*p - m) / s);
        }
    }
}

/// What is done to each example before it reaches the model.
#[derive(Clone, Debug, PartialEq)]
pub enum Transform {
    /// Training: random resized crop to `size`, optional horizontal flip, normalisation.
    Train {
        /// Output side in pixels.
        size: usize,
        /// Range of the crop's area as a fraction of the image (torchvision: 0.08..1).
        scale: (f64, f64),
        /// Range of the crop's aspect ratio w/h (torchvision: 3/4..4/3).
        ratio: (f64, f64),
        /// Flip left-right with probability 1/2 (off for digits and text).
        hflip: bool,
        /// Normalisation after the geometry.
        normalize: Normalize,
    },
    /// Evaluation: centre square resized to `size` (anti-aliased), normalisation.
    Eval {
        /// Output side in pixels.
        size: usize,
        /// Normalisation.
        normalize: Normalize,
    },
}

impl Transform {
    /// Side of the images this transform produces.
    pub fn size(&self) -> usize {
        match self {
            Transform::Train { size, .. } | Transform::Eval { size, .. } => *size,
        }
    }

    /// The normalisation after the geometry.
    pub fn normalize(&self) -> &Normalize {
        match self {
            Transform::Train { normalize, .. } | Transform::Eval { normalize, .. } => normalize,
        }
    }

    /// Transforms one image with draws from `rng`.
    pub fn apply(&self, img: &Image, rng: &mut Rng) -> Image {
        match self {
            Transform::Train { size, scale, ratio, hflip, normalize } => {
                let crop = random_crop(img, *scale, *ratio, rng);
                let mut out = crop_resize(img, crop, *size);
                if *hflip && rng.uniform() < 0.5 {
                    flip(&mut out);
                }
                normalize.apply(&mut out);
                out
            }
            Transform::Eval { size, normalize } => {
                let mut out = resize_square(img, *size);
                normalize.apply(&mut out);
                out
            }
        }
    }
}

/// torchvision's sampling: area fraction uniform in `scale`, log aspect ratio uniform in
/// `ratio`, up to ten tries for a box that fits, else the whole image.
fn random_crop(img: &Image, scale: (f64, f64), ratio: (f64, f64), rng: &mut Rng) -> Crop {
    let (h, w) = (img.height as f64, img.width as f64);
    for _ in 0..10 {
        let area = h * w * rng.range(scale.0, scale.1);
        let aspect = rng.range(ratio.0.ln(), ratio.1.ln()).exp();
        let (cw, ch) = ((area * aspect).sqrt(), (area / aspect).sqrt());
        if cw <= w && ch <= h {
            return Crop { x: rng.range(0.0, w - cw), y: rng.range(0.0, h - ch), w: cw, h: ch };
        }
    }
    Crop { x: 0.0, y: 0.0, w, h }
}

fn flip(img: &mut Image) {
    let w = img.width;
    img.pixels.chunks_mut(w).for_each(|row| row.reverse());
}

/// Mixup (Zhang et al.) with label smoothing, as timm's `Mixup` in batch mode: the batch is
/// blended with its reverse by λ ~ Beta(alpha, alpha), and so are the smoothed one-hot targets.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mixup {
    /// Beta distribution parameter; 0 turns blending off (smoothing only).
    pub alpha: f64,
    /// Label smoothing: the true class gets 1 - smoothing + smoothing / classes.
    pub smoothing: f64,
}

impl Mixup {
    /// Draws λ and returns the `n x classes` soft targets for `labels` (`n` of them) with λ: the
    /// images are to be blended as `λ image + (1 - λ) reversed image` (λ = 1: left as they are),
    /// which the trainer does on the device (`vit::batch::mix`), not here on its thread.
    pub fn targets(&self, labels: &[i64], classes: usize, rng: &mut Rng) -> (Vec<f32>, f64) {
        let n = labels.len();
        let lambda = if self.alpha > 0.0 { rng.beta(self.alpha) } else { 1.0 };
        let (off, on) = (self.smoothing / classes as f64, 1.0 - self.smoothing + self.smoothing / classes as f64);
        let mut targets = vec![0f32; n * classes];
        for (i, &label) in labels.iter().enumerate() {
            let j = n - 1 - i;
            for k in 0..classes {
                let t = |l: i64| if l as usize == k { on } else { off };
                targets[i * classes + k] = (lambda * t(label) + (1.0 - lambda) * t(labels[j])) as f32;
            }
        }
        (targets, lambda)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(c: usize, h: usize, w: usize) -> Image {
        Image::new(c, h, w, (0..c * h * w).map(|i| i as f32).collect())
    }

    #[test]
    fn whole_image_crop_at_the_same_size_is_the_identity() {
        let img = ramp(2, 4, 6);
        let out = crop_resize(&img, Crop { x: 0.0, y: 0.0, w: 6.0, h: 4.0 }, 4);
        assert_eq!((out.height, out.width), (4, 4));
        // Halving a ramp averages neighbouring pairs: row 0 of a 4x4 ramp -> 2.5, 4.5.
        let small = crop_resize(&ramp(1, 4, 4), Crop { x: 0.0, y: 0.0, w: 4.0, h: 4.0 }, 2);
        assert_eq!(small.pixels, vec![2.5, 4.5, 10.5, 12.5]);
    }

    #[test]
    fn train_transform_is_keyed_and_flips_rows() {
        let img = ramp(3, 8, 8);
        let t = Transform::Train {
            size: 8,
            scale: (0.5, 1.0),
            ratio: (0.75, 4.0 / 3.0),
            hflip: true,
            normalize: Normalize::imagenet(),
        };
        let a = t.apply(&img, &mut Rng::keyed(1, 2, 3));
        assert_eq!(a, t.apply(&img, &mut Rng::keyed(1, 2, 3)), "same key, same augmentation");
        assert_ne!(a, t.apply(&img, &mut Rng::keyed(1, 2, 4)), "another example, another draw");
        let mut f = ramp(1, 2, 3);
        flip(&mut f);
        assert_eq!(f.pixels, vec![2.0, 1.0, 0.0, 5.0, 4.0, 3.0]);
        let e = Transform::Eval { size: 8, normalize: Normalize::symmetric() }.apply(&img, &mut Rng::keyed(0, 0, 0));
        assert_eq!(e.pixels[1], (1.0 - 0.5) / 0.5);
    }

    #[test]
    fn random_crops_stay_inside_and_cover_the_scale_range() {
        let img = ramp(1, 10, 20);
        let mut rng = Rng::keyed(9, 0, 0);
        let mut areas = vec![];
        for _ in 0..500 {
            let c = random_crop(&img, (0.3, 1.0), (0.75, 4.0 / 3.0), &mut rng);
            assert!(c.x >= 0.0 && c.y >= 0.0 && c.x + c.w <= 20.0 + 1e-9 && c.y + c.h <= 10.0 + 1e-9, "{c:?}");
            areas.push(c.w * c.h / 200.0);
        }
        let (lo, hi) = areas.iter().fold((1.0f64, 0.0f64), |(lo, hi), &a| (lo.min(a), hi.max(a)));
        assert!(lo < 0.4 && hi > 0.9, "areas from {lo} to {hi}");
    }

    #[test]
    fn beta_samples_have_the_right_mean_and_mixup_targets_sum_to_one() {
        let mut rng = Rng::keyed(5, 0, 0);
        let samples: Vec<f64> = (0..4000).map(|_| rng.beta(0.4)).collect();
        let mean = samples.iter().sum::<f64>() / samples.len() as f64;
        assert!((mean - 0.5).abs() < 0.03, "Beta(0.4, 0.4) mean {mean}");
        assert!(samples.iter().all(|&s| (0.0..=1.0).contains(&s)));
        let mix = Mixup { alpha: 1.0, smoothing: 0.1 };
        let (targets, lambda) = mix.targets(&[0, 1], 3, &mut Rng::keyed(1, 0, 0));
        assert!(lambda > 0.0 && lambda < 1.0, "{lambda}");
        for row in targets.chunks(3) {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-6, "{row:?}");
        }
        // Image 0's targets: its own label's by λ, image 1's (the reverse's) by 1 - λ.
        let (on, off) = (1.0 - 0.1 + 0.1 / 3.0, 0.1 / 3.0);
        let expect = [lambda * on + (1.0 - lambda) * off, lambda * off + (1.0 - lambda) * on, off];
        for (t, e) in targets[..3].iter().zip(expect) {
            assert!((*t as f64 - e).abs() < 1e-6, "{targets:?} vs {expect:?}");
        }
        let (plain, lambda) = Mixup { alpha: 0.0, smoothing: 0.0 }.targets(&[2], 3, &mut Rng::keyed(1, 0, 0));
        assert_eq!((plain, lambda), (vec![0.0, 0.0, 1.0], 1.0));
    }
}
