//! Learning-rate schedules: linear warmup, then cosine, linear or AlphaFold's step decay; and
//! the linear scaling rule for large batches.

/// What happens after warmup.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decay {
    /// Stay at the peak.
    Constant,
    /// Half a cosine from the peak down to the floor at the last step.
    Cosine,
    /// A straight line from the peak down to the floor at the last step.
    Linear,
    /// AlphaFold's schedule (OpenFold's `AlphaFoldLRScheduler`): the peak until step `after`,
    /// then times `factor` once and again every `every` steps, never below the floor. As
    /// OpenFold counts, step `s > after` runs at `peak * factor^((s - after) / every + 1)`: the
    /// first cut at step `after + 1`, the next at `after + every`. The last step plays no part.
    Step {
        /// Steps between cuts (AlphaFold: 50,000).
        every: usize,
        /// Each cut's factor (AlphaFold: 0.95).
        factor: f64,
        /// Steps at the peak before the first cut, counted from 0 (AlphaFold: 50,000).
        after: usize,
    },
}

/// Linear warmup from 0 to `peak` over `warmup` steps, then `decay` to `floor` at `total`: the
/// schedules of transformers' and diffusers' `get_scheduler` (`get_cosine_schedule_with_warmup`
/// and friends), whose first step runs at 0 and whose step `warmup` reaches the peak; with
/// [`Decay::Step`], OpenFold's `AlphaFoldLRScheduler` (its `last_epoch` is our step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// Learning rate at the end of warmup.
    pub peak: f64,
    /// Learning rate at the last step.
    pub floor: f64,
    /// Warmup steps.
    pub warmup: usize,
    /// Total steps.
    pub total: usize,
    /// Shape after warmup.
    pub decay: Decay,
}

impl LrSchedule {
    /// The learning rate of step `step` (counted from 0).
    pub fn at(&self, step: usize) -> f64 {
        if step < self.warmup {
            return self.peak * step as f64 / self.warmup as f64;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f64;
        let progress = ((step - self.warmup) as f64 / span).min(1.0);
        let shape = match self.decay {
            Decay::Constant => 1.0,
            Decay::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            Decay::Linear => 1.0 - progress,
            Decay::Step { every, factor, after } => return self.step_decay(step, every, factor, after),
        };
        self.floor + (self.peak - self.floor) * shape
    }

    /// [`Decay::Step`]'s rate at `step`, past warm-up.
    fn step_decay(&self, step: usize, every: usize, factor: f64, after: usize) -> f64 {
        if step <= after {
            return self.peak;
        }
        // Whole cuts as an integer power: one number for every step of a plateau.
        let cuts = (step - after) / every.max(1) + 1;
        let cuts = i32::try_from(cuts).unwrap_or(i32::MAX);
        (self.peak * factor.powi(cuts)).max(self.floor)
    }
}

/// The linear scaling rule (Goyal et al.): a learning rate tuned at `base_batch` scaled to
/// `batch`.
pub fn scale_lr(lr: f64, batch: usize, base_batch: usize) -> f64 {
    lr * batch as f64 / base_batch.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_and_linear() {
        let s = LrSchedule { peak: 1.0, floor: 0.0, warmup: 4, total: 14, decay: Decay::Cosine };
        // As diffusers' get_scheduler("cosine", num_warmup_steps=4, num_training_steps=14).
        assert_eq!([s.at(0), s.at(1), s.at(3)], [0.0, 0.25, 0.75]);
        assert!((s.at(4) - 1.0).abs() < 1e-12);
        assert!((s.at(9) - 0.5).abs() < 1e-12, "half way down the cosine");
        assert!(s.at(14).abs() < 1e-12 && s.at(100).abs() < 1e-12, "stays at the floor");
        let l = LrSchedule { decay: Decay::Linear, floor: 0.1, ..s };
        assert!((l.at(9) - 0.55).abs() < 1e-12);
        let c = LrSchedule { decay: Decay::Constant, ..s };
        assert_eq!(c.at(50), 1.0);
    }

    /// AlphaFold's recipe at the steps around each boundary, against OpenFold's formula written
    /// out: warm-up to 1e-3 over 1000 steps, the plateau to 50,000, then 0.95 per 50,000.
    #[test]
    fn step_decay_is_openfolds_alphafold_schedule() {
        let decay = Decay::Step { every: 50_000, factor: 0.95, after: 50_000 };
        let s = LrSchedule { peak: 1e-3, floor: 0.0, warmup: 1000, total: 10, decay };
        let openfold = |step: usize| -> f64 {
            if step <= 1000 {
                step as f64 / 1000.0 * 1e-3
            } else if step > 50_000 {
                1e-3 * 0.95f64.powf(((step - 50_000) / 50_000 + 1) as f64)
            } else {
                1e-3
            }
        };
        let steps = [0, 1, 500, 999, 1000, 1001, 49_999, 50_000, 50_001, 50_002, 99_999, 100_000, 100_001, 149_999];
        for step in steps.into_iter().chain([150_000, 150_001, 1_000_000]) {
            let (ours, theirs) = (s.at(step), openfold(step));
            assert!((ours - theirs).abs() <= 1e-15, "step {step}: {ours} against OpenFold's {theirs}");
        }
        assert_eq!((s.at(0), s.at(1000), s.at(50_000)), (0.0, 1e-3, 1e-3));
        assert!((s.at(500) - 5e-4).abs() < 1e-15, "half way up");
        assert!((s.at(50_001) - 0.95e-3).abs() < 1e-15 && (s.at(99_999) - 0.95e-3).abs() < 1e-15);
        assert!((s.at(100_000) - 0.9025e-3).abs() < 1e-15, "the second cut");
        assert!((s.at(150_000) - 1e-3 * 0.95f64.powi(3)).abs() < 1e-15, "the third cut");
        // The floor (--min-lr-ratio) bounds it; without warm-up the first step is at the peak.
        let floored = LrSchedule { floor: 0.9e-3, warmup: 0, ..s };
        assert_eq!((floored.at(0), floored.at(300_000), floored.at(10_000_000)), (1e-3, 0.9e-3, 0.9e-3));
        assert!((floored.at(100_000) - 0.9025e-3).abs() < 1e-15, "above the floor");
        // Cuts from the first step after warm-up when `after` is 0; `every` 1 cuts at every step.
        let every = LrSchedule { decay: Decay::Step { every: 1, factor: 0.5, after: 0 }, warmup: 0, ..s };
        assert_eq!((every.at(0), every.at(1), every.at(3)), (1e-3, 0.25e-3, 0.0625e-3));
    }

    #[test]
    fn linear_scaling() {
        assert_eq!(scale_lr(1e-3, 32768, 256), 0.128);
    }
}
