//! Batches decoded and augmented on a rayon pool, ahead of training, with a bounded queue: at
//! most `prefetch` finished batches wait, so memory stays bounded whatever the data set size.
//!
//! The loader is given the whole list of batches up front (the sampler decides it), produces
//! them in order on a background thread, and stops early if the consumer goes away.
//! [`Prefetch`] is the same machinery for any item (fastfold's training examples).
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::thread::JoinHandle;

use rayon::prelude::*;

use crate::augment::{Rng, Transform};
use crate::images::Dataset;
use crate::{Error, Result};

/// The examples of one batch and the key of their augmentation draws.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchSpec {
    /// Example indices, in order.
    pub indices: Vec<usize>,
    /// The epoch: with the seed and the example index it keys the example's random draws.
    pub epoch: u64,
}

/// One batch, ready for the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// `[n, channels, size, size]` values, image after image.
    pub pixels: Vec<f32>,
    /// `[n]` labels.
    pub labels: Vec<i64>,
    /// `[n, channels, size, size]`.
    pub shape: [usize; 4],
}

/// Decodes, augments and stacks one batch (in parallel on the current rayon pool).
pub fn make_batch(dataset: &dyn Dataset, transform: &Transform, seed: u64, spec: &BatchSpec) -> Result<Batch> {
    let size = transform.size();
    let examples = spec
        .indices
        .par_iter()
        .map(|&i| {
            if i >= dataset.len() {
                return Err(Error::Format {
                    path: "<sampler>".into(),
                    msg: format!("index {i} beyond the {} examples", dataset.len()),
                });
            }
            let (img, label) = dataset.get(i)?;
            Ok((transform.apply(&img, &mut Rng::keyed(seed, spec.epoch, i as u64)), label))
        })
        .collect::<Result<Vec<_>>>()?;
    let channels = dataset.channels();
    let mut pixels = Vec::with_capacity(examples.len() * channels * size * size);
    let mut labels = Vec::with_capacity(examples.len());
    for (img, label) in examples {
        pixels.extend_from_slice(&img.pixels);
        labels.push(label);
    }
    Ok(Batch { shape: [labels.len(), channels, size, size], pixels, labels })
}

/// Items made in the background from a list of specs, in order: `parallel` at a time on a
/// pool of `workers` threads, at most `prefetch` finished ones waiting, so memory stays
/// bounded whatever the list's length. The first error is the last item. Iterate to receive
/// them; dropping it stops the work after the items being made.
pub struct Prefetch<T, E> {
    rx: Receiver<std::result::Result<T, E>>,
    worker: Option<JoinHandle<()>>,
}

impl<T: Send + 'static, E: Send + 'static> Prefetch<T, E> {
    /// Starts making `make(spec)` for each of `specs`, in order.
    pub fn new<S, F>(specs: Vec<S>, workers: usize, parallel: usize, prefetch: usize, make: F) -> Result<Self>
    where
        S: Send + Sync + 'static,
        F: Fn(&S) -> std::result::Result<T, E> + Send + Sync + 'static,
    {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(workers.max(1))
            .thread_name(|i| format!("loader-{i}"))
            .build()
            .map_err(|e| Error::Format { path: "<loader>".into(), msg: format!("cannot start decode threads: {e}") })?;
        let (tx, rx) = sync_channel(prefetch.max(1));
        let worker = std::thread::Builder::new()
            .name("loader".into())
            .spawn(move || {
                for window in specs.chunks(parallel.max(1)) {
                    let items: Vec<std::result::Result<T, E>> = pool.install(|| window.par_iter().map(&make).collect());
                    for item in items {
                        let failed = item.is_err();
                        // A closed channel means the consumer stopped early: stop too.
                        if tx.send(item).is_err() || failed {
                            return;
                        }
                    }
                }
            })
            .map_err(|e| Error::Format { path: "<loader>".into(), msg: format!("cannot start the loader: {e}") })?;
        Ok(Prefetch { rx, worker: Some(worker) })
    }
}

impl<T, E> Iterator for Prefetch<T, E> {
    type Item = std::result::Result<T, E>;

    fn next(&mut self) -> Option<Self::Item> {
        self.rx.recv().ok()
    }
}

impl<T, E> Drop for Prefetch<T, E> {
    fn drop(&mut self) {
        // Unblock a worker waiting on a full queue, then let it finish its current items.
        let (_, dead) = sync_channel(1);
        drop(std::mem::replace(&mut self.rx, dead));
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// Produces batches in the background; iterate to receive them in order.
pub struct Loader(Prefetch<Batch, Error>);

impl Loader {
    /// Starts producing `specs` in order with `workers` decode threads, keeping at most
    /// `prefetch` batches ready. One batch is made at a time, its examples in parallel.
    pub fn new(
        dataset: Arc<dyn Dataset>,
        transform: Transform,
        seed: u64,
        specs: Vec<BatchSpec>,
        workers: usize,
        prefetch: usize,
    ) -> Result<Loader> {
        let make = move |spec: &BatchSpec| make_batch(dataset.as_ref(), &transform, seed, spec);
        Ok(Loader(Prefetch::new(specs, workers, 1, prefetch, make)?))
    }
}

impl Iterator for Loader {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        self.0.next()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::augment::Normalize;
    use crate::images::InMemory;

    fn data(n: usize) -> Arc<dyn Dataset> {
        Arc::new(InMemory {
            shape: [1, 2, 2],
            pixels: (0..n * 4).map(|i| i as f32 / (n * 4) as f32).collect(),
            labels: (0..n as i64).collect(),
            classes: (0..n).map(|i| i.to_string()).collect(),
        })
    }

    fn eval() -> Transform {
        Transform::Eval { size: 2, normalize: Normalize { mean: vec![0.0], std: vec![1.0] } }
    }

    #[test]
    fn batches_arrive_in_order_with_their_pixels() {
        let specs: Vec<BatchSpec> = (0..5).map(|b| BatchSpec { indices: vec![2 * b, 2 * b + 1], epoch: 0 }).collect();
        let batches: Vec<Batch> = Loader::new(data(10), eval(), 0, specs, 2, 2).unwrap().map(|b| b.unwrap()).collect();
        assert_eq!(batches.len(), 5);
        assert_eq!(batches[3].labels, vec![6, 7]);
        assert_eq!(batches[3].shape, [2, 1, 2, 2]);
        assert_eq!(batches[3].pixels[0], 24.0 / 40.0);
    }

    #[test]
    fn augmentation_does_not_depend_on_threads() {
        let t = Transform::Train {
            size: 2,
            scale: (0.3, 1.0),
            ratio: (0.5, 2.0),
            hflip: true,
            normalize: Normalize::symmetric(),
        };
        let spec = BatchSpec { indices: (0..10).collect(), epoch: 3 };
        let one = Loader::new(data(10), t.clone(), 7, vec![spec.clone()], 1, 1).unwrap().next().unwrap().unwrap();
        let two = Loader::new(data(10), t, 7, vec![spec], 2, 1).unwrap().next().unwrap().unwrap();
        assert_eq!(one, two);
    }

    #[test]
    fn a_bad_index_is_an_error_and_dropping_early_does_not_hang() {
        let specs = vec![BatchSpec { indices: vec![0, 99], epoch: 0 }];
        let err = Loader::new(data(4), eval(), 0, specs, 1, 1).unwrap().next().unwrap().unwrap_err();
        assert!(err.to_string().contains("index 99 beyond the 4 examples"), "{err}");
        let many: Vec<BatchSpec> = (0..1000).map(|_| BatchSpec { indices: vec![0], epoch: 0 }).collect();
        let mut loader = Loader::new(data(4), eval(), 0, many, 1, 1).unwrap();
        assert!(loader.next().is_some());
        drop(loader);
    }

    #[test]
    fn prefetch_keeps_order_across_parallel_items_and_stops_at_an_error() {
        let make = |&i: &u64| if i == 7 { Err(format!("item {i}")) } else { Ok(i * i) };
        let items: Vec<std::result::Result<u64, String>> =
            Prefetch::new((0..10).collect(), 3, 3, 2, make).unwrap().collect();
        let squares: Vec<u64> = items.iter().take(7).map(|r| *r.as_ref().unwrap()).collect();
        assert_eq!(squares, [0, 1, 4, 9, 16, 25, 36]);
        assert_eq!(items.len(), 8, "nothing after the error");
        assert_eq!(items[7], Err("item 7".to_string()));
    }
}
