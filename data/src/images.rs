//! Labelled image data sets behind one trait, whatever their storage: the embedded digits
//! (in memory), a folder of image files, or an HDF5 file. Examples are decoded one at a time,
//! so memory does not grow with the data set.
use image::ImageEncoder;

use crate::Result;

/// One decoded image: channel-major (`[channels, height, width]`) pixels in `[0, 1]`.
#[derive(Clone, Debug, PartialEq)]
pub struct Image {
    /// Colour channels (1 grey, 3 RGB).
    pub channels: usize,
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
    /// `channels * height * width` values, channel-major.
    pub pixels: Vec<f32>,
}

impl Image {
    /// An image from channel-major pixels; the length must match the shape.
    pub fn new(channels: usize, height: usize, width: usize, pixels: Vec<f32>) -> Image {
        assert_eq!(pixels.len(), channels * height * width, "pixel count does not match the shape");
        Image { channels, height, width, pixels }
    }

    /// The pixel of channel `c` at row `y`, column `x`.
    pub fn at(&self, c: usize, y: usize, x: usize) -> f32 {
        self.pixels[(c * self.height + y) * self.width + x]
    }

    /// The image as an 8-bit PNG file's bytes (grey or RGB), values in `[0, 1]` clamped and
    /// rounded.
    pub fn png(&self) -> std::result::Result<Vec<u8>, String> {
        let plane = self.height * self.width;
        let mut bytes = vec![0u8; self.channels * plane];
        for (i, b) in bytes.iter_mut().enumerate() {
            let v = self.pixels[(i % self.channels) * plane + i / self.channels];
            *b = (v.clamp(0.0, 1.0) * 255.0).round() as u8;
        }
        encode_png(&bytes, self.width, self.height, self.channels)
    }

    /// Writes the image as an 8-bit PNG ([`Image::png`]), atomically (nothing is left at `path`
    /// if writing fails).
    pub fn write_png(&self, path: &std::path::Path) -> Result<()> {
        let png = self.png().map_err(|msg| crate::Error::Format { path: path.to_path_buf(), msg })?;
        crate::write_atomic(path, |w| -> Result<()> {
            use std::io::Write;
            w.write_all(&png).map_err(|e| crate::Error::Io { path: path.to_path_buf(), source: e })
        })
    }
}

/// An 8-bit PNG file's bytes from interleaved pixels (`height` rows of `width` pixels of
/// `channels` bytes: 1 grey, 3 RGB).
pub fn encode_png(bytes: &[u8], width: usize, height: usize, channels: usize) -> std::result::Result<Vec<u8>, String> {
    let color = match channels {
        1 => image::ExtendedColorType::L8,
        3 => image::ExtendedColorType::Rgb8,
        c => return Err(format!("PNG output needs 1 or 3 channels, not {c}")),
    };
    if bytes.len() != width * height * channels {
        return Err(format!("{} bytes are not {height} rows of {width} pixels of {channels} bytes", bytes.len()));
    }
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(bytes, width as u32, height as u32, color)
        .map_err(|e| format!("encoding PNG: {e}"))?;
    Ok(png)
}

/// Writes each image to its path as [`Image::write_png`] does, all or none: the images of one
/// run are a set, and a part of it would read as the output of a run with fewer images. When
/// one fails, those written before it are removed and the error says which one failed.
pub fn write_pngs(images: &[(std::path::PathBuf, Image)]) -> Result<()> {
    for (i, (path, image)) in images.iter().enumerate() {
        if let Err(e) = image.write_png(path) {
            for (done, _) in &images[..i] {
                let _ = std::fs::remove_file(done);
            }
            return Err(crate::Error::Format {
                path: path.clone(),
                msg: format!(
                    "writing image {} of {}: {e}; the {i} written before it were removed",
                    i + 1,
                    images.len()
                ),
            });
        }
    }
    Ok(())
}

/// A labelled image data set.
pub trait Dataset: Send + Sync {
    /// Number of examples.
    fn len(&self) -> usize;
    /// Whether there are no examples.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Class names, indexed by label.
    fn classes(&self) -> &[String];
    /// Colour channels of every image.
    fn channels(&self) -> usize;
    /// Decodes example `i` (`i < len()`): the image and its label. Errors name the file.
    fn get(&self, i: usize) -> Result<(Image, i64)>;
}

/// Images of one size held in memory.
#[derive(Clone, Debug)]
pub struct InMemory {
    /// `[channels, height, width]` of every image.
    pub shape: [usize; 3],
    /// All images' pixels in `[0, 1]`, image after image, each channel-major.
    pub pixels: Vec<f32>,
    /// One label per image.
    pub labels: Vec<i64>,
    /// Class names, indexed by label.
    pub classes: Vec<String>,
}

impl InMemory {
    /// The examples at `indices`, in that order.
    pub fn select(&self, indices: &[usize]) -> InMemory {
        let size = self.shape.iter().product::<usize>();
        InMemory {
            shape: self.shape,
            pixels: indices.iter().flat_map(|&i| self.pixels[i * size..(i + 1) * size].iter().copied()).collect(),
            labels: indices.iter().map(|&i| self.labels[i]).collect(),
            classes: self.classes.clone(),
        }
    }
}

impl Dataset for InMemory {
    fn len(&self) -> usize {
        self.labels.len()
    }

    fn classes(&self) -> &[String] {
        &self.classes
    }

    fn channels(&self) -> usize {
        self.shape[0]
    }

    fn get(&self, i: usize) -> Result<(Image, i64)> {
        let [c, h, w] = self.shape;
        let size = c * h * w;
        Ok((Image::new(c, h, w, self.pixels[i * size..(i + 1) * size].to_vec()), self.labels[i]))
    }
}

/// The examples of another data set at fixed indices (a validation hold-out, a rank's share).
pub struct Subset {
    inner: std::sync::Arc<dyn Dataset>,
    indices: Vec<usize>,
}

impl Subset {
    /// `inner`'s examples at `indices` (each below `inner.len()`), in that order.
    pub fn new(inner: std::sync::Arc<dyn Dataset>, indices: Vec<usize>) -> Subset {
        debug_assert!(indices.iter().all(|&i| i < inner.len()));
        Subset { inner, indices }
    }
}

impl Dataset for Subset {
    fn len(&self) -> usize {
        self.indices.len()
    }

    fn classes(&self) -> &[String] {
        self.inner.classes()
    }

    fn channels(&self) -> usize {
        self.inner.channels()
    }

    fn get(&self, i: usize) -> Result<(Image, i64)> {
        self.inner.get(self.indices[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_round_trip_and_bad_channel_count() {
        let dir = crate::scratch("png");
        let pixels: Vec<f32> = (0..3 * 4 * 5).map(|i| (i % 7) as f32 / 6.0).collect();
        let img = Image::new(3, 4, 5, pixels);
        let path = dir.join("x.png");
        img.write_png(&path).unwrap();
        let back = crate::folder::decode(&path, 3).unwrap();
        assert_eq!((back.channels, back.height, back.width), (3, 4, 5));
        let worst = back.pixels.iter().zip(&img.pixels).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 0.5 / 255.0 + 1e-6, "8-bit rounding only: {worst}");
        let err = Image::new(2, 1, 1, vec![0.0, 0.0]).write_png(&dir.join("y.png")).unwrap_err().to_string();
        assert!(err.contains("y.png: PNG output needs 1 or 3 channels, not 2"), "{err}");
        assert!(!dir.join("y.png").exists());
    }
}
