// Prepended to every kernel source. NVRTC compiles here without the CUDA toolkit's headers, so
// the 16-bit float types are plain bit patterns converted by hand (bf16: the high half of an
// f32, rounded to nearest even as PyTorch does; f16: PTX's own conversions). All arithmetic is
// done in f32.
typedef unsigned short u16;
typedef long long i64;
struct bf16 { u16 bits; };
struct f16 { u16 bits; };

#define NEG_INF __int_as_float(0xff800000)

// f16 <-> f32 by PTX's conversions (round to nearest even). The CPU emulator
// (kernels/src/cuda/emulator.hpp) defines its own.
#ifndef KERNELS_EMULATOR
__device__ __forceinline__ float f16_bits_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 float_to_f16_bits(float x) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}
#endif

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __uint_as_float(((unsigned int)x.bits) << 16); }
__device__ __forceinline__ float to_float(f16 x) { return f16_bits_to_float(x.bits); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
  unsigned int u = __float_as_uint(x);
  bf16 r;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    r.bits = 0x7fc0;  // NaN, as PyTorch writes it
  } else {
    r.bits = (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return r;
}
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
  f16 r;
  r.bits = float_to_f16_bits(x);
  return r;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The sum over the block, returned to every thread. blockDim.x is a multiple of 32 (at most
// 1024); `scratch` holds 32 floats in shared memory and may be reused by the next call.
__device__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // a previous call's readers are done with scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_sum(lane < warps ? scratch[lane] : 0.f);
}

__device__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_max(lane < warps ? scratch[lane] : NEG_INF);
}

// Four consecutive elements moved as one access (16 bytes of f32, 8 of bf16 or f16): memory
// bound kernels reach the device's bandwidth only with vector accesses. The address must be
// aligned to the four elements (the emulator fails a launch where it is not).
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[4];
};

template <typename T>
__device__ __forceinline__ Quad<T> load_quad(const T* p) {
#ifdef KERNELS_EMULATOR
  emu_check_aligned(p, sizeof(Quad<T>));
  Quad<T> q;
  memcpy(&q, p, sizeof q);
  return q;
#else
  return *reinterpret_cast<const Quad<T>*>(p);
#endif
}

template <typename T>
__device__ __forceinline__ void store_quad(T* p, const Quad<T>& q) {
#ifdef KERNELS_EMULATOR
  emu_check_aligned(p, sizeof(Quad<T>));
  memcpy(p, &q, sizeof q);
#else
  *reinterpret_cast<Quad<T>*>(p) = q;
#endif
}

// Elements p[0..n) (n <= 4) as floats, zeros after: one vector access for four elements where
// `vec` (p then aligned), else one access per element (none for n = 0).
template <typename T>
__device__ __forceinline__ void load4(const T* p, int n, bool vec, float (&out)[4]) {
  if (vec && n == 4) {
    const Quad<T> q = load_quad(p);
    for (int k = 0; k < 4; ++k) out[k] = to_float(q.v[k]);
  } else {
    for (int k = 0; k < 4; ++k) out[k] = k < n ? to_float(p[k]) : 0.f;
  }
}

template <typename T>
__device__ __forceinline__ void store4(T* p, int n, bool vec, const float (&in)[4]) {
  if (vec && n == 4) {
    Quad<T> q;
    for (int k = 0; k < 4; ++k) q.v[k] = from_float<T>(in[k]);
    store_quad(p, q);
  } else {
    // A constant trip count: the loop unrolls and `in` stays in registers.
    for (int k = 0; k < 4; ++k)
      if (k < n) p[k] = from_float<T>(in[k]);
  }
}

// W consecutive elements moved as one access of W sizeof(T) bytes (4, 8 or 16; W = 1: one
// element), held as 32-bit words so that 16 bytes of bf16 or f16 are one 128-bit access (an
// array of eight 16-bit elements may be split into narrower ones) and each element is unpacked
// only when used. The address must be aligned to the W elements (the emulator fails a launch
// where it is not).
template <typename T> __device__ __forceinline__ float word_element(const unsigned* w, int k);
template <> __device__ __forceinline__ float word_element<float>(const unsigned* w, int k) {
  return __uint_as_float(w[k]);
}
template <> __device__ __forceinline__ float word_element<bf16>(const unsigned* w, int k) {
  bf16 h;
  h.bits = (u16)(w[k >> 1] >> (16 * (k & 1)));
  return to_float(h);
}
template <> __device__ __forceinline__ float word_element<f16>(const unsigned* w, int k) {
  f16 h;
  h.bits = (u16)(w[k >> 1] >> (16 * (k & 1)));
  return to_float(h);
}
template <typename T> __device__ __forceinline__ unsigned element_bits(float x) { return from_float<T>(x).bits; }
template <> __device__ __forceinline__ unsigned element_bits<float>(float x) { return __float_as_uint(x); }

template <typename T, int W>
struct alignas(W * sizeof(T)) Pack {
  static_assert(W * sizeof(T) % 4 == 0 && W * sizeof(T) <= 16, "a pack of 4, 8 or 16 bytes");
  unsigned w[W * sizeof(T) / 4];
  __device__ __forceinline__ float get(int k) const { return word_element<T>(w, k); }
  // From W floats, each rounded to T.
  __device__ __forceinline__ void set(const float (&in)[W]) {
    constexpr int per_word = 4 / sizeof(T);
#pragma unroll
    for (int j = 0; j < W / per_word; ++j) {
      unsigned word = 0;
#pragma unroll
      for (int h = 0; h < per_word; ++h) word |= element_bits<T>(in[j * per_word + h]) << (32 / per_word * h);
      w[j] = word;
    }
  }
};
template <typename T>
struct Pack<T, 1> {
  T e;
  __device__ __forceinline__ float get(int) const { return to_float(e); }
  __device__ __forceinline__ void set(const float (&in)[1]) { e = from_float<T>(in[0]); }
};

template <typename T, int W>
__device__ __forceinline__ Pack<T, W> load_pack(const T* p) {
#ifdef KERNELS_EMULATOR
  emu_check_aligned(p, sizeof(Pack<T, W>));
  Pack<T, W> q;
  memcpy(&q, p, sizeof q);
  return q;
#else
  return *reinterpret_cast<const Pack<T, W>*>(p);
#endif
}

template <typename T, int W>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, W>& q) {
#ifdef KERNELS_EMULATOR
  emu_check_aligned(p, sizeof(Pack<T, W>));
  memcpy(p, &q, sizeof q);
#else
  *reinterpret_cast<Pack<T, W>*>(p) = q;
#endif
}

// Row kernels give rows of up to WARP_COLS elements one warp each, the row in registers: lane l
// holds the quads l + 32 j (j < Q), so a quad's four elements are one access and the warp's
// accesses are contiguous. Blocks hold blockDim.x / 32 rows. Each is compiled for Q = 1, 2, 3,
// 4, 6 and 8 quads per lane (rows of up to 128 Q), and a row takes the least Q that holds it
// (checks.rs, `warp_quads`): the registers and loops then fit the row, where one Q of 8 for all
// rows held a row of 256 in four times the registers it needed (72 a thread for the softmax,
// 44% occupancy on an H200, four times PyTorch's softmax time).
#define WARP_COLS 1024
#define FOR_EACH_WARP_QUADS(M, T, S) M(T, S, 1) M(T, S, 2) M(T, S, 3) M(T, S, 4) M(T, S, 6) M(T, S, 8)

__device__ __forceinline__ i64 warp_row() { return (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); }

// The first column of lane `lane`'s quad j, and how many of its four lie in a row of `cols`
// (none, or fewer than four at the row's end).
__device__ __forceinline__ int quad_col(int lane, int j) { return 4 * (lane + 32 * j); }
__device__ __forceinline__ int quad_len(int c, int cols) { return c >= cols ? 0 : min(4, cols - c); }

// A grid-stride loop over n elements.
#define GRID_STRIDE(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// One kernel per dtype from a template: NAME_f32, NAME_bf16, NAME_f16.
#define FOR_EACH_DTYPE(DEFINE) DEFINE(float, f32) DEFINE(bf16, bf16) DEFINE(f16, f16)
