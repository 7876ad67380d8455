// embedding launcher (see kernels_src/embedding.cu): the weight gradient of an embedding lookup,
// dense, deterministic, fp32 accumulation, in one launch.
#include <limits>

#include "../runtime/torch_launch.h"
#include "embedding_plan.h"  // the dispatch: vec or scalar, rows and items a block

namespace kforge {
namespace {

constexpr const char* kBwd = "embedding_backward";

Program prog("embedding");
// [int32 indices][vec]
Kernel kernels[2][2] = {{Kernel(prog, "embedding_backward_kernel<{T}, long long, false>"),
                         Kernel(prog, "embedding_backward_kernel<{T}, long long, true>")},
                        {Kernel(prog, "embedding_backward_kernel<{T}, int, false>"),
                         Kernel(prog, "embedding_backward_kernel<{T}, int, true>")}};

at::Tensor embedding_backward(const at::Tensor& grad_, const at::Tensor& indices_, int64_t num_weights,
                              int64_t padding_idx) {
  const at::Tensor grad = input(grad_, kBwd, "grad");
  KF_CHECK(indices_.defined() && indices_.is_cuda() && indices_.device() == grad.device(), kBwd,
           "indices must be a CUDA tensor on ", grad.device());
  const bool idx32 = indices_.scalar_type() == at::kInt;
  KF_CHECK(idx32 || indices_.scalar_type() == at::kLong, kBwd, "indices must be int64 or int32, got ",
           indices_.scalar_type());
  KF_CHECK(grad.dim() == indices_.dim() + 1 && grad.sizes().slice(0, indices_.dim()) == indices_.sizes(),
           kBwd, "grad must have shape indices.shape + (C,), got grad ", grad.sizes(), " and indices ",
           indices_.sizes());
  KF_CHECK(num_weights >= 0, kBwd, "num_weights must be >= 0, got ", num_weights);
  const int64_t C = grad.size(-1), N = indices_.numel();
  // Tokens are ints in the kernel's lists.
  KF_CHECK(N <= std::numeric_limits<int>::max(), kBwd, "at most 2^31 - 1 tokens, got ", N);
  KF_CHECK(C <= kEmbeddingMaxC, kBwd, "last dim C=", C, " exceeds ", kEmbeddingMaxC);
  LaunchOn on(grad);
  at::Tensor out = new_output({num_weights, C}, grad.options());
  if (num_weights == 0 || C == 0) return out;
  const at::Tensor indices = indices_.contiguous();
  const EmbeddingPlan p = plan_embedding_backward(N, C, num_weights, grad.element_size(), aligned16(grad),
                                                  sm_count(on.device));
  KF_CHECK(p.error.empty(), kBwd, p.error);
  // N == 0 launches too: the kernel then writes every row as zeros.
  kernels[idx32][p.layout_id == EmbeddingLayout::vec].launch(
      dtype_of(grad, kBwd), on.device, on.stream,
      Dim3(static_cast<unsigned>(p.grid), static_cast<unsigned>(p.grid_y)), Dim3(static_cast<unsigned>(p.block_x)),
      0, static_cast<const void*>(grad.data_ptr()), static_cast<const void*>(indices.data_ptr()), out.data_ptr(),
      static_cast<long long>(N), static_cast<long long>(C), static_cast<long long>(num_weights),
      static_cast<long long>(padding_idx), static_cast<int>(p.rows), static_cast<int>(p.block_items));
  return out;
}

}  // namespace

KFORGE_BIND_OP(embedding) {
  m.def("embedding_backward", &embedding_backward,
        "Weight gradient of an embedding lookup: (num_weights, C) in grad's dtype, row v the sum of "
        "grad's rows (..., C) whose index (indices: int64 / int32, grad's leading shape) is v; zero rows "
        "elsewhere. Tokens equal to padding_idx (-1: none) and indices outside [0, num_weights) add "
        "nothing. fp32 accumulation in token order: deterministic.",
        pybind11::arg("grad"), pybind11::arg("indices"), pybind11::arg("num_weights"),
        pybind11::arg("padding_idx") = -1);
}

}  // namespace kforge
