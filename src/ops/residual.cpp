// residual launcher (see kernels_src/residual.cu): out = a + b, one dtype, fp32 math; b has a's
// shape or a's trailing dims (broadcast along the leading ones). The output has a's layout when b has
// a's shape and a is dense (eager's layout), else it is contiguous.
#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

constexpr const char* kFwd = "residual_forward";

Program prog("residual");
Kernel fwd(prog, "residual_forward_kernel<{T}>");

// Whether x and y address their elements alike (the strides of every dim of size > 1 agree).
bool same_layout(const at::Tensor& x, const at::Tensor& y) {
  if (x.sizes() != y.sizes()) return false;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (x.size(d) > 1 && x.stride(d) != y.stride(d)) return false;
  return true;
}

at::Tensor residual_forward(const at::Tensor& a_, const at::Tensor& b_) {
  check_input(a_, kFwd, "a");
  check_input_like(b_, a_, kFwd, "b");
  const bool suffix = b_.dim() <= a_.dim() && b_.sizes() == a_.sizes().slice(a_.dim() - b_.dim());
  KF_CHECK(suffix, kFwd, "b has shape ", b_.sizes(), ": must be a's shape ", a_.sizes(), " or its trailing dims");
  LaunchOn on(a_);
  // The output takes a's layout, as eager's `a + b` does (TensorIterator follows its first operand):
  // a dense a of any dim order (a transposed (B, T, H, D) view, say) is read in place and b, when laid
  // out otherwise, is copied into that layout; the kernel then adds element i of the three buffers.
  // A broadcast b indexes a's elements in row-major order: a is made contiguous first.
  const bool keep = b_.sizes() == a_.sizes() && a_.is_non_overlapping_and_dense();
  const at::Tensor a = keep ? a_ : a_.contiguous();
  const at::Tensor b = !keep ? b_.contiguous() : same_layout(b_, a) ? b_ : at::empty_like(a).copy_(b_);
  at::Tensor out = keep ? at::empty_like(a) : new_output_like(a);
  if (keep && poison_outputs()) out.fill_(std::numeric_limits<double>::quiet_NaN());
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
