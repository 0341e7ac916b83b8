//! Template features from hhsearch's pdb70 hits, as AlphaFold's `templates.py`
//! (`HhsearchHitFeaturizer.get_templates`, `_process_single_hit`) makes them: hits in order
//! of `Sum_probs`, each mapped from the query onto its PDB chain's SEQRES (found in the mmCIF
//! file `<mmcif_dir>/<pdb id>.cif` exactly, by sequence alone, or with `X` as a wildcard,
//! else realigned with kalign), its atoms placed at the query residues they align to. Hits
//! are dropped as AlphaFold drops them: obsolete entries (or replaced by their successor),
//! released after `--max-template-date`, aligned over 10% of the query or less, shorter than
//! 10 residues, a realigned chain under 90% identical to the hit, a chain whose neighbouring
//! Cα atoms are over 150 Å apart, fewer than 5 atoms placed. At most [`MAX_HITS`] hits are kept.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use super::hhr::TemplateHit;
use super::mmcif::{self, Chain, Mmcif};
use super::tools::{Tool, WorkDir};
use crate::residue_constants::{atom_order, ATOM_TYPE_NUM};

/// Hits featurised per query (AlphaFold's `MAX_TEMPLATE_HITS`); the model uses the first 4.
pub const MAX_HITS: usize = 20;
/// Largest distance between consecutive Cα atoms of a usable chain (Å).
const MAX_CA_CA_DISTANCE: f32 = 150.0;

/// One featurised hit, aligned to the query (N residues).
#[derive(Clone, Debug, PartialEq)]
pub struct TemplateHitFeatures {
    /// The template residue at each query position, `-` where none aligns (N letters).
    pub sequence: String,
    /// `[N][37]` atom positions (Å), zero where absent.
    pub positions: Vec<[[f32; 3]; ATOM_TYPE_NUM]>,
    /// `[N][37]` 1 where the atom is present.
    pub masks: Vec<[f32; ATOM_TYPE_NUM]>,
    /// `<pdb id>_<chain>`.
    pub domain_name: String,
    /// The hit's `Sum_probs` (0 for hmmsearch hits).
    pub sum_probs: f32,
}

/// What turns hits into features.
#[derive(Clone, Debug)]
pub struct Featurizer {
    /// `pdb_mmcif/mmcif_files`.
    pub mmcif_dir: PathBuf,
    /// Latest release date allowed, `YYYY-MM-DD`.
    pub max_template_date: String,
    /// Entries that are obsolete: id -> its replacement (`None`: withdrawn).
    pub obsolete: HashMap<String, Option<String>>,
    /// The kalign binary for realignments.
    pub kalign: Tool,
    /// Keep only the first hit giving each aligned template sequence (AlphaFold's
    /// `HmmsearchHitFeaturizer`; its `HhsearchHitFeaturizer` keeps every hit).
    pub unique_sequences: bool,
}

/// The featurised hits and, for each hit dropped, why.
#[derive(Clone, Debug, Default)]
pub struct TemplateSearchResult {
    /// At most [`MAX_HITS`], best first.
    pub hits: Vec<TemplateHitFeatures>,
    /// Why hits were dropped (or realigned).
    pub warnings: Vec<String>,
}

/// Checks a `YYYY-MM-DD` date (as `--max-template-date` takes it).
pub fn check_date(date: &str) -> anyhow::Result<()> {
    let parts: Vec<&str> = date.split('-').collect();
    let digits = parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()));
    let ok = match parts[..] {
        [y, m, d] if digits && y.len() == 4 && m.len() == 2 && d.len() == 2 => {
            let (y, m, d) =
                (y.parse::<u32>().unwrap_or(0), m.parse::<u32>().unwrap_or(0), d.parse::<u32>().unwrap_or(0));
            let leap = y % 4 == 0 && (y % 100 != 0 || y % 400 == 0);
            let days = match m {
                2 if leap => 29,
                2 => 28,
                4 | 6 | 9 | 11 => 30,
                _ => 31,
            };
            (1..=12).contains(&m) && (1..=days).contains(&d)
        }
        _ => false,
    };
    if !ok {
        bail!("--max-template-date {date:?} is not a date YYYY-MM-DD");
    }
    Ok(())
}

/// PDB's `obsolete.dat` (`OBSLTE` lines: the withdrawn id at columns 21..25, its
/// replacement at 30..34 when there is one), as AlphaFold's `_parse_obsolete` reads it.
pub fn parse_obsolete(text: &str) -> HashMap<String, Option<String>> {
    let mut out = HashMap::new();
    for line in text.lines().map(str::trim) {
        if !line.starts_with("OBSLTE") {
            continue;
        }
        if line.len() > 30 {
            if let (Some(from), Some(to)) = (line.get(20..24), line.get(29..33)) {
                out.insert(from.to_lowercase(), Some(to.to_lowercase()));
            }
        } else if let (24, Some(from)) = (line.len(), line.get(20..24)) {
            out.insert(from.to_lowercase(), None);
        }
    }
    out
}

/// The PDB id (lower case) and chain of a pdb70 hit name (`1abc_A ...`).
pub fn pdb_id_and_chain(name: &str) -> anyhow::Result<(String, String)> {
    let id: String = name.chars().take(4).collect();
    let rest = &name[id.len()..];
    let chain: String = rest
        .strip_prefix('_')
        .map(|r| r.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '.').collect())
        .unwrap_or_default();
    if id.len() != 4 || !id.chars().all(|c| c.is_ascii_alphanumeric()) || chain.is_empty() {
        bail!("template hit {name:?} is not named <pdb id>_<chain>");
    }
    Ok((id.to_lowercase(), chain))
}

/// Why a hit gives no features (kept as a warning).
type Skip = String;
/// (query position, template position) pairs.
type Mapping = Vec<(usize, usize)>;

impl Featurizer {
    /// The features of `hits` for `query`, best `Sum_probs` first, at most [`MAX_HITS`].
    /// Errors (a missing or malformed mmCIF file, kalign failing to run) name the file.
    pub fn get_templates(&self, query: &str, hits: &[TemplateHit]) -> anyhow::Result<TemplateSearchResult> {
        let mut sorted: Vec<&TemplateHit> = hits.iter().collect();
        // Stable, as Python's sort: equal scores keep the file's order; hits without scores
        // (hmmsearch's) keep it too.
        if hits.first().is_some_and(|h| h.sum_probs.is_some()) {
            sorted.sort_by(|a, b| b.sum_probs.partial_cmp(&a.sum_probs).unwrap_or(std::cmp::Ordering::Equal));
        }
        self.featurize_in_order(query, &sorted, MAX_HITS)
    }

    /// The features of `hits` for `query`, taken in the order given (training draws its own,
    /// [`crate::train_data::templates`]) until `max` are featurised; errors as
    /// [`Featurizer::get_templates`].
    pub fn featurize_in_order(
        &self,
        query: &str,
        hits: &[&TemplateHit],
        max: usize,
    ) -> anyhow::Result<TemplateSearchResult> {
        let mut result = TemplateSearchResult::default();
        let mut cache: HashMap<String, Mmcif> = HashMap::new();
        for &hit in hits {
            if result.hits.len() >= max {
                break;
            }
            match self.process_hit(query, hit, &mut cache)? {
                Ok((features, warning)) => {
                    result.warnings.extend(warning);
                    if self.unique_sequences && result.hits.iter().any(|h| h.sequence == features.sequence) {
                        continue;
                    }
                    result.hits.push(features);
                }
                Err(skip) => result.warnings.push(format!("hit {} skipped: {skip}", hit.name)),
            }
        }
        Ok(result)
    }

    /// One hit: its features (and a realignment note), or why it was dropped.
    fn process_hit(
        &self,
        query: &str,
        hit: &TemplateHit,
        cache: &mut HashMap<String, Mmcif>,
    ) -> anyhow::Result<Result<(TemplateHitFeatures, Option<String>), Skip>> {
        let (mut pdb_id, chain_id) = pdb_id_and_chain(&hit.name)?;
        match self.obsolete.get(&pdb_id) {
            Some(None) => return Ok(Err(format!("{pdb_id} is obsolete"))),
            Some(Some(new)) => pdb_id = new.clone(),
            None => {}
        }
        if let Err(skip) = prefilter(hit, query) {
            return Ok(Err(skip));
        }
        let mapping = query_to_hit_mapping(hit, query);
        let template_sequence = hit.hit_sequence.replace('-', "");
        let path = self.mmcif_dir.join(format!("{pdb_id}.cif"));
        if !cache.contains_key(&pdb_id) {
            let parsed = mmcif::read(&path).with_context(|| format!("template hit {}", hit.name))?;
            cache.insert(pdb_id.clone(), parsed);
        }
        let entry = &cache[&pdb_id];
        let date = entry.release_date.as_deref().with_context(|| {
            format!("{}: no _pdbx_audit_revision_history.revision_date (the release date)", path.display())
        })?;
        if date > self.max_template_date.as_str() {
            return Ok(Err(format!("released {date}, after --max-template-date {}", self.max_template_date)));
        }
        self.extract(
            entry,
            &pdb_id,
            &chain_id,
            mapping,
            &template_sequence,
            query,
            hit.sum_probs.unwrap_or(0.0) as f32,
            &path,
        )
    }

    /// `_extract_template_features`: the chain found (or realigned), its atoms placed.
    #[allow(clippy::too_many_arguments)]
    fn extract(
        &self,
        entry: &Mmcif,
        pdb_id: &str,
        chain_id: &str,
        mapping: Vec<(usize, usize)>,
        template_sequence: &str,
        query: &str,
        sum_probs: f32,
        path: &Path,
    ) -> anyhow::Result<Result<(TemplateHitFeatures, Option<String>), Skip>> {
        let (chain, mapping, offset, warning) = match find_in_entry(chain_id, template_sequence, entry) {
            Some((chain, offset)) => (chain, mapping, offset, None),
            None => {
                let warning = format!(
                    "the sequence {template_sequence} of {pdb_id}_{chain_id} is not in {}: realigned with kalign",
                    path.display()
                );
                match self.realign(template_sequence, chain_id, entry, &mapping)? {
                    Ok((chain, mapping)) => (chain, mapping, 0, Some(warning)),
                    Err(skip) => return Ok(Err(skip)),
                }
            }
        };
        let (positions, masks) = match atom_positions(chain) {
            Ok(atoms) => atoms,
            Err(skip) => return Ok(Err(format!("no atom data for {pdb_id}_{}: {skip}", chain.id))),
        };
        let n = query.chars().count();
        let mut out = TemplateHitFeatures {
            sequence: String::new(),
            positions: vec![[[0.0; 3]; ATOM_TYPE_NUM]; n],
            masks: vec![[0.0; ATOM_TYPE_NUM]; n],
            domain_name: format!("{}_{}", pdb_id.to_lowercase(), chain.id),
            sum_probs,
        };
        let mut letters = vec!['-'; n];
        let seq: Vec<char> = chain.sequence.chars().collect();
        // After a realignment the mapping points into the chain's SEQRES itself.
        let template_letters: Vec<char> = if warning.is_some() { seq } else { template_sequence.chars().collect() };
        for &(q, t) in &mapping {
            let at = t + offset;
            let (Some(&letter), true) = (template_letters.get(t), at < positions.len()) else {
                return Ok(Err(format!("the alignment runs past the end of {pdb_id}_{}", chain.id)));
            };
            out.positions[q] = positions[at];
            out.masks[q] = masks[at];
            letters[q] = letter;
        }
        let placed: f32 = out.masks.iter().flatten().sum();
        if placed < 5.0 {
            return Ok(Err(format!("only {placed} atoms of {pdb_id}_{} align to the query", chain.id)));
        }
        out.sequence = letters.into_iter().collect();
        Ok(Ok((out, warning)))
    }

    /// `_realign_pdb_template_to_query`: the hit's sequence aligned with kalign to the chain's
    /// SEQRES (the only chain when `chain_id` is not there), the query mapping carried over;
    /// dropped when under 90% of the shorter sequence is identical.
    fn realign<'a>(
        &self,
        old: &str,
        chain_id: &str,
        entry: &'a Mmcif,
        mapping: &[(usize, usize)],
    ) -> anyhow::Result<Result<(&'a Chain, Mapping), Skip>> {
        let chain = match entry.chain(chain_id) {
            Some(c) if !c.sequence.is_empty() => c,
            _ if entry.chains.len() == 1 => &entry.chains[0],
            _ => return Ok(Err(format!("no protein chain {chain_id}"))),
        };
        let new = chain.sequence.as_str();
        if old.len() < 6 || new.len() < 6 {
            return Ok(Err("kalign needs sequences of at least 6 residues".into()));
        }
        let (old_aligned, new_aligned) = kalign_pair(&self.kalign, old, new)?;
        let mut old_to_new = HashMap::new();
        let (mut i, mut j, mut same) = (-1i64, -1i64, 0usize);
        for (a, b) in old_aligned.chars().zip(new_aligned.chars()) {
            i += (a != '-') as i64;
            j += (b != '-') as i64;
            if a != '-' && b != '-' {
                old_to_new.insert(i as usize, j as usize);
                same += (a == b) as usize;
            }
        }
        if (same as f64) / (old.len().min(new.len()) as f64) < 0.9 {
            return Ok(Err(format!("{old} and the chain's sequence {new} are under 90% identical")));
        }
        // Query positions whose template residue has no counterpart map nowhere.
        let mapped = mapping.iter().filter_map(|&(q, t)| old_to_new.get(&t).map(|&n| (q, n))).collect();
        Ok(Ok((chain, mapped)))
    }
}

/// AlphaFold's prefilter (`_assess_hhsearch_hit` with `max_subsequence_ratio` 1.0, as
/// `_process_single_hit` calls it): the hit must cover over 10% of the query and have at
/// least 10 residues (a duplicate of the query is a subsequence longer than it: never).
fn prefilter(hit: &TemplateHit, query: &str) -> Result<(), Skip> {
    let n = query.chars().count() as f64;
    let align_ratio = hit.aligned_cols as f64 / n;
    let template = hit.hit_sequence.replace('-', "");
    if align_ratio <= 0.1 {
        return Err(format!("aligned over {align_ratio:.3} of the query (at most 0.1)"));
    }
    if query.contains(&template) && template.len() as f64 / n > 1.0 {
        return Err("a duplicate of the query".into());
    }
    if template.len() < 10 {
        return Err(format!("{} residues (under 10)", template.len()));
    }
    Ok(())
}

/// `_build_query_to_hit_index_mapping`: (query position, hit position) of each column where
/// both have a residue, positions counted in the original query and in the hit's aligned part.
pub fn query_to_hit_mapping(hit: &TemplateHit, query: &str) -> Vec<(usize, usize)> {
    if hit.query.is_empty() {
        return Vec::new();
    }
    let hh_query = hit.query.replace('-', "");
    let hit_len = hit.hit_sequence.replace('-', "").len();
    let offset = query.find(&hh_query).map_or(-1, |o| o as i64);
    let min_of = |v: &[i64]| v.iter().copied().filter(|&x| x > -1).min().unwrap_or(0);
    let (min_hit, min_query) = (min_of(&hit.indices_hit), min_of(&hit.indices_query));
    let n = query.len() as i64;
    let mut mapping: Vec<(usize, usize)> = Vec::new();
    for (&qi, &ti) in hit.indices_query.iter().zip(&hit.indices_hit) {
        if qi == -1 || ti == -1 {
            continue;
        }
        let (q, t) = (qi - min_query + offset, ti - min_hit);
        if t >= hit_len as i64 || q >= n || q < 0 {
            continue;
        }
        // A later column for the same query position replaces the earlier (a dict in Python).
        match mapping.iter_mut().find(|(a, _)| *a == q as usize) {
            Some(m) => m.1 = t as usize,
            None => mapping.push((q as usize, t as usize)),
        }
    }
    mapping
}

/// `_find_template_in_pdb`: the chain holding `template` (the hit's chain, else any chain,
/// else any chain matching with `X` as a wildcard), and where in its SEQRES it starts.
fn find_in_entry<'a>(chain_id: &str, template: &str, entry: &'a Mmcif) -> Option<(&'a Chain, usize)> {
    if let Some(c) = entry.chain(chain_id).filter(|c| !c.sequence.is_empty()) {
        if let Some(at) = c.sequence.find(template) {
            return Some((c, at));
        }
    }
    for c in entry.chains.iter().filter(|c| !c.sequence.is_empty()) {
        if let Some(at) = c.sequence.find(template) {
            return Some((c, at));
        }
    }
    let t: Vec<char> = template.chars().collect();
    for c in &entry.chains {
        let s: Vec<char> = c.sequence.chars().collect();
        if t.len() > s.len() {
            continue;
        }
        let fits = |at: usize| t.iter().zip(&s[at..]).all(|(&a, &b)| a == 'X' || a == b || b == 'X');
        if let Some(at) = (0..=s.len() - t.len()).find(|&at| fits(at)) {
            return Some((c, at));
        }
    }
    None
}

/// `_get_atom_positions`: each SEQRES residue's atoms in the 37 atom types
/// ([`Chain::atom37`]), checked for chain breaks over [`MAX_CA_CA_DISTANCE`].
type Atoms = (Vec<[[f32; 3]; ATOM_TYPE_NUM]>, Vec<[f32; ATOM_TYPE_NUM]>);
fn atom_positions(chain: &Chain) -> Result<Atoms, Skip> {
    let ca = atom_order("CA").unwrap();
    let (positions, masks) = chain.atom37();
    let mut previous: Option<(usize, [f32; 3])> = None;
    for (i, (pos, mask)) in positions.iter().zip(&masks).enumerate() {
        if mask[ca] > 0.0 {
            if let Some((_, p)) = previous {
                let d =
                    ((pos[ca][0] - p[0]).powi(2) + (pos[ca][1] - p[1]).powi(2) + (pos[ca][2] - p[2]).powi(2)).sqrt();
                if d > MAX_CA_CA_DISTANCE {
                    return Err(format!("residues {i} and {} are {d:.1} Å apart", i + 1));
                }
            }
            previous = Some((i, pos[ca]));
        } else {
            previous = None;
        }
    }
    Ok((positions, masks))
}

/// Two sequences aligned by kalign (AlphaFold's `Kalign.align`: FASTA in, FASTA out), as
/// gapped strings in the given order.
fn kalign_pair(kalign: &Tool, a: &str, b: &str) -> anyhow::Result<(String, String)> {
    let work = WorkDir::new("kalign")?;
    let input = work.path().join("input.fasta");
    let output = work.path().join("output.a3m");
    std::fs::write(&input, format!(">sequence 0\n{a}\n>sequence 1\n{b}\n"))
        .with_context(|| format!("writing {}", input.display()))?;
    let args = [
        "-i".into(),
        input.clone().into_os_string(),
        "-o".into(),
        output.clone().into_os_string(),
        "-format".into(),
        "fasta".into(),
    ];
    kalign.run(&args, &input)?;
    let text =
        std::fs::read_to_string(&output).with_context(|| format!("kalign wrote no alignment {}", output.display()))?;
    let msa = data::a3m::parse(&text, &output)?;
    match &msa.sequences[..] {
        [x, y] => Ok((x.clone(), y.clone())),
        // The parser keeps one of two identical rows.
        [x] => Ok((x.clone(), x.clone())),
        _ => bail!("kalign's alignment {} has {} sequences, not 2", output.display(), msa.sequences.len()),
    }
}
