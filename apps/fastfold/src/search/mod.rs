//! Homology search as AlphaFold's data pipeline runs it (`alphafold/data/pipeline.py`):
//! jackhmmer against UniRef90 and MGnify, then hhblits against BFD + UniRef30
//! (`--db-preset full_dbs`) or jackhmmer against the small BFD (`reduced_dbs`). Each result is
//! saved under the query's `msas/` folder with AlphaFold's file names (`uniref90_hits.sto`,
//! `mgnify_hits.sto`, `bfd_uniref_hits.a3m` or `small_bfd_hits.sto`), UniRef90 capped at
//! 10,000 sequences and MGnify at 501 as AlphaFold caps them; `--use-precomputed-msas` reads
//! those files back instead of searching again. The three alignments are merged (duplicates
//! dropped) into the MSA the features are made from. `--msa-mode mmseqs2` runs ColabFold's
//! local MMseqs2 search instead ([`mmseqs`]), saved as `msas/mmseqs2_uniref_env.a3m`.
//!
//! Templates (with pdb70 in the data directory or `--pdb70-database-path`): the UniRef90
//! alignment, as A3M, is searched against pdb70 with hhsearch (saved as `msas/pdb_hits.hhr`,
//! reused as the alignments are), and the hits are featurised from the mmCIF files
//! ([`templates`]).
pub mod databases;
pub mod hhr;
pub mod hmmsearch;
pub mod mmcif;
pub mod mmseqs;
pub mod msa;
pub mod stockholm;
pub mod templates;
pub mod tools;

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use data::a3m::Msa;

use databases::{Bfd, DatabaseArgs, Databases};
use hhr::TemplateHit;
use mmseqs::MmseqsDatabases;
use tools::{threads, Tool, WorkDir};

/// Sequences kept from the UniRef90 search (AlphaFold's `uniref_max_hits`).
pub const UNIREF_MAX_HITS: usize = 10_000;
/// Sequences kept from the MGnify search (AlphaFold's `mgnify_max_hits`).
pub const MGNIFY_MAX_HITS: usize = 501;
/// Where the UniProt search (AlphaFold-Multimer's pairing) is saved under a chain's `msas/`.
pub const UNIPROT_FILE: &str = "uniprot_hits.sto";
/// Where the small BFD's search (`reduced_dbs`) is saved under `msas/`.
const SMALL_BFD_FILE: &str = "small_bfd_hits.sto";
/// Where ColabFold's search result is saved under `msas/`.
const MMSEQS_FILE: &str = "mmseqs2_uniref_env.a3m";
/// Threads AlphaFold gives jackhmmer and hhblits (`n_cpu`), and hhsearch's own default.
const JACKHMMER_CPUS: usize = 8;
const HHBLITS_CPUS: usize = 4;
const HHSEARCH_CPUS: usize = 2;
const HMMSEARCH_CPUS: usize = 8;
/// hmmsearch's thresholds in AlphaFold-Multimer's template search.
const HMMSEARCH_FLAGS: [&str; 14] =
    ["--F1", "0.1", "--F2", "0.1", "--F3", "0.1", "--incE", "100", "-E", "100", "--domE", "100", "--incdomE", "100"];
/// Where the template search's hits are saved under `msas/` (AlphaFold's names: hhsearch's,
/// then hmmsearch's, which training reads back too, [`crate::train_data::templates`]).
const PDB_HITS_FILE: &str = "pdb_hits.hhr";
pub const PDB_HITS_STO: &str = "pdb_hits.sto";

/// Which search finds the MSA.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MsaMode {
    /// AlphaFold's: jackhmmer and hhblits in AlphaFold's databases.
    #[default]
    Alphafold,
    /// ColabFold's local search: MMseqs2 in ColabFold's UniRef30 and environmental databases.
    Mmseqs2,
}

/// The search's options.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct SearchArgs {
    /// The databases.
    #[command(flatten)]
    pub databases: DatabaseArgs,
    /// alphafold (jackhmmer/hhblits, AlphaFold's databases under --data-dir) or mmseqs2
    /// (ColabFold's local search; --data-dir holds ColabFold's uniref30_2302_db and
    /// colabfold_envdb_202108_db, as its setup_databases.sh makes them).
    #[arg(long, value_enum, default_value = "alphafold")]
    pub msa_mode: MsaMode,
    /// ColabFold's UniRef30 MMseqs2 database (default: `<data-dir>/uniref30_2302_db`).
    #[arg(long)]
    pub mmseqs_uniref_db: Option<PathBuf>,
    /// ColabFold's environmental MMseqs2 database (default:
    /// `<data-dir>/colabfold_envdb_202108_db`).
    #[arg(long)]
    pub mmseqs_env_db: Option<PathBuf>,
    /// The mmseqs binary (default: `mmseqs` on PATH).
    #[arg(long)]
    pub mmseqs_binary_path: Option<PathBuf>,
    /// Reuse the alignments a previous run saved under `<out>/<query>/msas/` instead of
    /// searching again (a missing one is searched for).
    #[arg(long)]
    pub use_precomputed_msas: bool,
    /// Threads for each search tool (default: AlphaFold's, 8 for jackhmmer and 4 for hhblits,
    /// and every core for mmseqs, at most the cores there are).
    #[arg(long)]
    pub search_cpus: Option<usize>,
    /// The jackhmmer binary (default: `jackhmmer` on PATH).
    #[arg(long)]
    pub jackhmmer_binary_path: Option<PathBuf>,
    /// The hhblits binary (default: `hhblits` on PATH).
    #[arg(long)]
    pub hhblits_binary_path: Option<PathBuf>,
    /// The hhsearch binary (default: `hhsearch` on PATH).
    #[arg(long)]
    pub hhsearch_binary_path: Option<PathBuf>,
    /// The hmmsearch binary (default: `hmmsearch` on PATH).
    #[arg(long)]
    pub hmmsearch_binary_path: Option<PathBuf>,
    /// The hmmbuild binary (default: `hmmbuild` on PATH).
    #[arg(long)]
    pub hmmbuild_binary_path: Option<PathBuf>,
    /// The kalign binary, which realigns a template whose chain changed since pdb70 was
    /// built (default: `kalign` on PATH).
    #[arg(long)]
    pub kalign_binary_path: Option<PathBuf>,
    /// Templates released after this date (YYYY-MM-DD) are not used (default: none is
    /// excluded by date).
    #[arg(long)]
    pub max_template_date: Option<String>,
}

/// Whether a search may run the tools and write its results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Search (reusing saved results with --use-precomputed-msas) and save the results.
    Search,
    /// Only read results another process saved (the other ranks of a job while rank 0
    /// searches); a missing one is an error.
    ReadSaved,
}

/// The databases of one kind of search.
#[derive(Clone, Debug)]
enum Plan {
    AlphaFold(Databases),
    Mmseqs(MmseqsDatabases),
}

/// A resolved search: the databases, the tools and their threads.
#[derive(Clone, Debug)]
pub struct Search {
    plan: Plan,
    jackhmmer: Tool,
    hhblits: Tool,
    hhsearch: Tool,
    hmmsearch: Tool,
    hmmbuild: Tool,
    kalign: Tool,
    mmseqs: Tool,
    max_template_date: String,
    cpus: Option<usize>,
    reuse: bool,
}

/// What the search found for one query.
pub struct Found {
    /// The merged MSA.
    pub msa: Msa,
    /// The featurised template hits (best first), `None` without a template search.
    pub templates: Option<Vec<templates::TemplateHitFeatures>>,
}

impl SearchArgs {
    /// The search the options ask for, `None` when they ask for none (no --data-dir, no
    /// database flag). Missing databases are an error naming each (not checked when only
    /// reading saved results, or when reusing them: a rerun needs only its `msas/`).
    pub fn search(&self, mode: Mode) -> anyhow::Result<Option<Search>> {
        if !self.requested() {
            // Without databases no search runs: a search option would be ignored silently (and
            // --use-precomputed-msas would overwrite the saved search with a single sequence).
            // (--search-cpus, a resource knob, may stay in a script that sometimes searches.)
            let given = [
                ("--msa-mode mmseqs2", self.msa_mode == MsaMode::Mmseqs2),
                ("--use-precomputed-msas", self.use_precomputed_msas),
                ("--max-template-date", self.max_template_date.is_some()),
                ("--jackhmmer-binary-path", self.jackhmmer_binary_path.is_some()),
                ("--hhblits-binary-path", self.hhblits_binary_path.is_some()),
                ("--hhsearch-binary-path", self.hhsearch_binary_path.is_some()),
                ("--hmmsearch-binary-path", self.hmmsearch_binary_path.is_some()),
                ("--hmmbuild-binary-path", self.hmmbuild_binary_path.is_some()),
                ("--kalign-binary-path", self.kalign_binary_path.is_some()),
                ("--mmseqs-binary-path", self.mmseqs_binary_path.is_some()),
                ("--db-preset reduced_dbs", self.databases.db_preset == databases::DbPreset::ReducedDbs),
                (
                    "--template-searcher hmmsearch",
                    self.databases.template_searcher == databases::TemplateSearcher::Hmmsearch,
                ),
                ("--template-mmcif-dir", self.databases.template_mmcif_dir.is_some()),
                ("--obsolete-pdbs-path", self.databases.obsolete_pdbs_path.is_some()),
            ];
            if let Some((flag, _)) = given.iter().find(|(_, given)| *given) {
                bail!("{flag} applies to the homology search, which needs --data-dir or the databases' flags");
            }
            return Ok(None);
        }
        if self.search_cpus == Some(0) {
            bail!("--search-cpus must be at least 1");
        }
        let unused = self.unused();
        if !unused.is_empty() {
            bail!("search options that would be ignored:\n  {}", unused.join("\n  "));
        }
        if let Some(date) = &self.max_template_date {
            templates::check_date(date)?;
        }
        let check = mode == Mode::Search && !self.use_precomputed_msas;
        let plan = match self.msa_mode {
            MsaMode::Alphafold => Plan::AlphaFold(self.databases.resolve(check)?),
            MsaMode::Mmseqs2 => Plan::Mmseqs(MmseqsDatabases::resolve(
                self.databases.data_dir.as_deref(),
                self.mmseqs_uniref_db.as_deref(),
                self.mmseqs_env_db.as_deref(),
                check,
            )?),
        };
        Ok(Some(Search {
            plan,
            jackhmmer: Tool::new("jackhmmer", self.jackhmmer_binary_path.as_deref()),
            hhblits: Tool::new("hhblits", self.hhblits_binary_path.as_deref()),
            hhsearch: Tool::new("hhsearch", self.hhsearch_binary_path.as_deref()),
            hmmsearch: Tool::new("hmmsearch", self.hmmsearch_binary_path.as_deref()),
            hmmbuild: Tool::new("hmmbuild", self.hmmbuild_binary_path.as_deref()),
            kalign: Tool::new("kalign", self.kalign_binary_path.as_deref()),
            // Later than any release date: no template is excluded by date.
            max_template_date: self.max_template_date.clone().unwrap_or_else(|| "9999-12-31".into()),
            mmseqs: Tool::new("mmseqs", self.mmseqs_binary_path.as_deref()),
            cpus: self.search_cpus,
            reuse: self.use_precomputed_msas || mode == Mode::ReadSaved,
        }))
    }

    /// The database flags given that the chosen search does not use: AlphaFold's paths outside
    /// the preset and searcher, or under --msa-mode mmseqs2; ColabFold's under alphafold.
    fn unused(&self) -> Vec<String> {
        match self.msa_mode {
            MsaMode::Mmseqs2 => self.databases.unused_by_mmseqs(),
            MsaMode::Alphafold => {
                let mmseqs = [("--mmseqs-uniref-db", &self.mmseqs_uniref_db), ("--mmseqs-env-db", &self.mmseqs_env_db)];
                let mmseqs = mmseqs.into_iter().filter(|(_, p)| p.is_some());
                let mut unused = self.databases.unused();
                unused.extend(mmseqs.map(|(flag, _)| format!("{flag} needs --msa-mode mmseqs2")));
                unused
            }
        }
    }

    /// Whether a search was asked for: a data directory or any database flag.
    pub fn requested(&self) -> bool {
        self.databases.requested() || self.mmseqs_uniref_db.is_some() || self.mmseqs_env_db.is_some()
    }
}

impl Search {
    /// A search that only reads the alignments a previous search saved (as
    /// `--use-precomputed-msas` reads them, with [`Mode::ReadSaved`]): which files, by what the
    /// query folder `msa_dir` holds: ColabFold's `mmseqs2_uniref_env.a3m`, else the small BFD's
    /// `small_bfd_hits.sto` (`reduced_dbs`), else `full_dbs`'. No tool runs and no database is
    /// read, so none is named; no templates.
    pub fn saved(msa_dir: &Path) -> Search {
        let none = PathBuf::new;
        let plan = if msa_dir.join(MMSEQS_FILE).is_file() {
            Plan::Mmseqs(MmseqsDatabases { uniref: none(), env: none() })
        } else {
            let bfd = match msa_dir.join(SMALL_BFD_FILE).is_file() {
                true => Bfd::SmallBfd(none()),
                false => Bfd::Hhblits(Vec::new()),
            };
            Plan::AlphaFold(Databases { uniref90: none(), mgnify: none(), bfd, templates: None })
        };
        let tool = |name| Tool::new(name, None);
        Search {
            plan,
            jackhmmer: tool("jackhmmer"),
            hhblits: tool("hhblits"),
            hhsearch: tool("hhsearch"),
            hmmsearch: tool("hmmsearch"),
            hmmbuild: tool("hmmbuild"),
            kalign: tool("kalign"),
            mmseqs: tool("mmseqs"),
            max_template_date: "9999-12-31".into(),
            cpus: None,
            reuse: true,
        }
    }
}

/// One alignment file of the search: where it is saved and how it was produced.
struct Step<'a> {
    file: &'static str,
    database: &'a Path,
    max_sequences: Option<usize>,
}

impl Search {
    /// The merged MSA of `sequence` (the query named `name`) and its templates, each
    /// database's result saved in (or, reusing, read from) `msa_dir`; `mode` as
    /// [`SearchArgs::search`] was given.
    pub fn run(&self, name: &str, sequence: &str, msa_dir: &Path, mode: Mode) -> anyhow::Result<Found> {
        self.with_query(name, sequence, msa_dir, mode, |ctx| self.run_in(ctx, sequence))
    }

    /// jackhmmer of `sequence` (the query named `name`) against UniProt at `uniprot`, with
    /// AlphaFold's settings, for AlphaFold-Multimer's cross-chain pairing: saved whole as
    /// `uniprot_hits.sto` in `msa_dir` (AlphaFold truncates only the parsed alignment) and
    /// reused as the other alignments are.
    pub fn uniprot(
        &self,
        name: &str,
        sequence: &str,
        uniprot: &Path,
        msa_dir: &Path,
        mode: Mode,
    ) -> anyhow::Result<Msa> {
        self.with_query(name, sequence, msa_dir, mode, |ctx| {
            Ok(ctx.jackhmmer(&Step { file: UNIPROT_FILE, database: uniprot, max_sequences: None })?.0)
        })
    }

    /// `f` with the query written to a scratch folder (removed afterwards) and `msa_dir` made.
    fn with_query<T>(
        &self,
        name: &str,
        sequence: &str,
        msa_dir: &Path,
        mode: Mode,
        f: impl FnOnce(&Ctx) -> anyhow::Result<T>,
    ) -> anyhow::Result<T> {
        if mode == Mode::Search {
            std::fs::create_dir_all(msa_dir).with_context(|| format!("creating {}", msa_dir.display()))?;
        }
        let work = WorkDir::new("search")?;
        let query = work.path().join("query.fasta");
        std::fs::write(&query, format!(">{name}\n{sequence}\n"))
            .with_context(|| format!("writing {}", query.display()))?;
        f(&Ctx { search: self, query: &query, work: &work, msa_dir, mode })
    }

    /// [`Search::run`] of `sequence` in a prepared context.
    fn run_in(&self, ctx: &Ctx, sequence: &str) -> anyhow::Result<Found> {
        let db = match &self.plan {
            Plan::AlphaFold(db) => db,
            Plan::Mmseqs(dbs) => return Ok(Found { msa: ctx.mmseqs(MMSEQS_FILE, dbs)?, templates: None }),
        };
        let (uniref90, uniref90_sto) = ctx.jackhmmer(&Step {
            file: "uniref90_hits.sto",
            database: &db.uniref90,
            max_sequences: Some(UNIREF_MAX_HITS),
        })?;
        let templates = match &db.templates {
            Some(t) => Some(ctx.templates(sequence, &uniref90_sto, t)?),
            None => None,
        };
        let (mgnify, _) = ctx.jackhmmer(&Step {
            file: "mgnify_hits.sto",
            database: &db.mgnify,
            max_sequences: Some(MGNIFY_MAX_HITS),
        })?;
        let bfd = match &db.bfd {
            Bfd::SmallBfd(path) => {
                ctx.jackhmmer(&Step { file: SMALL_BFD_FILE, database: path, max_sequences: None })?.0
            }
            Bfd::Hhblits(paths) => ctx.hhblits("bfd_uniref_hits.a3m", paths)?,
        };
        Ok(Found { msa: msa::merge(&[&uniref90, &bfd, &mgnify]), templates })
    }
}

/// What one query's searches share.
struct Ctx<'a> {
    search: &'a Search,
    query: &'a Path,
    work: &'a WorkDir,
    msa_dir: &'a Path,
    mode: Mode,
}

impl Ctx<'_> {
    /// The saved result `file` when it may be reused and exists, else `None`; reading only,
    /// a missing file is an error.
    fn saved(&self, file: &str) -> anyhow::Result<Option<(PathBuf, String)>> {
        let path = self.msa_dir.join(file);
        if self.search.reuse && path.is_file() {
            let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
            return Ok(Some((path, text)));
        }
        if self.mode == Mode::ReadSaved {
            bail!("{} is missing (saved alignments are only read here, not searched for)", path.display());
        }
        Ok(None)
    }

    /// `parse`'s result on the saved result at `path`. A `fresh` one (just written by its tool)
    /// that does not parse is renamed `<file>.rejected`: kept to look at, and not reused by a
    /// rerun with --use-precomputed-msas, which searches again instead.
    fn parsed<T>(&self, path: &Path, fresh: bool, parse: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
        let result = parse();
        if fresh && result.is_err() {
            let mut rejected = path.as_os_str().to_owned();
            rejected.push(".rejected");
            let rejected = PathBuf::from(rejected);
            if std::fs::rename(path, &rejected).is_ok() {
                return result.with_context(|| format!("the tool's output is kept as {}", rejected.display()));
            }
        }
        result
    }

    /// Saves `text` as `file` under the query's `msas/` (whole or not at all).
    fn save(&self, file: &str, text: &str) -> anyhow::Result<PathBuf> {
        let path = self.msa_dir.join(file);
        data::write_atomic(&path, |w| -> anyhow::Result<()> { Ok(w.write_all(text.as_bytes())?) })
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(path)
    }

    /// jackhmmer against `step.database` with AlphaFold's settings (one iteration, E-value
    /// 1e-4, its prefilter thresholds), the Stockholm output truncated and saved; the
    /// alignment and that text.
    fn jackhmmer(&self, step: &Step) -> anyhow::Result<(Msa, String)> {
        let truncate = |text: &str| match step.max_sequences {
            Some(n) => stockholm::truncate(text, n),
            None => text.to_string(),
        };
        let (path, text, fresh) = match self.saved(step.file)? {
            Some((path, text)) => (path, truncate(&text), false),
            None => {
                check_exists(step.database, "jackhmmer")?;
                let out = self.work.path().join(step.file);
                let cpus = threads(self.search.cpus, JACKHMMER_CPUS);
                let args: Vec<OsString> = ["-o", "/dev/null", "-A"]
                    .iter()
                    .map(OsString::from)
                    .chain([out.clone().into_os_string()])
                    .chain(
                        [
                            "--noali",
                            "--F1",
                            "0.0005",
                            "--F2",
                            "0.00005",
                            "--F3",
                            "0.0000005",
                            "--incE",
                            "0.0001",
                            "-E",
                            "0.0001",
                            "-N",
                            "1",
                            "--cpu",
                        ]
                        .iter()
                        .map(OsString::from),
                    )
                    .chain([cpus.to_string().into(), self.query.into(), step.database.into()])
                    .collect();
                self.search.jackhmmer.run(&args, step.database)?;
                let text = std::fs::read_to_string(&out).with_context(|| {
                    format!("jackhmmer against {} wrote no alignment {}", step.database.display(), out.display())
                })?;
                let text = truncate(&text);
                (self.save(step.file, &text)?, text, true)
            }
        };
        Ok((self.parsed(&path, fresh, || Ok(stockholm::parse(&text, &path)?))?, text))
    }

    /// The template search: the UniRef90 alignment `uniref90_sto` searched against pdb70
    /// (hhsearch) or pdb_seqres (hmmsearch), its hits featurised for `sequence`. Hits
    /// dropped are reported.
    fn templates(
        &self,
        sequence: &str,
        uniref90_sto: &str,
        db: &databases::TemplateDatabases,
    ) -> anyhow::Result<Vec<templates::TemplateHitFeatures>> {
        let (hits, path) = match &db.index {
            databases::TemplateIndex::Pdb70(pdb70) => self.hhsearch(uniref90_sto, pdb70)?,
            databases::TemplateIndex::PdbSeqres(seqres) => self.hmmsearch(sequence, uniref90_sto, seqres)?,
        };
        let obsolete = match &db.obsolete {
            Some(p) => templates::parse_obsolete(
                &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
            ),
            None => Default::default(),
        };
        let featurizer = templates::Featurizer {
            mmcif_dir: db.mmcif_dir.clone(),
            max_template_date: self.search.max_template_date.clone(),
            obsolete,
            kalign: self.search.kalign.clone(),
            unique_sequences: matches!(db.index, databases::TemplateIndex::PdbSeqres(_)),
        };
        let result = featurizer.get_templates(sequence, &hits)?;
        if self.mode == Mode::Search {
            for warning in &result.warnings {
                eprintln!("template search: {warning}");
            }
            let names: Vec<String> =
                result.hits.iter().map(|h| format!("{} ({:.2})", h.domain_name, h.sum_probs)).collect();
            eprintln!(
                "template search: {} of {} hits in {} featurised: {}",
                result.hits.len(),
                hits.len(),
                path.display(),
                if names.is_empty() { "none".to_string() } else { names.join(", ") }
            );
        }
        Ok(result.hits)
    }

    /// hmmbuild (`--hand --amino`) of the deduplicated UniRef90 alignment without its empty
    /// columns, then hmmsearch of that model against `seqres` with AlphaFold-Multimer's
    /// thresholds; the Stockholm result saved as `pdb_hits.sto`; its hits and that file.
    fn hmmsearch(
        &self,
        sequence: &str,
        uniref90_sto: &str,
        seqres: &Path,
    ) -> anyhow::Result<(Vec<TemplateHit>, PathBuf)> {
        let (path, text, fresh) = match self.saved(PDB_HITS_STO)? {
            Some((path, text)) => (path, text, false),
            None => {
                check_exists(seqres, "hmmsearch")?;
                let source = self.msa_dir.join("uniref90_hits.sto");
                let msa = stockholm::remove_empty_columns(&stockholm::deduplicate(uniref90_sto, &source)?);
                let input = self.work.path().join("query.sto");
                std::fs::write(&input, msa).with_context(|| format!("writing {}", input.display()))?;
                let hmm = self.work.path().join("query.hmm");
                let args: Vec<OsString> =
                    vec!["--hand".into(), "--amino".into(), hmm.clone().into_os_string(), input.into_os_string()];
                self.search.hmmbuild.run(&args, &source)?;
                let out = self.work.path().join(PDB_HITS_STO);
                let cpus = threads(self.search.cpus, HMMSEARCH_CPUS);
                let mut args: Vec<OsString> = vec!["--noali".into(), "--cpu".into(), cpus.to_string().into()];
                args.extend(HMMSEARCH_FLAGS.iter().map(OsString::from));
                args.extend(["-A".into(), out.clone().into_os_string(), hmm.into_os_string(), seqres.into()]);
                self.search.hmmsearch.run(&args, seqres)?;
                let text = std::fs::read_to_string(&out).with_context(|| {
                    format!("hmmsearch against {} wrote no alignment {}", seqres.display(), out.display())
                })?;
                (self.save(PDB_HITS_STO, &text)?, text, true)
            }
        };
        let hits = self.parsed(&path, fresh, || Ok(hmmsearch::read_sto(&text, sequence, &path)?))?;
        Ok((hits, path))
    }

    /// hhsearch of the deduplicated UniRef90 alignment without its empty columns (as A3M) against pdb70 as AlphaFold
    /// runs it (`-maxseq 1000000`), the result saved as `pdb_hits.hhr`; its hits and that file.
    fn hhsearch(&self, uniref90_sto: &str, pdb70: &Path) -> anyhow::Result<(Vec<TemplateHit>, PathBuf)> {
        let (path, text, fresh) = match self.saved(PDB_HITS_FILE)? {
            Some((path, text)) => (path, text, false),
            None => {
                if !databases::hhsuite_database_exists(pdb70) {
                    bail!("hhsearch database {} has no <prefix>_*.ffindex/.ffdata files", pdb70.display());
                }
                let a3m = self.work.path().join("uniref90_hits.a3m");
                let source = self.msa_dir.join("uniref90_hits.sto");
                let msa = stockholm::remove_empty_columns(&stockholm::deduplicate(uniref90_sto, &source)?);
                let msa = stockholm::to_a3m(&msa, &source, true)?;
                std::fs::write(&a3m, msa).with_context(|| format!("writing {}", a3m.display()))?;
                let out = self.work.path().join(PDB_HITS_FILE);
                let cpus = threads(self.search.cpus, HHSEARCH_CPUS);
                let args: Vec<OsString> = vec![
                    "-i".into(),
                    a3m.into_os_string(),
                    "-o".into(),
                    out.clone().into_os_string(),
                    "-maxseq".into(),
                    "1000000".into(),
                    "-cpu".into(),
                    cpus.to_string().into(),
                    "-d".into(),
                    pdb70.into(),
                ];
                self.search.hhsearch.run(&args, pdb70)?;
                let text = std::fs::read_to_string(&out).with_context(|| {
                    format!("hhsearch against {} wrote no result {}", pdb70.display(), out.display())
                })?;
                (self.save(PDB_HITS_FILE, &text)?, text, true)
            }
        };
        Ok((self.parsed(&path, fresh, || Ok(hhr::parse(&text, &path)?))?, path))
    }

    /// hhblits against `databases` with AlphaFold's settings (3 iterations, E-value 1e-3,
    /// its prefilter and realignment limits), the A3M output saved as `file`.
    fn hhblits(&self, file: &str, databases: &[PathBuf]) -> anyhow::Result<Msa> {
        let (path, text, fresh) = match self.saved(file)? {
            Some((path, text)) => (path, text, false),
            None => {
                for db in databases {
                    check_hhsuite(db)?;
                }
                let out = self.work.path().join(file);
                let cpus = threads(self.search.cpus, HHBLITS_CPUS);
                let mut args: Vec<OsString> =
                    vec!["-i".into(), self.query.into(), "-cpu".into(), cpus.to_string().into()];
                args.extend(["-oa3m".into(), out.clone().into_os_string(), "-o".into(), "/dev/null".into()]);
                for (flag, value) in [
                    ("-n", "3"),
                    ("-e", "0.001"),
                    ("-maxseq", "1000000"),
                    ("-realign_max", "100000"),
                    ("-maxfilt", "100000"),
                    ("-min_prefilter_hits", "1000"),
                ] {
                    args.extend([flag.into(), value.into()]);
                }
                for db in databases {
                    args.extend(["-d".into(), db.clone().into_os_string()]);
                }
                let names: Vec<String> = databases.iter().map(|d| d.display().to_string()).collect();
                let named = PathBuf::from(names.join(" + "));
                self.search.hhblits.run(&args, &named)?;
                let text = std::fs::read_to_string(&out).with_context(|| {
                    format!("hhblits against {} wrote no alignment {}", named.display(), out.display())
                })?;
                (self.save(file, &text)?, text, true)
            }
        };
        self.parsed(&path, fresh, || Ok(data::a3m::parse(&text, &path)?))
    }
}

impl Ctx<'_> {
    /// ColabFold's search in `dbs`, its A3M saved as `file`.
    fn mmseqs(&self, file: &str, dbs: &MmseqsDatabases) -> anyhow::Result<Msa> {
        let (path, text, fresh) = match self.saved(file)? {
            Some((path, text)) => (path, text, false),
            None => {
                let cpus = threads(self.search.cpus, usize::MAX);
                let text = mmseqs::search(&self.search.mmseqs, dbs, self.query, self.work.path(), cpus)?;
                (self.save(file, &text)?, text, true)
            }
        };
        self.parsed(&path, fresh, || Ok(data::a3m::parse(&text, &path)?))
    }
}

/// An error naming `database` when it is not a file (before `tool` runs on it).
fn check_exists(database: &Path, tool: &str) -> anyhow::Result<()> {
    if !database.is_file() {
        bail!("{tool} database {} is not a file", database.display());
    }
    Ok(())
}

/// An error naming `prefix` when no HH-suite database has it.
fn check_hhsuite(prefix: &Path) -> anyhow::Result<()> {
    if !databases::hhsuite_database_exists(prefix) {
        bail!("hhblits database {} has no <prefix>_*.ffindex/.ffdata files", prefix.display());
    }
    Ok(())
}
