//! Gradients into chunks: each parameter's gradient is added into its chunk's accumulator as
//! autograd produces it; over a data-parallel group the chunks' gradients are reduced at the end
//! of backward (reduce-scattered when sharded, all-reduced when replicated).
//!
//! Which chunks get a gradient depends on the data when a branch is taken on some ranks and
//! not others, so ranks cannot each reduce a chunk as soon as it is complete for them: they
//! would issue different sequences of collectives (a hang, or different chunks summed
//! together). Instead every rank first agrees on the set of chunks that have a gradient on any
//! rank (one small all-reduce of flags), then reduces exactly those, in chunk order, with zeros
//! where it has none, as one process running every rank's batch would.
use tch::{Kind, Tensor};

use super::ChunkManager;
use crate::dist::ReduceOp;
use crate::gemini::chunk::TensorState;
use crate::Result;

impl ChunkManager {
    /// Parameter `i`'s gradient arrived. Alone it is added into its chunk's gradient
    /// accumulator (beside the home copy, so on the home's tier); with a data-parallel group
    /// into the chunk's whole gradient on the device. When every tensor of the chunk has its
    /// gradient the chunk's gradient is complete: it is reduced across ranks (see
    /// [`ChunkManager::reduce`]) and its tensors go back to `Hold`.
    pub fn add_gradient(&mut self, i: usize, grad: &Tensor) -> Result<()> {
        let (c, s) = self.places[i];
        self.chunks[c].slots[s].move_to(TensorState::ReadyForReduce)?;
        if self.replication.is_some() && self.chunks[c].full_grad.is_none() {
            self.allocate_full_grad(c)?;
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
            for s in &mut self.chunks[c].slots {
                s.move_to(TensorState::Hold)?;
            }
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
    /// rank, whatever each rank's data made its backward touch.
    fn reduce_agreed(&mut self) -> Result<()> {
        let Some(rep) = &self.replication else { return Ok(()) };
        let group = rep.group.clone();
        let local: Vec<f32> = self.chunks.iter().map(|ch| if ch.full_grad.is_some() { 1.0 } else { 0.0 }).collect();
        let flags = Tensor::from_slice(&local);
        group.all_reduce(&flags, ReduceOp::Max)?;
        let any: Vec<f32> = Vec::<f32>::try_from(&flags)?;
        for (c, &flag) in any.iter().enumerate() {
            if flag > 0.0 {
                if self.chunks[c].full_grad.is_none() {
                    self.allocate_full_grad(c)?;
                }
                self.reduce(c)?;
            }
        }
        Ok(())
    }

    /// Averages a chunk's whole gradient across the data-parallel group into this rank's
    /// accumulator: a reduce-scatter when sharded (each rank gets its part), an all-reduce
    /// when replicated. Called only by [`ChunkManager::reduce_agreed`].
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

    /// End of backward: the chunks' gradients are reduced over the group (see the module
    /// docs), tensors that got no gradient this step go back to `Hold`, and chunks whose
    /// gradient is partial (some tensors unused) are complete as they are. (A module whose
    /// input needs no gradient never reports the end of its backward: its tensors are still in
    /// `Compute` here.)
    pub fn finish_backward(&mut self) -> Result<()> {
        self.reduce_agreed()?;
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
}
