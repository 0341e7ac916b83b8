//! Liveness of the ranks of a multi-process job, for two failures that timeouts alone report
//! badly:
//!
//! - A rank that dies (SIGKILL, a node lost) under a launcher that does not stop the others:
//!   the survivors' next collective fails (Gloo sees the connection close), and the error
//!   should say *which* peer is gone. Every rank bumps a counter in the rendezvous store a few
//!   times a second; a failed collective reads its peers' counters twice and names those that
//!   stopped (`lost_peers`).
//! - A rank alive but stuck outside collectives (a hung data loader, an endless loop): its
//!   peers wait in a collective until the timeout and then report their own operation. Under
//!   the engine's spawner each rank also sends the spawner a pulse through a pipe a few times
//!   a second, saying how long ago it last made progress (a step, a completed collective) and
//!   whether it is waiting in a collective; the spawner ends the job when a rank has been
//!   neither progressing nor waiting for longer than `--timeout`, and names it
//!   (`Pulses::stalled`). A pipe, not a file: nothing is left on disk when the job is
//!   killed or interrupted.
//!
//! Nothing is enforced before a rank's first progress (start-up: loading data, building the
//! model), and a rank inside a collective is left to the collective's own timeout.
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::dist::store::Store;
use crate::Result;

/// Set by the spawner: the descriptor of the pipe (its write end) each rank sends pulses to,
/// with the pipe's device and inode (`<fd>:<dev>:<ino>`).
pub const HEARTBEAT_FD_ENV: &str = "ENGINE_HEARTBEAT_FD";
/// A pulse: milliseconds since the rank's last progress (`u64::MAX`: none yet) and the number
/// of collectives it is waiting in, as two little-endian u64s. Under `PIPE_BUF`, so each
/// write arrives whole.
const PULSE_BYTES: usize = 16;
/// How often a rank publishes its heartbeat.
const INTERVAL: Duration = Duration::from_millis(250);
/// How long a peer's counter must stand still to count as lost (several intervals: a busy
/// machine may delay a beat or two).
const LOST_AFTER: Duration = Duration::from_millis(1500);

/// Milliseconds since the epoch of this rank's last progress (0: none yet).
static LAST_PROGRESS_MS: AtomicU64 = AtomicU64::new(0);
/// Collectives this rank is waiting in right now.
static WAITING: AtomicUsize = AtomicUsize::new(0);
/// The store the counters live in (set once this rank's heartbeat runs).
static STORE: OnceLock<Store> = OnceLock::new();
/// Set when the job's world is dropped: the heartbeat thread stops touching the store, whose
/// host (rank 0, unless the launcher hosts it) may be exiting.
static STOPPED: AtomicBool = AtomicBool::new(false);

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn counter_key(rank: usize) -> String {
    format!("engine/alive/{rank}")
}

/// Records progress: every completed collective does, and a trainer calls it once per step
/// (so a rank computing long stretches between collectives still shows progress).
pub fn beat() {
    LAST_PROGRESS_MS.store(now_ms(), Ordering::Relaxed);
}

/// Held while waiting in a collective: the spawner does not judge a waiting rank (the
/// collective's timeout does). Completing the wait counts as progress.
pub(crate) struct Waiting;

impl Waiting {
    pub(crate) fn start() -> Waiting {
        WAITING.fetch_add(1, Ordering::Relaxed);
        Waiting
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        WAITING.fetch_sub(1, Ordering::Relaxed);
        beat();
    }
}

/// Starts this rank's heartbeat (once per process): a thread that bumps the rank's counter in
/// `store` and, under the spawner, rewrites its heartbeat file.
pub(crate) fn start(store: &Store, rank: usize) -> Result<()> {
    if STORE.get().is_some() {
        return Ok(());
    }
    let own = store.prefixed("")?;
    let _ = STORE.set(store.prefixed("")?);
    let mut pipe = spawner_pipe();
    std::thread::Builder::new()
        .name(format!("heartbeat-{rank}"))
        .spawn(move || {
            let mut store_answers = true;
            while !STOPPED.load(Ordering::Relaxed) {
                // Failures are not errors: the store's host may be gone (the job is ending), and
                // the heartbeat must never be what fails a job. After one, the store is left
                // alone (libtorch logs every failed request at length).
                store_answers = store_answers && own.add(&counter_key(rank), 1).is_ok();
                if let Some(pipe) = &mut pipe {
                    let _ = pipe.write_all(&pulse());
                }
                std::thread::sleep(INTERVAL);
            }
            // Leaving closes the pipe: the spawner judges nothing of a rank that is finishing.
        })
        .map_err(|e| crate::Error::io("starting the heartbeat thread", e))?;
    Ok(())
}

/// Stops this rank's heartbeat (the job's world is being dropped): no more store traffic while
/// the ranks exit, and the spawner stops judging this rank.
pub(crate) fn stop() {
    STOPPED.store(true, Ordering::Relaxed);
}

/// The pipe the spawner gave this rank (see [`HEARTBEAT_FD_ENV`]), made close-on-exec (the
/// rank's own subprocesses must not hold it open) and non-blocking (a stopped spawner must not
/// block the heartbeat). None outside the spawner, or when the descriptor is not the pipe the
/// variable names: a variable inherited or set by hand must not make the heartbeat write into
/// whatever holds that number here (this process's own interrupt pipe, a redirected stdout).
fn spawner_pipe() -> Option<File> {
    pipe_of(&std::env::var(HEARTBEAT_FD_ENV).ok()?)
}

/// [`spawner_pipe`] for the variable's `value`.
fn pipe_of(value: &str) -> Option<File> {
    let mut fields = value.split(':').map(|f| f.parse::<u64>().ok());
    let (Some(Some(fd)), Some(Some(dev)), Some(Some(ino)), None) =
        (fields.next(), fields.next(), fields.next(), fields.next())
    else {
        return None;
    };
    let fd = RawFd::try_from(fd).ok().filter(|&fd| fd > 2)?;
    // SAFETY: fstat and fcntl only read and set flags of a descriptor number, open or not.
    unsafe {
        if identity(fd) != Some((dev, ino)) {
            return None;
        }
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || flags & libc::O_ACCMODE != libc::O_WRONLY {
            return None;
        }
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        // SAFETY: the spawner's pipe (the same pipe object), which nothing else here owns.
        Some(File::from_raw_fd(fd))
    }
}

/// The device and inode of the pipe open as `fd`; None for a descriptor that is not a pipe.
fn identity(fd: RawFd) -> Option<(u64, u64)> {
    // SAFETY: fstat writes into a zeroed stat of the right type.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd, &mut stat) } != 0 || stat.st_mode & libc::S_IFMT != libc::S_IFIFO {
        return None;
    }
    Some((stat.st_dev as u64, stat.st_ino as u64))
}

/// The [`HEARTBEAT_FD_ENV`] value that gives a rank the write end `fd` of its pipe: the
/// descriptor's number and the pipe's identity, which the rank checks.
pub(crate) fn pipe_variable(fd: RawFd) -> Result<String> {
    let (dev, ino) = identity(fd)
        .ok_or_else(|| crate::Error::io("reading a heartbeat pipe's identity", std::io::Error::last_os_error()))?;
    Ok(format!("{fd}:{dev}:{ino}"))
}

/// This rank's pulse now (see [`PULSE_BYTES`]).
fn pulse() -> [u8; PULSE_BYTES] {
    let since = match LAST_PROGRESS_MS.load(Ordering::Relaxed) {
        0 => u64::MAX,
        at => now_ms().saturating_sub(at),
    };
    let mut bytes = [0; PULSE_BYTES];
    bytes[..8].copy_from_slice(&since.to_le_bytes());
    bytes[8..].copy_from_slice(&(WAITING.load(Ordering::Relaxed) as u64).to_le_bytes());
    bytes
}

/// Which of `ranks` (global ranks, this one excluded) stopped beating: their counters did not
/// move over [`LOST_AFTER`]. None when all beat, or when this rank has no heartbeat. Used to
/// explain a failed collective; it waits [`LOST_AFTER`] to decide.
pub(crate) fn lost_peers(ranks: &[usize], me: usize) -> Option<String> {
    let store = STORE.get()?;
    let peers: Vec<usize> = ranks.iter().copied().filter(|&r| r != me).collect();
    let read = || peers.iter().map(|&r| store.add(&counter_key(r), 0)).collect::<Result<Vec<i64>>>();
    let Ok(before) = read() else {
        return Some("the rendezvous store is unreachable: rank 0, which hosts it, is lost".into());
    };
    std::thread::sleep(LOST_AFTER);
    let Ok(after) = read() else {
        return Some("the rendezvous store is unreachable: rank 0, which hosts it, is lost".into());
    };
    let lost: Vec<String> =
        peers.iter().zip(before.iter().zip(&after)).filter(|(_, (b, a))| a == b).map(|(r, _)| r.to_string()).collect();
    match lost.len() {
        0 => None,
        1 => Some(format!("lost peer: rank {} (no heartbeat for {LOST_AFTER:?})", lost[0])),
        _ => Some(format!("lost peers: ranks {} (no heartbeat for {LOST_AFTER:?})", lost.join(", "))),
    }
}

/// A pipe for one rank's pulses: the spawner's read end, and the write end to pass to the
/// rank (see [`HEARTBEAT_FD_ENV`]; both close-on-exec, so that only the rank it is meant for
/// inherits the write end, once it is cleared there).
pub(crate) fn pipe() -> Result<(File, OwnedFd)> {
    let mut fds: [RawFd; 2] = [-1; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2(2) returns.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(crate::Error::io("creating a heartbeat pipe", std::io::Error::last_os_error()));
    }
    // SAFETY: both descriptors were just opened and are owned by nothing else.
    Ok(unsafe { (File::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// The last pulse from a rank: when it arrived, how long before that the rank last made
/// progress (None: not yet), and whether it was waiting in a collective.
struct Pulse {
    at: Instant,
    since_progress: Option<Duration>,
    waiting: bool,
}

/// The spawner's view of one rank's heartbeat, kept current by a thread reading its pipe.
pub(crate) struct Pulses(Arc<Mutex<Option<Pulse>>>);

impl Pulses {
    /// Reads `pipe` (the read end from [`pipe`]) until the rank closes it or exits. The thread
    /// is not joined: a subprocess the rank started before its heartbeat may hold the pipe.
    pub(crate) fn listen(mut pipe: File) -> Pulses {
        let last = Arc::new(Mutex::new(None));
        let shared = last.clone();
        std::thread::spawn(move || {
            let mut bytes = [0; PULSE_BYTES];
            while pipe.read_exact(&mut bytes).is_ok() {
                let word = |i: usize| u64::from_le_bytes(bytes[i..i + 8].try_into().expect("8 bytes"));
                let pulse = Pulse {
                    at: Instant::now(),
                    since_progress: (word(0) != u64::MAX).then(|| Duration::from_millis(word(0))),
                    waiting: word(8) > 0,
                };
                *shared.lock().unwrap_or_else(|e| e.into_inner()) = Some(pulse);
            }
            // Closed: the rank is finishing (or gone, which the spawner sees by itself).
            *shared.lock().unwrap_or_else(|e| e.into_inner()) = None;
        });
        Pulses(last)
    }

    /// Whether `rank` has been stuck for longer than `timeout`: alive but neither progressing
    /// nor waiting in a collective, or not sending pulses at all (stopped). None while it is
    /// fine, before its first progress, or when it sends no pulses.
    pub(crate) fn stalled(&self, rank: usize, timeout: Duration) -> Option<String> {
        let last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let pulse = last.as_ref()?;
        let silent = pulse.at.elapsed();
        if silent > timeout {
            return Some(format!(
                "rank {rank} stopped responding: no heartbeat for {:.1} s (--timeout {:.1} s)",
                silent.as_secs_f64(),
                timeout.as_secs_f64()
            ));
        }
        let idle = pulse.since_progress.map(|since| since + silent)?;
        if !pulse.waiting && idle > timeout {
            return Some(format!(
                "rank {rank} made no progress for {:.1} s outside collectives (--timeout {:.1} s)",
                idle.as_secs_f64(),
                timeout.as_secs_f64()
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn only_the_pipe_the_variable_names_is_written_to() {
        let (_read, write) = pipe().unwrap();
        let (_other_read, other) = pipe().unwrap();
        let named = pipe_variable(write.as_raw_fd()).unwrap();
        // Another pipe under the number the variable gives (a variable set by hand, or one
        // inherited by a process whose descriptor of that number is something else).
        let (fd, identity) = named.split_once(':').unwrap();
        let stolen = format!("{}:{identity}", other.as_raw_fd());
        for value in [stolen.as_str(), "1", "4", "abc", "-1:0:0", &format!("{fd}:0:0")] {
            assert!(pipe_of(value).is_none(), "{value}");
        }
        let file = pipe_of(&named).expect("the spawner's pipe");
        // The descriptor now belongs to `file`; `write` must not close it again.
        std::mem::forget(write);
        drop(file);
    }
}
