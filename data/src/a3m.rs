//! A3M multiple sequence alignments, as HHblits and ColabFold (MMseqs2) write them.
//!
//! An A3M file is FASTA-like: the first record is the query, each later record a hit aligned
//! to it. Upper-case letters and `-` are aligned columns (one per query residue); lower-case
//! letters are residues the hit inserts between query columns. Following AlphaFold's
//! `parsers.parse_a3m`, insertions are removed from the aligned sequence and counted into the
//! deletion matrix at the next aligned column (insertions after the last column are dropped).
//! `.` (an insert-column gap some tools write) carries nothing and is skipped. ColabFold's
//! leading `#len\tcardinality` line and other `#` lines before the first record are skipped.
//!
//! Duplicate aligned sequences are dropped, keeping the first, as AlphaFold's
//! `make_msa_features` does; the query is always row 0.
use std::collections::HashSet;
use std::path::Path;

use crate::{Error, Result};

/// A parsed alignment; row 0 is the query.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Msa {
    /// Aligned rows: upper-case letters `A`-`Z` and `-`, each the query's length.
    pub sequences: Vec<String>,
    /// `deletion_matrix[i][j]`: residues row `i` inserts before aligned column `j`.
    pub deletion_matrix: Vec<Vec<u32>>,
    /// Each row's header line after `>`.
    pub descriptions: Vec<String>,
}

impl Msa {
    /// The alignment of the query alone (single-sequence mode).
    pub fn single(query: &str, description: &str) -> Msa {
        Msa {
            sequences: vec![query.to_string()],
            deletion_matrix: vec![vec![0; query.chars().count()]],
            descriptions: vec![description.to_string()],
        }
    }

    /// Number of rows (the query included).
    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    /// Whether there are no rows (never true for a parsed file).
    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// The query's length, the number of aligned columns.
    pub fn width(&self) -> usize {
        self.sequences.first().map_or(0, |s| s.len())
    }
}

/// Reads the A3M file at `path`.
pub fn read(path: &Path) -> Result<Msa> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    parse(&text, path)
}

struct Row {
    description: String,
    line_no: usize,
    aligned: String,
    deletions: Vec<u32>,
    pending: u32,
}

/// Parses A3M text; `source` names the text in errors (the file it came from).
pub fn parse(text: &str, source: &Path) -> Result<Msa> {
    let bad = |msg: String| Error::Format { path: source.to_path_buf(), msg };
    let mut rows: Vec<Row> = Vec::new();
    for (line_index, line) in text.lines().enumerate() {
        let line_no = line_index + 1;
        let line = line.trim();
        if let Some(header) = line.strip_prefix('>') {
            rows.push(Row {
                description: header.trim().to_string(),
                line_no,
                aligned: String::new(),
                deletions: Vec::new(),
                pending: 0,
            });
            continue;
        }
        if line.is_empty() || (rows.is_empty() && line.starts_with('#')) {
            continue;
        }
        let Some(row) = rows.last_mut() else {
            return Err(bad(format!("line {line_no}: sequence data before the first '>' header")));
        };
        for (offset, c) in line.chars().filter(|c| !c.is_whitespace()).enumerate() {
            if c.is_ascii_uppercase() || c == '-' {
                row.aligned.push(c);
                row.deletions.push(row.pending);
                row.pending = 0;
            } else if c.is_ascii_lowercase() {
                row.pending += 1;
            } else if c != '.' {
                return Err(bad(format!(
                    "row {:?} (line {line_no}, character {}): {c:?} is not an alignment code \
                     (expected A-Z, '-', a-z for insertions or '.')",
                    row.description,
                    offset + 1
                )));
            }
        }
    }
    let Some(query) = rows.first() else {
        return Err(bad("no A3M records (expected a '>' header line)".into()));
    };
    let width = query.aligned.len();
    if width == 0 {
        return Err(bad(format!("query {:?} has no aligned residues", query.description)));
    }
    let mut msa = Msa { sequences: Vec::new(), deletion_matrix: Vec::new(), descriptions: Vec::new() };
    let mut seen = HashSet::new();
    for row in rows {
        if row.aligned.len() != width {
            return Err(bad(format!(
                "row {:?} (line {}) has {} aligned columns, the query has {width}",
                row.description,
                row.line_no,
                row.aligned.len()
            )));
        }
        if !seen.insert(row.aligned.clone()) {
            continue;
        }
        msa.sequences.push(row.aligned);
        msa.deletion_matrix.push(row.deletions);
        msa.descriptions.push(row.description);
    }
    Ok(msa)
}
