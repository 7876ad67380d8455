// rmsnorm_plan.h: which rmsnorm kernel runs `rows` rows of D elements and how it is launched (see
// src/ops/rmsnorm.cpp for the kernel tables). Pure host code.
#pragma once

#include <algorithm>
#include <limits>
#include <string>

#include "plan.h"

namespace kforge {
namespace rms_plan {
constexpr int kFwdK[] = {1, 2, 4, 8};
constexpr int kBwdThreads = 512;  // MAXT of every backward kernel
constexpr int kPipeMaxChunks = 1024;
constexpr int kRingMaxChunks = 1024;
struct RingShape {
  int K, S, NT;
};
constexpr RingShape kRingShort{4, 3, 384}, kRingLong{2, 3, 512};
// Longest row, in 16-byte chunks: 16384 bf16/fp16 or 8192 fp32 elements.
constexpr int kMaxChunks = 2048;

// The testing override `variant` of the backward.
enum BwdVariant : int64_t {
  kDefault = 0,   // the ring where it applies, else the fallbacks
  kFallback = 1,  // never the ring: the kernels that take the inputs the ring does not (tests)
  kPlain = 2,     // the plain kernel even for 16-byte rows (its fallback past 4 GiB a grid step; tests)
  kNumVariants = 3,
};

// rmsnorm_backward_kernel's R (rows per group at a time) for K chunks per thread: what fits in
// registers without spilling (ptxas, sm_80 / sm_90): fewer rows for element-wise access and for
// 16-bit types at K = 4. src/ops/rmsnorm.cpp instantiates exactly these.
constexpr int bwd_rows(int K, bool vec, bool f32) {
  return K == 1 ? 4 : K == 2 ? (vec ? 4 : 2) : (f32 && vec ? 2 : 1);
}
}  // namespace rms_plan

// warp / block: forward; ring / pipelined / plain: backward.
enum class RmsnormLayout : uint8_t { warp, block, ring, pipelined, plain };
inline const char* layout_name(RmsnormLayout l) {
  switch (l) {
    case RmsnormLayout::warp: return "warp";
    case RmsnormLayout::block: return "block";
    case RmsnormLayout::ring: return "ring";
    case RmsnormLayout::pipelined: return "pipelined";
    case RmsnormLayout::plain: return "plain";
  }
  return "";
}

struct RmsnormPlan : PlanWith<RmsnormLayout> {
  int K = 0;               // chunks per thread and row
  bool vec = false;        // 16-byte accesses
  bool res = false;        // residual fused (forward) / dresidual added (backward)
  bool cbw = false;        // backward: cast_before_weight as instantiated (false for fp32)
  int R = 0;               // "plain" backward: rows per group at a time
  int P = 0;               // "pipelined": rows in flight
  bool keep_g = false;     // "pipelined": g kept in registers
  int S = 0, NT = 0;       // "ring": stages, block-size bound
};

inline const char* const kRmsnormForwardLayouts[] = {"warp", "block"};
inline const char* const kRmsnormBackwardLayouts[] = {"ring", "pipelined", "plain"};

// Forward: one warp per row (8 rows per block) up to 256 chunks, with the fewest chunks per thread
// that fit; longer rows one block of <= 256 threads each, 8 chunks per thread (4 where that wastes
// fewer threads): the more of a row each thread loads at once, the more bytes each SM has in flight.
// nchunk: 16-byte chunks per row (rounded up); vec: 16-byte accesses.
inline RmsnormPlan plan_rmsnorm_forward(int64_t rows, int nchunk, bool vec, bool res) {
  using namespace rms_plan;
  using plan_util::round32;
  RmsnormPlan p;
  p.vec = vec, p.res = res;
  unsigned tx = 0, ty = 1;
  if (nchunk <= 32 * 8) {
    for (int i = 0; i < 4; ++i)
      if (nchunk <= 32 * kFwdK[i]) {
        p.K = kFwdK[i], tx = 32, ty = 8;
        break;
      }
    p.set_layout(RmsnormLayout::warp);
  } else {
    const unsigned tx4 = round32((nchunk + 3) / 4), tx8 = round32((nchunk + 7) / 8);
    if (tx4 <= 256 && 4 * tx4 < 8 * tx8)
      p.K = 4, tx = tx4;
    else
      p.K = 8, tx = tx8;
    p.set_layout(RmsnormLayout::block);
  }
  p.block_x = tx, p.block_y = ty;
  p.grid = plan_util::ceil_div_u(rows, ty);
  if ((rows + ty - 1) / ty > std::numeric_limits<int>::max())  // gridDim.x
    p.error = "too many rows: " + std::to_string(rows);
  return p;
}

// Backward of `rows` rows of D elements of elem_size bytes (f32: float32) on a device of `sms` SMs
// and `smem_optin` bytes of opt-in shared memory per block. The ring where it applies; elsewhere
// the pipelined kernel (16-byte rows of <= 1024 chunks), else rmsnorm_backward_kernel ("plain").
// dy_terms (2 or 3, float32 only): dy is that many 16-bit tensors summed by the ring kernel (its
// NY); the caller sums them with torch where the plan is not the ring.
inline RmsnormPlan plan_rmsnorm_backward(int64_t rows, int64_t D, int64_t elem_size, bool f32,
                                         bool vec, bool cbw, bool res, int64_t sms,
                                         int64_t smem_optin,
                                         int64_t variant = rms_plan::kDefault, int dy_terms = 0) {
  using namespace rms_plan;
  using plan_util::round32;
  RmsnormPlan p;
  const int64_t V = 16 / elem_size;
  const int nchunk = static_cast<int>((D + V - 1) / V);
  p.vec = vec, p.res = res, p.cbw = cbw && !f32;

  // Ring: a row group of `groups` rows of tx threads per block, tx = the thread count for K chunks
  // each, a multiple of 32 or a power of two below 32 (the kernel's reductions rely on it); the
  // stages in dynamic shared memory (see the kernel); a persistent grid of one block per SM (at most
  // the row groups). Not applied to element-wise access, rows longer than kRingMaxChunks, shared
  // memory beyond the device's limit, or a tensor too large for the kernel's 32-bit row step. res:
  // stages of three arrays (x, dy, dres) instead of two; the longest stages need an H100's opt-in
  // shared memory (sm_80 takes the pipelined kernel there). dy_terms: dy's array is 8 bytes a chunk
  // per term, and where the stages would not fit, a block takes fewer rows at a time.
  if (variant == kDefault && vec && nchunk <= kRingMaxChunks && (dy_terms == 0 || f32)) {
    const RingShape sh = nchunk > 512 ? kRingLong : kRingShort;
    int tx = (nchunk + sh.K - 1) / sh.K;
    if (tx <= 32) {
      int t = 1;
      while (t < tx) t *= 2;
      tx = t;
    } else {
      tx = static_cast<int>(round32(tx));
    }
    int groups = sh.NT / tx;  // tx <= NT: nchunk <= K * NT for every shape
    const size_t slot_bytes = 16 + (dy_terms ? 8 * size_t(dy_terms) : 16) + (res ? 16 : 0);
    const auto smem_of = [&](int g) {
      const int nseg = tx >= 32 ? tx * g / 32 : g;
      return size_t(sh.S) * (slot_bytes * g * tx * sh.K + size_t(nseg) * 4);
    };
    const size_t static_smem = size_t(2) * sh.NT;  // red[2][NT / 4] floats
    if (dy_terms)
      while (groups > 1 && smem_of(groups) + static_smem > static_cast<size_t>(smem_optin)) --groups;
    const size_t smem = smem_of(groups);
    if (smem + static_smem <= static_cast<size_t>(smem_optin)) {
      const int64_t ngroups = (rows + groups - 1) / groups;
      const int64_t grid = std::min<int64_t>(ngroups, sms);
      if (!(grid * groups * D * elem_size >= (int64_t(1) << 32) ||
            (ngroups + grid - 1) / grid > std::numeric_limits<int>::max() - 16)) {
        p.set_layout(RmsnormLayout::ring);
        p.K = sh.K, p.S = sh.S, p.NT = sh.NT;
        p.grid = grid, p.block_x = tx, p.block_y = groups;
        p.smem = static_cast<int64_t>(smem);
        return p;
      }
    }
  }

  // Pipelined: K = 1 (one warp per row, 16 rows per block) up to 32 chunks, else K = 2 (rows of
  // <= 512 threads). 16-bit types: P = 2 rows in flight (K = 1: 4) keeping g; fp32: P = 8 (K = 1)
  // or 4 (K = 2), without g (fp32's unpacking is free, so keeping g saves little). Persistent grid:
  // one block per SM, fewer when the rows do not need them; the kernel advances its pointers by a
  // 32-bit step per row and counts a group's rows in an int.
  const size_t fold_per_thread = size_t(V) * sizeof(float);  // the block's dweight fold
  if (variant != kPlain && vec && nchunk <= kPipeMaxChunks) {
    const int K = nchunk <= 32 ? 1 : 2;
    const unsigned tx = round32((nchunk + K - 1) / K);
    const unsigned groups = kBwdThreads / tx;
    const unsigned grid =
        static_cast<unsigned>(std::min<int64_t>((rows + groups - 1) / groups, sms));
    const int64_t stride = int64_t(grid) * groups;
    if (!(stride * D * elem_size >= (int64_t(1) << 32) ||
          (rows + stride - 1) / stride > std::numeric_limits<int>::max() - 8)) {
      p.set_layout(RmsnormLayout::pipelined);
      p.K = K, p.keep_g = !f32, p.P = f32 ? (K == 1 ? 8 : 4) : (K == 1 ? 4 : 2);
      p.grid = grid, p.block_x = tx, p.block_y = groups;
      p.smem = static_cast<int64_t>(size_t(tx) * groups * fold_per_thread);
      return p;
    }
  }

  // Plain: chunks per thread K = 1 (one warp per row) up to 32 chunks, K = 2 (rows of <= 256
  // threads) up to 512, else K = 4 (<= 512 threads); as many row groups per block as fit.
  p.set_layout(RmsnormLayout::plain);
  p.K = nchunk <= 32 ? 1 : nchunk <= 512 ? 2 : 4;
  p.R = bwd_rows(p.K, vec, f32);
  const unsigned tx = round32((nchunk + p.K - 1) / p.K), groups = kBwdThreads / tx;
  const int64_t rows_per_step = int64_t(groups) * p.R;
  p.grid = static_cast<unsigned>(std::min<int64_t>((rows + rows_per_step - 1) / rows_per_step, sms));
  p.block_x = tx, p.block_y = groups;
  p.smem = static_cast<int64_t>(size_t(tx) * groups * fold_per_thread);
  return p;
}

// Forward of fp32 T only: narrow_y "bf16" / "half" for a 16-bit y; narrow_x the same for a 16-bit x
// added to the fp32 residual (then y is float or x's type). Empty: T's own type.
// copy (backward): 0, or 1 / 2 for a bf16 / fp16 copy of an fp32 dx (the kernels' NZ).
// dy_terms / dy_type (ring backward): NY 16-bit dy terms of type 1 (bf16) / 2 (fp16), the ring's NY
// and YT.
inline std::string rmsnorm_kernel_name(const RmsnormPlan& p, bool forward, const std::string& narrow_y = "",
                                       const std::string& narrow_x = "", int copy = 0, int dy_terms = 0,
                                       int dy_type = 1) {
  const auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  const auto i = [](int v) { return std::to_string(v); };
  if (!forward && dy_terms && p.layout_id == RmsnormLayout::ring)
    return "rmsnorm_backward_ring_kernel<{T}, " + i(p.K) + ", " + i(p.S) + ", false, " + i(p.NT) + ", " +
           b(p.res) + ", " + i(copy) + ", " + i(dy_terms) + ", " + i(dy_type) + ">";
  const std::string res = copy ? ", " + b(p.res) + ", " + i(copy) : p.res ? ", true" : "";
  if (forward && !narrow_x.empty())
    return "rmsnorm_forward_kernel<float, " + i(p.K) + ", " + b(p.vec) + ", true, " +
           (narrow_y.empty() ? std::string("float") : narrow_y) + ", " + narrow_x + ">";
  if (forward && !narrow_y.empty())
    return "rmsnorm_forward_kernel<float, " + i(p.K) + ", " + b(p.vec) + ", false, " + narrow_y + ">";
  if (forward) return "rmsnorm_forward_kernel<{T}, " + i(p.K) + ", " + b(p.vec) + res + ">";
  if (p.layout_id == RmsnormLayout::ring)
    return "rmsnorm_backward_ring_kernel<{T}, " + i(p.K) + ", " + i(p.S) + ", " + b(p.cbw) + ", " +
           i(p.NT) + res + ">";
  if (p.layout_id == RmsnormLayout::pipelined)
    return "rmsnorm_backward_pipelined_kernel<{T}, " + i(p.K) + ", " + i(p.P) + ", " +
           b(p.keep_g) + ", " + b(p.cbw) + ", 512" + res + ">";
  return "rmsnorm_backward_kernel<{T}, " + i(p.K) + ", " + i(p.R) + ", " + b(p.vec) + ", " +
         b(p.cbw) + ", 512" + res + ">";
}

}  // namespace kforge
