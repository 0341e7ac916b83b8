//! Memory planned, not guessed: the inference forward traced on shapes alone for the peak of
//! its live bytes ([`profile`]), and the chunk size of every chunked operation chosen from a
//! budget ([`plan()`]).
//!
//! The training planner's profile (`crate::profile`) counts what autograd keeps for the
//! backward; inference keeps nothing for a backward, and what bounds it is the peak of the
//! bytes alive at once during a no-grad forward: the persistent tensors (the MSA and pair
//! being updated in place, the features, the outputs so far) plus each operation's
//! temporaries, freed after their last use. [`Trace`] simulates exactly that: each modelled
//! buffer is allocated and freed in the order the code allocates and frees it, and the trace
//! keeps the largest sum and where it happened.
mod dap;
pub mod multimer;
mod ops;
pub mod plan;
pub mod profile;

pub use multimer::{multimer_pass_peak, multimer_sizes_of, MultimerSizes};
pub use ops::AttentionLogits;
pub use plan::{plan, plan_multimer, plan_prediction, Plan};
pub use profile::{bytes_of, pass_peak, sizes_of, Peak, Sizes};

/// A buffer the trace holds: freed by [`Trace::free`], never silently.
#[must_use = "a traced buffer is freed with Trace::free"]
#[derive(Debug)]
pub struct Buf(u64);

/// The live bytes of a simulated forward and their peak.
#[derive(Debug, Default)]
pub struct Trace {
    live: u64,
    peak: u64,
    at: &'static str,
    peak_at: &'static str,
}

impl Trace {
    /// An empty trace.
    pub fn new() -> Trace {
        Trace::default()
    }

    /// Names what runs from now on (the place a peak is attributed to).
    pub fn at(&mut self, what: &'static str) {
        self.at = what;
    }

    /// Allocates `bytes`.
    pub fn alloc(&mut self, bytes: i64) -> Buf {
        let bytes = bytes.max(0) as u64;
        self.live += bytes;
        if self.live > self.peak {
            self.peak = self.live;
            self.peak_at = self.at;
        }
        Buf(bytes)
    }

    /// Frees a buffer.
    pub fn free(&mut self, b: Buf) {
        self.live -= b.0;
    }

    /// Frees buffers.
    pub fn free_all(&mut self, bufs: impl IntoIterator<Item = Buf>) {
        for b in bufs {
            self.free(b);
        }
    }

    /// `b` moved to the host: its device bytes freed. The host's bytes are not counted (the
    /// budget is the device's), so the buffer on the host holds none.
    pub fn to_host(&mut self, b: Buf) -> Buf {
        self.free(b);
        Buf(0)
    }

    /// `b` (on the host) moved to the device as `bytes`.
    pub fn to_device(&mut self, b: Buf, bytes: i64) -> Buf {
        self.free(b);
        self.alloc(bytes)
    }

    /// A buffer allocated and freed at once (a kernel's scratch).
    pub fn temp(&mut self, bytes: i64) {
        let b = self.alloc(bytes);
        self.free(b);
    }

    /// Bytes alive now.
    pub fn live(&self) -> u64 {
        self.live
    }

    /// The most bytes alive at once so far.
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// Where the peak happened.
    pub fn peak_at(&self) -> &'static str {
        self.peak_at
    }
}
