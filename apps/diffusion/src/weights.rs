//! A diffusers component on disk: `<pipeline>/model_index.json` names the component's class,
//! `<pipeline>/<component>/config.json` its architecture and
//! `<pipeline>/<component>/diffusion_pytorch_model.safetensors` its weights by module path
//! (`model.safetensors` for the transformers text encoders). Where only the half-precision
//! variant `<stem>.fp16.safetensors` exists (as many hub repositories ship it), that file is
//! used, its values converted to the VarStore's precision as they are copied; weights saved in
//! shards are read through their index (`<stem>.safetensors.index.json`, or its fp16 variant
//! `<stem>.safetensors.index.fp16.json`), as `from_pretrained` reads them. Loading is strict:
//! every parameter must be in the files with its shape, and every key of the files must be
//! used.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::Value;
use tch::nn::VarStore;
use tch::Tensor;

use crate::{Error, Result};

/// The weights file diffusers' `save_pretrained` writes.
pub const WEIGHTS: &str = "diffusion_pytorch_model.safetensors";
/// The stem of a diffusers model's weight files.
pub const DIFFUSERS_STEM: &str = "diffusion_pytorch_model";
/// The stem of a transformers model's weight files (the text encoders).
pub const TRANSFORMERS_STEM: &str = "model";
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
    /// The files of the diffusers component folder `dir` (e.g. `sd15/unet`); a missing file is
    /// an error naming it.
    pub fn in_dir(dir: &Path) -> Result<ComponentFiles> {
        Self::with_stem(dir, DIFFUSERS_STEM)
    }

    /// The files of the component folder `dir` whose weight files are named `<stem>.*`, taking
    /// the first that exists of: the plain file, the shards' index, the fp16 variant, the fp16
    /// shards' index (plain weights first in either layout, as `from_pretrained` without a
    /// variant reads them).
    pub fn with_stem(dir: &Path, stem: &str) -> Result<ComponentFiles> {
        let missing = |path: PathBuf, msg: String| Error::Format { path, msg };
        let config = dir.join(CONFIG);
        if !config.is_file() {
            return Err(missing(config, "missing: a diffusers component folder holds its config.json".into()));
        }
        let names = weight_names(stem);
        if let Some(weights) = names.iter().map(|n| dir.join(n)).find(|p| p.is_file()) {
            return Ok(ComponentFiles { config, weights });
        }
        let pickle = [format!("{stem}.bin"), format!("{stem}.fp16.bin")].into_iter().find(|n| dir.join(n).is_file());
        let hint = match pickle {
            Some(bin) => format!("; {bin} is there, a PyTorch pickle, which is not read: save it as safetensors"),
            None => String::new(),
        };
        Err(missing(dir.join(&names[0]), format!("missing, and so are {}{hint}", names[1..].join(", "))))
    }

    /// The files of `component` in the pipeline folder `root`, after checking that
    /// `root/model_index.json` lists it as diffusers' `class`.
    pub fn in_pipeline(root: &Path, component: &str, class: &str) -> Result<ComponentFiles> {
        crate::config::check_model_index(&root.join("model_index.json"), component, class)?;
        Self::in_dir(&root.join(component))
    }
}

/// The weight files of a component whose files are named `<stem>.*`, in the order they are
/// looked for: plain, plain shards' index, fp16 variant, fp16 variant shards' index.
pub fn weight_names(stem: &str) -> [String; 4] {
    [
        format!("{stem}.safetensors"),
        format!("{stem}.safetensors.index.json"),
        format!("{stem}.fp16.safetensors"),
        format!("{stem}.safetensors.index.fp16.json"),
    ]
}

/// A shards' index (`*.safetensors.index*.json`): each key's shard, a file name beside the
/// index (anything else is an error naming the index).
pub fn read_index(path: &Path) -> Result<std::collections::BTreeMap<String, String>> {
    let bad = |msg: String| Error::Format { path: path.to_path_buf(), msg };
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    #[derive(serde::Deserialize)]
    struct Index {
        weight_map: std::collections::BTreeMap<String, String>,
    }
    let index: Index = serde_json::from_str(&text).map_err(|e| bad(format!("not a shards' index: {e}")))?;
    if let Some(shard) =
        index.weight_map.values().find(|s| Path::new(s).file_name() != Some(std::ffi::OsStr::new(s.as_str())))
    {
        return Err(bad(format!("shard {shard:?} is not a file name beside the index")));
    }
    Ok(index.weight_map)
}

/// Every tensor of a component's weights, by key: the safetensors file at `path`, or, for a
/// shards' index (`*.index*.json`), of the shards it names beside it. Each key of the index
/// must be in its shard and each shard's keys in the index; a mismatch is an error naming the
/// index, the shard and the key.
pub fn read(path: &Path) -> Result<HashMap<String, Tensor>> {
    if path.extension().is_none_or(|e| e != "json") {
        return Ok(data::checkpoint::read_tensors(path)?);
    }
    let bad = |msg: String| Error::Format { path: path.to_path_buf(), msg };
    let mut by_shard: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for (key, shard) in read_index(path)? {
        by_shard.entry(shard).or_default().push(key);
    }
    let folder = path.parent().unwrap_or(Path::new("."));
    let mut all = HashMap::new();
    for (shard, keys) in by_shard {
        let mut tensors = data::checkpoint::read_tensors(&folder.join(&shard))?;
        for key in keys {
            let t = tensors.remove(&key).ok_or_else(|| bad(format!("key {key} is not in its shard {shard}")))?;
            all.insert(key, t);
        }
        if let Some(extra) = tensors.keys().min() {
            return Err(bad(format!("key {extra} of shard {shard} is not in the index")));
        }
    }
    Ok(all)
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
    for (key, tensor) in read(path)? {
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
