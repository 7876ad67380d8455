// gelu_plan.h: how the gelu kernels are launched on n elements (see src/ops/gelu.cpp). Pure host
// code.
#pragma once

#include <algorithm>
#include <limits>
#include <string>

#include "launch_params.cuh"  // kernels_src/: kGeluP, kGeluB, shared with gelu.cu
#include "plan.h"

namespace kforge {

// 16-byte packs or the scalar grid-stride kernel.
enum class GeluLayout : uint8_t { packs, scalar };
inline const char* layout_name(GeluLayout l) {
  switch (l) {
    case GeluLayout::packs: return "packs";
    case GeluLayout::scalar: return "scalar";
  }
  return "";
}

using GeluPlan = PlanWith<GeluLayout>;

inline const char* const kGeluLayouts[] = {"packs", "scalar"};

// aligned: every pointer 16-byte aligned. "packs": one block per kGeluP * kGeluB packs, plus one
// (partial or empty) block that also writes the scalar tail. "scalar": a few resident waves of
// 256-thread blocks (at most 16 per SM); the grid-stride loops cover the rest, so any numel
// (including > 2^31) works.
inline GeluPlan plan_gelu(int64_t n, int64_t elem_size, bool aligned, int64_t sms) {
  using namespace kf_gelu;
  GeluPlan p;
  if (!aligned) {
    p.set_layout(GeluLayout::scalar);
    p.block_x = 256;
    p.grid = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, sms * 16)));
    return p;
  }
  const int64_t blocks = n / (16 / elem_size) / (int64_t(kGeluP) * kGeluB) + 1;
  p.set_layout(GeluLayout::packs);
  p.block_x = kGeluB;
  p.grid = static_cast<unsigned>(blocks);
  if (blocks > std::numeric_limits<int>::max()) p.error = "too many elements: " + std::to_string(n);
  return p;
}

inline std::string gelu_kernel_name(const GeluPlan& p, bool forward, bool erf) {
  return std::string("gelu_") + (forward ? "forward" : "backward") +
         (p.layout_id == GeluLayout::scalar ? "_scalar" : "") + "_kernel<{T}, " +
         (erf ? "true" : "false") + ">";
}

}  // namespace kforge
