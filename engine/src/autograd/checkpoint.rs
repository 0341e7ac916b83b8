//! Activation checkpointing: run a segment without keeping its activations and recompute it
//! during backward (PyTorch's reentrant `torch.utils.checkpoint`). The generator state is
//! restored for the recomputation, so dropout draws the same masks.
use std::sync::Arc;

use tch::{Device, Tensor};

use crate::autograd::function::{apply, backward, Forward};
use crate::ffi::{self, check, RawTensor};
use crate::Result;

type Segment = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync;

/// Runs `segment` on `inputs` without saving its intermediate activations; backward recomputes
/// it. Gradients of parameters used inside the segment are accumulated into their `.grad`
/// during that recomputation (as with PyTorch's reentrant checkpoint, use `backward`, not
/// `grad`, for them).
pub fn checkpoint(
    inputs: &[&Tensor],
    segment: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
) -> Result<Vec<Tensor>> {
    let segment: Arc<Segment> = Arc::new(segment);
    let device = inputs.iter().map(|t| t.device()).find(|d| d.is_cuda());
    let needs_grad: Vec<bool> = inputs.iter().map(|t| t.requires_grad()).collect();
    let rng = RngState::capture(device)?;
    let recompute = segment.clone();
    apply(
        "checkpoint",
        inputs,
        |ins| {
            let outputs = segment(ins)?;
            Ok(Forward { outputs, saved: ins.iter().map(|t| t.shallow_clone()).collect(), non_differentiable: vec![] })
        },
        move |grads, saved| {
            let detached: Vec<Tensor> = saved
                .iter()
                .zip(&needs_grad)
                .map(|(t, &rg)| t.detach().set_requires_grad(rg))
                .collect();
            let now = RngState::capture(device)?;
            rng.restore()?;
            let outputs = tch::with_grad(|| recompute(&detached));
            now.restore()?;
            let outputs = outputs?;
            let (outs, gs): (Vec<&Tensor>, Vec<Option<&Tensor>>) =
                outputs.iter().zip(grads).filter(|(o, _)| o.requires_grad()).map(|(o, g)| (o, Some(g))).unzip();
            if !outs.is_empty() {
                backward(&outs, &gs, false)?;
            }
            Ok(detached.iter().map(|t| Some(t.grad()).filter(|g| g.defined())).collect())
        },
    )
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
    check(unsafe { ffi::eng_rng_get_state(device, &mut out) }, || format!("reading the generator state of device {device}"))?;
    Ok(unsafe { Tensor::from_ptr(out) })
}

fn set_state(device: i32, state: &Tensor) -> Result<()> {
    check(unsafe { ffi::eng_rng_set_state(device, state.raw()) }, || format!("setting the generator state of device {device}"))
}
