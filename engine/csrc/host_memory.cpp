// Counting the bytes the CPU allocator hands out. libtorch keeps no statistics for CPU memory
// (CUDA has its caching allocator's), so to measure what a computation holds on the host we
// wrap the CPU allocator: every allocation made after installation is recorded with its size,
// which is subtracted when the memory is freed.
#include <atomic>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "protect.h"

namespace {

// Allocations are handed out with the data pointer as their own context (a "simple" DataPtr),
// because parts of libtorch use the allocator's raw interface (raw_allocate/raw_deleter, e.g.
// scratch buffers of vectorised kernels), which requires it. Sizes are therefore looked up by
// pointer on free.
struct CountingAllocator final : c10::Allocator {
  explicit CountingAllocator(c10::Allocator* base) : base(base), base_free(base->raw_deleter()) {}

  c10::DataPtr allocate(size_t n) override {
    void* data = base->raw_allocate(n);
    {
      std::lock_guard<std::mutex> lock(sizes_mutex);
      sizes[data] = n;
    }
    int64_t now = current.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  static void release(void* data);

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  c10::Allocator* base;
  c10::DeleterFnPtr base_free;
  std::mutex sizes_mutex;
  std::unordered_map<void*, size_t> sizes;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
};

// Installed once and never freed: memory allocated through it may outlive any owner.
CountingAllocator* counter = nullptr;
std::mutex install;

void CountingAllocator::release(void* data) {
  if (data == nullptr) return;
  size_t n = 0;
  {
    std::lock_guard<std::mutex> lock(counter->sizes_mutex);
    auto it = counter->sizes.find(data);
    if (it != counter->sizes.end()) {
      n = it->second;
      counter->sizes.erase(it);
    }
  }
  counter->current.fetch_sub(static_cast<int64_t>(n));
  counter->base_free(data);
}

}  // namespace

extern "C" {

// Installs the counter (once; later calls do nothing). Only allocations made afterwards count.
char* eng_host_memory_install() {
  ENG_PROTECT({
    std::lock_guard<std::mutex> lock(install);
    if (counter == nullptr) {
      c10::Allocator* base = c10::GetCPUAllocator();
      TORCH_CHECK(base->raw_deleter() != nullptr, "the CPU allocator has no raw interface to wrap");
      counter = new CountingAllocator(base);
      // Above the default allocator's priority, so ours is the one handed out.
      c10::SetCPUAllocator(counter, /*priority=*/100);
      TORCH_CHECK(c10::GetCPUAllocator() == counter, "another CPU allocator of higher priority is installed");
    }
  })
}

// Bytes currently allocated and the peak since the last reset; -1 each if not installed.
char* eng_host_memory_stats(int64_t* current, int64_t* peak) {
  ENG_PROTECT({
    *current = counter ? counter->current.load() : -1;
    *peak = counter ? counter->peak.load() : -1;
  })
}

char* eng_host_memory_reset_peak() {
  ENG_PROTECT({
    if (counter) counter->peak.store(counter->current.load());
  })
}

}  // extern "C"
