//! The on-disk PTX cache: one file per (kernel, source hash, architecture), so a kernel is
//! compiled once per machine rather than once per process. The folder is [`CACHE_ENV`], else
//! `$XDG_CACHE_HOME/suite/kernels`, else `$HOME/.cache/suite/kernels`. The cache only saves
//! time: a folder that cannot be written is skipped with one notice.
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

/// Overrides the cache folder.
pub const CACHE_ENV: &str = "SUITE_KERNEL_CACHE";

/// The cache folder, if one can be named.
pub fn dir() -> Option<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var(CACHE_ENV)
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("suite").join("kernels")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("suite").join("kernels")))
}

/// FNV-1a, 64 bits: a hash that stays the same across Rust releases (std's does not promise
/// to), so cached files keep their names.
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        // A separator, so ("ab", "c") and ("a", "bc") differ.
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The cache file for a kernel whose key (source, options, NVRTC version) hashes to `hash`.
pub fn path(kernel: &str, hash: u64, arch: u32) -> Option<PathBuf> {
    dir().map(|d| d.join(format!("{kernel}-{hash:016x}-compute_{arch}.ptx")))
}

/// The cached PTX, if present.
pub fn read(kernel: &str, hash: u64, arch: u32) -> Option<String> {
    std::fs::read_to_string(path(kernel, hash, arch)?).ok()
}

/// Stores PTX: written to a temporary file, then renamed, so a reader never sees half a file.
pub fn write(kernel: &str, hash: u64, arch: u32, ptx: &str) {
    let Some(path) = path(kernel, hash, arch) else { return };
    let tmp = path.with_extension(format!("ptx.tmp{}", std::process::id()));
    let outcome = path
        .parent()
        .map_or(Ok(()), std::fs::create_dir_all)
        .and_then(|()| std::fs::write(&tmp, ptx))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = outcome {
        let _ = std::fs::remove_file(&tmp);
        static WARNED: AtomicBool = AtomicBool::new(false);
        if !WARNED.swap(true, Ordering::Relaxed) {
            eprintln!(
                "kernels: not caching compiled kernels in {} ({e}); set {CACHE_ENV} to a writable folder",
                path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_fixed_and_separates_parts() {
        // A fixed value: cached files keep their names across builds and toolchains.
        assert_eq!(fnv1a(&[b"a"]), 0x089b_c907_b544_c769);
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
        assert_ne!(fnv1a(&[b"x"]), fnv1a(&[b"y"]));
    }
}
