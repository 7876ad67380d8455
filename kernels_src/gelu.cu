// gelu, two modes selected by the template flag Erf (one source, fp32 math, nothing saved: backward
// recomputes from x, dx = dout * gelu'(x)):
// - tanh approximation (Erf = false, GPT-2's `approximate="tanh"`): out = 0.5 x (1 + tanh(u)),
//   u = sqrt(2/pi) (x + 0.044715 x^3), evaluated as x * sigmoid(2u) (the same function:
//   0.5 (1 + tanh(u)) = sigmoid(2u)), one exp and one divide.
// - exact (Erf = true, `nn.GELU()`'s default, nanoGPT's): out = x Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2,
//   gelu'(x) = Phi(x) + x exp(-x^2 / 2) / sqrt(2 pi). erfc, not 1 + erf: in the negative tail 1 + erf
//   cancels (20 % off at x = -5 in fp32) where erfc keeps full relative precision.
// Compiled with fast math: ex2.approx and the approximate reciprocal stay far inside the fp32
// tolerance.
//
// - gelu_{forward,backward}_kernel (every pointer 16-byte aligned): no loop; block b of 256 threads
//   covers packs [b 2 256, (b + 1) 2 256), thread t packs t and t + 256 (each warp coalesced), both
//   (backward: all four) 16-byte streaming loads issued before the first use (see gelu_gate), and
//   streaming stores. The grid is packs / 512 + 1 blocks: the last one is partial (bounds-checked,
//   possibly empty) and also does the < 8-element scalar tail.
// - gelu_{forward,backward}_scalar_kernel (any pointer misaligned): grid-stride loop over elements
//   with 64-bit indices.
#include "common.cuh"
#include "launch_params.cuh"

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

constexpr float kInvSqrt2 = 0.7071067811865476f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1 / sqrt(2 pi)

// Phi(x) = erfc(-x / sqrt 2) / 2 through erfc(a) = t exp(-a^2 + P(t)), a = |x| / sqrt 2 >= 0,
// t = 1 / (1 + a / 2) (Numerical Recipes' erfcc: relative error below 1.2e-7 for every a >= 0); the
// tail itself for x <= 0, 1 - tail for x > 0. One rcp, ten FMAs and one exp, no branch; -a^2 = -x^2 / 2
// is formed inside the exponent's FMA, so neither a nor x^2 is rounded there (fp32: 4e-6 relative
// at x = -12). The CUDA library's erfcf took more than 32 registers and spilled in the bf16 pack
// kernel (ptxas -v, sm_80 / sm_90).
KF_DEVICE float gelu_cdf(float x) {
  const float t = __fdividef(1.0f, fmaf(0.5f * kInvSqrt2, fabsf(x), 1.0f));
  float p = 0.17087277f;
  p = fmaf(p, t, -0.82215223f);
  p = fmaf(p, t, 1.48851587f);
  p = fmaf(p, t, -1.13520398f);
  p = fmaf(p, t, 0.27886807f);
  p = fmaf(p, t, -0.18628806f);
  p = fmaf(p, t, 0.09678418f);
  p = fmaf(p, t, 0.37409196f);
  p = fmaf(p, t, 1.00002368f);
  p = fmaf(p, t, -1.26551223f);
  const float tail = 0.5f * t * __expf(fmaf(-0.5f * x, x, p));  // |x| -> inf: t -> 0, exp -> 0
  return x > 0.0f ? 1.0f - tail : tail;
}
KF_DEVICE float gelu_erf_value(float x) { return x * gelu_cdf(x); }
// Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi): for x -> -inf both terms -> 0 (the exp
// underflows to 0 before x * 0 could meet an inf).
KF_DEVICE float gelu_erf_grad(float x) {
  return fmaf(x * kInvSqrt2Pi, __expf(-0.5f * x * x), gelu_cdf(x));  // -0.5 x * x: one rounding
}

// The scalar kernels' functions per mode.
template <bool Erf> KF_DEVICE float gelu_act(float x) { return Erf ? gelu_erf_value(x) : gelu_value(x); }
template <bool Erf> KF_DEVICE float gelu_dact(float x) { return Erf ? gelu_erf_grad(x) : gelu_grad(x); }

// Misaligned pointers: grid-stride loop, one element per thread per step, 64-bit indices.
template <typename T, bool Erf>
__global__ void gelu_forward_scalar_kernel(const T* __restrict__ x, T* __restrict__ out, long long n) {
  kf_wait_prior_grids();
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += stride)
    out[t] = from_float<T>(gelu_act<Erf>(to_float(x[t])));
}

template <typename T, bool Erf>
__global__ void gelu_backward_scalar_kernel(const T* __restrict__ dout, const T* __restrict__ x,
                                            T* __restrict__ dx, long long n) {
  kf_wait_prior_grids();
  const long long stride = (long long)gridDim.x * blockDim.x;
  for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < n; t += stride)
    dx[t] = from_float<T>(to_float(dout[t]) * gelu_dact<Erf>(to_float(x[t])));
}

// ---- 16-byte packs ------------------------------------------------------------------------------
// The same math with the constants folded: exp(-2u) = 2^(x (kE1 + kE3 x^2)); 7 instructions per
// element forward (2 of them MUFU), 12 backward with the dout product (gelu_value / gelu_grad under
// fast math: 10 and 16).
constexpr float kGeluE1 = -2.0f * 1.4426950408889634f * kGeluS;  // -2 log2(e) sqrt(2/pi)
constexpr float kGeluE3 = kGeluE1 * kGeluC;
constexpr float kGeluD1 = 2.0f * kGeluS;                          // 2 u' = kD1 + kD3 x^2
constexpr float kGeluD3 = 6.0f * kGeluS * kGeluC;

KF_DEVICE float gelu_ex2(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}
KF_DEVICE float gelu_rcp(float v) {  // 1 / v; 0 for v = inf. __fdividef(1, v) adds an FADD.
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

KF_DEVICE float gelu_value_fast(float x) {
  const float e = gelu_ex2(x * fmaf(kGeluE3, x * x, kGeluE1));  // exp(-2u); inf for x -> -inf
  return __fdividef(x, 1.0f + e);                                // -> -0 there, as in gelu_value
}
// gelu'(x) = s (1 + x (1 - s) 2u'), s = sigmoid(2u) = 1 / (1 + exp(-2u)) (see gelu_grad).
KF_DEVICE float gelu_grad_fast(float x) {
  const float x2 = x * x;
  const float s = gelu_rcp(1.0f + gelu_ex2(x * fmaf(kGeluE3, x2, kGeluE1)));
  return s * fmaf(x * (1.0f - s), fmaf(kGeluD3, x2, kGeluD1), 1.0f);
}

// The pack kernels' functions per mode.
template <bool Erf> KF_DEVICE float gelu_act_fast(float x) {
  return Erf ? gelu_erf_value(x) : gelu_value_fast(x);
}
template <bool Erf> KF_DEVICE float gelu_dact_fast(float x) {
  return Erf ? gelu_erf_grad(x) : gelu_grad_fast(x);
}

// A 16-byte pack kept as its four raw 32-bit words from the load until the math uses them, and
// unpacked / packed there word by word (Word<T>, common.cuh): bf16 takes one SHF (low half) or LOP3
// (high half) per element, where Pack128<bf16>::f compiled to PRMT + SHF for the high half.
KF_DEVICE int4 gelu_ld(const void* p) { return __ldcs(reinterpret_cast<const int4*>(p)); }
KF_DEVICE void gelu_st(void* p, int4 v) { __stcs(reinterpret_cast<int4*>(p), v); }

// One 32-bit word of a pack (1 float or 2 16-bit elements) in, one out.
template <typename T, bool Erf> KF_DEVICE u32 gelu_forward_word(u32 w) {
  typedef Word<T> W;
  float f[W::kElems];
  W::unpack(w, f);
#pragma unroll
  for (int j = 0; j < W::kElems; ++j) f[j] = gelu_act_fast<Erf>(f[j]);
  return W::pack(f);
}
template <typename T, bool Erf> KF_DEVICE u32 gelu_backward_word(u32 g, u32 w) {
  typedef Word<T> W;
  float f[W::kElems], d[W::kElems];
  W::unpack(w, f);
  W::unpack(g, d);
#pragma unroll
  for (int j = 0; j < W::kElems; ++j) f[j] = d[j] * gelu_dact_fast<Erf>(f[j]);
  return W::pack(f);
}

template <typename T, bool Erf> KF_DEVICE int4 gelu_forward_pack(int4 a) {
  int4 r;
#pragma unroll
  for (int i = 0; i < 4; ++i) set_word(r, i, gelu_forward_word<T, Erf>(word_of(a, i)));
  return r;
}
template <typename T, bool Erf> KF_DEVICE int4 gelu_backward_pack(int4 g, int4 a) {
  int4 r;
#pragma unroll
  for (int i = 0; i < 4; ++i) set_word(r, i, gelu_backward_word<T, Erf>(word_of(g, i), word_of(a, i)));
  return r;
}

// Load gate: ptxas sinks a thread's later independent loads towards their first use (for the 16-bit
// types and the backward only some of the 16-byte loads were issued up front, the rest after the
// first packs' math, each then costing another memory latency); a data dependence of one pack's
// math on every load did not stop it (it scheduled that pack last). A branch on every load does:
// the math sits after `if (!gelu_gate(...))`, whose condition ORs one word of every pack and masks
// it with n >> 62 (0 for every real tensor, not known to the compiler). A taken gate would fall
// through to the bounds-checked path, which is also correct. About P / 2 LOP3 per thread.
template <int P> KF_DEVICE bool gelu_gate(const int4 (&a)[P], long long n) {
  u32 t = 0;
#pragma unroll
  for (int k = 0; k < P; ++k) t |= (u32)a[k].x;
  return (t & (u32)((unsigned long long)n >> 62)) != 0;
}
template <int P> KF_DEVICE bool gelu_gate(const int4 (&g)[P], const int4 (&a)[P], long long n) {
  u32 t = 0;
#pragma unroll
  for (int k = 0; k < P; ++k) t |= (u32)g[k].x | (u32)a[k].x;
  return (t & (u32)((unsigned long long)n >> 62)) != 0;
}

// Packs per thread, threads per block and the launch bound's resident blocks of
// gelu_{forward,backward}_kernel: launch_params.cuh (kGeluP, kGeluB, kGeluMinBlocks), shared with
// src/ops/gelu.cpp (registers capped at 32 without spilling: nvcc --resource-usage, sm_80 / sm_90).
using namespace kf_gelu;

// Block b: packs [b P B, (b + 1) P B), thread t takes packs t + k B (k < P); the block with
// (b + 1) P B > packs (always the last one) is bounds-checked and writes the scalar tail.
template <typename T, bool Erf>
__global__ void __launch_bounds__(kGeluB, kGeluMinBlocks)
    gelu_forward_kernel(const T* __restrict__ x, T* __restrict__ out, long long n) {
  kf_wait_prior_grids();
  constexpr int V = Pack128<T>::size, P = kGeluP, B = kGeluB;
  const long long packs = n / V;
  const long long first = (long long)blockIdx.x * (P * B) + threadIdx.x;  // this thread's first pack
  const T* xp = x + first * V;
  T* op = out + first * V;
  int4 a[P];
  if ((long long)(blockIdx.x + 1) * (P * B) <= packs) {  // full block
#pragma unroll
    for (int k = 0; k < P; ++k) a[k] = gelu_ld(xp + k * B * V);
    if (!gelu_gate(a, n)) {
#pragma unroll
      for (int k = 0; k < P; ++k) gelu_st(op + k * B * V, gelu_forward_pack<T, Erf>(a[k]));
      return;
    }
  }
  const long long left = packs - first;  // this thread's packs are k B < left
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (k * B < left) a[k] = gelu_ld(xp + k * B * V);
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (k * B < left) gelu_st(op + k * B * V, gelu_forward_pack<T, Erf>(a[k]));
  const long long t = packs * V + threadIdx.x;  // n - packs V < V <= B elements
  if (t < n) out[t] = from_float<T>(gelu_act_fast<Erf>(to_float(x[t])));
}

// Layout as gelu_forward_kernel; 2 P loads (dout and x) in flight per thread.
template <typename T, bool Erf>
__global__ void __launch_bounds__(kGeluB, kGeluMinBlocks)
    gelu_backward_kernel(const T* __restrict__ dout, const T* __restrict__ x, T* __restrict__ dx,
                         long long n) {
  kf_wait_prior_grids();
  constexpr int V = Pack128<T>::size, P = kGeluP, B = kGeluB;
  const long long packs = n / V;
  const long long first = (long long)blockIdx.x * (P * B) + threadIdx.x;
  const T* gp = dout + first * V;
  const T* xp = x + first * V;
  T* op = dx + first * V;
  int4 g[P], a[P];
  if ((long long)(blockIdx.x + 1) * (P * B) <= packs) {  // full block
#pragma unroll
    for (int k = 0; k < P; ++k) {
      g[k] = gelu_ld(gp + k * B * V);
      a[k] = gelu_ld(xp + k * B * V);
    }
    if (!gelu_gate(g, a, n)) {
#pragma unroll
      for (int k = 0; k < P; ++k) gelu_st(op + k * B * V, gelu_backward_pack<T, Erf>(g[k], a[k]));
      return;
    }
  }
  const long long left = packs - first;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    if (k * B < left) {
      g[k] = gelu_ld(gp + k * B * V);
      a[k] = gelu_ld(xp + k * B * V);
    }
  }
#pragma unroll
  for (int k = 0; k < P; ++k)
    if (k * B < left) gelu_st(op + k * B * V, gelu_backward_pack<T, Erf>(g[k], a[k]));
  const long long t = packs * V + threadIdx.x;
  if (t < n) dx[t] = from_float<T>(to_float(dout[t]) * gelu_dact_fast<Erf>(to_float(x[t])));
}
