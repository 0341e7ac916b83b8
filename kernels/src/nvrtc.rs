//! NVRTC, CUDA's run-time compiler, found without a CUDA toolkit: the library is loaded from the
//! file or folder [`NVRTC_ENV`] names, else from the torch wheel's `nvidia/cu13/lib` (the pip
//! package `nvidia-cuda-nvrtc`, a dependency of torch, whose folder the build script records),
//! else by the system loader (`LD_LIBRARY_PATH`, `ld.so.cache`), in that order.
//!
//! cudarc opens NVRTC by name (`libnvrtc.so`, then versioned names such as `libnvrtc.so.13`);
//! loading it here first, by full path and with `RTLD_GLOBAL`, makes the versioned name resolve
//! to this copy. (A CUDA toolkit's unversioned `libnvrtc.so` on the loader's path would be
//! taken first; its PTX runs too, as the driver compiles any older PTX.) NVRTC itself opens
//! `libnvrtc-builtins.so.*` by name at compile time, so that library is loaded from the same
//! folder first.
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use crate::{Error, Result};

/// A path to `libnvrtc.so.*`, or the folder holding it, tried when the torch wheel's copy is
/// missing.
pub const NVRTC_ENV: &str = "SUITE_NVRTC";

/// The soname the torch wheel's CUDA 13 build ships.
const SONAME: &str = "libnvrtc.so.13";

/// The loaded library: where it came from and its version.
#[derive(Clone, Debug)]
pub struct Nvrtc {
    /// The path or name it was loaded by.
    pub origin: String,
    /// `(major, minor)`.
    pub version: (i32, i32),
    /// The virtual architectures it compiles for (`90` for `compute_90`), ascending.
    pub archs: Vec<u32>,
}

/// One place to look.
#[derive(Clone, Debug)]
pub(crate) enum Candidate {
    /// A full path to the library (skipped when absent).
    File(PathBuf),
    /// A name for the system loader.
    Name(String),
}

/// NVRTC, loaded on first use; the error (naming every place tried) is kept and returned to
/// every caller.
pub fn nvrtc() -> Result<&'static Nvrtc> {
    static LOADED: OnceLock<std::result::Result<Nvrtc, String>> = OnceLock::new();
    LOADED.get_or_init(|| candidates().and_then(|c| load_first(&c))).as_ref().map_err(|e| Error::Nvrtc(e.clone()))
}

/// The places to look, in order.
fn candidates() -> std::result::Result<Vec<Candidate>, String> {
    // The variable first: it is how a user (or gpu-check) overrides the build's copy.
    let mut out = vec![];
    if let Some(v) = std::env::var_os(NVRTC_ENV) {
        let p = PathBuf::from(&v);
        let file = if p.is_dir() { p.join(SONAME) } else { p };
        if !file.is_file() {
            return Err(format!("{NVRTC_ENV}={} names no file (expected {SONAME} or its folder)", file.display()));
        }
        out.push(Candidate::File(file));
    }
    out.push(Candidate::File(Path::new(env!("KERNELS_NVRTC_DIR")).join(SONAME)));
    out.extend([SONAME, "libnvrtc.so"].map(|n| Candidate::Name(n.to_string())));
    Ok(out)
}

/// Loads the first candidate that opens; the error lists what was tried and why each failed.
pub(crate) fn load_first(candidates: &[Candidate]) -> std::result::Result<Nvrtc, String> {
    let mut tried = Vec::new();
    for c in candidates {
        let (origin, outcome) = match c {
            Candidate::File(path) if !path.is_file() => {
                tried.push(format!("{} (absent)", path.display()));
                continue;
            }
            Candidate::File(path) => {
                // The builtins first: NVRTC opens them by name at each compilation.
                if let Some(builtins) = builtins_beside(path) {
                    let _ = dlopen(&builtins.display().to_string());
                }
                (path.display().to_string(), dlopen(&path.display().to_string()))
            }
            Candidate::Name(name) => (name.clone(), dlopen(name)),
        };
        match outcome {
            Ok(()) => return describe(origin),
            Err(e) => tried.push(format!("{origin} ({e})")),
        }
    }
    Err(format!(
        "tried {}. It comes with torch's CUDA build (pip package nvidia-cuda-nvrtc, installed by \
         scripts/setup.sh); set {NVRTC_ENV} to the file or its folder if it lives elsewhere",
        tried.join(", ")
    ))
}

/// `libnvrtc-builtins.so.<major>.<minor>` in the library's folder.
fn builtins_beside(lib: &Path) -> Option<PathBuf> {
    let dir = lib.parent()?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("libnvrtc-builtins.so.")))
        .collect();
    found.sort();
    found.into_iter().next()
}

/// Opens a library for good (never closed), its symbols visible to later lookups by soname.
fn dlopen(name: &str) -> std::result::Result<(), String> {
    let c = CString::new(name).map_err(|_| "a NUL in the name".to_string())?;
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        let err = unsafe { libc::dlerror() };
        return Err(if err.is_null() {
            "dlopen failed".into()
        } else {
            unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned()
        });
    }
    Ok(())
}

/// Asks the loaded library (through cudarc, which now finds it) for its version and targets.
fn describe(origin: String) -> std::result::Result<Nvrtc, String> {
    use cudarc::nvrtc::sys;
    // SAFETY: cudarc resolves the symbols in the library loaded above; the out-pointers are valid.
    unsafe {
        if !sys::is_culib_present() {
            return Err(format!("{origin} was loaded but cudarc cannot open it by name"));
        }
        let (mut major, mut minor) = (0, 0);
        sys::nvrtcVersion(&mut major, &mut minor).result().map_err(|e| format!("nvrtcVersion: {e:?}"))?;
        let mut n = 0;
        sys::nvrtcGetNumSupportedArchs(&mut n).result().map_err(|e| format!("nvrtcGetNumSupportedArchs: {e:?}"))?;
        let mut archs = vec![0; n.max(0) as usize];
        sys::nvrtcGetSupportedArchs(archs.as_mut_ptr())
            .result()
            .map_err(|e| format!("nvrtcGetSupportedArchs: {e:?}"))?;
        let mut archs: Vec<u32> = archs.into_iter().map(|a| a as u32).collect();
        archs.sort_unstable();
        Ok(Nvrtc { origin, version: (major, minor), archs })
    }
}

impl Nvrtc {
    /// The virtual architecture to compile for a device of compute capability `arch` (`90`):
    /// the newest NVRTC knows that is not newer than the device (PTX runs on later devices,
    /// compiled by the driver).
    pub fn target_for(&self, arch: u32) -> Result<u32> {
        self.archs.iter().rev().copied().find(|&a| a <= arch).ok_or_else(|| {
            Error::invalid(format!(
                "NVRTC {}.{} compiles for compute capabilities {:?}; this device is {}.{}",
                self.version.0,
                self.version.1,
                self.archs,
                arch / 10,
                arch % 10
            ))
        })
    }

    /// `major.minor`.
    pub fn version_string(&self) -> String {
        format!("{}.{}", self.version.0, self.version.1)
    }

    /// Compiles `source` to PTX for `compute_<arch>` with extra NVRTC `options`.
    pub fn compile(&self, kernel: &'static str, source: &str, arch: u32, options: &[&str]) -> Result<String> {
        use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions};
        let arch_name = format!("compute_{arch}");
        let mut opts = vec![format!("--gpu-architecture={arch_name}"), "--std=c++17".to_string()];
        opts.extend(options.iter().map(|o| o.to_string()));
        let compiled = compile_ptx_with_opts(
            source,
            CompileOptions { options: opts, name: Some(format!("{kernel}.cu")), ..Default::default() },
        );
        match compiled {
            Ok(ptx) => Ok(ptx.to_src()),
            Err(e) => {
                let log = match &e {
                    CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                    other => format!("{other:?}"),
                };
                Err(Error::Compile { kernel, arch: arch_name, version: self.version_string(), log })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_names_every_place_tried_and_the_fix() {
        let err = load_first(&[
            Candidate::File("/nonexistent/libnvrtc.so.13".into()),
            Candidate::Name("libnvrtc-that-does-not-exist.so.99".into()),
        ])
        .unwrap_err();
        assert!(err.contains("/nonexistent/libnvrtc.so.13 (absent)"), "{err}");
        assert!(err.contains("libnvrtc-that-does-not-exist.so.99 ("), "{err}");
        assert!(err.contains(NVRTC_ENV) && err.contains("nvidia-cuda-nvrtc"), "{err}");
    }

    #[test]
    fn the_environment_variable_names_a_file_or_its_folder() {
        // The only test that touches this variable.
        let wheel = Path::new(env!("KERNELS_NVRTC_DIR"));
        unsafe { std::env::set_var(NVRTC_ENV, wheel) };
        let found = candidates().unwrap();
        assert!(
            matches!(&found[0], Candidate::File(f) if f == &wheel.join(SONAME)),
            "the variable comes first: {found:?}"
        );
        unsafe { std::env::set_var(NVRTC_ENV, "/nonexistent/libnvrtc.so.13") };
        let err = candidates().unwrap_err();
        unsafe { std::env::remove_var(NVRTC_ENV) };
        assert!(err.contains("SUITE_NVRTC=/nonexistent/libnvrtc.so.13 names no file"), "{err}");
    }

    #[test]
    fn the_target_is_the_newest_arch_not_past_the_device() {
        let n = Nvrtc { origin: String::new(), version: (13, 0), archs: vec![75, 80, 86, 89, 90, 100] };
        assert_eq!(n.target_for(90).unwrap(), 90);
        assert_eq!(n.target_for(87).unwrap(), 86);
        assert_eq!(n.target_for(120).unwrap(), 100);
        let err = n.target_for(70).unwrap_err().to_string();
        assert!(err.contains("7.0"), "{err}");
    }
}
