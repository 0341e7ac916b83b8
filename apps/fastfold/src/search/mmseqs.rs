//! ColabFold's local MSA search (`colabfold_search`, `mmseqs_search_monomer`): MMseqs2
//! against UniRef30 and then, with the query's profile, against the environmental database,
//! each hit list expanded to the clusters' members, realigned, filtered and written as A3M;
//! the two A3Ms concatenated. The databases are ColabFold's (`setup_databases.sh`): each a
//! sequence database of cluster representatives `<db>` with its members `<db>_seq`, the
//! member alignments `<db>_aln` and an optional precomputed index `<db>.idx`.
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context};

use super::tools::Tool;

/// ColabFold's database names under the data directory.
pub const UNIREF30: &str = "uniref30_2302_db";
/// The environmental database (BFD, MGnify, MetaEuk, SMAG clusters).
pub const ENVDB: &str = "colabfold_envdb_202108_db";

/// The two databases, checked to exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MmseqsDatabases {
    /// UniRef30 (`--mmseqs-uniref-db`).
    pub uniref: PathBuf,
    /// The environmental database (`--mmseqs-env-db`).
    pub env: PathBuf,
}

impl MmseqsDatabases {
    /// The databases from their flags or under `data_dir`; `Err` names each missing one
    /// (a database is there when its `<db>.dbtype` is, as ColabFold checks).
    pub fn resolve(
        data_dir: Option<&Path>,
        uniref: Option<&Path>,
        env: Option<&Path>,
        check: bool,
    ) -> anyhow::Result<MmseqsDatabases> {
        let mut missing = Vec::new();
        let mut path = |given: Option<&Path>, default: &str, flag: &str| -> PathBuf {
            let p = match (given, data_dir) {
                (Some(p), _) => p.to_path_buf(),
                (None, Some(dir)) => dir.join(default),
                (None, None) => {
                    missing.push(format!("--{flag} (or --data-dir)"));
                    return PathBuf::new();
                }
            };
            if check && !with_suffix(&p, ".dbtype").is_file() {
                missing.push(format!("{} (--{flag}) is not an MMseqs2 database (no .dbtype file)", p.display()));
            }
            p
        };
        let uniref = path(uniref, UNIREF30, "mmseqs-uniref-db");
        let env = path(env, ENVDB, "mmseqs-env-db");
        if !missing.is_empty() {
            bail!("MMseqs2 databases missing (--msa-mode mmseqs2):\n  {}", missing.join("\n  "));
        }
        Ok(MmseqsDatabases { uniref, env })
    }
}

/// `path` with `suffix` appended to its file name.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// The member sequences and alignments of `db` (its index when there is one, as ColabFold
/// picks them).
fn members(db: &Path) -> (PathBuf, PathBuf) {
    if with_suffix(db, ".idx").is_file() || with_suffix(db, ".idx.index").is_file() {
        (with_suffix(db, ".idx"), with_suffix(db, ".idx"))
    } else {
        (with_suffix(db, "_seq"), with_suffix(db, "_aln"))
    }
}

/// Runs ColabFold's monomer search for the query in `query_fasta` with `threads` threads in
/// the scratch folder `work`; returns the A3M text (UniRef30's alignment, then the
/// environmental one, each starting with the query).
pub fn search(
    mmseqs: &Tool,
    dbs: &MmseqsDatabases,
    query_fasta: &Path,
    work: &Path,
    threads: usize,
) -> anyhow::Result<String> {
    let w = |name: &str| work.join(name);
    let run = |args: Vec<OsString>, db: &Path| mmseqs.run(&args, db);
    let t = threads.to_string();
    // ColabFold's settings with its default --filter 1 (qsc 0.8, max-accept 100000) and
    // database loading mode 0.
    let search =
        ["--num-iterations", "3", "--db-load-mode", "0", "-a", "-e", "0.1", "--max-seqs", "10000", "-s", "8.0"];
    let filter = [
        "--filter-msa",
        "1",
        "--filter-min-enable",
        "1000",
        "--diff",
        "3000",
        "--qid",
        "0.0,0.2,0.4,0.6,0.8,1.0",
        "--qsc",
        "0",
        "--max-seq-id",
        "0.95",
    ];
    let align = ["--db-load-mode", "0", "-e", "10", "--max-accept", "100000", "--alt-ali", "10", "-a"];
    let filter_result = [
        "--db-load-mode",
        "0",
        "--qid",
        "0",
        "--qsc",
        "0.8",
        "--diff",
        "0",
        "--max-seq-id",
        "1.0",
        "--filter-min-enable",
        "100",
    ];
    let args =
        |words: &[&dyn AsRef<OsStr>]| -> Vec<OsString> { words.iter().map(|w| w.as_ref().to_os_string()).collect() };

    run(args(&[&"createdb", &query_fasta, &w("qdb")]), query_fasta)?;
    let (uniref_seq, uniref_aln) = members(&dbs.uniref);
    let mut a = args(&[&"search", &w("qdb"), &dbs.uniref, &w("res"), &w("tmp"), &"--threads", &t]);
    a.extend(search.map(OsString::from));
    run(a, &dbs.uniref)?;
    run(args(&[&"mvdb", &w("tmp/latest/profile_1"), &w("prof_res")]), &dbs.uniref)?;
    run(args(&[&"lndb", &w("qdb_h"), &w("prof_res_h")]), &dbs.uniref)?;
    let mut a = args(&[&"expandaln", &w("qdb"), &uniref_seq, &w("res"), &uniref_aln, &w("res_exp"), &"--threads", &t]);
    a.extend(
        [
            "--db-load-mode",
            "0",
            "--expansion-mode",
            "0",
            "-e",
            "inf",
            "--expand-filter-clusters",
            "1",
            "--max-seq-id",
            "0.95",
        ]
        .map(OsString::from),
    );
    run(a, &dbs.uniref)?;
    let mut a = args(&[&"align", &w("prof_res"), &uniref_seq, &w("res_exp"), &w("res_exp_realign"), &"--threads", &t]);
    a.extend(align.map(OsString::from));
    run(a, &dbs.uniref)?;
    let mut a = args(&[
        &"filterresult",
        &w("qdb"),
        &uniref_seq,
        &w("res_exp_realign"),
        &w("res_exp_realign_filter"),
        &"--threads",
        &t,
    ]);
    a.extend(filter_result.map(OsString::from));
    run(a, &dbs.uniref)?;
    let mut a = args(&[
        &"result2msa",
        &w("qdb"),
        &uniref_seq,
        &w("res_exp_realign_filter"),
        &w("uniref.a3m"),
        &"--threads",
        &t,
    ]);
    a.extend(["--msa-format-mode", "6", "--db-load-mode", "0"].map(OsString::from));
    a.extend(filter.map(OsString::from));
    run(a, &dbs.uniref)?;

    let (env_seq, env_aln) = members(&dbs.env);
    let mut a = args(&[&"search", &w("prof_res"), &dbs.env, &w("res_env"), &w("tmp3"), &"--threads", &t]);
    a.extend(search.map(OsString::from));
    run(a, &dbs.env)?;
    let mut a =
        args(&[&"expandaln", &w("prof_res"), &env_seq, &w("res_env"), &env_aln, &w("res_env_exp"), &"--threads", &t]);
    a.extend(["-e", "inf", "--expansion-mode", "0", "--db-load-mode", "0"].map(OsString::from));
    run(a, &dbs.env)?;
    let mut a = args(&[
        &"align",
        &w("tmp3/latest/profile_1"),
        &env_seq,
        &w("res_env_exp"),
        &w("res_env_exp_realign"),
        &"--threads",
        &t,
    ]);
    a.extend(align.map(OsString::from));
    run(a, &dbs.env)?;
    let mut a = args(&[
        &"filterresult",
        &w("qdb"),
        &env_seq,
        &w("res_env_exp_realign"),
        &w("res_env_exp_realign_filter"),
        &"--threads",
        &t,
    ]);
    a.extend(filter_result.map(OsString::from));
    run(a, &dbs.env)?;
    let mut a =
        args(&[&"result2msa", &w("qdb"), &env_seq, &w("res_env_exp_realign_filter"), &w("env.a3m"), &"--threads", &t]);
    a.extend(["--msa-format-mode", "6", "--db-load-mode", "0"].map(OsString::from));
    a.extend(filter.map(OsString::from));
    run(a, &dbs.env)?;

    run(args(&[&"mergedbs", &w("qdb"), &w("final.a3m"), &w("uniref.a3m"), &w("env.a3m")]), &dbs.env)?;
    run(
        args(&[&"unpackdb", &w("final.a3m"), &w("out"), &"--unpack-name-mode", &"0", &"--unpack-suffix", &".a3m"]),
        &dbs.env,
    )?;
    let out = w("out/0.a3m");
    std::fs::read_to_string(&out).with_context(|| format!("mmseqs wrote no alignment {}", out.display()))
}
