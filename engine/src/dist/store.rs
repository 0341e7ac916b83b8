//! Key-value stores for rendezvous: c10d's `TCPStore` (one server, hosted by rank 0 or by the
//! launcher, every rank a client) and an in-memory store for single-process jobs.
use std::time::Duration;

use crate::ffi::{self, check, cstring, EngStore};
use crate::Result;

/// A c10d store. Cheap to share between the groups built on it; thread-safe on the C++ side.
pub struct Store {
    raw: *mut EngStore,
    describe: String,
    /// The TCP port, for a TCP store.
    port: Option<u16>,
}

// SAFETY: c10d stores are internally synchronised; the handle is only freed on drop.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl Store {
    /// Connects to (or, with `is_server`, hosts) the TCP store at `host:port`. A server given
    /// a `world_size` waits up to `timeout` for that many ranks to connect (0: for none);
    /// clients retry until `timeout`.
    pub fn tcp(host: &str, port: u16, is_server: bool, world_size: usize, timeout: Duration) -> Result<Store> {
        let role = if is_server { "hosting" } else { "connecting to" };
        let waits = if is_server && world_size > 0 { format!("world size {world_size}, ") } else { String::new() };
        let what = format!("rendezvous: {role} TCP store {host}:{port} ({waits}timeout {timeout:?})");
        Self::open(host, port, is_server, world_size, timeout, what)
    }

    /// Hosts a job's store as its launcher does (torchrun's agent store): on a port the kernel
    /// picks, held from before any rank starts (so no other process can take it in between),
    /// for ranks that all connect as clients. It waits for none of them; their rendezvous in
    /// the store does, up to their own timeout. `timeout` bounds this host's own requests.
    pub fn agent(timeout: Duration) -> Result<Store> {
        Self::open("127.0.0.1", 0, true, 0, timeout, "rendezvous: hosting the job's TCP store".into())
    }

    /// `workers`: how many clients (a server's own included) a server waits for; 0 for none.
    fn open(host: &str, port: u16, is_server: bool, workers: usize, timeout: Duration, what: String) -> Result<Store> {
        let c_host = cstring(host)?;
        let workers = i32::try_from(workers).map_err(|_| crate::Error::invalid(format!("{what}: too many ranks")))?;
        let (mut raw, mut bound) = (std::ptr::null_mut(), 0u16);
        let mut connect = || unsafe {
            ffi::eng_store_tcp(
                c_host.as_ptr(),
                port,
                is_server as i32,
                workers,
                timeout_ms(timeout),
                &mut bound,
                &mut raw,
            )
        };
        // A client can wait past its timeout: libtorch retries a connection once more after it,
        // and a port held by a program that is not a store never answers at all.
        let created = match is_server {
            true => connect(),
            false => super::deadline::or_exit(
                timeout.saturating_add(super::deadline::GRACE),
                format!("{what}: no store answered (is rank 0 running, and is the port not another program's?)"),
                connect,
            ),
        };
        check(created, || what)?;
        Ok(Store { raw, describe: format!("TCP store {host}:{bound}"), port: Some(bound) })
    }

    /// The port of a TCP store (the one bound, where the kernel picked it).
    pub fn port(&self) -> Option<u16> {
        self.port
    }

    /// A store in this process's memory, for a world of one.
    pub fn in_memory() -> Result<Store> {
        let mut raw = std::ptr::null_mut();
        check(unsafe { ffi::eng_store_hash(&mut raw) }, || "creating an in-memory store".into())?;
        Ok(Store { raw, describe: "in-memory store".into(), port: None })
    }

    /// A view of this store whose keys all start with `prefix`.
    pub fn prefixed(&self, prefix: &str) -> Result<Store> {
        let c_prefix = cstring(prefix)?;
        let mut raw = std::ptr::null_mut();
        check(unsafe { ffi::eng_store_prefix(self.raw, c_prefix.as_ptr(), &mut raw) }, || {
            format!("prefixing {} with {prefix:?}", self.describe)
        })?;
        Ok(Store { raw, describe: format!("{}/{prefix}", self.describe), port: self.port })
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let c_key = cstring(key)?;
        check(unsafe { ffi::eng_store_set(self.raw, c_key.as_ptr(), value.as_ptr(), value.len()) }, || {
            format!("setting {key:?} in {}", self.describe)
        })
    }

    /// Reads `key`, waiting (up to the store's timeout) until some rank sets it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let c_key = cstring(key)?;
        let (mut data, mut len) = (std::ptr::null_mut(), 0usize);
        check(unsafe { ffi::eng_store_get(self.raw, c_key.as_ptr(), &mut data, &mut len) }, || {
            format!("reading {key:?} from {}", self.describe)
        })?;
        // SAFETY: the bridge returned a malloc'ed buffer of `len` bytes that we now own.
        let value = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        unsafe { ffi::eng_free_bytes(data) };
        Ok(value)
    }

    /// Atomically adds `delta` to the integer at `key` and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let c_key = cstring(key)?;
        let mut out = 0;
        check(unsafe { ffi::eng_store_add(self.raw, c_key.as_ptr(), delta, &mut out) }, || {
            format!("adding to {key:?} in {}", self.describe)
        })?;
        Ok(out)
    }

    /// Sets how long `get` waits for a key.
    pub fn set_timeout(&self, timeout: Duration) -> Result<()> {
        check(unsafe { ffi::eng_store_set_timeout(self.raw, timeout_ms(timeout)) }, || {
            format!("setting the timeout of {}", self.describe)
        })
    }

    pub(crate) fn raw(&self) -> *mut EngStore {
        self.raw
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        unsafe { ffi::eng_store_free(self.raw) }
    }
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.describe)
    }
}

pub(crate) fn timeout_ms(timeout: Duration) -> i64 {
    i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_store_serves_ranks_that_all_connect_as_clients() {
        let timeout = Duration::from_secs(10);
        let agent = Store::agent(timeout).unwrap();
        let port = agent.port().unwrap();
        assert_ne!(port, 0, "the port the kernel picked");
        // Two ranks, rank 0 included, connect; neither hosts (the port is taken: a rank that
        // tried would fail to bind).
        let ranks: Vec<Store> = (0..2).map(|_| Store::tcp("127.0.0.1", port, false, 2, timeout).unwrap()).collect();
        ranks[0].set("from rank 0", b"hello").unwrap();
        assert_eq!(ranks[1].get("from rank 0").unwrap(), b"hello");
        assert_eq!(agent.get("from rank 0").unwrap(), b"hello", "one store, the agent's");
        assert!(Store::tcp("127.0.0.1", port, true, 2, timeout).is_err(), "a second host on the agent's port");
    }

    const CHILD_ENV: &str = "ENGINE_STORE_TEST_PORT";

    #[test]
    fn a_port_held_by_another_program_ends_a_client_naming_it() {
        if let Ok(port) = std::env::var(CHILD_ENV) {
            let _ = Store::tcp("127.0.0.1", port.parse().unwrap(), false, 2, Duration::from_millis(500));
            return;
        }
        // A program that accepts connections and never answers: libtorch's client waits for
        // its handshake's reply for good.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let held: Vec<_> = listener.incoming().collect();
            drop(held);
        });
        let start = std::time::Instant::now();
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "dist::store::tests::a_port_held_by_another_program_ends_a_client_naming_it"])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, port.to_string())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "exit status; stderr:\n{stderr}");
        assert!(stderr.contains(&format!("connecting to TCP store 127.0.0.1:{port}")), "{stderr}");
        assert!(stderr.contains("no store answered"), "{stderr}");
        assert!(start.elapsed() < Duration::from_secs(40), "took {:?}", start.elapsed());
    }
}
