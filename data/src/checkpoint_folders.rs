//! Checkpoint folders under a training run's output folder: `checkpoint-<step>/` (the names
//! diffusers' scripts and accelerate use) and `latest`, a file naming the newest complete one.
//!
//! A checkpoint is written into [`staging`] (`checkpoint-<step>.tmp/`, which [`begin`] empties),
//! by as many processes as hold parts of it; then one process calls [`commit`], whose only
//! commit point is the atomic rewrite of `latest`: every file in the staging folder is synced
//! (writers need not have synced their own), the folder is renamed to a name no folder has
//! (a step saved again becomes `checkpoint-<step>-<n>`, so `latest`'s old target is never
//! replaced in place), the parent is synced, and only then does `latest` switch and are older
//! checkpoints removed, each renamed away before it is deleted. A crash at any instant leaves
//! `latest` naming a complete checkpoint and no half-deleted folder under a checkpoint's name.
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{sync_dir, Error, Result};

/// The file naming the newest checkpoint folder.
pub const LATEST: &str = "latest";

const PREFIX: &str = "checkpoint-";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

/// The staging folder of step `step`'s checkpoint under `out` (every writer computes the same).
pub fn staging(out: &Path, step: usize) -> PathBuf {
    out.join(format!("{PREFIX}{step}.tmp"))
}

/// A staging folder being written, registered with [`crate::temporaries`] while this lives:
/// the process that began it keeps it until [`commit`], so that Ctrl-C leaves no half-written
/// `checkpoint-<step>.tmp/` behind.
pub struct Staging {
    dir: PathBuf,
    _live: crate::temporaries::Temporary,
}

impl Staging {
    /// The folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// Creates the staging folder of step `step` under `out`, empty (what a crashed attempt left
/// there is removed). One process calls it before any writes into the folder.
pub fn begin(out: &Path, step: usize) -> Result<Staging> {
    let dir = staging(out, step);
    let live = crate::temporaries::Temporary::new(&dir);
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(io(&dir))?;
    }
    fs::create_dir_all(&dir).map_err(io(&dir))?;
    Ok(Staging { dir, _live: live })
}

/// Commits step `step`'s staging folder as described in the module documentation, keeping at
/// most `keep` checkpoints (the new one and the newest others by step; `None` keeps all).
/// Returns the committed folder.
pub fn commit(out: &Path, step: usize, keep: Option<usize>) -> Result<PathBuf> {
    let tmp = staging(out, step);
    sync_tree(&tmp)?;
    let name = fresh_name(out, step);
    let dir = out.join(&name);
    fs::rename(&tmp, &dir).map_err(io(&dir))?;
    sync_dir(out)?;
    crate::write_atomic::<Error>(&out.join(LATEST), |w| w.write_all(name.as_bytes()).map_err(io(&out.join(LATEST))))?;
    let mut others: Vec<(usize, usize, PathBuf)> =
        committed_with_keys(out)?.into_iter().filter(|(_, _, p)| *p != dir).collect();
    others.sort();
    let remove = match keep {
        Some(k) => others.len().saturating_sub(k.saturating_sub(1)),
        None => 0,
    };
    for (_, _, path) in others.into_iter().take(remove) {
        remove_folder(&path)?;
    }
    // Staging folders of attempts that never committed, and removals a crash interrupted.
    for entry in fs::read_dir(out).map_err(io(out))? {
        let path = entry.map_err(io(out))?.path();
        let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        if file.starts_with(PREFIX) && (file.ends_with(".tmp") || file.ends_with(".removing")) && path.is_dir() {
            fs::remove_dir_all(&path).map_err(io(&path))?;
        }
    }
    Ok(dir)
}

/// Writes step `step`'s checkpoint under `out` from every process of a job and commits it,
/// keeping at most `keep`: the process of `rank` 0 begins the staging folder (held until the
/// commit, so that Ctrl-C removes it half-written), every process writes its part into it
/// (`write`), then rank 0 commits. `barrier` (the job's) separates the three, and the others
/// wait for the commit, so that none runs ahead of a checkpoint that could fail.
pub fn save_from_ranks<E: From<Error>>(
    out: &Path,
    step: usize,
    rank: usize,
    keep: Option<usize>,
    barrier: impl Fn() -> std::result::Result<(), E>,
    write: impl FnOnce(&Path) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let _staging = (rank == 0).then(|| begin(out, step)).transpose()?;
    barrier()?;
    write(&staging(out, step))?;
    barrier()?;
    if rank == 0 {
        commit(out, step, keep)?;
    }
    barrier()
}

/// The tensors of every `<prefix>*.safetensors` file in checkpoint folder `dir` (one per rank
/// that held a part of the state) in one dictionary by name, so that a run on another number
/// of ranks takes its own entries wherever they were saved. No such file is an error naming
/// the folder and what was looked for.
pub fn read_rank_files(dir: &Path, prefix: &str) -> Result<std::collections::HashMap<String, tch::Tensor>> {
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(io(dir))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            name.starts_with(prefix) && name.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::Format { path: dir.to_path_buf(), msg: format!("no {prefix}*.safetensors") });
    }
    let mut dict = std::collections::HashMap::new();
    for path in &files {
        dict.extend(crate::checkpoint::read_tensors(path)?);
    }
    Ok(dict)
}

/// The committed checkpoint folders under `out`, oldest first (by step, then by the suffix of a
/// step saved again).
pub fn committed(out: &Path) -> Result<Vec<PathBuf>> {
    let mut all = committed_with_keys(out)?;
    all.sort();
    Ok(all.into_iter().map(|(_, _, p)| p).collect())
}

/// The checkpoint folder `out/latest` names: `None` when there is no `latest` (nothing was ever
/// committed under `out`), an error naming both when it names a folder that is not there.
pub fn latest(out: &Path) -> Result<Option<PathBuf>> {
    let pointer = out.join(LATEST);
    let name = match fs::read_to_string(&pointer) {
        Ok(name) => name,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::Io { path: pointer, source: e }),
    };
    let name = name.trim();
    let dir = out.join(name);
    if parse(name).is_none() || !dir.is_dir() {
        return Err(Error::Format {
            path: pointer,
            msg: format!("names {:?}, which is not a checkpoint folder under {}", name, out.display()),
        });
    }
    Ok(Some(dir))
}

/// The file in a checkpoint folder that records a trainer's step and the settings a resume
/// must agree with (each app's own fields, as JSON).
pub const TRAINER_STATE: &str = "trainer.json";

/// Writes `state` to `dir`'s [`TRAINER_STATE`] (pretty JSON, replaced atomically).
pub fn write_trainer_state<S: serde::Serialize>(dir: &Path, state: &S) -> Result<()> {
    let path = dir.join(TRAINER_STATE);
    let json = serde_json::to_string_pretty(state)
        .map_err(|e| Error::Format { path: path.clone(), msg: format!("cannot write the trainer state: {e}") })?;
    crate::write_atomic::<Error>(&path, |w| w.write_all(json.as_bytes()).map_err(io(&path)))
}

/// Reads `dir`'s [`TRAINER_STATE`]; an error names the file, and what it should have been
/// (`what`, e.g. "a vit pretrain trainer state") when it cannot be read as one.
pub fn read_trainer_state<S: serde::de::DeserializeOwned>(dir: &Path, what: &str) -> Result<S> {
    let path = dir.join(TRAINER_STATE);
    let text = fs::read_to_string(&path).map_err(io(&path))?;
    serde_json::from_str(&text).map_err(|e| Error::Format { path, msg: format!("not {what}: {e}") })
}

/// (step, suffix) of a committed checkpoint's folder name: `checkpoint-<step>` is (step, 1),
/// `checkpoint-<step>-<n>` is (step, n).
fn parse(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix(PREFIX)?;
    let (step, n) = match rest.split_once('-') {
        Some((step, n)) => (step, n.parse().ok()?),
        None => (rest, 1),
    };
    Some((step.parse().ok()?, n))
}

fn committed_with_keys(out: &Path) -> Result<Vec<(usize, usize, PathBuf)>> {
    let mut all = vec![];
    for entry in fs::read_dir(out).map_err(io(out))? {
        let path = entry.map_err(io(out))?.path();
        let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        if let (Some((step, n)), true) = (parse(&file), path.is_dir()) {
            all.push((step, n, path));
        }
    }
    Ok(all)
}

/// `checkpoint-<step>`, or `checkpoint-<step>-<n>` with the first `n` no entry under `out` has.
fn fresh_name(out: &Path, step: usize) -> String {
    let base = format!("{PREFIX}{step}");
    std::iter::once(base.clone())
        .chain((2..).map(|n| format!("{base}-{n}")))
        .find(|name| !out.join(name).exists())
        .unwrap_or(base)
}

/// Renames a committed folder out of the checkpoints' names, then deletes it.
fn remove_folder(path: &Path) -> Result<()> {
    let mut doomed = path.as_os_str().to_owned();
    doomed.push(".removing");
    let doomed = PathBuf::from(doomed);
    fs::rename(path, &doomed).map_err(io(path))?;
    fs::remove_dir_all(&doomed).map_err(io(&doomed))
}

/// Syncs every file and folder under `dir`, and `dir` itself.
fn sync_tree(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let path = entry.path();
        if entry.file_type().map_err(io(&path))?.is_dir() {
            sync_tree(&path)?;
        } else {
            fs::File::open(&path).and_then(|f| f.sync_all()).map_err(io(&path))?;
        }
    }
    sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn save(out: &Path, step: usize, keep: Option<usize>) -> PathBuf {
        let staging = begin(out, step).unwrap();
        fs::create_dir_all(staging.dir().join("unet")).unwrap();
        fs::write(staging.dir().join("unet/weights"), step.to_string()).unwrap();
        commit(out, step, keep).unwrap()
    }

    fn names(out: &Path) -> Vec<String> {
        let mut n: Vec<String> =
            fs::read_dir(out).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        n.sort();
        n
    }

    #[test]
    fn keeps_the_newest_and_latest_names_a_complete_folder() {
        let out = crate::scratch("ckpt-keep");
        assert_eq!(latest(&out).unwrap(), None, "nothing committed yet");
        for step in [2, 4, 6, 8] {
            let dir = save(&out, step, Some(2));
            assert_eq!(latest(&out).unwrap(), Some(dir.clone()));
            assert_eq!(fs::read_to_string(dir.join("unet/weights")).unwrap(), step.to_string());
        }
        assert_eq!(names(&out), ["checkpoint-6", "checkpoint-8", "latest"]);
        // A step saved again (after resuming from an older checkpoint) gets a fresh name, and
        // the new checkpoint is kept even where older steps are newer by number.
        let dir = save(&out, 8, Some(2));
        assert_eq!(dir.file_name().unwrap(), "checkpoint-8-2");
        assert_eq!(names(&out), ["checkpoint-8", "checkpoint-8-2", "latest"]);
        let dir = save(&out, 4, Some(1));
        assert_eq!(names(&out), ["checkpoint-4", "latest"]);
        assert_eq!(latest(&out).unwrap(), Some(dir));
        save(&out, 6, None);
        save(&out, 10, None);
        let all: Vec<_> = committed(&out).unwrap().iter().map(|p| p.file_name().unwrap().to_owned()).collect();
        assert_eq!(all, ["checkpoint-4", "checkpoint-6", "checkpoint-10"]);
    }

    #[test]
    fn a_crashed_attempt_is_never_latest_and_is_cleaned_up() {
        let out = crate::scratch("ckpt-crash");
        save(&out, 2, None);
        // A crash while writing step 4 leaves its staging folder, and one during a removal a
        // renamed-away folder: neither is a checkpoint.
        let stale = begin(&out, 4).unwrap();
        fs::write(stale.dir().join("half"), b"x").unwrap();
        fs::create_dir_all(out.join("checkpoint-1.removing")).unwrap();
        assert_eq!(latest(&out).unwrap().unwrap().file_name().unwrap(), "checkpoint-2");
        assert_eq!(committed(&out).unwrap().len(), 1);
        let again = begin(&out, 4).unwrap();
        assert!(!again.dir().join("half").exists(), "begin starts from an empty folder");
        save(&out, 4, None);
        assert_eq!(names(&out), ["checkpoint-2", "checkpoint-4", "latest"]);
    }

    #[test]
    fn a_dangling_latest_is_an_error_naming_it() {
        let out = crate::scratch("ckpt-dangling");
        fs::write(out.join(LATEST), "checkpoint-9").unwrap();
        let err = latest(&out).unwrap_err().to_string();
        assert!(err.contains("latest") && err.contains("checkpoint-9"), "{err}");
        // Only a checkpoint folder's name: not the output folder itself, nor its parent.
        for name in [".", "..", "/"] {
            fs::write(out.join(LATEST), name).unwrap();
            let err = latest(&out).unwrap_err().to_string();
            assert!(err.contains("which is not a checkpoint folder"), "{name}: {err}");
        }
    }
}
