// axpy launcher: out = alpha * x + y (runtime smoke test; see kernels_src/axpy.cu).
#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

Program prog("axpy");
Kernel kernel(prog, "axpy_kernel<{T}>");

at::Tensor axpy(const at::Tensor& x_, const at::Tensor& y_, double alpha, int block) {
  const at::Tensor x = input(x_, "axpy", "x");
  const at::Tensor y = input_like(y_, x, "axpy", "y");
  const DType dt = dtype_of(x, "axpy");
  KF_CHECK(block > 0, "axpy", "block must be positive, got ", block);
  KF_CHECK(x.sizes() == y.sizes(), "axpy", "x and y sizes differ: ", x.sizes(), " vs ", y.sizes());
  LaunchOn on(x);
  at::Tensor out = new_output_like(x);
  const long long n = x.numel();
  if (n == 0) return out;
  const int vec = aligned16(x) && aligned16(y) && aligned16(out);
  const int64_t packs = vec ? n / (16 / x.element_size()) : n;
  const unsigned grid = grid_stride_blocks(packs, block, 16, on.device);
  kernel.launch(dt, on.device, on.stream, grid, block, 0, x.data_ptr(), y.data_ptr(),
                out.data_ptr(), static_cast<float>(alpha), n, vec);
  return out;
}

}  // namespace

KFORGE_BIND_OP(axpy) {
  m.def("axpy", &axpy, "out = alpha * x + y (runtime smoke-test kernel)", pybind11::arg("x"),
        pybind11::arg("y"), pybind11::arg("alpha") = 1.0,
        // Threads per block; tests pass an invalid value to exercise launch-error reporting.
        pybind11::arg("block") = 256);
}

}  // namespace kforge
