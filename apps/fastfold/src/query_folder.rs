//! One query's output folder, `out/<name>/`, as a `predict` run replaces it: the run's files
//! (its raw `features.npz`, the models' PDBs, confidence and raw outputs, the ranking, the
//! timings and the plots) are written to a staging folder beside it and moved in only when every model has
//! run, after the previous run's files are removed. So a folder never mixes two runs (a stale
//! `ranked_4.pdb` from a run of five models beside a new run of three), a failed or
//! interrupted run leaves the previous run's files as they were, and a new query's folder
//! appears only complete. The homology search's alignments (`msas/`) are written in place as
//! the search goes, and kept after a failure for `--use-precomputed-msas`.
use std::path::{Path, PathBuf};

use anyhow::Context;
use data::temporaries::Temporary;

/// The files every `predict` run writes to a query's folder, whatever its models.
const FIXED_OUTPUTS: [&str; 3] = ["features.npz", "ranking_debug.json", "timings.json"];
/// What `predict` writes per model, after the model's name (see `predict::write_outputs`).
const MODEL_OUTPUTS: [&str; 3] = ["_unrelaxed.pdb", "_confidence.json", "_outputs.npz"];

/// Whether `name` is `ranked_<n>.pdb`.
fn is_ranked_pdb(name: &str) -> bool {
    let ranked = name.strip_prefix("ranked_").and_then(|r| r.strip_suffix(".pdb"));
    ranked.is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
}

/// The models of the previous run in `dir`, as its `ranking_debug.json` names them (its
/// `"order"`); none without the file. Names that are not plain file-name parts are left out,
/// so that a hand-edited file cannot point the removal outside the folder.
fn previous_models(dir: &Path) -> Vec<String> {
    let path = dir.join("ranking_debug.json");
    let Ok(text) = std::fs::read_to_string(&path) else { return Vec::new() };
    // An unreadable ranking leaves the model files in place (they may be the user's), rather
    // than failing a run whose models have all run; the ranking itself is replaced.
    let order = serde_json::from_str::<serde_json::Value>(&text).ok().and_then(|v| v.get("order").cloned());
    let names = order.as_ref().and_then(|o| o.as_array()).map(Vec::as_slice).unwrap_or_default();
    names
        .iter()
        .filter_map(|n| n.as_str())
        .filter(|n| !n.is_empty() && !n.contains(['/', '\0']))
        .map(str::to_string)
        .collect()
}

/// The files of the previous `predict` run in `dir` (so they go when a new run's files come
/// in): the fixed names, `ranked_<n>.pdb`, the query's plots (`<query>_pae.png`, ...), and
/// the files of the models its `ranking_debug.json` lists. Only those: a user's `af_reference_confidence.json` beside
/// them is not a run's. `msas/` is the search's, rewritten by the search itself.
fn previous_outputs(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let models = previous_models(dir);
    let plots = dir.file_name().map(|q| crate::plots::file_names(&q.to_string_lossy())).unwrap_or_default();
    let is_output = |name: &str| {
        FIXED_OUTPUTS.contains(&name)
            || is_ranked_pdb(name)
            || plots.iter().any(|p| p == name)
            || models.iter().any(|m| MODEL_OUTPUTS.iter().any(|s| name.strip_prefix(m.as_str()) == Some(s)))
    };
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry.with_context(|| format!("reading {}", dir.display()))?.path();
        if path.file_name().and_then(|n| n.to_str()).is_some_and(is_output) && path.is_file() {
            found.push(path);
        }
    }
    Ok(found)
}

/// The process id in the name of a staging folder of query `name`
/// (`.<name>.partial-<pid>`).
fn staging_pid(folder: &str, name: &str) -> Option<i32> {
    let pid = folder.strip_prefix(&format!(".{name}.partial-"))?;
    // Digits only: `.a.partial-1.partial-7` is query `a.partial-1`'s, not `a`'s.
    match pid.bytes().all(|b| b.is_ascii_digit()) {
        true => pid.parse().ok().filter(|&p| p > 0),
        false => None,
    }
}

/// Whether no process `pid` exists: `kill(pid, 0)` fails with ESRCH. (EPERM means another
/// user's process holds the id: alive.)
fn process_is_gone(pid: i32) -> bool {
    // SAFETY: signal 0 sends nothing; kill(2) only checks that the process exists.
    let status = unsafe { libc::kill(pid, 0) };
    status != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Removes the staging folders of query `name` in `out` left by runs that were killed
/// outright (SIGKILL, the OOM killer), which no handler removes: those whose process is gone.
/// A live run's staging folder is left alone. (A run on another machine writing to a shared
/// `out` has a process id this machine does not know: do not run two machines on one query.)
fn remove_abandoned_staging(out: &Path, name: &str) {
    let Ok(entries) = std::fs::read_dir(out) else { return };
    for entry in entries.flatten() {
        let folder = entry.file_name();
        let pid = folder.to_str().and_then(|f| staging_pid(f, name));
        if pid.is_some_and(process_is_gone) {
            // A leftover that cannot be removed does not stop this run.
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A query folder being written by this run.
pub struct QueryFolder {
    /// The query's folder, `out/<name>`.
    pub dir: PathBuf,
    /// Where this run's files go until [`QueryFolder::commit`].
    pub staging: PathBuf,
    /// The staging folder's registration, so that an interrupt removes it.
    _live: Temporary,
}

impl QueryFolder {
    /// The folder `out/<name>` and an empty staging folder beside it; the staging folders of
    /// this query's earlier runs whose process is gone are removed first.
    pub fn open(out: &Path, name: &str) -> anyhow::Result<QueryFolder> {
        let dir = out.join(name);
        let staging = out.join(format!(".{name}.partial-{}", std::process::id()));
        remove_abandoned_staging(out, name);
        let _ = std::fs::remove_dir_all(&staging);
        std::fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
        let live = Temporary::new(&staging);
        Ok(QueryFolder { dir, staging, _live: live })
    }

    /// Replaces the previous run's outputs in the folder with this run's.
    pub fn commit(self) -> anyhow::Result<()> {
        let dir = &self.dir;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        for path in previous_outputs(dir)? {
            std::fs::remove_file(&path).with_context(|| format!("removing the earlier {}", path.display()))?;
        }
        for entry in std::fs::read_dir(&self.staging).with_context(|| format!("reading {}", self.staging.display()))? {
            let from = entry?.path();
            let to = dir.join(from.file_name().unwrap_or_default());
            std::fs::rename(&from, &to).with_context(|| format!("moving {} to {}", from.display(), to.display()))?;
        }
        std::fs::remove_dir(&self.staging).with_context(|| format!("removing {}", self.staging.display()))?;
        Ok(data::sync_dir(dir)?)
    }
}

impl Drop for QueryFolder {
    fn drop(&mut self) {
        // Gone after a commit; what a failure leaves otherwise.
        let _ = std::fs::remove_dir_all(&self.staging);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> suite_tests::Scratch {
        suite_tests::scratch("fastfold-query-folder", name)
    }

    fn names(dir: &Path) -> std::collections::BTreeSet<String> {
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect()
    }

    fn touch(dir: &Path, files: &[&str]) {
        for f in files {
            std::fs::write(dir.join(f), "x").unwrap();
        }
    }

    #[test]
    fn a_commit_removes_the_previous_runs_files_and_not_the_users() {
        // The old rule removed any name ending in `_confidence.json`, `_outputs.npz` or
        // `_unrelaxed.pdb`: the user's reference files below went with the run's.
        let out = scratch("commit");
        let q = out.join("q");
        std::fs::create_dir_all(q.join("msas")).unwrap();
        let previous = [
            "features.npz",
            "timings.json",
            "ranked_0.pdb",
            "ranked_1.pdb",
            "model_1_unrelaxed.pdb",
            "model_1_confidence.json",
            "model_1_outputs.npz",
            "model_2_ptm_unrelaxed.pdb",
            "model_2_ptm_confidence.json",
        ];
        let users = ["af_reference_confidence.json", "crystal_unrelaxed.pdb", "mine_outputs.npz", "notes.txt"];
        touch(&q, &previous);
        touch(&q, &users);
        std::fs::write(q.join("ranking_debug.json"), r#"{"plddts": {}, "order": ["model_2_ptm", "model_1"]}"#).unwrap();
        let folder = QueryFolder::open(&out, "q").unwrap();
        touch(&folder.staging, &["model_3_unrelaxed.pdb", "ranked_0.pdb", "ranking_debug.json"]);
        folder.commit().unwrap();
        let mut want: std::collections::BTreeSet<String> = users.iter().map(|s| s.to_string()).collect();
        want.extend(["msas", "model_3_unrelaxed.pdb", "ranked_0.pdb", "ranking_debug.json"].map(String::from));
        assert_eq!(names(&q), want);
        assert_eq!(names(&out), ["q".to_string()].into(), "the staging folder moved in");
    }

    #[test]
    fn without_a_ranking_only_the_fixed_names_go() {
        let out = scratch("no-ranking");
        let q = out.join("q");
        std::fs::create_dir_all(&q).unwrap();
        touch(
            &q,
            &["features.npz", "timings.json", "ranked_3.pdb", "ranked_.pdb", "ranked_x.pdb", "model_1_unrelaxed.pdb"],
        );
        // A ranking whose model names point elsewhere removes nothing there.
        std::fs::write(out.join("escape_unrelaxed.pdb"), "x").unwrap();
        let folder = QueryFolder::open(&out, "q").unwrap();
        folder.commit().unwrap();
        let want = ["model_1_unrelaxed.pdb", "ranked_.pdb", "ranked_x.pdb"].map(String::from).into();
        assert_eq!(names(&q), want);

        std::fs::write(q.join("ranking_debug.json"), r#"{"order": ["../escape", "", 3]}"#).unwrap();
        QueryFolder::open(&out, "q").unwrap().commit().unwrap();
        assert!(out.join("escape_unrelaxed.pdb").exists());
    }

    #[test]
    fn open_removes_the_staging_of_killed_runs_of_the_query_only() {
        // A run killed outright (SIGKILL, the OOM killer) leaves its staging folder; the old
        // `open` removed only its own process's.
        let out = scratch("abandoned");
        let mut exited = std::process::Command::new("true").spawn().unwrap();
        exited.wait().unwrap();
        let mut live = std::process::Command::new("sleep").arg("60").spawn().unwrap();
        let dead = format!(".q.partial-{}", exited.id());
        let running = format!(".q.partial-{}", live.id());
        let other_query = format!(".other.partial-{}", exited.id());
        let longer_name = format!(".q.partial-1.partial-{}", exited.id());
        for d in [&dead, &running, &other_query, &longer_name] {
            std::fs::create_dir_all(out.join(d).join("sub")).unwrap();
            touch(&out.join(d), &["ranked_0.pdb"]);
        }
        let folder = QueryFolder::open(&out, "q").unwrap();
        let left = names(&out);
        let _ = live.kill();
        let _ = live.wait();
        assert!(!left.contains(&dead), "the exited run's staging stays: {left:?}");
        for d in [&running, &other_query, &longer_name] {
            assert!(left.contains(d), "{d} was removed: {left:?}");
        }
        assert!(left.contains(folder.staging.file_name().unwrap().to_str().unwrap()));
        drop(folder);
    }

    #[test]
    fn staging_folder_names_give_their_process() {
        assert_eq!(staging_pid(".q.partial-123", "q"), Some(123));
        for (folder, name) in
            [(".q.partial-", "q"), (".q.partial-0", "q"), (".q.partial-12x", "q"), (".qq.partial-5", "q")]
        {
            assert_eq!(staging_pid(folder, name), None, "{folder}");
        }
        assert!(process_is_gone(i32::MAX - 1) && !process_is_gone(std::process::id() as i32));
    }
}
