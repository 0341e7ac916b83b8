//! `predict`'s AlphaFold-Multimer options, and what asks for a multimer run: `--model-preset
//! multimer`, or Multimer parameters by their release names (a file, or a directory of only
//! such files).
use std::path::{Path, PathBuf};

use anyhow::bail;

use super::preset::MultimerPreset;

/// AlphaFold's `--model_preset`, where it differs from the parameter files' own word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ModelPreset {
    /// The monomer models (`params_model_N[_ptm]`).
    Monomer,
    /// AlphaFold-Multimer (`params_model_N_multimer_v3`): every FASTA file one complex.
    Multimer,
}

/// AlphaFold-Multimer's options.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct MultimerArgs {
    /// monomer (each FASTA record a query) or multimer (the FASTA file's records one complex);
    /// default: what the --params files are, by name (`params_model_N_multimer_v3.npz`) or
    /// arrays.
    #[arg(long, value_enum)]
    pub model_preset: Option<ModelPreset>,
    /// Predictions per multimer model, each with its own seed (default 5, AlphaFold's).
    #[arg(long, value_parser = engine::parse::count(1..=1000))]
    pub num_multimer_predictions_per_model: Option<usize>,
    /// UniProt (FASTA), searched with jackhmmer for the rows paired across chains (multimer;
    /// default: `<data-dir>/uniprot/uniprot.fasta`).
    #[arg(long)]
    pub uniprot_database_path: Option<PathBuf>,
}

/// Where UniProt is under AlphaFold's data directory (`scripts/download_uniprot.sh`).
pub const UNIPROT: &str = "uniprot/uniprot.fasta";

impl MultimerArgs {
    /// UniProt's FASTA: `--uniprot-database-path`, else under `data_dir`.
    pub fn uniprot(&self, data_dir: Option<&Path>) -> Option<PathBuf> {
        self.uniprot_database_path.clone().or_else(|| data_dir.map(|d| d.join(UNIPROT)))
    }

    /// Whether the options or the `params` path ask for a multimer run (`--model-preset
    /// multimer`, or Multimer release files); an error when `--model-preset monomer` meets
    /// Multimer files, or a multimer option a monomer run.
    pub fn check(&self, params: &Path) -> anyhow::Result<bool> {
        if self.model_preset == Some(ModelPreset::Multimer) {
            return Ok(true);
        }
        if let Some(p) = multimer_params(params) {
            if self.model_preset == Some(ModelPreset::Monomer) {
                bail!("--model-preset monomer, but --params {} is AlphaFold-Multimer's ({p})", params.display());
            }
            return Ok(true);
        }
        let given = [
            ("--num-multimer-predictions-per-model", self.num_multimer_predictions_per_model.is_some()),
            ("--uniprot-database-path", self.uniprot_database_path.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
            bail!("{flag} applies to AlphaFold-Multimer (--model-preset multimer), which these parameters are not");
        }
        Ok(false)
    }
}

/// The Multimer preset `params` names: a file's release name, or the first Multimer release
/// file of a directory that has no monomer one.
fn multimer_params(params: &Path) -> Option<MultimerPreset> {
    if !params.is_dir() {
        return MultimerPreset::from_params_path(params);
    }
    let mut names: Vec<PathBuf> = std::fs::read_dir(params).ok()?.flatten().map(|e| e.path()).collect();
    names.sort();
    if names.iter().any(|p| crate::preset::Preset::from_params_path(p).is_some()) {
        return None;
    }
    names.iter().find_map(|p| MultimerPreset::from_params_path(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multimer_runs_are_recognised_and_options_alone_are_named() {
        let dir = suite_tests::scratch("fastfold-multimer", "args");
        std::fs::write(dir.join("params_model_1_multimer_v3.npz"), b"").unwrap();
        let none = MultimerArgs::default();
        assert!(none.check(&dir.join("params_model_1_multimer_v3.npz")).unwrap());
        assert!(none.check(&dir).unwrap());
        let multimer = MultimerArgs { model_preset: Some(ModelPreset::Multimer), ..Default::default() };
        assert!(multimer.check(Path::new("params_model_1.npz")).unwrap());
        let monomer = MultimerArgs { model_preset: Some(ModelPreset::Monomer), ..Default::default() };
        let err = monomer.check(&dir).unwrap_err().to_string();
        assert!(err.contains("--model-preset monomer, but --params"), "{err}");

        // A directory with monomer files runs them, as before.
        std::fs::write(dir.join("params_model_1_ptm.npz"), b"").unwrap();
        assert!(!none.check(&dir).unwrap());
        assert!(!monomer.check(&dir).unwrap());
        assert_eq!(none.uniprot(Some(Path::new("d"))), Some(PathBuf::from("d/uniprot/uniprot.fasta")));
        let given = MultimerArgs { uniprot_database_path: Some("u.fa".into()), ..Default::default() };
        assert_eq!(given.uniprot(Some(Path::new("d"))), Some(PathBuf::from("u.fa")));
        let extra = MultimerArgs { num_multimer_predictions_per_model: Some(2), ..Default::default() };
        let err = extra.check(&dir).unwrap_err().to_string();
        assert!(err.starts_with("--num-multimer-predictions-per-model applies to AlphaFold-Multimer"), "{err}");
    }
}
