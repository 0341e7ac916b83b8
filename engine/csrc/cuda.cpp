// CUDA streams, events and caching-allocator controls through a C ABI. Built on every machine
// (the torch wheel carries the CUDA runtime); each entry point first checks that a device
// exists, so a CPU-only machine gets an error message instead of a crash.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>

#include "protect.h"

struct EngStream {
  c10::cuda::CUDAStream stream;
};

struct EngEvent {
  c10::cuda::CUDAEvent event;
};

namespace {

void require_cuda() {
  TORCH_CHECK(torch::cuda::is_available(), "CUDA not available: no CUDA device or driver on this machine");
}

// Every entry point that names a device initialises libtorch's CUDA state first: the caching
// allocator's statistics, peak reset and cap throw "did you call init?" until something has
// (libtorch does it lazily at the first CUDA tensor; Python at import).
c10::DeviceIndex device_index(int device) {
  require_cuda();
  at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
  int count = static_cast<int>(c10::cuda::device_count());
  TORCH_CHECK(device >= 0 && device < count, "CUDA device ", device, " does not exist (", count, " devices)");
  return static_cast<c10::DeviceIndex>(device);
}

}  // namespace

extern "C" {

int eng_cuda_device_count() {
  try {
    return torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
  } catch (...) {
    return 0;
  }
}

char* eng_cuda_current_stream(int device, EngStream** out) {
  ENG_PROTECT({ *out = new EngStream{c10::cuda::getCurrentCUDAStream(device_index(device))}; })
}

char* eng_cuda_stream_from_pool(int device, int high_priority, EngStream** out) {
  ENG_PROTECT({ *out = new EngStream{c10::cuda::getStreamFromPool(high_priority != 0, device_index(device))}; })
}

char* eng_cuda_set_current_stream(EngStream* s) {
  ENG_PROTECT({ c10::cuda::setCurrentCUDAStream(s->stream); })
}

char* eng_cuda_stream_synchronize(EngStream* s) {
  ENG_PROTECT({ s->stream.synchronize(); })
}

char* eng_cuda_stream_query(EngStream* s, int* done) {
  ENG_PROTECT({ *done = s->stream.query() ? 1 : 0; })
}

char* eng_cuda_stream_wait_event(EngStream* s, EngEvent* e) {
  ENG_PROTECT({ e->event.block(s->stream); })
}

int64_t eng_cuda_stream_id(EngStream* s) { return s->stream.id(); }

int eng_cuda_stream_device(EngStream* s) { return s->stream.device_index(); }

// The raw cudaStream_t, for kernels launched outside libtorch (the NVRTC kernels of kernels/).
void* eng_cuda_stream_raw(EngStream* s) { return static_cast<void*>(s->stream.stream()); }

void eng_cuda_stream_free(EngStream* s) { delete s; }

char* eng_cuda_event_new(int enable_timing, EngEvent** out) {
  ENG_PROTECT({
    require_cuda();
    *out = new EngEvent{c10::cuda::CUDAEvent(enable_timing ? cudaEventDefault : cudaEventDisableTiming)};
  })
}

char* eng_cuda_event_record(EngEvent* e, EngStream* s) {
  ENG_PROTECT({ e->event.record(s->stream); })
}

char* eng_cuda_event_synchronize(EngEvent* e) {
  ENG_PROTECT({ e->event.synchronize(); })
}

char* eng_cuda_event_query(EngEvent* e, int* done) {
  ENG_PROTECT({ *done = e->event.query() ? 1 : 0; })
}

char* eng_cuda_event_elapsed_ms(EngEvent* start, EngEvent* end, float* ms) {
  ENG_PROTECT({ *ms = start->event.elapsed_time(end->event); })
}

void eng_cuda_event_free(EngEvent* e) { delete e; }

// Tells the caching allocator that `t` is used on stream `s`, so that its memory is not reused
// before work queued there finishes (needed whenever a side stream touches a tensor).
char* eng_cuda_record_stream(at::Tensor* t, EngStream* s) {
  ENG_PROTECT({
    TORCH_CHECK(t->is_cuda(), "record_stream needs a CUDA tensor");
    c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), s->stream);
  })
}

char* eng_cuda_set_device(int device) {
  ENG_PROTECT({ c10::cuda::set_device(device_index(device)); })
}

char* eng_cuda_synchronize(int device) {
  ENG_PROTECT({
    c10::cuda::CUDAGuard guard(device_index(device));
    c10::cuda::device_synchronize();
  })
}

// out: allocated current, allocated peak, reserved current, reserved peak, active current,
// number of allocation retries, number of OOMs, requested current.
char* eng_cuda_memory_stats(int device, int64_t* out) {
  ENG_PROTECT({
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device_index(device));
    const auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = stats.allocated_bytes[agg].current;
    out[1] = stats.allocated_bytes[agg].peak;
    out[2] = stats.reserved_bytes[agg].current;
    out[3] = stats.reserved_bytes[agg].peak;
    out[4] = stats.active_bytes[agg].current;
    out[5] = stats.num_alloc_retries;
    out[6] = stats.num_ooms;
    out[7] = stats.requested_bytes[agg].current;
  })
}

char* eng_cuda_reset_peak_stats(int device) {
  ENG_PROTECT({ c10::cuda::CUDACachingAllocator::resetPeakStats(device_index(device)); })
}

char* eng_cuda_set_memory_fraction(double fraction, int device) {
  ENG_PROTECT({
    TORCH_CHECK(fraction > 0.0 && fraction <= 1.0, "memory fraction must be in (0, 1], got ", fraction);
    // The allocator makes `device` current to read its total memory: keep the caller's.
    const auto index = device_index(device);
    c10::cuda::CUDAGuard guard(index);
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, index);
  })
}

// The caching allocator's settings, as PYTORCH_CUDA_ALLOC_CONF spells them
// ("expandable_segments:True"); they apply to the segments reserved after the call.
char* eng_cuda_set_allocator_settings(const char* settings) {
  ENG_PROTECT({
    require_cuda();
    c10::CachingAllocator::setAllocatorSettings(settings);
  })
}

// A copy of CPU tensor `t` in page-locked memory. tch's pin_memory always passes a device,
// which libtorch 2.11 answers with a deprecation warning on every call.
char* eng_cuda_pin_memory(at::Tensor* t, at::Tensor** out) {
  ENG_PROTECT({
    require_cuda();
    *out = new at::Tensor(t->pin_memory());
  })
}

// An uninitialised page-locked CPU tensor of `sizes`, of `kind_of`'s dtype (a tensor passed
// for its dtype alone), from libtorch's pinned-memory cache.
char* eng_cuda_empty_pinned(at::Tensor* kind_of, const int64_t* sizes, int ndim, at::Tensor** out) {
  ENG_PROTECT({
    require_cuda();
    auto options = at::TensorOptions().dtype(kind_of->scalar_type()).device(at::kCPU).pinned_memory(true);
    *out = new at::Tensor(at::empty(at::IntArrayRef(sizes, ndim), options));
  })
}

// dst.copy_(src) without waiting: from pinned host memory the copy is queued on the current
// stream and the call returns (tch's copy_ always blocks).
char* eng_cuda_copy_async(at::Tensor* dst, at::Tensor* src) {
  ENG_PROTECT({
    require_cuda();
    dst->copy_(*src, /*non_blocking=*/true);
  })
}

char* eng_cuda_empty_cache() {
  ENG_PROTECT({
    require_cuda();
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    c10::cuda::CUDACachingAllocator::emptyCache();
  })
}

char* eng_cuda_mem_get_info(int device, int64_t* free_bytes, int64_t* total_bytes) {
  ENG_PROTECT({
    c10::cuda::CUDAGuard guard(device_index(device));
    size_t f = 0, t = 0;
    C10_CUDA_CHECK(cudaMemGetInfo(&f, &t));
    *free_bytes = static_cast<int64_t>(f);
    *total_bytes = static_cast<int64_t>(t);
  })
}

}  // extern "C"
