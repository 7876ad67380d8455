// embedding: the weight gradient of an embedding lookup, dW[v, :] = sum of G[t, :] over the tokens t
// with I[t] == v, for grad G (N, C) and indices I (N,) (torch.ops.aten.embedding_backward, dense).
// Every row of dW (V, C) is written, zero where no token maps to it; tokens equal to padding_idx and
// indices outside [0, V) add nothing. One kernel, no atomics, no zero-fill pass, and deterministic:
// each element is an fp32 sum over its tokens in ascending token order, rounded once to T.
//
// Layout: blockDim kEmbThreads. blockIdx.x owns R consecutive rows of dW, blockIdx.y a chunk of Qb
// "items" of each row (an item is 32 lanes' units; a unit is a 16-byte pack when VEC, else one
// element). A block
//  1. scans all N indices, 2048 a step, and appends the tokens that fall in its rows to a list in
//     shared memory in token order (a block-wide prefix sum of each thread's hits per step);
//  2. groups the list by row, keeping token order within a row (a stable counting sort: each warp
//     counts and then places one segment of the list, warp peers of a row found with match.any);
//  3. gives each (row, item) to one warp: lane l owns unit 32 * item + l of the row, adds its tokens'
//     G units into fp32 registers (eight loads in flight) and writes the row's units once.
// A block whose rows hold more than kEmbListCap tokens (a few very frequent tokens, a tiny
// vocabulary) keeps no list: step 1 only marks its rows that have tokens, and step 3's warp finds a
// marked row's tokens itself, 32 indices per ballot, still in token order. Only the dW write and
// the index scans (N per block, from L2) grow with V; G is read once.
#include "common.cuh"
#include "launch_params.cuh"

using kf_embedding::kEmbIdxPerThread;
using kf_embedding::kEmbListCap;
using kf_embedding::kEmbMaxRows;
using kf_embedding::kEmbThreads;

constexpr int kEmbWarps = kEmbThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// Exclusive prefix sum of v over the block's threads in thread order, and the block's total.
// wsum: kEmbWarps ints the caller does not reuse before every thread has returned (callers
// alternate two buffers, so one __syncthreads a call suffices).
KF_DEVICE int block_exclusive_scan(int v, int* wsum, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
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
KF_DEVICE void load_indices(const IdxT* __restrict__ I, long long t0, long long N, bool aligned,
                            long long (&idx)[kEmbIdxPerThread]) {
  constexpr int K = kEmbIdxPerThread;
  constexpr int E = 16 / sizeof(IdxT);  // indices a 16-byte load
  if (aligned && t0 + K <= N) {
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

template <typename T, bool VEC>
KF_DEVICE void add_unit(float (&acc)[Unit<T, VEC>::size], const Unit<T, VEC>& g) {
#pragma unroll
  for (int e = 0; e < Unit<T, VEC>::size; ++e) acc[e] += g.f(e);
}

// acc += the units at column c0 of the G rows of tokens toks[j, e), in that order.
template <typename T, bool VEC>
KF_DEVICE void add_listed_tokens(float (&acc)[Unit<T, VEC>::size], const int* toks, int j, int e,
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

// The same for the tokens t with I[t] == target, found by the whole warp (every lane calls it;
// `active` lanes add), 32 indices a ballot, in token order.
template <typename T, typename IdxT, bool VEC>
KF_DEVICE void add_matching_tokens(float (&acc)[Unit<T, VEC>::size], const IdxT* __restrict__ I,
                                   long long N, long long target, const T* __restrict__ G,
                                   long long C, long long c0, bool active) {
  using U = Unit<T, VEC>;
  constexpr int B = 4;  // loads in flight
  const int lane = threadIdx.x & 31;
  for (long long b = 0; b < N; b += 32) {
    const long long t = b + lane;
    unsigned m = __ballot_sync(kFull, t < N && (long long)I[t] == target);
    while (m) {
      long long tk[B];
      bool ok[B];
#pragma unroll
      for (int k = 0; k < B; ++k) {
        ok[k] = m != 0;
        tk[k] = b + (ok[k] ? __ffs(m) - 1 : 0);
        m &= m - 1;
      }
      if (active) {
        U g[B];
#pragma unroll
        for (int k = 0; k < B; ++k)
          if (ok[k]) load_unit_last(g[k], G + tk[k] * C + c0);
#pragma unroll
        for (int k = 0; k < B; ++k)
          if (ok[k]) add_unit<T, VEC>(acc, g[k]);
      }
    }
  }
}

struct EmbShared {
  int tok[kEmbListCap];             // matched tokens, token order
  int sorted[kEmbListCap];          // the same grouped by row, token order within a row
  int seg[kEmbWarps][kEmbMaxRows];  // per warp segment: its tokens per row, then its cursors
  int start[kEmbMaxRows], end[kEmbMaxRows];  // row r's tokens: sorted[start[r], end[r])
  int wsum[2][kEmbWarps];
  u8 key[kEmbListCap];              // tok[i]'s row in the block
  u8 touched[kEmbMaxRows];          // row has a token (what the overflow path walks)
};

// dW (V, C) from G (N, C) and I (N,); pad: padding_idx (-1: none). R rows a block (<= kEmbMaxRows),
// Qb items of a row a block.
template <typename T, typename IdxT, bool VEC>
__global__ void __launch_bounds__(kEmbThreads)
    embedding_backward_kernel(const T* __restrict__ G, const IdxT* __restrict__ I, T* __restrict__ out,
                              long long N, long long C, long long V, long long pad, int R, int Qb) {
  kf_wait_prior_grids();
  constexpr int K = kEmbIdxPerThread;
  using U = Unit<T, VEC>;
  __shared__ EmbShared sh;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const long long row0 = (long long)blockIdx.x * R;
  const int rows = (int)min((long long)R, V - row0);

  for (int i = tid; i < kEmbWarps * kEmbMaxRows; i += kEmbThreads) (&sh.seg[0][0])[i] = 0;
  for (int i = tid; i < kEmbMaxRows; i += kEmbThreads) sh.start[i] = sh.end[i] = 0, sh.touched[i] = 0;
  __syncthreads();

  // 1. The block's tokens, in token order, while they fit the list.
  const bool aligned = (reinterpret_cast<u64>(I) & 15) == 0;
  int n = 0;              // listed tokens (the same in every thread)
  bool overflow = false;  // block-uniform
  constexpr long long kStep = (long long)kEmbThreads * K;
  int step = 0;
  long long next[K];  // the following step's indices, loaded a step ahead
  load_indices(I, (long long)tid * K, N, aligned, next);
  for (long long s0 = 0; s0 < N; s0 += kStep, ++step) {
    const long long t0 = s0 + (long long)tid * K;
    long long idx[K];
#pragma unroll
    for (int k = 0; k < K; ++k) idx[k] = next[k];
    if (s0 + kStep < N) load_indices(I, t0 + kStep, N, aligned, next);
    u32 hits = 0;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const long long d = idx[k] - row0;
      if ((unsigned long long)d < (unsigned long long)rows && idx[k] != pad) {
        hits |= 1u << k;
        sh.touched[d] = 1;  // every writer stores the same value
      }
    }
    if (!overflow) {
      int total;
      int p = block_exclusive_scan(__popc(hits), sh.wsum[step & 1], total);
      if (n + total > kEmbListCap) {
        overflow = true;
      } else {
        p += n;
#pragma unroll
        for (int k = 0; k < K; ++k)
          if (hits >> k & 1) sh.tok[p] = (int)(t0 + k), sh.key[p] = (u8)(idx[k] - row0), ++p;
        n += total;
      }
    }
  }
  __syncthreads();

  // 2. Group the list by row (stable). Warp w takes list segment w; pass one counts its tokens per
  // row, the rows' starts and each segment's cursor within a row follow, pass two places them.
  if (!overflow && n > 0) {
    const int seg_len = (n + kEmbWarps * 32 - 1) / (kEmbWarps * 32) * 32;
    const int b0 = warp * seg_len, b1 = min(n, b0 + seg_len);
    int* mine = sh.seg[warp];
    for (int b = b0; b < b1; b += 32) {
      const int m = b + lane;
      const int r = m < b1 ? sh.key[m] : kEmbMaxRows + lane;  // past the end: a key of its own
      const unsigned peers = __match_any_sync(kFull, r);
      if (m < b1 && lane == 31 - __clz(peers)) mine[r] += __popc(peers);
      __syncwarp();
    }
    __syncthreads();
    int count = 0;
    if (tid < rows)
#pragma unroll
      for (int w = 0; w < kEmbWarps; ++w) count += sh.seg[w][tid];
    int total;
    const int first = block_exclusive_scan(count, sh.wsum[step & 1], total);
    if (tid < rows) {
      sh.start[tid] = first;
      sh.end[tid] = first + count;
      int c = first;
#pragma unroll
      for (int w = 0; w < kEmbWarps; ++w) {
        const int s = sh.seg[w][tid];
        sh.seg[w][tid] = c;
        c += s;
      }
    }
    __syncthreads();
    for (int b = b0; b < b1; b += 32) {
      const int m = b + lane;
      const int r = m < b1 ? sh.key[m] : kEmbMaxRows + lane;
      const unsigned peers = __match_any_sync(kFull, r);
      if (m < b1) sh.sorted[mine[r] + __popc(peers & ((1u << lane) - 1))] = sh.tok[m];
      __syncwarp();  // every peer has read the cursor before its last peer moves it
      if (m < b1 && lane == 31 - __clz(peers)) mine[r] += __popc(peers);
      __syncwarp();
    }
    __syncthreads();
  }
  kf_allow_dependents();

  // 3. One warp per (row, item): sum in registers, write the row's units once.
  const long long units = VEC ? C / U::size : C;
  const long long Q = (units + 31) / 32;
  const long long q0 = (long long)blockIdx.y * Qb;
  const int qn = (int)min((long long)Qb, Q - q0);
  for (long long i = warp; i < (long long)rows * qn; i += kEmbWarps) {
    const int r = (int)(i / qn);
    const long long u = (q0 + i % qn) * 32 + lane;
    const bool active = u < units;
    const long long c0 = u * U::size;
    float acc[U::size];
#pragma unroll
    for (int e = 0; e < U::size; ++e) acc[e] = 0.0f;
    if (!overflow) {
      if (active) add_listed_tokens<T, VEC>(acc, sh.sorted, sh.start[r], sh.end[r], G, C, c0);
    } else if (sh.touched[r]) {  // warp-uniform
      add_matching_tokens<T, IdxT, VEC>(acc, I, N, row0 + r, G, C, c0, active);
    }
    if (active) {
      T* dst = out + (row0 + r) * C + c0;
      if constexpr (VEC) store_unit_last(dst, U::from(acc));
      else store_unit(dst, U::from(acc));
    }
  }
}
