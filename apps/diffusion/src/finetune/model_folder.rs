//! Writing the fine-tuned pipeline: the base folder with the UNet's weights replaced, staged
//! and renamed into place so a crash never leaves a half-written `model/`.
use std::path::{Path, PathBuf};

use tch::Tensor;

use crate::{Error, Result};

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

/// Writes `out/model/`: the base folder with the UNet replaced by `weights` (fp32, diffusers'
/// names), through a staging folder renamed into place.
pub fn save_model(base: &Path, weights: &[(String, Tensor)], out: &Path) -> Result<PathBuf> {
    let target = out.join("model");
    let staging = out.join(format!(".model.staging-{}", std::process::id()));
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    let _ = std::fs::remove_dir_all(&staging);
    let result = (|| -> Result<()> {
        for entry in std::fs::read_dir(base).map_err(io(base))? {
            let entry = entry.map_err(io(base))?;
            let name = entry.file_name();
            let to = staging.join(&name);
            if name == "unet" {
                continue;
            }
            match entry.file_type().map_err(io(&entry.path()))?.is_dir() {
                true => copy_tree(&entry.path(), &to).map_err(io(&to))?,
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
        let old = out.join(format!(".model.old-{}", std::process::id()));
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
