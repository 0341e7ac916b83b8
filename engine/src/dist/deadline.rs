//! A last resort for waits inside libtorch that their own timeout does not end. Gloo's
//! connection handshake is one: a rank that reaches a peer at a stale address (found under the
//! keys of a job's earlier start, say) and the peer itself can both wait in `connectFullMesh`
//! for good, past Gloo's timeout (seen under torchrun restarts before their keys were kept
//! apart). Such a wait cannot be cancelled from outside, so the rank says what it was waiting
//! for and exits, and its launcher brings the job down naming it.
use std::sync::mpsc::{channel, RecvTimeoutError};
use std::time::Duration;

/// How long past its own timeout a wait in libtorch may run before the process gives up on it.
pub(crate) const GRACE: Duration = Duration::from_secs(10);

/// Runs `f` on this thread. If it has not returned after `limit`, prints `what` to stderr and
/// ends the process with exit status 1 (without running destructors: `f` still holds libtorch's
/// locks).
pub(crate) fn or_exit<T>(limit: Duration, what: String, f: impl FnOnce() -> T) -> T {
    let (done, finished) = channel::<()>();
    let watchdog = std::thread::Builder::new().name("deadline".into()).spawn(move || {
        if finished.recv_timeout(limit) == Err(RecvTimeoutError::Timeout) {
            eprintln!("Error: {what}: still waiting after {limit:?}, past its own timeout; exiting");
            unsafe { libc::_exit(1) };
        }
    });
    let out = f();
    drop(done);
    if let Ok(watchdog) = watchdog {
        let _ = watchdog.join();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    const CHILD_ENV: &str = "ENGINE_DEADLINE_TEST_CHILD";

    #[test]
    fn a_wait_within_its_limit_returns_its_value() {
        assert_eq!(or_exit(Duration::from_secs(5), "a quick wait".into(), || 7), 7);
    }

    #[test]
    fn a_wait_past_its_limit_ends_the_process_saying_what_it_was() {
        if std::env::var_os(CHILD_ENV).is_some() {
            or_exit(Duration::from_millis(200), "creating process group world (rank 1 of 2)".into(), || {
                std::thread::sleep(Duration::from_secs(60))
            });
            return;
        }
        let start = Instant::now();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "dist::deadline::tests::a_wait_past_its_limit_ends_the_process_saying_what_it_was"])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, "1")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "exit status; stderr:\n{stderr}");
        assert!(
            stderr.contains("Error: creating process group world (rank 1 of 2): still waiting after 200ms"),
            "the message names the wait:\n{stderr}"
        );
        assert!(start.elapsed() < Duration::from_secs(30), "ended at the limit, not by the wait");
    }
}
