// gqa: grouped-query attention head expansion (Hugging Face repeat_kv). Forward: x (B, Hkv, T, D) ->
// out (B, Hkv * n_rep, T, D), out[:, h] = x[:, h / n_rep]. Backward: dx[:, j] = sum over r < n_rep of
// dout[:, j * n_rep + r], added in order of r in fp32 (deterministic). Nothing is saved.
//
// Forward layout: a 1-D grid walks units grid-stride; unit = (slab s = b * Hkv + h, rep group g,
// tile), tile fastest. A slab's T rows x D columns are cut into chunks (16 bytes when `vec`, else one
// element); a tile is 256 threads x K chunks: warp w takes 32 * K consecutive chunks, lane l chunks
// l + 32 k. Each thread issues its K loads, then writes them to every rep r of group g (out head
// h * n_rep + r): per rep a warp writes K * 512 contiguous bytes (when `vec`). With one group of
// n_rep reps (the default) x is read once; with n_rep groups of one rep the output is written in
// address order and x re-read from L2 n_rep times (`reps` picks). x may be strided in B, Hkv and T
// (a transposed (B, T, Hkv, D) view); out is contiguous.
// Backward layout: blockIdx.y walks the (b, kv head) slabs, the x-dimension of the grid walks the
// slab in chunks; the backward reads n_rep chunks and writes one. dout and dx are contiguous.
#include "common.cuh"

constexpr int kGqaFwdK = 4;  // chunks per thread in the forward

template <typename T, int W> struct GqaChunk { typedef Pack128<T> type; };
template <typename T> struct GqaChunk<T, 1> { typedef T type; };

template <typename T, int W>
KF_DEVICE void gqa_forward_units(const T* __restrict__ x, T* __restrict__ out, int Hkv, int n_rep,
                                 int reps, int Tn, int D, long long sb, long long sh, long long st,
                                 int tiles, long long units) {
  constexpr int K = kGqaFwdK;
  typedef typename GqaChunk<T, W>::type Chunk;
  const int nchunk = D / W;
  const int per_slab = Tn * nchunk;  // the launcher keeps a slab under 2^30 elements
  const long long slab_elems = (long long)Tn * D;
  const int groups = (n_rep + reps - 1) / reps;
  const bool once = groups == 1;  // x read once: streaming loads
  const int first = (threadIdx.x >> 5) * (32 * K) + (threadIdx.x & 31);  // chunk within the tile
  const int dt = 32 / nchunk, dc = 32 - dt * nchunk;  // 32 chunks = dt rows + dc columns
  for (long long u = blockIdx.x; u < units; u += gridDim.x) {
    const long long q = u / tiles;
    const int tile = (int)(u - q * tiles);
    const long long s = q / groups;
    const int g = (int)(q - s * groups);
    const long long b = s / Hkv, h = s - b * Hkv;
    const T* src = x + b * sb + h * sh;
    const int i0 = tile * (32 * K * (int)(blockDim.x >> 5)) + first;
    int t = i0 / nchunk, c = i0 - t * nchunk;
    Chunk v[K];
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if (i0 + 32 * k < per_slab) {
        const T* p = src + t * st + c * W;
        if constexpr (W > 1)
          v[k] = once ? load128cs(p) : load128(p);
        else
          v[k] = *p;
      }
      t += dt;
      c += dc;
      if (c >= nchunk) {
        c -= nchunk;
        ++t;
      }
    }
    const int r0 = g * reps, r1 = min(n_rep, r0 + reps);
    T* dst = out + (s * n_rep + r0) * slab_elems + (long long)i0 * W;
    for (int r = r0; r < r1; ++r, dst += slab_elems) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (i0 + 32 * k < per_slab) {
          if constexpr (W > 1)
            store128cs(dst + 32 * k * W, v[k]);
          else
            dst[32 * k] = v[k];
        }
      }
    }
  }
}

// Layout above; `reps` output heads per unit (n_rep: x read once), `tiles` tiles per slab, `units` =
// B * Hkv * ceil(n_rep / reps) * tiles. blockDim.x is a multiple of 32.
template <typename T>
__global__ void gqa_forward_kernel(const T* __restrict__ x, T* __restrict__ out, int Hkv, int n_rep,
                                   int reps, int Tn, int D, long long sb, long long sh, long long st,
                                   int tiles, long long units, int vec) {
  kf_wait_prior_grids();
  if (vec)
    gqa_forward_units<T, Pack128<T>::size>(x, out, Hkv, n_rep, reps, Tn, D, sb, sh, st, tiles, units);
  else
    gqa_forward_units<T, 1>(x, out, Hkv, n_rep, reps, Tn, D, sb, sh, st, tiles, units);
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
  kf_wait_prior_grids();
  if (vec)
    gqa_backward_slabs<T, Pack128<T>::size>(dout, dx, n_rep, slab_elems, slabs);
  else
    gqa_backward_slabs<T, 1>(dout, dx, n_rep, slab_elems, slabs);
}
