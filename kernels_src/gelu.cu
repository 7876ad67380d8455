// gelu, tanh approximation: out = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), evaluated
// as x * sigmoid(2u) (the same function: 0.5 (1 + tanh(u)) = sigmoid(2u)), one exp and one divide.
// Nothing is saved: backward recomputes from x, dx = dout * gelu'(x).
// Compiled with fast math: __expf and the approximate divide stay far inside the fp32 tolerance.
// Layout: grid-stride loop with 64-bit indices, one 16-byte pack per thread per step when every
// pointer is 16-byte aligned (`vec`), then a grid-stride scalar loop over what the packs left.
#include "common.cuh"

constexpr float kGeluS = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluC = 0.044715f;

KF_DEVICE float gelu_value(float x) {
  const float u = kGeluS * x * (1.0f + kGeluC * x * x);
  // x -> -inf: exp overflows to inf and the quotient is -0, as the limit is.
  return __fdividef(x, 1.0f + __expf(-2.0f * u));
}

// d/dx [x sigmoid(2u)] = s + x s (1 - s) 2 u',  s = sigmoid(2u),  u' = sqrt(2/pi) (1 + 3 c x^2).
KF_DEVICE float gelu_grad(float x) {
  const float x2 = x * x;
  const float u = kGeluS * x * (1.0f + kGeluC * x2);
  const float s = __fdividef(1.0f, 1.0f + __expf(-2.0f * u));
  const float du = kGeluS * (1.0f + 3.0f * kGeluC * x2);
  return s + 2.0f * x * s * (1.0f - s) * du;
}

template <typename T>
__global__ void gelu_forward_kernel(const T* __restrict__ x, T* __restrict__ out, long long n,
                                    int vec) {
  constexpr int V = Pack128<T>::size;
  const long long packs = vec ? n / V : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long i = tid; i < packs; i += stride) {
    const Pack128<T> a = load128cs(x + i * V);
    Pack128<T> r;
#pragma unroll
    for (int k = 0; k < V; ++k) r.set(k, gelu_value(a.f(k)));
    store128(out + i * V, r);
  }
  for (long long t = packs * V + tid; t < n; t += stride)
    out[t] = from_float<T>(gelu_value(to_float(x[t])));
}

template <typename T>
__global__ void gelu_backward_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                     T* __restrict__ dx, long long n, int vec) {
  constexpr int V = Pack128<T>::size;
  const long long packs = vec ? n / V : 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long i = tid; i < packs; i += stride) {
    const Pack128<T> g = load128cs(dout + i * V), a = load128cs(x + i * V);
    Pack128<T> r;
#pragma unroll
    for (int k = 0; k < V; ++k) r.set(k, g.f(k) * gelu_grad(a.f(k)));
    store128(dx + i * V, r);
  }
  for (long long t = packs * V + tid; t < n; t += stride)
    dx[t] = from_float<T>(to_float(dout[t]) * gelu_grad(to_float(x[t])));
}
