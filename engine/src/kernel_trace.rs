//! Where a region's time goes, from libtorch's profiler (Kineto, what `torch.profiler` runs):
//! [`KernelTrace::start`] before the region, [`KernelTrace::stop`] after it gives every event
//! (each operator on the host; with CUDA, each kernel, copy and fill on the GPU with its
//! device-side duration) and optionally writes the Chrome trace `torch.profiler` exports.
//! [`Events::table`] sums them by name, largest first, beside the region's wall time, so that a
//! benchmark run on a GPU reports what its kernels cost and how much of the wall time the GPU
//! was busy at all (the rest: launch overhead and host work).
use std::ffi::{c_char, CStr, CString};
use std::path::Path;

use crate::ffi::{self, check};
use crate::{Error, Result};

/// A running profiler; at most one at a time in a process.
pub struct KernelTrace(());

/// Which side an event ran on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// An operator on the host (nested operators each count their own time).
    Host,
    /// A kernel, copy or fill on a GPU.
    Gpu,
}

/// One profiled event.
#[derive(Clone, Debug)]
pub struct Event {
    /// Where it ran.
    pub side: Side,
    /// Its duration.
    pub nanoseconds: u64,
    /// The operator's or the kernel's name.
    pub name: String,
}

/// The events of one traced region.
pub struct Events(pub Vec<Event>);

impl KernelTrace {
    /// Starts profiling the host's operators and, with `cuda`, the GPU's kernels.
    pub fn start(cuda: bool) -> Result<KernelTrace> {
        check(unsafe { ffi::eng_kernel_trace_start(i32::from(cuda)) }, || "starting the profiler".into())?;
        Ok(KernelTrace(()))
    }

    /// Stops profiling: the events, and the Chrome trace written to `chrome` if given.
    pub fn stop(self, chrome: Option<&Path>) -> Result<Events> {
        let path = chrome
            .map(|p| CString::new(p.to_string_lossy().as_bytes()))
            .transpose()
            .map_err(|_| Error::Invalid("a trace path with a NUL byte".into()))?;
        let mut lines: *mut c_char = std::ptr::null_mut();
        let raw_path = path.as_ref().map_or(std::ptr::null(), |p| p.as_ptr());
        check(unsafe { ffi::eng_kernel_trace_stop(raw_path, &mut lines) }, || match chrome {
            Some(p) => format!("stopping the profiler and writing {}", p.display()),
            None => "stopping the profiler".into(),
        })?;
        // SAFETY: on success the bridge set `lines` to a NUL-terminated malloc'ed string.
        let text = unsafe { CStr::from_ptr(lines) }.to_string_lossy().into_owned();
        unsafe { ffi::eng_free_error(lines) };
        Ok(Events(text.lines().filter_map(parse).collect()))
    }
}

/// `region` run once under the profiler (kernels too with `cuda`): the table of its events
/// ([`Events::table`], `title`, the `top` names) over its wall time, its Chrome trace written to
/// `chrome`. `region` should end by waiting for the device, and the device should be idle
/// before it, so that the wall time is the region's. A profiler that cannot start (a machine
/// without CUPTI, say) or stop gives a line saying so in place of the table, so that a
/// benchmark goes on without its trace (a region that exists to be traced is then not run); an
/// error of `region` itself is returned.
pub fn table_of<E>(
    cuda: bool,
    chrome: &Path,
    title: &str,
    top: usize,
    region: impl FnOnce() -> std::result::Result<(), E>,
) -> std::result::Result<String, E> {
    let profiler = match KernelTrace::start(cuda) {
        Ok(p) => p,
        Err(e) => return Ok(format!("{title}: not traced ({e})")),
    };
    let start = std::time::Instant::now();
    let ran = region();
    let wall = start.elapsed().as_secs_f64();
    let events = profiler.stop(Some(chrome));
    ran?;
    Ok(match events {
        Ok(events) => events.table(title, wall, top),
        Err(e) => format!("{title}: not traced ({e})"),
    })
}

/// One line of the bridge's "<device>\t<ns>\t<name>".
fn parse(line: &str) -> Option<Event> {
    let mut parts = line.splitn(3, '\t');
    let side = match parts.next()? {
        "cuda" => Side::Gpu,
        _ => Side::Host,
    };
    let nanoseconds = parts.next()?.parse().ok()?;
    Some(Event { side, nanoseconds, name: parts.next()?.to_string() })
}

impl Events {
    /// Total time of the events on `side`, in seconds.
    pub fn busy_seconds(&self, side: Side) -> f64 {
        self.0.iter().filter(|e| e.side == side).map(|e| e.nanoseconds as f64).sum::<f64>() * 1e-9
    }

    /// The events on `side` summed by name, the `top` largest: (name, calls, seconds).
    pub fn by_name(&self, side: Side, top: usize) -> Vec<(String, usize, f64)> {
        let mut sums: std::collections::HashMap<&str, (usize, u64)> = std::collections::HashMap::new();
        for e in self.0.iter().filter(|e| e.side == side) {
            let entry = sums.entry(e.name.as_str()).or_default();
            *entry = (entry.0 + 1, entry.1 + e.nanoseconds);
        }
        let mut rows: Vec<(String, usize, f64)> =
            sums.into_iter().map(|(name, (calls, ns))| (name.to_string(), calls, ns as f64 * 1e-9)).collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        rows.truncate(top);
        rows
    }

    /// A markdown table of the `top` largest names on the GPU (or, without GPU events, the
    /// host's operators), after a line with the region's `wall` seconds and the time the GPU
    /// was busy in it. Names are cut to 100 characters.
    pub fn table(&self, title: &str, wall: f64, top: usize) -> String {
        let gpu = self.0.iter().any(|e| e.side == Side::Gpu);
        let side = if gpu { Side::Gpu } else { Side::Host };
        let busy = self.busy_seconds(side);
        let mut out = match gpu {
            true => format!(
                "{title}: wall {:.2} ms, GPU busy {:.2} ms ({:.0}%)\n",
                wall * 1e3,
                busy * 1e3,
                100.0 * busy / wall.max(f64::MIN_POSITIVE)
            ),
            false => format!(
                "{title}: wall {:.2} ms, host operators {:.2} ms (nested operators each count their own time)\n",
                wall * 1e3,
                busy * 1e3
            ),
        };
        out += &format!("| {} | calls | ms | share |\n|---|---:|---:|---:|\n", if gpu { "kernel" } else { "operator" });
        for (name, calls, seconds) in self.by_name(side, top) {
            let short: String = name.chars().take(100).collect();
            let share = 100.0 * seconds / busy.max(f64::MIN_POSITIVE);
            out += &format!("| `{}` | {calls} | {:.3} | {share:.1}% |\n", short.replace('|', "/"), seconds * 1e3);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    /// The profiler is the process's: one test at a time holds it.
    static PROFILER: std::sync::Mutex<()> = std::sync::Mutex::new(());

    // On the CPU the host's operators are traced; the GPU's kernels are checked by the
    // benchmarks that trace on a GPU.
    #[test]
    fn a_traced_product_shows_in_the_events_the_table_and_the_chrome_trace() {
        let _turn = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
        let dir = std::env::temp_dir().join(format!("kernel-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let chrome = dir.join("trace.json");
        let a = Tensor::ones([64, 64], (Kind::Float, Device::Cpu));
        let trace = KernelTrace::start(false).unwrap();
        assert!(KernelTrace::start(false).is_err(), "one profiler at a time");
        let _ = a.matmul(&a);
        let events = trace.stop(Some(&chrome)).unwrap();
        let mm = events.0.iter().filter(|e| e.name == "aten::mm").count();
        assert_eq!(mm, 1, "one aten::mm in {:?}", events.0.iter().map(|e| &e.name).collect::<Vec<_>>());
        assert!(events.0.iter().all(|e| e.side == Side::Host));
        let table = events.table("one product", 1e-3, 5);
        assert!(table.contains("`aten::mm` | 1 |") && table.contains("host operators"), "{table}");
        let json = std::fs::read_to_string(&chrome).unwrap();
        assert!(json.contains("\"traceEvents\"") && json.contains("aten::mm"), "the Chrome trace holds the product");
        // Stopped, it can start again.
        KernelTrace::start(false).unwrap().stop(None).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_region_is_traced_or_said_untraced_and_its_own_error_returned() {
        let _turn = PROFILER.lock().unwrap_or_else(|e| e.into_inner());
        let chrome = std::env::temp_dir().join(format!("kernel-trace-region-{}.json", std::process::id()));
        let a = Tensor::ones([8, 8], (Kind::Float, Device::Cpu));
        let table = table_of(false, &chrome, "region", 3, || -> Result<()> {
            let _ = a.matmul(&a);
            Ok(())
        })
        .unwrap();
        assert!(table.starts_with("region: wall") && chrome.is_file(), "{table}");
        std::fs::remove_file(&chrome).unwrap();
        // A profiler already running: the region is not run, and the table says why.
        let running = KernelTrace::start(false).unwrap();
        let mut ran = false;
        let table = table_of(false, &chrome, "second", 3, || -> Result<()> {
            ran = true;
            Ok(())
        });
        running.stop(None).unwrap();
        let table = table.unwrap();
        assert!(!ran && table.starts_with("second: not traced (") && table.contains("already running"), "{table}");
        let failed = table_of(false, &chrome, "failing", 3, || -> Result<()> { Err(Error::Invalid("boom".into())) });
        assert!(failed.unwrap_err().to_string().contains("boom"));
        let _ = std::fs::remove_file(&chrome);
    }

    #[test]
    fn events_sum_by_name_largest_first() {
        let e = |side, nanoseconds, name: &str| Event { side, nanoseconds, name: name.into() };
        let events = Events(vec![
            e(Side::Gpu, 3_000_000, "gemm"),
            e(Side::Gpu, 1_000_000, "softmax"),
            e(Side::Gpu, 2_000_000, "gemm"),
            e(Side::Host, 9_000_000, "aten::mm"),
        ]);
        assert_eq!(events.by_name(Side::Gpu, 5), [("gemm".to_string(), 2, 0.005), ("softmax".to_string(), 1, 0.001)]);
        assert!((events.busy_seconds(Side::Gpu) - 0.006).abs() < 1e-12);
        let table = events.table("step", 0.012, 1);
        assert!(table.starts_with("step: wall 12.00 ms, GPU busy 6.00 ms (50%)"), "{table}");
        assert!(table.contains("| `gemm` | 2 | 5.000 | 83.3% |") && !table.contains("softmax"), "{table}");
    }
}
