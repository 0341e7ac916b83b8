//! Labelled images of one size in an HDF5 file, read one row at a time, and the converter
//! that writes such a file from an [`ImageFolder`].
//!
//! # Schema (`suite-images-v1`)
//!
//! | name      | kind             | type                                       | shape          |
//! |-----------|------------------|--------------------------------------------|----------------|
//! | `format`  | attribute of `/` | variable-length string `"suite-images-v1"` | scalar         |
//! | `images`  | dataset          | uint8                                      | `[N, H, W, C]` |
//! | `labels`  | dataset          | int64                                      | `[N]`          |
//! | `classes` | dataset          | variable-length UTF-8 string               | `[K]`          |
//!
//! `C` is 1 (grey) or 3 (RGB); pixels are bytes, row-major with the channels interleaved (the
//! layout of h5py / numpy image arrays). Every label is in `0..K` and names `classes[label]`.
//! From Python: `f = h5py.File(p, "w"); f.attrs["format"] = "suite-images-v1";
//! f["images"] = uint8_nhwc; f["labels"] = labels.astype("int64");
//! f["classes"] = np.array(names, dtype=h5py.string_dtype())`.
use crate::folder::{resize_square, ImageFolder};
use crate::images::{Dataset, Image};
use crate::{Error, Result};
use hdf5::types::{IntSize, TypeDescriptor, VarLenUnicode};
use ndarray::{ArrayView4, Ix3};
use rayon::prelude::*;
use std::fs;
use std::path::{Path, PathBuf};

// Published as hdf5-metno, the maintained fork of the hdf5 crate.
use hdf5_metno as hdf5;

/// The value of the root attribute `format`.
pub const FORMAT: &str = "suite-images-v1";

/// Images written, and decoded by the converter, per batch: the bound on what is in memory.
const BATCH: usize = 64;

/// An HDF5 file in the [schema](self) above. The labels and class names are read when it is
/// opened; each image is read from disk by [`Dataset::get`], one row, so memory does not grow
/// with the file.
///
/// hdf5-metno serialises every library call behind one process-wide lock, so decode workers
/// reading rows through it would take turns. When `images` is stored contiguously and
/// unfiltered (what [`write_hdf5`] and h5py's `f["images"] = array` write), its rows are plain
/// bytes at a fixed file offset, and [`Dataset::get`] reads them with positioned reads on its
/// own file handle, which any number of workers do at once. Chunked or compressed datasets are
/// read through the library, one row at a time under its lock.
#[derive(Debug)]
pub struct Hdf5Images {
    path: PathBuf,
    rows: Rows,
    labels: Vec<i64>,
    classes: Vec<String>,
    /// `[channels, height, width]` of every image.
    shape: [usize; 3],
}

impl Hdf5Images {
    /// Opens `path` and checks it against the schema; each violation is an [`Error::Format`]
    /// naming the file and the dataset or attribute.
    pub fn open(path: &Path) -> Result<Hdf5Images> {
        fs::metadata(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let err = |msg: String| Error::Format { path: path.to_path_buf(), msg };
        let file = hdf5::File::open(path).map_err(|e| err(format!("not an HDF5 file: {e}")))?;

        let format = file.attr("format").map_err(|_| err("attribute `format` is missing".into()))?;
        let format = format
            .read_scalar::<VarLenUnicode>()
            .map_err(|e| err(format!("attribute `format` is not a string: {e}")))?;
        if format.as_str() != FORMAT {
            return Err(err(format!("attribute `format` is {:?}, expected {FORMAT:?}", format.as_str())));
        }

        let images = dataset(&file, path, "images", 4, TypeDescriptor::Unsigned(IntSize::U1), "uint8")?;
        let &[n, height, width, channels] = &images.shape()[..] else { unreachable!("rank checked") };
        if channels != 1 && channels != 3 {
            return Err(err(format!("dataset `images` has {channels} channels, expected 1 or 3")));
        }
        if height == 0 || width == 0 {
            return Err(err(format!("dataset `images` holds empty {height} x {width} images")));
        }

        let classes =
            dataset(&file, path, "classes", 1, TypeDescriptor::VarLenUnicode, "variable-length UTF-8 string")?;
        let classes: Vec<String> = classes
            .read_raw::<VarLenUnicode>()
            .map_err(|e| err(format!("dataset `classes`: {e}")))?
            .iter()
            .map(|s| s.as_str().to_string())
            .collect();
        let mut seen = std::collections::HashSet::new();
        if let Some(twice) = classes.iter().find(|c| !seen.insert(c.as_str())) {
            return Err(err(format!("dataset `classes`: {twice:?} appears twice (two labels would name one class)")));
        }

        let labels = dataset(&file, path, "labels", 1, TypeDescriptor::Integer(IntSize::U8), "int64")?;
        let labels = labels.read_raw::<i64>().map_err(|e| err(format!("dataset `labels`: {e}")))?;
        if labels.len() != n {
            return Err(err(format!("dataset `labels` has {} labels for {n} images", labels.len())));
        }
        if let Some((i, label)) = labels.iter().enumerate().find(|(_, &l)| l < 0 || l as usize >= classes.len()) {
            return Err(err(format!("dataset `labels`: label {label} of image {i} is not in 0..{}", classes.len())));
        }
        let rows = Rows::new(images, path, n, height * width * channels)?;
        Ok(Hdf5Images { path: path.to_path_buf(), rows, labels, classes, shape: [channels, height, width] })
    }

    /// Whether rows are read without the HDF5 library (and its lock): see [`Hdf5Images`].
    pub fn reads_directly(&self) -> bool {
        matches!(self.rows, Rows::Direct { .. })
    }

    /// Reads rows through the HDF5 library even where direct reads are possible: the
    /// baseline of the loader benchmark and of the test that both ways agree.
    pub fn read_through_library(mut self) -> Result<Hdf5Images> {
        if let Rows::Direct { .. } = self.rows {
            let file = hdf5::File::open(&self.path)
                .map_err(|e| Error::Format { path: self.path.clone(), msg: format!("not an HDF5 file: {e}") })?;
            let images = file
                .dataset("images")
                .map_err(|_| Error::Format { path: self.path.clone(), msg: "dataset `images` is missing".into() })?;
            self.rows = Rows::Library(images);
        }
        Ok(self)
    }

    /// The file this data set was opened from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `[channels, height, width]` of every image.
    pub fn shape(&self) -> [usize; 3] {
        self.shape
    }
}

/// Dataset `name` of `file`, checked to have rank `rank` and element type `dtype`.
fn dataset(
    file: &hdf5::File,
    path: &Path,
    name: &str,
    rank: usize,
    dtype: TypeDescriptor,
    dtype_name: &str,
) -> Result<hdf5::Dataset> {
    let err = |msg: String| Error::Format { path: path.to_path_buf(), msg: format!("dataset `{name}` {msg}") };
    let ds = file.dataset(name).map_err(|_| err("is missing".into()))?;
    if ds.ndim() != rank {
        return Err(err(format!("has shape {:?}, expected rank {rank}", ds.shape())));
    }
    let found = ds.dtype().and_then(|t| t.to_descriptor()).map_err(|e| err(format!("has an unknown type: {e}")))?;
    if found != dtype {
        return Err(err(format!("has type {found}, expected {dtype_name}")));
    }
    Ok(ds)
}

impl Dataset for Hdf5Images {
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
        assert!(i < self.len(), "image {i} of {}", self.len());
        let [channels, height, width] = self.shape;
        let row = self.rows.read(i, channels * height * width).map_err(|msg| Error::Format {
            path: self.path.clone(),
            msg: format!("dataset `images`, row {i}: {msg}"),
        })?;
        // Interleaved `[H, W, C]` bytes to channel-major floats.
        let mut pixels = vec![0.0; row.len()];
        for (j, &v) in row.iter().enumerate() {
            let (pixel, c) = (j / channels, j % channels);
            pixels[c * height * width + pixel] = f32::from(v) / 255.0;
        }
        Ok((Image::new(channels, height, width, pixels), self.labels[i]))
    }
}

/// How the rows of dataset `images` are read.
#[derive(Debug)]
enum Rows {
    /// Contiguous, unfiltered storage: row `i` is the `row` bytes at `offset + i * row`.
    Direct { file: fs::File, offset: u64 },
    /// Anything else: hyperslabs through the library.
    Library(hdf5::Dataset),
}

impl Rows {
    /// Chooses direct reads for `images` (`n` rows of `row` bytes) of the file at `path` when
    /// its storage allows them, checking that the file holds every row.
    fn new(images: hdf5::Dataset, path: &Path, n: usize, row: usize) -> Result<Rows> {
        let direct = images.layout() == hdf5::dataset::Layout::Contiguous && images.filters().is_empty();
        let Some(offset) = images.offset().filter(|_| direct) else { return Ok(Rows::Library(images)) };
        let file = fs::File::open(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let len = file.metadata().map_err(|source| Error::Io { path: path.to_path_buf(), source })?.len();
        let end = offset + (n * row) as u64;
        if end > len {
            return Err(Error::Format {
                path: path.to_path_buf(),
                msg: format!("dataset `images` ends at byte {end} but the file has {len} bytes (truncated?)"),
            });
        }
        Ok(Rows::Direct { file, offset })
    }

    /// Row `i`'s `row` bytes, `[H, W, C]` interleaved.
    fn read(&self, i: usize, row: usize) -> std::result::Result<Vec<u8>, String> {
        match self {
            Rows::Direct { file, offset } => {
                use std::os::unix::fs::FileExt;
                let mut bytes = vec![0; row];
                file.read_exact_at(&mut bytes, offset + (i * row) as u64).map_err(|e| e.to_string())?;
                Ok(bytes)
            }
            Rows::Library(images) => {
                // A hyperslab of row i only.
                let slab = images.read_slice::<u8, _, Ix3>((i, .., .., ..)).map_err(|e| e.to_string())?;
                Ok(slab.iter().copied().collect())
            }
        }
    }
}

/// Writes `count` examples, each `[channels, height, width]` = `shape`, to `path` in the
/// [schema](self) above, `BATCH` rows at a time. The file is written beside `path` under a
/// temporary name and renamed over it only once complete; on any error (including one from
/// `examples`, returned as it is) the temporary file is removed and `path` is left as it was.
pub fn write_hdf5(
    path: &Path,
    shape: [usize; 3],
    classes: &[String],
    count: usize,
    examples: impl Iterator<Item = Result<(Image, i64)>>,
) -> Result<()> {
    // Every HDF5 handle is closed when write_file returns, before the sync and rename.
    crate::write_staged(path, |tmp| write_file(tmp, path, shape, classes, count, examples))
}

/// The body of [`write_hdf5`]: writes `tmp`; errors name `path`, the file being made.
fn write_file(
    tmp: &Path,
    path: &Path,
    [channels, height, width]: [usize; 3],
    classes: &[String],
    count: usize,
    examples: impl Iterator<Item = Result<(Image, i64)>>,
) -> Result<()> {
    let err = |msg: String| Error::Format { path: path.to_path_buf(), msg };
    let h5 = |what: &str| {
        let what = what.to_string();
        move |e: hdf5::Error| Error::Io {
            path: path.to_path_buf(),
            source: std::io::Error::other(format!("{what}: {e}")),
        }
    };
    if channels != 1 && channels != 3 {
        return Err(err(format!("images must have 1 or 3 channels, not {channels}")));
    }
    if height == 0 || width == 0 {
        return Err(err(format!("images must not be empty, not {height} x {width}")));
    }
    let class_names = classes
        .iter()
        .map(|c| c.parse::<VarLenUnicode>().map_err(|e| err(format!("class name {c:?}: {e}"))))
        .collect::<Result<Vec<_>>>()?;

    let file = hdf5::File::create(tmp).map_err(h5("cannot create"))?;
    let format: VarLenUnicode = FORMAT.parse().expect("no NUL in the format name");
    file.new_attr::<VarLenUnicode>()
        .create("format")
        .and_then(|a| a.write_scalar(&format))
        .map_err(h5("attribute `format`"))?;
    file.new_dataset_builder().with_data(&class_names[..]).create("classes").map_err(h5("dataset `classes`"))?;
    let images = file
        .new_dataset::<u8>()
        .shape([count, height, width, channels])
        .create("images")
        .map_err(h5("dataset `images`"))?;

    let row = height * width * channels;
    let mut labels = Vec::with_capacity(count);
    let mut batch: Vec<u8> = Vec::with_capacity(BATCH.min(count) * row);
    let mut examples = examples.fuse();
    while labels.len() < count {
        let Some(example) = examples.next() else {
            return Err(err(format!("only {} of {count} examples were given", labels.len())));
        };
        let (img, label) = example?;
        let i = labels.len();
        if [img.channels, img.height, img.width] != [channels, height, width] {
            let found = format!("{} x {} x {}", img.channels, img.height, img.width);
            return Err(err(format!("example {i} is {found}, expected {channels} x {height} x {width}")));
        }
        if label < 0 || label as usize >= classes.len() {
            return Err(err(format!("label {label} of example {i} is not in 0..{}", classes.len())));
        }
        labels.push(label);
        // Channel-major floats to interleaved bytes (`as` saturates anything outside [0, 1]).
        let plane = height * width;
        batch.extend((0..row).map(|j| (img.pixels[(j % channels) * plane + j / channels] * 255.0).round() as u8));
        if batch.len() == BATCH * row || labels.len() == count {
            let rows = batch.len() / row;
            let view = ArrayView4::from_shape((rows, height, width, channels), &batch).expect("whole rows");
            let start = labels.len() - rows;
            images.write_slice(view, (start..start + rows, .., .., ..)).map_err(h5("dataset `images`"))?;
            batch.clear();
        }
    }
    if examples.next().is_some() {
        return Err(err(format!("more than the {count} examples announced were given")));
    }
    file.new_dataset_builder().with_data(&labels[..]).create("labels").map_err(h5("dataset `labels`"))?;
    file.flush().map_err(h5("flush"))
}

/// Whether `path` is named as an HDF5 file (`.h5` or `.hdf5`, in any case): how the trainers
/// tell an HDF5 data set from an image folder.
pub fn is_hdf5_path(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("h5") || e.eq_ignore_ascii_case("hdf5"))
}

/// Converts the [`ImageFolder`] at `folder` into an HDF5 file at `out` (see [`write_hdf5`]):
/// each image decoded with `channels` channels, cropped to its centred square and resized to
/// `size` x `size` by [`resize_square`]. Images are decoded in parallel, a batch at a time, so
/// memory stays bounded. Returns the number of images; an error names the offending file.
pub fn convert_folder(folder: &Path, out: &Path, size: usize, channels: usize) -> Result<usize> {
    if size == 0 {
        return Err(Error::Format { path: out.to_path_buf(), msg: "image size must be positive".into() });
    }
    if !is_hdf5_path(out) {
        return Err(Error::Format {
            path: out.to_path_buf(),
            msg: "the output must end in .h5 or .hdf5 (the trainers tell HDF5 data by its extension)".into(),
        });
    }
    let images = ImageFolder::open(folder, channels)?;
    let n = images.len();
    let load = |i: usize| {
        let (img, label) = images.get(i)?;
        if img.height == 0 || img.width == 0 {
            return Err(Error::Format { path: images.file(i).to_path_buf(), msg: "empty image".into() });
        }
        Ok((resize_square(&img, size), label))
    };
    // `flat_map` asks for the next batch only once the writer has taken the previous one.
    let examples = (0..n).step_by(BATCH).flat_map(|start| {
        let batch: Vec<_> = (start..n.min(start + BATCH)).into_par_iter().map(load).collect();
        batch
    });
    write_hdf5(out, [channels, size, size], images.classes(), n, examples)?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::folder::tests::{colour, make_folder};

    fn assert_close(a: &Image, b: &Image) {
        assert_eq!((a.channels, a.height, a.width), (b.channels, b.height, b.width));
        for (i, (x, y)) in a.pixels.iter().zip(&b.pixels).enumerate() {
            assert!((x - y).abs() <= 1.0 / 255.0 + 1e-6, "pixel {i}: {x} vs {y}");
        }
    }

    #[test]
    fn converts_a_folder_and_reads_it_back() {
        let dir = crate::scratch("h5-convert");
        let (src, out) = (dir.join("src"), dir.join("out.h5"));
        // 6 wide, 4 high: the centred square is columns 1..5, already the size asked for.
        make_folder(&src, 6, 4);
        assert_eq!(convert_folder(&src, &out, 4, 3).unwrap(), 3);
        let h5 = Hdf5Images::open(&out).unwrap();
        assert_eq!((h5.len(), h5.channels(), h5.shape()), (3, 3, [3, 4, 4]));
        assert_eq!(h5.classes(), ["ant", "bee"]);
        // Sorted: ant/a0.png (colour 1), ant/a1.png (0), bee/b.PNG (2).
        for (i, (n, label)) in [(1u8, 0), (0, 0), (2, 1)].into_iter().enumerate() {
            let (img, l) = h5.get(i).unwrap();
            assert_eq!(l, label, "label of image {i}");
            for (c, y, x) in [(0, 0, 0), (1, 3, 2), (2, 1, 3)] {
                let want = f32::from(colour(n, x as u32 + 1, y as u32)[c]) / 255.0;
                assert_eq!(img.at(c, y, x), want, "image {i} c{c} y{y} x{x}");
            }
        }

        // Grey and resized: the same as resizing the decoded image, to within a byte.
        assert_eq!(convert_folder(&src, &out, 3, 1).unwrap(), 3);
        let (folder, h5) = (ImageFolder::open(&src, 1).unwrap(), Hdf5Images::open(&out).unwrap());
        assert_eq!(h5.shape(), [1, 3, 3]);
        for i in 0..3 {
            let ((want, want_label), (got, label)) = (folder.get(i).unwrap(), h5.get(i).unwrap());
            assert_close(&got, &resize_square(&want, 3));
            assert_eq!(label, want_label);
        }
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 2, "src and out.h5, no temporary file");
    }

    #[test]
    fn writes_more_than_one_batch() {
        let dir = crate::scratch("h5-batches");
        let path = dir.join("many.h5");
        let n = BATCH * 2 + 3;
        let example = |i: usize| (Image::new(1, 1, 2, vec![(i % 256) as f32 / 255.0, 1.0]), (i % 2) as i64);
        let classes = ["even".to_string(), "odd".to_string()];
        write_hdf5(&path, [1, 1, 2], &classes, n, (0..n).map(|i| Ok(example(i)))).unwrap();
        let h5 = Hdf5Images::open(&path).unwrap();
        assert_eq!(h5.len(), n);
        for i in [0, BATCH - 1, BATCH, 2 * BATCH + 2] {
            assert_eq!(h5.get(i).unwrap(), example(i), "example {i}");
        }
    }

    #[test]
    fn an_empty_data_set_round_trips() {
        let dir = crate::scratch("h5-zero");
        let path = dir.join("z.h5");
        write_hdf5(&path, [1, 1, 1], &["a".to_string()], 0, std::iter::empty()).unwrap();
        assert_eq!(Hdf5Images::open(&path).unwrap().len(), 0);
    }

    #[test]
    fn a_failed_conversion_leaves_no_file() {
        let dir = crate::scratch("h5-fail");
        let (src, out) = (dir.join("src"), dir.join("out.h5"));
        make_folder(&src, 4, 4);
        let bad = src.join("bee").join("c.png");
        fs::write(&bad, b"garbage").unwrap();
        let err = convert_folder(&src, &out, 4, 3).unwrap_err();
        assert!(matches!(&err, Error::Format { path, .. } if *path == bad), "{err}");
        assert!(!out.exists());
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "only src, no temporary file");

        // The writer's own checks fail the same way: a label outside the classes.
        let examples = (0..2).map(|i| Ok((Image::new(1, 1, 1, vec![0.0]), i)));
        let err = write_hdf5(&out, [1, 1, 1], &["only".to_string()], 2, examples).unwrap_err();
        assert!(err.to_string().contains("label 1 of example 1"), "{err}");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "only src, no output or temporary file");

        // An output the trainers would not read as HDF5 is refused before any work.
        fs::remove_file(&bad).unwrap();
        let err = convert_folder(&src, &dir.join("out.txt"), 4, 3).unwrap_err().to_string();
        assert!(err.contains("out.txt: the output must end in .h5 or .hdf5"), "{err}");
        assert!(is_hdf5_path(Path::new("x.H5")) && is_hdf5_path(Path::new("x.Hdf5")) && !is_hdf5_path(Path::new("h5")));
        // Two classes of one name are refused when read.
        let examples = (0..2).map(|i| Ok((Image::new(1, 1, 1, vec![0.0]), i)));
        write_hdf5(&out, [1, 1, 1], &["ant".to_string(), "ant".to_string()], 2, examples).unwrap();
        let err = Hdf5Images::open(&out).err().unwrap().to_string();
        assert!(err.contains("\"ant\" appears twice"), "{err}");
    }

    #[test]
    fn direct_reads_equal_reads_through_the_library() {
        let dir = crate::scratch("h5-direct");
        let path = dir.join("rgb.h5");
        let n = 5;
        let example = |i: usize| {
            let pixels = (0..3 * 2 * 4).map(|j| ((i * 31 + j * 7) % 256) as f32 / 255.0).collect();
            (Image::new(3, 2, 4, pixels), (i % 3) as i64)
        };
        let classes: Vec<String> = ["a", "b", "c"].map(String::from).into();
        write_hdf5(&path, [3, 2, 4], &classes, n, (0..n).map(|i| Ok(example(i)))).unwrap();
        let direct = Hdf5Images::open(&path).unwrap();
        assert!(direct.reads_directly(), "write_hdf5 stores images contiguously");
        let library = Hdf5Images::open(&path).unwrap().read_through_library().unwrap();
        assert!(!library.reads_directly());
        for i in 0..n {
            assert_eq!(direct.get(i).unwrap(), example(i), "direct read of row {i}");
            assert_eq!(library.get(i).unwrap(), example(i), "library read of row {i}");
        }
    }

    #[test]
    fn chunked_images_are_read_through_the_library() {
        let dir = crate::scratch("h5-chunked");
        let path = dir.join("chunked.h5");
        write_with(&path, Fault::None);
        let file = hdf5::File::open_rw(&path).unwrap();
        file.unlink("images").unwrap();
        let pixels = ndarray::Array4::from_shape_fn((2, 2, 2, 1), |(i, y, x, _)| (i * 4 + y * 2 + x) as u8 * 10);
        file.new_dataset_builder().chunk([1, 2, 2, 1]).with_data(&pixels).create("images").unwrap();
        drop(file);
        let h5 = Hdf5Images::open(&path).unwrap();
        assert!(!h5.reads_directly(), "chunked storage has no single offset");
        let (img, label) = h5.get(1).unwrap();
        assert_eq!((img.pixels, label), ([40, 50, 60, 70].map(|v| v as f32 / 255.0).to_vec(), 1));
    }

    #[test]
    fn a_truncated_file_is_an_error_naming_it() {
        let dir = crate::scratch("h5-truncated");
        let path = dir.join("cut.h5");
        let example = |i: usize| Ok((Image::new(1, 16, 16, vec![i as f32 / 255.0; 256]), 0));
        write_hdf5(&path, [1, 16, 16], &["a".to_string()], 8, (0..8).map(example)).unwrap();
        let len = fs::metadata(&path).unwrap().len();
        fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 300).unwrap();
        let err = Hdf5Images::open(&path).unwrap_err();
        assert!(err.to_string().contains("cut.h5"), "{err}");
    }

    /// Ways to break an otherwise valid file.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Fault {
        None,
        NoLabels,
        FloatImages,
        LabelOutOfRange,
        NoFormat,
        WrongFormat,
        ImagesRank3,
        FewerLabels,
    }

    /// Writes a file of 2 grey 2 x 2 images with `fault`, the way another tool might.
    fn write_with(path: &Path, fault: Fault) {
        let file = hdf5::File::create(path).unwrap();
        if fault != Fault::NoFormat {
            let format = if fault == Fault::WrongFormat { "suite-images-v0" } else { FORMAT };
            let attr = file.new_attr::<VarLenUnicode>().create("format").unwrap();
            attr.write_scalar(&format.parse::<VarLenUnicode>().unwrap()).unwrap();
        }
        match fault {
            Fault::FloatImages => file.new_dataset::<f32>().shape([2, 2, 2, 1]).create("images").map(drop).unwrap(),
            Fault::ImagesRank3 => file.new_dataset::<u8>().shape([2, 2, 2]).create("images").map(drop).unwrap(),
            _ => file.new_dataset::<u8>().shape([2, 2, 2, 1]).create("images").map(drop).unwrap(),
        }
        let labels: &[i64] = match fault {
            Fault::LabelOutOfRange => &[0, 2],
            Fault::FewerLabels => &[0],
            _ => &[0, 1],
        };
        if fault != Fault::NoLabels {
            file.new_dataset_builder().with_data(labels).create("labels").unwrap();
        }
        let classes: Vec<VarLenUnicode> = ["a", "b"].iter().map(|c| c.parse().unwrap()).collect();
        file.new_dataset_builder().with_data(&classes[..]).create("classes").unwrap();
    }

    #[test]
    fn schema_violations_name_the_file_and_the_dataset() {
        let dir = crate::scratch("h5-schema");
        let path = dir.join("x.h5");
        write_with(&path, Fault::None);
        assert_eq!(Hdf5Images::open(&path).unwrap().len(), 2, "the unbroken file is valid");
        for (fault, expected) in [
            (Fault::NoLabels, "dataset `labels` is missing"),
            (Fault::FloatImages, "dataset `images` has type float32, expected uint8"),
            (Fault::LabelOutOfRange, "dataset `labels`: label 2 of image 1 is not in 0..2"),
            (Fault::NoFormat, "attribute `format` is missing"),
            (Fault::WrongFormat, "attribute `format` is \"suite-images-v0\""),
            (Fault::ImagesRank3, "dataset `images` has shape [2, 2, 2], expected rank 4"),
            (Fault::FewerLabels, "dataset `labels` has 1 labels for 2 images"),
        ] {
            write_with(&path, fault);
            match Hdf5Images::open(&path) {
                Err(Error::Format { path: p, msg }) => {
                    assert_eq!(p, path, "{fault:?}");
                    assert!(msg.contains(expected), "{fault:?}: {msg}");
                }
                other => panic!("{fault:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_missing_or_foreign_file_is_an_error() {
        let dir = crate::scratch("h5-foreign");
        let path = dir.join("x.h5");
        assert!(matches!(Hdf5Images::open(&path), Err(Error::Io { path: p, .. }) if p == path));
        fs::write(&path, b"not hdf5").unwrap();
        let err = Hdf5Images::open(&path).unwrap_err();
        assert!(err.to_string().contains("not an HDF5 file") && err.to_string().contains("x.h5"), "{err}");
    }
}
