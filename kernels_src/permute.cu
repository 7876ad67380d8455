// permute: the attention QKV split and head merge, as copies between two layouts of the same data:
//   token-major: (B, T, P, NH, HS), i.e. qkv (B, T, 3C) with P = 3, or y (B, T, C) with P = 1;
//   head-major:  P separate contiguous tensors (B, NH, T, HS): q, k, v, or y per head.
// split_qkv forward and merge_heads backward copy token-major -> head-major; split_qkv backward and
// merge_heads forward copy head-major -> token-major. Nothing is saved for backward: the backward of
// each copy is the inverse copy.
// Layout: one block per (b, t) token, its P * NH * HS elements walked in 16-byte packs when HS and
// the pointers allow (`vec`), else element by element. The token-major side is one contiguous run;
// the head-major side is NH * P runs of HS elements (128 bytes for bf16 HS = 64).
#include "common.cuh"

template <typename T>
KF_DEVICE T* head_part(T* h0, T* h1, T* h2, int p) {
  return p == 0 ? h0 : (p == 1 ? h1 : h2);
}

// One block per token row b * seq + t: src (token-major) -> h0, h1, h2 (head-major; P = parts).
template <typename T>
__global__ void permute_tokens_to_heads_kernel(const T* __restrict__ src, T* __restrict__ h0,
                                               T* __restrict__ h1, T* __restrict__ h2, int seq,
                                               int parts, int NH, int HS, int vec) {
  constexpr int V = Pack128<T>::size;
  const long long row = blockIdx.x;
  const long long b = row / seq;
  const int t = (int)(row % seq);
  const int G = vec ? V : 1;              // elements per step
  const int hs_steps = HS / G;            // HS % V == 0 when vec
  const int steps = parts * NH * hs_steps;
  const T* s = src + row * ((long long)parts * NH * HS);
  for (int j = threadIdx.x; j < steps; j += blockDim.x) {
    const int ph = j / hs_steps, hs = (j - ph * hs_steps) * G;  // ph = p * NH + h
    const int p = ph / NH, h = ph - p * NH;
    T* d = head_part(h0, h1, h2, p) + ((b * NH + h) * seq + t) * HS + hs;
    if (vec)
      store128(d, load128cs(s + (long long)j * V));
    else
      *d = s[j];
  }
}

// One block per token row b * seq + t: h0, h1, h2 (head-major) -> dst (token-major).
template <typename T>
__global__ void permute_heads_to_tokens_kernel(const T* __restrict__ h0, const T* __restrict__ h1,
                                               const T* __restrict__ h2, T* __restrict__ dst, int seq,
                                               int parts, int NH, int HS, int vec) {
  constexpr int V = Pack128<T>::size;
  const long long row = blockIdx.x;
  const long long b = row / seq;
  const int t = (int)(row % seq);
  const int G = vec ? V : 1;
  const int hs_steps = HS / G;
  const int steps = parts * NH * hs_steps;
  T* d = dst + row * ((long long)parts * NH * HS);
  for (int j = threadIdx.x; j < steps; j += blockDim.x) {
    const int ph = j / hs_steps, hs = (j - ph * hs_steps) * G;
    const int p = ph / NH, h = ph - p * NH;
    const T* s = head_part(h0, h1, h2, p) + ((b * NH + h) * seq + t) * HS + hs;
    if (vec)
      store128(d + (long long)j * V, load128cs(s));
    else
      d[j] = *s;
  }
}
