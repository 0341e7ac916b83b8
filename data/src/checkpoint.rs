//! Model weights as safetensors files, by parameter name (timm and diffusers key names fall
//! out of the module paths). Loading checks every key and shape; saving is atomic.
use std::collections::HashMap;
use std::path::Path;

use tch::nn::VarStore;
use tch::Tensor;

use crate::{Error, Result};

/// Every tensor of the safetensors file at `path`, by name; an unreadable file is an error
/// naming it, and a header entry that does not describe its bytes (an unknown dtype, a shape
/// whose size is not its byte range, a range outside the file) one naming the key too.
pub fn read_tensors(path: &Path) -> Result<HashMap<String, Tensor>> {
    let (header, data_bytes) = read_header(path)?;
    for (key, entry) in header.iter().filter(|(k, _)| *k != "__metadata__") {
        check_entry(entry, data_bytes)
            .map_err(|msg| Error::Format { path: path.to_path_buf(), msg: format!("key {key}: {msg}") })?;
    }
    let tensors = Tensor::read_safetensors(path).map_err(|e| Error::Format {
        path: path.to_path_buf(),
        msg: format!("not a readable safetensors file: {e}"),
    })?;
    Ok(tensors.into_iter().collect())
}

/// The `__metadata__` strings of the safetensors file at `path` (empty when it has none), read
/// from its header alone; a header that is not safetensors' is an error naming the file.
pub fn read_metadata(path: &Path) -> Result<HashMap<String, String>> {
    let (header, _) = read_header(path)?;
    let Some(metadata) = header.get("__metadata__") else { return Ok(HashMap::new()) };
    serde_json::from_value(metadata.clone()).map_err(|e| Error::Format {
        path: path.to_path_buf(),
        msg: format!("__metadata__ is not a map of strings to strings: {e}"),
    })
}

/// The JSON header of the safetensors file at `path`, and the bytes of data after it.
fn read_header(path: &Path) -> Result<(serde_json::Map<String, serde_json::Value>, u64)> {
    use std::io::Read;
    let bad = |msg: String| Error::Format { path: path.to_path_buf(), msg };
    let io = |source| Error::Io { path: path.to_path_buf(), source };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let mut len = [0u8; 8];
    file.read_exact(&mut len)
        .map_err(|_| bad("not a readable safetensors file: shorter than its header's length".into()))?;
    let len = u64::from_le_bytes(len);
    // The safetensors crate's own bound on a header, and the file's size.
    if len > 100_000_000 || len > size - 8 {
        return Err(bad(format!("not a readable safetensors file: a header of {len} bytes in a file of {size}")));
    }
    let mut header = vec![0u8; len as usize];
    file.read_exact(&mut header).map_err(io)?;
    let header: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|e| bad(format!("not a readable safetensors file: its header: {e}")))?;
    match header {
        serde_json::Value::Object(map) => Ok((map, size - 8 - len)),
        _ => Err(bad("not a readable safetensors file: its header is not a JSON object".into())),
    }
}

/// Whether one header entry describes `{"dtype", "shape", "data_offsets"}` that fit a data
/// section of `data_bytes`; the message says what does not.
fn check_entry(entry: &serde_json::Value, data_bytes: u64) -> std::result::Result<(), String> {
    let dtype = entry.get("dtype").and_then(|d| d.as_str()).ok_or("no dtype")?;
    let width: u64 = match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return Err(format!("dtype {dtype} is not one safetensors stores")),
    };
    let shape = entry.get("shape").and_then(|s| s.as_array()).ok_or("no shape")?;
    let shape: Vec<u64> = shape
        .iter()
        .map(|d| d.as_u64())
        .collect::<Option<_>>()
        .ok_or_else(|| format!("shape {} is not a list of sizes", entry["shape"]))?;
    let bytes = shape
        .iter()
        .try_fold(width, |b, &d| b.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} is too large"))?;
    let offsets = entry.get("data_offsets").and_then(|o| o.as_array()).ok_or("no data_offsets")?;
    let (start, end) = match offsets[..] {
        [ref s, ref e] => (s.as_u64(), e.as_u64()),
        _ => (None, None),
    };
    let (Some(start), Some(end)) = (start, end) else {
        return Err(format!("data_offsets {offsets:?} are not two byte positions"));
    };
    if start > end || end > data_bytes {
        return Err(format!(
            "data_offsets [{start}, {end}] are not a range within the file's {data_bytes} bytes of data"
        ));
    }
    if end - start != bytes {
        return Err(format!(
            "{dtype} {shape:?} needs {bytes} bytes, and data_offsets [{start}, {end}] hold {}",
            end - start
        ));
    }
    Ok(())
}

/// Copies every variable of `vs` from the safetensors file at `path`. A missing key or a
/// shape mismatch is an error naming the file, the key and both shapes. Returns the keys of
/// the file that no variable used, sorted.
pub fn load_safetensors(vs: &VarStore, path: &Path) -> Result<Vec<String>> {
    let mut file = read_tensors(path)?;
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    copy_into(&vars, &mut file, path)?;
    let mut unused: Vec<String> = file.into_keys().collect();
    unused.sort();
    Ok(unused)
}

/// Copies `file`'s tensors into `targets` by name, taking them out of `file`; a missing key, a
/// shape mismatch or integers for a floating-point target is an error naming `path` and the key.
pub fn copy_into(targets: &[(String, Tensor)], file: &mut HashMap<String, Tensor>, path: &Path) -> Result<()> {
    let bad = |msg: String| Error::Format { path: path.to_path_buf(), msg };
    tch::no_grad(|| {
        for (name, var) in targets {
            let src = file
                .remove(name)
                .ok_or_else(|| bad(format!("missing key {name} (expected shape {:?})", var.size())))?;
            if src.size() != var.size() {
                return Err(bad(format!("key {name} has shape {:?}, expected {:?}", src.size(), var.size())));
            }
            if var.is_floating_point() {
                floating(name, &src).map_err(bad)?;
            }
            var.shallow_clone().f_copy_(&src).map_err(|e| bad(format!("key {name}: {e}")))?;
        }
        Ok(())
    })
}

/// Checks that the tensor read as `key` holds floats, as weights do: floats convert (fp16 and
/// bf16 files load into fp32 models), but integers or booleans in place of weights mean a wrong
/// or damaged file, not values to cast.
pub fn floating(key: &str, t: &Tensor) -> std::result::Result<(), String> {
    match t.is_floating_point() {
        true => Ok(()),
        false => Err(format!("key {key} holds {:?} values, expected floating point", t.kind())),
    }
}

/// Writes every variable of `vs` to `path` as safetensors (through a temporary file).
pub fn save_safetensors(vs: &VarStore, path: &Path) -> Result<()> {
    let named: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    save_tensors(&named, path)
}

/// Writes named tensors to `path` as safetensors, sorted by name, through a temporary file.
pub fn save_tensors(named: &[(String, Tensor)], path: &Path) -> Result<()> {
    let mut named = on_cpu(named);
    named.sort_by(|a, b| a.0.cmp(&b.0));
    staged(path, |staging| Tensor::write_safetensors(&named, staging))
}

/// Writes named tensors to `path` as numpy's `.npz` (stored, as `numpy.savez`), through a
/// temporary file: the format of AlphaFold's parameters, features and outputs.
pub fn save_npz(named: &[(String, Tensor)], path: &Path) -> Result<()> {
    let named = on_cpu(named);
    let refs: Vec<(&str, Tensor)> = named.iter().map(|(n, t)| (n.as_str(), t.shallow_clone())).collect();
    staged(path, |staging| Tensor::write_npz(&refs, staging))
}

fn on_cpu(named: &[(String, Tensor)]) -> Vec<(String, Tensor)> {
    named.iter().map(|(n, t)| (n.clone(), t.detach().to_device(tch::Device::Cpu).contiguous())).collect()
}

/// Runs tch's `write` through [`crate::write_staged`], naming `path` in its errors.
fn staged(path: &Path, write: impl FnOnce(&Path) -> std::result::Result<(), tch::TchError>) -> Result<()> {
    crate::write_staged(path, |tmp| {
        write(tmp).map_err(|e| Error::Format { path: path.to_path_buf(), msg: e.to_string() })
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::nn::Init;
    use tch::Device;

    fn store(rows: i64) -> VarStore {
        let vs = VarStore::new(Device::Cpu);
        let root = vs.root();
        let _ = root.sub("layer").var("weight", &[rows, 2], Init::Randn { mean: 0.0, stdev: 1.0 });
        let _ = root.sub("layer").var("bias", &[2], Init::Const(0.5));
        vs
    }

    #[test]
    fn round_trip_and_key_errors() {
        let dir = crate::scratch("safetensors");
        let path = dir.join("model.safetensors");
        let a = store(3);
        save_safetensors(&a, &path).unwrap();
        let b = store(3);
        assert!(load_safetensors(&b, &path).unwrap().is_empty());
        let (wa, wb) = (&a.variables()["layer.weight"], &b.variables()["layer.weight"]);
        assert!(wa.equal(wb));
        let err = load_safetensors(&store(4), &path).unwrap_err().to_string();
        assert!(err.contains("key layer.weight has shape [3, 2], expected [4, 2]"), "{err}");
        let extra = store(3);
        let _ = extra.root().var("head", &[1], Init::Const(0.0));
        let err = load_safetensors(&extra, &path).unwrap_err().to_string();
        assert!(err.contains("missing key head") && err.contains("model.safetensors"), "{err}");
        // Integers where weights belong are an error, not values to cast; fp16 converts.
        let mut file: HashMap<String, Tensor> =
            [("layer.weight".to_string(), Tensor::ones([3, 2], (tch::Kind::Int, tch::Device::Cpu)))].into();
        let targets = [("layer.weight".to_string(), b.variables()["layer.weight"].shallow_clone())];
        let err = copy_into(&targets, &mut file, &path).unwrap_err().to_string();
        assert!(err.contains("key layer.weight holds Int values, expected floating point"), "{err}");
        let mut file: HashMap<String, Tensor> =
            [("layer.weight".to_string(), Tensor::ones([3, 2], (tch::Kind::Half, tch::Device::Cpu)))].into();
        copy_into(&targets, &mut file, &path).unwrap();
        assert_eq!(b.variables()["layer.weight"].sum(tch::Kind::Float).double_value(&[]), 6.0);
        std::fs::write(dir.join("bad.safetensors"), b"not really").unwrap();
        let err = load_safetensors(&b, &dir.join("bad.safetensors")).unwrap_err().to_string();
        assert!(err.contains("bad.safetensors: not a readable safetensors file"), "{err}");
    }

    #[test]
    fn a_place_that_cannot_be_written_is_named() {
        let dir = crate::scratch("unwritable");
        for path in [dir.join("missing/model.safetensors"), dir.join("missing/params.npz")] {
            let named = [("w".to_string(), Tensor::ones([2], (tch::Kind::Float, tch::Device::Cpu)))];
            let err = match path.extension().unwrap().to_str() {
                Some("npz") => save_npz(&named, &path),
                _ => save_tensors(&named, &path),
            };
            let err = err.unwrap_err().to_string();
            assert_eq!(err, format!("{}: No such file or directory (os error 2)", path.display()));
        }
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "nothing written");
    }
}
