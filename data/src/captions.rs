//! Image folders with captions, for text-to-image fine-tuning, in the layouts diffusers'
//! training scripts read:
//!
//! - `metadata.jsonl` in the folder: one JSON object per line with `file_name` (relative to the
//!   folder) and `text` (the caption), as the Hugging Face `imagefolder` loader reads it;
//! - otherwise a caption file beside each image, same stem, `.txt` (`dog1.png` + `dog1.txt`);
//! - DreamBooth: every image of the folder with one instance prompt.
//!
//! Images are the folder's `jpg`, `jpeg` and `png` files, sorted by name. A line of
//! `metadata.jsonl` that does not parse, an entry whose file is missing, an image without a
//! caption and an image that does not decode are errors naming the file (and line).
//!
//! [`CaptionedImages::load`] prepares an image as diffusers' `train_text_to_image.py` does:
//! shorter side resized to the resolution (antialiased bilinear), a centre or random square
//! crop, an optional random horizontal flip, values scaled to `[-1, 1]`.
use std::path::{Path, PathBuf};

use crate::augment::Rng;
use crate::folder::{decode_oriented, is_image, list, resize_shorter};
use crate::images::Image;
use crate::{Error, Result};

/// How the square is cut from the resized image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CropMode {
    /// The centred square.
    Center,
    /// A square at a random offset.
    Random,
}

/// How [`CaptionedImages::load`] prepares an image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preprocess {
    /// Side of the square result, in pixels.
    pub resolution: usize,
    /// Centre or random crop.
    pub crop: CropMode,
    /// Flip horizontally with probability 1/2.
    pub flip: bool,
}

/// Images and their captions (see the module documentation).
#[derive(Clone, Debug)]
pub struct CaptionedImages {
    root: PathBuf,
    items: Vec<(PathBuf, String)>,
    /// Turn images upright by their EXIF orientation: DreamBooth's scripts do
    /// (`exif_transpose`), diffusers' text-to-image script does not.
    upright: bool,
}

fn format_err(path: &Path, msg: String) -> Error {
    Error::Format { path: path.to_path_buf(), msg }
}

impl CaptionedImages {
    /// Reads the folder's images and captions; with `instance_prompt` every image takes that
    /// prompt (DreamBooth) and caption files are not read.
    pub fn open(root: &Path, instance_prompt: Option<&str>) -> Result<CaptionedImages> {
        if !root.is_dir() {
            return Err(format_err(root, "not a folder of images".into()));
        }
        let metadata = root.join("metadata.jsonl");
        let items = match instance_prompt {
            Some(prompt) => Self::images(root)?.into_iter().map(|p| (p, prompt.to_string())).collect(),
            // There but not a file (a folder, say) is an error from reading it, not a reason
            // to take the .txt captions instead.
            None if metadata.exists() => Self::from_metadata(root, &metadata)?,
            None => Self::images(root)?
                .into_iter()
                .map(|image| {
                    let caption = image.with_extension("txt");
                    let text = std::fs::read_to_string(&caption).map_err(|e| match e.kind() {
                        std::io::ErrorKind::NotFound => format_err(
                            &image,
                            format!(
                                "no caption: expected {} (or a metadata.jsonl in the folder, or an instance prompt)",
                                caption.display()
                            ),
                        ),
                        // There but unreadable (not UTF-8, a folder, no permission): say why.
                        _ => format_err(&caption, format!("caption of {}: {e}", image.display())),
                    })?;
                    Ok((image, text.trim().to_string()))
                })
                .collect::<Result<Vec<_>>>()?,
        };
        if items.is_empty() {
            return Err(format_err(root, format!("no images ({})", crate::folder::EXTENSIONS.join(", "))));
        }
        Ok(CaptionedImages { root: root.to_path_buf(), items, upright: instance_prompt.is_some() })
    }

    /// The images in `root` (not in its subfolders), sorted; hidden files (`.name`, such as
    /// macOS's `._photo.jpg`) are left out, as Hugging Face's imagefolder leaves them.
    fn images(root: &Path) -> Result<Vec<PathBuf>> {
        let mut images = Vec::new();
        for path in list(root)? {
            let hidden = path.file_name().is_some_and(|n| n.as_encoded_bytes().starts_with(b"."));
            if !hidden && is_image(&path)? {
                images.push(path);
            }
        }
        images.sort();
        Ok(images)
    }

    fn from_metadata(root: &Path, metadata: &Path) -> Result<Vec<(PathBuf, String)>> {
        #[derive(serde::Deserialize)]
        struct Entry {
            file_name: String,
            text: String,
        }
        let text =
            std::fs::read_to_string(metadata).map_err(|source| Error::Io { path: metadata.to_path_buf(), source })?;
        // Windows editors may start the file with a byte-order mark, which JSON does not allow.
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        let mut items = vec![];
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            let entry: Entry = serde_json::from_str(line).map_err(|e| {
                format_err(metadata, format!("line {}: expected {{\"file_name\": ..., \"text\": ...}}: {e}", n + 1))
            })?;
            let image = root.join(&entry.file_name);
            if !image.is_file() {
                return Err(format_err(metadata, format!("line {}: {} does not exist", n + 1, image.display())));
            }
            items.push((image, entry.text));
        }
        // Images the metadata leaves out have no caption.
        let listed: std::collections::HashSet<&PathBuf> = items.iter().map(|(p, _)| p).collect();
        for image in Self::images(root)? {
            if !listed.contains(&image) {
                return Err(format_err(&image, format!("no caption: not listed in {}", metadata.display())));
            }
        }
        Ok(items)
    }

    /// The folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether there are no images (never, once opened).
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Image `i`'s file.
    pub fn file(&self, i: usize) -> &Path {
        &self.items[i].0
    }

    /// Image `i`'s caption.
    pub fn caption(&self, i: usize) -> &str {
        &self.items[i].1
    }

    /// Image `i` decoded as RGB and prepared by `how` (see the module documentation), values
    /// in `[-1, 1]`; `rng` draws the crop offset and the flip.
    pub fn load(&self, i: usize, how: Preprocess, rng: &mut Rng) -> Result<Image> {
        Ok(self.load_with_geometry(i, how, rng)?.0)
    }

    /// [`CaptionedImages::load`], and where the square came from, as SDXL's size and crop
    /// conditioning records it.
    pub fn load_with_geometry(&self, i: usize, how: Preprocess, rng: &mut Rng) -> Result<(Image, Geometry)> {
        let path = self.file(i);
        let img = decode_oriented(path, 3, self.upright)?;
        if how.resolution == 0 {
            return Err(format_err(path, "resolution must be positive".into()));
        }
        let original = (img.height, img.width);
        let img = resize_shorter(&img, how.resolution);
        let r = how.resolution;
        let (top, left) = match how.crop {
            // torchvision's CenterCrop (and the SDXL script's crop corner):
            // `int(round((side - r) / 2))`, Python's round, halves to even.
            CropMode::Center => {
                let centre = |side: usize| ((side - r) as f64 / 2.0).round_ties_even() as usize;
                (centre(img.height), centre(img.width))
            }
            CropMode::Random => (
                (rng.uniform() * (img.height - r + 1) as f64) as usize,
                (rng.uniform() * (img.width - r + 1) as f64) as usize,
            ),
        };
        let flip = how.flip && rng.uniform() < 0.5;
        let mut pixels = Vec::with_capacity(3 * r * r);
        for c in 0..3 {
            for y in 0..r {
                for x in 0..r {
                    let sx = if flip { left + r - 1 - x } else { left + x };
                    pixels.push(img.at(c, top + y, sx) * 2.0 - 1.0);
                }
            }
        }
        // diffusers' SDXL script flips the resized image before cropping it, so a flipped
        // crop's left edge is counted from the mirrored side.
        let crop_left = if flip { img.width - r - left } else { left };
        Ok((Image::new(3, r, r, pixels), Geometry { original, crop_top_left: (top, crop_left) }))
    }
}

/// Where a prepared square came from: the decoded image's `(height, width)` and the crop's
/// `(top, left)` in the resized (and, when flipped, mirrored) image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    /// The image's size before resizing.
    pub original: (usize, usize),
    /// The crop's top-left corner.
    pub crop_top_left: (usize, usize),
}

#[cfg(test)]
mod tests {
    use std::fs;

    use image::{Rgb, RgbImage};

    use super::*;

    /// A `w` x `h` PNG whose red channel rises left to right.
    fn png(path: &Path, w: u32, h: u32) {
        RgbImage::from_fn(w, h, |x, _| Rgb([(x * 255 / (w - 1)) as u8, 0, 255])).save(path).unwrap();
    }

    #[test]
    fn captions_from_metadata_side_files_or_an_instance_prompt() {
        let s = crate::scratch("captions-sources");
        png(&s.join("b.png"), 8, 6);
        png(&s.join("a.jpg"), 6, 8);
        // Side files.
        fs::write(s.join("a.txt"), "a photo of a cat\n").unwrap();
        fs::write(s.join("b.txt"), "a dog").unwrap();
        let d = CaptionedImages::open(&s, None).unwrap();
        assert_eq!(d.len(), 2);
        assert_eq!((d.file(0).file_name().unwrap(), d.caption(0)), ("a.jpg".as_ref(), "a photo of a cat"));
        // DreamBooth.
        let d = CaptionedImages::open(&s, Some("a photo of sks dog")).unwrap();
        assert!((0..2).all(|i| d.caption(i) == "a photo of sks dog"));
        // metadata.jsonl wins over side files.
        fs::write(
            s.join("metadata.jsonl"),
            "{\"file_name\": \"b.png\", \"text\": \"from metadata\"}\n\n{\"file_name\": \"a.jpg\", \"text\": \"second\"}\n",
        )
        .unwrap();
        let d = CaptionedImages::open(&s, None).unwrap();
        assert_eq!((d.caption(0), d.caption(1)), ("from metadata", "second"));
    }

    #[test]
    fn missing_captions_bad_metadata_and_corrupt_images_are_named() {
        let s = crate::scratch("captions-errors");
        png(&s.join("a.png"), 8, 8);
        let err = CaptionedImages::open(&s, None).unwrap_err().to_string();
        assert!(err.contains("a.png: no caption: expected") && err.contains("a.txt"), "{err}");
        fs::write(s.join("a.txt"), b"\xff\xfe not UTF-8").unwrap();
        let err = CaptionedImages::open(&s, None).unwrap_err().to_string();
        assert!(err.contains("a.txt: caption of") && err.contains("UTF-8"), "{err}");
        fs::remove_file(s.join("a.txt")).unwrap();
        fs::write(s.join("metadata.jsonl"), "{\"file_name\": \"a.png\"}\n").unwrap();
        let err = CaptionedImages::open(&s, None).unwrap_err().to_string();
        assert!(err.contains("metadata.jsonl: line 1: expected"), "{err}");
        fs::write(s.join("metadata.jsonl"), "{\"file_name\": \"gone.png\", \"text\": \"x\"}\n").unwrap();
        let err = CaptionedImages::open(&s, None).unwrap_err().to_string();
        assert!(err.contains("line 1:") && err.contains("gone.png does not exist"), "{err}");
        fs::write(s.join("metadata.jsonl"), "").unwrap();
        let err = CaptionedImages::open(&s, None).unwrap_err().to_string();
        assert!(err.contains("a.png: no caption: not listed in"), "{err}");
        // A byte-order mark is skipped; hidden files (macOS's `._a.png`) are not images.
        fs::write(s.join("metadata.jsonl"), "\u{feff}{\"file_name\": \"a.png\", \"text\": \"x\"}\n").unwrap();
        fs::write(s.join("._a.png"), b"AppleDouble").unwrap();
        assert_eq!(CaptionedImages::open(&s, None).unwrap().len(), 1);
        fs::remove_file(s.join("._a.png")).unwrap();
        // A metadata.jsonl that is a folder is named, not passed over for .txt captions.
        fs::remove_file(s.join("metadata.jsonl")).unwrap();
        fs::create_dir(s.join("metadata.jsonl")).unwrap();
        let err = CaptionedImages::open(&s, None).unwrap_err().to_string();
        assert!(err.contains("metadata.jsonl"), "{err}");
        fs::remove_dir(s.join("metadata.jsonl")).unwrap();
        fs::write(s.join("b.png"), b"not a png").unwrap();
        let d = CaptionedImages::open(&s, Some("p")).unwrap();
        let how = Preprocess { resolution: 4, crop: CropMode::Center, flip: false };
        let err = d.load(1, how, &mut Rng::keyed(0, 0, 0)).unwrap_err().to_string();
        assert!(err.contains("b.png: cannot decode image"), "{err}");
        let empty = crate::scratch("captions-empty");
        let err = CaptionedImages::open(&empty, Some("p")).unwrap_err().to_string();
        assert!(err.contains("no images (jpg, jpeg, png"), "{err}");
    }

    #[test]
    fn centre_crops_are_torchvisions() {
        // Resize(16) then CenterCrop(16): the long side int(16 * long / short), the crop's
        // corner int(round((side - 16) / 2)) with Python's halves to even.
        let s = crate::scratch("captions-centre");
        for (w, h, left) in [(27, 20, 2), (29, 20, 4), (37, 24, 4), (20, 29, 0)] {
            png(&s.join("x.png"), w, h);
            let d = CaptionedImages::open(&s, Some("p")).unwrap();
            let how = Preprocess { resolution: 16, crop: CropMode::Center, flip: false };
            let (_, geometry) = d.load_with_geometry(0, how, &mut Rng::keyed(0, 0, 0)).unwrap();
            let top = if h > w { 4 } else { 0 };
            assert_eq!(geometry.crop_top_left, (top, left), "{w}x{h}");
        }
    }

    #[test]
    fn load_resizes_crops_flips_and_scales() {
        let s = crate::scratch("captions-load");
        png(&s.join("wide.png"), 40, 20);
        let d = CaptionedImages::open(&s, Some("p")).unwrap();
        let center = Preprocess { resolution: 10, crop: CropMode::Center, flip: false };
        let img = d.load(0, center, &mut Rng::keyed(0, 0, 0)).unwrap();
        assert_eq!((img.channels, img.height, img.width), (3, 10, 10));
        assert!(img.pixels.iter().all(|&v| (-1.0..=1.0).contains(&v)));
        // Blue is 255 everywhere: 1 after scaling; green 0: -1.
        assert!((img.at(2, 3, 3) - 1.0).abs() < 1e-6 && (img.at(1, 3, 3) + 1.0).abs() < 1e-6);
        // The centre of a 20-wide resize: red rises across the crop, around the middle value.
        let (first, last) = (img.at(0, 5, 0), img.at(0, 5, 9));
        assert!(first < last && first > -0.6 && last < 0.6, "{first} {last}");
        // Flipped: red falls left to right. Random crops stay inside and depend on the rng only.
        let flipped = Preprocess { resolution: 10, crop: CropMode::Random, flip: true };
        let mut saw_flip = false;
        for k in 0..8 {
            let a = d.load(0, flipped, &mut Rng::keyed(1, k, 0)).unwrap();
            let b = d.load(0, flipped, &mut Rng::keyed(1, k, 0)).unwrap();
            assert_eq!(a, b, "same key, same image");
            saw_flip |= a.at(0, 5, 0) > a.at(0, 5, 9);
        }
        assert!(saw_flip, "some of 8 draws flip");
        // The geometry SDXL conditions on: the decoded size, and the crop's corner in the
        // resized 20x10 image, counted from the mirrored side when flipped.
        let (_, g) = d.load_with_geometry(0, center, &mut Rng::keyed(0, 0, 0)).unwrap();
        assert_eq!(g, Geometry { original: (20, 40), crop_top_left: (0, 5) });
        let random = Preprocess { flip: false, ..flipped };
        for k in 0..8 {
            let (plain, g) = d.load_with_geometry(0, random, &mut Rng::keyed(1, k, 0)).unwrap();
            let (mirrored, m) = d.load_with_geometry(0, flipped, &mut Rng::keyed(1, k, 0)).unwrap();
            let left = g.crop_top_left.1;
            assert!(left <= 10);
            match plain == mirrored {
                true => assert_eq!(m.crop_top_left.1, left),
                false => assert_eq!(m.crop_top_left.1, 10 - left),
            }
        }
    }
}
