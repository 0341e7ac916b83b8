//! The local spawner behind every binary's `--nproc N`: re-executes a program N times with
//! torchrun's environment variables (fork and exec: no rank runs in a forked copy of a process
//! that has started libtorch), hosts the job's rendezvous store as torchrun's agent does,
//! prefixes each rank's output, and when one rank fails stops the others and reports which
//! rank failed and why. With a heartbeat timeout it also ends a job whose rank is stuck
//! outside collectives (see [`super::heartbeat`]), naming that rank.
use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::heartbeat;
use super::store::Store;
use crate::{Error, Result};

/// Lines of each rank's output kept for the failure report.
const TAIL_LINES: usize = 20;
/// How long stopped ranks get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(3);
/// After a rank's failure is seen, how long the others may still fail by themselves before
/// they are stopped: a rank whose peer died fails moments later, and the report should name
/// the rank that failed first, not whichever the polling loop happened to look at first.
const FAILURE_WINDOW: Duration = Duration::from_millis(200);

/// What to run and how.
#[derive(Clone, Debug)]
pub struct SpawnOptions {
    /// Number of ranks.
    pub nproc: usize,
    /// Program to run (by default this process's own executable).
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// Print every rank's output, prefixed with `[rank N]`; otherwise output is only kept for
    /// the failure report.
    pub echo: bool,
    /// End the job when a rank makes no progress outside collectives for this long (the
    /// binaries pass their `--timeout`); None: no heartbeat.
    pub heartbeat: Option<Duration>,
}

impl SpawnOptions {
    /// Re-run this process's own executable with its own arguments.
    pub fn this_program(nproc: usize) -> Result<SpawnOptions> {
        let program = std::env::current_exe().map_err(|e| Error::io("finding this program's executable", e))?;
        Ok(SpawnOptions {
            nproc,
            program,
            args: std::env::args_os().skip(1).collect(),
            env: vec![],
            echo: true,
            heartbeat: None,
        })
    }
}

struct Rank {
    child: Child,
    tail: Arc<Mutex<VecDeque<String>>>,
    /// When the rank's output streams first reached their end: the moment it exited, give or
    /// take the readers' lag (unlike `try_wait`, which sees exits only when polled).
    output_ended: Arc<OnceLock<Instant>>,
    readers: Vec<JoinHandle<()>>,
    /// Its heartbeat, when the job has one.
    pulses: Option<heartbeat::Pulses>,
    status: Option<ExitStatus>,
}

/// Runs the job and waits for it. Ok when every rank exits successfully; otherwise the error
/// names the first rank that failed, its exit status and the last lines it printed.
pub fn spawn(opts: &SpawnOptions) -> Result<()> {
    if opts.nproc == 0 {
        return Err(Error::invalid("--nproc must be at least 1"));
    }
    // The spawner hosts the job's store, as torchrun's agent does: bound here before any rank
    // starts, it cannot be taken by another process in between, and it outlives a failed rank.
    let store = Store::agent(super::launch::DEFAULT_TIMEOUT)?;
    let port = store.port().expect("a TCP store has a port");
    // Each rank gets an even share of the cores for its intra-op threads, as torchrun does;
    // oversubscribed OpenMP threads make every collective wait on the slowest rank.
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).div_ceil(opts.nproc).max(1);
    let mut ranks = Vec::with_capacity(opts.nproc);
    for rank in 0..opts.nproc {
        let mut cmd = Command::new(&opts.program);
        cmd.args(&opts.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", opts.nproc.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", opts.nproc.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(super::launch::AGENT_STORE_ENV, "True")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            cmd.env("OMP_NUM_THREADS", threads.to_string());
        }
        for (k, v) in &opts.env {
            cmd.env(k, v);
        }
        let pipe = opts.heartbeat.map(|_| heartbeat::pipe()).transpose()?;
        let pulse_fd = pipe.as_ref().map(|(_, write)| write.as_raw_fd());
        if let Some(fd) = pulse_fd {
            cmd.env(heartbeat::HEARTBEAT_FD_ENV, heartbeat::pipe_variable(fd)?);
        }
        // A rank outlives no spawner: if this process dies (killed by a scheduler, say), the
        // kernel sends each rank SIGTERM. The rank keeps its heartbeat pipe across exec.
        unsafe {
            cmd.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                if let Some(fd) = pulse_fd {
                    libc::fcntl(fd, libc::F_SETFD, 0);
                }
                Ok(())
            });
        }
        let spawned = cmd.spawn();
        // The rank has its copy of the write end now (or never will): the reader sees the
        // pipe close when the rank closes it.
        let pulses = pipe.map(|(read, _write)| heartbeat::Pulses::listen(read));
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                stop(&mut ranks);
                return Err(Error::io(format!("starting rank {rank} ({})", opts.program.display()), e));
            }
        };
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let output_ended = Arc::new(OnceLock::new());
        let readers = vec![
            forward(child.stdout.take().expect("piped"), rank, opts.echo, false, tail.clone(), output_ended.clone()),
            forward(child.stderr.take().expect("piped"), rank, opts.echo, true, tail.clone(), output_ended.clone()),
        ];
        ranks.push(Rank { child, tail, output_ended, readers, pulses, status: None });
    }
    let result = supervise(&mut ranks, opts.heartbeat);
    for r in &mut ranks {
        for h in r.readers.drain(..) {
            let _ = h.join();
        }
    }
    result.map_err(|(failed, why)| report(&ranks, failed, why))
}

/// Spawns `nproc` copies of this program when `nproc > 1` and this process was not itself
/// started by a launcher; returns whether it did (the caller then exits with the result).
/// `timeout` is also the heartbeat limit (see [`SpawnOptions::heartbeat`]).
pub fn maybe_relaunch(nproc: usize, timeout: Duration) -> Result<bool> {
    if let Some(env) = super::launch::LaunchEnv::from_env()? {
        // Under a launcher it decides the ranks; a --nproc that disagrees would be ignored
        // silently (the spawner's own ranks carry their --nproc, which agrees).
        if nproc > 1 && nproc != env.local_world_size && nproc != env.world_size {
            return Err(Error::invalid(format!(
                "--nproc {nproc}, but this process is {}: the launcher decides the ranks (drop --nproc, or \
                 unset its variables to spawn {nproc} ranks here)",
                env.describe()
            )));
        }
        return Ok(false);
    }
    if nproc <= 1 {
        return Ok(false);
    }
    spawn(&SpawnOptions { heartbeat: Some(timeout), ..SpawnOptions::this_program(nproc)? })?;
    Ok(true)
}

/// Why supervision ended a job: the rank, and a reason when it did not exit by itself.
type Failure = (usize, Option<String>);

/// Waits for all ranks; on the first failure (an exit, or a heartbeat stalled for longer than
/// `heartbeat`) stops the rest and returns the rank.
fn supervise(ranks: &mut [Rank], heartbeat: Option<Duration>) -> std::result::Result<(), Failure> {
    let mut next_check = Instant::now();
    loop {
        let (running, failed) = poll(ranks);
        if !failed.is_empty() {
            return Err((first_to_fail(ranks, failed), None));
        }
        if running == 0 {
            return Ok(());
        }
        if let Some(timeout) = heartbeat.filter(|_| Instant::now() >= next_check) {
            next_check = Instant::now() + Duration::from_millis(250);
            let stalled = (0..ranks.len())
                .filter(|&i| ranks[i].status.is_none())
                .find_map(|i| ranks[i].pulses.as_ref()?.stalled(i, timeout).map(|why| (i, why)));
            if let Some((i, why)) = stalled {
                stop(ranks);
                return Err((i, Some(why)));
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Records the exits of ranks still running; returns how many still run and which failed.
fn poll(ranks: &mut [Rank]) -> (usize, Vec<usize>) {
    let (mut running, mut failed) = (0, vec![]);
    for (i, r) in ranks.iter_mut().enumerate().filter(|(_, r)| r.status.is_none()) {
        match r.child.try_wait() {
            Ok(Some(status)) => {
                r.status = Some(status);
                if !status.success() {
                    failed.push(i);
                }
            }
            Ok(None) => running += 1,
            // A rank that cannot be waited for counts as failed (`report` says so).
            Err(_) => failed.push(i),
        }
    }
    (running, failed)
}

/// Given the ranks seen failing, lets the others fail by themselves for [`FAILURE_WINDOW`],
/// stops the rest, and returns the failed rank whose output ended first: the one that failed
/// first, whose loss the others' errors ("connection closed by peer") are the echo of.
fn first_to_fail(ranks: &mut [Rank], mut failed: Vec<usize>) -> usize {
    let window_ends = Instant::now() + FAILURE_WINDOW;
    while Instant::now() < window_ends {
        std::thread::sleep(Duration::from_millis(20));
        failed.extend(poll(ranks).1);
    }
    stop(ranks);
    let ended = |i: usize| ranks[i].output_ended.get().copied();
    // Earliest end first; a rank whose readers have not seen the end yet goes last; ties by rank.
    failed.into_iter().min_by_key(|&i| (ended(i).is_none(), ended(i), i)).expect("at least one failed rank")
}

/// SIGTERM to every rank still running, then SIGKILL after a grace period.
fn stop(ranks: &mut [Rank]) {
    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
        unsafe { libc::kill(r.child.id() as i32, libc::SIGTERM) };
    }
    let deadline = Instant::now() + GRACE;
    for r in ranks.iter_mut().filter(|r| r.status.is_none()) {
        loop {
            if let Ok(Some(status)) = r.child.try_wait() {
                r.status = Some(status);
                break;
            }
            if Instant::now() >= deadline {
                let _ = r.child.kill();
                r.status = r.child.wait().ok();
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn report(ranks: &[Rank], failed: usize, why: Option<String>) -> Error {
    let status = ranks[failed].status.map_or("could not be waited for".to_string(), describe_status);
    let tail = ranks[failed].tail.lock().map(|t| t.iter().cloned().collect::<Vec<_>>().join("\n")).unwrap_or_default();
    let mut msg = match why {
        Some(why) => format!("rank {failed} failed: {why}"),
        None => format!("rank {failed} failed ({status})"),
    };
    if ranks.len() > 1 {
        msg.push_str("; the other ranks were stopped");
    }
    if !tail.is_empty() {
        msg.push_str(&format!("\nlast output of rank {failed}:\n{tail}"));
    }
    Error::RankFailed(msg)
}

fn describe_status(s: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit code {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => s.to_string(),
    }
}

fn forward(
    stream: impl Read + Send + 'static,
    rank: usize,
    echo: bool,
    is_stderr: bool,
    tail: Arc<Mutex<VecDeque<String>>>,
    ended: Arc<OnceLock<Instant>>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { break };
            if echo {
                let prefixed = format!("[rank {rank}] {line}\n");
                // A closed stdout (say, `| head`) must not take the job down.
                let _ = if is_stderr {
                    std::io::stderr().write_all(prefixed.as_bytes())
                } else {
                    std::io::stdout().write_all(prefixed.as_bytes())
                };
            }
            if let Ok(mut t) = tail.lock() {
                if t.len() == TAIL_LINES {
                    t.pop_front();
                }
                t.push_back(line);
            }
        }
        let _ = ended.set(Instant::now());
    })
}
