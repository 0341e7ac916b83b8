//! The allocator of fastfold's processes: jemalloc for every allocation, libtorch's tensors
//! included (their `posix_memalign`/`free` resolve to the unprefixed jemalloc linked into the
//! executable), keeping freed memory for the next tensor.
//!
//! Why not glibc: a pass allocates and frees tensors of tens of MiB to GiBs op after op (at 256
//! residues the pair activations are 32 MiB, the attention logits up to 1 GiB). glibc hands
//! blocks above its mmap threshold back to the kernel when they are freed, so every op's output
//! is fresh pages that the kernel faults in and zeroes: in a 256-residue training step a quarter
//! of the CPU time was the kernel's (`perf`). Raising the threshold
//! ([`engine::process::keep_freed_memory`], what the vit and diffusion binaries do) keeps those
//! blocks in one heap that fragments: the step's peak resident memory rose from 6.1 to 13.3 GB.
//! jemalloc reuses freed extents by size class: the same step (`versus_alphafold_train`, 256
//! residues, 8 blocks, 2-core machine) ran in 249 s against glibc's 412 s with the raised
//! threshold, peaking at 8.6 GB (docs/benchmarks.md has the quiet figures).
//!
//! Binaries opt in with `process_allocator!` (`main.rs`, the benchmarks that time our side),
//! not the library: tests that read the resident set's growth (`tests/profile.rs`) rely on
//! glibc mapping each buffer on its own. So the library never names `tikv_jemallocator` (a
//! crate it named would be linked into every test binary, its `malloc` with it); the macro's
//! expansion does, in the binary.

/// jemalloc's options: freed pages are never returned to the kernel (dirty and muzzy decay
/// off), so a step's tensors reuse the last step's pages instead of faulting new ones in.
pub const MALLOC_CONF: &[u8] = b"dirty_decay_ms:-1,muzzy_decay_ms:-1\0";

/// Makes jemalloc, with [`MALLOC_CONF`], the allocator of the binary that invokes it (once, at
/// the crate root).
#[macro_export]
macro_rules! process_allocator {
    () => {
        #[global_allocator]
        static ALLOCATOR: ::tikv_jemallocator::Jemalloc = ::tikv_jemallocator::Jemalloc;

        /// Read by jemalloc at its first allocation (its `const char *malloc_conf`; the
        /// `MALLOC_CONF` environment variable still overrides it).
        #[no_mangle]
        pub static malloc_conf: Option<&u8> = Some(&$crate::allocator::MALLOC_CONF[0]);
    };
}
