// Multi-tensor optimizer steps: one launch updates every parameter. `table` holds 6 entries per
// tensor: the addresses of the weight, gradient, first and second moments (f32, contiguous),
// the element count, and whether weight decay and the trust ratio apply ("adapt"). `chunks`
// holds (tensor, first element) per block, each block covering `chunk` elements.
//
// The arithmetic is the engine's (engine/src/optim: adam.rs, adamw.rs, lamb.rs) operation for
// operation, each rounded to f32: this source is compiled with --fmad=false so that no
// multiply-add is contracted, as in the host executor.

struct Entry {
  float* w;
  const float* g;
  float* m;
  float* v;
  i64 n;
  bool adapt;
};

__device__ __forceinline__ Entry entry(const i64* table, i64 t) {
  const i64* e = table + 6 * t;
  Entry r;
  r.w = (float*)e[0];
  r.g = (const float*)e[1];
  r.m = (float*)e[2];
  r.v = (float*)e[3];
  r.n = e[4];
  r.adapt = e[5] != 0;
  return r;
}

struct AdamScalars {
  float b1, one_minus_b1, b2, one_minus_b2, bc1, sqrt_bc2, eps;
};

// Kernel parameters are passed one scalar each (the launcher's slots are 8 bytes).
#define ADAM_PARAMS float b1, float one_minus_b1, float b2, float one_minus_b2, float bc1, float sqrt_bc2, float eps
#define ADAM_SCALARS \
  const AdamScalars a = {b1, one_minus_b1, b2, one_minus_b2, bc1, sqrt_bc2, eps}

// m = m b1 + g (1 - b1); v = v b2 + g (g (1 - b2)); returns the direction
// (m / bc1) / (sqrt(v) / sqrt(bc2) + eps).
__device__ __forceinline__ float adam(const AdamScalars& a, float* m, float* v, float g) {
  const float mi = *m * a.b1 + g * a.one_minus_b1;
  const float vi = *v * a.b2 + g * (g * a.one_minus_b2);
  *m = mi;
  *v = vi;
  return (mi / a.bc1) / (sqrtf(vi) / a.sqrt_bc2 + a.eps);
}

__device__ __forceinline__ float direction(const AdamScalars& a, float m, float v) {
  return (m / a.bc1) / (sqrtf(v) / a.sqrt_bc2 + a.eps);
}

// w = w (1 - lr wd) - lr direction, the decay for adapted tensors only.
extern "C" __global__ void adamw_f32(const i64* table, const i64* chunks, int chunk, ADAM_PARAMS, float lr,
                                     float decay) {
  ADAM_SCALARS;
  const Entry e = entry(table, chunks[2 * blockIdx.x]);
  const i64 start = chunks[2 * blockIdx.x + 1], end = min(e.n, start + chunk);
  for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float d = adam(a, e.m + i, e.v + i, e.g[i]);
    float w = e.w[i];
    if (e.adapt) w = w * decay;
    e.w[i] = w - d * lr;
  }
}

// LAMB, first launch: the moments, and per adapted tensor the sums of squares of w and of the
// update r = direction + wd w, added into norms[2 t] and norms[2 t + 1] (zeroed by the caller).
extern "C" __global__ void lamb_moments_f32(const i64* table, const i64* chunks, int chunk, ADAM_PARAMS,
                                            float wd, float* norms) {
  ADAM_SCALARS;
  __shared__ float scratch[32];
  const i64 t = chunks[2 * blockIdx.x];
  const Entry e = entry(table, t);
  const i64 start = chunks[2 * blockIdx.x + 1], end = min(e.n, start + chunk);
  float ww = 0.f, rr = 0.f;
  for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
    float r = adam(a, e.m + i, e.v + i, e.g[i]);
    const float w = e.w[i];
    if (e.adapt && wd != 0.f) r = r + w * wd;
    ww += w * w;
    rr += r * r;
  }
  if (!e.adapt) return;  // the same for the whole block: no thread waits in block_sum alone
  ww = block_sum(ww, scratch);
  rr = block_sum(rr, scratch);
  if (threadIdx.x == 0) {
    atomicAdd(norms + 2 * t, ww);
    atomicAdd(norms + 2 * t + 1, rr);
  }
}

// LAMB, second launch: w = w - r lr ||w|| / ||r|| (the ratio 1 where either norm is 0, and for
// tensors that do not adapt), r recomputed from the updated moments and the old weight.
extern "C" __global__ void lamb_apply_f32(const i64* table, const i64* chunks, int chunk, ADAM_PARAMS, float wd,
                                          float lr, const float* norms) {
  ADAM_SCALARS;
  const i64 t = chunks[2 * blockIdx.x];
  const Entry e = entry(table, t);
  const i64 start = chunks[2 * blockIdx.x + 1], end = min(e.n, start + chunk);
  float scale = lr;
  if (e.adapt) {
    const float wn = sqrtf(norms[2 * t]), rn = sqrtf(norms[2 * t + 1]);
    if (wn > 0.f && rn > 0.f) scale = lr * (wn / rn);
  }
  for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float w = e.w[i];
    float r = direction(a, e.m[i], e.v[i]);
    if (e.adapt && wd != 0.f) r = r + w * wd;
    e.w[i] = w - r * scale;
  }
}

// LARS, first launch: per adapted tensor the sums of squares of w and of g, added into
// norms[2 t] and norms[2 t + 1] (zeroed by the caller). The table's first state slot is the
// momentum buffer (null without momentum); the second is unused.
extern "C" __global__ void lars_norms_f32(const i64* table, const i64* chunks, int chunk, float* norms) {
  __shared__ float scratch[32];
  const i64 t = chunks[2 * blockIdx.x];
  const Entry e = entry(table, t);
  if (!e.adapt) return;  // the same for the whole block
  const i64 start = chunks[2 * blockIdx.x + 1], end = min(e.n, start + chunk);
  float ww = 0.f, gg = 0.f;
  for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float w = e.w[i], g = e.g[i];
    ww += w * w;
    gg += g * g;
  }
  ww = block_sum(ww, scratch);
  gg = block_sum(gg, scratch);
  if (threadIdx.x == 0) {
    atomicAdd(norms + 2 * t, ww);
    atomicAdd(norms + 2 * t + 1, gg);
  }
}

// LARS, second launch (engine/src/optim/lars.rs): d = (g + wd w) ratio for an adapted tensor,
// ratio = trust ||w|| / (||g|| + wd ||w|| + eps) (1 where either norm is 0), else d = g; with a
// momentum buffer b = d on the first step, else b = b momentum + d, and d = b; w = w - lr d.
extern "C" __global__ void lars_apply_f32(const i64* table, const i64* chunks, int chunk, float lr, float momentum,
                                          float wd, float trust, float eps, int first, const float* norms) {
  const i64 t = chunks[2 * blockIdx.x];
  const Entry e = entry(table, t);
  const i64 start = chunks[2 * blockIdx.x + 1], end = min(e.n, start + chunk);
  float ratio = 1.f;
  if (e.adapt) {
    const float wn = sqrtf(norms[2 * t]), gn = sqrtf(norms[2 * t + 1]);
    if (wn > 0.f && gn > 0.f) ratio = trust * wn / (gn + wd * wn + eps);
  }
  for (i64 i = start + threadIdx.x; i < end; i += blockDim.x) {
    const float w = e.w[i];
    float d = e.adapt ? (e.g[i] + w * wd) * ratio : e.g[i];
    if (e.m) {
      const float b = first ? d : e.m[i] * momentum + d;
      e.m[i] = b;
      d = b;
    }
    e.w[i] = w - d * lr;
  }
}
