// softmax_plan.h: which softmax kernel runs `rows` rows of C elements and how it is launched (see
// kernels_src/softmax.cu for the layouts). Pure host code.
#pragma once

#include <algorithm>
#include <string>

#include "plan.h"

namespace kforge {
namespace softmax_plan {
// Register-resident rows (x, y, dy sharing their 16-byte phase): one warp per row with P packs per
// lane, P in {1, 2, 4} and 8 for fp32 only (16-bit rows of 8 packs per lane would hold 64 fp32 values
// per thread), 4 rows per block; else one block per row, 4 packs per thread. Longer rows, and rows
// whose tensors differ in 16-byte phase, stream. Block sizes match the kernels' __launch_bounds__.
constexpr int kBlockP = 4, kMaxBlock = 512, kWarpBlock = 128;
constexpr int kWarpP[] = {1, 2, 4, 8};
// Plain 16-bit rows on 16-byte boundaries of 33..128 packs (forward): persistent warps, blocks of 16
// warps sized to the GPU (kWarpsPerSm blocks per SM), each warp a balanced range of rows staged
// through a ring of kWarpSlots row slots in shared memory; P = 2 or 4 packs per lane and row.
constexpr int kWarpsBlock = 512, kWarpsPerSm = 2, kWarpSlots = 2;
}  // namespace softmax_plan

// Forward and backward layouts (the backward has no persistent warps).
enum class SoftmaxLayout : uint8_t { warps, warp, block, stream };
inline const char* layout_name(SoftmaxLayout l) {
  switch (l) {
    case SoftmaxLayout::warps: return "warps";
    case SoftmaxLayout::warp: return "warp";
    case SoftmaxLayout::block: return "block";
    case SoftmaxLayout::stream: return "stream";
  }
  return "";
}

struct SoftmaxPlan : PlanWith<SoftmaxLayout> {
  int P = 0;                 // "warps" / "warp": packs per lane and row
  int64_t q = 0, r = 0;      // "warps": q rows a warp, the first r warps one more
};

inline const char* const kSoftmaxForwardLayouts[] = {"warps", "warp", "block", "stream"};
inline const char* const kSoftmaxBackwardLayouts[] = {"warp", "block", "stream"};

// rows of C elements of elem_size bytes (f32: float32); same_phase: every tensor at the same
// address modulo 16 (16-byte packs); aligned: x and y 16-byte aligned (the persistent-warps
// forward); causal: the fused causal attention softmax (never the persistent warps).
inline SoftmaxPlan plan_softmax(int64_t rows, int64_t C, int64_t elem_size, bool f32, bool forward,
                                bool causal, bool same_phase, bool aligned, int64_t sms) {
  using namespace softmax_plan;
  SoftmaxPlan p;
  if (forward && !causal && elem_size == 2 && C % 8 == 0 && aligned) {
    const int64_t packs = C / 8;
    const int P = packs > 32 && packs <= 64 ? 2 : packs > 64 && packs <= 128 ? 4 : 0;
    if (P) {
      constexpr int warps = kWarpsBlock / 32;
      const int64_t need = plan_util::ceil_div_u(rows, warps);  // blocks for one row per warp
      p.set_layout(SoftmaxLayout::warps);
      p.P = P;
      p.grid = std::max<int64_t>(std::min<int64_t>(need, sms * kWarpsPerSm), 1);
      p.block_x = kWarpsBlock;
      p.smem = int64_t(warps) * kWarpSlots * P * 32 * 16;
      const int64_t tw = p.grid * warps;  // rows = q * tw + r: q or q + 1 rows per warp
      p.q = rows / tw, p.r = rows % tw;
      return p;
    }
  }
  if (same_phase) {
    const int64_t V = 16 / elem_size;
    const int64_t packs = (C + V - 1) / V;  // >= whole packs of any split of the row
    for (int P : kWarpP) {
      if ((P != 8 || f32) && packs <= 32 * P) {
        p.set_layout(SoftmaxLayout::warp);
        p.P = P;
        p.grid = plan_util::ceil_div_u(rows, kWarpBlock / 32);
        p.block_x = kWarpBlock;
        return p;
      }
    }
    if (packs <= int64_t(kMaxBlock) * kBlockP) {
      p.set_layout(SoftmaxLayout::block);
      p.grid = static_cast<unsigned>(rows);
      p.block_x = plan_util::ceil_div_u(packs, kBlockP * 32) * 32;  // whole warps
      return p;
    }
  }
  p.set_layout(SoftmaxLayout::stream);
  p.grid = static_cast<unsigned>(rows);
  p.block_x = kMaxBlock;
  return p;
}

inline std::string softmax_kernel_name(const SoftmaxPlan& p, bool forward) {
  const std::string dir = forward ? "forward" : "backward";
  using L = SoftmaxLayout;
  const std::string P = std::to_string(p.P);
  if (p.layout_id == L::warps) return "softmax_forward_warps_kernel<{T}, " + P + ", 2>";
  if (p.layout_id == L::warp) return "softmax_" + dir + "_kernel<{T}, " + P + ", true>";
  if (p.layout_id == L::block) return "softmax_" + dir + "_kernel<{T}, 4, false>";
  return "softmax_" + dir + "_stream_kernel<{T}>";
}

}  // namespace kforge
