//! This process and what it runs on: the libtorch it was built against, CUDA devices, threads
//! and the launcher's view of the job (every binary prints them with its `env` subcommand), the
//! allocator setting every binary makes at startup, and the peak memory a job reports.
use std::ffi::CStr;
use std::fmt::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::dist::LaunchEnv;
use crate::{cuda, ffi};

/// The libtorch version the bridge was compiled against.
pub fn torch_version() -> String {
    // SAFETY: a static NUL-terminated string from libtorch's version header.
    unsafe { CStr::from_ptr(ffi::eng_torch_version()) }.to_string_lossy().into_owned()
}

/// Keeps freed CPU tensor memory in the process instead of returning it to the kernel after
/// every op. glibc's defaults unmap (or trim) the large blocks that activations and gradients
/// live in as soon as they are freed, so every training step faults the same memory back in;
/// with blocks up to 128 MiB taken from the heap and the heap trimmed only above 1 GiB free,
/// a training step's forward pass ran 10-20% faster in `vit bench` (page faults fell about
/// fourfold). Call once at startup, before the first tensor.
pub fn keep_freed_memory() {
    // SAFETY: mallopt only changes allocator parameters; called before other threads allocate.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

/// The cores this process may use, shared among the ranks on its node (`LOCAL_WORLD_SIZE`,
/// set by every launcher): the default of thread-pool flags such as `--workers`.
pub fn cores_per_rank() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let local = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(1);
    (cores / local.max(1)).max(1)
}

/// A human-readable report of the runtime.
pub fn report() -> String {
    let mut out = String::new();
    let _ = writeln!(out, "libtorch      {}", torch_version());
    let _ = writeln!(out, "cpu threads   {}", tch::get_num_threads());
    let devices = cuda::device_count();
    if devices == 0 {
        let _ = writeln!(out, "cuda          not available (CPU only; collectives use Gloo)");
    }
    for d in 0..devices {
        match cuda::mem_get_info(d) {
            Ok((free, total)) => {
                let _ = writeln!(out, "cuda:{d}        {:.1} GiB free of {:.1} GiB", gib(free), gib(total));
            }
            Err(e) => {
                let _ = writeln!(out, "cuda:{d}        {e}");
            }
        }
    }
    let _ = match LaunchEnv::from_env() {
        Ok(Some(env)) => writeln!(out, "job           {}", env.describe()),
        Ok(None) => writeln!(out, "job           single process (no launcher variables set)"),
        Err(e) => writeln!(out, "job           {e}"),
    };
    out
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// The most memory this job has held on `device`: the caching allocator's peak on a GPU, the
/// process's peak resident set (`VmHWM`) on the CPU; `None` where neither can be read.
pub fn peak_memory(device: tch::Device) -> Option<u64> {
    match device {
        tch::Device::Cuda(d) => cuda::memory_stats(d).ok().map(|s| s.peak_allocated.max(0) as u64),
        _ => {
            let status = std::fs::read_to_string("/proc/self/status").ok()?;
            let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
            let kib: u64 = line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
            Some(kib * 1024)
        }
    }
}

/// The most memory a CUDA card holds while this runs, as `nvidia-smi`'s memory use counts it:
/// the CUDA context, the libraries' handles, workspaces and loaded modules, and the caching
/// allocator's whole reserve, not only its allocations ([`peak_memory`]). Read as the driver's
/// `total - free` (`cudaMemGetInfo`) on a thread of its own every [`CardPeak::PERIOD`]. It is
/// the card's use, so on a card this process has alone the process's plus the driver's own
/// few MiB. The caching allocator keeps what it reserved until its cache is emptied, so within
/// a run the use steps up and seldom falls back: sampling misses little of the peak.
pub struct CardPeak {
    stop: Arc<AtomicBool>,
    sampler: JoinHandle<crate::Result<u64>>,
}

impl CardPeak {
    /// How often the card's use is read.
    pub const PERIOD: Duration = Duration::from_millis(5);

    /// Starts reading `device`'s use; an error where it cannot be read (no CUDA).
    pub fn start(device: usize) -> crate::Result<CardPeak> {
        let used = move || cuda::mem_get_info(device).map(|(free, total)| total.saturating_sub(free));
        let first = used()?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let sampler = std::thread::spawn(move || {
            let mut peak = first;
            loop {
                // Read once more after the stop is seen, so the end of the run is counted.
                let last = stopped.load(Ordering::Acquire);
                peak = peak.max(used()?);
                if last {
                    return Ok(peak);
                }
                std::thread::sleep(Self::PERIOD);
            }
        });
        Ok(CardPeak { stop, sampler })
    }

    /// Stops reading: the largest use seen, in bytes.
    pub fn finish(self) -> crate::Result<u64> {
        self.stop.store(true, Ordering::Release);
        self.sampler.join().map_err(|_| crate::Error::invalid("the card memory sampler panicked"))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On a GPU the sampled use covers a 256 MiB tensor held meanwhile; without one, starting
    /// is an error (the benchmarks then print no card figure), not a panic.
    #[test]
    fn card_peak_covers_a_held_tensor_or_says_there_is_no_card() {
        if cuda::device_count() == 0 {
            assert!(CardPeak::start(0).is_err(), "a card peak read without a CUDA device");
            return;
        }
        let card = CardPeak::start(0).unwrap();
        let held = tch::Tensor::ones([64 << 20], (tch::Kind::Float, tch::Device::Cuda(0)));
        cuda::synchronize(0).unwrap();
        std::thread::sleep(CardPeak::PERIOD * 4);
        let peak = card.finish().unwrap();
        assert!(peak >= (256 << 20), "card peak {peak} below a 256 MiB tensor held");
        drop(held);
    }

    #[test]
    fn cpu_peak_memory_is_at_least_a_touched_buffer() {
        let buffer = vec![1u8; 64 << 20];
        let peak = peak_memory(tch::Device::Cpu).expect("VmHWM readable on Linux");
        assert!(peak >= buffer.len() as u64, "peak {peak} below a 64 MiB buffer in use");
    }
}
