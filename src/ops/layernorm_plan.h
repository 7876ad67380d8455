// layernorm_plan.h: which layernorm kernel runs a (N, C) input and how it is launched (see
// src/ops/layernorm.cpp for the layouts and the timings behind them). Pure host code.
#pragma once

#include <algorithm>
#include <climits>
#include <string>

#include "launch_params.cuh"  // kernels_src/: the constants layernorm.cu is compiled with
#include "plan.h"

namespace kforge {
namespace ln_plan {
using namespace kf_layernorm;
using plan_util::cdiv;

// The launchers' testing override `variant`: 0 the layouts above; 1 never GROUP / RING, the layouts
// the default falls back to past their int row index (WARP where it fits, else BLOCK).
constexpr int64_t kDefault = 0, kNoGroup = 1, kNumVariants = 2;

// WARP layout units per lane P: 16-byte units (VEC) or single elements. Backward units are limited
// to 32 columns a lane (P * pack <= 32), so P = 6, 8 exist for float only.
constexpr int kVecP[] = {2, 3, 4, 6, 8};
constexpr int kScalarP[] = {32};
constexpr int kNumVecP = 5, kNumScalarP = 1;

// Launcher-only limits (the kernels' own numbers: launch_params.cuh).
constexpr int64_t kMaxC = int64_t(1) << 30;  // keeps every in-row index (and 2C) in an int
constexpr int kMaxNamedBarrierGroups = 15;   // groups of several warps sync on bar.sync 1..15
constexpr int64_t kMaxGroupRows = int64_t(1) << 30;  // GROUP kernels index rows with int

// LnWarpCfg<T, VEC, P> of kernels_src/layernorm.cu.
struct WarpCfg {
  int fwd_rows, bwd_rows, fwd_blocks, bwd_warps;
};
inline WarpCfg ln_warp_cfg(bool vec, int P, int64_t elem_size) {
  return {ln_fwd_rows(vec, P), ln_bwd_rows(vec, P), ln_fwd_blocks(vec, P),
          ln_bwd_warps(vec, P, static_cast<int>(elem_size))};
}

// Warps per SM for `chunks` work items (a chunk: the rows a warp takes at once) on `sms` SMs with at
// most `max_per_sm` warps each: the fewest that still need the same number of rounds (a warp does
// one chunk per round), so the last round is nearly full.
inline int64_t balanced_warps_per_sm(int64_t chunks, int64_t sms, int64_t max_per_sm) {
  const int64_t rounds = cdiv(chunks, sms * max_per_sm);
  return std::max<int64_t>(1, std::min(max_per_sm, cdiv(chunks, sms * rounds)));
}

// GROUP layout: threads per row (a multiple of 32 covering the row at kGroupCols columns a thread).
inline int64_t group_tpr(int64_t C, bool vec, int64_t elem_size) {
  const int64_t V = vec ? 16 / elem_size : 1, P = kGroupCols / V;
  return 32 * cdiv(cdiv(C / V, P), 32);
}

// 16-byte units: C a multiple of the pack (rows then start 16-byte aligned too) and aligned pointers.
inline bool vec_ok(int64_t C, int64_t elem_size, bool aligned) {
  return aligned && C % (16 / elem_size) == 0;
}

// WARP layout choice: index into kVecP / kScalarP of the smallest P covering a row, or -1 when the
// row is too long for it (BLOCK layout then).
struct WarpChoice {
  int index = -1;
  int P = 0;
};
inline WarpChoice warp_choice(int64_t C, int64_t elem_size, bool vec, bool backward) {
  WarpChoice w;
  const int64_t V = vec ? 16 / elem_size : 1;
  const int64_t need = (C / V + 31) / 32;  // units per lane
  const int* ps = vec ? kVecP : kScalarP;
  const int n = vec ? kNumVecP : kNumScalarP;
  for (int i = 0; i < n; ++i) {
    if (ps[i] < need) continue;
    if (backward && ps[i] * V > kMaxBwdColumns) break;
    w.index = i;
    w.P = ps[i];
    break;
  }
  return w;
}

// How a row is split over a block in the BLOCK layout.
struct RowLayout {
  bool vec;   // 16-byte units
  bool fits;  // a thread's units fit in kRegElems registers
  int tpr;    // threads per row (blockDim.x)
};
inline RowLayout row_layout(int64_t C, int64_t elem_size, bool aligned) {
  RowLayout L;
  L.vec = vec_ok(C, elem_size, aligned);
  const int64_t v = L.vec ? 16 / elem_size : 1, units = C / v, regs = kRegElems / v;
  const int64_t tpr_fit = (plan_util::ceil_div_u(units, regs) + 31) / 32 * 32;
  L.fits = tpr_fit <= 512;  // FITS kernels are launch-bounded to 512 threads
  L.tpr = static_cast<int>(L.fits ? tpr_fit : 1024);
  return L;
}
}  // namespace ln_plan

// Kernel template arguments on top of the launch: VEC for every layout, the WARP layout's P (and
// its index in the launcher's tables), the BLOCK layout's FITS; RING's row ranges (q rows a group,
// the first r groups one more).
// Forward and backward layouts (the forward has no ring).
enum class LayernormLayout : uint8_t { ring, group, warp, block };
inline const char* layout_name(LayernormLayout l) {
  switch (l) {
    case LayernormLayout::ring: return "ring";
    case LayernormLayout::group: return "group";
    case LayernormLayout::warp: return "warp";
    case LayernormLayout::block: return "block";
  }
  return "";
}

struct LayernormPlan : PlanWith<LayernormLayout> {
  bool vec = false, fits = false;
  int warp_index = -1, P = 0;
  int64_t ring_q = 0, ring_r = 0;
};

inline const char* const kLayernormForwardLayouts[] = {"group", "warp", "block"};
inline const char* const kLayernormBackwardLayouts[] = {"ring", "group", "warp", "block"};

// Forward of N rows of C elements (elem_size bytes; aligned: every pointer 16-byte aligned) on a
// device of `sms` SMs. max_warps, variant: the testing override (0, 0: the launcher's own choice).
inline LayernormPlan plan_layernorm_forward(int64_t N, int64_t C, int64_t es, bool aligned,
                                            int64_t sms, int64_t max_warps = 0,
                                            int64_t variant = ln_plan::kDefault) {
  using namespace ln_plan;
  LayernormPlan p;
  const bool vec = vec_ok(C, es, aligned);
  p.vec = vec;
  const WarpChoice wp = warp_choice(C, es, vec, /*backward=*/false);

  // GROUP (fp32): blocks of up to kGroupFwdWarps warps (G groups of tpr threads), kGroupFwdBlocks
  // resident per SM, as few groups per SM as keep the same number of rounds; groups loop beyond.
  const int64_t tpr = group_tpr(C, vec, es);
  if (variant != kNoGroup && es == 4 && wp.index >= 0 && N <= kMaxGroupRows &&
      tpr <= 32 * kGroupFwdWarps) {
    const int64_t nw = tpr / 32;
    int64_t G = 32 * kGroupFwdWarps / tpr;
    if (nw > 1) G = std::min<int64_t>(G, kMaxNamedBarrierGroups);
    int64_t most = kGroupFwdBlocks * G;  // groups per SM
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(1, max_warps / nw));
    G = std::min(G, most);
    const int64_t per_sm = balanced_warps_per_sm(N, sms, most);
    p.set_layout(LayernormLayout::group);
    p.grid = std::min(cdiv(N, G), sms * cdiv(per_sm, G));
    p.block_x = tpr, p.block_y = G;
    return p;
  }

  if (wp.index >= 0) {
    // WARP: warps of fwd_rows rows each, kFwdWarps per block; no more blocks than stay resident (the
    // kernel's launch bound), as few per SM as keep the same number of rounds.
    const WarpCfg cfg = ln_warp_cfg(vec, wp.P, es);
    const int64_t chunks = cdiv(N, cfg.fwd_rows);
    int64_t most = int64_t(cfg.fwd_blocks) * kFwdWarps;
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(kFwdWarps, max_warps));
    const int64_t per_sm = balanced_warps_per_sm(chunks, sms, most);
    p.set_layout(LayernormLayout::warp);
    p.warp_index = wp.index, p.P = wp.P;
    p.grid = std::min(cdiv(chunks, kFwdWarps), sms * cdiv(per_sm, kFwdWarps));
    p.block_x = 32, p.block_y = kFwdWarps;
    return p;
  }

  const RowLayout L = row_layout(C, es, aligned);
  // Small blocks pack the SMs best; several rows per block when rows are short.
  const int rows = L.fits ? std::clamp(256 / L.tpr, 1, kMaxRowsPerBlock) : 1;
  p.set_layout(LayernormLayout::block);
  p.vec = L.vec, p.fits = L.fits;
  p.grid = static_cast<unsigned>(std::min<int64_t>((N + rows - 1) / rows, INT32_MAX));
  p.block_x = L.tpr, p.block_y = rows;
  return p;
}

// Backward; need_partial: a weight or bias gradient is wanted (the kernels then leave per-block
// partial rows, which the launcher reduces over p.grid rows); smem_optin: the device's opt-in
// shared memory per block.
inline LayernormPlan plan_layernorm_backward(int64_t N, int64_t C, int64_t es, bool aligned,
                                             bool need_partial, int64_t sms, int64_t smem_optin,
                                             int64_t max_warps = 0,
                                             int64_t variant = ln_plan::kDefault) {
  using namespace ln_plan;
  LayernormPlan p;
  const bool vec = vec_ok(C, es, aligned);
  p.vec = vec;
  const WarpChoice wp = warp_choice(C, es, vec, /*backward=*/true);

  // RING (bf16 / half, 16-byte units, C <= kRingMaxC): one block per SM of G groups (tpr threads
  // each), as many groups as the shared memory holds (kRingSlots row slots of x and dout each, at
  // most 16 KiB; the fold at the end reuses it) and the launch bound allows, as few as keep the
  // same number of rounds; the N rows split into contiguous ranges of q or q + 1 rows, one per
  // group.
  if (variant != kNoGroup && es == 2 && vec && C <= kRingMaxC && N < (int64_t(1) << 31)) {
    const int64_t units = C / 8;
    const int64_t rtpr = 32 * cdiv(units, 32);
    const int64_t ring_bytes = int64_t(kRingSlots) * 2 * units * 16;  // a group's slots
    const int64_t fold_bytes = 2 * 8 * 4 * rtpr;                      // a group's column sums
    const int64_t per_group = std::max(ring_bytes, fold_bytes);
    const int64_t budget = smem_optin - kRingStaticSmem;
    int64_t most = std::min<int64_t>(kRingThreads / rtpr, budget / per_group);
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(1, max_warps / (rtpr / 32)));
    p.set_layout(LayernormLayout::ring);
    if (most < 1) {
      p.error = "a row of " + std::to_string(C) + " columns needs " +
                std::to_string(per_group + kRingStaticSmem) +
                " bytes of shared memory, the device has " + std::to_string(smem_optin);
      return p;
    }
    const int64_t G = balanced_warps_per_sm(N, sms, most);
    p.grid = std::min(sms, cdiv(N, G));
    const int64_t groups = p.grid * G;
    p.block_x = rtpr, p.block_y = G;
    p.smem = G * per_group;
    p.ring_q = N / groups, p.ring_r = N % groups;
    return p;
  }

  // GROUP (rows the WARP layout would fit): one block per SM of G groups (tpr threads each), as few
  // groups per SM as keep the same number of rounds. The block's column sums take 64 bytes of
  // shared memory per thread.
  const int gwarps = ln_group_bwd_warps(vec);
  const int64_t tpr = group_tpr(C, vec, es);
  if (variant != kNoGroup && wp.index >= 0 && N <= kMaxGroupRows && tpr <= 32 * gwarps) {
    const int64_t nw = tpr / 32;
    int64_t most = 32 * gwarps / tpr;  // groups per SM
    if (nw > 1) most = std::min<int64_t>(most, kMaxNamedBarrierGroups);
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(1, max_warps / nw));
    const int64_t G = balanced_warps_per_sm(N, sms, most);
    p.set_layout(LayernormLayout::group);
    p.grid = std::min(sms, cdiv(N, G));
    p.block_x = tpr, p.block_y = G;
    p.smem = need_partial ? G * tpr * 2 * kGroupCols * int64_t(sizeof(float)) : 0;
    return p;
  }

  if (wp.index >= 0) {
    // WARP, persistent: at most one block per SM, warps of bwd_rows rows each, as few per SM as keep
    // the same number of rounds. A warp's column sums take 32 * P * pack floats of shared memory
    // for dweight and as many for dbias, which may cap the warps of a block.
    const WarpCfg cfg = ln_warp_cfg(vec, wp.P, es);
    const int64_t chunks = cdiv(N, cfg.bwd_rows);
    const int64_t pack = vec ? 16 / es : 1;
    const int64_t warp_smem = 2 * 32 * wp.P * pack * int64_t(sizeof(float));
    int64_t most = cfg.bwd_warps;
    if (max_warps > 0) most = std::min(most, max_warps);
    if (need_partial) most = std::clamp<int64_t>(smem_optin / warp_smem, 1, most);
    const int64_t warps = balanced_warps_per_sm(chunks, sms, most);
    p.set_layout(LayernormLayout::warp);
    p.warp_index = wp.index, p.P = wp.P;
    p.grid = std::min(sms, cdiv(chunks, warps));
    p.block_x = 32, p.block_y = warps;
    p.smem = need_partial ? warps * warp_smem : 0;
    return p;
  }

  const RowLayout L = row_layout(C, es, aligned);
  // More rows per block than the forward: each block leaves one partial row of 2C floats, so the
  // grid should be about one wave of resident blocks, each looping over several row groups.
  const int rows = L.fits ? std::clamp(512 / L.tpr, 1, kMaxRowsPerBlock) : 1;
  const int64_t threads = int64_t(L.tpr) * rows;
  // ~1024 resident threads per SM (the FITS backward uses up to 64 registers per thread); at
  // most one partial row per 8 rows, so the scratch never outgrows the input.
  const int64_t max_grid = std::max<int64_t>(
      1, std::min<int64_t>(sms * std::max<int64_t>(1, 1024 / threads), (N + 7) / 8));
  const int64_t groups = (N + rows - 1) / rows;
  const int64_t iters = (groups + max_grid - 1) / max_grid;
  p.set_layout(LayernormLayout::block);
  p.vec = L.vec, p.fits = L.fits;
  p.grid = (groups + iters - 1) / iters;  // every block gets `iters` groups (last: fewer)
  p.block_x = L.tpr, p.block_y = rows;
  // FITS folds the row slots' column sums in shared memory: 2C floats (C <= 4096 there: 32 KiB).
  p.smem = L.fits && need_partial ? 2 * C * int64_t(sizeof(float)) : 0;
  return p;
}

// The kernel a plan launches, as its name expression ({T}: the element type).
inline std::string layernorm_kernel_name(const LayernormPlan& p, bool forward) {
  const std::string dir = forward ? "forward" : "backward";
  const std::string v = p.vec ? "true" : "false";
  using L = LayernormLayout;
  if (p.layout_id == L::ring) return "layernorm_backward_ring_kernel<{T}>";
  if (p.layout_id == L::group) return "layernorm_" + dir + "_group_kernel<{T}, " + v + ">";
  if (p.layout_id == L::warp)
    return "layernorm_" + dir + "_warp_kernel<{T}, " + v + ", " + std::to_string(p.P) + ">";
  return "layernorm_" + dir + "_kernel<{T}, " + v + ", " + (p.fits ? "true" : "false") + ">";
}

}  // namespace kforge
