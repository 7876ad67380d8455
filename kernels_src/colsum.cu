// colsum: out[c] = sum over rows r of x[r, c] for x viewed as (N, C) (every dim but the last summed):
// a linear layer's bias gradient. fp32 accumulation, rounded once to T; deterministic (fixed order,
// no atomics): colsum_partial_kernel leaves one fp32 partial row per chunk of rows, and
// colsum_final_kernel adds the chunks' partial rows in a fixed order.
// Layout (partial): blockDim (32, 8). blockIdx.x picks a tile of 32 column units (a unit is a 16-byte
// pack when VEC, else one column); lane threadIdx.x owns one unit of the tile, so a warp reads one
// contiguous 512-byte span of a row; threadIdx.y strides over the rows of the chunk blockIdx.y, four
// rows' loads in flight per thread. The 8 row slots are then added in slot order in shared memory.
#include "common.cuh"
#include "launch_params.cuh"

using kf_colsum::kColsumRows;  // blockDim.y; shared with src/ops/colsum.cpp

template <typename T, bool VEC>
__global__ void __launch_bounds__(32 * kColsumRows)
    colsum_partial_kernel(const T* __restrict__ x, float* __restrict__ partial, long long N, int C,
                          long long rows_per_chunk) {
  kf_wait_prior_grids();
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
    // R rows' loads in flight per thread: every load of a step is issued (guarded, not branched
    // around) before the adds, tail included, so no step serialises on one load's latency.
    constexpr int R = 4;
    for (long long r = r_begin + threadIdx.y; r < r_end; r += R * kColsumRows) {
      if constexpr (VEC) {
        Pack128<T> p[R];
#pragma unroll
        for (int k = 0; k < R; ++k) {
          const long long rk = r + k * kColsumRows;
          if (rk < r_end) p[k] = load128cs(x + rk * C + c0);
          else p[k] = Pack128<T>{};
        }
#pragma unroll
        for (int k = 0; k < R; ++k)
#pragma unroll
          for (int i = 0; i < U; ++i) acc[i] += p[k].f(i);
      } else {
        float v[R];
#pragma unroll
        for (int k = 0; k < R; ++k) {
          const long long rk = r + k * kColsumRows;
          v[k] = rk < r_end ? to_float(x[rk * C + c0]) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < R; ++k) acc[0] += v[k];
      }
    }
  }
  kf_allow_dependents();  // colsum_final_kernel's blocks may be scheduled now (they wait for us)
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

// out[c] = sum of the G partial rows' column c, in a fixed order. blockDim (32, kColsumRows): lane x
// owns column blockIdx.x * 32 + x, row slot y adds chunks y, y + 8, ... (eight loads in flight), and
// the slots are added in slot order: a fixed order for every launch.
template <typename T>
__global__ void __launch_bounds__(32 * kColsumRows)
    colsum_final_kernel(const float* __restrict__ partial, T* __restrict__ out, int G, int C) {
  kf_wait_prior_grids();
  __shared__ float red[kColsumRows][32];
  const int c = blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < C) {
    constexpr int R = 8;
    for (int g = threadIdx.y; g < G; g += R * kColsumRows) {
      float v[R];
#pragma unroll
      for (int k = 0; k < R; ++k) {
        const int gk = g + k * kColsumRows;
        v[k] = gk < G ? partial[(long long)gk * C + c] : 0.0f;
      }
#pragma unroll
      for (int k = 0; k < R; ++k) s += v[k];
    }
  }
  red[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float t = 0.0f;
#pragma unroll
    for (int y = 0; y < kColsumRows; ++y) t += red[y][threadIdx.x];
    out[c] = from_float<T>(t);
  }
}
