//! The temporary files and staging folders being written (by [`crate::write_atomic`], the
//! tensor and HDF5 writers and the apps' staged folders, before their rename into place),
//! removed when the process is interrupted (SIGINT, SIGTERM) as they are on an error: Ctrl-C
//! during `vit data convert`, a conversion or a checkpoint leaves no `.name.tmp-<pid>` behind.
//! Subprocess groups registered as [`ChildGroup`]s are sent SIGTERM first.
//!
//! A signal handler may only do what is async-signal-safe, so it writes the signal's number
//! to a pipe; a thread waiting on the pipe removes the files, restores the signal's default
//! action and raises it again, so the process still ends as interrupted (status 130 in a
//! shell) and a launcher still sees which signal ended it.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, Once};

/// The temporary files alive now.
static LIVE: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
/// The process groups of the subprocesses running now.
static GROUPS: Mutex<Vec<libc::pid_t>> = Mutex::new(Vec::new());
/// The pipe's write end (-1 until [`remove_on_interrupt`] has run).
static PIPE: AtomicI32 = AtomicI32::new(-1);
const SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// A temporary file or staging folder in the making: registered while alive, so an interrupt
/// removes it (the owner removes or renames it otherwise).
pub struct Temporary(PathBuf);

impl Temporary {
    /// Registers `path` until the returned value is dropped.
    pub fn new(path: &Path) -> Temporary {
        LIVE.lock().unwrap_or_else(|e| e.into_inner()).push(path.to_path_buf());
        Temporary(path.to_path_buf())
    }
}

impl Drop for Temporary {
    fn drop(&mut self) {
        let mut live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = live.iter().position(|p| *p == self.0) {
            live.swap_remove(i);
        }
    }
}

/// A subprocess running in its own process group (the leader `pid`), registered while alive
/// so that an interrupt ends the whole group: a tool started through a wrapper script has
/// children the wrapper's own death would leave running.
pub struct ChildGroup(libc::pid_t);

impl ChildGroup {
    /// Registers the group led by `pid` until the returned value is dropped.
    pub fn new(pid: u32) -> ChildGroup {
        let pid = pid as libc::pid_t;
        GROUPS.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
        ChildGroup(pid)
    }
}

impl Drop for ChildGroup {
    fn drop(&mut self) {
        let mut groups = GROUPS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = groups.iter().position(|&p| p == self.0) {
            groups.swap_remove(i);
        }
    }
}

extern "C" fn on_signal(signal: libc::c_int) {
    let byte = signal as u8;
    // SAFETY: write(2) is async-signal-safe; the pipe's end stays open for the process's life.
    unsafe { libc::write(PIPE.load(Ordering::Relaxed), (&byte as *const u8).cast(), 1) };
}

/// Installs the removal on SIGINT and SIGTERM (once per process; later calls do nothing).
/// The apps call it first thing in `main`.
pub fn remove_on_interrupt() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` has room for the two descriptors pipe2(2) returns. Close-on-exec: the
        // programs this process runs (search tools, ranks) must not hold its pipe.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return;
        }
        PIPE.store(fds[1], Ordering::Relaxed);
        let read_end = fds[0];
        let spawned = std::thread::Builder::new().name("interrupts".into()).spawn(move || {
            let mut byte = 0u8;
            // SAFETY: one byte into a live local.
            while unsafe { libc::read(read_end, (&mut byte as *mut u8).cast(), 1) } != 1 {}
            for &group in GROUPS.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                // SAFETY: signalling a process group this process started.
                unsafe { libc::killpg(group, libc::SIGTERM) };
            }
            for path in LIVE.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let _ = match path.is_dir() {
                    true => std::fs::remove_dir_all(path),
                    false => std::fs::remove_file(path),
                };
            }
            let signal = libc::c_int::from(byte);
            // SAFETY: restoring the default action and raising the signal ends the process as
            // the signal would have.
            unsafe {
                libc::signal(signal, libc::SIG_DFL);
                libc::raise(signal);
            }
        });
        if spawned.is_err() {
            return;
        }
        for signal in SIGNALS {
            // SAFETY: the handler only writes to the pipe.
            unsafe { libc::signal(signal, on_signal as *const () as libc::sighandler_t) };
        }
    });
}
