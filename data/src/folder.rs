//! A folder of image files, one subfolder per class (the layout of torchvision's
//! `ImageFolder`, with the same class order), decoded one file at a time.
//!
//! ```text
//! root/cat/001.jpg
//! root/cat/002.png
//! root/dog/001.jpeg
//! ```
use crate::images::{Dataset, Image};
use crate::{Error, Result};
use image::imageops::{self, FilterType};
use image::{ImageBuffer, ImageDecoder, ImageReader, Luma};
use std::fs;
use std::path::{Path, PathBuf};

/// Extensions (compared case-insensitively) of the files taken as images: torchvision's
/// `IMG_EXTENSIONS`.
pub const EXTENSIONS: [&str; 9] = ["jpg", "jpeg", "png", "ppm", "bmp", "pgm", "tif", "tiff", "webp"];

/// The images of a folder with one subfolder per class. Classes are the subfolder names in
/// sorted order (a label is the index of its class); the images of a class are the files with
/// one of [`EXTENSIONS`] anywhere under its folder (symbolic links followed), in torchvision's
/// order (by folder, then by name). Other files are ignored. Each image is decoded at its own
/// size when it is read.
#[derive(Clone, Debug)]
pub struct ImageFolder {
    root: PathBuf,
    channels: usize,
    classes: Vec<String>,
    /// Every image file, with its label.
    files: Vec<(PathBuf, i64)>,
}

impl ImageFolder {
    /// Lists the classes and images under `root`; images will be decoded as grey
    /// (`channels` 1) or RGB (3).
    pub fn open(root: &Path, channels: usize) -> Result<ImageFolder> {
        if channels != 1 && channels != 3 {
            return Err(format_err(root, format!("channels must be 1 or 3, not {channels}")));
        }
        let mut class_dirs = Vec::new();
        for entry in list(root)? {
            // `is_dir` follows symbolic links, so a linked class folder counts.
            if entry.is_dir() {
                let name = entry.file_name().and_then(|n| n.to_str()).map(str::to_string);
                let name = name.ok_or_else(|| format_err(&entry, "class folder name is not UTF-8".into()))?;
                class_dirs.push((name, entry));
            }
        }
        if class_dirs.is_empty() {
            return Err(format_err(root, "no class folders".into()));
        }
        // Byte order of UTF-8 is code point order, the order Python's `sorted` gives, so the
        // labels match torchvision's for the same folder.
        class_dirs.sort();
        let mut files = Vec::new();
        for (label, (_, dir)) in class_dirs.iter().enumerate() {
            let images = images_under(dir)?;
            // As torchvision's ImageFolder: a class without images is an error, not a label
            // the model must learn with no example.
            if images.is_empty() {
                return Err(format_err(
                    dir,
                    format!("no image files ({}) in this class folder", EXTENSIONS.join(", ")),
                ));
            }
            files.extend(images.into_iter().map(|p| (p, label as i64)));
        }
        let classes = class_dirs.into_iter().map(|(name, _)| name).collect();
        Ok(ImageFolder { root: root.to_path_buf(), channels, classes, files })
    }

    /// The folder this data set was opened from.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The file of example `i`.
    pub fn file(&self, i: usize) -> &Path {
        &self.files[i].0
    }
}

impl Dataset for ImageFolder {
    fn len(&self) -> usize {
        self.files.len()
    }

    fn classes(&self) -> &[String] {
        &self.classes
    }

    fn channels(&self) -> usize {
        self.channels
    }

    fn get(&self, i: usize) -> Result<(Image, i64)> {
        let (path, label) = &self.files[i];
        Ok((decode(path, self.channels)?, *label))
    }
}

/// Decodes the image file at `path` as grey (`channels` 1) or RGB (3), at its own size, as
/// Pillow's `convert("L")`/`convert("RGB")` would. A JPEG cut short is an error, as in Pillow
/// ("image file is truncated"), not an image whose missing part is grey.
pub fn decode(path: &Path, channels: usize) -> Result<Image> {
    decode_oriented(path, channels, false)
}

/// [`decode`], turned upright by the file's EXIF orientation first when `upright` (Pillow's
/// `ImageOps.exif_transpose`, which diffusers' DreamBooth scripts apply).
pub fn decode_oriented(path: &Path, channels: usize, upright: bool) -> Result<Image> {
    if channels != 1 && channels != 3 {
        return Err(format_err(path, format!("channels must be 1 or 3, not {channels}")));
    }
    let bytes = fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    if let Err(msg) = jpeg_complete(&bytes) {
        return Err(format_err(path, format!("cannot decode image: {msg}")));
    }
    // Trust the file's first bytes over its extension: a PNG named .jpg still decodes.
    let reader = ImageReader::new(std::io::Cursor::new(&bytes))
        .with_guessed_format()
        .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    let cannot = |e: image::ImageError| format_err(path, format!("cannot decode image: {e}"));
    let mut decoder = reader.into_decoder().map_err(cannot)?;
    let orientation = match upright {
        true => decoder.orientation().map_err(cannot)?,
        false => image::metadata::Orientation::NoTransforms,
    };
    let mut img = image::DynamicImage::from_decoder(decoder).map_err(cannot)?;
    img.apply_orientation(orientation);
    let (width, height) = (img.width() as usize, img.height() as usize);
    let grey_source = !img.color().has_color();
    let interleaved = match channels {
        1 if grey_source => img.into_luma8().into_raw(),
        // ITU-R 601-2 luma with Pillow's fixed-point weights and rounding (the `image`
        // crate's own conversion weighs by Rec. 709).
        1 => img
            .into_rgb8()
            .into_raw()
            .chunks_exact(3)
            .map(|p| ((p[0] as u32 * 19595 + p[1] as u32 * 38470 + p[2] as u32 * 7471 + 0x8000) >> 16) as u8)
            .collect(),
        _ => img.into_rgb8().into_raw(),
    };
    // Interleaved `[y, x, c]` bytes to channel-major `[c, y, x]` values in [0, 1].
    let plane = height * width;
    let mut pixels = vec![0.0; channels * plane];
    for (i, &v) in interleaved.iter().enumerate() {
        pixels[(i % channels) * plane + i / channels] = f32::from(v) / 255.0;
    }
    Ok(Image::new(channels, height, width, pixels))
}

/// `img` resized so that its shorter side is `size` (the aspect ratio kept, the longer side
/// `size * long / short` truncated, as torchvision computes it), with the triangle filter of
/// [`resize_square`] (torchvision's antialiased `Resize(size)`).
///
/// # Panics
/// If `size` is 0 or `img` has no pixels.
pub fn resize_shorter(img: &Image, size: usize) -> Image {
    assert!(size > 0 && img.height > 0 && img.width > 0, "resize_shorter needs a non-empty image and size");
    let (short, long) = (img.height.min(img.width), img.height.max(img.width));
    let resized_long = (size * long / short).max(size);
    let (h, w) = if img.height <= img.width { (size, resized_long) } else { (resized_long, size) };
    crop_and_resize(img, (0, 0, img.width, img.height), w, h)
}

/// `img` cropped to the largest centred square, then resized to `size` x `size` with a
/// triangle (bilinear) filter, which widens with the scale when shrinking so that the result
/// does not alias. Every channel is resized on its own.
///
/// # Panics
/// If `size` is 0 or `img` has no pixels.
pub fn resize_square(img: &Image, size: usize) -> Image {
    assert!(size > 0 && img.height > 0 && img.width > 0, "resize_square needs a non-empty image and size");
    let side = img.height.min(img.width);
    let (top, left) = ((img.height - side) / 2, (img.width - side) / 2);
    crop_and_resize(img, (left, top, side, side), size, size)
}

/// The `(left, top, width, height)` box of `img` resized to `w` x `h`, channel by channel, with
/// the triangle filter.
fn crop_and_resize(img: &Image, (left, top, cw, ch): (usize, usize, usize, usize), w: usize, h: usize) -> Image {
    let plane = img.height * img.width;
    let mut pixels = Vec::with_capacity(img.channels * w * h);
    for c in 0..img.channels {
        let channel = img.pixels[c * plane..(c + 1) * plane].to_vec();
        let buf: ImageBuffer<Luma<f32>, Vec<f32>> = ImageBuffer::from_raw(img.width as u32, img.height as u32, channel)
            .expect("an Image's pixel count matches its shape");
        let cropped = imageops::crop_imm(&buf, left as u32, top as u32, cw as u32, ch as u32).to_image();
        pixels.extend(imageops::resize(&cropped, w as u32, h as u32, FilterType::Triangle).into_raw());
    }
    Image::new(img.channels, h, w, pixels)
}

fn format_err(path: &Path, msg: String) -> Error {
    Error::Format { path: path.to_path_buf(), msg }
}

/// The paths in directory `dir`, unsorted.
pub(crate) fn list(dir: &Path) -> Result<Vec<PathBuf>> {
    let io_err = |source| Error::Io { path: dir.to_path_buf(), source };
    fs::read_dir(dir).map_err(io_err)?.map(|e| e.map(|e| e.path()).map_err(io_err)).collect()
}

/// Whether `path` is named as an image (one of [`EXTENSIONS`]) and is a file; a symbolic link
/// named so that leads nowhere is an error naming it, not an image silently left out.
pub(crate) fn is_image(path: &Path) -> Result<bool> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    if !EXTENSIONS.iter().any(|known| ext.eq_ignore_ascii_case(known)) {
        return Ok(false);
    }
    if !path.exists() && path.symlink_metadata().is_ok() {
        return Err(format_err(path, "a symbolic link to nothing".into()));
    }
    Ok(path.is_file())
}

/// The image files anywhere under `dir` (symbolic links followed, as torchvision's
/// `os.walk(followlinks=True)`), ordered as torchvision orders them: by folder path, then by
/// file name, both as bytes. A link back to a folder above is an error naming it.
fn images_under(dir: &Path) -> Result<Vec<PathBuf>> {
    fn walk(dir: &Path, above: &mut Vec<PathBuf>, found: &mut Vec<PathBuf>) -> Result<()> {
        let real = fs::canonicalize(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
        if above.contains(&real) {
            return Err(format_err(dir, "a symbolic link loop (a folder inside itself)".into()));
        }
        above.push(real);
        for path in list(dir)? {
            if path.is_dir() {
                walk(&path, above, found)?;
            } else if is_image(&path)? {
                found.push(path);
            }
        }
        above.pop();
        Ok(())
    }
    let mut found = Vec::new();
    walk(dir, &mut Vec::new(), &mut found)?;
    let key = |p: &PathBuf| {
        let bytes = |p: &Path| p.as_os_str().as_encoded_bytes().to_vec();
        (p.parent().map(bytes).unwrap_or_default(), p.file_name().map(|n| n.as_encoded_bytes().to_vec()))
    };
    found.sort_by_key(key);
    Ok(found)
}

/// `Err` with what is wrong when `bytes` are a JPEG that ends before its end-of-image marker
/// (a file cut short); `Ok` for a whole JPEG and for anything else. The markers are followed
/// by their lengths, so an embedded thumbnail's own end marker does not count, and entropy-
/// coded data is scanned to the next marker (where `0xFF` is followed by a byte other than a
/// stuffed `0x00` or a restart marker).
fn jpeg_complete(bytes: &[u8]) -> std::result::Result<(), String> {
    if !bytes.starts_with(&[0xFF, 0xD8]) {
        return Ok(());
    }
    let cut = || Err("the JPEG data ends before its end-of-image marker (the file is truncated)".to_string());
    let mut at = 2;
    loop {
        // Skip to the next marker (libjpeg passes over stray bytes between segments too).
        while at < bytes.len() && bytes[at] != 0xFF {
            at += 1;
        }
        while at < bytes.len() && bytes[at] == 0xFF {
            at += 1;
        }
        let Some(&marker) = bytes.get(at) else { return cut() };
        at += 1;
        match marker {
            0xD9 => return Ok(()),
            0x01 | 0xD0..=0xD7 => continue,
            _ => {}
        }
        let Some(len) = bytes.get(at..at + 2).map(|l| u16::from_be_bytes([l[0], l[1]]) as usize) else { return cut() };
        at += len;
        if at > bytes.len() {
            return cut();
        }
        if marker == 0xDA {
            // Entropy-coded data up to the next real marker.
            let starts_marker = |i: usize| bytes[i] == 0xFF && !matches!(bytes[i + 1], 0x00 | 0xD0..=0xD7 | 0xFF);
            while at + 1 < bytes.len() && !starts_marker(at) {
                at += 1;
            }
            if at + 1 >= bytes.len() {
                return cut();
            }
        }
    }
}

/// Helpers shared with the tests of [`crate::h5`].
#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use image::{Rgb, RgbImage};

    /// The colour of pixel (`x`, `y`) of image `n`: distinct in every channel and position.
    pub(crate) fn colour(n: u8, x: u32, y: u32) -> [u8; 3] {
        [n * 40 + x as u8, 10 * y as u8, 255 - n * 30 - x as u8]
    }

    /// Writes `root/<class>/<name>.png` images of `w` x `h` coloured by [`colour`]:
    /// class "ant" has images 0 and 1, class "bee" has image 2, plus a text file to ignore.
    pub(crate) fn make_folder(root: &Path, w: u32, h: u32) {
        for (class, name, n) in [("bee", "b.PNG", 2u8), ("ant", "a1.png", 0), ("ant", "a0.png", 1)] {
            fs::create_dir_all(root.join(class)).unwrap();
            RgbImage::from_fn(w, h, |x, y| Rgb(colour(n, x, y))).save(root.join(class).join(name)).unwrap();
        }
        fs::write(root.join("ant").join("notes.txt"), "not an image").unwrap();
    }

    #[test]
    fn lists_classes_and_files_in_sorted_order() {
        let dir = crate::scratch("list");
        make_folder(&dir, 4, 3);
        let folder = ImageFolder::open(&dir, 3).unwrap();
        assert_eq!(folder.classes(), ["ant", "bee"]);
        assert_eq!(folder.len(), 3, "notes.txt is not an image");
        let names: Vec<_> = (0..3).map(|i| folder.file(i).file_name().unwrap().to_str().unwrap()).collect();
        assert_eq!(names, ["a0.png", "a1.png", "b.PNG"]);
        let labels: Vec<_> = (0..3).map(|i| folder.get(i).unwrap().1).collect();
        assert_eq!(labels, [0, 0, 1]);
        // A class folder without images is an error naming it (torchvision's ImageFolder too).
        fs::create_dir(dir.join("cat")).unwrap();
        let err = ImageFolder::open(&dir, 3).err().unwrap().to_string();
        assert!(err.contains("cat") && err.contains("no image files (jpg, jpeg, png, ppm"), "{err}");
        fs::remove_dir(dir.join("cat")).unwrap();
        // As torchvision: images in subfolders belong to the class, ordered by folder then by
        // name, in every format torchvision's extensions name; a link to nothing is named.
        fs::create_dir(dir.join("ant").join("sub")).unwrap();
        RgbImage::from_fn(4, 3, |x, y| Rgb(colour(3, x, y))).save(dir.join("ant").join("sub").join("0.png")).unwrap();
        RgbImage::from_fn(4, 3, |x, y| Rgb(colour(4, x, y))).save(dir.join("ant").join("z.bmp")).unwrap();
        let folder = ImageFolder::open(&dir, 3).unwrap();
        let names: Vec<_> = (0..folder.len()).map(|i| folder.file(i).strip_prefix(&dir).unwrap().to_owned()).collect();
        let want = ["ant/a0.png", "ant/a1.png", "ant/z.bmp", "ant/sub/0.png", "bee/b.PNG"];
        assert_eq!(names, want.map(PathBuf::from));
        assert_eq!(folder.get(2).unwrap().0.at(0, 1, 2), f32::from(colour(4, 2, 1)[0]) / 255.0, "the BMP decodes");
        std::os::unix::fs::symlink(dir.join("nowhere.png"), dir.join("bee").join("gone.png")).unwrap();
        let err = ImageFolder::open(&dir, 3).err().unwrap().to_string();
        assert!(err.contains("gone.png: a symbolic link to nothing"), "{err}");
        fs::remove_file(dir.join("bee").join("gone.png")).unwrap();
        std::os::unix::fs::symlink(dir.join("ant"), dir.join("ant").join("sub").join("up")).unwrap();
        let err = ImageFolder::open(&dir, 3).err().unwrap().to_string();
        assert!(err.contains("symbolic link loop"), "{err}");
    }

    #[test]
    fn decodes_rgb_channel_major() {
        let dir = crate::scratch("rgb");
        make_folder(&dir, 4, 3);
        let (img, _) = ImageFolder::open(&dir, 3).unwrap().get(2).unwrap();
        assert_eq!((img.channels, img.height, img.width), (3, 3, 4));
        for (y, x, c) in [(0, 0, 0), (2, 3, 1), (1, 2, 2)] {
            assert_eq!(img.at(c, y, x), f32::from(colour(2, x as u32, y as u32)[c]) / 255.0, "c{c} y{y} x{x}");
        }
    }

    #[test]
    fn decodes_grey_with_one_channel() {
        let dir = crate::scratch("grey");
        make_folder(&dir, 4, 3);
        let (img, label) = ImageFolder::open(&dir, 1).unwrap().get(0).unwrap();
        assert_eq!((img.channels, img.height, img.width, label), (1, 3, 4, 0));
        // Pillow's ITU-R 601-2 luma (`convert("L")`), rounded to a byte.
        let [r, g, b] = colour(1, 3, 2).map(f32::from);
        let luma = (0.299 * r + 0.587 * g + 0.114 * b).round();
        assert!((img.at(0, 2, 3) * 255.0 - luma).abs() <= 0.5, "{} vs {luma}", img.at(0, 2, 3) * 255.0);
        // Pure red, green and blue as Pillow makes them grey.
        let path = dir.join("primaries.png");
        RgbImage::from_fn(3, 1, |x, _| Rgb(std::array::from_fn(|c| if c == x as usize { 255 } else { 0 })))
            .save(&path)
            .unwrap();
        let grey = decode(&path, 1).unwrap();
        assert_eq!(grey.pixels.iter().map(|v| (v * 255.0).round() as u8).collect::<Vec<_>>(), [76, 150, 29]);
    }

    #[test]
    fn a_truncated_jpeg_is_an_error_and_exif_orientation_turns_images_upright() {
        let dir = crate::scratch("truncated");
        let path = dir.join("x.jpg");
        RgbImage::from_fn(40, 48, |x, y| Rgb([(x * 6) as u8, (y * 5) as u8, 90])).save(&path).unwrap();
        let whole = fs::read(&path).unwrap();
        assert!(decode(&path, 3).is_ok());
        for cut in [whole.len() / 2, whole.len() - 2] {
            fs::write(&path, &whole[..cut]).unwrap();
            let err = decode(&path, 3).unwrap_err().to_string();
            assert!(err.contains("x.jpg") && err.contains("truncated"), "cut at {cut}: {err}");
        }
        // A 2x1 PNG whose EXIF says "rotate 90 degrees clockwise" (orientation 6).
        let exif =
            [b"MM\0*".as_slice(), &[0, 0, 0, 8, 0, 1, 0x01, 0x12, 0, 3, 0, 0, 0, 1, 0, 6, 0, 0, 0, 0, 0, 0]].concat();
        let png = dir.join("turned.png");
        let mut bytes = Vec::new();
        let mut encoder = image::codecs::png::PngEncoder::new(&mut bytes);
        image::ImageEncoder::set_exif_metadata(&mut encoder, exif).unwrap();
        image::ImageEncoder::write_image(encoder, &[255, 0, 0, 0, 0, 255], 2, 1, image::ExtendedColorType::Rgb8)
            .unwrap();
        fs::write(&png, bytes).unwrap();
        let as_stored = decode(&png, 3).unwrap();
        assert_eq!((as_stored.height, as_stored.width), (1, 2));
        let upright = decode_oriented(&png, 3, true).unwrap();
        assert_eq!((upright.height, upright.width), (2, 1));
        assert_eq!((upright.at(0, 0, 0), upright.at(2, 1, 0)), (1.0, 1.0), "red on top, blue below");
    }

    #[test]
    fn decodes_jpeg_whatever_the_case_of_its_extension() {
        let dir = crate::scratch("jpeg");
        fs::create_dir(dir.join("cat")).unwrap();
        RgbImage::from_pixel(8, 8, Rgb([200, 100, 50])).save(dir.join("cat").join("x.JPG")).unwrap();
        let (img, _) = ImageFolder::open(&dir, 3).unwrap().get(0).unwrap();
        assert_eq!((img.channels, img.height, img.width), (3, 8, 8));
        // JPEG is lossy, but a flat colour survives to within a few levels.
        for (c, want) in [200.0, 100.0, 50.0].into_iter().enumerate() {
            assert!((img.at(c, 4, 4) * 255.0 - want).abs() <= 3.0, "channel {c}: {}", img.at(c, 4, 4) * 255.0);
        }
    }

    #[test]
    fn a_corrupt_file_names_the_file() {
        let dir = crate::scratch("corrupt");
        make_folder(&dir, 4, 3);
        let bad = dir.join("bee").join("c.png");
        fs::write(&bad, b"\x89PNG garbage, not an image").unwrap();
        let folder = ImageFolder::open(&dir, 3).unwrap();
        assert_eq!(folder.file(3), bad);
        let err = folder.get(3).unwrap_err();
        assert!(matches!(&err, Error::Format { path, .. } if *path == bad), "{err}");
    }

    #[test]
    fn bad_folders_are_errors_naming_the_path() {
        let dir = crate::scratch("bad");
        let missing = dir.join("missing");
        let err = ImageFolder::open(&missing, 3).unwrap_err();
        assert!(matches!(&err, Error::Io { path, .. } if *path == missing), "{err}");

        fs::write(dir.join("loose.png"), b"").unwrap();
        let err = ImageFolder::open(&dir, 3).unwrap_err();
        assert!(err.to_string().contains("no class folders") && err.to_string().contains("bad"), "{err}");

        fs::create_dir(dir.join("empty")).unwrap();
        let err = ImageFolder::open(&dir, 3).unwrap_err();
        assert!(err.to_string().contains("no image files"), "{err}");

        make_folder(&dir, 2, 2);
        let err = ImageFolder::open(&dir, 3).unwrap_err();
        assert!(err.to_string().contains("empty: no image files"), "an empty class folder beside full ones: {err}");
        fs::remove_dir(dir.join("empty")).unwrap();
        assert!(ImageFolder::open(&dir, 3).is_ok());
        let err = ImageFolder::open(&dir, 4).unwrap_err();
        assert!(err.to_string().contains("channels must be 1 or 3"), "{err}");
    }

    #[test]
    fn resize_square_crops_the_centre() {
        // 2 channels, 2 x 6: the centre 2 x 2 square is columns 2 and 3.
        let pixels: Vec<f32> = (0..24).map(|v| v as f32 / 24.0).collect();
        let img = Image::new(2, 2, 6, pixels);
        let out = resize_square(&img, 2);
        assert_eq!((out.channels, out.height, out.width), (2, 2, 2));
        for (c, y, x) in [(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 1, 0)] {
            assert_eq!(out.at(c, y, x), img.at(c, y, x + 2), "c{c} y{y} x{x}");
        }
    }

    #[test]
    fn resize_square_averages_when_shrinking() {
        // A 4 x 4 checkerboard shrunk to 2 x 2 is a flat grey, not a sample of it.
        let pixels: Vec<f32> = (0..16).map(|i| ((i / 4 + i % 4) % 2) as f32).collect();
        let out = resize_square(&Image::new(1, 4, 4, pixels), 2);
        for &v in &out.pixels {
            assert!((v - 0.5).abs() < 0.1, "{:?}", out.pixels);
        }
    }

    #[test]
    fn resize_square_keeps_a_flat_image_flat() {
        let out = resize_square(&Image::new(3, 5, 7, vec![0.25; 105]), 11);
        assert_eq!(out.pixels.len(), 3 * 11 * 11);
        assert!(out.pixels.iter().all(|&v| (v - 0.25).abs() < 1e-5), "{:?}", out.pixels);
    }
}
