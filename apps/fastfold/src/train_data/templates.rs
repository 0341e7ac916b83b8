//! A training chain's templates, chosen as AlphaFold's and OpenFold's training pipelines choose
//! them (AlphaFold supplement 1.2.3; OpenFold's `TemplateHitFeaturizer.get_templates` with
//! its training config): from the hits of the chain folder's `.hhr` files (hhsearch against
//! pdb70, `pdb70_hits.hhr`; OpenFold reads every `.hhr` file of the folder) or, in their place
//! when the folder has it (a monomer chain's and a complex's alike), of hmmsearch's Stockholm
//! result against pdb_seqres (AlphaFold-Multimer's template search: `pdb_hits.sto` as predict
//! saves it, `hmm_output.sto` as OpenFold names it; [`super::layout::hit_files`]),
//!
//! 1. hits released too late are dropped: after `--max-template-date`, or less than
//!    [`DAYS_BEFORE_QUERY`] days before the chain's own release (the template must not be
//!    the answer published later, nor the same deposition);
//! 2. the prefilter (`_assess_hhsearch_hit` as training calls it) drops the chain's own entry,
//!    hits aligned over 10% of the query or less, near-duplicates of the query (a
//!    subsequence of it longer than [`MAX_SUBSEQUENCE_RATIO`] of it) and hits under 10
//!    residues;
//! 3. the rest, best `Sum_probs` first (hmmsearch's hits are unscored: in the file's order),
//!    have their first [`SHUFFLE_TOP_K`] shuffled (`shuffle_top_k_prefiltered`), and are
//!    featurised in that order as predict featurises that search's hits ([`Featurizer`],
//!    kalign realigning where the entry's chain changed; hmmsearch's keeping one hit per
//!    template sequence) until `--max-templates` have features;
//! 4. the number kept is drawn as `random_crop_to_size` draws it with `subsample_templates`:
//!    the `T` featurised, less a number uniform in `0..=T`, in a shuffled order.
//!
//! The draws of steps 3 and 4 come from one generator keyed by the example's number
//! ([`super::transforms::Draw::Templates`]), so a run repeats its templates exactly.
use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context};

use super::layout::is_hmmsearch_hits;
use super::transforms::{keyed, Draw};
use crate::features::rng::Rng;
use crate::search::hhr::{self, TemplateHit};
use crate::search::hmmsearch;
use crate::search::templates::{pdb_id_and_chain, Featurizer, TemplateHitFeatures};
use crate::search::tools::Tool;

/// Hits at the top whose order is shuffled (OpenFold's `shuffle_top_k_prefiltered`).
pub const SHUFFLE_TOP_K: usize = 20;
/// A template must be released this many days before the training chain (AlphaFold's and
/// OpenFold's `get_templates`: the query's release date minus 60 days, when that is earlier
/// than the maximum template date).
pub const DAYS_BEFORE_QUERY: i64 = 60;
/// A hit whose sequence lies within the query and covers more of it than this is a duplicate
/// of the query (`_assess_hhsearch_hit`'s `max_subsequence_ratio`).
pub const MAX_SUBSEQUENCE_RATIO: f64 = 0.95;
/// A hit must align over more than this share of the query (`min_align_ratio`).
const MIN_ALIGN_RATIO: f64 = 0.1;
/// Fewest residues of a hit.
const MIN_HIT_LENGTH: usize = 10;

/// Which search found a chain's hits; each is read and featurised as predict reads that
/// search's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HitSearch {
    /// hhsearch against pdb70 (`.hhr`, scored by `Sum_probs`).
    Hhsearch,
    /// hmmsearch against pdb_seqres (Stockholm, unscored; one hit per template sequence).
    Hmmsearch,
}

/// How training chooses templates (the `--max-templates` group of flags).
#[derive(Clone, Debug, PartialEq)]
pub struct TemplateSampling {
    /// Most templates an example gets (AlphaFold and OpenFold: 4).
    pub max_templates: usize,
    /// The mmCIF entries of the templates (`--template-mmcif-dir`, default --mmcif-dir).
    pub mmcif_dir: PathBuf,
    /// Latest release of a template, `YYYY-MM-DD` (`--max-template-date`).
    pub max_template_date: Option<String>,
    /// Obsolete entries: id -> its successor (`None`: withdrawn), from `--obsolete-pdbs-path`.
    pub obsolete: HashMap<String, Option<String>>,
    /// The kalign binary (`--kalign-binary-path`; default `kalign` on PATH), run only for a
    /// hit whose sequence is not in its entry.
    pub kalign: Option<PathBuf>,
}

/// A chain's template hits, read with the chain.
#[derive(Clone, Debug)]
pub struct ChainTemplates {
    /// The hit files, in file-name order.
    pub paths: Vec<PathBuf>,
    /// Their hits, in the files' order.
    pub hits: Vec<TemplateHit>,
    /// The search that found them.
    pub search: HitSearch,
    /// The PDB id of the chain's entry (lower case).
    pub query_pdb: String,
    /// The chain's release date, `YYYY-MM-DD`, when its entry has one.
    pub release_date: Option<String>,
}

/// Reads the hit files of the chain `query` (its sequence, which hmmsearch's hits are aligned
/// to), their hits concatenated: `.hhr` files as hhsearch's, [`super::layout::HMMSEARCH_HITS`] as hmmsearch's
/// (predict's readers, [`hhr::parse`] and [`hmmsearch::read_sto`]). Files of both searches
/// together are an error naming them.
pub fn read_hits(
    paths: &[PathBuf],
    query: &str,
    query_pdb: &str,
    release_date: Option<String>,
) -> anyhow::Result<ChainTemplates> {
    let search = match paths.iter().all(|p| is_hmmsearch_hits(p)) {
        true => HitSearch::Hmmsearch,
        false => HitSearch::Hhsearch,
    };
    let mut hits = Vec::new();
    for path in paths {
        if (search == HitSearch::Hmmsearch) != is_hmmsearch_hits(path) {
            let files: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            bail!("template hits {}: hhsearch's and hmmsearch's hits are not read together", files.join(", "));
        }
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        match search {
            HitSearch::Hhsearch => hits.extend(hhr::parse(&text, path)?),
            HitSearch::Hmmsearch => hits.extend(hmmsearch::read_sto(&text, query, path)?),
        }
    }
    Ok(ChainTemplates { paths: paths.to_vec(), hits, search, query_pdb: query_pdb.to_lowercase(), release_date })
}

impl ChainTemplates {
    /// The hit files, for messages.
    fn files(&self) -> String {
        self.paths.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
    }
}

/// Days from 1970-01-01 to a `YYYY-MM-DD` date (the proleptic Gregorian calendar, by Hinnant's
/// `days_from_civil`); `None` for anything else.
pub fn days_since_epoch(date: &str) -> Option<i64> {
    crate::search::templates::check_date(date).ok()?;
    let (y, m, d) =
        (date[0..4].parse::<i64>().ok()?, date[5..7].parse::<i64>().ok()?, date[8..10].parse::<i64>().ok()?);
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some(era * 146_097 + doe - 719_468)
}

/// The `YYYY-MM-DD` date `days` after 1970-01-01 (Hinnant's `civil_from_days`).
pub fn date_from_days(days: i64) -> String {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The latest release date of a template of a chain released `query_release`: the earlier of
/// `max_template_date` and [`DAYS_BEFORE_QUERY`] days before the chain's release (neither:
/// no limit).
pub fn cutoff_date(max_template_date: Option<&str>, query_release: Option<&str>) -> String {
    let by_query = query_release.and_then(days_since_epoch).map(|d| date_from_days(d - DAYS_BEFORE_QUERY));
    match (max_template_date, by_query) {
        (Some(max), Some(q)) => max.min(q.as_str()).to_string(),
        (Some(max), None) => max.to_string(),
        (None, Some(q)) => q,
        (None, None) => "9999-12-31".to_string(),
    }
}

/// Training's prefilter of a hit of PDB entry `hit_pdb` against `query` (of entry
/// `query_pdb`): `Err` says why the hit is dropped.
pub fn prefilter(hit: &TemplateHit, hit_pdb: &str, query: &str, query_pdb: &str) -> Result<(), String> {
    if hit_pdb.eq_ignore_ascii_case(query_pdb) {
        return Err(format!("from the chain's own entry {query_pdb}"));
    }
    let n = query.chars().count() as f64;
    let align_ratio = hit.aligned_cols as f64 / n;
    if align_ratio <= MIN_ALIGN_RATIO {
        return Err(format!("aligned over {align_ratio:.3} of the query (at most {MIN_ALIGN_RATIO})"));
    }
    let template = hit.hit_sequence.replace('-', "");
    let length_ratio = template.chars().count() as f64 / n;
    if query.contains(&template) && length_ratio > MAX_SUBSEQUENCE_RATIO {
        return Err(format!("a duplicate of the query (its subsequence over {length_ratio:.3} of it)"));
    }
    if template.chars().count() < MIN_HIT_LENGTH {
        return Err(format!("{} residues (under {MIN_HIT_LENGTH})", template.chars().count()));
    }
    Ok(())
}

/// The hits in the order their features are tried: best `Sum_probs` first (stable), those
/// passing [`prefilter`], the first [`SHUFFLE_TOP_K`] shuffled by `rng`; and why the others
/// were dropped. A hit not named `<pdb id>_<chain>` is an error.
pub fn candidate_order<'a>(
    hits: &'a [TemplateHit],
    query: &str,
    query_pdb: &str,
    rng: &mut Rng,
) -> anyhow::Result<(Vec<&'a TemplateHit>, Vec<String>)> {
    let mut sorted: Vec<&TemplateHit> = hits.iter().collect();
    sorted.sort_by(|a, b| b.sum_probs.partial_cmp(&a.sum_probs).unwrap_or(std::cmp::Ordering::Equal));
    let (mut kept, mut dropped) = (Vec::new(), Vec::new());
    for hit in sorted {
        let (hit_pdb, _) = pdb_id_and_chain(&hit.name)?;
        match prefilter(hit, &hit_pdb, query, query_pdb) {
            Ok(()) => kept.push(hit),
            Err(why) => dropped.push(format!("hit {} skipped: {why}", hit.name)),
        }
    }
    let top = kept.len().min(SHUFFLE_TOP_K);
    rng.shuffle(&mut kept[..top]);
    Ok((kept, dropped))
}

impl TemplateSampling {
    /// The templates of one example, number `number` of a run seeded `seed`, drawn by
    /// [`TemplateSampling::sample`] from the generator those and `index` key
    /// ([`Draw::Templates`]; `index`: a complex's entity, 0-based, or a monomer example's
    /// second key), the dropped hits' notes left out. Every training path draws this way.
    pub fn draw(
        &self,
        query: &str,
        chain: &ChainTemplates,
        (seed, number, index): (u64, u64, u64),
    ) -> anyhow::Result<Vec<TemplateHitFeatures>> {
        let mut rng = keyed(seed, Draw::Templates, number, index);
        Ok(self.sample(query, chain, &mut rng)?.0)
    }

    /// The templates of one example of the chain `query` (its SEQRES as its MSAs' query gives
    /// it) drawn from `rng`, and why hits were dropped. Errors (an mmCIF entry missing or
    /// malformed, kalign needed and failing to run) name the hit file and the flag to fix.
    pub fn sample(
        &self,
        query: &str,
        chain: &ChainTemplates,
        rng: &mut Rng,
    ) -> anyhow::Result<(Vec<TemplateHitFeatures>, Vec<String>)> {
        if self.max_templates == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let (order, mut notes) = candidate_order(&chain.hits, query, &chain.query_pdb, rng)
            .with_context(|| format!("template hits {}", chain.files()))?;
        let featurizer = Featurizer {
            mmcif_dir: self.mmcif_dir.clone(),
            max_template_date: cutoff_date(self.max_template_date.as_deref(), chain.release_date.as_deref()),
            obsolete: self.obsolete.clone(),
            kalign: Tool::new("kalign", self.kalign.as_deref()),
            unique_sequences: chain.search == HitSearch::Hmmsearch,
        };
        let result = featurizer.featurize_in_order(query, &order, self.max_templates).with_context(|| {
            format!(
                "template hits {} (entries from --template-mmcif-dir {}; kalign from --kalign-binary-path or PATH)",
                chain.files(),
                self.mmcif_dir.display()
            )
        })?;
        notes.extend(result.warnings);
        let mut hits = result.hits;
        let keep = hits.len() - rng.below(hits.len() + 1);
        rng.shuffle(&mut hits);
        hits.truncate(keep);
        Ok((hits, notes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hit named `name` aligning `hit_sequence` (no gaps) to the query from its first
    /// residue, over `aligned_cols` columns.
    fn hit(name: &str, hit_sequence: &str, aligned_cols: usize, sum_probs: f64) -> TemplateHit {
        let n = hit_sequence.len() as i64;
        TemplateHit {
            index: 1,
            name: name.to_string(),
            aligned_cols,
            sum_probs: Some(sum_probs),
            query: hit_sequence.to_string(),
            hit_sequence: hit_sequence.to_string(),
            indices_query: (0..n).collect(),
            indices_hit: (0..n).collect(),
        }
    }

    const QUERY: &str = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRV";

    #[test]
    fn dates_count_days_across_months_years_and_leap_days() {
        assert_eq!(days_since_epoch("1970-01-01"), Some(0));
        assert_eq!(days_since_epoch("2000-03-01"), Some(11_017));
        assert_eq!(date_from_days(11_017 - 1), "2000-02-29");
        assert_eq!(days_since_epoch("2021-13-01"), None);
        assert_eq!(days_since_epoch("2021-5-1"), None);
        for date in ["1999-12-31", "2020-02-29", "2021-03-01", "2100-03-01", "1969-07-20"] {
            assert_eq!(date_from_days(days_since_epoch(date).unwrap()), date);
        }
        // 60 days before 2021-05-01: April has 30, March 31.
        assert_eq!(cutoff_date(None, Some("2021-05-01")), "2021-03-02");
        assert_eq!(cutoff_date(Some("2020-01-01"), Some("2021-05-01")), "2020-01-01", "the earlier");
        assert_eq!(cutoff_date(Some("2022-01-01"), Some("2021-05-01")), "2021-03-02");
        assert_eq!(cutoff_date(Some("2022-01-01"), None), "2022-01-01");
        assert_eq!(cutoff_date(None, None), "9999-12-31");
    }

    #[test]
    fn prefilter_drops_the_chains_own_entry_duplicates_short_and_sparse_hits() {
        let ok = hit("2def_B", &QUERY[5..30], 25, 10.0);
        assert_eq!(prefilter(&ok, "2def", QUERY, "9qry"), Ok(()));
        let own = prefilter(&ok, "9QRY", QUERY, "9qry").unwrap_err();
        assert!(own.contains("own entry"), "{own}");
        // The whole query, or 39 of its 40 residues, is a duplicate (> 0.95); 38 is not.
        assert!(prefilter(&hit("1abc_A", QUERY, 40, 1.0), "1abc", QUERY, "9qry").unwrap_err().contains("duplicate"));
        assert!(prefilter(&hit("1abc_A", &QUERY[1..], 39, 1.0), "1abc", QUERY, "9qry").is_err());
        assert_eq!(prefilter(&hit("1abc_A", &QUERY[2..], 38, 1.0), "1abc", QUERY, "9qry"), Ok(()));
        // A different sequence of the query's length is no duplicate.
        let changed: String = QUERY.replacen('M', "A", 1);
        assert_eq!(prefilter(&hit("1abc_A", &changed, 40, 1.0), "1abc", QUERY, "9qry"), Ok(()));
        // 4 of 40 columns is 0.1: too few; 5 pass. 9 residues are too short.
        let sparse = prefilter(&hit("1abc_A", &QUERY[..20], 4, 1.0), "1abc", QUERY, "9qry").unwrap_err();
        assert!(sparse.contains("0.100"), "{sparse}");
        assert_eq!(prefilter(&hit("1abc_A", &QUERY[..20], 5, 1.0), "1abc", QUERY, "9qry"), Ok(()));
        let short = prefilter(&hit("1abc_A", &QUERY[..9], 9, 1.0), "1abc", QUERY, "9qry").unwrap_err();
        assert!(short.contains("9 residues"), "{short}");
    }

    /// 25 usable hits (sum_probs 25 down to 1) and two dropped ones.
    fn many_hits() -> Vec<TemplateHit> {
        let mut hits: Vec<TemplateHit> =
            (0..25).map(|k| hit(&format!("{}abc_A", k % 10), &QUERY[..20], 20, 25.0 - k as f64)).collect();
        hits.push(hit("9qry_A", &QUERY[..20], 20, 100.0));
        hits.push(hit("1xyz_A", QUERY, 40, 50.0));
        hits
    }

    #[test]
    fn candidates_shuffle_the_top_20_of_the_prefiltered_hits_by_their_key() {
        let hits = many_hits();
        let order = |example: u64| {
            let (kept, dropped) =
                candidate_order(&hits, QUERY, "9qry", &mut keyed(1, Draw::Templates, example, 0)).unwrap();
            assert_eq!(dropped.len(), 2, "{dropped:?}");
            kept.iter().map(|h| h.sum_probs.unwrap() as i64).collect::<Vec<_>>()
        };
        let first = order(1);
        let mut top: Vec<i64> = first[..20].to_vec();
        top.sort_unstable_by(|a, b| b.cmp(a));
        assert_eq!(top, (6..=25).rev().collect::<Vec<_>>(), "the top 20 stay the top 20");
        assert_eq!(first[20..], [5, 4, 3, 2, 1], "the rest keep their order");
        assert_ne!(first[..20], top[..], "shuffled");
        assert_eq!(order(1), first, "the same example draws the same order");
        assert_ne!(order(2), first, "another example draws another");
        let bad = [hit("1abc", QUERY, 40, 1.0)];
        let err = candidate_order(&bad, QUERY, "9qry", &mut keyed(1, Draw::Templates, 1, 0)).unwrap_err();
        assert!(err.to_string().contains("1abc"), "{err}");
    }
}
