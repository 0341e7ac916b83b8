//! AlphaFold-Multimer's presets as AlphaFold 2.3 runs them (`model/config.py`'s
//! `CONFIG_MULTIMER` and `CONFIG_DIFFS`, `run_alphafold.py --model_preset multimer`): the five
//! models of each release (`model_N_multimer` v1, `_v2`, `_v3`), recognised from their file
//! names (`params_model_N_multimer_v3.npz`) or from their arrays (the chain-relative position
//! encoding only Multimer has; v3's fused triangle-multiplication projection), the sizes and
//! run settings each implies, and the runs of a prediction: every model
//! `--num-multimer-predictions-per-model` times (5), each with its own seed.
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use anyhow::bail;

use crate::model::keys::{FUSED_TRIANGLE_PROJECTION as V3_KEY, MULTIMER_RELATIVE_ENCODING as MULTIMER_KEY};

/// Predictions per model by default (`--num_multimer_predictions_per_model`).
pub const PREDICTIONS_PER_MODEL: usize = 5;
/// Recycling passes after the first, at most (`CONFIG_MULTIMER`'s `model.num_recycle`).
pub const NUM_RECYCLE: usize = 20;
/// Recycling stops once the CA distances move less than this (Å; `recycle_early_stop_tolerance`).
pub const RECYCLE_EARLY_STOP_TOLERANCE: f64 = 0.5;

/// The parameter release.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Version {
    /// `model_N_multimer` (AlphaFold 2.1).
    V1,
    /// `model_N_multimer_v2` (2.2).
    V2,
    /// `model_N_multimer_v3` (2.3).
    V3,
}

/// One of AlphaFold-Multimer's fifteen parameter sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MultimerPreset {
    /// 1 to 5.
    pub model: u8,
    /// The release.
    pub version: Version,
}

/// What a parameter file's arrays say of it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Network {
    /// AlphaFold's monomer network.
    Monomer,
    /// AlphaFold-Multimer's: v3, or v1/v2 (their arrays are alike).
    Multimer {
        /// v3's fused projections.
        v3: bool,
    },
}

impl Network {
    /// The network of a parameter file with these array names.
    pub fn of_arrays<'a>(names: impl IntoIterator<Item = &'a str>) -> Network {
        let (mut multimer, mut v3) = (false, false);
        for n in names {
            multimer |= n == MULTIMER_KEY;
            v3 |= n == V3_KEY;
        }
        match multimer {
            true => Network::Multimer { v3 },
            false => Network::Monomer,
        }
    }
}

impl MultimerPreset {
    /// The five models of the release AlphaFold's `--model_preset multimer` runs (v3).
    pub fn all(version: Version) -> [MultimerPreset; 5] {
        std::array::from_fn(|i| MultimerPreset { model: i as u8 + 1, version })
    }

    /// The preset of a parameter file under its release name (`params_model_2_multimer_v3.npz`,
    /// or its `.safetensors` conversion); `None` for any other name.
    pub fn from_params_path(path: &Path) -> Option<MultimerPreset> {
        path.file_stem()?.to_str()?.strip_prefix("params_")?.parse().ok()
    }

    /// Checks the preset against a file's arrays (`Network::of_arrays`); the error says what
    /// differs.
    pub fn check(self, network: Network) -> Result<(), String> {
        match network {
            Network::Monomer => Err(format!("{self} is AlphaFold-Multimer's; these are monomer parameters")),
            Network::Multimer { v3 } if v3 != (self.version == Version::V3) => Err(format!(
                "{self} {} v3's fused triangle-multiplication projections; these parameters {}",
                if v3 { "lacks" } else { "has" },
                if v3 { "have them (v3)" } else { "do not (v1 or v2)" }
            )),
            Network::Multimer { .. } => Ok(()),
        }
    }

    /// MSA rows sampled as cluster centres (`embeddings_and_evoformer.num_msa`): 508 in v3,
    /// 252 in v1 and v2.
    pub fn num_msa(self) -> usize {
        match self.version {
            Version::V3 => 508,
            _ => 252,
        }
    }

    /// Extra-MSA rows (`num_extra_msa`): 2048 for v3's models 1 to 3, else 1152.
    pub fn num_extra_msa(self) -> usize {
        match (self.version, self.model) {
            (Version::V3, 1..=3) => 2048,
            _ => 1152,
        }
    }

    /// Whether the triangle multiplications' left and right projections are one fused array
    /// (`fuse_projection_weights`: v3 only).
    pub fn fused_projections(self) -> bool {
        self.version == Version::V3
    }
}

impl FromStr for MultimerPreset {
    type Err = String;

    fn from_str(s: &str) -> Result<MultimerPreset, String> {
        let bad = || {
            format!("{s:?} is not an AlphaFold-Multimer model: expected model_1_multimer_v3 ... model_5_multimer_v3 (or _v2, or no suffix for v1)")
        };
        let rest = s.strip_prefix("model_").ok_or_else(bad)?;
        let (number, version) = rest.split_once("_multimer").ok_or_else(bad)?;
        let version = match version {
            "" => Version::V1,
            "_v2" => Version::V2,
            "_v3" => Version::V3,
            _ => return Err(bad()),
        };
        match number {
            "1" | "2" | "3" | "4" | "5" => Ok(MultimerPreset { model: number.as_bytes()[0] - b'0', version }),
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for MultimerPreset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let suffix = match self.version {
            Version::V1 => "",
            Version::V2 => "_v2",
            Version::V3 => "_v3",
        };
        write!(f, "model_{}_multimer{suffix}", self.model)
    }
}

/// One prediction of a multimer run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// `<model>_pred_<i>`, its output files' name.
    pub name: String,
    /// The parameter set.
    pub preset: MultimerPreset,
    /// The seed of its feature sampling and network (`model_random_seed`).
    pub seed: u64,
}

/// The settings of a multimer prediction: AlphaFold 2.3's, each overridable.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// Predictions per model, each with its own seed.
    pub predictions_per_model: usize,
    /// Recycling passes after the first, at most.
    pub num_recycle: usize,
    /// Stop recycling once the CA distances moved less than this (Å).
    pub recycle_early_stop_tolerance: f64,
}

impl Settings {
    /// AlphaFold's defaults where no override is given.
    pub fn new(predictions: Option<usize>, num_recycle: Option<usize>, tolerance: Option<f64>) -> Settings {
        Settings {
            predictions_per_model: predictions.unwrap_or(PREDICTIONS_PER_MODEL),
            num_recycle: num_recycle.unwrap_or(NUM_RECYCLE),
            recycle_early_stop_tolerance: tolerance.unwrap_or(RECYCLE_EARLY_STOP_TOLERANCE),
        }
    }

    /// Every model `predictions_per_model` times, in `run_alphafold.py`'s order and seeds:
    /// run k of n gets `k + seed * n` (`model_random_seed`); a seed that overflows is an error
    /// naming `--seed`.
    pub fn runs(&self, models: &[MultimerPreset], seed: u64) -> anyhow::Result<Vec<Run>> {
        let n = (models.len() * self.predictions_per_model) as u64;
        let Some(base) = seed.checked_mul(n).filter(|b| b.checked_add(n).is_some()) else {
            bail!("--seed {seed} times {n} runs does not fit in 64 bits: give a smaller seed");
        };
        let runs = models.iter().flat_map(|&preset| (0..self.predictions_per_model).map(move |i| (preset, i)));
        Ok(runs
            .enumerate()
            .map(|(k, (preset, i))| Run { name: format!("{preset}_pred_{i}"), preset, seed: base + k as u64 })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_files_are_recognised() {
        for v in [Version::V1, Version::V2, Version::V3] {
            for p in MultimerPreset::all(v) {
                assert_eq!(p.to_string().parse::<MultimerPreset>(), Ok(p));
            }
        }
        let p = MultimerPreset::from_params_path(Path::new("d/params_model_4_multimer_v3.npz")).unwrap();
        assert_eq!((p.model, p.version), (4, Version::V3));
        let p = MultimerPreset::from_params_path(Path::new("params_model_1_multimer.safetensors")).unwrap();
        assert_eq!(p.version, Version::V1);
        for other in ["params_model_1_ptm.npz", "params_model_6_multimer_v3.npz", "params_model_1_multimer_v4.npz"] {
            assert_eq!(MultimerPreset::from_params_path(Path::new(other)), None, "{other}");
        }
        assert!("model_1_multimer_v9".parse::<MultimerPreset>().unwrap_err().contains("model_1_multimer_v9"));
    }

    #[test]
    fn sizes_follow_config_diffs_and_arrays_tell_the_network() {
        let sizes = |v| MultimerPreset::all(v).map(|p| (p.num_msa(), p.num_extra_msa(), p.fused_projections()));
        assert_eq!(
            sizes(Version::V3),
            [(508, 2048, true), (508, 2048, true), (508, 2048, true), (508, 1152, true), (508, 1152, true)]
        );
        assert_eq!(sizes(Version::V2), [(252, 1152, false); 5]);
        assert_eq!(sizes(Version::V1), sizes(Version::V2));

        let monomer = ["alphafold/alphafold_iteration/evoformer/pair_activiations//weights"];
        assert_eq!(Network::of_arrays(monomer), Network::Monomer);
        assert_eq!(Network::of_arrays([MULTIMER_KEY]), Network::Multimer { v3: false });
        let v3 = Network::of_arrays([MULTIMER_KEY, V3_KEY]);
        assert_eq!(v3, Network::Multimer { v3: true });
        let p: MultimerPreset = "model_1_multimer_v3".parse().unwrap();
        assert_eq!(p.check(v3), Ok(()));
        assert!(p.check(Network::Multimer { v3: false }).unwrap_err().contains("v1 or v2"));
        assert!(p.check(Network::Monomer).unwrap_err().contains("monomer parameters"));
    }

    #[test]
    fn runs_take_alphafolds_names_and_seeds_and_overrides() {
        let s = Settings::new(None, None, None);
        assert_eq!((s.predictions_per_model, s.num_recycle, s.recycle_early_stop_tolerance), (5, 20, 0.5));
        let runs = s.runs(&MultimerPreset::all(Version::V3), 7).unwrap();
        assert_eq!(runs.len(), 25);
        assert_eq!((runs[0].name.as_str(), runs[0].seed), ("model_1_multimer_v3_pred_0", 175));
        assert_eq!((runs[24].name.as_str(), runs[24].seed), ("model_5_multimer_v3_pred_4", 199));
        let s = Settings::new(Some(2), Some(3), Some(0.0));
        let runs = s.runs(&MultimerPreset::all(Version::V2)[..2], 0).unwrap();
        let names: Vec<(&str, u64)> = runs.iter().map(|r| (r.name.as_str(), r.seed)).collect();
        assert_eq!(
            names,
            [
                ("model_1_multimer_v2_pred_0", 0),
                ("model_1_multimer_v2_pred_1", 1),
                ("model_2_multimer_v2_pred_0", 2),
                ("model_2_multimer_v2_pred_1", 3)
            ]
        );
        assert!(s.runs(&[runs[0].preset], u64::MAX / 2).unwrap_err().to_string().contains("--seed"));
    }
}
