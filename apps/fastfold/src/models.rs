//! Which parameter sets a prediction runs: `--params` names one file, or a directory holding
//! AlphaFold's release files (`params_model_N[_ptm].npz`, or their `.safetensors`
//! conversions), of which `--models` picks some, as `run_alphafold.py`'s model presets do.
//! AlphaFold-Multimer's files (`params_model_N_multimer_v3.npz`) are picked by the same
//! `--models` entries (`predict::complex`).
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context};

use crate::multimer::preset::MultimerPreset;
use crate::preset::Preset;

/// One `--models` entry: a model number (1 to 5) or a preset name (`model_3`, `model_3_ptm`,
/// or AlphaFold-Multimer's `model_3_multimer_v3`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelChoice {
    /// `N`: `model_N_ptm` where the directory has it (it adds pTM and PAE), else `model_N`.
    Number(u8),
    /// One set by its preset name.
    Named(Preset),
    /// One AlphaFold-Multimer set by its name.
    Multimer(MultimerPreset),
}

impl FromStr for ModelChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            n @ ("1" | "2" | "3" | "4" | "5") => Ok(ModelChoice::Number(n.as_bytes()[0] - b'0')),
            name => name.parse().map(ModelChoice::Named).or_else(|_| name.parse().map(ModelChoice::Multimer)).map_err(
                |_| {
                    format!(
                        "{s:?} is not a model: expected a number 1 to 5 or a preset name like model_1_ptm or \
                         model_1_multimer_v3"
                    )
                },
            ),
        }
    }
}

impl fmt::Display for ModelChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelChoice::Number(n) => write!(f, "{n}"),
            ModelChoice::Named(p) => write!(f, "{p}"),
            ModelChoice::Multimer(p) => write!(f, "{p}"),
        }
    }
}

/// One parameter set to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFile {
    /// AlphaFold's model name (`model_1_ptm`), or for a file without a release name its stem
    /// less `params_`: the name of its output files and its key in `ranking_debug.json`.
    pub name: String,
    /// The parameter file.
    pub path: PathBuf,
    /// The preset its release name gives, if any.
    pub preset: Option<Preset>,
}

impl ModelFile {
    fn of(path: PathBuf) -> ModelFile {
        let preset = Preset::from_params_path(&path);
        let name = match preset {
            Some(p) => p.to_string(),
            None => {
                let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
                stem.strip_prefix("params_").map(str::to_string).unwrap_or(stem)
            }
        };
        ModelFile { name, path, preset }
    }
}

/// The sets to run, in order: the `--params` file, or from a `--params` directory the
/// `--models` chosen (default: every number 1 to 5 the directory has).
pub fn resolve(params: &Path, models: Option<&[ModelChoice]>) -> anyhow::Result<Vec<ModelFile>> {
    if !params.is_dir() {
        no_choice_of_a_file(params, models)?;
        if !params.exists() {
            bail!("--params {}: no such file or directory", params.display());
        }
        return Ok(vec![ModelFile::of(params.to_path_buf())]);
    }
    let found = release_files(params)?;
    if found.is_empty() {
        bail!(
            "--params {}: no AlphaFold parameter files (params_model_N[_ptm].npz or .safetensors) in the directory",
            params.display()
        );
    }
    let numbers: Vec<ModelChoice> = (1..=5).map(ModelChoice::Number).collect();
    let (choices, explicit) = match models {
        Some(m) => (m, true),
        None => (numbers.as_slice(), false),
    };
    let mut picked: Vec<ModelFile> = Vec::new();
    for &choice in choices {
        let preset = match choice {
            ModelChoice::Named(p) => Some(p).filter(|p| found.contains_key(&p.to_string())),
            ModelChoice::Multimer(p) => {
                bail!("--models {p} is AlphaFold-Multimer's, but --params {} holds monomer models", params.display())
            }
            ModelChoice::Number(n) => [format!("model_{n}_ptm"), format!("model_{n}")]
                .iter()
                .find(|name| found.contains_key(*name))
                .and_then(|name| name.parse().ok()),
        };
        let Some(preset) = preset else {
            if explicit {
                let have: Vec<&String> = found.keys().collect();
                bail!("--models {choice}: {} has no parameter file for it (it has {have:?})", params.display());
            }
            continue;
        };
        let file = ModelFile::of(found[&preset.to_string()].clone());
        if picked.iter().any(|m| m.name == file.name) {
            bail!("--models names {} twice", file.name);
        }
        picked.push(file);
    }
    Ok(picked)
}

/// An error naming `--models` when `params` is a file (there is nothing to pick from).
pub(crate) fn no_choice_of_a_file(params: &Path, models: Option<&[ModelChoice]>) -> anyhow::Result<()> {
    if let Some(m) = models.filter(|_| !params.is_dir()) {
        let m: Vec<String> = m.iter().map(ToString::to_string).collect();
        bail!("--models {} picks files from a directory, but --params {} is a file", m.join(","), params.display());
    }
    Ok(())
}

/// The directory's release-named parameter files by preset name (`.npz` over `.safetensors`
/// where both exist).
fn release_files(dir: &Path) -> anyhow::Result<BTreeMap<String, PathBuf>> {
    let mut found = BTreeMap::new();
    let entries = std::fs::read_dir(dir).with_context(|| format!("--params {}", dir.display()))?;
    for entry in entries {
        let path = entry.with_context(|| format!("--params {}", dir.display()))?.path();
        let Some(preset) = Preset::from_params_path(&path) else { continue };
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !matches!(ext, "npz" | "safetensors") {
            continue;
        }
        let name = preset.to_string();
        let npz_already = found.get(&name).is_some_and(|p: &PathBuf| p.extension().is_some_and(|e| e == "npz"));
        if !npz_already {
            found.insert(name, path);
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str, files: &[&str]) -> suite_tests::Scratch {
        let d = suite_tests::scratch("fastfold-models", name);
        for f in files {
            std::fs::write(d.join(f), b"").unwrap();
        }
        d
    }

    fn names(m: &[ModelFile]) -> Vec<&str> {
        m.iter().map(|m| m.name.as_str()).collect()
    }

    #[test]
    fn numbers_take_the_ptm_set_where_there_is_one_and_names_pick_exactly() {
        let d = scratch(
            "pick",
            &["params_model_1.npz", "params_model_1_ptm.npz", "params_model_3.safetensors", "notes.txt", "x.npz"],
        );
        assert_eq!(names(&resolve(&d, None).unwrap()), ["model_1_ptm", "model_3"]);
        let choices: Vec<ModelChoice> = ["3", "model_1"].iter().map(|s| s.parse().unwrap()).collect();
        let picked = resolve(&d, Some(&choices)).unwrap();
        assert_eq!(names(&picked), ["model_3", "model_1"]);
        assert_eq!(picked[0].path, d.join("params_model_3.safetensors"));

        let err = resolve(&d, Some(&["2".parse().unwrap()])).unwrap_err().to_string();
        assert!(err.contains("--models 2:") && err.contains("model_1_ptm"), "{err}");
        let err = "6".parse::<ModelChoice>().unwrap_err();
        assert!(err.contains("\"6\""), "{err}");
        let err = resolve(&scratch("empty", &[]), None).unwrap_err().to_string();
        assert!(err.contains("--params") && err.contains("no AlphaFold parameter files"), "{err}");
    }

    #[test]
    fn a_file_is_one_set_named_by_its_release_name_or_stem() {
        let d = scratch("file", &["params_model_2_ptm.npz", "params_tiny.npz"]);
        assert_eq!(names(&resolve(&d.join("params_model_2_ptm.npz"), None).unwrap()), ["model_2_ptm"]);
        assert_eq!(names(&resolve(&d.join("params_tiny.npz"), None).unwrap()), ["tiny"]);
        let err = resolve(&d.join("params_tiny.npz"), Some(&[ModelChoice::Number(1)])).unwrap_err().to_string();
        assert!(err.contains("--models") && err.contains("is a file"), "{err}");
    }
}
