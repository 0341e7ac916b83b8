//! The chunk manager: owns every chunk, makes a chunk's payload resident on the compute device
//! when its parameters are needed and frees it afterwards, and keeps the bytes it has placed on
//! the device within the budget by evicting the resident chunk whose next use is farthest away
//! (Belady's rule, optimal when the access order is known: it is, from the recorded trace).
//!
//! Each chunk has a home copy (on the device or in host memory, as the placement says) and a
//! payload on the compute device that exists only while the chunk is resident. Parameters are
//! views into the payload: releasing a chunk resizes the payload's storage to zero, so the
//! parameters and the views autograd saved of them stay valid objects whose memory comes back,
//! refilled from the home copy, the next time the chunk is accessed.
//!
//! Over a data-parallel group the chunks are either sharded (ZeRO-3: each rank keeps
//! `1/N` of every home, gradient accumulator and optimizer state; a load is an all-gather of
//! the shards, cast to the compute dtype first; a chunk's gradient, collected on the device,
//! is reduce-scattered once all its tensors have theirs) or replicated (whole homes
//! everywhere, gradients all-reduced), for models small enough to keep whole.
//!
//! Without a GPU the CPU stands in for both tiers and the budget is enforced on the manager's
//! own accounting, so placement and eviction are the same code and testable anywhere.
use tch::{Device, Kind, Tensor};

use super::chunk::{Layout, Slot, TensorState};
use crate::cuda;
use crate::dist::{ProcessGroup, ReduceOp};
use crate::optim::Param;
use crate::storage::resize_storage;
use crate::{Error, Result};

/// Where a chunk's home copy lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// On the compute device (counts against the budget).
    Device,
    /// In host memory.
    Host,
}

/// Chunk manager options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ChunkConfig {
    /// The compute device.
    pub device: Device,
    /// Bytes of model data the manager may place on the device.
    pub budget: usize,
    /// Chunk size search: smallest and largest size in elements, and the step.
    pub search: (usize, usize, usize),
    /// Home-sized buffers a chunk keeps beside its payload, charged to the budget when its home
    /// is on the device: the home (fp32 master) and its gradient accumulator (2), plus the
    /// optimizer's state buffers (Adam and LAMB 2, LARS with momentum 1).
    pub home_buffers: usize,
    /// The dtype the model computes in: the payloads' (and so the parameters') dtype. Homes
    /// are fp32 masters whatever it is; bf16 or fp16 halves the device bytes of resident
    /// chunks and of their gathers.
    pub compute: Kind,
}

/// How chunks are spread over a data-parallel group.
#[derive(Clone, Debug)]
pub struct Replication {
    /// The data-parallel group.
    pub group: ProcessGroup,
    /// ZeRO-3: each rank keeps 1/N of every chunk's home, gradient and optimizer state, gathers
    /// a chunk to use it and reduce-scatters its gradient. Otherwise every rank keeps whole
    /// chunks and gradients are all-reduced (small models).
    pub shard: bool,
}

/// Something the manager did, for diagnostics and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A chunk's payload was made resident (filled from its home copy).
    Load(usize),
    /// A chunk's payload was freed to make room.
    Evict(usize),
    /// A chunk was loaded ahead of its use, following the trace.
    Prefetch(usize),
    /// A chunk's home copy moved between tiers.
    MoveHome(usize, Tier),
}

pub(crate) struct Chunk {
    pub(crate) slots: Vec<Slot>,
    pub(crate) kind: Kind,
    /// `[capacity]` on the compute device; storage of zero bytes while not resident.
    pub(crate) payload: Tensor,
    /// This rank's part of the home copy: `[capacity / shards]` fp32, elements
    /// `shard_offset..` of the chunk.
    pub(crate) home: Tensor,
    pub(crate) tier: Tier,
    pub(crate) resident: bool,
    /// Gradient accumulator beside the home copy, same shape.
    pub(crate) grad: Tensor,
    /// `[capacity]` gradient of the whole chunk on the compute device, collecting the
    /// parameters' gradients until the chunk's are all here and it is reduced across ranks
    /// (only with a data-parallel group).
    pub(crate) full_grad: Option<Tensor>,
    /// Marks the end of a prefetch copy still in flight on the side stream (GPU only).
    ready: Option<cuda::Event>,
}

impl Chunk {
    fn bytes(&self) -> usize {
        self.payload.numel() * self.kind.elt_size_in_bytes()
    }

    /// Bytes of one home-sized buffer (fp32).
    fn home_bytes(&self) -> usize {
        self.home.numel() * 4
    }

    fn in_compute(&self) -> bool {
        self.slots.iter().any(|s| s.state != TensorState::Hold && s.state != TensorState::Free)
    }
}

/// A part of a parameter inside one rank's shard of a chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    /// Registration index of the parameter.
    pub param: usize,
    pub name: String,
    pub shape: Vec<i64>,
    /// First element of the piece within the (flattened) parameter.
    pub in_param: usize,
    /// First element of the piece within the shard.
    pub in_shard: usize,
    pub len: usize,
}

/// Owns the chunks of a model's parameters. See the module documentation.
pub struct ChunkManager {
    device: Device,
    budget: usize,
    home_buffers: usize,
    pub(crate) chunks: Vec<Chunk>,
    /// (chunk, slot) of each registered parameter, by registration index.
    places: Vec<(usize, usize)>,
    /// Whether weight decay and trust ratios apply, by registration index.
    pub(crate) adapt: Vec<bool>,
    pub(crate) replication: Option<Replication>,
    /// First element of this rank's shard in every chunk.
    pub(crate) shard_offset: usize,
    device_bytes: usize,
    peak_device_bytes: usize,
    /// Chunk accesses in order: recorded during the first step, replayed afterwards.
    trace: Vec<usize>,
    recording: bool,
    /// The most chunks one access has needed.
    widest: usize,
    /// The GPU side stream prefetches copy on (created at the first).
    side: Option<cuda::Stream>,
    /// Position in the trace during a replayed step.
    cursor: usize,
    events: Vec<Event>,
}

impl ChunkManager {
    /// Packs `params` (in execution order, all of one dtype) into chunks, makes every parameter a
    /// view into its chunk's payload, and releases every payload: afterwards each chunk lives
    /// only in its home copy, on `tier`.
    pub fn new(params: &[Param], cfg: ChunkConfig, tier: Tier) -> Result<ChunkManager> {
        Self::build(params, cfg, tier, None)
    }

    /// As [`ChunkManager::new`], every rank of `replication.group` registering the same
    /// parameters with the same values; with sharding each keeps only its part of every home.
    pub fn replicated(
        params: &[Param],
        cfg: ChunkConfig,
        tier: Tier,
        replication: Replication,
    ) -> Result<ChunkManager> {
        let replication = (replication.group.size() > 1).then_some(replication);
        Self::build(params, cfg, tier, replication)
    }

    fn build(params: &[Param], cfg: ChunkConfig, tier: Tier, replication: Option<Replication>) -> Result<ChunkManager> {
        crate::error::ensure!(!params.is_empty(), "gemini: no parameters to manage");
        for p in params {
            crate::error::ensure!(
                p.tensor.kind() == Kind::Float,
                "gemini: parameter {} is {:?}; register fp32 parameters (they become fp32 masters)",
                p.name,
                p.tensor.kind()
            );
        }
        crate::error::ensure!(
            matches!(cfg.compute, Kind::Float | Kind::BFloat16 | Kind::Half),
            "gemini: compute dtype {:?} is not fp32, bf16 or fp16",
            cfg.compute
        );
        let kind = cfg.compute;
        let (shards, rank) = match &replication {
            Some(r) if r.shard => (r.group.size(), r.group.rank()),
            _ => (1, 0),
        };
        let numels: Vec<usize> = params.iter().map(|p| p.tensor.numel()).collect();
        let (min, max, step) = cfg.search;
        let layout = Layout::search(&numels, min, max, step, shards);
        let shard_len = layout.chunk_size / shards;
        let mut manager = ChunkManager {
            device: cfg.device,
            budget: cfg.budget,
            home_buffers: cfg.home_buffers,
            chunks: vec![],
            places: vec![(0, 0); params.len()],
            adapt: params.iter().map(|p| p.adapt).collect(),
            replication,
            shard_offset: rank * shard_len,
            device_bytes: 0,
            peak_device_bytes: 0,
            trace: vec![],
            recording: true,
            widest: 0,
            side: None,
            cursor: 0,
            events: vec![],
        };
        for (c, members) in layout.chunks.iter().enumerate() {
            let payload = Tensor::f_zeros([layout.chunk_size as i64], (kind, cfg.device))?;
            // The fp32 values, from which the home is cut (the payload may be rounded).
            let master = Tensor::f_zeros([layout.chunk_size as i64], (Kind::Float, cfg.device))?;
            let mut slots = vec![];
            let mut offset = 0;
            for (s, &i) in members.iter().enumerate() {
                let p = &params[i];
                let n = numels[i];
                let flat = p.tensor.f_detach()?.f_flatten(0, -1)?;
                tch::no_grad(|| master.f_narrow(0, offset as i64, n as i64)?.f_copy_(&flat))?;
                let view = payload.f_narrow(0, offset as i64, n as i64)?.f_view(p.tensor.size().as_slice())?;
                tch::no_grad(|| view.shallow_clone().f_copy_(&p.tensor))?;
                // The parameter keeps its identity (autograd, hooks, the VarStore) and now
                // points into the chunk.
                let mut t = p.tensor.shallow_clone();
                t.f_set_data(&view)?;
                slots.push(Slot {
                    name: p.name.clone(),
                    shape: p.tensor.size(),
                    offset,
                    numel: n,
                    state: TensorState::Free,
                });
                manager.places[i] = (c, s);
                offset += n;
            }
            let home = manager.on_tier(&master.f_narrow(0, manager.shard_offset as i64, shard_len as i64)?, tier)?;
            let grad = manager.on_tier(&home.f_zeros_like()?, tier)?;
            let chunk = Chunk { slots, kind, payload, home, tier, resident: false, grad, full_grad: None, ready: None };
            resize_storage(&chunk.payload, 0)?;
            if tier == Tier::Device {
                manager.charge(manager.home_buffers * chunk.home_bytes(), c)?;
            }
            manager.chunks.push(chunk);
        }
        Ok(manager)
    }

    /// Number of chunks.
    pub fn chunk_count(&self) -> usize {
        self.chunks.len()
    }

    /// The chunk holding parameter `i` (registration order).
    pub fn chunk_of(&self, i: usize) -> usize {
        self.places[i].0
    }

    /// Elements per chunk.
    pub fn chunk_numel(&self) -> usize {
        self.chunks[0].payload.numel()
    }

    /// Bytes the manager has placed on the device now, and at most so far.
    pub fn device_bytes(&self) -> (usize, usize) {
        (self.device_bytes, self.peak_device_bytes)
    }

    /// Whether a chunk's payload is resident.
    pub fn is_resident(&self, chunk: usize) -> bool {
        self.chunks[chunk].resident
    }

    /// The state of each tensor of a chunk.
    pub fn states(&self, chunk: usize) -> Vec<TensorState> {
        self.chunks[chunk].slots.iter().map(|s| s.state).collect()
    }

    /// What happened so far (loads, evictions, prefetches, moves), oldest first.
    pub fn events(&self) -> &[Event] {
        &self.events
    }

    /// The recorded access trace.
    pub fn trace(&self) -> &[usize] {
        &self.trace
    }

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
        let chunks = self.chunks_of(params);
        self.widest = self.widest.max(chunks.len());
        for &c in &chunks {
            if self.recording {
                self.trace.push(c);
            } else if self.trace.get(self.cursor) == Some(&c) {
                self.cursor += 1;
            }
            self.make_resident(c, &chunks)?;
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
        self.move_params(params, TensorState::Hold)
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
    /// (in trace order), evicting only chunks
    /// whose next use is farther away than the one loaded (so a prefetch never costs a reload
    /// sooner than it saves one).
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
            let need = self.chunks[c].bytes();
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

    /// Moves a chunk's home copy to `tier` (accounting follows).
    pub fn move_home(&mut self, chunk: usize, tier: Tier) -> Result<()> {
        if self.chunks[chunk].tier == tier {
            return Ok(());
        }
        // The home copy, its gradient accumulator and the optimizer state move together.
        let bytes = self.home_buffers * self.chunks[chunk].home_bytes();
        if tier == Tier::Device {
            self.charge(bytes, chunk)?;
        } else {
            self.device_bytes -= bytes;
        }
        let (home, grad) =
            (self.on_tier(&self.chunks[chunk].home, tier)?, self.on_tier(&self.chunks[chunk].grad, tier)?);
        let ch = &mut self.chunks[chunk];
        (ch.home, ch.grad) = (home, grad);
        ch.tier = tier;
        self.events.push(Event::MoveHome(chunk, tier));
        Ok(())
    }

    /// The module that used `params` finished its backward: those whose gradient has not
    /// arrived wait in `HoldAfterBackward`.
    pub fn done_backward(&mut self, params: &[usize]) -> Result<()> {
        for &i in params {
            let (c, s) = self.places[i];
            let slot = &mut self.chunks[c].slots[s];
            if slot.state == TensorState::Compute {
                slot.move_to(TensorState::HoldAfterBackward)?;
            }
        }
        Ok(())
    }

    /// Parameter `i`'s gradient arrived. Alone it is added into its chunk's gradient
    /// accumulator (beside the home copy, so on the home's tier); with a data-parallel group
    /// into the chunk's whole gradient on the device. When every tensor of the chunk has its
    /// gradient the chunk's gradient is complete: it is reduced across ranks (see
    /// [`ChunkManager::reduce`]) and its tensors go back to `Hold`.
    pub fn add_gradient(&mut self, i: usize, grad: &Tensor) -> Result<()> {
        let (c, s) = self.places[i];
        self.chunks[c].slots[s].move_to(TensorState::ReadyForReduce)?;
        if self.replication.is_some() && self.chunks[c].full_grad.is_none() {
            let bytes = self.chunks[c].payload.numel() * 4;
            self.make_room(bytes, &[c])?;
            self.charge(bytes, c)?;
            self.chunks[c].full_grad =
                Some(Tensor::f_zeros([self.chunks[c].payload.numel() as i64], (Kind::Float, self.device))?);
        }
        let ch = &self.chunks[c];
        let slot = &ch.slots[s];
        let acc = match &ch.full_grad {
            Some(full) => full.f_narrow(0, slot.offset as i64, slot.numel as i64)?,
            None => ch.grad.f_narrow(0, slot.offset as i64, slot.numel as i64)?,
        };
        let g = grad.f_flatten(0, -1)?.f_to_device(acc.device())?.f_to_kind(Kind::Float)?;
        tch::no_grad(|| acc.shallow_clone().f_add_(&g).map(drop))?;
        if self.chunks[c].slots.iter().all(|s| s.state == TensorState::ReadyForReduce) {
            self.reduce(c)?;
            for s in &mut self.chunks[c].slots {
                s.move_to(TensorState::Hold)?;
            }
        }
        Ok(())
    }

    /// Averages a chunk's whole gradient across the data-parallel group into this rank's
    /// accumulator: a reduce-scatter when sharded (each rank gets its part), an all-reduce
    /// when replicated. Every rank reduces the same chunks in the same order (gradients arrive
    /// in the order of the same backward graph; partial chunks are reduced in chunk order by
    /// [`ChunkManager::finish_backward`]).
    fn reduce(&mut self, c: usize) -> Result<()> {
        let Some(full) = self.chunks[c].full_grad.take() else { return Ok(()) };
        let Some(rep) = &self.replication else { return Ok(()) };
        let mine = if rep.shard {
            rep.group.reduce_scatter(&full, ReduceOp::Avg)?
        } else {
            rep.group.all_reduce(&full, ReduceOp::Avg)?;
            full.shallow_clone()
        };
        let ch = &self.chunks[c];
        tch::no_grad(|| ch.grad.shallow_clone().f_add_(&mine.f_to_device(ch.grad.device())?).map(drop))?;
        self.device_bytes -= full.numel() * 4;
        Ok(())
    }

    /// End of backward: tensors that got no gradient this step go back to `Hold`, and chunks
    /// whose gradient is partial (some tensors unused) are complete as they are. (A module
    /// whose input needs no gradient never reports the end of its backward: its tensors are
    /// still in `Compute` here.)
    pub fn finish_backward(&mut self) -> Result<()> {
        for c in 0..self.chunks.len() {
            self.reduce(c)?;
        }
        for ch in &mut self.chunks {
            for s in &mut ch.slots {
                if s.state == TensorState::Compute {
                    s.move_to(TensorState::HoldAfterBackward)?;
                }
                if matches!(s.state, TensorState::HoldAfterBackward | TensorState::ReadyForReduce) {
                    s.move_to(TensorState::Hold)?;
                }
            }
        }
        Ok(())
    }

    /// A copy of `t` on `tier`: on the compute device, or in host memory, pinned when the
    /// compute device is a GPU (so copies to and from it can run asynchronously).
    fn on_tier(&self, t: &Tensor, tier: Tier) -> Result<Tensor> {
        Ok(match (tier, self.device) {
            (Tier::Device, device) => t.f_to_device(device)?.f_detach_copy()?,
            (Tier::Host, Device::Cuda(d)) => t.f_to_device(Device::Cpu)?.f_pin_memory(Device::Cuda(d))?,
            (Tier::Host, _) => t.f_to_device(Device::Cpu)?.f_detach_copy()?,
        })
    }

    /// The parts of parameters in this rank's shard of chunk `c`, in offset order.
    pub(crate) fn pieces(&self, c: usize) -> Vec<Piece> {
        let ch = &self.chunks[c];
        let (lo, hi) = (self.shard_offset, self.shard_offset + ch.home.numel());
        let mut out = vec![];
        for (i, &(pc, ps)) in self.places.iter().enumerate() {
            if pc != c {
                continue;
            }
            let slot = &ch.slots[ps];
            let (start, end) = (slot.offset.max(lo), (slot.offset + slot.numel).min(hi));
            if start < end {
                out.push(Piece {
                    param: i,
                    name: slot.name.clone(),
                    shape: slot.shape.clone(),
                    in_param: start - slot.offset,
                    in_shard: start - lo,
                    len: end - start,
                });
            }
        }
        out.sort_by_key(|p| p.in_shard);
        out
    }

    /// Registered parameters.
    pub fn param_count(&self) -> usize {
        self.places.len()
    }

    /// Where chunk `c`'s home lives.
    pub fn tier(&self, c: usize) -> Tier {
        self.chunks[c].tier
    }

    /// The home-sized buffers charged per device home (see [`ChunkConfig::home_buffers`]).
    pub(crate) fn home_buffer_bytes(&self, c: usize) -> usize {
        self.home_buffers * self.chunks[c].home_bytes()
    }

    /// The compute device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Bytes of one chunk's payload on the device.
    pub fn chunk_bytes(&self) -> usize {
        self.chunks[0].bytes()
    }

    /// The most chunks one module has needed at once so far.
    pub fn widest_access(&self) -> usize {
        self.widest
    }

    /// The byte budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Lowers or raises the byte budget (the auto policy sets what model data may use).
    pub(crate) fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
    }

    /// Whether the first step is still being recorded.
    pub fn recording(&self) -> bool {
        self.recording
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
    fn make_room(&mut self, need: usize, pinned: &[usize]) -> Result<()> {
        while self.device_bytes + need > self.budget {
            let Some((victim, _)) = self.victim(pinned) else {
                let busy: Vec<usize> = (0..self.chunks.len()).filter(|&i| self.chunks[i].resident).collect();
                return Err(Error::invalid(format!(
                    "gemini: {} more are needed on the device for chunk {}, {} of the {} budget are taken (resident chunks in use: {busy:?}); raise the memory budget or offload more",
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
        let candidates = (0..self.chunks.len())
            .filter(|&c| self.chunks[c].resident && !self.chunks[c].in_compute() && !pinned.contains(&c));
        if self.recording {
            let loaded_at = |c: usize| {
                self.events.iter().rposition(|e| matches!(e, Event::Load(x) | Event::Prefetch(x) if *x == c))
            };
            return candidates.min_by_key(|&c| loaded_at(c)).map(|c| (c, usize::MAX));
        }
        let next_use = |c: usize| self.trace[self.cursor..].iter().position(|&x| x == c).unwrap_or(usize::MAX);
        candidates.map(|c| (c, next_use(c))).max_by_key(|&(c, next)| (next, c))
    }

    /// Makes chunk `c`'s payload resident. `ahead`: a prefetch, which on a GPU copies on a
    /// side stream so that it overlaps the running module; the chunk's next access makes the
    /// compute stream wait for it.
    fn load(&mut self, c: usize, ahead: bool) -> Result<()> {
        let bytes = self.chunks[c].bytes();
        self.charge(bytes, c)?;
        // The payload's memory comes from the compute stream's pool.
        resize_storage(&self.chunks[c].payload, bytes)?;
        match (&self.replication, self.device) {
            (Some(rep), _) if rep.shard => {
                let ch = &self.chunks[c];
                let mine = ch.home.f_to_device(self.device)?.f_to_kind(ch.kind)?;
                rep.group.all_gather_into_async(&ch.payload, &mine)?.wait()?;
            }
            (_, Device::Cuda(d)) if ahead => {
                let ready = self.copy_on_side_stream(c, d)?;
                self.chunks[c].ready = Some(ready);
            }
            _ => {
                let ch = &self.chunks[c];
                tch::no_grad(|| ch.payload.shallow_clone().f_copy_(&ch.home))?;
            }
        }
        let ch = &mut self.chunks[c];
        for s in &mut ch.slots {
            s.move_to(TensorState::Hold)?;
        }
        ch.resident = true;
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
        // Pinned host homes copy asynchronously; the dtype cast runs on the side stream too.
        let copied = tch::no_grad(|| -> Result<()> {
            let staged = ch.home.f_to_dtype_layout((ch.home.kind(), self.device), true, false)?;
            ch.payload.shallow_clone().f_copy_(&staged)?;
            Ok(())
        });
        main.set_current()?;
        copied?;
        let done = cuda::Event::new(false)?;
        done.record(side)?;
        Ok(done)
    }

    /// Waits (on the host) for chunk `c`'s side-stream copy, if one is in flight: before its
    /// memory is freed, and before its home is stepped.
    fn settle(&mut self, c: usize) -> Result<()> {
        if let Some(ready) = self.chunks[c].ready.take() {
            ready.synchronize()?;
        }
        Ok(())
    }

    fn evict(&mut self, c: usize) -> Result<()> {
        self.settle(c)?;
        let ch = &mut self.chunks[c];
        for s in &mut ch.slots {
            s.move_to(TensorState::Free)?;
        }
        resize_storage(&ch.payload, 0)?;
        ch.resident = false;
        self.device_bytes -= ch.bytes();
        self.events.push(Event::Evict(c));
        Ok(())
    }

    fn charge(&mut self, bytes: usize, chunk: usize) -> Result<()> {
        if self.device_bytes + bytes > self.budget {
            return Err(Error::invalid(format!(
                "gemini: chunk {chunk} needs {} on the device, {} of the {} budget are taken",
                human(bytes),
                human(self.device_bytes),
                human(self.budget)
            )));
        }
        self.device_bytes += bytes;
        self.peak_device_bytes = self.peak_device_bytes.max(self.device_bytes);
        Ok(())
    }
}

/// Bytes for messages: `1.5 MiB`.
pub fn human(bytes: usize) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
