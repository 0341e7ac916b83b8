//! A data set of complexes for AlphaFold-Multimer, in the same layout as the monomer data set
//! ([`super::layout`]): each mmCIF entry of `--mmcif-dir` named by the chain folders of
//! `--alignment-dir` (or `--train-list`) is one complex of all its protein chains, as
//! OpenFold-Multimer trains on whole entries; an entry of one protein chain is a complex of
//! one chain. Every protein chain needs its folder `<pdb>_<chain>/`: its `.a3m` and `.sto`
//! files but `uniprot_hits.*` and hmmsearch's hits are its MSA (as the monomer path reads
//! them), and `uniprot_hits.sto` (or `.a3m`), when there, the rows paired across distinct
//! chains by species (without it a chain pairs its query row alone); its template hits, when
//! there, drawn per example as for a monomer chain: hmmsearch's `hmm_output.sto` (or predict's
//! `pdb_hits.sto`), AlphaFold-Multimer's search, else its `.hhr` files
//! ([`super::layout::hit_files`]). Chains of the same sequence are
//! copies of one entity ([`crate::multimer::Complex`]); the features are
//! [`crate::multimer::features()`]' and the truth the entry's chains in the features' order.
//!
//! The filters are the monomer data set's applied to the whole complex: resolution and
//! release date of the entry, `--min-length`/`--max-length` on its residues in all chains, and
//! no residue type over 80% of them; with OpenFold's chain data cache they read the cache's
//! chains of the entry rather than its parsed file, and entries it lacks are left out
//! ([`select_complexes`]). Entries are drawn over the run as chains are
//! ([`super::loader::schedule`], `openfold` sampling weighing the complex's length and, with
//! the cache, its chains' cluster sizes), each
//! data-parallel replica taking its share of the stream ([`Shard`]), and read ahead on a
//! thread pool. Validation reads held-out complexes by the same selection and reading
//! ([`select_complexes_as`], [`LoadedComplex::read`]; [`crate::validation`]).
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use data::a3m::Msa;
use data::fasta::FastaRecord;
use rayon::prelude::*;
use tch::Device;

use super::example::read_msas;
use super::layout::hit_files;
use super::layout::Selection;
use super::layout::{alignment_files, chain_folders, count_excluded, excluded_by, mmcif_path, nothing_selected};
use super::layout::{split_name, ChainData, Filters, LayoutFlags};
use super::loader::{ChainSampling, Shard, PARALLEL, PREFETCH};
use super::target::{chain_sequence, chain_structure};
use super::templates::{read_hits, TemplateSampling};
use super::transforms::sample_recycles;
use crate::features::RawFeatures;
use crate::input::parse_alignment;
use crate::model::multimer::MultimerInputs;
use crate::multimer::{Complex, EntityInput, MultimerFeatures, PairingMsa};
use crate::pdb::Structure;
use crate::search::mmcif;
use crate::train_complex::{join_chains, TrainingComplex};

/// The stem of a chain folder's UniProt alignment (`uniprot_hits.sto` or `.a3m`), read for
/// pairing rather than as the chain's MSA.
pub const UNIPROT_STEM: &str = "uniprot_hits";

/// One protein chain of a training complex and its alignments.
#[derive(Clone, Debug, PartialEq)]
pub struct EntryChain {
    /// The author chain id in the mmCIF file.
    pub chain: String,
    /// The MSA files of its folder (all `.a3m` and `.sto` but [`UNIPROT_STEM`]'s), in
    /// file-name order.
    pub msas: Vec<PathBuf>,
    /// Its UniProt alignment, when its folder has one.
    pub uniprot: Option<PathBuf>,
    /// Its template hit files ([`super::layout::hit_files`]: hmmsearch's, else `.hhr`), in
    /// file-name order; none when its folder has none.
    pub templates: Vec<PathBuf>,
    /// Its folder.
    pub folder: PathBuf,
    /// Chains in its sequence cluster, from the chain data cache (`None`: not known).
    pub cluster_size: Option<usize>,
}

/// One training complex: an mmCIF entry and its protein chains.
#[derive(Clone, Debug, PartialEq)]
pub struct ComplexEntry {
    /// The entry's id as the chain folders name it (`<pdb>` of `<pdb>_<chain>`).
    pub name: String,
    /// The mmCIF entry.
    pub mmcif: PathBuf,
    /// Its protein chains, in the file's order.
    pub chains: Vec<EntryChain>,
    /// Residues of all its chains.
    pub length: usize,
}

/// The entries of a layout that pass the filters, in name order, and how many each filter
/// left out.
pub type ComplexSelection = Selection<ComplexEntry>;

/// The complexes of the layout that pass `filters`. Which entries: those of the chain folders
/// of `alignment_dir` (or the `--train-list`), each entry once. What an entry is, for the
/// filters and the sampling: without a chain data cache, its mmCIF file parsed (on the rayon
/// pool), all its protein chains in the file's order; with one ([`Filters::chain_data`]), no
/// file is parsed here: the entry's chains are the cache's chains `<pdb>_<chain>` of it (in
/// chain order here; [`load_complex`] lays them out in the file's order, so an example is the
/// same either way), its release date and resolution the cache's (of its first chain: they
/// are the entry's), its residues the chains' `seq`, each chain's `cluster_size` its sampling
/// weight ([`ChainSampling::probability`]); an entry is left out ("not in
/// --chain-data-cache") when the cache lacks it or any chain of it that the folders (or the
/// list) name. Errors name the entry and the chain: an entry without protein chains, a
/// protein chain without its alignment folder or MSA files.
pub fn select_complexes(mmcif_dir: &Path, alignment_dir: &Path, filters: &Filters) -> anyhow::Result<ComplexSelection> {
    select_complexes_as(mmcif_dir, alignment_dir, filters, &LayoutFlags::TRAINING)
}

/// [`select_complexes`] for a layout that `flags` name in its errors (the held-out complexes'
/// of validation, [`LayoutFlags::VALIDATION`]).
pub fn select_complexes_as(
    mmcif_dir: &Path,
    alignment_dir: &Path,
    filters: &Filters,
    flags: &LayoutFlags,
) -> anyhow::Result<ComplexSelection> {
    if !mmcif_dir.is_dir() {
        bail!("{} {} is not a folder", flags.mmcif_dir, mmcif_dir.display());
    }
    let names = match &filters.train_list {
        Some(list) => list.clone(),
        None => chain_folders(alignment_dir, flags)?,
    };
    // Each entry and the chains the folders (or the list) name of it.
    let mut named: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for name in &names {
        let (pdb, chain) = split_name(name)
            .with_context(|| format!("chain {name:?} (in {}) is not named <pdb>_<chain>", alignment_dir.display()))?;
        named.entry(pdb.to_string()).or_default().push(chain.to_string());
    }
    let located: Vec<(String, PathBuf)> =
        named.keys().map(|pdb| Ok((pdb.clone(), mmcif_path(mmcif_dir, pdb, flags)?))).collect::<anyhow::Result<_>>()?;
    let described: Vec<Option<Described>> = match &filters.chain_data {
        Some(cache) => {
            let by_entry = cache_by_entry(cache);
            located.iter().map(|(pdb, _)| described_by_cache(by_entry.get(pdb.as_str()), &named[pdb])).collect()
        }
        None => located
            .par_iter()
            .map(|(pdb, path)| described_by_entry(pdb, path, flags).map(Some))
            .collect::<anyhow::Result<_>>()?,
    };
    let (mut entries, mut excluded): (Vec<ComplexEntry>, Vec<(String, usize)>) = (Vec::new(), Vec::new());
    for ((pdb, path), described) in located.into_iter().zip(described) {
        let Some(d) = described else {
            count_excluded(&mut excluded, "not in --chain-data-cache");
            continue;
        };
        let sequence: String = d.chains.iter().map(|c| c.1.as_str()).collect();
        if let Some(why) = excluded_by(filters, d.resolution, d.release_date.as_deref(), &sequence) {
            count_excluded(&mut excluded, why);
            continue;
        }
        let chains = d
            .chains
            .iter()
            .map(|(id, _, cluster_size)| entry_chain(alignment_dir, &pdb, id, *cluster_size, &path, flags))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let length = sequence.chars().count();
        entries.push(ComplexEntry { name: pdb, mmcif: path, chains, length });
    }
    if entries.is_empty() {
        return Err(nothing_selected(&format!("{} complexes", flags.what), flags, alignment_dir, &excluded));
    }
    Ok(Selection { chains: entries, excluded })
}

/// What the filters and the sampling read of an entry: its protein chains (id, SEQRES, cluster
/// size), resolution (0: none) and release date.
struct Described {
    chains: Vec<(String, String, Option<usize>)>,
    resolution: f64,
    release_date: Option<String>,
}

/// Entry `pdb` as its mmCIF file `path` describes it: its protein chains in the file's order
/// (none is an error naming the entry), no cluster sizes.
fn described_by_entry(pdb: &str, path: &Path, flags: &LayoutFlags) -> anyhow::Result<Described> {
    let entry = mmcif::read(path).with_context(|| format!("entry {pdb}"))?;
    if entry.chains.is_empty() {
        bail!("entry {pdb} ({}): no protein chains (a {} complex needs one)", path.display(), flags.what);
    }
    let chains = entry.chains.iter().map(|c| (c.id.clone(), chain_sequence(c), None)).collect();
    Ok(Described { chains, resolution: entry.resolution, release_date: entry.release_date })
}

/// The chain data cache's chains grouped by entry: `<pdb>` -> (chain, record), in chain order.
fn cache_by_entry(cache: &HashMap<String, ChainData>) -> HashMap<&str, Vec<(&str, &ChainData)>> {
    let mut by_entry: HashMap<&str, Vec<(&str, &ChainData)>> = HashMap::new();
    for (name, data) in cache {
        if let Some((pdb, chain)) = split_name(name) {
            by_entry.entry(pdb).or_default().push((chain, data));
        }
    }
    for chains in by_entry.values_mut() {
        chains.sort_by(|a, b| a.0.cmp(b.0));
    }
    by_entry
}

/// An entry as the chain data cache describes it (`cached`: its chains there), `None` when the
/// cache lacks it or one of its `named` chains.
fn described_by_cache(cached: Option<&Vec<(&str, &ChainData)>>, named: &[String]) -> Option<Described> {
    let cached = cached?;
    if !named.iter().all(|n| cached.iter().any(|(c, _)| c == n)) {
        return None;
    }
    let first = cached.first()?.1;
    Some(Described {
        chains: cached.iter().map(|(c, d)| (c.to_string(), d.seq.clone(), d.cluster_size)).collect(),
        resolution: first.resolution.unwrap_or(0.0),
        release_date: first.release_date.clone(),
    })
}

/// Chain `chain` of entry `pdb` (read from `mmcif`): its folder's alignments, or an error
/// naming the entry, the chain, the folder and its flag in `flags`.
fn entry_chain(
    alignment_dir: &Path,
    pdb: &str,
    chain: &str,
    cluster_size: Option<usize>,
    mmcif: &Path,
    flags: &LayoutFlags,
) -> anyhow::Result<EntryChain> {
    let folder = alignment_dir.join(format!("{pdb}_{chain}"));
    if !folder.is_dir() {
        bail!(
            "entry {pdb} ({}): protein chain {chain} has no alignment folder {} ({}; every protein chain of a \
             complex needs its alignments)",
            mmcif.display(),
            folder.display(),
            flags.alignment_dir
        );
    }
    let is_uniprot = |p: &PathBuf| p.file_stem().is_some_and(|s| s == UNIPROT_STEM);
    let (uniprot, msas): (Vec<PathBuf>, Vec<PathBuf>) = alignment_files(&folder)?.into_iter().partition(is_uniprot);
    if msas.is_empty() {
        bail!(
            "entry {pdb}, chain {chain}: alignment folder {} has no .a3m or .sto file (but {UNIPROT_STEM} and \
             template hits)",
            folder.display()
        );
    }
    let templates = hit_files(&folder)?;
    let uniprot = uniprot.into_iter().next();
    Ok(EntryChain { chain: chain.to_string(), msas, uniprot, templates, folder, cluster_size })
}

/// A complex as read for one example: its features (numpy-like arrays, on no device yet), its
/// truth laid out as the features' chains, and the draws of its number.
#[derive(Debug)]
pub struct LoadedComplex {
    /// The entry and its chains as the log names them (`1abc A+B`).
    pub name: String,
    /// The mmCIF file, for errors.
    pub mmcif: PathBuf,
    /// AlphaFold-Multimer's features of the whole complex.
    pub features: MultimerFeatures,
    /// Its true structure, whole, in the features' chain order.
    pub truth: Structure,
    /// The entry's resolution in Å (0: none).
    pub resolution: f64,
    /// Its number in the run's stream of examples.
    pub number: u64,
    /// Recycling passes before the trained one, drawn from the number.
    pub recycles: usize,
}

impl LoadedComplex {
    /// Reads `entry` ([`load_complex`]) as example `number` of a run, with `recycles` passes
    /// before the last; with `templates` (sampling, seed), each entity's templates drawn for
    /// that number. Named in the log as its entry and chains (`1abc A+B`).
    pub fn read(
        entry: &ComplexEntry,
        templates: Option<(&TemplateSampling, u64)>,
        number: u64,
        recycles: usize,
    ) -> anyhow::Result<LoadedComplex> {
        let (features, truth, resolution) = load_complex(entry, templates.map(|(t, seed)| (t, seed, number)))?;
        let letters: Vec<&str> = entry.chains.iter().map(|c| c.chain.as_str()).collect();
        Ok(LoadedComplex {
            name: format!("{} {}", entry.name, letters.join("+")),
            mmcif: entry.mmcif.clone(),
            features,
            truth,
            resolution,
            number,
            recycles,
        })
    }

    /// The complex on `device`, cropped to `crop` residues per example when given.
    pub fn training(&self, crop: Option<usize>, device: Device) -> anyhow::Result<TrainingComplex> {
        let f = &self.features;
        let inputs = MultimerInputs::from_named(|n| f.get(n).map(|a| a.tensor().to_device(device)), &self.name)?;
        let source = format!("entry {} ({})", self.name, self.mmcif.display());
        TrainingComplex::new(inputs, self.truth.clone(), self.resolution, crop, source)
    }
}

/// Reads `entry` as a complex (its features, truth and resolution): each protein chain's mmCIF chain and MSAs (SEQRES's unknown
/// residues named by the alignments' query, as for a monomer chain), the chains in file order
/// as AlphaFold-Multimer's records `A`, `B`, ..., each entity's features from its first
/// chain's alignments, pairing from the UniProt alignment of each distinct chain (its query
/// row alone without one). With `templates`, (sampling, seed, example number), each entity whose
/// first chain has hit files draws its templates as a monomer chain does
/// ([`TemplateSampling::sample`], the hits before the entry's release), keyed by the seed, the
/// example's number and the entity; Multimer's pipeline keeps up to 4 per chain.
pub fn load_complex(
    entry: &ComplexEntry,
    templates: Option<(&TemplateSampling, u64, u64)>,
) -> anyhow::Result<(MultimerFeatures, Structure, f64)> {
    let parsed = mmcif::read(&entry.mmcif)?;
    let chains = in_file_order(entry, &parsed)?;
    let mut records = Vec::with_capacity(chains.len());
    let mut read = Vec::with_capacity(chains.len());
    for c in &chains {
        let name = format!("{}_{}", entry.name, c.chain);
        let found = parsed.chain(&c.chain).with_context(|| {
            format!("entry {} ({}): no protein chain {}", entry.name, entry.mmcif.display(), c.chain)
        })?;
        let (msa, sequence) = read_msas(&c.msas, &name, &chain_sequence(found), &entry.mmcif)?;
        records.push(FastaRecord { name: name.clone(), description: name.clone(), sequence: sequence.clone() });
        read.push((msa, sequence, chain_structure(found)));
    }
    let complex = Complex::new(&records, &entry.mmcif)?;
    let index = |id: char| complex.chains.iter().position(|c| c.id == id).unwrap_or(0);
    let pair = !complex.is_homomer_or_monomer();
    let entities = complex
        .entity_representatives()
        .into_iter()
        .enumerate()
        .map(|(e, rep)| {
            let k = index(rep.id);
            let (c, (msa, sequence, _)) = (chains[k], &read[k]);
            let what = || format!("entry {}, chain {} ({})", entry.name, c.chain, c.folder.display());
            let mut raw = RawFeatures::new(sequence, Some((msa, &c.msas[0]))).with_context(what)?;
            if let (Some((sampling, seed, number)), false) = (templates, c.templates.is_empty()) {
                let release = parsed.release_date.clone();
                let hits = read_hits(&c.templates, sequence, &entry.name, release).with_context(what)?;
                raw.templates = Some(sampling.draw(sequence, &hits, (seed, number, e as u64)).with_context(what)?);
            }
            let pairing = match pair {
                true => Some(pairing(c, sequence, &rep.record).with_context(what)?),
                false => None,
            };
            Ok(EntityInput { raw, pairing })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let features = crate::multimer::features(&complex, &entities)
        .with_context(|| format!("entry {} ({})", entry.name, entry.mmcif.display()))?;
    let truth = join_chains(complex.assembly_order().iter().map(|c| read[index(c.id)].2.clone()).collect())
        .context("a complex without chains")?;
    Ok((features, truth, parsed.resolution))
}

/// `entry`'s chains in the order of its mmCIF file's protein chains (`parsed`): an error names
/// the entry and a protein chain of the file that the entry lacks (a chain data cache without
/// it), or a chain of the entry that the file lacks.
fn in_file_order<'a>(entry: &'a ComplexEntry, parsed: &mmcif::Mmcif) -> anyhow::Result<Vec<&'a EntryChain>> {
    let what = || format!("entry {} ({})", entry.name, entry.mmcif.display());
    let mut chains = Vec::with_capacity(entry.chains.len());
    for p in &parsed.chains {
        let c = entry.chains.iter().find(|c| c.chain == p.id).with_context(|| {
            let ids: Vec<&str> = entry.chains.iter().map(|c| c.chain.as_str()).collect();
            format!(
                "{}: its protein chain {} is not among the complex's chains {} (with --chain-data-cache: the \
                 cache's chains of the entry)",
                what(),
                p.id,
                ids.join(", ")
            )
        })?;
        chains.push(c);
    }
    if let Some(c) = entry.chains.iter().find(|c| parsed.chain(&c.chain).is_none()) {
        bail!("{}: no protein chain {}", what(), c.chain);
    }
    Ok(chains)
}

/// A chain's rows for pairing: its UniProt alignment, else its query row alone.
fn pairing(chain: &EntryChain, sequence: &str, name: &str) -> anyhow::Result<PairingMsa> {
    match &chain.uniprot {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
            let msa = parse_alignment(&text, path)?;
            Ok(PairingMsa::new(sequence, &msa, path)?)
        }
        None => Ok(PairingMsa::new(sequence, &Msa::single(sequence, name), &chain.folder)?),
    }
}

/// This replica's complexes, arriving in order, read ahead on a pool of threads.
pub struct ComplexLoader(data::loader::Prefetch<LoadedComplex, anyhow::Error>);

impl ComplexLoader {
    /// Starts reading `shard`'s examples of steps `first..=steps` from `entries`, drawn by
    /// `sampling` (on the complexes' lengths) under `seed`, each with its recycling count drawn
    /// from 0..=`max_recycles` by its number and its templates by `templates` (`None`: none),
    /// on `workers` threads.
    pub fn from_step(
        entries: Vec<ComplexEntry>,
        sampling: ChainSampling,
        templates: Option<TemplateSampling>,
        (seed, max_recycles): (u64, usize),
        (first, steps): (u64, u64),
        shard: Shard,
        workers: usize,
    ) -> anyhow::Result<ComplexLoader> {
        let acceptance: Vec<f64> = entries
            .iter()
            .map(|e| sampling.probability(e.length, &e.chains.iter().map(|c| c.cluster_size).collect::<Vec<_>>()))
            .collect();
        let specs = shard.stream(&acceptance, seed, first, steps)?;
        let entries = Arc::new(entries);
        let make = move |&(number, k): &(u64, usize)| -> anyhow::Result<LoadedComplex> {
            let recycles = sample_recycles(seed, number, max_recycles);
            LoadedComplex::read(&entries[k], templates.as_ref().map(|t| (t, seed)), number, recycles)
        };
        let parallel = PARALLEL.min(workers.max(1));
        Ok(ComplexLoader(data::loader::Prefetch::new(specs, workers, parallel, PREFETCH, make)?))
    }

    /// The next complex.
    pub fn next_complex(&mut self) -> anyhow::Result<LoadedComplex> {
        self.0.next().unwrap_or_else(|| Err(anyhow::anyhow!("the training data loader stopped early")))
    }
}
