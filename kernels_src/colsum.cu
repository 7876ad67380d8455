// colsum: out[c] = sum over rows r of x[r, c] for x viewed as (N, C) (every dim but the last summed):
// a linear layer's bias gradient. fp32 accumulation, rounded once to T; deterministic (fixed order,
// no atomics): colsum_partial_kernel leaves one fp32 partial row per chunk of rows, and
// colsum_final_kernel adds the chunks' partial rows in chunk order.
// Layout (partial): blockDim (32, 8). blockIdx.x picks a tile of 32 column units (a unit is a 16-byte
// pack when VEC, else one column); lane threadIdx.x owns one unit of the tile, so a warp reads one
// contiguous 512-byte span of a row; threadIdx.y strides over the rows of the chunk blockIdx.y, four
// rows' loads in flight per thread. The 8 row slots are then added in slot order in shared memory.
#include "common.cuh"

constexpr int kColsumRows = 8;  // blockDim.y; src/ops/colsum.cpp launches (32, kColsumRows)

template <typename T, bool VEC>
__global__ void __launch_bounds__(32 * kColsumRows)
    colsum_partial_kernel(const T* __restrict__ x, float* __restrict__ partial, long long N, int C,
                          long long rows_per_chunk) {
  constexpr int U = VEC ? Pack128<T>::size : 1;  // columns per unit
  __shared__ float red[kColsumRows][32 * U];
  const int unit = blockIdx.x * 32 + threadIdx.x;
  const int c0 = unit * U;
  const bool active = c0 < C;
  const long long r_begin = (long long)blockIdx.y * rows_per_chunk;
  const long long r_end = r_begin + rows_per_chunk < N ? r_begin + rows_per_chunk : N;
  float acc[U];
#pragma unroll
  for (int i = 0; i < U; ++i) acc[i] = 0.0f;
  if (active) {
    constexpr int R = 4;  // rows in flight per thread
    long long r = r_begin + threadIdx.y;
    for (; r + (R - 1) * kColsumRows < r_end; r += R * kColsumRows) {
      if constexpr (VEC) {
        Pack128<T> p[R];
#pragma unroll
        for (int k = 0; k < R; ++k) p[k] = load128cs(x + (r + k * kColsumRows) * C + c0);
#pragma unroll
        for (int k = 0; k < R; ++k)
#pragma unroll
          for (int i = 0; i < U; ++i) acc[i] += p[k].f(i);
      } else {
        float v[R];
#pragma unroll
        for (int k = 0; k < R; ++k) v[k] = to_float(x[(r + k * kColsumRows) * C + c0]);
#pragma unroll
        for (int k = 0; k < R; ++k) acc[0] += v[k];
      }
    }
    for (; r < r_end; r += kColsumRows) {
      if constexpr (VEC) {
        const Pack128<T> p = load128cs(x + r * C + c0);
#pragma unroll
        for (int i = 0; i < U; ++i) acc[i] += p.f(i);
      } else {
        acc[0] += to_float(x[r * C + c0]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < U; ++i) red[threadIdx.y][threadIdx.x * U + i] = acc[i];
  __syncthreads();
  // Row slots in slot order; the block's 256 threads write the tile's 32 * U columns.
  float* prow = partial + (long long)blockIdx.y * C;
  for (int j = threadIdx.y * 32 + threadIdx.x; j < 32 * U; j += 32 * kColsumRows) {
    const int c = blockIdx.x * 32 * U + j;
    if (c < C) {
      float s = 0.0f;
#pragma unroll
      for (int y = 0; y < kColsumRows; ++y) s += red[y][j];
      prow[c] = s;
    }
  }
}

// out[c] = sum of the G partial rows' column c, in chunk order; one thread per column.
template <typename T>
__global__ void colsum_final_kernel(const float* __restrict__ partial, T* __restrict__ out, int G,
                                    int C) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= C) return;
  float s = 0.0f;
  for (int g = 0; g < G; ++g) s += partial[(long long)g * C + c];
  out[c] = from_float<T>(s);
}
