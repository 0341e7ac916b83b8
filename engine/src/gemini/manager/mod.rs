//! The chunk manager: owns every chunk of a model's parameters (payloads, homes, gradient
//! accumulators), keeps the bytes it has placed on the compute device within a budget, and
//! answers what the optimizer, checkpoints and tests read about the chunks.
//!
//! Each chunk has a home copy (on the device or in host memory, as the placement says) and a
//! payload on the compute device that exists only while the chunk is resident. Parameters are
//! views into the payload: releasing a chunk resizes the payload's storage to zero, so the
//! parameters and the views autograd saved of them stay valid objects whose memory comes back,
//! refilled from the home copy, the next time the chunk is accessed.
//!
//! Over a data-parallel group the chunks are either sharded (ZeRO-3: each rank keeps
//! `1/N` of every home, gradient accumulator and optimizer state; a load is an all-gather of
//! the shards, cast to the compute dtype first, launched ahead of the chunk's use when
//! prefetched and waited for at its access; the chunks' gradients, collected on the device,
//! are reduce-scattered together at the end of backward) or replicated (whole homes
//! everywhere, gradients all-reduced), for models small enough to keep whole.
//!
//! Without a GPU the CPU stands in for both tiers and the budget is enforced on the manager's
//! own accounting, so placement and eviction are the same code and testable anywhere.
//!
//! This file has the chunks, their construction, homes and accounting; `residency.rs` makes
//! payloads resident and evicts them along the trace; `gradients.rs` accumulates and reduces
//! the chunks' gradients. The fields stay private to these three files: other modules read
//! through methods.
use tch::{Device, Kind, Tensor};

use super::budget::human;
use super::chunk::{Layout, Slot, TensorState};
use crate::cuda;
use crate::dist::{ProcessGroup, Work};
use crate::optim::Param;
use crate::storage::resize_storage;
use crate::{Error, Result};

mod gradients;
mod residency;

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
    /// On the CPU, for fp32 compute and whole (unsharded) homes, make each payload the home
    /// itself: loading and evicting are then bookkeeping (the budget is still kept), with no
    /// copy and no freed memory to fault back in, and the optimizer's writes are what the
    /// model reads next. Off, the CPU frees and refills payloads as a GPU does (tests of that
    /// path).
    pub share_cpu_homes: bool,
    /// Whether the parameters train. Frozen ones (the base weights under LoRA) get no gradient
    /// accumulator, no optimizer state and no gradient hook, and their homes keep the compute
    /// kind (nothing steps them; half the host memory under bf16/fp16): each chunk is a home
    /// and a payload, streamed in for the forward and again for the backward (which still
    /// needs the weights for its input's gradient), evictable again as soon as each module is
    /// done.
    pub trainable: bool,
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

struct Chunk {
    slots: Vec<Slot>,
    kind: Kind,
    /// `[capacity]` on the compute device; storage of zero bytes while not resident.
    payload: Tensor,
    /// This rank's part of the home copy: `[capacity / shards]` fp32 (frozen chunks: the
    /// compute kind), elements `shard_offset..` of the chunk.
    home: Tensor,
    tier: Tier,
    resident: bool,
    /// The payload is the home (see [`ChunkConfig::share_cpu_homes`]).
    shared: bool,
    /// Gradient accumulator beside the home copy, same shape. Not cleared after a step (that
    /// pass over it cost a fifth of the host step): what it holds is spent, and each slot's
    /// first gradient of the next step overwrites its part (see `gradients.rs`).
    grad: Tensor,
    /// Per slot: whether `grad` holds a gradient of the step under way for it (else what it
    /// holds is spent: the slot's next gradient overwrites it, and the end of backward zeroes
    /// it if none came).
    live: Vec<bool>,
    /// A host home's values in the compute kind (bf16/fp16 payloads of a whole, unshared host
    /// home; pinned on a GPU), which the optimizer's pass writes beside the home: a load then
    /// copies it as it is, half the bytes of the home, with no cast on either side.
    upload: Option<Tensor>,
    /// Whether `upload` holds the home's values (anything else writing the home makes it stale:
    /// [`ChunkManager::homes_changed`]).
    upload_fresh: bool,
    /// `[capacity]` gradient of the whole chunk on the compute device, collecting the
    /// parameters' gradients until the chunk's are all here and it is reduced across ranks
    /// (only with a data-parallel group).
    full_grad: Option<Tensor>,
    /// `[capacity]` on the compute device, in the gradients' kind: the gradients of a chunk
    /// accumulated in host memory, gathered here as they arrive and moved to the host in one
    /// transfer once the chunk's are all here (or at the end of backward), with which slots
    /// hold one. Moving each tensor's gradient as it came waited for the device every time, a
    /// few hundred times a backward for SD 1.5's UNet (see `gradients.rs`).
    staged: Option<(Tensor, Vec<bool>)>,
    /// Marks the end of a prefetch copy still in flight on the side stream (GPU only).
    ready: Option<cuda::Event>,
    /// A prefetched all-gather of the shards still in flight (ZeRO-3), with its input (which
    /// must live until it completes): waited for at the chunk's next access.
    gather: Option<(Work, Tensor)>,
}

impl Chunk {
    fn bytes(&self) -> usize {
        self.payload.numel() * self.kind.elt_size_in_bytes()
    }

    /// Bytes of one home-sized buffer.
    fn home_bytes(&self) -> usize {
        self.home.numel() * self.home.kind().elt_size_in_bytes()
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
    trainable: bool,
    chunks: Vec<Chunk>,
    /// (chunk, slot) of each registered parameter, by registration index.
    places: Vec<(usize, usize)>,
    /// Whether weight decay and trust ratios apply, by registration index.
    adapt: Vec<bool>,
    replication: Option<Replication>,
    /// First element of this rank's shard in every chunk.
    shard_offset: usize,
    device_bytes: usize,
    peak_device_bytes: usize,
    /// Chunk accesses in order: recorded during the first step, replayed afterwards.
    trace: Vec<usize>,
    recording: bool,
    /// The most chunks one access has needed.
    widest: usize,
    /// Evict each chunk as soon as no module uses it (see [`ChunkManager::set_lean`]).
    lean: bool,
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
        let shared = cfg.share_cpu_homes && cfg.device == Device::Cpu && kind == Kind::Float && shards == 1;
        let shard_len = layout.chunk_size / shards;
        let mut manager = ChunkManager {
            device: cfg.device,
            budget: cfg.budget,
            home_buffers: cfg.home_buffers,
            trainable: cfg.trainable,
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
            lean: false,
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
            // Frozen homes keep the compute kind: nothing steps them.
            let home_kind = if cfg.trainable { Kind::Float } else { kind };
            let home = match shared {
                // The payload holds the fp32 values already.
                true => payload.shallow_clone(),
                false => manager.on_tier(
                    &master.f_narrow(0, manager.shard_offset as i64, shard_len as i64)?.f_to_kind(home_kind)?,
                    tier,
                )?,
            };
            let upload = match cfg.trainable && !shared && kind != Kind::Float && shards == 1 && tier == Tier::Host {
                true => Some(manager.on_tier(&home.f_to_kind(kind)?, Tier::Host)?),
                false => None,
            };
            let grad = match cfg.trainable {
                true => manager.on_tier(&home.f_zeros_like()?, tier)?,
                false => Tensor::f_empty([0], (Kind::Float, home.device()))?,
            };
            let chunk = Chunk {
                slots,
                kind,
                payload,
                home,
                tier,
                resident: false,
                shared,
                upload_fresh: upload.is_some(),
                upload,
                live: vec![false; members.len()],
                grad,
                full_grad: None,
                staged: None,
                ready: None,
                gather: None,
            };
            if !shared {
                resize_storage(&chunk.payload, 0)?;
            }
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

    /// Device bytes of the whole fp32 gradients a data-parallel backward keeps until its end,
    /// where they are reduced together (see `gradients.rs`): every chunk's, at the last
    /// gradient; none without a group or without training.
    pub fn reduced_gradient_bytes(&self) -> usize {
        match (&self.replication, self.trainable) {
            (Some(_), true) => self.chunks.iter().map(|c| c.payload.numel() * 4).sum(),
            _ => 0,
        }
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

    /// Whether the parameters train (see [`ChunkConfig::trainable`]).
    pub fn trainable(&self) -> bool {
        self.trainable
    }

    /// Whether the first step is still being recorded.
    pub fn recording(&self) -> bool {
        self.recording
    }

    /// Lean residency: a chunk leaves the device as soon as no module uses it (after a
    /// module's forward, or its backward for frozen chunks), instead of when room is needed.
    /// Gemini's auto policy runs its warm-up step so on a GPU, where the activations, not yet
    /// measured, share the allocator's cap with the chunks; the step costs reloads instead of
    /// running out of memory.
    pub fn set_lean(&mut self, lean: bool) {
        self.lean = lean;
    }

    /// The most device bytes a prefetch stages beside the payload it fills (see
    /// `ChunkManager::staging_of`), over the chunks as their homes now lie.
    pub fn staging_bytes(&self) -> usize {
        (0..self.chunks.len()).map(|c| self.staging_of(c)).max().unwrap_or(0)
    }

    /// Device bytes a prefetch of chunk `c` stages beside its payload while the copy lasts: on
    /// a GPU, a copy of a host home whose dtype is not the payload's and whose upload copy is
    /// stale (its bytes cross as they are and the cast runs on the device), else none. Not counted: a sharded chunk's gather
    /// input, its shard in the compute dtype on the device until the chunk's access (ZeRO-3 over
    /// several GPUs).
    pub(crate) fn staging_of(&self, c: usize) -> usize {
        let ch = &self.chunks[c];
        let staged =
            self.device.is_cuda() && ch.home.device() != self.device && ch.home.kind() != ch.kind && !ch.upload_fresh;
        if staged {
            ch.home_bytes()
        } else {
            0
        }
    }

    /// This rank's part of chunk `c`'s home copy (fp32, frozen chunks' in the compute kind; on
    /// the home's tier).
    pub(crate) fn home(&self, c: usize) -> &Tensor {
        &self.chunks[c].home
    }

    /// Whether a chunk of this manager keeps an upload copy on the host tier (see
    /// [`Chunk::upload`]): trainable, bf16 or fp16 payloads, homes whole and not shared.
    fn upload_kind(&self, c: usize) -> Option<Kind> {
        let ch = &self.chunks[c];
        let whole = self.replication.as_ref().is_none_or(|r| !r.shard);
        (self.trainable && !ch.shared && ch.kind != Kind::Float && whole).then_some(ch.kind)
    }

    /// Chunk `c`'s upload copy (see [`Chunk::upload`]), which the optimizer writes beside the
    /// home and then marks fresh ([`ChunkManager::set_upload_fresh`]).
    pub(crate) fn upload(&self, c: usize) -> Option<&Tensor> {
        self.chunks[c].upload.as_ref()
    }

    /// Says whether chunk `c`'s upload copy holds its home's values.
    pub(crate) fn set_upload_fresh(&mut self, c: usize, fresh: bool) {
        self.chunks[c].upload_fresh = fresh && self.chunks[c].upload.is_some();
    }

    /// The homes were written outside the optimizer (a checkpoint loaded, a shadow swapped in):
    /// the upload copies are stale until the next step writes them, and resident payloads hold
    /// the old values, so they are freed.
    pub fn homes_changed(&mut self) -> Result<()> {
        for ch in &mut self.chunks {
            ch.upload_fresh = false;
        }
        self.release_all()
    }

    /// Chunk `c`'s gradient accumulator: beside its home, of the same shape.
    pub(crate) fn grad(&self, c: usize) -> &Tensor {
        &self.chunks[c].grad
    }

    /// The places of chunk `c`'s parameters (names, shapes, offsets, states).
    pub(crate) fn slots(&self, c: usize) -> &[Slot] {
        &self.chunks[c].slots
    }

    /// Whether weight decay and trust ratios apply to parameter `i` (registration order).
    pub(crate) fn adapt(&self, i: usize) -> bool {
        self.adapt[i]
    }

    /// The data-parallel group the chunks are spread over, and how, if any.
    pub(crate) fn replication(&self) -> Option<&Replication> {
        self.replication.as_ref()
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
        // A shared home stays where it is: on the CPU both tiers are host memory.
        if !self.chunks[chunk].shared {
            let (home, grad) =
                (self.on_tier(&self.chunks[chunk].home, tier)?, self.on_tier(&self.chunks[chunk].grad, tier)?);
            // A device home loads on the device; a host home gets the upload copy back.
            let upload = match (tier, self.upload_kind(chunk)) {
                (Tier::Host, Some(kind)) => Some(self.on_tier(&home.f_to_kind(kind)?, Tier::Host)?),
                _ => None,
            };
            let ch = &mut self.chunks[chunk];
            (ch.home, ch.grad, ch.upload_fresh, ch.upload) = (home, grad, upload.is_some(), upload);
        }
        let ch = &mut self.chunks[chunk];
        ch.tier = tier;
        self.events.push(Event::MoveHome(chunk, tier));
        Ok(())
    }

    /// A copy of `t` on `tier`: on the compute device, or in host memory, pinned when the
    /// compute device is a GPU (so copies to and from it can run asynchronously).
    fn on_tier(&self, t: &Tensor, tier: Tier) -> Result<Tensor> {
        Ok(match (tier, self.device) {
            (Tier::Device, device) => t.f_to_device(device)?.f_detach_copy()?,
            (Tier::Host, Device::Cuda(_)) => cuda::pinned(&t.f_to_device(Device::Cpu)?)?,
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
