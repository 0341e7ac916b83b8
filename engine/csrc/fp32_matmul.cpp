// How libtorch's CUDA matrix products treat fp32 inputs: TF32 tensor cores or IEEE fp32
// (cuBLAS's math mode, chosen per call from the global setting and the calling thread's
// NoTF32Guard). Neither needs a device: on a machine without a GPU they only set flags.
#include <ATen/Context.h>

#include "protect.h"

extern "C" {

// The legacy setter keeps libtorch's two records of the setting (the matmul precision and
// the per-backend fp32 precision) in step; setting only the new one makes allowTF32CuBLAS()
// throw on the mismatch. It leaves oneDNN's CPU products alone.
char* eng_set_tf32_matmul(int on) {
  ENG_PROTECT({ at::globalContext().setAllowTF32CuBLAS(on != 0); })
}

char* eng_tf32_matmul(int* on) {
  ENG_PROTECT({ *on = at::globalContext().allowTF32CuBLAS() ? 1 : 0; })
}

// A NoTF32Guard on the calling thread (IEEE products there until it is freed, on that
// thread); null only where the allocation failed.
void* eng_ieee_scope_enter() {
  try {
    return new at::NoTF32Guard();
  } catch (...) {
    return nullptr;
  }
}

void eng_ieee_scope_exit(void* scope) { delete static_cast<at::NoTF32Guard*>(scope); }

int eng_ieee_scope_in_force() { return at::NoTF32Guard::should_disable_tf32() ? 1 : 0; }

}  // extern "C"
