// colsum launcher (see kernels_src/colsum.cu): the sum over every dim but the last (a linear layer's
// bias gradient), deterministic, fp32 accumulation.
#include <algorithm>

#include "../runtime/torch_launch.h"
#include "launch_params.cuh"  // kernels_src/: kColsumRows, shared with colsum.cu

namespace kforge {
namespace {

constexpr const char* kFwd = "colsum_forward";
using kf_colsum::kColsumRows;

Program prog("colsum");
Kernel partial_kernels[2] = {Kernel(prog, "colsum_partial_kernel<{T}, false>"),
                             Kernel(prog, "colsum_partial_kernel<{T}, true>")};
Kernel final_kernel(prog, "colsum_final_kernel<{T}>");

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }  // 64-bit (ceil_div is unsigned)

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
  const int64_t pack = 16 / x.element_size();
  const bool vec = C % pack == 0 && aligned16(x);  // rows then start 16-byte aligned too
  const int64_t unit = vec ? pack : 1;
  const int64_t tiles = cdiv(cdiv(C, unit), 32);
  // About 4 blocks of 256 threads per SM in all (one wave), each chunk a multiple of 32 rows (four
  // rows in flight per row slot) and at least 64, so the partial rows stay small next to x.
  const int64_t target = int64_t(sm_count(on.device)) * 4;
  const int64_t chunks = std::clamp<int64_t>(target / tiles, 1, std::max<int64_t>(1, cdiv(N, 64)));
  const int64_t rows_per_chunk = cdiv(cdiv(N, chunks), 32) * 32;
  const int64_t G = cdiv(N, rows_per_chunk);  // chunks actually used
  KF_CHECK(G <= 65535, kFwd, "too many row chunks (", G, ")");
  at::Tensor partial = new_output({G, C}, x.options().dtype(at::kFloat));
  const DType dt = dtype_of(x, kFwd);
  partial_kernels[vec].launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(G)),
                              Dim3(32, kColsumRows), 0, x.data_ptr(), partial.data_ptr(),
                              static_cast<long long>(N), static_cast<int>(C),
                              static_cast<long long>(rows_per_chunk));
  final_kernel.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(cdiv(C, 32))), Dim3(32, kColsumRows), 0,
                      static_cast<const void*>(partial.data_ptr()), out.data_ptr(), static_cast<int>(G),
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
