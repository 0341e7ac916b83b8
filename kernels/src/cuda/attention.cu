// Memory-efficient attention with AlphaFold's key mask and pair bias: out = softmax(q k^T scale
// + 1e9 (mask - 1) + bias) v, without materialising the [queries, keys] weights. q [B, H, Nq, D],
// k and v [B, H, Nk, D], out [B, H, Nq, D], all contiguous, D <= MAX_D; mask [B, Nk] (or null);
// bias with `bias_rows` rows of Nk (H * Nq: a pair bias shared across the batch; B * H * Nq: one
// per row) and query row r using row r % bias_rows (or null).
//
// Tiled as FlashAttention-2 on CUDA cores. A block of 128 threads owns ROWS = 32 rows of one
// batch element and head (queries; keys in the backward's second pass) and walks the other side
// in tiles staged in shared memory, so each key (or query) is read from global memory once per
// 32 rows, coalesced. Thread t owns rows 4 (t / 16) + i (i < 4) and, of a tile, the columns
// t % 16 + 16 j: the 16 threads of a row group are half a warp, so a row's reductions are four
// shuffles. Both operands of a product are stored transposed ([dim][row]): the rows at a stride
// of 36 (read as aligned 4-vectors, the other half-warp 16 banks away), the tiles at an odd
// stride (read by 16 consecutive lanes, and written by a coalesced load, without bank
// conflicts).
//
// The forward keeps each query's softmax statistics, its largest logit m and log l, l the sum of
// exp(logit - m), apart (as [rows, 2]): the backward recomputes the weights as
// exp((logit - m) - log l) (FlashAttention's recomputation). One log-sum-exp m + log l would
// round log l away where m is AlphaFold's -1e9 (a query whose keys are all masked: uniform
// weights in the forward, each 1 in a backward reading m + log l, the gradients nk times too
// large). The backward runs in two passes without atomics on q, k or v: the first over
// query blocks gives dq, the bias gradient (atomically added over the batch where the bias is
// shared) and delta = sum(dout out) per query; the second over key blocks gives dk and dv.

#define MAX_D 64
#define ROWS 32
#define ROW_STRIDE (ROWS + 4)
// The forward's key tiles, and the backward's tiles (smaller: each pass stages two operands of
// the tile and two of its own rows within 48 KiB of static shared memory).
#define FWD_TILE 64
#define BWD_TILE 32

struct alignas(16) f32x4 {
  float x, y, z, w;
};

__device__ __forceinline__ int row_group() { return threadIdx.x >> 4; }
__device__ __forceinline__ int col_lane() { return threadIdx.x & 15; }

// The maximum and sum over the 16 threads of a row group (a half-warp; every lane of the warp
// takes part).
__device__ __forceinline__ float group_max(float v) {
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float group_sum(float v) {
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Stages rows [0, n) of the row-major `src` (d values each) transposed into dst[e * stride + r],
// times `scale`, with zeros for rows at or past `valid`. Consecutive threads read consecutive
// values: the n * d values are contiguous in global memory.
template <typename T>
__device__ void stage_transposed(float* dst, int stride, const T* src, int n, int valid, int d, float scale) {
  for (int idx = threadIdx.x; idx < n * d; idx += blockDim.x) {
    const int r = idx / d, e = idx - r * d;
    dst[e * stride + r] = r < valid ? to_float(src[(i64)r * d + e]) * scale : 0.f;
  }
}

// acc[i][j] += sum_e rows[e][4 g + i] * cols[e][c + 16 j]: the thread's block of a product of
// the block's rows (stride ROW_STRIDE) with a tile's columns (stride `col_stride`).
template <int J>
__device__ __forceinline__ void dot_tile(float (&acc)[4][J], const float* rows, const float* cols, int col_stride,
                                         int d) {
  const int g = row_group(), c = col_lane();
  for (int e = 0; e < d; ++e) {
    const f32x4 a = *reinterpret_cast<const f32x4*>(rows + e * ROW_STRIDE + 4 * g);
    const float* b = cols + e * col_stride + c;
    for (int j = 0; j < J; ++j) {
      const float bj = b[16 * j];
      acc[0][j] += a.x * bj;
      acc[1][j] += a.y * bj;
      acc[2][j] += a.z * bj;
      acc[3][j] += a.w * bj;
    }
  }
}

// acc[i][k] += sum_{j < n} w[(4 g + i) * w_stride + j] * cols[(c + 16 k) * col_stride + j]: the
// thread's rows of weights (in shared memory, rows of w_stride, a multiple of 4) times a staged
// tile, for the dims c + 16 k below d. n is a multiple of 4.
__device__ __forceinline__ void weigh_tile(float (&acc)[4][MAX_D / 16], const float* w, int w_stride,
                                           const float* cols, int col_stride, int n, int d) {
  const int g = row_group(), c = col_lane();
  for (int j = 0; j < n; j += 4) {
    f32x4 p[4];
    for (int i = 0; i < 4; ++i) p[i] = *reinterpret_cast<const f32x4*>(w + (4 * g + i) * w_stride + j);
    for (int k = 0; k < MAX_D / 16; ++k) {
      if (c + 16 * k >= d) break;
      const float* v = cols + (c + 16 * k) * col_stride + j;
      const float v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];
      for (int i = 0; i < 4; ++i) acc[i][k] += p[i].x * v0 + p[i].y * v1 + p[i].z * v2 + p[i].w * v3;
    }
  }
}

// The logit from the score s = q.k scale: the key mask's 1e9 (mask - 1) added, then the bias,
// in that order in every pass (the composition's). Near -1e9 a float has steps of 64, so
// another order can round a tie the other way, and a fully masked query's weights, taken
// relative to its largest logit, then differ by e^64 between the passes.
template <typename T>
__device__ __forceinline__ float logit(float s, const T* mask, const T* bias, i64 b, i64 bias_row, int j, int nk) {
  if (mask) s += 1e9f * (to_float(mask[b * nk + j]) - 1.f);
  if (bias) s += to_float(bias[bias_row * nk + j]);
  return s;
}

__device__ __forceinline__ int round_up4(int n) { return (n + 3) & ~3; }

// Writes the thread's rows of `acc` times `scale` to out[(first + 4 g + i) * d + dim] for rows
// below `valid`.
template <typename T>
__device__ void write_rows(T* out, const float (&acc)[4][MAX_D / 16], int valid, int d, float scale) {
  const int g = row_group(), c = col_lane();
  for (int i = 0; i < 4; ++i) {
    if (4 * g + i >= valid) continue;
    for (int k = 0; k < MAX_D / 16; ++k)
      if (c + 16 * k < d) out[(i64)(4 * g + i) * d + c + 16 * k] = from_float<T>(acc[i][k] * scale);
  }
}

// Grid: one block per 32 queries of each batch element and head, ceil(Nq / 32) B H blocks.
template <typename T>
__device__ void mea_forward(const T* q, const T* k, const T* v, const T* mask, const T* bias, T* out, float* stats,
                            int heads, int nq, int nk, int d, i64 bias_rows, float scale) {
  alignas(16) __shared__ float q_t[MAX_D * ROW_STRIDE];
  // The key tile, then (once the scores are taken) the weights [row][key] at a stride of 68.
  alignas(16) __shared__ float k_t[MAX_D * (FWD_TILE + 1)];
  alignas(16) __shared__ float v_t[MAX_D * (FWD_TILE + 1)];
  const int tiles = (nq + ROWS - 1) / ROWS;
  const i64 bh = blockIdx.x / tiles, b = bh / heads;
  const int first = (blockIdx.x % tiles) * ROWS, valid = min(ROWS, nq - first);
  const int g = row_group(), c = col_lane();
  const i64 row0 = bh * nq + first;  // the block's first query row
  k += bh * nk * d;
  v += bh * nk * d;
  stage_transposed(q_t, ROW_STRIDE, q + row0 * d, ROWS, valid, d, scale);
  float o[4][MAX_D / 16] = {}, m[4], l[4] = {};
  for (int i = 0; i < 4; ++i) m[i] = NEG_INF;
  float* p_s = k_t;
  const int p_stride = FWD_TILE + 4;
  for (int j0 = 0; j0 < nk; j0 += FWD_TILE) {
    const int n = min(FWD_TILE, nk - j0);
    __syncthreads();  // the previous tile's readers are done
    stage_transposed(k_t, FWD_TILE + 1, k + (i64)j0 * d, FWD_TILE, n, d, 1.f);
    stage_transposed(v_t, FWD_TILE + 1, v + (i64)j0 * d, FWD_TILE, n, d, 1.f);
    __syncthreads();
    float s[4][FWD_TILE / 16] = {};
    dot_tile(s, q_t, k_t, FWD_TILE + 1, d);
    for (int i = 0; i < 4; ++i) {
      const i64 bias_row = bias ? (row0 + 4 * g + i) % bias_rows : 0;
      float tile_max = NEG_INF;
      for (int j = 0; j < FWD_TILE / 16; ++j) {
        const int key = c + 16 * j;
        const bool live = key < n && 4 * g + i < valid;
        s[i][j] = live ? logit(s[i][j], mask, bias, b, bias_row, j0 + key, nk) : NEG_INF;
        tile_max = fmaxf(tile_max, s[i][j]);
      }
      const float m_new = fmaxf(m[i], group_max(tile_max));
      // Nothing but -inf so far: no weight, and nothing to rescale.
      const float f = m_new == NEG_INF ? 1.f : expf(m[i] - m_new);
      for (int j = 0; j < FWD_TILE / 16; ++j) s[i][j] = m_new == NEG_INF ? 0.f : expf(s[i][j] - m_new);
      l[i] *= f;
      for (int j = 0; j < FWD_TILE / 16; ++j) l[i] += s[i][j];
      for (int k2 = 0; k2 < MAX_D / 16; ++k2) o[i][k2] *= f;
      m[i] = m_new;
    }
    __syncthreads();  // every thread is done with the key tile: its space takes the weights
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < FWD_TILE / 16; ++j) p_s[(4 * g + i) * p_stride + c + 16 * j] = s[i][j];
    __syncthreads();
    weigh_tile(o, p_s, p_stride, v_t, FWD_TILE + 1, round_up4(n), d);
  }
  for (int i = 0; i < 4; ++i) {
    const float total = group_sum(l[i]);
    for (int k2 = 0; k2 < MAX_D / 16; ++k2) o[i][k2] /= total;
    if (c == 0 && 4 * g + i < valid) {
      stats[2 * (row0 + 4 * g + i)] = m[i];
      stats[2 * (row0 + 4 * g + i) + 1] = logf(total);
    }
  }
  write_rows(out + row0 * d, o, valid, d, 1.f);
}

// The weight of a logit z in a row with statistics `m_logl` (see above).
__device__ __forceinline__ float weight(float z, const float* m_logl) { return expf((z - m_logl[0]) - m_logl[1]); }

// First pass, one block per 32 queries: delta = sum(dout out); with p the weights and
// ds = p (dout . v_j - delta), dq = scale sum_j ds k_j and the bias gradient gets ds (added
// atomically where the bias is shared across the batch, stored where each row has its own).
template <typename T>
__device__ void mea_backward_queries(const T* q, const T* k, const T* v, const T* mask, const T* bias, const T* out,
                                     const T* dout, const float* stats, float* delta, T* dq, float* dbias, i64 rows,
                                     int heads, int nq, int nk, int d, i64 bias_rows, float scale) {
  alignas(16) __shared__ float q_t[MAX_D * ROW_STRIDE];
  alignas(16) __shared__ float do_t[MAX_D * ROW_STRIDE];
  alignas(16) __shared__ float k_t[MAX_D * (BWD_TILE + 1)];
  alignas(16) __shared__ float v_t[MAX_D * (BWD_TILE + 1)];
  alignas(16) __shared__ float ds_s[ROWS * ROW_STRIDE];
  __shared__ float delta_s[ROWS];
  const int tiles = (nq + ROWS - 1) / ROWS;
  const i64 bh = blockIdx.x / tiles, b = bh / heads;
  const int first = (blockIdx.x % tiles) * ROWS, valid = min(ROWS, nq - first);
  const int g = row_group(), c = col_lane();
  const i64 row0 = bh * nq + first;
  k += bh * nk * d;
  v += bh * nk * d;
  stage_transposed(q_t, ROW_STRIDE, q + row0 * d, ROWS, valid, d, scale);
  stage_transposed(do_t, ROW_STRIDE, dout + row0 * d, ROWS, valid, d, 1.f);
  __syncthreads();
  if (threadIdx.x < ROWS) {
    const int r = threadIdx.x;
    float dd = 0.f;
    if (r < valid)
      for (int e = 0; e < d; ++e) dd += do_t[e * ROW_STRIDE + r] * to_float(out[(row0 + r) * d + e]);
    delta_s[r] = dd;
    if (r < valid) delta[row0 + r] = dd;
  }
  // The bias is shared when several batch elements' rows read each of its rows.
  const bool shared_bias = bias_rows < rows;
  float dq_acc[4][MAX_D / 16] = {}, stats_r[4][2];
  for (int i = 0; i < 4; ++i)
    for (int t = 0; t < 2; ++t) stats_r[i][t] = 4 * g + i < valid ? stats[2 * (row0 + 4 * g + i) + t] : 0.f;
  for (int j0 = 0; j0 < nk; j0 += BWD_TILE) {
    const int n = min(BWD_TILE, nk - j0);
    __syncthreads();  // delta_s is written; the previous tile's readers are done
    stage_transposed(k_t, BWD_TILE + 1, k + (i64)j0 * d, BWD_TILE, n, d, 1.f);
    stage_transposed(v_t, BWD_TILE + 1, v + (i64)j0 * d, BWD_TILE, n, d, 1.f);
    __syncthreads();
    float s[4][BWD_TILE / 16] = {}, dp[4][BWD_TILE / 16] = {};
    dot_tile(s, q_t, k_t, BWD_TILE + 1, d);
    dot_tile(dp, do_t, v_t, BWD_TILE + 1, d);
    for (int i = 0; i < 4; ++i) {
      const i64 row = row0 + 4 * g + i, bias_row = bias ? row % bias_rows : 0;
      for (int j = 0; j < BWD_TILE / 16; ++j) {
        const int key = c + 16 * j;
        float ds = 0.f;
        if (key < n && 4 * g + i < valid) {
          const float p = weight(logit(s[i][j], mask, bias, b, bias_row, j0 + key, nk), stats_r[i]);
          ds = p * (dp[i][j] - delta_s[4 * g + i]);
          if (dbias) {
            float* at = dbias + bias_row * nk + j0 + key;
            if (shared_bias) atomicAdd(at, ds);
            else *at = ds;
          }
        }
        ds_s[(4 * g + i) * ROW_STRIDE + key] = ds;
      }
    }
    __syncthreads();
    weigh_tile(dq_acc, ds_s, ROW_STRIDE, k_t, BWD_TILE + 1, round_up4(n), d);
  }
  write_rows(dq + row0 * d, dq_acc, valid, d, scale);
}

// Second pass, one block per 32 keys: dk = scale sum_i ds_ij q_i, dv = sum_i p_ij dout_i. The
// bias tile is staged [query][key] by a coalesced load and read across.
template <typename T>
__device__ void mea_backward_keys(const T* q, const T* k, const T* v, const T* mask, const T* bias, const T* dout,
                                  const float* stats, const float* delta, T* dk, T* dv, int heads, int nq, int nk, int d,
                                  i64 bias_rows, float scale) {
  alignas(16) __shared__ float k_t[MAX_D * ROW_STRIDE];
  alignas(16) __shared__ float v_t[MAX_D * ROW_STRIDE];
  alignas(16) __shared__ float q_t[MAX_D * (BWD_TILE + 1)];
  alignas(16) __shared__ float do_t[MAX_D * (BWD_TILE + 1)];
  alignas(16) __shared__ float p_s[ROWS * ROW_STRIDE];
  alignas(16) __shared__ float ds_s[ROWS * ROW_STRIDE];
  __shared__ float bias_s[BWD_TILE * (ROWS + 1)];
  __shared__ float stats_s[BWD_TILE][2], delta_s[BWD_TILE];
  const int tiles = (nk + ROWS - 1) / ROWS;
  const i64 bh = blockIdx.x / tiles, b = bh / heads;
  const int first = (blockIdx.x % tiles) * ROWS, valid = min(ROWS, nk - first);
  const int g = row_group(), c = col_lane();
  const i64 key0 = bh * nk + first;  // the block's first key row
  stage_transposed(k_t, ROW_STRIDE, k + key0 * d, ROWS, valid, d, 1.f);
  stage_transposed(v_t, ROW_STRIDE, v + key0 * d, ROWS, valid, d, 1.f);
  float dk_acc[4][MAX_D / 16] = {}, dv_acc[4][MAX_D / 16] = {};
  const i64 qrow0 = bh * nq;
  for (int i0 = 0; i0 < nq; i0 += BWD_TILE) {
    const int n = min(BWD_TILE, nq - i0);
    __syncthreads();  // the previous tile's readers are done
    stage_transposed(q_t, BWD_TILE + 1, q + (qrow0 + i0) * d, BWD_TILE, n, d, scale);
    stage_transposed(do_t, BWD_TILE + 1, dout + (qrow0 + i0) * d, BWD_TILE, n, d, 1.f);
    if (threadIdx.x < BWD_TILE) {
      const int r = threadIdx.x;
      for (int t = 0; t < 2; ++t) stats_s[r][t] = r < n ? stats[2 * (qrow0 + i0 + r) + t] : 0.f;
      delta_s[r] = r < n ? delta[qrow0 + i0 + r] : 0.f;
    }
    if (bias)
      for (int idx = threadIdx.x; idx < BWD_TILE * ROWS; idx += blockDim.x) {
        const int r = idx / ROWS, key = idx % ROWS;
        bias_s[r * (ROWS + 1) + key] =
            r < n && key < valid ? to_float(bias[((qrow0 + i0 + r) % bias_rows) * nk + first + key]) : 0.f;
      }
    __syncthreads();
    float s[4][BWD_TILE / 16] = {}, dp[4][BWD_TILE / 16] = {};
    dot_tile(s, k_t, q_t, BWD_TILE + 1, d);
    dot_tile(dp, v_t, do_t, BWD_TILE + 1, d);
    for (int i = 0; i < 4; ++i)
      for (int j = 0; j < BWD_TILE / 16; ++j) {
        const int qi = c + 16 * j;
        float p = 0.f, ds = 0.f;
        if (qi < n && 4 * g + i < valid) {
          // `logit`'s order, (s + mask) + bias, with the bias from the staged tile.
          const float z = logit(s[i][j], mask, (const T*)nullptr, b, 0, first + 4 * g + i, nk) +
                          (bias ? bias_s[qi * (ROWS + 1) + 4 * g + i] : 0.f);
          p = weight(z, stats_s[qi]);
          ds = p * (dp[i][j] - delta_s[qi]);
        }
        p_s[(4 * g + i) * ROW_STRIDE + qi] = p;
        ds_s[(4 * g + i) * ROW_STRIDE + qi] = ds;
      }
    __syncthreads();
    weigh_tile(dv_acc, p_s, ROW_STRIDE, do_t, BWD_TILE + 1, round_up4(n), d);
    weigh_tile(dk_acc, ds_s, ROW_STRIDE, q_t, BWD_TILE + 1, round_up4(n), d);  // q_t is q scale
  }
  write_rows(dk + key0 * d, dk_acc, valid, d, 1.f);
  write_rows(dv + key0 * d, dv_acc, valid, d, 1.f);
}

#define DEFINE(T, S)                                                                                              \
  extern "C" __global__ void mea_forward_##S(const T* q, const T* k, const T* v, const T* mask, const T* bias,   \
                                             T* out, float* stats, int heads, int nq, int nk, int d,              \
                                             i64 bias_rows, float scale) {                                        \
    mea_forward<T>(q, k, v, mask, bias, out, stats, heads, nq, nk, d, bias_rows, scale);                          \
  }                                                                                                               \
  extern "C" __global__ void mea_backward_queries_##S(                                                           \
      const T* q, const T* k, const T* v, const T* mask, const T* bias, const T* out, const T* dout,              \
      const float* stats, float* delta, T* dq, float* dbias, i64 rows, int heads, int nq, int nk, int d,          \
      i64 bias_rows, float scale) {                                                                               \
    mea_backward_queries<T>(q, k, v, mask, bias, out, dout, stats, delta, dq, dbias, rows, heads, nq, nk, d,      \
                            bias_rows, scale);                                                                    \
  }                                                                                                               \
  extern "C" __global__ void mea_backward_keys_##S(const T* q, const T* k, const T* v, const T* mask,            \
                                                   const T* bias, const T* dout, const float* stats,              \
                                                   const float* delta, T* dk, T* dv, int heads, int nq, int nk,   \
                                                   int d, i64 bias_rows, float scale) {                           \
    mea_backward_keys<T>(q, k, v, mask, bias, dout, stats, delta, dk, dv, heads, nq, nk, d, bias_rows, scale);    \
  }
FOR_EACH_DTYPE(DEFINE)
