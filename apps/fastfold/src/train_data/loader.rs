//! The order of the training chains and their loading ahead of the steps: each epoch the
//! chains shuffled by (seed, epoch, rank), step after step; each step's example read and
//! prepared ([`super::example`]) on a pool of threads ([`data::loader::Prefetch`]), at most
//! a few waiting, while the steps before it train.
use std::sync::Arc;

use super::example::{load, prepare, Pipeline, Prepared};
use super::layout::ChainEntry;
use super::transforms::{keyed, Draw};

/// The chain (index into `len` chains) each of steps `first..first + steps` (1-based) trains
/// on, on data-parallel rank `rank`: epochs of every chain once, in an order drawn per epoch.
pub fn schedule(len: usize, seed: u64, rank: u64, first: u64, steps: u64) -> Vec<usize> {
    let order = |epoch: u64| {
        let mut order: Vec<usize> = (0..len).collect();
        keyed(seed, Draw::Shuffle, epoch, rank).shuffle(&mut order);
        order
    };
    let mut cached: Option<(u64, Vec<usize>)> = None;
    (first..first + steps)
        .map(|step| {
            let (epoch, at) = ((step - 1) / len as u64, ((step - 1) % len as u64) as usize);
            if cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
                cached = Some((epoch, order(epoch)));
            }
            cached.as_ref().map(|(_, o)| o[at]).unwrap_or(0)
        })
        .collect()
}

/// Examples of steps 1.. arriving in order, made ahead on `workers` threads.
pub struct ExampleLoader(data::loader::Prefetch<Prepared, anyhow::Error>);

/// Examples being made at once (and so the most memory a loader holds, with [`PREFETCH`]).
const PARALLEL: usize = 2;
/// Finished examples waiting for their step.
const PREFETCH: usize = 2;

impl ExampleLoader {
    /// Starts making the examples of `steps` steps from `chains` on data-parallel rank `rank`.
    pub fn new(
        chains: Vec<ChainEntry>,
        pipeline: Pipeline,
        steps: u64,
        rank: u64,
        workers: usize,
    ) -> anyhow::Result<ExampleLoader> {
        let order = schedule(chains.len(), pipeline.seed, rank, 1, steps);
        let specs: Vec<(u64, usize)> = order.into_iter().enumerate().map(|(k, c)| (k as u64 + 1, c)).collect();
        let chains = Arc::new(chains);
        let make = move |&(step, c): &(u64, usize)| -> anyhow::Result<Prepared> {
            let example = load(&chains[c])?;
            prepare(&example, &pipeline, step, rank)
        };
        Ok(ExampleLoader(data::loader::Prefetch::new(specs, workers, PARALLEL.min(workers.max(1)), PREFETCH, make)?))
    }

    /// The next step's example.
    pub fn next_example(&mut self) -> anyhow::Result<Prepared> {
        self.0.next().unwrap_or_else(|| Err(anyhow::anyhow!("the training data loader stopped early")))
    }
}

#[cfg(test)]
mod tests {
    use super::schedule;

    #[test]
    fn each_epoch_visits_every_chain_once_in_its_own_order() {
        let s = schedule(5, 3, 0, 1, 15);
        for epoch in s.chunks(5) {
            let mut e = epoch.to_vec();
            e.sort();
            assert_eq!(e, [0, 1, 2, 3, 4]);
        }
        assert_ne!(s[..5], s[5..10], "epochs are shuffled apart");
        assert_eq!(schedule(5, 3, 0, 7, 4), s[6..10], "a later start continues the same order");
        assert_ne!(schedule(5, 3, 1, 1, 15), s, "ranks draw their own order");
        assert_eq!(schedule(1, 3, 0, 1, 3), [0, 0, 0]);
    }
}
