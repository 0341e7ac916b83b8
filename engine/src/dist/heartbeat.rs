//! Liveness of the ranks of a multi-process job, for two failures that timeouts alone report
//! badly:
//!
//! - A rank that dies (SIGKILL, a node lost) under a launcher that does not stop the others:
//!   the survivors' next collective fails (Gloo sees the connection close), and the error
//!   should say *which* peer is gone. Every rank bumps a counter in the rendezvous store a few
//!   times a second; a failed collective reads its peers' counters twice and names those that
//!   stopped ([`lost_peers`]).
//! - A rank alive but stuck outside collectives (a hung data loader, an endless loop): its
//!   peers wait in a collective until the timeout and then report their own operation. Under
//!   the engine's spawner each rank also writes a small heartbeat file saying when it last
//!   made progress (a step, a completed collective) and whether it is waiting in a
//!   collective; the spawner ends the job when a rank has been neither progressing nor
//!   waiting for longer than `--timeout`, and names it ([`stalled`]).
//!
//! Nothing is enforced before a rank's first progress (start-up: loading data, building the
//! model), and a rank inside a collective is left to the collective's own timeout.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::dist::store::Store;
use crate::Result;

/// Set by the spawner: the folder where each rank writes its heartbeat file.
pub const HEARTBEAT_DIR_ENV: &str = "ENGINE_HEARTBEAT_DIR";
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
    let file = std::env::var_os(HEARTBEAT_DIR_ENV).map(|d| file_of(Path::new(&d), rank));
    std::thread::Builder::new()
        .name(format!("heartbeat-{rank}"))
        .spawn(move || {
            while !STOPPED.load(Ordering::Relaxed) {
                // Failures are ignored: the store's host may be gone (the job is ending), and
                // the heartbeat must never be what fails a job.
                let _ = own.add(&counter_key(rank), 1);
                if let Some(path) = &file {
                    let _ = write_pulse(path);
                }
                std::thread::sleep(INTERVAL);
            }
            // No file: the spawner judges nothing of a rank that is finishing.
            if let Some(path) = &file {
                let _ = std::fs::remove_file(path);
            }
        })
        .map_err(|e| crate::Error::io("starting the heartbeat thread", e))?;
    Ok(())
}

/// Stops this rank's heartbeat (the job's world is being dropped): no more store traffic while
/// the ranks exit, and the spawner stops judging this rank.
pub(crate) fn stop() {
    STOPPED.store(true, Ordering::Relaxed);
}

fn file_of(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank}"))
}

/// Writes `<now> <last progress> <waiting>` (whole, through a rename: the spawner never reads
/// half a line).
fn write_pulse(path: &Path) -> std::io::Result<()> {
    let line =
        format!("{} {} {}\n", now_ms(), LAST_PROGRESS_MS.load(Ordering::Relaxed), WAITING.load(Ordering::Relaxed));
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, line)?;
    std::fs::rename(&tmp, path)
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

/// Whether the heartbeat file of `rank` under `dir` shows a rank stuck for longer than
/// `timeout`: alive but neither progressing nor waiting in a collective, or not writing its
/// heartbeat at all (stopped). None while it is fine, before its first progress, or when it
/// writes no heartbeat.
pub(crate) fn stalled(dir: &Path, rank: usize, timeout: Duration) -> Option<String> {
    let text = std::fs::read_to_string(file_of(dir, rank)).ok()?;
    let fields: Vec<u64> = text.split_whitespace().filter_map(|f| f.parse().ok()).collect();
    let [written, progress, waiting] = fields[..] else { return None };
    let now = now_ms();
    let limit = timeout.as_millis() as u64;
    if now.saturating_sub(written) > limit {
        return Some(format!(
            "rank {rank} stopped responding: no heartbeat for {:.1} s (--timeout {:.1} s)",
            now.saturating_sub(written) as f64 / 1e3,
            timeout.as_secs_f64()
        ));
    }
    if progress > 0 && waiting == 0 && now.saturating_sub(progress) > limit {
        return Some(format!(
            "rank {rank} made no progress for {:.1} s outside collectives (--timeout {:.1} s)",
            now.saturating_sub(progress) as f64 / 1e3,
            timeout.as_secs_f64()
        ));
    }
    None
}
