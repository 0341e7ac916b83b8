//! Training logs: one record per step as JSON lines or CSV, chosen by the file's extension, for
//! every trainer. On resume, records after the checkpoint's step are dropped, so the file reads
//! as one uninterrupted run.
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

/// What a trainer logs per step: JSON by its `Serialize` field names, CSV by its own header
/// and row (the number formats are the record's). Both carry the step number, first in a CSV
/// row, under `step` in JSON, so a resumed log can be cut at the checkpoint.
pub trait Record: serde::Serialize {
    /// The CSV header line (comma-separated field names, `step` first).
    const CSV_HEADER: &'static str;
    /// The record as one CSV line, without the newline.
    fn csv_row(&self) -> String;
}

/// An open metrics file (see the module docs). The file is written from the first record on,
/// so a run that fails before its first step leaves an earlier log as it was and no empty one.
pub struct Metrics {
    path: PathBuf,
    file: Option<File>,
    /// The lines that go before the first record: the CSV header and the records kept on resume.
    leading: Vec<String>,
    csv: bool,
}

fn io_error(path: &Path, e: std::io::Error) -> Error {
    Error::io(format!("metrics file {}", path.display()), e)
}

impl Metrics {
    /// Opens `path` for records of `R` (`.csv` for CSV, anything else JSON lines). From
    /// scratch (`resume_step` None) the file is replaced; on resume, records up to
    /// `resume_step` are kept. Whether `path` can be written is checked here, before any step.
    pub fn open<R: Record>(path: &Path, resume_step: Option<usize>) -> Result<Metrics> {
        let csv = path.extension().is_some_and(|e| e == "csv");
        let kept = match resume_step {
            Some(step) if path.exists() => kept_lines(path, csv, step)?,
            _ => vec![],
        };
        if path.exists() {
            OpenOptions::new().append(true).open(path).map_err(|e| io_error(path, e))?;
        } else {
            OpenOptions::new().write(true).create_new(true).open(path).map_err(|e| io_error(path, e))?;
            std::fs::remove_file(path).map_err(|e| io_error(path, e))?;
        }
        let header = csv.then(|| R::CSV_HEADER.to_owned());
        Ok(Metrics { path: path.to_path_buf(), file: None, leading: header.into_iter().chain(kept).collect(), csv })
    }

    /// Appends one record and flushes it, so the log is current if the job dies.
    pub fn write<R: Record>(&mut self, r: &R) -> Result<()> {
        let line = match self.csv {
            true => r.csv_row(),
            false => serde_json::to_string(r).map_err(|e| Error::Invalid(format!("metrics record: {e}")))?,
        };
        let path = &self.path;
        let file = match &mut self.file {
            Some(file) => file,
            None => {
                let mut file = File::create(path).map_err(|e| io_error(path, e))?;
                for line in self.leading.drain(..) {
                    writeln!(file, "{line}").map_err(|e| io_error(path, e))?;
                }
                self.file.insert(file)
            }
        };
        writeln!(file, "{line}").and_then(|()| file.flush()).map_err(|e| io_error(path, e))
    }
}

/// The record lines of an existing metrics file whose step is at most `step`.
fn kept_lines(path: &Path, csv: bool, step: usize) -> Result<Vec<String>> {
    let file = File::open(path).map_err(|e| io_error(path, e))?;
    let mut kept = vec![];
    for line in BufReader::new(file).lines() {
        let line = line.map_err(|e| io_error(path, e))?;
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

    #[derive(serde::Serialize)]
    struct Step {
        step: usize,
        loss: f64,
        val: Option<f64>,
    }

    impl Record for Step {
        const CSV_HEADER: &'static str = "step,loss,val";
        fn csv_row(&self) -> String {
            format!("{},{:.6},{}", self.step, self.loss, self.val.map(|v| format!("{v:.6}")).unwrap_or_default())
        }
    }

    #[test]
    fn resume_keeps_records_up_to_the_checkpoint() {
        let dir = std::env::temp_dir().join(format!("engine-metrics-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let record = |step| Step { step, loss: 1.5, val: (step == 2).then_some(0.5) };
        for name in ["m.jsonl", "m.csv"] {
            let path = dir.join(name);
            let mut m = Metrics::open::<Step>(&path, None).unwrap();
            (1..=4).for_each(|s| m.write(&record(s)).unwrap());
            drop(m);
            // Until its first record a resumed run leaves the log as it was.
            let mut m = Metrics::open::<Step>(&path, Some(2)).unwrap();
            assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 4 + name.ends_with("csv") as usize);
            m.write(&record(3)).unwrap();
            let text = std::fs::read_to_string(&path).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            let csv = name.ends_with("csv");
            assert_eq!(lines.len(), 3 + csv as usize, "{text}");
            if csv {
                assert_eq!(lines[0], Step::CSV_HEADER);
                assert_eq!(lines[2], "2,1.500000,0.500000");
            } else {
                assert!(lines[1].contains("\"val\":0.5") && lines[2].starts_with("{\"step\":3"), "{text}");
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_run_without_records_writes_no_file_and_an_unwritable_path_fails_at_open() {
        let dir = std::env::temp_dir().join(format!("engine-metrics-none-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("m.csv");
        drop(Metrics::open::<Step>(&path, None).unwrap());
        assert!(!path.exists(), "an empty log was left");
        let missing = dir.join("no-such-folder/m.jsonl");
        let err = Metrics::open::<Step>(&missing, None).err().unwrap().to_string();
        assert!(err.contains("no-such-folder/m.jsonl"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
