//! `vit pretrain`'s training log record: one per step, with validation figures at epoch ends,
//! written by the engine's [`engine::metrics::Metrics`] as JSON lines or CSV (and to
//! TensorBoard).

/// One step's figures.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Record {
    /// Optimizer steps completed.
    pub step: usize,
    /// Epoch (1-based) the step belongs to.
    pub epoch: usize,
    /// Mean training loss over the global batch.
    pub loss: f64,
    /// Learning rate used by the step.
    pub lr: f64,
    /// Training images per second over the step, all ranks.
    pub images_per_s: f64,
    /// Whether the step was applied (fp16 skips steps whose gradients overflowed).
    pub applied: bool,
    /// Validation top-1 accuracy, at evaluation steps.
    pub val_top1: Option<f64>,
    /// Validation top-5 accuracy, at evaluation steps.
    pub val_top5: Option<f64>,
    /// Seconds of the step.
    pub seconds: f64,
    /// Global gradient norm before clipping, where the step takes it (`--clip-grad`, fp16).
    pub grad_norm: Option<f64>,
    /// Peak memory so far (allocator on a GPU, resident set on the CPU), bytes.
    pub peak_bytes: Option<u64>,
}

impl engine::metrics::Record for Record {
    const CSV_HEADER: &'static str =
        "step,epoch,loss,lr,images_per_s,applied,val_top1,val_top5,seconds,grad_norm,peak_bytes";

    fn csv_row(&self) -> String {
        let opt = |v: Option<f64>| v.map(|v| format!("{v:.6}")).unwrap_or_default();
        format!(
            "{},{},{:.6},{:.6e},{:.1},{},{},{},{:.3},{},{}",
            self.step,
            self.epoch,
            self.loss,
            self.lr,
            self.images_per_s,
            self.applied,
            opt(self.val_top1),
            opt(self.val_top5),
            self.seconds,
            opt(self.grad_norm),
            self.peak_bytes.map(|b| b.to_string()).unwrap_or_default()
        )
    }

    fn step(&self) -> usize {
        self.step
    }

    fn scalars(&self) -> Vec<(&'static str, f64)> {
        let always = [
            ("train/loss", self.loss),
            ("train/lr", self.lr),
            ("train/images_per_s", self.images_per_s),
            ("train/step_seconds", self.seconds),
        ];
        let sometimes = [
            ("train/grad_norm", self.grad_norm),
            ("train/peak_memory_gib", self.peak_bytes.map(engine::metrics::gib)),
            ("val/top1", self.val_top1),
            ("val/top5", self.val_top5),
        ];
        always.into_iter().chain(sometimes.into_iter().filter_map(|(t, v)| Some((t, v?)))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::metrics::Record as _;

    #[test]
    fn csv_and_json_rows_carry_every_field() {
        let r = Record {
            step: 2,
            epoch: 1,
            loss: 1.5,
            lr: 1e-3,
            images_per_s: 10.0,
            applied: true,
            val_top1: Some(0.5),
            val_top5: None,
            seconds: 0.25,
            grad_norm: Some(2.0),
            peak_bytes: None,
        };
        let header = "step,epoch,loss,lr,images_per_s,applied,val_top1,val_top5,seconds,grad_norm,peak_bytes";
        assert_eq!(Record::CSV_HEADER, header);
        assert_eq!(r.csv_row(), "2,1,1.500000,1.000000e-3,10.0,true,0.500000,,0.250,2.000000,");
        let tags: Vec<&str> = r.scalars().iter().map(|(t, _)| *t).collect();
        let want =
            ["train/loss", "train/lr", "train/images_per_s", "train/step_seconds", "train/grad_norm", "val/top1"];
        assert_eq!(tags, want, "the figures the step has");
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.starts_with("{\"step\":2") && json.contains("\"val_top1\":0.5"), "{json}");
    }
}
