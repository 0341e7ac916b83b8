//! A kernel: CUDA C source, compiled by NVRTC for a device's architecture (cached on disk),
//! and the arguments a launch passes it; [`crate::launch`] runs it on a device or on the CPU
//! emulator.
use std::ffi::c_void;

use tch::Tensor;

use crate::nvrtc::nvrtc;
use crate::{cache, Result};

/// Scalar types without the toolkit's headers, conversions and block reductions: prepended to
/// every kernel source.
const PRELUDE: &str = include_str!("cuda/prelude.cuh");

/// A CUDA C source and the `extern "C"` kernels it defines.
#[derive(Debug)]
pub struct Kernel {
    /// The source's name (cache files and messages).
    pub name: &'static str,
    body: &'static str,
    /// The `extern "C"` functions, checked to exist in the compiled module.
    pub functions: &'static [&'static str],
    /// Extra NVRTC options.
    options: &'static [&'static str],
    /// The least compute capability it runs on (`80` for 8.0): a device below is refused by
    /// name before anything compiles.
    pub min_arch: u32,
}

impl Kernel {
    pub(crate) const fn new(
        name: &'static str,
        body: &'static str,
        functions: &'static [&'static str],
        options: &'static [&'static str],
    ) -> Kernel {
        Kernel { name, body, functions, options, min_arch: 0 }
    }

    /// The kernel, refused on devices of compute capability below `arch` (`80` for 8.0).
    pub(crate) const fn needs_arch(self, arch: u32) -> Kernel {
        Kernel { min_arch: arch, ..self }
    }

    /// The full source NVRTC compiles.
    pub fn source(&self) -> String {
        format!("{PRELUDE}\n{}", self.body)
    }

    /// PTX for `compute_<arch>`: from the disk cache, else compiled and cached.
    pub fn ptx(&self, arch: u32) -> Result<String> {
        let nvrtc = nvrtc()?;
        let source = self.source();
        let version = nvrtc.version_string();
        let options = self.options.join(" ");
        let hash = cache::fnv1a(&[source.as_bytes(), options.as_bytes(), version.as_bytes()]);
        if let Some(ptx) = cache::read(self.name, hash, arch) {
            return Ok(ptx);
        }
        let ptx = nvrtc.compile(self.name, &source, arch, self.options)?;
        cache::write(self.name, hash, arch, &ptx);
        Ok(ptx)
    }
}

/// A kernel's arguments in order, each in an 8-byte slot (the driver reads each parameter's
/// size from the kernel's signature; slots hold the value in their low bytes).
#[derive(Debug, Default)]
pub(crate) struct Args(Vec<u64>);

impl Args {
    /// A tensor's data pointer (its own memory: callers check device, dtype and layout).
    pub(crate) fn tensor(mut self, t: &Tensor) -> Args {
        self.0.push(t.data_ptr() as u64);
        self
    }

    /// An optional tensor: a null pointer when absent.
    pub(crate) fn opt(self, t: Option<&Tensor>) -> Args {
        match t {
            Some(t) => self.tensor(t),
            None => self.u64(0),
        }
    }

    /// A 32-bit integer.
    pub(crate) fn i32(mut self, v: i32) -> Args {
        self.0.push(v as u32 as u64);
        self
    }

    /// A 64-bit integer.
    pub(crate) fn i64(self, v: i64) -> Args {
        self.u64(v as u64)
    }

    fn u64(mut self, v: u64) -> Args {
        self.0.push(v);
        self
    }

    /// A 32-bit float.
    pub(crate) fn f32(mut self, v: f32) -> Args {
        self.0.push(v.to_bits() as u64);
        self
    }

    /// `self`'s arguments followed by `more`'s.
    #[cfg(test)]
    pub(crate) fn append(mut self, more: Args) -> Args {
        self.0.extend(more.0);
        self
    }

    /// A pointer to each slot, as a launch takes them.
    pub(crate) fn slots(&mut self) -> Vec<*mut c_void> {
        self.0.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_sit_in_the_low_bytes_of_their_slots() {
        let args = Args::default().i32(-2).f32(1.5).i64(-3).opt(None);
        assert_eq!(args.0[0].to_le_bytes()[..4], (-2i32).to_le_bytes());
        assert_eq!(args.0[1].to_le_bytes()[..4], 1.5f32.to_le_bytes());
        assert_eq!(args.0[2], (-3i64) as u64);
        assert_eq!(args.0[3], 0);
    }
}
