//! Declarations of the C++ bridge (`csrc/`) and the one place its errors become Rust errors.
#![allow(missing_docs)]

use std::ffi::{c_char, c_int, c_void, CStr};

use torch_sys::C_tensor;

use crate::{Error, Result};

pub enum EngStore {}
pub enum EngGroup {}
pub enum EngWork {}
pub enum EngStream {}
pub enum EngEvent {}

pub type BackwardCb = unsafe extern "C" fn(
    state: *mut c_void,
    grads: *mut *mut C_tensor,
    ngrads: c_int,
    saved: *mut *mut C_tensor,
    nsaved: c_int,
    grad_inputs: *mut *mut C_tensor,
    ninputs: c_int,
) -> *mut c_char;
pub type HookCb = unsafe extern "C" fn(state: *mut c_void, tensor: *mut C_tensor) -> *mut c_char;
pub type DropCb = unsafe extern "C" fn(state: *mut c_void);

extern "C" {
    pub fn eng_free_error(err: *mut c_char);
    pub fn eng_torch_version() -> *const c_char;
    pub fn eng_free_bytes(data: *mut u8);

    pub fn eng_store_tcp(
        host: *const c_char,
        port: u16,
        is_server: c_int,
        workers: c_int,
        timeout_ms: i64,
        bound_port: *mut u16,
        out: *mut *mut EngStore,
    ) -> *mut c_char;
    pub fn eng_store_hash(out: *mut *mut EngStore) -> *mut c_char;
    pub fn eng_store_prefix(base: *mut EngStore, prefix: *const c_char, out: *mut *mut EngStore) -> *mut c_char;
    pub fn eng_store_set(s: *mut EngStore, key: *const c_char, data: *const u8, len: usize) -> *mut c_char;
    pub fn eng_store_get(s: *mut EngStore, key: *const c_char, data: *mut *mut u8, len: *mut usize) -> *mut c_char;
    pub fn eng_store_add(s: *mut EngStore, key: *const c_char, value: i64, out: *mut i64) -> *mut c_char;
    pub fn eng_store_set_timeout(s: *mut EngStore, timeout_ms: i64) -> *mut c_char;
    pub fn eng_store_free(s: *mut EngStore);

    pub fn eng_group_new(
        store: *mut EngStore,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        loopback: c_int,
        out: *mut *mut EngGroup,
    ) -> *mut c_char;
    pub fn eng_group_free(g: *mut EngGroup);
    pub fn eng_allreduce(g: *mut EngGroup, t: *mut C_tensor, op: c_int, out: *mut *mut EngWork) -> *mut c_char;
    pub fn eng_reduce(
        g: *mut EngGroup,
        t: *mut C_tensor,
        root: c_int,
        op: c_int,
        out: *mut *mut EngWork,
    ) -> *mut c_char;
    pub fn eng_broadcast(g: *mut EngGroup, t: *mut C_tensor, root: c_int, out: *mut *mut EngWork) -> *mut c_char;
    pub fn eng_allgather_into(
        g: *mut EngGroup,
        output: *mut C_tensor,
        input: *mut C_tensor,
        out: *mut *mut EngWork,
    ) -> *mut c_char;
    pub fn eng_allgather_list(
        g: *mut EngGroup,
        outputs: *mut *mut C_tensor,
        n: c_int,
        input: *mut C_tensor,
        out: *mut *mut EngWork,
    ) -> *mut c_char;
    pub fn eng_reduce_scatter_into(
        g: *mut EngGroup,
        output: *mut C_tensor,
        input: *mut C_tensor,
        op: c_int,
        out: *mut *mut EngWork,
    ) -> *mut c_char;
    pub fn eng_alltoall(
        g: *mut EngGroup,
        output: *mut C_tensor,
        input: *mut C_tensor,
        out_splits: *const i64,
        in_splits: *const i64,
        nsplits: c_int,
        out: *mut *mut EngWork,
    ) -> *mut c_char;
    pub fn eng_send(g: *mut EngGroup, t: *mut C_tensor, dst: c_int, tag: c_int, out: *mut *mut EngWork) -> *mut c_char;
    pub fn eng_recv(g: *mut EngGroup, t: *mut C_tensor, src: c_int, tag: c_int, out: *mut *mut EngWork) -> *mut c_char;
    pub fn eng_barrier(g: *mut EngGroup, out: *mut *mut EngWork) -> *mut c_char;
    pub fn eng_work_wait(w: *mut EngWork, timeout_ms: i64) -> *mut c_char;
    pub fn eng_work_is_completed(w: *mut EngWork, out: *mut c_int) -> *mut c_char;
    pub fn eng_work_free(w: *mut EngWork);

    #[allow(clippy::too_many_arguments)]
    pub fn eng_function_apply(
        inputs: *mut *mut C_tensor,
        ninputs: c_int,
        outputs: *mut *mut C_tensor,
        noutputs: c_int,
        saved: *mut *mut C_tensor,
        nsaved: c_int,
        nondiff: *const i64,
        nnondiff: c_int,
        materialize_grads: c_int,
        state: *mut c_void,
        backward: BackwardCb,
        drop: DropCb,
        results: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn eng_add_post_accumulate_hook(
        t: *mut C_tensor,
        state: *mut c_void,
        call: HookCb,
        drop: DropCb,
    ) -> *mut c_char;
    pub fn eng_backward(
        outputs: *mut *mut C_tensor,
        grads: *mut *mut C_tensor,
        n: c_int,
        keep_graph: c_int,
    ) -> *mut c_char;
    pub fn eng_grad(
        outputs: *mut *mut C_tensor,
        grads: *mut *mut C_tensor,
        n: c_int,
        inputs: *mut *mut C_tensor,
        ninputs: c_int,
        keep_graph: c_int,
        accumulate: c_int,
        results: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn eng_set_grad(t: *mut C_tensor, grad: *mut C_tensor) -> *mut c_char;
    pub fn eng_rng_get_state(device: c_int, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn eng_rng_set_state(device: c_int, state: *mut C_tensor) -> *mut c_char;
}

extern "C" {
    pub fn eng_cuda_device_count() -> c_int;
    pub fn eng_cuda_current_stream(device: c_int, out: *mut *mut EngStream) -> *mut c_char;
    pub fn eng_cuda_stream_from_pool(device: c_int, high_priority: c_int, out: *mut *mut EngStream) -> *mut c_char;
    pub fn eng_cuda_set_current_stream(s: *mut EngStream) -> *mut c_char;
    pub fn eng_cuda_stream_synchronize(s: *mut EngStream) -> *mut c_char;
    pub fn eng_cuda_stream_query(s: *mut EngStream, done: *mut c_int) -> *mut c_char;
    pub fn eng_cuda_stream_wait_event(s: *mut EngStream, e: *mut EngEvent) -> *mut c_char;
    pub fn eng_cuda_stream_id(s: *mut EngStream) -> i64;
    pub fn eng_cuda_stream_device(s: *mut EngStream) -> c_int;
    pub fn eng_cuda_stream_raw(s: *mut EngStream) -> *mut std::ffi::c_void;
    pub fn eng_cuda_stream_free(s: *mut EngStream);
    pub fn eng_cuda_event_new(enable_timing: c_int, out: *mut *mut EngEvent) -> *mut c_char;
    pub fn eng_cuda_event_record(e: *mut EngEvent, s: *mut EngStream) -> *mut c_char;
    pub fn eng_cuda_event_synchronize(e: *mut EngEvent) -> *mut c_char;
    pub fn eng_cuda_event_query(e: *mut EngEvent, done: *mut c_int) -> *mut c_char;
    pub fn eng_cuda_event_elapsed_ms(start: *mut EngEvent, end: *mut EngEvent, ms: *mut f32) -> *mut c_char;
    pub fn eng_cuda_event_free(e: *mut EngEvent);
    pub fn eng_cuda_record_stream(t: *mut C_tensor, s: *mut EngStream) -> *mut c_char;
    pub fn eng_cuda_pin_memory(t: *mut C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
    pub fn eng_cuda_empty_pinned(
        kind_of: *mut C_tensor,
        sizes: *const i64,
        ndim: c_int,
        out: *mut *mut C_tensor,
    ) -> *mut c_char;
    pub fn eng_cuda_copy_async(dst: *mut C_tensor, src: *mut C_tensor) -> *mut c_char;
    pub fn eng_cuda_synchronize(device: c_int) -> *mut c_char;
    pub fn eng_cuda_set_device(device: c_int) -> *mut c_char;
    pub fn eng_cuda_memory_stats(device: c_int, out: *mut i64) -> *mut c_char;
    pub fn eng_cuda_reset_peak_stats(device: c_int) -> *mut c_char;
    pub fn eng_cuda_set_memory_fraction(fraction: f64, device: c_int) -> *mut c_char;
    pub fn eng_cuda_empty_cache() -> *mut c_char;
    pub fn eng_cuda_set_allocator_settings(settings: *const c_char) -> *mut c_char;
    pub fn eng_cuda_mem_get_info(device: c_int, free: *mut i64, total: *mut i64) -> *mut c_char;

    // storage.cpp
    pub fn eng_storage_resize(t: *mut C_tensor, nbytes: i64) -> *mut c_char;
    pub fn eng_storage_nbytes(t: *mut C_tensor, out: *mut i64) -> *mut c_char;

    // fp32_matmul.cpp
    pub fn eng_set_tf32_matmul(on: c_int) -> *mut c_char;
    pub fn eng_tf32_matmul(on: *mut c_int) -> *mut c_char;
    pub fn eng_ieee_scope_enter() -> *mut c_void;
    pub fn eng_ieee_scope_exit(scope: *mut c_void);
    pub fn eng_ieee_scope_in_force() -> c_int;

    // kernel_trace.cpp
    pub fn eng_kernel_trace_start(cuda: c_int) -> *mut c_char;
    pub fn eng_kernel_trace_stop(path: *const c_char, lines: *mut *mut c_char) -> *mut c_char;

    // host_memory.cpp
    pub fn eng_host_memory_install() -> *mut c_char;
    pub fn eng_host_memory_stats(current: *mut i64, peak: *mut i64) -> *mut c_char;
    pub fn eng_host_memory_reset_peak() -> *mut c_char;
}

/// Turns a bridge return value into a result, naming what was being done.
pub fn check(err: *mut c_char, context: impl FnOnce() -> String) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: the bridge returns either null or a NUL-terminated string from malloc.
    let message = unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned();
    unsafe { eng_free_error(err) };
    Err(Error::Torch { context: context(), message })
}

/// A message as a malloc'ed C string the bridge takes ownership of (Rust errors going into C++).
pub fn c_error(message: &str) -> *mut c_char {
    let bytes = message.as_bytes();
    // SAFETY: plain malloc of len + 1 bytes, filled and NUL-terminated; freed by the bridge.
    unsafe {
        let p = libc::malloc(bytes.len() + 1) as *mut u8;
        if p.is_null() {
            return std::ptr::null_mut();
        }
        std::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len());
        *p.add(bytes.len()) = 0;
        p as *mut c_char
    }
}

/// A C string for the bridge; interior NUL bytes are an argument error.
pub fn cstring(s: &str) -> Result<std::ffi::CString> {
    std::ffi::CString::new(s).map_err(|_| Error::invalid(format!("{s:?} contains a NUL byte")))
}

/// The `at::Tensor*` behind a tch tensor, for bridge calls. The bridge copies the handle (a
/// reference count on the same storage) and never frees what it is given.
pub trait RawTensor {
    /// The raw pointer; valid while `self` lives.
    fn raw(&self) -> *mut C_tensor;
}

impl RawTensor for tch::Tensor {
    fn raw(&self) -> *mut C_tensor {
        self.as_ptr() as *mut C_tensor
    }
}
