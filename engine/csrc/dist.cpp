// c10d through a C ABI: stores, process groups (Gloo for CPU tensors, NCCL for CUDA tensors,
// chosen per call by the tensor's device) and Work handles.
#include <chrono>
#include <memory>
#include <mutex>
#include <vector>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <torch/version.h>

#include "protect.h"

using c10::intrusive_ptr;
using std::chrono::milliseconds;

struct EngStore {
  intrusive_ptr<c10d::Store> store;
};

struct EngGroup {
  intrusive_ptr<c10d::Store> store;
  int rank;
  int size;
  milliseconds timeout;
  bool loopback;
  intrusive_ptr<c10d::Backend> gloo;
  intrusive_ptr<c10d::Backend> nccl;  // created on the first CUDA collective, like c10d does
  std::mutex nccl_once;                // two threads' first CUDA collectives create it once
};

struct EngWork {
  intrusive_ptr<c10d::Work> work;
  // Tensors the operation reads or writes, kept alive until the handle is dropped.
  std::vector<at::Tensor> keep;
};

namespace {

c10d::Backend& backend_for(EngGroup* g, const at::Tensor& t) {
  if (!t.is_cuda()) return *g->gloo;
#ifdef USE_C10D_NCCL
  std::lock_guard<std::mutex> lock(g->nccl_once);
  if (!g->nccl) {
    auto opts = c10d::ProcessGroupNCCL::Options::create();
    opts->timeout = g->timeout;
    g->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("nccl", g->store), g->rank, g->size, opts);
  }
  return *g->nccl;
#else
  TORCH_CHECK(false, "this build has no NCCL support; CUDA tensors cannot be communicated");
#endif
}

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case 0: return c10d::ReduceOp::SUM;
    case 1: return c10d::ReduceOp::MAX;
    case 2: return c10d::ReduceOp::MIN;
    case 3: return c10d::ReduceOp::PRODUCT;
    default: TORCH_CHECK(false, "unknown reduce op ", op);
  }
}

void finish(EngWork** out, intrusive_ptr<c10d::Work> work, std::vector<at::Tensor> keep) {
  *out = new EngWork{std::move(work), std::move(keep)};
}

}  // namespace

extern "C" {

void eng_free_error(char* err) { std::free(err); }

const char* eng_torch_version() { return TORCH_VERSION; }

// A server waits for `workers` clients (itself included) before returning; with 0 it waits
// for none (an agent's store, which is no worker). Port 0 asks the kernel for one; the port
// bound is returned in `bound_port`.
char* eng_store_tcp(const char* host, uint16_t port, int is_server, int workers,
                    int64_t timeout_ms, uint16_t* bound_port, EngStore** out) {
  ENG_PROTECT({
    c10d::TCPStoreOptions opts;
    opts.port = port;
    opts.isServer = is_server != 0;
    if (workers > 0) opts.numWorkers = workers;
    opts.waitWorkers = workers > 0;
    opts.timeout = milliseconds(timeout_ms);
    auto store = c10::make_intrusive<c10d::TCPStore>(host, opts);
    *bound_port = store->getPort();
    *out = new EngStore{std::move(store)};
  })
}

char* eng_store_hash(EngStore** out) {
  ENG_PROTECT({ *out = new EngStore{c10::make_intrusive<c10d::HashStore>()}; })
}

char* eng_store_prefix(EngStore* base, const char* prefix, EngStore** out) {
  ENG_PROTECT({ *out = new EngStore{c10::make_intrusive<c10d::PrefixStore>(prefix, base->store)}; })
}

char* eng_store_set(EngStore* s, const char* key, const uint8_t* data, size_t len) {
  ENG_PROTECT({ s->store->set(key, std::vector<uint8_t>(data, data + len)); })
}

// The value is copied into a malloc'ed buffer that Rust frees with eng_free_bytes.
char* eng_store_get(EngStore* s, const char* key, uint8_t** data, size_t* len) {
  ENG_PROTECT({
    std::vector<uint8_t> v = s->store->get(key);
    *len = v.size();
    *data = static_cast<uint8_t*>(std::malloc(v.empty() ? 1 : v.size()));
    TORCH_CHECK(*data != nullptr, "out of memory reading store key ", key);
    if (!v.empty()) std::memcpy(*data, v.data(), v.size());
  })
}

void eng_free_bytes(uint8_t* data) { std::free(data); }

char* eng_store_add(EngStore* s, const char* key, int64_t value, int64_t* out) {
  ENG_PROTECT({ *out = s->store->add(key, value); })
}

char* eng_store_set_timeout(EngStore* s, int64_t timeout_ms) {
  ENG_PROTECT({ s->store->setTimeout(milliseconds(timeout_ms)); })
}

void eng_store_free(EngStore* s) { delete s; }

// Creates the group's Gloo backend (a rendezvous among `size` ranks through `store`).
char* eng_group_new(EngStore* store, int rank, int size, int64_t timeout_ms, int loopback,
                    EngGroup** out) {
  ENG_PROTECT({
    TORCH_CHECK(size > 0 && rank >= 0 && rank < size, "rank ", rank, " is not in a group of size ", size);
    auto timeout = milliseconds(timeout_ms);
    c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> opts;
    if (loopback) {
      opts = c10d::ProcessGroupGloo::Options::create(timeout);
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
      // Honours GLOO_SOCKET_IFNAME, as torch.distributed does.
      opts = c10d::ProcessGroupGloo::Options::create_default(timeout);
    }
    auto gloo_store = c10::make_intrusive<c10d::PrefixStore>("gloo", store->store);
    auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(gloo_store, rank, size, opts);
    *out = new EngGroup{store->store, rank, size, timeout, loopback != 0, gloo, {}, {}};
  })
}

// An NCCL backend is aborted before it goes. Its destructor would do the same (abort, which
// does not block, rather than shutdown, which waits for pending work that a failed peer may
// never finish), but first warns on stderr that destroy_process_group() was not called (a
// Python call a libtorch program cannot make): seen at the end of every CUDA run.
void eng_group_free(EngGroup* g) {
  if (g->nccl) {
    try {
      g->nccl->abort();
    } catch (...) {
      // Nothing is left to tell: the group is going away either way.
    }
  }
  delete g;
}

char* eng_allreduce(EngGroup* g, at::Tensor* t, int op, EngWork** out) {
  ENG_PROTECT({
    std::vector<at::Tensor> ts{*t};
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = g->timeout;
    finish(out, backend_for(g, *t).allreduce(ts, opts), ts);
  })
}

char* eng_reduce(EngGroup* g, at::Tensor* t, int root, int op, EngWork** out) {
  ENG_PROTECT({
    TORCH_CHECK(root >= 0 && root < g->size, "reduce root ", root, " is not in a group of size ", g->size);
    std::vector<at::Tensor> ts{*t};
    c10d::ReduceOptions opts;
    opts.rootRank = root;
    opts.reduceOp = reduce_op(op);
    opts.timeout = g->timeout;
    finish(out, backend_for(g, *t).reduce(ts, opts), ts);
  })
}

char* eng_broadcast(EngGroup* g, at::Tensor* t, int root, EngWork** out) {
  ENG_PROTECT({
    TORCH_CHECK(root >= 0 && root < g->size, "broadcast root ", root, " is not in a group of size ", g->size);
    std::vector<at::Tensor> ts{*t};
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = g->timeout;
    finish(out, backend_for(g, *t).broadcast(ts, opts), ts);
  })
}

// `output` is `size` copies of `input`'s shape stacked along dim 0.
char* eng_allgather_into(EngGroup* g, at::Tensor* output, at::Tensor* input, EngWork** out) {
  ENG_PROTECT({
    c10d::AllgatherOptions opts;
    opts.timeout = g->timeout;
    finish(out, backend_for(g, *input)._allgather_base(*output, *input, opts), {*output, *input});
  })
}

char* eng_allgather_list(EngGroup* g, at::Tensor** outputs, int n, at::Tensor* input, EngWork** out) {
  ENG_PROTECT({
    TORCH_CHECK(n == g->size, "all_gather needs ", g->size, " output tensors, got ", n);
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int i = 0; i < n; ++i) outs[0].push_back(*outputs[i]);
    std::vector<at::Tensor> ins{*input};
    c10d::AllgatherOptions opts;
    opts.timeout = g->timeout;
    auto keep = outs[0];
    keep.push_back(*input);
    finish(out, backend_for(g, *input).allgather(outs, ins, opts), keep);
  })
}

// `input` is `size` blocks of `output`'s shape stacked along dim 0; rank r receives the
// reduction of block r.
char* eng_reduce_scatter_into(EngGroup* g, at::Tensor* output, at::Tensor* input, int op, EngWork** out) {
  ENG_PROTECT({
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = g->timeout;
    finish(out, backend_for(g, *input)._reduce_scatter_base(*output, *input, opts), {*output, *input});
  })
}

// Splits are row counts along dim 0; empty split arrays mean equal splits.
char* eng_alltoall(EngGroup* g, at::Tensor* output, at::Tensor* input, const int64_t* out_splits,
                   const int64_t* in_splits, int nsplits, EngWork** out) {
  ENG_PROTECT({
    std::vector<int64_t> os(out_splits, out_splits + nsplits);
    std::vector<int64_t> is(in_splits, in_splits + nsplits);
    c10d::AllToAllOptions opts;
    opts.timeout = g->timeout;
    finish(out, backend_for(g, *input).alltoall_base(*output, *input, os, is, opts), {*output, *input});
  })
}

char* eng_send(EngGroup* g, at::Tensor* t, int dst, int tag, EngWork** out) {
  ENG_PROTECT({
    TORCH_CHECK(dst >= 0 && dst < g->size && dst != g->rank, "cannot send from rank ", g->rank, " to rank ", dst, " in a group of size ", g->size);
    std::vector<at::Tensor> ts{*t};
    finish(out, backend_for(g, *t).send(ts, dst, tag), ts);
  })
}

char* eng_recv(EngGroup* g, at::Tensor* t, int src, int tag, EngWork** out) {
  ENG_PROTECT({
    TORCH_CHECK(src >= 0 && src < g->size && src != g->rank, "cannot receive on rank ", g->rank, " from rank ", src, " in a group of size ", g->size);
    std::vector<at::Tensor> ts{*t};
    finish(out, backend_for(g, *t).recv(ts, src, tag), ts);
  })
}

char* eng_barrier(EngGroup* g, EngWork** out) {
  ENG_PROTECT({
    c10d::BarrierOptions opts;
    opts.timeout = g->timeout;
    finish(out, g->gloo->barrier(opts), {});
  })
}

char* eng_work_wait(EngWork* w, int64_t timeout_ms) {
  ENG_PROTECT({
    bool done = timeout_ms < 0 ? w->work->wait() : w->work->wait(milliseconds(timeout_ms));
    TORCH_CHECK(done, "collective did not complete within ", timeout_ms, " ms");
  })
}

char* eng_work_is_completed(EngWork* w, int* out) {
  ENG_PROTECT({ *out = w->work->isCompleted() ? 1 : 0; })
}

void eng_work_free(EngWork* w) { delete w; }

}  // extern "C"
