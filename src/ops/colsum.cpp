// colsum launcher (see kernels_src/colsum.cu): the sum over every dim but the last (a linear layer's
// bias gradient), deterministic, fp32 accumulation.
#include <limits>

#include "../runtime/torch_launch.h"
#include "colsum_plan.h"  // the dispatch: vec or scalar, row chunks, both grids

namespace kforge {
namespace {

constexpr const char* kFwd = "colsum_forward";

Program prog("colsum");
Kernel partial_kernels[2] = {Kernel(prog, "colsum_partial_kernel<{T}, false>"),
                             Kernel(prog, "colsum_partial_kernel<{T}, true>")};
Kernel final_kernel(prog, "colsum_final_kernel<{T}>");

at::Tensor colsum_forward(const at::Tensor& x_) {
  const at::Tensor x = input(x_, kFwd, "x");
  KF_CHECK(x.dim() >= 1, kFwd, "x must have at least one dimension");
  const int64_t C = x.size(-1);
  KF_CHECK(C <= std::numeric_limits<int>::max() / 2, kFwd, "last dim C=", C, " too large");
  const int64_t N = C ? x.numel() / C : 0;
  LaunchOn on(x);
  at::Tensor out = new_output({C}, x.options());
  if (C == 0) return out;
  if (N == 0) return out.zero_();  // an empty sum
  const ColsumPlan p = plan_colsum(N, C, x.element_size(), aligned16(x), sm_count(on.device));
  KF_CHECK(p.error.empty(), kFwd, p.error);
  at::Tensor partial = new_output({p.G, C}, x.options().dtype(at::kFloat));
  const DType dt = dtype_of(x, kFwd);
  const Dim3 block(static_cast<unsigned>(p.block_x), static_cast<unsigned>(p.block_y));
  partial_kernels[p.layout_id == ColsumLayout::vec].launch(
      dt, on.device, on.stream, Dim3(static_cast<unsigned>(p.grid), static_cast<unsigned>(p.grid_y)),
      block, 0, x.data_ptr(), partial.data_ptr(), static_cast<long long>(N), static_cast<int>(C),
      static_cast<long long>(p.rows_per_chunk));
  final_kernel.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(p.final_grid)), block, 0,
                      static_cast<const void*>(partial.data_ptr()), out.data_ptr(), static_cast<int>(p.G),
                      static_cast<int>(C));
  return out;
}

}  // namespace

KFORGE_BIND_OP(colsum) {
  m.def("colsum_forward", &colsum_forward,
        "sum over every dim but the last (x viewed as (N, C) -> (C,)), fp32 accumulation, deterministic",
        pybind11::arg("x"));
}

}  // namespace kforge
