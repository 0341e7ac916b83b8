//! AlphaFold's monomer presets, `model_1` ... `model_5` and their `_ptm` variants (fine-tuned
//! with the predicted-aligned-error head): the MSA sizes each parameter set was run with
//! (AlphaFold's `CONFIG_DIFFS`) and the modules its parameter file has. Channel sizes and block
//! counts are the same for all ten and are read from the parameter file anyway; what a preset
//! adds is the feature pipeline's row counts, the sizes no shape shows (the structure module's
//! iterations: [`crate::model::PresetSizes`]), and a check that the file is the network named.
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use crate::model::{ModelConfig, PresetSizes};

/// Template slots AlphaFold reserves (`max_templates`).
const MAX_TEMPLATES: usize = 4;

/// One of AlphaFold's ten monomer presets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Preset {
    /// 1 to 5.
    model: u8,
    /// The `_ptm` variant.
    ptm: bool,
}

impl Preset {
    /// The preset of a parameter file under AlphaFold's release name
    /// (`params_model_3_ptm.npz`, or its `.safetensors` conversion); `None` for any other name.
    pub fn from_params_path(path: &Path) -> Option<Preset> {
        let stem = path.file_stem()?.to_str()?;
        stem.strip_prefix("params_")?.parse().ok()
    }

    /// Whether the network embeds templates (`model_1`, `model_2`).
    pub fn templates(self) -> bool {
        self.model <= 2
    }

    /// Whether the network has the predicted-aligned-error head (pTM, PAE).
    pub fn ptm(self) -> bool {
        self.ptm
    }

    /// The sizes no parameter shape shows: AlphaFold's 8 structure-module iterations and
    /// position scale 10, the same in all ten presets (`CONFIG_DIFFS` changes neither).
    pub fn sizes(self) -> PresetSizes {
        PresetSizes::default()
    }

    /// Extra-MSA rows (`data.common.max_extra_msa`): 5120 for models 1, 3 and 4, else 1024.
    pub fn max_extra_msa(self) -> usize {
        match self.model {
            1 | 3 | 4 => 5120,
            _ => 1024,
        }
    }

    /// MSA cluster rows: 512, less the template slots where the templates' torsion-angle rows
    /// join the MSA (`reduce_msa_clusters_by_max_templates`).
    pub fn max_msa_clusters(self) -> usize {
        if self.templates() {
            512 - MAX_TEMPLATES
        } else {
            512
        }
    }

    /// Checks that `config` (read from a parameter file's shapes) is this preset's network;
    /// the error says what differs.
    pub fn check(self, config: &ModelConfig) -> Result<(), String> {
        let parts = [
            ("template embedding", self.templates(), config.templates.is_some()),
            ("predicted-aligned-error head", self.ptm, config.aligned_error_bins.is_some()),
        ];
        for (part, expected, found) in parts {
            if expected != found {
                return Err(match expected {
                    true => format!("{self} has a {part}; these parameters have none"),
                    false => format!("{self} has no {part}; these parameters have one"),
                });
            }
        }
        Ok(())
    }
}

impl FromStr for Preset {
    type Err = String;

    fn from_str(s: &str) -> Result<Preset, String> {
        let bad =
            || format!("{s:?} is not an AlphaFold monomer preset: expected model_1 ... model_5, optionally with _ptm");
        let rest = s.strip_prefix("model_").ok_or_else(bad)?;
        let (number, ptm) = match rest.strip_suffix("_ptm") {
            Some(n) => (n, true),
            None => (rest, false),
        };
        match number {
            "1" | "2" | "3" | "4" | "5" => Ok(Preset { model: number.as_bytes()[0] - b'0', ptm }),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Preset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "model_{}{}", self.model, if self.ptm { "_ptm" } else { "" })
    }
}
