//! A diffusers component on disk: `<pipeline>/model_index.json` names the component's class,
//! `<pipeline>/<component>/config.json` its architecture and
//! `<pipeline>/<component>/diffusion_pytorch_model.safetensors` its weights by module path.
//! Where only the half-precision variant `diffusion_pytorch_model.fp16.safetensors` exists
//! (as many hub repositories ship it), that file is used and its values are converted to the
//! VarStore's precision as they are copied. Loading is strict: every parameter must be in the
//! file with its shape, and every key of the file must be used.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;
use tch::nn::VarStore;
use tch::Tensor;

use crate::{Error, Result};

/// The weights file diffusers' `save_pretrained` writes.
pub const WEIGHTS: &str = "diffusion_pytorch_model.safetensors";
/// The half-precision variant, used where [`WEIGHTS`] is absent.
pub const WEIGHTS_FP16: &str = "diffusion_pytorch_model.fp16.safetensors";
/// A component's configuration.
pub const CONFIG: &str = "config.json";

/// The two files of one component.
#[derive(Clone, Debug, PartialEq)]
pub struct ComponentFiles {
    /// `config.json`.
    pub config: PathBuf,
    /// The safetensors weights (plain, or the fp16 variant where the plain one is absent).
    pub weights: PathBuf,
}

impl ComponentFiles {
    /// The files of the component folder `dir` (e.g. `sd15/unet`); a missing file is an error
    /// naming it.
    pub fn in_dir(dir: &Path) -> Result<ComponentFiles> {
        let missing = |path: PathBuf, msg: &str| Error::Format { path, msg: msg.into() };
        let config = dir.join(CONFIG);
        if !config.is_file() {
            return Err(missing(config, "missing: a diffusers component folder holds its config.json"));
        }
        let (plain, half) = (dir.join(WEIGHTS), dir.join(WEIGHTS_FP16));
        let weights = match (plain.is_file(), half.is_file()) {
            (true, _) => plain,
            (false, true) => half,
            (false, false) => return Err(missing(plain, &format!("missing, and so is {WEIGHTS_FP16}"))),
        };
        Ok(ComponentFiles { config, weights })
    }

    /// The files of `component` in the pipeline folder `root`, after checking that
    /// `root/model_index.json` lists it as diffusers' `class`.
    pub fn in_pipeline(root: &Path, component: &str, class: &str) -> Result<ComponentFiles> {
        crate::config::check_model_index(&root.join("model_index.json"), component, class)?;
        Self::in_dir(&root.join(component))
    }
}

/// Fills every variable of `vs` from the safetensors file at `path`. `rename` maps a file key
/// to the variable's name where they differ (`None`: same name); a renamed tensor stored as a
/// 1x1 convolution `[out, in, 1, 1]` fills a linear weight `[out, in]`. A missing key, a shape
/// mismatch (both shapes named), two keys renamed to one, or keys no variable uses are errors
/// naming the file and the keys.
pub fn load_into(vs: &VarStore, path: &Path, rename: impl Fn(&str) -> Option<String>) -> Result<()> {
    let bad = |msg: String| Error::Format { path: path.to_path_buf(), msg };
    let vars = vs.variables();
    let mut file: HashMap<String, Tensor> = HashMap::new();
    for (key, tensor) in data::checkpoint::read_tensors(path)? {
        let (name, tensor) = match rename(&key) {
            Some(name) => {
                let tensor = match vars.get(&name) {
                    Some(v) if v.dim() == 2 && tensor.size() == [v.size(), vec![1, 1]].concat() => {
                        tensor.flatten(1, -1)
                    }
                    _ => tensor,
                };
                (name, tensor)
            }
            None => (key.clone(), tensor),
        };
        if file.insert(name.clone(), tensor).is_some() {
            return Err(bad(format!("two keys give parameter {name} (one of them {key})")));
        }
    }
    let mut targets: Vec<(String, Tensor)> = vars.into_iter().collect();
    targets.sort_by(|a, b| a.0.cmp(&b.0));
    data::checkpoint::copy_into(&targets, &mut file, path)?;
    if !file.is_empty() {
        let mut extra: Vec<String> = file.into_keys().collect();
        extra.sort();
        let shown = extra.iter().take(10).cloned().collect::<Vec<_>>().join(", ");
        let more = if extra.len() > 10 { format!(" and {} more", extra.len() - 10) } else { String::new() };
        return Err(bad(format!("{} unexpected keys: {shown}{more}", extra.len())));
    }
    Ok(())
}

/// Writes a component folder as diffusers' `save_pretrained` does: `dir/config.json` (the
/// config as read, with `_class_name` set to `class`) and `dir/`[`WEIGHTS`] holding every
/// variable of `vs` in float32. Both files are written through temporary files and renamed.
pub fn save_component<C: Serialize>(vs: &VarStore, config: &C, class: &str, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
    let path = dir.join(CONFIG);
    let bad = |msg: String| Error::Format { path: path.clone(), msg };
    let mut json = serde_json::to_value(config).map_err(|e| bad(e.to_string()))?;
    let obj = json.as_object_mut().ok_or_else(|| bad("config is not a JSON object".into()))?;
    obj.insert("_class_name".into(), Value::from(class));
    data::write_atomic(&path, |w| serde_json::to_writer_pretty(w, &json).map_err(|e| bad(e.to_string())))?;
    let named: Vec<(String, Tensor)> =
        vs.variables().into_iter().map(|(k, v)| (k, v.to_kind(tch::Kind::Float))).collect();
    data::checkpoint::save_tensors(&named, &dir.join(WEIGHTS))?;
    Ok(())
}
