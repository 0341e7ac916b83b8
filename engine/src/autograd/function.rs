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
    /// Whether backward gets the gradient of an output nothing used as undefined (`defined()`
    /// false), as PyTorch's `ctx.set_materialize_grads(False)` leaves it, rather than as zeros:
    /// for a backward whose result depends on which outputs were used (checkpointing).
    pub undefined_grads: bool,
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
    let materialize_grads = !fwd.undefined_grads as c_int;
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
                materialize_grads,
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
        Err(panic) => c_error(&format!("{name}: panicked: {}", crate::failure::panic_message(&*panic))),
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

/// Sets (or, with `None`, clears) the `.grad` of a tensor, e.g. to give a parameter that took
/// no part in this step the gradient its peers computed.
pub fn set_grad(tensor: &Tensor, grad: Option<&Tensor>) -> Result<()> {
    let g = grad.map_or(std::ptr::null_mut(), |g| g.raw());
    check(unsafe { ffi::eng_set_grad(tensor.raw(), g) }, || "setting a gradient".to_string())
}

/// Backward from `outputs` with the given output gradients (`None`: an implicit one for a
/// scalar). Unlike `Tensor::backward`, errors (including those raised inside custom backwards)
/// are returned, not panicked.
pub fn backward(outputs: &[&Tensor], grads: &[Option<&Tensor>], keep_graph: bool) -> Result<()> {
    crate::error::ensure!(
        outputs.len() == grads.len(),
        "backward: {} outputs but {} gradients",
        outputs.len(),
        grads.len()
    );
    let mut outs: Vec<_> = outputs.iter().map(|t| t.raw()).collect();
    let mut gs: Vec<_> = grads.iter().map(|g| g.map_or(std::ptr::null_mut(), |t| t.raw())).collect();
    check(
        unsafe { ffi::eng_backward(outs.as_mut_ptr(), gs.as_mut_ptr(), outs.len() as c_int, keep_graph as c_int) },
        || "backward".to_string(),
    )
}

/// Gradients of `outputs` (with output gradients `grads`, as in [`backward`]) with respect to
/// `inputs` only, returned rather than accumulated: no `.grad` changes (`torch.autograd.grad`).
/// An input the outputs do not depend on gets `None`. With `keep_graph` the graph survives for
/// a later pass, as the pipeline's split backward needs.
pub fn grad(
    outputs: &[&Tensor],
    grads: &[Option<&Tensor>],
    inputs: &[&Tensor],
    keep_graph: bool,
) -> Result<Vec<Option<Tensor>>> {
    let mut results = vec![std::ptr::null_mut(); inputs.len()];
    restricted(outputs, grads, inputs, keep_graph, false, &mut results)?;
    // SAFETY: the bridge filled each slot with a new heap tensor we now own, or left it null.
    Ok(results.into_iter().map(|p| (!p.is_null()).then(|| unsafe { Tensor::from_ptr(p) })).collect())
}

/// Backward from `outputs` that accumulates into the `.grad` of `inputs` only
/// (`torch.autograd.backward(..., inputs=)`): the weight pass of a split backward.
pub fn backward_into(
    outputs: &[&Tensor],
    grads: &[Option<&Tensor>],
    inputs: &[&Tensor],
    keep_graph: bool,
) -> Result<()> {
    restricted(outputs, grads, inputs, keep_graph, true, &mut [])
}

fn restricted(
    outputs: &[&Tensor],
    grads: &[Option<&Tensor>],
    inputs: &[&Tensor],
    keep_graph: bool,
    accumulate: bool,
    results: &mut [*mut C_tensor],
) -> Result<()> {
    crate::error::ensure!(
        outputs.len() == grads.len(),
        "backward: {} outputs but {} gradients",
        outputs.len(),
        grads.len()
    );
    crate::error::ensure!(!inputs.is_empty(), "backward restricted to inputs: no inputs given");
    let mut outs: Vec<_> = outputs.iter().map(|t| t.raw()).collect();
    let mut gs: Vec<_> = grads.iter().map(|g| g.map_or(std::ptr::null_mut(), |t| t.raw())).collect();
    let mut ins: Vec<_> = inputs.iter().map(|t| t.raw()).collect();
    check(
        unsafe {
            ffi::eng_grad(
                outs.as_mut_ptr(),
                gs.as_mut_ptr(),
                outs.len() as c_int,
                ins.as_mut_ptr(),
                ins.len() as c_int,
                keep_graph as c_int,
                accumulate as c_int,
                results.as_mut_ptr(),
            )
        },
        || format!("backward restricted to {} inputs", inputs.len()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn leaf(values: &[f32]) -> Tensor {
        Tensor::from_slice(values).set_requires_grad(true)
    }

    /// y = x^3 with a hand-written backward 3 x^2 g, against the analytic gradient.
    fn cube(x: &Tensor) -> Tensor {
        let out = apply(
            "cube",
            &[x],
            |i| {
                Ok(Forward {
                    outputs: vec![i[0].pow_tensor_scalar(3)],
                    saved: vec![i[0].shallow_clone()],
                    ..Forward::default()
                })
            },
            |g, saved| Ok(vec![Some(&g[0] * saved[0].pow_tensor_scalar(2) * 3.0)]),
        )
        .unwrap();
        out.into_iter().next().unwrap()
    }

    #[test]
    fn gradient_of_a_custom_function_is_analytic() {
        let x = leaf(&[1.0, -2.0, 0.5]);
        let y = cube(&x);
        assert_eq!(Vec::<f32>::try_from(&y).unwrap(), vec![1.0, -8.0, 0.125]);
        (y * Tensor::from_slice(&[1.0f32, 2.0, 3.0])).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(x.grad()).unwrap(), vec![3.0, 24.0, 2.25]);
    }

    #[test]
    fn several_inputs_outputs_and_a_non_differentiable_output() {
        let (a, b) = (leaf(&[1.0, 2.0]), leaf(&[3.0, 5.0]));
        // (a * b, a + b, argmax) with d(ab)/da = b, d(ab)/db = a.
        let out = apply(
            "mul_add",
            &[&a, &b],
            |i| {
                Ok(Forward {
                    outputs: vec![&i[0] * &i[1], &i[0] + &i[1], i[0].argmax(0, false)],
                    saved: vec![i[0].shallow_clone(), i[1].shallow_clone()],
                    non_differentiable: vec![2],
                    ..Forward::default()
                })
            },
            |g, s| Ok(vec![Some(&g[0] * &s[1] + &g[1]), Some(&g[0] * &s[0] + &g[1])]),
        )
        .unwrap();
        assert!(!out[2].requires_grad(), "marked output has no gradient");
        assert!(out[0].requires_grad() && out[1].requires_grad());
        (&out[0] * 2.0 + &out[1]).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(a.grad()).unwrap(), vec![7.0, 11.0]);
        assert_eq!(Vec::<f32>::try_from(b.grad()).unwrap(), vec![3.0, 5.0]);
    }

    #[test]
    fn an_output_that_is_its_input_keeps_the_graph() {
        let x = leaf(&[2.0]);
        let y = apply(
            "identity",
            &[&x],
            |i| Ok(Forward::outputs(vec![i[0].shallow_clone()])),
            |g, _| Ok(vec![Some(&g[0] * 10.0)]),
        )
        .unwrap();
        (&y[0] * 1.0).sum(Kind::Float).backward();
        assert_eq!(Vec::<f32>::try_from(x.grad()).unwrap(), vec![10.0]);
    }

    #[test]
    fn errors_and_panics_in_backward_become_errors() {
        let x = leaf(&[1.0]);
        let y = apply("wrong_count", &[&x], |i| Ok(Forward::outputs(vec![&i[0] * 2.0])), |_, _| Ok(vec![])).unwrap();
        let err = backward(&[&y[0].sum(Kind::Float)], &[None], false).unwrap_err().to_string();
        assert!(err.contains("backward of wrong_count") && err.contains("0 gradients for 1 inputs"), "{err}");

        let y = apply("panics", &[&x], |i| Ok(Forward::outputs(vec![&i[0] * 2.0])), |_, _| panic!("boom")).unwrap();
        let err = backward(&[&y[0].sum(Kind::Float)], &[None], false).unwrap_err().to_string();
        assert!(err.contains("backward of panics: panicked: boom"), "{err}");
    }

    #[test]
    fn backward_with_explicit_output_gradients() {
        let x = leaf(&[1.0, 2.0]);
        let y = cube(&x);
        let g = Tensor::from_slice(&[1.0f32, 0.5]);
        backward(&[&y], &[Some(&g)], false).unwrap();
        assert_eq!(Vec::<f32>::try_from(x.grad()).unwrap(), vec![3.0, 6.0]);
        let err = backward(&[&y], &[], false).unwrap_err().to_string();
        assert!(err.contains("1 outputs but 0 gradients"), "{err}");
    }

    #[test]
    fn gradients_wrt_chosen_inputs_then_the_rest() {
        // y = (x w)^2 summed: dy/dx = 2 x w^2, dy/dw = 2 x^2 w.
        let (x, w) = (leaf(&[3.0]), leaf(&[2.0]));
        let y = (&x * &w).square().sum(Kind::Float);
        let gx = grad(&[&y], &[None], &[&x], true).unwrap();
        assert_eq!(Vec::<f32>::try_from(gx[0].as_ref().unwrap()).unwrap(), vec![24.0]);
        assert!(!x.grad().defined() && !w.grad().defined(), "grad() accumulates nothing");
        backward_into(&[&y], &[None], &[&w], false).unwrap();
        assert_eq!(Vec::<f32>::try_from(w.grad()).unwrap(), vec![36.0]);
        assert!(!x.grad().defined(), "only the chosen inputs accumulate");
        let unused = leaf(&[1.0]);
        let z = (&x * 2.0).sum(Kind::Float);
        assert!(grad(&[&z], &[None], &[&unused], false).unwrap()[0].is_none());
    }

    #[test]
    fn inputs_without_grad_make_no_node() {
        let x = Tensor::from_slice(&[1.0f32]).to_device(Device::Cpu);
        let y = cube(&x);
        assert!(!y.requires_grad());
    }
}
