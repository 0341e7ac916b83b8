// LayerNorm over the last dimension of x [rows, cols] with weight and bias [cols]: the forward
// writes y and each row's mean and 1/std (f32, saved for the backward); the backward writes dx
// per row, and partial sums of the weight's and bias's gradients over blocks of rows
// ([parts, cols], f32), which the caller adds up.

template <typename T>
__device__ void ln_forward(const T* x, const T* w, const T* b, T* y, float* mean_out, float* rstd_out, int cols,
                           float eps) {
  __shared__ float scratch[32];
  const i64 base = (i64)blockIdx.x * cols;
  float s = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += to_float(x[base + c]);
  const float mean = block_sum(s, scratch) / cols;
  float q = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = to_float(x[base + c]) - mean;
    q += d * d;
  }
  const float rstd = rsqrtf(block_sum(q, scratch) / cols + eps);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_float(x[base + c]) - mean) * rstd;
    y[base + c] = from_float<T>(xhat * to_float(w[c]) + to_float(b[c]));
  }
  if (threadIdx.x == 0) {
    mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w.
template <typename T>
__device__ void ln_backward_input(const T* x, const T* w, const float* mean, const float* rstd, const T* dy, T* dx,
                                  int cols) {
  __shared__ float scratch[32];
  const i64 base = (i64)blockIdx.x * cols;
  const float mu = mean[blockIdx.x], r = rstd[blockIdx.x];
  float sg = 0.f, sgx = 0.f;
  // g rounded alike in both loops (__fmul_rn is never fused into an FMA): a contracted
  // `dy * w - sg` below would leave the product's rounding error, times rstd, in dx where the
  // exact value is 0 (seen on an H200 with one column, 1.9e-5 against torch's 0).
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = __fmul_rn(to_float(dy[base + c]), to_float(w[c]));
    sg += g;
    sgx += g * (to_float(x[base + c]) - mu) * r;
  }
  sg = block_sum(sg, scratch) / cols;
  sgx = block_sum(sgx, scratch) / cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = __fmul_rn(to_float(dy[base + c]), to_float(w[c]));
    const float xhat = (to_float(x[base + c]) - mu) * r;
    dx[base + c] = from_float<T>(r * (g - sg - xhat * sgx));
  }
}

// Block (i, p) sums columns [i * blockDim.x, ...) over rows [p * rows_per_part, ...).
template <typename T>
__device__ void ln_backward_params(const T* x, const float* mean, const float* rstd, const T* dy, float* dw_parts,
                                   float* db_parts, int rows, int cols, int rows_per_part) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int start = blockIdx.y * rows_per_part;
  const int end = min(rows, start + rows_per_part);
  float dw = 0.f, db = 0.f;
  for (int r = start; r < end; ++r) {
    const i64 i = (i64)r * cols + c;
    const float g = to_float(dy[i]);
    dw += g * (to_float(x[i]) - mean[r]) * rstd[r];
    db += g;
  }
  dw_parts[(i64)blockIdx.y * cols + c] = dw;
  db_parts[(i64)blockIdx.y * cols + c] = db;
}

#define DEFINE(T, S)                                                                                          \
  extern "C" __global__ void layer_norm_forward_##S(const T* x, const T* w, const T* b, T* y, float* mean,    \
                                                    float* rstd, int cols, float eps) {                        \
    ln_forward<T>(x, w, b, y, mean, rstd, cols, eps);                                                        \
  }                                                                                                          \
  extern "C" __global__ void layer_norm_backward_input_##S(const T* x, const T* w, const float* mean,         \
                                                           const float* rstd, const T* dy, T* dx, int cols) {  \
    ln_backward_input<T>(x, w, mean, rstd, dy, dx, cols);                                                    \
  }                                                                                                          \
  extern "C" __global__ void layer_norm_backward_params_##S(const T* x, const float* mean, const float* rstd,  \
                                                            const T* dy, float* dw_parts, float* db_parts,    \
                                                            int rows, int cols, int rows_per_part) {          \
    ln_backward_params<T>(x, mean, rstd, dy, dw_parts, db_parts, rows, cols, rows_per_part);                 \
  }
FOR_EACH_DTYPE(DEFINE)
