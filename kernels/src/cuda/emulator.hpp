// The CUDA C the kernels use, on the CPU: prepended to a kernel source (before the prelude) when
// kernels/src/emulator.rs compiles it with the system C++ compiler, so that tests without a GPU
// run every kernel through the same launch code as on a device.
//
// A launch runs its blocks one after another on the calling thread. A block's threads are
// fibers switched cooperatively: a thread runs until it reaches __syncthreads or a warp shuffle,
// or returns. A barrier opens when every thread it concerns has reached it: all of the block's
// for __syncthreads, the warp's 32 lanes for a shuffle, which then reads every lane's
// value before any lane goes on. Each warp runs as far ahead of the others as the barriers let
// it, in alternating orders (run_block), so that code missing a barrier reads or overwrites
// shared memory too early here too. The emulator is stricter than the hardware where the
// hardware forgives undefined code: a __syncthreads that some threads never reach (they
// returned, or wait at a shuffle), a shuffle that some lanes never reach, or a shuffle over a
// partial warp fails the launch with a message instead of running.
//
// __shared__ variables are thread-local statics: one copy per calling thread, shared by the
// block's fibers, and blocks never overlap (a block finds the previous block's values there,
// not garbage). Atomics are plain read-modify-writes for the same reason.
//
// A fiber starts on its own stack through makecontext/setcontext once per launch and then runs
// the kernel for each of the launch's blocks in turn. Every other switch is the compiler's
// __builtin_setjmp/__builtin_longjmp (GCC's and Clang's nonlocal goto: the stack and frame
// pointers and a resume address; the compiler saves the other registers around the setjmp):
// swapcontext saves and restores the signal mask with a system call at each switch, which was
// nine tenths of an emulated test's time, and libc's longjmp is fortified against jumping to
// another stack and, under AddressSanitizer, unpoisons the frames it leaves.
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

// AddressSanitizer (the parity tests' second run) is told of each switch, so that it checks
// each fiber's frames against that fiber's stack.
#if defined(__SANITIZE_ADDRESS__)
#define EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define EMU_ASAN 1
#endif
#endif
#ifdef EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#define KERNELS_EMULATOR 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
// The running fiber's indices, set by the scheduler before it resumes a fiber.
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
inline float __fmul_rn(float a, float b) { return a * b; }
// CUDA's integer min, for mixed int and long long arguments as device code writes them.
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
  return a < b ? a : b;
}
inline float atomicAdd(float* p, float v) {
  const float old = *p;
  *p = old + v;
  return old;
}

// f16 conversions rounding to nearest even, as PTX's cvt.rn does (the prelude's PTX versions
// stand aside when KERNELS_EMULATOR is defined).
inline float f16_bits_to_float(unsigned short h) {
  _Float16 f;
  std::memcpy(&f, &h, 2);
  return (float)f;
}
inline unsigned short float_to_f16_bits(float x) {
  const _Float16 f = (_Float16)x;
  unsigned short h;
  std::memcpy(&h, &f, 2);
  return h;
}

namespace emu {

enum class Wait { Running, Block, Warp, Done };

// What a fiber waiting at a warp barrier (Wait::Warp) does there.
enum class WarpOp { Xor, Index, Mma };

// A lane's part of an mma.sync (see mma below): its A and B fragment registers, and its
// accumulators, read and then overwritten.
struct MmaLane {
  int shape;  // MMA_TF32_M16N8K8, MMA_BF16_M16N8K16 or MMA_F16_M16N8K16
  const unsigned* a;
  const unsigned* b;
  float* d;
};

struct Fiber {
  ucontext_t start;    // the first entry, at the top of its stack
  void* resume[5];     // where it goes on after a wait (__builtin_setjmp's buffer)
  bool started = false;
  void* fake_stack = nullptr;  // AddressSanitizer's, saved while it waits
  Wait wait = Wait::Done;
  std::uint64_t value = 0, result = 0;  // a shuffle's value in, and the value it reads
  int lane_mask = 0;                    // xor: the mask; index: the source lane
  WarpOp op = WarpOp::Xor;
  const MmaLane* mma = nullptr;
};

// One launch on the calling thread.
struct Launch {
  void* scheduler[5];  // where the scheduler goes on when a fiber waits
  const void* scheduler_stack = nullptr;  // its stack, for AddressSanitizer
  std::size_t scheduler_stack_size = 0;
  void* scheduler_fake_stack = nullptr;
  std::vector<Fiber> fibers;
  int current = 0;
  void (*body)(void*) = nullptr;  // runs the kernel with its arguments
  void* bound = nullptr;
  std::string error;
};

inline thread_local Launch* active = nullptr;

// Fibers' stacks, kept per calling thread across launches.
constexpr std::size_t STACK = 64 * 1024;
inline thread_local std::vector<std::unique_ptr<char[]>> stacks;

inline Fiber& me() { return active->fibers[active->current]; }

// AddressSanitizer's fiber annotations: before a switch to the stack at `bottom`, and after
// one (the stack switched from written to `from` and `from_size` where asked).
inline void leaving(void** fake_stack, const void* bottom, std::size_t size) {
#ifdef EMU_ASAN
  __sanitizer_start_switch_fiber(fake_stack, bottom, size);
#else
  (void)fake_stack, (void)bottom, (void)size;
#endif
}
inline void arrived(void* fake_stack, const void** from, std::size_t* from_size) {
#ifdef EMU_ASAN
  __sanitizer_finish_switch_fiber(fake_stack, from, from_size);
#else
  (void)fake_stack, (void)from, (void)from_size;
#endif
}

// To the __builtin_setjmp that filled `to`. Not in the function that called that setjmp (the
// builtin's rule), and not instrumented: AddressSanitizer would unpoison the frames of the
// stack it leaves, which it comes back to.
__attribute__((noinline, no_sanitize_address)) inline void jump(void** to) { __builtin_longjmp(to, 1); }

// From the running fiber to the scheduler, until the scheduler resumes it.
inline void wait(Wait w) {
  Fiber& f = me();
  f.wait = w;
  if (__builtin_setjmp(f.resume) == 0) {
    leaving(&f.fake_stack, active->scheduler_stack, active->scheduler_stack_size);
    jump(active->scheduler);
  }
  arrived(f.fake_stack, nullptr, nullptr);
}

inline dim3 thread_index(int t, const dim3& b) {
  const unsigned u = (unsigned)t;
  return dim3{u % b.x, (u / b.x) % b.y, u / (b.x * b.y)};
}

inline std::string where(int t, const dim3& b) {
  const dim3 i = thread_index(t, b);
  return "thread (" + std::to_string(i.x) + "," + std::to_string(i.y) + "," + std::to_string(i.z) + ")";
}

// Fails the launch from inside a thread: the scheduler stops at once, and this fiber is never
// resumed.
inline void fail(const std::string& why) {
  if (active->error.empty()) active->error = where(active->current, blockDim) + ": " + why;
  wait(Wait::Done);
}

// A fiber's life: the kernel once for each block of the launch (the scheduler resumes it for
// the next block once every thread has returned). It never returns: the launch drops it.
inline void entry() {
  arrived(nullptr, &active->scheduler_stack, &active->scheduler_stack_size);
  for (;;) {
    active->body(active->bound);
    wait(Wait::Done);
  }
}

// From the scheduler into fiber `t`, until it waits again.
inline void resume(Launch& L, int t) {
  Fiber& f = L.fibers[t];
  if (__builtin_setjmp(L.scheduler) == 0) {
    leaving(&L.scheduler_fake_stack, f.start.uc_stack.ss_sp, f.start.uc_stack.ss_size);
    if (!f.started) {
      f.started = true;
      setcontext(&f.start);
    }
    jump(f.resume);
  }
  arrived(L.scheduler_fake_stack, nullptr, nullptr);
}

inline void run_mma(Launch& L, int lo);

// Opens warp `w`'s shuffle or mma if all its lanes wait there: every lane reads its partner's
// value (or the warp's product) before any goes on. False (error set) for a warp operation in a
// partial warp, or lanes waiting at different ones.
inline bool open_shuffle(Launch& L, int w, bool& opened) {
  const int n = (int)L.fibers.size(), lo = w * 32, hi = std::min(n, lo + 32);
  int waiting = 0;
  for (int t = lo; t < hi; ++t) waiting += L.fibers[t].wait == Wait::Warp;
  opened = waiting == 32;
  if (waiting > 0 && hi - lo < 32) {
    L.error = "a warp shuffle in a partial warp of " + std::to_string(hi - lo) + " threads";
    return false;
  }
  if (!opened) return true;  // the other lanes may still arrive
  const WarpOp op = L.fibers[lo].op;
  for (int t = lo; t < hi; ++t) {
    const Fiber& f = L.fibers[t];
    if (f.op != op || (op == WarpOp::Mma && f.mma->shape != L.fibers[lo].mma->shape)) {
      L.error = "the lanes of warp " + std::to_string(w) + " wait at different warp operations";
      return false;
    }
  }
  if (op == WarpOp::Mma) run_mma(L, lo);
  for (int t = lo; t < hi; ++t) {
    Fiber& f = L.fibers[t];
    // PTX's shfl.bfly and shfl.idx read the mask's or lane's low five bits.
    if (op == WarpOp::Xor) f.result = L.fibers[lo + ((t - lo) ^ (f.lane_mask & 31))].value;
    if (op == WarpOp::Index) f.result = L.fibers[lo + (f.lane_mask & 31)].value;
    f.wait = Wait::Running;
  }
  return true;
}

// Runs warp `w` as far as it goes alone: its lanes, each to its next wait, and again through
// every shuffle of the whole warp, until they wait at __syncthreads, at a shuffle some lane has
// not reached, or return. False on an error.
inline bool run_warp(Launch& L, int w) {
  const int n = (int)L.fibers.size(), lo = w * 32, hi = std::min(n, lo + 32);
  for (bool opened = true; opened;) {
    for (int t = lo; t < hi; ++t) {
      if (L.fibers[t].wait != Wait::Running) continue;
      L.current = t;
      threadIdx = thread_index(t, blockDim);
      resume(L, t);
      if (!L.error.empty()) return false;
    }
    if (!open_shuffle(L, w, opened)) return false;
  }
  return true;
}

// With every warp stopped: opens __syncthreads if every thread waits there; true when the
// block is done. False (error set) when nothing can open.
inline bool open_barrier(Launch& L, bool& done) {
  const int n = (int)L.fibers.size();
  int at_block = 0, returned = 0;
  for (const Fiber& f : L.fibers) {
    at_block += f.wait == Wait::Block;
    returned += f.wait == Wait::Done;
  }
  done = returned == n;
  if (at_block == n) {
    for (Fiber& f : L.fibers) f.wait = Wait::Running;
    return true;
  }
  if (done) return true;
  if (at_block == n - returned) {
    L.error = "__syncthreads reached by " + std::to_string(at_block) + " of " + std::to_string(n) +
              " threads; the others returned";
    return false;
  }
  // Some lanes wait at a shuffle that others never reach.
  for (int t = 0; t < n; ++t) {
    if (L.fibers[t].wait != Wait::Warp) continue;
    for (int u = t / 32 * 32; u < std::min(n, t / 32 * 32 + 32); ++u) {
      if (L.fibers[u].wait != Wait::Warp) {
        L.error = "a warp shuffle reached by " + where(t, blockDim) + " but not by " + where(u, blockDim) +
                  (L.fibers[u].wait == Wait::Done ? ", which returned" : ", which waits at __syncthreads");
        return false;
      }
    }
  }
  L.error = "the block's threads wait at barriers that cannot open";
  return false;
}

// Runs one block to completion; false on an error. Each warp runs as far ahead of the others
// as the code lets it, first to last in even blocks and last to first in odd ones, so that a
// missing __syncthreads shows as a warp reading or overwriting shared memory too early.
inline bool run_block(Launch& L, bool reverse) {
  const int n = (int)L.fibers.size(), warps = (n + 31) / 32;
  for (Fiber& f : L.fibers) f.wait = Wait::Running;
  for (bool done = false; !done;) {
    for (int i = 0; i < warps; ++i) {
      if (!run_warp(L, reverse ? warps - 1 - i : i)) return false;
    }
    if (!open_barrier(L, done)) return false;
  }
  return true;
}

// Runs `body(bound)` as a kernel over `grid` x `block`. Returns 0, or 1 with a message in
// `err` (NUL-terminated, cut to `err_len`).
inline int run(const unsigned* grid, const unsigned* block, void (*body)(void*), void* bound, char* err,
               std::size_t err_len) {
  Launch L;
  L.body = body;
  L.bound = bound;
  const dim3 g{grid[0], grid[1], grid[2]}, b{block[0], block[1], block[2]};
  const long threads = (long)b.x * b.y * b.z;
  auto failed = [&](const std::string& why) {
    std::snprintf(err, err_len, "%s", why.c_str());
    return 1;
  };
  if (threads < 1 || threads > 1024) return failed("a block of " + std::to_string(threads) + " threads");
  L.fibers.resize(threads);
  while (stacks.size() < (std::size_t)threads) stacks.emplace_back(new char[STACK]);
  for (long t = 0; t < threads; ++t) {
    Fiber& f = L.fibers[t];
    getcontext(&f.start);
    f.start.uc_stack.ss_sp = stacks[t].get();
    f.start.uc_stack.ss_size = STACK;
    f.start.uc_link = nullptr;
#ifdef EMU_ASAN
    // A failed launch left its fibers' frames on these stacks, their redzones poisoned.
    __asan_unpoison_memory_region(stacks[t].get(), STACK);
#endif
    makecontext(&f.start, entry, 0);
  }
  active = &L;
  gridDim = g;
  blockDim = b;
  int rc = 0;
  for (unsigned z = 0; z < g.z && rc == 0; ++z)
    for (unsigned y = 0; y < g.y && rc == 0; ++y)
      for (unsigned x = 0; x < g.x && rc == 0; ++x) {
        blockIdx = dim3{x, y, z};
        if (!run_block(L, (x + y + z) % 2 == 1)) {
          rc = failed("block (" + std::to_string(x) + "," + std::to_string(y) + "," + std::to_string(z) + "), " +
                      L.error);
        }
      }
  active = nullptr;
  return rc;
}

// Calls a kernel with its arguments read from the launcher's slots, each holding one argument
// in its low bytes as the CUDA driver reads them.
template <typename... A, std::size_t... I>
void call(void (*f)(A...), void** slots, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<A>*>(slots[I])...);
}

template <typename... A>
int launch(void (*f)(A...), const unsigned* grid, const unsigned* block, void** slots, char* err,
           std::size_t err_len) {
  struct Bound {
    void (*f)(A...);
    void** slots;
  } bound{f, slots};
  auto body = [](void* p) {
    auto* b = static_cast<Bound*>(p);
    call(b->f, b->slots, std::index_sequence_for<A...>{});
  };
  // Nothing may unwind into the Rust caller.
  try {
    return run(grid, block, body, &bound, err, err_len);
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
}

}  // namespace emu

inline void __syncthreads() { emu::wait(emu::Wait::Block); }

namespace emu {
template <typename T>
T shuffle(unsigned mask, T v, int lane, WarpOp op) {
  static_assert(sizeof(T) <= 8, "a shuffle of at most 8 bytes");
  if (mask != 0xffffffffu) fail("a shuffle with a partial mask (the emulator takes full warps only)");
  Fiber& f = me();
  std::memcpy(&f.value, &v, sizeof v);
  f.lane_mask = lane;
  f.op = op;
  wait(Wait::Warp);
  T r;
  std::memcpy(&r, &me().result, sizeof r);
  return r;
}
}  // namespace emu

template <typename T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
  return emu::shuffle(mask, v, lane_mask, emu::WarpOp::Xor);
}

template <typename T>
T __shfl_sync(unsigned mask, T v, int src_lane) {
  return emu::shuffle(mask, v, src_lane, emu::WarpOp::Index);
}

// mma.sync.aligned.m16n8k{8,16}.row.col.f32: D = A B + C over a warp, each lane holding the
// fragment elements the PTX ISA assigns it (groupID = lane / 4, threadID_in_group = lane % 4):
// A 16 x K, B K x 8, C and D 16 x 8 in f32. The lanes meet as at a shuffle; the product is taken
// in f32 from every lane's registers before any lane's accumulators are overwritten.
#define MMA_TF32_M16N8K8 0
#define MMA_BF16_M16N8K16 1
#define MMA_F16_M16N8K16 2

inline void emu_mma(int shape, const unsigned* a, const unsigned* b, float* d) {
  emu::MmaLane lane{shape, a, b, d};
  emu::Fiber& f = emu::me();
  f.op = emu::WarpOp::Mma;
  f.mma = &lane;
  emu::wait(emu::Wait::Warp);
  emu::me().mma = nullptr;
}

// PTX's cvt.rna.tf32.f32: to TF32's 10-bit mantissa, rounding to nearest, ties away from zero
// (the low 13 bits cleared); infinities and NaN unchanged.
inline unsigned emu_tf32(float x) {
  unsigned u = __float_as_uint(x);
  if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;
  return u & 0xffffe000u;
}

namespace emu {
// A 16-bit element of a fragment register: the lower half holds the element of lower index.
inline float half_of(unsigned reg, int hi, int shape) {
  const unsigned short bits = (unsigned short)(reg >> (16 * hi));
  return shape == MMA_BF16_M16N8K16 ? __uint_as_float((unsigned)bits << 16) : f16_bits_to_float(bits);
}

inline void run_mma(Launch& L, int lo) {
  const int shape = L.fibers[lo].mma->shape, K = shape == MMA_TF32_M16N8K8 ? 8 : 16;
  float A[16][16] = {}, B[16][8] = {}, C[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const MmaLane& m = *L.fibers[lo + lane].mma;
    const int g = lane >> 2, t = lane & 3;
    if (shape == MMA_TF32_M16N8K8) {
      // The hardware reads a TF32 operand's top 19 bits.
      auto tf = [](unsigned r) { return __uint_as_float(r & 0xffffe000u); };
      A[g][t] = tf(m.a[0]);
      A[g + 8][t] = tf(m.a[1]);
      A[g][t + 4] = tf(m.a[2]);
      A[g + 8][t + 4] = tf(m.a[3]);
      B[t][g] = tf(m.b[0]);
      B[t + 4][g] = tf(m.b[1]);
    } else {
      for (int h = 0; h < 2; ++h) {
        A[g][2 * t + h] = half_of(m.a[0], h, shape);
        A[g + 8][2 * t + h] = half_of(m.a[1], h, shape);
        A[g][2 * t + 8 + h] = half_of(m.a[2], h, shape);
        A[g + 8][2 * t + 8 + h] = half_of(m.a[3], h, shape);
        B[2 * t + h][g] = half_of(m.b[0], h, shape);
        B[2 * t + 8 + h][g] = half_of(m.b[1], h, shape);
      }
    }
    C[g][2 * t] = m.d[0];
    C[g][2 * t + 1] = m.d[1];
    C[g + 8][2 * t] = m.d[2];
    C[g + 8][2 * t + 1] = m.d[3];
  }
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 8; ++c)
      for (int k = 0; k < K; ++k) C[r][c] += A[r][k] * B[k][c];
  for (int lane = 0; lane < 32; ++lane) {
    float* d = L.fibers[lo + lane].mma->d;
    const int g = lane >> 2, t = lane & 3;
    d[0] = C[g][2 * t];
    d[1] = C[g][2 * t + 1];
    d[2] = C[g + 8][2 * t];
    d[3] = C[g + 8][2 * t + 1];
  }
}
}  // namespace emu

// A vector access (prelude.cuh's load_quad/store_quad) at an address the hardware would fault
// on fails the launch here too.
inline void emu_check_aligned(const void* p, std::size_t align) {
  if (reinterpret_cast<std::uintptr_t>(p) % align != 0)
    emu::fail("a " + std::to_string(align) + "-byte vector access at a misaligned address");
}
