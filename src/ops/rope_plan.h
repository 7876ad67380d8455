// rope_plan.h: which rope kernel rotates q (B, Hq, T, D) and k (B, Hkv, T, D) and how it is
// launched (see src/ops/rope.cpp). Pure host code.
#pragma once

#include <algorithm>
#include <string>

#include "plan.h"

namespace kforge {
namespace rope_plan {
constexpr int64_t kTileHeads = 8, kTileThreads = 256;  // U of rope_tile_kernel, its block size
constexpr int64_t kHeadsInFlight = 4;                  // as in kernels_src/rope.cu
}  // namespace rope_plan

// The tiled or the per-token kernel.
enum class RopeLayout : uint8_t { tile, token };
inline const char* layout_name(RopeLayout l) {
  switch (l) {
    case RopeLayout::tile: return "tile";
    case RopeLayout::token: return "token";
  }
  return "";
}

struct RopePlan : PlanWith<RopeLayout> {
  int64_t ntiles = 0, q_groups = 0;  // "tile": token tiles, q's head groups (grid.y beyond: k's)
  bool f32tab = false, interleaved = false;
};

inline const char* const kRopeLayouts[] = {"tile", "token"};

// vec: 16-byte chunks for every head row (and rotate_half's second half) of q, k and the outputs;
// tvec: the cos / sin rows too; f32tab: fp32 tables for 16-bit q / k.
inline RopePlan plan_rope(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                          int64_t elem_size, bool interleaved, bool vec, bool tvec, bool f32tab) {
  using namespace rope_plan;
  RopePlan p;
  p.f32tab = f32tab, p.interleaved = interleaved;
  const int64_t V = 16 / elem_size, H = Hq + Hkv;
  // Tiled kernel: 16-byte aligned rows and table rows, a row's chunks within one block (at most
  // 256 chunks of 16 bytes), head groups within grid.y; threadIdx.x over the row's 16-byte chunks,
  // threadIdx.y over a tile of consecutive tokens.
  const int64_t U = kTileHeads;
  const int64_t nchunk16 = (interleaved ? D : D / 2) / V;
  const int64_t gq = (Hq + U - 1) / U, groups = gq + (Hkv + U - 1) / U;
  if (vec && tvec && nchunk16 <= kTileThreads && groups <= 65535) {
    const int64_t ntok = B * T, bx = nchunk16;
    const int64_t by = std::min<int64_t>(kTileThreads / bx, ntok);
    p.set_layout(RopeLayout::tile);
    p.ntiles = (ntok + by - 1) / by, p.q_groups = gq;
    p.grid = p.ntiles;
    p.grid_y = groups;
    p.block_x = bx, p.block_y = by;
    return p;
  }
  // Per-token kernel: threadIdx.x over a row's chunks, threadIdx.y over heads, each thread
  // kHeadsInFlight heads at a time (the kernel's batch; any block shape is correct, this one leaves
  // few slots idle).
  const int64_t width = vec ? V : (interleaved ? 2 : 1);
  const int64_t nchunk = (interleaved ? D : D / 2) / width;
  const unsigned tx = static_cast<unsigned>(std::min<int64_t>(nchunk, 128));
  int64_t ty = std::min<int64_t>(std::max<int64_t>(1, 128 / tx), (H + kHeadsInFlight - 1) / kHeadsInFlight);
  const int64_t batches = (H + kHeadsInFlight * ty - 1) / (kHeadsInFlight * ty);
  ty = (H + kHeadsInFlight * batches - 1) / (kHeadsInFlight * batches);
  p.set_layout(RopeLayout::token);
  p.grid = static_cast<unsigned>(B * T);
  p.block_x = tx, p.block_y = ty;
  return p;
}

inline std::string rope_kernel_name(const RopePlan& p) {
  if (p.layout_id == RopeLayout::tile)
    return std::string(p.f32tab ? "rope_tile_f32tab_kernel" : "rope_tile_kernel") + "<{T}, 8, " +
           (p.interleaved ? "true" : "false") + ">";
  return std::string(p.f32tab ? "rope_f32tab_kernel" : "rope_kernel") + "<{T}>";
}

}  // namespace kforge
