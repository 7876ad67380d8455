// gelu launchers, tanh approximation or exact (erf) gelu (see kernels_src/gelu.cu): forward -> out;
// backward -> dx, recomputed from x. `approximate` is torch's: "tanh" or "none" (erf). Every pointer
// 16-byte aligned: gelu_{forward,backward}_kernel, no loop, 256-thread blocks, 2 packs per thread
// (backward: 2 of dout and 2 of x) all loaded before the math, grid packs / 512 + 1, streaming loads
// and stores; 32 registers, 8 blocks per SM (forward 64 KB of loads
// in flight per SM, backward 128 KB). Any pointer misaligned: the grid-stride scalar kernels.
#include <limits>
#include <string>

#include "../runtime/torch_launch.h"
#include "gelu_plan.h"  // the dispatch: packs or scalar, grid, block

namespace kforge {
namespace {

constexpr const char* kFwd = "gelu_forward";
constexpr const char* kBwd = "gelu_backward";

Program prog("gelu", ProgramOptions{/*fast_math=*/true});
// [tanh, erf]: the kernels' Erf template flag.
Kernel fwd[2] = {Kernel(prog, "gelu_forward_kernel<{T}, false>"), Kernel(prog, "gelu_forward_kernel<{T}, true>")};
Kernel bwd[2] = {Kernel(prog, "gelu_backward_kernel<{T}, false>"), Kernel(prog, "gelu_backward_kernel<{T}, true>")};
Kernel fwd_scalar[2] = {Kernel(prog, "gelu_forward_scalar_kernel<{T}, false>"),
                        Kernel(prog, "gelu_forward_scalar_kernel<{T}, true>")};
Kernel bwd_scalar[2] = {Kernel(prog, "gelu_backward_scalar_kernel<{T}, false>"),
                        Kernel(prog, "gelu_backward_scalar_kernel<{T}, true>")};

// torch's `approximate` argument -> the kernels' Erf flag (index into the tables above).
int erf_mode(const std::string& approximate, const char* op) {
  KF_CHECK(approximate == "tanh" || approximate == "none", op,
           "approximate must be \"tanh\" or \"none\", got \"", approximate, "\"");
  return approximate == "none" ? 1 : 0;
}

at::Tensor gelu_forward(const at::Tensor& x_, const std::string& approximate) {
  const int erf = erf_mode(approximate, kFwd);
  const at::Tensor x = input(x_, kFwd, "x");
  LaunchOn on(x);
  at::Tensor out = new_output_like(x);
  const long long n = x.numel();
  if (n == 0) return out;
  const DType dt = dtype_of(x, kFwd);
  const GeluPlan p =
      plan_gelu(n, x.element_size(), aligned16(x) && aligned16(out), sm_count(on.device));
  KF_CHECK(p.error.empty(), kFwd, p.error);
  Kernel& k = p.layout_id == GeluLayout::scalar ? fwd_scalar[erf] : fwd[erf];
  k.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(p.grid)),
           Dim3(static_cast<unsigned>(p.block_x)), 0, x.data_ptr(), out.data_ptr(), n);
  return out;
}

at::Tensor gelu_backward(const at::Tensor& dout_, const at::Tensor& x_, const std::string& approximate) {
  const int erf = erf_mode(approximate, kBwd);
  const at::Tensor x = input(x_, kBwd, "x");
  const at::Tensor dout = input_like(dout_, x, kBwd, "dout");
  KF_CHECK(dout.sizes() == x.sizes(), kBwd, "dout has shape ", dout.sizes(), ", x has ", x.sizes());
  LaunchOn on(x);
  at::Tensor dx = new_output_like(x);
  const long long n = x.numel();
  if (n == 0) return dx;
  const DType dt = dtype_of(x, kBwd);
  const GeluPlan p = plan_gelu(
      n, x.element_size(), aligned16(x) && aligned16(dout) && aligned16(dx), sm_count(on.device));
  KF_CHECK(p.error.empty(), kBwd, p.error);
  Kernel& k = p.layout_id == GeluLayout::scalar ? bwd_scalar[erf] : bwd[erf];
  k.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(p.grid)),
           Dim3(static_cast<unsigned>(p.block_x)), 0, dout.data_ptr(), x.data_ptr(), dx.data_ptr(), n);
  return dx;
}

}  // namespace

KFORGE_BIND_OP(gelu) {
  m.def("gelu_forward", &gelu_forward,
        "gelu: approximate=\"tanh\" (default) or \"none\" (exact, erf). 16-byte packs (2 per thread, all "
        "loads first); misaligned inputs take a scalar grid-stride kernel.",
        pybind11::arg("x"), pybind11::arg("approximate") = "tanh");
  m.def("gelu_backward", &gelu_backward,
        "gradient of gelu: dout * gelu'(x), approximate=\"tanh\" (default) or \"none\" (erf). 16-byte packs "
        "(2 of dout and 2 of x per thread, all loads first); misaligned inputs take a scalar grid-stride "
        "kernel.",
        pybind11::arg("dout"), pybind11::arg("x"), pybind11::arg("approximate") = "tanh");
}

}  // namespace kforge
