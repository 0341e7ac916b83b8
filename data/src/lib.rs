//! Datasets, file formats and loaders shared by the apps. Every file the suite writes goes
//! through [`write_atomic`], so a crash or an error never leaves a half-written file behind.
#![warn(missing_docs)]

pub mod a3m;
pub mod augment;
pub mod captions;
pub mod checkpoint;
pub mod checkpoint_folders;
pub mod digits;
pub mod fasta;
pub mod folder;
pub mod h5;
pub mod images;
pub mod loader;
pub mod npz;
pub mod sampler;
pub mod temporaries;

pub use captions::CaptionedImages;
pub use folder::ImageFolder;
pub use h5::Hdf5Images;
pub use images::{Dataset, Image, InMemory, Subset};
pub use sampler::DistributedSampler;

use std::fs::{self, File};
use std::io::BufWriter;
use std::path::{Path, PathBuf};

/// Errors of the data crate; each names the file involved.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file's contents are not what they should be.
    #[error("{path}: {msg}")]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key or field.
        msg: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: std::io::Error,
    },
}

/// The data crate's result type.
pub type Result<T> = std::result::Result<T, Error>;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

/// Makes the entries of directory `dir` (files created, renamed or removed in it) durable: a
/// rename is on disk only once its directory is synced, so a crash right after it cannot bring
/// the old name back.
pub fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))
}

/// Writes `path` through `write`, which is handed a temporary path beside it to write (for
/// libraries that write only by path: tch, HDF5). The temporary file is synced, renamed over
/// `path` only once `write` succeeds, and made durable with its directory; on any error it is
/// removed and `path` is left as it was.
pub fn write_staged<E: From<Error>>(
    path: &Path,
    write: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| Error::Io { path: path.to_path_buf(), source: std::io::Error::other("not a file path") })?;
    let tmp = dir.join(format!(".{}.tmp-{}", name.to_string_lossy(), std::process::id()));
    let _live = temporaries::Temporary::new(&tmp);
    let result = (|| {
        // Made here first, so that a place that cannot be written is named by `path` (the
        // libraries name the temporary file, tch in a debug dump).
        File::create(&tmp).map_err(io_err(path))?;
        write(&tmp)?;
        File::open(&tmp).and_then(|f| f.sync_all()).map_err(io_err(&tmp))?;
        fs::rename(&tmp, path).map_err(io_err(path))?;
        Ok(sync_dir(dir)?)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Writes `path` through `write` on a buffered writer, as [`write_staged`] does: `path` is
/// either left as it was or replaced whole.
pub fn write_atomic<E: From<Error>>(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    write_staged(path, |tmp| {
        let mut out = BufWriter::new(File::create(tmp).map_err(io_err(tmp))?);
        write(&mut out)?;
        out.into_inner().map_err(|e| io_err(tmp)(e.into_error()))?;
        Ok(())
    })
}

/// A scratch folder for the crate's unit test `name`.
#[cfg(test)]
pub(crate) fn scratch(name: &str) -> suite_tests::Scratch {
    suite_tests::scratch("data-test", name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn writes_the_whole_file() {
        let dir = scratch("whole");
        let path = dir.join("out.txt");
        write_atomic::<Error>(&path, |w| w.write_all(b"hello").map_err(io_err(&path))).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"hello");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "no temporary file left");
    }

    #[test]
    fn a_failed_write_leaves_the_old_file_and_no_temporary() {
        let dir = scratch("failed");
        let path = dir.join("out.txt");
        fs::write(&path, b"old").unwrap();
        let err = write_atomic::<Error>(&path, |w| {
            w.write_all(b"partial").unwrap();
            Err(Error::Io { path: path.clone(), source: std::io::Error::other("disk on fire") })
        })
        .unwrap_err();
        assert!(err.to_string().contains("disk on fire"));
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1, "no temporary file left");
    }

    #[test]
    fn a_missing_directory_names_the_file() {
        let path = Path::new("/nonexistent-dir-for-test/out.bin");
        let err = write_atomic::<Error>(path, |_| Ok(())).unwrap_err();
        assert_eq!(err.to_string(), "/nonexistent-dir-for-test/out.bin: No such file or directory (os error 2)");
    }
}
