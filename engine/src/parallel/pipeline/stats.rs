//! What one rank's pipeline steps spent their time on, when asked ([`super::Pipeline::measure`]):
//! computing (forward, backward and weight passes, each timed per action), posting sends and
//! receives, and waiting (blocked on a receive, a shape header or the end-of-step flush of the
//! sends). Waiting over the step's wall time is the rank's measured idle fraction, the
//! measured counterpart of the simulator's bubble; the per-action means are the costs to feed
//! the simulator ([`StepStats::costs`]).
//!
//! Timing is off by default and then costs nothing: no clock is read. On CUDA, where kernels
//! and NCCL's transfers run asynchronously to the host, a measuring pipeline synchronizes its
//! stream after each action and each wait, so the host's clock sees the device's time; that
//! removes the overlap of a rank's own compute with its own transfers, so measure in separate
//! steps from those whose speed counts.
use super::simulate::Costs;

/// Total seconds and count of one kind of action.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timed {
    /// Seconds spent, summed.
    pub seconds: f64,
    /// Actions timed.
    pub count: usize,
}

impl Timed {
    /// Seconds per action (0 when none ran).
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.seconds / self.count as f64
        }
    }

    pub(crate) fn add(&mut self, seconds: f64) {
        self.seconds += seconds;
        self.count += 1;
    }
}

/// One rank's time in one or more steps (summed by [`StepStats::accumulate`]). The parts are
/// disjoint intervals of the step, so `compute + posting + waiting <= wall`; the rest is the
/// runtime's own bookkeeping.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepStats {
    /// Steps summed.
    pub steps: usize,
    /// Seconds inside [`super::Pipeline::step`].
    pub wall: f64,
    /// Forward passes of a chunk on a micro-batch (their receive's wait excluded).
    pub forward: Timed,
    /// Backward passes (the input-gradient pass under a split backward; the gradient's
    /// receive excluded).
    pub backward: Timed,
    /// Weight-gradient passes of a split backward.
    pub weight: Timed,
    /// Posting sends and receives (the messages' host-side cost; the transfers themselves run
    /// beside the compute). `count` is the messages sent.
    pub posting: Timed,
    /// Seconds blocked waiting for a peer: on receives, shape headers and the final flush of
    /// this step's sends.
    pub waiting: f64,
}

impl StepStats {
    /// Seconds computing: forward, backward and weight passes.
    pub fn compute(&self) -> f64 {
        self.forward.seconds + self.backward.seconds + self.weight.seconds
    }

    /// Waiting over wall time: the rank's measured idle fraction.
    pub fn idle_fraction(&self) -> f64 {
        if self.wall > 0.0 {
            self.waiting / self.wall
        } else {
            0.0
        }
    }

    /// Adds `other`'s steps to these.
    pub fn accumulate(&mut self, other: &StepStats) {
        self.steps += other.steps;
        self.wall += other.wall;
        for (a, b) in [
            (&mut self.forward, &other.forward),
            (&mut self.backward, &other.backward),
            (&mut self.weight, &other.weight),
            (&mut self.posting, &other.posting),
        ] {
            a.seconds += b.seconds;
            a.count += b.count;
        }
        self.waiting += other.waiting;
    }

    /// The measured mean cost of each pass, as the simulator takes them, with `hop` seconds
    /// from a message's send to its arrival (e.g. [`super::Pipeline::hop_time`]). Without a
    /// split backward the whole backward is the input-gradient pass and the weight pass costs
    /// nothing.
    pub fn costs(&self, hop: f64) -> Costs {
        Costs { forward: self.forward.mean(), input_grad: self.backward.mean(), weight_grad: self.weight.mean(), hop }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_means_and_fractions() {
        let mut one = StepStats { steps: 1, wall: 4.0, waiting: 1.0, ..StepStats::default() };
        one.forward.add(1.0);
        one.backward.add(2.0);
        let mut total = StepStats::default();
        total.accumulate(&one);
        total.accumulate(&one);
        assert_eq!((total.steps, total.forward.count, total.backward.seconds), (2, 2, 4.0));
        assert_eq!(total.compute(), 6.0);
        assert_eq!(total.idle_fraction(), 0.25);
        let c = total.costs(0.5);
        assert_eq!((c.forward, c.input_grad, c.weight_grad, c.hop), (1.0, 2.0, 0.0, 0.5));
        assert_eq!(StepStats::default().idle_fraction(), 0.0);
    }
}
