// residual launcher (see kernels_src/residual.cu): out = a + b, one dtype, fp32 math; b has a's
// shape or a's trailing dims (broadcast along the leading ones).
#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

constexpr const char* kFwd = "residual_forward";

Program prog("residual");
Kernel fwd(prog, "residual_forward_kernel<{T}>");

at::Tensor residual_forward(const at::Tensor& a_, const at::Tensor& b_) {
  const at::Tensor a = input(a_, kFwd, "a");
  const at::Tensor b = input_like(b_, a, kFwd, "b");
  const bool suffix = b.dim() <= a.dim() && b.sizes() == a.sizes().slice(a.dim() - b.dim());
  KF_CHECK(suffix, kFwd, "b has shape ", b.sizes(), ": must be a's shape ", a.sizes(), " or its trailing dims");
  LaunchOn on(a);
  at::Tensor out = new_output_like(a);
  const long long n = a.numel(), nb = b.numel();
  if (n == 0) return out;
  const int64_t pack = 16 / a.element_size();
  const int vec = aligned16(a) && aligned16(b) && aligned16(out) && nb % pack == 0;
  // Two packs per thread per step: a few resident waves of 256-thread blocks cover the rest.
  const int64_t work = vec ? (n / (16 / a.element_size()) + 1) / 2 : n;
  fwd.launch(dtype_of(a, kFwd), on.device, on.stream, Dim3(grid_stride_blocks(work, 256, 16, on.device)),
             Dim3(256), 0, a.data_ptr(), b.data_ptr(), out.data_ptr(), n, nb, vec);
  return out;
}

}  // namespace

KFORGE_BIND_OP(residual) {
  m.def("residual_forward", &residual_forward,
        "a + b for tensors of one dtype, b of a's shape or its trailing dims, computed in fp32 and "
        "rounded once",
        pybind11::arg("a"), pybind11::arg("b"));
}

}  // namespace kforge
