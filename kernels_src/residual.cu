// residual: out = a + b for two tensors of one dtype (the transformer residual stream), computed in
// fp32 and rounded once, as eager PyTorch does for bf16 / fp16. b has a's shape, or a's trailing
// dims (nb elements, repeated along the leading dims: b[i % nb]). Without it
// Thunder's torch path runs a low-precision add as upcast, upcast, fp32 add, downcast (four kernels,
// ~5x the bytes) and its backward casts the gradient back and forth again. Backward is the identity
// (the gradient flows unchanged to a and b): no kernel.
// Layout: grid-stride loop with 64-bit indices; each thread moves two 16-byte packs of a and b per
// step (all four loads issued before the adds) when every pointer is 16-byte aligned and nb is a
// whole number of packs (`vec`), then a grid-stride scalar loop over the tail.
#include "common.cuh"

template <typename T>
__global__ void residual_forward_kernel(const T* __restrict__ a, const T* __restrict__ b,
                                        T* __restrict__ out, long long n, long long nb, int vec) {
  kf_wait_prior_grids();
  constexpr int V = Pack128<T>::size;
  constexpr int U = 2;  // packs per thread per step
  const long long packs = vec ? n / V : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long i0 = tid; i0 < packs; i0 += U * stride) {
    Pack128<T> pa[U], pb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = i0 + u * stride;
      if (i < packs) {
        pa[u] = load128cs(a + i * V);
        // A broadcast b is small and re-read: keep it cached (plain load).
        pb[u] = nb == n ? load128cs(b + i * V) : load128(b + (i * V) % nb);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long i = i0 + u * stride;
      if (i < packs) {
        Pack128<T> r;
#pragma unroll
        for (int k = 0; k < V; ++k) r.set(k, pa[u].f(k) + pb[u].f(k));
        store128(out + i * V, r);
      }
    }
  }
  for (long long t = packs * V + tid; t < n; t += stride)
    out[t] = from_float<T>(to_float(a[t]) + to_float(b[nb == n ? t : t % nb]));
}
