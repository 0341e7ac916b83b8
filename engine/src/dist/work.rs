//! Handles to collectives in flight.
use std::time::Duration;

use tch::Tensor;

use crate::dist::heartbeat::{self, Waiting};
use crate::dist::store::timeout_ms;
use crate::dist::ProcessGroup;
use crate::ffi::{self, check, EngWork};
use crate::Result;

type Then = Box<dyn FnOnce() -> Result<()> + Send>;

/// A collective in flight. [`Work::wait`] blocks until it completes (or fails, or the group's
/// timeout passes) and then runs the operation's finishing step, such as dividing by the group
/// size for an average or copying into a non-contiguous destination. Dropping a `Work` without
/// waiting leaves the operation running and its result unobserved.
#[must_use = "a collective's result is only valid after wait()"]
pub struct Work {
    raw: *mut EngWork,
    then: Option<Then>,
    what: String,
    /// None: wait without a client-side timeout (NCCL work, whose watchdog has one).
    timeout: Option<Duration>,
    /// The group (a shared handle), to name lost peers when the work fails.
    group: Option<ProcessGroup>,
}

// SAFETY: c10d work objects are thread-safe; the handle is owned and freed once.
unsafe impl Send for Work {}

impl Work {
    pub(crate) fn new(raw: *mut EngWork, what: String, timeout: Option<Duration>) -> Work {
        Work { raw, then: None, what, timeout, group: None }
    }

    /// Keeps a handle on the group (groups of one need none), so a failure can say which peers
    /// stopped beating (see [`heartbeat::lost_peers`]).
    pub(crate) fn among(mut self, group: &ProcessGroup) -> Work {
        self.group = (group.size() > 1).then(|| group.clone());
        self
    }

    /// Adds a step to run after the collective completes.
    pub(crate) fn then(mut self, step: impl FnOnce() -> Result<()> + Send + 'static) -> Work {
        self.then = Some(match self.then.take() {
            None => Box::new(step),
            Some(first) => Box::new(move || {
                first()?;
                step()
            }),
        });
        self
    }

    /// Waits for completion; an error names the operation, carries c10d's message and names
    /// the peers that are gone, if any.
    pub fn wait(mut self) -> Result<()> {
        let timeout = self.timeout.map_or(-1, timeout_ms);
        let _waiting = Waiting::start();
        check(unsafe { ffi::eng_work_wait(self.raw, timeout) }, || {
            let lost = self.group.as_ref().and_then(|g| {
                let ranks = g.global_ranks();
                heartbeat::lost_peers(ranks, ranks[g.rank()])
            });
            match lost {
                Some(lost) => format!("{} failed; {lost}", self.what),
                None => format!("{} failed", self.what),
            }
        })?;
        match self.then.take() {
            Some(step) => step(),
            None => Ok(()),
        }
    }

    /// Whether the collective has finished (successfully or not), without blocking.
    pub fn is_completed(&self) -> Result<bool> {
        let mut done = 0;
        check(unsafe { ffi::eng_work_is_completed(self.raw, &mut done) }, || format!("querying {}", self.what))?;
        Ok(done != 0)
    }

    /// What this work is, for messages: the operation, the rank and the group.
    pub fn describe(&self) -> &str {
        &self.what
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        unsafe { ffi::eng_work_free(self.raw) }
    }
}

impl std::fmt::Debug for Work {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work({})", self.what)
    }
}

/// One step of a ring in flight ([`ProcessGroup::ring_pass`]): this rank's tensor on its way to
/// the next rank while the previous rank's comes in.
#[must_use = "the previous rank's tensor comes from wait()"]
pub struct Hop {
    pub(crate) sent: Work,
    pub(crate) received: Work,
    pub(crate) inbox: Tensor,
    /// Kept alive until the send completes.
    pub(crate) outbox: Tensor,
}

impl Hop {
    /// Waits for both transfers and returns the previous rank's tensor.
    pub fn wait(self) -> Result<Tensor> {
        self.sent.wait()?;
        self.received.wait()?;
        drop(self.outbox);
        Ok(self.inbox)
    }
}
