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


// ---- column sums of per-block partial rows, inside the kernel that writes them -------------------
// A persistent kernel whose blocks each leave one row of `ncol` fp32 partial sums (row blockIdx.x of
// `partial`) can add them up itself instead of in a second kernel: the blocks that finish first take
// a column slice each and add the rows of the slice as they land, so when the last block writes its
// row only that row's chunk and the final sums are left. The bits do not depend on timing: a slice's
// column is summed in chunks of kColChunk rows (rows in order), then the chunk sums in order.
// No block ever waits for one that may not have started: a block takes a slice only if every block
// of the grid has started (those never wait: they finish on their own), and the last block to finish
// takes whatever slices are left. So nothing depends on the grid being co-resident.
// `sync`: kColSyncInts + gridDim.x ints, zero between launches (the last block to leave zeroes
// them), owned by one launch at a time (the runtime hands each stream its own; see
// src/runtime/torch_launch.h). [0] blocks started, [1] slices taken, [2] blocks done, [3] blocks
// left, [kColSyncInts + b] block b's row is written.
// Needs gridDim.x <= 32 * kColChunk (one 32-bit mask of chunks) and `csum` (shared memory) of
// ceil(gridDim.x / kColChunk) * slice_cols floats, slice_cols = ceil(ncol / nslice); the launcher
// checks both.
constexpr int kColSyncInts = 4;
constexpr int kColChunk = 8;

KF_DEVICE int kf_ld_acquire(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
KF_DEVICE void kf_st_release(int* p, int v) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Every block calls this once, right after kf_wait_prior_grids() (the previous launch on the stream
// has zeroed `sync` by then).
KF_DEVICE void kf_colsum_started(int* sync) {
  if (sync && threadIdx.x == 0 && threadIdx.y == 0) atomicAdd(sync, 1);
}

// Called by every thread of every block once the block's partial row is written (plain stores).
// out(col, sum) stores a column's total.
template <typename Out>
KF_DEVICE void kf_colsum_finish(const float* __restrict__ partial, int ncol, int nslice, int* sync,
                                float* csum, Out out) {
  __shared__ int claim[3];  // the slice taken on finishing, the leftover slices [claim[1], claim[2])
  __shared__ unsigned ready_mask;
  __shared__ int last_out;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthr = blockDim.x * blockDim.y;
  const int G = gridDim.x, nch = (G + kColChunk - 1) / kColChunk;
  int* const flags = sync + kColSyncInts;
  __threadfence();  // this thread's partial stores, before the flag (every thread, then thread 0)
  __syncthreads();
  if (tid == 0) {
    kf_st_release(flags + blockIdx.x, 1);
    int mine = nslice, lo = nslice;
    if (kf_ld_acquire(sync) == G) mine = atomicAdd(sync + 1, 1);  // all started: waiting is safe
    __threadfence();  // the claim before the count of finished blocks (the last one reads both)
    if (atomicAdd(sync + 2, 1) == G - 1) lo = atomicAdd(sync + 1, nslice);  // last: the rest
    claim[0] = mine < nslice ? mine : nslice;
    claim[1] = lo < nslice ? lo : nslice;
    claim[2] = nslice;
  }
  __syncthreads();
  const int w = (ncol + nslice - 1) / nslice;
  const unsigned all = nch == 32 ? ~0u : (1u << nch) - 1u;
  for (int pass = 0; pass < 2; ++pass) {
    const int first = pass == 0 ? claim[0] : claim[1];
    const int last = pass == 0 ? min(claim[0] + 1, nslice) : claim[2];
    for (int s = first; s < last; ++s) {
      const int c0 = s * w, wn = min(w, ncol - c0);
      unsigned done = 0u;  // chunks added (the same in every thread)
      while (done != all) {
        if (tid == 0) ready_mask = 0u;
        __syncthreads();
        // Chunk readiness: thread t looks at row t (rows past G count as written); chunk k's bit
        // is set when its kColChunk rows are.
        if (tid < 32 * ((G + 31) / 32)) {
          const bool r = tid >= G || kf_ld_acquire(flags + tid) != 0;
          const unsigned b = __ballot_sync(0xffffffffu, r);
          if ((tid & 31) == 0) {
            unsigned bits = 0u;
#pragma unroll
            for (int q = 0; q < 32 / kColChunk; ++q)
              if (((b >> (kColChunk * q)) & ((1u << kColChunk) - 1u)) == (1u << kColChunk) - 1u)
                bits |= 1u << q;
            atomicOr(&ready_mask, bits << ((32 / kColChunk) * (tid >> 5)));
          }
        }
        __syncthreads();
        const unsigned fresh = ready_mask & all & ~done;
        if (fresh == 0u) {
          __nanosleep(200);
        } else {
          __threadfence();  // the rows behind the flags seen above
          // Items (j-th fresh chunk, column); two in flight per thread.
          const int items = __popc(fresh) * wn;
          for (int i = tid; i < items; i += 2 * nthr) {
            float v[2][kColChunk];
            int at[2];
#pragma unroll
            for (int u = 0; u < 2; ++u) {
              const int it = i + u * nthr;
              at[u] = -1;
              if (it < items) {
                const int j = it / wn, col = it - j * wn;
                unsigned m = fresh;
                for (int q = 0; q < j; ++q) m &= m - 1u;
                const int k = __ffs(m) - 1;  // the j-th fresh chunk
                at[u] = k * w + col;
#pragma unroll
                for (int r = 0; r < kColChunk; ++r) {
                  const int row = k * kColChunk + r;
                  v[u][r] = row < G ? __ldcg(partial + (long long)row * ncol + c0 + col) : 0.0f;
                }
              }
            }
#pragma unroll
            for (int u = 0; u < 2; ++u)
              if (at[u] >= 0) {
                float t = v[u][0];
#pragma unroll
                for (int r = 1; r < kColChunk; ++r) t += v[u][r];
                csum[at[u]] = t;
              }
          }
          done |= fresh;
        }
        __syncthreads();  // ready_mask read by every thread; csum written
      }
      for (int col = tid; col < wn; col += nthr) {
        float t = csum[col];
        for (int k = 1; k < nch; ++k) t += csum[k * w + col];
        out(c0 + col, t);
      }
      __syncthreads();  // csum read before the next slice reuses it
    }
  }
  // Leaving: the last block out zeroes `sync` for the next launch (every block is done with it).
  if (tid == 0) {
    __threadfence();
    last_out = atomicAdd(sync + 3, 1) == G - 1;
  }
  __syncthreads();
  if (last_out)
    for (int i = tid; i < kColSyncInts + G; i += nthr) sync[i] = 0;
}
