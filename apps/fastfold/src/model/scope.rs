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
//! `layer_stack` writes them); block `i`'s modules hold views of row `i`, and gradients of the
//! blocks land in the stacked arrays' `.grad` (see `block_leaf` for how, when they train).
//!
//! This is the leaf every module file builds on: it imports no model module but the error
//! type, so the store ([`crate::model::params`]) and the modules can both depend on it.
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use kernels::Backend;
use tch::{Device, Kind, Tensor};

use crate::model::{ensure, Error, Result};

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

/// Which attention runs without autograd on the fused kernels (`--attention`): training, and
/// libtorch's compositions, always make the logits whole.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AttentionKernel {
    /// The logits made whole by cuBLAS and softmaxed in place by the fused softmax.
    #[default]
    Logits,
    /// The tensor-core kernel ([`kernels::flash_attention`]): the logits never in memory. Its
    /// f32 products are TF32.
    Flash,
}

impl AttentionKernel {
    /// Refuses the tensor-core attention where it cannot run as asked: off the fused kernels
    /// (the compositions make the logits whole), or with strict IEEE fp32 products asked for
    /// (its fp32 products are TF32).
    pub fn check(self, kernels: Backend, strict_fp32: bool) -> Result<()> {
        if self == AttentionKernel::Flash {
            ensure!(
                kernels == Backend::Fused,
                "--attention flash runs on the fused kernels (a GPU's default), not with {kernels:?}'s compositions"
            );
            ensure!(
                !strict_fp32,
                "--attention flash takes its fp32 products as TF32; with --fp32-matmul ieee use --attention logits"
            );
        }
        Ok(())
    }
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
    attention: AttentionKernel,
}

impl Builder {
    /// A builder over `arrays`; `file` names their file in errors.
    pub(crate) fn new(mode: Mode, arrays: BTreeMap<String, Tensor>, file: Option<String>) -> Builder {
        let (arrays, used) = (RefCell::new(arrays), RefCell::new(BTreeSet::new()));
        Builder { mode, arrays, used, file, kernels: Backend::Torch, attention: AttentionKernel::Logits }
    }

    /// Modules built from here run `kernels` where they have fused ones, and on the fused
    /// kernels `attention` without autograd.
    pub(crate) fn with_kernels(mut self, (kernels, attention): (Backend, AttentionKernel)) -> Builder {
        self.kernels = kernels;
        self.attention = attention;
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

    /// Which attention the module runs without autograd on the fused kernels.
    pub fn attention(&self) -> AttentionKernel {
        self.builder.attention
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
            Some((i, _)) if t.requires_grad() => block_leaf(t, i)?,
            Some((i, _)) => t.f_select(0, i)?,
            None => t.shallow_clone(),
        };
        b.used.borrow_mut().insert(key);
        Ok(out)
    }
}

/// Block `i`'s array of a trained stack: a leaf of its own over row `i` of the stack's memory
/// (so the optimizer's in-place updates of the stack reach it), whose gradient, once
/// accumulated, is added into row `i` of the stack's `.grad` and cleared.
///
/// A `select(0, i)` view (the untrained path) would reach the stack through autograd, whose
/// backward of a select zero-fills a whole stack-sized gradient, copies the row into it and
/// adds that to the stack's `.grad`: per array, per block, per backward (48 blocks: 48
/// stack-sized buffers for each of the stack's arrays; three kernels per array even for one
/// block). Here it is one addition of the row. The sums are the same, in the same order, so
/// the gradients are bitwise those of the views. The stack's own gradient hooks do not run
/// (its gradient never passes through autograd): data parallelism reduces its buckets when
/// backward ends (`DataParallel::finish_gradients`), not while it runs.
///
/// The leaf aliases the row (`set_`) rather than being a view of it: a view shares the
/// stack's version counter, and after the optimizer's in-place step libtorch would rebuild
/// the history of views taken from the leaf (a fused projection's halves) from the stack's
/// untracked base, cutting their gradients off.
fn block_leaf(stack: &Tensor, i: i64) -> Result<Tensor> {
    let row = stack.f_detach()?.f_select(0, i)?;
    let mut leaf = Tensor::f_empty([0], (stack.kind(), stack.device()))?;
    let _alias = leaf.f_set_source_tensor_(&row)?;
    let leaf = leaf.f_set_requires_grad(true)?;
    let stack = stack.shallow_clone();
    engine::autograd::register_post_accumulate_grad_hook(&leaf, move |leaf| {
        tch::no_grad(|| -> engine::Result<()> {
            let mut total = stack.grad();
            if !total.defined() {
                total = stack.f_zeros_like()?;
                engine::autograd::set_grad(&stack, Some(&total))?;
            }
            let _row = total.f_select(0, i)?.f_add_(&leaf.grad())?;
            engine::autograd::set_grad(leaf, None)
        })
    })?;
    Ok(leaf)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A loss over a stack's blocks that uses block 1 twice and block 2 not at all.
    fn loss(blocks: &[Tensor]) -> Tensor {
        let c: Vec<Tensor> = (0..3).map(|i| Tensor::from_slice(&[1.0f32 + i as f32, -2.0, 0.5, 3.0])).collect();
        (&blocks[0] * &blocks[0] * &c[0]).sum(Kind::Float)
            + (&blocks[1] * &c[1]).sum(Kind::Float)
            + (&blocks[1] * &blocks[1]).sum(Kind::Float)
    }

    /// The trained stack's blocks are leaves of their own, and their gradients land in the
    /// stack's `.grad` bitwise as `select` views' do, accumulating over backward passes, also
    /// when a block is recomputed by a checkpoint's backward; the stack's in-place updates
    /// reach them.
    #[test]
    fn trained_blocks_give_the_gradients_of_select_views() {
        let values = Tensor::randn([3, 4], (Kind::Float, Device::Cpu));
        let stack = values.copy().set_requires_grad(true);
        let mut arrays = BTreeMap::new();
        arrays.insert("stack//w".to_string(), stack.shallow_clone());
        let b = Builder::new(Mode::Load, arrays, None);
        let blocks: Vec<Tensor> =
            (0..3).map(|i| b.block("stack", i, 3).param("w", &[4], Init::Small).unwrap()).collect();
        assert!(blocks.iter().all(|t| t.is_leaf() && t.requires_grad()));

        let views = values.copy().set_requires_grad(true);
        let selected: Vec<Tensor> = (0..3).map(|i| views.select(0, i)).collect();
        for _ in 0..2 {
            loss(&blocks).backward();
            loss(&selected).backward();
        }
        assert!(stack.grad().equal(&views.grad()), "{} vs {}", stack.grad(), views.grad());
        assert!(blocks.iter().all(|t| !t.grad().defined()), "the blocks' own gradients are cleared");
        assert_eq!(stack.grad().select(0, 2).abs().max().double_value(&[]), 0.0);

        // Block 1 inside a checkpoint: its gradient arrives during the recomputation's backward.
        let _ = tch::no_grad(|| stack.grad().zero_());
        let inside = blocks[1].shallow_clone();
        let out = engine::autograd::checkpoint(&[&blocks[0]], move |ins| Ok(vec![&ins[0] * &inside])).unwrap();
        out[0].sum(Kind::Float).backward();
        let want = Tensor::stack(&[blocks[1].detach(), blocks[0].detach(), blocks[2].zeros_like()], 0);
        assert!(stack.grad().allclose(&want, 0.0, 0.0, false), "{} vs {want}", stack.grad());

        // A view of a block made before the optimizer steps the stack in place (as a fused
        // projection's halves are) still reaches the stack's gradient after the step.
        let half = blocks[1].narrow(0, 2, 2);
        tch::no_grad(|| {
            let _ = stack.get(1).fill_(7.0);
        });
        assert_eq!(Vec::<f32>::try_from(&blocks[1]).unwrap(), vec![7.0; 4]);
        let _ = tch::no_grad(|| stack.grad().zero_());
        (&half * 2.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(stack.grad().get(1)).unwrap(), vec![0.0, 0.0, 2.0, 2.0]);
    }
}
