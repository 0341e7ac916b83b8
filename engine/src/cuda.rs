//! CUDA streams, events and the caching allocator's statistics and memory cap, through the
//! C++ bridge. On a machine without a GPU every call returns [`Error::CudaUnavailable`].
use crate::ffi::{self, check, EngEvent, EngStream, RawTensor};
use crate::{Error, Result};

/// Number of visible CUDA devices (0 without a GPU or driver).
pub fn device_count() -> usize {
    unsafe { ffi::eng_cuda_device_count() }.max(0) as usize
}

/// Whether at least one CUDA device is usable.
pub fn is_available() -> bool {
    device_count() > 0
}

/// An error unless CUDA is usable; GPU-only code paths call this first.
pub fn require() -> Result<()> {
    if is_available() {
        Ok(())
    } else {
        Err(Error::CudaUnavailable("no CUDA device or driver on this machine".into()))
    }
}

fn cuda_check(err: *mut std::ffi::c_char, what: impl FnOnce() -> String) -> Result<()> {
    require()?;
    check(err, what)
}

/// A CUDA stream of the caching allocator's pool (or the current stream).
pub struct Stream {
    raw: *mut EngStream,
}

// SAFETY: a CUDA stream handle may be used from any thread.
unsafe impl Send for Stream {}

impl Stream {
    /// The current stream of `device`.
    pub fn current(device: usize) -> Result<Stream> {
        let mut raw = std::ptr::null_mut();
        cuda_check(unsafe { ffi::eng_cuda_current_stream(device as i32, &mut raw) }, || {
            format!("getting the current stream of cuda:{device}")
        })?;
        Ok(Stream { raw })
    }

    /// A side stream from PyTorch's pool for `device`.
    pub fn from_pool(device: usize, high_priority: bool) -> Result<Stream> {
        let mut raw = std::ptr::null_mut();
        cuda_check(unsafe { ffi::eng_cuda_stream_from_pool(device as i32, high_priority as i32, &mut raw) }, || {
            format!("getting a side stream of cuda:{device}")
        })?;
        Ok(Stream { raw })
    }

    /// Makes this the current stream of its device: kernels launched from now on go here.
    pub fn set_current(&self) -> Result<()> {
        check(unsafe { ffi::eng_cuda_set_current_stream(self.raw) }, || "setting the current stream".into())
    }

    /// Blocks until all work queued on this stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        check(unsafe { ffi::eng_cuda_stream_synchronize(self.raw) }, || "synchronizing a stream".into())
    }

    /// Whether all work queued on this stream has finished.
    pub fn query(&self) -> Result<bool> {
        let mut done = 0;
        check(unsafe { ffi::eng_cuda_stream_query(self.raw, &mut done) }, || "querying a stream".into())?;
        Ok(done != 0)
    }

    /// Makes future work on this stream wait until `event` has completed.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        check(unsafe { ffi::eng_cuda_stream_wait_event(self.raw, event.raw) }, || "waiting on an event".into())
    }

    /// The stream's id (equal ids: the same stream).
    pub fn id(&self) -> i64 {
        unsafe { ffi::eng_cuda_stream_id(self.raw) }
    }

    /// The stream's device index.
    pub fn device(&self) -> usize {
        unsafe { ffi::eng_cuda_stream_device(self.raw) }.max(0) as usize
    }

    /// The raw `cudaStream_t` (a `CUstream` to the driver API), for launching kernels compiled
    /// outside libtorch on this stream. Valid while the stream lives: a pool or current stream
    /// of libtorch lives as long as the process.
    pub fn raw_handle(&self) -> *mut std::ffi::c_void {
        unsafe { ffi::eng_cuda_stream_raw(self.raw) }
    }

    /// Marks `tensor` as used on this stream, so that the caching allocator does not hand its
    /// memory out again before the work queued here finishes.
    pub fn record_tensor(&self, tensor: &tch::Tensor) -> Result<()> {
        check(unsafe { ffi::eng_cuda_record_stream(tensor.raw(), self.raw) }, || {
            "recording a tensor on a stream".into()
        })
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        unsafe { ffi::eng_cuda_stream_free(self.raw) }
    }
}

/// A CUDA event, for ordering streams and timing.
pub struct Event {
    raw: *mut EngEvent,
}

// SAFETY: a CUDA event handle may be used from any thread.
unsafe impl Send for Event {}

impl Event {
    /// A new event; `timing` enables [`Event::elapsed_ms`].
    pub fn new(timing: bool) -> Result<Event> {
        let mut raw = std::ptr::null_mut();
        cuda_check(unsafe { ffi::eng_cuda_event_new(timing as i32, &mut raw) }, || "creating an event".into())?;
        Ok(Event { raw })
    }

    /// Records the event at the current end of `stream`'s queue.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        check(unsafe { ffi::eng_cuda_event_record(self.raw, stream.raw) }, || "recording an event".into())
    }

    /// Blocks until the event has completed.
    pub fn synchronize(&self) -> Result<()> {
        check(unsafe { ffi::eng_cuda_event_synchronize(self.raw) }, || "synchronizing an event".into())
    }

    /// Whether the event has completed.
    pub fn query(&self) -> Result<bool> {
        let mut done = 0;
        check(unsafe { ffi::eng_cuda_event_query(self.raw, &mut done) }, || "querying an event".into())?;
        Ok(done != 0)
    }

    /// Milliseconds from this event to `end` (both recorded with timing enabled).
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        let mut ms = 0.0;
        check(unsafe { ffi::eng_cuda_event_elapsed_ms(self.raw, end.raw, &mut ms) }, || "timing events".into())?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        unsafe { ffi::eng_cuda_event_free(self.raw) }
    }
}

/// The caching allocator's counters for one device, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes in tensors now.
    pub allocated: i64,
    /// Most bytes in tensors since the last peak reset.
    pub peak_allocated: i64,
    /// Bytes reserved from the driver now (tensors and cache).
    pub reserved: i64,
    /// Most bytes reserved since the last peak reset.
    pub peak_reserved: i64,
    /// Bytes in active blocks.
    pub active: i64,
    /// Allocations that had to free the cache and retry.
    pub alloc_retries: i64,
    /// Allocations that failed.
    pub ooms: i64,
    /// Bytes the live tensors asked for (`allocated` less the allocator's rounding to 512
    /// bytes and the small remainders it leaves inside reused blocks).
    pub requested: i64,
}

/// The caching allocator's counters for `device`.
pub fn memory_stats(device: usize) -> Result<MemoryStats> {
    let mut v = [0i64; 8];
    cuda_check(unsafe { ffi::eng_cuda_memory_stats(device as i32, v.as_mut_ptr()) }, || {
        format!("reading memory statistics of cuda:{device}")
    })?;
    Ok(MemoryStats {
        allocated: v[0],
        peak_allocated: v[1],
        reserved: v[2],
        peak_reserved: v[3],
        active: v[4],
        alloc_retries: v[5],
        ooms: v[6],
        requested: v[7],
    })
}

/// Resets the peak counters of `device`.
pub fn reset_peak_stats(device: usize) -> Result<()> {
    cuda_check(unsafe { ffi::eng_cuda_reset_peak_stats(device as i32) }, || format!("resetting peaks of cuda:{device}"))
}

/// Caps this process's caching allocator on `device` at `fraction` of the device's memory;
/// allocations beyond it fail with an out-of-memory error.
pub fn set_memory_fraction(fraction: f64, device: usize) -> Result<()> {
    cuda_check(unsafe { ffi::eng_cuda_set_memory_fraction(fraction, device as i32) }, || {
        format!("capping memory of cuda:{device} at fraction {fraction}")
    })
}

/// Caps this process's caching allocator on `device` at `bytes` (e.g. `--gpu-mem 4G` on a
/// larger card). An error if the device has less memory than that.
pub fn set_memory_cap(bytes: u64, device: usize) -> Result<()> {
    let (_, total) = mem_get_info(device)?;
    if bytes > total {
        return Err(Error::invalid(format!("memory cap of {bytes} bytes exceeds cuda:{device}'s {total} bytes")));
    }
    set_memory_fraction(bytes as f64 / total as f64, device)
}

/// Sets the caching allocator's options, as `PYTORCH_CUDA_ALLOC_CONF` spells them
/// (`expandable_segments:True`); they apply to what it reserves after the call.
pub fn set_allocator_settings(settings: &str) -> Result<()> {
    let c = std::ffi::CString::new(settings)
        .map_err(|_| Error::invalid(format!("allocator settings {settings:?} hold a NUL byte")))?;
    cuda_check(unsafe { ffi::eng_cuda_set_allocator_settings(c.as_ptr()) }, || {
        format!("setting the CUDA allocator's options to {settings:?}")
    })
}

/// Returns cached, unused blocks to the driver.
pub fn empty_cache() -> Result<()> {
    cuda_check(unsafe { ffi::eng_cuda_empty_cache() }, || "emptying the CUDA cache".into())
}

/// A copy of CPU tensor `t` in page-locked host memory, which copies to and from a GPU can read
/// and write asynchronously.
pub fn pinned(t: &tch::Tensor) -> Result<tch::Tensor> {
    let mut out = std::ptr::null_mut();
    cuda_check(unsafe { ffi::eng_cuda_pin_memory(t.raw(), &mut out) }, || "pinning host memory".into())?;
    Ok(unsafe { tch::Tensor::from_ptr(out) })
}

/// Copies `src` into `dst` (same shape) on the current stream without waiting for the copy:
/// asynchronous from pinned host memory (from pageable memory the driver still blocks).
pub fn copy_async(dst: &tch::Tensor, src: &tch::Tensor) -> Result<()> {
    tch::no_grad(|| {
        cuda_check(unsafe { ffi::eng_cuda_copy_async(dst.raw(), src.raw()) }, || {
            format!("copying {:?} {:?} into {:?} {:?}", src.size(), src.device(), dst.size(), dst.device())
        })
    })
}

/// `data` as a tensor of `shape` on `device`, without holding the host until the device's
/// queue drains: on a GPU `data` is copied straight into page-locked memory (by every core, in
/// slices) and from there asynchronously on the current stream (a copy from pageable memory
/// waits for the stream, so a training loop uploading each micro-batch that way leaves the GPU
/// idle while it queues the next one's work); elsewhere an ordinary tensor. The staging buffer
/// returns to libtorch's pinned-memory cache only once the copy is done. One host copy: a
/// micro-batch of 256 images at 224 px is 154 MB of fp32, and made a tensor first, then pinned,
/// it cost two copies and a fresh buffer's page faults on the training thread each time.
pub fn upload_slice<T: tch::kind::Element + Copy + Send + Sync>(
    data: &[T],
    shape: &[i64],
    device: tch::Device,
) -> Result<tch::Tensor> {
    let numel: i64 = shape.iter().product();
    if numel < 0 || numel as usize != data.len() {
        return Err(Error::invalid(format!("{} values do not fill a tensor of shape {shape:?}", data.len())));
    }
    let tch::Device::Cuda(_) = device else {
        return Ok(tch::Tensor::f_from_slice(data)?.f_view(shape)?);
    };
    let staged = empty_pinned(shape, T::KIND)?;
    if !data.is_empty() {
        // SAFETY: `staged` is a fresh contiguous CPU tensor of `data.len()` elements of `T`,
        // owned here and not yet shared with any stream.
        let dst = unsafe { std::slice::from_raw_parts_mut(staged.data_ptr() as *mut T, data.len()) };
        use rayon::prelude::*;
        const SLICE: usize = 1 << 18;
        dst.par_chunks_mut(SLICE).zip(data.par_chunks(SLICE)).for_each(|(d, s)| d.copy_from_slice(s));
    }
    let dev = tch::Tensor::f_empty(shape, (T::KIND, device))?;
    copy_async(&dev, &staged)?;
    Ok(dev)
}

/// An uninitialised CPU tensor of `shape` and `kind` in page-locked memory (from libtorch's
/// pinned-memory cache), which copies to and from a GPU read and write at the bus's speed.
pub fn empty_pinned(shape: &[i64], kind: tch::Kind) -> Result<tch::Tensor> {
    let kind_of = tch::Tensor::f_empty([0], (kind, tch::Device::Cpu))?;
    let mut out = std::ptr::null_mut();
    cuda_check(
        unsafe { ffi::eng_cuda_empty_pinned(kind_of.raw(), shape.as_ptr(), shape.len() as i32, &mut out) },
        || format!("allocating {shape:?} in pinned host memory"),
    )?;
    Ok(unsafe { tch::Tensor::from_ptr(out) })
}

/// Free and total bytes of `device` as the driver sees them.
pub fn mem_get_info(device: usize) -> Result<(u64, u64)> {
    let (mut free, mut total) = (0i64, 0i64);
    cuda_check(unsafe { ffi::eng_cuda_mem_get_info(device as i32, &mut free, &mut total) }, || {
        format!("reading memory of cuda:{device}")
    })?;
    Ok((free.max(0) as u64, total.max(0) as u64))
}

/// Makes `device` this thread's current CUDA device (`cudaSetDevice`), so that allocations
/// and NCCL communicators without an explicit device land on it.
pub fn set_device(device: usize) -> Result<()> {
    cuda_check(unsafe { ffi::eng_cuda_set_device(device as i32) }, || format!("making cuda:{device} current"))
}

/// Blocks until all work on `device` has finished.
pub fn synchronize(device: usize) -> Result<()> {
    cuda_check(unsafe { ffi::eng_cuda_synchronize(device as i32) }, || format!("synchronizing cuda:{device}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upload_slice_shapes_the_values_and_refuses_a_wrong_count() {
        let data: Vec<f32> = (0..24).map(|i| i as f32 * 0.5).collect();
        let t = upload_slice(&data, &[2, 3, 4], tch::Device::Cpu).unwrap();
        assert_eq!(t.size(), [2, 3, 4]);
        assert!(t.equal(&tch::Tensor::from_slice(&data).view([2, 3, 4])));
        let err = upload_slice(&data, &[5, 5], tch::Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("24 values do not fill a tensor of shape [5, 5]"), "{err}");
    }
}
