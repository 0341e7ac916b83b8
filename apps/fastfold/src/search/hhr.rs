//! HH-suite's `.hhr` result files (hhsearch against pdb70), read the way AlphaFold's
//! `parsers.parse_hhr` reads them: one hit per `No <n>` paragraph, its name from the `>`
//! line, `Aligned_cols` and `Sum_probs` from the summary line, and the pairwise alignment from
//! the `Q <name>` and `T <name>` lines (secondary-structure and consensus lines skipped),
//! whose fixed 17-character prefix is followed by `start sequence end (length)`.
use std::path::Path;

use data::{Error, Result};

/// One template hit of an `.hhr` file.
#[derive(Clone, Debug, PartialEq)]
pub struct TemplateHit {
    /// The hit's number in the file (1-based).
    pub index: usize,
    /// The `>` line without the `>`: `<pdb id>_<chain> <description>`.
    pub name: String,
    /// Aligned columns.
    pub aligned_cols: usize,
    /// HH-suite's sum of the alignment's posterior probabilities (the hits' ranking key);
    /// `None` for hmmsearch hits, which have none.
    pub sum_probs: Option<f64>,
    /// The query's aligned part, `-` where the hit has an insertion.
    pub query: String,
    /// The hit's aligned part, `-` where the query has an insertion.
    pub hit_sequence: String,
    /// For each column of `query`, the 0-based query residue, or -1 for a gap.
    pub indices_query: Vec<i64>,
    /// For each column of `hit_sequence`, the 0-based hit residue, or -1 for a gap.
    pub indices_hit: Vec<i64>,
}

/// The width of the `Q <name>` / `T <name>` prefix of an alignment line.
const PREFIX: usize = 17;

/// Parses `.hhr` text; `source` names it in errors (with the line).
pub fn parse(text: &str, source: &Path) -> Result<Vec<TemplateHit>> {
    let lines: Vec<&str> = text.lines().collect();
    let mut starts: Vec<usize> =
        lines.iter().enumerate().filter(|(_, l)| l.starts_with("No ")).map(|(i, _)| i).collect();
    starts.push(lines.len());
    starts.windows(2).map(|w| parse_hit(&lines[w[0]..w[1]], w[0], source)).collect()
}

/// One `No <n>` paragraph starting at (0-based) line `first`.
fn parse_hit(lines: &[&str], first: usize, source: &Path) -> Result<TemplateHit> {
    let bad = |line: usize, msg: String| Error::Format {
        path: source.to_path_buf(),
        msg: format!("line {}: {msg}", first + line + 1),
    };
    if lines.len() < 3 {
        return Err(bad(0, "a hit needs its number, `>` name and summary lines".into()));
    }
    let index = lines[0]
        .split_whitespace()
        .last()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| bad(0, format!("expected `No <hit number>`, found {:?}", lines[0])))?;
    let name = lines[1].get(1..).unwrap_or_default().to_string();
    let summary = summary(lines[2]).ok_or_else(|| {
        bad(2, format!("expected the summary line (Probab=... Aligned_cols=... Sum_probs=...), found {:?}", lines[2]))
    })?;
    let mut hit = TemplateHit {
        index,
        name,
        aligned_cols: summary.0 as usize,
        sum_probs: Some(summary.1),
        query: String::new(),
        hit_sequence: String::new(),
        indices_query: Vec::new(),
        indices_hit: Vec::new(),
    };
    let mut block_len: Option<usize> = None;
    for (k, line) in lines.iter().enumerate().skip(3) {
        let skipped = ["ss_dssp", "ss_pred", "Consensus"];
        let is = |tag: &str| line.starts_with(tag) && !skipped.iter().any(|s| line[2..].starts_with(s));
        if is("Q ") {
            let (start, seq, end) = alignment_line(line.get(PREFIX..).unwrap_or_default(), true)
                .ok_or_else(|| bad(k, format!("cannot parse the query line {line:?}")))?;
            let start = start.checked_sub(1).ok_or_else(|| bad(k, "residue numbers start at 1".into()))?;
            let gaps = seq.chars().filter(|&c| c == '-').count();
            let len = (end + gaps).checked_sub(start).filter(|&n| n == seq.len());
            let len =
                len.ok_or_else(|| bad(k, format!("{} columns between residues {} and {end}", seq.len(), start + 1)))?;
            block_len = Some(len);
            hit.query.push_str(seq);
            push_indices(seq, start, &mut hit.indices_query);
        } else if is("T ") {
            let (start, seq, _) = alignment_line(line.get(PREFIX..).unwrap_or_default(), false)
                .ok_or_else(|| bad(k, format!("cannot parse the template line {line:?}")))?;
            let start = start.checked_sub(1).ok_or_else(|| bad(k, "residue numbers start at 1".into()))?;
            if block_len != Some(seq.len()) {
                return Err(bad(k, format!("template line of {} columns does not match its query line", seq.len())));
            }
            hit.hit_sequence.push_str(seq);
            push_indices(seq, start, &mut hit.indices_hit);
        }
    }
    Ok(hit)
}

/// (Aligned_cols, Sum_probs) of a summary line `Probab=.. E-value=.. Score=.. Aligned_cols=..
/// Identities=..% Similarity=.. Sum_probs=.. Template_Neff=..` (every field must be there,
/// in that order, and be a finite number: a NaN would sort ahead of every real hit).
fn summary(line: &str) -> Option<(f64, f64)> {
    let labels = [
        "Probab=",
        "E-value=",
        "Score=",
        "Aligned_cols=",
        "Identities=",
        "Similarity=",
        "Sum_probs=",
        "Template_Neff=",
    ];
    let mut rest = line.strip_prefix(labels[0])?;
    let mut values = Vec::with_capacity(labels.len());
    for next in labels.iter().skip(1).map(Some).chain([None]) {
        let (value, after) = match next {
            Some(label) => rest.split_once(label)?,
            None => (rest, ""),
        };
        let value = value.trim();
        // Identities is a percentage.
        let value = if next == Some(&"Similarity=") { value.strip_suffix('%')? } else { value };
        values.push(value.trim().parse::<f64>().ok().filter(|v| v.is_finite())?);
        rest = after;
    }
    Some((values[3], values[6]))
}

/// `start sequence end (length)` after an alignment line's prefix (blanks before `start`
/// and `end`, one space before the sequence, which is upper-case letters and `-`); `end` is
/// required on query lines only, as AlphaFold's patterns have it.
fn alignment_line(text: &str, need_end: bool) -> Option<(usize, &str, usize)> {
    let text = text.trim_start_matches([' ', '\t']);
    let digits = |s: &str| s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let n = digits(text);
    let start = text[..n].parse().ok()?;
    let rest = text[n..].strip_prefix(' ')?;
    let m = rest.find(|c: char| !(c.is_ascii_uppercase() || c == '-')).unwrap_or(rest.len());
    let seq = &rest[..m];
    let rest = rest[m..].trim_start_matches([' ', '\t']);
    let k = digits(rest);
    let end = if need_end { rest[..k].parse().ok()? } else { rest[..k].parse().unwrap_or(0) };
    let rest = rest[k..].strip_prefix(" (")?;
    let l = digits(rest);
    rest[l..].starts_with(')').then_some((start, seq, end))
}

/// Appends the residue index of each column of `seq` (-1 for a gap), counting from `start`.
fn push_indices(seq: &str, start: usize, indices: &mut Vec<i64>) {
    let mut next = start as i64;
    for c in seq.chars() {
        if c == '-' {
            indices.push(-1);
        } else {
            indices.push(next);
            next += 1;
        }
    }
}
