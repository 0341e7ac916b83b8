//! `fastfold predict --data-dir` end to end with the real search tools (HMMER's jackhmmer,
//! HH-suite's hhblits; scripts/setup.sh installs them, and these tests fail without them) on
//! tiny databases built here: mutated homologues of a query (substitutions, one insertion,
//! one deletion) among unrelated random sequences, in AlphaFold's layout, the HH-suite
//! databases made with HH-suite's own tools. Checks the saved alignments (every homologue
//! found, no random sequence, residues and deletion counts where they must be), the merged
//! MSA's depth in `features.npz`, the reuse of saved alignments, and the errors for a missing
//! database, a missing tool, a failing tool and a malformed saved result.
mod common;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use fastfold::model::{EvoformerConfig, ModelConfig, Params, TemplateConfig};
use fastfold::search::stockholm;
use tch::Tensor;

use common::layout::{template_atom, write_mmcif, TEMPLATE_ATOMS};
use common::BIN;
const AA: &[u8] = b"ACDEFGHIKLMNPQRSTVWY";
const QUERY: &str = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQAPILSRVGDGTQDNLSGAEKAVQVKVKALPDAQFEVVH";
/// Homologues with `INSERTION` after query residue 35, and with query residues 20..23 deleted.
const WITH_INSERTION: [usize; 3] = [3, 9, 15];
const WITH_DELETION: [usize; 2] = [5, 11];
const INSERTION: &str = "GSGSG";

fn dir(name: &str) -> suite_tests::Scratch {
    common::scratch("search", name)
}

/// Tiny parameters with a template embedding (as `model_1`/`model_2` have one).
fn template_params_file() -> &'static Path {
    static FILE: OnceLock<PathBuf> = OnceLock::new();
    FILE.get_or_init(|| {
        let path = dir("template-params").until_exit().join("params_tiny_templates.npz");
        let model = ModelConfig { templates: Some(TemplateConfig::tiny()), ..ModelConfig::tiny() };
        Params::random_model(&EvoformerConfig::tiny(), &model, 7).unwrap().save(&path).unwrap();
        path
    })
}

/// A fixed pseudo-random stream (xorshift), so the databases are the same every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
    fn residue(&mut self) -> char {
        AA[self.next(AA.len())] as char
    }
}

/// Homologue `i`: about 20% of the query's residues substituted, with its indel if any.
fn homologue(i: usize) -> String {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ ((i as u64 + 1) * 0x1234_5678));
    let mut s: String = QUERY.chars().map(|c| if rng.next(5) == 0 { rng.residue() } else { c }).collect();
    if WITH_INSERTION.contains(&i) {
        s.insert_str(35, INSERTION);
    }
    if WITH_DELETION.contains(&i) {
        s.replace_range(20..23, "");
    }
    s
}

fn random_sequence(i: usize) -> String {
    let mut rng = Rng(0xdead_beef ^ ((i as u64 + 7) * 0x9876_5431));
    (0..QUERY.len()).map(|_| rng.residue()).collect()
}

/// A FASTA of homologues `hom` (named `homN`), copies of homologues `copies` (named
/// `copyN`, same sequence) and random sequences `rnd` (named `rndN`).
fn fasta_db(hom: std::ops::Range<usize>, copies: &[usize], rnd: std::ops::Range<usize>) -> String {
    let mut text = String::new();
    for i in hom {
        text += &format!(">hom{i} homologue {i}\n{}\n", homologue(i));
    }
    for &i in copies {
        text += &format!(">copy{i} copy of homologue {i}\n{}\n", homologue(i));
    }
    for i in rnd {
        text += &format!(">rnd{i} unrelated\n{}\n", random_sequence(i));
    }
    text
}

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// The reduced_dbs layout: UniRef90 has homologues 0..14, MGnify 14..20 and copies of 0 and
/// 1, the small BFD 20..24 and a copy of 2; random sequences in each.
fn reduced_data_dir(root: &Path) -> PathBuf {
    let d = root.join("data");
    write(&d.join("uniref90/uniref90.fasta"), &fasta_db(0..14, &[], 0..15));
    write(&d.join("mgnify/mgy_clusters_2022_05.fa"), &fasta_db(14..20, &[0, 1], 15..23));
    write(&d.join("small_bfd/bfd-first_non_consensus_sequences.fasta"), &fasta_db(20..24, &[2], 23..30));
    d
}

/// Runs `cmd`, panicking with its output when it fails.
fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?} (scripts/setup.sh installs it): {e}"));
    assert!(out.status.success(), "{cmd:?} failed:\n{}", String::from_utf8_lossy(&out.stderr));
}

/// HH-suite's `cstranslate` (Debian installs its per-CPU builds under libexec and a wrapper
/// that only works from /usr/bin; the plain build runs everywhere).
fn cstranslate() -> PathBuf {
    let plain = Path::new("/usr/libexec/hhsuite/cstranslate-plain");
    if plain.exists() {
        plain.to_path_buf()
    } else {
        PathBuf::from("cstranslate")
    }
}

/// An HH-suite database `prefix` of `fasta`'s sequences (each its own one-row A3M), built
/// with HH-suite's tools: ffindex_from_fasta, hhmake through ffindex_apply, cstranslate.
fn hhsuite_db(prefix: &Path, fasta: &str) {
    let dir = prefix.parent().unwrap();
    let seqs = dir.join("seqs.fasta");
    write(&seqs, fasta);
    let p = |suffix: &str| format!("{}_{suffix}", prefix.display());
    run(Command::new("ffindex_from_fasta").args(["-s", &p("a3m.ffdata"), &p("a3m.ffindex")]).arg(&seqs));
    run(Command::new("ffindex_apply")
        .args([&p("a3m.ffdata"), &p("a3m.ffindex"), "-i", &p("hhm.ffindex"), "-d", &p("hhm.ffdata")])
        .args(["--", "hhmake", "-i", "stdin", "-o", "stdout", "-v", "0"]));
    let data = Path::new("/usr/share/hhsuite/data");
    run(Command::new(cstranslate())
        .args(["-f", "-x", "0.3", "-c", "4", "-I", "a3m", "-b", "-i", &p("a3m"), "-o", &p("cs219")])
        .arg("-A")
        .arg(data.join("cs219.lib"))
        .arg("-D")
        .arg(data.join("context_data.lib")));
    std::fs::remove_file(seqs).unwrap();
}

/// A ColabFold-style MMseqs2 database `prefix` (`<prefix>` the cluster representatives,
/// `_seq` the members, `_aln` their alignments to the representatives, `_h` and `_seq_h` the
/// headers) of `fasta`'s sequences, built with MMseqs2's own commands.
fn mmseqs_db(prefix: &Path, fasta: &str) {
    let seqs = prefix.with_extension("fasta");
    write(&seqs, fasta);
    let p = |suffix: &str| format!("{}{suffix}", prefix.display());
    let tmp = p("_tmp");
    let mmseqs = |args: &[&str]| run(Command::new("mmseqs").args(args).args(["-v", "1"]));
    mmseqs(&["createdb", seqs.to_str().unwrap(), &p("_seq")]);
    mmseqs(&["cluster", &p("_seq"), &p("_clu"), &tmp, "--min-seq-id", "0.9", "--threads", "1"]);
    mmseqs(&["align", &p("_seq"), &p("_seq"), &p("_clu"), &p("_aln"), "-a", "--threads", "1"]);
    mmseqs(&["createsubdb", &p("_clu"), &p("_seq"), &p("")]);
    mmseqs(&["createsubdb", &p("_clu"), &p("_seq_h"), &p("_h")]);
    mmseqs(&["rmdb", &p("_clu")]);
    std::fs::remove_dir_all(tmp).unwrap();
    std::fs::remove_file(seqs).unwrap();
}

/// Runs `fastfold predict` on the query; returns (success, stdout + stderr).
fn predict(root: &Path, extra: &[&str]) -> (bool, String) {
    predict_records(root, "out", &[("query", QUERY)], common::tiny_params(), extra)
}

/// Runs `fastfold predict` on `records` (name, sequence) into `root/out`; returns (success,
/// stdout + stderr).
fn predict_records(root: &Path, out: &str, records: &[(&str, &str)], params: &Path, extra: &[&str]) -> (bool, String) {
    let fa = root.join("query.fasta");
    write(&fa, &records.iter().map(|(name, seq)| format!(">{name} test query\n{seq}\n")).collect::<String>());
    let out = root.join(out);
    let mut args: Vec<String> =
        ["predict", fa.to_str().unwrap(), "--params", params.to_str().unwrap()].map(String::from).to_vec();
    args.extend(["--num-recycle", "0", "--search-cpus", "1", "-o", out.to_str().unwrap()].map(String::from));
    args.extend(extra.iter().map(|s| s.to_string()));
    // Its own temporary folder, to see that the search's scratch folders are removed.
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let out = Command::new(BIN).args(&args).env("FASTFOLD_TEST", "1").env("TMPDIR", &tmp).output().unwrap();
    (out.status.success(), format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)))
}

/// The search's scratch folders left in the runs' temporary folder.
fn scratch_left(root: &Path) -> Vec<String> {
    std::fs::read_dir(root.join("tmp"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("fastfold-search"))
        .collect()
}

/// A shell script standing in for a tool: it appends its arguments to `log`, then runs
/// `body`.
fn wrapper(path: &Path, log: &Path, body: &str) -> PathBuf {
    write(path, &format!("#!/bin/sh\necho \"$@\" >> '{}'\n{body}\n", log.display()));
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path.to_path_buf()
}

fn predict_ok(root: &Path, extra: &[&str]) {
    let (ok, text) = predict(root, extra);
    assert!(ok, "fastfold predict {extra:?} failed:\n{text}");
}

/// A hit's name without jackhmmer's `/from-to` suffix, and the range.
fn hit_name(description: &str) -> (&str, Option<(usize, usize)>) {
    let word = description.split_whitespace().next().unwrap();
    match word.split_once('/') {
        Some((name, range)) => {
            let (a, b) = range.split_once('-').unwrap();
            (name, Some((a.parse().unwrap(), b.parse().unwrap())))
        }
        None => (word, None),
    }
}

fn read_sto(path: &Path) -> data::a3m::Msa {
    stockholm::parse(&std::fs::read_to_string(path).unwrap(), path).unwrap()
}

/// Checks a jackhmmer alignment: the query first, exactly the homologues `expected` (by
/// name) besides, each hit's residues where they must be.
fn check_jackhmmer_hits(path: &Path, expected: &BTreeSet<String>) {
    let msa = read_sto(path);
    assert_eq!(msa.sequences[0], QUERY, "{}", path.display());
    assert_eq!(hit_name(&msa.descriptions[0]).0, "query");
    let names: BTreeSet<String> = msa.descriptions[1..].iter().map(|d| hit_name(d).0.to_string()).collect();
    assert_eq!(&names, expected, "{}: hits", path.display());
    for ((row, deletions), description) in msa.sequences.iter().zip(&msa.deletion_matrix).zip(&msa.descriptions).skip(1)
    {
        let (name, range) = hit_name(description);
        let (from, to) = range.unwrap();
        let i: usize = name.trim_start_matches(|c: char| c.is_alphabetic()).parse().unwrap();
        let seq = homologue(i);
        let aligned = row.chars().filter(|&c| c != '-').count();
        let deleted: u32 = deletions.iter().sum();
        // Every residue of the hit's matched segment is an aligned column or a deletion.
        assert_eq!(aligned + deleted as usize, to - from + 1, "{description}: {row} {deletions:?}");
        assert!(aligned >= 60, "{description}: only {aligned} residues aligned");
        if WITH_INSERTION.contains(&i) {
            assert_eq!(deleted as usize, INSERTION.len(), "{description}: {deletions:?}");
        } else {
            assert_eq!(deleted, 0, "{description}: {deletions:?}");
        }
        if !WITH_INSERTION.contains(&i) && !WITH_DELETION.contains(&i) {
            // Substitutions only: aligned column j holds the homologue's residue j.
            for (j, c) in row.chars().enumerate() {
                assert!(c == '-' || seq.as_bytes()[j] as char == c, "{description}: column {j}");
            }
        }
        if WITH_DELETION.contains(&i) {
            assert!(row[20..23].chars().filter(|&c| c == '-').count() >= 2, "{description}: {row}");
        }
    }
}

fn names(range: std::ops::Range<usize>, copies: &[usize]) -> BTreeSet<String> {
    range.map(|i| format!("hom{i}")).chain(copies.iter().map(|i| format!("copy{i}"))).collect()
}

fn features(root: &Path) -> HashMap<String, Tensor> {
    npz(&root.join("out/query/features.npz"))
}

fn npz(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_npz(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())).into_iter().collect()
}

fn num_alignments(f: &HashMap<String, Tensor>) -> i64 {
    f["msa"].size()[0]
}

#[test]
fn reduced_dbs_search_finds_the_homologues_and_feeds_the_model() {
    let root = dir("reduced");
    let data = reduced_data_dir(&root);
    predict_ok(&root, &["--data-dir", data.to_str().unwrap(), "--db-preset", "reduced_dbs"]);
    let msas = root.join("out/query/msas");
    check_jackhmmer_hits(&msas.join("uniref90_hits.sto"), &names(0..14, &[]));
    check_jackhmmer_hits(&msas.join("mgnify_hits.sto"), &names(14..20, &[0, 1]));
    check_jackhmmer_hits(&msas.join("small_bfd_hits.sto"), &names(20..24, &[2]));
    assert!(root.join("out/query/ranked_0.pdb").is_file());

    // The merged MSA: the query and the 24 homologues once each (the copies align as their
    // originals do and are dropped), rows as the saved alignments have them.
    let f = features(&root);
    assert_eq!(num_alignments(&f), 1 + 24);
    assert_eq!(f["num_alignments"].int64_value(&[0]), 25);
    let rows: HashSet<String> =
        [msas.join("uniref90_hits.sto"), msas.join("small_bfd_hits.sto"), msas.join("mgnify_hits.sto")]
            .iter()
            .flat_map(|p| read_sto(p).sequences)
            .collect();
    assert_eq!(rows.len(), 25);
    let deletions: i64 = f["deletion_matrix_int"].sum(tch::Kind::Int64).int64_value(&[]);
    assert_eq!(deletions, (WITH_INSERTION.len() * INSERTION.len()) as i64);

    // A rerun reuses the saved alignments: no tool runs (the binary given does not exist),
    // same features; without the flag the missing binary is an error naming it.
    let before = f["msa"].copy();
    let data_s = data.to_str().unwrap();
    let no_tool =
        ["--data-dir", data_s, "--db-preset", "reduced_dbs", "--jackhmmer-binary-path", "/nonexistent/jackhmmer"];
    predict_ok(&root, &[&no_tool[..], &["--use-precomputed-msas"]].concat());
    assert!(features(&root)["msa"].equal(&before));
    let (ok, text) = predict(&root, &no_tool);
    assert!(!ok && text.contains("cannot run jackhmmer") && text.contains("/nonexistent/jackhmmer"), "{text}");
    assert!(text.contains("uniref90.fasta"), "{text}");

    // A malformed saved alignment is an error naming the file.
    write(&msas.join("mgnify_hits.sto"), "# STOCKHOLM 1.0\nquery MKT AAA\n//\n");
    let (ok, text) = predict(&root, &[&no_tool[..], &["--use-precomputed-msas"]].concat());
    assert!(!ok && text.contains("mgnify_hits.sto") && text.contains("line 2"), "{text}");
}

#[test]
fn two_records_on_two_ranks_search_once_each_and_match_one_rank() {
    // Rank 0 searches and saves; rank 1 reads what it saved (a different MSA on one rank
    // would make the DAP run disagree with the single-process one).
    let root = dir("ranks");
    let data = reduced_data_dir(&root);
    let second = homologue(7);
    let records = [("query", QUERY), ("second", second.as_str())];
    let common = ["--data-dir", data.to_str().unwrap(), "--db-preset", "reduced_dbs", "--save-outputs"];
    for (out, extra) in [("one", &[][..]), ("two", &["--nproc", "2"][..])] {
        let (ok, text) = predict_records(&root, out, &records, common::tiny_params(), &[&common[..], extra].concat());
        assert!(ok, "{out}: {text}");
    }
    for (name, seq) in records {
        let (one, two) = (root.join("one").join(name), root.join("two").join(name));
        let f = npz(&one.join("features.npz"));
        assert!(f["msa"].equal(&npz(&two.join("features.npz"))["msa"]), "{name}");
        let sto = read_sto(&two.join("msas/uniref90_hits.sto"));
        assert_eq!(sto.sequences[0], seq, "{name}: its own search");
        assert!(f["msa"].size()[0] > 20, "{name}: {:?}", f["msa"].size());
        let (a, b) = (npz(&one.join("tiny_outputs.npz")), npz(&two.join("tiny_outputs.npz")));
        for key in ["distogram/logits", "representations/pair", "representations/msa_first_row"] {
            let diff = (&a[key] - &b[key]).abs().max().double_value(&[]);
            assert!(diff < 1e-4, "{name}: {key} differs between 1 and 2 ranks by {diff}");
        }
    }
}

#[test]
fn each_query_has_its_own_search_time_and_timings_keep_their_order() {
    // run_alphafold.py times each FASTA file's features step; the old code gave every query
    // the reading and search time of all queries together, and wrote the keys sorted.
    let root = dir("timings");
    let data = reduced_data_dir(&root);
    let log = root.join("jackhmmer.log");
    // The second query's three searches (the wrapper logs each before its body) sleep 0.5 s.
    let body = format!("if [ \"$(wc -l < '{}')\" -gt 3 ]; then sleep 0.5; fi\nexec jackhmmer \"$@\"", log.display());
    let jackhmmer = wrapper(&root.join("bin/jackhmmer"), &log, &body);
    let second = homologue(7);
    let records = [("query", QUERY), ("second", second.as_str())];
    let args = ["--data-dir", data.to_str().unwrap(), "--db-preset", "reduced_dbs", "--jackhmmer-binary-path"];
    let (ok, text) = predict_records(
        &root,
        "out",
        &records,
        common::tiny_params(),
        &[&args[..], &[jackhmmer.to_str().unwrap()]].concat(),
    );
    assert!(ok, "{text}");
    assert_eq!(std::fs::read_to_string(&log).unwrap().lines().count(), 6, "three searches per query");
    let timings = |name: &str| std::fs::read_to_string(root.join("out").join(name).join("timings.json")).unwrap();
    let features = |name: &str| {
        let json: serde_json::Value = serde_json::from_str(&timings(name)).unwrap();
        json["features"].as_f64().unwrap()
    };
    let (first, second) = (features("query"), features("second"));
    assert!(second - first > 1.0, "features: {first} s for the first query, {second} s for the second");
    let text = timings("query");
    let at = |key: &str| text.find(&format!("\"{key}\"")).unwrap_or_else(|| panic!("no {key} in {text}"));
    assert!(
        at("features") < at("process_features_tiny") && at("process_features_tiny") < at("predict_and_compile_tiny")
    );
}

#[test]
fn search_tools_hold_no_descriptor_of_the_rank() {
    // A tool that held the rank's pipes or sockets kept them open past the rank's death.
    let root = dir("descriptors");
    let data = reduced_data_dir(&root);
    let (log, fds) = (root.join("jackhmmer.log"), root.join("fds.txt"));
    let body = format!(
        "for f in /proc/$$/fd/*; do n=${{f##*/}}; [ \"$n\" -gt 2 ] && readlink \"$f\"; done >> '{}'\nexec jackhmmer \"$@\"",
        fds.display()
    );
    let jackhmmer = wrapper(&root.join("bin/jackhmmer"), &log, &body);
    let args = ["--data-dir", data.to_str().unwrap(), "--db-preset", "reduced_dbs", "--jackhmmer-binary-path"];
    let (ok, text) = predict_records(
        &root,
        "out",
        &[("query", QUERY)],
        common::tiny_params(),
        &[&args[..], &[jackhmmer.to_str().unwrap()]].concat(),
    );
    assert!(ok, "{text}");
    let held = std::fs::read_to_string(&fds).unwrap();
    assert!(!held.contains("pipe:") && !held.contains("socket:"), "the tool held: {held}");
}

#[test]
fn an_interrupted_search_ends_its_tools_and_their_children() {
    // A tool started through a wrapper script runs in the wrapper's child, which the
    // wrapper's own death would leave running; SIGTERM to fastfold must end both, and
    // remove the search's scratch folder.
    use std::os::unix::process::ExitStatusExt;
    let root = dir("interrupted");
    let data = reduced_data_dir(&root);
    let marker = format!("{}.{}", 30 + std::process::id() % 1000, 4159);
    let jackhmmer = wrapper(&root.join("bin/jackhmmer"), &root.join("jackhmmer.log"), &format!("sleep {marker}"));
    let fa = root.join("query.fasta");
    write(&fa, &format!(">query test query\n{QUERY}\n"));
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    let mut child = Command::new(BIN)
        .args(["predict", fa.to_str().unwrap(), "--params", common::tiny_params().to_str().unwrap()])
        .args(["-o", root.join("out").to_str().unwrap(), "--data-dir", data.to_str().unwrap()])
        .args(["--db-preset", "reduced_dbs", "--jackhmmer-binary-path", jackhmmer.to_str().unwrap()])
        .env("TMPDIR", &tmp)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let sleeping = || {
        let out = Command::new("pgrep").args(["-f", &format!("sleep {marker}")]).output().unwrap();
        !out.stdout.is_empty()
    };
    let start = std::time::Instant::now();
    while !sleeping() {
        assert!(start.elapsed().as_secs() < 120, "the tool never started");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));
    let ended = std::time::Instant::now();
    while sleeping() {
        assert!(ended.elapsed().as_secs() < 10, "the tool's child outlived fastfold");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(scratch_left(&root).is_empty(), "{:?}", scratch_left(&root));
}

#[test]
fn full_dbs_search_runs_hhblits_on_bfd_and_uniref30() {
    let root = dir("full");
    let data = root.join("data");
    write(&data.join("uniref90/uniref90.fasta"), &fasta_db(0..10, &[], 0..10));
    write(&data.join("mgnify/mgy_clusters_2022_05.fa"), &fasta_db(10..14, &[], 10..15));
    let bfd = data.join("bfd/bfd_metaclust_clu_complete_id30_c90_final_seq.sorted_opt");
    let uniref30 = data.join("uniref30/UniRef30_2021_03");
    std::fs::create_dir_all(bfd.parent().unwrap()).unwrap();
    std::fs::create_dir_all(uniref30.parent().unwrap()).unwrap();
    hhsuite_db(&bfd, &fasta_db(14..18, &[], 15..20));
    hhsuite_db(&uniref30, &fasta_db(18..22, &[0], 20..25));
    let log = root.join("tools.log");
    let jackhmmer = wrapper(&root.join("bin/jackhmmer"), &log, "exec jackhmmer \"$@\"");
    let hhblits = wrapper(&root.join("bin/hhblits"), &log, "exec hhblits \"$@\"");
    predict_ok(
        &root,
        &[
            "--data-dir",
            data.to_str().unwrap(),
            "--db-preset",
            "full_dbs",
            "--jackhmmer-binary-path",
            jackhmmer.to_str().unwrap(),
            "--hhblits-binary-path",
            hhblits.to_str().unwrap(),
        ],
    );
    // Each tool ran with the thread count given and AlphaFold's settings.
    let calls = std::fs::read_to_string(&log).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 3, "{calls:?}");
    for call in &calls[..2] {
        for flag in ["--cpu 1 ", "-N 1 ", "-E 0.0001 ", "--incE 0.0001 ", "--F1 0.0005 ", "--noali"] {
            assert!(call.contains(flag), "jackhmmer call without {flag:?}: {call}");
        }
    }
    assert!(calls[0].ends_with("uniref90/uniref90.fasta") && calls[1].ends_with("mgy_clusters_2022_05.fa"));
    for flag in
        ["-cpu 1 ", "-n 3 ", "-e 0.001 ", "-maxseq 1000000 ", "-realign_max 100000 ", "-min_prefilter_hits 1000 "]
    {
        assert!(calls[2].contains(flag), "hhblits call without {flag:?}: {}", calls[2]);
    }
    assert!(calls[2].contains(&format!("-d {} -d {}", bfd.display(), uniref30.display())), "{}", calls[2]);
    assert!(scratch_left(&root).is_empty(), "{:?}", scratch_left(&root));
    let msas = root.join("out/query/msas");
    check_jackhmmer_hits(&msas.join("uniref90_hits.sto"), &names(0..10, &[]));
    check_jackhmmer_hits(&msas.join("mgnify_hits.sto"), &names(10..14, &[]));
    let a3m = data::a3m::read(&msas.join("bfd_uniref_hits.a3m")).unwrap();
    assert_eq!(a3m.sequences[0], QUERY);
    let found: BTreeSet<String> = a3m.descriptions[1..].iter().map(|d| hit_name(d).0.to_string()).collect();
    assert_eq!(found, names(14..22, &[0]), "hhblits hits from both databases, no random sequence");
    for (row, description) in a3m.sequences.iter().zip(&a3m.descriptions).skip(1) {
        let i: usize = hit_name(description).0.trim_start_matches(|c: char| c.is_alphabetic()).parse().unwrap();
        if !WITH_INSERTION.contains(&i) && !WITH_DELETION.contains(&i) {
            let seq = homologue(i);
            assert!(row.chars().enumerate().all(|(j, c)| c == '-' || seq.as_bytes()[j] as char == c), "{description}");
        }
    }
    // Query, homologues 0..22 once each; copy0 repeats hom0's row unless hhblits aligned it
    // differently from jackhmmer (then it is a row of its own).
    let n = num_alignments(&features(&root));
    assert!(n == 1 + 22 || n == 1 + 23, "merged depth {n}");
}

#[test]
fn mmseqs2_mode_runs_colabfolds_search() {
    let root = dir("mmseqs");
    let data = root.join("colabfold");
    std::fs::create_dir_all(&data).unwrap();
    mmseqs_db(&data.join("uniref30_2302_db"), &fasta_db(0..12, &[], 0..12));
    mmseqs_db(&data.join("colabfold_envdb_202108_db"), &fasta_db(12..20, &[0], 12..24));
    let log = root.join("tools.log");
    let mmseqs = wrapper(&root.join("bin/mmseqs"), &log, "exec mmseqs \"$@\"");
    predict_ok(
        &root,
        &[
            "--msa-mode",
            "mmseqs2",
            "--data-dir",
            data.to_str().unwrap(),
            "--mmseqs-binary-path",
            mmseqs.to_str().unwrap(),
        ],
    );
    let calls = std::fs::read_to_string(&log).unwrap();
    let searches: Vec<&str> = calls.lines().filter(|c| c.starts_with("search ")).collect();
    assert_eq!(searches.len(), 2, "UniRef30 then the environmental database: {calls}");
    for call in &searches {
        for flag in ["--threads 1 ", "--num-iterations 3 ", "-e 0.1 ", "--max-seqs 10000 ", "-s 8.0"] {
            assert!(call.contains(flag), "mmseqs search without {flag:?}: {call}");
        }
    }
    assert!(scratch_left(&root).is_empty(), "{:?}", scratch_left(&root));

    let a3m = data::a3m::read(&root.join("out/query/msas/mmseqs2_uniref_env.a3m")).unwrap();
    assert_eq!(a3m.sequences[0], QUERY);
    // Both databases' homologues and no random sequence (copy0 repeats hom0's row).
    let found: BTreeSet<String> = a3m.descriptions[1..].iter().map(|d| hit_name(d).0.to_string()).collect();
    assert_eq!(found, names(0..20, &[]));
    for ((row, deletions), description) in a3m.sequences.iter().zip(&a3m.deletion_matrix).zip(&a3m.descriptions).skip(1)
    {
        let i: usize = hit_name(description).0.trim_start_matches(|c: char| c.is_alphabetic()).parse().unwrap();
        let deleted: u32 = deletions.iter().sum();
        if WITH_INSERTION.contains(&i) {
            assert_eq!(deleted as usize, INSERTION.len(), "{description}: {deletions:?}");
        } else if !WITH_DELETION.contains(&i) {
            // Substitutions only: column j holds the homologue's residue j, but for a gap
            // MMseqs2 may open near a substituted end.
            let seq = homologue(i);
            let aligned: Vec<(usize, char)> = row.chars().enumerate().filter(|&(_, c)| c != '-').collect();
            let same = aligned.iter().filter(|&&(j, c)| seq.as_bytes()[j] as char == c).count();
            assert!(same + 2 >= aligned.len() && aligned.len() >= 60, "{description}: {row}");
            assert_eq!(deleted, 0, "{description}");
        }
    }
    assert_eq!(num_alignments(&features(&root)), 1 + 20);
}

#[test]
fn missing_databases_and_failing_tools_are_named() {
    let root = dir("errors");
    let data = reduced_data_dir(&root);
    std::fs::remove_file(data.join("mgnify/mgy_clusters_2022_05.fa")).unwrap();
    let (ok, text) = predict(&root, &["--data-dir", data.to_str().unwrap(), "--db-preset", "reduced_dbs"]);
    assert!(!ok && text.contains("mgy_clusters_2022_05.fa") && text.contains("--mgnify-database-path"), "{text}");
    assert!(!text.contains("uniref90.fasta (--"), "present databases are not named: {text}");
    // full_dbs names the HH-suite databases it lacks.
    let (ok, text) = predict(&root, &["--data-dir", data.to_str().unwrap()]);
    assert!(!ok && text.contains("--bfd-database-path") && text.contains("--uniref30-database-path"), "{text}");

    // A pdb70 asked for but absent is named, and so is a missing mmCIF folder; a bad date is
    // named with its flag.
    let reduced = ["--data-dir", data.to_str().unwrap(), "--db-preset", "reduced_dbs"];
    let mgnify_back = data.join("mgnify/mgy_clusters_2022_05.fa");
    write(&mgnify_back, &fasta_db(14..20, &[], 0..0));
    let (ok, text) = predict(&root, &[&reduced[..], &["--pdb70-database-path", "/nonexistent/pdb70"]].concat());
    assert!(!ok && text.contains("/nonexistent/pdb70 (--pdb70-database-path)"), "{text}");
    assert!(text.contains("mmcif_files (--template-mmcif-dir) is not a folder"), "{text}");
    let seqres = ["--template-searcher", "hmmsearch", "--pdb-seqres-database-path", "/nonexistent/pdb_seqres.txt"];
    let (ok, text) = predict(&root, &[&reduced[..], &seqres[..]].concat());
    assert!(!ok && text.contains("/nonexistent/pdb_seqres.txt (--pdb-seqres-database-path) is not a file"), "{text}");
    let (ok, text) = predict(&root, &[&reduced[..], &["--max-template-date", "2020-13-01"]].concat());
    assert!(!ok && text.contains("--max-template-date \"2020-13-01\""), "{text}");
    let (ok, text) = predict(&root, &[&reduced[..], &["--max-template-date", "2021-02-29"]].concat());
    assert!(!ok && text.contains("--max-template-date \"2021-02-29\""), "not a leap year: {text}");
    std::fs::remove_file(&mgnify_back).unwrap();

    // ColabFold's databases are named when absent.
    let (ok, text) = predict(&root, &["--data-dir", data.to_str().unwrap(), "--msa-mode", "mmseqs2"]);
    assert!(!ok && text.contains("uniref30_2302_db (--mmseqs-uniref-db)"), "{text}");
    assert!(text.contains("colabfold_envdb_202108_db (--mmseqs-env-db)"), "{text}");

    // A database jackhmmer cannot read: its error names the tool, the database and quotes
    // jackhmmer's stderr; nothing is left in msas/.
    let bad = root.join("bad.fasta");
    write(&bad, "this is not a FASTA file\n");
    let mgnify = data.join("mgnify/mgy_clusters_2022_05.fa");
    write(&mgnify, &fasta_db(14..20, &[], 0..0));
    let (ok, text) = predict(&root, &[&reduced[..], &["--uniref90-database-path", bad.to_str().unwrap()]].concat());
    assert!(!ok && text.contains("jackhmmer failed against") && text.contains("bad.fasta"), "{text}");
    assert!(text.to_lowercase().contains("pars") || text.to_lowercase().contains("format"), "stderr quoted: {text}");
    assert!(!root.join("out/query/msas/uniref90_hits.sto").exists());
    assert!(scratch_left(&root).is_empty(), "scratch folders left after a failure: {:?}", scratch_left(&root));

    // Only the tail of a long stderr is quoted, with the exit status.
    let log = root.join("noisy.log");
    let noisy =
        wrapper(&root.join("bin/noisy"), &log, "for i in $(seq 1 40); do echo \"noise line $i\" >&2; done; exit 3");
    let (ok, text) = predict(&root, &[&reduced[..], &["--jackhmmer-binary-path", noisy.to_str().unwrap()]].concat());
    assert!(!ok && text.contains("noise line 40") && text.contains("noise line 21"), "{text}");
    assert!(!text.contains("noise line 20\n") && text.contains("exit status: 3"), "{text}");

    // A tool that exits cleanly with output that does not parse: named, its output kept aside
    // as .rejected (not reused by --use-precomputed-msas, which would fail on it again).
    let garbage = wrapper(
        &root.join("bin/garbage"),
        &log,
        "while [ \"$1\" != -A ]; do shift; done; echo 'this is garbage' > \"$2\"",
    );
    let (ok, text) = predict(&root, &[&reduced[..], &["--jackhmmer-binary-path", garbage.to_str().unwrap()]].concat());
    let msas = root.join("out/query/msas");
    assert!(
        !ok && text.contains("the tool's output is kept as") && text.contains("uniref90_hits.sto.rejected"),
        "{text}"
    );
    assert!(!msas.join("uniref90_hits.sto").exists() && msas.join("uniref90_hits.sto.rejected").exists());
    assert!(text.contains("running jackhmmer against"), "each tool run is said: {text}");

    // Search options without a search, and database flags the preset does not use, are named
    // rather than ignored.
    for (extra, named) in [
        (&["--use-precomputed-msas"][..], "--use-precomputed-msas applies to the homology search"),
        (&["--msa-mode", "mmseqs2"], "--msa-mode mmseqs2 applies to the homology search"),
        (&["--max-template-date", "2020-01-01"], "--max-template-date applies to the homology search"),
        (&["--db-preset", "reduced_dbs"], "--db-preset reduced_dbs applies to the homology search"),
        (&["--template-searcher", "hmmsearch"], "--template-searcher hmmsearch applies to the homology search"),
        (&["--template-mmcif-dir", "mmcif"], "--template-mmcif-dir applies to the homology search"),
    ] {
        let (ok, text) = predict(&root, extra);
        assert!(!ok && text.contains(named), "{extra:?}: {text}");
    }
    let ignored = [
        ("--bfd-database-path", "is not used with --db-preset reduced_dbs"),
        ("--mmseqs-uniref-db", "needs --msa-mode mmseqs2"),
    ];
    for (flag, named) in ignored {
        let (ok, text) = predict(&root, &[&reduced[..], &[flag, "/nonexistent/x"]].concat());
        assert!(!ok && text.contains(&format!("{flag} {named}")), "{flag}: {text}");
    }

    // An alignment given and a search asked for: one or the other.
    let a3m = root.join("given.a3m");
    write(&a3m, &format!(">query\n{QUERY}\n"));
    let (ok, text) = predict(&root, &["--data-dir", data.to_str().unwrap(), "--msa", a3m.to_str().unwrap()]);
    assert!(!ok && text.contains("given.a3m") && text.contains("nothing to search"), "{text}");
}

// ---------------------------------------------------------------- templates

/// Template search data on top of the reduced_dbs layout: pdb70 of three homologues of the
/// query and unrelated sequences, and their mmCIF entries. 1tpl_A is homologue 0 (released
/// 2010); 2tpl_B is homologue 1 with two residues before it, and one residue changed in the
/// mmCIF file since pdb70 was built (so it is realigned with kalign; released 2012); 3tpl_A
/// is homologue 4, released 2025.
fn template_data_dir(root: &Path) -> PathBuf {
    let data = reduced_data_dir(root);
    let pdb70 = data.join("pdb70/pdb70");
    std::fs::create_dir_all(pdb70.parent().unwrap()).unwrap();
    let (h0, h1, h4) = (homologue(0), homologue(1), homologue(4));
    let chain_b = format!("MS{h1}");
    let mut changed = chain_b.clone();
    let k = 40;
    let new = if &changed[k..k + 1] == "W" { "Y" } else { "W" };
    changed.replace_range(k..k + 1, new);
    let mut fasta = format!(">1tpl_A mol:protein length:{}\n{h0}\n", h0.len());
    fasta += &format!(">2tpl_B mol:protein length:{}\n{chain_b}\n", chain_b.len());
    fasta += &format!(">3tpl_A mol:protein length:{}\n{h4}\n", h4.len());
    let mmcif = data.join("pdb_mmcif/mmcif_files");
    for i in 0..6 {
        let rnd = random_sequence(40 + i);
        fasta += &format!(">{}rnd_A mol:protein length:{}\n{rnd}\n", 4 + i, rnd.len());
        write_mmcif(&mmcif.join(format!("{}rnd.cif", 4 + i)), &format!("{}RND", 4 + i), "2000-01-01", &[("A", &rnd)]);
    }
    write(&data.join("pdb_seqres/pdb_seqres.txt"), &fasta);
    hhsuite_db(&pdb70, &fasta);
    write_mmcif(&mmcif.join("1tpl.cif"), "1TPL", "2010-05-05", &[("A", &h0)]);
    let other = random_sequence(60);
    write_mmcif(&mmcif.join("2tpl.cif"), "2TPL", "2012-03-03", &[("A", &other), ("B", &changed)]);
    write_mmcif(&mmcif.join("3tpl.cif"), "3TPL", "2025-02-02", &[("A", &h4)]);
    data
}

#[test]
fn template_search_finds_and_featurises_templates() {
    let root = dir("templates");
    let data = template_data_dir(&root);
    let data_s = data.to_str().unwrap();
    let log = root.join("tools.log");
    let hhsearch = wrapper(&root.join("bin/hhsearch"), &log, "exec hhsearch \"$@\"");
    let args = [
        "--data-dir",
        data_s,
        "--db-preset",
        "reduced_dbs",
        "--max-template-date",
        "2020-01-01",
        "--hhsearch-binary-path",
        hhsearch.to_str().unwrap(),
        "--save-outputs",
    ];
    // The model has a template embedding, so the templates run through it.
    let predict =
        |root: &Path, extra: &[&str]| predict_records(root, "out", &[("query", QUERY)], template_params_file(), extra);
    let (ok, text) = predict(&root, &args);
    assert!(ok, "{text}");
    // hhsearch ran once, with AlphaFold's settings, on the UniRef90 alignment.
    let calls = std::fs::read_to_string(&log).unwrap();
    assert_eq!(calls.lines().count(), 1, "{calls}");
    assert!(calls.contains("-maxseq 1000000 ") && calls.contains("-cpu 1 "), "{calls}");
    assert!(calls.trim_end().ends_with(&format!("-d {}", data.join("pdb70/pdb70").display())), "{calls}");
    assert!(scratch_left(&root).is_empty(), "{:?}", scratch_left(&root));

    // The saved hits: the three homologues, best first by Sum_probs as featurised.
    let hhr_path = root.join("out/query/msas/pdb_hits.hhr");
    let hits = fastfold::search::hhr::parse(&std::fs::read_to_string(&hhr_path).unwrap(), &hhr_path).unwrap();
    let names: BTreeSet<&str> = hits.iter().map(|h| &h.name[..6]).collect();
    for name in ["1tpl_A", "2tpl_B", "3tpl_A"] {
        assert!(names.contains(name), "{name} not among the hits {names:?}");
    }
    // 3tpl (2025) is after the date; 2tpl_B is realigned to the changed chain.
    assert!(text.contains("3tpl") && text.contains("after --max-template-date 2020-01-01"), "{text}");
    assert!(text.contains("2tpl_B") && text.contains("realigned with kalign"), "{text}");

    let f = features(&root);
    let probs = Vec::<f32>::try_from(&f["template_sum_probs"].reshape([-1])).unwrap();
    // 1tpl_A and 2tpl_B first; unrelated entries hhsearch lists with low scores after them
    // (AlphaFold keeps those too); never 3tpl_A.
    assert!(probs.len() >= 2 && probs.windows(2).all(|w| w[0] >= w[1]), "{probs:?}");
    assert!(probs[2..].iter().all(|&p| p < 20.0), "{probs:?}");
    let expected_probs: Vec<f32> = {
        let mut p: Vec<(String, f32)> = hits
            .iter()
            .filter(|h| h.name.starts_with("1tpl") || h.name.starts_with("2tpl"))
            .map(|h| (h.name[..6].to_string(), h.sum_probs.unwrap() as f32))
            .collect();
        p.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
        // hhsearch may list a second, weaker alignment to the same template.
        p.iter().take(2).map(|x| x.1).collect()
    };
    assert_eq!(probs[..2], expected_probs);
    let order: Vec<String> = {
        let mut p: Vec<(&str, f64)> = hits.iter().map(|h| (&h.name[..6], h.sum_probs.unwrap())).collect();
        p.retain(|(n, _)| *n == "1tpl_A" || *n == "2tpl_B");
        p.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap());
        p.iter().take(2).map(|x| x.0.to_string()).collect()
    };
    assert_eq!(f["template_all_atom_positions"].size(), [probs.len() as i64, QUERY.len() as i64, 37, 3]);
    for (t, name) in order.iter().enumerate() {
        check_template(&f, t as i64, name);
    }
    assert!(root.join("out/query/ranked_0.pdb").is_file());

    // The templates reach the model: without pdb70 (the same saved MSAs reused, so the same
    // MSA features) the pair representation differs.
    let outputs = |root: &Path| {
        let dir = root.join("out/query");
        let file = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.to_string_lossy().ends_with("_outputs.npz"))
            .unwrap_or_else(|| panic!("no --save-outputs file in {}", dir.display()));
        npz(&file)
    };
    let with_templates = outputs(&root)["representations/pair"].copy();
    std::fs::rename(data.join("pdb70"), data.join("pdb70.off")).unwrap();
    let (ok, text) = predict(&root, &[&args[..6], &["--use-precomputed-msas", "--save-outputs"]].concat());
    std::fs::rename(data.join("pdb70.off"), data.join("pdb70")).unwrap();
    assert!(ok, "{text}");
    assert!(!features(&root).contains_key("template_aatype"));
    let diff = (&outputs(&root)["representations/pair"] - &with_templates).abs().max().double_value(&[]);
    assert!(diff > 1e-3, "templates changed the pair representation by only {diff}");

    // A rerun reuses pdb_hits.hhr (hhsearch is not run: the binary given does not exist).
    let before = f["template_all_atom_positions"].copy();
    let reuse = [&args[..6], &["--hhsearch-binary-path", "/nonexistent/hhsearch", "--use-precomputed-msas"]].concat();
    let (ok, text) = predict(&root, &reuse);
    assert!(ok, "{text}");
    assert!(features(&root)["template_all_atom_positions"].equal(&before));

    // A bad mmCIF file is an error naming it.
    let cif = data.join("pdb_mmcif/mmcif_files/1tpl.cif");
    let good = std::fs::read_to_string(&cif).unwrap();
    write(&cif, &good.replacen("_struct_asym.entity_id\n", "_struct_asym.entity_id\n'A 1\n", 1));
    let (ok, text) = predict(&root, &reuse);
    assert!(!ok && text.contains("1tpl.cif") && text.contains("not closed"), "{text}");
    write(&cif, &good);
}

#[test]
fn hmmsearch_template_search_against_pdb_seqres() {
    let root = dir("hmmsearch");
    let data = template_data_dir(&root);
    let log = root.join("tools.log");
    let hmmsearch = wrapper(&root.join("bin/hmmsearch"), &log, "exec hmmsearch \"$@\"");
    let (ok, text) = predict(
        &root,
        &[
            "--data-dir",
            data.to_str().unwrap(),
            "--db-preset",
            "reduced_dbs",
            "--template-searcher",
            "hmmsearch",
            "--max-template-date",
            "2020-01-01",
            "--hmmsearch-binary-path",
            hmmsearch.to_str().unwrap(),
        ],
    );
    assert!(ok, "{text}");
    let calls = std::fs::read_to_string(&log).unwrap();
    let flags = "--noali --cpu 1 --F1 0.1 --F2 0.1 --F3 0.1 --incE 100 -E 100 --domE 100 --incdomE 100 -A ";
    assert!(calls.lines().count() == 1 && calls.contains(flags), "hmmsearch's call: {calls}");
    assert!(calls.trim_end().ends_with("pdb_seqres/pdb_seqres.txt"), "{calls}");
    assert!(root.join("out/query/msas/pdb_hits.sto").is_file());
    assert!(scratch_left(&root).is_empty(), "{:?}", scratch_left(&root));
    // The featurised templates as printed, in hmmsearch's order (no scores: all 0).
    let line = text.lines().find(|l| l.contains("featurised:")).unwrap_or_else(|| panic!("{text}"));
    let names: Vec<&str> = line.split("featurised: ").nth(1).unwrap().split(", ").map(|n| &n[..6]).collect();
    assert!(names.contains(&"1tpl_A") && names.contains(&"2tpl_B") && !names.contains(&"3tpl_A"), "{line}");
    let f = features(&root);
    let probs = Vec::<f32>::try_from(&f["template_sum_probs"].reshape([-1])).unwrap();
    assert!(probs.len() == names.len() && probs.iter().all(|&p| p == 0.0), "{probs:?}");
    for (t, name) in names.iter().enumerate() {
        if *name == "1tpl_A" || *name == "2tpl_B" {
            check_template(&f, t as i64, name);
        }
    }
}

/// Checks template `t` of the raw features `f`, hit `name` (1tpl_A or 2tpl_B of
/// [`template_data_dir`]): each query residue with a template residue has one chain residue's
/// letter and atoms (which residue, read back from its Cα), those residues in chain order, and
/// at least 60 of them where substitutions put them (the same offset: homologues have no
/// indels); the search tool may align a few end residues otherwise.
fn check_template(f: &HashMap<String, Tensor>, t: i64, name: &str) {
    let aatype = f["template_aatype"].argmax(-1, false);
    let positions = &f["template_all_atom_positions"];
    let masks = &f["template_all_atom_masks"];
    let n = QUERY.len() as i64;
    let ca = fastfold::residue_constants::atom_order("CA").unwrap() as i64;
    {
        // Chain residue of query residue i: homologue 0 has substitutions only (residue i);
        // 2tpl_B's chain is homologue 1 after two extra residues (residue i + 2).
        let (chain, shift) = if name == "1tpl_A" {
            (homologue(0), 0usize)
        } else {
            let mut c = format!("MS{}", homologue(1));
            let new = if &c[40..41] == "W" { "Y" } else { "W" };
            c.replace_range(40..41, new);
            (c, 2)
        };
        let mut placed = 0;
        let mut previous = None;
        for i in 0..n {
            if masks.double_value(&[t, i, ca]) == 0.0 {
                assert_eq!(aatype.int64_value(&[t, i]), 21, "{name}: residue {i} has no template residue");
                continue;
            }
            // The chain residue whose Cα this is (x = 3.8 k + 0.6 sin 1).
            let x = positions.double_value(&[t, i, ca, 0]);
            let k = ((x - 0.6 * 1f64.sin()) / 3.8).round() as usize;
            assert!(previous.is_none_or(|p| k > p), "{name}: residue {i} placed before residue {previous:?}");
            previous = Some(k);
            placed += (k == i as usize + shift) as usize;
            let letter = fastfold::residue_constants::ID_TO_HHBLITS_AA[aatype.int64_value(&[t, i]) as usize];
            assert_eq!(letter, chain.as_bytes()[k] as char, "{name}: residue {i}");
            for (j, atom) in TEMPLATE_ATOMS.iter().enumerate() {
                let a = fastfold::residue_constants::atom_order(atom).unwrap() as i64;
                let expected = if letter == 'G' && *atom == "CB" { None } else { Some(template_atom(k, j)) };
                assert_eq!(masks.double_value(&[t, i, a]) == 1.0, expected.is_some(), "{name} {i} {atom}");
                if let Some(p) = expected {
                    let got = Vec::<f32>::try_from(&positions.get(t).get(i).get(a)).unwrap();
                    assert_eq!(got, p, "{name}: residue {i} atom {atom}");
                }
            }
            // Only backbone and CB atoms exist in these entries.
            assert_eq!(masks.get(t).get(i).sum(tch::Kind::Float).double_value(&[]), expected_atoms(letter));
        }
        assert!(placed >= 60, "{name}: only {placed} query residues have a template residue");
    }
}

fn expected_atoms(letter: char) -> f64 {
    if letter == 'G' {
        4.0
    } else {
        5.0
    }
}
