//! Optimizers (AdamW, LAMB, LARS), learning-rate schedules, gradient clipping and mixed
//! precision (fp32 master weights, dynamic loss scaling).
//!
//! Each optimizer updates a list of [`Param`]s in place from their `.grad`, skipping
//! parameters without a gradient. Following common practice (timm, the LAMB paper's BERT
//! setup), weight decay and the layer-wise trust ratio apply only to parameters marked
//! `adapt`: by default every parameter of two or more dimensions, so biases and normalisation
//! weights are left alone.
mod adamw;
mod clip;
mod lamb;
mod lars;
mod moments;
pub mod precision;
pub mod schedule;

pub use adamw::{AdamW, AdamWConfig};
pub use clip::clip_grad_norm;
pub use lamb::{Lamb, LambConfig};
pub use lars::{Lars, LarsConfig};
pub use precision::{LossScaler, MasterWeights};
pub use schedule::{Decay, LrSchedule};

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
}

impl Param {
    /// A parameter with the default rule: adapted unless it has fewer than two dimensions.
    pub fn new(name: impl Into<String>, tensor: &Tensor) -> Param {
        Param { name: name.into(), adapt: tensor.dim() >= 2, tensor: tensor.shallow_clone() }
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
    /// Clears every parameter's gradient.
    fn zero_grad(&mut self) {
        for p in self.params() {
            let mut g = p.tensor.grad();
            if g.defined() {
                let _ = g.detach_().zero_();
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
}

/// ||w|| / ||u||, or 1 where either norm is zero (the LAMB/LARS convention).
pub(crate) fn trust_ratio(numerator: f64, denominator: f64) -> f64 {
    if numerator > 0.0 && denominator > 0.0 {
        numerator / denominator
    } else {
        1.0
    }
}

/// The L2 norm of a tensor as f64.
pub(crate) fn norm(t: &Tensor) -> Result<f64> {
    Ok(t.f_norm()?.f_double_value(&[])?)
}

/// Lazily created per-parameter state tensors (moments, momentum buffers).
pub(crate) fn state_for<'a>(slot: &'a mut Option<Tensor>, like: &Tensor) -> Result<&'a mut Tensor> {
    if slot.is_none() {
        *slot = Some(like.f_zeros_like()?);
    }
    Ok(slot.as_mut().expect("just filled"))
}

/// Bytes of a list of lazily created state tensors.
pub(crate) fn bytes_of(states: &[Option<Tensor>]) -> usize {
    states.iter().flatten().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
}
