//! Training AlphaFold-Multimer on a data set of complexes (`--mmcif-dir`, `--alignment-dir`)
//! with the tiny Multimer parameters of `fixtures/multimer_network/model_params.npz`: three
//! synthetic entries (a heterodimer, a homodimer, one chain alone) are read as complexes (their
//! chains' alignments, UniProt rows paired across distinct chains, copies one entity, the truth
//! in the features' chain order); `fastfold train` trains on them, each step logging its entry,
//! and a second epoch's losses are below the first's; two data-parallel replicas train
//! different complexes, the step's mean equal to one process accumulating both; a chain's
//! template hits (hhsearch's, or hmmsearch's as predict featurises them) give its examples
//! templates; `--resume` repeats the uninterrupted run;
//! validation on held-out complexes (`--val-mmcif-dir`, `--val-alignment-dir`) gives the same
//! record every time, the training forward's loss and an lDDT-Cα computed here, and the same
//! record on 2 DAP ranks and on 2 replicas as in one process; OpenFold's chain data cache
//! selects and filters the complexes without parsing their entries, and trains them as the
//! files do; a chain without its folder, an entry without protein chains, a held-out folder
//! without complexes, a malformed chain data cache and what complexes do not support yet are
//! refused by name.
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser;
use engine::job::{OptimizerArgs, OptimizerKind};
use fastfold::loss::LossConfig;
use fastfold::model::multimer::{load_multimer_params, network_key, MultimerAlphaFold, MULTIMER_STRUCTURE_ITERATIONS};
use fastfold::model::Exec;
use fastfold::pdb::Structure;
use fastfold::train::{ComplexExample, TrainArgs, Trainer};
use fastfold::train_data::complexes::{load_complex, select_complexes, LoadedComplex};
use fastfold::train_data::layout::{read_chain_data_cache, Filters};
use fastfold::train_data::templates::{read_hits, TemplateSampling};
use fastfold::validation::{ValResult, Validation};
use tch::{Device, Tensor};

use common::layout::{check_drawn_as_predicted, hmmsearch_fixture, predict_hmmsearch_features};
use common::layout::{query_chain_layout, template_sampling, write_complexes, ComplexSpec, QUERY};
use common::{step_log, BIN};

const HETERO: &[(&str, &str)] = &[("A", "MKTAYIAKQR"), ("B", "GSWEDLKKLA")];
const HOMO: &[(&str, &str)] = &[("A", "MKVLHEGIRT"), ("B", "MKVLHEGIRT")];
const ONE: &[(&str, &str)] = &[("A", "MKTAYIAKQRQIS")];

/// The three complexes' data set under `dir`: (mmcif dir, alignment dir).
fn data_set(dir: &Path) -> (PathBuf, PathBuf) {
    let entries: [ComplexSpec; 3] =
        [("1het", "2010-01-01", HETERO), ("2hom", "2012-01-01", HOMO), ("3one", "2014-01-01", ONE)];
    write_complexes(dir, &entries)
}

fn tiny_multimer() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/multimer_network/model_params.npz")
}

/// `fastfold train` on the data set with the tiny Multimer parameters into `out` with `flags`:
/// (success, output).
fn train(mmcif: &Path, alignments: &Path, out: &Path, flags: &[&str]) -> (bool, String) {
    let path = |p: &Path| p.display().to_string();
    let o = Command::new(BIN)
        .arg("train")
        .args(["--mmcif-dir".into(), path(mmcif), "--alignment-dir".into(), path(alignments)])
        .args(["--params".into(), path(&tiny_multimer()), "-o".into(), path(out)])
        .args(["--model-preset", "multimer", "--warmup", "0", "--max-recycles", "0", "--chain-sampling", "uniform"])
        .args(flags)
        .output()
        .unwrap();
    (o.status.success(), format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr)))
}

/// The data set's complexes as read: the heterodimer's 20 residues are two chains of two
/// entities with the UniProt rows paired (the query and HUMAN, MOUSE and YEAST rows across both
/// chains, then each chain's own hits), the homodimer one entity of two copies, the lone chain
/// a complex of one; the truth has the entry's atoms in the features' order (chain B 8 Å
/// from A, as written).
#[test]
fn entries_are_read_as_complexes_of_their_protein_chains() {
    let dir = common::scratch("train_complex_data", "read");
    let (mmcif, alignments) = data_set(&dir);
    let selection = select_complexes(&mmcif, &alignments, &Filters::default()).unwrap();
    let names: Vec<&str> = selection.chains.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["1het", "2hom", "3one"]);
    assert_eq!(selection.chains.iter().map(|e| e.length).collect::<Vec<_>>(), [20, 20, 13]);
    let ids = |name: &str, entry: usize| {
        let (features, truth, resolution) = load_complex(&selection.chains[entry], None).unwrap();
        let get = |n: &str| features.get(n).unwrap().tensor();
        let vec = |n: &str| Vec::<i64>::try_from(get(n).to_kind(tch::Kind::Int64)).unwrap();
        assert_eq!(resolution, 2.0, "{name}");
        assert_eq!(truth.aatype.len(), vec("aatype").len(), "{name}");
        (vec("asym_id"), vec("entity_id"), vec("sym_id"), get("msa_mask"), truth)
    };
    let (asym, entity, _, msa_mask, truth) = ids("1het", 0);
    assert_eq!((asym[9], asym[10], entity[9], entity[10]), (1, 2, 1, 2));
    // Rows with a residue: the query and 3 species' rows paired, then each chain's 6 own rows
    // (its query dropped as already paired).
    let rows = msa_mask.sum_dim_intlist(1, false, tch::Kind::Float).gt(0.0).sum(tch::Kind::Int64).int64_value(&[]);
    assert_eq!(rows, 4 + 2 * 6, "heterodimer MSA rows");
    let z = |k: usize| truth.positions[k][1][2];
    assert!((z(10) - z(0) - 8.0).abs() < 1e-3, "chain B's CA 8 Å from A's: {} {}", z(10), z(0));
    let (asym, entity, sym, _, _) = ids("2hom", 1);
    assert_eq!((asym[0], asym[19], entity[19], sym[0], sym[19]), (1, 2, 1, 1, 2));
    let (asym, _, _, _, _) = ids("3one", 2);
    assert!(asym.iter().all(|&a| a == 1) && asym.len() == 13);
}

/// `fastfold train` on the data set, 6 steps (two epochs of the three complexes, uniform
/// sampling): every step logs its entry and chains and finite terms, each epoch visits every
/// entry once, and the second epoch's losses sum below the first's.
#[test]
fn a_data_set_of_complexes_trains_and_logs_each_entry() {
    let dir = common::scratch("train_complex_data", "train");
    let (mmcif, alignments) = data_set(&dir);
    let out = dir.join("out");
    let (ok, text) = train(&mmcif, &alignments, &out, &["--steps", "6", "--lr", "3e-3"]);
    assert!(ok, "{text}");
    assert!(text.contains("3 training complexes"), "{text}");
    let log = step_log(&out);
    assert_eq!(log.len(), 6);
    let examples: Vec<String> = log.iter().map(|s| s["example"].as_str().unwrap().to_string()).collect();
    let loss: Vec<f64> = log.iter().map(|s| s["loss"].as_f64().unwrap()).collect();
    eprintln!("examples {examples:?}\nlosses {loss:?}");
    for s in &log {
        for term in ["loss", "fape", "distogram", "masked_msa", "plddt"] {
            assert!(s[term].as_f64().is_some_and(f64::is_finite), "step {}: {term} {}", s["step"], s[term]);
        }
    }
    for epoch in examples.chunks(3) {
        let mut e = epoch.to_vec();
        e.sort();
        assert_eq!(e, ["1het A+B", "2hom A+B", "3one A"], "an epoch visits every entry once");
    }
    let by_entry = |range: std::ops::Range<usize>| -> f64 {
        let mut pairs: Vec<(&String, f64)> = range.map(|i| (&examples[i], loss[i])).collect();
        pairs.sort_by(|a, b| a.0.cmp(b.0));
        pairs.iter().map(|p| p.1).sum()
    };
    let (first, second) = (by_entry(0..3), by_entry(3..6));
    assert!(second < first, "the second epoch's losses ({second}) are not below the first's ({first})");
}

/// One step over 2 data-parallel replicas (`--nproc 2 --dap 1`) trains the stream's first two
/// complexes, one each (rank 0's the first, as one process accumulating both trains them in
/// that order, two different entries), and its mean loss is within 1e-5 of one process's
/// accumulating both (`--accumulation 2`), its gradient norm within 1e-4; examples cropped to
/// 16 residues (`--crop-size`), each replica its own crop.
#[test]
fn replicas_train_different_complexes_and_match_one_process() {
    let dir = common::scratch("train_complex_data", "replicas");
    let (mmcif, alignments) = data_set(&dir);
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let flags = [&["--steps", "1", "--crop-size", "16", "--quiet"][..], extra].concat();
        let (ok, text) = train(&mmcif, &alignments, &out, &flags);
        assert!(ok, "{name}: {text}");
        let log = step_log(&out);
        assert_eq!(log.len(), 1, "{name}: {log:?}");
        let value = |field: &str| log[0][field].as_f64().unwrap_or_else(|| panic!("{name}: no {field} in {log:?}"));
        (value("loss"), value("grad_norm"), log[0]["example"].as_str().unwrap().to_string())
    };
    let (loss, norm, examples) = run("one", &["--accumulation", "2"]);
    let (l, n, example) = run("replicas", &["--nproc", "2", "--dap", "1"]);
    eprintln!("one process {examples:?}: loss {loss}, norm {norm}; replicas (rank 0 {example:?}): loss {l}, norm {n}");
    let both: Vec<&str> = examples.split("; ").collect();
    assert_eq!(both.len(), 2, "{examples}");
    let entry = |e: &str| e.split(' ').next().unwrap().to_string();
    assert_ne!(entry(both[0]), entry(both[1]), "one step's two examples are different complexes");
    assert_eq!(example, both[0], "rank 0 trains the stream's first example");
    assert!(loss.is_finite() && norm.is_finite() && norm > 0.0, "loss {loss}, gradient norm {norm}");
    assert!((l - loss).abs() <= 1e-5 * loss.abs(), "replicas' mean loss {l}, one process {loss}");
    assert!((n - norm).abs() <= 1e-4 * norm, "replicas' gradient norm {n}, one process {norm}");
}

/// A protein chain without its alignment folder, a folder with only the UniProt hits, and an
/// entry without protein chains are refused naming the entry, the chain and the folder; the
/// command refuses a held-out alignment folder without complexes naming the flag and the
/// folder, and a malformed chain data cache naming the file.
#[test]
fn bad_complex_data_is_refused_by_name() {
    let dir = common::scratch("train_complex_data", "refused");
    let (mmcif, alignments) = data_set(&dir);
    let err = |alignments: &Path| match select_complexes(&mmcif, alignments, &Filters::default()) {
        Ok(s) => panic!("selected {:?}", s.chains.iter().map(|e| &e.name).collect::<Vec<_>>()),
        Err(e) => format!("{e:#}"),
    };
    let folder = alignments.join("1het_B");
    let moved = dir.join("1het_B");
    std::fs::rename(&folder, &moved).unwrap();
    let e = err(&alignments);
    for expect in ["entry 1het", "chain B", &folder.display().to_string()] {
        assert!(e.contains(expect), "no {expect:?} in: {e}");
    }
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::copy(moved.join("uniprot_hits.sto"), folder.join("uniprot_hits.sto")).unwrap();
    let e = err(&alignments);
    assert!(e.contains("entry 1het, chain B") && e.contains("no .a3m or .sto"), "{e}");
    std::fs::remove_dir_all(&folder).unwrap();
    std::fs::rename(&moved, &folder).unwrap();

    // An RNA entry: a polymer, no protein chain.
    let cols = ["group_PDB", "id", "type_symbol", "label_atom_id", "label_comp_id", "label_asym_id"];
    let cols =
        [&cols[..], &["label_entity_id", "label_seq_id", "Cartn_x", "Cartn_y", "Cartn_z", "auth_asym_id"]].concat();
    let atoms: String = cols.iter().map(|c| format!("_atom_site.{c}\n")).collect();
    let empty = format!(
        "data_4NOP\n_entry.id 4NOP\nloop_\n_chem_comp.id\n_chem_comp.type\nA 'RNA linking'\nloop_\n\
         _entity_poly_seq.entity_id\n_entity_poly_seq.num\n_entity_poly_seq.mon_id\n1 1 A\n1 2 A\nloop_\n\
         _struct_asym.id\n_struct_asym.entity_id\nA 1\nloop_\n{atoms}ATOM 1 P P A A 1 1 0.0 0.0 0.0 A\n"
    );
    std::fs::write(mmcif.join("4nop.cif"), empty).unwrap();
    std::fs::create_dir_all(alignments.join("4nop_A")).unwrap();
    let e = err(&alignments);
    assert!(e.contains("entry 4nop") && e.contains("no protein chains"), "{e}");
    std::fs::remove_dir_all(alignments.join("4nop_A")).unwrap();

    let out = dir.join("out");
    let refused = |flags: &[&str], expect: &[&str]| {
        let (ok, text) = train(&mmcif, &alignments, &out, flags);
        assert!(!ok, "trained: {text}");
        for e in expect {
            assert!(text.contains(e), "no {e:?} in: {text}");
        }
    };
    let m = mmcif.display().to_string();
    // Held-out folders: one without chain folders, then a held-out set whose chain lacks its
    // folder (training's set is whole).
    let empty = dir.join("no_alignments");
    std::fs::create_dir_all(&empty).unwrap();
    let e = empty.display().to_string();
    refused(
        &["--val-mmcif-dir", &m, "--val-alignment-dir", &e],
        &["no validation complexes in --val-alignment-dir", &e, "no chain folders"],
    );
    let (held_mmcif, held_alignments) = data_set(&dir.join("held_out"));
    let folder = held_alignments.join("1het_B");
    std::fs::remove_dir_all(&folder).unwrap();
    let (hm, ha) = (held_mmcif.display().to_string(), held_alignments.display().to_string());
    let f = folder.display().to_string();
    refused(
        &["--val-mmcif-dir", &hm, "--val-alignment-dir", &ha],
        &["entry 1het", "chain B", &f, "--val-alignment-dir"],
    );
    let cache = dir.join("cache.json");
    std::fs::write(&cache, r#"{"1het_A": {"release_date": "2010-01-01", "seq": 5}}"#).unwrap();
    let named = cache.display().to_string();
    refused(&["--chain-data-cache", &named], &["--chain-data-cache", &named, "not OpenFold's chain data cache"]);
    assert!(!out.join("params.npz").exists(), "parameters written");
}

/// An entry of a chain data cache: (pdb, release date, resolution, (chain, SEQRES) chains).
type Cached<'a> = (&'a str, &'a str, f64, &'a [(&'a str, &'a str)]);

/// OpenFold's chain data cache for the data set's chains (`entries`), written to `path`; every
/// chain in a cluster of `cluster_size`.
fn write_cache(path: &Path, entries: &[Cached], cluster_size: usize) {
    let mut cache = serde_json::Map::new();
    for (pdb, date, resolution, chains) in entries {
        for (chain, seq) in chains.iter() {
            let record = serde_json::json!({
                "release_date": date, "seq": seq, "resolution": resolution, "cluster_size": cluster_size,
                "oligomeric_count": 2
            });
            cache.insert(format!("{pdb}_{chain}"), record);
        }
    }
    std::fs::write(path, serde_json::Value::Object(cache).to_string()).unwrap();
}

/// The data set's three entries in a chain data cache, at 2 Å.
const CACHED: [Cached; 3] =
    [("1het", "2010-01-01", 2.0, HETERO), ("2hom", "2012-01-01", 2.0, HOMO), ("3one", "2014-01-01", 2.0, ONE)];

/// With a chain data cache the complexes are selected from it without parsing an entry: the
/// cache of all three selects them as the files do (the same chains, the same features bit for
/// bit), with the lone chain's mmCIF file unreadable it still selects it; a cache that lacks
/// the lone chain's entry and gives the homodimer 12 Å leaves both out (counted per reason;
/// `--max-release-date` and the length filters read it too); a cache that lacks one chain
/// of an entry leaves the entry out, or, with a `--train-list` of the chains it has, its
/// example is refused naming the chain the file has and the cache lacks.
#[test]
fn a_chain_data_cache_selects_complexes_without_parsing_them() {
    let dir = common::scratch("train_complex_data", "cache");
    let (mmcif, alignments) = data_set(&dir);
    let select = |cache: &Path, train_list: Option<Vec<String>>, extra: Filters| {
        let chain_data = Some(read_chain_data_cache(cache).unwrap());
        select_complexes(&mmcif, &alignments, &Filters { chain_data, train_list, ..extra })
    };
    let names = |s: &fastfold::train_data::complexes::ComplexSelection| {
        s.chains.iter().map(|e| e.name.clone()).collect::<Vec<_>>()
    };
    let full = dir.join("full.json");
    write_cache(&full, &CACHED, 3);
    let files = select_complexes(&mmcif, &alignments, &Filters::default()).unwrap();
    let cached = select(&full, None, Filters::default()).unwrap();
    assert_eq!(names(&cached), ["1het", "2hom", "3one"]);
    assert!(cached.excluded.is_empty(), "{:?}", cached.excluded);
    for (a, b) in files.chains.iter().zip(&cached.chains) {
        assert_eq!((a.length, &a.mmcif), (b.length, &b.mmcif), "{}", a.name);
        let chains = |e: &fastfold::train_data::complexes::ComplexEntry| {
            e.chains.iter().map(|c| (c.chain.clone(), c.msas.clone(), c.uniprot.clone())).collect::<Vec<_>>()
        };
        assert_eq!(chains(a), chains(b), "{}", a.name);
        assert!(b.chains.iter().all(|c| c.cluster_size == Some(3)), "{}: cluster sizes from the cache", b.name);
        let ((fa, ta, ra), (fb, tb, rb)) = (load_complex(a, None).unwrap(), load_complex(b, None).unwrap());
        assert_eq!((ta.aatype, ra), (tb.aatype, rb), "{}", a.name);
        assert!(fa == fb, "{}: the features differ", a.name);
    }

    // Nothing filtered out by the cache is parsed: an unreadable entry of it still selects.
    let one = mmcif.join("3one.cif");
    let text = std::fs::read_to_string(&one).unwrap();
    std::fs::write(&one, "not an mmCIF file").unwrap();
    assert!(select_complexes(&mmcif, &alignments, &Filters::default()).is_err(), "the files are parsed");
    assert_eq!(names(&select(&full, None, Filters::default()).unwrap()), ["1het", "2hom", "3one"]);
    std::fs::write(&one, text).unwrap();

    let partial = dir.join("partial.json");
    write_cache(&partial, &[CACHED[0], ("2hom", "2012-01-01", 12.0, HOMO)], 1);
    let s = select(&partial, None, Filters::default()).unwrap();
    assert_eq!(names(&s), ["1het"]);
    let mut excluded = s.excluded.clone();
    excluded.sort();
    let want = [("not in --chain-data-cache".to_string(), 1), ("resolution above --max-resolution".to_string(), 1)];
    assert_eq!(excluded, want);
    let dated = Filters { max_release_date: Some("2011-01-01".into()), max_resolution: 20.0, ..Filters::default() };
    let s = select(&partial, None, dated).unwrap();
    assert_eq!(
        (names(&s), s.excluded),
        (
            vec!["1het".to_string()],
            vec![("released after --max-release-date".into(), 1), ("not in --chain-data-cache".into(), 1)]
        )
    );
    let long = Filters { min_length: 21, ..Filters::default() };
    let e = format!("{:#}", select(&full, None, long).unwrap_err());
    assert!(e.contains("3 shorter than --min-length"), "the complexes' 20, 20 and 13 residues: {e}");

    // A cache without chain B of 1het: the entry is left out, unless the list names only A;
    // then its example is refused, the file having B.
    let lone = dir.join("lone.json");
    write_cache(&lone, &[("1het", "2010-01-01", 2.0, &HETERO[..1]), CACHED[1], CACHED[2]], 1);
    let s = select(&lone, None, Filters::default()).unwrap();
    assert_eq!(
        (names(&s), s.excluded),
        (vec!["2hom".to_string(), "3one".into()], vec![("not in --chain-data-cache".into(), 1)])
    );
    let s = select(&lone, Some(vec!["1het_A".into()]), Filters::default()).unwrap();
    assert_eq!(names(&s), ["1het"]);
    let e = format!("{:#}", load_complex(&s.chains[0], None).unwrap_err());
    for expect in ["entry 1het", "protein chain B", "--chain-data-cache"] {
        assert!(e.contains(expect), "no {expect:?} in: {e}");
    }
}

/// `fastfold train --chain-data-cache`: with the cache of all three entries 3 steps train the
/// same examples to the same losses and gradient norms, bit for bit, as without it; with a
/// cache that lacks the lone chain's entry and gives the homodimer 12 Å, the command says
/// 1 complex trains and why 2 are left out, and only the heterodimer trains.
#[test]
fn training_with_a_chain_data_cache_trains_its_complexes() {
    let dir = common::scratch("train_complex_data", "cache_train");
    let (mmcif, alignments) = data_set(&dir);
    let run = |name: &str, flags: &[&str]| {
        let out = dir.join(name);
        let (ok, text) = train(&mmcif, &alignments, &out, &[&["--lr", "3e-3"][..], flags].concat());
        assert!(ok, "{name}: {text}");
        (text, step_log(&out))
    };
    let full = dir.join("full.json");
    write_cache(&full, &CACHED, 1);
    let (_, files) = run("files", &["--steps", "3"]);
    let (text, cached) = run("cached", &["--steps", "3", "--chain-data-cache", full.to_str().unwrap()]);
    assert!(text.contains("3 training complexes") && !text.contains("left out"), "{text}");
    assert_eq!(cached.len(), 3);
    for (a, b) in files.iter().zip(&cached) {
        for field in ["example", "loss", "fape", "grad_norm"] {
            assert_eq!(a[field], b[field], "step {}: {field}", a["step"]);
        }
    }
    let partial = dir.join("partial.json");
    write_cache(&partial, &[CACHED[0], ("2hom", "2012-01-01", 12.0, HOMO)], 1);
    let (text, log) = run("partial", &["--steps", "2", "--chain-data-cache", partial.to_str().unwrap()]);
    for expect in ["1 training complexes", "1 not in --chain-data-cache", "1 resolution above --max-resolution"] {
        assert!(text.contains(expect), "no {expect:?} in: {text}");
    }
    assert_eq!(log.len(), 2);
    for s in &log {
        assert_eq!(s["example"].as_str(), Some("1het A+B"), "{s}");
        assert!(s["loss"].as_f64().is_some_and(f64::is_finite), "{s}");
    }
}

/// A chain with template hits (the template fixtures' 40-residue query, entry 9qry, its
/// folder's `pdb70_hits.hhr`; the usable hits 1abc_A and 2def_B) as a complex of one chain:
/// with template sampling each example's features hold 0 to 2 templates drawn by its number
/// (the same again for the same number, at least one over 8 examples), without it none; and
/// `fastfold train` (templates on by default) trains 2 steps on it, every term finite.
#[test]
fn a_chains_template_hits_give_its_complex_templates() {
    let dir = common::scratch("train_complex_data", "templates");
    let (mmcif, alignments) = query_chain_layout(&dir);
    let entry = select_complexes(&mmcif, &alignments, &Filters::default()).unwrap().chains.remove(0);
    assert_eq!(entry.name, "9qry");
    assert_eq!(entry.chains[0].templates, [alignments.join("9qry_A/pdb70_hits.hhr")]);
    let sampling = template_sampling(&mmcif);
    // Templates with an observed atom, and their masks.
    let templates = |draw: Option<(&TemplateSampling, u64, u64)>| {
        let (features, _, _) = load_complex(&entry, draw).unwrap();
        let Some(mask) = features.get("template_all_atom_mask").map(|a| a.tensor()) else { return (0, None) };
        let t = mask.size()[0];
        let real = mask.view([t, -1]).sum_dim_intlist(1, false, tch::Kind::Float).gt(0.0);
        (real.sum(tch::Kind::Int64).int64_value(&[]), Some(mask))
    };
    assert_eq!(templates(None).0, 0, "no templates without sampling");
    let mut counts = std::collections::BTreeSet::new();
    for number in 1..=8 {
        let (n, mask) = templates(Some((&sampling, 0, number)));
        let (again, mask_again) = templates(Some((&sampling, 0, number)));
        assert_eq!(n, again, "example {number} draws the same templates");
        assert!(mask.zip(mask_again).is_none_or(|(a, b)| a.equal(&b)), "example {number}: masks differ");
        counts.insert(n);
    }
    eprintln!("templates per example: {counts:?}");
    assert!(counts.iter().all(|&n| n <= 2) && counts.iter().any(|&n| n >= 1), "{counts:?}");

    let out = dir.join("out");
    let (ok, text) = train(&mmcif, &alignments, &out, &["--steps", "2", "--lr", "3e-3"]);
    assert!(ok, "{text}");
    let log = step_log(&out);
    assert_eq!(log.len(), 2);
    for s in &log {
        assert_eq!(s["example"].as_str(), Some("9qry A"));
        assert!(s["loss"].as_f64().is_some_and(f64::is_finite), "{s}");
    }
}

/// The template fixtures' query as an entry of one chain (9qry, released 2021-06-01) whose
/// folder holds hmmsearch's hits as OpenFold names them (`hmm_output.sto`, the fixtures'
/// hmmsearch result) beside its `pdb70_hits.hhr`: the `.sto` is its template hits, not an MSA,
/// and over examples 1-8 every drawn hit is predict's featurisation of the same hit with the
/// entry's date limit (60 days before its release: 3ghi_A, released 2021-05-01, is dropped),
/// in the template slot it was drawn to, bit for bit; the same number draws the same.
#[test]
fn a_chains_hmmsearch_hits_give_its_complex_templates() {
    let dir = common::scratch("train_complex_data", "hmmsearch");
    let (mmcif, alignments) = query_chain_layout(&dir);
    let sto = alignments.join("9qry_A/hmm_output.sto");
    std::fs::copy(hmmsearch_fixture(), &sto).unwrap();
    let entry = select_complexes(&mmcif, &alignments, &Filters::default()).unwrap().chains.remove(0);
    assert_eq!(entry.chains[0].templates, std::slice::from_ref(&sto), "hmmsearch's hits, not the .hhr");
    assert_eq!(entry.chains[0].msas, [alignments.join("9qry_A/bfd_uniclust_hits.a3m")], "the .sto is no MSA");
    let sampling = template_sampling(&mmcif);
    let predicted = predict_hmmsearch_features(&sto, QUERY, &mmcif, "2021-04-02");
    let hits = read_hits(std::slice::from_ref(&sto), QUERY, "9qry", Some("2021-06-01".into())).unwrap();
    let mut draws = Vec::new();
    for number in 1..=8 {
        let drawn = sampling.draw(QUERY, &hits, (0, number, 0)).unwrap();
        let (features, _, _) = load_complex(&entry, Some((&sampling, 0, number))).unwrap();
        let tensor = |name: &str| features.get(name).map(|a| a.tensor()).unwrap();
        let n = QUERY.len() as i64;
        let positions = tensor("template_all_atom_positions").view([-1, n, 37, 3]);
        let masks = tensor("template_all_atom_mask").view([-1, n, 37]);
        let names = check_drawn_as_predicted(&drawn, &predicted, Some((&positions, &masks)), 0);
        let (again, _, _) = load_complex(&entry, Some((&sampling, 0, number))).unwrap();
        assert!(again.get("template_all_atom_positions").unwrap().tensor().view([-1, n, 37, 3]).equal(&positions));
        draws.push(names);
    }
    eprintln!(
        "predict's hits {:?}; drawn per example {draws:?}",
        predicted.iter().map(|h| &h.domain_name).collect::<Vec<_>>()
    );
    assert!(draws.iter().flatten().all(|name| name != "3ghi_A"), "a hit released too late drawn: {draws:?}");
    assert!(draws.iter().any(|d| !d.is_empty()), "no template drawn: {draws:?}");
}

/// `--resume` on the data set of complexes: 2 steps, then 2 more from the checkpoint, train
/// the 4 steps' examples (cropped to 16) to the same logged examples, losses, gradient norms
/// and learning rates, and the same weights, bit for bit, as the uninterrupted run: the
/// loader starts at the resumed step's examples.
#[test]
fn a_resumed_complex_data_run_repeats_the_uninterrupted_one() {
    let dir = common::scratch("train_complex_data", "resume");
    let (mmcif, alignments) = data_set(&dir);
    let run = |out: &Path, extra: &[&str]| {
        let flags = [&["--crop-size", "16", "--save-every", "2", "--lr", "3e-3", "--quiet"][..], extra].concat();
        let (ok, text) = train(&mmcif, &alignments, out, &flags);
        assert!(ok, "{text}");
        step_log(out)
    };
    let straight = run(&dir.join("straight"), &["--steps", "4"]);
    let parted = dir.join("parted");
    run(&parted, &["--steps", "2"]);
    let resumed = run(&parted, &["--steps", "4", "--resume"]);
    assert_eq!(resumed.len(), 4);
    for (a, b) in straight.iter().zip(&resumed) {
        for field in ["step", "example", "recycles", "loss", "grad_norm", "lr"] {
            assert_eq!(a[field], b[field], "step {}: {field}", a["step"]);
        }
    }
    let load = |p: PathBuf| fastfold::model::multimer::load_multimer_params(&p).unwrap();
    let (a, b) = (load(dir.join("straight/params-raw.npz")), load(parted.join("params-raw.npz")));
    for ((name, x), (_, y)) in a.iter().zip(b.iter()) {
        assert!(x.equal(y), "{name}: the resumed run's weights differ");
    }
}

/// `fastfold train`'s flags, parsed as the command parses them.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    train: TrainArgs,
}

/// Seed of the validation tests' runs.
const SEED: u64 = 3;
/// Recycling passes before the evaluated one in the validation tests.
const RECYCLES: usize = 1;

/// The data set's complexes as held-out complexes (`--val-mmcif-dir`, `--val-alignment-dir`
/// the same folders), cropped to `crop` residues when given.
fn held_out(mmcif: &Path, alignments: &Path, crop: Option<usize>) -> Validation {
    let (m, a) = (mmcif.display().to_string(), alignments.display().to_string());
    let params = tiny_multimer().display().to_string();
    let mut words = vec!["train", "--mmcif-dir", &m, "--alignment-dir", &a, "--params", &params, "-o", "unused"];
    words.extend(["--val-mmcif-dir", &m, "--val-alignment-dir", &a, "--val-recycles", "1"]);
    let crop = crop.map(|c| c.to_string());
    if let Some(c) = &crop {
        words.extend(["--val-crop-size", c]);
    }
    let args = Cli::try_parse_from(words).unwrap().train;
    Validation::open_complexes(&args.val, &args.data, SEED, Device::Cpu).unwrap().expect("a validation set")
}

/// A trainer of the tiny Multimer parameters under [`SEED`] (no step taken).
fn trainer() -> Trainer {
    let params = load_multimer_params(&tiny_multimer()).unwrap();
    let adam = OptimizerArgs {
        optimizer: OptimizerKind::Adamw,
        lr: 1e-3,
        weight_decay: 0.0,
        clip_grad: None,
        adam_epsilon: None,
    };
    Trainer::new(&params, Device::Cpu, &adam).unwrap().with_loss(LossConfig::initial_training(), SEED)
}

/// lDDT-Cα (15 Å, AlphaFold's global form: the share of the 0.5/1/2/4 Å tests passed over every
/// ordered pair of distinct resolved residues within 15 Å in the truth), written out here
/// rather than taken from the library: `predicted` [N, 37, 3], the truth's Cα in `order`.
fn lddt_by_hand(predicted: &Tensor, truth: &Structure, order: &[usize]) -> f64 {
    let p: Vec<f64> = Vec::try_from(predicted.select(1, 1).to_kind(tch::Kind::Double).reshape([-1])).unwrap();
    let n = order.len();
    let pred = |i: usize| [p[3 * i], p[3 * i + 1], p[3 * i + 2]];
    let real = |i: usize| truth.positions[order[i]][1].map(f64::from);
    let resolved = |i: usize| truth.mask[order[i]][1] > 0.5;
    let dist =
        |a: [f64; 3], b: [f64; 3]| ((a[0] - b[0]).powi(2) + (a[1] - b[1]).powi(2) + (a[2] - b[2]).powi(2)).sqrt();
    let (mut scored, mut passed) = (0.0, 0.0);
    for i in 0..n {
        for j in 0..n {
            let d = dist(real(i), real(j));
            if i == j || !resolved(i) || !resolved(j) || d >= 15.0 {
                continue;
            }
            let error = (d - dist(pred(i), pred(j))).abs();
            scored += 1.0;
            passed += [0.5, 1.0, 2.0, 4.0].iter().filter(|&&t| error < t).count() as f64 / 4.0;
        }
    }
    passed / scored
}

/// Validating the three complexes (whole, 1 recycle) twice with the same weights gives the same
/// record, bit for bit; its loss is the mean of what the training forward
/// (`Trainer::accumulate_complex`, the same seed and example numbers 1, 2, 3) gives each
/// complex (within 1e-5 relative), and its lDDT-Cα the mean of an lDDT computed here from the
/// network's own forward (within 1e-5; the homodimer's copies against the truth in either
/// order, whichever the chain permutation alignment chose). Cropped to 16 residues
/// (`--val-crop-size`) the 20-residue complexes give another loss, equal to the training
/// forward's on each one's crop for that number (within 1e-5 relative).
#[test]
fn validating_complexes_repeats_and_equals_the_training_forward() {
    let dir = common::scratch("train_complex_data", "validate");
    let (mmcif, alignments) = data_set(&dir);
    let whole = held_out(&mmcif, &alignments, None);
    assert_eq!((whole.len(), whole.what()), (3, "complexes"));
    let (evaluator, exec) = (trainer(), Exec::serial());
    let validate = |v: &Validation| -> ValResult { v.run(|e| evaluator.evaluate(e, &exec)).unwrap() };
    let record = validate(&whole);
    eprintln!("whole complexes: {record:?}");
    assert_eq!(record, validate(&whole), "the same weights, another record");
    assert_eq!(record.val_chains, 3);
    assert!(record.val_lddt_ca > 0.0 && record.val_lddt_ca <= 1.0, "lDDT-Ca {}", record.val_lddt_ca);

    // The training forward on each complex, as example number (place + 1) of the same seed.
    let entries = select_complexes(&mmcif, &alignments, &Filters::default()).unwrap().chains;
    let net =
        MultimerAlphaFold::from_params(&load_multimer_params(&tiny_multimer()).unwrap(), MULTIMER_STRUCTURE_ITERATIONS)
            .unwrap();
    let mut training = trainer();
    let mut train_loss = |crop: Option<usize>| -> (Vec<f64>, Vec<[f64; 2]>) {
        let (mut losses, mut lddts) = (Vec::new(), Vec::new());
        for (i, entry) in entries.iter().enumerate() {
            let number = i as u64 + 1;
            let complex =
                LoadedComplex::read(entry, None, number, RECYCLES).unwrap().training(crop, Device::Cpu).unwrap();
            let cropped = complex.cropped(SEED, number).unwrap();
            let (features, target) = match &cropped {
                Some((features, target, _)) => (features, target),
                None => (&complex.inputs, &complex.target),
            };
            training.begin_step(1).unwrap();
            let e = ComplexExample { features, target, recycles: RECYCLES, number };
            losses.push(training.accumulate_complex(&e, &exec).unwrap().terms.loss);
            if crop.is_none() {
                let key = network_key(SEED).fold_in(number as u32);
                let (pass, _) = tch::no_grad(|| net.train_forward(features, RECYCLES, key, &exec)).unwrap();
                let n = complex.truth.aatype.len();
                let in_order: Vec<usize> = (0..n).collect();
                // The homodimer's copies swapped (the other entries' are kept: one entity each).
                let swapped: Vec<usize> = match entry.name.as_str() {
                    "2hom" => (n / 2..n).chain(0..n / 2).collect(),
                    _ => in_order.clone(),
                };
                let atom37 = &pass.structure.atom37;
                lddts.push([
                    lddt_by_hand(atom37, &complex.truth, &in_order),
                    lddt_by_hand(atom37, &complex.truth, &swapped),
                ]);
            }
        }
        (losses, lddts)
    };
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let (losses, lddts) = train_loss(None);
    eprintln!("training forward: losses {losses:?}, lDDT-Ca by hand {lddts:?}");
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-5 * b.abs().max(1.0);
    assert!(
        close(record.val_loss, mean(&losses)),
        "validation loss {}, training forward {}",
        record.val_loss,
        mean(&losses)
    );
    let candidates: Vec<f64> = [0, 1].iter().map(|&h| mean(&[lddts[0][0], lddts[1][h], lddts[2][0]])).collect();
    assert!(
        candidates.iter().any(|&l| close(record.val_lddt_ca, l)),
        "validation lDDT-Ca {}, by hand {candidates:?}",
        record.val_lddt_ca
    );

    let cropped = held_out(&mmcif, &alignments, Some(16));
    let crop_record = validate(&cropped);
    eprintln!("cropped to 16: {crop_record:?}");
    assert_ne!(crop_record.val_loss, record.val_loss, "cropping changed nothing");
    let (losses, _) = train_loss(Some(16));
    let want = mean(&losses);
    eprintln!("training forward on the crops: losses {losses:?}, mean {want}");
    assert!(
        close(crop_record.val_loss, want),
        "cropped validation loss {}, training forward {want}",
        crop_record.val_loss
    );
}

/// `fastfold train` on the data set with the same complexes held out (`--val-every 1`, 1
/// recycle, cropped to 16): rank 0 says how many, every step's record holds the validation
/// (3 complexes, lDDT-Cα in [0, 1], every term finite) and rank 0 prints it; 2 DAP ranks
/// (`--nproc 2`) log the same records as one process, and 2 replicas (`--nproc 2 --dap 1`)
/// as one process accumulating both examples (`--accumulation 2`), each value within 1e-4
/// relative (1e-4 absolute below 1).
#[test]
fn a_data_set_of_complexes_validates_on_one_rank_and_two() {
    let dir = common::scratch("train_complex_data", "validation");
    let (mmcif, alignments) = data_set(&dir);
    let (m, a) = (mmcif.display().to_string(), alignments.display().to_string());
    let run = |name: &str, extra: &[&str]| {
        let out = dir.join(name);
        let flags = ["--lr", "3e-3", "--crop-size", "16", "--val-every", "1", "--val-recycles", "1"];
        let held_out = ["--val-crop-size", "16", "--val-mmcif-dir", &m, "--val-alignment-dir", &a];
        let (ok, text) = train(&mmcif, &alignments, &out, &[&flags[..], &held_out, extra].concat());
        assert!(ok, "{name}: {text}");
        (step_log(&out), text)
    };
    let terms = ["val_lddt_ca", "val_loss", "val_fape", "val_sidechain_fape", "val_chi", "val_violation"];
    let terms = [&terms[..], &["val_distogram", "val_masked_msa", "val_plddt", "val_experimentally_resolved"]].concat();
    let (one, text) = run("one", &["--steps", "2"]);
    assert!(text.contains("3 validation complexes, 1 recycles"), "{text}");
    assert!(text.contains("validation after step 2: 3 complexes"), "{text}");
    assert_eq!(one.len(), 2);
    for s in &one {
        assert_eq!(s["val_chains"], 3, "{s}");
        for t in &terms {
            assert!(s[*t].as_f64().is_some_and(f64::is_finite), "step {}: {t} {}", s["step"], s[*t]);
        }
        let lddt = s["val_lddt_ca"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&lddt), "lDDT-Ca {lddt}");
    }
    eprintln!("one process: {}", serde_json::to_string(&one).unwrap());
    let same = |what: &str, got: &[serde_json::Value], want: &[serde_json::Value]| {
        assert_eq!(got.len(), want.len(), "{what}");
        for (g, w) in got.iter().zip(want) {
            assert_eq!(g["val_chains"], w["val_chains"], "{what}");
            for t in &terms {
                let (x, y) = (g[*t].as_f64().unwrap(), w[*t].as_f64().unwrap());
                let worst = (x - y).abs() / y.abs().max(1.0);
                eprintln!("{what}, step {}: {t} {x} (one process {y}, {worst:.1e} apart)", g["step"]);
                assert!(worst <= 1e-4, "{what}, step {}: {t} {x}, one process {y}", g["step"]);
            }
        }
    };
    let (dap, _) = run("dap", &["--steps", "2", "--nproc", "2"]);
    same("2 DAP ranks", &dap, &one);
    let (accumulated, _) = run("accumulated", &["--steps", "1", "--accumulation", "2"]);
    let (replicas, _) = run("replicas", &["--steps", "1", "--nproc", "2", "--dap", "1"]);
    same("2 replicas", &replicas, &accumulated);
}
