//! Template search pieces against AlphaFold's own code: the `.hhr` parser against
//! `parsers.parse_hhr`, and the hit featuriser (mmCIF parsing, the query-to-chain mapping,
//! the wildcard match of a selenomethionine, kalign's realignment of a chain whose sequence
//! changed, AlphaFold's date filter) against `templates.HhsearchHitFeaturizer.get_templates`
//! on the fixtures of `fixtures/templates/` (written by `make_template_fixtures.py`: a
//! hand-written hhsearch result, a real one from HH-suite's hhsearch, and three synthetic
//! mmCIF entries); the A3M hhsearch is given against `convert_stockholm_to_a3m`. AlphaFold's other
//! filters and the errors for malformed files are checked against values worked out here.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use fastfold::residue_constants::{hhblits_aa_to_id, ATOM_TYPE_NUM};
use fastfold::search::hhr::{self, TemplateHit};
use fastfold::search::templates::{parse_obsolete, Featurizer, TemplateSearchResult};
use fastfold::search::tools::Tool;
use serde_json::Value;
use tch::Tensor;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/templates").join(name)
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap()
}

fn hits() -> Vec<TemplateHit> {
    hits_of("pdb_hits.hhr")
}

fn hits_of(file: &str) -> Vec<TemplateHit> {
    let path = fixture(file);
    hhr::parse(&std::fs::read_to_string(&path).unwrap(), &path).unwrap()
}

fn featurizer(mmcif_dir: &Path, date: &str) -> Featurizer {
    Featurizer {
        mmcif_dir: mmcif_dir.to_path_buf(),
        max_template_date: date.to_string(),
        obsolete: HashMap::new(),
        kalign: Tool::new("kalign", None),
        unique_sequences: false,
    }
}

fn query() -> String {
    expected()["query"].as_str().unwrap().to_string()
}

fn scratch(name: &str) -> suite_tests::Scratch {
    suite_tests::scratch("fastfold-template-parsers", name)
}

#[test]
fn hhr_parses_as_alphafold_does() {
    let ours = hits();
    check_hits(&ours, &expected());
    // The 1abc_A hit spans two blocks with a gap on each side.
    assert!(ours[1].query.contains('-') && ours[1].hit_sequence.contains('-'));
}

/// `ours` equal AlphaFold's parse in `e["hits"]`.
fn check_hits(ours: &[TemplateHit], e: &Value) {
    let theirs = e["hits"].as_array().unwrap();
    assert_eq!(ours.len(), theirs.len());
    for (h, t) in ours.iter().zip(theirs) {
        let ints = |k: &str| t[k].as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect::<Vec<_>>();
        assert_eq!(h.index as u64, t["index"].as_u64().unwrap());
        assert_eq!(h.name, t["name"].as_str().unwrap());
        assert_eq!(h.aligned_cols as u64, t["aligned_cols"].as_u64().unwrap());
        assert_eq!(h.sum_probs, t["sum_probs"].as_f64());
        assert_eq!(h.query, t["query"].as_str().unwrap(), "{}", h.name);
        assert_eq!(h.hit_sequence, t["hit_sequence"].as_str().unwrap(), "{}", h.name);
        assert_eq!(h.indices_query, ints("indices_query"), "{}", h.name);
        assert_eq!(h.indices_hit, ints("indices_hit"), "{}", h.name);
    }
}

#[test]
fn real_hhsearch_output_parses_and_featurises_as_alphafold_does() {
    let e = expected();
    let ours = hits_of("hhsearch_hits.hhr");
    assert_eq!(ours.len(), 3);
    check_hits(&ours, &e["hhsearch"]);
    let date = e["max_template_date"].as_str().unwrap();
    let result = featurizer(&fixture("mmcif"), date).get_templates(&query(), &ours).unwrap();
    check_against_alphafold(&result, &e["hhsearch"], "expected_hhsearch.npz");
}

#[test]
fn malformed_hhr_is_an_error_naming_file_and_line() {
    let path = Path::new("bad.hhr");
    let text = std::fs::read_to_string(fixture("pdb_hits.hhr")).unwrap();
    // A summary line without its fields.
    let broken = text.replacen("Probab=99.20", "Probability 99.20", 1);
    let line = broken.lines().position(|l| l.starts_with("Probability")).unwrap() + 1;
    let err = hhr::parse(&broken, path).unwrap_err().to_string();
    assert!(err.contains("bad.hhr") && err.contains(&format!("line {line}")), "{err}");
    // A template line whose width disagrees with its query line.
    let broken =
        text.replacen("T 1abc_A            4 YIAKQRMISFGVKSHFSRQL", "T 1abc_A            4 YIAKQRMISFGVKSHFSRQ", 1);
    assert_ne!(broken, text);
    let err = hhr::parse(&broken, path).unwrap_err().to_string();
    assert!(err.contains("does not match its query line"), "{err}");
    // A score that is not a number (it would sort ahead of every real hit).
    let broken = text.replacen("Sum_probs=30.5", "Sum_probs=nan", 1);
    assert_ne!(broken, text);
    let err = hhr::parse(&broken, path).unwrap_err().to_string();
    assert!(err.contains("bad.hhr") && err.contains("line 16"), "{err}");
    // No hits at all is no error.
    assert!(hhr::parse("Query query\n\nDone!\n", path).unwrap().is_empty());
}

/// `result` equals AlphaFold's features: names and sequences in `e`, arrays in `npz`.
fn check_against_alphafold(result: &TemplateSearchResult, e: &Value, npz: &str) {
    let names: Vec<&str> = e["domain_names"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let sequences: Vec<&str> = e["sequences"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
    let ours_names: Vec<&str> = result.hits.iter().map(|h| h.domain_name.as_str()).collect();
    assert_eq!(ours_names, names);
    let ours_seqs: Vec<&str> = result.hits.iter().map(|h| h.sequence.as_str()).collect();
    assert_eq!(ours_seqs, sequences);
    let npz: HashMap<String, Tensor> = Tensor::read_npz(fixture(npz)).unwrap().into_iter().collect();
    let probs = Vec::<f32>::try_from(&npz["template_sum_probs"]).unwrap();
    assert_eq!(result.hits.iter().map(|h| h.sum_probs).collect::<Vec<_>>(), probs);
    for (t, hit) in result.hits.iter().enumerate() {
        let t = t as i64;
        let aatype = Vec::<i64>::try_from(&npz["template_aatype"].get(t)).unwrap();
        let ours: Vec<i64> = hit.sequence.chars().map(|c| hhblits_aa_to_id(c).unwrap() as i64).collect();
        assert_eq!(ours, aatype, "{}", hit.domain_name);
        let n = hit.positions.len() as i64;
        let flat: Vec<f32> = hit.positions.iter().flatten().flatten().copied().collect();
        let pos = Tensor::from_slice(&flat).reshape([n, ATOM_TYPE_NUM as i64, 3]);
        let diff = (&pos - npz["template_all_atom_positions"].get(t)).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "{}: positions differ by {diff}", hit.domain_name);
        let flat: Vec<f32> = hit.masks.iter().flatten().copied().collect();
        let mask = Tensor::from_slice(&flat).reshape([n, ATOM_TYPE_NUM as i64]);
        assert!(mask.equal(&npz["template_all_atom_masks"].get(t)), "{}: masks", hit.domain_name);
    }
}

#[test]
fn hits_featurise_as_alphafold_does() {
    let e = expected();
    let date = e["max_template_date"].as_str().unwrap();
    let result = featurizer(&fixture("mmcif"), date).get_templates(&query(), &hits()).unwrap();
    check_against_alphafold(&result, &e, "expected.npz");
    // 3ghi was released after the date; 2def_B was realigned: both said.
    assert!(result.warnings.iter().any(|w| w.contains("3ghi") && w.contains("2021-05-01")), "{:?}", result.warnings);
    assert!(result.warnings.iter().any(|w| w.contains("2def") && w.contains("kalign")), "{:?}", result.warnings);
    // (The comparison above covers the alternative locations and arginine's NH1/NH2 too.)
    // The selenomethionine's selenium sits in SD (chain residue 9 is query residue 10); the
    // unobserved chain residue 20 (query residue 20, after the insertion) has no atoms.
    let abc = &result.hits[1];
    let sd = fastfold::residue_constants::atom_order("SD").unwrap();
    assert_eq!(abc.masks[10][sd], 1.0);
    assert!(abc.masks[20].iter().all(|&m| m == 0.0));
}

#[test]
fn alphafolds_filters_drop_hits() {
    let q = query();
    let all = hits();
    let f = featurizer(&fixture("mmcif"), "2030-01-01");
    // With a later date, 3ghi is kept (its chain is the query's first 30 residues).
    let names = |r: &TemplateSearchResult| r.hits.iter().map(|h| h.domain_name.clone()).collect::<Vec<_>>();
    assert_eq!(names(&f.get_templates(&q, &all).unwrap()), ["2def_B", "3ghi_A", "1abc_A"]);
    // With a date between 1abc's release (2015) and 2def's (2018), only 1abc is left.
    assert_eq!(names(&featurizer(&fixture("mmcif"), "2016-01-01").get_templates(&q, &all).unwrap()), ["1abc_A"]);

    // Too short: 9 residues; aligned over 10% of the query or less (4 of 40 columns).
    let mut short = all[2].clone();
    short.query.truncate(9);
    short.hit_sequence.truncate(9);
    short.indices_query.truncate(9);
    short.indices_hit.truncate(9);
    short.aligned_cols = 9;
    let mut sparse = all[2].clone();
    sparse.aligned_cols = 4;
    let r = f.get_templates(&q, &[short, sparse]).unwrap();
    assert!(r.hits.is_empty());
    assert!(r.warnings[0].contains("9 residues (under 10)"), "{:?}", r.warnings);
    assert!(r.warnings[1].contains("aligned over 0.100"), "{:?}", r.warnings);

    // Obsolete entries: withdrawn ones are dropped, replaced ones read from their successor.
    let obsolete = parse_obsolete(
        " LIST OF OBSOLETE COORDINATE ENTRIES AND SUCCESSORS\nOBSLTE    30-SEP-20 3GHI     1ABC\nOBSLTE    30-SEP-20 2DEF\n",
    );
    assert_eq!(obsolete.get("3ghi"), Some(&Some("1abc".to_string())));
    assert_eq!(obsolete.get("2def"), Some(&None));
    // A line whose id columns split a multi-byte character is skipped, not a panic.
    assert!(parse_obsolete("OBSLTE             \u{e9}abc\n").is_empty());
    let f = Featurizer { obsolete, ..f };
    let r = f.get_templates(&q, &all).unwrap();
    assert!(r.warnings.iter().any(|w| w.contains("2def is obsolete")), "{:?}", r.warnings);
    // 3ghi_A's sequence (the query's first 30) is not in 1abc_A: realigned there, or
    // dropped as under 90% identical; either way it is read from 1abc.
    assert!(!names(&r).iter().any(|n| n.starts_with("3ghi") || n.starts_with("2def")), "{:?}", names(&r));

    // At most 20 hits.
    let many: Vec<TemplateHit> = (0..25).map(|_| all[1].clone()).collect();
    assert_eq!(featurizer(&fixture("mmcif"), "2030-01-01").get_templates(&q, &many).unwrap().hits.len(), 20);
}

#[test]
fn bad_mmcif_is_an_error_naming_the_file() {
    let dir = scratch("bad");
    for name in ["1abc.cif", "2def.cif", "3ghi.cif"] {
        std::fs::copy(fixture("mmcif").join(name), dir.join(name)).unwrap();
    }
    let text = std::fs::read_to_string(dir.join("2def.cif")).unwrap();
    std::fs::write(dir.join("2def.cif"), text.replacen("'X-RAY DIFFRACTION'", "'X-RAY DIFFRACTION", 1)).unwrap();
    let f = featurizer(&dir, "2030-01-01");
    let err = format!("{:#}", f.get_templates(&query(), &hits()).unwrap_err());
    assert!(err.contains("2def.cif") && err.contains("not closed") && err.contains("2def_B"), "{err}");
    // A loop with a value missing.
    let text = std::fs::read_to_string(dir.join("1abc.cif")).unwrap();
    std::fs::write(dir.join("2def.cif"), text.replacen("1 2015-06-01", "1", 1)).unwrap();
    let err = format!("{:#}", f.get_templates(&query(), &hits()).unwrap_err());
    assert!(err.contains("2def.cif") && err.contains("not a multiple"), "{err}");
    // A coordinate that parses but is not finite.
    std::fs::write(dir.join("2def.cif"), text.replacen("0.589 1.986", "nan 1.986", 1)).unwrap();
    let err = format!("{:#}", f.get_templates(&query(), &hits()).unwrap_err());
    assert!(err.contains("2def.cif") && err.contains("_atom_site.Cartn_x \"nan\" is not a finite number"), "{err}");
    // A missing entry.
    std::fs::remove_file(dir.join("2def.cif")).unwrap();
    let err = format!("{:#}", f.get_templates(&query(), &hits()).unwrap_err());
    assert!(err.contains("2def.cif"), "{err}");
}

#[test]
fn featurised_hits_become_the_models_template_features() {
    use fastfold::features::{process, FeatureConfig, RawFeatures, MAX_TEMPLATES};
    use fastfold::residue_constants::{aatype_of, atom_order};
    let e = expected();
    let result = featurizer(&fixture("mmcif"), e["max_template_date"].as_str().unwrap())
        .get_templates(&query(), &hits())
        .unwrap();
    let q = query();
    let raw = RawFeatures { templates: Some(result.hits.clone()), ..RawFeatures::new(&q, None).unwrap() };
    let config = FeatureConfig { max_msa_clusters: 4, max_extra_msa: 4, num_recycle: 1, ..FeatureConfig::default() };
    let f = process(&raw, &config, 0, tch::Device::Cpu).unwrap();
    let t = f.templates.expect("template features");
    let n = q.len() as i64;
    assert_eq!(t.aatype.size(), [2, MAX_TEMPLATES as i64, n]);
    assert_eq!(t.all_atom_positions.size(), [2, MAX_TEMPLATES as i64, n, 37, 3]);
    // Two hits, two padding slots.
    assert_eq!(Vec::<f32>::try_from(&t.mask.get(0)).unwrap(), [1.0, 1.0, 0.0, 0.0]);
    assert_eq!(t.all_atom_masks.get(0).narrow(0, 2, 2).sum(tch::Kind::Float).double_value(&[]), 0.0);
    let (ca, cb) = (atom_order("CA").unwrap(), atom_order("CB").unwrap());
    for (k, hit) in result.hits.iter().enumerate() {
        for (i, c) in hit.sequence.chars().enumerate() {
            let (k, ii) = (k as i64, i as i64);
            let expected = if c == '-' { 21 } else { aatype_of(c) as i64 };
            assert_eq!(t.aatype.int64_value(&[1, k, ii]), expected, "{} {i}", hit.domain_name);
            let atom = if c == 'G' { ca } else { cb };
            let beta = Vec::<f32>::try_from(&t.pseudo_beta.get(0).get(k).get(ii)).unwrap();
            assert_eq!(beta, hit.positions[i][atom], "{} {i}", hit.domain_name);
            assert_eq!(t.pseudo_beta_mask.double_value(&[0, k, ii]) as f32, hit.masks[i][atom]);
        }
    }
}

#[test]
fn hmmsearch_result_parses_and_featurises_as_alphafold_does() {
    let e = expected();
    let path = fixture("hmmsearch_hits.sto");
    let text = std::fs::read_to_string(&path).unwrap();
    let a3m = fastfold::search::stockholm::to_a3m(&text, &path, false).unwrap();
    let ours = fastfold::search::hmmsearch::parse(&a3m, &query(), &path).unwrap();
    check_hits(&ours, &e["hmmsearch"]);
    assert!(ours.iter().all(|h| h.sum_probs.is_none()));
    let date = e["max_template_date"].as_str().unwrap();
    let f = Featurizer { unique_sequences: true, ..featurizer(&fixture("mmcif"), date) };
    let result = f.get_templates(&query(), &ours).unwrap();
    check_against_alphafold(&result, &e["hmmsearch"], "expected_hmmsearch.npz");
    // A hit header that names no chain is an error naming the file.
    let bad = a3m.replacen("2def_B/1-32", "2def-B", 1);
    let err = fastfold::search::hmmsearch::parse(&bad, &query(), &path).unwrap_err().to_string();
    assert!(err.contains("hmmsearch_hits.sto") && err.contains("2def-B"), "{err}");
}

#[test]
fn uniref90_alignment_goes_to_hhsearch_as_alphafold_converts_it() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/search/uniref90_hits.sto");
    use fastfold::search::stockholm::{deduplicate, remove_empty_columns, to_a3m};
    let sto = deduplicate(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
    let cleaned = remove_empty_columns(&sto);
    assert_eq!(cleaned, expected()["uniref90_for_templates"].as_str().unwrap());
    let ours = to_a3m(&cleaned, &path, true).unwrap();
    assert_eq!(ours, expected()["uniref90_a3m"].as_str().unwrap());
}
