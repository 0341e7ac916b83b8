//! Running a model under Gemini: each module's chunks are made resident before its forward and
//! again before its backward, released for eviction after each, and gradients leave the
//! parameters for the chunks' accumulators as soon as autograd produces them.
//!
//! The model stays an ordinary serial model; its forward wraps each module in
//! [`Gemini::run`]. Around the module's output sits an identity autograd function whose
//! backward makes the module's chunks resident before the module's own backward runs
//! (pre-backward), and around its input one whose backward runs after it (post-backward), the
//! way Colossal-AI's parameter-op hooks do it.
use std::sync::{Arc, Mutex, MutexGuard};

use tch::Tensor;

use super::manager::{ChunkConfig, ChunkManager, Tier};
use crate::autograd::{apply, register_post_accumulate_grad_hook, set_grad, Forward};
use crate::optim::Param;
use crate::{Error, Result};

/// A model's parameters under Gemini. See the module documentation.
#[derive(Clone)]
pub struct Gemini {
    manager: Arc<Mutex<ChunkManager>>,
    prefetch: usize,
}

impl Gemini {
    /// Puts `params` (in execution order) into chunks with homes on `tier`, and hooks their
    /// gradients. `prefetch`: how many chunks ahead of the trace to load while a module runs.
    pub fn new(params: &[Param], cfg: ChunkConfig, tier: Tier, prefetch: usize) -> Result<Gemini> {
        let manager = Arc::new(Mutex::new(ChunkManager::new(params, cfg, tier)?));
        for (i, p) in params.iter().enumerate() {
            let m = Arc::downgrade(&manager);
            register_post_accumulate_grad_hook(&p.tensor, move |t| {
                let Some(m) = m.upgrade() else { return Ok(()) };
                let mut m = m.lock().map_err(|_| Error::invalid("gemini state poisoned"))?;
                m.add_gradient(i, &t.grad())?;
                // The gradient now lives in the chunk; free autograd's copy.
                set_grad(t, None)
            })?;
        }
        Ok(Gemini { manager, prefetch })
    }

    /// The chunk manager, for inspection.
    pub fn manager(&self) -> Result<MutexGuard<'_, ChunkManager>> {
        self.manager.lock().map_err(|_| Error::invalid("gemini state poisoned"))
    }

    /// Runs one module, `f`, on `input`; `params` are the indices (registration order) of the
    /// parameters it uses.
    pub fn run(&self, params: &[usize], input: &Tensor, f: impl FnOnce(&Tensor) -> Tensor) -> Result<Tensor> {
        {
            let mut m = self.manager()?;
            m.access(params)?;
            m.prefetch(self.prefetch)?;
        }
        let input = self.marker("gemini_post_backward", input, params, false)?;
        let output = f(&input);
        self.manager()?.done(params)?;
        self.marker("gemini_pre_backward", &output, params, true)
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
                let mut m = m.lock().map_err(|_| Error::invalid("gemini state poisoned"))?;
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

    /// After backward: every gradient is in the chunks.
    pub fn finish_backward(&self) -> Result<()> {
        self.manager()?.finish_backward()
    }

    /// After the optimizer stepped the home copies: resident payloads are stale, free them
    /// (the next access reloads), and the first step's accesses become the trace.
    pub fn after_step(&self) -> Result<()> {
        let mut m = self.manager()?;
        m.end_step();
        m.release_all()
    }

    /// The parameters the optimizer steps (views into the home copies and gradient
    /// accumulators; see [`ChunkManager::home_params`]).
    pub fn optimizer_params(&self) -> Result<Vec<Param>> {
        self.manager()?.home_params()
    }
}
