//! The memory budget a user gives (`--gpu-mem 4G`): parsed, then applied both as the cap of
//! libtorch's caching allocator for the process (so the rest of the program cannot use more
//! either, and a 24 GB card rehearses a 4 GB one) and as Gemini's budget; and byte counts
//! written back for messages.
//!
//! The cap is the whole process's, as `nvidia-smi` counts it: the CUDA context, library
//! handles and loaded modules sit outside the caching allocator, so [`cap_process_memory`]
//! measures them at start ([`DeviceSplit`]) and caps the allocator at what they leave. The
//! arithmetic is tested on the CPU; on an H200 the process stayed within a 4 GiB cap.
use std::sync::Mutex;

use tch::{Device, Kind, Tensor};

use crate::{Error, Result};

/// Bytes held back for what the CUDA libraries load after start-up (NVRTC modules of the
/// fused kernels, kernels cuBLAS and cuDNN load lazily on first use), beside what they hold
/// when [`cap_process_memory`] measures.
pub const LATE_LOADS: u64 = 256 << 20;

/// How a process's device-memory cap splits: what the CUDA context and libraries hold outside
/// the caching allocator (measured at start), a margin for what they load later, and the
/// caching allocator's cap, which Gemini's budget and the activations share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceSplit {
    /// The process's cap (`--gpu-mem`).
    pub cap: u64,
    /// Device bytes in use outside the caching allocator when measured.
    pub outside: u64,
    /// Held back for later loads ([`LATE_LOADS`]).
    pub margin: u64,
    /// The caching allocator's cap: `cap - outside - margin`.
    pub allocator: u64,
}

impl DeviceSplit {
    /// The split of `cap` on a device of `total` bytes with `free` free, of which the caching
    /// allocator had `reserved` reserved when measured: the rest of what is used is outside
    /// it. On a device this process has alone; another process's memory counts as outside
    /// (the split is then conservative). An error when the cap exceeds the device, or when
    /// what is outside and the margin leave the allocator nothing.
    pub fn new(cap: u64, total: u64, free: u64, reserved: u64, margin: u64) -> Result<DeviceSplit> {
        if cap > total {
            return Err(Error::invalid(format!(
                "a memory cap of {} exceeds the device's {}",
                human(cap as usize),
                human(total as usize)
            )));
        }
        let outside = total.saturating_sub(free).saturating_sub(reserved);
        let held = outside.saturating_add(margin);
        if held >= cap {
            return Err(Error::invalid(format!(
                "a memory cap of {} leaves the caching allocator nothing: the CUDA context and libraries hold {} \
                 of the device and {} is kept for modules they load later",
                human(cap as usize),
                human(outside as usize),
                human(margin as usize)
            )));
        }
        Ok(DeviceSplit { cap, outside, margin, allocator: cap - held })
    }
}

impl std::fmt::Display for DeviceSplit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "device memory cap {}: {} held by the CUDA context and libraries, {} kept for modules loaded later, {} for the caching allocator",
            human(self.cap as usize),
            human(self.outside as usize),
            human(self.margin as usize),
            human(self.allocator as usize)
        )
    }
}

/// Caps the whole process's memory on `device` at `cap` bytes when it is a GPU: starts the
/// CUDA context, cuBLAS and, for a program that runs `convolutions`, cuDNN (a small matrix
/// product in fp16 and fp32, a small convolution), measures what they hold outside the caching
/// allocator, and caps the allocator at what they leave less [`LATE_LOADS`] ([`DeviceSplit`],
/// which callers print). A program without convolutions never loads cuDNN, so starting it
/// would take its share from the allocator for nothing.
/// On the CPU there is no allocator cap (the budget is Gemini's own accounting): None.
///
/// The first call also turns on the allocator's expandable segments (unless the user set
/// `PYTORCH_CUDA_ALLOC_CONF`): a capped allocator then grows its reserve page by page instead
/// of in whole segments of the sizes it rounds requests to, so what it holds beyond the live
/// tensors stays small (a 1,200-residue `fastfold predict` on the H200 held about 0.9 GiB more
/// than its 2.3 GiB of tensors without them). A later call with the same cap (a plan made again
/// for the next model) caps the allocator at the first call's split without measuring again.
pub fn cap_process_memory(device: Device, cap: u64, convolutions: bool) -> Result<Option<DeviceSplit>> {
    static SPLITS: Mutex<Vec<(usize, DeviceSplit)>> = Mutex::new(Vec::new());
    let Device::Cuda(d) = device else { return Ok(None) };
    let mut splits = SPLITS.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(&(_, split)) = splits.iter().find(|(dev, split)| *dev == d && split.cap == cap) {
        crate::cuda::set_memory_cap(split.allocator, d)?;
        return Ok(Some(split));
    }
    if splits.is_empty() && std::env::var_os("PYTORCH_CUDA_ALLOC_CONF").is_none() {
        crate::cuda::set_allocator_settings("expandable_segments:True")?;
    }
    tch::no_grad(|| -> Result<()> {
        for kind in [Kind::Half, Kind::Float] {
            let x = Tensor::f_ones([64, 64], (kind, device))?;
            let _ = x.f_matmul(&x)?;
            if !convolutions {
                continue;
            }
            let image = Tensor::f_ones([1, 4, 16, 16], (kind, device))?;
            let _ = image.f_conv2d::<Tensor>(
                &Tensor::f_ones([4, 4, 3, 3], (kind, device))?,
                None,
                [1, 1],
                [1, 1],
                [1, 1],
                1,
            )?;
        }
        Ok(())
    })?;
    crate::cuda::synchronize(d)?;
    let (free, total) = crate::cuda::mem_get_info(d)?;
    let reserved = crate::cuda::memory_stats(d)?.reserved.max(0) as u64;
    let split = DeviceSplit::new(cap, total, free, reserved, LATE_LOADS)?;
    crate::cuda::set_memory_cap(split.allocator, d)?;
    splits.push((d, split));
    Ok(Some(split))
}

/// Parses a byte count: a number with an optional binary unit, `K`, `M`, `G`, `T` (also
/// `KiB`, `KB`, ...; all powers of 1024) or none for bytes: `4G`, `512M`, `1.5GiB`, `4096`.
pub fn parse_bytes(text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let bad = || Error::invalid(format!("{text:?} is not a byte count (expected e.g. 4G, 512M, 1.5GiB, 4096)"));
    let value: f64 = number.parse().map_err(|_| bad())?;
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(bad()),
    };
    let bytes = value * (1u64 << shift) as f64;
    // "1.5" without a unit would be 1 byte: a unit was meant.
    let fractional_bytes = shift == 0 && value.fract() != 0.0;
    if bytes == 0.0 && !fractional_bytes {
        return Err(Error::invalid(format!("{text:?}: a memory budget must be more than 0 bytes")));
    }
    if bytes > u64::MAX as f64 {
        return Err(Error::invalid(format!("{text:?} is too large a byte count (at most 16 EiB)")));
    }
    if !bytes.is_finite() || bytes < 1.0 || fractional_bytes {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// Caps the caching allocator of `device` at `bytes` when it is a GPU (an error if the GPU
/// has less); on the CPU there is no allocator cap and the budget is Gemini's own accounting.
pub fn cap_device_memory(device: Device, bytes: u64) -> Result<()> {
    match device {
        Device::Cuda(d) => crate::cuda::set_memory_cap(bytes, d),
        _ => Ok(()),
    }
}

/// Bytes for messages: `1.5 MiB`.
pub fn human(bytes: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_with_binary_units() {
        assert_eq!(parse_bytes("4G").unwrap(), 4 << 30);
        assert_eq!(parse_bytes("512M").unwrap(), 512 << 20);
        assert_eq!(parse_bytes("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_bytes("1.1G").unwrap(), (1.1 * (1u64 << 30) as f64) as u64);
        assert_eq!(parse_bytes(" 64kb ").unwrap(), 64 << 10);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        for bad in ["", "G", "4X", "-1G", "1..2G", "1.5", "0.5"] {
            let err = parse_bytes(bad).unwrap_err().to_string();
            assert!(err.contains("is not a byte count"), "{bad}: {err}");
        }
        for zero in ["0", "0G", "0.0M"] {
            let err = parse_bytes(zero).unwrap_err().to_string();
            assert!(err.contains("must be more than 0 bytes"), "{zero}: {err}");
        }
        for huge in ["99999999999T", &"9".repeat(400)] {
            let err = parse_bytes(huge).unwrap_err().to_string();
            assert!(err.contains("too large"), "{err}");
        }
        assert!(cap_device_memory(Device::Cpu, 1 << 30).is_ok());
    }

    #[test]
    fn the_process_cap_leaves_the_allocator_what_the_context_and_libraries_do_not_hold() {
        const M: u64 = 1 << 20;
        // An 80 GiB device with 600 MiB in use, 88 MiB of it the allocator's.
        let split = DeviceSplit::new(4 << 30, 80 << 30, (80 << 30) - 600 * M, 88 * M, LATE_LOADS).unwrap();
        assert_eq!(
            split,
            DeviceSplit { cap: 4 << 30, outside: 512 * M, margin: 256 * M, allocator: (4 << 30) - 768 * M }
        );
        assert_eq!(
            split.to_string(),
            "device memory cap 4.0 GiB: 512.0 MiB held by the CUDA context and libraries, 256.0 MiB kept for \
             modules loaded later, 3.2 GiB for the caching allocator"
        );
        // The allocator reporting more than the device's used bytes (counters read apart)
        // leaves nothing outside rather than wrapping around.
        assert_eq!(DeviceSplit::new(1 << 30, 2 << 30, (2 << 30) - M, 2 * M, 0).unwrap().allocator, 1 << 30);
        let err = DeviceSplit::new(8 << 30, 4 << 30, 4 << 30, 0, 0).unwrap_err().to_string();
        assert!(err.contains("8.0 GiB exceeds the device's 4.0 GiB"), "{err}");
        let err = DeviceSplit::new(700 * M, 80 << 30, (80 << 30) - 500 * M, 0, 200 * M).unwrap_err().to_string();
        assert!(err.contains("leaves the caching allocator nothing") && err.contains("hold 500.0 MiB"), "{err}");
        assert_eq!(cap_process_memory(Device::Cpu, 1 << 30, true).unwrap(), None);
    }
}
