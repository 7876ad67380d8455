// launch_params.cuh: the numbers a kernel and its launcher must agree on, in one place.
//
// Included by the kernel sources (NVRTC, from kernels_src at run time) and by the C++ launchers
// (src/ops/<op>.cpp, through the build's include path), so a launch bound, a block shape or a
// per-instantiation limit is written once. Plain constexpr values and functions only: no CUDA
// keywords and no includes, so both compilers take it as it is. The runtime hashes every header a
// kernel includes into its cache key: editing this file recompiles the kernels that include it (and
// the launchers need a rebuild of kforge._C).
#pragma once

// ---- layernorm (kernels_src/layernorm.cu, src/ops/layernorm.cpp) ---------------------------------
namespace kf_layernorm {
constexpr int ln_clamp(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

// BLOCK layout: elements a thread keeps in registers per row on the FITS path, and the most rows a
// block works on at once (blockDim.y; sizes the reduction scratch).
constexpr int kRegElems = 8;
constexpr int kMaxRowsPerBlock = 16;

// WARP layout, per instantiation (T, VEC, P units per lane; a unit is 16 bytes = 4 registers when
// VEC, else one element = 1 register). Forward: blocks of kFwdWarps warps, a warp taking ln_fwd_rows
// rows at once (their x units within 24 registers, at most 4), ln_fwd_blocks resident blocks per SM
// (the launch bound). Backward: a warp takes ln_bwd_rows rows at once (x and dout within 48
// registers, at most 4), ln_bwd_warps warps per SM (one block). The block / warp counts are the most
// that compile without spills (ptxas, sm_80 / sm_90): registers are split over the SM's 4 quarters,
// so n warps per quarter get at most 16384 / (32 n) each: 5 / 7 / 8 / 9 / 12 blocks -> 102 / 72 / 64
// / 56 / 40 registers; 12 / 16 / 20 / 24 warps -> 168 / 128 / 96 / 80.
constexpr int kFwdWarps = 4;
constexpr int kMaxBwdColumns = 32;  // columns a lane of the backward keeps sums for (P * pack)
constexpr int ln_unit_regs(bool vec) { return vec ? 4 : 1; }
constexpr int ln_fwd_rows(bool vec, int P) { return ln_clamp(24 / (P * ln_unit_regs(vec)), 1, 4); }
constexpr int ln_bwd_rows(bool vec, int P) { return ln_clamp(48 / (2 * P * ln_unit_regs(vec)), 1, 4); }
constexpr int ln_fwd_blocks(bool vec, int P) {
  return vec ? (P == 2 ? 7 : P == 4 ? 12 : P == 6 ? 9 : 8) : 5;
}
constexpr int ln_bwd_warps(bool vec, int P, int elem_size) {
  return vec ? (P == 4 && elem_size == 4 ? 24 : P == 8 || (P <= 3 && elem_size == 2) ? 16 : 20) : 12;
}

// GROUP layout: columns a thread; backward warps per block (its launch bound: 24 warps, 80
// registers, for fp32 16-byte units; 20, 96 registers, for scalars); forward blocks of at most
// kGroupFwdWarps warps, kGroupFwdBlocks of them resident per SM (56 registers).
constexpr int kGroupCols = 8;
constexpr int ln_group_bwd_warps(bool vec) { return vec ? 24 : 20; }
constexpr int kGroupFwdWarps = 12;
constexpr int kGroupFwdBlocks = 3;

// RING layout (bf16 / half backward): row slots a group, the launch bound (768 threads: 80
// registers), the row-sum scratch (float2 entries, double-buffered: >= max(NW, 4) G for every block
// the launcher makes with NW > 1: NW <= 4, G <= 12) and the longest rows it takes.
constexpr int kRingSlots = 4;
constexpr int kRingThreads = 768;
constexpr int kLnRingRed = 64;
constexpr int kRingStaticSmem = 2 * kLnRingRed * 8;  // bytes of that scratch
constexpr int kRingMaxC = 1024;

// Parameter-gradient reduce (16-byte loads): blockDim (kPgX float4 columns, kPgY partial rows).
constexpr int kPgX = 4, kPgY = 64;
}  // namespace kf_layernorm

// ---- colsum (kernels_src/colsum.cu, src/ops/colsum.cpp) -----------------------------------------
namespace kf_colsum {
constexpr int kColsumRows = 8;  // blockDim.y of both kernels: blocks of (32, kColsumRows)
}

// ---- cross_entropy (kernels_src/cross_entropy.cu, src/ops/cross_entropy.cpp) ----------------------
namespace kf_cross_entropy {
constexpr int kBwdThreads = 256;     // backward block size
constexpr int kBwdUnrollVec = 4;     // 16-byte packs per thread (64 bytes in flight)
constexpr int kBwdUnrollScalar = 2;  // element-wise "packs" (P loads each) per thread
// Fused forward + backward with the row in shared memory: block size, and the rows it takes (at
// most two blocks an SM at the top; below the bottom the L2 re-read of the register kernel hits).
constexpr int kSmemThreads = 512;
constexpr long long kSmemMinRowBytes = 16 * 1024;
constexpr long long kSmemMaxRowBytes = 112 * 1024;
}

// ---- gelu (kernels_src/gelu.cu, src/ops/gelu.cpp) -------------------------------------------------
namespace kf_gelu {
// Packs per thread and threads per block of the pack kernels; the launch bound's minimum of 8
// resident blocks per SM caps the registers at 32 (full occupancy) without spilling in both modes.
constexpr int kGeluP = 2;
constexpr int kGeluB = 256;
constexpr int kGeluMinBlocks = 8;
}

// ---- embedding (kernels_src/embedding.cu, src/ops/embedding.cpp) ----------------------------------
namespace kf_embedding {
constexpr int kEmbThreads = 256;     // block size: 8 warps
constexpr int kEmbIdxPerThread = 8;  // indices a thread tests per scan step (2048 a block-step)
constexpr int kEmbListCap = 4096;    // matched tokens a block keeps in shared memory
constexpr int kEmbMaxRows = 128;     // vocabulary rows a block owns (list keys are 8-bit)
constexpr int kEmbMinRows = 8;       // one row per warp: fewer only by splitting the channels
constexpr int kEmbMaxBlockItems = 8; // items (32 lanes' columns) of a row a block: one per warp
constexpr int kEmbHotRow = 128;      // tokens from which a row is summed by the whole block
}
