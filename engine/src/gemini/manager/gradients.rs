//! Gradients into chunks: each parameter's gradient is added into its chunk's accumulator as
//! autograd produces it; over a data-parallel group the chunks' gradients are reduced at the end
//! of backward (reduce-scattered when sharded, all-reduced when replicated).
//!
//! Which chunks get a gradient depends on the data when a branch is taken on some ranks and
//! not others, so ranks cannot each reduce a chunk as soon as it is complete for them: they
//! would issue different sequences of collectives (a hang, or different chunks summed
//! together). Instead every rank first agrees on the set of chunks that have a gradient on any
//! rank (one small all-reduce of flags), then reduces exactly those, in chunk order, with zeros
//! where it has none, as one process running every rank's batch would. The reductions are all
//! launched before the first is waited for, so they overlap each other.
//!
//! A step leaves the accumulators as they are (clearing them was a fifth of the host step's
//! time): each slot knows whether its part holds a gradient of the step under way (`live`).
//! The first gradient a slot receives after a step overwrites its part, later ones (further
//! micro-batches) are added; the end of each backward zeroes the parts no gradient reached, so
//! the norm and the step read zeros for unused parameters, as they did when the step cleared.
use tch::{Kind, Tensor};

use super::ChunkManager;
use crate::dist::{ReduceOp, Work};
use crate::gemini::chunk::TensorState;
use crate::Result;

impl ChunkManager {
    /// Parameter `i`'s gradient arrived. Alone it goes into its chunk's gradient accumulator
    /// (beside the home copy, so on the home's tier: copied over a spent part, added to a live
    /// one); with a data-parallel group it is added into the chunk's whole gradient on the
    /// device, zero at each backward's first gradient. When every tensor of the chunk has its
    /// gradient the chunk's gradient is complete: it is reduced across ranks (see
    /// `ChunkManager::reduce`) and its tensors go back to `Hold`. Returns the chunk when
    /// this gradient completed it.
    pub fn add_gradient(&mut self, i: usize, grad: &Tensor) -> Result<Option<usize>> {
        let (c, s) = self.places[i];
        crate::error::ensure!(
            self.trainable,
            "gemini: {} is frozen (its chunks keep no gradient) but got one",
            self.chunks[c].slots[s].name
        );
        self.chunks[c].slots[s].move_to(TensorState::ReadyForReduce)?;
        if self.replication.is_some() && self.chunks[c].full_grad.is_none() {
            self.allocate_full_grad(c)?;
        }
        let g = grad.f_flatten(0, -1)?;
        let crosses = self.chunks[c].full_grad.is_none() && self.chunks[c].grad.device() != g.device();
        if !(crosses && self.stage(c, s, &g)?) {
            let ch = &mut self.chunks[c];
            let slot = &ch.slots[s];
            let (acc, live) = match &ch.full_grad {
                Some(full) => (full.f_narrow(0, slot.offset as i64, slot.numel as i64)?, true),
                None => (
                    ch.grad.f_narrow(0, slot.offset as i64, slot.numel as i64)?,
                    std::mem::replace(&mut ch.live[s], true),
                ),
            };
            accumulate(&acc, &g, live)?;
        }
        if self.chunks[c].slots.iter().all(|s| s.state == TensorState::ReadyForReduce) {
            self.unstage(c)?;
            for s in &mut self.chunks[c].slots {
                s.move_to(TensorState::Hold)?;
            }
            return Ok(Some(c));
        }
        Ok(None)
    }

    /// Gathers slot `s`'s gradient `g` (on the device) into chunk `c`'s staging buffer on the
    /// device ([`Chunk::staged`](super::Chunk)), made within the budget at the chunk's first
    /// gradient; false (nothing done: the caller moves `g` itself) when the budget has no room
    /// for the buffer.
    fn stage(&mut self, c: usize, s: usize, g: &Tensor) -> Result<bool> {
        if self.chunks[c].staged.is_none() {
            let numel = self.chunks[c].payload.numel();
            let bytes = numel * g.kind().elt_size_in_bytes();
            if self.make_room(bytes, &[c]).is_err() {
                return Ok(false);
            }
            self.charge(bytes, c)?;
            let buffer = Tensor::f_empty([numel as i64], (g.kind(), g.device()))?;
            let slots = vec![false; self.chunks[c].slots.len()];
            self.chunks[c].staged = Some((buffer, slots));
        }
        let ch = &mut self.chunks[c];
        let slot = &ch.slots[s];
        let (buffer, staged) = ch.staged.as_mut().expect("made above");
        let part = buffer.f_narrow(0, slot.offset as i64, slot.numel as i64)?;
        tch::no_grad(|| part.shallow_clone().f_copy_(g).map(drop))?;
        staged[s] = true;
        Ok(true)
    }

    /// Moves chunk `c`'s staged gradients to its accumulator in host memory, one transfer
    /// (into page-locked memory on a GPU), then each slot's part added or copied as
    /// [`ChunkManager::add_gradient`] would have done it directly: the same values.
    fn unstage(&mut self, c: usize) -> Result<()> {
        let Some((buffer, staged)) = self.chunks[c].staged.take() else { return Ok(()) };
        let host = match buffer.device() {
            tch::Device::Cuda(_) => crate::cuda::empty_pinned(&buffer.size(), buffer.kind())?,
            _ => buffer.f_empty_like()?,
        };
        tch::no_grad(|| host.shallow_clone().f_copy_(&buffer).map(drop))?;
        self.device_bytes -= buffer.numel() * buffer.kind().elt_size_in_bytes();
        drop(buffer);
        let ch = &mut self.chunks[c];
        for (s, _) in staged.iter().enumerate().filter(|(_, &got)| got) {
            let slot = &ch.slots[s];
            let (offset, numel) = (slot.offset as i64, slot.numel as i64);
            let live = std::mem::replace(&mut ch.live[s], true);
            accumulate(&ch.grad.f_narrow(0, offset, numel)?, &host.f_narrow(0, offset, numel)?, live)?;
        }
        Ok(())
    }

    /// A zero whole-chunk gradient on the device for chunk `c`, within the budget.
    fn allocate_full_grad(&mut self, c: usize) -> Result<()> {
        let bytes = self.chunks[c].payload.numel() * 4;
        self.make_room(bytes, &[c])?;
        self.charge(bytes, c)?;
        self.chunks[c].full_grad =
            Some(Tensor::f_zeros([self.chunks[c].payload.numel() as i64], (Kind::Float, self.device))?);
        Ok(())
    }

    /// Reduces, in chunk order, every chunk that has a gradient on any rank of the group (a
    /// zero one where this rank has none): the same collectives in the same order on every
    /// rank, whatever each rank's data made its backward touch. All are launched before any
    /// is waited for, so they are in flight together.
    fn reduce_agreed(&mut self) -> Result<()> {
        let Some(rep) = self.replication.as_ref().filter(|_| self.trainable) else { return Ok(()) };
        let group = rep.group.clone();
        let local: Vec<f32> = self.chunks.iter().map(|ch| if ch.full_grad.is_some() { 1.0 } else { 0.0 }).collect();
        let flags = Tensor::from_slice(&local);
        group.all_reduce(&flags, ReduceOp::Max)?;
        let any: Vec<f32> = Vec::<f32>::try_from(&flags)?;
        let mut launched = Vec::new();
        for (c, &flag) in any.iter().enumerate() {
            if flag > 0.0 {
                if self.chunks[c].full_grad.is_none() {
                    self.allocate_full_grad(c)?;
                }
                launched.push(self.launch_reduce(c)?);
            }
        }
        for (c, full, mine, work) in launched {
            work.wait()?;
            let ch = &mut self.chunks[c];
            // A reduction covers the whole chunk (zeros for slots no rank used): the slots are
            // all live or all spent, and the first reduction after a step overwrites.
            let mut grad = ch.grad.shallow_clone();
            tch::no_grad(|| match ch.live.iter().any(|&l| l) {
                true => grad.f_add_(&mine.f_to_device(grad.device())?).map(drop),
                false => grad.f_copy_(&mine).map(drop),
            })?;
            ch.live.fill(true);
            self.device_bytes -= full.numel() * 4;
        }
        Ok(())
    }

    /// Starts averaging chunk `c`'s whole gradient across the data-parallel group: a
    /// reduce-scatter when sharded (this rank's part lands in the returned tensor), an
    /// all-reduce when replicated. Returns the chunk, its whole gradient (to free once done),
    /// this rank's result and the work; only [`ChunkManager::reduce_agreed`] calls it.
    fn launch_reduce(&mut self, c: usize) -> Result<(usize, Tensor, Tensor, Work)> {
        let full = self.chunks[c].full_grad.take().expect("allocated by reduce_agreed");
        let rep = self.replication.as_ref().expect("reduce_agreed checked");
        let (mine, work) = match rep.shard {
            true => rep.group.reduce_scatter_async(&full, ReduceOp::Avg)?,
            false => (full.shallow_clone(), rep.group.all_reduce_async(&full, ReduceOp::Avg)?),
        };
        Ok((c, full, mine, work))
    }

    /// End of backward: the chunks' gradients are reduced over the group (see the module
    /// docs), tensors that got no gradient this step go back to `Hold`, and chunks whose
    /// gradient is partial (some tensors unused) are complete as they are: the parts of the
    /// accumulators no gradient reached since the step are zeroed. (A module whose input needs
    /// no gradient never reports the end of its backward: its tensors are still in `Compute`
    /// here.)
    pub fn finish_backward(&mut self) -> Result<()> {
        for c in 0..self.chunks.len() {
            self.unstage(c)?;
        }
        self.reduce_agreed()?;
        self.zero_spent()?;
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

    /// Zeroes the parts of the gradient accumulators that hold a spent gradient (their slots
    /// got none since the last step), which are then live: the step and the norm read zeros
    /// there, and later micro-batches add to them. Chunks being stepped during backward
    /// (`early.rs`) are complete, all live, and so untouched.
    fn zero_spent(&mut self) -> Result<()> {
        if !self.trainable {
            return Ok(());
        }
        for ch in &mut self.chunks {
            if ch.live.iter().all(|&l| l) {
                continue;
            }
            // A chunk no gradient reached: all of it (a shard under ZeRO-3, whose slots'
            // offsets are the whole chunk's). Otherwise only a whole chunk's slots can be
            // partly live (see `add_gradient`).
            if !ch.live.iter().any(|&l| l) {
                tch::no_grad(|| ch.grad.shallow_clone().f_zero_().map(drop))?;
            } else {
                for (slot, _) in ch.slots.iter().zip(&ch.live).filter(|(_, &l)| !l) {
                    let part = ch.grad.f_narrow(0, slot.offset as i64, slot.numel as i64)?;
                    tch::no_grad(|| part.shallow_clone().f_zero_().map(drop))?;
                }
            }
            ch.live.fill(true);
        }
        Ok(())
    }

    /// The step has taken the accumulated gradients (or skipped them): every slot's part is
    /// spent, and its next gradient overwrites it.
    pub(crate) fn gradients_spent(&mut self) {
        for ch in &mut self.chunks {
            ch.live.fill(false);
        }
    }
}

/// Adds gradient `g` into accumulator part `acc` when it is `live` (holds a gradient of this
/// step), else overwrites it (`copy_` converts the device and dtype on the way).
fn accumulate(acc: &Tensor, g: &Tensor, live: bool) -> Result<()> {
    tch::no_grad(|| match live {
        true => acc.shallow_clone().f_add_(&g.f_to_device(acc.device())?.f_to_kind(Kind::Float)?).map(drop),
        false => acc.shallow_clone().f_copy_(g).map(drop),
    })?;
    Ok(())
}
