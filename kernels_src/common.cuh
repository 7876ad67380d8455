// common.cuh: what every kforge kernel shares.
//
// Compiled by NVRTC with no CUDA headers at all (NVRTC 13 ships no cuda_bf16.h / cuda_fp16.h), so
// the 16-bit float storage types below are our own: plain 16-bit structs converted with the PTX
// `cvt` instructions (sm_80+: round-to-nearest-even, NaN preserved). All arithmetic is done in fp32.
//
// Conventions for kernels:
// - Template on the storage type T (float, bf16, half); instantiated from the C++ launcher through
//   NVRTC name expressions, e.g. "gelu_forward_kernel<bf16>".
// - Index with size_t / long long wherever an offset can exceed 2^31 elements.
// - Pack128<T> moves 16 bytes per access; scalar tails handle sizes that are not a multiple of it.
#pragma once

#define KF_DEVICE __device__ __forceinline__

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// NVRTC has no <math.h>: INFINITY is not defined.
#define KF_INF __int_as_float(0x7f800000)

struct __align__(2) bf16 { u16 bits; };
struct __align__(2) half { u16 bits; };

// ---- dependent launches (Kernel::launch in the runtime) ------------------------------------------
// On sm_90+ every kernel is launched as a programmatic dependent of the kernel before it on the
// stream, so it may start while that kernel is still draining. Every kernel therefore begins with
// kf_wait_prior_grids(), which returns once that kernel has finished and its writes are visible
// (tests/test_runtime.py checks it is each kernel's first statement). A no-op before sm_90.
KF_DEVICE void kf_wait_prior_grids() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the dependent kernel's blocks be scheduled now (e.g. as this block enters its epilogue) rather
// than when this grid exits. Only scheduling: the dependent still waits in kf_wait_prior_grids().
KF_DEVICE void kf_allow_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ---- conversions --------------------------------------------------------------------------------
KF_DEVICE float to_float(float x) { return x; }
KF_DEVICE float to_float(bf16 x) { return __uint_as_float(((u32)x.bits) << 16); }
KF_DEVICE float to_float(half x) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
  return f;
}

template <typename T> KF_DEVICE T from_float(float x);
template <> KF_DEVICE float from_float<float>(float x) { return x; }
template <> KF_DEVICE bf16 from_float<bf16>(float x) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}
template <> KF_DEVICE half from_float<half>(float x) {
  half r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x));
  return r;
}

// ---- 16-byte packed vector ----------------------------------------------------------------------
// Pack128<T> holds 16 bytes of T (4 floats or 8 bf16/half). Loads/stores must be 16-byte aligned;
// launchers check base pointer alignment and row strides before choosing a vectorised kernel.
template <typename T>
struct __align__(16) Pack128 {
  static constexpr int size = 16 / sizeof(T);
  T v[size];
  KF_DEVICE T& operator[](int i) { return v[i]; }
  KF_DEVICE const T& operator[](int i) const { return v[i]; }
  KF_DEVICE float f(int i) const { return to_float(v[i]); }
  KF_DEVICE void set(int i, float x) { v[i] = from_float<T>(x); }
};

template <typename T> KF_DEVICE Pack128<T> load128(const T* p) {
  Pack128<T> r;
  *reinterpret_cast<int4*>(&r) = *reinterpret_cast<const int4*>(p);
  return r;
}
// Streaming (evict-first) load for data read exactly once.
template <typename T> KF_DEVICE Pack128<T> load128cs(const T* p) {
  Pack128<T> r;
  *reinterpret_cast<int4*>(&r) = __ldcs(reinterpret_cast<const int4*>(p));
  return r;
}
template <typename T> KF_DEVICE void store128(T* p, const Pack128<T>& x) {
  *reinterpret_cast<int4*>(p) = *reinterpret_cast<const int4*>(&x);
}
// Streaming store for outputs no later kernel of this op re-reads soon.
template <typename T> KF_DEVICE void store128cs(T* p, const Pack128<T>& x) {
  __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&x));
}

// ---- reductions ---------------------------------------------------------------------------------
KF_DEVICE float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}
KF_DEVICE float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// Block-wide reduction; every thread gets the result. `scratch` holds >= 32 floats of shared memory.
// blockDim.x must be a multiple of 32. Safe to call repeatedly with the same scratch.
template <bool IsMax>
KF_DEVICE float block_reduce(float x, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  x = IsMax ? warp_max(x) : warp_sum(x);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = x;
  __syncthreads();
  float init = IsMax ? -KF_INF : 0.0f;
  x = lane < nwarps ? scratch[lane] : init;
  return IsMax ? warp_max(x) : warp_sum(x);
}
KF_DEVICE float block_sum(float x, float* scratch) { return block_reduce<false>(x, scratch); }
KF_DEVICE float block_max(float x, float* scratch) { return block_reduce<true>(x, scratch); }

