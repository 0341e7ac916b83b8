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
