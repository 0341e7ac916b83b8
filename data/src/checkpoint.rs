//! Model weights as safetensors files, by parameter name (timm and diffusers key names fall
//! out of the module paths). Loading checks every key and shape; saving is atomic.
use std::collections::HashMap;
use std::path::Path;

use tch::nn::VarStore;
use tch::Tensor;

use crate::{Error, Result};

/// Every tensor of the safetensors file at `path`, by name; an unreadable file is an error
/// naming it.
pub fn read_tensors(path: &Path) -> Result<HashMap<String, Tensor>> {
    let tensors = Tensor::read_safetensors(path).map_err(|e| Error::Format {
        path: path.to_path_buf(),
        msg: format!("not a readable safetensors file: {e}"),
    })?;
    Ok(tensors.into_iter().collect())
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

/// Runs `write` on a staging path beside `path`, syncs it, then renames it into place and syncs
/// the directory, so the target is durably either the old file or the whole new one (tch
/// writes only to paths); the staging file is removed on failure.
fn staged(path: &Path, write: impl FnOnce(&Path) -> std::result::Result<(), tch::TchError>) -> Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let staging =
        dir.join(format!(".{}.staging-{}", path.file_name().unwrap_or_default().to_string_lossy(), std::process::id()));
    let _live = crate::temporaries::Temporary::new(&staging);
    let result =
        write(&staging).map_err(|e| Error::Format { path: path.to_path_buf(), msg: e.to_string() }).and_then(|()| {
            let io = |source| Error::Io { path: staging.clone(), source };
            std::fs::File::open(&staging).and_then(|f| f.sync_all()).map_err(io)?;
            std::fs::rename(&staging, path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
            crate::sync_dir(dir)
        });
    if result.is_err() {
        let _ = std::fs::remove_file(&staging);
    }
    result
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
        let dir = std::env::temp_dir().join(format!("ckpt-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
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
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
