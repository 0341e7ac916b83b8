// libtorch's Kineto profiler, started and stopped around a region: every operator on the host
// and, with CUDA activities, every kernel and copy on the GPU with its device-side duration.
// The events come back as text lines for Rust to summarise; the Chrome trace (the JSON
// `torch.profiler` exports, for Perfetto or chrome://tracing) is written where asked.
#include <set>
#include <sstream>
#include <string>

#include <torch/csrc/autograd/profiler_kineto.h>

#include "protect.h"

namespace {

namespace prof = torch::autograd::profiler;
namespace impl = torch::profiler::impl;

std::set<impl::ActivityType> activities(int cuda) {
  std::set<impl::ActivityType> out{impl::ActivityType::CPU};
  if (cuda != 0) out.insert(impl::ActivityType::CUDA);
  return out;
}

impl::ProfilerConfig config() { return impl::ProfilerConfig(impl::ProfilerState::KINETO); }

}  // namespace

extern "C" {

char* eng_kernel_trace_start(int cuda) {
  ENG_PROTECT({
    TORCH_CHECK(!prof::isProfilerEnabledInMainThread(), "a profiler is already running");
    prof::prepareProfiler(config(), activities(cuda));
    prof::enableProfiler(config(), activities(cuda));
  })
}

// Stops the profiler; `path` (may be null) receives the Chrome trace. `*lines`: one event a
// line, "<device>\t<duration ns>\t<name>" (device "cpu" or "cuda"; tabs and newlines in names
// replaced by spaces), malloc'ed for the caller to free with eng_free_error.
char* eng_kernel_trace_stop(const char* path, char** lines) {
  ENG_PROTECT({
    auto result = prof::disableProfiler();
    TORCH_CHECK(result != nullptr, "no profiler was running");
    std::ostringstream out;
    for (const auto& e : result->events()) {
      std::string name = e.name();
      for (auto& c : name) {
        if (c == '\t' || c == '\n') c = ' ';
      }
      out << (e.deviceType() == c10::DeviceType::CUDA ? "cuda" : "cpu") << '\t' << e.durationNs() << '\t' << name
          << '\n';
    }
    if (path != nullptr) result->save(path);
    *lines = eng_make_error(out.str());
  })
}

}  // extern "C"
