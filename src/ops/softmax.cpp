// softmax launchers: softmax over the last dim and the fused causal attention softmax, forward and
// backward (see kernels_src/softmax.cu for the layouts).
#include "../runtime/torch_launch.h"
#include "softmax_plan.h"  // the dispatch: which kernel, grid, block, shared memory

namespace kforge {
namespace {
using namespace softmax_plan;

Program prog("softmax", ProgramOptions{/*fast_math=*/false});

// The layouts and their sizes: src/ops/softmax_plan.h.
const std::vector<DType> kF32 = {DType::f32};
struct WarpKernels {
  int P;
  Kernel fwd, bwd;
};
WarpKernels warp_kernels[] = {
    {1, {prog, "softmax_forward_kernel<{T}, 1, true>"}, {prog, "softmax_backward_kernel<{T}, 1, true>"}},
    {2, {prog, "softmax_forward_kernel<{T}, 2, true>"}, {prog, "softmax_backward_kernel<{T}, 2, true>"}},
    {4, {prog, "softmax_forward_kernel<{T}, 4, true>"}, {prog, "softmax_backward_kernel<{T}, 4, true>"}},
    {8, {prog, "softmax_forward_kernel<{T}, 8, true>", kF32}, {prog, "softmax_backward_kernel<{T}, 8, true>", kF32}},
};
const std::vector<DType> k16 = {DType::bf16, DType::f16};
Kernel fwd_warps_p2(prog, "softmax_forward_warps_kernel<{T}, 2, 2>", k16);
Kernel fwd_warps_p4(prog, "softmax_forward_warps_kernel<{T}, 4, 2>", k16);
Kernel fwd_block(prog, "softmax_forward_kernel<{T}, 4, false>");
Kernel fwd_stream(prog, "softmax_forward_stream_kernel<{T}>");
Kernel bwd_block(prog, "softmax_backward_kernel<{T}, 4, false>");
Kernel bwd_stream(prog, "softmax_backward_stream_kernel<{T}>");

// The plan's kernel.
Kernel& kernel_of(const SoftmaxPlan& p, bool forward) {
  using L = SoftmaxLayout;
  if (p.layout_id == L::warps) return p.P == 2 ? fwd_warps_p2 : fwd_warps_p4;
  if (p.layout_id == L::warp)
    for (WarpKernels& w : warp_kernels)
      if (w.P == p.P) return forward ? w.fwd : w.bwd;
  if (p.layout_id == L::block) return forward ? fwd_block : bwd_block;
  return forward ? fwd_stream : bwd_stream;
}

bool same_alignment(std::initializer_list<const at::Tensor*> ts) {
  const uintptr_t a = reinterpret_cast<uintptr_t>((*ts.begin())->data_ptr()) & 15;
  for (const at::Tensor* t : ts)
    if ((reinterpret_cast<uintptr_t>(t->data_ptr()) & 15) != a) return false;
  return true;
}

// The length C of x's rows (its last dim) and their count, after checking that the kernels' int row
// and column indices hold and, when causal, that x is (..., T, T) scores.
std::pair<int64_t, int64_t> checked_rows(const at::Tensor& x, bool causal, const char* op) {
  if (causal)
    KF_CHECK(x.dim() >= 2 && x.size(-1) == x.size(-2), op,
             "expected scores of shape (..., T, T), got ", x.sizes());
  const int64_t C = x.dim() ? x.size(-1) : 1;
  KF_CHECK(x.dim() >= 1, op, "expected at least 1 dimension, got a 0-d tensor");
  KF_CHECK(C <= std::numeric_limits<int>::max(), op, "rows of ", C, " elements are too long (max 2^31-1)");
  if (C > 0)
    KF_CHECK(x.numel() / C < std::numeric_limits<int>::max(), op, "too many rows: ", x.numel() / C);
  return {C, C > 0 ? x.numel() / C : 0};
}

bool aligned16_ptr(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

at::Tensor forward(const at::Tensor& x_, bool causal, double scale, const char* op) {
  const at::Tensor x = input(x_, op, "x");
  const auto [C, rows] = checked_rows(x, causal, op);
  LaunchOn on(x);
  at::Tensor y = new_output_like(x);
  if (x.numel() == 0) return y;
  const DType dt = dtype_of(x, op);
  const bool vec = same_alignment({&x, &y});
  const SoftmaxPlan p = plan_softmax(rows, C, x.element_size(), dt == DType::f32, /*forward=*/true,
                                     causal, vec, aligned16_ptr(x) && aligned16_ptr(y),
                                     sm_count(on.device));
  const SoftmaxLayout layout = p.layout_id;
  Kernel& k = kernel_of(p, /*forward=*/true);
  const Dim3 grid(static_cast<unsigned>(p.grid)), block(static_cast<unsigned>(p.block_x));
  if (layout == SoftmaxLayout::warps)  // takes scale * log2(e) and its warps' row ranges
    k.launch(dt, on.device, on.stream, grid, block, static_cast<size_t>(p.smem), x.data_ptr(),
             y.data_ptr(), static_cast<int>(p.q), static_cast<int>(p.r), static_cast<int>(C),
             static_cast<float>(1.4426950408889634));
  else if (layout == SoftmaxLayout::stream)
    k.launch(dt, on.device, on.stream, grid, block, 0, x.data_ptr(), y.data_ptr(),
             static_cast<long long>(rows), static_cast<int>(C), int(causal),
             static_cast<float>(scale), int(vec));
  else  // the register kernels take scale * log2(e)
    k.launch(dt, on.device, on.stream, grid, block, 0, x.data_ptr(), y.data_ptr(),
             static_cast<int>(rows), static_cast<int>(C), int(causal),
             static_cast<float>(scale * 1.4426950408889634));
  return y;
}

at::Tensor backward(const at::Tensor& dy_, const at::Tensor& y_, bool causal, double scale,
                    const char* op) {
  const at::Tensor y = input(y_, op, "y");
  const at::Tensor dy = input_like(dy_, y, op, "dy");
  KF_CHECK(dy.sizes() == y.sizes(), op, "dy and y sizes differ: ", dy.sizes(), " vs ", y.sizes());
  const auto [C, rows] = checked_rows(y, causal, op);
  LaunchOn on(y);
  at::Tensor dx = new_output_like(y);
  if (y.numel() == 0) return dx;
  const DType dt = dtype_of(y, op);
  const bool vec = same_alignment({&dy, &y, &dx});
  const SoftmaxPlan p = plan_softmax(rows, C, y.element_size(), dt == DType::f32, /*forward=*/false,
                                     causal, vec, /*aligned=*/false, sm_count(on.device));
  Kernel& k = kernel_of(p, /*forward=*/false);
  const Dim3 grid(static_cast<unsigned>(p.grid)), block(static_cast<unsigned>(p.block_x));
  if (p.layout_id == SoftmaxLayout::stream)
    k.launch(dt, on.device, on.stream, grid, block, 0, dy.data_ptr(), y.data_ptr(), dx.data_ptr(),
             static_cast<long long>(rows), static_cast<int>(C), int(causal),
             static_cast<float>(scale), int(vec));
  else
    k.launch(dt, on.device, on.stream, grid, block, 0, dy.data_ptr(), y.data_ptr(), dx.data_ptr(),
             static_cast<int>(rows), static_cast<int>(C), int(causal), static_cast<float>(scale));
  return dx;
}

at::Tensor softmax_forward(const at::Tensor& x) {
  return forward(x, false, 1.0, "softmax_forward");
}
at::Tensor softmax_backward(const at::Tensor& dy, const at::Tensor& y) {
  return backward(dy, y, false, 1.0, "softmax_backward");
}
at::Tensor causal_softmax_forward(const at::Tensor& preatt, double scale) {
  return forward(preatt, true, scale, "causal_softmax_forward");
}
at::Tensor causal_softmax_backward(const at::Tensor& datt, const at::Tensor& att, double scale) {
  return backward(datt, att, true, scale, "causal_softmax_backward");
}

}  // namespace

KFORGE_BIND_OP(softmax) {
  m.def("softmax_forward", &softmax_forward,
        "y = softmax(x) over the last dim", pybind11::arg("x"));
  m.def("softmax_backward", &softmax_backward, "dx = y * (dy - sum(dy * y, -1)) over the last dim",
        pybind11::arg("dy"), pybind11::arg("y"));
  m.def("causal_softmax_forward", &causal_softmax_forward,
        "att = softmax(scale * preatt) over the last dim of (..., T, T) scores, row i keeping its "
        "first i + 1 entries (the rest exactly 0)",
        pybind11::arg("preatt"), pybind11::arg("scale"));
  m.def("causal_softmax_backward", &causal_softmax_backward,
        "dpreatt = scale * att * (datt - sum(datt * att, -1)), exactly 0 above the diagonal",
        pybind11::arg("datt"), pybind11::arg("att"), pybind11::arg("scale"));
}

}  // namespace kforge
