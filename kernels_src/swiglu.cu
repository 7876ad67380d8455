// swiglu: out = silu(gate) * up, elementwise, silu(g) = g * sigmoid(g). Saved for backward: gate and
// up (the inputs); silu is recomputed, never stored. Backward, in one pass over dout, gate, up:
//   d_up = dout * silu(gate),  d_gate = dout * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate))).
// fp32 math. Layout: grid-stride loop over 16-byte packs when every pointer is 16-byte aligned
// (`vec`), then a grid-stride loop over the scalars the packs did not cover; 64-bit offsets.
#include "common.cuh"

KF_DEVICE float sigmoid(float g) { return 1.0f / (1.0f + __expf(-g)); }

template <typename T>
__global__ void swiglu_forward_kernel(const T* __restrict__ gate, const T* __restrict__ up,
                                      T* __restrict__ out, long long n, int vec) {
  kf_wait_prior_grids();
  constexpr int V = Pack128<T>::size;
  const long long packs = vec ? n / V : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long i = tid; i < packs; i += stride) {
    const Pack128<T> g = load128cs(gate + i * V), u = load128cs(up + i * V);
    Pack128<T> r;
#pragma unroll
    for (int j = 0; j < V; ++j) r.set(j, g.f(j) * sigmoid(g.f(j)) * u.f(j));
    store128(out + i * V, r);
  }
  for (long long i = packs * V + tid; i < n; i += stride) {
    const float g = to_float(gate[i]);
    out[i] = from_float<T>(g * sigmoid(g) * to_float(up[i]));
  }
}

KF_DEVICE void swiglu_grad(float d, float g, float u, float& dg, float& du) {
  const float s = sigmoid(g);
  du = d * g * s;
  dg = d * u * s * (1.0f + g * (1.0f - s));
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* __restrict__ dout, const T* __restrict__ gate,
                                       const T* __restrict__ up, T* __restrict__ dgate,
                                       T* __restrict__ dup, long long n, int vec) {
  kf_wait_prior_grids();
  constexpr int V = Pack128<T>::size;
  const long long packs = vec ? n / V : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long i = tid; i < packs; i += stride) {
    const Pack128<T> d = load128cs(dout + i * V), g = load128cs(gate + i * V),
                     u = load128cs(up + i * V);
    Pack128<T> dg, du;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      float a, b;
      swiglu_grad(d.f(j), g.f(j), u.f(j), a, b);
      dg.set(j, a);
      du.set(j, b);
    }
    store128(dgate + i * V, dg);
    store128(dup + i * V, du);
  }
  for (long long i = packs * V + tid; i < n; i += stride) {
    float a, b;
    swiglu_grad(to_float(dout[i]), to_float(gate[i]), to_float(up[i]), a, b);
    dgate[i] = from_float<T>(a);
    dup[i] = from_float<T>(b);
  }
}
