//! The species of an MSA row from its description, as AlphaFold's
//! `msa_identifiers.get_identifiers` reads it: the description's first word up to a `/` (the
//! jackhmmer subsequence suffix) must be a UniProtKB name, `tr|<accession>|<entry>_<species>` or
//! `sp|<accession>|<mnemonic>_<species>`, where the accession is 6 to 10 letters or digits with
//! an optional isoform suffix `_<digit>`, the entry or mnemonic letters and digits, and the
//! species code 1 to 5 letters or digits, optionally followed by small BFD's `_<digits>`.
//! Anything else (UniRef, MGnify, BFD names) has no species: the empty string.

/// The species code of the row described by `description`, or `""`.
pub fn species_id(description: &str) -> &str {
    let Some(word) = description.split_whitespace().next() else { return "" };
    let identifier = word.split('/').next().unwrap_or_default();
    uniprot_species(identifier).unwrap_or_default()
}

/// Letters and digits only (ASCII), at least one.
fn alphanumeric(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Digits only (ASCII), at least one.
fn digits(s: &str) -> bool {
    !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit())
}

/// The species of a whole UniProtKB identifier (`_UNIPROT_PATTERN`), if it is one.
fn uniprot_species(identifier: &str) -> Option<&str> {
    let rest = identifier.strip_prefix("tr|").or_else(|| identifier.strip_prefix("sp|"))?;
    let (accession, name) = rest.split_once('|')?;
    // The accession, optionally with an isoform suffix of one digit.
    let accession = match accession.split_once('_') {
        Some((a, isoform)) if isoform.len() == 1 && digits(isoform) => a,
        Some(_) => return None,
        None => accession,
    };
    if !(6..=10).contains(&accession.len()) || !alphanumeric(accession) {
        return None;
    }
    // The entry name cannot hold `_`, so the first one ends it.
    let (entry, species) = name.split_once('_')?;
    if !alphanumeric(entry) {
        return None;
    }
    let species = match species.split_once('_') {
        Some((s, suffix)) if digits(suffix) => s,
        Some(_) => return None,
        None => species,
    };
    ((1..=5).contains(&species.len()) && alphanumeric(species)).then_some(species)
}

#[cfg(test)]
mod tests {
    use super::species_id;

    /// Each case as AlphaFold's regular expression reads it (checked with
    /// `msa_identifiers.get_identifiers` of alphafold 2.3).
    #[test]
    fn uniprot_names_give_their_species_and_others_none() {
        let cases = [
            ("tr|A0A146SKV9|A0A146SKV9_FUNHE", "FUNHE"),
            ("sp|P0C2L1|A3X1_LOXLA/12-80 some description", "LOXLA"),
            ("tr|P12345_1|P12345_YEAST/3-19", "YEAST"),
            ("sp|Q12345|ABC1_YEAST_12", "YEAST"),
            ("  tr|A0A0B4J2F0|A0A0B4J2F0_HUMAN", "HUMAN"),
            ("tr|A0A0B4J2F1|A0A0B4J2F1_TOOLONG", ""),
            ("tr|ABC|ABC_HUMAN", ""),
            ("tr|A0A0B4J2F0123|X_HUMAN", ""),
            ("tr|P12345_12|P12345_YEAST", ""),
            ("sp|Q12345|ABC1_YEAST_1a", ""),
            ("xx|Q12345|ABC1_YEAST", ""),
            ("sp|Q12345|_YEAST", ""),
            ("sp|Q12345|ABC1_", ""),
            ("sp|Q12345|AB_C1_YEAST", ""),
            ("sp|Q12345|AB_C1_12", "C1"),
            ("UniRef90_A0A0B4J2F0/1-20", ""),
            ("MGYP000123", ""),
            ("", ""),
        ];
        for (description, species) in cases {
            assert_eq!(species_id(description), species, "{description:?}");
        }
    }
}
