// Counting the bytes the CPU allocator hands out. libtorch keeps no statistics for CPU memory
// (CUDA has its caching allocator's), so to measure what a computation holds on the host we
// wrap the CPU allocator: every allocation made after installation carries a small context
// that remembers its size and subtracts it when the memory is freed.
#include <atomic>
#include <mutex>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include "protect.h"

namespace {

struct CountingAllocator;

struct Allocation {
  c10::DataPtr inner;
  size_t bytes;
  CountingAllocator* owner;
};

struct CountingAllocator final : c10::Allocator {
  explicit CountingAllocator(c10::Allocator* base) : base(base) {}

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    c10::Device device = inner.device();
    auto* a = new Allocation{std::move(inner), n, this};
    int64_t now = current.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
    return {data, a, &release, device};
  }

  static void release(void* ctx) {
    auto* a = static_cast<Allocation*>(ctx);
    a->owner->current.fetch_sub(static_cast<int64_t>(a->bytes));
    delete a;  // frees the memory through the base allocator's own deleter
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  c10::Allocator* base;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
};

// Installed once and never freed: memory allocated through it may outlive any owner.
CountingAllocator* counter = nullptr;
std::mutex install;

}  // namespace

extern "C" {

// Installs the counter (once; later calls do nothing). Only allocations made afterwards count.
char* eng_host_memory_install() {
  ENG_PROTECT({
    std::lock_guard<std::mutex> lock(install);
    if (counter == nullptr) {
      counter = new CountingAllocator(c10::GetCPUAllocator());
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
