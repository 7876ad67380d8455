// gelu launchers (tanh approximation, see kernels_src/gelu.cu): forward -> out; backward -> dx,
// recomputed from x.
#include <algorithm>

#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

constexpr const char* kFwd = "gelu_forward";
constexpr const char* kBwd = "gelu_backward";

Program prog("gelu", ProgramOptions{/*fast_math=*/true});
Kernel fwd(prog, "gelu_forward_kernel<{T}>");
Kernel bwd(prog, "gelu_backward_kernel<{T}>");

// Elementwise grid: a few resident waves of 256-thread blocks; the kernels' grid-stride loops cover
// the rest, so any numel (including > 2^31) works.
Dim3 elementwise_grid(int64_t n, bool vec, int64_t elem_size, int device) {
  return grid_stride_blocks(vec ? n / (16 / elem_size) : n, 256, 16, device);
}

at::Tensor gelu_forward(const at::Tensor& x_) {
  const at::Tensor x = input(x_, kFwd, "x");
  LaunchOn on(x);
  at::Tensor out = new_output_like(x);
  const long long n = x.numel();
  if (n == 0) return out;
  const int vec = aligned16(x) && aligned16(out);
  fwd.launch(dtype_of(x, kFwd), on.device, on.stream, elementwise_grid(n, vec, x.element_size(), on.device),
             Dim3(256), 0, x.data_ptr(), out.data_ptr(), n, vec);
  return out;
}

at::Tensor gelu_backward(const at::Tensor& dout_, const at::Tensor& x_) {
  const at::Tensor x = input(x_, kBwd, "x");
  const at::Tensor dout = input_like(dout_, x, kBwd, "dout");
  KF_CHECK(dout.sizes() == x.sizes(), kBwd, "dout has shape ", dout.sizes(), ", x has ", x.sizes());
  LaunchOn on(x);
  at::Tensor dx = new_output_like(x);
  const long long n = x.numel();
  if (n == 0) return dx;
  const int vec = aligned16(x) && aligned16(dout) && aligned16(dx);
  bwd.launch(dtype_of(x, kBwd), on.device, on.stream, elementwise_grid(n, vec, x.element_size(), on.device),
             Dim3(256), 0, dout.data_ptr(), x.data_ptr(), dx.data_ptr(), n, vec);
  return dx;
}

}  // namespace

KFORGE_BIND_OP(gelu) {
  m.def("gelu_forward", &gelu_forward, "gelu, tanh approximation", pybind11::arg("x"));
  m.def("gelu_backward", &gelu_backward, "gradient of the tanh-approximation gelu: dout * gelu'(x)",
        pybind11::arg("dout"), pybind11::arg("x"));
}

}  // namespace kforge
