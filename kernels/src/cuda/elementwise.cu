// Element-wise fusions over x [rows, cols] with a bias [cols] broadcast over rows:
// y = gelu(x + b) (the exact, erf form: PyTorch's default and timm's nn.GELU) and its backward;
// y = residual + mask (x + b) / (1 - p) (dropout with a keep-mask drawn by the caller, 1 byte
// per element, or none) and its backward. Grid-stride loops over the n elements four at a
// time: with `vec` (cols a multiple of 4 and every pointer aligned to four elements, which the
// caller checks) each four are one vector access; otherwise element by element.

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

template <typename T>
__device__ void bias_gelu_forward(const T* x, const T* b, T* y, i64 n, int cols, int vec) {
  GRID_STRIDE_QUADS(i, n) {
    const int m = (int)min((i64)4, n - i);
    float v[4], bv[4];
    load4(x + i, m, vec, v);
    load_bias(b, i, m, cols, vec, bv);
    for (int k = 0; k < 4; ++k) v[k] = gelu(v[k] + bv[k]);
    store4(y + i, m, vec, v);
  }
}

template <typename T>
__device__ void bias_gelu_backward(const T* x, const T* b, const T* dy, T* dx, i64 n, int cols, int vec) {
  GRID_STRIDE_QUADS(i, n) {
    const int m = (int)min((i64)4, n - i);
    float v[4], bv[4], g[4];
    load4(x + i, m, vec, v);
    load_bias(b, i, m, cols, vec, bv);
    load4(dy + i, m, vec, g);
    for (int k = 0; k < 4; ++k) v[k] = g[k] * gelu_grad(v[k] + bv[k]);
    store4(dx + i, m, vec, v);
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
  extern "C" __global__ void bias_gelu_forward_##S(const T* x, const T* b, T* y, i64 n, int cols, int vec) {   \
    bias_gelu_forward<T>(x, b, y, n, cols, vec);                                                               \
  }                                                                                                            \
  extern "C" __global__ void bias_gelu_backward_##S(const T* x, const T* b, const T* dy, T* dx, i64 n,         \
                                                    int cols, int vec) {                                       \
    bias_gelu_backward<T>(x, b, dy, dx, n, cols, vec);                                                         \
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
