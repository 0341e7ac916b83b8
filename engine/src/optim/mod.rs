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
pub use schedule::{scale_lr, Decay, LrSchedule};

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

/// Named state tensors, as read from a checkpoint.
pub type StateDict = std::collections::HashMap<String, Tensor>;

/// `{param}.{slot}` entries for the slots that exist.
pub(crate) fn slots_to_state(params: &[Param], slot: &str, states: &[Option<Tensor>]) -> Vec<(String, Tensor)> {
    params
        .iter()
        .zip(states)
        .filter_map(|(p, s)| s.as_ref().map(|t| (format!("{}.{slot}", p.name), t.shallow_clone())))
        .collect()
}

/// Fills `states` from `{param}.{slot}` entries; a parameter without one starts empty, as in a
/// fresh optimizer (it had no gradient yet when the checkpoint was taken).
pub(crate) fn slots_from_state(
    params: &[Param],
    slot: &str,
    states: &mut [Option<Tensor>],
    dict: &mut StateDict,
) -> Result<()> {
    for (p, s) in params.iter().zip(states.iter_mut()) {
        let key = format!("{}.{slot}", p.name);
        *s = match dict.remove(&key) {
            Some(t) => {
                crate::error::ensure!(
                    t.size() == p.tensor.size(),
                    "optimizer state {key} has shape {:?}, the parameter {:?}",
                    t.size(),
                    p.tensor.size()
                );
                Some(t.f_to_kind(p.tensor.kind())?.f_to_device(p.tensor.device())?)
            }
            None => None,
        };
    }
    Ok(())
}

/// Takes a scalar counter such as `step` out of a state dict.
pub(crate) fn counter_from_state(dict: &mut StateDict, key: &str) -> Result<i64> {
    let t = dict.remove(key).ok_or_else(|| crate::Error::invalid(format!("optimizer state has no {key}")))?;
    Ok(t.f_int64_value(&[])?)
}

/// Bytes of a list of lazily created state tensors.
pub(crate) fn bytes_of(states: &[Option<Tensor>]) -> usize {
    states.iter().flatten().map(|t| t.numel() * t.kind().elt_size_in_bytes()).sum()
}
