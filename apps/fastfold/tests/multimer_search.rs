//! AlphaFold-Multimer's searches for a complex, with real jackhmmer on tiny databases built
//! here (AlphaFold's reduced_dbs layout and a UniProt of species-named homologues of both
//! chains among unrelated sequences): each entity searched once into `msas/<chain id>/`, UniProt
//! only for a complex of distinct chains, the species read from the hits' names, rows paired
//! across the chains by species, the saved alignments read back with --use-precomputed-msas
//! to the same features, and a heteromer without UniProt named.
mod common;

use std::path::{Path, PathBuf};

use fastfold::multimer::search::entity_inputs;
use fastfold::multimer::{features, Complex};
use fastfold::search::databases::{DatabaseArgs, DbPreset};
use fastfold::search::{Mode, Search, SearchArgs};

const AA: &[u8] = b"ACDEFGHIKLMNPQRSTVWY";
const CHAIN_A: &str = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKAL";
const CHAIN_B: &str = "GSHMLEDPVRWCNPQTYHEIRKLMAGFDSWVEKNPLHTQYRDAMGEILKTFSWPAVNDEQRT";

/// A fixed pseudo-random stream (xorshift), so the databases are the same every run.
fn stream(seed: u64) -> impl FnMut(usize) -> usize {
    let mut x = seed | 1;
    move |n| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    }
}

/// `query` with about a fifth of its residues changed.
fn homologue(query: &str, seed: u64) -> String {
    let mut next = stream(seed * 0x9e37_79b9 + 11);
    query.chars().map(|c| if next(5) == 0 { AA[next(AA.len())] as char } else { c }).collect()
}

fn unrelated(seed: u64) -> String {
    let mut next = stream(seed * 0x1234_5679 + 3);
    (0..60).map(|_| AA[next(AA.len())] as char).collect()
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// The data directory: each monomer database holds homologues of both chains; UniProt holds
/// HUMAN and MOUSE homologues of both, a YEAST one of A only, and unrelated entries.
fn data_dir(root: &Path) -> PathBuf {
    let d = root.join("data");
    let monomer = |tag: &str, seeds: std::ops::Range<u64>| -> String {
        let mut text = String::new();
        for s in seeds.clone() {
            text += &format!(">{tag}A{s}\n{}\n>{tag}B{s}\n{}\n", homologue(CHAIN_A, s), homologue(CHAIN_B, s));
            text += &format!(">{tag}R{s}\n{}\n", unrelated(s));
        }
        text
    };
    write(&d.join("uniref90/uniref90.fasta"), &monomer("UniRef90_", 0..4));
    write(&d.join("mgnify/mgy_clusters_2022_05.fa"), &monomer("MGYP", 4..6));
    write(&d.join("small_bfd/bfd-first_non_consensus_sequences.fasta"), &monomer("bfd", 6..8));
    let entries = [
        ("tr|A0A0A0A0A1|A0A0A0A0A1_HUMAN", homologue(CHAIN_A, 20)),
        ("tr|B0B0B0B0B1|B0B0B0B0B1_HUMAN", homologue(CHAIN_B, 21)),
        ("sp|P11111|AAA1_MOUSE", homologue(CHAIN_A, 22)),
        ("sp|P22222|BBB1_MOUSE", homologue(CHAIN_B, 23)),
        ("tr|A0A0A0A0A3|A0A0A0A0A3_YEAST", homologue(CHAIN_A, 24)),
        ("tr|C0C0C0C0C1|C0C0C0C0C1_ECOLI", unrelated(25)),
    ];
    let uniprot: String = entries.iter().map(|(name, seq)| format!(">{name} some protein OS=x\n{seq}\n")).collect();
    write(&d.join("uniprot/uniprot.fasta"), &uniprot);
    d
}

fn search(data: &Path, reuse: bool) -> Search {
    let args = SearchArgs {
        databases: DatabaseArgs {
            data_dir: Some(data.to_path_buf()),
            db_preset: DbPreset::ReducedDbs,
            ..Default::default()
        },
        use_precomputed_msas: reuse,
        search_cpus: Some(1),
        ..Default::default()
    };
    args.search(Mode::Search).unwrap().unwrap()
}

fn complex(d: &Path, records: &[(&str, &str)]) -> Complex {
    let text: String = records.iter().map(|(n, s)| format!(">{n}\n{s}\n")).collect();
    let path = d.join(format!("{}.fasta", records.len()));
    std::fs::write(&path, text).unwrap();
    Complex::new(&data::fasta::read(&path).unwrap(), &path).unwrap()
}

#[test]
fn chains_are_searched_once_per_entity_and_uniprot_rows_pair_by_species() {
    let d = common::scratch("multimer-search", "pair");
    let data = data_dir(&d);
    let uniprot = data.join("uniprot/uniprot.fasta");
    let msas = d.join("out/msas");
    let c = complex(&d, &[("heavy", CHAIN_A), ("light", CHAIN_B), ("heavy2", CHAIN_A)]);
    let inputs = entity_inputs(&c, &search(&data, false), Some(&uniprot), &msas, Mode::Search).unwrap();
    for file in ["uniref90_hits.sto", "mgnify_hits.sto", "small_bfd_hits.sto", "uniprot_hits.sto"] {
        assert!(msas.join("A").join(file).is_file() && msas.join("B").join(file).is_file(), "{file}");
    }
    assert!(!msas.join("C").exists(), "chain C is a copy of A, not searched again");
    assert!(std::fs::read_to_string(msas.join("chain_id_map.json")).unwrap().contains("\"heavy2\""));
    // Each chain's own homologues in its monomer MSA (query, 3 databases x 2 seeds or more).
    assert!(inputs.iter().all(|i| i.raw.num_alignments >= 5), "{:?}", inputs.iter().map(|i| i.raw.num_alignments));
    let species = |i: usize| {
        let mut s: Vec<&str> = inputs[i].pairing.as_ref().unwrap().species.iter().map(String::as_str).collect();
        s.sort();
        s
    };
    assert_eq!(species(0), ["", "HUMAN", "MOUSE", "YEAST"]);
    assert_eq!(species(1), ["", "HUMAN", "MOUSE"]);
    let f = features(&c, &inputs).unwrap();
    let msa = f.get("msa").unwrap().tensor();
    // Rows 0-2: the queries, then HUMAN and MOUSE across all three chains (A, C, then B);
    // row 3: YEAST across A and C, B's part gap.
    let filled = |row: i64, from: i64, len: i64| msa.get(row).narrow(0, from, len).ne(21).any().int64_value(&[]) == 1;
    let (a, b) = (CHAIN_A.len() as i64, CHAIN_B.len() as i64);
    for row in 0..3 {
        assert!(filled(row, 0, 2 * a) && filled(row, 2 * a, b), "row {row} pairs all three chains");
    }
    assert!(filled(3, 0, 2 * a) && !filled(3, 2 * a, b), "row 3 pairs A's YEAST rows alone");

    // Reading the saved alignments back (the databases gone) gives the same features.
    std::fs::remove_dir_all(&data).unwrap();
    let again = entity_inputs(&c, &search(&data, true), Some(&uniprot), &msas, Mode::Search).unwrap();
    assert_eq!(features(&c, &again).unwrap(), f);
}

#[test]
fn homomers_search_no_uniprot_and_heteromers_need_it() {
    let d = common::scratch("multimer-search", "homomer");
    let data = data_dir(&d);
    let msas = d.join("out/msas");
    let homodimer = complex(&d, &[("a", CHAIN_B), ("b", CHAIN_B)]);
    let inputs = entity_inputs(&homodimer, &search(&data, false), None, &msas, Mode::Search).unwrap();
    assert!(inputs.len() == 1 && inputs[0].pairing.is_none());
    assert!(msas.join("A/small_bfd_hits.sto").is_file() && !msas.join("A/uniprot_hits.sto").exists());
    let heteromer = complex(&d, &[("a", CHAIN_A), ("b", CHAIN_B)]);
    let err = entity_inputs(&heteromer, &search(&data, false), None, &msas, Mode::Search).unwrap_err().to_string();
    assert!(err.contains("--uniprot-database-path"), "{err}");
}

#[test]
fn predict_searches_a_complex_and_pairs_its_rows_through_uniprot() {
    // `fastfold predict` with Multimer's parameters (the network fixture's tiny v3-layout set)
    // and the databases: each entity searched once, UniProt pairing the distinct chains, the
    // paired features predicted as one complex of three PDB chains.
    let d = common::scratch("multimer-search", "predict");
    let data = data_dir(&d);
    let params = d.join("params_model_1_multimer_v3.npz");
    let tiny = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network/model_params.npz");
    std::fs::copy(tiny, &params).unwrap();
    let fasta = d.join("complex.fasta");
    std::fs::write(&fasta, format!(">heavy\n{CHAIN_A}\n>light\n{CHAIN_B}\n>heavy2\n{CHAIN_A}\n")).unwrap();
    let out = d.join("out");
    let run = std::process::Command::new(common::BIN)
        .args(["predict", fasta.to_str().unwrap(), "-o", out.to_str().unwrap()])
        .args(["--params", params.to_str().unwrap(), "--data-dir", data.to_str().unwrap()])
        .args(["--db-preset", "reduced_dbs", "--search-cpus", "1"])
        .args(["--num-multimer-predictions-per-model", "1", "--num-recycle", "0"])
        .env("FASTFOLD_TEST", "1")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{text}");
    let dir = out.join("complex");
    for file in ["uniref90_hits.sto", "small_bfd_hits.sto", "uniprot_hits.sto"] {
        assert!(dir.join("msas/A").join(file).is_file() && dir.join("msas/B").join(file).is_file(), "{file}");
    }
    assert!(!dir.join("msas/C").exists(), "chain C is a copy of A, not searched again");
    let features: std::collections::HashMap<String, tch::Tensor> =
        tch::Tensor::read_npz(dir.join("features.npz")).unwrap().into_iter().collect();
    let rows = features["num_alignments"].int64_value(&[]);
    assert!(rows >= 10, "the searched and paired rows: {rows}");
    let pdb = std::fs::read_to_string(dir.join("ranked_0.pdb")).unwrap();
    let ters: Vec<&str> = pdb.lines().filter(|l| l.starts_with("TER")).collect();
    assert_eq!(ters.len(), 3, "{pdb}");
    assert!(dir.join("model_1_multimer_v3_pred_0_confidence.json").is_file());
}
