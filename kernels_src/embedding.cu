// embedding: the weight gradient of an embedding lookup, dW[v, :] = sum of G[t, :] over the tokens t
// with I[t] == v, for grad G (N, C) and indices I (N,) (torch.ops.aten.embedding_backward, dense).
// Every row of dW (V, C) is written, zero where no token maps to it; tokens equal to padding_idx and
// indices outside [0, V) add nothing. One kernel, no zero-fill pass, no atomics (but integer counts
// in shared memory past the list's capacity, below), and deterministic: each element is an fp32 sum
// over its tokens in an order fixed by the indices alone (ascending token; for a row of kEmbHotRow
// tokens or more, eight ascending runs added in run order), rounded once to T.
//
// Layout: blockDim kEmbThreads (8 warps). blockIdx.x owns R consecutive rows of dW, blockIdx.y a
// chunk of at most 8 "items" of each row (an item: 32 lanes' units, a unit being a 16-byte pack when
// VEC, else one element). A block
//  1. scans all N indices, 2048 a step, and lists the tokens that fall in its rows in shared memory
//     in token order (a block-wide prefix sum of each thread's hits per step);
//  2. groups the list by row, keeping token order within a row (a stable counting sort: each warp
//     counts, then places, one segment of the list; warp peers of a row found with match.any);
//  3. gives each (row, item) to one warp: lane l owns unit 32 * item + l, adds its tokens' G units in
//     fp32 registers (eight loads in flight) and writes the row's units once. A row of kEmbHotRow
//     tokens or more is split instead: each warp sums one eighth of its tokens for every item, and
//     warp w adds the eight partial sums of item w in order.
// A block whose rows hold more than kEmbListCap tokens (frequent tokens, a small vocabulary) counts
// its tokens per row, then runs 1-3 once per range of consecutive rows whose tokens fit the list; a
// single row with more goes through step 3's split in rounds of kEmbListCap tokens, warp w keeping
// item w's running sum in registers. G is read once; the index scans (N per block and pass, from L2)
// are what grows with the number of blocks.
#include "common.cuh"
#include "launch_params.cuh"

using kf_embedding::kEmbHotRow;
using kf_embedding::kEmbIdxPerThread;
using kf_embedding::kEmbListCap;
using kf_embedding::kEmbMaxRows;
using kf_embedding::kEmbThreads;

constexpr int kEmbWarps = kEmbThreads / 32;
constexpr unsigned kFull = 0xffffffffu;
constexpr long long kEmbStep = (long long)kEmbThreads * kEmbIdxPerThread;  // indices a scan step
// Resident blocks per SM the launch bound asks for: the most that compile without spills (ptxas,
// CUDA 13: at most 80 registers on sm_90 for three; sm_80 spills a little at three). Unbounded,
// ptxas chose 64 registers and spilled.
#if __CUDA_ARCH__ >= 900
constexpr int kEmbMinBlocks = 3;
#else
constexpr int kEmbMinBlocks = 2;
#endif

struct EmbShared {
  int tok[kEmbListCap];             // listed tokens, token order
  int sorted[kEmbListCap];          // the same grouped by row, token order within a row
  int seg[kEmbWarps][kEmbMaxRows];  // per warp's list segment: its tokens per row, then its cursors
  int start[kEmbMaxRows], end[kEmbMaxRows];  // row r's tokens: sorted[start[r], end[r])
  int count[kEmbMaxRows];           // tokens per row (blocks past the list's capacity)
  int wsum[2][kEmbWarps];           // block_exclusive_scan's warp totals, alternating
  u8 key[kEmbListCap];              // tok[i]'s row in the block
};

// Exclusive prefix sum of v over the block's threads in thread order, and the block's total. Uses
// sh.wsum[step & 1] and advances step (uniform): calls alternate buffers, so one __syncthreads each.
KF_DEVICE int block_exclusive_scan(EmbShared& sh, int v, int& total, int& step) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int* wsum = sh.wsum[step++ & 1];
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) wsum[warp] = x;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < kEmbWarps; ++w) {
    const int s = wsum[w];
    before += w < warp ? s : 0;
    total += s;
  }
  return before + x - v;
}

// The kEmbIdxPerThread indices at t0 (16-byte loads where aligned and whole; -1 past N).
template <typename IdxT>
KF_DEVICE void load_indices(const IdxT* __restrict__ I, long long t0, long long N,
                            long long (&idx)[kEmbIdxPerThread]) {
  constexpr int K = kEmbIdxPerThread;
  constexpr int E = 16 / sizeof(IdxT);  // indices a 16-byte load
  if ((reinterpret_cast<u64>(I) & 15) == 0 && t0 + K <= N) {
    const int4* p = reinterpret_cast<const int4*>(I + t0);
#pragma unroll
    for (int j = 0; j < K / E; ++j) {
      const int4 v = __ldg(p + j);
      if constexpr (sizeof(IdxT) == 8) {
        idx[2 * j] = ((long long)(u32)v.y << 32) | (u32)v.x;
        idx[2 * j + 1] = ((long long)(u32)v.w << 32) | (u32)v.z;
      } else {
        idx[4 * j] = v.x, idx[4 * j + 1] = v.y, idx[4 * j + 2] = v.z, idx[4 * j + 3] = v.w;
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) idx[k] = t0 + k < N ? (long long)I[t0 + k] : -1;
  }
}

// The scan over all N indices, kEmbIdxPerThread of them per thread and step:
//   IndexScan<IdxT, Prefetch> scan(I, N); long long t0, idx[K]; while (scan.next(t0, idx)) {...}
// gives this thread's indices from token t0 for every step; with Prefetch the following step's loads
// are in flight meanwhile (16 more registers live through the loop body). Every thread runs every
// step (the body may synchronise) unless all leave together.
template <typename IdxT, bool Prefetch>
struct IndexScan {
  static constexpr int K = kEmbIdxPerThread;
  const IdxT* __restrict__ I;
  long long N, t;  // t: this thread's first token of the next step
  long long ahead[K];
  KF_DEVICE IndexScan(const IdxT* __restrict__ I_, long long N_) : I(I_), N(N_), t((long long)threadIdx.x * K) {
    if constexpr (Prefetch) load_indices(I, t, N, ahead);
  }
  KF_DEVICE bool next(long long& t0, long long (&idx)[K]) {
    if (t - (long long)threadIdx.x * K >= N) return false;  // uniform: the step's first token
    t0 = t;
    t += kEmbStep;
    if constexpr (Prefetch) {
#pragma unroll
      for (int k = 0; k < K; ++k) idx[k] = ahead[k];
      if (t - (long long)threadIdx.x * K < N) load_indices(I, t, N, ahead);
    } else {
      load_indices(I, t0, N, idx);
    }
    return true;
  }
};

// Bit k: token t0 + k is in rows [lo, hi) of the block (indices row0 + lo .. row0 + hi - 1).
KF_DEVICE u32 hit_mask(const long long (&idx)[kEmbIdxPerThread], long long row0, int lo, int hi,
                       long long pad) {
  u32 hits = 0;
#pragma unroll
  for (int k = 0; k < kEmbIdxPerThread; ++k) {
    const long long d = idx[k] - row0 - lo;
    if ((unsigned long long)d < (unsigned long long)(hi - lo) && idx[k] != pad) hits |= 1u << k;
  }
  return hits;
}

// Appends this step's hits at list position n + (hits of the threads before), token order.
KF_DEVICE void append(EmbShared& sh, int pos, u32 hits, long long t0,
                      const long long (&idx)[kEmbIdxPerThread], long long row0) {
#pragma unroll
  for (int k = 0; k < kEmbIdxPerThread; ++k)
    if (hits >> k & 1) sh.tok[pos] = (int)(t0 + k), sh.key[pos] = (u8)(idx[k] - row0), ++pos;
}

// Lists the tokens of rows [lo, hi) in sh.tok / sh.key in token order. Returns how many, or -1 as
// soon as they pass kEmbListCap (the list is then incomplete).
template <typename IdxT>
KF_DEVICE int list_tokens(EmbShared& sh, const IdxT* __restrict__ I, long long N, long long row0, int lo,
                          int hi, long long pad, int& step) {
  int n = 0;
  IndexScan<IdxT, true> scan(I, N);
  long long t0, idx[kEmbIdxPerThread];
  while (scan.next(t0, idx)) {
    const u32 hits = hit_mask(idx, row0, lo, hi, pad);
    int total;
    const int pos = block_exclusive_scan(sh, __popc(hits), total, step);
    if (n + total > kEmbListCap) {
      n = -1;
      break;
    }
    append(sh, n + pos, hits, t0, idx, row0);
    n += total;
  }
  __syncthreads();
  return n;
}

// sh.count[r] = tokens of row r, for rows [0, rows): one shared atomic add per warp and row a step.
template <typename IdxT>
KF_DEVICE void count_tokens(EmbShared& sh, const IdxT* __restrict__ I, long long N, long long row0,
                            int rows, long long pad) {
  const int lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < kEmbMaxRows; i += kEmbThreads) sh.count[i] = 0;
  __syncthreads();
  IndexScan<IdxT, true> scan(I, N);
  long long t0, idx[kEmbIdxPerThread];
  while (scan.next(t0, idx)) {
    const u32 hits = hit_mask(idx, row0, 0, rows, pad);
#pragma unroll
    for (int k = 0; k < kEmbIdxPerThread; ++k) {
      const bool hit = hits >> k & 1;
      const int r = hit ? (int)(idx[k] - row0) : kEmbMaxRows + lane;  // misses: a key each
      const unsigned peers = __match_any_sync(kFull, r);
      if (hit && lane == 31 - __clz(peers)) atomicAdd(&sh.count[r], __popc(peers));
    }
  }
  __syncthreads();
}

// Groups the n listed tokens (rows in [lo, hi)) by row into sh.sorted, token order kept within a
// row; sets sh.start / sh.end for rows [lo, hi). Warp w takes list segment w: pass one counts its
// tokens per row, the rows' starts and each segment's cursor within its row follow, pass two places.
KF_DEVICE void group_by_row(EmbShared& sh, int n, int lo, int hi, int& step) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int i = tid; i < kEmbWarps * kEmbMaxRows; i += kEmbThreads) (&sh.seg[0][0])[i] = 0;
  __syncthreads();
  const int seg_len = (n + kEmbWarps * 32 - 1) / (kEmbWarps * 32) * 32;
  const int b0 = warp * seg_len, b1 = min(n, b0 + seg_len);
  int* mine = sh.seg[warp];
  for (int b = b0; b < b1; b += 32) {
    const int m = b + lane;
    const int r = m < b1 ? sh.key[m] : kEmbMaxRows + lane;  // past the segment: a key each
    const unsigned peers = __match_any_sync(kFull, r);
    if (m < b1 && lane == 31 - __clz(peers)) mine[r] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
  const int r = lo + tid;
  int count = 0;
  if (r < hi)
#pragma unroll
    for (int w = 0; w < kEmbWarps; ++w) count += sh.seg[w][r];
  int total;
  const int first = block_exclusive_scan(sh, count, total, step);
  if (r < hi) {
    sh.start[r] = first;
    sh.end[r] = first + count;
    int c = first;
#pragma unroll
    for (int w = 0; w < kEmbWarps; ++w) {
      const int s = sh.seg[w][r];
      sh.seg[w][r] = c;
      c += s;
    }
  }
  __syncthreads();
  for (int b = b0; b < b1; b += 32) {
    const int m = b + lane;
    const int rk = m < b1 ? sh.key[m] : kEmbMaxRows + lane;
    const unsigned peers = __match_any_sync(kFull, rk);
    if (m < b1) sh.sorted[mine[rk] + __popc(peers & ((1u << lane) - 1))] = sh.tok[m];
    __syncwarp();  // every peer has read the cursor before its last peer moves it
    if (m < b1 && lane == 31 - __clz(peers)) mine[rk] += __popc(peers);
    __syncwarp();
  }
  __syncthreads();
}

template <typename T, bool VEC>
KF_DEVICE void add_unit(float (&acc)[Unit<T, VEC>::size], const Unit<T, VEC>& g) {
#pragma unroll
  for (int e = 0; e < Unit<T, VEC>::size; ++e) acc[e] += g.f(e);
}

// acc += the units at column c0 of the G rows of tokens toks[j, e), in that order.
template <typename T, bool VEC>
KF_DEVICE void add_tokens(float (&acc)[Unit<T, VEC>::size], const int* toks, int j, int e,
                          const T* __restrict__ G, long long C, long long c0) {
  using U = Unit<T, VEC>;
  constexpr int B = 8;  // loads in flight
  for (; j + B <= e; j += B) {
    U g[B];
#pragma unroll
    for (int k = 0; k < B; ++k) load_unit_last(g[k], G + (long long)toks[j + k] * C + c0);
#pragma unroll
    for (int k = 0; k < B; ++k) add_unit<T, VEC>(acc, g[k]);
  }
  for (; j < e; ++j) {
    U g;
    load_unit_last(g, G + (long long)toks[j] * C + c0);
    add_unit<T, VEC>(acc, g);
  }
}

// Where the block's items of a row start (unit index) and how many units a row has.
struct EmbItems {
  long long u0, units;  // the block's first unit (32 * its first item), units per row
  int qn;               // items of a row in this block (<= kEmbWarps)
};

template <typename T, bool VEC>
KF_DEVICE void store_units(T* __restrict__ out, long long row, long long C, long long u,
                           const float (&acc)[Unit<T, VEC>::size]) {
  using U = Unit<T, VEC>;
  T* dst = out + row * C + u * U::size;
  if constexpr (VEC) store_unit_last(dst, U::from(acc));
  else store_unit(dst, U::from(acc));
}

// One row's n tokens toks[0, n) summed by the whole block: warp w sums the w-th eighth of them for
// every item (groups of items at a time, their partial sums in `part`: kEmbListCap floats of shared
// memory not holding toks), then warp w adds the eight partial sums of item w to acc in order.
template <typename T, bool VEC>
KF_DEVICE void add_split(float (&acc)[Unit<T, VEC>::size], const int* toks, int n, float* part,
                         const T* __restrict__ G, long long C, const EmbItems& it) {
  constexpr int S = Unit<T, VEC>::size;
  constexpr int kGroup = kEmbListCap / (kEmbWarps * 32 * S);  // items whose partials fit `part`
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int a = (int)((long long)n * warp / kEmbWarps), b = (int)((long long)n * (warp + 1) / kEmbWarps);
  for (int g0 = 0; g0 < it.qn; g0 += kGroup) {
    const int gn = min(kGroup, it.qn - g0);
    for (int g = 0; g < gn; ++g) {
      float p[S];
#pragma unroll
      for (int e = 0; e < S; ++e) p[e] = 0.0f;
      const long long u = it.u0 + (g0 + g) * 32 + lane;
      if (u < it.units) add_tokens<T, VEC>(p, toks, a, b, G, C, u * S);
#pragma unroll
      for (int e = 0; e < S; ++e) part[((g * kEmbWarps + warp) * 32 + lane) * S + e] = p[e];
    }
    __syncthreads();
    if (warp >= g0 && warp < g0 + gn) {
#pragma unroll
      for (int e = 0; e < S; ++e) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kEmbWarps; ++w) s += part[(((warp - g0) * kEmbWarps + w) * 32 + lane) * S + e];
        acc[e] += s;
      }
    }
    __syncthreads();  // `part` is free for the next group
  }
}

// Steps 2 and 3 for rows [lo, hi) of the block, their n tokens listed in sh.tok / sh.key.
template <typename T, bool VEC>
KF_DEVICE void write_rows(EmbShared& sh, int n, int lo, int hi, int& step, const T* __restrict__ G,
                          T* __restrict__ out, long long C, long long row0, const EmbItems& it) {
  constexpr int S = Unit<T, VEC>::size;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  group_by_row(sh, n, lo, hi, step);
  // One warp per (row, item) of a row below kEmbHotRow tokens.
  for (int i = warp; i < (hi - lo) * it.qn; i += kEmbWarps) {
    const int r = lo + i / it.qn;
    const int s = sh.start[r], e = sh.end[r];
    if (e - s >= kEmbHotRow) continue;  // warp-uniform
    const long long u = it.u0 + (i % it.qn) * 32 + lane;
    if (u >= it.units) continue;
    float acc[S];
#pragma unroll
    for (int k = 0; k < S; ++k) acc[k] = 0.0f;
    add_tokens<T, VEC>(acc, sh.sorted, s, e, G, C, u * S);
    store_units<T, VEC>(out, row0 + r, C, u, acc);
  }
  // The rest by the whole block, one row at a time (sh.tok is free: the partial sums go there).
  for (int r = lo; r < hi; ++r) {
    const int s = sh.start[r], e = sh.end[r];
    if (e - s < kEmbHotRow) continue;  // uniform
    float acc[S];
#pragma unroll
    for (int k = 0; k < S; ++k) acc[k] = 0.0f;
    add_split<T, VEC>(acc, sh.sorted + s, e - s, reinterpret_cast<float*>(sh.tok), G, C, it);
    const long long u = it.u0 + warp * 32 + lane;
    if (warp < it.qn && u < it.units) store_units<T, VEC>(out, row0 + r, C, u, acc);
  }
  __syncthreads();  // sh is reused by the next range
}

// Row r of more than kEmbListCap tokens: listed and summed in rounds (add_split), warp w keeping
// item w's running sum.
template <typename T, typename IdxT, bool VEC>
KF_DEVICE void write_crowded_row(EmbShared& sh, int r, int& step, const T* __restrict__ G,
                                 const IdxT* __restrict__ I, T* __restrict__ out, long long N, long long C,
                                 long long row0, long long pad, const EmbItems& it) {
  constexpr int S = Unit<T, VEC>::size;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* part = reinterpret_cast<float*>(sh.sorted);
  float acc[S];
#pragma unroll
  for (int k = 0; k < S; ++k) acc[k] = 0.0f;
  int n = 0;
  // No prefetch, and only tokens listed (one row: no keys), so no index is live across add_split.
  IndexScan<IdxT, false> scan(I, N);
  long long t0, idx[kEmbIdxPerThread];
  while (scan.next(t0, idx)) {
    const u32 hits = hit_mask(idx, row0, r, r + 1, pad);
    int total;
    int pos = block_exclusive_scan(sh, __popc(hits), total, step);
    if (n + total > kEmbListCap) {  // the earlier steps' tokens are visible since the scan's barrier
      add_split<T, VEC>(acc, sh.tok, n, part, G, C, it);
      n = 0;
    }
    pos += n;
#pragma unroll
    for (int k = 0; k < kEmbIdxPerThread; ++k)
      if (hits >> k & 1) sh.tok[pos++] = (int)(t0 + k);
    n += total;
  }
  __syncthreads();
  add_split<T, VEC>(acc, sh.tok, n, part, G, C, it);
  const long long u = it.u0 + warp * 32 + lane;
  if (warp < it.qn && u < it.units) store_units<T, VEC>(out, row0 + r, C, u, acc);
  __syncthreads();
}

// dW (V, C) from G (N, C) and I (N,); pad: padding_idx (-1: none). R rows a block (<= kEmbMaxRows),
// Qb items of a row a block (<= kEmbMaxBlockItems).
template <typename T, typename IdxT, bool VEC>
__global__ void __launch_bounds__(kEmbThreads, kEmbMinBlocks)
    embedding_backward_kernel(const T* __restrict__ G, const IdxT* __restrict__ I, T* __restrict__ out,
                              long long N, long long C, long long V, long long pad, int R, int Qb) {
  kf_wait_prior_grids();
  __shared__ EmbShared sh;
  const long long row0 = (long long)blockIdx.x * R;
  const int rows = (int)min((long long)R, V - row0);
  EmbItems it;
  it.units = VEC ? C / Unit<T, VEC>::size : C;
  const long long q0 = (long long)blockIdx.y * Qb;
  it.u0 = q0 * 32;
  it.qn = (int)min((long long)Qb, (it.units + 31) / 32 - q0);
  int step = 0;

  const int n = list_tokens(sh, I, N, row0, 0, rows, pad, step);
  kf_allow_dependents();
  if (n >= 0) {
    write_rows<T, VEC>(sh, n, 0, rows, step, G, out, C, row0, it);
    return;
  }
  // Past the list's capacity: ranges of rows whose tokens fit it, and rows that alone do not.
  count_tokens(sh, I, N, row0, rows, pad);
  for (int lo = 0; lo < rows;) {  // uniform: every thread reads the same counts
    int hi = lo, sum = 0;
    while (hi < rows && sum + sh.count[hi] <= kEmbListCap) sum += sh.count[hi++];
    if (hi > lo) {
      const int m = sum ? list_tokens(sh, I, N, row0, lo, hi, pad, step) : 0;
      write_rows<T, VEC>(sh, m, lo, hi, step, G, out, C, row0, it);
    } else {
      write_crowded_row<T, IdxT, VEC>(sh, lo, step, G, I, out, N, C, row0, pad, it);
      hi = lo + 1;
    }
    lo = hi;
  }
}
