//! What this process runs on: the libtorch it was built against, CUDA devices, threads, and
//! the launcher's view of the job. Every binary prints this with its `env` subcommand.
use std::ffi::CStr;
use std::fmt::Write;

use crate::dist::LaunchEnv;
use crate::{cuda, ffi};

/// The libtorch version the bridge was compiled against.
pub fn torch_version() -> String {
    // SAFETY: a static NUL-terminated string from libtorch's version header.
    unsafe { CStr::from_ptr(ffi::eng_torch_version()) }.to_string_lossy().into_owned()
}

/// A human-readable report of the runtime.
pub fn report() -> String {
    let mut out = String::new();
    let _ = writeln!(out, "libtorch      {}", torch_version());
    let _ = writeln!(out, "cpu threads   {}", tch::get_num_threads());
    let devices = cuda::device_count();
    if devices == 0 {
        let _ = writeln!(out, "cuda          not available (CPU only; collectives use Gloo)");
    }
    for d in 0..devices {
        match cuda::mem_get_info(d) {
            Ok((free, total)) => {
                let _ = writeln!(out, "cuda:{d}        {:.1} GiB free of {:.1} GiB", gib(free), gib(total));
            }
            Err(e) => {
                let _ = writeln!(out, "cuda:{d}        {e}");
            }
        }
    }
    let _ = match LaunchEnv::from_env() {
        Ok(Some(env)) => writeln!(
            out,
            "job           rank {} of {} (local {} of {}) via {:?}, rendezvous {}:{}",
            env.rank,
            env.world_size,
            env.local_rank,
            env.local_world_size,
            env.launcher,
            env.master_addr,
            env.master_port
        ),
        Ok(None) => writeln!(out, "job           single process (no launcher variables set)"),
        Err(e) => writeln!(out, "job           {e}"),
    };
    out
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}
