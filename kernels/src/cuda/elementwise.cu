// Element-wise fusions over x [rows, cols] with a bias [cols] broadcast over rows:
// y = gelu(x + b) (the exact, erf form: PyTorch's default and timm's nn.GELU) and its backward;
// y = residual + mask (x + b) / (1 - p) (dropout with a keep-mask drawn by the caller, 1 byte
// per element, or none) and its backward. Grid-stride loops over all n elements.

__device__ __forceinline__ float gelu(float z) { return 0.5f * z * (1.f + erff(z * 0.70710678118654752f)); }

// d gelu / dz = Phi(z) + z phi(z).
__device__ __forceinline__ float gelu_grad(float z) {
  const float cdf = 0.5f * (1.f + erff(z * 0.70710678118654752f));
  const float pdf = expf(-0.5f * z * z) * 0.39894228040143268f;
  return cdf + z * pdf;
}

template <typename T>
__device__ void bias_gelu_forward(const T* x, const T* b, T* y, i64 n, int cols) {
  GRID_STRIDE(i, n) { y[i] = from_float<T>(gelu(to_float(x[i]) + to_float(b[i % cols]))); }
}

template <typename T>
__device__ void bias_gelu_backward(const T* x, const T* b, const T* dy, T* dx, i64 n, int cols) {
  GRID_STRIDE(i, n) { dx[i] = from_float<T>(to_float(dy[i]) * gelu_grad(to_float(x[i]) + to_float(b[i % cols]))); }
}

template <typename T>
__device__ void bias_dropout_residual_forward(const T* x, const T* b, const T* residual, const unsigned char* keep,
                                              T* y, i64 n, int cols, float scale) {
  GRID_STRIDE(i, n) {
    float v = to_float(x[i]) + to_float(b[i % cols]);
    if (keep) v = keep[i] ? v * scale : 0.f;
    y[i] = from_float<T>(to_float(residual[i]) + v);
  }
}

template <typename T>
__device__ void dropout_backward(const T* dy, const unsigned char* keep, T* dx, i64 n, float scale) {
  GRID_STRIDE(i, n) { dx[i] = from_float<T>(keep[i] ? to_float(dy[i]) * scale : 0.f); }
}

#define DEFINE(T, S)                                                                                            \
  extern "C" __global__ void bias_gelu_forward_##S(const T* x, const T* b, T* y, i64 n, int cols) {            \
    bias_gelu_forward<T>(x, b, y, n, cols);                                                                    \
  }                                                                                                            \
  extern "C" __global__ void bias_gelu_backward_##S(const T* x, const T* b, const T* dy, T* dx, i64 n,         \
                                                    int cols) {                                                \
    bias_gelu_backward<T>(x, b, dy, dx, n, cols);                                                              \
  }                                                                                                            \
  extern "C" __global__ void bias_dropout_residual_forward_##S(const T* x, const T* b, const T* residual,      \
                                                               const unsigned char* keep, T* y, i64 n,         \
                                                               int cols, float scale) {                        \
    bias_dropout_residual_forward<T>(x, b, residual, keep, y, n, cols, scale);                                 \
  }                                                                                                            \
  extern "C" __global__ void dropout_backward_##S(const T* dy, const unsigned char* keep, T* dx, i64 n,        \
                                                  float scale) {                                               \
    dropout_backward<T>(dy, keep, dx, n, scale);                                                               \
  }
FOR_EACH_DTYPE(DEFINE)
