//! The kernels on the CPU, for tests on machines without a GPU. After [`enable`], a fused
//! operation on CPU tensors runs the same CUDA C, compiled as C++ by the system compiler with
//! `cuda/emulator.hpp` in front, through the same wrappers, argument lists and launch shapes as
//! on a device. It checks what the wrappers and the kernels' arithmetic and synchronisation
//! compute, not speed or memory: blocks run one after another and a block's threads are
//! fibers. Each source is compiled once per machine (cached beside the PTX) and loaded once per
//! process.
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};

use crate::kernel::{Args, Kernel};
use crate::{cache, Error, Result};

/// Makes the emulator's CUDA: threads, barriers, shuffles, atomics and intrinsics in C++.
const RUNTIME: &str = include_str!("cuda/emulator.hpp");

/// Names the compiler, as build tools read it.
const CXX_ENV: &str = "CXX";
/// Extra compiler flags, split at spaces (the parity tests' AddressSanitizer run sets them). Not
/// `CXXFLAGS`: flags an environment sets for builds in general (`-ffp-contract=fast`,
/// sanitizers) must not reach the emulator unasked.
pub const FLAGS_ENV: &str = "SUITE_EMULATOR_CXXFLAGS";

static ENABLED: AtomicBool = AtomicBool::new(false);

/// From now on, in this process, fused operations take CPU tensors and run them on the
/// emulator. For tests: the emulator is orders of magnitude slower than either backend.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// From now on, in this process, fused operations refuse CPU tensors again (a test that
/// emulated them hands the CPU back to the tests that assert the refusal).
pub fn disable() {
    ENABLED.store(false, Ordering::Relaxed);
}

/// Whether the emulator is enabled.
pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// A kernel's entry point in the emulator's library: grid and block sizes (3 each), the
/// argument slots, and a buffer for the message of a failed launch.
type Entry = unsafe extern "C" fn(*const u32, *const u32, *mut *mut c_void, *mut c_char, usize) -> c_int;

/// The C++ compiler the emulator uses: `CXX`, else `c++`.
pub fn compiler() -> String {
    std::env::var(CXX_ENV).ok().filter(|c| !c.is_empty()).unwrap_or_else(|| "c++".into())
}

/// Runs `function` of `kernel` on the CPU.
pub(crate) fn launch(
    kernel: &Kernel,
    function: &str,
    grid: (u32, u32, u32),
    block: u32,
    args: &mut Args,
) -> Result<()> {
    let entry = entry(kernel, function)?;
    let grid = [grid.0, grid.1, grid.2];
    let block = [block, 1, 1];
    let mut slots = args.slots();
    let mut message = vec![0 as c_char; 1024];
    // SAFETY: the entry point comes from the library compiled from the kernel's source, the
    // slots match the kernel's signature (each operation's wrapper builds them) and point at
    // live CPU tensors' memory, and the message buffer's length is passed with it.
    let rc = unsafe { entry(grid.as_ptr(), block.as_ptr(), slots.as_mut_ptr(), message.as_mut_ptr(), message.len()) };
    if rc != 0 {
        // SAFETY: the emulator writes a NUL-terminated message within the buffer.
        let message = unsafe { CStr::from_ptr(message.as_ptr()) }.to_string_lossy().into_owned();
        return Err(Error::Emulator(format!("{}::{function}: {message}", kernel.name)));
    }
    Ok(())
}

/// The entry point of `function`, compiling and loading its kernel's library on first use.
fn entry(kernel: &Kernel, function: &str) -> Result<Entry> {
    static LOADED: OnceLock<Mutex<HashMap<&'static str, HashMap<String, Entry>>>> = OnceLock::new();
    let mut loaded = LOADED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    let entries = match loaded.entry(kernel.name) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => e.insert(load(kernel)?),
    };
    entries
        .get(function)
        .copied()
        .ok_or_else(|| Error::invalid(format!("kernel source {} defines no function {function}", kernel.name)))
}

/// The C++ the compiler takes: the runtime, the kernel's source, and one entry point per
/// function that reads the function's arguments from the launcher's slots.
fn source(kernel: &Kernel) -> String {
    let mut s = format!("{RUNTIME}\n{}\n", kernel.source());
    for f in kernel.functions {
        s.push_str(&format!(
            "extern \"C\" int emu_launch_{f}(const unsigned* g, const unsigned* b, void** slots, char* err, \
             unsigned long len) {{ return emu::launch(&{f}, g, b, slots, err, len); }}\n"
        ));
    }
    s
}

fn load(kernel: &Kernel) -> Result<HashMap<String, Entry>> {
    let library = compile(kernel)?;
    let path = CString::new(library.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::Emulator(format!("{}: a path with a NUL byte", library.display())))?;
    // SAFETY: a NUL-terminated path to a library this module compiled; never unloaded.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(Error::Emulator(format!("loading {}: {}", library.display(), dl_error())));
    }
    let mut entries = HashMap::new();
    for &f in kernel.functions {
        let symbol = CString::new(format!("emu_launch_{f}")).expect("a kernel name");
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(handle, symbol.as_ptr()) };
        if p.is_null() {
            return Err(Error::Emulator(format!("{}: no entry point for {f}: {}", library.display(), dl_error())));
        }
        // SAFETY: the symbol is the `emu_launch_*` function generated by `source` with the
        // signature of `Entry`.
        entries.insert(f.to_string(), unsafe { std::mem::transmute::<*mut c_void, Entry>(p) });
    }
    Ok(entries)
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated message.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: see above.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// The kernel's library: from the cache folder (else the temporary folder), compiled there if
/// absent. Written under a temporary name and renamed, so no reader sees half a library.
fn compile(kernel: &Kernel) -> Result<PathBuf> {
    let compiler = compiler();
    let flags = std::env::var(FLAGS_ENV).unwrap_or_default();
    let source = source(kernel);
    let hash = cache::fnv1a(&[source.as_bytes(), compiler.as_bytes(), compiler_version(), flags.as_bytes()]);
    let dir = cache::dir().filter(|d| std::fs::create_dir_all(d).is_ok()).unwrap_or_else(std::env::temp_dir);
    let library = dir.join(format!("{}-{hash:016x}-emulator.so", kernel.name));
    if library.exists() {
        return Ok(library);
    }
    // The process id and the time: processes of several machines may share a cache folder.
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let tmp = |ext: &str| library.with_extension(format!("{ext}.tmp{}-{nanos}", std::process::id()));
    let (cpp, so) = (tmp("cpp"), tmp("so"));
    let outcome = build(&compiler, &flags, &source, &cpp, &so).and_then(|()| {
        std::fs::rename(&so, &library)
            .map_err(|e| Error::Emulator(format!("moving {} to {}: {e}", so.display(), library.display())))
    });
    let _ = std::fs::remove_file(&cpp);
    let _ = std::fs::remove_file(&so);
    outcome.map(|()| library).map_err(|e| match e {
        Error::Emulator(m) => Error::Emulator(format!("compiling kernel {}: {m}", kernel.name)),
        other => other,
    })
}

/// What the compiler's `--version` prints (empty if it cannot run: `build` then says why), so
/// that an upgraded compiler builds the libraries again. Asked once per process.
fn compiler_version() -> &'static [u8] {
    static VERSION: OnceLock<Vec<u8>> = OnceLock::new();
    VERSION.get_or_init(|| {
        std::process::Command::new(compiler()).arg("--version").output().map(|o| o.stdout).unwrap_or_default()
    })
}

fn build(compiler: &str, flags: &str, source: &str, cpp: &Path, so: &Path) -> Result<()> {
    std::fs::write(cpp, source).map_err(|e| Error::Emulator(format!("writing {}: {e}", cpp.display())))?;
    // No contraction into multiply-adds (last, so that no extra flag turns it back on): each
    // operation rounds on its own, as the optimizers' source asks of NVRTC (the other kernels'
    // tolerances allow either).
    let out = std::process::Command::new(compiler)
        .args(["-std=c++17", "-O2", "-fPIC", "-shared"])
        .args(flags.split_whitespace())
        .args(["-ffp-contract=off", "-o"])
        .arg(so)
        .args(["-x", "c++"]) // the temporary file's name does not end in .cpp
        .arg(cpp)
        .output()
        .map_err(|e| Error::Emulator(format!("running {compiler} (set {CXX_ENV} to a C++ compiler): {e}")))?;
    if !out.status.success() {
        return Err(Error::Emulator(format!("{compiler} failed:\n{}", String::from_utf8_lossy(&out.stderr))));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use tch::{Kind, Tensor};

    use crate::kernel::{Args, Kernel};
    use crate::launch::Target;

    static PROBE: Kernel = Kernel::new(
        "emulator_probe",
        r#"
extern "C" __global__ void sums(float* out) {
  __shared__ float scratch[32];
  const float s = block_sum((float)threadIdx.x, scratch);
  const float n = block_sum(1.f, scratch);
  const float m = block_max((float)(threadIdx.x + blockIdx.y), scratch);
  const i64 at = ((i64)blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
  out[3 * at] = s;
  out[3 * at + 1] = n;
  out[3 * at + 2] = m;
}
extern "C" __global__ void arguments(float* out, int a, i64 b, float c, const float* absent) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    out[0] = a;
    out[1] = (float)b;
    out[2] = c;
    out[3] = absent == nullptr;
  }
}
extern "C" __global__ void barrier_after_return(float* out) {
  if (threadIdx.x < 32) return;
  __syncthreads();
}
extern "C" __global__ void shuffle_after_return(float* out) {
  if (threadIdx.x == 3) return;
  out[threadIdx.x] = warp_sum(1.f);
}
"#,
        &["sums", "arguments", "barrier_after_return", "shuffle_after_return"],
        &[],
    );

    fn launch(function: &str, grid: (u32, u32, u32), block: u32, out: &Tensor, args: Args) -> crate::Result<()> {
        PROBE.launch(function, Target::Emulator, grid, block, &mut Args::default().tensor(out).append(args))
    }

    #[test]
    fn block_reductions_reach_every_thread_of_every_block() {
        // Two sums in a row reuse the scratch memory: each needs its barriers (a warp running
        // ahead would overwrite what another has not read yet).
        let (grid, threads) = ((3, 2, 1), 96);
        let out = Tensor::full([2, 3, threads, 3], -1.0, (Kind::Float, tch::Device::Cpu));
        launch("sums", grid, threads as u32, &out, Args::default()).unwrap();
        for y in 0..2 {
            let want = [(0..threads).sum::<i64>(), threads, threads - 1 + y];
            for (i, (want, what)) in want.into_iter().zip(["sum of indices", "count", "maximum"]).enumerate() {
                let got = out.get(y).select(-1, i as i64);
                let (lo, hi) = (got.min().double_value(&[]), got.max().double_value(&[]));
                assert_eq!((lo, hi), (want as f64, want as f64), "block row {y}: {what}");
            }
        }
    }

    #[test]
    fn arguments_of_every_width_arrive() {
        let out = Tensor::zeros([4], (Kind::Float, tch::Device::Cpu));
        let args = Args::default().i32(-7).i64(1 << 40).f32(2.5).opt(None);
        launch("arguments", (2, 1, 1), 32, &out, args).unwrap();
        assert_eq!(Vec::<f32>::try_from(&out).unwrap(), [-7.0, (1i64 << 40) as f32, 2.5, 1.0]);
    }

    #[test]
    fn barriers_that_some_threads_never_reach_fail_the_launch() {
        let out = Tensor::zeros([64], (Kind::Float, tch::Device::Cpu));
        let err = launch("barrier_after_return", (1, 1, 1), 64, &out, Args::default()).unwrap_err().to_string();
        assert!(err.contains("block (0,0,0), __syncthreads reached by 32 of 64 threads; the others returned"), "{err}");
        let err = launch("shuffle_after_return", (1, 1, 1), 32, &out, Args::default()).unwrap_err().to_string();
        assert!(
            err.contains("a warp shuffle reached by thread (0,0,0) but not by thread (3,0,0), which returned"),
            "{err}"
        );
    }
}
