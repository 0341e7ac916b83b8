//! Where the sequence databases are: AlphaFold's download layout under `--data-dir`
//! (`scripts/download_all_data.sh`, the paths `docker/run_docker.py` passes to
//! `run_alphafold.py`), each path overridable by the flag `run_alphafold.py` names it with.
use std::path::{Path, PathBuf};

use anyhow::bail;

/// AlphaFold's `--db_preset`: which databases the MSA search uses besides UniRef90 and MGnify.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
#[clap(rename_all = "snake_case")]
pub enum DbPreset {
    /// hhblits against BFD and UniRef30.
    #[default]
    FullDbs,
    /// jackhmmer against the small BFD.
    ReducedDbs,
}

impl DbPreset {
    /// The preset's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DbPreset::FullDbs => "full_dbs",
            DbPreset::ReducedDbs => "reduced_dbs",
        }
    }
}

/// Each database's path under the data directory, as AlphaFold's downloads lay them out.
pub const UNIREF90: &str = "uniref90/uniref90.fasta";
/// MGnify clusters (FASTA).
pub const MGNIFY: &str = "mgnify/mgy_clusters_2022_05.fa";
/// BFD (an HH-suite database prefix).
pub const BFD: &str = "bfd/bfd_metaclust_clu_complete_id30_c90_final_seq.sorted_opt";
/// The small BFD (FASTA).
pub const SMALL_BFD: &str = "small_bfd/bfd-first_non_consensus_sequences.fasta";
/// UniRef30 (an HH-suite database prefix).
pub const UNIREF30: &str = "uniref30/UniRef30_2021_03";
/// pdb70 (an HH-suite database prefix), searched with hhsearch for templates.
pub const PDB70: &str = "pdb70/pdb70";
/// The PDB's chain sequences (FASTA), searched with hmmsearch for templates.
pub const PDB_SEQRES: &str = "pdb_seqres/pdb_seqres.txt";
/// The PDB's mmCIF files, `<pdb id>.cif`.
pub const MMCIF_DIR: &str = "pdb_mmcif/mmcif_files";
/// The PDB's list of obsolete entries and their successors.
pub const OBSOLETE: &str = "pdb_mmcif/obsolete.dat";

/// Which tool searches for templates.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TemplateSearcher {
    /// hhsearch against pdb70 (AlphaFold's monomer pipeline).
    #[default]
    Hhsearch,
    /// hmmbuild and hmmsearch against pdb_seqres (AlphaFold-Multimer's pipeline).
    Hmmsearch,
}

/// `--data-dir` and the per-database overrides.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct DatabaseArgs {
    /// AlphaFold's database folder (`uniref90/`, `mgnify/`, `bfd/` or `small_bfd/`,
    /// `uniref30/`, as its download scripts lay it out): search it for homologues of every
    /// query. Without it (and without the database flags) queries run on --msa or alone.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Which databases besides UniRef90 and MGnify: full_dbs (hhblits against BFD and
    /// UniRef30) or reduced_dbs (jackhmmer against the small BFD).
    #[arg(long, value_enum, default_value = "full_dbs")]
    pub db_preset: DbPreset,
    /// UniRef90 FASTA (default: `<data-dir>/uniref90/uniref90.fasta`).
    #[arg(long)]
    pub uniref90_database_path: Option<PathBuf>,
    /// MGnify FASTA (default: `<data-dir>/mgnify/mgy_clusters_2022_05.fa`).
    #[arg(long)]
    pub mgnify_database_path: Option<PathBuf>,
    /// BFD, an HH-suite database prefix (full_dbs; default:
    /// `<data-dir>/bfd/bfd_metaclust_clu_complete_id30_c90_final_seq.sorted_opt`).
    #[arg(long)]
    pub bfd_database_path: Option<PathBuf>,
    /// UniRef30, an HH-suite database prefix (full_dbs; default:
    /// `<data-dir>/uniref30/UniRef30_2021_03`).
    #[arg(long)]
    pub uniref30_database_path: Option<PathBuf>,
    /// Small BFD FASTA (reduced_dbs; default:
    /// `<data-dir>/small_bfd/bfd-first_non_consensus_sequences.fasta`).
    #[arg(long)]
    pub small_bfd_database_path: Option<PathBuf>,
    /// pdb70, an HH-suite database prefix searched with hhsearch for templates (default:
    /// `<data-dir>/pdb70/pdb70`; without it, and without that folder, no template search).
    #[arg(long)]
    pub pdb70_database_path: Option<PathBuf>,
    /// hhsearch against pdb70 (AlphaFold's monomer search) or hmmsearch against pdb_seqres
    /// (AlphaFold-Multimer's) for templates.
    #[arg(long, value_enum, default_value = "hhsearch")]
    pub template_searcher: TemplateSearcher,
    /// The PDB's sequences for --template-searcher hmmsearch (default:
    /// `<data-dir>/pdb_seqres/pdb_seqres.txt`; without it, and without that file, no template
    /// search).
    #[arg(long)]
    pub pdb_seqres_database_path: Option<PathBuf>,
    /// The templates' mmCIF files, `<pdb` id>.cif (default: `<data-dir>/pdb_mmcif/mmcif_files`).
    #[arg(long)]
    pub template_mmcif_dir: Option<PathBuf>,
    /// The PDB's obsolete.dat: withdrawn templates dropped, replaced ones read from their
    /// successor (default: `<data-dir>/pdb_mmcif/obsolete.dat` when it exists).
    #[arg(long)]
    pub obsolete_pdbs_path: Option<PathBuf>,
}

/// The third search of the preset.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bfd {
    /// hhblits against these HH-suite databases (BFD, UniRef30).
    Hhblits(Vec<PathBuf>),
    /// jackhmmer against this FASTA.
    SmallBfd(PathBuf),
}

/// What the template search searches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TemplateIndex {
    /// pdb70 (an HH-suite database prefix), for hhsearch.
    Pdb70(PathBuf),
    /// pdb_seqres.txt (FASTA), for hmmsearch.
    PdbSeqres(PathBuf),
}

/// The template search's databases.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateDatabases {
    /// pdb70 or pdb_seqres.
    pub index: TemplateIndex,
    /// The folder of `<pdb id>.cif` files.
    pub mmcif_dir: PathBuf,
    /// obsolete.dat, when there is one.
    pub obsolete: Option<PathBuf>,
}

/// The databases one search uses, every path checked to exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Databases {
    /// UniRef90 FASTA.
    pub uniref90: PathBuf,
    /// MGnify FASTA.
    pub mgnify: PathBuf,
    /// BFD (and UniRef30) or the small BFD.
    pub bfd: Bfd,
    /// pdb70 and the mmCIF files, when templates are searched for.
    pub templates: Option<TemplateDatabases>,
}

impl DatabaseArgs {
    /// Whether a search was asked for (a data directory or any database flag).
    pub fn requested(&self) -> bool {
        self.data_dir.is_some() || self.databases_given().iter().any(|(_, given)| *given)
    }

    /// Each database flag and whether it was given.
    fn databases_given(&self) -> [(&'static str, bool); 7] {
        [
            ("--uniref90-database-path", self.uniref90_database_path.is_some()),
            ("--mgnify-database-path", self.mgnify_database_path.is_some()),
            ("--bfd-database-path", self.bfd_database_path.is_some()),
            ("--uniref30-database-path", self.uniref30_database_path.is_some()),
            ("--small-bfd-database-path", self.small_bfd_database_path.is_some()),
            ("--pdb70-database-path", self.pdb70_database_path.is_some()),
            ("--pdb-seqres-database-path", self.pdb_seqres_database_path.is_some()),
        ]
    }

    /// The path flags given that ColabFold's MMseqs2 search does not use (it reads its own
    /// databases and searches no templates).
    pub fn unused_by_mmseqs(&self) -> Vec<String> {
        let files = [
            ("--template-mmcif-dir", self.template_mmcif_dir.is_some()),
            ("--obsolete-pdbs-path", self.obsolete_pdbs_path.is_some()),
        ];
        let given = self.databases_given().into_iter().chain(files).filter(|(_, given)| *given);
        given.map(|(flag, _)| format!("{flag} is not used with --msa-mode mmseqs2")).collect()
    }

    /// The database flags given that the preset and template searcher do not use (AlphaFold's
    /// run_alphafold refuses them too): each would be ignored silently.
    pub fn unused(&self) -> Vec<String> {
        let full = self.db_preset == DbPreset::FullDbs;
        let hhsearch = self.template_searcher == TemplateSearcher::Hhsearch;
        let preset = format!("--db-preset {}", self.db_preset.name());
        let searcher = format!("--template-searcher {}", if hhsearch { "hhsearch" } else { "hmmsearch" });
        [
            ("--bfd-database-path", self.bfd_database_path.is_some() && !full, &preset),
            ("--uniref30-database-path", self.uniref30_database_path.is_some() && !full, &preset),
            ("--small-bfd-database-path", self.small_bfd_database_path.is_some() && full, &preset),
            ("--pdb70-database-path", self.pdb70_database_path.is_some() && !hhsearch, &searcher),
            ("--pdb-seqres-database-path", self.pdb_seqres_database_path.is_some() && hhsearch, &searcher),
        ]
        .into_iter()
        .filter(|(_, unused, _)| *unused)
        .map(|(flag, _, why)| format!("{flag} is not used with {why}"))
        .collect()
    }

    /// The preset's databases; `Err` names every one that is missing, with its flag. With
    /// `check` false the paths are only resolved (a rerun on precomputed MSAs needs none).
    pub fn resolve(&self, check: bool) -> anyhow::Result<Databases> {
        let mut missing = Vec::new();
        let mut path = |given: &Option<PathBuf>, default: &str, flag: &str, hhsuite: bool| -> PathBuf {
            let p = match (given, &self.data_dir) {
                (Some(p), _) => p.clone(),
                (None, Some(dir)) => dir.join(default),
                (None, None) => {
                    missing.push(format!("--{flag} (or --data-dir)"));
                    return PathBuf::new();
                }
            };
            let present = if hhsuite { hhsuite_database_exists(&p) } else { p.is_file() };
            if check && !present {
                let what =
                    if hhsuite { "an HH-suite database (no <prefix>_*.ffindex/.ffdata files)" } else { "a file" };
                missing.push(format!("{} (--{flag}) is not {what}", p.display()));
            }
            p
        };
        let uniref90 = path(&self.uniref90_database_path, UNIREF90, "uniref90-database-path", false);
        let mgnify = path(&self.mgnify_database_path, MGNIFY, "mgnify-database-path", false);
        let bfd = match self.db_preset {
            DbPreset::FullDbs => Bfd::Hhblits(vec![
                path(&self.bfd_database_path, BFD, "bfd-database-path", true),
                path(&self.uniref30_database_path, UNIREF30, "uniref30-database-path", true),
            ]),
            DbPreset::ReducedDbs => {
                Bfd::SmallBfd(path(&self.small_bfd_database_path, SMALL_BFD, "small-bfd-database-path", false))
            }
        };
        let templates = self.templates(check, &mut missing);
        if !missing.is_empty() {
            bail!(
                "homology search databases missing (--db-preset {}):\n  {}",
                self.db_preset.name(),
                missing.join("\n  ")
            );
        }
        Ok(Databases { uniref90, mgnify, bfd, templates })
    }

    /// The template databases: searched when the searcher's database is given
    /// (--pdb70-database-path, --pdb-seqres-database-path) or is in the data directory
    /// (pdb70/pdb70, pdb_seqres/pdb_seqres.txt); then the mmCIF folder must exist too (with
    /// `check`, what is missing is added to `missing`).
    fn templates(&self, check: bool, missing: &mut Vec<String>) -> Option<TemplateDatabases> {
        let default = |rel: &str| self.data_dir.as_ref().map(|d| d.join(rel));
        let index = match self.template_searcher {
            TemplateSearcher::Hhsearch => {
                let pdb70 = match (&self.pdb70_database_path, default(PDB70)) {
                    (Some(p), _) => p.clone(),
                    (None, Some(p)) if hhsuite_database_exists(&p) => p,
                    _ => return None,
                };
                if check && !hhsuite_database_exists(&pdb70) {
                    missing.push(format!(
                        "{} (--pdb70-database-path) is not an HH-suite database (no <prefix>_*.ffindex/.ffdata files)",
                        pdb70.display()
                    ));
                }
                TemplateIndex::Pdb70(pdb70)
            }
            TemplateSearcher::Hmmsearch => {
                let seqres = match (&self.pdb_seqres_database_path, default(PDB_SEQRES)) {
                    (Some(p), _) => p.clone(),
                    (None, Some(p)) if p.is_file() => p,
                    _ => return None,
                };
                if check && !seqres.is_file() {
                    missing.push(format!("{} (--pdb-seqres-database-path) is not a file", seqres.display()));
                }
                TemplateIndex::PdbSeqres(seqres)
            }
        };
        let mmcif_dir = match (self.template_mmcif_dir.clone(), default(MMCIF_DIR)) {
            (Some(p), _) | (None, Some(p)) => p,
            (None, None) => {
                missing.push("--template-mmcif-dir (or --data-dir), for the template search".into());
                PathBuf::new()
            }
        };
        if check && !mmcif_dir.as_os_str().is_empty() && !mmcif_dir.is_dir() {
            missing.push(format!("{} (--template-mmcif-dir) is not a folder", mmcif_dir.display()));
        }
        let obsolete = match (&self.obsolete_pdbs_path, default(OBSOLETE)) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(p)) if p.is_file() => Some(p),
            _ => None,
        };
        Some(TemplateDatabases { index, mmcif_dir, obsolete })
    }
}

/// Whether an HH-suite database with this prefix exists: hhblits reads `<prefix>_a3m`,
/// `_hhm` and `_cs219` ffindex/ffdata pairs; any of them present is what AlphaFold checks.
pub(crate) fn hhsuite_database_exists(prefix: &Path) -> bool {
    let (Some(dir), Some(stem)) = (prefix.parent(), prefix.file_name()) else { return false };
    let dir = if dir.as_os_str().is_empty() { Path::new(".") } else { dir };
    let stem = format!("{}_", stem.to_string_lossy());
    std::fs::read_dir(dir)
        .map(|entries| entries.flatten().any(|e| e.file_name().to_string_lossy().starts_with(&stem)))
        .unwrap_or(false)
}
