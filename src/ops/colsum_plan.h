// colsum_plan.h: how the colsum kernels sum x viewed as (N, C) over its rows (see
// src/ops/colsum.cpp). Pure host code.
#pragma once

#include <algorithm>
#include <string>

#include "launch_params.cuh"  // kernels_src/: kColsumRows, shared with colsum.cu
#include "plan.h"

namespace kforge {

// 16-byte packs of columns or single columns per lane (colsum_partial_kernel's VEC).
enum class ColsumLayout : uint8_t { vec, scalar };
inline const char* layout_name(ColsumLayout l) {
  switch (l) {
    case ColsumLayout::vec: return "vec";
    case ColsumLayout::scalar: return "scalar";
  }
  return "";
}

// Two launches: grid / block are colsum_partial_kernel's, (tiles, G) blocks each summing up to
// rows_per_chunk rows of 32 lanes' columns into one of G fp32 partial rows; colsum_final_kernel
// then folds the G partial rows in final_grid blocks of the same block shape.
struct ColsumPlan : PlanWith<ColsumLayout> {
  int64_t tiles = 0, chunks = 0, rows_per_chunk = 0, G = 0;
  int64_t final_grid = 0;
};

inline const char* const kColsumLayouts[] = {"vec", "scalar"};

// N rows of C columns, both >= 1 (the launcher launches nothing for empty inputs), of elem_size
// bytes; aligned: x 16-byte aligned.
inline ColsumPlan plan_colsum(int64_t N, int64_t C, int64_t elem_size, bool aligned, int64_t sms) {
  using kf_colsum::kColsumRows;
  using plan_util::cdiv;
  ColsumPlan p;
  const int64_t pack = 16 / elem_size;
  const bool vec = C % pack == 0 && aligned;  // rows then start 16-byte aligned too
  p.set_layout(vec ? ColsumLayout::vec : ColsumLayout::scalar);
  const int64_t unit = vec ? pack : 1;
  p.tiles = cdiv(cdiv(C, unit), 32);
  // About 4 blocks of 256 threads per SM in all (one wave), each chunk a multiple of 32 rows (four
  // rows in flight per row slot) and at least 64, so the partial rows stay small next to x.
  const int64_t target = sms * 4;
  p.chunks = std::clamp<int64_t>(target / p.tiles, 1, std::max<int64_t>(1, cdiv(N, 64)));
  p.rows_per_chunk = cdiv(cdiv(N, p.chunks), 32) * 32;
  p.G = cdiv(N, p.rows_per_chunk);  // chunks actually used
  p.grid = p.tiles, p.grid_y = p.G;
  p.block_x = 32, p.block_y = kColsumRows;
  p.final_grid = cdiv(C, 32);
  if (p.G > 65535) p.error = "too many row chunks (" + std::to_string(p.G) + ")";  // gridDim.y
  return p;
}

inline std::string colsum_kernel_name(const ColsumPlan& p, bool final) {
  if (final) return "colsum_final_kernel<{T}>";
  return std::string("colsum_partial_kernel<{T}, ") +
         (p.layout_id == ColsumLayout::vec ? "true" : "false") + ">";
}

}  // namespace kforge
