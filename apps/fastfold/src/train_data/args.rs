//! `fastfold train`'s flags for training data in OpenFold's layout, parsed once into the
//! [`Filters`] and the [`Pipeline`] the rest reads.
use std::path::PathBuf;

use anyhow::{bail, Context};

use super::example::Pipeline;
use super::layout::{read_chain_data_cache, read_train_list, Filters};
use super::loader::ChainSampling;
use super::templates::TemplateSampling;
use super::transforms::BlockDeletion;
use crate::features::FeatureConfig;
use crate::loss::TrainingStage;
use crate::search::templates::parse_obsolete;

/// Training on a data set (OpenFold's `train_openfold.py` layout) rather than one example.
#[derive(clap::Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("dataset").args(["data_dir", "mmcif_dir"])))]
pub struct TrainDataArgs {
    /// A data set in one folder: its `mmcif_files/` and `alignments/` (as --mmcif-dir and
    /// --alignment-dir) and, when there, `chain_data_cache.json` and `obsolete.dat` (as
    /// --chain-data-cache and --obsolete-pdbs-path, which override them).
    #[arg(long = "data", value_name = "DIR", conflicts_with_all = ["mmcif_dir", "alignment_dir", "fasta", "features", "msa", "target", "chain", "resolution", "recycles"])]
    pub data_dir: Option<PathBuf>,
    /// Folder of mmCIF entries (`<pdb>.cif`), the training structures (OpenFold's
    /// `train_data_dir`). With --alignment-dir, in place of the FASTA input and --target. With
    /// AlphaFold-Multimer's parameters each entry is one complex of its protein chains.
    #[arg(long, requires = "alignment_dir", conflicts_with_all = ["fasta", "features", "msa", "target", "chain", "resolution", "recycles"])]
    pub mmcif_dir: Option<PathBuf>,
    /// Folder with one folder per training chain, `<pdb>_<chain>/`, holding its `.a3m` and
    /// `.sto` MSAs (OpenFold's `train_alignment_dir`).
    #[arg(long, requires = "mmcif_dir")]
    pub alignment_dir: Option<PathBuf>,
    /// File of the chains to train on, one `<pdb>_<chain>` a line (OpenFold's
    /// `train_filter_path`; default: every folder of --alignment-dir).
    #[arg(long, requires = "dataset")]
    pub train_list: Option<PathBuf>,
    /// OpenFold's chain data cache (`chain_data_cache.json`: each chain's release date,
    /// sequence, resolution and cluster size) for the filters and the sampling, in place of
    /// parsing every mmCIF entry at the start (OpenFold's `train_chain_data_cache_path`); chains
    /// it lacks are left out. With AlphaFold-Multimer's parameters an entry's chains are the
    /// cache's chains of it, and an entry it lacks (or lacks a named chain of) is left out.
    #[arg(long, requires = "dataset")]
    pub chain_data_cache: Option<PathBuf>,
    /// Leave out entries solved at a resolution above this, in Å (OpenFold: 9; entries
    /// without one, NMR, stay).
    #[arg(long, default_value_t = 9.0, value_parser = engine::parse::non_negative)]
    pub max_resolution: f64,
    /// Leave out entries released after this date, `YYYY-MM-DD`.
    #[arg(long)]
    pub max_release_date: Option<String>,
    /// Leave out chains of fewer SEQRES residues.
    #[arg(long, default_value_t = 1)]
    pub min_length: usize,
    /// Leave out chains of more SEQRES residues.
    #[arg(long)]
    pub max_length: Option<usize>,
    /// Residues of the contiguous crop (default: the --config-preset's, 256 for initial
    /// training and 384 for fine-tuning). A complex (AlphaFold-Multimer) is cropped only when
    /// it is given, by AlphaFold-Multimer's mix of contiguous and spatial crops.
    #[arg(long, value_parser = engine::parse::count(1..))]
    pub crop_size: Option<usize>,
    /// Recycling passes before the trained one are drawn uniformly from 0 to this, per example,
    /// for a data set and for one complex (AlphaFold: 3).
    #[arg(long, default_value_t = 3, value_parser = engine::parse::count(0..=crate::input::MAX_RECYCLES))]
    pub max_recycles: usize,
    /// Templates per example, drawn from the hits of the chain folder's hmmsearch
    /// `hmm_output.sto` or `pdb_hits.sto` when there, else its `.hhr` files, as AlphaFold
    /// trains (of the top 20 hits, in random order, up to this many featurised, then a
    /// random number of them kept; 0: no templates). Without a hit file a chain has none.
    #[arg(long, default_value_t = crate::features::MAX_TEMPLATES, value_parser = engine::parse::count(0..=crate::features::MAX_TEMPLATES as u64))]
    pub max_templates: usize,
    /// Folder of the templates' mmCIF entries (OpenFold's `template_mmcif_dir`; default:
    /// --mmcif-dir). For one complex (its FASTA file, --target and --msas) templates are drawn
    /// only when it is given, from the hits of each entity's --msas folder (`pdb_hits.sto`,
    /// else `.hhr`).
    #[arg(long, requires = "template_source")]
    pub template_mmcif_dir: Option<PathBuf>,
    /// Templates released after this date (YYYY-MM-DD) are not used; whatever it is, a
    /// chain's templates are released at least 60 days before the chain (a data set's: one
    /// complex from a FASTA file has no release date).
    #[arg(long, requires = "template_source", value_parser = parse_date)]
    pub max_template_date: Option<String>,
    /// PDB's list of obsolete entries (`obsolete.dat`; OpenFold's `obsolete_pdbs_file_path`):
    /// a hit of a withdrawn entry is dropped, one of a superseded entry reads its successor.
    #[arg(long, requires = "template_source")]
    pub obsolete_pdbs_path: Option<PathBuf>,
    /// The kalign binary, which realigns a template hit whose chain changed since the hits
    /// were searched (default: `kalign` on PATH; needed only then).
    #[arg(long, requires = "template_source")]
    pub kalign_binary_path: Option<PathBuf>,
    /// How often each chain trains: `openfold`, OpenFold's stochastic filter (a chain's turn
    /// taken with probability max(min(length, 512), 256) / 512, over its cluster's size when
    /// --chain-data-cache gives `cluster_size`; a complex's length is its chains' together, and
    /// its weight the mean over its chains of 1 / cluster size), or `uniform`, every chain once
    /// an epoch.
    #[arg(long, value_enum, default_value_t = ChainSampling::Openfold)]
    pub chain_sampling: ChainSampling,
    /// Threads reading and preparing the next examples while the current step trains.
    #[arg(long, default_value_t = 2, value_parser = engine::parse::count(1..))]
    pub loader_workers: usize,
}

/// A `YYYY-MM-DD` date flag.
fn parse_date(s: &str) -> Result<String, String> {
    crate::search::templates::check_date(s).map(|()| s.to_string()).map_err(|_| "not a date YYYY-MM-DD".to_string())
}

/// Where a data set's files are, from `--data` or the separate flags.
#[derive(Clone, Debug, PartialEq)]
pub struct DataFiles {
    /// The training chains' mmCIF entries.
    pub mmcif_dir: PathBuf,
    /// One folder per training chain.
    pub alignment_dir: PathBuf,
    /// OpenFold's chain data cache, when there is one.
    pub chain_data_cache: Option<PathBuf>,
    /// PDB's `obsolete.dat`, when there is one.
    pub obsolete_pdbs_path: Option<PathBuf>,
}

/// The mmCIF folder of a `--data` folder.
pub const DATA_MMCIF: &str = "mmcif_files";
/// The alignment folder of a `--data` folder.
pub const DATA_ALIGNMENTS: &str = "alignments";
/// The chain data cache of a `--data` folder, read when present.
pub const DATA_CHAIN_CACHE: &str = "chain_data_cache.json";
/// The obsolete entries of a `--data` folder, read when present.
pub const DATA_OBSOLETE: &str = "obsolete.dat";

impl TrainDataArgs {
    /// The data set's files (`None`: the flags name none); with `--data`, an error names a
    /// missing `mmcif_files/` or `alignments/` folder.
    pub fn files(&self) -> anyhow::Result<Option<DataFiles>> {
        if let Some(dir) = &self.data_dir {
            let (mmcif_dir, alignment_dir) = (dir.join(DATA_MMCIF), dir.join(DATA_ALIGNMENTS));
            for (folder, flag) in [(&mmcif_dir, "--mmcif-dir"), (&alignment_dir, "--alignment-dir")] {
                if !folder.is_dir() {
                    bail!(
                        "--data {}: no folder {} (a data set folder holds {DATA_MMCIF}/ and {DATA_ALIGNMENTS}/; \
                         or give {flag} and its partner)",
                        dir.display(),
                        folder.display()
                    );
                }
            }
            let present = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
            return Ok(Some(DataFiles {
                mmcif_dir,
                alignment_dir,
                chain_data_cache: self.chain_data_cache.clone().or_else(|| present(DATA_CHAIN_CACHE)),
                obsolete_pdbs_path: self.obsolete_pdbs_path.clone().or_else(|| present(DATA_OBSOLETE)),
            }));
        }
        let (Some(mmcif_dir), Some(alignment_dir)) = (&self.mmcif_dir, &self.alignment_dir) else {
            return Ok(None);
        };
        Ok(Some(DataFiles {
            mmcif_dir: mmcif_dir.clone(),
            alignment_dir: alignment_dir.clone(),
            chain_data_cache: self.chain_data_cache.clone(),
            obsolete_pdbs_path: self.obsolete_pdbs_path.clone(),
        }))
    }

    /// The chain filters: the train list read, the date checked.
    pub fn filters(&self) -> anyhow::Result<Filters> {
        if let Some(date) = &self.max_release_date {
            if crate::search::templates::check_date(date).is_err() {
                bail!("--max-release-date {date:?} is not a date YYYY-MM-DD");
            }
        }
        if let Some(dir) = self.template_mmcif_dir.as_ref().filter(|d| !d.is_dir()) {
            bail!("--template-mmcif-dir {} is not a folder", dir.display());
        }
        if self.max_length.is_some_and(|m| m < self.min_length) {
            bail!("--max-length {} is below --min-length {}", self.max_length.unwrap_or(0), self.min_length);
        }
        Ok(Filters {
            train_list: self.train_list.as_deref().map(read_train_list).transpose()?,
            max_resolution: self.max_resolution,
            max_release_date: self.max_release_date.clone(),
            min_length: self.min_length,
            max_length: self.max_length,
            chain_data: match self.files()?.and_then(|f| f.chain_data_cache) {
                Some(path) => Some(read_chain_data_cache(&path)?),
                None => None,
            },
        })
    }

    /// The per-step pipeline: the stage's crop and MSA sizes (OpenFold's training config:
    /// 128 clusters and 1024 extra rows in initial training, 512 and 5120 in fine-tuning)
    /// unless `max_msa_clusters` or `max_extra_msa` are given.
    pub fn pipeline(
        &self,
        stage: TrainingStage,
        max_msa_clusters: Option<usize>,
        max_extra_msa: Option<usize>,
        seed: u64,
    ) -> anyhow::Result<Pipeline> {
        Ok(Pipeline {
            features: FeatureConfig {
                max_msa_clusters: max_msa_clusters.unwrap_or(stage.max_msa_clusters()),
                max_extra_msa: max_extra_msa.unwrap_or(stage.max_extra_msa()),
                ..FeatureConfig::default()
            },
            block_deletion: BlockDeletion::default(),
            crop_size: self.crop_size.unwrap_or(stage.crop_size()),
            max_recycles: self.max_recycles,
            seed,
            templates: self.template_sampling()?,
        })
    }

    /// How examples draw templates: `None` with `--max-templates 0` or without a data set.
    /// An error names an `--obsolete-pdbs-path` that cannot be read.
    pub fn template_sampling(&self) -> anyhow::Result<Option<TemplateSampling>> {
        let Some(files) = self.files()? else { return Ok(None) };
        let mmcif_dir = self.template_mmcif_dir.clone().unwrap_or(files.mmcif_dir);
        self.sampling_in(mmcif_dir, files.obsolete_pdbs_path.as_ref())
    }

    /// How the examples of one complex (a FASTA file, --target and --msas; no data set) draw
    /// templates: `None` without `--template-mmcif-dir` (there is no --mmcif-dir to default to)
    /// or with `--max-templates 0`. Errors name a `--template-mmcif-dir` that is no folder and
    /// an `--obsolete-pdbs-path` that cannot be read.
    pub fn one_complex_template_sampling(&self) -> anyhow::Result<Option<TemplateSampling>> {
        let Some(dir) = &self.template_mmcif_dir else { return Ok(None) };
        if !dir.is_dir() {
            bail!("--template-mmcif-dir {} is not a folder", dir.display());
        }
        self.sampling_in(dir.clone(), self.obsolete_pdbs_path.as_ref())
    }

    /// Template sampling from the entries of `mmcif_dir` with the obsolete entries of
    /// `obsolete` (`None`: none), as the flags say.
    fn sampling_in(&self, mmcif_dir: PathBuf, obsolete: Option<&PathBuf>) -> anyhow::Result<Option<TemplateSampling>> {
        if self.max_templates == 0 {
            return Ok(None);
        }
        let obsolete = match obsolete {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading --obsolete-pdbs-path {}", path.display()))?;
                parse_obsolete(&text)
            }
            None => Default::default(),
        };
        Ok(Some(TemplateSampling {
            max_templates: self.max_templates,
            mmcif_dir,
            max_template_date: self.max_template_date.clone(),
            obsolete,
            kalign: self.kalign_binary_path.clone(),
        }))
    }
}
