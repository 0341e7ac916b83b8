//! OpenFold's training layout: `--mmcif-dir` holds `<pdb>.cif` entries, `--alignment-dir`
//! one folder per chain, `<pdb>_<chain>/` (the author chain id, as pdb70 names chains), with
//! that chain's MSAs (`uniref90_hits.sto`, `bfd_uniclust_hits.a3m`, `mgnify_hits.a3m`, ...:
//! every `.a3m` and `.sto` file) and template hits (hmmsearch's `hmm_output.sto` when there,
//! else `pdb70_hits.hhr`: [`hit_files`], read by [`super::templates`]). The chains trained on
//! are the folders (or the `--train-list` of them), filtered as OpenFold's deterministic
//! training filter does (resolution, single-residue composition) and by release date and
//! length.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use rayon::prelude::*;

use super::target::chain_sequence;
use crate::search::{mmcif, PDB_HITS_STO};

/// The MSA files of a chain folder: these extensions, read in file-name order.
pub const MSA_EXTENSIONS: [&str; 2] = ["a3m", "sto"];

/// Largest share of one residue type in a training chain (OpenFold's `max_single_aa_prop`).
pub const MAX_SINGLE_AA_PROP: f64 = 0.8;

/// Which chains train: OpenFold's `deterministic_train_filter` and the flags.
#[derive(Clone, Debug, PartialEq)]
pub struct Filters {
    /// Chain names (`<pdb>_<chain>`) to use; `None`: every folder of the alignment dir.
    pub train_list: Option<Vec<String>>,
    /// Highest resolution in Å (OpenFold: 9); entries without one (NMR) pass.
    pub max_resolution: f64,
    /// Latest release date, `YYYY-MM-DD`.
    pub max_release_date: Option<String>,
    /// Fewest SEQRES residues.
    pub min_length: usize,
    /// Most SEQRES residues.
    pub max_length: Option<usize>,
    /// Each chain's release date, resolution and sequence from OpenFold's chain data cache, in
    /// place of parsing every entry (chains it lacks are left out).
    pub chain_data: Option<HashMap<String, ChainData>>,
}

/// A chain's record in OpenFold's chain data cache (`chain_data_cache.json`, written by its
/// `scripts/generate_chain_data_cache.py`; its other fields are not read).
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
pub struct ChainData {
    /// The entry's release date, `YYYY-MM-DD`.
    pub release_date: Option<String>,
    /// The chain's SEQRES.
    pub seq: String,
    /// Resolution in Å (`null` or absent: none).
    #[serde(default)]
    pub resolution: Option<f64>,
    /// Chains in the chain's sequence cluster (the script's `--cluster_file`, PDB's
    /// `clusters-by-entity-40.txt`; absent: not known), for the sampling weight
    /// ([`super::loader::ChainSampling`]).
    #[serde(default)]
    pub cluster_size: Option<usize>,
}

/// Reads a `--chain-data-cache` file: `{"<pdb>_<chain>": {"release_date": .., "seq": ..,
/// "resolution": .., "cluster_size": ..}, ..}`.
pub fn read_chain_data_cache(path: &Path) -> anyhow::Result<HashMap<String, ChainData>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading --chain-data-cache {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| {
        format!(
            "--chain-data-cache {}: not OpenFold's chain data cache (chain -> release_date, seq, resolution)",
            path.display()
        )
    })
}

impl Default for Filters {
    fn default() -> Self {
        Filters {
            train_list: None,
            max_resolution: 9.0,
            max_release_date: None,
            min_length: 1,
            max_length: None,
            chain_data: None,
        }
    }
}

/// One training chain and where its files are.
#[derive(Clone, Debug, PartialEq)]
pub struct ChainEntry {
    /// `<pdb>_<chain>`.
    pub name: String,
    /// The author chain id in the mmCIF file.
    pub chain: String,
    /// The mmCIF entry.
    pub mmcif: PathBuf,
    /// The chain's MSA files, in file-name order.
    pub msas: Vec<PathBuf>,
    /// The chain's template hit files ([`hit_files`]: hmmsearch's, else `.hhr`), in file-name
    /// order; none when its folder has none.
    pub templates: Vec<PathBuf>,
    /// SEQRES residues.
    pub length: usize,
    /// Chains in its sequence cluster, from the chain data cache (`None`: not known).
    pub cluster_size: Option<usize>,
}

/// The chains of a layout that pass the filters, in name order, and how many each filter
/// left out (filter, count).
#[derive(Clone, Debug, PartialEq)]
pub struct Selection<T = ChainEntry> {
    /// The chains (or complexes) kept.
    pub chains: Vec<T>,
    /// Chains left out per reason, for the log.
    pub excluded: Vec<(String, usize)>,
}

/// Reads a `--train-list` file: one chain name (`<pdb>_<chain>`) a line; blank lines and
/// lines starting with `#` skipped; anything after the name on a line ignored (OpenFold's
/// filter files hold the name alone).
pub fn read_train_list(path: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading --train-list {}", path.display()))?;
    let names: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|w| !w.starts_with('#'))
        .map(str::to_string)
        .collect();
    if names.is_empty() {
        bail!("--train-list {}: no chain names", path.display());
    }
    Ok(names)
}

/// `<pdb>_<chain>` split at its last `_`.
pub(super) fn split_name(name: &str) -> Option<(&str, &str)> {
    name.rsplit_once('_').filter(|(pdb, chain)| !pdb.is_empty() && !chain.is_empty())
}

/// The chain folders of the alignment dir, by name.
pub(super) fn chain_folders(alignment_dir: &Path, flags: &LayoutFlags) -> anyhow::Result<Vec<String>> {
    let flag = flags.alignment_dir;
    let entries =
        std::fs::read_dir(alignment_dir).with_context(|| format!("reading {flag} {}", alignment_dir.display()))?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.with_context(|| format!("reading {flag} {}", alignment_dir.display()))?;
        if entry.path().is_dir() {
            names.push(entry.file_name().to_string_lossy().to_string());
        }
    }
    Ok(names)
}

/// The MSA files of a chain folder, in file-name order; an error naming the folder when it
/// has none.
fn msa_files(folder: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let files = alignment_files(folder)?;
    if files.is_empty() {
        bail!("alignment folder {} has no .a3m or .sto file", folder.display());
    }
    Ok(files)
}

/// A chain folder's `.a3m` and `.sto` files but its hmmsearch hits (template hits, not an MSA:
/// [`HMMSEARCH_HITS`]), in file-name order.
pub(super) fn alignment_files(folder: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let files = files_with(folder, &MSA_EXTENSIONS)?;
    Ok(files.into_iter().filter(|p| !is_hmmsearch_hits(p)).collect())
}

/// The files of a chain folder with one of `extensions`, in file-name order.
pub(crate) fn files_with(folder: &Path, extensions: &[&str]) -> anyhow::Result<Vec<PathBuf>> {
    let entries =
        std::fs::read_dir(folder).with_context(|| format!("reading alignment folder {}", folder.display()))?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry.with_context(|| format!("reading alignment folder {}", folder.display()))?.path();
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if path.is_file() && extensions.contains(&ext) {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// The mmCIF file of entry `pdb`: `<pdb>.cif`, else its lower-case name.
pub(super) fn mmcif_path(mmcif_dir: &Path, pdb: &str, flags: &LayoutFlags) -> anyhow::Result<PathBuf> {
    let candidates = [mmcif_dir.join(format!("{pdb}.cif")), mmcif_dir.join(format!("{}.cif", pdb.to_lowercase()))];
    candidates.iter().find(|p| p.is_file()).cloned().with_context(|| {
        format!("no mmCIF file {} for the chains of {pdb} ({})", candidates[0].display(), flags.mmcif_dir)
    })
}

/// Why a chain fails the filters, or `None`.
pub(super) fn excluded_by(
    filters: &Filters,
    resolution: f64,
    date: Option<&str>,
    sequence: &str,
) -> Option<&'static str> {
    let n = sequence.chars().count();
    if resolution > filters.max_resolution {
        return Some("resolution above --max-resolution");
    }
    if let Some(max) = &filters.max_release_date {
        match date {
            None => return Some("no release date (with --max-release-date)"),
            Some(d) if d > max.as_str() => return Some("released after --max-release-date"),
            _ => {}
        }
    }
    if n < filters.min_length {
        return Some("shorter than --min-length");
    }
    if filters.max_length.is_some_and(|m| n > m) {
        return Some("longer than --max-length");
    }
    let mut counts: HashMap<char, usize> = HashMap::new();
    for c in sequence.chars() {
        *counts.entry(c).or_default() += 1;
    }
    let most = counts.values().copied().max().unwrap_or(0);
    if most as f64 > MAX_SINGLE_AA_PROP * n as f64 {
        return Some("one residue type over 80% of the chain");
    }
    None
}

/// The flags that name a layout's folders, and its use, as errors name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutFlags {
    /// The mmCIF folder's flag.
    pub mmcif_dir: &'static str,
    /// The alignment folder's flag.
    pub alignment_dir: &'static str,
    /// What its chains are for.
    pub what: &'static str,
}

impl LayoutFlags {
    /// The training chains' (`--mmcif-dir`, `--alignment-dir`).
    pub const TRAINING: LayoutFlags =
        LayoutFlags { mmcif_dir: "--mmcif-dir", alignment_dir: "--alignment-dir", what: "training" };
    /// The held-out chains' (`--val-mmcif-dir`, `--val-alignment-dir`).
    pub const VALIDATION: LayoutFlags =
        LayoutFlags { mmcif_dir: "--val-mmcif-dir", alignment_dir: "--val-alignment-dir", what: "validation" };
}

/// The chains of the layout that pass `filters`. Every mmCIF entry named is read once (on the
/// rayon pool) for its resolution, release date and SEQRES, unless the filters hold a chain
/// data cache, which gives them. Errors name the missing folder, file or chain.
pub fn select(mmcif_dir: &Path, alignment_dir: &Path, filters: &Filters) -> anyhow::Result<Selection> {
    select_as(mmcif_dir, alignment_dir, filters, &LayoutFlags::TRAINING)
}

/// [`select`] for a layout that `flags` name (in its errors).
pub fn select_as(
    mmcif_dir: &Path,
    alignment_dir: &Path,
    filters: &Filters,
    flags: &LayoutFlags,
) -> anyhow::Result<Selection> {
    if !mmcif_dir.is_dir() {
        bail!("{} {} is not a folder", flags.mmcif_dir, mmcif_dir.display());
    }
    let mut names = match &filters.train_list {
        Some(list) => list.clone(),
        None => chain_folders(alignment_dir, flags)?,
    };
    names.sort();
    names.dedup();
    let mut located: Vec<Located> = Vec::with_capacity(names.len());
    for name in &names {
        let (pdb, chain) = split_name(name)
            .with_context(|| format!("chain {name:?} (in {}) is not named <pdb>_<chain>", alignment_dir.display()))?;
        let folder = alignment_dir.join(name);
        if !folder.is_dir() {
            bail!("no alignment folder {} for chain {name} ({})", folder.display(), flags.alignment_dir);
        }
        located.push((name.clone(), pdb.to_string(), chain.to_string(), mmcif_path(mmcif_dir, pdb, flags)?, folder));
    }
    let mut chains = Vec::new();
    let mut excluded: Vec<(String, usize)> = Vec::new();
    let mut exclude = |why: &str| count_excluded(&mut excluded, why);
    // (resolution, release date, sequence, cluster size) of each chain, None when the cache
    // lacks it.
    let described: Vec<Option<Described>> = match &filters.chain_data {
        Some(cache) => located
            .iter()
            .map(|l| {
                let c = cache.get(&l.0)?;
                Some((c.resolution.unwrap_or(0.0), c.release_date.clone(), c.seq.clone(), c.cluster_size))
            })
            .collect(),
        None => described_by_entries(&located)?.into_iter().map(Some).collect(),
    };
    for ((name, _, chain, path, folder), described) in located.into_iter().zip(described) {
        let Some((resolution, date, sequence, cluster_size)) = described else {
            exclude("not in --chain-data-cache");
            continue;
        };
        if let Some(why) = excluded_by(filters, resolution, date.as_deref(), &sequence) {
            exclude(why);
            continue;
        }
        let msas = msa_files(&folder)?;
        let templates = hit_files(&folder)?;
        let length = sequence.chars().count();
        chains.push(ChainEntry { name, chain, length, cluster_size, mmcif: path, msas, templates });
    }
    if chains.is_empty() {
        return Err(nothing_selected(&format!("{} chains", flags.what), flags, alignment_dir, &excluded));
    }
    Ok(Selection { chains, excluded })
}

/// The error of a layout where nothing (`what`: "training chains") passes the filters, with how
/// many each left out.
pub(super) fn nothing_selected(
    what: &str,
    flags: &LayoutFlags,
    alignment_dir: &Path,
    excluded: &[(String, usize)],
) -> anyhow::Error {
    let why: Vec<String> = excluded.iter().map(|(w, n)| format!("{n} {w}")).collect();
    anyhow::anyhow!(
        "no {what} in {} {} ({})",
        flags.alignment_dir,
        alignment_dir.display(),
        if why.is_empty() { "it has no chain folders".to_string() } else { format!("left out: {}", why.join(", ")) }
    )
}

/// Counts one more left out for `why`.
pub(super) fn count_excluded(excluded: &mut Vec<(String, usize)>, why: &str) {
    match excluded.iter_mut().find(|(w, _)| w == why) {
        Some((_, n)) => *n += 1,
        None => excluded.push((why.to_string(), 1)),
    }
}

/// A located chain: (name, pdb id, chain id, mmCIF file, alignment folder).
type Located = (String, String, String, PathBuf, PathBuf);

/// What the filters and the sampling read of a chain: (resolution, release date, SEQRES,
/// cluster size).
type Described = (f64, Option<String>, String, Option<usize>);

/// (resolution, release date, SEQRES) of each chain from its mmCIF entry, each entry parsed
/// once (on the rayon pool) whatever number of its chains train; no cluster size.
fn described_by_entries(located: &[Located]) -> anyhow::Result<Vec<Described>> {
    let mut files: Vec<PathBuf> = located.iter().map(|l| l.3.clone()).collect();
    files.sort();
    files.dedup();
    let parsed: HashMap<PathBuf, mmcif::Mmcif> = files
        .into_par_iter()
        .map(|p| {
            let entry = mmcif::read(&p)?;
            Ok((p, entry))
        })
        .collect::<anyhow::Result<Vec<_>>>()?
        .into_iter()
        .collect();
    located
        .iter()
        .map(|(name, _, chain, path, _)| {
            let entry = &parsed[path];
            let found = entry.chain(chain).with_context(|| {
                let ids: Vec<&str> = entry.chains.iter().map(|c| c.id.as_str()).collect();
                format!(
                    "{}: no protein chain {chain:?} for {name} (its protein chains: {})",
                    path.display(),
                    ids.join(", ")
                )
            })?;
            Ok((entry.resolution, entry.release_date.clone(), chain_sequence(found), None))
        })
        .collect()
}

/// The extension of a chain folder's template hit files (hhsearch's; OpenFold names pdb70's
/// `pdb70_hits.hhr`).
pub const HIT_EXTENSION: &str = "hhr";
/// The names of a chain folder's hmmsearch hits (OpenFold's, then predict's), in file-name
/// order. They are Stockholm files but no MSA: the MSA readers leave them out
/// ([`is_hmmsearch_hits`]).
pub const HMMSEARCH_HITS: [&str; 2] = ["hmm_output.sto", PDB_HITS_STO];

/// Whether `path` is a chain folder's hmmsearch hits (one of [`HMMSEARCH_HITS`]).
pub fn is_hmmsearch_hits(path: &Path) -> bool {
    path.file_name().and_then(|n| n.to_str()).is_some_and(|n| HMMSEARCH_HITS.contains(&n))
}

/// A chain folder's template hit files, a monomer chain's and a complex's alike: its hmmsearch
/// hits ([`HMMSEARCH_HITS`]) when it has them, AlphaFold-Multimer's own search, else its `.hhr`
/// files; none when it has neither. The two are not mixed: their hits are featurised by
/// different rules.
pub fn hit_files(folder: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let hmmsearch: Vec<PathBuf> = files_with(folder, &["sto"])?.into_iter().filter(|p| is_hmmsearch_hits(p)).collect();
    match hmmsearch.is_empty() {
        true => files_with(folder, &[HIT_EXTENSION]),
        false => Ok(hmmsearch),
    }
}
