//! hmmsearch's template hits (AlphaFold-Multimer's template search against `pdb_seqres.txt`),
//! read as AlphaFold's `Hmmsearch.get_template_hits` reads them: the Stockholm result as A3M
//! rows kept as they are ([`super::stockholm::to_a3m`] without query columns), then
//! `parsers.parse_hmmsearch_a3m`: one hit per protein row (`mol:protein` in its header),
//! named `<pdb id>_<chain>` from `<pdb id>_<chain>/<from>-<to> ... protein length:<n>`, its
//! upper-case residues and gaps the columns of the query's model (lower-case ones are
//! insertions), aligned to the query's residues one to one.
use std::path::Path;

use data::{Error, Result};

use super::hhr::TemplateHit;

/// The hits of hmmsearch's saved Stockholm result `text` (`pdb_hits.sto`; `source` names it
/// in errors) for the query `query`: none when it is empty (hmmsearch writes an empty file
/// when nothing is found), else [`parse`] of its rows as A3M. Predict and training both read
/// a saved result here, so a hit is the same hit for both.
pub fn read_sto(text: &str, query: &str, source: &Path) -> Result<Vec<TemplateHit>> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    parse(&super::stockholm::to_a3m(text, source, false)?, query, source)
}

/// The hits of hmmsearch's result as A3M text (`source` names the result in errors) for
/// the query `query`.
pub fn parse(a3m: &str, query: &str, source: &Path) -> Result<Vec<TemplateHit>> {
    let bad = |msg: String| Error::Format { path: source.to_path_buf(), msg };
    let mut rows: Vec<(String, String)> = Vec::new();
    for line in a3m.lines() {
        if let Some(header) = line.strip_prefix('>') {
            rows.push((header.to_string(), String::new()));
        } else if let Some((_, seq)) = rows.last_mut() {
            seq.push_str(line.trim());
        }
    }
    let indices_query = indices(query, 0);
    let mut hits = Vec::new();
    for (i, (header, seq)) in rows.iter().enumerate() {
        if !header.contains("mol:protein") {
            continue;
        }
        let (name, start) = describe(header).ok_or_else(|| {
            bad(format!("hit {header:?} is not described as <pdb id>_<chain>/<from>-<to> ... protein length:<n>"))
        })?;
        hits.push(TemplateHit {
            index: i + 1,
            name,
            aligned_cols: seq.chars().filter(|c| c.is_ascii_uppercase()).count(),
            sum_probs: None,
            query: query.to_string(),
            hit_sequence: seq.to_ascii_uppercase(),
            indices_query: indices_query.clone(),
            indices_hit: indices(seq, start - 1),
        });
    }
    Ok(hits)
}

/// (`<pdb id>_<chain>`, from) of a hit header `<pdb id>_<chain>/<from>-<to> ... protein
/// length:<n> ...` (the id lower-case letters and digits, the chain word characters).
fn describe(header: &str) -> Option<(String, i64)> {
    let header = header.trim();
    let (id, rest) = header.split_once('_')?;
    let (chain, rest) = rest.split_once('/')?;
    let word = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_alphanumeric() || c == '_');
    if id.is_empty() || !id.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit()) || !word(chain) {
        return None;
    }
    let (from, rest) = rest.split_once('-')?;
    let to_len = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    let (from, to): (i64, &str) = (from.parse().ok()?, &rest[..to_len]);
    to.parse::<i64>().ok()?;
    let length = rest.split_once("protein length:")?.1;
    length.chars().next().filter(char::is_ascii_digit)?;
    Some((format!("{id}_{chain}"), from))
}

/// AlphaFold's `_get_indices`: for each match column of `seq` (upper case or `-`), the
/// residue index counted from `start` (-1 for a gap); lower-case insertions count but have
/// no column.
fn indices(seq: &str, start: i64) -> Vec<i64> {
    let mut out = Vec::with_capacity(seq.len());
    let mut next = start;
    for c in seq.chars() {
        if c == '-' {
            out.push(-1);
        } else if c.is_lowercase() {
            next += 1;
        } else {
            out.push(next);
            next += 1;
        }
    }
    out
}
