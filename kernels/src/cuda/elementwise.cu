// Element-wise fusions over x [rows, cols] with a bias [cols] broadcast over rows:
// y = gelu(x + b) (the exact, erf form: PyTorch's default and timm's nn.GELU) and its backward;
// y = residual + mask (x + b) / (1 - p) (dropout with a keep-mask drawn by the caller, 1 byte
// per element, or none) and its backward.
//
// bias + GELU moves `width` elements per access: 16 bytes (8 bf16 or f16, 4 f32), else 8, else
// one element, the widest that divides cols and to which every pointer is aligned (the caller
// picks it), so a vector never straddles two rows and its bias is one access too. Each thread
// takes GELU_VECTORS vectors per trip of a grid-stride loop over a grid the size of what the
// device holds at once, loading them all before computing any, so that several accesses per
// thread are in flight. The dropout kernels go four elements at a time: with `vec` (cols a
// multiple of 4 and every pointer aligned to four elements, which the caller checks) each four
// are one vector access; otherwise element by element.

__device__ __forceinline__ float gelu(float z) { return 0.5f * z * (1.f + erff(z * 0.70710678118654752f)); }

// d gelu / dz = Phi(z) + z phi(z).
__device__ __forceinline__ float gelu_grad(float z) {
  const float cdf = 0.5f * (1.f + erff(z * 0.70710678118654752f));
  const float pdf = expf(-0.5f * z * z) * 0.39894228040143268f;
  return cdf + z * pdf;
}

// Element i's column (its bias element): in 32 bits where i fits, several times cheaper than a
// 64-bit remainder.
__device__ __forceinline__ int column(i64 i, int cols) {
  return (unsigned long long)i <= 0xffffffffull ? (int)((unsigned)i % (unsigned)cols) : (int)(i % cols);
}

// A grid-stride loop over n elements, four at a time: i is the first of them.
#define GRID_STRIDE_QUADS(i, n)                                                                  \
  for (i64 i = 4 * ((i64)blockIdx.x * blockDim.x + threadIdx.x); i < (n); i += 4 * (i64)blockDim.x * gridDim.x)

// The bias elements of elements [i, i + n): with `vec` one access (the four share a row).
template <typename T>
__device__ __forceinline__ void load_bias(const T* b, i64 i, int n, int cols, bool vec, float (&out)[4]) {
  if (vec && n == 4) return load4(b + column(i, cols), 4, true, out);
  for (int k = 0; k < 4; ++k) out[k] = k < n ? to_float(b[column(i + k, cols)]) : 0.f;
}

__device__ __forceinline__ void load_keep(const unsigned char* keep, int n, bool vec, bool (&out)[4]) {
  if (vec && n == 4) {
    const Quad<unsigned char> q = load_quad(keep);
    for (int k = 0; k < 4; ++k) out[k] = q.v[k] != 0;
  } else {
    for (int k = 0; k < 4; ++k) out[k] = k < n && keep[k] != 0;
  }
}

// Vectors per thread per trip of bias + GELU's grid-stride loop (GELU_VECTORS in elementwise.rs).
#define GELU_VECTORS 4

// The column of a thread's elements first, first + stride, first + 2 stride, ...: a 64-bit
// remainder once per thread, then an addition per step (a remainder per vector costs more than
// the memory access it feeds). Columns and steps are below cols < 2^31, so their sum fits.
struct Columns {
  unsigned at, step, cols;
  __device__ __forceinline__ Columns(i64 first, i64 stride, int cols)
      : at((unsigned)(first % cols)), step((unsigned)(stride % cols)), cols((unsigned)cols) {}
  __device__ __forceinline__ unsigned next() {
    const unsigned c = at;
    at += step;
    if (at >= cols) at -= cols;
    return c;
  }
};

// The n / W vectors of W elements (n a multiple of W: rows of cols, cols a multiple of W) in a
// grid-stride loop: a thread's GELU_VECTORS vectors of a trip lie `threads` vectors apart (each
// warp's accesses contiguous), loaded (x, its bias, and for the gradient dy) before any is
// computed. Forward: out = gelu(x + b); GRAD: out = dy gelu'(x + b) (dy unread otherwise). The
// arithmetic per element is the element path's.
template <typename T, int W, bool GRAD>
__device__ __forceinline__ void bias_gelu_w(const T* __restrict__ x, const T* __restrict__ b,
                                            const T* __restrict__ dy, T* __restrict__ out, i64 n, int cols) {
  const i64 vectors = n / W, threads = (i64)blockDim.x * gridDim.x;
  const i64 first = (i64)blockIdx.x * blockDim.x + threadIdx.x;
  Columns col(first * W, threads * W, cols);
  for (i64 v = first; v < vectors; v += GELU_VECTORS * threads) {
    Pack<T, W> xv[GELU_VECTORS], bv[GELU_VECTORS], gv[GELU_VECTORS];
#pragma unroll
    for (int u = 0; u < GELU_VECTORS; ++u) {
      const i64 at = v + u * threads;
      const unsigned c = col.next();
      if (at < vectors) {
        xv[u] = load_pack<T, W>(x + at * W);
        bv[u] = load_pack<T, W>(b + c);
        if (GRAD) gv[u] = load_pack<T, W>(dy + at * W);
      }
    }
#pragma unroll
    for (int u = 0; u < GELU_VECTORS; ++u) {
      const i64 at = v + u * threads;
      if (at >= vectors) continue;
      float o[W];
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const float z = xv[u].get(k) + bv[u].get(k);
        o[k] = GRAD ? gv[u].get(k) * gelu_grad(z) : gelu(z);
      }
      Pack<T, W> q;
      q.set(o);
      store_pack<T, W>(out + at * W, q);
    }
  }
}

// `width`: 16 / sizeof(T) or 8 / sizeof(T) elements per access, anything else one.
template <typename T, bool GRAD>
__device__ void bias_gelu(const T* x, const T* b, const T* dy, T* out, i64 n, int cols, int width) {
  constexpr int V16 = 16 / sizeof(T), V8 = 8 / sizeof(T);
  if (width == V16) {
    bias_gelu_w<T, V16, GRAD>(x, b, dy, out, n, cols);
  } else if (width == V8) {
    bias_gelu_w<T, V8, GRAD>(x, b, dy, out, n, cols);
  } else {
    bias_gelu_w<T, 1, GRAD>(x, b, dy, out, n, cols);
  }
}

template <typename T>
__device__ void bias_dropout_residual_forward(const T* x, const T* b, const T* residual, const unsigned char* keep,
                                              T* y, i64 n, int cols, float scale, int vec) {
  GRID_STRIDE_QUADS(i, n) {
    const int m = (int)min((i64)4, n - i);
    float v[4], bv[4], r[4];
    bool kept[4] = {true, true, true, true};
    load4(x + i, m, vec, v);
    load_bias(b, i, m, cols, vec, bv);
    load4(residual + i, m, vec, r);
    if (keep) load_keep(keep + i, m, vec, kept);
    for (int k = 0; k < 4; ++k) {
      const float z = v[k] + bv[k];
      v[k] = r[k] + (keep ? (kept[k] ? z * scale : 0.f) : z);
    }
    store4(y + i, m, vec, v);
  }
}

template <typename T>
__device__ void dropout_backward(const T* dy, const unsigned char* keep, T* dx, i64 n, float scale, int vec) {
  GRID_STRIDE_QUADS(i, n) {
    const int m = (int)min((i64)4, n - i);
    float g[4];
    bool kept[4];
    load4(dy + i, m, vec, g);
    load_keep(keep + i, m, vec, kept);
    for (int k = 0; k < 4; ++k) g[k] = kept[k] ? g[k] * scale : 0.f;
    store4(dx + i, m, vec, g);
  }
}

#define DEFINE(T, S)                                                                                            \
  extern "C" __global__ void bias_gelu_forward_##S(const T* x, const T* b, T* y, i64 n, int cols, int width) { \
    bias_gelu<T, false>(x, b, nullptr, y, n, cols, width);                                                     \
  }                                                                                                            \
  extern "C" __global__ void bias_gelu_backward_##S(const T* x, const T* b, const T* dy, T* dx, i64 n,         \
                                                    int cols, int width) {                                     \
    bias_gelu<T, true>(x, b, dy, dx, n, cols, width);                                                          \
  }                                                                                                            \
  extern "C" __global__ void bias_dropout_residual_forward_##S(const T* x, const T* b, const T* residual,      \
                                                               const unsigned char* keep, T* y, i64 n,         \
                                                               int cols, float scale, int vec) {               \
    bias_dropout_residual_forward<T>(x, b, residual, keep, y, n, cols, scale, vec);                            \
  }                                                                                                            \
  extern "C" __global__ void dropout_backward_##S(const T* dy, const unsigned char* keep, T* dx, i64 n,        \
                                                  float scale, int vec) {                                      \
    dropout_backward<T>(dy, keep, dx, n, scale, vec);                                                          \
  }
FOR_EACH_DTYPE(DEFINE)
