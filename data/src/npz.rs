//! NumPy `.npz` archives (AlphaFold's parameters and processed features), read with every
//! length checked: each zip entry is a `.npy` file whose header (magic, version, a dict of
//! `descr`, `fortran_order` and `shape`) must describe exactly the bytes that follow. A
//! mismatch, a dtype or layout this reader does not take, or a damaged archive is an error
//! naming the file and the array; nothing is read past the end of a buffer.
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use tch::{Kind, Tensor};

use crate::{Error, Result};

const MAGIC: &[u8] = b"\x93NUMPY";
/// Largest header this reader accepts (NumPy writes a few hundred bytes).
const MAX_HEADER: usize = 1 << 16;

fn format_err(path: &Path, msg: String) -> Error {
    Error::Format { path: path.to_path_buf(), msg }
}

/// Every array of the `.npz` file at `path`, by name (the entry name without `.npy`).
pub fn read(path: &Path) -> Result<Vec<(String, Tensor)>> {
    let file = File::open(path).map_err(crate::io_err(path))?;
    let mut zip = zip::ZipArchive::new(BufReader::new(file))
        .map_err(|e| format_err(path, format!("not a readable .npz (zip) archive: {e}")))?;
    let mut arrays = Vec::with_capacity(zip.len());
    for i in 0..zip.len() {
        let mut entry = zip.by_index(i).map_err(|e| format_err(path, format!("zip entry {i}: {e}")))?;
        let name = entry.name().strip_suffix(".npy").unwrap_or(entry.name()).to_string();
        let declared = entry.size();
        let bad = |msg: String| format_err(path, format!("array {name}: {msg}"));
        // The size the zip directory declares bounds what is read (and allocated).
        let capacity = usize::try_from(declared).map_err(|_| bad(format!("entry of {declared} bytes")))?;
        let mut bytes = Vec::with_capacity(capacity.min(1 << 30));
        entry.by_ref().take(declared.saturating_add(1)).read_to_end(&mut bytes).map_err(|e| bad(e.to_string()))?;
        if bytes.len() as u64 != declared {
            return Err(bad(format!("the archive declares {declared} bytes, the entry holds {}", bytes.len())));
        }
        let tensor = parse_npy(&bytes).map_err(bad)?;
        arrays.push((name, tensor));
    }
    Ok(arrays)
}

/// A `.npy` file's array; the message says what does not fit.
pub fn parse_npy(bytes: &[u8]) -> std::result::Result<Tensor, String> {
    if bytes.len() < MAGIC.len() + 4 || &bytes[..MAGIC.len()] != MAGIC {
        return Err("not a .npy array (bad magic)".into());
    }
    let major = bytes[MAGIC.len()];
    // Version 1 stores the header length in 2 bytes, versions 2 and 3 in 4.
    let start = match major {
        1 => MAGIC.len() + 4,
        2 | 3 => MAGIC.len() + 6,
        v => return Err(format!(".npy format version {v} (1 to 3 are known)")),
    };
    if bytes.len() < start {
        return Err("truncated .npy header".into());
    }
    let len_field = &bytes[MAGIC.len() + 2..start];
    let header_len = len_field.iter().rev().fold(0usize, |n, &b| (n << 8) | b as usize);
    let end = start.checked_add(header_len).filter(|&e| e <= bytes.len() && header_len <= MAX_HEADER);
    let end = end.ok_or_else(|| format!("header of {header_len} bytes runs past the file"))?;
    let header = std::str::from_utf8(&bytes[start..end]).map_err(|_| "header is not text".to_string())?;
    let (kind, elem, big_endian, fortran, shape) = parse_header(header)?;
    if fortran && shape.len() > 1 {
        return Err("Fortran-ordered arrays are not supported".into());
    }
    let numel =
        shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)).ok_or_else(|| format!("shape {shape:?} overflows"))?;
    let want = numel.checked_mul(elem).ok_or_else(|| format!("shape {shape:?} overflows"))?;
    let data = &bytes[end..];
    if data.len() != want {
        return Err(format!("header declares shape {shape:?} ({want} bytes), the data holds {} bytes", data.len()));
    }
    let data: std::borrow::Cow<[u8]> = match big_endian && elem > 1 {
        true => data.chunks_exact(elem).flat_map(|c| c.iter().rev().copied()).collect::<Vec<u8>>().into(),
        false => data.into(),
    };
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    Tensor::f_from_data_size(&data, &dims, kind).map_err(|e| e.to_string())
}

/// (kind, bytes per element, big-endian, fortran order, shape) from the header's dict.
fn parse_header(header: &str) -> std::result::Result<(Kind, usize, bool, bool, Vec<usize>), String> {
    let field = |key: &str| -> std::result::Result<&str, String> {
        let at = header.find(&format!("'{key}'")).ok_or_else(|| format!("header has no '{key}': {header:?}"))?;
        let rest = header[at + key.len() + 2..].trim_start();
        let rest = rest.strip_prefix(':').ok_or_else(|| format!("header: no ':' after '{key}'"))?;
        Ok(rest.trim_start())
    };
    let descr = field("descr")?;
    let descr = descr.strip_prefix('\'').and_then(|d| d.split('\'').next()).ok_or("header: descr is not a string")?;
    let (order, code) = descr.split_at(descr.len().min(1));
    let big_endian = match order {
        "<" | "|" | "=" => false,
        ">" => true,
        _ => return Err(format!("dtype {descr:?}")),
    };
    let (kind, elem) = match code {
        "f2" => (Kind::Half, 2),
        "f4" => (Kind::Float, 4),
        "f8" => (Kind::Double, 8),
        "i1" => (Kind::Int8, 1),
        "u1" => (Kind::Uint8, 1),
        "i2" => (Kind::Int16, 2),
        "i4" => (Kind::Int, 4),
        "i8" => (Kind::Int64, 8),
        "b1" => (Kind::Bool, 1),
        _ => return Err(format!("dtype {descr:?} is not supported (float, int, uint8 or bool)")),
    };
    let fortran = field("fortran_order")?.starts_with("True");
    let shape = field("shape")?;
    let inner = shape.strip_prefix('(').and_then(|s| s.split(')').next()).ok_or("header: shape is not a tuple")?;
    let shape = inner
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.trim_end_matches('L').parse::<usize>().map_err(|_| format!("shape entry {s:?}")))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((kind, elem, big_endian, fortran, shape))
}
