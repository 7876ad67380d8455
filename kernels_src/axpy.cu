// axpy: out = alpha * x + y, elementwise. The runtime's smoke-test kernel (no Thunder op): small
// enough to check compile, cache, load and launch end to end.
// Layout: grid-stride loop, one 16-byte pack per thread per step when all pointers are 16-byte
// aligned (`vec`), then a grid-stride scalar loop over whatever the packs did not cover.
#include "common.cuh"

template <typename T>
__global__ void axpy_kernel(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out,
                            float alpha, long long n, int vec) {
  kf_wait_prior_grids();
  constexpr int V = Pack128<T>::size;
  const long long packs = vec ? n / V : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long i = tid; i < packs; i += stride) {
    Pack128<T> a = load128cs(x + i * V), b = load128cs(y + i * V), r;
#pragma unroll
    for (int k = 0; k < V; ++k) r.set(k, alpha * a.f(k) + b.f(k));
    store128(out + i * V, r);
  }
  for (long long t = packs * V + tid; t < n; t += stride)
    out[t] = from_float<T>(alpha * to_float(x[t]) + to_float(y[t]));
}
