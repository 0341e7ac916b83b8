//! A tiny training data set in OpenFold's layout, written from the template fixtures' mmCIF
//! entries: `mmcif/<pdb>.cif` and, per chain, `alignments/<pdb>_<chain>/` with an A3M and a
//! Stockholm MSA whose query is the chain's SEQRES.
use std::path::{Path, PathBuf};

use fastfold::search::mmcif;
use fastfold::train_data::target::chain_sequence;

/// The template fixtures' mmCIF entry `<pdb>.cif`.
pub fn mmcif_fixture(pdb: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates/mmcif").join(format!("{pdb}.cif"))
}

/// `query` with every `step`-th residue from `from` changed (to A, or G where it is A).
fn variant(query: &str, from: usize, step: usize) -> String {
    query
        .chars()
        .enumerate()
        .map(|(i, c)| match (i >= from && (i - from).is_multiple_of(step), c) {
            (true, 'A') => 'G',
            (true, _) => 'A',
            (false, c) => c,
        })
        .collect()
}

/// Writes `dir/mmcif/` (the entries of `chains`) and `dir/alignments/<chain>/` for each
/// chain name (`1abc_A`): `bfd_uniclust_hits.a3m` (the query, four variants, one with an
/// insertion and one with a gap) and `uniref90_hits.sto` (the query and two variants).
/// Returns (mmcif dir, alignment dir).
pub fn write(dir: &Path, chains: &[&str]) -> (PathBuf, PathBuf) {
    let (mmcif_dir, alignment_dir) = (dir.join("mmcif"), dir.join("alignments"));
    std::fs::create_dir_all(&mmcif_dir).unwrap();
    for name in chains {
        let (pdb, chain) = name.rsplit_once('_').unwrap();
        let cif = mmcif_fixture(pdb);
        std::fs::copy(&cif, mmcif_dir.join(format!("{pdb}.cif"))).unwrap();
        let entry = mmcif::read(&cif).unwrap();
        let query = chain_sequence(entry.chain(chain).unwrap());
        let folder = alignment_dir.join(name);
        std::fs::create_dir_all(&folder).unwrap();
        let mut a3m = format!(">{name}\n{query}\n");
        for k in 0..4 {
            let mut row = variant(&query, k, 3 + k);
            if k == 1 {
                row.insert_str(5, "kl");
            }
            if k == 2 {
                row.replace_range(7..8, "-");
            }
            a3m.push_str(&format!(">hit{k}\n{row}\n"));
        }
        std::fs::write(folder.join("bfd_uniclust_hits.a3m"), a3m).unwrap();
        let sto = format!(
            "# STOCKHOLM 1.0\n\n{name} {query}\nu1 {}\nu2 {}\n//\n",
            variant(&query, 1, 2),
            variant(&query, 0, 4)
        );
        std::fs::write(folder.join("uniref90_hits.sto"), sto).unwrap();
    }
    (mmcif_dir, alignment_dir)
}
