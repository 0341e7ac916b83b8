//! The optimizer of a model under Gemini: it steps each chunk's home (this rank's shard of
//! it) where the home lives, with the multi-threaded host kernels ([`HostOptimizer`]) for
//! homes in host memory and the same rule as tensor operations ([`DeviceOptimizer`]) for homes
//! on the device, and its state beside the home. LAMB and LARS trust ratios are per
//! parameter although parameters are split over shards: each shard's sums of squares per
//! parameter are all-reduced before the update.
//!
//! Loss-scale unscaling and clipping ([`ChunkOptimizer::unscale_and_clip`]) read host chunks'
//! gradients once for the norm and leave their factors pending: the step's fused AdamW pass
//! applies them as it reads the gradients (the values scaling the buffers in place would give,
//! without the two passes over them). Device chunks and the rules without a fused pass are
//! scaled in place as before. Host chunks whose gradients completed during a planned backward
//! were taken up then (`early.rs`); the step runs the rest, host chunks in parallel.
use rayon::prelude::*;
use tch::{Device, Kind, Tensor};

use super::early::{Early, StepPlan};
use super::manager::{ChunkManager, Piece, Tier};
use crate::dist::ReduceOp;
use crate::optim::flat::{sum_squares_scaled, CpuRule, DeviceOptimizer, Half, HostOptimizer, Segment, StepExtras};
use crate::optim::{clip_coefficient, clip_to, local_square_sum, reduce_square_sum, Held, Param};
use crate::{Error, Result};

/// One chunk's optimizer, on its home's tier.
enum ShardOptimizer {
    Host(HostOptimizer),
    Device(DeviceOptimizer),
}

/// Steps the chunks of a [`ChunkManager`]. See the module documentation.
pub struct ChunkOptimizer {
    rule: CpuRule,
    /// Per chunk, created at the first step on the home's tier then (the auto placement
    /// decides tiers before it).
    shards: Vec<Option<ShardOptimizer>>,
    steps: i32,
    /// Factors the host chunks' gradients are still to be multiplied by, in order (unscaling,
    /// clipping), applied by the step's fused pass (rules that fuse them only).
    pending: Vec<f64>,
    /// Work started during the last backward, if the step was planned.
    early: Option<Early>,
    /// Chunks taken up during the last planned backward.
    early_chunks: usize,
}

/// A contiguous f32 host tensor's elements. (A `Tensor` is a handle: writing through a shared
/// handle is how every in-place torch operation works, hence `&Tensor` to `&mut`.)
///
/// # Safety
/// No other live slice may overlap the tensor's memory while the returned one is used.
#[allow(clippy::mut_from_ref)]
unsafe fn host_slice(t: &Tensor) -> Result<&mut [f32]> {
    crate::error::ensure!(
        t.device() == Device::Cpu && t.kind() == Kind::Float && t.is_contiguous(),
        "gemini: host step on a {:?} {:?} tensor",
        t.device(),
        t.kind()
    );
    Ok(std::slice::from_raw_parts_mut(t.data_ptr() as *mut f32, t.numel()))
}

/// A host chunk's upload copy (see `ChunkManager::upload`) as the half-precision elements the
/// optimizer's pass writes.
///
/// # Safety
/// As [`host_slice`].
#[allow(clippy::mut_from_ref)]
unsafe fn upload_slice(m: &ChunkManager, c: usize) -> Result<Option<(Half, &mut [u16])>> {
    let Some(t) = m.upload(c) else { return Ok(None) };
    let kind = match t.kind() {
        Kind::Half => Half::F16,
        Kind::BFloat16 => Half::Bf16,
        other => return Err(crate::Error::invalid(format!("gemini: an upload copy of kind {other:?}"))),
    };
    crate::error::ensure!(t.device() == Device::Cpu && t.is_contiguous(), "gemini: upload copy not in host memory");
    Ok(Some((kind, std::slice::from_raw_parts_mut(t.data_ptr() as *mut u16, t.numel()))))
}

impl ChunkOptimizer {
    /// An optimizer with `rule` for every chunk.
    pub fn new(rule: CpuRule) -> ChunkOptimizer {
        ChunkOptimizer { rule, shards: vec![], steps: 0, pending: vec![], early: None, early_chunks: 0 }
    }

    /// The rule and its hyper-parameters.
    pub fn rule(&self) -> &CpuRule {
        &self.rule
    }

    /// The learning rate of the next step.
    pub fn lr(&self) -> f64 {
        self.rule.lr()
    }

    /// Sets the learning rate (schedules call this before each step).
    pub fn set_lr(&mut self, lr: f64) {
        self.rule.set_lr(lr);
        for s in self.shards.iter_mut().flatten() {
            match s {
                ShardOptimizer::Host(o) => o.set_lr(lr),
                ShardOptimizer::Device(o) => o.set_lr(lr),
            }
        }
    }

    /// Steps taken.
    pub fn steps(&self) -> i32 {
        self.steps
    }

    /// Bytes of optimizer state on this rank (host and device together).
    pub fn state_bytes(&self) -> usize {
        self.shards
            .iter()
            .flatten()
            .map(|s| match s {
                ShardOptimizer::Host(o) => o.state_bytes(),
                ShardOptimizer::Device(o) => o.state_bytes(),
            })
            .sum()
    }

    fn segments(m: &ChunkManager, pieces: &[Piece]) -> Vec<Segment> {
        pieces
            .iter()
            .map(|p| Segment { name: p.name.clone(), offset: p.in_shard, len: p.len, adapt: m.adapt(p.param) })
            .collect()
    }

    /// Creates the chunks' optimizers where missing, where their homes live: the host loop for
    /// homes in host memory (the host tier, and both tiers when the compute device is the CPU:
    /// one fused pass per element there, where the tensor ops make eight), tensor ops on the
    /// GPU.
    fn ensure_shards(&mut self, m: &ChunkManager) -> Result<()> {
        self.not_lent()?;
        if self.shards.len() == m.chunk_count() && self.shards.iter().all(Option::is_some) {
            return Ok(());
        }
        self.shards.resize_with(m.chunk_count(), || None);
        for (c, shard) in self.shards.iter_mut().enumerate() {
            if shard.is_none() {
                let segments = Self::segments(m, &m.pieces(c));
                *shard = Some(if m.tier(c) == Tier::Host || m.home(c).device() == Device::Cpu {
                    ShardOptimizer::Host(HostOptimizer::new(self.rule, segments, m.home(c).numel()))
                } else {
                    ShardOptimizer::Device(DeviceOptimizer::new(self.rule, segments, m.home(c))?)
                });
            }
        }
        Ok(())
    }

    /// Sums a host f64 tensor across the group when chunks are sharded (the all-reduce runs
    /// on the compute device for NCCL groups).
    fn sum_over_shards(m: &ChunkManager, t: Tensor) -> Result<Tensor> {
        match m.replication() {
            Some(rep) if rep.shard => {
                let on = t.f_to_device(m.device())?;
                rep.group.all_reduce(&on, ReduceOp::Sum)?;
                Ok(on.f_to_device(Device::Cpu)?)
            }
            _ => Ok(t),
        }
    }

    /// Chunk `c`'s accumulated gradient as a parameter (this rank's shard of its home, with
    /// the shard of its gradient as `.grad`), for the engine's tensor functions.
    fn gradient(m: &ChunkManager, c: usize) -> Result<Param> {
        let w = m.home(c).f_detach()?.f_set_requires_grad(true)?;
        crate::autograd::set_grad(&w, Some(m.grad(c)))?;
        Ok(Param::new(format!("chunk {c}"), &w).with_adapt(false))
    }

    /// Whether chunk `c`'s gradient factors wait for the step's fused pass (a host home under
    /// a rule that fuses them) rather than being applied in place.
    fn defers(&self, c: usize) -> bool {
        matches!(&self.shards[c], Some(ShardOptimizer::Host(o)) if o.fuses_factors())
    }

    /// Starts the work host chunks can do during the coming backward (see `early.rs`).
    pub(crate) fn plan(&mut self, m: &ChunkManager, plan: StepPlan) -> Result<()> {
        self.join()?;
        self.ensure_shards(m)?;
        self.early = Some(Early::new(plan, m.chunk_count()));
        self.early_chunks = 0;
        Ok(())
    }

    /// Chunk `c`'s gradient is complete: during a planned backward a host chunk's work starts.
    pub(crate) fn chunk_complete(&mut self, m: &ChunkManager, c: usize) -> Result<()> {
        let Some(early) = self.early.as_mut().filter(|e| !e.started(c)) else { return Ok(()) };
        if !matches!(self.shards[c], Some(ShardOptimizer::Host(_))) {
            return Ok(());
        }
        let Some(ShardOptimizer::Host(opt)) = self.shards[c].take() else { unreachable!("checked above") };
        // SAFETY: the home and gradient are distinct tensors the manager keeps; every reader
        // and writer of them joins the task first (see `early.rs`).
        unsafe {
            let (w, g) = (host_slice(m.home(c))?, host_slice(m.grad(c))?);
            early.start(c, opt, w, g, upload_slice(m, c)?);
        }
        Ok(())
    }

    /// An error while tasks started during backward hold chunks' optimizers (their state is
    /// theirs until the step joins them).
    fn not_lent(&self) -> Result<()> {
        match &self.early {
            Some(e) if e.busy() => Err(Error::invalid(
                "gemini: the optimizer's state is held by the step running during backward; read or load it after the step",
            )),
            _ => Ok(()),
        }
    }

    /// Waits for the work started during backward and takes the chunks' optimizers back.
    fn join(&mut self) -> Result<()> {
        let Some(early) = self.early.as_mut() else { return Ok(()) };
        let (shards, lr, mut taken) = (&mut self.shards, self.rule.lr(), 0);
        let joined = early.join(|c, mut opt| {
            // The learning rate may have been set while the task held the optimizer.
            opt.set_lr(lr);
            shards[c] = Some(ShardOptimizer::Host(opt));
            taken += 1;
        });
        self.early_chunks += taken;
        joined
    }

    /// How many chunks the last planned backward took up before the step (see `early.rs`).
    pub fn early_chunks(&self) -> usize {
        self.early_chunks
    }

    /// Multiplies the chunks' gradients by `scale` (skipped when 1) and returns their global
    /// norm, reduced over the group they are sharded or replicated on; then, given `max_norm`,
    /// clips them to it (as [`crate::optim::clip_to`]). Host chunks under a fused rule are read
    /// once here and scaled in the step's pass (see the module documentation). None when the
    /// norm is not finite and `check_finite` (fp16 overflow: skip the step).
    pub(crate) fn unscale_and_clip(
        &mut self,
        m: &ChunkManager,
        scale: f64,
        max_norm: Option<f64>,
        check_finite: bool,
    ) -> Result<Option<f64>> {
        self.join()?;
        self.ensure_shards(m)?;
        let mut factors = self.pending.clone();
        if scale != 1.0 {
            factors.push(scale);
        }
        let (mut in_place, mut host_sum) = (vec![], 0f64);
        for c in 0..m.chunk_count() {
            if let Some(early) = self.early.as_ref().filter(|e| e.stepped(c)) {
                return Err(Error::invalid(format!(
                    "gemini: the step was planned without unscaling or a norm ({:?}), and chunk {c} stepped during \
                     backward; plan the step with them",
                    early.plan()
                )));
            }
            if !self.defers(c) {
                in_place.push(Self::gradient(m, c)?);
                continue;
            }
            host_sum += match self.early.as_ref().and_then(|e| e.sum(c, &factors)) {
                Some(sum) => sum,
                // SAFETY: the gradient is only read, and no task holds it (joined above).
                None => sum_squares_scaled(unsafe { host_slice(m.grad(c))? }, &factors),
            };
        }
        self.early = None;
        let sum = local_square_sum(&in_place, scale)?.f_add_scalar(host_sum)?;
        // Replicated chunks hold the same gradients everywhere, but the decision must still be
        // the same on every rank: take the group either way.
        let held = match m.replication() {
            Some(r) if r.shard => Held::Sharded(&r.group),
            Some(r) => Held::Replicated(&r.group),
            None => Held::Local,
        };
        let norm = reduce_square_sum(sum, held)?;
        if check_finite && !norm.is_finite() {
            return Ok(None);
        }
        self.pending = factors;
        if let Some(max) = max_norm {
            clip_to(&in_place, norm, max)?;
            self.pending.extend(clip_coefficient(norm, max));
        }
        Ok(Some(norm))
    }

    /// Ends a step without updating: joins the work started during backward, forgets pending
    /// factors, and the accumulated gradients are spent (the next backward overwrites them).
    pub(crate) fn discard(&mut self, m: &mut ChunkManager) -> Result<()> {
        let joined = self.join();
        self.early = None;
        self.pending.clear();
        m.gradients_spent();
        joined
    }

    /// One step of every chunk from its accumulated gradient, which is then spent: the host
    /// pass leaves it as it is, and the next backward overwrites it (see the manager's
    /// `gradients.rs`); chunks stepped during a planned backward are done already.
    pub fn step(&mut self, m: &mut ChunkManager) -> Result<()> {
        self.join()?;
        self.ensure_shards(m)?;
        let done: Vec<bool> = (0..m.chunk_count()).map(|c| self.early.as_ref().is_some_and(|e| e.stepped(c))).collect();
        self.early = None;
        // The factors deferred to the fused pass (the other chunks were scaled in place).
        let pending = std::mem::take(&mut self.pending);
        let pieces: Vec<Vec<Piece>> = (0..m.chunk_count()).map(|c| m.pieces(c)).collect();
        // Phase 1: moments and each piece's sums of squares, added per parameter.
        let mut totals = vec![[0f64; 2]; m.param_count()];
        for (c, shard) in self.shards.iter_mut().enumerate().filter(|(c, _)| !done[*c]) {
            let (home, grad) = (m.home(c), m.grad(c));
            let sums: Vec<[f64; 2]> = match shard.as_mut().expect("created above") {
                ShardOptimizer::Host(o) => {
                    // SAFETY: the home and gradient are distinct tensors, used only here.
                    let (w, g) = unsafe { (host_slice(home)?, host_slice(grad)?) };
                    o.prepare(w, g)
                }
                ShardOptimizer::Device(o) => {
                    let t = o.prepare(home, grad)?;
                    Vec::<Vec<f64>>::try_from(t)?.into_iter().map(|r| [r[0], r[1]]).collect()
                }
            };
            for (p, s) in pieces[c].iter().zip(sums) {
                totals[p.param][0] += s[0];
                totals[p.param][1] += s[1];
            }
        }
        let flat: Vec<f64> = totals.iter().flatten().copied().collect();
        let summed = Self::sum_over_shards(m, Tensor::from_slice(&flat))?;
        let summed = Vec::<f64>::try_from(summed)?;
        // Phase 2: the updates with whole-parameter sums; host chunks in parallel.
        let mut host = vec![];
        for (c, shard) in self.shards.iter_mut().enumerate().filter(|(c, _)| !done[*c]) {
            let (home, grad) = (m.home(c), m.grad(c));
            let sums: Vec<[f64; 2]> =
                pieces[c].iter().map(|p| [summed[2 * p.param], summed[2 * p.param + 1]]).collect();
            match shard.as_mut().expect("created above") {
                ShardOptimizer::Host(o) => {
                    // SAFETY: as above; each chunk's tensors are its own.
                    let (w, g, half) = unsafe { (host_slice(home)?, host_slice(grad)?, upload_slice(m, c)?) };
                    let factors: &[f64] = if o.fuses_factors() { &pending } else { &[] };
                    host.push((
                        o,
                        w,
                        g,
                        sums,
                        StepExtras { grad_factors: factors, half_out: half, keep_gradients: true },
                    ));
                }
                ShardOptimizer::Device(o) => o.finish(home, grad, &sums)?,
            }
        }
        host.into_par_iter().for_each(|(o, w, g, sums, extras)| o.finish_with(w, g, &sums, extras));
        // Host chunks wrote their upload copies in the pass (those stepped during backward too).
        for c in 0..m.chunk_count() {
            if matches!(self.shards[c], Some(ShardOptimizer::Host(_))) {
                m.set_upload_fresh(c, true);
            }
        }
        m.gradients_spent();
        self.steps += 1;
        Ok(())
    }

    /// This rank's optimizer state as named pieces of flattened parameters:
    /// `(parameter, slot, first element, values)`, plus the step count.
    pub(crate) fn state_pieces(&self, m: &ChunkManager) -> Result<Vec<(String, &'static str, usize, Tensor)>> {
        self.not_lent()?;
        let mut out = vec![];
        for (c, shard) in self.shards.iter().enumerate() {
            let Some(shard) = shard else { continue };
            let buffers: Vec<Tensor> = match shard {
                ShardOptimizer::Host(o) => {
                    let (a, b) = o.state();
                    [a, b].iter().filter(|x| !x.is_empty()).map(|x| Tensor::from_slice(x)).collect()
                }
                ShardOptimizer::Device(o) => {
                    let (a, b) = o.state();
                    [a, b]
                        .iter()
                        .filter(|x| x.defined())
                        .map(|x| x.f_to_device(Device::Cpu))
                        .collect::<std::result::Result<_, _>>()?
                }
            };
            for p in m.pieces(c) {
                for (slot, buf) in self.rule.state_slots().iter().zip(&buffers) {
                    out.push((
                        p.name.clone(),
                        *slot,
                        p.in_param,
                        buf.f_narrow(0, p.in_shard as i64, p.len as i64)?.f_detach_copy()?,
                    ));
                }
            }
        }
        Ok(out)
    }

    /// Restores state saved by [`ChunkOptimizer::state_pieces`], on this or any other number of
    /// ranks: `lookup(parameter, slot, first, len)` returns those elements of the flattened
    /// parameter's state (or an error naming what is missing).
    pub(crate) fn load_state_pieces(
        &mut self,
        m: &ChunkManager,
        steps: i32,
        lookup: &mut dyn FnMut(&str, &str, usize, usize) -> Result<Tensor>,
    ) -> Result<()> {
        self.ensure_shards(m)?;
        let slots = self.rule.state_slots();
        for (c, shard) in self.shards.iter_mut().enumerate() {
            let len = m.home(c).numel() as i64;
            let mut buffers: Vec<Tensor> = slots
                .iter()
                .map(|_| Tensor::f_zeros([len], (Kind::Float, Device::Cpu)))
                .collect::<std::result::Result<_, _>>()?;
            for p in m.pieces(c) {
                for (slot, buf) in slots.iter().zip(&mut buffers) {
                    let values = lookup(&p.name, slot, p.in_param, p.len)?;
                    buf.f_narrow(0, p.in_shard as i64, p.len as i64)?.f_copy_(&values)?;
                }
            }
            let empty = Tensor::new();
            let (a, b) = (buffers.first().unwrap_or(&empty), buffers.get(1).unwrap_or(&empty));
            match shard.as_mut().expect("created above") {
                ShardOptimizer::Host(o) => {
                    let host = |t: &Tensor| -> Result<Vec<f32>> {
                        Ok(if t.defined() { Vec::<f32>::try_from(t)? } else { vec![] })
                    };
                    o.load_state(steps, &host(a)?, &host(b)?);
                }
                ShardOptimizer::Device(o) => o.load_state(steps, a, b)?,
            }
        }
        self.steps = steps;
        Ok(())
    }
}
