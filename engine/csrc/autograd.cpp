// Autograd through a C ABI: one C++ autograd Function whose backward calls into Rust, gradient
// hooks that run after a parameter's gradient is accumulated, backward with given output
// gradients, and generator state (for recomputation in activation checkpointing).
#include <memory>
#include <vector>

#include <ATen/Context.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/custom_class.h>

#include "protect.h"

// Rust callbacks. A backward callback receives the gradients of the outputs and the saved
// tensors and writes one gradient per input (nullptr for "no gradient"); it returns nullptr or
// an error message allocated with malloc.
typedef char* (*eng_backward_cb)(void* state, at::Tensor** grads, int ngrads, at::Tensor** saved,
                                 int nsaved, at::Tensor** grad_inputs, int ninputs);
typedef char* (*eng_hook_cb)(void* state, at::Tensor* tensor);
typedef void (*eng_drop_cb)(void* state);

namespace {

void throw_rust_error(char* err) {
  std::string message(err);
  std::free(err);
  throw std::runtime_error(message);
}

// Owns the Rust side of a function application; freed with the autograd node.
struct RustState : torch::CustomClassHolder {
  void* state;
  eng_backward_cb backward;
  eng_drop_cb drop;
  RustState(void* s, eng_backward_cb b, eng_drop_cb d) : state(s), backward(b), drop(d) {}
  ~RustState() override { drop(state); }
};

// Everything forward needs that is not an input: passed by pointer so that autograd does not
// count these tensors as inputs of the function.
struct ForwardPayload {
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> saved;
  std::vector<int64_t> non_differentiable;
  bool materialize_grads;
  c10::intrusive_ptr<RustState> rust;
};

struct RustFunction : public torch::autograd::Function<RustFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                ForwardPayload* payload) {
    ctx->saved_data["rust"] = c10::IValue::make_capsule(payload->rust);
    ctx->saved_data["ninputs"] = static_cast<int64_t>(inputs.size());
    ctx->save_for_backward(payload->saved);
    std::vector<at::Tensor> nondiff;
    for (int64_t i : payload->non_differentiable) nondiff.push_back(payload->outputs.at(i));
    if (!nondiff.empty()) ctx->mark_non_differentiable(nondiff);
    ctx->set_materialize_grads(payload->materialize_grads);
    return payload->outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto rust = c10::static_intrusive_pointer_cast<RustState>(ctx->saved_data["rust"].toCapsule());
    int64_t ninputs = ctx->saved_data["ninputs"].toInt();
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor*> grad_ptrs, saved_ptrs;
    for (auto& g : grads) grad_ptrs.push_back(&g);
    for (auto& s : saved) saved_ptrs.push_back(&s);
    std::vector<at::Tensor*> outs(ninputs, nullptr);
    char* err = rust->backward(rust->state, grad_ptrs.data(), grad_ptrs.size(), saved_ptrs.data(),
                               saved_ptrs.size(), outs.data(), ninputs);
    // One entry per forward argument: the inputs, then none for the payload pointer.
    torch::autograd::variable_list result(ninputs + 1);
    for (int64_t i = 0; i < ninputs; ++i) {
      if (outs[i] != nullptr) {
        result[i] = std::move(*outs[i]);
        delete outs[i];
      }
    }
    if (err != nullptr) throw_rust_error(err);
    return result;
  }
};

// All post-accumulate hooks of one tensor, in registration order.
struct RustPostAccHooks : torch::autograd::PostAccumulateGradHook {
  struct Hook {
    void* state;
    eng_hook_cb call;
    eng_drop_cb drop;
  };
  std::vector<Hook> hooks;
  ~RustPostAccHooks() override {
    for (auto& h : hooks) h.drop(h.state);
  }
  void operator()(const torch::autograd::Variable& tensor) override {
    at::Tensor t = tensor;
    for (auto& h : hooks) {
      char* err = h.call(h.state, &t);
      if (err != nullptr) throw_rust_error(err);
    }
  }
};

}  // namespace

extern "C" {

// Applies the function: `outputs` were computed by Rust without autograd; the result tensors
// are those outputs connected to the graph through a node whose backward calls `backward`
// (an output's gradient that nothing used as zeros with `materialize_grads`, else undefined).
// On success the node owns `state`; on failure `state` is dropped here.
char* eng_function_apply(at::Tensor** inputs, int ninputs, at::Tensor** outputs, int noutputs,
                         at::Tensor** saved, int nsaved, const int64_t* nondiff, int nnondiff,
                         int materialize_grads, void* state, eng_backward_cb backward,
                         eng_drop_cb drop, at::Tensor** results) {
  auto rust = c10::make_intrusive<RustState>(state, backward, drop);
  ENG_PROTECT({
    torch::autograd::variable_list ins;
    for (int i = 0; i < ninputs; ++i) ins.push_back(*inputs[i]);
    ForwardPayload payload;
    for (int i = 0; i < noutputs; ++i) payload.outputs.push_back(*outputs[i]);
    for (int i = 0; i < nsaved; ++i) payload.saved.push_back(*saved[i]);
    payload.non_differentiable.assign(nondiff, nondiff + nnondiff);
    payload.materialize_grads = materialize_grads != 0;
    payload.rust = std::move(rust);
    // As a TensorList (not a vector) so that autograd sees the inputs as variables.
    auto outs = RustFunction::apply(at::TensorList(ins), &payload);
    for (int i = 0; i < noutputs; ++i) results[i] = new at::Tensor(outs[i]);
  })
}

char* eng_add_post_accumulate_hook(at::Tensor* t, void* state, eng_hook_cb call, eng_drop_cb drop) {
  RustPostAccHooks::Hook hook{state, call, drop};
  try {
    TORCH_CHECK(t->is_leaf() && t->requires_grad(),
                "gradient hooks go on leaf tensors that require grad (parameters)");
    auto& slot = torch::autograd::impl::post_acc_grad_hooks(*t);
    if (!slot) slot = std::make_unique<RustPostAccHooks>();
    auto* ours = dynamic_cast<RustPostAccHooks*>(slot.get());
    TORCH_CHECK(ours != nullptr, "tensor already has a post-accumulate hook from elsewhere");
    ours->hooks.push_back(hook);
    return nullptr;
  } catch (const c10::Error& e) {
    drop(state);
    return eng_make_error(e.what_without_backtrace());
  } catch (const std::exception& e) {
    drop(state);
    return eng_make_error(e.what());
  }
}

char* eng_backward(at::Tensor** outputs, at::Tensor** grads, int n, int keep_graph) {
  ENG_PROTECT({
    torch::autograd::variable_list outs, gs;
    for (int i = 0; i < n; ++i) {
      outs.push_back(*outputs[i]);
      gs.push_back(grads[i] == nullptr ? at::Tensor() : *grads[i]);
    }
    torch::autograd::backward(outs, gs, keep_graph != 0);
  })
}

// Backward restricted to `inputs`: with `accumulate`, their `.grad`s receive the gradients
// (torch.autograd.backward(..., inputs=)); without, the gradients are returned in `results`
// (torch.autograd.grad, unused inputs as null) and no `.grad` changes. The pipeline's split
// backward (input gradients now, weight gradients later) needs both.
char* eng_grad(at::Tensor** outputs, at::Tensor** grads, int n, at::Tensor** inputs, int ninputs, int keep_graph,
               int accumulate, at::Tensor** results) {
  ENG_PROTECT({
    torch::autograd::variable_list outs, gs, ins;
    for (int i = 0; i < n; ++i) {
      outs.push_back(*outputs[i]);
      gs.push_back(grads[i] == nullptr ? at::Tensor() : *grads[i]);
    }
    for (int i = 0; i < ninputs; ++i) ins.push_back(*inputs[i]);
    if (accumulate != 0) {
      torch::autograd::backward(outs, gs, keep_graph != 0, false, ins);
    } else {
      auto out = torch::autograd::grad(outs, ins, gs, keep_graph != 0, false, true);
      for (int i = 0; i < ninputs; ++i) results[i] = out[i].defined() ? new at::Tensor(out[i]) : nullptr;
    }
  })
}

char* eng_set_grad(at::Tensor* t, at::Tensor* grad) {
  ENG_PROTECT({ t->mutable_grad() = grad == nullptr ? at::Tensor() : *grad; })
}

// Generator state of the default generator of a device (-1: CPU, else a CUDA index).
char* eng_rng_get_state(int device, at::Tensor** out) {
  ENG_PROTECT({
    auto dev = device < 0 ? c10::Device(c10::kCPU) : c10::Device(c10::kCUDA, device);
    auto gen = at::globalContext().defaultGenerator(dev);
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = new at::Tensor(gen.get_state());
  })
}

char* eng_rng_set_state(int device, at::Tensor* state) {
  ENG_PROTECT({
    auto dev = device < 0 ? c10::Device(c10::kCPU) : c10::Device(c10::kCUDA, device);
    auto gen = at::globalContext().defaultGenerator(dev);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  })
}

}  // extern "C"
