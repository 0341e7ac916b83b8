//! Stockholm alignments as jackhmmer writes them (`-A`), read the way AlphaFold's
//! `parsers.parse_stockholm` and `parsers.truncate_stockholm_msa` read them.
//!
//! The first sequence is the query. Columns where the query has a gap (`-`) are the hits'
//! insertions: they are removed from every row and counted into the deletion matrix at the
//! next query column. A sequence may be split over several blocks; its pieces are joined in
//! order. Rows are kept as they come, duplicates included (the merge removes those).
use std::collections::HashSet;
use std::path::Path;

use data::a3m::Msa;
use data::{Error, Result};

use crate::residue_constants::msa_class_of;

/// Each sequence's (name, joined alignment), in order of first appearance.
fn rows(text: &str, source: &Path) -> Result<Vec<(String, String)>> {
    let bad = |msg: String| Error::Format { path: source.to_path_buf(), msg };
    // (name, joined alignment) in order of first appearance.
    let mut rows: Vec<(String, String)> = Vec::new();
    let mut index = std::collections::HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with("//") {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let [name, aligned] = fields[..] else {
            return Err(bad(format!(
                "line {}: expected a sequence name and its aligned residues, found {} fields",
                i + 1,
                fields.len()
            )));
        };
        let k = *index.entry(name.to_string()).or_insert_with(|| {
            rows.push((name.to_string(), String::new()));
            rows.len() - 1
        });
        rows[k].1.push_str(aligned);
    }
    Ok(rows)
}

/// `text` without the rows whose residues in the query's columns repeat an earlier row's
/// (AlphaFold's `deduplicate_stockholm_msa`, before the template search); `source` names
/// the text in errors. Line order and layout stay.
pub fn deduplicate(text: &str, source: &Path) -> Result<String> {
    let rows = rows(text, source)?;
    let in_query: Vec<bool> = rows.first().map(|(_, q)| q.chars().map(|c| c != '-').collect()).unwrap_or_default();
    let mut seen = HashSet::new();
    let keep: HashSet<&str> = rows
        .iter()
        .filter(|(_, aligned)| {
            seen.insert(aligned.chars().zip(&in_query).filter(|(_, &q)| q).map(|(c, _)| c).collect::<String>())
        })
        .map(|(name, _)| name.as_str())
        .collect();
    Ok(keep_lines(text, &keep))
}

/// `text` without the columns that are gaps in every sequence, block by block (AlphaFold's
/// `remove_empty_columns_from_stockholm_msa`: each block's sequence lines, and its `#=GC RF`
/// line that ends the block, keep the columns some sequence fills). Lines are joined with
/// newlines and no final one, as AlphaFold joins them.
pub fn remove_empty_columns(text: &str) -> String {
    let mut out: Vec<String> = Vec::new();
    // (index in `out`, line) of the current block's sequence lines.
    let mut block: Vec<(usize, &str)> = Vec::new();
    let alignment = |line: &str| line.rsplit_once(' ').map_or(("", line), |(p, a)| (p, a)).1.to_string();
    for line in text.lines() {
        if line.starts_with("#=GC RF") {
            let width = alignment(line).chars().count();
            let rows: Vec<Vec<char>> = block.iter().map(|(_, l)| alignment(l).chars().collect()).collect();
            let mask: Vec<bool> =
                (0..width).map(|j| rows.iter().any(|r| r.get(j).is_some_and(|&c| c != '-'))).collect();
            out.push(line.to_string());
            block.push((out.len() - 1, line));
            let any = mask.iter().any(|&m| m);
            for (at, l) in block.drain(..) {
                out[at] = if any {
                    let (prefix, aligned) = l.rsplit_once(' ').unwrap_or(("", l));
                    let kept: String = aligned.chars().zip(&mask).filter(|(_, &m)| m).map(|(c, _)| c).collect();
                    format!("{prefix} {kept}")
                } else {
                    String::new()
                };
            }
        } else if !line.trim().is_empty() && !line.starts_with('#') && !line.starts_with("//") {
            out.push(line.to_string());
            block.push((out.len() - 1, line));
        } else {
            out.push(line.to_string());
        }
    }
    out.join("\n")
}

/// Stockholm text as A3M (AlphaFold's `convert_stockholm_to_a3m`): each sequence once, its
/// `#=GS DE` description on its header, `.` dropped; with `query_columns`, a residue in a
/// column where the query (the first sequence) has a gap becomes a lower-case insertion and
/// such columns' gaps go (how hhsearch is given the UniRef90 alignment); without, rows are
/// kept as they are (how hmmsearch's result is read). `source` names the text in errors.
pub fn to_a3m(text: &str, source: &Path, query_columns: bool) -> Result<String> {
    let rows = rows(text, source)?;
    let Some((_, query)) = rows.first() else {
        return Err(Error::Format { path: source.to_path_buf(), msg: "no aligned sequences".into() });
    };
    let in_query: Vec<bool> = query.chars().filter(|&c| c != '.').map(|c| c != '-').collect();
    let mut descriptions: std::collections::HashMap<&str, String> = std::collections::HashMap::new();
    for line in text.lines().filter(|l| l.starts_with("#=GS")) {
        let mut parts = line.split_whitespace();
        if let (Some(_), Some(name), Some("DE")) = (parts.next(), parts.next(), parts.next()) {
            let rest: Vec<&str> = parts.collect();
            descriptions.insert(name, rest.join(" "));
        }
    }
    let mut out = String::new();
    for (name, aligned) in &rows {
        let aligned = aligned.chars().filter(|&c| c != '.');
        let a3m: String = if query_columns {
            aligned
                .zip(&in_query)
                .filter_map(|(c, &q)| match (q, c) {
                    (true, c) => Some(c),
                    (false, '-') => None,
                    (false, c) => Some(c.to_ascii_lowercase()),
                })
                .collect()
        } else {
            aligned.collect()
        };
        out += &format!(">{name} {}\n{a3m}\n", descriptions.get(name.as_str()).map_or("", String::as_str));
    }
    Ok(out)
}

/// Parses Stockholm text; `source` names it in errors.
pub fn parse(text: &str, source: &Path) -> Result<Msa> {
    let bad = |msg: String| Error::Format { path: source.to_path_buf(), msg };
    let rows = rows(text, source)?;
    let Some((query_name, query)) = rows.first() else {
        return Err(bad("no aligned sequences (expected the query first, then the hits)".into()));
    };
    let query: Vec<char> = query.chars().collect();
    let mut msa = Msa { sequences: Vec::new(), deletion_matrix: Vec::new(), descriptions: Vec::new() };
    for (name, aligned) in &rows {
        let aligned: Vec<char> = aligned.chars().collect();
        if aligned.len() != query.len() {
            return Err(bad(format!(
                "sequence {name:?} has {} alignment columns, the query {query_name:?} has {}",
                aligned.len(),
                query.len()
            )));
        }
        let mut row = String::new();
        let mut deletions = Vec::new();
        let mut pending = 0;
        for (j, (&c, &q)) in aligned.iter().zip(&query).enumerate() {
            if q != '-' {
                // Checked here, where the file is known: the merged MSA no longer knows it.
                if msa_class_of(c).is_none() {
                    return Err(bad(format!("sequence {name:?}, column {}: {c:?} is not an alignment code", j + 1)));
                }
                row.push(c);
                deletions.push(pending);
                pending = 0;
            } else if c != '-' {
                pending += 1;
            }
        }
        msa.sequences.push(row);
        msa.deletion_matrix.push(deletions);
        msa.descriptions.push(name.clone());
    }
    Ok(msa)
}

/// The name a Stockholm line is about: a sequence line's first word, a `#=GS` line's second;
/// `None` for other lines.
fn line_sequence_name(line: &str) -> Option<&str> {
    if line.starts_with("#=GS") {
        return line.split_whitespace().nth(1);
    }
    if line.trim().is_empty() || line.starts_with('#') || line.starts_with("//") {
        return None;
    }
    line.split(' ').next()
}

/// `text` keeping only its first `max_sequences` sequences (the query counts) with their
/// `#=GS` descriptions, the header, `#=GC RF` lines and the end mark, as AlphaFold truncates
/// jackhmmer's output before saving it (UniRef90 10,000, MGnify 501).
pub fn truncate(text: &str, max_sequences: usize) -> String {
    let mut keep: HashSet<&str> = HashSet::new();
    for line in text.lines() {
        if keep.len() >= max_sequences {
            break;
        }
        if line.trim().is_empty() || line.starts_with('#') || line.starts_with("//") {
            continue;
        }
        keep.insert(line.split(' ').next().unwrap_or_default());
    }
    keep_lines(text, &keep)
}

/// `text` keeping the sequence and `#=GS` lines of the sequences in `keep`, blank lines, the
/// header, the end mark and `#=GC RF` lines (AlphaFold's `_keep_line`).
fn keep_lines(text: &str, keep: &HashSet<&str>) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        // Blank lines, the header, the end mark and the reference annotation stay; other
        // markup goes; sequence and `#=GS` lines stay for the kept names.
        let structural = line.trim().is_empty()
            || line.trim() == "//"
            || line.starts_with("# STOCKHOLM")
            || line.starts_with("#=GC RF");
        let kept = if structural {
            true
        } else if line.starts_with('#') && !line.starts_with("#=GS") {
            false
        } else {
            line_sequence_name(line).is_some_and(|n| keep.contains(n))
        };
        if kept {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}
