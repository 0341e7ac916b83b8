// LayerNorm over the last dimension of x [rows, cols] with weight and bias [cols]: the forward
// writes y and each row's mean and 1/std (f32, saved for the backward); the backward writes dx
// per row, and partial sums of the weight's and bias's gradients over blocks of rows
// ([parts, cols], f32), which the caller adds up.
//
// Forward and backward read x's rows where a `Rows` layout puts them, so that a transposed view
// (an MSA's columns, a pair's) is normalised, and differentiated, without first being copied;
// y, dy and dx are contiguous.

// Where row r of x starts: groups of `inner` rows `inner_stride` apart, the groups
// `outer_stride` apart (contiguous x: inner = rows, inner_stride = cols).
struct Rows {
  i64 inner, inner_stride, outer_stride;
  __device__ __forceinline__ i64 at(i64 r) const { return (r / inner) * outer_stride + (r % inner) * inner_stride; }
};

template <typename T>
__device__ void ln_forward(const T* x, const T* w, const T* b, T* y, float* mean_out, float* rstd_out, int cols,
                           float eps, Rows layout) {
  __shared__ float scratch[32];
  const i64 in = layout.at(blockIdx.x), out = (i64)blockIdx.x * cols;
  float s = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) s += to_float(x[in + c]);
  const float mean = block_sum(s, scratch) / cols;
  float q = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float d = to_float(x[in + c]) - mean;
    q += d * d;
  }
  const float rstd = rsqrtf(block_sum(q, scratch) / cols + eps);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float xhat = (to_float(x[in + c]) - mean) * rstd;
    y[out + c] = from_float<T>(xhat * to_float(w[c]) + to_float(b[c]));
  }
  if (threadIdx.x == 0) {
    mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
}

// dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w.
template <typename T>
__device__ void ln_backward_input(const T* x, const T* w, const float* mean, const float* rstd, const T* dy, T* dx,
                                  int cols, Rows layout) {
  __shared__ float scratch[32];
  const i64 base = (i64)blockIdx.x * cols, in = layout.at(blockIdx.x);
  const float mu = mean[blockIdx.x], r = rstd[blockIdx.x];
  float sg = 0.f, sgx = 0.f;
  // g rounded alike in both loops (__fmul_rn is never fused into an FMA): a contracted
  // `dy * w - sg` below would leave the product's rounding error, times rstd, in dx where the
  // exact value is 0 (seen on an H200 with one column, 1.9e-5 against torch's 0).
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = __fmul_rn(to_float(dy[base + c]), to_float(w[c]));
    sg += g;
    sgx += g * (to_float(x[in + c]) - mu) * r;
  }
  sg = block_sum(sg, scratch) / cols;
  sgx = block_sum(sgx, scratch) / cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    const float g = __fmul_rn(to_float(dy[base + c]), to_float(w[c]));
    const float xhat = (to_float(x[in + c]) - mu) * r;
    dx[base + c] = from_float<T>(r * (g - sg - xhat * sgx));
  }
}

// Block (i, p) sums columns [i * blockDim.x, ...) over rows [p * rows_per_part, ...).
template <typename T>
__device__ void ln_backward_params(const T* x, const float* mean, const float* rstd, const T* dy, float* dw_parts,
                                   float* db_parts, int rows, int cols, int rows_per_part, Rows layout) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  // 64-bit: the last part's start + rows_per_part may pass 2^31 for rows near it.
  const i64 start = (i64)blockIdx.y * rows_per_part;
  const i64 end = min((i64)rows, start + rows_per_part);
  float dw = 0.f, db = 0.f;
  for (i64 r = start; r < end; ++r) {
    const float g = to_float(dy[r * cols + c]);
    dw += g * (to_float(x[layout.at(r) + c]) - mean[r]) * rstd[r];
    db += g;
  }
  dw_parts[(i64)blockIdx.y * cols + c] = dw;
  db_parts[(i64)blockIdx.y * cols + c] = db;
}

// The weight's and bias's gradients: ln_backward_params's partial sums [parts, cols] added up per
// column and written in the parameters' dtype, one launch where a reduction and a conversion
// per array took four. A block takes 32 columns, its 8 warps' lanes striding down the parts of
// one column each, then summed in shared memory.
template <typename T>
__device__ void ln_backward_params_total(const float* dw_parts, const float* db_parts, T* dw, T* db, int parts,
                                         int cols) {
  __shared__ float sw[8][33], sb[8][33];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = blockIdx.x * 32 + lane;
  float w = 0.f, b = 0.f;
  if (c < cols) {
    for (int p = warp; p < parts; p += 8) {
      w += dw_parts[(i64)p * cols + c];
      b += db_parts[(i64)p * cols + c];
    }
  }
  sw[warp][lane] = w;
  sb[warp][lane] = b;
  __syncthreads();
  if (warp == 0 && c < cols) {
    for (int k = 1; k < 8; ++k) {
      w += sw[k][lane];
      b += sb[k][lane];
    }
    dw[c] = from_float<T>(w);
    db[c] = from_float<T>(b);
  }
}

// Rows of up to WARP_COLS: one warp per row with the row in registers (see prelude.cuh), read
// once; the same arithmetic as above, reduced by shuffles. `vec`: cols a multiple of 4 and every
// pointer aligned to four elements. The block kernels' entry points take the same arguments
// (ignoring `rows` and `vec`), so the caller picks one by name.
template <typename T, int Q>
__device__ void ln_forward_warp(const T* x, const T* w, const T* b, T* y, float* mean_out, float* rstd_out, i64 rows,
                                int cols, float eps, int vec, Rows layout) {
  const int lane = threadIdx.x & 31;
  const i64 row = warp_row();
  if (row >= rows) return;  // the whole warp: its row is its own
  const i64 in = layout.at(row);
  float v[Q][4];
  float s = 0.f;
  for (int j = 0; j < Q; ++j) {
    const int c = quad_col(lane, j);
    load4(x + in + c, quad_len(c, cols), vec, v[j]);
    for (int k = 0; k < 4; ++k) s += v[j][k];  // zeros past the row's end
  }
  const float mean = warp_sum(s) / cols;
  float q = 0.f;
  for (int j = 0; j < Q; ++j)
    for (int k = 0; k < 4; ++k) {
      const float d = quad_col(lane, j) + k < cols ? v[j][k] - mean : 0.f;
      q += d * d;
    }
  const float rstd = rsqrtf(warp_sum(q) / cols + eps);
  for (int j = 0; j < Q; ++j) {
    const int c = quad_col(lane, j), n = quad_len(c, cols);
    if (n == 0) continue;
    float wv[4], bv[4];
    load4(w + c, n, vec, wv);
    load4(b + c, n, vec, bv);
    for (int k = 0; k < 4; ++k) v[j][k] = (v[j][k] - mean) * rstd * wv[k] + bv[k];
    store4(y + row * cols + c, n, vec, v[j]);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

template <typename T, int Q>
__device__ void ln_backward_input_warp(const T* x, const T* w, const float* mean, const float* rstd, const T* dy,
                                       T* dx, i64 rows, int cols, int vec, Rows layout) {
  const int lane = threadIdx.x & 31;
  const i64 row = warp_row();
  if (row >= rows) return;
  const float mu = mean[row], r = rstd[row];
  const i64 in = layout.at(row);
  float g[Q][4], xhat[Q][4];
  float sg = 0.f, sgx = 0.f;
  for (int j = 0; j < Q; ++j) {
    const int c = quad_col(lane, j), n = quad_len(c, cols);
    float wv[4];
    load4(dy + row * cols + c, n, vec, g[j]);
    load4(w + c, n, vec, wv);
    load4(x + in + c, n, vec, xhat[j]);
    for (int k = 0; k < 4; ++k) {
      g[j][k] = __fmul_rn(g[j][k], wv[k]);  // as ln_backward_input: never contracted
      xhat[j][k] = k < n ? (xhat[j][k] - mu) * r : 0.f;
      sg += g[j][k];
      sgx += g[j][k] * xhat[j][k];
    }
  }
  sg = warp_sum(sg) / cols;
  sgx = warp_sum(sgx) / cols;
  for (int j = 0; j < Q; ++j) {
    const int c = quad_col(lane, j), n = quad_len(c, cols);
    if (n == 0) continue;
    for (int k = 0; k < 4; ++k) g[j][k] = r * (g[j][k] - sg - xhat[j][k] * sgx);
    store4(dx + row * cols + c, n, vec, g[j]);
  }
}

#define DEFINE_WARP(T, S, Q)                                                                                  \
  extern "C" __global__ void layer_norm_forward_warp##Q##_##S(                                                 \
      const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, i64 rows, int cols, float eps, int vec,  \
      i64 inner, i64 inner_stride, i64 outer_stride) {                                                         \
    ln_forward_warp<T, Q>(x, w, b, y, mean, rstd, rows, cols, eps, vec, Rows{inner, inner_stride, outer_stride}); \
  }                                                                                                            \
  extern "C" __global__ void layer_norm_backward_input_warp##Q##_##S(                                          \
      const T* x, const T* w, const float* mean, const float* rstd, const T* dy, T* dx, i64 rows, int cols,     \
      int vec, i64 inner, i64 inner_stride, i64 outer_stride) {                                                \
    ln_backward_input_warp<T, Q>(x, w, mean, rstd, dy, dx, rows, cols, vec,                                    \
                                 Rows{inner, inner_stride, outer_stride});                                     \
  }

#define DEFINE(T, S)                                                                                          \
  extern "C" __global__ void layer_norm_forward_##S(const T* x, const T* w, const T* b, T* y, float* mean,    \
                                                    float* rstd, i64 rows, int cols, float eps, int vec,       \
                                                    i64 inner, i64 inner_stride, i64 outer_stride) {           \
    ln_forward<T>(x, w, b, y, mean, rstd, cols, eps, Rows{inner, inner_stride, outer_stride});              \
  }                                                                                                          \
  extern "C" __global__ void layer_norm_backward_input_##S(                                                  \
      const T* x, const T* w, const float* mean, const float* rstd, const T* dy, T* dx, i64 rows, int cols,     \
      int vec, i64 inner, i64 inner_stride, i64 outer_stride) {                                                \
    ln_backward_input<T>(x, w, mean, rstd, dy, dx, cols, Rows{inner, inner_stride, outer_stride});           \
  }                                                                                                          \
  extern "C" __global__ void layer_norm_backward_params_##S(                                                 \
      const T* x, const float* mean, const float* rstd, const T* dy, float* dw_parts, float* db_parts,          \
      int rows, int cols, int rows_per_part, i64 inner, i64 inner_stride, i64 outer_stride) {                  \
    ln_backward_params<T>(x, mean, rstd, dy, dw_parts, db_parts, rows, cols, rows_per_part,                  \
                          Rows{inner, inner_stride, outer_stride});                                           \
  }                                                                                                          \
  extern "C" __global__ void layer_norm_backward_params_total_##S(const float* dw_parts, const float* db_parts, \
                                                                  T* dw, T* db, int parts, int cols) {         \
    ln_backward_params_total<T>(dw_parts, db_parts, dw, db, parts, cols);                                     \
  }                                                                                                          \
  FOR_EACH_WARP_QUADS(DEFINE_WARP, T, S)
FOR_EACH_DTYPE(DEFINE)
