// Attention with AlphaFold's key mask and pair bias on tensor cores, forward only (inference):
// out = softmax(q k^T scale + 1e9 (mask - 1) + bias) v, the [queries, keys] logits never in
// memory. q, k, v and out are [B, H, N, D] at any strides (fastfold's projections are
// [B, H * D, N], each head's [D, N] contiguous, and its output is read that way too); mask
// [B, Nk] (or null); bias with `bias_rows` rows of Nk (H * Nq: a pair bias shared across the
// batch; B * H * Nq: one per row), query row r using row r % bias_rows (or null).
//
// FlashAttention-2's forward: a block of FA_WARPS warps owns 16 queries per warp of one batch
// element and head and walks the keys in tiles of FA_KEYS, staged in shared memory as f32
// (rows zero-padded to the compiled head width DP). Each warp takes its scores S = Q K^T and
// then O += P V with mma.sync, accumulating in f32: bf16 and f16 inputs as they are
// (m16n8k16), f32 inputs as TF32 (m16n8k8, the precision of fastfold's other f32 products on
// these GPUs; a strict-IEEE run does not use this kernel). The scores stay in the registers the
// mma leaves them in; each thread holds two rows' (groupID, groupID + 8) elements, whose
// online softmax (running maximum m and sum l, as in attention.cu) reduces over the four lanes
// of a group. For 16-bit inputs the P V product reads P from those same registers (the
// accumulator layout of two 8-key tiles is the A layout of one 16-key step); for TF32 the lanes
// exchange them by shuffles.
//
// The logit of a score is (s scale + 1e9 (mask - 1)) + bias, in that order, as the composition
// and attention.cu take it (near -1e9 another order rounds differently).

#define FA_WARPS 4
#define FA_QUERIES (16 * FA_WARPS)
#define FA_KEYS 32

#ifdef KERNELS_EMULATOR
__device__ __forceinline__ unsigned tf32_bits(float x) { return emu_tf32(x); }
#define MMA(SHAPE, d, a, b) emu_mma(SHAPE, a, b, d)
#else
#define MMA_TF32_M16N8K8 0
#define MMA_BF16_M16N8K16 1
#define MMA_F16_M16N8K16 2
__device__ __forceinline__ unsigned tf32_bits(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ void mma_tf32(float* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_bf16(float* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ void mma_f16(float* d, const unsigned* a, const unsigned* b) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#define MMA(SHAPE, d, a, b) \
  (SHAPE == MMA_TF32_M16N8K8 ? mma_tf32(d, a, b) : SHAPE == MMA_BF16_M16N8K16 ? mma_bf16(d, a, b) : mma_f16(d, a, b))
#endif

// Per element type: the mma's K step and how two f32 values become one register of it.
template <typename T> struct TensorCore;
template <> struct TensorCore<float> {
  static constexpr int K = 8, SHAPE = MMA_TF32_M16N8K8;
};
template <> struct TensorCore<bf16> {
  static constexpr int K = 16, SHAPE = MMA_BF16_M16N8K16;
};
template <> struct TensorCore<f16> {
  static constexpr int K = 16, SHAPE = MMA_F16_M16N8K16;
};

// Two values as one register of 16-bit elements, the first in the lower half.
template <typename T>
__device__ __forceinline__ unsigned pair_bits(float lo, float hi) {
  return element_bits<T>(lo) | (element_bits<T>(hi) << 16);
}

__device__ __forceinline__ int fa_group() { return (threadIdx.x & 31) >> 2; }
__device__ __forceinline__ int fa_thread() { return threadIdx.x & 3; }

// The A fragment of the 16 x K tile of row-major `s` (row stride `ld`) at row r0, column c0.
template <typename T>
__device__ __forceinline__ void load_a(unsigned (&a)[4], const float* s, int ld, int r0, int c0) {
  const float* lo = s + (r0 + fa_group()) * ld + c0;
  const float* hi = lo + 8 * ld;
  const int t = fa_thread();
  if constexpr (TensorCore<T>::K == 8) {
    a[0] = tf32_bits(lo[t]);
    a[1] = tf32_bits(hi[t]);
    a[2] = tf32_bits(lo[t + 4]);
    a[3] = tf32_bits(hi[t + 4]);
  } else {
    a[0] = pair_bits<T>(lo[2 * t], lo[2 * t + 1]);
    a[1] = pair_bits<T>(hi[2 * t], hi[2 * t + 1]);
    a[2] = pair_bits<T>(lo[2 * t + 8], lo[2 * t + 9]);
    a[3] = pair_bits<T>(hi[2 * t + 8], hi[2 * t + 9]);
  }
}

// The B fragment of the K x 8 tile whose element (k, n) is s[(n0 + n) * ld + k0 + k]: the keys'
// rows of a staged tile, for Q K^T.
template <typename T>
__device__ __forceinline__ void load_b_rows(unsigned (&b)[2], const float* s, int ld, int n0, int k0) {
  const float* row = s + (n0 + fa_group()) * ld + k0;
  const int t = fa_thread();
  if constexpr (TensorCore<T>::K == 8) {
    b[0] = tf32_bits(row[t]);
    b[1] = tf32_bits(row[t + 4]);
  } else {
    b[0] = pair_bits<T>(row[2 * t], row[2 * t + 1]);
    b[1] = pair_bits<T>(row[2 * t + 8], row[2 * t + 9]);
  }
}

// The B fragment of the K x 8 tile whose element (k, n) is s[(k0 + k) * ld + n0 + n]: the
// values' columns of a staged tile, for P V.
template <typename T>
__device__ __forceinline__ void load_b_cols(unsigned (&b)[2], const float* s, int ld, int k0, int n0) {
  const float* col = s + k0 * ld + n0 + fa_group();
  const int t = fa_thread();
  if constexpr (TensorCore<T>::K == 8) {
    b[0] = tf32_bits(col[t * ld]);
    b[1] = tf32_bits(col[(t + 4) * ld]);
  } else {
    b[0] = pair_bits<T>(col[2 * t * ld], col[(2 * t + 1) * ld]);
    b[1] = pair_bits<T>(col[(2 * t + 8) * ld], col[(2 * t + 9) * ld]);
  }
}

// The A fragment of P for keys [K kk, K kk + K) from the scores' accumulators p[n-tile][4] (row
// groupID: elements 0, 1 at columns 2 t, 2 t + 1; row groupID + 8: elements 2, 3).
template <typename T, int NT>
__device__ __forceinline__ void p_fragment(unsigned (&a)[4], const float (&p)[NT][4], int kk) {
  if constexpr (TensorCore<T>::K == 16) {
    a[0] = pair_bits<T>(p[2 * kk][0], p[2 * kk][1]);
    a[1] = pair_bits<T>(p[2 * kk][2], p[2 * kk][3]);
    a[2] = pair_bits<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]);
    a[3] = pair_bits<T>(p[2 * kk + 1][2], p[2 * kk + 1][3]);
  } else {
    // TF32's A wants columns t and t + 4 of the 8-key tile: held by lanes t / 2 and 2 + t / 2
    // of the group, as their element t % 2 (row groupID) or 2 + t % 2 (row groupID + 8).
    const int lane = threadIdx.x & 31, t = lane & 3, odd = t & 1;
    const int near = (lane & ~3) | (t >> 1), far = near + 2;
    float x[4][2];
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[e][0] = __shfl_sync(0xffffffffu, p[kk][e], near);
      x[e][1] = __shfl_sync(0xffffffffu, p[kk][e], far);
    }
    a[0] = tf32_bits(odd ? x[1][0] : x[0][0]);
    a[1] = tf32_bits(odd ? x[3][0] : x[2][0]);
    a[2] = tf32_bits(odd ? x[1][1] : x[0][1]);
    a[3] = tf32_bits(odd ? x[3][1] : x[2][1]);
  }
}

// Stages `rows` rows of DP values into dst (row stride ld) as f32: element (r, e) of the
// source at src[r s_r + e s_d], zeros at rows from `valid` and columns from d. Consecutive
// threads read consecutive addresses where the rows are adjacent (s_r 1) or the columns are.
template <typename T, int DP>
__device__ void stage_rows(float* dst, int ld, const T* src, i64 s_r, i64 s_d, int rows, int valid, int d) {
  if (s_r == 1) {
    for (int idx = threadIdx.x; idx < rows * DP; idx += blockDim.x) {
      const int e = idx / rows, r = idx - e * rows;
      dst[r * ld + e] = r < valid && e < d ? to_float(src[r + e * s_d]) : 0.f;
    }
  } else {
    for (int idx = threadIdx.x; idx < rows * DP; idx += blockDim.x) {
      const int r = idx / DP, e = idx - r * DP;
      dst[r * ld + e] = r < valid && e < d ? to_float(src[r * s_r + e * s_d]) : 0.f;
    }
  }
}

// One tensor's strides: batch, head, row, element.
struct Strides {
  i64 b, h, r, d;
};

// Grid: one block per FA_QUERIES queries of each batch element and head, ceil(Nq / FA_QUERIES)
// B H blocks of 32 FA_WARPS threads.
template <typename T, int DP>
__device__ void flash_forward(const T* q, const T* k, const T* v, const T* mask, const T* bias, T* out, int heads,
                              int nq, int nk, int d, i64 bias_rows, float scale, Strides qs, Strides ks, Strides vs,
                              Strides os) {
  constexpr int KS = TensorCore<T>::K, SHAPE = TensorCore<T>::SHAPE;
  constexpr int QLD = DP + 4, KLD = DP + 4, VLD = DP + 8;  // conflict-free fragment reads
  alignas(16) __shared__ float q_s[FA_QUERIES * QLD];
  alignas(16) __shared__ float k_s[FA_KEYS * KLD];
  alignas(16) __shared__ float v_s[FA_KEYS * VLD];
  const int tiles = (nq + FA_QUERIES - 1) / FA_QUERIES;
  const i64 bh = blockIdx.x / tiles, b = bh / heads, h = bh % heads;
  const int first = (blockIdx.x % tiles) * FA_QUERIES, warp = threadIdx.x >> 5, t = fa_thread();
  q += b * qs.b + h * qs.h + first * qs.r;
  k += b * ks.b + h * ks.h;
  v += b * vs.b + h * vs.h;
  stage_rows<T, DP>(q_s, QLD, q, qs.r, qs.d, FA_QUERIES, nq - first, d);
  __syncthreads();
  unsigned qa[DP / KS][4];
  #pragma unroll
  for (int s = 0; s < DP / KS; ++s) load_a<T>(qa[s], q_s, QLD, 16 * warp, s * KS);
  // This thread's two rows: groupID and groupID + 8 of the warp's 16.
  const int row[2] = {first + 16 * warp + fa_group(), first + 16 * warp + fa_group() + 8};
  float o[DP / 8][4] = {}, m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  for (int j0 = 0; j0 < nk; j0 += FA_KEYS) {
    const int n = min(FA_KEYS, nk - j0);
    __syncthreads();  // the previous tile's readers are done
    stage_rows<T, DP>(k_s, KLD, k + j0 * ks.r, ks.r, ks.d, FA_KEYS, n, d);
    stage_rows<T, DP>(v_s, VLD, v + j0 * vs.r, vs.r, vs.d, FA_KEYS, n, d);
    __syncthreads();
    float p[FA_KEYS / 8][4] = {};
    #pragma unroll
    for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
      #pragma unroll
      for (int s = 0; s < DP / KS; ++s) {
        unsigned kb[2];
        load_b_rows<T>(kb, k_s, KLD, 8 * nt, s * KS);
        MMA(SHAPE, p[nt], qa[s], kb);
      }
    }
    float tile_max[2] = {NEG_INF, NEG_INF};
    #pragma unroll
    for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = row[e >> 1], key = j0 + 8 * nt + 2 * t + (e & 1);
        float z = NEG_INF;
        if (r < nq && key < nk) {
          z = p[nt][e] * scale;
          if (mask) z += 1e9f * (to_float(mask[b * nk + key]) - 1.f);
          if (bias) z += to_float(bias[((bh * nq + r) % bias_rows) * nk + key]);
        }
        p[nt][e] = z;
        tile_max[e >> 1] = fmaxf(tile_max[e >> 1], z);
      }
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
      float mx = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_new = fmaxf(m[i], mx);
      // Nothing but -inf so far: no weight, and nothing to rescale.
      const float f = m_new == NEG_INF ? 1.f : expf(m[i] - m_new);
      l[i] *= f;
      #pragma unroll
      for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
        #pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& z = p[nt][2 * i + c];
          z = m_new == NEG_INF ? 0.f : expf(z - m_new);
          l[i] += z;
        }
      }
      #pragma unroll
      for (int dn = 0; dn < DP / 8; ++dn) {
        o[dn][2 * i] *= f;
        o[dn][2 * i + 1] *= f;
      }
      m[i] = m_new;
    }
    #pragma unroll
    for (int kk = 0; kk < FA_KEYS / KS; ++kk) {
      unsigned pa[4];
      p_fragment<T>(pa, p, kk);
      #pragma unroll
      for (int dn = 0; dn < DP / 8; ++dn) {
        unsigned vb[2];
        load_b_cols<T>(vb, v_s, VLD, kk * KS, 8 * dn);
        MMA(SHAPE, o[dn], pa, vb);
      }
    }
  }
  out += b * os.b + h * os.h;
  #pragma unroll
  for (int i = 0; i < 2; ++i) {
    float total = l[i] + __shfl_xor_sync(0xffffffffu, l[i], 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    if (row[i] >= nq) continue;
    #pragma unroll
    for (int dn = 0; dn < DP / 8; ++dn) {
      #pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int e = 8 * dn + 2 * t + c;
        if (e < d) out[row[i] * os.r + e * os.d] = from_float<T>(o[dn][2 * i + c] / total);
      }
    }
  }
}

#define DEFINE_FLASH(T, S, DP)                                                                                        \
  extern "C" __global__ void flash_forward_##S##_d##DP(                                                               \
      const T* q, const T* k, const T* v, const T* mask, const T* bias, T* out, int heads, int nq, int nk, int d,   \
      i64 bias_rows, float scale, i64 qb, i64 qh, i64 qr, i64 qd, i64 kb, i64 kh, i64 kr, i64 kd, i64 vb, i64 vh,     \
      i64 vr, i64 vd, i64 ob, i64 oh, i64 orow, i64 od) {                                                              \
    flash_forward<T, DP>(q, k, v, mask, bias, out, heads, nq, nk, d, bias_rows, scale, Strides{qb, qh, qr, qd},      \
                         Strides{kb, kh, kr, kd}, Strides{vb, vh, vr, vd}, Strides{ob, oh, orow, od});                \
  }
#define DEFINE_FLASH_WIDTHS(T, S) DEFINE_FLASH(T, S, 16) DEFINE_FLASH(T, S, 32) DEFINE_FLASH(T, S, 64)
FOR_EACH_DTYPE(DEFINE_FLASH_WIDTHS)
