// permute_plan.h: how a copy between token-major (B, T, parts * NH * HS) and head-major
// (B, NH, T, HS) tensors is launched, either way (see src/ops/permute.cpp). Pure host code.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "plan.h"

namespace kforge {
namespace permute_plan {
constexpr int64_t kTokensPerThread = 4;  // kPermuteK in kernels_src/permute.cu
constexpr int64_t kMaxBlockX = 512;      // tiles: columns per block
constexpr int64_t kTargetBlock = 256;    // tiles: threads per block when a token row is short

constexpr int kLanesBlock = 256;
// Blocks per SM pinned by permute_lanes_min_blocks(K) (__launch_bounds__) in kernels_src/permute.cu.
constexpr int lanes_min_blocks(int K) { return K <= 2 ? 8 : 6; }
}  // namespace permute_plan

// The persistent token lanes (permute_lanes_kernel) or the 64-bit tiles.
enum class PermuteLayout : uint8_t { lanes, tiles };
inline const char* layout_name(PermuteLayout l) {
  switch (l) {
    case PermuteLayout::lanes: return "lanes";
    case PermuteLayout::tiles: return "tiles";
  }
  return "";
}

struct PermutePlan : PlanWith<PermuteLayout> {
  bool vec = false, to_heads = false;  // 16-byte columns; tokens -> heads
  int64_t cols = 0;                    // columns of a token row (16-byte or single elements)
  // "lanes": K tokens per round and lane; a head row's columns; the token sequence the lanes
  // divide by (seq, with the heads' batch and token strides in bytes: a (B, 1) copy runs as one
  // sequence of B tokens) and the token row's bytes.
  int K = 0;
  int64_t lanes = 0, hsw = 0, seq = 0, sb_bytes = 0, st_bytes = 0, row_bytes = 0;
  // "tiles": token tiles per sequence, the (b, token tile) units blockIdx.y walks.
  int64_t tiles_per_seq = 0, units = 0;
};

inline const char* const kPermuteLayouts[] = {"lanes", "tiles"};

namespace permute_plan {
// The token lanes into p; false where their 32-bit byte strides, thread index or token counter do
// not fit (then the tiles run).
inline bool plan_lanes(PermutePlan& p, int64_t parts, int64_t B, int64_t T, int64_t NH, int64_t HS,
                       int64_t sb, int64_t st, int64_t es, int64_t sms) {
  const int64_t W = p.vec ? 16 / es : 1;
  const int64_t cols = p.cols, hsw = HS / W, ntok = B * T;
  int64_t seq = T;
  if (seq == 1) {  // (b, 0) -> (0, t = b): the token division only ever divides by seq >= 2
    seq = B;
    st = sb;
    sb = 0;
  }
  const int64_t rowB = parts * NH * HS * es, sbB = sb * es, stB = st * es;
  const int64_t u32max = int64_t(std::numeric_limits<uint32_t>::max());
  if (rowB > u32max || sbB > u32max || stB > u32max || sbB < 0 || stB < 0) return false;
  // K: the smallest of 1, 2, 4 that moves every token in one round of one wave, else 4 (rounds).
  auto lanes_max = [&](int K) {
    return std::max<int64_t>(1, sms * lanes_min_blocks(K) * kLanesBlock / cols);
  };
  int K = 1;
  while (K < 4 && ntok > K * lanes_max(K)) K *= 2;
  const int64_t rounds = (ntok + K * lanes_max(K) - 1) / (K * lanes_max(K));
  const int64_t lanes = (ntok + K * rounds - 1) / (K * rounds);  // <= lanes_max(K)
  const int64_t threads = lanes * cols;
  // 32-bit thread index (< 2^31, permute_div) and token counter (tf0 + K * lanes < 2^32).
  if (threads + kLanesBlock > std::numeric_limits<int>::max() || ntok + K * lanes > u32max)
    return false;
  p.set_layout(PermuteLayout::lanes);
  p.K = K, p.lanes = lanes, p.hsw = hsw, p.seq = seq;
  p.sb_bytes = sbB, p.st_bytes = stB, p.row_bytes = rowB;
  p.grid = plan_util::ceil_div_u(threads, kLanesBlock);
  p.block_x = kLanesBlock;
  return true;
}
}  // namespace permute_plan

// Copies between token-major `tokens` (B, T, parts * NH * HS) and `parts` head-major tensors
// (B, NH, T, HS) sharing the element strides sb, sh, st (last stride 1): tokens -> heads when
// to_heads, else heads -> tokens. B * T and the row are in [1, 2^31) (the launcher's checks);
// aligned: the tokens and every head tensor 16-byte aligned.
// The token lanes where they fit; else the tiles: the row's `cols` columns in the fewest chunks of
// <= 512 threads (blockIdx.x), as many token lanes per block as fit in 256 threads (blockDim.y;
// fewer for short sequences), 4 tokens per thread; blockIdx.y walks (b, token tile) units: at most
// about two waves of blocks, each block the same number of units.
// force_tiles: the tiles whatever the sizes (the testing override, so small shapes reach them).
inline PermutePlan plan_permute(bool to_heads, int64_t parts, int64_t B, int64_t T, int64_t NH,
                                int64_t HS, int64_t sb, int64_t sh, int64_t st, int64_t elem_size,
                                bool aligned, int64_t sms, bool force_tiles = false) {
  using namespace permute_plan;
  PermutePlan p;
  p.to_heads = to_heads;
  const int64_t V = 16 / elem_size, row = parts * NH * HS;
  p.vec = HS % V == 0 && aligned && sb % V == 0 && sh % V == 0 && st % V == 0;
  p.cols = p.vec ? row / V : row;
  if (!force_tiles && plan_lanes(p, parts, B, T, NH, HS, sb, st, elem_size, sms)) return p;
  const int64_t cols = p.cols;
  const int64_t nchunks = (cols + kMaxBlockX - 1) / kMaxBlockX;
  const int64_t bx = (cols + nchunks - 1) / nchunks;
  // Token lanes: fill ~256 threads, but no more than short sequences need.
  const int64_t by = std::max<int64_t>(
      1, std::min<int64_t>(kTargetBlock / bx, (T + kTokensPerThread - 1) / kTokensPerThread));
  p.tiles_per_seq = (T + kTokensPerThread * by - 1) / (kTokensPerThread * by);
  p.units = B * p.tiles_per_seq;
  const int64_t per_sm = std::max<int64_t>(1, 2048 / (bx * by));  // resident blocks, at best
  const int64_t cap =
      std::min<int64_t>(65535, std::max<int64_t>(1, sms * per_sm * 2 / nchunks));
  const int64_t iters = (p.units + cap - 1) / cap;
  p.set_layout(PermuteLayout::tiles);
  p.grid = static_cast<unsigned>(nchunks);
  p.grid_y = static_cast<unsigned>((p.units + iters - 1) / iters);
  p.block_x = static_cast<unsigned>(bx), p.block_y = static_cast<unsigned>(by);
  return p;
}

inline std::string permute_kernel_name(const PermutePlan& p) {
  const std::string v = p.vec ? "true" : "false";
  if (p.layout_id == PermuteLayout::lanes)
    return "permute_lanes_kernel<{T}, " + v + ", " + (p.to_heads ? "true" : "false") + ", " +
           std::to_string(p.K) + ">";
  return std::string(p.to_heads ? "permute_tokens_to_heads_kernel" : "permute_heads_to_tokens_kernel") +
         "<{T}, " + v + ">";
}

}  // namespace kforge
