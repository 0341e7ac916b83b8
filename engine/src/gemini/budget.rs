//! The memory budget a user gives (`--gpu-mem 4G`): parsed, then applied both as the cap of
//! libtorch's caching allocator for the process (so the rest of the program cannot use more
//! either, and a 24 GB card rehearses a 4 GB one) and as Gemini's budget; and byte counts
//! written back for messages.
use tch::Device;

use crate::{Error, Result};

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
}
