//! A tiny training data set in OpenFold's layout, written from the template fixtures' mmCIF
//! entries: `mmcif/<pdb>.cif` and, per chain, `alignments/<pdb>_<chain>/` with an A3M and a
//! Stockholm MSA whose query is the chain's SEQRES; synthetic mmCIF entries
//! ([`write_mmcif`]) and data sets of complexes of them ([`write_complexes`]).
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

/// A chain folder's MSAs for the chain `name` of SEQRES `query`: `bfd_uniclust_hits.a3m` (the
/// query, four variants, one with an insertion and one with a gap) and `uniref90_hits.sto`
/// (the query and two variants).
fn write_alignments(folder: &Path, name: &str, query: &str) {
    std::fs::create_dir_all(folder).unwrap();
    let mut a3m = format!(">{name}\n{query}\n");
    for k in 0..4 {
        let mut row = variant(query, k, 3 + k);
        if k == 1 {
            row.insert_str(5, "kl");
        }
        if k == 2 {
            row.replace_range(7..8, "-");
        }
        a3m.push_str(&format!(">hit{k}\n{row}\n"));
    }
    std::fs::write(folder.join("bfd_uniclust_hits.a3m"), a3m).unwrap();
    let sto =
        format!("# STOCKHOLM 1.0\n\n{name} {query}\nu1 {}\nu2 {}\n//\n", variant(query, 1, 2), variant(query, 0, 4));
    std::fs::write(folder.join("uniref90_hits.sto"), sto).unwrap();
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
        write_alignments(&alignment_dir.join(name), name, &query);
    }
    (mmcif_dir, alignment_dir)
}

/// Position of atom `j` of SEQRES residue `i` in the synthetic template entries (consecutive
/// Cα atoms about 3.8 Å apart), rounded as mmCIF files write them.
pub fn template_atom(i: usize, j: usize) -> [f32; 3] {
    let r = |x: f64| ((x * 1000.0).round() / 1000.0) as f32;
    let (i, j) = (i as f64, j as f64);
    [r(3.8 * i + 0.6 * j.sin()), r(1.5 * (0.5 * i).cos() + 0.8 * j.cos()), r(0.4 * j - 1.0)]
}

/// The backbone atoms written per residue (and CB but for glycine), in atom37 order names.
pub const TEMPLATE_ATOMS: [&str; 5] = ["N", "CA", "C", "O", "CB"];

/// A synthetic mmCIF entry `id` released on `date` with one protein chain per (author
/// chain, sequence), each its own entity; every residue observed, backbone and CB atoms at
/// [`template_atom`].
pub fn write_mmcif(path: &Path, id: &str, date: &str, chains: &[(&str, &str)]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, mmcif_text(id, date, chains, 0.0, None)).unwrap();
}

/// [`write_mmcif`]'s text, chain `e` moved by `e * apart` Å along z (chains of one complex
/// side by side rather than on top of each other), with `_refine.ls_d_res_high` when a
/// resolution is given.
fn mmcif_text(id: &str, date: &str, chains: &[(&str, &str)], apart: f32, resolution: Option<f64>) -> String {
    let three = |c: char| {
        let names = fastfold::residue_constants::RESNAMES;
        names[fastfold::residue_constants::aatype_of(c)]
    };
    let mut t = format!("data_{id}\n_entry.id {id}\nloop_\n_pdbx_audit_revision_history.ordinal\n");
    t += &format!("_pdbx_audit_revision_history.revision_date\n1 {date}\n2 2024-01-01\n#\n");
    if let Some(r) = resolution {
        t += &format!("_refine.ls_d_res_high {r}\n");
    }
    t += "loop_\n_chem_comp.id\n_chem_comp.type\n";
    for c in b"ACDEFGHIKLMNPQRSTVWY" {
        t += &format!("{} 'L-peptide linking'\n", three(*c as char));
    }
    t += "loop_\n_entity_poly_seq.entity_id\n_entity_poly_seq.num\n_entity_poly_seq.mon_id\n";
    for (e, (_, seq)) in chains.iter().enumerate() {
        for (k, c) in seq.chars().enumerate() {
            t += &format!("{} {} {}\n", e + 1, k + 1, three(c));
        }
    }
    t += "loop_\n_struct_asym.id\n_struct_asym.entity_id\n";
    for (e, _) in chains.iter().enumerate() {
        t += &format!("{} {}\n", (b'A' + e as u8) as char, e + 1);
    }
    let cols = "group_PDB id type_symbol label_atom_id label_alt_id label_comp_id label_asym_id label_entity_id \
                label_seq_id pdbx_PDB_ins_code Cartn_x Cartn_y Cartn_z occupancy B_iso_or_equiv auth_seq_id \
                auth_asym_id pdbx_PDB_model_num";
    t += "loop_\n";
    for c in cols.split_whitespace() {
        t += &format!("_atom_site.{c}\n");
    }
    let mut n = 0;
    for (e, (auth, seq)) in chains.iter().enumerate() {
        for (k, c) in seq.chars().enumerate() {
            for (j, atom) in TEMPLATE_ATOMS.iter().enumerate() {
                if c == 'G' && *atom == "CB" {
                    continue;
                }
                n += 1;
                let [x, y, z] = template_atom(k, j);
                let z = z + e as f32 * apart;
                let asym = (b'A' + e as u8) as char;
                t += &format!(
                    "ATOM {n} {} {atom} . {} {asym} {} {} ? {x:.3} {y:.3} {z:.3} 1.0 20.0 {} {auth} 1\n",
                    &atom[..1],
                    three(c),
                    e + 1,
                    k + 1,
                    k + 1
                );
            }
        }
    }
    t
}

/// A complex of a data set: its entry id, release date and (author chain, SEQRES) chains.
pub type ComplexSpec<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)]);

/// Writes a data set of complexes: `dir/mmcif/<pdb>.cif` for each of `entries` (synthetic
/// entries at 2 Å, [`template_atom`]'s chains 8 Å apart) and `dir/alignments/<pdb>_<chain>/`
/// for each chain, its MSAs as [`write`] writes them and `uniprot_hits.sto` (the query and
/// three rows of HUMAN, MOUSE and YEAST, which pair across distinct chains). Returns (mmcif
/// dir, alignment dir).
pub fn write_complexes(dir: &Path, entries: &[ComplexSpec]) -> (PathBuf, PathBuf) {
    let (mmcif_dir, alignment_dir) = (dir.join("mmcif"), dir.join("alignments"));
    std::fs::create_dir_all(&mmcif_dir).unwrap();
    for (pdb, date, chains) in entries {
        let text = mmcif_text(&pdb.to_uppercase(), date, chains, 8.0, Some(2.0));
        std::fs::write(mmcif_dir.join(format!("{pdb}.cif")), text).unwrap();
        for (chain, query) in chains.iter() {
            let name = format!("{pdb}_{chain}");
            let folder = alignment_dir.join(&name);
            write_alignments(&folder, &name, query);
            let mut sto = format!("# STOCKHOLM 1.0\n\n{name} {query}\n");
            for (k, species) in ["HUMAN", "MOUSE", "YEAST"].iter().enumerate() {
                sto += &format!(
                    "tr|Q{chain}0000{k}|Q{chain}0000{k}_{species}/1-{} {}\n",
                    query.len(),
                    variant(query, k, 7)
                );
            }
            std::fs::write(folder.join("uniprot_hits.sto"), sto + "//\n").unwrap();
        }
    }
    (mmcif_dir, alignment_dir)
}

/// The template fixtures' 40-residue query as a training chain: entry `9qry` is 3ghi's (whose
/// chain is the query's first 30 residues) with the query's last 10 residues added to SEQRES,
/// unobserved, released 2021-06-01. Its folder holds an A3M and the fixtures' `pdb_hits.hhr`
/// as `pdb70_hits.hhr`; the template entries 1abc, 2def and 3ghi sit beside it.
pub fn query_chain_layout(d: &Path) -> (std::path::PathBuf, std::path::PathBuf) {
    let (mmcif, alignments) = (d.join("mmcif"), d.join("alignments"));
    let folder = alignments.join("9qry_A");
    std::fs::create_dir_all(&mmcif).unwrap();
    std::fs::create_dir_all(&folder).unwrap();
    for pdb in ["1abc", "2def", "3ghi"] {
        std::fs::copy(mmcif_fixture(pdb), mmcif.join(format!("{pdb}.cif"))).unwrap();
    }
    let tail = ["GLU", "VAL", "GLN", "ALA", "PRO", "ILE", "LEU", "SER", "ARG", "VAL"];
    let added: String = tail.iter().enumerate().map(|(k, m)| format!("\n1 {} {m} n", 31 + k)).collect();
    let cif = std::fs::read_to_string(mmcif_fixture("3ghi"))
        .unwrap()
        .replace("3GHI", "9QRY")
        .replacen("1 2021-05-01", "1 2021-06-01", 1)
        .replacen("PHE 'L-peptide linking'", "PHE 'L-peptide linking'\nPRO 'L-peptide linking'", 1)
        .replacen("1 30 ILE n", &format!("1 30 ILE n{added}"), 1);
    std::fs::write(mmcif.join("9qry.cif"), cif).unwrap();
    let a3m = format!(">9qry_A\n{QUERY}\n>hit\n{}\n", QUERY.replace('K', "R"));
    std::fs::write(folder.join("bfd_uniclust_hits.a3m"), a3m).unwrap();
    let hits = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates/pdb_hits.hhr");
    std::fs::copy(hits, folder.join("pdb70_hits.hhr")).unwrap();
    (mmcif, alignments)
}

/// The template fixtures' query.
pub const QUERY: &str = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRV";

/// Template sampling as training's defaults take it: up to 4 templates from the hits of
/// entries in `mmcif_dir`, no date cut-off but the chain's own, nothing obsolete, `kalign` on
/// PATH.
pub fn template_sampling(mmcif_dir: &Path) -> fastfold::train_data::templates::TemplateSampling {
    fastfold::train_data::templates::TemplateSampling {
        max_templates: 4,
        mmcif_dir: mmcif_dir.to_path_buf(),
        max_template_date: None,
        obsolete: Default::default(),
        kalign: None,
    }
}

/// The template fixtures' hmmsearch result (`hmmsearch_hits.sto`: hits 2def_B, 3ghi_A and
/// 1abc_A of [`QUERY`], the last with an insertion).
pub fn hmmsearch_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates/hmmsearch_hits.sto")
}

/// The features `fastfold predict --template-searcher hmmsearch` makes of the hits saved in
/// `path` for `query` (its reader and featuriser as `Search::templates` sets them: one hit per
/// template sequence), the entries from `mmcif_dir`, released by `date`, `kalign` on PATH.
pub fn predict_hmmsearch_features(
    path: &Path,
    query: &str,
    mmcif_dir: &Path,
    date: &str,
) -> Vec<fastfold::search::templates::TemplateHitFeatures> {
    use fastfold::search::templates::Featurizer;
    let text = std::fs::read_to_string(path).unwrap();
    let hits = fastfold::search::hmmsearch::read_sto(&text, query, path).unwrap();
    let featurizer = Featurizer {
        mmcif_dir: mmcif_dir.to_path_buf(),
        max_template_date: date.to_string(),
        obsolete: Default::default(),
        kalign: fastfold::search::tools::Tool::new("kalign", None),
        unique_sequences: true,
    };
    featurizer.get_templates(query, &hits).unwrap().hits
}

/// Checks that every drawn hit is predict's featurisation of the same hit (`predicted`, by
/// domain name: sequence, positions and masks equal) and that template slot k of a complex's
/// features (`positions` [T, N, 37, 3] and `masks` [T, N, 37]) holds drawn hit k over residues
/// `from..from + n` (the chain's), bit for bit. Returns the drawn hits' names.
pub fn check_drawn_as_predicted(
    drawn: &[fastfold::search::templates::TemplateHitFeatures],
    predicted: &[fastfold::search::templates::TemplateHitFeatures],
    features: Option<(&tch::Tensor, &tch::Tensor)>,
    from: i64,
) -> Vec<String> {
    for (k, hit) in drawn.iter().enumerate() {
        let same = predicted.iter().find(|p| p.domain_name == hit.domain_name);
        assert_eq!(Some(hit), same, "drawn hit {k} ({}) is not predict's", hit.domain_name);
        let Some((positions, masks)) = features else { panic!("{} drawn, no template features", drawn.len()) };
        let n = hit.positions.len() as i64;
        let flat: Vec<f32> = hit.positions.iter().flatten().flatten().copied().collect();
        let want = tch::Tensor::from_slice(&flat).reshape([n, 37, 3]);
        let got = positions.get(k as i64).narrow(0, from, n);
        assert!(got.equal(&want), "template {k} ({}): positions differ from predict's", hit.domain_name);
        let flat: Vec<f32> = hit.masks.iter().flatten().copied().collect();
        let want = tch::Tensor::from_slice(&flat).reshape([n, 37]);
        assert!(masks.get(k as i64).narrow(0, from, n).equal(&want), "template {k}: masks differ");
    }
    drawn.iter().map(|h| h.domain_name.clone()).collect()
}
