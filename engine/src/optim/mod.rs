//! Optimizers (AdamW, LAMB, LARS), learning-rate schedules, gradient clipping, mixed
//! precision (fp32 master weights, dynamic loss scaling) and an exponential moving average of
//! the weights ([`ema`]).
//!
//! Each rule lives in one module (`adamw`, `lamb`, `lars`, with the Adam core AdamW and LAMB
//! share in `adam`) that holds its configuration, its arithmetic written once over
//! `elementwise::Elementwise` (an `f32` or a tensor), and its tensor optimizer. The same
//! arithmetic runs in three executors:
//!
//! - the tensor optimizers ([`AdamW`], [`Lamb`], [`Lars`]): a list of [`Param`]s updated in
//!   place from their `.grad`, skipping parameters without a gradient;
//! - [`flat::HostOptimizer`]: flat fp32 buffers in host memory, multi-threaded;
//! - [`flat::DeviceOptimizer`]: flat fp32 tensors where they live, with the host kernels'
//!   rounding (both step Gemini's chunks, and their trust ratios add over shards).
//!
//! An app with fused multi-tensor kernels installs them ([`fused::install`]); the tensor
//! optimizers then step every parameter in one call where those kernels take the tensors.
//! [`fused::Rule::step`] runs the same call with tensor operations: what such kernels fall
//! back on, and the reference they are tested against.
//!
//! Following common practice (timm, the LAMB paper's BERT setup), weight decay and the
//! layer-wise trust ratio apply only to parameters marked `adapt`: by default every parameter
//! of two or more dimensions, so biases and normalisation weights are left alone.
mod adam;
mod adamw;
mod clip;
mod elementwise;
pub mod ema;
pub mod flat;
pub mod fused;
mod lamb;
mod lars;
pub mod precision;
pub mod schedule;
mod state;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::{clip_coefficient, clip_grad_norm, clip_to, scaled_grad_norm, Held};
pub(crate) use clip::{local_square_sum, reduce_square_sum};
pub use ema::Ema;
pub use lamb::{Lamb, LambConfig};
pub use lars::{Lars, LarsConfig};
pub use precision::{LossScaler, MasterWeights};
pub use schedule::{scale_lr, Decay, LrSchedule};
pub use state::StateDict;

use tch::Tensor;

use crate::Result;

/// A trainable tensor and whether weight decay and trust ratios apply to it.
#[derive(Debug)]
pub struct Param {
    /// The parameter's name (its module path), for messages and checkpoints.
    pub name: String,
    /// The parameter itself (a leaf that requires grad).
    pub tensor: Tensor,
    /// Whether weight decay and the trust ratio apply.
    pub adapt: bool,
    /// The tensor-parallel group this tensor is one shard of (`None`: the whole parameter).
    /// The parameter's norms (LAMB's and LARS's trust ratios, gradient clipping) are then of
    /// the whole parameter: squares are summed over this group.
    pub split_over: Option<crate::dist::ProcessGroup>,
    /// How many ranks of `split_over` hold this same shard (1 under 1D tensor parallelism;
    /// 2D, 2.5D and 3D keep some blocks on several ranks of the group, e.g. a LayerNorm's
    /// block on every row of a 2D grid): each copy's squares count `1 / copies`.
    pub copies: usize,
}

impl Param {
    /// A parameter with the default rule: adapted unless it has fewer than two dimensions.
    pub fn new(name: impl Into<String>, tensor: &Tensor) -> Param {
        Param {
            name: name.into(),
            adapt: tensor.dim() >= 2,
            tensor: tensor.shallow_clone(),
            split_over: None,
            copies: 1,
        }
    }

    /// Another handle on the same tensor, with the same name and rule.
    pub fn shallow_copy(&self) -> Param {
        Param {
            name: self.name.clone(),
            tensor: self.tensor.shallow_clone(),
            adapt: self.adapt,
            split_over: self.split_over.clone(),
            copies: self.copies,
        }
    }

    /// Another handle on the same parameter whose tensor is `tensor` (an fp32 master copy, a
    /// fresh leaf): the same name, rule and split.
    pub fn with_tensor(&self, tensor: Tensor) -> Param {
        Param { tensor, ..self.shallow_copy() }
    }

    /// Marks the tensor as this rank's shard of a parameter split over `group` (tensor
    /// parallelism); a group of one rank leaves it whole.
    pub fn split_over(mut self, group: Option<&crate::dist::ProcessGroup>) -> Param {
        self.split_over = group.filter(|g| g.size() > 1).cloned();
        self
    }

    /// Marks the shard as held by `copies` ranks of its `split_over` group (at least 1).
    pub fn with_copies(mut self, copies: usize) -> Param {
        self.copies = copies.max(1);
        self
    }

    /// Overrides the default decay/trust rule.
    pub fn with_adapt(mut self, adapt: bool) -> Param {
        self.adapt = adapt;
        self
    }
}

/// The trainable variables of a `VarStore`, sorted by name (every rank then sees the same
/// order), with the default decay/trust rule.
pub fn params_of(vs: &tch::nn::VarStore) -> Vec<Param> {
    let mut named: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named.into_iter().map(|(n, t)| Param::new(n, &t)).collect()
}

/// What every optimizer offers.
pub trait Optimizer {
    /// Applies one update from the parameters' current gradients.
    fn step(&mut self) -> Result<()>;
    /// The learning rate of the next step.
    fn lr(&self) -> f64;
    /// Sets the learning rate (schedules call this before each step).
    fn set_lr(&mut self, lr: f64);
    /// The parameters being optimized.
    fn params(&self) -> &[Param];
    /// Bytes held in optimizer state (moments, momentum buffers) on this rank.
    fn state_bytes(&self) -> usize;
    /// The state for a checkpoint, as named tensors: `{param}.{slot}` per parameter that has
    /// state, plus counters such as `step`.
    fn state(&self) -> Vec<(String, Tensor)>;
    /// Restores what [`Optimizer::state`] returned; takes the entries it uses out of `state`.
    /// A missing or mis-shaped entry is an error naming it.
    fn load_state(&mut self, state: &mut StateDict) -> Result<()>;
    /// Clears every parameter's gradient.
    fn zero_grad(&mut self) {
        for p in self.params() {
            let mut g = p.tensor.grad();
            // Gradients may be views into a flat buffer (Gemini's chunks), which cannot be
            // detached in place; they carry no history to detach from anyway.
            if g.defined() {
                let _ = tch::no_grad(|| g.zero_());
            }
        }
    }
}

impl<T: Optimizer + ?Sized> Optimizer for Box<T> {
    fn step(&mut self) -> Result<()> {
        (**self).step()
    }
    fn lr(&self) -> f64 {
        (**self).lr()
    }
    fn set_lr(&mut self, lr: f64) {
        (**self).set_lr(lr)
    }
    fn params(&self) -> &[Param] {
        (**self).params()
    }
    fn state_bytes(&self) -> usize {
        (**self).state_bytes()
    }
    fn state(&self) -> Vec<(String, Tensor)> {
        (**self).state()
    }
    fn load_state(&mut self, state: &mut StateDict) -> Result<()> {
        (**self).load_state(state)
    }
}

/// The L2 norms of `a` and `b`, two tensors shaped like parameter `p` (the weight and its
/// update or gradient: the tensor optimizers' trust ratios), as f64. For a tensor-parallel
/// shard the squares are summed over its group first, so the ratio is the whole parameter's,
/// as in one process: one all-reduce of two numbers per split parameter.
pub(crate) fn norms(p: &Param, a: &Tensor, b: &Tensor) -> Result<(f64, f64)> {
    let Some(group) = &p.split_over else { return whole_norms(a, b) };
    let squares = Tensor::f_stack(&[clip::square_sum(a)?, clip::square_sum(b)?], 0)?.f_div_scalar(p.copies as f64)?;
    group.all_reduce(&squares, crate::dist::ReduceOp::Sum)?;
    let squares = squares.f_to_device(tch::Device::Cpu)?;
    Ok((squares.f_double_value(&[0])?.sqrt(), squares.f_double_value(&[1])?.sqrt()))
}

/// The L2 norms of two whole tensors, as f64 (each computed in the tensors' precision).
pub(crate) fn whole_norms(a: &Tensor, b: &Tensor) -> Result<(f64, f64)> {
    Ok((a.f_norm()?.f_double_value(&[])?, b.f_norm()?.f_double_value(&[])?))
}
