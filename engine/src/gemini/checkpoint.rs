//! Checkpoints of a model trained under Gemini: the parameters as an ordinary state dict
//! (full, unsharded tensors under their registered names, whatever the sharding), and the
//! optimizer state sharded: each rank writes the pieces of parameters its shards hold,
//! `optimizer-<rank>-of-<ranks>.safetensors`, keyed `<parameter>::<slot>::<first element>`
//! over the flattened parameter, and rank 0 an index, `optimizer-index.json`, with the files
//! and the step count. Loading assembles each rank's pieces from whichever files hold them, so
//! the state loads on any number of ranks.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::{Device, Tensor};

use super::shadow;
use super::training::Gemini;
use crate::{Error, Result};

/// The optimizer index file's name.
pub const INDEX: &str = "optimizer-index.json";

#[derive(serde::Serialize, serde::Deserialize)]
struct Index {
    format: String,
    steps: i32,
    files: Vec<String>,
}

const FORMAT: &str = "gemini-optimizer-v1";

fn shard_file(rank: usize, ranks: usize) -> String {
    format!("optimizer-{rank:05}-of-{ranks:05}.safetensors")
}

/// Writes `write(tmp)` to a temporary name beside `path`, then renames it into place.
fn write_then_rename(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let result = write(&tmp).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|e| Error::invalid(format!("renaming {}: {e}", tmp.display())))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

impl Gemini {
    /// The parameters, full and on the host, under their registered names (collective: every
    /// rank of a sharded group must call it).
    pub fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let m = self.manager()?;
        let homes: Vec<Tensor> = (0..m.chunk_count()).map(|c| m.home(c).shallow_clone()).collect();
        shadow::gather(&m, &homes)
    }

    /// Loads parameters from a full state dict (each rank takes its shards' parts). A missing
    /// name or a shape that differs is an error naming it.
    pub fn load_state_dict(&self, named: &HashMap<String, Tensor>) -> Result<()> {
        let mut m = self.manager()?;
        let homes: Vec<Tensor> = (0..m.chunk_count()).map(|c| m.home(c).shallow_clone()).collect();
        shadow::for_each_piece(&m, named, |c, at, len, src| {
            homes[c].f_narrow(0, at as i64, len as i64)?.f_copy_(src)?;
            Ok(())
        })?;
        // Resident payloads and upload copies hold the old values.
        m.homes_changed()
    }

    /// Writes this rank's optimizer shard into `dir` (and, on rank 0, the index). Every rank
    /// calls it; the caller synchronises before relying on the directory.
    pub fn save_optimizer(&self, dir: &Path) -> Result<()> {
        let m = self.manager()?;
        let opt = self.optimizer()?;
        let (rank, ranks) = match m.replication() {
            Some(rep) if rep.shard => (rep.group.rank(), rep.group.size()),
            Some(rep) => (rep.group.rank(), 1),
            None => (0, 1),
        };
        // Replicated ranks hold the same state: rank 0 writes it.
        let writes = m.replication().is_none_or(|rep| rep.shard || rep.group.rank() == 0);
        if writes {
            let named: Vec<(String, Tensor)> = opt
                .state_pieces(&m)?
                .into_iter()
                .map(|(name, slot, start, t)| (format!("{name}::{slot}::{start}"), t))
                .collect();
            let path = dir.join(shard_file(rank, ranks));
            write_then_rename(&path, |tmp| {
                Tensor::write_safetensors(&named, tmp)
                    .map_err(|e| Error::invalid(format!("writing {}: {e}", tmp.display())))
            })?;
        }
        if rank == 0 && m.replication().is_none_or(|rep| rep.group.rank() == 0) {
            let index = Index {
                format: FORMAT.into(),
                steps: opt.steps(),
                files: (0..ranks).map(|r| shard_file(r, ranks)).collect(),
            };
            let path = dir.join(INDEX);
            let text = serde_json::to_string_pretty(&index).map_err(|e| Error::invalid(e.to_string()))?;
            write_then_rename(&path, |tmp| {
                std::fs::write(tmp, text).map_err(|e| Error::invalid(format!("writing {}: {e}", tmp.display())))
            })?;
        }
        Ok(())
    }

    /// Loads optimizer state written by [`Gemini::save_optimizer`] with any number of ranks.
    /// A missing file, or state missing for part of a parameter, is an error naming it.
    pub fn load_optimizer(&self, dir: &Path) -> Result<()> {
        let index_path = dir.join(INDEX);
        let text = std::fs::read_to_string(&index_path)
            .map_err(|e| Error::invalid(format!("reading {}: {e}", index_path.display())))?;
        let index: Index = serde_json::from_str(&text)
            .map_err(|e| Error::invalid(format!("{}: not a Gemini optimizer index: {e}", index_path.display())))?;
        crate::error::ensure!(
            index.format == FORMAT,
            "{}: format {:?}, expected {FORMAT:?}",
            index_path.display(),
            index.format
        );
        // (parameter, slot) -> pieces (first element, values).
        let mut pieces: HashMap<(String, String), Vec<(usize, Tensor)>> = HashMap::new();
        for file in &index.files {
            let path = dir.join(file);
            let named = Tensor::read_safetensors(&path)
                .map_err(|e| Error::invalid(format!("reading {}: {e}", path.display())))?;
            for (key, t) in named {
                let mut parts = key.rsplitn(3, "::");
                let (Some(start), Some(slot), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
                    return Err(Error::invalid(format!("{}: unexpected key {key}", path.display())));
                };
                let start: usize =
                    start.parse().map_err(|_| Error::invalid(format!("{}: unexpected key {key}", path.display())))?;
                // Pieces are flat runs of fp32 state: another shape or kind is a damaged file.
                if t.dim() != 1 || !t.is_floating_point() {
                    return Err(Error::invalid(format!(
                        "{}: key {key} is {:?} {:?}, expected a flat floating-point piece",
                        path.display(),
                        t.kind(),
                        t.size()
                    )));
                }
                pieces.entry((name.to_string(), slot.to_string())).or_default().push((start, t));
            }
        }
        let m = self.manager()?;
        let mut lookup = |name: &str, slot: &str, first: usize, len: usize| -> Result<Tensor> {
            let missing =
                || Error::invalid(format!("{}: no {slot} state for {name}[{first}..{}]", dir.display(), first + len));
            let stored = pieces.get(&(name.to_string(), slot.to_string())).ok_or_else(missing)?;
            let out = Tensor::f_zeros([len as i64], (tch::Kind::Float, Device::Cpu))?;
            let mut covered = 0;
            for (start, t) in stored {
                let (a, b) = ((*start).max(first), (start + t.numel()).min(first + len));
                if a < b {
                    out.f_narrow(0, (a - first) as i64, (b - a) as i64)?.f_copy_(&t.f_narrow(
                        0,
                        (a - start) as i64,
                        (b - a) as i64,
                    )?)?;
                    covered += b - a;
                }
            }
            crate::error::ensure!(
                covered == len,
                "{}: {slot} state of {name}[{first}..{}]: the stored pieces cover {covered} of its {len} elements",
                dir.display(),
                first + len
            );
            Ok(out)
        };
        self.optimizer()?.load_state_pieces(&m, index.steps, &mut lookup)
    }
}
