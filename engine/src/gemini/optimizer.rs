//! The optimizer of a model under Gemini: it steps each chunk's home (this rank's shard of
//! it) where the home lives, with the multi-threaded host kernels ([`HostOptimizer`]) for
//! homes in host memory and the same rule as tensor operations ([`DeviceOptimizer`]) for homes
//! on the device, and its state beside the home. LAMB and LARS trust ratios are per
//! parameter although parameters are split over shards: each shard's sums of squares per
//! parameter are all-reduced before the update. Clipping and loss-scale unscaling use the
//! engine's functions on [`ChunkOptimizer::gradients`].
use tch::{Device, Kind, Tensor};

use super::manager::{ChunkManager, Piece, Tier};
use crate::dist::{ProcessGroup, ReduceOp};
use crate::optim::flat::{CpuRule, DeviceOptimizer, HostOptimizer, Segment};
use crate::optim::Param;
use crate::Result;

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

impl ChunkOptimizer {
    /// An optimizer with `rule` for every chunk.
    pub fn new(rule: CpuRule) -> ChunkOptimizer {
        ChunkOptimizer { rule, shards: vec![], steps: 0 }
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

    /// The chunks' accumulated gradients as one parameter per chunk (this rank's shard of
    /// its home, with the shard of its gradient as `.grad`), for the engine's
    /// [`crate::optim::clip_grad_norm`] and [`crate::optim::LossScaler::unscale`]; the group
    /// they are sharded over, if they are.
    pub fn gradients(m: &ChunkManager) -> Result<(Vec<Param>, Option<ProcessGroup>)> {
        let mut out = vec![];
        for c in 0..m.chunk_count() {
            let w = m.home(c).f_detach()?.f_set_requires_grad(true)?;
            crate::autograd::set_grad(&w, Some(m.grad(c)))?;
            out.push(Param::new(format!("chunk {c}"), &w).with_adapt(false));
        }
        let group = m.replication().filter(|r| r.shard).map(|r| r.group.clone());
        Ok((out, group))
    }

    /// Clears the accumulated gradients.
    pub fn zero_grad(m: &ChunkManager) -> Result<()> {
        for c in 0..m.chunk_count() {
            tch::no_grad(|| m.grad(c).shallow_clone().f_zero_().map(drop))?;
        }
        Ok(())
    }

    /// One step of every chunk from its accumulated gradient, clearing the gradients (in the
    /// update's own pass: see [`HostOptimizer::finish`]).
    pub fn step(&mut self, m: &mut ChunkManager) -> Result<()> {
        self.ensure_shards(m)?;
        let pieces: Vec<Vec<Piece>> = (0..m.chunk_count()).map(|c| m.pieces(c)).collect();
        // Phase 1: moments and each piece's sums of squares, added per parameter.
        let mut totals = vec![[0f64; 2]; m.param_count()];
        for (c, shard) in self.shards.iter_mut().enumerate() {
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
        // Phase 2: the updates with whole-parameter sums.
        for (c, shard) in self.shards.iter_mut().enumerate() {
            let (home, grad) = (m.home(c), m.grad(c));
            let sums: Vec<[f64; 2]> =
                pieces[c].iter().map(|p| [summed[2 * p.param], summed[2 * p.param + 1]]).collect();
            match shard.as_mut().expect("created above") {
                ShardOptimizer::Host(o) => {
                    // SAFETY: as above.
                    let (w, g) = unsafe { (host_slice(home)?, host_slice(grad)?) };
                    o.finish(w, g, &sums);
                }
                ShardOptimizer::Device(o) => o.finish(home, grad, &sums)?,
            }
        }
        self.steps += 1;
        Ok(())
    }

    /// This rank's optimizer state as named pieces of flattened parameters:
    /// `(parameter, slot, first element, values)`, plus the step count.
    pub(crate) fn state_pieces(&self, m: &ChunkManager) -> Result<Vec<(String, &'static str, usize, Tensor)>> {
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
