//! Writing the fine-tuned pipeline: the base folder with the UNet's weights replaced, staged
//! and renamed into place so a crash never leaves a half-written `model/`.
use std::path::{Path, PathBuf};

use tch::Tensor;

use crate::{Error, Result};

/// An I/O error's mapping, naming `path`.
fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

/// Copies a file tree (the components that fine-tuning does not change).
fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), target)?;
        }
    }
    Ok(())
}

/// The staging folder a save writes, and where it moves the previous `model/` while it swaps
/// the two (one run writes an `--out` at a time, so the names are fixed: a run killed midway is
/// recovered by the next, see [`recover`]).
const STAGING: &str = ".model.staging";
const OLD: &str = ".model.old";

/// Undoes what a save killed midway left under `out`: its staging folder is removed, and a
/// previous model it had moved aside goes back to `model/` if that is missing (a kill between
/// the swap's two renames), else is removed. Names with a suffix are earlier versions'
/// (`.model.staging-<pid>`).
fn recover(out: &Path, target: &Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(out) else { return Ok(()) };
    let mut entries: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if !path.is_dir() {
            continue;
        }
        if name.starts_with(STAGING) {
            std::fs::remove_dir_all(&path).map_err(io(&path))?;
        } else if name.starts_with(OLD) {
            match target.exists() {
                false => std::fs::rename(&path, target).map_err(io(target))?,
                true => std::fs::remove_dir_all(&path).map_err(io(&path))?,
            }
        }
    }
    Ok(())
}

/// Gives a component copied from the base folder plain fp32 weights where the base has only
/// the fp16 variant's (single or sharded): `save_pretrained` writes plain names, which
/// `from_pretrained` finds without `variant="fp16"`, and the UNet beside it is fp32, so a
/// component left in fp16 would fail its first call in a pipeline loaded as saved.
fn plain_names(component: &Path) -> Result<()> {
    use crate::weights::{weight_names, DIFFUSERS_STEM, TRANSFORMERS_STEM};
    for stem in [DIFFUSERS_STEM, TRANSFORMERS_STEM] {
        let [plain, plain_index, variant, variant_index] = weight_names(stem).map(|n| component.join(n));
        if plain.exists() || plain_index.exists() {
            continue;
        }
        let Some(from) = [&variant, &variant_index].into_iter().find(|p| p.is_file()) else { continue };
        let mut tensors: Vec<(String, Tensor)> = crate::weights::read(from)?
            .into_iter()
            .map(|(k, t)| {
                let t = if t.is_floating_point() { t.to_kind(tch::Kind::Float) } else { t };
                (k, t)
            })
            .collect();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        data::checkpoint::save_tensors(&tensors, &plain)?;
        remove_variant(component, from)?;
    }
    Ok(())
}

/// Removes the variant weights `file` (and, for a shards' index, the shards it names) from the
/// staging copy of a component.
fn remove_variant(component: &Path, file: &Path) -> Result<()> {
    if file.extension().is_some_and(|e| e == "json") {
        let shards: std::collections::BTreeSet<String> = crate::weights::read_index(file)?.into_values().collect();
        for shard in shards {
            let path = component.join(shard);
            std::fs::remove_file(&path).map_err(io(&path))?;
        }
    }
    std::fs::remove_file(file).map_err(io(file))
}

/// Writes `out/model/`: the base folder with the UNet replaced by `weights` (fp32, diffusers'
/// names), through a staging folder renamed into place; components kept from the base have
/// plain weight names (see `plain_names`).
pub fn save_model(base: &Path, weights: &[(String, Tensor)], out: &Path) -> Result<PathBuf> {
    let target = out.join("model");
    let staging = out.join(STAGING);
    recover(out, &target)?;
    let _live = data::temporaries::Temporary::new(&staging);
    let result = (|| -> Result<()> {
        for entry in std::fs::read_dir(base).map_err(io(base))? {
            let entry = entry.map_err(io(base))?;
            let name = entry.file_name();
            let to = staging.join(&name);
            if name == "unet" {
                continue;
            }
            match entry.file_type().map_err(io(&entry.path()))?.is_dir() {
                true => {
                    copy_tree(&entry.path(), &to).map_err(io(&to))?;
                    plain_names(&to)?;
                }
                false => {
                    std::fs::create_dir_all(&staging).map_err(io(&staging))?;
                    std::fs::copy(entry.path(), &to).map_err(io(&to))?;
                }
            }
        }
        let unet = staging.join("unet");
        std::fs::create_dir_all(&unet).map_err(io(&unet))?;
        std::fs::copy(base.join("unet").join("config.json"), unet.join("config.json")).map_err(io(&unet))?;
        data::checkpoint::save_tensors(weights, &unet.join(crate::weights::WEIGHTS))?;
        let old = out.join(OLD);
        if target.exists() {
            std::fs::rename(&target, &old).map_err(io(&target))?;
        }
        std::fs::rename(&staging, &target).map_err(io(&target))?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result.map(|()| target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_save_killed_midway_is_undone_by_the_next() {
        let out = suite_tests::scratch("diffusion", "model-folder");
        let target = out.join("model");
        // Killed between the swap's renames: the previous model is aside, a staging folder half written.
        for dir in [".model.old-17", ".model.staging-17/unet"] {
            std::fs::create_dir_all(out.join(dir)).unwrap();
        }
        std::fs::write(out.join(".model.old-17/model_index.json"), "{}").unwrap();
        recover(&out, &target).unwrap();
        assert!(target.join("model_index.json").exists(), "the previous model is back");
        // Killed after the swap: the previous model is removed, the new one kept.
        std::fs::create_dir_all(out.join(OLD)).unwrap();
        recover(&out, &target).unwrap();
        let left: Vec<String> =
            std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        assert_eq!(left, ["model"]);
        assert!(target.join("model_index.json").exists());
    }
}
