//! Learning-rate schedules: linear warmup, then cosine or linear decay; and the linear
//! scaling rule for large batches.

/// What happens after warmup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decay {
    /// Stay at the peak.
    Constant,
    /// Half a cosine from the peak down to the floor at the last step.
    Cosine,
    /// A straight line from the peak down to the floor at the last step.
    Linear,
}

/// Linear warmup from 0 to `peak` over `warmup` steps, then `decay` to `floor` at `total`: the
/// schedules of transformers' and diffusers' `get_scheduler` (`get_cosine_schedule_with_warmup`
/// and friends), whose first step runs at 0 and whose step `warmup` reaches the peak.
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
        };
        self.floor + (self.peak - self.floor) * shape
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

    #[test]
    fn linear_scaling() {
        assert_eq!(scale_lr(1e-3, 32768, 256), 0.128);
    }
}
