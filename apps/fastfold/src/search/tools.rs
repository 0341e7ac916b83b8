//! Running the search tools (jackhmmer, hhblits) as subprocesses: each with its own thread
//! count, in a scratch folder removed afterwards, its exit status checked. A failure names the
//! tool, the database it searched and the last lines of its stderr, which is where HMMER and
//! HH-suite say what went wrong.
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::{bail, Context};

/// Lines of a failed tool's stderr quoted in the error.
const STDERR_TAIL_LINES: usize = 20;

/// One search program: its name in messages and the binary to run.
#[derive(Clone, Debug)]
pub struct Tool {
    /// What messages call it (`jackhmmer`, `hhblits`).
    pub name: &'static str,
    /// The executable: a path, or a bare name looked up on `PATH`.
    pub binary: PathBuf,
}

impl Tool {
    /// `name`'s binary from `binary` (a flag), else `name` itself on `PATH`.
    pub fn new(name: &'static str, binary: Option<&Path>) -> Tool {
        Tool { name, binary: binary.map_or_else(|| PathBuf::from(name), Path::to_path_buf) }
    }

    /// Runs the tool with `args` against `database` (named in errors only); stdout is
    /// discarded (the tools write their results to files named in `args`).
    pub fn run(&self, args: &[OsString], database: &Path) -> anyhow::Result<()> {
        // A search can take hours: say which tool runs against which database, and for how long
        // (AlphaFold logs the same), so a stuck tool is seen as one.
        eprintln!("running {} against {}", self.name, database.display());
        let start = std::time::Instant::now();
        let mut command = Command::new(&self.binary);
        command.args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
        // A tool outlives no rank: it gets SIGTERM when this process dies (a rank the spawner
        // stops, or one killed), its whole process group does when this one is interrupted
        // (a wrapper script's children included), and it holds none of the rank's
        // descriptors (Gloo's sockets, the interrupt pipe), which libtorch does not open
        // close-on-exec.
        // SAFETY: setpgid, prctl and close_range are async-signal-safe; errors (an old kernel
        // without close_range) leave the tool as it would otherwise be.
        unsafe {
            command.pre_exec(|| {
                libc::setpgid(0, 0);
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, libc::CLOSE_RANGE_CLOEXEC);
                Ok(())
            });
        }
        let output = command
            .spawn()
            .and_then(|child| {
                let _group = data::temporaries::ChildGroup::new(child.id());
                child.wait_with_output()
            })
            .map_err(|e| {
                anyhow::anyhow!(
                    "cannot run {} ({}) against {}: {e}{}",
                    self.name,
                    self.binary.display(),
                    database.display(),
                    match e.kind() {
                        std::io::ErrorKind::NotFound => {
                            " (install HMMER and HH-suite: scripts/setup.sh, or apt-get install hmmer hhsuite, \
                             or give the binary's path with its --*-binary-path flag)"
                        }
                        _ => "",
                    }
                )
            })?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
            let tail = lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..].join("\n");
            bail!(
                "{} failed against {} ({}):\n{}",
                self.name,
                database.display(),
                output.status,
                if tail.is_empty() { "(nothing on stderr)".to_string() } else { tail }
            );
        }
        eprintln!("{} against {}: done in {:.1} s", self.name, database.display(), start.elapsed().as_secs_f64());
        Ok(())
    }
}

/// The threads a tool gets: `requested`, else AlphaFold's count for it (`default`) bounded by
/// the cores there are.
pub fn threads(requested: Option<usize>, default: usize) -> usize {
    requested.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        default.min(cores)
    })
}

/// A scratch folder under the system's temporary directory, removed with everything in it
/// when dropped (also when the search fails half-way, and on Ctrl-C or SIGTERM: it is
/// registered with [`data::temporaries`]).
pub struct WorkDir {
    path: PathBuf,
    _live: data::temporaries::Temporary,
}

impl WorkDir {
    /// A new, empty folder whose name starts with `prefix`.
    pub fn new(prefix: &str) -> anyhow::Result<WorkDir> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("fastfold-{prefix}-{}-{n}", std::process::id()));
        let live = data::temporaries::Temporary::new(&path);
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).with_context(|| format!("creating the scratch folder {}", path.display()))?;
        Ok(WorkDir { path, _live: live })
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
