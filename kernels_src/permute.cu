// permute: the attention QKV split and head merge, as copies between two layouts of the same data:
//   token-major: (B, T, P, NH, HS), i.e. qkv (B, T, 3C) with P = 3, or y (B, T, C) with P = 1;
//   head-major:  P separate tensors (B, NH, T, HS): q, k, v, or y per head; contiguous, or any
//                strides (sb, sh, st) shared by the P parts with a unit last stride (e.g. the
//                token-major gradients flash attention returns for q, k, v given as views).
// split_qkv forward and merge_heads backward copy token-major -> head-major; split_qkv backward and
// merge_heads forward copy head-major -> token-major. Nothing is saved for backward: the backward of
// each copy is the inverse copy.
//
// Layout: a token row (P * NH * HS elements) is cut into `cols` columns of W elements (W = 16 bytes
// when HS and the pointers allow, else one element); column j is part p, head h, offset c in HS.
// blockIdx.x picks a chunk of blockDim.x consecutive columns (the column math, with its divisions,
// is done once per thread); blockIdx.y walks (b, tile of K * blockDim.y tokens) grid-stride, and
// thread (x, y) moves its column of tokens y, y + blockDim.y, ... of the tile: K loads, then K
// stores. A warp covers 32 consecutive columns of one token: 512 contiguous bytes on the token
// side, whole head rows (128 bytes for bf16 HS = 64) on the head side, and a block's tile is
// K * blockDim.y consecutive tokens, contiguous on both sides. Offsets are 64-bit.
#include "common.cuh"

constexpr int kPermuteK = 4;  // tokens per thread

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
  permute_tiles<T, VEC ? Pack128<T>::size : 1, false>(dst, const_cast<T*>(h0), const_cast<T*>(h1),
                                                       const_cast<T*>(h2), seq, NH, HS, cols,
                                                       tiles_per_seq, units, sb, sh, st);
}
