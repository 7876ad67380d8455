// rmsnorm: y = x * rstd * weight over the last dim (D elements), rstd = 1 / sqrt(mean(x^2) + eps),
// statistics in fp32. Two conventions for where the result is rounded to the storage type T:
//   cast_before_weight = 1 (Hugging Face Llama): y = weight * T(x * rstd)
//   cast_before_weight = 0 (torch F.rms_norm):   y = T(x * rstd * weight)
// (identical for fp32). weight may be null (no affine weight: w = 1).
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
// Backward of 16-byte rows of more than 32 chunks instead uses rmsnorm_backward_staged_kernel: each
// row group copies its next rows into shared memory with cp.async while it computes the current one,
// so its loads stay in flight through its reductions and compute (see there).
#include "common.cuh"

// ---- chunks in registers ------------------------------------------------------------------------
// 16 bytes as four 32-bit words (two bf16/half per word): a chunk costs four registers whatever T is
// (16-bit values unpacked one per register would cost twice as many).
struct __align__(16) Chunk {
  u32 w[4];
};

// Per type: V elements per chunk; get(c, i): element i as fp32; put(f): chunk from V floats (rn);
// round(a, b): a and b rounded to T and read back; kOne: a word of ones.
template <typename T>
struct Elems;
template <>
struct Elems<float> {
  static constexpr int V = 4;
  static constexpr u32 kOne = 0x3f800000u;
  static KF_DEVICE float get(const Chunk& c, int i) { return __uint_as_float(c.w[i]); }
  static KF_DEVICE Chunk put(const float (&f)[4]) {
    Chunk c;
#pragma unroll
    for (int i = 0; i < 4; ++i) c.w[i] = __float_as_uint(f[i]);
    return c;
  }
  static KF_DEVICE void round(float&, float&) {}
};
template <>
struct Elems<bf16> {
  static constexpr int V = 8;
  static constexpr u32 kOne = 0x3f803f80u;
  static KF_DEVICE float get(const Chunk& c, int i) {
    const u32 w = c.w[i >> 1];
    return __uint_as_float(i & 1 ? w & 0xffff0000u : w << 16);
  }
  static KF_DEVICE u32 pair(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static KF_DEVICE Chunk put(const float (&f)[8]) {
    Chunk c;
#pragma unroll
    for (int i = 0; i < 4; ++i) c.w[i] = pair(f[2 * i], f[2 * i + 1]);
    return c;
  }
  static KF_DEVICE void round(float& a, float& b) {
    const u32 r = pair(a, b);
    a = __uint_as_float(r << 16);
    b = __uint_as_float(r & 0xffff0000u);
  }
};
template <>
struct Elems<half> {
  static constexpr int V = 8;
  static constexpr u32 kOne = 0x3c003c00u;
  static KF_DEVICE float get(const Chunk& c, int i) {
    float f;
    if (i & 1)
      asm("{.reg .f16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, hi;}"
          : "=f"(f)
          : "r"(c.w[i >> 1]));
    else
      asm("{.reg .f16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.f32.f16 %0, lo;}"
          : "=f"(f)
          : "r"(c.w[i >> 1]));
    return f;
  }
  static KF_DEVICE u32 pair(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
  static KF_DEVICE Chunk put(const float (&f)[8]) {
    Chunk c;
#pragma unroll
    for (int i = 0; i < 4; ++i) c.w[i] = pair(f[2 * i], f[2 * i + 1]);
    return c;
  }
  static KF_DEVICE void round(float& a, float& b) {
    const Chunk c = {{pair(a, b), 0u, 0u, 0u}};
    a = get(c, 0);
    b = get(c, 1);
  }
};

KF_DEVICE Chunk words(u32 w) { return Chunk{{w, w, w, w}}; }

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

// Chunk c of a row; STREAMING: evict-first (data read once). Not VEC: element-wise, zeros past D.
template <typename T, bool VEC, bool STREAMING>
KF_DEVICE Chunk load_chunk(const T* row, int c, int D) {
  constexpr int V = Elems<T>::V;
  Chunk r;
  if constexpr (VEC) {
    const int4* p = reinterpret_cast<const int4*>(row + c * V);
    const int4 v = STREAMING ? __ldcs(p) : *p;
    r.w[0] = (u32)v.x, r.w[1] = (u32)v.y, r.w[2] = (u32)v.z, r.w[3] = (u32)v.w;
  } else {
#pragma unroll
    for (int q = 0; q < 4; ++q) r.w[q] = 0u;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const u32 b = c * V + i < D ? bits_of(row[c * V + i]) : 0u;
      if constexpr (V == 4)
        r.w[i] = b;
      else
        r.w[i >> 1] |= b << (16 * (i & 1));
    }
  }
  return r;
}

template <typename T, bool VEC>
KF_DEVICE void store_chunk(T* row, int c, int D, const Chunk& p) {
  constexpr int V = Elems<T>::V;
  if constexpr (VEC) {
    int4 v;
    v.x = (int)p.w[0], v.y = (int)p.w[1], v.z = (int)p.w[2], v.w = (int)p.w[3];
    *reinterpret_cast<int4*>(row + c * V) = v;
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i)
      if (c * V + i < D)
        row[c * V + i] = of_bits<T>(V == 4 ? p.w[i] : p.w[i >> 1] >> (16 * (i & 1)));
  }
}

// Weight chunk (default caching: every row reads it), or ones when there is no weight.
template <typename T, bool VEC>
KF_DEVICE Chunk weight_chunk(const T* weight, int c, int D) {
  return weight ? load_chunk<T, VEC, false>(weight, c, D) : words(Elems<T>::kOne);
}

// Makes the compiler forget what a chunk holds: fp32 values unpacked from it before this point are
// not kept alive to be reused after it (nor hoisted out of the row loop), so a row waits out the
// reduction in registers as packed words rather than as twice as many floats. `zero` is 0 at run time
// (a kernel argument) but unknown to the compiler: ptxas sees through a no-op such as an empty asm,
// and then keeps, or spills, the unpacked values. Also applied to fp32 chunks, where it keeps ptxas
// from spilling at 128 registers too (one xor per word).
KF_DEVICE void opaque(Chunk& p, u32 zero) {
#pragma unroll
  for (int i = 0; i < 4; ++i) asm("xor.b32 %0, %0, %1;" : "+r"(p.w[i]) : "r"(zero));
}

// Barrier of the blockDim.x threads of one row group (bar.sync id 1 + threadIdx.y): the groups of a
// block run independently; barrier 0 (__syncthreads) is left for the whole block.
KF_DEVICE void group_barrier() {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + (int)threadIdx.y), "r"((int)blockDim.x) : "memory");
}

// Resident 256-thread blocks per SM the forward kernel is compiled for (at most 65536 / (256 * n)
// registers per thread): what its K chunks of x need without spilling, and no more.
constexpr int fwd_min_blocks(int K, bool vec) {
  return K == 1 || (K == 2 && vec) ? 8 : K == 2 ? 6 : K == 4 ? 5 : 4;
}

// ---- forward ------------------------------------------------------------------------------------
// Layout: blockDim.y rows per block (one warp per row), or one row per block of blockDim.x <= 256
// threads; K chunks of x per thread in registers, all loads issued first. One reduction: shuffles,
// plus one __syncthreads for rows of several warps. Many blocks per SM (<= 64 registers per thread).
template <typename T, int K, bool VEC>
__global__ void __launch_bounds__(256, fwd_min_blocks(K, VEC))
    rmsnorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ y,
                           float* __restrict__ rstd, long long rows, int D, float inv_d, float eps,
                           int zero, int cast_before_weight) {
  using E = Elems<T>;
  constexpr int V = E::V;
  __shared__ float scratch[16];  // one per warp of the block (<= 256 threads), 8 spare
  const int nchunk = (D + V - 1) / V;
  const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const T* xr = x + row * D;

  Chunk xc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    xc[k] = live && c < nchunk ? load_chunk<T, VEC, true>(xr, c, D) : words(0u);
  }
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) ss += E::get(xc[k], i) * E::get(xc[k], i);

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
  T* yr = y + row * D;
  const bool cbw = cast_before_weight && sizeof(T) < 4;
  const int tx = blockDim.x;
  Chunk wnext = (int)threadIdx.x < nchunk ? weight_chunk<T, VEC>(weight, threadIdx.x, D) : words(0u);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    opaque(xc[k], zero);
    const int c = threadIdx.x + k * tx;
    const Chunk wc = wnext;
    if (k + 1 < K && c + tx < nchunk) wnext = weight_chunk<T, VEC>(weight, c + tx, D);
    if (c < nchunk) {
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = E::get(xc[k], i) * r;
      if (cbw) {  // y = w * T(x * rstd)
#pragma unroll
        for (int i = 0; i < V; i += 2) E::round(o[i], o[i + 1]);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] *= E::get(wc, i);
      store_chunk<T, VEC>(yr, c, D, E::put(o));
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
  group_barrier();
#pragma unroll
  for (int j = 0; j < R; ++j) v[j] = lane < nw ? s[j * 32 + lane] : 0.0f;
#pragma unroll
  for (int j = 0; j < R; ++j) v[j] = warp_sum(v[j]);
}

// dx of one chunk, and its dweight terms dy * x_hat added to acc (CBW: x_hat rounded to T first, as
// the forward used it).
template <typename T, bool VEC, bool CBW>
KF_DEVICE void backward_chunk(T* dxr, int c, int D, const Chunk& xc, const Chunk& gc,
                              const Chunk& wc, float r, float mean_gx, float (&acc)[Elems<T>::V]) {
  using E = Elems<T>;
  constexpr int V = E::V;
  float o[V], xh[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    xh[i] = E::get(xc, i) * r;
    o[i] = r * (E::get(gc, i) * E::get(wc, i) - xh[i] * mean_gx);
  }
  store_chunk<T, VEC>(dxr, c, D, E::put(o));
  if (CBW)
#pragma unroll
    for (int i = 0; i < V; i += 2) E::round(xh[i], xh[i + 1]);
#pragma unroll
  for (int i = 0; i < V; ++i) acc[i] += E::get(gc, i) * xh[i];
}

// CBW: cast_before_weight (16-bit T; the launcher instantiates fp32 with false only).
// Layout: persistent grid of one block (<= MAXT threads) per SM. The block is blockDim.y row groups
// of blockDim.x threads; a group works on R rows at a time (base .. base + R - 1, then R rows further
// by the grid-wide stride), each thread holding K chunks of x and dy of each, all loads issued before
// the reduction. Groups synchronise only among themselves (group_barrier), so one group's loads
// overlap another's reduction and stores. A thread owns the same columns in every row it visits: it
// keeps their weight chunks and their dweight sums in registers. At the end the block adds its
// groups' sums in order of the group through `fold` (blockDim.y * blockDim.x * V floats of dynamic
// shared memory) into dw_partial row blockIdx.x (fp32, D wide).
template <typename T, int K, int R, bool VEC, bool CBW, int MAXT>
__global__ void __launch_bounds__(MAXT, 1)
    rmsnorm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                            const T* __restrict__ weight, const float* __restrict__ rstd,
                            T* __restrict__ dx, float* __restrict__ dw_partial, long long rows, int D,
                            float inv_d, int zero) {
  using E = Elems<T>;
  constexpr int V = E::V;
  __shared__ float scratch[2][MAXT / 64 * 32 * R];  // [buffer][group][value][warp]
  extern __shared__ float fold[];
  const int nchunk = (D + V - 1) / V;

  Chunk wc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    wc[k] = c < nchunk ? weight_chunk<T, VEC>(weight, c, D) : words(0u);
  }
  float acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) acc[k][i] = 0.0f;

  // The loop bound is the same for the whole group (group_sum synchronises it).
  const long long step = (long long)gridDim.x * blockDim.y * R;
  int buf = 0;
  for (long long base = ((long long)blockIdx.x * blockDim.y + threadIdx.y) * R; base < rows;
       base += step) {
    Chunk xc[R][K], gc[R][K];
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
        xc[j][k] = ok ? load_chunk<T, VEC, true>(x + row * D, c, D) : words(0u);
        gc[j][k] = ok ? load_chunk<T, VEC, true>(dy + row * D, c, D) : words(0u);
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
          dot[j] += E::get(gc[j][k], i) * E::get(wc[k], i) * E::get(xc[j][k], i);
    }
    group_sum<R>(dot, scratch[buf]);
    buf ^= 1;

#pragma unroll
    for (int j = 0; j < R; ++j) {
      const long long row = base + j;
      if (row < rows) {
        const float mean_gx = dot[j] * r[j] * inv_d;
        T* dxr = dx + row * D;
#pragma unroll
        for (int k = 0; k < K; ++k) {
          opaque(xc[j][k], zero);
          opaque(gc[j][k], zero);
          opaque(wc[k], zero);
          const int c = threadIdx.x + k * blockDim.x;
          if (c < nchunk)
            backward_chunk<T, VEC, CBW>(dxr, c, D, xc[j][k], gc[j][k], wc[k], r[j], mean_gx,
                                        acc[k]);
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

// ---- backward, pipelined: rows staged in shared memory by cp.async (16-byte rows, sm_80+) ----------
// What limits the register-resident kernel above is that a row group's loads are in flight only
// between its reductions: while it computes, it has none, and 16-bit rows (twice the elements per
// byte) spend long in compute. Here each row group copies x, dy (and rstd) of its next S - 1 rows into
// S shared-memory stages with cp.async while it computes the current row, so the bytes in flight no
// longer depend on registers or on the compute phase, and registers hold one row only (no `opaque`
// tricks, fewer instructions per element).
// Each thread copies and later reads only its own 16-byte slots, so a stage needs no barrier: its
// own cp.async.wait_group makes the data visible to it. rstd: every thread copies the row's rstd
// into its own 4-byte slot (a warp's 32 copies of one address are one request).
KF_DEVICE u32 smem_u32(const void* p) {
  u32 a;
  asm("{ .reg .u64 t;\n cvta.to.shared.u64 t, %1;\n cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
KF_DEVICE u64 evict_first_policy() {
  u64 p;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
  return p;
}
KF_DEVICE void cp_async16(u32 dst, const void* src, u64 policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "l"(policy)
               : "memory");
}
KF_DEVICE void cp_async4(u32 dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
KF_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most n (< kMaxStages) of this thread's committed groups are pending.
constexpr int kMaxStages = 8;
KF_DEVICE void cp_async_wait(int n) {
  switch (n) {
    case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
    case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
    case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
    case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
    case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
    case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
    case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
    default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
  }
}

// Layout: persistent grid, one block per SM (the stages fill its shared memory). The block is
// blockDim.y <= 8 row groups of blockDim.x (64..512, a multiple of 32) threads; group y of block b
// takes rows b * blockDim.y + y + i * gridDim.x * blockDim.y, i = 0, 1, ..., one at a time, and
// thread x owns chunks x + k * blockDim.x, k < K, of every row (D % V == 0 and 16-byte aligned
// pointers: the launcher checks). Shared memory of a group: `stages` (2..kMaxStages) stages of
// [x chunks k = 0..K-1 | dy chunks k = 0..K-1] x blockDim.x x 16 bytes, then stages x blockDim.x
// rstd floats. One reduction (one named barrier of the group) per row. dweight sums in registers
// (the thread's columns), folded at the end into dw_partial row blockIdx.x as in the kernel above.
template <typename T, int K, bool CBW>
__global__ void __launch_bounds__(512, 1)
    rmsnorm_backward_staged_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                                   const T* __restrict__ weight, const float* __restrict__ rstd,
                                   T* __restrict__ dx, float* __restrict__ dw_partial,
                                   long long rows, int D, float inv_d, int stages, int zero) {
  using E = Elems<T>;
  constexpr int V = E::V;
  // Warp sums of a group's reduction, [buffer][group][warp]; slots of warps the group does not have
  // stay 0, so every group adds all 16 in one fixed order.
  __shared__ __align__(16) float red[2][8][16];
  extern __shared__ __align__(16) unsigned char stage_mem[];
  const int tx = blockDim.x, tid = threadIdx.x, gy = threadIdx.y;
  const int lane = tid & 31, warp = tid >> 5;
  const int nchunk = D / V;
  const int chunk_bytes = tx * 16;  // one k of x (or dy) of one stage
  const int stage_bytes = 2 * K * chunk_bytes;
  const int group_bytes = stages * (stage_bytes + tx * 4);
  // This thread's slots, as offsets into stage_mem: x chunk k of stage s at
  // mine + s * stage_bytes + k * chunk_bytes, dy chunk k at + (K + k) * chunk_bytes; rstd of stage s
  // at mine_r + s * tx * 4.
  const int mine = gy * group_bytes + tid * 16;
  const int mine_r = gy * group_bytes + stages * stage_bytes + tid * 4;
  const u32 smem = smem_u32(stage_mem);
  const u64 policy = evict_first_policy();
  bool has[K];  // chunk k of the rows is this thread's
#pragma unroll
  for (int k = 0; k < K; ++k) has[k] = tid + k * tx < nchunk;

  for (int e = gy * tx + tid; e < 2 * 8 * 16; e += tx * blockDim.y) (&red[0][0][0])[e] = 0.0f;

  const long long stride = (long long)gridDim.x * blockDim.y;  // rows between a group's rows
  const long long first = (long long)blockIdx.x * blockDim.y + gy;
  const long long n = first < rows ? (rows - first + stride - 1) / stride : 0;  // rows of the group
  const long long step = stride * D;  // elements between a group's rows

  // Copy position: the next row to copy (row `first + c * stride`, c counted in `left`) and its
  // stage. Every call commits a group, empty once the group's rows are all copied, so that the
  // number of pending groups is the same for every thread and row.
  const T* cx = x + first * D + tid * V;
  const T* cg = dy + first * D + tid * V;
  const float* cr = rstd + first;
  long long left = n;
  int cs = 0;
  auto issue = [&]() {
    if (left > 0) {
      const u32 dst = smem + mine + cs * stage_bytes;
#pragma unroll
      for (int k = 0; k < K; ++k)
        if (has[k]) {
          cp_async16(dst + k * chunk_bytes, cx + k * tx * V, policy);
          cp_async16(dst + (K + k) * chunk_bytes, cg + k * tx * V, policy);
        }
      cp_async4(smem + mine_r + cs * tx * 4, cr);
      cx += step, cg += step, cr += stride, --left;
      cs = cs + 1 == stages ? 0 : cs + 1;
    }
    cp_async_commit();
  };

  Chunk wc[K];
#pragma unroll
  for (int k = 0; k < K; ++k)
    wc[k] = has[k] ? weight_chunk<T, true>(weight, tid + k * tx, D) : words(0u);
  float acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) acc[k][i] = 0.0f;

  for (int s = 0; s + 1 < stages; ++s) issue();
  __syncthreads();  // red is zeroed
  T* dxr = dx + first * D + tid * V;
  int st = 0, buf = 0;
  for (long long i = 0; i < n; ++i) {
    // The stage the copy goes to held row i - 1, which this thread has read and used: refill it
    // with row i + stages - 1, then wait for row i (rows i + 1 .. i + stages - 1 may pend).
    issue();
    cp_async_wait(stages - 1);
    // 16-bit T with K = 4: keep the weight packed (unpacked, its 32 floats stay live across the
    // loop and ptxas spills at 128 registers); with fewer chunks they stay unpacked, which saves
    // two unpackings per element.
    if constexpr (K * V > 16)
#pragma unroll
      for (int k = 0; k < K; ++k) opaque(wc[k], zero);

    Chunk xc[K], gc[K];
    const unsigned char* sp = stage_mem + mine + st * stage_bytes;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      xc[k] = has[k] ? *reinterpret_cast<const Chunk*>(sp + k * chunk_bytes) : words(0u);
      gc[k] = has[k] ? *reinterpret_cast<const Chunk*>(sp + (K + k) * chunk_bytes) : words(0u);
    }
    const float r = *reinterpret_cast<const float*>(stage_mem + mine_r + st * tx * 4);
    st = st + 1 == stages ? 0 : st + 1;

    // dot = sum(dy * w * x) over the row: per chunk, over chunks, over the warp, then the group's
    // warps through `red` (one named barrier; the buffers alternate, so the other one's last readers
    // have passed this barrier before it is written again).
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      float d = 0.0f;
#pragma unroll
      for (int e = 0; e < V; ++e) d += E::get(gc[k], e) * E::get(wc[k], e) * E::get(xc[k], e);
      dot += d;
    }
    dot = warp_sum(dot);
    const float4* sums = reinterpret_cast<const float4*>(red[buf][gy]);
    if (lane == 0) red[buf][gy][warp] = dot;
    group_barrier();
    buf ^= 1;
    float4 q[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = sums[j];
    dot = ((q[0].x + q[0].y) + (q[0].z + q[0].w)) + ((q[1].x + q[1].y) + (q[1].z + q[1].w));
    dot += ((q[2].x + q[2].y) + (q[2].z + q[2].w)) + ((q[3].x + q[3].y) + (q[3].z + q[3].w));

    const float mean_gx = dot * r * inv_d;  // mean(g * x_hat)
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if constexpr (K * V > 16) {  // likewise x and dy wait out the reduction packed
        opaque(xc[k], zero);
        opaque(gc[k], zero);
        opaque(wc[k], zero);
      }
      if (has[k])
        backward_chunk<T, true, CBW>(dxr + k * tx * V, 0, V, xc[k], gc[k], wc[k], r, mean_gx,
                                     acc[k]);
    }
    dxr += step;
  }

  if (dw_partial == nullptr) return;  // no weight (uniform over the block)
  // Fold through the stage memory: every group writes its sums for one k, the block adds them in
  // order of the group. (The copies still pending are empty groups: the group's rows are done.)
  float* fold = reinterpret_cast<float*>(stage_mem);
  float* part = dw_partial + (long long)blockIdx.x * D;
  const int span = tx * V;  // floats per group and k
  const int t = gy * tx + tid;
  const int nt = tx * blockDim.y;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    __syncthreads();  // stage reads, or the previous k's fold reads, are done
#pragma unroll
    for (int i = 0; i < V; ++i) fold[gy * span + tid * V + i] = acc[k][i];
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

// dweight[j] = sum over g of partial[g][j], in a fixed order.
// Layout: block (32, kDwRows); thread (x, y) sums partial rows y, y + kDwRows, ... of column
// blockIdx.x * 32 + x (loads issued 8 at a time before the adds), then the kDwRows sums of a column
// are added in order of y.
constexpr int kDwRows = 32;
template <typename T>
__global__ void __launch_bounds__(32 * kDwRows)
    rmsnorm_dweight_kernel(const float* __restrict__ partial, T* __restrict__ dweight, int G, int D) {
  __shared__ float s[kDwRows][33];
  const int j = blockIdx.x * 32 + threadIdx.x;
  float a = 0.0f;
  if (j < D)
    for (int g0 = threadIdx.y; g0 < G; g0 += 8 * kDwRows) {
      float v[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const int g = g0 + q * kDwRows;
        v[q] = g < G ? partial[(long long)g * D + j] : 0.0f;
      }
#pragma unroll
      for (int q = 0; q < 8; ++q) a += v[q];
    }
  s[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && j < D) {
    float t = 0.0f;
#pragma unroll
    for (int yy = 0; yy < kDwRows; ++yy) t += s[yy][threadIdx.x];
    dweight[j] = from_float<T>(t);
  }
}
