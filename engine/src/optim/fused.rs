//! An optional multi-tensor implementation of the rules' steps, installed by an app that has
//! one: the `kernels` crate's fused CUDA launches (that crate builds on the engine, so the
//! engine reaches it only through this trait). While one is installed, the tensor optimizers
//! ([`super::AdamW`], [`super::Lamb`], [`super::Lars`]) hand it all the parameters of a step
//! in one call when it accepts every tensor, and step them one by one with tensor operations
//! otherwise: CPU tensors, parameters whose trust-ratio norms span a tensor-parallel group
//! (`Param::split_over`), or LARS momentum buffers of which some are new and some not. Data
//! parallelism and ZeRO step through those optimizers, so they use it too.
//!
//! It is process-wide, as one run has one `--kernels` choice; [`install`] replaces it.
//!
//! [`Rule::step`] is the same step with tensor operations, tensor by tensor: the rules' own
//! arithmetic (as the flat executors round it), which an implementation runs where it has no
//! kernel and its kernels are checked against.
use std::sync::{Arc, RwLock};

use tch::Tensor;

use super::state::state_for;
use super::{whole_norms, AdamWConfig, LambConfig, LarsConfig, Param};
use crate::{Error, Result};

/// One parameter's tensors for a multi-tensor step, updated in place.
#[derive(Debug)]
pub struct StepTensors<'a> {
    /// The weight.
    pub param: &'a Tensor,
    /// Its gradient.
    pub grad: &'a Tensor,
    /// The rule's state: Adam's first and second moments; LARS's momentum buffer and nothing
    /// (nothing at all without momentum).
    pub state: [Option<&'a Tensor>; 2],
    /// Whether weight decay and the trust ratio apply.
    pub adapt: bool,
}

/// A rule and its hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    /// AdamW.
    AdamW(AdamWConfig),
    /// LAMB.
    Lamb(LambConfig),
    /// LARS.
    Lars(LarsConfig),
}

impl Rule {
    /// Step `step` of the rule over `tensors`, as [`MultiTensorSteps::step`] takes them, with
    /// tensor operations one tensor at a time: each rule's arithmetic rounded as the flat
    /// executors round it (no multiply-add contracted), and whole tensors' norms. A state slot
    /// the rule needs that is missing is an error naming the tensor.
    pub fn step(&self, tensors: &[StepTensors], step: i32) -> Result<()> {
        tch::no_grad(|| {
            for (i, t) in tensors.iter().enumerate() {
                let state = |slot: usize| -> Result<Tensor> {
                    let s = t.state[slot].ok_or_else(|| {
                        Error::invalid(format!("{self:?} step: tensor {i} has no state in slot {slot}"))
                    })?;
                    Ok(s.shallow_clone())
                };
                let mut w = t.param.shallow_clone();
                match *self {
                    Rule::AdamW(c) => {
                        let (mut m, mut v) = (state(0)?, state(1)?);
                        c.at::<f64>(step, t.adapt).step(&mut w, &mut m, &mut v, t.grad)?;
                    }
                    Rule::Lamb(c) => {
                        let rule = c.at::<f64>(step, t.adapt);
                        let (mut m, mut v) = (state(0)?, state(1)?);
                        rule.adam.moments(&mut m, &mut v, t.grad)?;
                        let r = rule.update(&w, &m, &v)?;
                        let norms = if t.adapt { Some(whole_norms(&w, &r)?) } else { None };
                        rule.apply(&mut w, &r, rule.scale(norms))?;
                    }
                    Rule::Lars(c) => {
                        let norms = if t.adapt { Some(whole_norms(&w, t.grad)?) } else { None };
                        let mut buf = if c.momentum != 0.0 { Some(state(0)?) } else { None };
                        c.at::<f64>(norms).step(&mut w, buf.as_mut().map(|b| (b, step == 1)), t.grad)?;
                    }
                }
            }
            Ok(())
        })
    }
}

/// A multi-tensor implementation of the rules.
pub trait MultiTensorSteps: Send + Sync + std::fmt::Debug {
    /// Whether it can step this tensor (device, dtype, layout).
    fn accepts(&self, t: &Tensor) -> bool;
    /// Step `step` (from 1: Adam's bias correction) of `rule` over every tensor, with whole
    /// tensors' norms. For LARS, step 1 means the momentum buffers start (they are set to the
    /// first update) and any other value that they continue.
    fn step(&self, rule: Rule, tensors: &[StepTensors], step: i32) -> Result<()>;
}

static INSTALLED: RwLock<Option<Arc<dyn MultiTensorSteps>>> = RwLock::new(None);

/// Installs `steps` for the tensor optimizers of this process (`None`: tensor operations only).
pub fn install(steps: Option<Arc<dyn MultiTensorSteps>>) {
    *INSTALLED.write().unwrap_or_else(|p| p.into_inner()) = steps;
}

/// The installed implementation, if any.
pub fn installed() -> Option<Arc<dyn MultiTensorSteps>> {
    INSTALLED.read().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Runs one step of `rule` over the parameters that have a gradient through the installed
/// implementation, when there is one and it accepts them all; returns whether it did (the
/// caller then steps them itself). `states` are the parameters' state slots (one or two per
/// parameter; created as zeros like the gradient here when `create` says the rule keeps them),
/// `step` as [`MultiTensorSteps::step`] takes it.
pub(crate) fn try_step(
    rule: Rule,
    params: &[Param],
    states: [&mut [Option<Tensor>]; 2],
    create: [bool; 2],
    step: i32,
) -> Result<bool> {
    let Some(steps) = installed() else { return Ok(false) };
    let grads: Vec<(usize, Tensor)> =
        params.iter().enumerate().map(|(i, p)| (i, p.tensor.grad())).filter(|(_, g)| g.defined()).collect();
    if grads.is_empty() || params.iter().any(|p| p.split_over.is_some()) {
        return Ok(false);
    }
    let [first, second] = states;
    // Everything is checked before any state is created: a caller that steps the tensors
    // itself must find them as it left them.
    let accepts = |s: &Option<Tensor>| s.as_ref().is_none_or(|s| steps.accepts(s));
    let accepted = grads.iter().all(|(i, g)| {
        steps.accepts(&params[*i].tensor) && steps.accepts(g) && accepts(&first[*i]) && accepts(&second[*i])
    });
    if !accepted {
        return Ok(false);
    }
    for &(i, ref g) in &grads {
        if create[0] {
            state_for(&mut first[i], g)?;
        }
        if create[1] {
            state_for(&mut second[i], g)?;
        }
    }
    let tensors: Vec<StepTensors> = grads
        .iter()
        .map(|(i, g)| StepTensors {
            param: &params[*i].tensor,
            grad: g,
            state: [first[*i].as_ref(), second[*i].as_ref()],
            adapt: params[*i].adapt,
        })
        .collect();
    tch::no_grad(|| steps.step(rule, &tensors, step))?;
    Ok(true)
}
