//! Activation checkpointing: run a segment without keeping its activations and recompute it
//! during backward (PyTorch's reentrant `torch.utils.checkpoint`). The generator state is
//! restored for the recomputation, so dropout draws the same masks.
use std::sync::{Arc, Mutex};

use tch::{Device, Tensor};

use crate::autograd::function::{apply, backward, Forward};
use crate::ffi::{self, check, RawTensor};
use crate::Result;

type Segment = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send;

/// Runs `segment` on `inputs` without saving its intermediate activations; backward recomputes
/// it. Gradients of parameters used inside the segment are accumulated into their `.grad`
/// during that recomputation (as with PyTorch's reentrant checkpoint, use `backward`, not
/// `grad`, for them). Backward runs through the outputs that were used only, so that a
/// parameter reaching none of them gets no gradient, as without checkpointing (not a zero one,
/// which an optimizer would step).
pub fn checkpoint(
    inputs: &[&Tensor],
    segment: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + 'static,
) -> Result<Vec<Tensor>> {
    // Shared by the forward (now) and the backward (later, possibly on autograd's thread).
    let segment: Arc<Mutex<Box<Segment>>> = Arc::new(Mutex::new(Box::new(segment)));
    let device = inputs.iter().map(|t| t.device()).find(|d| d.is_cuda());
    let needs_grad: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
    let rng = RngState::capture(device)?;
    let recompute = segment.clone();
    apply(
        "checkpoint",
        inputs,
        |ins| {
            let outputs = run(&segment, ins)?;
            let saved = ins.iter().map(|t| t.shallow_clone()).collect();
            // An output nothing used comes back with an undefined gradient, not zeros.
            Ok(Forward { outputs, saved, undefined_grads: true, ..Forward::default() })
        },
        move |grads, saved| {
            if grads.iter().all(|g| !g.defined()) {
                return Ok(saved.iter().map(|_| None).collect());
            }
            let detached: Vec<Tensor> =
                saved.iter().zip(&needs_grad).map(|(t, &rg)| t.detach().set_requires_grad(rg)).collect();
            let now = RngState::capture(device)?;
            rng.restore()?;
            let outputs = tch::with_grad(|| run(&recompute, &detached));
            now.restore()?;
            let outputs = outputs?;
            let (outs, gs): (Vec<&Tensor>, Vec<Option<&Tensor>>) = outputs
                .iter()
                .zip(grads)
                .filter(|(o, g)| o.requires_grad() && g.defined())
                .map(|(o, g)| (o, Some(g)))
                .unzip();
            if !outs.is_empty() {
                backward(&outs, &gs, false)?;
            }
            Ok(detached.iter().map(|t| Some(t.grad()).filter(|g| g.defined())).collect())
        },
    )
}

fn run(segment: &Mutex<Box<Segment>>, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let f = segment.lock().map_err(|_| crate::Error::invalid("checkpointed segment panicked earlier"))?;
    f(inputs)
}

/// The default generators' states of the CPU and, where the segment runs there, one GPU.
struct RngState {
    cpu: Tensor,
    cuda: Option<(i32, Tensor)>,
}

impl RngState {
    fn capture(device: Option<Device>) -> Result<RngState> {
        let cuda = match device {
            Some(Device::Cuda(i)) => Some((i as i32, get_state(i as i32)?)),
            _ => None,
        };
        Ok(RngState { cpu: get_state(-1)?, cuda })
    }

    fn restore(&self) -> Result<()> {
        set_state(-1, &self.cpu)?;
        if let Some((i, s)) = &self.cuda {
            set_state(*i, s)?;
        }
        Ok(())
    }
}

fn get_state(device: i32) -> Result<Tensor> {
    let mut out = std::ptr::null_mut();
    check(unsafe { ffi::eng_rng_get_state(device, &mut out) }, || {
        format!("reading the generator state of device {device}")
    })?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

fn set_state(device: i32, state: &Tensor) -> Result<()> {
    check(unsafe { ffi::eng_rng_set_state(device, state.raw()) }, || {
        format!("setting the generator state of device {device}")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Kind, Tensor};

    /// A two-layer MLP with dropout; parameters captured by the segment.
    fn segment(w1: &Tensor, w2: &Tensor) -> impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + 'static {
        let (w1, w2) = (w1.shallow_clone(), w2.shallow_clone());
        move |x| Ok(vec![x[0].matmul(&w1).gelu("none").dropout(0.5, true).matmul(&w2), x[0].sum(Kind::Float)])
    }

    #[test]
    fn checkpointed_gradients_equal_plain_ones() {
        tch::manual_seed(0);
        let x0 = Tensor::randn([4, 6], (Kind::Float, Device::Cpu));
        let mut w1 = Tensor::randn([6, 8], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut w2 = Tensor::randn([8, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let mut run = |checkpointed: bool| {
            let x = x0.copy().set_requires_grad(true);
            w1.zero_grad();
            w2.zero_grad();
            tch::manual_seed(7);
            let f = segment(&w1, &w2);
            let out = if checkpointed { checkpoint(&[&x], f).unwrap() } else { f(&[x.shallow_clone()]).unwrap() };
            // Draw from the generator between forward and backward: recomputation must not see it.
            let _ = Tensor::rand([5], (Kind::Float, Device::Cpu));
            ((&out[0] * &out[0]).sum(Kind::Float) + &out[1] * 0.5).backward();
            (out[0].copy(), x.grad(), w1.grad().copy(), w2.grad().copy())
        };
        let (y_plain, gx_plain, g1_plain, g2_plain) = run(false);
        let (y_ckpt, gx_ckpt, g1_ckpt, g2_ckpt) = run(true);
        assert!(y_plain.allclose(&y_ckpt, 0.0, 0.0, false), "outputs");
        for (a, b, what) in [(&gx_plain, &gx_ckpt, "input"), (&g1_plain, &g1_ckpt, "w1"), (&g2_plain, &g2_ckpt, "w2")] {
            let diff = (a - b).abs().max().double_value(&[]);
            assert!(diff <= 1e-6, "{what} gradient differs by {diff}");
            assert!(a.abs().sum(Kind::Float).double_value(&[]) > 0.0, "{what} gradient is not trivially zero");
        }
    }

    /// A segment with two outputs, the second unused downstream: `v`, which reaches only that
    /// one, gets no gradient with checkpointing as without; `w` and the input get theirs.
    #[test]
    fn a_parameter_reaching_only_an_unused_output_gets_no_gradient() {
        tch::manual_seed(0);
        let x0 = Tensor::randn([4, 6], (Kind::Float, Device::Cpu));
        let w = Tensor::randn([6, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let v = Tensor::randn([6, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true);
        let run = |checkpointed: bool| {
            let x = x0.copy().set_requires_grad(true);
            crate::autograd::set_grad(&w, None).unwrap();
            crate::autograd::set_grad(&v, None).unwrap();
            let (w, v) = (w.shallow_clone(), v.shallow_clone());
            let f = move |x: &[Tensor]| Ok(vec![x[0].matmul(&w).tanh(), x[0].matmul(&v)]);
            let out = if checkpointed { checkpoint(&[&x], f).unwrap() } else { f(&[x.shallow_clone()]).unwrap() };
            assert!(out[1].requires_grad(), "the unused output is in the graph");
            out[0].square().sum(Kind::Float).backward();
            x.grad()
        };
        let plain = run(false);
        let (w_plain, v_defined_plain) = (w.grad().copy(), v.grad().defined());
        let ckpt = run(true);
        assert!(!v_defined_plain, "plain autograd leaves v's gradient undefined");
        assert!(!v.grad().defined(), "checkpointed, v's gradient is undefined as without");
        assert!((&plain - &ckpt).abs().max().double_value(&[]) <= 1e-6, "input gradient");
        assert!((&w_plain - w.grad()).abs().max().double_value(&[]) <= 1e-6, "w gradient");
    }

    #[test]
    fn checkpoint_of_inputs_without_grad_is_plain_forward() {
        let x = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
        let out = checkpoint(&[&x], |i| Ok(vec![&i[0] * 2.0])).unwrap();
        assert_eq!(out[0].sum(Kind::Float).double_value(&[]), 8.0);
        assert!(!out[0].requires_grad());
    }
}
