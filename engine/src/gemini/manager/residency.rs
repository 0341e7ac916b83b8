//! Which chunks are resident on the compute device: a module's access makes its chunks'
//! payloads resident and its tensors `Compute`, the end of its use puts them back in `Hold`,
//! and room is made by evicting the resident chunk whose next use is farthest away (Belady's
//! rule, optimal when the access order is known: it is, from the trace the first step records).
//! Prefetch loads the next chunks of the trace ahead of their use, on a GPU on a side stream
//! that the compute stream waits for at the chunk's next access.
use tch::{Device, Tensor};

use super::{ChunkManager, Event};
use crate::cuda;
use crate::gemini::budget::human;
use crate::gemini::chunk::TensorState;
use crate::storage::resize_storage;
use crate::{Error, Result};

impl ChunkManager {
    /// Ends a step: the first step's accesses become the trace later steps plan from.
    pub fn end_step(&mut self) {
        self.recording = false;
        self.cursor = 0;
    }

    /// The chunks holding parameters `params` (registration order), each once, in order of
    /// first appearance.
    pub fn chunks_of(&self, params: &[usize]) -> Vec<usize> {
        let mut chunks: Vec<usize> = vec![];
        for &i in params {
            if !chunks.contains(&self.places[i].0) {
                chunks.push(self.places[i].0);
            }
        }
        chunks
    }

    /// A module that uses `params` starts forward or backward: their chunks become resident
    /// (evicting others as the budget requires; an error names the bytes when even that is not
    /// enough) and the parameters `Compute`. Other tensors sharing those chunks keep their
    /// state.
    pub fn access(&mut self, params: &[usize]) -> Result<()> {
        // A part of the model about to run is progress (the spawner's heartbeat), however long
        // a step goes without a collective.
        crate::dist::heartbeat::beat();
        let chunks = self.chunks_of(params);
        self.widest = self.widest.max(chunks.len());
        for &c in &chunks {
            if self.recording {
                self.trace.push(c);
            } else if self.trace.get(self.cursor) == Some(&c) {
                self.cursor += 1;
            }
            self.make_resident(c, &chunks)?;
            // A prefetched gather still in flight: its shards must have arrived.
            if let Some((work, _input)) = self.chunks[c].gather.take() {
                work.wait()?;
            }
            // A prefetch still copying: the module's kernels queue behind it.
            if let (Some(ready), Device::Cuda(d)) = (self.chunks[c].ready.take(), self.device) {
                cuda::Stream::current(d)?.wait_event(&ready)?;
            }
        }
        // Backward enters a module of several outputs once per output. On the CPU autograd
        // runs every output's marker before the module's own backward, but nothing promises
        // that order (device threads, reentrant checkpoints): tensors whose gradient already
        // arrived are done with this step and stay as they are.
        let waiting: Vec<usize> = params
            .iter()
            .copied()
            .filter(|&i| {
                let (c, s) = self.places[i];
                self.chunks[c].slots[s].state != TensorState::ReadyForReduce
            })
            .collect();
        self.move_params(&waiting, TensorState::Compute)
    }

    /// The module's forward is done with `params`: back to `Hold` (the payloads stay resident
    /// until room is needed).
    pub fn done(&mut self, params: &[usize]) -> Result<()> {
        for &i in params {
            let (c, s) = self.places[i];
            let slot = &mut self.chunks[c].slots[s];
            // Free -> Hold is legal for a load, not for the end of a module's use.
            if slot.state != TensorState::Compute {
                return Err(Error::invalid(format!(
                    "gemini: illegal state change of {}: {} -> Hold (done with a tensor not in use)",
                    slot.name, slot.state
                )));
            }
        }
        self.move_params(params, TensorState::Hold)?;
        self.leave_if_lean(params)
    }

    /// The module that used `params` finished its backward: those whose gradient has not
    /// arrived wait in `HoldAfterBackward`; frozen ones, which get none, are done (`Hold`).
    pub fn done_backward(&mut self, params: &[usize]) -> Result<()> {
        let after = match self.trainable {
            true => TensorState::HoldAfterBackward,
            false => TensorState::Hold,
        };
        for &i in params {
            let (c, s) = self.places[i];
            let slot = &mut self.chunks[c].slots[s];
            if slot.state == TensorState::Compute {
                slot.move_to(after)?;
            }
        }
        self.leave_if_lean(params)
    }

    /// Under lean residency, evicts the chunks of `params` that no module uses any more.
    fn leave_if_lean(&mut self, params: &[usize]) -> Result<()> {
        if !self.lean {
            return Ok(());
        }
        for c in self.chunks_of(params) {
            if self.chunks[c].resident && !self.chunks[c].in_compute() {
                self.evict(c)?;
            }
        }
        Ok(())
    }

    fn move_params(&mut self, params: &[usize], to: TensorState) -> Result<()> {
        for &i in params {
            let (c, s) = self.places[i];
            let slot = &mut self.chunks[c].slots[s];
            if slot.state != to {
                slot.move_to(to)?;
            }
        }
        Ok(())
    }

    /// Loads the next `depth` chunks of the trace that are not resident ahead of their use
    /// (in trace order), evicting only chunks whose next use is farther away than the one
    /// loaded (so a prefetch never costs a reload sooner than it saves one). A chunk whose
    /// payload and staged copy (`ChunkManager::staging_of`) do not fit is left to its access,
    /// whose load of a whole chunk converts on the host and stages nothing on the device.
    pub fn prefetch(&mut self, depth: usize) -> Result<()> {
        if self.recording {
            return Ok(());
        }
        // The next `depth` chunks of the trace that are not resident, with their distance.
        let mut upcoming: Vec<(usize, usize)> = vec![];
        for (distance, &c) in self.trace[self.cursor..].iter().enumerate() {
            if upcoming.len() == depth {
                break;
            }
            if !self.chunks[c].resident && !upcoming.iter().any(|&(_, u)| u == c) {
                upcoming.push((distance, c));
            }
        }
        for (distance, c) in upcoming {
            if self.chunks[c].resident {
                continue;
            }
            // The staged copy of the home is not charged (it is freed once the copy ends), but
            // it must fit while it lasts.
            let need = self.chunks[c].bytes() + self.staging_of(c);
            if self.device_bytes + need > self.budget {
                // Evict nothing for a prefetch that cannot fit even once every chunk used
                // later than it is gone.
                let later: usize = (0..self.chunks.len())
                    .filter(|&v| self.evictable(v, &[c]) && self.next_use(v) > distance)
                    .map(|v| self.chunks[v].bytes())
                    .sum();
                if self.device_bytes.saturating_sub(later) + need > self.budget {
                    return Ok(());
                }
            }
            while self.device_bytes + need > self.budget {
                match self.victim(&[c]) {
                    Some((victim, next)) if next > distance => self.evict(victim)?,
                    _ => return Ok(()),
                }
            }
            self.load(c, true)?;
            self.events.push(Event::Prefetch(c));
        }
        Ok(())
    }

    /// Frees every resident payload not in use (end of a step, or before a checkpoint).
    pub fn release_all(&mut self) -> Result<()> {
        for c in 0..self.chunks.len() {
            self.settle(c)?;
        }
        for c in 0..self.chunks.len() {
            if self.chunks[c].resident && !self.chunks[c].in_compute() {
                self.evict(c)?;
            }
        }
        Ok(())
    }

    fn make_resident(&mut self, c: usize, pinned: &[usize]) -> Result<()> {
        if self.chunks[c].resident {
            return Ok(());
        }
        self.make_room(self.chunks[c].bytes(), pinned)?;
        self.load(c, false)?;
        self.events.push(Event::Load(c));
        Ok(())
    }

    /// Evicts chunks (farthest next use first, never those in `pinned`) until `need` more
    /// bytes fit in the budget; the error names the bytes when that is not possible.
    pub(super) fn make_room(&mut self, need: usize, pinned: &[usize]) -> Result<()> {
        while self.device_bytes + need > self.budget {
            let Some((victim, _)) = self.victim(pinned) else {
                let busy: Vec<usize> = (0..self.chunks.len()).filter(|&i| self.chunks[i].resident).collect();
                return Err(Error::invalid(format!(
                    "gemini: {} more are needed on the device for chunk {}, {} of the {} budget are taken (resident chunks in use: {busy:?}); raise the memory budget (or, with a static placement, offload more chunks)",
                    human(need),
                    pinned.first().copied().unwrap_or(0),
                    human(self.device_bytes),
                    human(self.budget)
                )));
            };
            self.evict(victim)?;
        }
        Ok(())
    }

    /// The resident chunk not in use whose next access in the trace is farthest (never used
    /// again comes first), with that distance; while recording, the least recently loaded.
    fn victim(&self, pinned: &[usize]) -> Option<(usize, usize)> {
        let candidates = (0..self.chunks.len()).filter(|&c| self.evictable(c, pinned));
        if self.recording {
            let loaded_at = |c: usize| {
                self.events.iter().rposition(|e| matches!(e, Event::Load(x) | Event::Prefetch(x) if *x == c))
            };
            return candidates.min_by_key(|&c| loaded_at(c)).map(|c| (c, usize::MAX));
        }
        candidates.map(|c| (c, self.next_use(c))).max_by_key(|&(c, next)| (next, c))
    }

    /// Whether chunk `c` could be evicted now: resident, not in use, not in `pinned`.
    fn evictable(&self, c: usize, pinned: &[usize]) -> bool {
        self.chunks[c].resident && !self.chunks[c].in_compute() && !pinned.contains(&c)
    }

    /// How many accesses ahead in the trace chunk `c` is used next (`usize::MAX`: not again).
    fn next_use(&self, c: usize) -> usize {
        self.trace[self.cursor..].iter().position(|&x| x == c).unwrap_or(usize::MAX)
    }

    /// Makes chunk `c`'s payload resident. `ahead`: a prefetch, which on a GPU copies on a
    /// side stream so that it overlaps the running module; the chunk's next access makes the
    /// compute stream wait for it.
    fn load(&mut self, c: usize, ahead: bool) -> Result<()> {
        let bytes = self.chunks[c].bytes();
        self.charge(bytes, c)?;
        // A shared payload is the home: nothing to fill.
        if !self.chunks[c].shared {
            self.fill(c, ahead, bytes)?;
        }
        let ch = &mut self.chunks[c];
        for s in &mut ch.slots {
            s.move_to(TensorState::Hold)?;
        }
        ch.resident = true;
        Ok(())
    }

    /// Allocates chunk `c`'s payload (`bytes`) and fills it from its home (see
    /// [`ChunkManager::load`]).
    fn fill(&mut self, c: usize, ahead: bool, bytes: usize) -> Result<()> {
        // The payload's memory comes from the compute stream's pool.
        resize_storage(&self.chunks[c].payload, bytes)?;
        match (&self.replication, self.device) {
            (Some(rep), _) if rep.shard => {
                same_chunk_everywhere(&rep.group, c)?;
                let ch = &self.chunks[c];
                let mine = ch.home.f_to_device(self.device)?.f_to_kind(ch.kind)?;
                let work = rep.group.all_gather_into_async(&ch.payload, &mine)?;
                // A prefetch overlaps the gather with the modules before the chunk's use.
                match ahead {
                    true => self.chunks[c].gather = Some((work, mine)),
                    false => work.wait()?,
                }
            }
            (_, Device::Cuda(d)) if ahead => {
                let ready = self.copy_on_side_stream(c, d)?;
                self.chunks[c].ready = Some(ready);
            }
            _ => {
                let ch = &self.chunks[c];
                let source = ch.upload.as_ref().filter(|_| ch.upload_fresh).unwrap_or(&ch.home);
                tch::no_grad(|| ch.payload.shallow_clone().f_copy_(source))?;
            }
        }
        Ok(())
    }

    /// Fills chunk `c`'s payload from its home on a side stream of GPU `d`, after the work
    /// queued so far on the compute stream (which may have used the payload's memory last);
    /// returns the event that marks the copy done.
    fn copy_on_side_stream(&mut self, c: usize, d: usize) -> Result<cuda::Event> {
        let main = cuda::Stream::current(d)?;
        if self.side.is_none() {
            self.side = Some(cuda::Stream::from_pool(d, false)?);
        }
        let side = self.side.as_ref().expect("created above");
        let before = cuda::Event::new(false)?;
        before.record(&main)?;
        side.wait_event(&before)?;
        side.set_current()?;
        let ch = &self.chunks[c];
        // Pinned host homes copy asynchronously: straight into the payload when the dtypes
        // agree (or from the upload copy in the payload's kind); else the home's bytes cross as
        // they are and the side stream casts them.
        let copied = tch::no_grad(|| -> Result<()> {
            if let Some(upload) = ch.upload.as_ref().filter(|_| ch.upload_fresh) {
                cuda::copy_async(&ch.payload, upload)?;
            } else if ch.home.kind() == ch.payload.kind() {
                cuda::copy_async(&ch.payload, &ch.home)?;
            } else {
                let staged = ch.home.f_to_dtype_layout((ch.home.kind(), self.device), true, false)?;
                ch.payload.shallow_clone().f_copy_(&staged)?;
            }
            // Should the payload be freed before the copy ends (an error dropping the manager),
            // its memory waits for the side stream.
            side.record_tensor(&ch.payload)
        });
        main.set_current()?;
        copied?;
        let done = cuda::Event::new(false)?;
        done.record(side)?;
        Ok(done)
    }

    /// Waits (on the host) for chunk `c`'s side-stream copy or prefetched gather, if one is
    /// in flight: before its memory is freed, and before its home is stepped.
    fn settle(&mut self, c: usize) -> Result<()> {
        if let Some(ready) = self.chunks[c].ready.take() {
            ready.synchronize()?;
        }
        if let Some((work, _input)) = self.chunks[c].gather.take() {
            work.wait()?;
        }
        Ok(())
    }

    fn evict(&mut self, c: usize) -> Result<()> {
        self.settle(c)?;
        let ch = &mut self.chunks[c];
        for s in &mut ch.slots {
            s.move_to(TensorState::Free)?;
        }
        if !ch.shared {
            resize_storage(&ch.payload, 0)?;
        }
        ch.resident = false;
        self.device_bytes -= ch.bytes();
        self.events.push(Event::Evict(c));
        Ok(())
    }
}

/// Checks that every rank of `group` is about to gather chunk `c` (one small all-gather of the
/// chunk's index). A sharded chunk is gathered when a rank's module needs it, so ranks whose
/// data sent them down different branches would otherwise pair one chunk's shards with
/// another's, or wait for each other forever; this makes that an error naming the chunks.
fn same_chunk_everywhere(group: &crate::dist::ProcessGroup, c: usize) -> Result<()> {
    let all = group.all_gather(&Tensor::from_slice(&[c as i64]))?;
    let all = Vec::<i64>::try_from(&all)?;
    if all.iter().all(|&x| x == c as i64) {
        return Ok(());
    }
    let which: Vec<String> = all.iter().enumerate().map(|(r, x)| format!("rank {r}: chunk {x}")).collect();
    Err(Error::invalid(format!(
        "gemini: the ranks gathered different sharded chunks at the same point ({}): sharded chunks \
         (ZeRO-3) need every rank to run the same modules in the same order; when the data decides \
         which modules run, keep the chunks replicated (shard: false)",
        which.join(", ")
    )))
}
