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
// lives in registers between the reduction and the output pass). `vec`: 16-byte accesses (D % V == 0
// and every pointer 16-byte aligned, checked by the launcher); otherwise chunks are moved element-wise
// and the last one is cut at D.
#include "common.cuh"

template <typename T>
KF_DEVICE Pack128<T> load_chunk(const T* row, int c, int D, int vec, bool streaming) {
  constexpr int V = Pack128<T>::size;
  if (vec) return streaming ? load128cs(row + c * V) : load128(row + c * V);
  Pack128<T> p;
#pragma unroll
  for (int i = 0; i < V; ++i) p[i] = c * V + i < D ? row[c * V + i] : from_float<T>(0.0f);
  return p;
}

template <typename T>
KF_DEVICE void store_chunk(T* row, int c, int D, int vec, const Pack128<T>& p) {
  constexpr int V = Pack128<T>::size;
  if (vec) {
    store128(row + c * V, p);
    return;
  }
#pragma unroll
  for (int i = 0; i < V; ++i)
    if (c * V + i < D) row[c * V + i] = p[i];
}

// Weight chunk, or ones when there is no weight.
template <typename T>
KF_DEVICE Pack128<T> weight_chunk(const T* weight, int c, int D, int vec) {
  if (weight) return load_chunk(weight, c, D, vec, false);
  Pack128<T> p;
#pragma unroll
  for (int i = 0; i < Pack128<T>::size; ++i) p[i] = from_float<T>(1.0f);
  return p;
}

// x as stored in T and read back (the identity for float).
template <typename T>
KF_DEVICE float round_to(float x) { return to_float(from_float<T>(x)); }

// Sum over the blockDim.x threads of this thread's row, in a fixed order. Every thread of the block
// must call it (it synchronises the block when a row spans several warps). `scratch`: 32 floats.
KF_DEVICE float row_sum(float v, float* scratch) {
  v = warp_sum(v);
  if (blockDim.x == 32) return v;
  const int warps_per_row = blockDim.x >> 5;
  const int first = threadIdx.y * warps_per_row;
  __syncthreads();  // scratch may still be read by the previous call
  if ((threadIdx.x & 31) == 0) scratch[first + (threadIdx.x >> 5)] = v;
  __syncthreads();
  float s = 0.0f;
  for (int w = 0; w < warps_per_row; ++w) s += scratch[first + w];
  return s;
}

// Layout: blockDim.y rows per block, blockDim.x threads per row, K chunks per thread in registers.
template <typename T, int K>
__global__ void __launch_bounds__(256)
    rmsnorm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight, T* __restrict__ y,
                           float* __restrict__ rstd, long long rows, int D, float eps, int vec,
                           int cast_before_weight) {
  constexpr int V = Pack128<T>::size;
  __shared__ float scratch[32];
  const int nchunk = (D + V - 1) / V;
  const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
  const bool live = row < rows;  // dead rows still take part in row_sum's barriers
  const T* xr = x + row * D;

  Pack128<T> xc[K];
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (live && c < nchunk) {
      xc[k] = load_chunk(xr, c, D, vec, true);
#pragma unroll
      for (int i = 0; i < V; ++i) ss += xc[k].f(i) * xc[k].f(i);
    }
  }
  const float r = rsqrtf(row_sum(ss, scratch) / (float)D + eps);
  if (!live) return;
  if (threadIdx.x == 0) rstd[row] = r;

  T* yr = y + row * D;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int c = threadIdx.x + k * blockDim.x;
    if (c < nchunk) {
      const Pack128<T> w = weight_chunk(weight, c, D, vec);
      Pack128<T> out;
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float n = xc[k].f(i) * r;
        out.set(i, cast_before_weight ? w.f(i) * round_to<T>(n) : n * w.f(i));
      }
      store_chunk(yr, c, D, vec, out);
    }
  }
}

// Layout: persistent grid; blockDim.y rows at a time per block, blockDim.x threads per row, K chunks
// per thread. A thread owns the same columns in every row it visits, so it keeps their dweight sums in
// registers; at the end the block folds them over threadIdx.y (in order) through `fold`
// (blockDim.x * V floats of dynamic shared memory) into dw_partial row blockIdx.x (fp32, D wide).
template <typename T, int K>
__global__ void __launch_bounds__(K == 1 ? 1024 : 512)
    rmsnorm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                            const T* __restrict__ weight, const float* __restrict__ rstd,
                            T* __restrict__ dx, float* __restrict__ dw_partial, long long rows, int D,
                            int vec, int cast_before_weight) {
  constexpr int V = Pack128<T>::size;
  __shared__ float scratch[32];
  extern __shared__ float fold[];
  const int nchunk = (D + V - 1) / V;
  const float inv_d = 1.0f / (float)D;

  float acc[K][V];
#pragma unroll
  for (int k = 0; k < K; ++k)
#pragma unroll
    for (int i = 0; i < V; ++i) acc[k][i] = 0.0f;

  // The loop bound is the same for the whole block (row_sum synchronises it).
  const long long step = (long long)gridDim.x * blockDim.y;
  for (long long base = (long long)blockIdx.x * blockDim.y; base < rows; base += step) {
    const long long row = base + threadIdx.y;
    const bool live = row < rows;
    const float r = live ? rstd[row] : 0.0f;
    const T* xr = x + row * D;
    const T* dyr = dy + row * D;

    Pack128<T> xc[K], gc[K];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (live && c < nchunk) {
        xc[k] = load_chunk(xr, c, D, vec, false);
        gc[k] = load_chunk(dyr, c, D, vec, true);
        const Pack128<T> w = weight_chunk(weight, c, D, vec);  // L1-resident: same columns every row
#pragma unroll
        for (int i = 0; i < V; ++i) dot += gc[k].f(i) * w.f(i) * (xc[k].f(i) * r);
      }
    }
    const float mean_gx = row_sum(dot, scratch) * inv_d;
    if (!live) continue;

    T* dxr = dx + row * D;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      const int c = threadIdx.x + k * blockDim.x;
      if (c < nchunk) {
        const Pack128<T> w = weight_chunk(weight, c, D, vec);
        Pack128<T> out;
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float xh = xc[k].f(i) * r;
          const float d = gc[k].f(i);
          out.set(i, r * (d * w.f(i) - xh * mean_gx));
          acc[k][i] += d * (cast_before_weight ? round_to<T>(xh) : xh);
        }
        store_chunk(dxr, c, D, vec, out);
      }
    }
  }

  if (dw_partial == nullptr) return;  // no weight: nothing to reduce (uniform over the block)
  float* part = dw_partial + (long long)blockIdx.x * D;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    for (int yy = 0; yy < (int)blockDim.y; ++yy) {
      if (threadIdx.y == yy) {
#pragma unroll
        for (int i = 0; i < V; ++i)
          fold[threadIdx.x * V + i] = (yy == 0 ? 0.0f : fold[threadIdx.x * V + i]) + acc[k][i];
      }
      __syncthreads();
    }
    const int c = threadIdx.x + k * blockDim.x;
    if (threadIdx.y == 0 && c < nchunk) {
#pragma unroll
      for (int i = 0; i < V; ++i)
        if (c * V + i < D) part[c * V + i] = fold[threadIdx.x * V + i];
    }
    __syncthreads();  // fold is rewritten for the next k
  }
}

// dweight[j] = sum over g of partial[g][j], in a fixed order.
// Layout: block (32, 16); thread (x, y) sums partial rows y, y + 16, ... of column blockIdx.x * 32 + x,
// then the 16 sums of a column are added in order of y.
constexpr int kDwRows = 16;
template <typename T>
__global__ void rmsnorm_dweight_kernel(const float* __restrict__ partial, T* __restrict__ dweight,
                                       int G, int D) {
  __shared__ float s[kDwRows][33];
  const int j = blockIdx.x * 32 + threadIdx.x;
  float a = 0.0f;
  if (j < D)
    for (int g = threadIdx.y; g < G; g += kDwRows) a += partial[(long long)g * D + j];
  s[threadIdx.y][threadIdx.x] = a;
  __syncthreads();
  if (threadIdx.y == 0 && j < D) {
    float t = 0.0f;
#pragma unroll
    for (int yy = 0; yy < kDwRows; ++yy) t += s[yy][threadIdx.x];
    dweight[j] = from_float<T>(t);
  }
}
