// Resizing a tensor's storage in place: every view of the storage (parameters that are views
// into a chunk, and the copies autograd saved of them) sees the change. Gemini frees a chunk's
// memory by resizing its storage to zero bytes and brings it back by resizing it to its full
// size, without touching the tensors that point into it.
#include <ATen/core/Tensor.h>
#include <ATen/native/Resize.h>
#include <ATen/native/cuda/Resize.h>

#include "protect.h"

extern "C" {

char* eng_storage_resize(at::Tensor* t, int64_t nbytes) {
  ENG_PROTECT({
    TORCH_CHECK(nbytes >= 0, "storage size must not be negative, got ", nbytes);
    auto* impl = t->storage().unsafeGetStorageImpl();
    if (t->is_cuda()) {
      at::native::resize_bytes_cuda(impl, static_cast<size_t>(nbytes));
    } else if (t->is_cpu()) {
      at::native::resize_bytes_cpu(impl, static_cast<size_t>(nbytes));
    } else {
      TORCH_CHECK(false, "storage resize: unsupported device ", t->device());
    }
  })
}

char* eng_storage_nbytes(at::Tensor* t, int64_t* out) {
  ENG_PROTECT({ *out = static_cast<int64_t>(t->storage().nbytes()); })
}

}  // extern "C"
