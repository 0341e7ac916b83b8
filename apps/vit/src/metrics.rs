//! `vit pretrain`'s training log record: one per step, with validation figures at epoch ends,
//! written by the engine's [`engine::metrics::Metrics`] as JSON lines or CSV.

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
}

impl engine::metrics::Record for Record {
    const CSV_HEADER: &'static str = "step,epoch,loss,lr,images_per_s,applied,val_top1,val_top5";

    fn csv_row(&self) -> String {
        let opt = |v: Option<f64>| v.map(|v| format!("{v:.6}")).unwrap_or_default();
        format!(
            "{},{},{:.6},{:.6e},{:.1},{},{},{}",
            self.step,
            self.epoch,
            self.loss,
            self.lr,
            self.images_per_s,
            self.applied,
            opt(self.val_top1),
            opt(self.val_top5)
        )
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
        };
        assert_eq!(Record::CSV_HEADER, "step,epoch,loss,lr,images_per_s,applied,val_top1,val_top5");
        assert_eq!(r.csv_row(), "2,1,1.500000,1.000000e-3,10.0,true,0.500000,");
        let json = serde_json::to_string(&r).unwrap();
        assert!(json.starts_with("{\"step\":2") && json.contains("\"val_top1\":0.5"), "{json}");
    }
}
