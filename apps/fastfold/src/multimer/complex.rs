//! A FASTA file with several records as one complex, as AlphaFold-Multimer's
//! `pipeline_multimer.DataPipeline.process` reads it: the records in order are chains `A`,
//! `B`, ... (`protein.PDB_CHAIN_IDS`, at most 62), records with the same sequence are copies of
//! one entity, and `add_assembly_features` numbers them: entities by first appearance
//! (`entity_id` from 1), copies within an entity in FASTA order (`sym_id` from 1), and chains in
//! the assembly's order, entity by entity (`asym_id` from 1). That order is also the order of
//! the residues in the features: all copies of entity 1, then entity 2's, and so on.
use std::path::Path;

use anyhow::bail;
use data::fasta::FastaRecord;

/// AlphaFold's chain identifiers (`protein.PDB_CHAIN_IDS`), in the order the records get them.
pub const CHAIN_IDS: &str = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";

/// One chain of the complex.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chain {
    /// AlphaFold's chain id (`A`, `B`, ... in FASTA order), the key of its `chain_id_map.json`
    /// and the name of the chain's alignment folder.
    pub id: char,
    /// The FASTA record's name.
    pub record: String,
    /// The FASTA record's whole header.
    pub description: String,
    /// The residues.
    pub sequence: String,
    /// The chain's entity (identical sequences share one), from 1 in order of first appearance.
    pub entity_id: usize,
    /// The copy of its entity, from 1 in FASTA order.
    pub sym_id: usize,
    /// The chain's place in the assembly (entity by entity, copies in order), from 1.
    pub asym_id: usize,
}

impl Chain {
    /// AlphaFold's key of the chain in the assembly, `<entity letters>_<sym_id>` (`A_1`,
    /// `A_2`, `B_1`; entities past 26 as spreadsheet columns, `int_id_to_str_id`).
    pub fn assembly_key(&self) -> String {
        format!("{}_{}", entity_letters(self.entity_id), self.sym_id)
    }
}

/// AlphaFold's `int_id_to_str_id`: 1 = A, ..., 26 = Z, 27 = AA, 28 = BA (reversed spreadsheet
/// columns).
pub fn entity_letters(id: usize) -> String {
    let mut n = id as i64 - 1;
    let mut out = String::new();
    while n >= 0 {
        out.push((b'A' + (n % 26) as u8) as char);
        n = n / 26 - 1;
    }
    out
}

/// The chains of one complex.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Complex {
    /// In FASTA order (chain ids `A`, `B`, ...).
    pub chains: Vec<Chain>,
}

impl Complex {
    /// The complex of `records`, read from `fasta` (named in errors): one chain per record. More
    /// chains than AlphaFold's chain ids is an error naming the first record without one.
    pub fn new(records: &[FastaRecord], fasta: &Path) -> anyhow::Result<Complex> {
        if records.is_empty() {
            bail!("{}: no FASTA records", fasta.display());
        }
        if let Some(extra) = records.get(CHAIN_IDS.len()) {
            bail!(
                "{}: record {} ({:?}) would be chain {}, but AlphaFold-Multimer names at most {} chains (as the PDB \
                 format does): split the complex",
                fasta.display(),
                CHAIN_IDS.len() + 1,
                extra.name,
                CHAIN_IDS.len() + 1,
                CHAIN_IDS.len()
            );
        }
        let mut sequences: Vec<&str> = Vec::new();
        let mut chains: Vec<Chain> = records
            .iter()
            .zip(CHAIN_IDS.chars())
            .map(|(r, id)| {
                let entity = match sequences.iter().position(|s| *s == r.sequence) {
                    Some(i) => i + 1,
                    None => {
                        sequences.push(&r.sequence);
                        sequences.len()
                    }
                };
                Chain {
                    id,
                    record: r.name.clone(),
                    description: r.description.clone(),
                    sequence: r.sequence.clone(),
                    entity_id: entity,
                    sym_id: 0,
                    asym_id: 0,
                }
            })
            .collect();
        let mut asym = 0;
        for entity in 1..=sequences.len() {
            let mut sym = 0;
            for c in chains.iter_mut().filter(|c| c.entity_id == entity) {
                sym += 1;
                asym += 1;
                (c.sym_id, c.asym_id) = (sym, asym);
            }
        }
        Ok(Complex { chains })
    }

    /// The chains in the assembly's order (by `asym_id`): the order of the features' residues.
    pub fn assembly_order(&self) -> Vec<&Chain> {
        let mut chains: Vec<&Chain> = self.chains.iter().collect();
        chains.sort_by_key(|c| c.asym_id);
        chains
    }

    /// Number of distinct sequences.
    pub fn num_entities(&self) -> usize {
        self.chains.iter().map(|c| c.entity_id).max().unwrap_or(0)
    }

    /// Whether every chain has the same sequence (a monomer or a homomer): then AlphaFold
    /// neither searches UniProt nor pairs rows across chains.
    pub fn is_homomer_or_monomer(&self) -> bool {
        self.num_entities() == 1
    }

    /// The first chain of each entity, in entity order: the chains whose sequences are searched.
    pub fn entity_representatives(&self) -> Vec<&Chain> {
        (1..=self.num_entities()).filter_map(|e| self.chains.iter().find(|c| c.entity_id == e)).collect()
    }

    /// AlphaFold's `chain_id_map.json`: each chain id with its record's sequence and header,
    /// keys sorted, indented by 4, as `json.dump(..., indent=4, sort_keys=True)` writes it.
    pub fn chain_id_map_json(&self) -> String {
        let mut map = serde_json::Map::new();
        for c in &self.chains {
            let mut entry = serde_json::Map::new();
            entry.insert("description".into(), c.description.clone().into());
            entry.insert("sequence".into(), c.sequence.clone().into());
            map.insert(c.id.to_string(), entry.into());
        }
        let mut out = Vec::new();
        let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
        let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
        serde::Serialize::serialize(&map, &mut ser).expect("a JSON map serialises");
        // Python's `ensure_ascii`: characters past ASCII as `\uXXXX` (UTF-16 units).
        String::from_utf8_lossy(&out)
            .chars()
            .flat_map(|c| match c.is_ascii() {
                true => vec![c.to_string()],
                false => c.encode_utf16(&mut [0; 2]).iter().map(|u| format!("\\u{u:04x}")).collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(seqs: &[&str]) -> Vec<FastaRecord> {
        seqs.iter()
            .enumerate()
            .map(|(i, s)| FastaRecord {
                name: format!("r{i}"),
                description: format!("r{i} chain"),
                sequence: s.to_string(),
            })
            .collect()
    }

    #[test]
    fn copies_share_an_entity_and_the_assembly_goes_entity_by_entity() {
        let c = Complex::new(&records(&["MKV", "GSH", "MKV", "PPW", "GSH"]), Path::new("x.fasta")).unwrap();
        let ids: Vec<(char, usize, usize, usize)> =
            c.chains.iter().map(|c| (c.id, c.entity_id, c.sym_id, c.asym_id)).collect();
        assert_eq!(ids, [('A', 1, 1, 1), ('B', 2, 1, 3), ('C', 1, 2, 2), ('D', 3, 1, 5), ('E', 2, 2, 4)]);
        let order: Vec<String> = c.assembly_order().iter().map(|c| c.assembly_key()).collect();
        assert_eq!(order, ["A_1", "A_2", "B_1", "B_2", "C_1"]);
        assert_eq!(c.entity_representatives().iter().map(|c| c.id).collect::<String>(), "ABD");
        assert!(!c.is_homomer_or_monomer());
        assert!(Complex::new(&records(&["MKV", "MKV"]), Path::new("x.fasta")).unwrap().is_homomer_or_monomer());
        assert_eq!([1, 26, 27, 28, 53, 703].map(entity_letters), ["A", "Z", "AA", "BA", "AB", "AAA"]);
    }

    #[test]
    fn more_chains_than_ids_names_the_record() {
        let seqs: Vec<&str> = vec!["MKV"; 63];
        let err = Complex::new(&records(&seqs), Path::new("big.fasta")).unwrap_err().to_string();
        assert!(err.contains("big.fasta: record 63 (\"r62\")") && err.contains("at most 62 chains"), "{err}");
        let c = Complex::new(&records(&seqs[..62]), Path::new("big.fasta")).unwrap();
        assert_eq!(c.chains.last().unwrap().id, '9');
        let json = c.chain_id_map_json();
        assert!(json.starts_with("{\n    \"0\": {\n        \"description\": \"r52 chain\","), "{json}");
        let mut r = records(&["MKV"]);
        r[0].description = "r0 protéine 🧬".into();
        let json = Complex::new(&r, Path::new("x.fasta")).unwrap().chain_id_map_json();
        assert!(json.contains(r#""r0 prot\u00e9ine \ud83e\uddec""#), "{json}");
    }
}
