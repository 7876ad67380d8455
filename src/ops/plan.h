// plan.h: what a launcher's dispatch decides, as plain data (no CUDA, no torch).
//
// Each multi-layout op has one host function plan_<op>(shape, dtype, alignment, device limits)
// in src/ops/<op>_plan.h; its launcher computes the plan and launches what it says, so the choice
// is made in one place, and kforge._C.plan() / the CPU tests ask the same function (the device's
// SM count and shared-memory limit are inputs, so a plan can be asked for without a GPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kforge {

struct Plan {
  const char* layout = "";  // one of the op's layout names (static strings: no allocation)
  int64_t grid = 0;
  int64_t block_x = 1, block_y = 1;
  int64_t smem = 0;   // dynamic shared memory, bytes
  std::string error;  // non-empty: the input cannot be launched (the launcher raises this)
};

namespace plan_util {
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
// torch_launch.h's ceil_div: an unsigned result, as the launchers have always used it.
inline unsigned ceil_div_u(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }
inline unsigned round32(int64_t n) { return static_cast<unsigned>((n + 31) / 32 * 32); }
}  // namespace plan_util

}  // namespace kforge
