//! Merging the databases' alignments into the one MSA the features are made from, as
//! AlphaFold's `make_msa_features` does: the alignments in order (UniRef90, BFD, MGnify), a
//! row dropped when an earlier row (of any database) has the same aligned sequence, so the
//! query stays row 0 and appears once.
use std::collections::HashSet;

use data::a3m::Msa;

/// `msas` in order, each aligned sequence kept once (its first row).
pub fn merge(msas: &[&Msa]) -> Msa {
    let mut merged = Msa { sequences: Vec::new(), deletion_matrix: Vec::new(), descriptions: Vec::new() };
    let mut seen = HashSet::new();
    for msa in msas {
        for ((seq, del), desc) in msa.sequences.iter().zip(&msa.deletion_matrix).zip(&msa.descriptions) {
            if seen.insert(seq.as_str()) {
                merged.sequences.push(seq.clone());
                merged.deletion_matrix.push(del.clone());
                merged.descriptions.push(desc.clone());
            }
        }
    }
    merged
}
