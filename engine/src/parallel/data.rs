//! Data parallelism (DDP): every rank holds the whole model, computes gradients on its shard of
//! the batch, and the gradients are averaged over the group before the optimizer step.
//!
//! Gradients are grouped into buckets of about `bucket_bytes` in reverse registration order
//! (the order backward produces them). A post-accumulate hook on each parameter marks it
//! ready; when a bucket is complete its gradients are flattened into one buffer and its
//! all-reduce is launched asynchronously, so communication overlaps the rest of backward.
//! Buckets are launched strictly in order, the same order on every rank, whatever order the
//! hooks fire in. [`DataParallel::finish_gradients`] launches what is left (buckets holding a
//! parameter that got no gradient this step count its gradient as zero: nothing hangs), waits
//! for everything and writes the averaged gradients back. As in one process, a parameter that
//! got no gradient on any rank keeps no gradient (the optimizer then skips it); one that got a
//! gradient on some ranks gets the average with zeros for the others.
//!
//! A launched bucket's gradients live only in its flat buffer (the `.grad`s are dropped at
//! launch and set again from the result), so no rank holds a gradient twice. Under ZeRO-2
//! (owners given) a bucket is reduced to its owner only; the other ranks keep its buffer only
//! while it is being sent, at most [`MAX_SENDING`] of them at once (older ones are waited
//! for), so the gradients a rank holds at the peak of backward are its own ~1/N plus a few
//! buckets, not the whole model's. [`DataParallel::gradient_bytes`] reports that peak from a
//! counter.
use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};

use tch::{Kind, Tensor};

use crate::autograd::{register_post_accumulate_grad_hook, set_grad};
use crate::dist::{ProcessGroup, ReduceOp, Work};
use crate::error::ensure;
use crate::optim::Param;
use crate::{Error, Result};

/// Data-parallel options.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataParallelConfig {
    /// Target bucket size in bytes (PyTorch's default: 25 MiB).
    pub bucket_bytes: usize,
    /// Broadcast rank 0's parameters to every rank at construction.
    pub broadcast_parameters: bool,
    /// Divide the gradients by the group's size in the reduction (PyTorch DDP's average);
    /// `false` when each rank's loss was divided by it before backward (as
    /// [`crate::parallel::Parallelized`] does), so that the reduction sums.
    pub average: bool,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        DataParallelConfig { bucket_bytes: 25 << 20, broadcast_parameters: true, average: true }
    }
}

/// Under ZeRO-2, how many buckets another rank owns may be in flight at once: each holds a
/// send buffer of the bucket's size, so this bounds the memory that sharding cannot save.
pub const MAX_SENDING: usize = 2;

struct Bucket {
    /// Indices into `State::params`, in the order their gradients are laid out.
    members: Vec<usize>,
    ready: usize,
    in_flight: Option<(Work, Tensor)>,
}

/// Bytes held in gradients (and in buffers on their way to another rank) during backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GradientBytes {
    /// Held now.
    pub now: usize,
    /// The most held at once since the step began.
    pub peak: usize,
}

impl GradientBytes {
    fn add(&mut self, bytes: usize) {
        self.now += bytes;
        self.peak = self.peak.max(self.now);
    }

    fn sub(&mut self, bytes: usize) {
        self.now = self.now.saturating_sub(bytes);
    }
}

struct State {
    group: ProcessGroup,
    /// ZeRO-2: the rank that owns each parameter's gradient (buckets are reduced to it and
    /// the others drop theirs). None: every rank keeps every gradient (all-reduce).
    owners: Option<Vec<usize>>,
    params: Vec<Tensor>,
    /// Their names, for errors.
    names: Vec<String>,
    /// Which bucket each parameter belongs to.
    bucket_of: Vec<usize>,
    /// Whether each parameter's gradient has arrived this step.
    arrived: Vec<bool>,
    buckets: Vec<Bucket>,
    /// The next bucket to launch; buckets launch in index order.
    next: usize,
    sync: bool,
    /// The first error raised inside a hook, reported by `finish_gradients`.
    error: Option<String>,
    /// Whether the gradient bytes held before this step's first hook were counted, and which
    /// parameters had a gradient then (their arrival adds no bytes).
    counted: bool,
    had_grad: Vec<bool>,
    /// Buckets this rank is sending to another owner, oldest first (ZeRO-2).
    sending: VecDeque<usize>,
    bytes: GradientBytes,
    /// See [`DataParallelConfig::average`].
    average: bool,
}

/// Averages gradients over a data-parallel group. See the module documentation.
pub struct DataParallel {
    state: Arc<Mutex<State>>,
}

impl DataParallel {
    /// Wraps `params` (the same list, in the same order, on every rank) for data parallelism
    /// over `group`. All parameters of a bucket share a dtype and device.
    pub fn new(params: &[Param], group: &ProcessGroup, cfg: DataParallelConfig) -> Result<DataParallel> {
        Self::build(params, group, cfg, None)
    }

    /// Like [`DataParallel::new`], but each parameter's averaged gradient goes only to its
    /// owner rank (`owners[i]` for `params[i]`, see [`super::zero::partition`]); the other
    /// ranks end the step with no gradient for it (ZeRO stage 2).
    pub fn new_sharded(
        params: &[Param],
        group: &ProcessGroup,
        cfg: DataParallelConfig,
        owners: Vec<usize>,
    ) -> Result<DataParallel> {
        ensure!(owners.len() == params.len(), "data parallel: {} owners for {} parameters", owners.len(), params.len());
        ensure!(owners.iter().all(|&o| o < group.size()), "data parallel: an owner is not in the group");
        Self::build(params, group, cfg, Some(owners))
    }

    fn build(
        params: &[Param],
        group: &ProcessGroup,
        cfg: DataParallelConfig,
        owners: Option<Vec<usize>>,
    ) -> Result<DataParallel> {
        ensure!(cfg.bucket_bytes > 0, "data parallel: bucket size must be positive");
        let tensors: Vec<Tensor> = params.iter().map(|p| p.tensor.shallow_clone()).collect();
        for (p, t) in params.iter().zip(&tensors) {
            ensure!(t.requires_grad(), "data parallel: parameter {} does not require grad", p.name);
        }
        if cfg.broadcast_parameters {
            tch::no_grad(|| tensors.iter().try_for_each(|t| group.broadcast(t, 0)))?;
        }
        let (buckets, bucket_of) = plan_buckets(&tensors, cfg.bucket_bytes, owners.as_deref());
        let state = Arc::new(Mutex::new(State {
            group: group.clone(),
            owners,
            arrived: vec![false; tensors.len()],
            params: tensors.iter().map(|t| t.shallow_clone()).collect(),
            names: params.iter().map(|p| p.name.clone()).collect(),
            bucket_of,
            buckets,
            next: 0,
            sync: true,
            error: None,
            counted: false,
            had_grad: vec![false; tensors.len()],
            sending: VecDeque::new(),
            bytes: GradientBytes::default(),
            average: cfg.average,
        }));
        for (i, t) in tensors.iter().enumerate() {
            let weak: Weak<Mutex<State>> = Arc::downgrade(&state);
            register_post_accumulate_grad_hook(t, move |_| {
                // The hook outlives the wrapper; once it is dropped the hook does nothing.
                let Some(state) = weak.upgrade() else { return Ok(()) };
                let mut s = state.lock().map_err(|_| Error::invalid("data parallel state poisoned"))?;
                if let Err(e) = s.mark_ready(i) {
                    s.error.get_or_insert(e.to_string());
                }
                Ok(())
            })?;
        }
        Ok(DataParallel { state })
    }

    /// With `false`, backward passes accumulate gradients locally without communicating
    /// (gradient accumulation's non-final micro-steps); set `true` before the last one.
    pub fn set_sync(&self, sync: bool) -> Result<()> {
        self.lock()?.sync = sync;
        Ok(())
    }

    /// After backward: launches the buckets not yet launched, waits for every all-reduce and
    /// writes the averaged gradients into the parameters' `.grad`.
    pub fn finish_gradients(&self) -> Result<()> {
        let mut s = self.lock()?;
        if let Some(e) = s.error.take() {
            s.reset();
            return Err(Error::invalid(format!("data parallel gradient hook failed: {e}")));
        }
        if !s.sync {
            return Ok(());
        }
        while s.next < s.buckets.len() {
            s.launch_next()?;
        }
        for b in 0..s.buckets.len() {
            // A bucket sent to its owner may have been waited for (and dropped) already.
            let Some((work, flat)) = s.buckets[b].in_flight.take() else { continue };
            work.wait()?;
            if s.bucket_owner(b).is_some_and(|o| o != s.group.rank()) {
                s.bytes.sub(byte_size(&flat));
                continue;
            }
            let members: Vec<Tensor> = s.buckets[b].members.iter().map(|&i| s.params[i].shallow_clone()).collect();
            let fresh = write_back(&members, &flat)?;
            s.bytes.sub(byte_size(&flat));
            s.bytes.add(fresh);
        }
        s.reset();
        Ok(())
    }

    /// The gradient bytes this rank held during the last synchronised backward (its peak) and
    /// holds now: every parameter's `.grad` plus the buffers being reduced. Counted, not
    /// measured by an allocator, so the same on CPU and GPU.
    pub fn gradient_bytes(&self) -> Result<GradientBytes> {
        Ok(self.lock()?.bytes)
    }

    /// The number of gradient buckets (for tests and diagnostics).
    pub fn bucket_count(&self) -> Result<usize> {
        Ok(self.lock()?.buckets.len())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.state.lock().map_err(|_| Error::invalid("data parallel state poisoned"))
    }
}

impl State {
    fn mark_ready(&mut self, i: usize) -> Result<()> {
        if !self.sync {
            return Ok(());
        }
        if self.arrived[i] {
            // A parameter accumulated by several backward passes (used in two segments
            // recomputed by reentrant checkpointing): more of its gradient is fine while its
            // bucket waits, but once the bucket is reduced, the rest would be overwritten by the
            // reduced gradient when backward ends, and lost.
            ensure!(
                self.bucket_of[i] >= self.next,
                "data parallel: {} received more gradient after its bucket was reduced: a parameter \
                 must reach its gradient once per backward (not once per checkpointed segment using \
                 it)",
                self.names[i]
            );
            return Ok(());
        }
        if !self.counted {
            // Gradients already there (accumulated micro-batches, zeroed ones kept between
            // steps) count from the start; the one that just arrived is among them.
            self.counted = true;
            self.had_grad = self.params.iter().map(|p| p.grad().defined()).collect();
            let held = self.params.iter().map(|p| byte_size(&p.grad())).sum();
            self.bytes = GradientBytes::default();
            self.bytes.add(held);
        } else if !self.had_grad[i] {
            self.bytes.add(byte_size(&self.params[i].grad()));
        }
        self.arrived[i] = true;
        let b = self.bucket_of[i];
        self.buckets[b].ready += 1;
        // Launch in order: a complete bucket waits for the ones before it.
        while self.next < self.buckets.len() && self.buckets[self.next].ready == self.buckets[self.next].members.len() {
            self.launch_next()?;
        }
        Ok(())
    }

    /// Flattens the next bucket's gradients (zeros for a parameter without one), followed by
    /// one 0/1 flag per parameter saying whether it had a gradient, and starts the all-reduce.
    fn launch_next(&mut self) -> Result<()> {
        let b = self.next;
        let members: Vec<Tensor> = self.buckets[b].members.iter().map(|&i| self.params[i].shallow_clone()).collect();
        let flat = flatten_with_flags(&members, if self.average { self.group.size() as f64 } else { 1.0 })?;
        let work = match self.bucket_owner(b) {
            Some(owner) => self.group.reduce_async(&flat, owner, ReduceOp::Sum)?,
            None => self.group.all_reduce_async(&flat, ReduceOp::Sum)?,
        };
        // The gradients live in `flat` now (the reduction's result lands there on the ranks
        // that get one): drop the copies, so no rank holds a bucket twice.
        self.bytes.add(byte_size(&flat));
        for &i in &self.buckets[b].members.clone() {
            self.bytes.sub(byte_size(&self.params[i].grad()));
            set_grad(&self.params[i], None)?;
        }
        self.buckets[b].in_flight = Some((work, flat));
        if self.bucket_owner(b).is_some_and(|o| o != self.group.rank()) {
            self.sending.push_back(b);
        }
        self.next += 1;
        self.settle_sent()
    }

    /// Waits for the oldest buckets sent to other owners while more than [`MAX_SENDING`] are
    /// in flight, and drops any that already finished: their send buffers are freed early.
    fn settle_sent(&mut self) -> Result<()> {
        // Oldest first: wait while too many are in flight.
        while self.sending.len() > MAX_SENDING {
            let b = self.sending.pop_front().expect("more than MAX_SENDING");
            self.drop_sent(b)?;
        }
        // Then drop those that already finished.
        let mut unfinished = VecDeque::with_capacity(self.sending.len());
        while let Some(b) = self.sending.pop_front() {
            match &self.buckets[b].in_flight {
                Some((work, _)) if !work.is_completed()? => unfinished.push_back(b),
                _ => self.drop_sent(b)?,
            }
        }
        self.sending = unfinished;
        Ok(())
    }

    /// Waits for bucket `b`'s send to its owner and frees its buffer.
    fn drop_sent(&mut self, b: usize) -> Result<()> {
        if let Some((work, flat)) = self.buckets[b].in_flight.take() {
            work.wait()?;
            self.bytes.sub(byte_size(&flat));
        }
        Ok(())
    }

    fn bucket_owner(&self, b: usize) -> Option<usize> {
        self.owners.as_ref().map(|o| o[self.buckets[b].members[0]])
    }

    fn reset(&mut self) {
        self.arrived.iter_mut().for_each(|a| *a = false);
        for b in &mut self.buckets {
            b.ready = 0;
            b.in_flight = None;
        }
        self.next = 0;
        self.counted = false;
        self.sending.clear();
    }
}

/// Averages the gradients of `params` over `group` after backward, with one all-reduce and
/// [`DataParallel`]'s rule for missing gradients (zeros in the sum; a parameter without a
/// gradient on every rank keeps none). For small parameter sets trained without hooks; the
/// same collective on every rank whatever each rank's backward touched.
pub fn average_gradients(params: &[Param], group: &ProcessGroup) -> Result<()> {
    let tensors: Vec<Tensor> = params.iter().map(|p| p.tensor.shallow_clone()).collect();
    reduce_gradients(&tensors, group, group.size() as f64)
}

/// Divides the gradients of `params` by `divide_by` and sums them over `group`, with one
/// all-reduce (see [`average_gradients`]); the sum alone with 1.
pub(crate) fn reduce_gradients(params: &[Tensor], group: &ProcessGroup, divide_by: f64) -> Result<()> {
    if group.size() == 1 || params.is_empty() {
        return Ok(());
    }
    let first = (params[0].kind(), params[0].device());
    ensure!(
        params.iter().all(|t| (t.kind(), t.device()) == first),
        "reducing gradients: parameters of several dtypes or devices"
    );
    let flat = flatten_with_flags(params, divide_by)?;
    group.all_reduce(&flat, ReduceOp::Sum)?;
    write_back(params, &flat).map(drop)
}

/// The gradients of `params` divided by `divide_by` (zeros where one has none) in one flat
/// buffer, followed by one 0/1 flag per parameter saying whether it had a gradient: what a
/// bucket reduces. Dividing before the sum, as PyTorch DDP's default hook does, keeps a sum
/// of loss-scaled fp16 gradients from overflowing where their average would not.
fn flatten_with_flags(params: &[Tensor], divide_by: f64) -> Result<Tensor> {
    let mut pieces = Vec::with_capacity(params.len() + 1);
    let mut used = Vec::with_capacity(params.len());
    for p in params {
        let g = p.grad();
        used.push(g.defined() as u8 as f64);
        pieces.push(match g.defined() {
            // Dividing by 1 would copy every gradient for nothing (the summing callers).
            true if divide_by == 1.0 => g.f_flatten(0, -1)?,
            true => g.f_flatten(0, -1)?.f_div_scalar(divide_by)?,
            false => Tensor::f_zeros([p.numel() as i64], (p.kind(), p.device()))?,
        });
    }
    pieces.push(Tensor::f_from_slice(&used)?.f_to_kind(params[0].kind())?.f_to_device(params[0].device())?);
    Ok(tch::no_grad(|| Tensor::f_cat(&pieces, 0))?)
}

/// Sets each parameter's gradient to its part of the reduced `flat`, where any rank had one
/// (the flags after the gradients say); returns the bytes of gradients set.
fn write_back(params: &[Tensor], flat: &Tensor) -> Result<usize> {
    let total: i64 = params.iter().map(|p| p.numel() as i64).sum();
    let used = flat.f_narrow(0, total, params.len() as i64)?.f_to_kind(Kind::Double)?.f_to_device(tch::Device::Cpu)?;
    let used = Vec::<f64>::try_from(used)?;
    let (mut offset, mut fresh) = (0, 0);
    for (p, used) in params.iter().zip(used) {
        let numel = p.numel() as i64;
        let reduced = flat.f_narrow(0, offset, numel)?.f_view(p.size().as_slice())?;
        offset += numel;
        if used > 0.0 {
            set_grad(p, Some(&reduced))?;
            fresh += byte_size(&reduced);
        }
    }
    Ok(fresh)
}

/// The bytes of `t`'s elements (0 for an undefined tensor).
fn byte_size(t: &Tensor) -> usize {
    if t.defined() {
        t.numel() * t.kind().elt_size_in_bytes()
    } else {
        0
    }
}

/// Buckets in reverse parameter order, each at most `bucket_bytes` (a larger parameter gets a
/// bucket of its own) and holding one dtype, device and (with owners) owner.
fn plan_buckets(params: &[Tensor], bucket_bytes: usize, owners: Option<&[usize]>) -> (Vec<Bucket>, Vec<usize>) {
    let mut buckets: Vec<Bucket> = Vec::new();
    let mut bucket_of = vec![0; params.len()];
    let mut bytes = 0usize;
    let mut key: Option<(Kind, tch::Device, usize)> = None;
    for i in (0..params.len()).rev() {
        let p = &params[i];
        let size = p.numel() * p.kind().elt_size_in_bytes();
        let this = (p.kind(), p.device(), owners.map_or(0, |o| o[i]));
        let fits = key == Some(this) && bytes + size <= bucket_bytes;
        if !fits || buckets.is_empty() {
            buckets.push(Bucket { members: vec![], ready: 0, in_flight: None });
            bytes = 0;
            key = Some(this);
        }
        let b = buckets.len() - 1;
        buckets[b].members.push(i);
        bucket_of[i] = b;
        bytes += size;
    }
    (buckets, bucket_of)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    #[test]
    fn buckets_follow_reverse_order_and_size() {
        let t = |n: i64, k: Kind| Tensor::zeros([n], (k, Device::Cpu));
        // 4-byte floats: 10, 10, 30 and 5 elements; 100-byte buckets.
        let params = [t(10, Kind::Float), t(10, Kind::Float), t(30, Kind::Float), t(5, Kind::Double)];
        let (buckets, of) = plan_buckets(&params, 100, None);
        let members: Vec<_> = buckets.iter().map(|b| b.members.clone()).collect();
        // Reverse order; the double starts its own bucket; 30 floats (120 B) exceed a bucket alone.
        assert_eq!(members, vec![vec![3], vec![2], vec![1, 0]]);
        assert_eq!(of, vec![2, 2, 1, 0]);
        // Owners split buckets too.
        let floats = [t(1, Kind::Float), t(1, Kind::Float), t(1, Kind::Float)];
        let (buckets, _) = plan_buckets(&floats, 100, Some(&[0, 0, 1]));
        assert_eq!(buckets.iter().map(|b| b.members.clone()).collect::<Vec<_>>(), vec![vec![2], vec![1, 0]]);
    }
}
