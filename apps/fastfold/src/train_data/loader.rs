//! The order of the training chains and their loading ahead of the steps: the run's examples
//! form one stream, numbered 1, 2, ... (each epoch every chain once, in an order drawn by
//! (seed, epoch)); a data-parallel replica trains every `replicas`-th of them, as PyTorch's
//! `DistributedSampler` splits an epoch, so replicas never share an example ([`Shard`]). Each
//! of this replica's examples is read and prepared ([`super::example`], its draws keyed by its
//! number in the stream) on a pool of threads ([`data::loader::Prefetch`]), at most a few
//! waiting, while the steps before it train.
use std::sync::Arc;

use super::example::{load, prepare, Pipeline, Prepared};
use super::layout::ChainEntry;
use super::transforms::{keyed, Draw};

/// Which examples of the run's stream one data-parallel replica trains, and how many per
/// optimizer step. Example numbers depend only on the step, the micro-step and the replica,
/// so `R` replicas accumulating `K` examples each train a step on the same `R x K` examples
/// (and draws) as one process accumulating `R x K`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This replica (0-based).
    pub replica: u64,
    /// Replicas training different examples.
    pub replicas: u64,
    /// Examples each replica accumulates per optimizer step.
    pub accumulation: u64,
}

impl Shard {
    /// One process, one example a step: example `n` in step `n`.
    pub const ONE: Shard = Shard { replica: 0, replicas: 1, accumulation: 1 };

    /// The number in the stream (1-based) of micro-step `micro` (0-based) of `step` (1-based)
    /// on this replica: replicas interleave within each micro-step.
    pub fn example(&self, step: u64, micro: u64) -> u64 {
        ((step - 1) * self.accumulation + micro) * self.replicas + self.replica + 1
    }

    /// This replica's example numbers of steps `1..=steps`, in training order.
    pub fn examples(&self, steps: u64) -> Vec<u64> {
        (1..=steps).flat_map(|step| (0..self.accumulation).map(move |k| self.example(step, k))).collect()
    }
}

/// The chain (index into `len` chains) of each of the stream's `examples` (1-based numbers):
/// epochs of every chain once, in an order drawn per epoch.
pub fn schedule(len: usize, seed: u64, examples: &[u64]) -> Vec<usize> {
    let order = |epoch: u64| {
        let mut order: Vec<usize> = (0..len).collect();
        // Every replica draws the same order (rank 0's key) and takes its own share of it.
        keyed(seed, Draw::Shuffle, epoch, 0).shuffle(&mut order);
        order
    };
    let mut cached: Option<(u64, Vec<usize>)> = None;
    examples
        .iter()
        .map(|&n| {
            let (epoch, at) = ((n - 1) / len as u64, ((n - 1) % len as u64) as usize);
            if cached.as_ref().is_none_or(|(e, _)| *e != epoch) {
                cached = Some((epoch, order(epoch)));
            }
            cached.as_ref().map(|(_, o)| o[at]).unwrap_or(0)
        })
        .collect()
}

/// This replica's examples, arriving in order, made ahead on `workers` threads.
pub struct ExampleLoader(data::loader::Prefetch<Prepared, anyhow::Error>);

/// Examples being made at once (and so the most memory a loader holds, with [`PREFETCH`]).
const PARALLEL: usize = 2;
/// Finished examples waiting for their step.
const PREFETCH: usize = 2;

impl ExampleLoader {
    /// Starts making `shard`'s examples of `steps` steps from `chains`, each prepared with the
    /// draws of its number in the stream.
    pub fn new(
        chains: Vec<ChainEntry>,
        pipeline: Pipeline,
        steps: u64,
        shard: Shard,
        workers: usize,
    ) -> anyhow::Result<ExampleLoader> {
        ExampleLoader::from_step(chains, pipeline, 1, steps, shard, workers)
    }

    /// As [`ExampleLoader::new`], the examples of steps `first..=steps` (a resumed run's): the
    /// same examples those steps get in a run from step 1, since each is drawn by its number.
    pub fn from_step(
        chains: Vec<ChainEntry>,
        pipeline: Pipeline,
        first: u64,
        steps: u64,
        shard: Shard,
        workers: usize,
    ) -> anyhow::Result<ExampleLoader> {
        let skip = (first.saturating_sub(1) * shard.accumulation) as usize;
        let numbers: Vec<u64> = shard.examples(steps).into_iter().skip(skip).collect();
        let order = schedule(chains.len(), pipeline.seed, &numbers);
        let specs: Vec<(u64, usize)> = numbers.into_iter().zip(order).collect();
        let mut chains = chains;
        if pipeline.templates.is_none() {
            // Hit files are not read (nor their errors raised) without templates.
            chains.iter_mut().for_each(|c| c.templates.clear());
        }
        let chains = Arc::new(chains);
        let make = move |&(n, c): &(u64, usize)| -> anyhow::Result<Prepared> {
            let example = load(&chains[c])?;
            // Keyed by the example's number alone: the same example on any layout of ranks.
            prepare(&example, &pipeline, n, 0)
        };
        Ok(ExampleLoader(data::loader::Prefetch::new(specs, workers, PARALLEL.min(workers.max(1)), PREFETCH, make)?))
    }

    /// The next example.
    pub fn next_example(&mut self) -> anyhow::Result<Prepared> {
        self.0.next().unwrap_or_else(|| Err(anyhow::anyhow!("the training data loader stopped early")))
    }
}

#[cfg(test)]
mod tests {
    use super::{schedule, Shard};

    #[test]
    fn each_epoch_visits_every_chain_once_in_its_own_order() {
        let all: Vec<u64> = (1..=15).collect();
        let s = schedule(5, 3, &all);
        for epoch in s.chunks(5) {
            let mut e = epoch.to_vec();
            e.sort();
            assert_eq!(e, [0, 1, 2, 3, 4]);
        }
        assert_ne!(s[..5], s[5..10], "epochs are shuffled apart");
        assert_eq!(schedule(5, 3, &all[6..10]), s[6..10], "a later start continues the same order");
        assert_eq!(schedule(1, 3, &[1, 2, 3]), [0, 0, 0]);
    }

    #[test]
    fn replicas_split_the_stream_and_accumulation_keeps_its_examples() {
        let two = |replica| Shard { replica, replicas: 2, accumulation: 3 };
        let (a, b) = (two(0).examples(2), two(1).examples(2));
        assert_eq!(a, [1, 3, 5, 7, 9, 11]);
        assert_eq!(b, [2, 4, 6, 8, 10, 12]);
        // Step 2 of 2 replicas x 3 is step 2 of one process accumulating 6.
        let one = Shard { accumulation: 6, ..Shard::ONE };
        let mut step2: Vec<u64> = a[3..].iter().chain(&b[3..]).copied().collect();
        step2.sort();
        assert_eq!(step2, one.examples(2)[6..]);
        assert_eq!(Shard::ONE.examples(3), [1, 2, 3], "one process: example n in step n");
    }
}
