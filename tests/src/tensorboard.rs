//! TensorBoard's own reader on the event files a trainer wrote: `EventAccumulator` from the
//! project's Python environment (`tensorboard` in scripts/requirements.txt), a fixture tool only.
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// What TensorBoard finds in one run's folder: every scalar by tag as `(step, value)`, every
/// image by tag as `(step, width, height)`, steps in order. Resumed runs' files are read as
/// TensorBoard reads them (what a restart's `SessionLog` START says to drop is dropped).
#[derive(Debug, Default)]
pub struct Events {
    /// Scalars by tag.
    pub scalars: BTreeMap<String, Vec<(i64, f64)>>,
    /// Images by tag.
    pub images: BTreeMap<String, Vec<(i64, u32, u32)>>,
}

impl Events {
    /// The steps of scalar `tag` (none when the tag is missing).
    pub fn steps(&self, tag: &str) -> Vec<i64> {
        self.scalars.get(tag).map(|v| v.iter().map(|(s, _)| *s).collect()).unwrap_or_default()
    }

    /// The values of scalar `tag`, panicking with the tags there are when it is missing.
    pub fn values(&self, tag: &str) -> Vec<f64> {
        let v = self
            .scalars
            .get(tag)
            .unwrap_or_else(|| panic!("no scalar {tag}; TensorBoard has {:?}", self.scalars.keys()));
        v.iter().map(|(_, x)| *x).collect()
    }
}

const READER: &str = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.IMAGES: 0})
acc.Reload()
tags = acc.Tags()
print(json.dumps({
    "scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]},
    "images": {t: [[e.step, e.width, e.height] for e in acc.Images(t)] for t in tags["images"]},
}))
"#;

/// Reads the run folder `dir` with TensorBoard's `EventAccumulator` (Python from
/// `SUITE_PYTHON`, which scripts/setup.sh sets in cargo's configuration).
pub fn read_tensorboard(dir: &Path) -> Events {
    let python = std::env::var("SUITE_PYTHON").expect("SUITE_PYTHON (set by scripts/setup.sh's cargo config)");
    let out = Command::new(&python).args(["-c", READER]).arg(dir).output().expect("running SUITE_PYTHON");
    assert!(
        out.status.success(),
        "TensorBoard's reader failed on {} (is tensorboard installed? scripts/setup.sh installs \
         scripts/requirements.txt):\n{}",
        dir.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("the reader's JSON");
    let mut events = Events::default();
    for (tag, points) in json["scalars"].as_object().into_iter().flatten() {
        let points = points.as_array().into_iter().flatten().map(|p| (p[0].as_i64().unwrap(), p[1].as_f64().unwrap()));
        events.scalars.insert(tag.clone(), points.collect());
    }
    for (tag, points) in json["images"].as_object().into_iter().flatten() {
        let points = points
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| (p[0].as_i64().unwrap(), p[1].as_u64().unwrap() as u32, p[2].as_u64().unwrap() as u32));
        events.images.insert(tag.clone(), points.collect());
    }
    events
}
