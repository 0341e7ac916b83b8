//! Where a module's arrays come from while it is built: a `Builder` over named arrays and the
//! [`Scope`] (module path) at which each constructor asks for its arrays.
//!
//! A weight's name is its module path: constructors ask a [`Scope`] for
//! `p.sub("attention").param("query_w", ..)`, and the key is `<module path>//<name>` exactly as
//! in AlphaFold's files (haiku module path, `//`, parameter name), so the constructors are the
//! mapping to AlphaFold's names (the roots and the per-module names are tabled in
//! [`crate::model::keys`]).
//!
//! A stack's arrays carry a leading block dimension (`[num_blocks, ...]`, as haiku's
//! `layer_stack` writes them); block `i`'s modules hold `select(0, i)` views of them, so
//! gradients of the blocks land in the stacked arrays.
//!
//! This is the leaf every module file builds on: it imports no model module but the error
//! type, so the store ([`crate::model::params`]) and the modules can both depend on it.
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use kernels::Backend;
use tch::{Device, Kind, Tensor};

use crate::model::{Error, Result};

/// How [`Params::random`](crate::model::Params::random) draws an array. Every array gets
/// non-degenerate values (AlphaFold's training init zeroes output and gating weights, which
/// would hide errors in tests).
#[derive(Clone, Copy, Debug)]
pub enum Init {
    /// Normal with variance `1 / fan_in`.
    Weight {
        /// Inputs summed per output.
        fan_in: i64,
    },
    /// Normal around 0 with standard deviation 0.1 (biases, LayerNorm offsets).
    Small,
    /// Normal around 1 with standard deviation 0.1 (LayerNorm scales, gating biases).
    One,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Look arrays up and check their shapes.
    Load,
    /// Create arrays that are absent.
    Init,
}

/// The arrays being read (or created) while modules are built, and which keys were used.
pub(crate) struct Builder {
    mode: Mode,
    arrays: RefCell<BTreeMap<String, Tensor>>,
    used: RefCell<BTreeSet<String>>,
    file: Option<String>,
    kernels: Backend,
}

impl Builder {
    /// A builder over `arrays`; `file` names their file in errors.
    pub(crate) fn new(mode: Mode, arrays: BTreeMap<String, Tensor>, file: Option<String>) -> Builder {
        let (arrays, used) = (RefCell::new(arrays), RefCell::new(BTreeSet::new()));
        Builder { mode, arrays, used, file, kernels: Backend::Torch }
    }

    /// Modules built from here run `kernels` where they have fused ones.
    pub(crate) fn with_kernels(mut self, kernels: Backend) -> Builder {
        self.kernels = kernels;
        self
    }

    /// Keys under `prefix` that no module asked for.
    pub(crate) fn unused_under(&self, prefix: &str) -> Vec<String> {
        let used = self.used.borrow();
        self.arrays.borrow().keys().filter(|k| k.starts_with(prefix) && !used.contains(*k)).cloned().collect()
    }

    /// The arrays some module asked for (an initialising builder's arrays are all of them:
    /// each was created by a module asking for it).
    pub(crate) fn into_used(self) -> BTreeMap<String, Tensor> {
        let used = self.used.into_inner();
        self.arrays.into_inner().into_iter().filter(|(k, _)| used.contains(k)).collect()
    }

    /// A scope at an unstacked module path (embedders, heads).
    pub(crate) fn root(&self, path: &str) -> Scope<'_> {
        Scope { builder: self, path: path.to_string(), block: None }
    }

    /// A scope at the root of a stack of `blocks` blocks, for block `index`.
    pub(crate) fn block(&self, path: &str, index: i64, blocks: i64) -> Scope<'_> {
        Scope { builder: self, path: path.to_string(), block: Some((index, blocks)) }
    }
}

/// A module path inside a `Builder` (haiku's module names joined by `/`).
pub struct Scope<'a> {
    builder: &'a Builder,
    path: String,
    /// (this block, blocks in the stack) when the arrays are stacked.
    block: Option<(i64, i64)>,
}

impl Scope<'_> {
    /// The sub-module `name`.
    pub fn sub(&self, name: &str) -> Self {
        Scope { builder: self.builder, path: format!("{}/{name}", self.path), block: self.block }
    }

    /// Which implementation the module's fused operations run.
    pub fn kernels(&self) -> Backend {
        self.builder.kernels
    }

    /// The array `name` of this module with per-block shape `shape`.
    pub fn param(&self, name: &str, shape: &[i64], init: Init) -> Result<Tensor> {
        let key = format!("{}//{name}", self.path);
        let full: Vec<i64> = match self.block {
            Some((_, n)) => std::iter::once(n).chain(shape.iter().copied()).collect(),
            None => shape.to_vec(),
        };
        let b = self.builder;
        let mut arrays = b.arrays.borrow_mut();
        if !arrays.contains_key(&key) {
            match b.mode {
                Mode::Load => return Err(Error::Missing { key, file: b.file.clone() }),
                Mode::Init => {
                    arrays.insert(key.clone(), draw(&full, init)?);
                }
            }
        }
        let t = &arrays[&key];
        if t.size() != full {
            return Err(Error::Shape { key, expected: full, found: t.size(), file: b.file.clone() });
        }
        let out = match self.block {
            Some((i, _)) => t.f_select(0, i)?,
            None => t.shallow_clone(),
        };
        b.used.borrow_mut().insert(key);
        Ok(out)
    }
}

fn draw(shape: &[i64], init: Init) -> Result<Tensor> {
    let opts = (Kind::Float, Device::Cpu);
    let n = Tensor::f_randn(shape, opts)?;
    Ok(match init {
        Init::Weight { fan_in } => n.f_mul_scalar(1.0 / (fan_in.max(1) as f64).sqrt())?,
        Init::Small => n.f_mul_scalar(0.1)?,
        Init::One => n.f_mul_scalar(0.1)?.f_add_scalar(1.0)?,
    })
}
