//! The order of the training chains and their loading ahead of the steps: the run's examples
//! form one stream, numbered 1, 2, ... (the chains' places in epochs of every chain once, in an
//! order drawn by (seed, epoch), each place taken or passed by OpenFold's stochastic filter,
//! [`ChainSampling`]); a data-parallel replica trains every `replicas`-th of them, as PyTorch's
//! `DistributedSampler` splits an epoch, so replicas never share an example ([`Shard`]). Each
//! of this replica's examples is read and prepared ([`super::example`], its draws keyed by its
//! number in the stream) on a pool of threads ([`data::loader::Prefetch`]), at most a few
//! waiting, while the steps before it train.
use std::sync::Arc;

use super::example::{load, prepare, Pipeline, Prepared};
use super::layout::ChainEntry;
use super::transforms::{keyed, Draw};

/// How often each chain trains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ChainSampling {
    /// OpenFold's stochastic training filter (`get_stochastic_train_filter_prob`): a chain's
    /// place in the epochs' order is taken with probability `max(min(length, 512), 256) / 512`,
    /// times `1 / cluster_size` when the chain data cache gives its cluster, so that short
    /// chains and large clusters of near-copies do not dominate training.
    Openfold,
    /// Every chain once an epoch.
    Uniform,
}

impl ChainSampling {
    /// The probability that a place of `chain` in the epochs' order trains.
    pub fn acceptance(self, chain: &ChainEntry) -> f64 {
        self.probability(chain.length, &[chain.cluster_size])
    }

    /// The probability that a place of an example of `length` residues (a chain, or a
    /// complex's chains together) takes its turn, its chains in clusters of `cluster_sizes`
    /// (one a chain; `None`: not known, as a cluster of one): the length's factor times the
    /// mean over the chains of `1 / cluster_size`, which for one chain is OpenFold's
    /// `1 / cluster_size` and for a complex weighs it by how rare its chains are on average.
    pub fn probability(self, length: usize, cluster_sizes: &[Option<usize>]) -> f64 {
        match self {
            ChainSampling::Uniform => 1.0,
            ChainSampling::Openfold => {
                let length = length.clamp(256, 512) as f64 / 512.0;
                let weight = |size: &Option<usize>| size.filter(|&n| n > 0).map_or(1.0, |n| 1.0 / n as f64);
                let cluster = match cluster_sizes.len() {
                    0 => 1.0,
                    n => cluster_sizes.iter().map(weight).sum::<f64>() / n as f64,
                };
                length * cluster
            }
        }
    }
}

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

    /// This replica's examples of steps `first..=steps` (a resumed run's from `first`), each
    /// its number in the stream and the example (index into `acceptance`, one probability an
    /// example) that [`schedule`] gives that number under `seed`.
    pub fn stream(&self, acceptance: &[f64], seed: u64, first: u64, steps: u64) -> anyhow::Result<Vec<(u64, usize)>> {
        let skip = (first.saturating_sub(1) * self.accumulation) as usize;
        let numbers: Vec<u64> = self.examples(steps).into_iter().skip(skip).collect();
        let order = schedule(acceptance, seed, &numbers)?;
        Ok(numbers.into_iter().zip(order).collect())
    }
}

/// The chain (index into `acceptance`, one probability a chain) of each of the stream's
/// `examples` (1-based numbers, ascending): the places of epochs of every chain once, in an
/// order drawn per epoch, each taken with its chain's probability (drawn by the place), the
/// taken ones numbered in turn. An error when the chains' probabilities are all 0.
pub fn schedule(acceptance: &[f64], seed: u64, examples: &[u64]) -> anyhow::Result<Vec<usize>> {
    let len = acceptance.len() as u64;
    anyhow::ensure!(
        acceptance.iter().any(|&p| p > 0.0),
        "no training chain can be drawn (every chain's sampling probability is 0)"
    );
    let order = |epoch: u64| {
        let mut order: Vec<usize> = (0..len as usize).collect();
        // Every replica draws the same order (rank 0's key) and takes its own share of it.
        keyed(seed, Draw::Shuffle, epoch, 0).shuffle(&mut order);
        order
    };
    let mut chains = Vec::with_capacity(examples.len());
    let (mut taken, mut place) = (0u64, 0u64);
    let mut epoch_order: Option<(u64, Vec<usize>)> = None;
    for &n in examples {
        // Walk the places (every replica walks them all, so all agree) up to the n-th taken.
        loop {
            let epoch = place / len;
            if epoch_order.as_ref().is_none_or(|(e, _)| *e != epoch) {
                epoch_order = Some((epoch, order(epoch)));
            }
            let chain = epoch_order.as_ref().map_or(0, |(_, o)| o[(place % len) as usize]);
            place += 1;
            let p = acceptance[chain];
            if p >= 1.0 || keyed(seed, Draw::Accept, place, 0).uniform() < p {
                taken += 1;
                if taken == n {
                    chains.push(chain);
                    break;
                }
            }
        }
    }
    Ok(chains)
}

/// This replica's examples, arriving in order, made ahead on `workers` threads.
pub struct ExampleLoader(data::loader::Prefetch<Prepared, anyhow::Error>);

/// Examples being made at once (and so the most memory a loader holds, with [`PREFETCH`]).
pub(super) const PARALLEL: usize = 2;
/// Finished examples waiting for their step.
pub(super) const PREFETCH: usize = 2;

impl ExampleLoader {
    /// Starts making `shard`'s examples of `steps` steps from `chains`, drawn by `sampling`,
    /// each prepared with the draws of its number in the stream.
    pub fn new(
        chains: Vec<ChainEntry>,
        pipeline: Pipeline,
        sampling: ChainSampling,
        steps: u64,
        shard: Shard,
        workers: usize,
    ) -> anyhow::Result<ExampleLoader> {
        ExampleLoader::from_step(chains, pipeline, sampling, 1, steps, shard, workers)
    }

    /// As [`ExampleLoader::new`], the examples of steps `first..=steps` (a resumed run's): the
    /// same examples those steps get in a run from step 1, since each is drawn by its number.
    pub fn from_step(
        chains: Vec<ChainEntry>,
        pipeline: Pipeline,
        sampling: ChainSampling,
        first: u64,
        steps: u64,
        shard: Shard,
        workers: usize,
    ) -> anyhow::Result<ExampleLoader> {
        let acceptance: Vec<f64> = chains.iter().map(|c| sampling.acceptance(c)).collect();
        let specs = shard.stream(&acceptance, pipeline.seed, first, steps)?;
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
    use std::path::PathBuf;

    use super::{schedule, ChainEntry, ChainSampling, Shard};

    #[test]
    fn each_epoch_visits_every_chain_once_in_its_own_order() {
        let all: Vec<u64> = (1..=15).collect();
        let s = schedule(&[1.0; 5], 3, &all).unwrap();
        for epoch in s.chunks(5) {
            let mut e = epoch.to_vec();
            e.sort();
            assert_eq!(e, [0, 1, 2, 3, 4]);
        }
        assert_ne!(s[..5], s[5..10], "epochs are shuffled apart");
        assert_eq!(schedule(&[1.0; 5], 3, &all[6..10]).unwrap(), s[6..10], "a later start continues the same order");
        assert_eq!(schedule(&[1.0], 3, &[1, 2, 3]).unwrap(), [0, 0, 0]);
    }

    fn chain(length: usize, cluster_size: Option<usize>) -> ChainEntry {
        let (name, chain) = ("1abc_A".to_string(), "A".to_string());
        let (mmcif, msas, templates) = (PathBuf::new(), Vec::new(), Vec::new());
        ChainEntry { name, chain, mmcif, msas, templates, length, cluster_size }
    }

    /// OpenFold's weights: length clamped to 256..512 over 512, over the cluster's size.
    #[test]
    fn openfold_sampling_weighs_by_length_and_cluster() {
        let p = |length, cluster| ChainSampling::Openfold.acceptance(&chain(length, cluster));
        assert_eq!([p(100, None), p(384, None), p(1000, None)], [0.5, 0.75, 1.0]);
        assert_eq!([p(1000, Some(4)), p(100, Some(2)), p(1000, Some(0))], [0.25, 0.25, 1.0]);
        assert_eq!(ChainSampling::Uniform.acceptance(&chain(100, Some(9))), 1.0);
    }

    /// A complex's weight: its chains' length together, times the mean of its chains'
    /// `1 / cluster_size` (unknown: 1).
    #[test]
    fn a_complex_weighs_by_its_length_and_its_chains_clusters() {
        let p = |length, clusters: &[Option<usize>]| ChainSampling::Openfold.probability(length, clusters);
        assert_eq!(p(384, &[Some(2), Some(4)]), 0.75 * (0.5 + 0.25) / 2.0);
        assert_eq!(p(600, &[Some(4), None]), (0.25 + 1.0) / 2.0);
        assert!((p(600, &[Some(3), Some(3), Some(3)]) - p(600, &[Some(3)])).abs() < 1e-15, "copies weigh as one");
        assert_eq!(p(100, &[]), 0.5);
        assert_eq!(ChainSampling::Uniform.probability(100, &[Some(9), Some(9)]), 1.0);
    }

    /// Taken places follow their probabilities, a later start continues the same stream, and
    /// chains that can never be drawn are an error rather than an endless walk.
    #[test]
    fn chains_are_taken_in_proportion_to_their_probability() {
        let all: Vec<u64> = (1..=4000).collect();
        let s = schedule(&[1.0, 0.25, 0.0], 7, &all).unwrap();
        let count = |c| s.iter().filter(|&&x| x == c).count() as f64;
        assert_eq!(count(2), 0.0, "a chain of probability 0 never trains");
        // Each epoch takes chain 0 once and chain 1 with probability 1/4: 4 to 1.
        let ratio = count(0) / count(1);
        assert!((ratio - 4.0).abs() < 0.4, "taken 4 to 1, found {ratio}");
        assert_eq!(schedule(&[1.0, 0.25, 0.0], 7, &all[100..120]).unwrap(), s[100..120]);
        assert!(schedule(&[0.0, 0.0], 7, &[1]).is_err());
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
