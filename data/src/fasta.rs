//! Protein FASTA files: one or more records, each a `>` header line and sequence lines.
//!
//! Sequences are read the way AlphaFold's pipeline reads them (`parsers.parse_fasta`, then
//! `residue_constants.sequence_to_onehot(map_unknown_to_x=True)`): whitespace is removed and
//! letters are upper-cased. The 20 standard amino acids, `X` and the ambiguity and rare codes
//! `B`, `Z`, `U`, `O` and `J` are kept as written: AlphaFold keeps them too, its `aatype` maps
//! them to the unknown type while its MSA (`HHBLITS_AA_TO_ID`, the query row included) reads
//! `B`, `Z`, `U` as `D`, `E`, `C`, and the search tools get the sequence unchanged, so the
//! mapping belongs to each consumer, not to the reader. Anything else (digits,
//! `*`, `-`, `.`) is an error naming the file, the record, the 1-based position in the
//! sequence and the character, so a stray stop codon or an alignment passed by mistake is
//! caught here rather than folded silently.
use std::collections::HashSet;
use std::path::Path;

use crate::{Error, Result};

/// One FASTA record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FastaRecord {
    /// The first word of the header (after `>`), unique within the file.
    pub name: String,
    /// The whole header line after `>`, trimmed.
    pub description: String,
    /// One upper-case letter per residue from `ACDEFGHIKLMNPQRSTVWYX` and `BZUOJ`.
    pub sequence: String,
}

/// The 20 standard amino-acid letters, in AlphaFold's `restypes` order.
pub const STANDARD_AMINO_ACIDS: &str = "ARNDCQEGHILKMFPSTWYV";

/// Letters accepted and kept, though outside the 20 (ambiguous or non-standard residues):
/// AlphaFold's residue type for them is `X`, its MSA class `D`, `E`, `C`, `X`, `X`.
pub const NON_STANDARD: &str = "BZUOJ";

/// The residue letter a sequence character stands for (upper-cased), or `None` if it is not
/// an amino-acid code. Upper- and lower-case are the same residue.
pub fn residue_letter(c: char) -> Option<char> {
    let up = c.to_ascii_uppercase();
    (STANDARD_AMINO_ACIDS.contains(up) || up == 'X' || NON_STANDARD.contains(up)).then_some(up)
}

/// Reads every record of the FASTA file at `path`.
pub fn read(path: &Path) -> Result<Vec<FastaRecord>> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    parse(&text, path)
}

/// Parses FASTA text; `source` names the text in errors (the file it came from).
pub fn parse(text: &str, source: &Path) -> Result<Vec<FastaRecord>> {
    let bad = |msg: String| Error::Format { path: source.to_path_buf(), msg };
    let mut records: Vec<FastaRecord> = Vec::new();
    let mut names = HashSet::new();
    // A byte-order mark (some Windows editors write one) is not sequence data.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (line_index, line) in text.lines().enumerate() {
        let line_no = line_index + 1;
        let line = line.trim();
        if let Some(header) = line.strip_prefix('>') {
            if let Some(last) = records.last() {
                if last.sequence.is_empty() {
                    return Err(bad(format!("record {:?} has an empty sequence", last.name)));
                }
            }
            let description = header.trim().to_string();
            let name = description.split_whitespace().next().unwrap_or("").to_string();
            if name.is_empty() {
                return Err(bad(format!("line {line_no}: header has no name after '>'")));
            }
            if !names.insert(name.clone()) {
                return Err(bad(format!("line {line_no}: duplicate record name {name:?}")));
            }
            records.push(FastaRecord { name, description, sequence: String::new() });
            continue;
        }
        if line.is_empty() {
            continue;
        }
        let Some(record) = records.last_mut() else {
            return Err(bad(format!("line {line_no}: sequence data before the first '>' header")));
        };
        for c in line.chars().filter(|c| !c.is_whitespace()) {
            let position = record.sequence.len() + 1;
            let residue = residue_letter(c).ok_or_else(|| {
                bad(format!(
                    "record {:?}, position {position} (line {line_no}): {c:?} is not an amino-acid code \
                     (expected one of {STANDARD_AMINO_ACIDS}, X or {NON_STANDARD})",
                    record.name
                ))
            })?;
            record.sequence.push(residue);
        }
    }
    match records.last() {
        None => Err(bad("no FASTA records (expected a '>' header line)".into())),
        Some(last) if last.sequence.is_empty() => Err(bad(format!("record {:?} has an empty sequence", last.name))),
        Some(_) => Ok(records),
    }
}
