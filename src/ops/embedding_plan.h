// embedding_plan.h: how embedding_backward_kernel splits dW (V, C) over blocks (see
// src/ops/embedding.cpp). Pure host code.
#pragma once

#include <algorithm>
#include <string>

#include "launch_params.cuh"  // kernels_src/: kf_embedding, shared with embedding.cu
#include "plan.h"

namespace kforge {

// 16-byte packs of columns or single columns per lane.
enum class EmbeddingLayout : uint8_t { vec, scalar };
inline const char* layout_name(EmbeddingLayout l) {
  switch (l) {
    case EmbeddingLayout::vec: return "vec";
    case EmbeddingLayout::scalar: return "scalar";
  }
  return "";
}

// One launch of (tiles, chunks) blocks: block (x, y) owns rows [x * rows, (x + 1) * rows) of dW and
// items [y * block_items, (y + 1) * block_items) of each (an item: 32 lanes' columns, a lane's
// being a 16-byte pack when vec, else one column); `items` per row in all.
struct EmbeddingPlan : PlanWith<EmbeddingLayout> {
  int64_t rows = 0, items = 0, block_items = 0, tiles = 0, chunks = 0;
};

inline const char* const kEmbeddingLayouts[] = {"vec", "scalar"};

// The widest row: gridDim.y holds at most 65535 chunks of kEmbMaxBlockItems items of 32 columns
// (element-wise; 16-byte units go further). kforge/ops/embedding.py's checker says the same.
constexpr int64_t kEmbeddingMaxC = 65535LL * 32 * kf_embedding::kEmbMaxBlockItems;

// N tokens, rows of C columns of elem_size bytes, V rows of dW (N >= 0, C, V >= 1: the launcher
// launches nothing for an empty dW); aligned: grad 16-byte aligned.
inline EmbeddingPlan plan_embedding_backward(int64_t N, int64_t C, int64_t V, int64_t elem_size,
                                             bool aligned, int64_t sms) {
  using namespace kf_embedding;
  using plan_util::cdiv;
  (void)N;  // every block scans all N indices whatever the split
  EmbeddingPlan p;
  const int64_t pack = 16 / elem_size;
  const bool vec = C % pack == 0 && aligned;  // every row then starts 16-byte aligned
  p.set_layout(vec ? EmbeddingLayout::vec : EmbeddingLayout::scalar);
  p.items = cdiv(vec ? C / pack : C, 32);
  // Every block scans all N indices, so blocks are made as large as keeps about two per SM busy:
  // halve the rows a block owns (down to one per warp), then split each row's items (at most one
  // per warp in any case: a row of many tokens keeps one running sum per warp).
  const int64_t target = 2 * sms;
  p.rows = kEmbMaxRows, p.block_items = std::min<int64_t>(p.items, kEmbMaxBlockItems);
  auto blocks = [&] { return cdiv(V, p.rows) * cdiv(p.items, p.block_items); };
  while (blocks() < target && (p.rows > kEmbMinRows || p.block_items > 1)) {
    if (p.rows > kEmbMinRows) p.rows /= 2;
    else p.block_items = cdiv(p.block_items, 2);
  }
  p.tiles = cdiv(V, p.rows), p.chunks = cdiv(p.items, p.block_items);
  p.grid = p.tiles, p.grid_y = p.chunks;
  p.block_x = kEmbThreads;
  if (p.tiles > 2147483647LL) p.error = "too many row tiles (" + std::to_string(p.tiles) + ")";
  if (p.chunks > 65535) p.error = "too many column chunks (" + std::to_string(p.chunks) + ")";  // gridDim.y
  return p;
}

// idx32: int32 indices (else int64).
inline std::string embedding_kernel_name(const EmbeddingPlan& p, bool idx32) {
  return std::string("embedding_backward_kernel<{T}, ") + (idx32 ? "int" : "long long") + ", " +
         (p.layout_id == EmbeddingLayout::vec ? "true" : "false") + ">";
}

}  // namespace kforge
