// gqa: grouped-query attention head expansion (Hugging Face repeat_kv). Forward: x (B, Hkv, T, D) ->
// out (B, Hkv * n_rep, T, D), out[:, h] = x[:, h / n_rep]. Backward: dx[:, j] = sum over r < n_rep of
// dout[:, j * n_rep + r], added in order of r in fp32 (deterministic). Nothing is saved.
//
// Layout (both directions): blockIdx.y walks the (b, kv head) slabs, the x-dimension of the grid
// walks the slab's T rows x D columns in chunks (16 bytes when `vec`, else one element); the forward
// reads each input chunk once and writes it n_rep times, the backward reads n_rep chunks and writes
// one. The input of the forward may be strided in B, Hkv and T (a transposed (B, T, Hkv, D) view);
// every other tensor is contiguous.
#include "common.cuh"

template <typename T, int W>
KF_DEVICE void gqa_forward_slabs(const T* __restrict__ x, T* __restrict__ out, int Hkv, int n_rep,
                                 int Tn, int D, long long sb, long long sh, long long st,
                                 long long slabs) {
  const int nchunk = D / W;
  const int per_slab = Tn * nchunk;  // the launcher keeps a slab under 2^31 elements
  const long long slab_elems = (long long)Tn * D;
  for (long long s = blockIdx.y; s < slabs; s += gridDim.y) {
    const long long b = s / Hkv, h = s - b * Hkv;
    const T* src = x + b * sb + h * sh;
    T* dst = out + s * n_rep * slab_elems;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < per_slab; i += gridDim.x * blockDim.x) {
      const int t = i / nchunk, c = i - t * nchunk;
      const int o = t * D + c * W;
      if constexpr (W > 1) {
        const Pack128<T> v = load128cs(src + t * st + c * W);
        for (int r = 0; r < n_rep; ++r) store128(dst + r * slab_elems + o, v);
      } else {
        const T v = src[t * st + c];
        for (int r = 0; r < n_rep; ++r) dst[r * slab_elems + o] = v;
      }
    }
  }
}

template <typename T>
__global__ void gqa_forward_kernel(const T* __restrict__ x, T* __restrict__ out, int Hkv, int n_rep,
                                   int Tn, int D, long long sb, long long sh, long long st,
                                   long long slabs, int vec) {
  if (vec)
    gqa_forward_slabs<T, Pack128<T>::size>(x, out, Hkv, n_rep, Tn, D, sb, sh, st, slabs);
  else
    gqa_forward_slabs<T, 1>(x, out, Hkv, n_rep, Tn, D, sb, sh, st, slabs);
}

template <typename T, int W>
KF_DEVICE void gqa_backward_slabs(const T* __restrict__ dout, T* __restrict__ dx, int n_rep,
                                  long long slab_elems, long long slabs) {
  const int per_slab = (int)(slab_elems / W);
  for (long long s = blockIdx.y; s < slabs; s += gridDim.y) {
    const T* src = dout + s * n_rep * slab_elems;
    T* dst = dx + s * slab_elems;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < per_slab; i += gridDim.x * blockDim.x) {
      float acc[W];
#pragma unroll
      for (int j = 0; j < W; ++j) acc[j] = 0.0f;
      for (int r = 0; r < n_rep; ++r) {
        if constexpr (W > 1) {
          const Pack128<T> v = load128cs(src + r * slab_elems + i * W);
#pragma unroll
          for (int j = 0; j < W; ++j) acc[j] += v.f(j);
        } else {
          acc[0] += to_float(src[r * slab_elems + i]);
        }
      }
      if constexpr (W > 1) {
        Pack128<T> v;
#pragma unroll
        for (int j = 0; j < W; ++j) v.set(j, acc[j]);
        store128(dst + i * W, v);
      } else {
        dst[i] = from_float<T>(acc[0]);
      }
    }
  }
}

template <typename T>
__global__ void gqa_backward_kernel(const T* __restrict__ dout, T* __restrict__ dx, int n_rep,
                                    long long slab_elems, long long slabs, int vec) {
  if (vec)
    gqa_backward_slabs<T, Pack128<T>::size>(dout, dx, n_rep, slab_elems, slabs);
  else
    gqa_backward_slabs<T, 1>(dout, dx, n_rep, slab_elems, slabs);
}
