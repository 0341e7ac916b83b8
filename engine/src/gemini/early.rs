//! The optimizer's work on host chunks started during backward (Colossal-AI's HybridAdam
//! overlap): once a chunk's every gradient has arrived, nothing later in backward reads or
//! writes its home or gradient, so a task on rayon's pool takes it up while the device (or, on
//! the CPU, libtorch's own threads) runs the rest of backward. What a task may do depends on
//! the step the caller plans ([`StepPlan`]): with neither loss scaling nor a norm it steps the
//! chunk outright; otherwise every update needs the global norm of all gradients first, so it
//! takes the chunk's sum of squares (the read the norm needs), and the updates run when the
//! step comes, one fused pass per chunk.
//!
//! A task owns the chunk's [`HostOptimizer`] (taken out of [`super::ChunkOptimizer`] and put
//! back when joined) and the chunk's home and gradient memory until it is joined; the step,
//! the norm and skipping a step join every task before they touch a gradient. Each task runs
//! exactly the arithmetic the serial step runs on that chunk, so the weights are the same bit
//! for bit (`tests/tests/gemini_overlap.rs`). Assumed of the model, as Colossal-AI assumes it:
//! a parameter's value is read in backward only by the operations that produce its gradient
//! (true of every layer here; a parameter's detached value saved for backward would break it
//! on the CPU, where the home is the parameter's memory).
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{channel, Receiver, Sender};

use crate::optim::flat::{sum_squares_scaled, Half, HostOptimizer, StepExtras};
use crate::{Error, Result};

/// What the step after a backward does to the gradients before updating, given before that
/// backward ([`super::Gemini::plan_step`]) so that host chunks start on the step as their
/// gradients complete.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepPlan {
    /// The loss scale the gradients will be unscaled by (fp16 training), if any.
    pub loss_scale: Option<f64>,
    /// Whether their global norm will be taken (clipping, or logging it).
    pub norm: bool,
}

impl StepPlan {
    /// Whether chunks step outright during backward (nothing needs every gradient first).
    pub(crate) fn steps_early(&self) -> bool {
        self.loss_scale.is_none() && !self.norm
    }

    /// The factors the chunks' sums of squares are taken with.
    pub(crate) fn factors(&self) -> Vec<f64> {
        self.loss_scale.map(|s| 1.0 / s).filter(|&f| f != 1.0).into_iter().collect()
    }
}

/// A chunk's home, gradient or upload memory lent to a task.
struct Lent<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: the memory stays allocated (the manager keeps the tensors, and their tier does not
// change outside the first step, when no task runs) and nothing else touches it until the task
// is joined.
unsafe impl<T> Send for Lent<T> {}

impl<T> Lent<T> {
    fn new(x: &mut [T]) -> Lent<T> {
        Lent { ptr: x.as_mut_ptr(), len: x.len() }
    }

    /// # Safety
    /// As for `std::slice::from_raw_parts_mut`, for the life of the slice.
    unsafe fn slice<'a>(&self) -> &'a mut [T] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// A task's result, sent back to the optimizer.
struct Finished {
    chunk: usize,
    opt: HostOptimizer,
    /// The chunk's sum of squares (a plan with a norm), or None (stepped).
    sum: Option<f64>,
    /// The panic's message, had the task panicked (its optimizer is then lost).
    failed: Option<String>,
}

/// The tasks started during one backward. See the module documentation.
pub(crate) struct Early {
    plan: StepPlan,
    started: Vec<bool>,
    outstanding: usize,
    tx: Sender<Finished>,
    rx: Receiver<Finished>,
    /// Per chunk, once joined: its sum of squares with the plan's factors.
    sums: Vec<Option<f64>>,
    /// Per chunk, once joined: stepped during backward.
    stepped: Vec<bool>,
}

impl Early {
    pub(crate) fn new(plan: StepPlan, chunks: usize) -> Early {
        let (tx, rx) = channel();
        Early {
            plan,
            started: vec![false; chunks],
            outstanding: 0,
            tx,
            rx,
            sums: vec![None; chunks],
            stepped: vec![false; chunks],
        }
    }

    pub(crate) fn plan(&self) -> StepPlan {
        self.plan
    }

    /// Whether tasks are running (not yet joined).
    pub(crate) fn busy(&self) -> bool {
        self.outstanding > 0
    }

    /// Whether chunk `c` was taken up during backward.
    pub(crate) fn started(&self, c: usize) -> bool {
        self.started[c]
    }

    /// Starts chunk `c`'s work on the pool, with its optimizer, home and gradient (`w`, `g`) and
    /// upload copy (`half`, written when it steps), which the task owns until [`Early::join`].
    ///
    /// # Safety
    /// The memory must stay valid, and nothing else may touch it, until [`Early::join`].
    pub(crate) unsafe fn start(
        &mut self,
        c: usize,
        mut opt: HostOptimizer,
        w: &mut [f32],
        g: &mut [f32],
        half: Option<(Half, &mut [u16])>,
    ) {
        self.started[c] = true;
        self.outstanding += 1;
        let (w, g, half) = (Lent::new(w), Lent::new(g), half.map(|(kind, h)| (kind, Lent::new(h))));
        let (tx, plan) = (self.tx.clone(), self.plan);
        rayon::spawn(move || {
            let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
                // SAFETY: the caller of `start` lends the memory until the task is joined.
                let (w, g) = unsafe { (w.slice(), g.slice()) };
                match plan.steps_early() {
                    true => {
                        // SAFETY: as above.
                        let half_out = half.map(|(kind, h)| (kind, unsafe { h.slice() }));
                        // The manager marks the gradient spent at the step; no pass clears it.
                        let extras = StepExtras { half_out, keep_gradients: true, ..StepExtras::default() };
                        opt.step_with(w, g, extras);
                        None
                    }
                    false => Some(sum_squares_scaled(g, &plan.factors())),
                }
            }));
            let (sum, failed) = match run {
                Ok(sum) => (sum, None),
                Err(panic) => (None, Some(crate::failure::panic_message(panic.as_ref()).to_string())),
            };
            // The receiver lives until every task is joined.
            let _ = tx.send(Finished { chunk: c, opt, sum, failed });
        });
    }

    /// Waits for every task started; hands each chunk's optimizer to `put_back`. An error names
    /// a task that panicked.
    pub(crate) fn join(&mut self, mut put_back: impl FnMut(usize, HostOptimizer)) -> Result<()> {
        let mut failed = None;
        while self.outstanding > 0 {
            let done = self.rx.recv().map_err(|_| Error::invalid("gemini: an early optimizer task vanished"))?;
            self.outstanding -= 1;
            match done.failed {
                Some(why) => {
                    failed = Some(format!("gemini: chunk {}'s step during backward failed: {why}", done.chunk))
                }
                None => {
                    self.sums[done.chunk] = done.sum;
                    self.stepped[done.chunk] = done.sum.is_none();
                    put_back(done.chunk, done.opt);
                }
            }
        }
        failed.map_or(Ok(()), |why| Err(Error::invalid(why)))
    }

    /// Chunk `c`'s sum of squares if it was taken with `factors` (joined first).
    pub(crate) fn sum(&self, c: usize, factors: &[f64]) -> Option<f64> {
        self.sums[c].filter(|_| self.plan.factors() == factors)
    }

    /// Whether chunk `c` was stepped during backward (joined first).
    pub(crate) fn stepped(&self, c: usize) -> bool {
        self.stepped[c]
    }
}

impl Drop for Early {
    /// Tasks still running own memory the manager may free next: wait for them.
    fn drop(&mut self) {
        while self.outstanding > 0 && self.rx.recv().is_ok() {
            self.outstanding -= 1;
        }
    }
}
