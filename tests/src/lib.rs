//! The multi-process test harness. A test body runs once per rank, each rank in its own
//! process: the test binary re-executes itself through the engine's spawner, and in the child
//! processes (recognised by [`WORKER_ENV`]) the same test function runs the body after joining
//! the job. A rank's failure fails the test with that rank's message.
use std::time::Duration;

pub mod gemini_model;
mod ports;
mod scratch;
pub mod slurm;
mod tensorboard;

pub use ports::free_port;
pub use scratch::{scratch, Scratch};
pub use tensorboard::{read_tensorboard, Events};

use engine::dist::{self, InitOptions, SpawnOptions, World};
use tch::{Device, Tensor};

/// With `SUITE_REQUIRE_CUDA=1`, a CUDA test that finds no CUDA device at all fails instead of
/// passing with a notice (`scripts/gpu-check.sh` sets it on GPU machines, so a missing or
/// broken CUDA runtime cannot pass as a skip); one that needs more devices than a machine with
/// some has still skips with a notice.
pub const REQUIRE_CUDA_ENV: &str = "SUITE_REQUIRE_CUDA";

/// Whether `devices` CUDA devices are there for `test`. Without them the test should return
/// early: this says so on stderr, or panics under [`REQUIRE_CUDA_ENV`]`=1`.
pub fn cuda_devices(devices: usize, test: &str) -> bool {
    let found = engine::cuda::device_count();
    if found >= devices {
        return true;
    }
    let message = format!("{test}: needs {devices} CUDA device(s), found {found}");
    if found == 0 && cuda_required() {
        panic!("{message} ({REQUIRE_CUDA_ENV}=1: a missing GPU is a failure, not a skip)");
    }
    eprintln!("skipped: {message}");
    false
}

/// Where a test of the fused kernels runs: CUDA device 0 where there is one; else the CPU after
/// `enable_emulator` (`kernels::emulator::enable`, passed in because the kernels crate's own
/// tests use this crate), which runs the same kernels compiled as C++. Under
/// [`REQUIRE_CUDA_ENV`]`=1` a missing GPU fails the test instead.
pub fn cuda_or_emulator(test: &str, enable_emulator: fn()) -> tch::Device {
    if engine::cuda::device_count() == 0 && !cuda_required() {
        eprintln!("{test}: no CUDA device; the kernels run on the CPU emulator");
        enable_emulator();
        return tch::Device::Cpu;
    }
    // With no device this panics (REQUIRE_CUDA_ENV is set).
    assert!(cuda_devices(1, test));
    tch::Device::Cuda(0)
}

/// Whether [`REQUIRE_CUDA_ENV`] is `1`.
pub fn cuda_required() -> bool {
    std::env::var(REQUIRE_CUDA_ENV).as_deref() == Ok("1")
}

/// Set in the child processes to the name of the test they run.
pub const WORKER_ENV: &str = "SUITE_TEST_WORKER";
/// Set in the child processes to a folder where each rank that ran the body leaves a marker,
/// so a child that ran no test (a name that matches nothing) cannot pass vacuously.
pub const MARKER_ENV: &str = "SUITE_TEST_MARKERS";
/// Collective and rendezvous timeout inside tests: short, so a broken test fails quickly.
pub const TEST_TIMEOUT: Duration = Duration::from_secs(60);

/// What a rank's body returns.
pub type TestResult = anyhow::Result<()>;

/// Runs `body` on `ranks` processes. `test` is the test's full name as libtest knows it
/// ([`dist_test!`] fills it in). Panics with the failing rank's message if the job fails.
pub fn run_ranks(ranks: usize, test: &str, body: impl FnOnce(&World) -> TestResult) {
    if let Err(e) = run_job(ranks, test, &[], body) {
        panic!("{e}");
    }
}

/// Like [`run_ranks`], with extra environment for the ranks, returning the job's outcome (in
/// the parent process; a rank process exits through the test harness).
pub fn run_job(
    ranks: usize,
    test: &str,
    env: &[(&str, &str)],
    body: impl FnOnce(&World) -> TestResult,
) -> Result<(), engine::Error> {
    run_job_with_heartbeat(ranks, test, env, None, body)
}

/// Like [`run_job`], with the spawner's heartbeat limit (see `engine::dist::heartbeat`).
pub fn run_job_with_heartbeat(
    ranks: usize,
    test: &str,
    env: &[(&str, &str)],
    heartbeat: Option<Duration>,
    body: impl FnOnce(&World) -> TestResult,
) -> Result<(), engine::Error> {
    if std::env::var(WORKER_ENV).as_deref() == Ok(test) {
        let timeout = dist::launch::timeout_from_env().unwrap_or(TEST_TIMEOUT);
        let world = dist::init(&InitOptions { timeout }).expect("joining the test job");
        if let Err(e) = body(&world) {
            panic!("rank {}: {e:#}", world.rank());
        }
        if let Some(dir) = std::env::var_os(MARKER_ENV) {
            let marker = std::path::Path::new(&dir).join(format!("rank-{}", world.rank()));
            std::fs::write(&marker, test).expect("writing the test's marker");
        }
        return Ok(());
    }
    let markers = marker_dir(test);
    let mut vars = vec![
        (WORKER_ENV.to_string(), test.to_string()),
        (MARKER_ENV.to_string(), markers.display().to_string()),
        // Backtraces would push the failing rank's message out of the report's tail.
        ("RUST_BACKTRACE".to_string(), "0".to_string()),
    ];
    vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    let outcome = dist::spawn(&SpawnOptions {
        nproc: ranks,
        program: std::env::current_exe().expect("test executable"),
        args: [test, "--exact", "--nocapture", "--test-threads=1"].map(Into::into).to_vec(),
        env: vars,
        echo: std::env::var_os("SUITE_TEST_ECHO").is_some(),
        heartbeat,
    })
    .and_then(|()| {
        let missing: Vec<usize> = (0..ranks).filter(|r| !markers.join(format!("rank-{r}")).exists()).collect();
        match missing.is_empty() {
            true => Ok(()),
            false => Err(engine::Error::invalid(format!(
                "ranks {missing:?} exited cleanly without running test {test:?} (no test of that exact name \
                 in this binary?)"
            ))),
        }
    });
    let _ = std::fs::remove_dir_all(&markers);
    outcome
}

/// A fresh, empty folder for one job's markers.
fn marker_dir(test: &str) -> std::path::PathBuf {
    static JOBS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let job = JOBS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let safe: String = test.chars().map(|c| if c.is_ascii_alphanumeric() { c } else { '_' }).collect();
    let dir = std::env::temp_dir().join(format!("suite-test-{}-{job}-{safe}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating the test's marker folder");
    dir
}

/// The libtest name of a test function, from `module_path!()` and its identifier.
pub fn test_name(module_path: &str, function: &str) -> String {
    match module_path.split_once("::") {
        Some((_, rest)) => format!("{rest}::{function}"),
        None => function.to_string(),
    }
}

/// Declares a test whose body runs on N ranks: `dist_test!(name, 2, |world| { ... Ok(()) });`.
/// With `cpu_and_cuda`, it declares `name` (Gloo, CPU tensors) and `name_cuda` (NCCL, one GPU
/// per rank), which passes with a notice when there are fewer GPUs than ranks (fails under
/// [`REQUIRE_CUDA_ENV`]`=1`).
#[macro_export]
macro_rules! dist_test {
    ($name:ident, $ranks:expr, |$world:ident| $body:block) => {
        #[test]
        fn $name() {
            $crate::run_ranks($ranks, &$crate::test_name(module_path!(), stringify!($name)), |$world| $body);
        }
    };
    (cpu_and_cuda $name:ident, $cuda_name:ident, $ranks:expr, |$world:ident, $device:ident| $body:block) => {
        #[test]
        fn $name() {
            let $device = tch::Device::Cpu;
            $crate::run_ranks($ranks, &$crate::test_name(module_path!(), stringify!($name)), |$world| $body);
        }
        #[test]
        fn $cuda_name() {
            if !$crate::cuda_devices($ranks, stringify!($cuda_name)) {
                return;
            }
            $crate::run_ranks($ranks, &$crate::test_name(module_path!(), stringify!($cuda_name)), |$world| {
                let $device = tch::Device::Cuda($world.env.local_rank);
                $body
            });
        }
    };
}

/// Asserts `actual` is within `rtol * |expected| + atol` of `expected` elementwise, naming
/// the largest difference.
pub fn assert_close(actual: &Tensor, expected: &Tensor, rtol: f64, atol: f64, what: &str) {
    assert_eq!(actual.size(), expected.size(), "{what}: shapes differ");
    let a = actual.to_device(Device::Cpu).to_kind(tch::Kind::Double);
    let e = expected.to_device(Device::Cpu).to_kind(tch::Kind::Double);
    let diff = (&a - &e).abs();
    let bound = e.abs() * rtol + atol;
    let excess = (&diff - &bound).max().double_value(&[]);
    let max_diff = diff.max().double_value(&[]);
    assert!(excess <= 0.0, "{what}: max abs difference {max_diff:e} exceeds rtol {rtol:e} / atol {atol:e}");
}

/// Every tensor of a safetensors file, sorted by name (the file's order is not).
pub fn sorted_safetensors(path: &std::path::Path) -> Vec<(String, Tensor)> {
    let mut named = Tensor::read_safetensors(path).expect("reading a safetensors file");
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// A tensor with the same values on every rank (seeded), for single-process references.
pub fn seeded(seed: i64, shape: &[i64]) -> Tensor {
    tch::manual_seed(seed);
    Tensor::randn(shape, (tch::Kind::Float, Device::Cpu))
}

/// The host memory counter once it has settled: after a barrier on `group`, the reading that
/// stayed the same for 50 consecutive reads a millisecond apart (at most two seconds). Gloo's
/// worker threads let go of a finished collective's buffers a moment after `wait` returns
/// (when the thread loops), so a reading taken at once can still include them; this waits
/// for them, it asserts nothing about time.
pub fn settled_host_memory(group: &engine::dist::ProcessGroup) -> engine::Result<engine::host_memory::HostMemory> {
    group.barrier()?;
    let mut last = engine::host_memory::stats()?;
    let mut same = 0;
    for _ in 0..2000 {
        std::thread::sleep(Duration::from_millis(1));
        let now = engine::host_memory::stats()?;
        same = if now.current == last.current { same + 1 } else { 0 };
        last = now;
        if same == 50 {
            break;
        }
    }
    Ok(last)
}

/// Resident-set bytes of this process (`/proc/self/statm`): what a CPU step keeps allocated,
/// measured as the growth across it.
pub fn resident_bytes() -> f64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: f64 = statm.split_whitespace().nth(1).expect("resident field").parse().expect("a number");
    pages * 4096.0
}

/// Asserts that `measured` bytes are within `tolerance` (relative) of `predicted` bytes, and
/// prints both with their ratio (the figure a memory model's check reports).
pub fn assert_bytes_close(what: &str, measured: f64, predicted: f64, tolerance: f64) {
    let error = (measured - predicted).abs() / predicted;
    eprintln!("{what}: kept {measured} bytes, predicted {predicted} (ratio {:.3})", measured / predicted);
    assert!(
        error <= tolerance,
        "{what}: kept {measured} bytes, the profile predicts {predicted} ({:.1}% off, tolerance {:.0}%)",
        100.0 * error,
        100.0 * tolerance
    );
}
