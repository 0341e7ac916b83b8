//! Tests' scratch folders: private to the process, and gone when the test passes.
use std::ffi::OsStr;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, Once};

/// A fresh, empty folder `<suite>-<pid>-<name>` under the system's temporary directory for
/// test `name` of `suite` (emptied first: a crashed earlier process with this id may have left
/// one). It is removed when the [`Scratch`] is dropped, unless the test is failing.
pub fn scratch(suite: &str, name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("{suite}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating a scratch folder");
    Scratch(dir)
}

/// A scratch folder that removes itself when dropped, except while its thread panics (a failed
/// assertion), so that a failing test's files stay for inspection. The machines that run the
/// tests share their temporary directory between runs, so a passing run leaves nothing there.
/// Bind it to a variable for as long as the folder is used: `scratch(..).join(..)` alone drops
/// it, and the folder, at the end of the statement.
#[must_use = "the folder is removed when this is dropped"]
#[derive(Debug)]
pub struct Scratch(PathBuf);

impl Scratch {
    /// The folder, kept until the process exits, for files that a `static` shares between a
    /// binary's tests (Rust never drops a static). They are the tests' generated inputs, so
    /// they go at exit whether the tests passed or not.
    pub fn until_exit(self) -> PathBuf {
        static FOLDERS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());
        static REGISTER: Once = Once::new();
        extern "C" fn remove_folders() {
            if let Ok(folders) = FOLDERS.lock() {
                for dir in folders.iter() {
                    let _ = std::fs::remove_dir_all(dir);
                }
            }
        }
        // SAFETY: `atexit` only records the function; it runs once, at exit, on one thread.
        REGISTER.call_once(|| unsafe {
            libc::atexit(remove_folders);
        });
        let dir = self.0.clone();
        std::mem::forget(self);
        FOLDERS.lock().unwrap_or_else(|e| e.into_inner()).push(dir.clone());
        dir
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

impl Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<OsStr> for Scratch {
    fn as_ref(&self) -> &OsStr {
        self.0.as_os_str()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_passing_test_leaves_no_folder() {
        let s = scratch("suite-tests", "passing");
        let dir = s.to_path_buf();
        std::fs::write(s.join("file"), b"x").unwrap();
        assert!(dir.join("file").is_file());
        drop(s);
        assert!(!dir.exists(), "{} is still there", dir.display());
    }

    #[test]
    fn a_failing_test_keeps_its_folder() {
        let dir = std::thread::spawn(|| {
            let s = scratch("suite-tests", "failing");
            let dir = s.to_path_buf();
            let kept = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let _s = s;
                panic!("a failed assertion");
            }));
            assert!(kept.is_err());
            dir
        })
        .join()
        .unwrap();
        assert!(dir.is_dir(), "{} was removed", dir.display());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Set for the child process of the test below (this test binary, run again), which makes
    /// a folder kept until exit, prints its path and returns as a test binary does when its
    /// tests are done.
    const CHILD_ENV: &str = "SUITE_TESTS_SCRATCH_CHILD";

    #[test]
    fn a_folder_kept_until_exit_stays_until_the_process_exits() {
        if std::env::var_os(CHILD_ENV).is_some() {
            let dir = scratch("suite-tests", "until-exit").until_exit();
            std::fs::write(dir.join("file"), b"x").unwrap();
            println!("folder: {}", dir.display());
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "scratch::tests::a_folder_kept_until_exit_stays_until_the_process_exits", "--nocapture"])
            .env(CHILD_ENV, "1")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
        let dir = stdout.lines().find_map(|l| l.strip_prefix("folder: ")).unwrap_or_else(|| panic!("{stdout}"));
        assert!(dir.contains("until-exit"), "{dir}");
        assert!(!Path::new(dir).exists(), "{dir} outlived its process");
        // And while the process runs, it stays.
        let kept = scratch("suite-tests", "until-exit-here").until_exit();
        assert!(kept.is_dir());
        std::fs::remove_dir_all(&kept).unwrap();
    }
}
