//! Training metrics, one record per step (and validation figures at epoch ends), as JSON lines
//! or CSV chosen by the file's extension. On resume, records after the checkpoint's step are
//! dropped so the file reads as one uninterrupted run.
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

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

const CSV_HEADER: &str = "step,epoch,loss,lr,images_per_s,applied,val_top1,val_top5";

/// Appends records to a metrics file.
pub struct Metrics {
    path: PathBuf,
    file: File,
    csv: bool,
}

impl Metrics {
    /// Opens `path` (`.csv` for CSV, anything else JSON lines). From scratch (`resume_step`
    /// None) the file is replaced; on resume, records up to `resume_step` are kept.
    pub fn open(path: &Path, resume_step: Option<usize>) -> anyhow::Result<Metrics> {
        let csv = path.extension().is_some_and(|e| e == "csv");
        let kept = match resume_step {
            Some(step) if path.exists() => kept_lines(path, csv, step)?,
            _ => vec![],
        };
        let mut file = File::create(path).with_context(|| format!("creating {}", path.display()))?;
        if csv {
            writeln!(file, "{CSV_HEADER}")?;
        }
        for line in kept {
            writeln!(file, "{line}")?;
        }
        Ok(Metrics { path: path.to_path_buf(), file, csv })
    }

    /// Appends one record and flushes it.
    pub fn write(&mut self, r: &Record) -> anyhow::Result<()> {
        let line = if self.csv {
            let opt = |v: Option<f64>| v.map(|v| format!("{v:.6}")).unwrap_or_default();
            format!(
                "{},{},{:.6},{:.6e},{:.1},{},{},{}",
                r.step,
                r.epoch,
                r.loss,
                r.lr,
                r.images_per_s,
                r.applied,
                opt(r.val_top1),
                opt(r.val_top5)
            )
        } else {
            serde_json::to_string(r)?
        };
        writeln!(self.file, "{line}")
            .and_then(|()| self.file.flush())
            .with_context(|| format!("writing {}", self.path.display()))
    }
}

/// The lines of an existing metrics file whose step is at most `step`.
fn kept_lines(path: &Path, csv: bool, step: usize) -> anyhow::Result<Vec<String>> {
    let file = File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut kept = vec![];
    for line in BufReader::new(file).lines() {
        let line = line.with_context(|| format!("reading {}", path.display()))?;
        let record_step = if csv {
            line.split(',').next().and_then(|s| s.parse::<usize>().ok())
        } else {
            serde_json::from_str::<serde_json::Value>(&line).ok().and_then(|v| v["step"].as_u64()).map(|s| s as usize)
        };
        if record_step.is_some_and(|s| s <= step) {
            kept.push(line);
        }
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(step: usize) -> Record {
        Record {
            step,
            epoch: 1,
            loss: 1.5,
            lr: 1e-3,
            images_per_s: 10.0,
            applied: true,
            val_top1: (step == 2).then_some(0.5),
            val_top5: None,
        }
    }

    #[test]
    fn resume_keeps_records_up_to_the_checkpoint() {
        let dir = std::env::temp_dir().join(format!("vit-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["m.jsonl", "m.csv"] {
            let path = dir.join(name);
            let mut m = Metrics::open(&path, None).unwrap();
            (1..=4).for_each(|s| m.write(&record(s)).unwrap());
            drop(m);
            let mut m = Metrics::open(&path, Some(2)).unwrap();
            m.write(&record(3)).unwrap();
            let text = std::fs::read_to_string(&path).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            let csv = name.ends_with("csv");
            assert_eq!(lines.len(), 3 + csv as usize, "{text}");
            if csv {
                assert_eq!(lines[0], CSV_HEADER);
                assert_eq!(lines[2], "2,1,1.500000,1.000000e-3,10.0,true,0.500000,");
            } else {
                assert!(lines[1].contains("\"val_top1\":0.5") && lines[2].starts_with("{\"step\":3"), "{text}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
