//! Running a model under Gemini: each module's chunks are made resident before its forward and
//! again before its backward, released for eviction after each, gradients leave the
//! parameters for the chunks as soon as autograd produces them, and the optimizer steps the
//! chunks' homes where they live.
//!
//! The model stays an ordinary serial model; its forward wraps each module in
//! [`Gemini::run`]. Around the module's output sits an identity autograd function whose
//! backward makes the module's chunks resident before the module's own backward runs
//! (pre-backward), and around its input one whose backward runs after it (post-backward), the
//! way Colossal-AI's parameter-op hooks do it.
//!
//! A step is: forward and backward of each micro-batch (with [`Gemini::finish_backward`]
//! after each backward: gradients accumulate in the chunks), optionally
//! [`Gemini::clip_grad_norm`], then [`Gemini::step`]. [`Gemini::plan_step`] before the last
//! micro-batch's backward lets host chunks start on the step while that backward runs
//! (`early.rs`). Where the homes live is the [`Placement`] policy's (`placement.rs`); saving
//! and loading are in `checkpoint.rs`.
use std::sync::{Arc, Mutex, MutexGuard};

use tch::Tensor;

use super::early::StepPlan;
use super::manager::{ChunkConfig, ChunkManager, Replication};
use super::optimizer::ChunkOptimizer;
use super::placement::{self, Placement};
use crate::autograd::{apply, register_post_accumulate_grad_hook, set_grad, Forward};
use crate::optim::flat::CpuRule;
use crate::optim::{LossScaler, Param};
use crate::{Error, Result};

/// Gemini's options.
#[derive(Clone, Debug)]
pub struct GeminiConfig {
    /// Chunk layout, compute device and budget (its `home_buffers` is set from the rule).
    pub chunks: ChunkConfig,
    /// Home placement policy.
    pub placement: Placement,
    /// Chunks loaded ahead of the trace while a module runs.
    pub prefetch: usize,
    /// The optimizer.
    pub rule: CpuRule,
    /// Data parallelism over a group (ZeRO-3 sharding or replicated chunks), if any.
    pub replication: Option<Replication>,
}

/// A model's parameters and optimizer under Gemini. See the module documentation.
#[derive(Clone)]
pub struct Gemini {
    manager: Arc<Mutex<ChunkManager>>,
    optimizer: Arc<Mutex<ChunkOptimizer>>,
    prefetch: usize,
    placement: Placement,
    /// Device bytes in use before the warm-up step (GPU only; for the auto policy).
    baseline: i64,
}

fn poisoned<T>(_: T) -> Error {
    Error::invalid("gemini state poisoned")
}

impl Gemini {
    /// Puts `params` (in execution order, the same on every rank) into chunks placed by the
    /// policy, and hooks their gradients.
    /// Frozen parameters (`cfg.chunks.trainable` false) must not require gradients; they get
    /// no hooks, and [`Gemini::step`] only ends the step.
    pub fn new(params: &[Param], cfg: GeminiConfig) -> Result<Gemini> {
        let mut chunks = cfg.chunks;
        chunks.home_buffers = match chunks.trainable {
            true => 2 + cfg.rule.state_slots().len(),
            // The home alone.
            false => 1,
        };
        if let Some(p) = params.iter().find(|p| !chunks.trainable && p.tensor.requires_grad()) {
            return Err(Error::invalid(format!(
                "gemini: {} requires a gradient but the chunks are frozen (trainable: false)",
                p.name
            )));
        }
        let first_tier = cfg.placement.first_tier()?;
        let mut manager = match cfg.replication {
            Some(rep) => ChunkManager::replicated(params, chunks, first_tier, rep)?,
            None => ChunkManager::new(params, chunks, first_tier)?,
        };
        cfg.placement.place_static(&mut manager)?;
        cfg.placement.begin_warmup(&mut manager);
        let manager = Arc::new(Mutex::new(manager));
        let optimizer = Arc::new(Mutex::new(ChunkOptimizer::new(cfg.rule)));
        // Frozen parameters get no gradient, so no hook.
        let hooked = if chunks.trainable { params } else { &[] };
        for (i, p) in hooked.iter().enumerate() {
            let (m, o) = (Arc::downgrade(&manager), Arc::downgrade(&optimizer));
            register_post_accumulate_grad_hook(&p.tensor, move |t| {
                let Some(m) = m.upgrade() else { return Ok(()) };
                let m = &mut *m.lock().map_err(poisoned)?;
                let complete = m.add_gradient(i, &t.grad())?;
                // A chunk whose gradient is complete may start on the step (a planned one).
                if let (Some(c), Some(o)) = (complete, o.upgrade()) {
                    o.lock().map_err(poisoned)?.chunk_complete(m, c)?;
                }
                // The gradient now lives in the chunk; free autograd's copy.
                set_grad(t, None)
            })?;
        }
        let baseline = placement::device_baseline(chunks.device)?;
        Ok(Gemini { manager, optimizer, prefetch: cfg.prefetch, placement: cfg.placement, baseline })
    }

    /// The chunk manager, for inspection.
    pub fn manager(&self) -> Result<MutexGuard<'_, ChunkManager>> {
        self.manager.lock().map_err(poisoned)
    }

    /// The optimizer, for its learning rate and state.
    pub fn optimizer(&self) -> Result<MutexGuard<'_, ChunkOptimizer>> {
        self.optimizer.lock().map_err(poisoned)
    }

    /// Runs one module, `f`, on `input`; `params` are the indices (registration order) of the
    /// parameters it uses.
    pub fn run(&self, params: &[usize], input: &Tensor, f: impl FnOnce(&Tensor) -> Tensor) -> Result<Tensor> {
        let mut out = self.run_many(params, &[input], |x| Ok::<_, Error>(vec![f(&x[0])]))?;
        Ok(out.remove(0))
    }

    /// [`Gemini::run`] for a module of several inputs and outputs. `inputs[0]` is its main
    /// path, the input whose gradient its backward produces last: when that arrives the
    /// module's backward is done. Backward may enter the module through any output, so each
    /// output makes the chunks resident. The other inputs (a shared embedding, skip
    /// connections) pass through unmarked.
    pub fn run_many<E: From<Error>>(
        &self,
        params: &[usize],
        inputs: &[&Tensor],
        f: impl FnOnce(&[Tensor]) -> std::result::Result<Vec<Tensor>, E>,
    ) -> std::result::Result<Vec<Tensor>, E> {
        {
            let mut m = self.manager()?;
            m.access(params)?;
            m.prefetch(self.prefetch)?;
        }
        let mut marked: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
        if let Some(first) = marked.first_mut() {
            *first = self.marker("gemini_post_backward", first, params, false)?;
        }
        let outputs = f(&marked)?;
        self.manager()?.done(params)?;
        let marked = outputs.iter().map(|y| self.marker("gemini_pre_backward", y, params, true));
        Ok(marked.collect::<Result<Vec<_>>>()?)
    }

    /// Identity whose backward either makes `params` resident (before the module's backward)
    /// or reports the module's backward done (after it).
    fn marker(&self, name: &'static str, x: &Tensor, params: &[usize], before: bool) -> Result<Tensor> {
        if !x.requires_grad() {
            return Ok(x.shallow_clone());
        }
        let (m, chunks, prefetch) = (self.manager.clone(), params.to_vec(), self.prefetch);
        let out = apply(
            name,
            &[x],
            |x| Ok(Forward::outputs(vec![x[0].shallow_clone()])),
            move |g, _| {
                let mut m = m.lock().map_err(poisoned)?;
                if before {
                    m.access(&chunks)?;
                    m.prefetch(prefetch)?;
                } else {
                    m.done_backward(&chunks)?;
                }
                Ok(vec![Some(g[0].shallow_clone())])
            },
        )?;
        Ok(out.into_iter().next().expect("one output"))
    }

    /// After each backward: every gradient is in the chunks (partial chunks reduced). After
    /// the first, the auto policy places the homes.
    pub fn finish_backward(&self) -> Result<()> {
        let mut m = self.manager()?;
        m.finish_backward()?;
        if self.placement == Placement::Auto && m.recording() && self.optimizer()?.steps() == 0 {
            placement::place_after_warmup(&mut m, self.baseline, self.prefetch)?;
        }
        Ok(())
    }

    /// Clips the accumulated gradients to a global norm of `max_norm`; returns the norm before.
    pub fn clip_grad_norm(&self, max_norm: f64) -> Result<f64> {
        let norm = self.unscale_and_clip(None, Some(max_norm))?;
        Ok(norm.expect("without a scaler there is no overflow to report"))
    }

    /// Divides the accumulated gradients by a loss scale (fp16 training) and returns whether
    /// they are all finite on every rank; when not, call [`Gemini::skip_step`] instead of
    /// [`Gemini::step`].
    pub fn unscale(&self, scaler: &LossScaler) -> Result<bool> {
        Ok(self.unscale_and_clip(Some(scaler), None)?.is_some())
    }

    /// Unscales the accumulated gradients by `scaler` (fp16) and clips them to a global norm
    /// of `max_norm`, with one reduction and one host sync for both. Returns the norm before
    /// clipping, or None when a scaler is given and the gradients overflowed on some rank
    /// (then call [`Gemini::skip_step`]). Host chunks' gradients are only read here; the step's
    /// fused pass scales them.
    pub fn unscale_and_clip(&self, scaler: Option<&LossScaler>, max_norm: Option<f64>) -> Result<Option<f64>> {
        let m = self.manager()?;
        let scale = scaler.map_or(1.0, |s| 1.0 / s.scale);
        self.optimizer()?.unscale_and_clip(&m, scale, max_norm, scaler.is_some())
    }

    /// Says, before the step's last backward, what the step will do to the gradients first, so
    /// that each host chunk starts on the step as soon as its gradient is complete, on rayon's
    /// pool while the rest of backward runs (`early.rs`): with neither a loss scale nor a norm
    /// it steps, else it reads its gradient for the norm. The step then runs what is left,
    /// with the same results bit for bit. Not taken during the first step (the placement is
    /// decided at its end) nor over a data-parallel group (gradients are reduced at the end of
    /// backward). On the CPU the pool's threads share the cores with the backward's. A chunk
    /// that steps during backward steps at the learning rate set before it.
    pub fn plan_step(&self, plan: StepPlan) -> Result<()> {
        let m = self.manager()?;
        if m.recording() || m.replication().is_some() || !m.trainable() {
            return Ok(());
        }
        self.optimizer()?.plan(&m, plan)
    }

    /// Ends a step without updating (an overflow under loss scaling, or every step of frozen
    /// parameters): drops the gradients (the next backward overwrites them) and frees the
    /// payloads.
    pub fn skip_step(&self) -> Result<()> {
        let mut m = self.manager()?;
        self.optimizer()?.discard(&mut m)?;
        m.end_step();
        m.release_all()
    }

    /// Steps every chunk's home from its accumulated gradient, which the next backward
    /// overwrites; resident
    /// payloads are stale after it and are freed (the next access reloads), and the first
    /// step's accesses become the trace.
    pub fn step(&self) -> Result<()> {
        if !self.manager()?.trainable() {
            return self.skip_step();
        }
        let mut m = self.manager()?;
        // Payloads are stale after the step; freeing them first also waits for any prefetch
        // still reading a home the optimizer is about to write.
        m.release_all()?;
        self.optimizer()?.step(&mut m)?;
        m.end_step();
        Ok(())
    }
}
