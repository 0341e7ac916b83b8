//! The search results' parsers and merge against AlphaFold's own: the Stockholm (jackhmmer)
//! and A3M (hhblits) fixtures under `fixtures/search/` as `parsers.parse_stockholm`,
//! `parsers.parse_a3m` and `parsers.truncate_stockholm_msa` read them, and the merged MSA
//! features as DeepMind's `make_msa_features` makes them (`expected.json`, written by
//! `fixtures/search/make_search_fixtures.py`). Malformed files are errors naming the file.
use std::path::{Path, PathBuf};

use data::a3m::Msa;
use fastfold::features::RawFeatures;
use fastfold::search::{msa, stockholm};
use serde_json::Value;
use tch::Tensor;

const QUERY: &str = "MKTAYIAKQRQISFVK";

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/search").join(name)
}

fn expected() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("expected.json")).unwrap()).unwrap()
}

fn read_sto(name: &str) -> Msa {
    let path = fixture(name);
    stockholm::parse(&std::fs::read_to_string(&path).unwrap(), &path).unwrap()
}

fn read_a3m(name: &str) -> Msa {
    data::a3m::read(&fixture(name)).unwrap()
}

/// AlphaFold's parse as an `Msa`, rows kept as listed.
fn as_msa(v: &Value) -> Msa {
    let strings = |k: &str| v[k].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_string()).collect();
    Msa {
        sequences: strings("sequences"),
        deletion_matrix: v["deletion_matrix"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as u32).collect())
            .collect(),
        descriptions: strings("descriptions"),
    }
}

#[test]
fn stockholm_parses_as_alphafold_does() {
    let e = expected();
    for (file, key) in [("uniref90_hits.sto", "uniref90"), ("mgnify_hits.sto", "mgnify")] {
        let ours = read_sto(file);
        assert_eq!(ours, as_msa(&e[key]), "{file}");
    }
    // The fixture has insertions in query-gap columns of two blocks, counted at the next
    // query column; a duplicate of the query row is kept (the merge drops it).
    let u = read_sto("uniref90_hits.sto");
    assert_eq!(u.sequences[0], QUERY);
    assert_eq!(u.deletion_matrix[1][4], 2);
    assert_eq!(u.len(), 5);
}

#[test]
fn stockholm_truncation_keeps_the_first_sequences_as_alphafold_does() {
    let e = &expected()["uniref90_truncated_3"];
    let text = std::fs::read_to_string(fixture("uniref90_hits.sto")).unwrap();
    let truncated = stockholm::truncate(&text, 3);
    assert_eq!(truncated, e["text"].as_str().unwrap());
    let parsed = stockholm::parse(&truncated, Path::new("truncated")).unwrap();
    assert_eq!(parsed, as_msa(e));
    assert_eq!(parsed.len(), 3);
}

#[test]
fn a3m_parses_as_alphafold_does_duplicates_aside() {
    // data::a3m drops a file's repeated rows as it reads (AlphaFold drops them in the merge);
    // the rows that remain are AlphaFold's, in order.
    let theirs = as_msa(&expected()["bfd"]);
    let mut seen = std::collections::HashSet::new();
    let keep: Vec<usize> = (0..theirs.len()).filter(|&i| seen.insert(theirs.sequences[i].clone())).collect();
    let pick = |v: &Vec<String>| keep.iter().map(|&i| v[i].clone()).collect::<Vec<_>>();
    let ours = read_a3m("bfd_uniref_hits.a3m");
    assert_eq!(ours.sequences, pick(&theirs.sequences));
    assert_eq!(ours.descriptions, pick(&theirs.descriptions));
    assert_eq!(ours.deletion_matrix, keep.iter().map(|&i| theirs.deletion_matrix[i].clone()).collect::<Vec<_>>());
    assert!(ours.len() < theirs.len(), "the fixture repeats a row");
}

#[test]
fn merged_msa_features_equal_alphafold_make_msa_features() {
    let e = &expected()["merged"];
    let (u, b, m) = (read_sto("uniref90_hits.sto"), read_a3m("bfd_uniref_hits.a3m"), read_sto("mgnify_hits.sto"));
    let merged = msa::merge(&[&u, &b, &m]);
    let raw = RawFeatures::new(QUERY, Some((&merged, Path::new("merged")))).unwrap();
    let ints = |v: &Value| -> Vec<Vec<i64>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|x| x.as_i64().unwrap()).collect())
            .collect()
    };
    assert_eq!(raw.num_alignments as i64, e["num_alignments"].as_i64().unwrap());
    assert_eq!(raw.msa, ints(&e["msa"]));
    let deletions: Vec<Vec<i64>> = raw.deletion_matrix.iter().map(|r| r.iter().map(|&d| d as i64).collect()).collect();
    assert_eq!(deletions, ints(&e["deletion_matrix_int"]));
    // Every database contributes and some rows repeat across them.
    assert!(raw.num_alignments > u.len() - 1 && raw.num_alignments < u.len() + b.len() + m.len());

    // features.npz holds AlphaFold's raw encoding (HHblits ids).
    let dir = suite_tests::scratch("fastfold", "search-parsers");
    let path = dir.join("features.npz");
    raw.save_npz(&path).unwrap();
    let saved: std::collections::HashMap<String, Tensor> = Tensor::read_npz(&path).unwrap().into_iter().collect();
    let msa: Vec<Vec<i64>> = Vec::<Vec<i64>>::try_from(&saved["msa"].to_kind(tch::Kind::Int64)).unwrap();
    assert_eq!(msa, ints(&e["msa_hhblits"]));
    assert_eq!(saved["aatype"].size(), vec![QUERY.len() as i64, 21]);
}

#[test]
fn malformed_stockholm_is_an_error_naming_the_file_and_line() {
    let path = Path::new("/results/uniref90_hits.sto");
    let err = stockholm::parse("# STOCKHOLM 1.0\nquery MKT A\n//\n", path).unwrap_err().to_string();
    assert!(err.contains("uniref90_hits.sto") && err.contains("line 2"), "{err}");
    let err = stockholm::parse("query MKTA\nhit MK-\n", path).unwrap_err().to_string();
    assert!(err.contains("\"hit\"") && err.contains("3 alignment columns"), "{err}");
    let err = stockholm::parse("# STOCKHOLM 1.0\n//\n", path).unwrap_err().to_string();
    assert!(err.contains("no aligned sequences"), "{err}");
    // Named here, with the file: the merged MSA of several files would no longer know it.
    let err = stockholm::parse("query MK-TA\nhit MK1TA\nbad MKT1A\n", path).unwrap_err().to_string();
    assert!(
        err.contains("uniref90_hits.sto") && err.contains("\"bad\", column 4: '1' is not an alignment code"),
        "{err}"
    );
}
