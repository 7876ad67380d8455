// axpy launcher: out = alpha * x + y (runtime smoke test; see kernels_src/axpy.cu).
#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

Program prog("axpy");
Kernel kernel(prog, "axpy_kernel<{T}>");

at::Tensor axpy(const at::Tensor& x, const at::Tensor& y, double alpha) {
  const DType dt = check_input(x, "axpy", "x");
  check_same(x, y, "axpy", "y");
  KF_CHECK(x.sizes() == y.sizes(), "axpy", "x and y sizes differ: ", x.sizes(), " vs ", y.sizes());
  KF_CHECK(aligned16(x) && aligned16(y), "axpy", "x and y must be 16-byte aligned");
  LaunchOn on(x);
  at::Tensor out = at::empty_like(x);
  const long long n = x.numel();
  if (n == 0) return out;
  const int block = 256;
  const int64_t packs = n / (16 / x.element_size());
  // Enough blocks to fill the GPU several times over; the grid-stride loop covers the rest.
  const unsigned grid = std::max<unsigned>(1, std::min<int64_t>(ceil_div(packs, block), sm_count(on.device) * 16));
  kernel.launch(dt, on.device, on.stream, grid, block, 0, x.data_ptr(), y.data_ptr(),
                out.data_ptr(), static_cast<float>(alpha), n);
  return out;
}

}  // namespace

KFORGE_BIND_OP(axpy) {
  m.def("axpy", &axpy, "out = alpha * x + y (runtime smoke-test kernel)", pybind11::arg("x"),
        pybind11::arg("y"), pybind11::arg("alpha") = 1.0);
}

}  // namespace kforge
