//! ZeRO stages 1 and 2 (Rajbhandari et al.): each data-parallel rank keeps the optimizer state
//! of, and steps, only the parameters it owns; after the step every parameter is broadcast
//! from its owner. With stage 2 the gradients are also reduced only to their owner
//! ([`super::DataParallel::new_sharded`]).
//!
//! Ownership is by whole parameter (as PyTorch's `ZeroRedundancyOptimizer`), so the
//! layer-wise norms of LAMB and LARS are of the whole parameter, never of a shard: the plain
//! optimizers are exact here. Per-rank state is about 1/N of the unsharded state, give or
//! take the largest parameter.
use crate::dist::ProcessGroup;
use crate::optim::{Optimizer, Param};
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
        crate::error::ensure!(
            owners.len() == params.len(),
            "ZeRO: {} owners for {} parameters",
            owners.len(),
            params.len()
        );
        let mine =
            params.iter().zip(&owners).filter(|(_, &o)| o == group.rank()).map(|(p, _)| p.shallow_copy()).collect();
        Ok(ZeroOptimizer { inner: make(mine), params, owners, group: group.clone() })
    }

    /// The optimizer over this rank's parameters.
    pub fn inner(&self) -> &O {
        &self.inner
    }
}

impl<O: Optimizer> Optimizer for ZeroOptimizer<O> {
    fn step(&mut self) -> Result<()> {
        self.inner.step()?;
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
