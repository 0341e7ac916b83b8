//! Process groups: the ranks that run a collective together, over c10d's Gloo (CPU tensors) and
//! NCCL (CUDA tensors) backends. Every operation has an async form returning a [`Work`]; the
//! plain form waits on it.
//!
//! Every group counts the bytes its collectives hand to c10d ([`ProcessGroup::bytes_communicated`]),
//! so a benchmark or test can check a layer's traffic against its formula whatever code path
//! launched the collective. The convention is the full-size buffer of each operation, per rank:
//! an all-reduce, broadcast or reduce counts its tensor; an all-gather its gathered output
//! (group size times the input); a reduce-scatter and an all-to-all their input; a send its
//! tensor (a receive nothing: the sender counted it); a barrier nothing. A group of one rank
//! sends nothing and counts nothing.
use std::ffi::c_char;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tch::Tensor;

use crate::dist::store::{timeout_ms, Store};
use crate::dist::work::{Hop, Work};
use crate::error::ensure;
use crate::ffi::{self, check, EngGroup, EngWork, RawTensor};
use crate::{Error, Result};

/// How an all-reduce or reduce-scatter combines the ranks' values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Elementwise sum.
    Sum,
    /// Elementwise mean over the group (a sum divided by the group size).
    Avg,
    /// Elementwise maximum.
    Max,
    /// Elementwise minimum.
    Min,
    /// Elementwise product.
    Product,
}

impl ReduceOp {
    /// The c10d op code (`csrc/dist.cpp`); averages are sums followed by a division.
    fn code(self) -> i32 {
        match self {
            ReduceOp::Sum | ReduceOp::Avg => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
            ReduceOp::Product => 3,
        }
    }
}

struct Inner {
    raw: *mut EngGroup,
    store: Store,
    rank: usize,
    ranks: Vec<usize>,
    name: String,
    timeout: Duration,
    loopback: bool,
    subgroups: AtomicU64,
    /// Bytes counted by this group, then those of the groups it was made from: a collective
    /// on a sub-group also counts in its parents, so the world's counter sees every one.
    bytes: Vec<Arc<AtomicU64>>,
}

// SAFETY: c10d backends accept operations from any thread; the handle is freed once, on drop.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        unsafe { ffi::eng_group_free(self.raw) }
    }
}

/// A group of ranks. Cloning is cheap and shares the group.
#[derive(Clone)]
pub struct ProcessGroup(Arc<Inner>);

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ProcessGroup({}, rank {} of {})", self.0.name, self.rank(), self.size())
    }
}

impl ProcessGroup {
    /// Joins a group of `size` ranks that rendezvous through `store`. `global_ranks[i]` is the
    /// job-wide rank of group rank `i` (for messages and for building sub-groups); `loopback`
    /// binds Gloo to 127.0.0.1, for jobs on one machine.
    pub fn new(
        store: Store,
        rank: usize,
        global_ranks: Vec<usize>,
        name: &str,
        timeout: Duration,
        loopback: bool,
    ) -> Result<ProcessGroup> {
        Self::with_parents(store, rank, global_ranks, name, timeout, loopback, &[])
    }

    fn with_parents(
        store: Store,
        rank: usize,
        global_ranks: Vec<usize>,
        name: &str,
        timeout: Duration,
        loopback: bool,
        parents: &[Arc<AtomicU64>],
    ) -> Result<ProcessGroup> {
        let size = global_ranks.len();
        ensure!(rank < size, "rank {rank} is not in group {name} of size {size}");
        let mut raw = std::ptr::null_mut();
        let what = format!("creating process group {name} (rank {rank} of {size})");
        // Gloo connects the group's pairs here, and its handshake can outlast its timeout.
        let created =
            super::deadline::or_exit(timeout.saturating_add(super::deadline::GRACE), what.clone(), || unsafe {
                ffi::eng_group_new(
                    store.raw(),
                    rank as i32,
                    size as i32,
                    timeout_ms(timeout),
                    loopback as i32,
                    &mut raw,
                )
            });
        // A peer that never connects (stopped, or gone before its address was published) is
        // named by its silent heartbeat, as a failed collective's is.
        check(created, || match size > 1 {
            true => match crate::dist::heartbeat::lost_peers(&global_ranks, global_ranks[rank]) {
                Some(lost) => format!("{what}; {lost}"),
                None => what,
            },
            false => what,
        })?;
        let group = ProcessGroup(Arc::new(Inner {
            raw,
            store,
            rank,
            ranks: global_ranks,
            name: name.to_string(),
            timeout,
            loopback,
            subgroups: AtomicU64::new(0),
            bytes: std::iter::once(Arc::new(AtomicU64::new(0))).chain(parents.iter().cloned()).collect(),
        }));
        group.wait_until_every_member_connected()?;
        Ok(group)
    }

    /// Returns once every member has finished Gloo's connection handshake, as
    /// `torch.distributed.new_group` does with its store-based barrier. Without it a member
    /// that is done connecting may leave at once (every rank reaching the same configuration
    /// error right after building its groups, say) and close its sockets while a slower member
    /// is still in the handshake with it, which then fails with "Connection closed by peer".
    fn wait_until_every_member_connected(&self) -> Result<()> {
        if self.size() == 1 {
            return Ok(());
        }
        let (counter, done) = ("eng-members-connected", "eng-every-member-connected");
        let wrap = |e: Error| Error::Torch {
            context: format!("process group {}: waiting for every member to finish connecting", self.name()),
            message: e.to_string(),
        };
        if self.0.store.add(counter, 1).map_err(wrap)? == self.size() as i64 {
            self.0.store.set(done, b"1").map_err(wrap)?;
        }
        self.0.store.get(done).map(drop).map_err(wrap)
    }

    /// Bytes this rank has handed to c10d in this group's collectives and in those of every
    /// sub-group made from it, since creation or the last [`ProcessGroup::reset_bytes_communicated`]
    /// (conventions in the module docs).
    pub fn bytes_communicated(&self) -> u64 {
        self.0.bytes[0].load(Ordering::Relaxed)
    }

    /// Sets this group's byte counter to zero (its parents' counters are left as they are).
    pub fn reset_bytes_communicated(&self) {
        self.0.bytes[0].store(0, Ordering::Relaxed);
    }

    /// This process's rank in the group.
    pub fn rank(&self) -> usize {
        self.0.rank
    }

    /// The number of ranks in the group.
    pub fn size(&self) -> usize {
        self.0.ranks.len()
    }

    /// Job-wide ranks of the members, in group-rank order.
    pub fn global_ranks(&self) -> &[usize] {
        &self.0.ranks
    }

    /// The group's name, as used in messages.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The timeout every collective of this group runs under.
    pub fn timeout(&self) -> Duration {
        self.0.timeout
    }

    /// Creates a sub-group of the given members (ranks of this group). Every rank of this group
    /// must call `subgroup` with the same arguments in the same order, as with
    /// `torch.distributed.new_group`; members get `Some(group)`, the others `None`.
    pub fn subgroup(&self, members: &[usize], name: &str) -> Result<Option<ProcessGroup>> {
        ensure!(!members.is_empty(), "sub-group {name} has no members");
        let mut seen = vec![false; self.size()];
        for &m in members {
            ensure!(
                m < self.size(),
                "sub-group {name}: rank {m} is not in group {} of size {}",
                self.name(),
                self.size()
            );
            ensure!(!seen[m], "sub-group {name}: rank {m} is listed twice");
            seen[m] = true;
        }
        let index = self.0.subgroups.fetch_add(1, Ordering::SeqCst);
        let Some(rank) = members.iter().position(|&m| m == self.rank()) else {
            return Ok(None);
        };
        let store = self.0.store.prefixed(&format!("sub{index}"))?;
        let global = members.iter().map(|&m| self.0.ranks[m]).collect();
        let full_name = format!("{}/{name}", self.name());
        ProcessGroup::with_parents(store, rank, global, &full_name, self.0.timeout, self.0.loopback, &self.0.bytes)
            .map(Some)
    }

    /// Launches a collective on `tensor`'s backend, counting `bytes` (the module docs'
    /// convention) once c10d has accepted it. CPU (Gloo) work is waited for under the group's
    /// timeout; CUDA (NCCL) work is waited for the c10d way, by making the current stream wait,
    /// and NCCL's watchdog enforces the same timeout.
    fn start(
        &self,
        op: &str,
        tensor: Option<&Tensor>,
        bytes: u64,
        call: impl FnOnce(*mut EngGroup, *mut *mut EngWork) -> *mut c_char,
    ) -> Result<Work> {
        let what = format!("{op} on rank {} of group {} (size {})", self.rank(), self.name(), self.size());
        let mut raw = std::ptr::null_mut();
        check(call(self.0.raw, &mut raw), || what.clone())?;
        if self.size() > 1 {
            for counter in &self.0.bytes {
                counter.fetch_add(bytes, Ordering::Relaxed);
            }
        }
        let on_gpu = tensor.is_some_and(|t| t.device().is_cuda());
        Ok(Work::new(raw, what, (!on_gpu).then_some(self.0.timeout)).among(self))
    }

    /// All-reduces `tensor` in place.
    pub fn all_reduce(&self, tensor: &Tensor, op: ReduceOp) -> Result<()> {
        self.all_reduce_async(tensor, op)?.wait()
    }

    /// Starts an in-place all-reduce of `tensor`.
    pub fn all_reduce_async(&self, tensor: &Tensor, op: ReduceOp) -> Result<Work> {
        let (buffer, write_back) = contiguous_buffer(tensor)?;
        let mut work = self.start("all_reduce", Some(&buffer), nbytes(&buffer), |g, w| unsafe {
            ffi::eng_allreduce(g, buffer.raw(), op.code(), w)
        })?;
        if op == ReduceOp::Avg {
            let (t, n) = (buffer.shallow_clone(), self.size() as f64);
            work = work.then(move || divide(&t, n));
        }
        Ok(match write_back {
            Some(dst) => work.then(move || copy_into(&dst, &buffer)),
            None => work,
        })
    }

    /// Reduces `tensor` into group rank `root`'s copy, in place; other ranks' tensors are
    /// left unspecified.
    pub fn reduce(&self, tensor: &Tensor, root: usize, op: ReduceOp) -> Result<()> {
        self.reduce_async(tensor, root, op)?.wait()
    }

    /// Starts an in-place reduce into group rank `root`.
    pub fn reduce_async(&self, tensor: &Tensor, root: usize, op: ReduceOp) -> Result<Work> {
        ensure!(root < self.size(), "reduce root {root} is not in group {} of size {}", self.name(), self.size());
        let (buffer, write_back) = contiguous_buffer(tensor)?;
        let mut work = self.start("reduce", Some(&buffer), nbytes(&buffer), |g, w| unsafe {
            ffi::eng_reduce(g, buffer.raw(), root as i32, op.code(), w)
        })?;
        if op == ReduceOp::Avg && self.rank() == root {
            let (t, n) = (buffer.shallow_clone(), self.size() as f64);
            work = work.then(move || divide(&t, n));
        }
        Ok(match write_back {
            Some(dst) => work.then(move || copy_into(&dst, &buffer)),
            None => work,
        })
    }

    /// Broadcasts `tensor` from group rank `root` to every rank, in place.
    pub fn broadcast(&self, tensor: &Tensor, root: usize) -> Result<()> {
        self.broadcast_async(tensor, root)?.wait()
    }

    /// Starts an in-place broadcast from group rank `root`.
    pub fn broadcast_async(&self, tensor: &Tensor, root: usize) -> Result<Work> {
        ensure!(root < self.size(), "broadcast root {root} is not in group {} of size {}", self.name(), self.size());
        let (buffer, write_back) = contiguous_buffer(tensor)?;
        let work = self.start("broadcast", Some(&buffer), nbytes(&buffer), |g, w| unsafe {
            ffi::eng_broadcast(g, buffer.raw(), root as i32, w)
        })?;
        Ok(match write_back {
            Some(dst) => work.then(move || copy_into(&dst, &buffer)),
            None => work,
        })
    }

    /// Gathers every rank's `input` (same shape everywhere) concatenated along dim 0.
    pub fn all_gather(&self, input: &Tensor) -> Result<Tensor> {
        let (out, work) = self.all_gather_async(input)?;
        work.wait()?;
        Ok(out)
    }

    /// Starts [`ProcessGroup::all_gather`]; the returned tensor is valid after `wait`.
    pub fn all_gather_async(&self, input: &Tensor) -> Result<(Tensor, Work)> {
        let mut shape = leading_dim(input, "all_gather")?.size();
        shape[0] *= self.size() as i64;
        let out = Tensor::f_empty(&shape, (input.kind(), input.device()))?;
        let work = self.all_gather_into_async(&out, input)?;
        Ok((out, work))
    }

    /// Starts an all-gather into a preallocated contiguous `output` (group size times
    /// `input`'s dim 0), sparing the allocation in loops that repeat it.
    pub fn all_gather_into_async(&self, output: &Tensor, input: &Tensor) -> Result<Work> {
        let input = leading_dim(input, "all_gather")?;
        let mut shape = input.size();
        shape[0] *= self.size() as i64;
        check_output("all_gather", output, &shape, &input)?;
        if !output.device().is_cuda() && self.size() > 1 {
            // Gloo gathers into a staging buffer of the output's size and copies it out, which
            // doubles the largest tensor of a gather (DAP's whole pair at a stack's end). Each
            // rank's block broadcast into its place holds nothing more, as NCCL's gather does.
            let block = input.size()[0];
            output.f_narrow(0, self.rank() as i64 * block, block)?.f_copy_(&input)?;
            let mut works = (0..self.size())
                .map(|root| self.broadcast_async(&output.f_narrow(0, root as i64 * block, block)?, root))
                .collect::<Result<Vec<_>>>()?;
            let last = works.pop().expect("a group of two or more");
            return Ok(last.then(move || works.into_iter().try_for_each(Work::wait)));
        }
        self.start("all_gather", Some(&input), nbytes(output), |g, w| unsafe {
            ffi::eng_allgather_into(g, output.raw(), input.raw(), w)
        })
    }

    /// Gathers every rank's `input` as a list indexed by group rank.
    pub fn all_gather_list(&self, input: &Tensor) -> Result<Vec<Tensor>> {
        let (outs, work) = self.all_gather_list_async(input)?;
        work.wait()?;
        Ok(outs)
    }

    /// Starts [`ProcessGroup::all_gather_list`]; the returned tensors are valid after `wait`.
    pub fn all_gather_list_async(&self, input: &Tensor) -> Result<(Vec<Tensor>, Work)> {
        let input = input.f_contiguous()?;
        let outs = (0..self.size()).map(|_| input.f_empty_like()).collect::<std::result::Result<Vec<_>, _>>()?;
        let mut ptrs: Vec<_> = outs.iter().map(|t| t.raw()).collect();
        let work = self.start("all_gather", Some(&input), nbytes(&input) * ptrs.len() as u64, |g, w| unsafe {
            ffi::eng_allgather_list(g, ptrs.as_mut_ptr(), ptrs.len() as i32, input.raw(), w)
        })?;
        Ok((outs, work))
    }

    /// Reduces `input` across ranks and gives rank `r` block `r` of dim 0 (dim 0 must divide by
    /// the group size).
    pub fn reduce_scatter(&self, input: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let (out, work) = self.reduce_scatter_async(input, op)?;
        work.wait()?;
        Ok(out)
    }

    /// Starts [`ProcessGroup::reduce_scatter`]; the returned tensor is valid after `wait`.
    pub fn reduce_scatter_async(&self, input: &Tensor, op: ReduceOp) -> Result<(Tensor, Work)> {
        let input = leading_dim(input, "reduce_scatter")?;
        let mut shape = input.size();
        let n = self.size() as i64;
        ensure!(shape[0] % n == 0, "reduce_scatter: dim 0 of size {} does not divide by the group size {n}", shape[0]);
        shape[0] /= n;
        let out = Tensor::f_empty(&shape, (input.kind(), input.device()))?;
        let mut work = self.start("reduce_scatter", Some(&input), nbytes(&input), |g, w| unsafe {
            ffi::eng_reduce_scatter_into(g, out.raw(), input.raw(), op.code(), w)
        })?;
        if op == ReduceOp::Avg {
            let t = out.shallow_clone();
            work = work.then(move || divide(&t, n as f64));
        }
        Ok((out, work))
    }

    /// All-to-all with equal splits: dim 0 of `input` is cut into group-size blocks, block `j`
    /// goes to rank `j`, and the result stacks the blocks received from ranks `0..n` in order.
    pub fn all_to_all(&self, input: &Tensor) -> Result<Tensor> {
        let (out, work) = self.all_to_all_async(input)?;
        work.wait()?;
        Ok(out)
    }

    /// Starts [`ProcessGroup::all_to_all`]; the returned tensor is valid after `wait`.
    pub fn all_to_all_async(&self, input: &Tensor) -> Result<(Tensor, Work)> {
        let rows = leading_dim(input, "all_to_all")?.size()[0];
        let n = self.size() as i64;
        ensure!(rows % n == 0, "all_to_all: dim 0 of size {rows} does not divide by the group size {n}");
        let splits = vec![rows / n; self.size()];
        self.all_to_all_uneven_async(input, &splits, &splits)
    }

    /// All-to-all with uneven splits: `input_splits[j]` rows of `input` (along dim 0) go to rank
    /// `j`, and `output_splits[j]` rows come from rank `j`.
    pub fn all_to_all_uneven(&self, input: &Tensor, input_splits: &[i64], output_splits: &[i64]) -> Result<Tensor> {
        let (out, work) = self.all_to_all_uneven_async(input, input_splits, output_splits)?;
        work.wait()?;
        Ok(out)
    }

    /// Starts [`ProcessGroup::all_to_all_uneven`]; the returned tensor is valid after `wait`.
    pub fn all_to_all_uneven_async(
        &self,
        input: &Tensor,
        input_splits: &[i64],
        output_splits: &[i64],
    ) -> Result<(Tensor, Work)> {
        let mut shape = leading_dim(input, "all_to_all")?.size();
        shape[0] = output_splits.iter().sum();
        let out = Tensor::f_empty(&shape, (input.kind(), input.device()))?;
        let work = self.all_to_all_into_async(&out, input, input_splits, output_splits)?;
        Ok((out, work))
    }

    /// Starts an all-to-all into a preallocated contiguous `output` whose dim 0 is the sum of
    /// `output_splits`, sparing the allocation in loops that repeat it.
    pub fn all_to_all_into_async(
        &self,
        output: &Tensor,
        input: &Tensor,
        input_splits: &[i64],
        output_splits: &[i64],
    ) -> Result<Work> {
        let input = leading_dim(input, "all_to_all")?;
        let n = self.size();
        ensure!(
            input_splits.len() == n && output_splits.len() == n,
            "all_to_all: {} input and {} output splits for a group of size {n}",
            input_splits.len(),
            output_splits.len()
        );
        ensure!(input_splits.iter().chain(output_splits).all(|&s| s >= 0), "all_to_all: negative split size");
        let rows: i64 = input_splits.iter().sum();
        ensure!(rows == input.size()[0], "all_to_all: input splits sum to {rows} but dim 0 has {}", input.size()[0]);
        let mut shape = input.size();
        shape[0] = output_splits.iter().sum();
        check_output("all_to_all", output, &shape, &input)?;
        self.start("all_to_all", Some(&input), nbytes(&input), |g, w| unsafe {
            ffi::eng_alltoall(g, output.raw(), input.raw(), output_splits.as_ptr(), input_splits.as_ptr(), n as i32, w)
        })
    }

    /// Sends `tensor` to group rank `dst`; `tag` matches it with the receiver's `recv`.
    pub fn send(&self, tensor: &Tensor, dst: usize, tag: i32) -> Result<()> {
        self.send_async(tensor, dst, tag)?.wait()
    }

    /// Starts a send.
    pub fn send_async(&self, tensor: &Tensor, dst: usize, tag: i32) -> Result<Work> {
        let buffer = tensor.f_contiguous()?;
        self.start("send", Some(&buffer), nbytes(&buffer), |g, w| unsafe {
            ffi::eng_send(g, buffer.raw(), dst as i32, tag, w)
        })
    }

    /// Receives into `tensor` from group rank `src`.
    pub fn recv(&self, tensor: &Tensor, src: usize, tag: i32) -> Result<()> {
        self.recv_async(tensor, src, tag)?.wait()
    }

    /// Starts a receive into `tensor`.
    pub fn recv_async(&self, tensor: &Tensor, src: usize, tag: i32) -> Result<Work> {
        let (buffer, write_back) = contiguous_buffer(tensor)?;
        let work =
            self.start("recv", Some(&buffer), 0, |g, w| unsafe { ffi::eng_recv(g, buffer.raw(), src as i32, tag, w) })?;
        Ok(match write_back {
            Some(dst) => work.then(move || copy_into(&dst, &buffer)),
            None => work,
        })
    }

    /// Starts passing `tensor` one step around the ring of the group's ranks: to rank
    /// `rank + 1` while rank `rank - 1`'s tensor of the same shape comes in (`tag` matches the
    /// two). Every rank passes at the same step, so a ring of `size` steps brings every rank's
    /// tensor to every rank.
    pub fn ring_pass(&self, tensor: &Tensor, tag: i32) -> Result<Hop> {
        let n = self.size();
        let (next, prev) = ((self.rank() + 1) % n, (self.rank() + n - 1) % n);
        let outbox = tensor.f_contiguous()?;
        let inbox = outbox.f_empty_like()?;
        // Even ranks send first and odd ranks receive first. Gloo does not mind, but NCCL runs
        // the point-to-point operations between two ranks in order on one stream, and with
        // two ranks (next == prev) "both receive first" would wait forever.
        let (sent, received) = if self.rank().is_multiple_of(2) {
            let sent = self.send_async(&outbox, next, tag)?;
            (sent, self.recv_async(&inbox, prev, tag)?)
        } else {
            let received = self.recv_async(&inbox, prev, tag)?;
            (self.send_async(&outbox, next, tag)?, received)
        };
        Ok(Hop { sent, received, inbox, outbox })
    }

    /// Waits until every rank of the group reaches the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.barrier_async()?.wait()
    }

    /// Starts a barrier; `wait` returns once every rank has reached it.
    pub fn barrier_async(&self) -> Result<Work> {
        self.start("barrier", None, 0, |g, w| unsafe { ffi::eng_barrier(g, w) })
    }
}

/// c10d needs contiguous tensors. For an in-place operation on a non-contiguous tensor we work
/// on a contiguous copy and write it back afterwards.
fn contiguous_buffer(t: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
    if t.is_contiguous() {
        Ok((t.shallow_clone(), None))
    } else {
        Ok((t.f_contiguous()?, Some(t.shallow_clone())))
    }
}

/// The bytes of `t`'s elements.
fn nbytes(t: &Tensor) -> u64 {
    t.numel() as u64 * t.kind().elt_size_in_bytes() as u64
}

fn leading_dim(t: &Tensor, op: &str) -> Result<Tensor> {
    ensure!(t.dim() >= 1, "{op} needs a tensor with at least one dimension, got a scalar");
    Ok(t.f_contiguous()?)
}

/// A caller's output buffer must be what the collective writes: c10d checks sizes only.
fn check_output(op: &str, output: &Tensor, shape: &[i64], input: &Tensor) -> Result<()> {
    ensure!(output.size() == shape, "{op}: output has shape {:?}, expected {shape:?}", output.size());
    ensure!(output.kind() == input.kind(), "{op}: output is {:?} but input is {:?}", output.kind(), input.kind());
    ensure!(
        output.device() == input.device(),
        "{op}: output is on {:?} but input on {:?}",
        output.device(),
        input.device()
    );
    ensure!(output.is_contiguous(), "{op}: output must be contiguous");
    Ok(())
}

fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    let mut dst = dst.shallow_clone();
    tch::no_grad(|| dst.f_copy_(src)).map_err(Error::from)
}

fn divide(t: &Tensor, n: f64) -> Result<()> {
    ensure!(t.is_floating_point(), "average of a {:?} tensor: use a floating-point dtype", t.kind());
    let mut t = t.shallow_clone();
    tch::no_grad(|| t.f_div_scalar_(n)).map(|_| ()).map_err(Error::from)
}
