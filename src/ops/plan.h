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
  // The layout's name, for Python (kforge._C.plan) and messages only: a static string, so a plan
  // allocates nothing; launchers dispatch on the typed layout_id of PlanWith below.
  const char* layout = "";
  int64_t grid = 0, grid_y = 1;
  int64_t block_x = 1, block_y = 1;
  int64_t smem = 0;   // dynamic shared memory, bytes
  std::string error;  // non-empty: the input cannot be launched (the launcher raises this)
};

// A plan whose layout is one of an op's enum L. set_layout keeps the id and the name in step; the
// name comes from the op's layout_name(L) overload, so the launch path compares integers only.
template <typename L>
struct PlanWith : Plan {
  L layout_id{};
  void set_layout(L l) {
    layout_id = l;
    layout = layout_name(l);
  }
};

namespace plan_util {
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
// torch_launch.h's ceil_div: an unsigned result, as the launchers have always used it.
inline unsigned ceil_div_u(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }
inline unsigned round32(int64_t n) { return static_cast<unsigned>((n + 31) / 32 * 32); }
}  // namespace plan_util

}  // namespace kforge

#include <atomic>
#include <map>

namespace kforge {

// A testing override of one launcher's dispatch: `variant` forces one of its other layouts (0: the
// plan's own choice), `max_warps` caps resident warps per SM (0: the kernel's own limit). Set with
// kforge._testing.override (tests, scripts/ab.py's A/B timing), so the public bindings take only
// their inputs. Process-wide; read with relaxed loads (a launch costs two atomic reads).
struct TestingOverride {
  const char* op;
  int64_t num_variants;  // valid variants: [0, num_variants)
  bool has_max_warps;
  std::atomic<int64_t> variant{0}, max_warps{0};
  TestingOverride(const char* op_, int64_t num_variants_, bool has_max_warps_)
      : op(op_), num_variants(num_variants_), has_max_warps(has_max_warps_) {
    testing_overrides()[op] = this;
  }
  int64_t get_variant() const { return variant.load(std::memory_order_relaxed); }
  int64_t get_max_warps() const { return max_warps.load(std::memory_order_relaxed); }
  static std::map<std::string, TestingOverride*>& testing_overrides() {
    static std::map<std::string, TestingOverride*> m;
    return m;
  }
};

}  // namespace kforge
