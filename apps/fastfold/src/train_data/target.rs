//! An mmCIF chain as a training target, as OpenFold's `make_mmcif_features` makes one: the
//! query is the chain's SEQRES (not only its observed residues), each SEQRES residue has its
//! observed atoms in the atom37 layout ([`Chain::atom37`], AlphaFold's `_get_atom_positions`)
//! and residues never observed have mask 0; the resolution is the entry's (0 for NMR), the
//! release date its first revision's.
use std::path::Path;

use anyhow::Context;

use crate::pdb::Structure;
use crate::residue_constants::{aatype_of, SELENOMETHIONINE};
use crate::search::mmcif::{self, Chain};

/// One chain of an mmCIF entry, read for training.
#[derive(Clone, Debug, PartialEq)]
pub struct ChainTarget {
    /// `<pdb>_<chain>`, as the alignment folder names it.
    pub name: String,
    /// SEQRES as one-letter codes (see [`chain_sequence`]).
    pub sequence: String,
    /// The true structure over SEQRES.
    pub structure: Structure,
    /// Resolution in Å (0: none given).
    pub resolution: f64,
    /// The entry's first release, `YYYY-MM-DD`, when the file has one.
    pub release_date: Option<String>,
}

/// The chain's SEQRES letters, selenomethionine (`MSE`) read as methionine as AlphaFold's
/// mmCIF parser reads it (through Biopython's `protein_letters_3to1`); other residues outside
/// the 20 stay `X`.
pub fn chain_sequence(chain: &Chain) -> String {
    chain.sequence.chars().zip(&chain.monomers).map(|(c, mon)| if mon == SELENOMETHIONINE { 'M' } else { c }).collect()
}

/// The true structure over the chain's SEQRES: residue types from [`chain_sequence`],
/// residue indices 0..N, atoms from [`Chain::atom37`] (all masked for residues not observed),
/// B-factors 0.
pub fn chain_structure(chain: &Chain) -> Structure {
    let (positions, mask) = chain.atom37();
    let sequence = chain_sequence(chain);
    Structure {
        aatype: sequence.chars().map(aatype_of).collect(),
        residue_index: (0..positions.len() as i64).collect(),
        b_factors: vec![0.0; positions.len()],
        positions,
        mask,
    }
}

/// Chain `chain` (author id) of the mmCIF file `path`, named `<pdb>_<chain>` by the file's
/// stem. Errors name the file and, for a missing chain, the chains it has.
pub fn read_chain(path: &Path, chain: &str) -> anyhow::Result<ChainTarget> {
    let entry = mmcif::read(path)?;
    let found = entry.chain(chain).with_context(|| {
        let ids: Vec<&str> = entry.chains.iter().map(|c| c.id.as_str()).collect();
        format!("{}: no protein chain {chain:?} (its protein chains: {})", path.display(), ids.join(", "))
    })?;
    let stem = path.file_stem().map(|s| s.to_string_lossy().to_string()).unwrap_or_default();
    Ok(ChainTarget {
        name: format!("{stem}_{chain}"),
        sequence: chain_sequence(found),
        structure: chain_structure(found),
        resolution: entry.resolution,
        release_date: entry.release_date.clone(),
    })
}
