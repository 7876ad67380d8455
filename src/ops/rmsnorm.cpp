// rmsnorm launchers: forward (y, rstd) and backward (dx, dweight); see kernels_src/rmsnorm.cu.
#include <pybind11/stl.h>

#include <optional>

#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

Program prog("rmsnorm");

// Kernels by K, the chunks of 16 bytes each thread keeps in registers.
constexpr int kFwdK[] = {1, 2, 4, 8};
Kernel fwd_kernels[] = {{prog, "rmsnorm_forward_kernel<{T}, 1>"},
                        {prog, "rmsnorm_forward_kernel<{T}, 2>"},
                        {prog, "rmsnorm_forward_kernel<{T}, 4>"},
                        {prog, "rmsnorm_forward_kernel<{T}, 8>"}};
constexpr int kBwdK[] = {1, 2, 4};
Kernel bwd_kernels[] = {{prog, "rmsnorm_backward_kernel<{T}, 1>"},
                        {prog, "rmsnorm_backward_kernel<{T}, 2>"},
                        {prog, "rmsnorm_backward_kernel<{T}, 4>"}};
Kernel dweight_kernel(prog, "rmsnorm_dweight_kernel<{T}>");

// Longest row, in 16-byte chunks: 16384 bf16/fp16 or 8192 fp32 elements (kforge.ops.rmsnorm's
// checker declines longer rows).
constexpr int kMaxChunks = 2048;

struct Geometry {
  Kernel* kernel;
  unsigned tx, ty;  // threads per row, rows per block
};

unsigned round32(int64_t n) { return static_cast<unsigned>((n + 31) / 32 * 32); }

// Forward: one warp per row (8 rows per block) up to 256 chunks, else one block of <= 256 threads per
// row; the fewest chunks per thread that fit.
Geometry forward_geometry(int nchunk) {
  if (nchunk <= 32 * 8)
    for (int i = 0; i < 4; ++i)
      if (nchunk <= 32 * kFwdK[i]) return {&fwd_kernels[i], 32, 8};
  for (int i = 0; i < 4; ++i) {
    const int64_t per_k = (nchunk + kFwdK[i] - 1) / kFwdK[i];
    if (per_k <= 256) {
      const unsigned tx = round32(per_k);
      return {&fwd_kernels[i], tx, std::max(1u, 256 / tx)};
    }
  }
  fail("rmsnorm_forward", "row of ", nchunk, " chunks is too long");
}

// Backward: one warp per row (16 rows per block) up to 128 chunks, else rows of up to 512 threads and
// blocks of up to 1024 (K = 1) or 512 threads (K >= 2, more registers per thread).
Geometry backward_geometry(int nchunk) {
  if (nchunk <= 32 * 4)
    for (int i = 0; i < 3; ++i)
      if (nchunk <= 32 * kBwdK[i]) return {&bwd_kernels[i], 32, 16};
  for (int i = 0; i < 3; ++i) {
    const int64_t per_k = (nchunk + kBwdK[i] - 1) / kBwdK[i];
    if (per_k <= 512) {
      const unsigned tx = round32(per_k);
      return {&bwd_kernels[i], tx, std::max(1u, (kBwdK[i] == 1 ? 1024u : 512u) / tx)};
    }
  }
  fail("rmsnorm_backward", "row of ", nchunk, " chunks is too long");
}

// Elements per row: the product of the last `normalized_ndim` sizes of x.
int64_t row_length(const at::Tensor& x, int64_t normalized_ndim, const char* op) {
  KF_CHECK(normalized_ndim >= 1 && normalized_ndim <= x.dim(), op, "normalized_ndim ", normalized_ndim,
           " must be in [1, ", x.dim(), "] for x of shape ", x.sizes());
  int64_t D = 1;
  for (int64_t d = x.dim() - normalized_ndim; d < x.dim(); ++d) D *= x.size(d);
  const int64_t V = 16 / x.element_size();
  KF_CHECK(D > 0, op, "normalized size is 0 for x of shape ", x.sizes());
  KF_CHECK(D <= kMaxChunks * V, op, "rows of ", D, " elements are too long (max ", kMaxChunks * V,
           " for ", x.scalar_type(), ")");
  return D;
}

std::optional<at::Tensor> weight_input(const std::optional<at::Tensor>& w, const at::Tensor& x,
                                       int64_t D, const char* op) {
  if (!w.has_value() || !w->defined()) return std::nullopt;
  at::Tensor t = input_like(*w, x, op, "weight");
  KF_CHECK(t.numel() == D, op, "weight has ", t.numel(), " elements, expected ", D);
  return t;
}

void* ptr(const std::optional<at::Tensor>& t) { return t ? t->data_ptr() : nullptr; }

std::tuple<at::Tensor, at::Tensor> rmsnorm_forward(const at::Tensor& x_,
                                                   const std::optional<at::Tensor>& weight_,
                                                   double eps, int64_t normalized_ndim,
                                                   bool cast_before_weight) {
  const char* op = "rmsnorm_forward";
  const at::Tensor x = input(x_, op, "x");
  const int64_t D = row_length(x, normalized_ndim, op);
  const auto weight = weight_input(weight_, x, D, op);
  LaunchOn on(x);
  const int64_t rows = x.numel() / D;
  at::Tensor y = new_output_like(x);
  at::Tensor rstd = new_output({rows}, x.options().dtype(at::kFloat));
  if (rows == 0) return {y, rstd};
  const int64_t V = 16 / x.element_size();
  const int vec = D % V == 0 && aligned16(x) && aligned16(y) && (!weight || aligned16(*weight));
  const Geometry g = forward_geometry(static_cast<int>((D + V - 1) / V));
  KF_CHECK((rows + g.ty - 1) / g.ty <= std::numeric_limits<int>::max(), op, "too many rows: ", rows);
  g.kernel->launch(dtype_of(x, op), on.device, on.stream, ceil_div(rows, g.ty), Dim3(g.tx, g.ty), 0,
                   x.data_ptr(), ptr(weight), y.data_ptr(), rstd.data_ptr(),
                   static_cast<long long>(rows), static_cast<int>(D), static_cast<float>(eps), vec,
                   int(cast_before_weight));
  return {y, rstd};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> rmsnorm_backward(
    const at::Tensor& dy_, const at::Tensor& x_, const std::optional<at::Tensor>& weight_,
    const at::Tensor& rstd_, int64_t normalized_ndim, bool cast_before_weight) {
  const char* op = "rmsnorm_backward";
  const at::Tensor x = input(x_, op, "x");
  const at::Tensor dy = input_like(dy_, x, op, "dy");
  KF_CHECK(dy.sizes() == x.sizes(), op, "dy and x sizes differ: ", dy.sizes(), " vs ", x.sizes());
  const int64_t D = row_length(x, normalized_ndim, op);
  const auto weight = weight_input(weight_, x, D, op);
  const int64_t rows = x.numel() / D;
  KF_CHECK(rstd_.defined() && rstd_.is_cuda() && rstd_.device() == x.device() &&
               rstd_.scalar_type() == at::kFloat && rstd_.numel() == rows,
           op, "rstd must be a float32 CUDA tensor of ", rows, " elements on ", x.device());
  const at::Tensor rstd = rstd_.contiguous();
  LaunchOn on(x);
  at::Tensor dx = new_output_like(x);
  std::optional<at::Tensor> dweight;
  if (weight) dweight = new_output_like(*weight);
  if (rows == 0) {
    if (dweight) dweight->zero_();
    return {dx, dweight};
  }
  const int64_t V = 16 / x.element_size();
  const int nchunk = static_cast<int>((D + V - 1) / V);
  const int vec = D % V == 0 && aligned16(x) && aligned16(dy) && aligned16(dx) &&
                  (!weight || aligned16(*weight));
  const Geometry g = backward_geometry(nchunk);
  const DType dt = dtype_of(x, op);
  // Persistent grid: about one resident block per 1024 threads of each SM; every block writes one
  // partial dweight row, so fewer blocks also means less partial traffic.
  const int64_t per_sm = std::max<int64_t>(1, 1024 / (g.tx * g.ty));
  const unsigned grid = static_cast<unsigned>(
      std::min<int64_t>(ceil_div(rows, g.ty), sm_count(on.device) * per_sm));
  std::optional<at::Tensor> partial;
  if (weight) partial = new_output({static_cast<int64_t>(grid), D}, x.options().dtype(at::kFloat));
  const size_t fold_bytes = size_t(g.tx) * V * sizeof(float);
  g.kernel->launch(dt, on.device, on.stream, grid, Dim3(g.tx, g.ty), fold_bytes, dy.data_ptr(),
                   x.data_ptr(), ptr(weight), rstd.data_ptr(), dx.data_ptr(), ptr(partial),
                   static_cast<long long>(rows), static_cast<int>(D), vec, int(cast_before_weight));
  if (weight)
    dweight_kernel.launch(dt, on.device, on.stream, ceil_div(D, 32), Dim3(32, 16), 0,
                          partial->data_ptr(), dweight->data_ptr(), static_cast<int>(grid),
                          static_cast<int>(D));
  return {dx, dweight};
}

}  // namespace

KFORGE_BIND_OP(rmsnorm) {
  m.def("rmsnorm_forward", &rmsnorm_forward,
        "RMSNorm over the last `normalized_ndim` dims: returns (y, rstd) with rstd float32 of one "
        "element per row. cast_before_weight: y = weight * T(x * rstd) (Hugging Face Llama), else "
        "y = T(x * rstd * weight) (torch F.rms_norm). weight may be None.",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("normalized_ndim") = 1, pybind11::arg("cast_before_weight") = true);
  m.def("rmsnorm_backward", &rmsnorm_backward,
        "Backward of rmsnorm_forward from the saved rstd: returns (dx, dweight), dweight None when "
        "weight is None; dweight is reduced in a fixed order (deterministic).",
        pybind11::arg("dy"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("rstd"),
        pybind11::arg("normalized_ndim") = 1, pybind11::arg("cast_before_weight") = true);
}

}  // namespace kforge
