//! Where the project's libtorch lives, for build scripts, and the link arguments that let every
//! binary and test binary find it at run time without `LD_LIBRARY_PATH`.
//!
//! `LIBTORCH` (written into `.cargo/config.toml` by `scripts/setup.sh`) is the `torch` package
//! directory of the torch wheel: headers under `include/`, libraries under `lib/`; the CUDA
//! runtime comes from the wheel's `nvidia` siblings. Link arguments of a build script reach only
//! its own package's binaries, so each crate that links libtorch calls
//! [`Libtorch::link_binaries`] from its `build.rs`; the engine also uses the paths to compile
//! its C++ bridge.
use std::env;
use std::path::{Path, PathBuf};

/// The torch package of the project's Python environment.
pub struct Libtorch {
    dir: PathBuf,
}

impl Libtorch {
    /// From `LIBTORCH`; the build script reruns when it changes. Panics (a build script's way
    /// to fail) with the fix when it is unset.
    pub fn from_env() -> Libtorch {
        println!("cargo:rerun-if-env-changed=LIBTORCH");
        let dir = env::var("LIBTORCH").unwrap_or_else(|_| {
            panic!("LIBTORCH is not set: run scripts/setup.sh, which writes it into .cargo/config.toml")
        });
        Libtorch { dir: PathBuf::from(dir) }
    }

    /// The `torch` package directory (headers under `include/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// libtorch's shared libraries.
    pub fn lib_dir(&self) -> PathBuf {
        self.dir.join("lib")
    }

    /// The wheel's `nvidia` directory beside `torch` (the CUDA 13 build's pip packages).
    pub fn nvidia_dir(&self) -> PathBuf {
        self.dir.parent().expect("LIBTORCH has a parent directory").join("nvidia")
    }

    /// The CUDA 13 runtime's libraries (`libcudart.so.13`).
    pub fn cuda_lib_dir(&self) -> PathBuf {
        self.nvidia_dir().join("cu13").join("lib")
    }

    /// Gives every binary, test and bench of the calling package the link arguments below (a
    /// build script's link arguments reach only its own package).
    pub fn link_binaries(&self) {
        for arg in self.link_args() {
            println!("cargo:rustc-link-arg={arg}");
        }
    }

    /// An rpath to libtorch's and the CUDA runtime's libraries, so that nobody sets
    /// `LD_LIBRARY_PATH`, and libtorch_cuda kept as a dependency even where nothing references
    /// it directly: without it, CUDA silently reports unavailable.
    fn link_args(&self) -> Vec<String> {
        let rpath = [self.lib_dir(), self.cuda_lib_dir()].map(|d| d.display().to_string()).join(":");
        vec![
            format!("-Wl,-rpath,{rpath}"),
            "-Wl,--no-as-needed".into(),
            "-ltorch_cuda".into(),
            "-Wl,--as-needed".into(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_args_carry_both_library_directories_and_keep_torch_cuda() {
        let libtorch = Libtorch { dir: PathBuf::from("/venv/site-packages/torch") };
        assert_eq!(
            libtorch.link_args(),
            [
                "-Wl,-rpath,/venv/site-packages/torch/lib:/venv/site-packages/nvidia/cu13/lib",
                "-Wl,--no-as-needed",
                "-ltorch_cuda",
                "-Wl,--as-needed",
            ]
        );
    }
}
