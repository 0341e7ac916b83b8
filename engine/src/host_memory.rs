//! Bytes held in host (CPU) memory by tensors, measured rather than estimated. libtorch keeps
//! statistics for its CUDA caching allocator only, so [`track`] wraps the CPU allocator with a
//! counter (`csrc/host_memory.cpp`): from then on every CPU allocation adds its size and every
//! free subtracts it. Tests use it to check what a computation keeps alive for backward, e.g.
//! that sequence-parallel attention holds 1/sp of the serial activations on each rank.
//!
//! Installation is process-wide and permanent, and allocations made before it are not seen:
//! [`HostMemory::current`] is the bytes allocated since [`track`] that are still alive. The
//! counter sees every thread, so measure in a process that runs one thing at a time (the
//! multi-process tests in `tests/` run one test per rank process).
use crate::ffi::{self, check};
use crate::Result;

/// A reading of the counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostMemory {
    /// Bytes allocated since tracking began and not yet freed.
    pub current: i64,
    /// The largest `current` since tracking began or the last [`reset_peak`].
    pub peak: i64,
}

/// Starts counting CPU allocations (a second call does nothing).
pub fn track() -> Result<()> {
    check(unsafe { ffi::eng_host_memory_install() }, || "installing the host memory counter".into())
}

/// The counter now; an error if [`track`] was never called.
pub fn stats() -> Result<HostMemory> {
    let (mut current, mut peak) = (0i64, 0i64);
    check(unsafe { ffi::eng_host_memory_stats(&mut current, &mut peak) }, || "reading host memory".into())?;
    crate::error::ensure!(current >= 0, "host memory is not tracked: call host_memory::track() first");
    Ok(HostMemory { current, peak })
}

/// Sets the peak to the current value, to measure the peak of what follows.
pub fn reset_peak() -> Result<()> {
    check(unsafe { ffi::eng_host_memory_reset_peak() }, || "resetting the host memory peak".into())
}
