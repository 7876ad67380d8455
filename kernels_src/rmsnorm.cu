// rmsnorm: y = x * rstd * weight over the last dim (D elements), rstd = 1 / sqrt(mean(x^2) + eps),
// statistics in fp32. Two conventions for where the result is rounded to the storage type T:
//   cast_before_weight = 1 (Hugging Face Llama): y = weight * T(x * rstd)
//   cast_before_weight = 0 (torch F.rms_norm):   y = T(x * rstd * weight)
// (identical for fp32). weight may be null (no affine weight: w = 1).
//
// Fused residual add (RES, a template flag of the forward and the three backward kernels; llm.c's
// fused residual forward): the forward reads x and residual, writes s = T(x + residual) (fp32 add,
// one rounding: eager's 16-bit add) and normalises that rounded s, so the add costs one read and one
// write per element and no launch. The backward takes dres, the gradient of s from its other
// consumers, and writes dx = T(norm's dx in fp32 + dres), one rounding; x's and residual's gradients
// are both that dx.
//
// 16-bit copy of dx (NZ, a template parameter of the three backward kernels, fp32 T only: 1 bf16, 2
// fp16): the kernel also stores dx rounded once to that type, the value eager's cast of dx gives.
// Under autocast the fp32 residual stream's gradient is both added on (fp32) and read by the next
// 16-bit matmul (the cast's backward); one kernel writes both instead of a conversion re-reading dx.
//
// Saved for backward: rstd (fp32, one per row). Backward recomputes x_hat = x * rstd from x and
// rstd; with g = dy * w: dx = rstd * (g - x_hat * mean(g * x_hat)), and dweight = sum over rows of
// dy * x_hat (x_hat rounded to T first under cast_before_weight, as the forward used it).
// dweight is deterministic: each backward block accumulates fp32 sums for its rows in registers and
// writes one partial row; rmsnorm_dweight_kernel adds the partial rows in a fixed order.
//
// Layout shared by both directions: a row is split into chunks of V = 16 / sizeof(T) elements;
// blockDim.x threads own a row (one warp, or several warps), blockDim.y rows are handled side by
// side, and thread x owns chunks x, x + blockDim.x, ... (at most K, a template parameter, so the row
// lives in registers between the reduction and the output pass). All loads of x (and dy, rstd) of a
// row are issued before their first use, so a thread has them all in flight at once. VEC (template):
// 16-byte accesses (D % V == 0 and every pointer 16-byte aligned, checked by the launcher);
// otherwise chunks are moved element-wise and the last one is cut at D.
//
// What limits these kernels is bytes in flight per SM, i.e. registers: the launcher picks K (and,
// backward, rows per group R) so that loads fill a good part of the register file, and every kernel
// instantiation compiles without spills (launch bounds below; checked with ptxas for sm_80/sm_90).
// Backward kernels: rmsnorm_backward_ring_kernel (16-byte accesses, rows of up to 1024 chunks: the
// next rows staged in shared memory by cp.async, many bytes in flight per SM); where its stages do
// not fit in shared memory, rmsnorm_backward_pipelined_kernel (the next rows' loads in registers);
// for anything else (element-wise access, longer rows) rmsnorm_backward_kernel (R rows per group
// loaded at once, then computed; any size).
#include "common.cuh"

// ---- chunks in registers ------------------------------------------------------------------------
// A chunk is a 16-byte unit held as four 32-bit words (common.cuh), so it costs four registers
// whatever T is (16-bit values unpacked one per register would cost twice as many). Word<T> gives
// the per-word conversions (kOne: a word of ones, round: a pair rounded to T and read back).
template <typename T> using Chunk = Pack128<T, Held::words>;

// Bits of one element (16-bit types in the low half) and back.
KF_DEVICE u32 bits_of(float v) { return __float_as_uint(v); }
KF_DEVICE u32 bits_of(bf16 v) { return v.bits; }
KF_DEVICE u32 bits_of(half v) { return v.bits; }
template <typename T>
KF_DEVICE T of_bits(u32 b) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(b);
  } else {
    T t;
    t.bits = (u16)b;
    return t;
  }
}

// Chunk<T> c of a row; STREAMING: evict-first (data read once). Not VEC: element-wise, zeros past D.
template <typename T, bool VEC, bool STREAMING>
KF_DEVICE Chunk<T> load_chunk(const T* row, int c, int D) {
  constexpr int V = Chunk<T>::size;
  Chunk<T> r;
  if constexpr (VEC) {
    const int4* p = reinterpret_cast<const int4*>(row + c * V);
    const int4 v = STREAMING ? __ldcs(p) : *p;
    r.word(0) = (u32)v.x, r.word(1) = (u32)v.y, r.word(2) = (u32)v.z, r.word(3) = (u32)v.w;
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) r.word(q) = 0u;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const u32 b = c * V + i < D ? bits_of(row[c * V + i]) : 0u;
      if constexpr (V == 4)
        r.word(i) = b;
      else
        r.word(i >> 1) |= b << (16 * (i & 1));
    }
  }
  return r;
}

template <typename T, bool VEC>
KF_DEVICE void store_chunk(T* row, int c, int D, const Chunk<T>& p) {
  constexpr int V = Chunk<T>::size;
  if constexpr (VEC) {
    int4 v;
    v.x = (int)p.word(0), v.y = (int)p.word(1), v.z = (int)p.word(2), v.w = (int)p.word(3);
    *reinterpret_cast<int4*>(row + c * V) = v;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (c * V + i < D)
        row[c * V + i] = of_bits<T>(V == 4 ? p.word(i) : p.word(i >> 1) >> (16 * (i & 1)));
  }
}

// Four 16-bit X of chunk c (an fp32 chunk's width) as two packed words: one 8-byte load (VEC) or
// element-wise, zeros past D. Read once: evict-first.
template <typename X, bool VEC>
KF_DEVICE uint2 load_narrow(const X* row, int c, int D) {
  if constexpr (VEC) {
    return __ldcs(reinterpret_cast<const uint2*>(row + c * 4));
  } else {
    u32 w[2] = {0u, 0u};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (c * 4 + i < D) w[i >> 1] |= bits_of(row[c * 4 + i]) << (16 * (i & 1));
    return make_uint2(w[0], w[1]);
  }
}

// Four fp32 results stored as 16-bit Y: one 8-byte store (VEC) or element-wise.
template <typename Y, bool VEC>
KF_DEVICE void store_narrow(Y* row, int c, int D, const float (&o)[4]) {
  if constexpr (VEC) {
    *reinterpret_cast<uint2*>(row + c * 4) = make_uint2(Word<Y>::pack2(o[0], o[1]), Word<Y>::pack2(o[2], o[3]));
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (c * 4 + i < D) row[c * 4 + i] = from_float<Y>(o[i]);
  }
}

// Weight chunk (default caching: every row reads it), or ones when there is no weight.
template <typename T, bool VEC>
KF_DEVICE Chunk<T> weight_chunk(const T* weight, int c, int D) {
  return weight ? load_chunk<T, VEC, false>(weight, c, D) : Chunk<T>::words(Word<T>::kOne);
}

// opaque(chunk, zero) (common.cuh) makes the compiler forget what a chunk holds, so a row waits out
// the reduction in registers as packed words rather than as twice as many floats (and fp32 chunks do
// not spill at 128 registers either).

// Resident 256-thread blocks per SM the forward kernel is compiled for (at most 65536 / (256 * n)
// registers per thread): what its K chunks of x need without spilling, and no more. RES holds the
// residual's K chunks too until the add: registers as for 2K chunks.
constexpr int fwd_min_blocks(int K, bool vec, bool res = false) {
  return res ? (K == 1 ? 8 : K == 2 ? 5 : K == 4 ? 4 : 2)
             : K == 1 || (K == 2 && vec) ? 8 : K == 2 ? 6 : K == 4 ? 5 : 4;
}

// ---- forward ------------------------------------------------------------------------------------
// Layout: blockDim.y rows per block (one warp per row), or one row per block of blockDim.x <= 256
// threads; K chunks of x per thread in registers, all loads issued first. One reduction: shuffles,
// plus one __syncthreads for rows of several warps. Many blocks per SM (<= 64 registers per thread).
// RES: residual's chunks are loaded with x's; s = T(x + residual) replaces x (stored right away, so
// only the rounded s waits out the reduction in registers).
// Y: y's type. A 16-bit Y with fp32 T (an fp32 residual stream under autocast, whose norm output
// only a cast to the matmuls' dtype reads) stores y rounded once from the fp32 result, as eager's cast.
// X: x's type, 16-bit with fp32 T only under RES (autocast's bf16 branch added to the fp32 stream):
// s = float(x) + residual, eager's upcast and fp32 add; x's four elements per chunk wait packed.
template <typename T, int K, bool VEC, bool RES = false, typename Y = T, typename X = T>
__global__ void __launch_bounds__(256, fwd_min_blocks(K, VEC, RES))
    rmsnorm_forward_kernel(const X* __restrict__ x, const T* __restrict__ weight, Y* __restrict__ y,
                           float* __restrict__ rstd, long long rows, int D, float inv_d, float eps,
                           int zero, int cast_before_weight, const T* __restrict__ residual,
                           T* __restrict__ s) {
  kf_wait_prior_grids();
  using E = Chunk<T>;
  constexpr int V = E::size;
  __shared__ float scratch[16];  // one per warp of the block (<= 256 threads), 8 spare
  const int nchunk = (D + V - 1) / V;
  const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  constexpr bool NX = sizeof(X) < sizeof(T);  // a 16-bit x added to an fp32 residual
  static_assert(!NX || (RES && sizeof(T) == 4), "a narrower x only with an fp32 residual");
  const X* xr = x + row * D;

  Chunk<T> xc[K], rc[RES ? K : 1];
  uint2 xn[NX ? K : 1];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if constexpr (NX)
      xn[k] = live && c < nchunk ? load_narrow<X, VEC>(xr, c, D) : make_uint2(0u, 0u);
    else
      xc[k] = live && c < nchunk ? load_chunk<T, VEC, true>(reinterpret_cast<const T*>(xr), c, D)
                                 : Chunk<T>::words(0u);
    if constexpr (RES)
      rc[k] = live && c < nchunk ? load_chunk<T, VEC, true>(residual + row * D, c, D) : Chunk<T>::words(0u);
  }
  if constexpr (RES) {
    T* sr = s + row * D;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      float f[V];
      if constexpr (NX) {
        Word<X>::unpack(xn[k].x, &f[0]);
        Word<X>::unpack(xn[k].y, &f[2]);
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] += rc[k].f(i);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) f[i] = xc[k].f(i) + rc[k].f(i);
      }
      xc[k] = E::from(f);  // zeros stay zeros past the row and the tensor
      if (live && c < nchunk) store_chunk<T, VEC>(sr, c, D, xc[k]);
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) ss += xc[k].f(i) * xc[k].f(i);

  ss = warp_sum(ss);
  if (blockDim.x > 32) {  // rows of several warps: one exchange through shared memory
    const int nw = blockDim.x >> 5;
    const int first = threadIdx.y * nw;
    if ((threadIdx.x & 31) == 0) scratch[first + (threadIdx.x >> 5)] = ss;
    __syncthreads();
    ss = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w)  // nw <= 8; first + w < 16
      if (w < nw) ss += scratch[first + w];
  }
  const float r = rsqrtf(ss * inv_d + eps);
  if (!live) return;
  if (threadIdx.x == 0) rstd[row] = r;

  // The weight is loaded only now, one chunk ahead of its use (an L1 hit: every block of the SM reads
  // it), so it holds no registers through the reduction and few after it.
  Y* yr = y + row * D;
  const bool cbw = cast_before_weight && sizeof(T) < 4;
  const int tx = blockDim.x;
  Chunk<T> wnext = (int)threadIdx.x < nchunk ? weight_chunk<T, VEC>(weight, threadIdx.x, D) : Chunk<T>::words(0u);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    opaque(xc[k], zero);
    const int c = threadIdx.x + k * tx;
    const Chunk<T> wc = wnext;
    if (k + 1 < K && c + tx < nchunk) wnext = weight_chunk<T, VEC>(weight, c + tx, D);
    if (c < nchunk) {
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = xc[k].f(i) * r;
      if (cbw) {  // y = w * T(x * rstd)
#pragma unroll
        for (int i = 0; i < V; i += 2) Word<T>::round(o[i], o[i + 1]);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] *= wc.f(i);
      if constexpr (sizeof(Y) == sizeof(T))
        store_chunk<T, VEC>(yr, c, D, E::from(o));
      else
        store_narrow<Y, VEC>(yr, c, D, o);
    }
  }
}

// ---- backward -----------------------------------------------------------------------------------
// Sum of v[0..R) over the blockDim.x threads of this row group, in a fixed order (shuffle trees).
// `scratch`: one buffer of the kernel's (MAXT / 64 groups of 32 * R floats) that the group's previous
// call did not use (the caller alternates two, so one barrier per call suffices).
template <int R>
KF_DEVICE void group_sum(float (&v)[R], float* scratch) {
#pragma unroll
  for (int j = 0; j < R; ++j) v[j] = warp_sum(v[j]);
  if (blockDim.x == 32) return;  // one warp per row: no shared memory, no barrier
  float* s = scratch + threadIdx.y * (32 * R);  // groups of several warps: <= MAXT / 64 of them
  const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  if (lane == 0)
#pragma unroll
    for (int j = 0; j < R; ++j) s[j * 32 + (threadIdx.x >> 5)] = v[j];
  named_barrier(1 + (int)threadIdx.y, (int)blockDim.x);  // the row group's threads
#pragma unroll
  for (int j = 0; j < R; ++j) v[j] = lane < nw ? s[j * 32 + lane] : 0.0f;
#pragma unroll
  for (int j = 0; j < R; ++j) v[j] = warp_sum(v[j]);
}

// dx of one chunk (RES: plus dres's chunk dc before the one rounding), and its dweight terms
// dy * x_hat added to acc (CBW: x_hat rounded to T first, as the forward used it).
template <typename T, bool VEC, bool CBW, bool RES, int NZ>
KF_DEVICE void backward_chunk(T* dxr, typename CopyOf<NZ>::type* zr, int c, int D, const Chunk<T>& xc,
                              const Chunk<T>& gc, const Chunk<T>& wc, const Chunk<T>& dc, float r,
                              float mean_gx, float (&acc)[Chunk<T>::size]) {
  using E = Chunk<T>;
  constexpr int V = E::size;
  float o[V], xh[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    xh[i] = xc.f(i) * r;
    o[i] = r * (gc.f(i) * wc.f(i) - xh[i] * mean_gx);
    if (RES) o[i] += dc.f(i);
  }
  store_chunk<T, VEC>(dxr, c, D, E::from(o));
  if constexpr (NZ != 0) store_narrow<typename CopyOf<NZ>::type, VEC>(zr, c, D, o);
  if (CBW)
#pragma unroll
    for (int i = 0; i < V; i += 2) Word<T>::round(xh[i], xh[i + 1]);
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] += gc.f(i) * xh[i];
}

// CBW: cast_before_weight (16-bit T; the launcher instantiates fp32 with false only).
// Layout: persistent grid of one block (<= MAXT threads) per SM. The block is blockDim.y row groups
// of blockDim.x threads; a group works on R rows at a time (base .. base + R - 1, then R rows further
// by the grid-wide stride), each thread holding K chunks of x and dy of each, all loads issued before
// the reduction. Groups synchronise only among themselves (named_barrier 1 + threadIdx.y), so one group's loads
// overlap another's reduction and stores. A thread owns the same columns in every row it visits: it
// keeps their weight chunks and their dweight sums in registers. At the end the block adds its
// groups' sums in order of the group through `fold` (blockDim.y * blockDim.x * V floats of dynamic
// shared memory) into dw_partial row blockIdx.x (fp32, D wide).
// RES: each dres chunk is loaded where its dx is computed (after the reduction): no registers held
// through the row's loads (this kernel takes odd sizes and long rows, not the common case).
template <typename T, int K, int R, bool VEC, bool CBW, int MAXT, bool RES = false, int NZ = 0>
__global__ void __launch_bounds__(MAXT, 1)
    rmsnorm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                            const T* __restrict__ weight, const float* __restrict__ rstd,
                            T* __restrict__ dx, float* __restrict__ dw_partial, long long rows, int D,
                            float inv_d, int zero, const T* __restrict__ dres, void* __restrict__ dz) {
  kf_wait_prior_grids();
  using E = Chunk<T>;
  using Z = typename CopyOf<NZ>::type;
  constexpr int V = E::size;
  static_assert(NZ == 0 || sizeof(T) == 4, "a 16-bit copy of an fp32 dx only");
  __shared__ float scratch[2][MAXT / 64 * 32 * R];  // [buffer][group][value][warp]
  extern __shared__ float fold[];
  const int nchunk = (D + V - 1) / V;

  Chunk<T> wc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    wc[k] = c < nchunk ? weight_chunk<T, VEC>(weight, c, D) : Chunk<T>::words(0u);
  }
  float acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) acc[k][i] = 0.0f;

  // The loop bound is the same for the whole block: every group passes the same number of group
  // barriers (group_sum), even a group whose last rows lie past the end. Not needed for correctness
  // (the barriers are per group), but racecheck's accounting of named barriers reports the fold below
  // as a hazard when groups pass unequal numbers of them.
  const long long step = (long long)gridDim.x * blockDim.y * R;
  int buf = 0;
  for (long long first = (long long)blockIdx.x * blockDim.y * R; first < rows; first += step) {
    const long long base = first + (long long)threadIdx.y * R;
    Chunk<T> xc[R][K], gc[R][K];
    float r[R], dot[R];
#pragma unroll
    for (int k = 0; k < K; ++k) opaque(wc[k], zero);
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const long long row = base + j;
      const bool live = row < rows;
      r[j] = live ? rstd[row] : 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int c = threadIdx.x + k * blockDim.x;
        const bool ok = live && c < nchunk;
        xc[j][k] = ok ? load_chunk<T, VEC, true>(x + row * D, c, D) : Chunk<T>::words(0u);
        gc[j][k] = ok ? load_chunk<T, VEC, true>(dy + row * D, c, D) : Chunk<T>::words(0u);
      }
    }
    // dot = sum(dy * w * x); mean(g * x_hat) = dot * rstd / D.
#pragma unroll
    for (int j = 0; j < R; ++j) {
      dot[j] = 0.0f;
#pragma unroll
      for (int k = 0; k < K; ++k)
#pragma unroll
        for (int i = 0; i < V; ++i)
          dot[j] += gc[j][k].f(i) * wc[k].f(i) * xc[j][k].f(i);
    }
    group_sum<R>(dot, scratch[buf]);
    buf ^= 1;

#pragma unroll
    for (int j = 0; j < R; ++j) {
      const long long row = base + j;
      if (row < rows) {
        const float mean_gx = dot[j] * r[j] * inv_d;
        T* dxr = dx + row * D;
        Z* zr = NZ != 0 ? static_cast<Z*>(dz) + row * D : nullptr;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          opaque(xc[j][k], zero);
          opaque(gc[j][k], zero);
          opaque(wc[k], zero);
          const int c = threadIdx.x + k * blockDim.x;
          if (c < nchunk) {
            const Chunk<T> dc = RES ? load_chunk<T, VEC, true>(dres + row * D, c, D) : Chunk<T>::words(0u);
            backward_chunk<T, VEC, CBW, RES, NZ>(dxr, zr, c, D, xc[j][k], gc[j][k], wc[k], dc, r[j],
                                                 mean_gx, acc[k]);
          }
        }
      }
    }
  }

  if (dw_partial == nullptr) return;  // no weight: nothing to reduce (uniform over the block)
  // Fold, one k at a time: every group writes its sums, then the block adds them column by column in
  // order of the group.
  float* part = dw_partial + (long long)blockIdx.x * D;
  const int span = blockDim.x * V;  // floats per group and k
  const int t = threadIdx.y * blockDim.x + threadIdx.x;
  const int nt = blockDim.x * blockDim.y;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    __syncthreads();  // the previous k's reads are done
#pragma unroll
    for (int i = 0; i < V; ++i) fold[threadIdx.y * span + threadIdx.x * V + i] = acc[k][i];
    __syncthreads();
    for (int e = t; e < span; e += nt) {
      const int col = k * span + e;
      if (col < D) {
        float s = 0.0f;
        for (int g = 0; g < (int)blockDim.y; ++g) s += fold[g * span + e];
        part[col] = s;
      }
    }
  }
}

// ---- backward, pipelined (where the ring's stages do not fit in shared memory) --------------------
// Same layout and dweight scheme as rmsnorm_backward_kernel (persistent grid of one block per SM,
// blockDim.y row groups of blockDim.x threads, thread x owns chunks x, x + blockDim.x, ... (K of
// them) in every row, the weight and the dweight sums of its columns in registers, fold at the end),
// but one row at a time with the loads of the next P rows always in flight: group y of block b takes
// rows first = b * blockDim.y + y, first + stride, ... (stride = gridDim.x * blockDim.y); each thread
// keeps P rows' x, dy (packed, K chunks each) and rstd in registers, buffer p = row number mod P, and
// refills a buffer with the row P further on as soon as it is done with it. While a thread waits for
// a row, the P - 1 rows after it are in flight too (the previous kernel had a group's R rows in
// flight, then nothing while it computed them).
// A row, per element: g = dy * w, dot += g * x and the dweight sums += dy * x_hat (x_hat = x * r;
// CBW: rounded to T, as the forward used it); the reduction of dot; then
// dx = r * (g - x_hat * mean(g * x_hat)) = r * (g + a * x) with a = -r^2 * dot / D: one FMA and one
// multiply. The weight is kept as fp32.
// KEEP_G (16-bit types): g stays in registers (fp32, K * V of them) through the reduction and dy's
// buffer is refilled before it; x's after dx. Otherwise (fp32, whose unpacking is free) both are
// refilled after dx and g is recomputed from dy (fewer registers, so room for more rows in flight).
// x (and dy) are unpacked a second time for dx so that a row waits out the reduction packed (4
// registers a chunk): for bf16 that second unpacking uses masks passed as kernel arguments (`lo_mul`
// = 1 << 16, `hi_mask` = 0xffff0000, read as constant-bank operands), so the compiler cannot merge
// it with the first and keep the floats alive instead; fp16 uses opaque() (`zero` = 0).
// Where the loads go: ptxas moves loads up, above the last reads of the buffer they refill; the
// loaded value then lands in other registers and the move into the buffer's registers at the loop's
// end waits for the load. So each refill's address depends (+ 0) on a value computed from every read
// of the buffer (dot for dy's, the last dx value for x's); and on leaving the loop the buffers are
// used (+ 0), or the loads would be moved below the loop's exit test, behind the next row's wait.
// Only 16-byte accesses (VEC; the launcher sends other cases to rmsnorm_backward_kernel). Addressing:
// per-thread byte pointers advanced by a 32-bit step per row (stride * D * sizeof(T) < 2^32, checked
// by the launcher); past the group's last row the prefetch pointers stay on it (the tail re-reads
// that row, unused), so every load is unconditional. Chunks past the end of the row (x + k * tx >=
// nchunk) load the thread's chunk 0 instead (the row's last chunk for threads x >= nchunk) and get
// weight 0: they add nothing to dot, their dx is not stored and their dweight sums are not written.
// Reduction of a row: shuffles; for rows of several warps, lane 0 of each warp writes its sum to the
// group's 16 slots (zeros past the last warp), one group barrier, then every lane reads slot
// lane % 16 and four more shuffles (the same sums in the same order in every lane). Two sets of slots,
// used by alternate rows.
// RES: the row's dres chunks are loaded as the row starts (in flight through its reduction, held
// packed) and added to dx before its one rounding.
KF_DEVICE const char* plus(const char* p, u64 bytes) {
  return reinterpret_cast<const char*>(reinterpret_cast<u64>(p) + bytes);
}

template <typename T>
KF_DEVICE float reget(const Chunk<T>& c, int i, u32 lo_mul, u32 hi_mask) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(c.word(i));
  } else if constexpr (Word<T>::kOne == Word<bf16>::kOne) {
    const u32 w = c.word(i >> 1);
    return __uint_as_float(i & 1 ? w & hi_mask : w * lo_mul);
  } else {
    return c.f(i);  // the chunk went through opaque() first
  }
}

// One row's per-element backward terms, shared by the pipelined and ring kernels: g = dy * w,
// dot += g * x, dweight sums acc += dy * x_hat with x_hat = x * r (CBW: rounded to T first, as the
// forward used it for the weight); a pair of elements at a time (CBW rounds pairs).
template <typename T, int K, bool CBW>
KF_DEVICE void rn_row_terms(const Chunk<T> (&xc)[K], const Chunk<T> (&gc)[K],
                            const float (&w)[K][Chunk<T>::size], float r, float (&g)[K][Chunk<T>::size],
                            float& dot, float (&acc)[K][Chunk<T>::size]) {
  using E = Chunk<T>;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < E::size; i += 2) {
      float d[2], xr[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float xv = xc[k].f(i + j);
        d[j] = gc[k].f(i + j);
        g[k][i + j] = d[j] * w[k][i + j];
        dot = fmaf(g[k][i + j], xv, dot);
        xr[j] = xv * r;
      }
      if (CBW) Word<T>::round(xr[0], xr[1]);
#pragma unroll
      for (int j = 0; j < 2; ++j) acc[k][i + j] = fmaf(d[j], xr[j], acc[k][i + j]);
    }
}

template <typename T, int K, int P, bool KEEP_G, bool CBW, int MAXT, bool RES = false, int NZ = 0>
__global__ void __launch_bounds__(MAXT, 1)
    rmsnorm_backward_pipelined_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                      const T* __restrict__ weight, const float* __restrict__ rstd,
                                      T* __restrict__ dx, float* __restrict__ dw_partial,
                                      long long rows, int D, float inv_d, u32 lo_mul, u32 hi_mask,
                                      int zero, const T* __restrict__ dres, void* __restrict__ dz) {
  kf_wait_prior_grids();
  using E = Chunk<T>;
  using Z = typename CopyOf<NZ>::type;
  static_assert(NZ == 0 || sizeof(T) == 4, "a 16-bit copy of an fp32 dx only");
  // NZ: element e of dx is at dx + 4e bytes and of the copy at dz + 2e, so the copy's address is
  // zbase + (dx's address >> 1) (dx is 16-byte aligned): one shift and one add per chunk.
  const u64 zbase = reinterpret_cast<u64>(dz) - (reinterpret_cast<u64>(dx) >> 1);
  constexpr int V = E::size;
  constexpr bool kHalf = sizeof(T) == 2 && Word<T>::kOne != Word<bf16>::kOne;
  static_assert(MAXT <= 512, "16 warps per row at most");
  __shared__ float scratch[2][MAXT / 32 * 16];  // [set][group * 16 + warp]; groups <= MAXT / 32
  extern __shared__ float fold[];
  const int tx = blockDim.x;
  const int nchunk = D / V;  // D % V == 0 (VEC)
  const int nw = tx >> 5;
  const int lane = threadIdx.x & 31;
  const u32 kbytes = (u32)tx * 16u;  // from one chunk of a thread to its next

  bool ok[K];
  u32 koff[K];  // byte offset of chunk k from chunk 0
#pragma unroll
  for (int k = 0; k < K; ++k) {
    ok[k] = (int)threadIdx.x + k * tx < nchunk;
    koff[k] = ok[k] ? (u32)k * kbytes : 0u;
  }
  float w[K][V], acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const Chunk<T> wc = !ok[k] ? Chunk<T>::words(0u)
                     : weight ? load_chunk<T, true, false>(weight + threadIdx.x * V, k * tx, D)
                              : Chunk<T>::words(Word<T>::kOne);
#pragma unroll
    for (int i = 0; i < V; ++i) w[k][i] = wc.f(i), acc[k][i] = 0.0f;
  }
  // Shared-memory byte addresses: this warp's slot (sw) and this lane's read slot (sl) in the set
  // of the next row; sflip switches both to the other set.
  const u32 s0 = (u32)__cvta_generic_to_shared(&scratch[0][threadIdx.y * 16]);
  const u32 sflip = s0 ^ (u32)__cvta_generic_to_shared(&scratch[1][threadIdx.y * 16]);
  u32 sw = s0 + (threadIdx.x >> 5) * 4, sl = s0 + (lane & 15) * 4;
  if ((int)threadIdx.x >= nw && threadIdx.x < 16) {  // padding, never written again
    scratch[0][threadIdx.y * 16 + threadIdx.x] = 0.0f;
    scratch[1][threadIdx.y * 16 + threadIdx.x] = 0.0f;
  }

  const long long first = (long long)blockIdx.x * blockDim.y + threadIdx.y;
  const long long stride = (long long)gridDim.x * blockDim.y;
  const int n = first < rows ? (int)((rows - 1 - first) / stride) + 1 : 0;  // rows of this group
  if (n == 0) goto done;  // uniform over the group
  {
    const u32 step = (u32)(stride * D) * (u32)sizeof(T);
    const u32 rstep = (u32)stride * 4u;
    // Column of chunk 0: a thread past the end of the row (K = 1, nchunk < 32) reads the row's last
    // chunk instead (never stored, weight 0).
    const int c0 = min((int)threadIdx.x, nchunk - 1);
    const long long off = first * D + c0 * V;
    const char* nx = reinterpret_cast<const char*>(x + off);  // the row to load next
    // Not KEEP_G: dy's addresses are x's plus gdelta (uniform: one pointer register fewer).
    const u64 gdelta = reinterpret_cast<u64>(dy) - reinterpret_cast<u64>(x);
    const char* ng = reinterpret_cast<const char*>(dy + off);  // KEEP_G: dy runs ahead of x
    const char* nr = reinterpret_cast<const char*>(rstd + first);
    char* cd = reinterpret_cast<char*>(dx + off);  // current row's dx
    const u64 rdelta = reinterpret_cast<u64>(dres) - reinterpret_cast<u64>(dx);  // RES: dres - dx

    Chunk<T> bx[P][K], bg[P][K];
    float br[P];
#pragma unroll
    for (int p = 0; p < P; ++p) {
      if (p > 0) {
        const u32 inc = p < n ? step : 0u;
        nx += inc, nr += p < n ? rstep : 0u;
        if (KEEP_G) ng += inc;
      }
      br[p] = *reinterpret_cast<const float*>(nr);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        bx[p][k] = load_chunk<T, true, true>(reinterpret_cast<const T*>(nx + koff[k]), 0, D);
        bg[p][k] = load_chunk<T, true, true>(
            reinterpret_cast<const T*>(KEEP_G ? ng + koff[k] : plus(nx, gdelta + koff[k])), 0, D);
      }
    }

    for (int t = 0;;) {
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const float r = br[p];
        const u32 inc = t + P < n ? step : 0u;  // to row t + P, or stay on the group's last row
        Chunk<T> dc[RES ? K : 1];
        if constexpr (RES)
#pragma unroll
          for (int k = 0; k < K; ++k)
            dc[k] = load_chunk<T, true, true>(reinterpret_cast<const T*>(plus(cd, rdelta + koff[k])),
                                              0, D);
        float g[K][V], dot = 0.0f;
        rn_row_terms<T, K, CBW>(bx[p], bg[p], w, r, g, dot, acc);
        if (KEEP_G) {  // dy's buffer is free: refill it with row t + P
          // + 0 that depends on dot: see "Where the loads go" above.
          ng += inc + (__float_as_uint(dot) & (u32)zero);
#pragma unroll
          for (int k = 0; k < K; ++k)
            bg[p][k] = load_chunk<T, true, true>(reinterpret_cast<const T*>(ng + koff[k]), 0, D);
        }
        dot = warp_sum(dot);
        if (nw > 1) {  // rows of several warps: partial sums through shared memory, one barrier
          if (lane == 0) asm volatile("st.shared.f32 [%0], %1;" ::"r"(sw), "f"(dot));
          named_barrier(1 + (int)threadIdx.y, (int)blockDim.x);  // the row group's threads
          asm volatile("ld.shared.f32 %0, [%1];" : "=f"(dot) : "r"(sl));
#pragma unroll
          for (int o = 8; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
          sw ^= sflip, sl ^= sflip;
        }
        const float a = -(dot * inv_d) * r * r;
        u32 last = 0u;  // bits of each chunk's last dx value: see "Where the loads go" above
#pragma unroll
        for (int k = 0; k < K; ++k) {
          if (kHalf) {
            opaque(bx[p][k], zero);
            if (!KEEP_G) opaque(bg[p][k], zero);
          }
          if constexpr (RES) opaque(dc[k], zero);
          float o[V];
#pragma unroll
          for (int i = 0; i < V; ++i) {
            const float gi = KEEP_G ? g[k][i] : reget<T>(bg[p][k], i, lo_mul, hi_mask) * w[k][i];
            o[i] = r * fmaf(a, reget<T>(bx[p][k], i, lo_mul, hi_mask), gi);
            if constexpr (RES) o[i] += dc[k].f(i);
          }
          if (ok[k]) store_chunk<T, true>(reinterpret_cast<T*>(cd + koff[k]), 0, D, E::from(o));
          if constexpr (NZ != 0)  // the copy's address from dx's (zbase: see above)
            if (ok[k])
              store_narrow<Z, true>(reinterpret_cast<Z*>(zbase + (reinterpret_cast<u64>(cd + koff[k]) >> 1)), 0,
                                    D, o);
          last |= __float_as_uint(o[V - 1]);
        }
        cd += step;
        // Refill x's buffer (and dy's) and rstd's with row t + P.
        const u32 dep = last & (u32)zero;
        nx += inc + dep, nr += (inc ? rstep : 0u) + dep;
        br[p] = *reinterpret_cast<const float*>(nr);
#pragma unroll
        for (int k = 0; k < K; ++k) {
          bx[p][k] = load_chunk<T, true, true>(reinterpret_cast<const T*>(nx + koff[k]), 0, D);
          if (!KEEP_G)
            bg[p][k] = load_chunk<T, true, true>(
                reinterpret_cast<const T*>(plus(nx, gdelta + koff[k])), 0, D);
        }
        if (++t >= n) {
          // Leaving: the buffers are used (+ 0), see "Where the loads go" above.
          u32 sink = 0u;
#pragma unroll
          for (int q = 0; q < P; ++q) {
            sink |= __float_as_uint(br[q]);
#pragma unroll
            for (int k = 0; k < K; ++k) sink |= bx[q][k].word(0) | bg[q][k].word(0);
          }
          acc[0][0] = __uint_as_float(__float_as_uint(acc[0][0]) | (sink & (u32)zero));
          goto done;
        }
      }
    }
  }
done:
  if (dw_partial == nullptr) return;  // no weight: nothing to reduce (uniform over the block)
  float* part = dw_partial + (long long)blockIdx.x * D;
  const int span = tx * V;  // floats per group and k
  const int t = threadIdx.y * tx + threadIdx.x;
  const int nt = tx * blockDim.y;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    __syncthreads();  // the previous k's reads are done
#pragma unroll
    for (int i = 0; i < V; ++i) fold[threadIdx.y * span + threadIdx.x * V + i] = acc[k][i];
    __syncthreads();
    for (int e = t; e < span; e += nt) {
      const int cidx = k * span + e;
      if (cidx < D) {
        float sum = 0.0f;
        for (int gi = 0; gi < (int)blockDim.y; ++gi) sum += fold[gi * span + e];
        part[cidx] = sum;
      }
    }
  }
}

// ---- backward, shared-memory ring (the default for 16-byte rows of <= 1024 chunks) ---------------
// Layout: persistent grid of one block per SM (at most the row groups); a block is blockDim.y
// row groups of blockDim.x threads and takes blockDim.y rows at a time (a row group of the tensor):
// row groups blockIdx.x, + gridDim.x, ... Thread x owns chunks x, x + blockDim.x, ... (K of them) of
// its group's row, in every row it visits: it keeps their weight (fp32) and dweight sums in registers.
// blockDim.x is a multiple of 32 (<= 512) or a power of two below 32 (several rows per warp).
// Rows are staged in shared memory by cp.async (16 bytes per chunk, .cg), in a ring of S stages per
// block (a stage: the block's rows of x and dy, plus rstd); the first S row groups are requested up
// front, and as soon as a thread has read its chunks of a stage into registers (and used them all in
// dot), it requests the row group S further on into that stage. Each thread copies exactly the
// chunks it later reads itself (rstd: the first thread of each warp-segment of a group copies it and
// hands it on by a shuffle), so cp.async.wait_group S - 1 alone orders the ring: no barrier guards
// it. A group is committed every row group, empty when nothing is left to request, so the count
// holds. Rows past the end of the tensor (the last row group) are zero-filled by the thread itself
// (st.shared) with rstd 0; chunks past the end of the row (x + k * blockDim.x >= D / V) are zeros,
// written once, never copied, with weight 0. So every read is unconditional and adds nothing where
// there is no data; dx is stored only for real rows and chunks.
// Per element the same arithmetic (and rounding) as the pipelined kernel: g = dy * w, dot += g * x,
// dweight sums += dy * x_hat (CBW: x_hat rounded to T first); one reduction of dot per row (shuffles;
// groups of several warps: lane 0 of each warp writes its sum to the group's 16 slots, zeros past the
// last warp, one __syncthreads, every lane reads slot lane % 16 and four more shuffles; two sets of
// slots used by alternate rows); dx = r * (g + a * x), a = -r^2 * dot / D.
// At the end the block writes its dweight sums as row blockIdx.x of dw_partial (fp32, D wide):
// directly when blockDim.y == 1, else added over the groups in order of the group through the ring's
// shared memory.
// Only 16-byte accesses (D % V == 0, pointers 16-byte aligned; the launcher checks). Dynamic shared
// memory: S * (A * blockDim.y * blockDim.x * K + nseg * 4) bytes, A = 32 bytes a chunk slot (x and dy;
// NY: 16 + 8 * NY) plus 16 with RES, nseg =
// blockDim.y * blockDim.x / 32 (blockDim.x >= 32) or blockDim.y (smaller groups).
// RES: a stage also holds the rows of dres, copied and zero-filled as x's and dy's; they are read with
// them and folded into h = r * g + dres before the stage is requested again (g's registers, none
// more), so dx = r * a * x + h, rounded once.
// NY (2 or 3, fp32 T only): dy is the sum of NY 16-bit tensors (CopyOf<YT>: 1 bf16, 2 fp16), dy,
// dy1 (and dy2), each upcast and added in fp32 in that order, ((dy + dy1) + dy2), the values of
// eager's upcasts and adds (autocast: a norm's output read by two or three 16-bit matmuls, whose
// input gradients autograd sums in fp32). A stage holds each term's rows at 8 bytes a chunk (copied
// by 8-byte cp.async) in dy's place; the terms are summed as they are read from the stage, so the
// rest of the kernel sees an fp32 dy. Stage bytes per chunk slot: 16 (x) + 8 * NY + 16 (RES).
template <typename T, int K, int S, bool CBW, int NT, bool RES = false, int NZ = 0, int NY = 0, int YT = 1>
__global__ void __launch_bounds__(NT, 1)
    rmsnorm_backward_ring_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                 const T* __restrict__ weight, const float* __restrict__ rstd,
                                 T* __restrict__ dx, float* __restrict__ dw_partial, long long rows,
                                 int D, float inv_d, int zero, const T* __restrict__ dres,
                                 void* __restrict__ dz, const void* __restrict__ dy1,
                                 const void* __restrict__ dy2) {
  kf_wait_prior_grids();
  using E = Chunk<T>;
  using Z = typename CopyOf<NZ>::type;
  using Y = typename CopyOf<YT>::type;
  static_assert(NZ == 0 || sizeof(T) == 4, "a 16-bit copy of an fp32 dx only");
  static_assert(NY == 0 || (sizeof(T) == 4 && (NY == 2 || NY == 3)), "2 or 3 16-bit dy terms of an fp32 x");
  const u64 zbase = reinterpret_cast<u64>(dz) - (reinterpret_cast<u64>(dx) >> 1);
  constexpr int V = E::size;
  static_assert(NT <= 512 && NT % 64 == 0, "groups of <= 16 warps");
  __shared__ float red[2][NT / 4];  // [set][group * 16 + warp]: groups of >= 64 threads, <= NT / 64
  extern __shared__ uint4 ring[];
  const int tx = blockDim.x, G = blockDim.y;
  const int tid = threadIdx.y * tx + threadIdx.x;
  const int lane = tid & 31;
  const int nchunk = D / V;
  const int rowpad = tx * K;  // chunks of a row in a stage
  const u32 kstep = (u32)tx * 16u;  // bytes from one chunk of a thread to its next (row and stage)
  const u32 slots = (u32)(G * rowpad);  // chunk slots of an array in a stage
  constexpr u32 kDyBytes = NY ? 8u * NY : 16u;  // dy's bytes per chunk slot
  const u32 stage_bytes = (16u + kDyBytes + (RES ? 16u : 0u)) * slots;
  const u32 dyoff = slots * 16u;  // dy's rows follow x's in a stage (NY: term by term), then dres's
  const u32 resoff = dyoff + slots * kDyBytes;
  const u32 my = smem_u32(ring) + (u32)(threadIdx.y * rowpad + threadIdx.x) * 16u;
  // NY: term 0's slot of this thread's chunk 0 in stage 0; term j's is slots * 8 * j further, and a
  // term's next chunk kstep8 further (in shared and in global memory).
  const u32 my8 = smem_u32(ring) + dyoff + (u32)(threadIdx.y * rowpad + threadIdx.x) * 8u;
  const u32 kstep8 = (u32)tx * 8u;
  const int nseg = tx >= 32 ? (tx * G) >> 5 : G;  // rstd slots per stage
  const u32 rslot =
      smem_u32(ring) + (u32)S * stage_bytes + (u32)(tx >= 32 ? tid >> 5 : (int)threadIdx.y) * 4u;
  const u32 rstage = (u32)nseg * 4u;
  const bool leader = (threadIdx.x & 31) == 0;  // copies and reads rstd for its warp-segment
  const int src = lane - (int)(threadIdx.x & 31);

  bool ok[K];
  float w[K][V], acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * tx;
    ok[k] = c < nchunk;
    const Chunk<T> wc = !ok[k]  ? Chunk<T>::words(0u)
                     : weight ? load_chunk<T, true, false>(weight, c, D)
                              : E::words(Word<T>::kOne);
#pragma unroll
    for (int i = 0; i < V; ++i) w[k][i] = wc.f(i), acc[k][i] = 0.0f;
    if (!ok[k])  // never copied: zeros in every stage
      for (int s = 0; s < S; ++s) {
        sts16_zero(my + (u32)s * stage_bytes + (u32)k * kstep);
        if (NY == 0) sts16_zero(my + (u32)s * stage_bytes + dyoff + (u32)k * kstep);
#pragma unroll
        for (int j = 0; j < NY; ++j) sts8_zero(my8 + (u32)s * stage_bytes + (u32)j * slots * 8u + (u32)k * kstep8);
        if (RES) sts16_zero(my + (u32)s * stage_bytes + resoff + (u32)k * kstep);
      }
  }
  const int nw = tx >> 5;
  if (tx > 32 && (int)threadIdx.x >= nw && threadIdx.x < 16) {  // padding slots, never written again
    red[0][threadIdx.y * 16 + threadIdx.x] = 0.0f;
    red[1][threadIdx.y * 16 + threadIdx.x] = 0.0f;
  }

  // Row groups of the block (n, the same for all its threads: the launcher's grid is <= the number
  // of row groups) and the rows of this thread's group (nv <= n: the tensor's last row group may be
  // partial). Addressing: byte pointers advanced by a 32-bit step per row group (the launcher checks
  // that gridDim.x * G * D * sizeof(T) < 2^32).
  const long long row0 = (long long)blockIdx.x * G + threadIdx.y;
  const long long rstep = (long long)gridDim.x * G;
  const long long ngroups = (rows + G - 1) / G;
  const int n = (int)((ngroups - 1 - blockIdx.x) / gridDim.x) + 1;
  const int nv = row0 < rows ? (int)((rows - 1 - row0) / rstep) + 1 : 0;
  const u32 step = (u32)(rstep * D) * (u32)sizeof(T);
  const u32 rbytes = (u32)rstep * 4u;
  const long long off = row0 * D + threadIdx.x * V;
  const char* lx = reinterpret_cast<const char*>(x + off);  // the row to request next
  const char* lr = reinterpret_cast<const char*>(rstd + row0);
  const u64 gdelta = reinterpret_cast<u64>(dy) - reinterpret_cast<u64>(x);
  const u64 rdelta = reinterpret_cast<u64>(dres) - reinterpret_cast<u64>(x);  // RES
  // NY: term j's address for x's address p is ydelta[j] + p / 2 (2 bytes an element against 4; x is
  // 16-byte aligned, so p / 2 is exact).
  const u64 xhalf = reinterpret_cast<u64>(x) >> 1;
  const u64 ydelta[3] = {reinterpret_cast<u64>(dy) - xhalf, reinterpret_cast<u64>(dy1) - xhalf,
                         reinterpret_cast<u64>(dy2) - xhalf};
  char* cdx = reinterpret_cast<char*>(dx + off);  // the row being computed

  // Requests row group t into stage s (zeros past the end of the tensor). `dep`: 0, computed from what
  // the thread last read of the stage, so the copies wait for those reads.
  auto request = [&](int t, int s, u32 dep) {
    const u32 sa = my + (u32)s * stage_bytes + dep;
    const u32 ya = my8 + (u32)s * stage_bytes + dep;
    const u32 ra = rslot + (u32)s * rstage + dep;
    if (t < nv) {
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (ok[k]) {
          cp_async16(sa + (u32)k * kstep, lx + k * kstep);
          if (NY == 0) cp_async16(sa + dyoff + (u32)k * kstep, plus(lx, gdelta + k * kstep));
#pragma unroll
          for (int j = 0; j < NY; ++j)
            cp_async8(ya + (u32)j * slots * 8u + (u32)k * kstep8,
                      reinterpret_cast<const char*>(ydelta[j] + (reinterpret_cast<u64>(lx) >> 1) + k * kstep8));
          if (RES) cp_async16(sa + resoff + (u32)k * kstep, plus(lx, rdelta + k * kstep));
        }
      if (leader) cp_async4(ra, lr);
    } else {
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (ok[k]) {
          sts16_zero(sa + (u32)k * kstep);
          if (NY == 0) sts16_zero(sa + dyoff + (u32)k * kstep);
#pragma unroll
          for (int j = 0; j < NY; ++j) sts8_zero(ya + (u32)j * slots * 8u + (u32)k * kstep8);
          if (RES) sts16_zero(sa + resoff + (u32)k * kstep);
        }
      if (leader) sts_f32(ra, 0.0f);
    }
    lx += step;
    lr += rbytes;
  };

#pragma unroll
  for (int s = 0; s < S; ++s) {
    if (s < n) request(s, s, 0u);
    cp_async_commit();  // always: wait_group counts groups
  }

  int s = 0;  // the stage of row group t
  u32 set = 0u;  // reduction slot set
#pragma unroll 1
  for (int t = 0; t < n; ++t) {
    cp_async_wait<S - 1>();  // row group t has landed (this thread's part of it)
    const u32 sa = my + (u32)s * stage_bytes;
    Chunk<T> xc[K], gc[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      xc[k] = lds16<T>(sa + (u32)k * kstep);
      if constexpr (NY == 0) {
        gc[k] = lds16<T>(sa + dyoff + (u32)k * kstep);
      } else {  // dy = ((term 0 + term 1) + term 2), each upcast: eager's sum of the gradients
        const u32 ya = my8 + (u32)s * stage_bytes + (u32)k * kstep8;
        float f[V];
#pragma unroll
        for (int j = 0; j < NY; ++j) {
          u32 w0, w1;
          lds8(ya + (u32)j * slots * 8u, w0, w1);
          float v[4];
          Word<Y>::widen(w0, v[0], v[1]);
          Word<Y>::widen(w1, v[2], v[3]);
#pragma unroll
          for (int i = 0; i < V; ++i) f[i] = j == 0 ? v[i] : f[i] + v[i];
        }
        gc[k] = E::from(f);
      }
    }
    float r = leader ? lds_f32(rslot + (u32)s * rstage) : 0.0f;
    r = __shfl_sync(0xffffffffu, r, src);

    float g[K][V], dot = 0.0f;
    rn_row_terms<T, K, CBW>(xc, gc, w, r, g, dot, acc);
    u32 dep = __float_as_uint(dot);
    if constexpr (RES) {
      Chunk<T> dc[K];
#pragma unroll
      for (int k = 0; k < K; ++k) dc[k] = lds16<T>(sa + resoff + (u32)k * kstep);
#pragma unroll
      for (int k = 0; k < K; ++k) {
#pragma unroll
        for (int i = 0; i < V; ++i) g[k][i] = fmaf(r, g[k][i], dc[k].f(i));  // h
        dep |= dc[k].word(0);
      }
    }
    // Stage s is read (dep depends on every word of it): request row group t + S into it.
    if (t + S < n) request(t + S, s, dep & (u32)zero);
    cp_async_commit();

    if (tx <= 32) {  // one warp or less per row: shuffles within the group
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
        if (o < tx) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    } else {
      dot = warp_sum(dot);
      float* slots = &red[0][0] + set + threadIdx.y * 16;
      if (lane == 0) slots[threadIdx.x >> 5] = dot;
      __syncthreads();
      dot = slots[lane & 15];
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
      set ^= NT / 4;
    }
    const float a = -(dot * inv_d) * r * r;
    if (t < nv) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        float o[V];
#pragma unroll
        for (int i = 0; i < V; ++i)
          o[i] = RES ? fmaf(r * a, xc[k].f(i), g[k][i]) : r * fmaf(a, xc[k].f(i), g[k][i]);
        if (ok[k]) store_chunk<T, true>(reinterpret_cast<T*>(cdx + k * kstep), 0, D, E::from(o));
        if constexpr (NZ != 0)  // the copy's address from dx's (zbase: see the pipelined kernel)
          if (ok[k])
            store_narrow<Z, true>(reinterpret_cast<Z*>(zbase + (reinterpret_cast<u64>(cdx + k * kstep) >> 1)),
                                  0, D, o);
      }
    }
    cdx += step;
    s = s + 1 == S ? 0 : s + 1;
  }

  if (dw_partial == nullptr) return;  // no weight: nothing to reduce (uniform over the block)
  float* part = dw_partial + (long long)blockIdx.x * D;
  if (G == 1) {
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (ok[k]) {
        float* p = part + (threadIdx.x + k * tx) * V;
#pragma unroll
        for (int i = 0; i < V; i += 4)
          *reinterpret_cast<float4*>(p + i) =
              make_float4(acc[k][i], acc[k][i + 1], acc[k][i + 2], acc[k][i + 3]);
      }
  } else {
    // Several groups: add their sums column by column in order of the group, through the ring
    // (every copy has landed: the groups left are empty).
    cp_async_wait<0>();
    __syncthreads();  // every thread is done reading the ring
    // 16 bytes at a time both ways (D % 4 == 0): the last block's epilogue is on the call's critical
    // path.
    float4* fold = reinterpret_cast<float4*>(ring);
    const int span4 = rowpad * V / 4;  // float4s per group (>= D / 4)
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int i = 0; i < V; i += 4)
        fold[threadIdx.y * span4 + ((threadIdx.x + k * tx) * V + i) / 4] =
            make_float4(acc[k][i], acc[k][i + 1], acc[k][i + 2], acc[k][i + 3]);
    __syncthreads();
    float4* part4 = reinterpret_cast<float4*>(part);
    for (int q = tid; q < D / 4; q += tx * G) {
      float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll 4
      for (int gi = 0; gi < G; ++gi) {
        const float4 b = fold[gi * span4 + q];
        sum.x += b.x, sum.y += b.y, sum.z += b.z, sum.w += b.w;
      }
      part4[q] = sum;
    }
  }
}

// dweight[j] = sum over g of partial[g][j], in a fixed order.
// Layout: blocks of (8, 32) threads; thread (x, y) owns columns 4 * (blockIdx.x * 8 + x) + 0..3 and
// adds partial rows y, y + 32, y + 64, ... in order of the row, issuing the loads of up to 16 rows
// (16 bytes each when VEC: D % 4 == 0) before the first add; then the 32 sums of a column are added in
// a fixed tree (two shuffles within a warp, then the 8 warps in order).
constexpr int kDwQuads = 8, kDwSlices = 32, kDwBatch = 16;
template <typename T, bool VEC>
__global__ void __launch_bounds__(kDwQuads * kDwSlices)
    rmsnorm_dweight_kernel(const float* __restrict__ partial, T* __restrict__ dweight, int G, int D) {
  kf_wait_prior_grids();
  __shared__ float4 s[kDwQuads * kDwSlices / 32][kDwQuads];
  const int j = (blockIdx.x * kDwQuads + threadIdx.x) * 4;
  float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  if (j < D) {
    for (int g0 = threadIdx.y; g0 < G; g0 += kDwSlices * kDwBatch) {
      float4 v[kDwBatch];
#pragma unroll
      for (int u = 0; u < kDwBatch; ++u) {
        const int g = g0 + u * kDwSlices;
        const float* p = partial + (long long)g * D + j;
        v[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (g < G) {
          if (VEC) {
            v[u] = __ldcg(reinterpret_cast<const float4*>(p));
          } else {
            v[u].x = __ldcg(p);
            if (j + 1 < D) v[u].y = __ldcg(p + 1);
            if (j + 2 < D) v[u].z = __ldcg(p + 2);
            if (j + 3 < D) v[u].w = __ldcg(p + 3);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kDwBatch; ++u) a.x += v[u].x, a.y += v[u].y, a.z += v[u].z, a.w += v[u].w;
    }
  }
  // Lane = x + 8 * (y % 4): the warp's 4 slices of a column, then the warps.
#pragma unroll
  for (int o = 8; o < 32; o <<= 1) {
    a.x += __shfl_xor_sync(0xffffffffu, a.x, o);
    a.y += __shfl_xor_sync(0xffffffffu, a.y, o);
    a.z += __shfl_xor_sync(0xffffffffu, a.z, o);
    a.w += __shfl_xor_sync(0xffffffffu, a.w, o);
  }
  const int warp = threadIdx.y >> 2;
  if ((threadIdx.y & 3) == 0) s[warp][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && j < D) {
    float4 t = s[0][threadIdx.x];
#pragma unroll
    for (int q = 1; q < kDwQuads * kDwSlices / 32; ++q) {
      const float4 b = s[q][threadIdx.x];
      t.x += b.x, t.y += b.y, t.z += b.z, t.w += b.w;
    }
    const float tv[4] = {t.x, t.y, t.z, t.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (j + i < D) dweight[j + i] = from_float<T>(tv[i]);
  }
}
