// Evoformer attention's softmax, fused: y = softmax(x * scale + 1e9 (mask - 1) + bias) over the
// last dimension, and its backward. x and y are [rows, cols] (rows = batch * heads * queries);
// the mask [batch, cols] is shared by the `per_batch` rows of a batch element (heads * queries);
// the bias has `bias_rows` rows and row r uses row r % bias_rows (a pair bias [heads, q, k]
// shared across the batch, or one per row). Absent mask or bias: null pointers.
//
// One block per row. The forward reads the row twice: once for the running maximum and sum of
// exponentials (merged across threads, the "online softmax"), once to write.

template <typename T>
__device__ __forceinline__ float logit(const T* x, const T* mask, const T* bias, i64 row, i64 mask_row,
                                       i64 bias_row, int cols, int c, float scale) {
  float z = to_float(x[row * cols + c]) * scale;
  if (mask) z += 1e9f * (to_float(mask[mask_row * cols + c]) - 1.f);
  if (bias) z += to_float(bias[bias_row * cols + c]);
  return z;
}

template <typename T>
__device__ void softmax_forward(const T* x, const T* mask, const T* bias, T* y, int cols, i64 per_batch,
                                i64 bias_rows, float scale) {
  __shared__ float scratch[32];
  const i64 row = blockIdx.x;
  const i64 mask_row = row / per_batch, bias_row = bias_rows > 0 ? row % bias_rows : 0;
  float m = NEG_INF, s = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float z = logit(x, mask, bias, row, mask_row, bias_row, cols, c, scale);
    if (z == NEG_INF) continue;  // contributes nothing (and exp(-inf - -inf) would be NaN)
    if (z > m) {
      s = s * expf(m - z) + 1.f;
      m = z;
    } else {
      s += expf(z - m);
    }
  }
  const float row_max = block_max(m, scratch);
  const float sum = block_sum(m == NEG_INF ? 0.f : s * expf(m - row_max), scratch);
  const float inv = 1.f / sum;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float z = logit(x, mask, bias, row, mask_row, bias_row, cols, c, scale);
    y[row * cols + c] = from_float<T>(expf(z - row_max) * inv);
  }
}

// dz = y (dy - sum(dy y)); dx = scale dz; dlogits (when not null) = dz, for the bias gradient.
template <typename T>
__device__ void softmax_backward(const T* y, const T* dy, T* dx, T* dlogits, int cols, float scale) {
  __shared__ float scratch[32];
  const i64 base = (i64)blockIdx.x * cols;
  float dot = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) dot += to_float(dy[base + c]) * to_float(y[base + c]);
  dot = block_sum(dot, scratch);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float dz = to_float(y[base + c]) * (to_float(dy[base + c]) - dot);
    dx[base + c] = from_float<T>(dz * scale);
    if (dlogits) dlogits[base + c] = from_float<T>(dz);
  }
}

#define DEFINE(T, S)                                                                                     \
  extern "C" __global__ void attention_softmax_forward_##S(const T* x, const T* mask, const T* bias, T* y, \
                                                           int cols, i64 per_batch, i64 bias_rows,      \
                                                           float scale) {                                 \
    softmax_forward<T>(x, mask, bias, y, cols, per_batch, bias_rows, scale);                              \
  }                                                                                                       \
  extern "C" __global__ void attention_softmax_backward_##S(const T* y, const T* dy, T* dx, T* dlogits,   \
                                                            int cols, float scale) {                      \
    softmax_backward<T>(y, dy, dx, dlogits, cols, scale);                                                 \
  }
FOR_EACH_DTYPE(DEFINE)
