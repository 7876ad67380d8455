// permute: the attention QKV split and head merge, as copies between two layouts of the same data:
//   token-major: (B, T, P, NH, HS), i.e. qkv (B, T, 3C) with P = 3, or y (B, T, C) with P = 1;
//   head-major:  P separate tensors (B, NH, T, HS): q, k, v, or y per head; contiguous, or any
//                strides (sb, sh, st) shared by the P parts with a unit last stride (e.g. the
//                token-major gradients flash attention returns for q, k, v given as views).
// split_qkv forward and merge_heads backward copy token-major -> head-major; split_qkv backward and
// merge_heads forward copy head-major -> token-major. Nothing is saved for backward: the backward of
// each copy is the inverse copy.
//
// A token row (P * NH * HS elements) is cut into `cols` columns of W elements (W = 16 bytes when HS,
// the strides and the pointers allow, else one element); column j is part p, head h, offset c in HS.
// Two kernels, both K loads then K stores per thread and round, warps over consecutive columns of a
// token (512 contiguous bytes on the token side, whole head rows on the head side):
// - permute_lanes_kernel (what the launcher runs): one wave of token lanes, 32-bit byte strides,
//   no divisions in the token loop (layout below).
// - permute_tokens_to_heads_kernel / permute_heads_to_tokens_kernel: tiles of tokens with 64-bit
//   offsets, for the tensors whose byte strides or row do not fit in 32 bits.
#include "common.cuh"

constexpr int kPermuteK = 4;  // tokens per thread and tile (permute_tiles)

template <typename T, int W> struct PermuteChunk { typedef Pack128<T> type; };
template <typename T> struct PermuteChunk<T, 1> { typedef T type; };

template <typename T, int W>
KF_DEVICE typename PermuteChunk<T, W>::type permute_load(const T* p) {
  if constexpr (W == 1)
    return *p;
  else
    return load128cs(p);
}
template <typename T, int W>
KF_DEVICE void permute_store(T* p, const typename PermuteChunk<T, W>::type& v) {
  if constexpr (W == 1)
    *p = v;
  else
    store128cs(p, v);
}

// ---- tiles (64-bit offsets) ---------------------------------------------------------------------
// blockIdx.x picks a chunk of blockDim.x consecutive columns (the column math, with its divisions,
// is done once per thread); blockIdx.y walks (b, tile of K * blockDim.y tokens) grid-stride, and
// thread (x, y) moves its column of tokens y, y + blockDim.y, ... of the tile: K loads, then K
// stores. A block's tile is K * blockDim.y consecutive tokens, contiguous on both sides.
// tok: token-major (B, seq, cols * W); h0, h1, h2: head-major parts (B, NH, seq, HS) with element
// strides (sb, sh, st, 1), `cols` = parts * NH * HS / W. TO_HEADS: tok -> heads, else heads -> tok
// (the source side is only read).
template <typename T, int W, bool TO_HEADS>
KF_DEVICE void permute_tiles(T* __restrict__ tok, T* __restrict__ h0, T* __restrict__ h1,
                             T* __restrict__ h2, int seq, int NH, int HS, int cols,
                             long long tiles_per_seq, long long units, long long sb, long long sh,
                             long long st) {
  constexpr int K = kPermuteK;
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= cols) return;  // no block-wide synchronisation below
  const int hsw = HS / W;
  const int ph = col / hsw, c = col - ph * hsw;  // ph = p * NH + h
  const int p = ph / NH, h = ph - p * NH;
  T* __restrict__ hp = (p == 0 ? h0 : (p == 1 ? h1 : h2)) + (long long)h * sh + c * W;
  T* __restrict__ tp = tok + (long long)col * W;
  const long long row_len = (long long)cols * W;  // elements per token row
  const int by = blockDim.y;
  const long long tok_step = by * row_len, head_step = (long long)by * st;
  const long long tile_tokens = (long long)K * by;
  for (long long u = blockIdx.y; u < units; u += gridDim.y) {
    const long long b = u / tiles_per_seq;
    const long long t = (u - b * tiles_per_seq) * tile_tokens + threadIdx.y;
    const long long left = seq - t;  // tokens of this sequence from t on (<= 0: none)
    T* tq = tp + (b * seq + t) * row_len;
    T* hq = hp + b * sb + t * st;
    typename PermuteChunk<T, W>::type v[K];
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (k * by < left) v[k] = permute_load<T, W>(TO_HEADS ? tq + k * tok_step : hq + k * head_step);
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (k * by < left) permute_store<T, W>(TO_HEADS ? hq + k * head_step : tq + k * tok_step, v[k]);
  }
}

// src (token-major) -> h0, h1, h2 (head-major); layout above.
template <typename T, bool VEC>
__global__ void permute_tokens_to_heads_kernel(const T* __restrict__ src, T* __restrict__ h0,
                                               T* __restrict__ h1, T* __restrict__ h2, int seq,
                                               int NH, int HS, int cols, long long tiles_per_seq,
                                               long long units, long long sb, long long sh,
                                               long long st) {
  kf_wait_prior_grids();
  permute_tiles<T, VEC ? Pack128<T>::size : 1, true>(const_cast<T*>(src), h0, h1, h2, seq, NH, HS,
                                                      cols, tiles_per_seq, units, sb, sh, st);
}

// h0, h1, h2 (head-major) -> dst (token-major); layout above.
template <typename T, bool VEC>
__global__ void permute_heads_to_tokens_kernel(const T* __restrict__ h0, const T* __restrict__ h1,
                                               const T* __restrict__ h2, T* __restrict__ dst, int seq,
                                               int NH, int HS, int cols, long long tiles_per_seq,
                                               long long units, long long sb, long long sh,
                                               long long st) {
  kf_wait_prior_grids();
  permute_tiles<T, VEC ? Pack128<T>::size : 1, false>(dst, const_cast<T*>(h0), const_cast<T*>(h1),
                                                       const_cast<T*>(h2), seq, NH, HS, cols,
                                                       tiles_per_seq, units, sb, sh, st);
}

// ---- persistent token lanes (32-bit byte strides) ------------------------------------------------
// One wave of 256-thread blocks (the launcher sizes it from the pinned occupancy below). Thread g is
// column col = g % cols of token lane lane = g / cols (lane < lanes, the rest exit); it moves tokens
// tf = lane, lane + lanes, lane + 2 lanes, ... of the B * seq tokens, K per round: K loads (of 16
// bytes when VEC), then K stores. Consecutive threads are consecutive columns of a token, so a warp
// covers 512 contiguous bytes on the token side and whole head rows on the head side. The column
// math (part, head, offset) is done once per thread; per token the only division (b = tf / seq) is
// a multiply-high by a magic number (permute_div). Byte strides sbB, stB, rowB and the thread count
// fit in 32 bits (the launcher checks, else the tiles run): addresses are 64-bit base + u32 * u32.
// K = 1, 2 or 4 (the launcher's choice); register budget pinned by __launch_bounds__: K <= 2: 8
// blocks (2048 threads) per SM, K = 4: 6; the launcher uses the same numbers (lanes_min_blocks in
// src/ops/permute.cpp).

// n / d for n < 2^31 and 1 <= d < 2^31: umulhi(2n, m) >> s with s = ceil(log2 d) and
// m = ceil(2^(31 + s) / d) < 2^32 (computed by the launcher; error < n / 2^(31 + s) < 1 / d).
KF_DEVICE u32 permute_div(u32 n, u32 m, u32 s) { return __umulhi(n << 1, m) >> s; }
// The same with s1 = s - 1 (d >= 2, or n = 0 with any m, s1): umulhi(n, m) >> (s - 1), one
// instruction less; the hot loop's b = tf / seq (the launcher makes seq >= 2 unless one token).
KF_DEVICE u32 permute_div_hot(u32 n, u32 m, u32 s1) { return __umulhi(n, m) >> s1; }

// a * b + c, u32 * u32 + u64 (one IMAD.WIDE.U32; plain C++ leaves zero-adds of the high word).
KF_DEVICE u64 permute_mad_wide(u32 a, u32 b, u64 c) {
  u64 d;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(d) : "r"(a), "r"(b), "l"(c));
  return d;
}

// One round of a lane: tokens tf0 + k * lanes, k < K (those < n when CHECK): K loads, then K stores.
template <typename T, int W, bool TO_HEADS, int K, bool CHECK>
KF_DEVICE void permute_lanes_round(u64 tbase, u64 hbase, u32 tf0, u32 lanes, u32 n, u32 ms, u32 ss,
                                   u32 nseq, u32 sbB, u32 stB, u32 rowB) {
  typename PermuteChunk<T, W>::type v[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const u32 tf = tf0 + k * lanes;
    if (!CHECK || tf < n) {
      const u32 b = permute_div_hot(tf, ms, ss), t = tf + b * nseq;
      v[k] = permute_load<T, W>(reinterpret_cast<const T*>(
          TO_HEADS ? permute_mad_wide(tf, rowB, tbase)
                   : permute_mad_wide(t, stB, permute_mad_wide(b, sbB, hbase))));
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const u32 tf = tf0 + k * lanes;
    if (!CHECK || tf < n) {
      const u32 b = permute_div_hot(tf, ms, ss), t = tf + b * nseq;
      permute_store<T, W>(
          reinterpret_cast<T*>(TO_HEADS ? permute_mad_wide(t, stB, permute_mad_wide(b, sbB, hbase))
                                        : permute_mad_wide(tf, rowB, tbase)),
          v[k]);
    }
  }
}

constexpr int permute_lanes_min_blocks(int K) { return K <= 2 ? 8 : 6; }

// tok: token-major (B * seq tokens of rowB bytes); h0, h1, h2: head-major parts with byte strides
// (sbB, shB, stB, 1 element). TO_HEADS: tok -> heads, else heads -> tok (the source is only read).
// m_* / s_*: permute_div magic numbers of cols, hsw (= HS / W) and NH; m_seq, s_seq (= s - 1):
// permute_div_hot magic of seq.
template <typename T, bool VEC, bool TO_HEADS, int K>
__global__ void __launch_bounds__(256, permute_lanes_min_blocks(K))
    permute_lanes_kernel(T* __restrict__ tok, T* __restrict__ h0, T* __restrict__ h1,
                         T* __restrict__ h2, int ntok, int lanes, int cols, int hsw, int NH,
                         int seq, int m_cols, int s_cols, int m_hsw, int s_hsw, int m_nh, int s_nh,
                         int m_seq, int s_seq, long long shB, int sbB_, int stB_, int rowB_) {
  kf_wait_prior_grids();
  constexpr int W = VEC ? Pack128<T>::size : 1;
  const u32 g = blockIdx.x * 256u + threadIdx.x;
  const u32 lane = permute_div(g, (u32)m_cols, (u32)s_cols);
  if (lane >= (u32)lanes) return;  // no block-wide synchronisation below
  const u32 col = g - lane * (u32)cols;
  const u32 ph = permute_div(col, (u32)m_hsw, (u32)s_hsw), c = col - ph * (u32)hsw;
  const u32 p = permute_div(ph, (u32)m_nh, (u32)s_nh), h = ph - p * (u32)NH;
  // 64-bit byte addresses as integers: per token, base + u32 * u32 products (IMAD.WIDE.U32).
  const u64 hbase = reinterpret_cast<u64>(p == 0 ? h0 : (p == 1 ? h1 : h2)) + (u64)((long long)h * shB) +
                    (u64)(c * (u32)(W * sizeof(T)));
  const u64 tbase = reinterpret_cast<u64>(tok) + (u64)col * (W * sizeof(T));
  const u32 sbB = (u32)sbB_, stB = (u32)stB_, rowB = (u32)rowB_, nseq = 0u - (u32)seq,
            n = (u32)ntok, ms = (u32)m_seq, ss = (u32)s_seq, ul = (u32)lanes;
  u32 tf0 = lane;
  for (; tf0 + (K - 1) * ul < n; tf0 += K * ul)  // whole rounds: K tokens, no bounds checks
    permute_lanes_round<T, W, TO_HEADS, K, false>(tbase, hbase, tf0, ul, n, ms, ss, nseq, sbB, stB, rowB);
  if (tf0 < n)  // the last, partial round
    permute_lanes_round<T, W, TO_HEADS, K, true>(tbase, hbase, tf0, ul, n, ms, ss, nseq, sbB, stB, rowB);
}
