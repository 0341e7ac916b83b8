//! The one runtime every schedule runs on: it walks this rank's action list, computing chunks'
//! forwards and backwards and exchanging activations and gradients with the neighbouring
//! ranks over the pipeline group (Gloo for CPU tensors, NCCL for CUDA ones).
//!
//! Communication: every send is asynchronous and waited for at the end of the step; a receive
//! is posted at its action (on CPU, one compute action earlier, once its buffer exists) and
//! waited for by the compute that needs it, under the group's timeout. Shapes and dtypes cross once: before a chunk's first activation, the sender sends a
//! small header, and the receiver allocates its receive buffers for every micro-batch of that
//! chunk; later steps reuse them (gradient buffers likewise, from the chunk's own output shape),
//! so a step allocates no communication buffers. Every micro-batch of a chunk must therefore
//! have the same activation shape.
//!
//! On NCCL (not yet run on two GPUs) tags do not match messages, each neighbour pair's sends
//! and receives share one stream per rank, and a send larger than NCCL's staging buffer
//! completes only once the peer's receive runs. The lists [`Schedule::new`] builds order every
//! pair's exchanges the same way on both sides, which is safe under those rules, and on a GPU
//! [`Pipeline::new`] checks any list against them ([`super::check_p2p_order`]) rather than let a
//! step hang.
//!
//! Split backward (ZB-H1): each layer runs on a detached copy of its input, so a chunk's graph
//! is one small graph per layer. The input-gradient pass walks the layers backwards computing
//! only the gradients of their inputs, keeping the graphs; the weight pass later runs each
//! layer's graph once more into its parameters' `.grad`, then frees it. The memory cost: a
//! micro-batch's activations stay alive until its weight pass, not its backward, which is why
//! ZB-H1 defers at most `pp - 1` weight passes. The weight pass of a layer that is one matmul
//! is exactly its weight gradient; a deeper layer re-traverses its own internal activation
//! gradients (finer layers split better).
//!
//! Measuring ([`Pipeline::measure`]): each action is timed, the time blocked in waits (every
//! wait goes through one method that counts it) is taken out of the action that waited, and the
//! step's [`StepStats`] can be read after it ([`Pipeline::last_stats`]).
use std::cell::Cell;
use std::collections::HashMap;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::schedule::{Action, Schedule, Step};
use super::stage::Chunk;
use super::stats::StepStats;
use crate::autograd;
use crate::dist::{ProcessGroup, Work};
use crate::error::ensure;
use crate::optim::Param;
use crate::{Error, Result};

/// Room in a shape header: the number of dimensions, a dtype code, and the sizes (so at most
/// eight dimensions).
const HEADER: usize = 10;
/// Header tags live above every data tag.
const HEADER_TAG: i32 = 1 << 29;
/// Inference tags live above the headers.
const INFER_TAG: i32 = 1 << 30;
/// The tags of [`Pipeline::hop_time`]'s probe, above the inference tags.
const PROBE_TAG: i32 = INFER_TAG + (1 << 29);

/// One rank's part of a pipeline and the schedule it runs.
pub struct Pipeline {
    group: ProcessGroup,
    schedule: Schedule,
    chunks: Vec<Chunk>,
    device: Device,
    /// Activation shape and dtype each chunk sent (checked against later micro-batches).
    sent_shapes: HashMap<usize, (Vec<i64>, Kind)>,
    /// Activation shape and dtype each chunk receives (its first message's header).
    received_shapes: HashMap<usize, (Vec<i64>, Kind)>,
    activation_buffers: ReceiveBuffers,
    grad_buffers: ReceiveBuffers,
    held: usize,
    peak: usize,
    /// Whether steps are timed ([`Pipeline::measure`]).
    measuring: bool,
    /// The last timed step's times (boxed: a pipeline stays small where it is unmeasured).
    stats: Option<Box<StepStats>>,
    /// Seconds blocked on peers so far in this step (when measuring).
    waited: Cell<f64>,
}

/// A micro-batch's state on one chunk between its forward and its last backward pass.
struct Held {
    /// The chunk's input as received (a leaf requiring grad) or as given (first stage).
    input: Tensor,
    /// Per layer (and the loss, on the last stage): the leaf it ran on and its output. Without
    /// a split backward there is one entry: the chunk's input and its output (or scaled loss).
    pieces: Vec<(Tensor, Tensor)>,
    /// What the weight pass needs: per layer, its output, that output's gradient and its
    /// parameters.
    weight: Vec<(Tensor, Tensor, Vec<Tensor>)>,
}

/// Receive buffers of one kind (activations or gradients), one per micro-batch in flight on
/// a chunk and reused after: a micro-batch takes one when its receive is posted and gives it
/// back after its last backward pass (its received activation is its input leaf until then,
/// and under a split backward the weight pass reads its received gradient). Kept from step to
/// step, so that from the second step receives are posted ahead into free buffers, and a step
/// holds as many as its schedule has micro-batches in flight, not one per micro-batch.
#[derive(Default)]
struct ReceiveBuffers {
    taken: HashMap<Step, Tensor>,
    free: HashMap<usize, Vec<Tensor>>,
}

impl ReceiveBuffers {
    /// `s`'s buffer: the one it holds, else a free one of its chunk, else one `make` makes.
    fn take(&mut self, s: Step, make: impl FnOnce() -> Result<Tensor>) -> Result<Tensor> {
        if let Some(b) = self.take_existing(s) {
            return Ok(b);
        }
        let b = make()?;
        self.taken.insert(s, b.shallow_clone());
        Ok(b)
    }

    /// `s`'s buffer if it holds one or its chunk has a free one (taken then), else `None`.
    fn take_existing(&mut self, s: Step) -> Option<Tensor> {
        if let Some(b) = self.taken.get(&s) {
            return Some(b.shallow_clone());
        }
        let b = self.free.get_mut(&s.chunk)?.pop()?;
        self.taken.insert(s, b.shallow_clone());
        Some(b)
    }

    /// The buffer `s` holds.
    fn held(&self, s: Step) -> Result<Tensor> {
        self.taken.get(&s).map(Tensor::shallow_clone).ok_or_else(|| Error::invalid("a receive without its buffer"))
    }

    /// `s`'s buffer, if any, back to its chunk's free ones.
    fn release(&mut self, s: Step) {
        if let Some(b) = self.taken.remove(&s) {
            self.free.entry(s.chunk).or_default().push(b);
        }
    }

    /// Every buffer back (the step's end).
    fn release_all(&mut self) {
        let steps: Vec<Step> = self.taken.keys().copied().collect();
        for s in steps {
            self.release(s);
        }
    }

    /// Buffers kept, taken and free.
    fn len(&self) -> usize {
        self.taken.len() + self.free.values().map(Vec::len).sum::<usize>()
    }
}

/// This step's work in progress.
#[derive(Default)]
struct StepState {
    held: HashMap<Step, Held>,
    receives: HashMap<Step, Work>,
    grad_receives: HashMap<Step, Work>,
    input_grads: HashMap<Step, Option<Tensor>>,
    sends: Vec<(Work, Tensor)>,
    loss: Option<Tensor>,
}

impl Pipeline {
    /// A pipeline rank holding `chunks` (from [`super::assign`]; chunk `c` must be virtual
    /// stage `c * pp + rank`) over the pipeline `group`, running `schedule`. Receive buffers
    /// are made on `device`. On a GPU, a schedule whose exchanges would hang or cross on NCCL
    /// is an error.
    pub fn new(group: &ProcessGroup, chunks: Vec<Chunk>, schedule: Schedule, device: Device) -> Result<Pipeline> {
        let (p, v, m) = (schedule.pp, schedule.virtual_stages, schedule.micro_batches);
        ensure!(
            group.size() == p,
            "pipeline: the schedule is for pp={p} ranks but group {} has {}",
            group.name(),
            group.size()
        );
        ensure!(
            chunks.len() == v,
            "pipeline: rank {} holds {} chunks but virtual_stages={v}",
            group.rank(),
            chunks.len()
        );
        for (c, chunk) in chunks.iter().enumerate() {
            let want = schedule.stage_of(group.rank(), c);
            ensure!(
                chunk.stage == want,
                "pipeline: chunk {c} of rank {} is stage {} but should be {want}",
                group.rank(),
                chunk.stage
            );
            ensure!(!chunk.layers.is_empty(), "pipeline: stage {want} has no layers");
        }
        schedule.check_stages()?;
        if device.is_cuda() {
            super::check_p2p_order(&schedule)?;
        }
        ensure!(
            (m * p * v * 2) < HEADER_TAG as usize,
            "pipeline: micro_batches={m} x {} stages is too many for message tags",
            p * v
        );
        Ok(Pipeline {
            group: group.clone(),
            schedule,
            chunks,
            device,
            sent_shapes: HashMap::new(),
            received_shapes: HashMap::new(),
            activation_buffers: ReceiveBuffers::default(),
            grad_buffers: ReceiveBuffers::default(),
            held: 0,
            peak: 0,
            measuring: false,
            stats: None,
            waited: Cell::new(0.0),
        })
    }

    /// The schedule this pipeline runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Every parameter this rank holds, chunk by chunk.
    pub fn params(&self) -> Vec<Param> {
        self.chunks.iter().flat_map(Chunk::params).collect()
    }

    /// The most micro-batch chunks this rank held at once (forward run, last backward pass not
    /// yet) during the last step.
    pub fn peak_in_flight(&self) -> usize {
        self.peak
    }

    /// Times the following steps (`true`) or stops (`false`, the default, in which no clock is
    /// read). On CUDA a measuring rank synchronizes its stream after each action and wait (see
    /// [`StepStats`]).
    pub fn measure(&mut self, on: bool) {
        self.measuring = on;
        if !on {
            self.stats = None;
        }
    }

    /// What the last step spent its time on, if it was measured.
    pub fn last_stats(&self) -> Option<&StepStats> {
        self.stats.as_deref()
    }

    /// Seconds a message shaped like `probe` takes from one pipeline rank to the next: group
    /// ranks 0 and 1 pass it back and forth `rounds` times (after one untimed round) and halve
    /// the mean round trip. Every rank of the group calls it; every rank gets rank 0's figure
    /// (0 on one rank). Not for use inside a step.
    pub fn hop_time(&self, probe: &Tensor, rounds: usize) -> Result<f64> {
        let rank = self.group.rank();
        let mut seconds = 0.0;
        if self.group.size() > 1 && rank < 2 && rounds > 0 {
            let buffer = Tensor::f_zeros(probe.size(), (probe.kind(), self.device))?;
            let mut start = Instant::now();
            for round in 0..=rounds {
                if round == 1 {
                    self.settle()?;
                    start = Instant::now();
                }
                if rank == 0 {
                    self.group.send(&buffer, 1, PROBE_TAG)?;
                    self.group.recv(&buffer, 1, PROBE_TAG + 1)?;
                } else {
                    self.group.recv(&buffer, 0, PROBE_TAG)?;
                    self.group.send(&buffer, 0, PROBE_TAG + 1)?;
                }
            }
            self.settle()?;
            seconds = start.elapsed().as_secs_f64() / (2 * rounds) as f64;
        }
        let shared = Tensor::from_slice(&[seconds]).f_to_device(self.device)?;
        self.group.broadcast(&shared, 0)?;
        Ok(shared.f_to_device(Device::Cpu)?.f_double_value(&[0])?)
    }

    /// The receive buffers (activations and gradients) this rank keeps between steps: about
    /// as many as it had micro-batches in flight, not one per micro-batch.
    pub fn receive_buffers(&self) -> usize {
        self.activation_buffers.len() + self.grad_buffers.len()
    }

    /// Whether this rank runs the last virtual stage (where the loss lives).
    pub fn holds_loss(&self) -> bool {
        self.chunks.iter().any(|c| c.stage == self.schedule.stages() - 1)
    }

    /// Inference (evaluation): `input` (read on the rank holding stage 0; others pass `None`)
    /// through every stage in order without recording gradients. Returns the last stage's
    /// output on the rank holding it, `None` elsewhere. Each activation crosses with its shape
    /// header, so successive calls may differ in batch size (a last, smaller evaluation batch);
    /// every rank of the pipeline group makes the same calls. Not for use inside a step.
    pub fn forward_only(&self, input: Option<&Tensor>) -> Result<Option<Tensor>> {
        let (rank, stages) = (self.group.rank(), self.schedule.stages());
        // Tags above the training step's data and header tags.
        let tag = |stage: usize, header: bool| INFER_TAG + (2 * stage + header as usize) as i32;
        let mut sends = Vec::new();
        let mut output = None;
        tch::no_grad(|| -> Result<()> {
            for stage in (rank..stages).step_by(self.schedule.pp) {
                let mut x = match stage {
                    0 => input
                        .ok_or_else(|| Error::invalid("pipeline: forward_only needs the input on stage 0"))?
                        .shallow_clone(),
                    _ => {
                        let from = self.rank_of(stage - 1);
                        let (shape, kind) = self.recv_header(from, tag(stage - 1, true))?;
                        let x = Tensor::f_empty(&shape, (kind, self.device))?;
                        self.group.recv(&x, from, tag(stage - 1, false))?;
                        x
                    }
                };
                for layer in &self.chunks[stage / self.schedule.pp].layers {
                    x = layer.forward(&x)?;
                }
                if stage + 1 == stages {
                    output = Some(x);
                    break;
                }
                let to = self.rank_of(stage + 1);
                let header = Tensor::from_slice(&header_of(&x, stage)?).f_to_device(self.device)?;
                sends.push((self.group.send_async(&header, to, tag(stage, true))?, header));
                sends.push((self.group.send_async(&x, to, tag(stage, false))?, x));
            }
            Ok(())
        })?;
        for (work, _keep_alive) in sends {
            work.wait()?;
        }
        Ok(output)
    }

    /// One training step over `micro_batches` micro-batches: `inputs[i]` is micro-batch `i`'s
    /// input (read on the rank holding stage 0; other ranks may pass none), and on the last
    /// stage `loss(i, output)` gives micro-batch `i`'s scalar loss. Gradients accumulate into
    /// the parameters' `.grad` as the gradient of the mean of the micro-batch losses (the
    /// micro-batches are the gradient accumulation). Returns that mean on the rank holding the
    /// last stage, `None` elsewhere.
    pub fn step(
        &mut self,
        inputs: &[Tensor],
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<Option<f64>> {
        let m = self.schedule.micro_batches;
        if self.chunks.iter().any(|c| c.stage == 0) {
            ensure!(inputs.len() == m, "pipeline: {} inputs for micro_batches={m}", inputs.len());
        }
        self.held = 0;
        self.peak = 0;
        let start = self.clock();
        self.waited.set(0.0);
        let mut stats = StepStats { steps: 1, ..StepStats::default() };
        let mut state = StepState::default();
        let actions = self.schedule.actions[self.group.rank()].clone();
        for (k, &action) in actions.iter().enumerate() {
            if matches!(action, Action::Forward(_) | Action::Backward(_) | Action::Weight(_)) {
                let t = self.clock();
                self.prefetch(&actions[k + 1..], &mut state)?;
                if let Some(t) = t {
                    stats.posting.seconds += t.elapsed().as_secs_f64();
                }
            }
            let (t, waited) = (self.clock(), self.waited.get());
            self.run(action, &mut state, inputs, loss).map_err(|e| {
                Error::invalid(format!(
                    "pipeline rank {} (stage {}): {action}: {e}",
                    self.group.rank(),
                    self.schedule.stage_of(self.group.rank(), action.step().chunk)
                ))
            })?;
            if let Some(t) = t {
                self.settle()?;
                let busy = t.elapsed().as_secs_f64() - (self.waited.get() - waited);
                match action {
                    Action::Forward(_) => stats.forward.add(busy),
                    Action::Backward(_) => stats.backward.add(busy),
                    Action::Weight(_) => stats.weight.add(busy),
                    Action::SendActivation(_) | Action::SendGrad(_) => stats.posting.add(busy),
                    Action::RecvActivation(_) | Action::RecvGrad(_) => stats.posting.seconds += busy,
                }
            }
        }
        for (work, _keep_alive) in state.sends.drain(..) {
            self.wait(work)?;
        }
        if let Some(start) = start {
            stats.wall = start.elapsed().as_secs_f64();
            stats.waiting = self.waited.get();
            self.stats = Some(Box::new(stats));
        }
        ensure!(
            state.held.is_empty(),
            "pipeline: the schedule left {} micro-batches without backward",
            state.held.len()
        );
        self.activation_buffers.release_all();
        self.grad_buffers.release_all();
        match state.loss {
            Some(sum) => Ok(Some(sum.f_double_value(&[])?)),
            None => Ok(None),
        }
    }

    /// The time now, when measuring.
    fn clock(&self) -> Option<Instant> {
        self.measuring.then(Instant::now)
    }

    /// Waits for `work`, counting the time blocked when measuring.
    fn wait(&self, work: Work) -> Result<()> {
        let Some(t) = self.clock() else { return work.wait() };
        work.wait()?;
        self.settle()?;
        self.waited.set(self.waited.get() + t.elapsed().as_secs_f64());
        Ok(())
    }

    /// On CUDA, blocks until this rank's stream has run what was queued (work waited for included),
    /// so the host's clock covers it; nothing on the CPU.
    fn settle(&self) -> Result<()> {
        match self.device {
            Device::Cuda(d) => crate::cuda::Stream::current(d)?.synchronize(),
            _ => Ok(()),
        }
    }

    fn stage(&self, s: Step) -> usize {
        self.schedule.stage_of(self.group.rank(), s.chunk)
    }

    /// The group rank holding virtual stage `stage`.
    fn rank_of(&self, stage: usize) -> usize {
        stage % self.schedule.pp
    }

    /// The tag of micro-batch `micro`'s message across the boundary after `stage`.
    fn tag(&self, micro: usize, stage: usize, grad: bool) -> i32 {
        ((micro * self.schedule.stages() + stage) * 2 + grad as usize) as i32
    }

    fn run(
        &mut self,
        action: Action,
        state: &mut StepState,
        inputs: &[Tensor],
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<()> {
        match action {
            Action::RecvActivation(s) if state.receives.contains_key(&s) => {}
            Action::RecvActivation(s) => {
                let stage = self.stage(s);
                let buffer = self.activation_buffer(s, stage)?;
                let work =
                    self.group.recv_async(&buffer, self.rank_of(stage - 1), self.tag(s.micro, stage - 1, false))?;
                state.receives.insert(s, work);
            }
            Action::Forward(s) => self.forward(s, state, inputs, loss)?,
            Action::SendActivation(s) => {
                self.reap_sends(state)?;
                let stage = self.stage(s);
                let out = self.held_of(state, s)?.pieces.last().expect("a chunk has pieces").1.f_detach()?;
                self.send_header(s, stage, &out, state)?;
                let work = self.group.send_async(&out, self.rank_of(stage + 1), self.tag(s.micro, stage, false))?;
                state.sends.push((work, out));
            }
            Action::RecvGrad(s) if state.grad_receives.contains_key(&s) => {}
            Action::RecvGrad(s) => {
                let stage = self.stage(s);
                let out = &self.held_of(state, s)?.pieces.last().expect("a chunk has pieces").1;
                let buffer = self.grad_buffers.take(s, || Ok(out.f_empty_like()?))?;
                let work = self.group.recv_async(&buffer, self.rank_of(stage + 1), self.tag(s.micro, stage, true))?;
                state.grad_receives.insert(s, work);
            }
            Action::Backward(s) => self.backward(s, state)?,
            Action::SendGrad(s) => {
                self.reap_sends(state)?;
                let stage = self.stage(s);
                let grad = state.input_grads.remove(&s).flatten().ok_or_else(|| {
                    Error::invalid(format!("no gradient reached the input of stage {stage} (is it used?)"))
                })?;
                let work = self.group.send_async(&grad, self.rank_of(stage - 1), self.tag(s.micro, stage - 1, true))?;
                state.sends.push((work, grad));
            }
            Action::Weight(s) => {
                let held = state.held.remove(&s).ok_or_else(|| Error::invalid("weight pass before backward"))?;
                for (out, grad, params) in &held.weight {
                    autograd::backward_into(&[out], &[Some(grad)], &params.iter().collect::<Vec<_>>(), false)?;
                }
                drop(held);
                self.release(s);
                self.held -= 1;
            }
        }
        Ok(())
    }

    /// Ends the sends that have completed, dropping the tensors they kept alive: a step holds
    /// the sends still in flight, not every micro-batch's gradient (or activation) until its
    /// end. On NCCL; Gloo reports a send completed only once it is waited for, so on the CPU
    /// the step's sends stay until its end (waiting on one early could wait on a peer that
    /// needs this rank's next message first).
    fn reap_sends(&self, state: &mut StepState) -> Result<()> {
        let mut pending = Vec::with_capacity(state.sends.len());
        for (work, tensor) in state.sends.drain(..) {
            match work.is_completed()? {
                true => self.wait(work)?,
                false => pending.push((work, tensor)),
            }
        }
        state.sends = pending;
        Ok(())
    }

    /// Posts the receives that feed the next compute action before this one runs, so their
    /// data moves while this rank computes (Gloo moves a message once both sides have posted).
    /// Only receives whose buffers exist (every step after the first), and only on CPU: on
    /// NCCL a receive queued ahead of the order both sides agreed on could sit ahead of a send
    /// the peer needs first.
    fn prefetch(&mut self, ahead: &[Action], state: &mut StepState) -> Result<()> {
        if self.device != Device::Cpu {
            return Ok(());
        }
        for &action in ahead {
            match action {
                Action::RecvActivation(s) if !state.receives.contains_key(&s) => {
                    if let Some(buffer) = self.activation_buffers.take_existing(s) {
                        let stage = self.stage(s);
                        let tag = self.tag(s.micro, stage - 1, false);
                        state.receives.insert(s, self.group.recv_async(&buffer, self.rank_of(stage - 1), tag)?);
                    }
                }
                Action::RecvGrad(s) if !state.grad_receives.contains_key(&s) => {
                    if let Some(buffer) = self.grad_buffers.take_existing(s) {
                        let stage = self.stage(s);
                        let tag = self.tag(s.micro, stage, true);
                        state.grad_receives.insert(s, self.group.recv_async(&buffer, self.rank_of(stage + 1), tag)?);
                    }
                }
                Action::Forward(_) | Action::Backward(_) | Action::Weight(_) => break,
                _ => {}
            }
        }
        Ok(())
    }

    fn held_of<'a>(&self, state: &'a StepState, s: Step) -> Result<&'a Held> {
        state.held.get(&s).ok_or_else(|| Error::invalid("the schedule uses a micro-batch before its forward"))
    }

    fn forward(
        &mut self,
        s: Step,
        state: &mut StepState,
        inputs: &[Tensor],
        loss: &mut dyn FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<()> {
        let stage = self.stage(s);
        let last = stage + 1 == self.schedule.stages();
        let input = if stage == 0 {
            inputs[s.micro].shallow_clone()
        } else {
            let work = state.receives.remove(&s).ok_or_else(|| Error::invalid("forward before its receive"))?;
            self.wait(work)?;
            let buffer = self.activation_buffers.held(s)?;
            buffer.f_detach()?.set_requires_grad(buffer.is_floating_point())
        };
        let split = self.schedule.split_backward;
        let scale = 1.0 / self.schedule.micro_batches as f64;
        let mut pieces = Vec::new();
        let mut x = input.shallow_clone();
        for layer in &self.chunks[s.chunk].layers {
            // Under a split backward each layer gets its own graph (see the module comment).
            let leaf = if split && !pieces.is_empty() { detached(&x)? } else { x };
            let out = layer.forward(&leaf)?;
            if split || pieces.is_empty() {
                pieces.push((leaf, out.shallow_clone()));
            } else {
                pieces.last_mut().expect("one piece").1 = out.shallow_clone();
            }
            x = out;
        }
        if last {
            let leaf = if split { detached(&x)? } else { x };
            let l = loss(s.micro, &leaf)?;
            ensure!(l.numel() == 1, "the loss of micro-batch {} has shape {:?}, expected a scalar", s.micro, l.size());
            let scaled = l.f_mul_scalar(scale)?;
            let value = scaled.f_detach()?.f_reshape([0i64; 0])?;
            state.loss = Some(match state.loss.take() {
                Some(sum) => sum.f_add(&value)?,
                None => value,
            });
            if split {
                pieces.push((leaf, scaled));
            } else {
                pieces.last_mut().expect("one piece").1 = scaled;
            }
        }
        state.held.insert(s, Held { input, pieces, weight: Vec::new() });
        self.held += 1;
        self.peak = self.peak.max(self.held);
        Ok(())
    }

    fn backward(&mut self, s: Step, state: &mut StepState) -> Result<()> {
        let stage = self.stage(s);
        let last = stage + 1 == self.schedule.stages();
        let grad = if last {
            None
        } else {
            let work = state.grad_receives.remove(&s).ok_or_else(|| Error::invalid("backward before its receive"))?;
            self.wait(work)?;
            Some(self.grad_buffers.held(s)?)
        };
        let mut held = state.held.remove(&s).ok_or_else(|| Error::invalid("backward before forward"))?;
        let wants_input = stage > 0 && held.input.requires_grad();
        if !self.schedule.split_backward {
            let (_, out) = held.pieces.last().expect("a chunk has pieces");
            autograd::backward(&[out], &[grad.as_ref()], false)?;
            state.input_grads.insert(s, wants_input.then(|| held.input.grad()).filter(Tensor::defined));
            drop(held);
            self.release(s);
            self.held -= 1;
            return Ok(());
        }
        // Input-gradient pass: layer by layer from the last, keeping each layer's graph.
        let layers = self.chunks[s.chunk].layers.iter().map(|l| Some(l.as_ref())).chain(last.then_some(None));
        let params: Vec<Vec<Tensor>> = layers
            .map(|l| {
                l.map_or_else(Vec::new, |l| {
                    l.params().into_iter().map(|p| p.tensor).filter(Tensor::requires_grad).collect()
                })
            })
            .collect();
        let mut out_grad = grad;
        let mut weight = Vec::with_capacity(held.pieces.len());
        let pieces = held.pieces.len();
        for (i, (leaf, out)) in held.pieces.iter().enumerate().rev() {
            let g = out_grad.take();
            // The loss (last piece of the last stage) starts with an implicit gradient; any
            // other piece that got none does not contribute to the loss.
            if g.is_none() && !(last && i + 1 == pieces) {
                continue;
            }
            let needs_input = (i > 0 || wants_input) && leaf.requires_grad();
            if needs_input {
                out_grad = autograd::grad(&[out], &[g.as_ref()], &[leaf], true)?.pop().flatten();
            }
            if let (Some(g), false) = (g, params[i].is_empty()) {
                weight.push((out.shallow_clone(), g, params[i].iter().map(Tensor::shallow_clone).collect()));
            }
        }
        state.input_grads.insert(s, if wants_input { out_grad } else { None });
        held.weight = weight;
        state.held.insert(s, held);
        Ok(())
    }

    /// The receive buffer of `s`'s input activation; the first receive of a chunk reads the
    /// sender's shape header (sent once: every later message of that chunk has its shape).
    fn activation_buffer(&mut self, s: Step, stage: usize) -> Result<Tensor> {
        if let Some(b) = self.activation_buffers.take_existing(s) {
            return Ok(b);
        }
        let (shape, kind) = match self.received_shapes.get(&s.chunk) {
            Some(known) => known.clone(),
            None => {
                let header = self.recv_header(self.rank_of(stage - 1), HEADER_TAG + (stage - 1) as i32)?;
                self.received_shapes.insert(s.chunk, header.clone());
                header
            }
        };
        let device = self.device;
        self.activation_buffers.take(s, || Ok(Tensor::f_empty(&shape, (kind, device))?))
    }

    /// Gives back `s`'s receive buffers once its last backward pass is done: its input (a leaf
    /// sharing the activation buffer) and the gradient it received are read no more.
    fn release(&mut self, s: Step) {
        self.activation_buffers.release(s);
        self.grad_buffers.release(s);
    }

    /// The shape and dtype a shape header from group rank `from` announces.
    fn recv_header(&self, from: usize, tag: i32) -> Result<(Vec<i64>, Kind)> {
        let header = Tensor::f_zeros([HEADER as i64], (Kind::Int64, Device::Cpu))?.f_to_device(self.device)?;
        self.wait(self.group.recv_async(&header, from, tag)?)?;
        let values = Vec::<i64>::try_from(header.f_to_device(Device::Cpu)?)?;
        let (dims, kind) = (values[0] as usize, kind_of(values[1])?);
        ensure!(dims + 2 <= HEADER, "a shape header with {dims} dimensions");
        Ok((values[2..2 + dims].to_vec(), kind))
    }

    /// Before a chunk's first activation goes out, its shape and dtype; every later activation
    /// of the chunk must match them.
    fn send_header(&mut self, s: Step, stage: usize, out: &Tensor, state: &mut StepState) -> Result<()> {
        let (shape, kind) = (out.size(), out.kind());
        if let Some((sent, sent_kind)) = self.sent_shapes.get(&s.chunk) {
            ensure!(
                *sent == shape && *sent_kind == kind,
                "micro-batch {} gives stage {stage} an output of shape {shape:?} ({kind:?}), but the first gave \
                 {sent:?} ({sent_kind:?}); every micro-batch must have the same shape",
                s.micro
            );
            return Ok(());
        }
        let header = Tensor::from_slice(&header_of(out, stage)?).f_to_device(self.device)?;
        let work = self.group.send_async(&header, self.rank_of(stage + 1), HEADER_TAG + stage as i32)?;
        state.sends.push((work, header));
        self.sent_shapes.insert(s.chunk, (shape, kind));
        Ok(())
    }
}

/// The shape header of stage `stage`'s output `out`: its number of dimensions, dtype code and
/// sizes.
fn header_of(out: &Tensor, stage: usize) -> Result<Vec<i64>> {
    let shape = out.size();
    ensure!(
        shape.len() + 2 <= HEADER,
        "stage {stage} outputs {} dimensions; at most {} cross",
        shape.len(),
        HEADER - 2
    );
    let mut values = vec![0i64; HEADER];
    values[0] = shape.len() as i64;
    values[1] = code_of(out.kind())?;
    values[2..2 + shape.len()].copy_from_slice(&shape);
    Ok(values)
}

/// A new leaf on `x`'s data, recording gradients when its dtype can have them.
fn detached(x: &Tensor) -> Result<Tensor> {
    Ok(x.f_detach()?.set_requires_grad(x.is_floating_point()))
}

const KINDS: [Kind; 6] = [Kind::Float, Kind::Double, Kind::Half, Kind::BFloat16, Kind::Int64, Kind::Int];

fn code_of(kind: Kind) -> Result<i64> {
    KINDS
        .iter()
        .position(|&k| k == kind)
        .map(|i| i as i64)
        .ok_or_else(|| Error::invalid(format!("activations of dtype {kind:?} cannot cross pipeline stages")))
}

fn kind_of(code: i64) -> Result<Kind> {
    KINDS.get(code as usize).copied().ok_or_else(|| Error::invalid(format!("a shape header with dtype code {code}")))
}

#[cfg(test)]
mod tests {
    use super::super::{assign, split_costs, FnLayer, Layer, ScheduleKind};
    use super::*;
    use crate::dist::{InitOptions, World};

    /// Three affine layers with tanh, on seeded weights.
    fn layers() -> Vec<Box<dyn Layer>> {
        (0..3)
            .map(|i| {
                tch::manual_seed(i);
                let w = Tensor::randn([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                let b = Tensor::randn([4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
                let params = vec![Param::new(format!("w{i}"), &w), Param::new(format!("b{i}"), &b)];
                Box::new(FnLayer::new(params, |x: &Tensor, p: &[Param]| {
                    Ok(x.f_matmul(&p[0].tensor)?.f_add(&p[1].tensor)?.f_tanh()?)
                })) as Box<dyn Layer>
            })
            .collect()
    }

    /// On one rank every schedule, split backward included, gives plain autograd's loss and
    /// gradients: the mean over micro-batches.
    #[test]
    fn one_stage_equals_plain_autograd() {
        let world = World::single(&InitOptions::default()).unwrap();
        tch::manual_seed(9);
        let x = Tensor::randn([6, 4], (Kind::Float, Device::Cpu));
        let reference = layers();
        let out = reference.iter().fold(x.shallow_clone(), |h, l| l.forward(&h).unwrap());
        let loss = out.square().mean(Kind::Float);
        loss.backward();
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZeroBubbleH1] {
            let split = split_costs(vec![1.0; 3], 1, "layers").unwrap();
            let chunks = assign(layers(), &split, 0, 1).unwrap();
            let mut pipe =
                Pipeline::new(&world.group, chunks, Schedule::new(kind, 1, 3, 1).unwrap(), Device::Cpu).unwrap();
            let inputs: Vec<Tensor> = (0..3).map(|i| x.narrow(0, 2 * i, 2)).collect();
            let got = pipe.step(&inputs, &mut |_, out| Ok(out.f_square()?.f_mean(Kind::Float)?)).unwrap().unwrap();
            assert!((got - loss.double_value(&[])).abs() < 1e-6, "{kind:?}: loss {got}");
            for (p, q) in pipe.params().iter().zip(reference.iter().flat_map(|l| l.params())) {
                let err = (p.tensor.grad() - q.tensor.grad()).abs().max().double_value(&[]);
                assert!(err < 1e-6, "{kind:?}: gradient of {} off by {err}", p.name);
            }
            assert_eq!(pipe.peak_in_flight(), if kind == ScheduleKind::GPipe { 3 } else { 1 }, "{kind:?}");
            let inferred = pipe.forward_only(Some(&x)).unwrap().unwrap();
            assert!(!inferred.requires_grad() && inferred.allclose(&out, 1e-6, 1e-6, false), "{kind:?}: forward_only");
        }
    }

    #[test]
    fn wrong_inputs_and_chunks_are_errors_naming_them() {
        let world = World::single(&InitOptions::default()).unwrap();
        let split = split_costs(vec![1.0; 3], 1, "layers").unwrap();
        let schedule = Schedule::new(ScheduleKind::OneFOneB, 1, 2, 1).unwrap();
        let mut pipe =
            Pipeline::new(&world.group, assign(layers(), &split, 0, 1).unwrap(), schedule, Device::Cpu).unwrap();
        let err = pipe.step(&[], &mut |_, o| Ok(o.shallow_clone())).unwrap_err().to_string();
        assert!(err.contains("0 inputs for micro_batches=2"), "{err}");
        let x = Tensor::zeros([2, 4], (Kind::Float, Device::Cpu));
        let err = pipe.step(&[x.shallow_clone(), x], &mut |_, o| Ok(o.shallow_clone())).unwrap_err().to_string();
        assert!(err.contains("pipeline rank 0 (stage 0): F(micro 0, chunk 0)"), "{err}");
        assert!(err.contains("has shape [2, 4], expected a scalar"), "{err}");
        let schedule = Schedule::new(ScheduleKind::Interleaved, 2, 2, 2).unwrap();
        let err = Pipeline::new(&world.group, Vec::new(), schedule, Device::Cpu).err().unwrap().to_string();
        assert!(err.contains("the schedule is for pp=2 ranks but group world has 1"), "{err}");
    }
}
