//! Custom autograd functions written in Rust: the forward runs here without autograd, and one
//! C++ `torch::autograd::Function` (csrc/autograd.cpp) connects its outputs to the graph through
//! a node whose backward calls the Rust closure.
use std::ffi::{c_char, c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

use tch::Tensor;
use torch_sys::C_tensor;

use crate::ffi::{self, c_error, check, RawTensor};
use crate::{Error, Result};

/// What a forward computed.
#[derive(Debug, Default)]
pub struct Forward {
    /// The function's outputs.
    pub outputs: Vec<Tensor>,
    /// Tensors the backward needs, handed back to it. Saved through autograd's own mechanism
    /// (so saving an output makes no reference cycle, and in-place changes are detected).
    pub saved: Vec<Tensor>,
    /// Indices of outputs that have no gradient (indices, masks).
    pub non_differentiable: Vec<usize>,
}

impl Forward {
    /// Outputs with nothing saved.
    pub fn outputs(outputs: Vec<Tensor>) -> Forward {
        Forward { outputs, ..Forward::default() }
    }
}

/// A backward: given the gradients of the outputs and the saved tensors, the gradient of each
/// input (`None` where an input gets none). May be called more than once when the graph is
/// retained.
pub type Backward = dyn FnMut(&[Tensor], &[Tensor]) -> Result<Vec<Option<Tensor>>> + Send;

struct State {
    name: &'static str,
    backward: Box<Backward>,
}

/// Applies a custom function. `forward` sees the inputs and runs without autograd recording;
/// `backward` must return exactly one entry per input. Errors in backward surface as an error
/// of the backward call that reached this node, naming the function.
pub fn apply(
    name: &'static str,
    inputs: &[&Tensor],
    forward: impl FnOnce(&[Tensor]) -> Result<Forward>,
    backward: impl FnMut(&[Tensor], &[Tensor]) -> Result<Vec<Option<Tensor>>> + Send + 'static,
) -> Result<Vec<Tensor>> {
    // Shallow clones share the TensorImpl, so an output that *is* an input is recognised as such.
    let shared: Vec<Tensor> = inputs.iter().map(|t| t.shallow_clone()).collect();
    let fwd = tch::no_grad(|| forward(&shared))?;
    for &i in &fwd.non_differentiable {
        crate::error::ensure!(i < fwd.outputs.len(), "{name}: non-differentiable output {i} of {}", fwd.outputs.len());
    }
    let mut in_ptrs: Vec<*mut C_tensor> = inputs.iter().map(|t| t.raw()).collect();
    let mut out_ptrs: Vec<*mut C_tensor> = fwd.outputs.iter().map(|t| t.raw()).collect();
    let mut saved_ptrs: Vec<*mut C_tensor> = fwd.saved.iter().map(|t| t.raw()).collect();
    let nondiff: Vec<i64> = fwd.non_differentiable.iter().map(|&i| i as i64).collect();
    let state = Box::into_raw(Box::new(State { name, backward: Box::new(backward) })) as *mut c_void;
    let mut results = vec![std::ptr::null_mut(); out_ptrs.len()];
    check(
        unsafe {
            ffi::eng_function_apply(
                in_ptrs.as_mut_ptr(),
                in_ptrs.len() as c_int,
                out_ptrs.as_mut_ptr(),
                out_ptrs.len() as c_int,
                saved_ptrs.as_mut_ptr(),
                saved_ptrs.len() as c_int,
                nondiff.as_ptr(),
                nondiff.len() as c_int,
                state,
                backward_trampoline,
                drop_state,
                results.as_mut_ptr(),
            )
        },
        || format!("applying autograd function {name}"),
    )?;
    // SAFETY: on success the bridge filled every slot with a new heap tensor we now own.
    Ok(results.into_iter().map(|p| unsafe { Tensor::from_ptr(p) }).collect())
}

/// Owned copies of tensors the bridge lends us (pointers into a C++ vector).
pub(crate) unsafe fn borrow_tensors(ptrs: *mut *mut C_tensor, n: c_int) -> Vec<Tensor> {
    (0..n as usize).map(|i| unsafe { Tensor::from_ptr(torch_sys::at_shallow_clone(*ptrs.add(i))) }).collect()
}

/// Runs a Rust callback for the bridge: errors and panics become a C error message.
pub(crate) fn guard(name: &str, f: impl FnOnce() -> Result<()>) -> *mut c_char {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => std::ptr::null_mut(),
        Ok(Err(e)) => c_error(&format!("{name}: {e}")),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "panic".into());
            c_error(&format!("{name}: panicked: {what}"))
        }
    }
}

unsafe extern "C" fn backward_trampoline(
    state: *mut c_void,
    grads: *mut *mut C_tensor,
    ngrads: c_int,
    saved: *mut *mut C_tensor,
    nsaved: c_int,
    grad_inputs: *mut *mut C_tensor,
    ninputs: c_int,
) -> *mut c_char {
    let state = unsafe { &mut *(state as *mut State) };
    guard(&format!("backward of {}", state.name), || {
        let grads = unsafe { borrow_tensors(grads, ngrads) };
        let saved = unsafe { borrow_tensors(saved, nsaved) };
        let result = (state.backward)(&grads, &saved)?;
        if result.len() != ninputs as usize {
            return Err(Error::invalid(format!("returned {} gradients for {ninputs} inputs", result.len())));
        }
        for (i, g) in result.into_iter().enumerate() {
            if let Some(mut g) = g {
                // Ownership passes to the bridge, which moves the tensor out and deletes the box.
                unsafe { *grad_inputs.add(i) = g.as_mut_ptr() };
                std::mem::forget(g);
            }
        }
        Ok(())
    })
}

unsafe extern "C" fn drop_state(state: *mut c_void) {
    drop(unsafe { Box::from_raw(state as *mut State) });
}

/// Backward from `outputs` with the given output gradients (`None`: an implicit one for a
/// scalar). Unlike `Tensor::backward`, errors (including those raised inside custom backwards)
/// are returned, not panicked.
pub fn backward(outputs: &[&Tensor], grads: &[Option<&Tensor>], keep_graph: bool) -> Result<()> {
    crate::error::ensure!(outputs.len() == grads.len(), "backward: {} outputs but {} gradients", outputs.len(), grads.len());
    let mut outs: Vec<_> = outputs.iter().map(|t| t.raw()).collect();
    let mut gs: Vec<_> = grads.iter().map(|g| g.map_or(std::ptr::null_mut(), |t| t.raw())).collect();
    check(
        unsafe { ffi::eng_backward(outs.as_mut_ptr(), gs.as_mut_ptr(), outs.len() as c_int, keep_graph as c_int) },
        || "backward".to_string(),
    )
}
