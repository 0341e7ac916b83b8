//! Training logs: one record per step as JSON lines or CSV, chosen by the file's extension, for
//! every trainer, and with `--report-to tensorboard` the same steps' scalars (and images a
//! trainer adds) in TensorBoard event files ([`tensorboard`]). On resume, records after the
//! checkpoint's step are dropped, so the log reads as one uninterrupted run (TensorBoard is
//! told to drop them too).
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};

use crate::{Error, Result};

pub mod tensorboard;

use tensorboard::{EventWriter, Value};

/// What a trainer logs per step: JSON by its `Serialize` field names, CSV by its own header
/// and row (the number formats are the record's), TensorBoard by its scalars. All carry the
/// step number, first in a CSV row, under `step` in JSON, so a resumed log can be cut at the
/// checkpoint.
pub trait Record: serde::Serialize {
    /// The CSV header line (comma-separated field names, `step` first).
    const CSV_HEADER: &'static str;
    /// The record as one CSV line, without the newline.
    fn csv_row(&self) -> String;
    /// The step number.
    fn step(&self) -> usize;
    /// The scalars TensorBoard shows, by tag (`train/loss`, `val/top1`, ...); figures the step
    /// does not have are left out.
    fn scalars(&self) -> Vec<(&'static str, f64)>;
}

/// An image for TensorBoard: its tag and PNG file.
pub struct LoggedImage {
    /// The tag (`validation/0`).
    pub tag: String,
    /// The PNG file's bytes.
    pub png: Vec<u8>,
    /// Pixels down.
    pub height: u32,
    /// Pixels across.
    pub width: u32,
    /// Channels: 1 grey, 3 RGB, 4 RGBA.
    pub channels: u32,
}

/// Bytes as GiB, the unit TensorBoard's memory scalars are in.
pub fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// An open training log (see the module docs). The files are written from the first record on,
/// so a run that fails before its first step leaves an earlier log as it was and no empty one.
pub struct Metrics {
    path: PathBuf,
    file: Option<File>,
    /// The lines that go before the first record: the CSV header and the records kept on resume.
    leading: Vec<String>,
    csv: bool,
    tensorboard: Option<TensorBoard>,
}

/// The event file of a log, made at its first record.
struct TensorBoard {
    dir: PathBuf,
    resumed_after: Option<usize>,
    writer: Option<EventWriter>,
}

impl TensorBoard {
    fn writer(&mut self) -> Result<&mut EventWriter> {
        if self.writer.is_none() {
            self.writer = Some(EventWriter::create(&self.dir, self.resumed_after)?);
        }
        Ok(self.writer.as_mut().expect("made above"))
    }
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
        let leading = header.into_iter().chain(kept).collect();
        Ok(Metrics { path: path.to_path_buf(), file: None, leading, csv, tensorboard: None })
    }

    /// Also logs to a new TensorBoard event file in `dir` (made now, with its parents; the
    /// file at the first record). `resume_step`: as for [`Metrics::open`].
    pub fn with_tensorboard(mut self, dir: &Path, resume_step: Option<usize>) -> Result<Metrics> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io(format!("TensorBoard log folder {}", dir.display()), e))?;
        self.tensorboard = Some(TensorBoard { dir: dir.to_path_buf(), resumed_after: resume_step, writer: None });
        Ok(self)
    }

    /// Appends one record and flushes it (and its scalars to TensorBoard), so the log is
    /// current if the job dies.
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
        writeln!(file, "{line}").and_then(|()| file.flush()).map_err(|e| io_error(path, e))?;
        if let Some(tb) = &mut self.tensorboard {
            let scalars: Vec<(&str, Value)> = r.scalars().into_iter().map(|(t, v)| (t, Value::Scalar(v))).collect();
            tb.writer()?.write(r.step(), &scalars)?;
        }
        Ok(())
    }

    /// Logs `images` to TensorBoard at `step` (nothing without it).
    pub fn images(&mut self, step: usize, images: &[LoggedImage]) -> Result<()> {
        let Some(tb) = &mut self.tensorboard else { return Ok(()) };
        let values: Vec<(&str, Value)> = images
            .iter()
            .map(|i| {
                let image = Value::Image { height: i.height, width: i.width, channels: i.channels, png: &i.png };
                (i.tag.as_str(), image)
            })
            .collect();
        tb.writer()?.write(step, &values)
    }

    /// The TensorBoard event file, once written.
    pub fn event_file(&self) -> Option<&Path> {
        self.tensorboard.as_ref().and_then(|tb| tb.writer.as_ref()).map(EventWriter::path)
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
        fn step(&self) -> usize {
            self.step
        }
        fn scalars(&self) -> Vec<(&'static str, f64)> {
            [("train/loss", Some(self.loss)), ("val/loss", self.val)]
                .into_iter()
                .filter_map(|(t, v)| Some((t, v?)))
                .collect()
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

    #[test]
    fn tensorboard_gets_each_records_scalars_from_the_first_record_on() {
        let dir = std::env::temp_dir().join(format!("engine-metrics-tb-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let logs = dir.join("logs/run");
        let mut m = Metrics::open::<Step>(&dir.join("m.jsonl"), None).unwrap().with_tensorboard(&logs, None).unwrap();
        assert!(logs.is_dir() && std::fs::read_dir(&logs).unwrap().next().is_none(), "no event file before a record");
        m.write(&Step { step: 1, loss: 0.25, val: Some(0.5) }).unwrap();
        let image = LoggedImage { tag: "validation/0".into(), png: vec![1, 2, 3], height: 1, width: 1, channels: 3 };
        m.images(1, &[image]).unwrap();
        let bytes = std::fs::read(m.event_file().unwrap()).unwrap();
        // The tags and the loss as a little-endian float, on disk before the log is dropped.
        let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
        assert!(has(b"train/loss") && has(b"val/loss") && has(b"validation/0") && has(&0.25f32.to_le_bytes()));
        let err = Metrics::open::<Step>(&dir.join("m.csv"), None)
            .unwrap()
            .with_tensorboard(&dir.join("m.jsonl/logs"), None)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("m.jsonl/logs"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
