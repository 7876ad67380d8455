// cross_entropy_plan.h: how the cross_entropy kernels are launched on (N, V) logits (see
// src/ops/cross_entropy.cpp). Pure host code.
#pragma once

#include <algorithm>
#include <limits>
#include <string>

#include "launch_params.cuh"  // kernels_src/: the backward's block shape, shared with the kernel
#include "plan.h"

namespace kforge {

// row: forward / fused; smem: fused with the row in shared memory; vec / scalar: backward.
enum class CrossEntropyLayout : uint8_t { row, smem, vec, scalar };
inline const char* layout_name(CrossEntropyLayout l) {
  switch (l) {
    case CrossEntropyLayout::row: return "row";
    case CrossEntropyLayout::smem: return "smem";
    case CrossEntropyLayout::vec: return "vec";
    case CrossEntropyLayout::scalar: return "scalar";
  }
  return "";
}

struct CrossEntropyPlan : PlanWith<CrossEntropyLayout> {
  bool vec = false;                         // 16-byte packs (backward / fused)
  long long chunks = 1, chunk_packs = 0;    // backward: a row's packs in `chunks` equal chunks
};

inline const char* const kCrossEntropyForwardLayouts[] = {"row"};
inline const char* const kCrossEntropyForwardBackwardLayouts[] = {"row", "smem"};
inline const char* const kCrossEntropyBackwardLayouts[] = {"vec", "scalar"};

// Forward and fused forward + backward: one block per row, one 16-byte pack per thread for short
// rows, 512 threads for long ones. same_phase (fused): logits and dlogits at the same address
// modulo 16, passed to the kernel (16-byte packs). fused: rows of kSmemMinRowBytes ..
// kSmemMaxRowBytes with same_phase take the shared-memory kernel (the row, plus up to 15 bytes of
// its offset from a 16-byte boundary, in dynamic shared memory).
inline CrossEntropyPlan plan_cross_entropy_forward(long long N, long long V, int64_t elem_size,
                                                   bool same_phase = false, bool fused = false) {
  using namespace kf_cross_entropy;
  CrossEntropyPlan p;
  const int64_t bytes = V * elem_size, packs = (bytes + 15) / 16;
  p.vec = same_phase;
  p.grid = static_cast<unsigned>(N);
  if (fused && same_phase && bytes >= kSmemMinRowBytes && bytes <= kSmemMaxRowBytes) {
    p.set_layout(CrossEntropyLayout::smem);
    p.block_x = kSmemThreads;
    p.smem = packs * 16 + 16;
    return p;
  }
  p.set_layout(CrossEntropyLayout::row);
  p.block_x = static_cast<unsigned>(std::clamp<int64_t>((packs + 31) / 32 * 32, 32, 512));
  return p;
}

// Backward, one block per (row, chunk) item: 16-byte packs when logits and dlogits share their
// address modulo 16 (same_phase), else element-wise; a row's packs split into equal chunks of at
// most one block's worth (threads x unroll packs). The launcher checks N * chunks fits gridDim.x.
inline CrossEntropyPlan plan_cross_entropy_backward(long long N, long long V, int64_t elem_size,
                                                    bool same_phase) {
  using namespace kf_cross_entropy;
  CrossEntropyPlan p;
  p.vec = same_phase;
  p.set_layout(p.vec ? CrossEntropyLayout::vec : CrossEntropyLayout::scalar);
  const long long pack = 16 / elem_size;
  const long long max_packs = std::max<long long>(1, (V + pack - 1) / pack);  // >= packs of any row split
  const long long cap = static_cast<long long>(kBwdThreads) * (p.vec ? kBwdUnrollVec : kBwdUnrollScalar);
  p.chunks = (max_packs + cap - 1) / cap;
  p.chunk_packs = (max_packs + p.chunks - 1) / p.chunks;
  p.grid = static_cast<unsigned>(N * p.chunks);
  p.block_x = kBwdThreads;
  // One block per item: N * chunks blocks fit gridDim.x for any tensor that fits in memory (a row of
  // two or more chunks has >= 1024 elements per chunk, so 2^31 items would be >= 2^41 elements).
  if (N * p.chunks > std::numeric_limits<int>::max())
    p.error = "too many (row, chunk) work items: " + std::to_string(N * p.chunks);
  return p;
}

inline std::string cross_entropy_kernel_name(const CrossEntropyPlan& p, const std::string& which) {
  const std::string v = p.vec ? "true" : "false";
  if (which == "forward") return "cross_entropy_forward_kernel<{T}, false>";
  if (which == "forward_backward")
    return p.layout_id == CrossEntropyLayout::smem ? "cross_entropy_fused_smem_kernel<{T}>"
                                                   : "cross_entropy_forward_kernel<{T}, true>";
  return "cross_entropy_backward_kernel<{T}, " + v + ">";
}

}  // namespace kforge
