//! Hooks that run when a parameter's gradient has been accumulated into `.grad` during
//! backward (PyTorch's `register_post_accumulate_grad_hook`). Data parallelism uses them to
//! launch a bucket's all-reduce as soon as its last gradient is ready.
use std::ffi::{c_char, c_void};

use tch::Tensor;
use torch_sys::C_tensor;

use crate::autograd::function::guard;
use crate::ffi::{self, check, RawTensor};
use crate::Result;

type Hook = Box<dyn FnMut(&Tensor) -> Result<()> + Send>;

/// Registers `hook` on a leaf tensor that requires grad; it receives the tensor (whose `grad()`
/// now holds the accumulated gradient). Hooks run in registration order, for the tensor's
/// lifetime. An error from a hook fails the backward call.
pub fn register_post_accumulate_grad_hook(
    tensor: &Tensor,
    hook: impl FnMut(&Tensor) -> Result<()> + Send + 'static,
) -> Result<()> {
    let state = Box::into_raw(Box::new(Box::new(hook) as Hook)) as *mut c_void;
    check(unsafe { ffi::eng_add_post_accumulate_hook(tensor.raw(), state, call_hook, drop_hook) }, || {
        "registering a gradient hook".to_string()
    })
}

unsafe extern "C" fn call_hook(state: *mut c_void, tensor: *mut C_tensor) -> *mut c_char {
    let hook = unsafe { &mut *(state as *mut Hook) };
    guard("gradient hook", || {
        let t = unsafe { Tensor::from_ptr(torch_sys::at_shallow_clone(tensor)) };
        hook(&t)
    })
}

unsafe extern "C" fn drop_hook(state: *mut c_void) {
    drop(unsafe { Box::from_raw(state as *mut Hook) });
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use tch::Kind;

    #[test]
    fn hooks_run_after_accumulation_in_order() {
        let w = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let seen = Arc::new(Mutex::new(Vec::new()));
        for tag in ["first", "second"] {
            let seen = seen.clone();
            register_post_accumulate_grad_hook(&w, move |t| {
                seen.lock().unwrap().push((tag, Vec::<f32>::try_from(t.grad()).unwrap()));
                Ok(())
            })
            .unwrap();
        }
        (&w * 3.0).sum(Kind::Float).backward();
        (&w * 1.0).sum(Kind::Float).backward();
        let seen = seen.lock().unwrap();
        // The hook sees the accumulated gradient: 3, then 3 + 1.
        assert_eq!(
            *seen,
            vec![
                ("first", vec![3.0, 3.0]),
                ("second", vec![3.0, 3.0]),
                ("first", vec![4.0, 4.0]),
                ("second", vec![4.0, 4.0])
            ]
        );
    }

    #[test]
    fn a_failing_hook_fails_backward_and_non_leaves_are_refused() {
        let w = Tensor::from_slice(&[1.0f32]).set_requires_grad(true);
        register_post_accumulate_grad_hook(&w, |_| Err(crate::Error::invalid("bucket full"))).unwrap();
        let err = crate::autograd::backward(&[&(&w * 2.0).sum(Kind::Float)], &[None], false).unwrap_err();
        assert!(err.to_string().contains("gradient hook: bucket full"), "{err}");
        let err = register_post_accumulate_grad_hook(&(&w * 2.0), |_| Ok(())).unwrap_err();
        assert!(err.to_string().contains("leaf tensors"), "{err}");
    }
}
