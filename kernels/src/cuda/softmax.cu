// Evoformer attention's softmax, fused: y = softmax(x * scale + 1e9 (mask - 1) + bias) over the
// last dimension, and its backward. x and y are [rows, cols] (rows = batch * heads * queries);
// the mask [batch, cols] is shared by the `per_batch` rows of a batch element (heads * queries);
// the bias has `bias_rows` rows and row r uses row r % bias_rows (a pair bias [heads, q, k]
// shared across the batch, or one per row). Absent mask or bias: null pointers.
//
// Rows of up to WARP_COLS take the warp kernels below. Longer rows: one block per row. The
// forward reads the row twice: once for the running maximum and sum of exponentials (merged
// across threads, the "online softmax"), once to write. Both kinds of entry point take the same
// arguments (the block kernels ignore `rows` and `vec`), so the caller picks one by name.

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

// The same for rows of at most WARP_COLS, one warp each with the row in registers: x, the mask
// and the bias are read once, and the reductions are shuffles (no shared memory, no block
// barriers). `vec`: cols a multiple of 4 and every pointer aligned to four elements.
template <typename T, int Q>
__device__ void softmax_forward_warp(const T* x, const T* mask, const T* bias, T* y, i64 rows, int cols,
                                     i64 per_batch, i64 bias_rows, float scale, int vec) {
  const int lane = threadIdx.x & 31;
  const i64 row = warp_row();
  if (row >= rows) return;  // the whole warp: its row is its own
  const i64 mask_row = row / per_batch, bias_row = bias_rows > 0 ? row % bias_rows : 0;
  float z[Q][4];
  float m = NEG_INF;
  for (int j = 0; j < Q; ++j) {
    const int c = quad_col(lane, j), n = quad_len(c, cols);
    float xv[4], mv[4], bv[4];
    load4(x + row * cols + c, n, vec, xv);
    if (mask) load4(mask + mask_row * cols + c, n, vec, mv);
    if (bias) load4(bias + bias_row * cols + c, n, vec, bv);
    for (int k = 0; k < 4; ++k) {
      float v = xv[k] * scale;
      if (mask) v += 1e9f * (mv[k] - 1.f);
      if (bias) v += bv[k];
      z[j][k] = k < n ? v : NEG_INF;
      m = fmaxf(m, z[j][k]);
    }
  }
  m = warp_max(m);
  float s = 0.f;
  for (int j = 0; j < Q; ++j)
    for (int k = 0; k < 4; ++k) {
      // Past the row's end: no weight (exp(-inf - m) is 0, or NaN for a row of nothing but
      // -inf, as the composition gives).
      z[j][k] = quad_col(lane, j) + k < cols ? expf(z[j][k] - m) : 0.f;
      s += z[j][k];
    }
  const float inv = 1.f / warp_sum(s);
  for (int j = 0; j < Q; ++j) {
    const int c = quad_col(lane, j), n = quad_len(c, cols);
    if (n == 0) continue;
    for (int k = 0; k < 4; ++k) z[j][k] *= inv;
    store4(y + row * cols + c, n, vec, z[j]);
  }
}

template <typename T, int Q>
__device__ void softmax_backward_warp(const T* y, const T* dy, T* dx, T* dlogits, i64 rows, int cols, float scale,
                                      int vec) {
  const int lane = threadIdx.x & 31;
  const i64 row = warp_row();
  if (row >= rows) return;
  float yv[Q][4], g[Q][4];
  float dot = 0.f;
  for (int j = 0; j < Q; ++j) {
    const int c = quad_col(lane, j), n = quad_len(c, cols);
    load4(y + row * cols + c, n, vec, yv[j]);
    load4(dy + row * cols + c, n, vec, g[j]);
    for (int k = 0; k < 4; ++k) dot += g[j][k] * yv[j][k];  // zeros past the row's end
  }
  dot = warp_sum(dot);
  for (int j = 0; j < Q; ++j) {
    const int c = quad_col(lane, j), n = quad_len(c, cols);
    if (n == 0) continue;
    float dz[4], d[4];
    for (int k = 0; k < 4; ++k) {
      dz[k] = yv[j][k] * (g[j][k] - dot);
      d[k] = dz[k] * scale;
    }
    store4(dx + row * cols + c, n, vec, d);
    if (dlogits) store4(dlogits + row * cols + c, n, vec, dz);
  }
}

#define DEFINE_WARP(T, S, Q)                                                                               \
  extern "C" __global__ void attention_softmax_forward_warp##Q##_##S(const T* x, const T* mask, const T* bias, \
                                                                     T* y, i64 rows, int cols, i64 per_batch, \
                                                                     i64 bias_rows, float scale, int vec) {   \
    softmax_forward_warp<T, Q>(x, mask, bias, y, rows, cols, per_batch, bias_rows, scale, vec);             \
  }                                                                                                         \
  extern "C" __global__ void attention_softmax_backward_warp##Q##_##S(const T* y, const T* dy, T* dx,        \
                                                                      T* dlogits, i64 rows, int cols,       \
                                                                      float scale, int vec) {               \
    softmax_backward_warp<T, Q>(y, dy, dx, dlogits, rows, cols, scale, vec);                                \
  }

#define DEFINE(T, S)                                                                                     \
  extern "C" __global__ void attention_softmax_forward_##S(const T* x, const T* mask, const T* bias, T* y, \
                                                           i64 rows, int cols, i64 per_batch,           \
                                                           i64 bias_rows, float scale, int vec) {       \
    softmax_forward<T>(x, mask, bias, y, cols, per_batch, bias_rows, scale);                              \
  }                                                                                                       \
  extern "C" __global__ void attention_softmax_backward_##S(const T* y, const T* dy, T* dx, T* dlogits,   \
                                                            i64 rows, int cols, float scale, int vec) {   \
    softmax_backward<T>(y, dy, dx, dlogits, cols, scale);                                                 \
  }                                                                                                       \
  FOR_EACH_WARP_QUADS(DEFINE_WARP, T, S)
FOR_EACH_DTYPE(DEFINE)
