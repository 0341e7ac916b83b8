//! Labelled image data sets behind one trait, whatever their storage: the embedded digits
//! (in memory), a folder of image files, or an HDF5 file. Examples are decoded one at a time,
//! so memory does not grow with the data set.
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
