//! ZeRO stages 1 and 2 (Rajbhandari et al.): each data-parallel rank keeps the optimizer state
//! of, and steps, only the parameters it owns; after the step every parameter is broadcast
//! from its owner. With stage 2 the gradients are also reduced only to their owner
//! ([`super::DataParallel::new_sharded`]).
//!
//! Ownership is by whole parameter (as PyTorch's `ZeroRedundancyOptimizer`), so the
//! layer-wise norms of LAMB and LARS are of the whole parameter, never of a shard: the plain
//! optimizers are exact here. Per-rank state is about 1/N of the unsharded state, give or
//! take the largest parameter.
//!
//! Under mixed precision (or optimizer offload) the fp32 master weights are sharded the same
//! way ([`ZeroOptimizer::with_masters`]): a rank keeps masters of its own parameters only,
//! steps them, rounds them into the model and broadcasts the model's (bf16/fp16) weights.
use tch::{Device, Kind, Tensor};

use crate::dist::ProcessGroup;
use crate::optim::{MasterWeights, Optimizer, Param};
use crate::Result;

/// Owner rank of each parameter: contiguous runs in reverse order (the order backward produces
/// gradients, so ZeRO-2 buckets stay large) balanced by bytes.
pub fn partition(params: &[Param], ranks: usize) -> Vec<usize> {
    let bytes: Vec<usize> = params.iter().map(|p| p.tensor.numel() * p.tensor.kind().elt_size_in_bytes()).collect();
    let total: usize = bytes.iter().sum();
    let mut owners = vec![0; params.len()];
    let mut filled = 0usize;
    for i in (0..params.len()).rev() {
        // The rank whose 1/N slice of the byte range holds this parameter's midpoint.
        let mid = filled + bytes[i] / 2;
        owners[i] = (mid * ranks / total.max(1)).min(ranks - 1);
        filled += bytes[i];
    }
    owners
}

/// An optimizer whose state is sharded over a data-parallel group.
pub struct ZeroOptimizer<O> {
    inner: O,
    params: Vec<Param>,
    owners: Vec<usize>,
    group: ProcessGroup,
    /// fp32 copies of this rank's own parameters, which `inner` steps (None: it steps the
    /// model's own tensors).
    master: Option<MasterWeights>,
}

impl<O: Optimizer> ZeroOptimizer<O> {
    /// Shards `params` (the same list on every rank) over `group` by `owners` (see
    /// [`partition`]); `make` builds the real optimizer over this rank's parameters.
    pub fn new(
        params: Vec<Param>,
        owners: Vec<usize>,
        group: &ProcessGroup,
        make: impl FnOnce(Vec<Param>) -> O,
    ) -> Result<ZeroOptimizer<O>> {
        Self::build(params, owners, group, None, make)
    }

    /// Like [`ZeroOptimizer::new`], with fp32 master copies of this rank's parameters only, on
    /// `device` (the model's, or the CPU for offload): `make` builds the optimizer over them,
    /// and each step rounds them into the model before the broadcast.
    pub fn with_masters(
        params: Vec<Param>,
        owners: Vec<usize>,
        group: &ProcessGroup,
        device: Device,
        make: impl FnOnce(Vec<Param>) -> O,
    ) -> Result<ZeroOptimizer<O>> {
        Self::build(params, owners, group, Some(device), make)
    }

    fn build(
        params: Vec<Param>,
        owners: Vec<usize>,
        group: &ProcessGroup,
        master_device: Option<Device>,
        make: impl FnOnce(Vec<Param>) -> O,
    ) -> Result<ZeroOptimizer<O>> {
        crate::error::ensure!(
            owners.len() == params.len(),
            "ZeRO: {} owners for {} parameters",
            owners.len(),
            params.len()
        );
        let mine: Vec<Param> =
            params.iter().zip(&owners).filter(|(_, &o)| o == group.rank()).map(|(p, _)| p.shallow_copy()).collect();
        let (master, stepped) = match master_device {
            Some(device) => {
                let m = MasterWeights::on(mine, device)?;
                let stepped = m.master();
                (Some(m), stepped)
            }
            None => (None, mine),
        };
        Ok(ZeroOptimizer { inner: make(stepped), params, owners, group: group.clone(), master })
    }

    /// The parameters this rank steps (its own; their fp32 masters where there are masters):
    /// where its gradients are, for unscaling and clipping.
    pub fn stepped(&self) -> &[Param] {
        self.inner.params()
    }

    /// The fp32 master shard, if any.
    pub fn master(&self) -> Option<&MasterWeights> {
        self.master.as_ref()
    }

    /// Every parameter in fp32, the same full tensors on every rank (for checkpoints and
    /// evaluation): without masters the model's own tensors; with them each master is
    /// broadcast from its owner into a fresh buffer (a collective: every rank calls it).
    pub fn full_weights(&self) -> Result<Vec<(String, Tensor)>> {
        let Some(master) = &self.master else {
            return Ok(self.params.iter().map(|p| (p.name.clone(), p.tensor.shallow_clone())).collect());
        };
        let mut own = master.master().into_iter();
        let me = self.group.rank();
        let full = self
            .params
            .iter()
            .zip(&self.owners)
            .map(|(p, &o)| {
                let t = match o == me {
                    true => own.next().expect("one master per own parameter").tensor.f_detach_copy()?,
                    false => Tensor::f_zeros(p.tensor.size(), (Kind::Float, master.device()))?,
                };
                Ok((p.name.clone(), t))
            })
            .collect::<Result<Vec<_>>>()?;
        let works = full.iter().zip(&self.owners).map(|((_, t), &o)| self.group.broadcast_async(t, o));
        works.collect::<Result<Vec<_>>>()?.into_iter().try_for_each(|w| w.wait())?;
        Ok(full)
    }

    /// Sets every parameter from full fp32 tensors (what [`Self::full_weights`] returned,
    /// perhaps filled from a checkpoint): the model's weights and this rank's masters.
    pub fn load_full_weights(&self, full: &[(String, Tensor)]) -> Result<()> {
        crate::error::ensure!(
            full.len() == self.params.len(),
            "ZeRO: {} weights for {} parameters",
            full.len(),
            self.params.len()
        );
        let mut own = self.master.as_ref().map(|m| m.master().into_iter());
        tch::no_grad(|| {
            for ((p, (_, t)), &o) in self.params.iter().zip(full).zip(&self.owners) {
                p.tensor.shallow_clone().f_copy_(t)?;
                if let (Some(own), true) = (own.as_mut(), o == self.group.rank()) {
                    own.next().expect("one master per own parameter").tensor.shallow_clone().f_copy_(t)?;
                }
            }
            Ok(())
        })
    }

    /// Copies this rank's model gradients into its masters (fp32); no-op without masters.
    pub fn gradients_to_master(&self) -> Result<()> {
        self.master.as_ref().map_or(Ok(()), MasterWeights::gradients_to_master)
    }

    /// The optimizer over this rank's parameters.
    pub fn inner(&self) -> &O {
        &self.inner
    }
}

impl<O: Optimizer> Optimizer for ZeroOptimizer<O> {
    fn step(&mut self) -> Result<()> {
        self.inner.step()?;
        if let Some(m) = &self.master {
            m.weights_to_model()?;
        }
        // Every rank issues the same broadcasts in the same order, all in flight at once.
        let works = tch::no_grad(|| {
            self.params
                .iter()
                .zip(&self.owners)
                .map(|(p, &o)| self.group.broadcast_async(&p.tensor, o))
                .collect::<Result<Vec<_>>>()
        })?;
        works.into_iter().try_for_each(|w| w.wait())
    }

    fn lr(&self) -> f64 {
        self.inner.lr()
    }

    fn set_lr(&mut self, lr: f64) {
        self.inner.set_lr(lr);
    }

    fn params(&self) -> &[Param] {
        &self.params
    }

    fn state_bytes(&self) -> usize {
        self.inner.state_bytes()
    }

    /// This rank's shard of the state (each rank checkpoints its own).
    fn state(&self) -> Vec<(String, tch::Tensor)> {
        self.inner.state()
    }

    fn load_state(&mut self, state: &mut crate::optim::StateDict) -> Result<()> {
        self.inner.load_state(state)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind, Tensor};

    #[test]
    fn partition_balances_bytes_in_reverse_runs() {
        let p = |n: i64| Param::new("p", &Tensor::zeros([n], (Kind::Float, Device::Cpu)));
        let params = [p(10), p(10), p(10), p(10)];
        assert_eq!(partition(&params, 2), vec![1, 1, 0, 0]);
        assert_eq!(partition(&params, 4), vec![3, 2, 1, 0]);
        assert_eq!(partition(&params, 1), vec![0, 0, 0, 0]);
        // More ranks than parameters: some ranks own nothing.
        assert_eq!(partition(&params[..2], 4), vec![3, 1]);
    }
}
