// Sigmoid gates with their biases: y = mask (x + xb) sigmoid(g + gb) over x and g [rows, cols],
// biases [cols] broadcast over rows, and a mask [rows] broadcast over cols (or none): the
// gated projections of the triangle multiplicative update (AlphaFold's left and right
// projections times the pair mask times their gates) and, without a mask, the output gates
// of the Evoformer's modules. The backward writes dx = dy m s and dg = dy m v s (1 - s), with
// v = x + xb and s = sigmoid(g + gb) recomputed from the saved inputs.

__device__ __forceinline__ float sigmoid(float z) { return 1.f / (1.f + expf(-z)); }

template <typename T>
__device__ void sigmoid_gate_forward(const T* x, const T* xb, const T* g, const T* gb, const T* mask, T* y, i64 n,
                                     int cols) {
  GRID_STRIDE(i, n) {
    const int c = (int)(i % cols);
    const float m = mask ? to_float(mask[i / cols]) : 1.f;
    const float v = to_float(x[i]) + to_float(xb[c]);
    y[i] = from_float<T>(m * v * sigmoid(to_float(g[i]) + to_float(gb[c])));
  }
}

template <typename T>
__device__ void sigmoid_gate_backward(const T* x, const T* xb, const T* g, const T* gb, const T* mask, const T* dy,
                                      T* dx, T* dg, i64 n, int cols) {
  GRID_STRIDE(i, n) {
    const int c = (int)(i % cols);
    const float m = mask ? to_float(mask[i / cols]) : 1.f;
    const float v = to_float(x[i]) + to_float(xb[c]);
    const float s = sigmoid(to_float(g[i]) + to_float(gb[c]));
    const float d = to_float(dy[i]) * m;
    dx[i] = from_float<T>(d * s);
    dg[i] = from_float<T>(d * v * s * (1.f - s));
  }
}

#define DEFINE(T, S)                                                                                           \
  extern "C" __global__ void sigmoid_gate_forward_##S(const T* x, const T* xb, const T* g, const T* gb,         \
                                                      const T* mask, T* y, i64 n, int cols) {                   \
    sigmoid_gate_forward<T>(x, xb, g, gb, mask, y, n, cols);                                                   \
  }                                                                                                           \
  extern "C" __global__ void sigmoid_gate_backward_##S(const T* x, const T* xb, const T* g, const T* gb,        \
                                                       const T* mask, const T* dy, T* dx, T* dg, i64 n,         \
                                                       int cols) {                                              \
    sigmoid_gate_backward<T>(x, xb, g, gb, mask, dy, dx, dg, n, cols);                                         \
  }
FOR_EACH_DTYPE(DEFINE)
