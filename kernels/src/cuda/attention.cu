// Memory-efficient attention with AlphaFold's key mask and pair bias: out = softmax(q k^T scale
// + 1e9 (mask - 1) + bias) v, without materialising the [queries, keys] weights. q [B, H, Nq, D],
// k and v [B, H, Nk, D], out [B, H, Nq, D], all contiguous, D <= MAX_D; mask [B, Nk] (or null);
// bias with `bias_rows` rows of Nk (H * Nq: a pair bias shared across the batch; B * H * Nq: one
// per row) and query row r using row r % bias_rows (or null).
//
// One warp per row (a query forward and in the backward's first pass, a key in its second);
// the lanes share the row's keys (or queries) and each keeps its own online-softmax state,
// merged across the warp at the end. The forward saves each query's log-sum-exp; the backward
// recomputes the weights from it (FlashAttention's recomputation): the first pass gives dq and
// the bias gradient (added over the batch for a shared bias), and D = sum(dout out) per query;
// the second gives dk and dv without atomics.

#define MAX_D 64

// The row this warp handles: blocks of (blockDim.x / 32) warps, one row each.
__device__ __forceinline__ i64 warp_row() { return (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); }

// Where query row `row` reads: its batch element, its bias row, and its batch element and
// head's keys and values.
template <typename T>
struct QueryRow {
  i64 b, bias_row;
  const T* k;
  const T* v;
};

template <typename T>
__device__ __forceinline__ QueryRow<T> query_row(i64 row, const T* k, const T* v, const T* bias, int heads, int nq,
                                                 int nk, int d, i64 bias_rows) {
  const i64 bh = row / nq;
  return QueryRow<T>{bh / heads, bias ? row % bias_rows : 0, k + bh * nk * d, v + bh * nk * d};
}

template <typename T>
__device__ __forceinline__ float score(const float* qs, const T* kj, int d) {
  float s = 0.f;
  for (int e = 0; e < d; ++e) s += qs[e] * to_float(kj[e]);
  return s;
}

// The logit of query row `row` (batch `b`) and key `j`, from the scaled query `qs`.
template <typename T>
__device__ __forceinline__ float logit_at(const float* qs, const T* kj, const T* mask, const T* bias, i64 b, int j,
                                          i64 bias_row, int nk, int d) {
  float s = score(qs, kj, d);
  if (mask) s += 1e9f * (to_float(mask[b * nk + j]) - 1.f);
  if (bias) s += to_float(bias[bias_row * nk + j]);
  return s;
}

template <typename T>
__device__ void mea_forward(const T* q, const T* k, const T* v, const T* mask, const T* bias, T* out, float* lse,
                            i64 rows, int heads, int nq, int nk, int d, i64 bias_rows, float scale) {
  const int lane = threadIdx.x & 31;
  const i64 row = warp_row();
  if (row >= rows) return;
  const QueryRow<T> at = query_row(row, k, v, bias, heads, nq, nk, d, bias_rows);
  float qs[MAX_D], acc[MAX_D];
  for (int e = 0; e < d; ++e) {
    qs[e] = to_float(q[row * d + e]) * scale;
    acc[e] = 0.f;
  }
  float m = NEG_INF, l = 0.f;
  for (int j = lane; j < nk; j += 32) {
    const float s = logit_at(qs, at.k + (i64)j * d, mask, bias, at.b, j, at.bias_row, nk, d);
    if (s == NEG_INF) continue;
    const T* vj = at.v + (i64)j * d;
    if (s > m) {
      const float f = expf(m - s);
      l = l * f + 1.f;
      for (int e = 0; e < d; ++e) acc[e] = acc[e] * f + to_float(vj[e]);
      m = s;
    } else {
      const float p = expf(s - m);
      l += p;
      for (int e = 0; e < d; ++e) acc[e] += p * to_float(vj[e]);
    }
  }
  const float mt = warp_max(m);
  const float f = m == NEG_INF ? 0.f : expf(m - mt);
  const float lt = warp_sum(l * f);
  for (int e = 0; e < d; ++e) {
    const float a = warp_sum(acc[e] * f);
    if (lane == 0) out[row * d + e] = from_float<T>(a / lt);
  }
  if (lane == 0) lse[row] = mt + logf(lt);
}

// First pass, one warp per query row: delta = sum(dout out); dq = scale sum_j ds_ij k_j with
// ds = p (dout . v_j - delta); the bias gradient gets ds (atomically: a shared bias adds the
// batch's rows).
template <typename T>
__device__ void mea_backward_queries(const T* q, const T* k, const T* v, const T* mask, const T* bias, const T* out,
                                     const T* dout, const float* lse, float* delta, T* dq, float* dbias, i64 rows,
                                     int heads, int nq, int nk, int d, i64 bias_rows, float scale) {
  const int lane = threadIdx.x & 31;
  const i64 row = warp_row();
  if (row >= rows) return;
  const QueryRow<T> at = query_row(row, k, v, bias, heads, nq, nk, d, bias_rows);
  float qs[MAX_D], dos[MAX_D], acc[MAX_D];
  float dd = 0.f;
  for (int e = 0; e < d; ++e) {
    qs[e] = to_float(q[row * d + e]) * scale;
    dos[e] = to_float(dout[row * d + e]);
    dd += dos[e] * to_float(out[row * d + e]);
    acc[e] = 0.f;
  }
  const float lse_row = lse[row];
  for (int j = lane; j < nk; j += 32) {
    const T* kj = at.k + (i64)j * d;
    const float p = expf(logit_at(qs, kj, mask, bias, at.b, j, at.bias_row, nk, d) - lse_row);
    const float ds = p * (score(dos, at.v + (i64)j * d, d) - dd);
    for (int e = 0; e < d; ++e) acc[e] += ds * to_float(kj[e]);
    if (dbias) atomicAdd(dbias + at.bias_row * nk + j, ds);
  }
  for (int e = 0; e < d; ++e) {
    const float a = warp_sum(acc[e]);
    if (lane == 0) dq[row * d + e] = from_float<T>(a * scale);
  }
  if (lane == 0) delta[row] = dd;
}

// Second pass, one warp per key row: dk = scale sum_i ds_ij q_i, dv = sum_i p_ij dout_i.
template <typename T>
__device__ void mea_backward_keys(const T* q, const T* k, const T* v, const T* mask, const T* bias, const T* dout,
                                  const float* lse, const float* delta, T* dk, T* dv, i64 key_rows, int heads, int nq,
                                  int nk, int d, i64 bias_rows, float scale) {
  const int lane = threadIdx.x & 31;
  const i64 key_row = warp_row();
  if (key_row >= key_rows) return;
  const i64 bh = key_row / nk, b = bh / heads;
  const int j = key_row % nk;
  const T* kj = k + key_row * d;
  const T* vj = v + key_row * d;
  float dk_acc[MAX_D], dv_acc[MAX_D], qs[MAX_D], dos[MAX_D];
  for (int e = 0; e < d; ++e) dk_acc[e] = dv_acc[e] = 0.f;
  for (int i = lane; i < nq; i += 32) {
    const i64 row = bh * nq + i;
    for (int e = 0; e < d; ++e) {
      qs[e] = to_float(q[row * d + e]) * scale;
      dos[e] = to_float(dout[row * d + e]);
    }
    const i64 bias_row = bias ? row % bias_rows : 0;
    const float p = expf(logit_at(qs, kj, mask, bias, b, j, bias_row, nk, d) - lse[row]);
    const float ds = p * (score(dos, vj, d) - delta[row]);
    for (int e = 0; e < d; ++e) {
      dk_acc[e] += ds * qs[e];  // qs is q scale: dk = scale sum ds q
      dv_acc[e] += p * dos[e];
    }
  }
  for (int e = 0; e < d; ++e) {
    const float a = warp_sum(dk_acc[e]), c = warp_sum(dv_acc[e]);
    if (lane == 0) {
      dk[key_row * d + e] = from_float<T>(a);
      dv[key_row * d + e] = from_float<T>(c);
    }
  }
}

#define DEFINE(T, S)                                                                                              \
  extern "C" __global__ void mea_forward_##S(const T* q, const T* k, const T* v, const T* mask, const T* bias,   \
                                             T* out, float* lse, i64 rows, int heads, int nq, int nk, int d,      \
                                             i64 bias_rows, float scale) {                                        \
    mea_forward<T>(q, k, v, mask, bias, out, lse, rows, heads, nq, nk, d, bias_rows, scale);                      \
  }                                                                                                               \
  extern "C" __global__ void mea_backward_queries_##S(                                                           \
      const T* q, const T* k, const T* v, const T* mask, const T* bias, const T* out, const T* dout,              \
      const float* lse, float* delta, T* dq, float* dbias, i64 rows, int heads, int nq, int nk, int d,            \
      i64 bias_rows, float scale) {                                                                               \
    mea_backward_queries<T>(q, k, v, mask, bias, out, dout, lse, delta, dq, dbias, rows, heads, nq, nk, d,        \
                            bias_rows, scale);                                                                    \
  }                                                                                                               \
  extern "C" __global__ void mea_backward_keys_##S(const T* q, const T* k, const T* v, const T* mask,            \
                                                   const T* bias, const T* dout, const float* lse,                \
                                                   const float* delta, T* dk, T* dv, i64 key_rows, int heads,     \
                                                   int nq, int nk, int d, i64 bias_rows, float scale) {           \
    mea_backward_keys<T>(q, k, v, mask, bias, dout, lse, delta, dk, dv, key_rows, heads, nq, nk, d, bias_rows,    \
                         scale);                                                                                  \
  }
FOR_EACH_DTYPE(DEFINE)
