// softmax launchers: softmax over the last dim and the fused causal attention softmax, forward and
// backward (see kernels_src/softmax.cu for the layouts).
#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

Program prog("softmax", ProgramOptions{/*fast_math=*/false});

// Register-resident rows (x, y, dy sharing their 16-byte phase): one warp per row with P packs per
// lane, P in {1, 2, 4} and 8 for fp32 only (16-bit rows of 8 packs per lane would hold 64 fp32 values
// per thread), 4 rows per block; else one block per row, 4 packs per thread. Longer rows, and rows
// whose tensors differ in 16-byte phase, stream. Block sizes match the kernels' __launch_bounds__.
constexpr int kBlockP = 4, kMaxBlock = 512, kWarpBlock = 128;
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
// Plain 16-bit rows on 16-byte boundaries of 33..128 packs (forward): persistent warps, blocks of 16
// warps sized to the GPU (kWarpsPerSm blocks per SM), each warp a balanced range of rows staged
// through a ring of kWarpSlots row slots in shared memory; P = 2 or 4 packs per lane and row.
const std::vector<DType> k16 = {DType::bf16, DType::f16};
constexpr int kWarpsBlock = 512, kWarpsPerSm = 2, kWarpSlots = 2;
Kernel fwd_warps_p2(prog, "softmax_forward_warps_kernel<{T}, 2, 2>", k16);
Kernel fwd_warps_p4(prog, "softmax_forward_warps_kernel<{T}, 4, 2>", k16);
Kernel fwd_block(prog, "softmax_forward_kernel<{T}, 4, false>");
Kernel fwd_stream(prog, "softmax_forward_stream_kernel<{T}>");
Kernel bwd_block(prog, "softmax_backward_kernel<{T}, 4, false>");
Kernel bwd_stream(prog, "softmax_backward_stream_kernel<{T}>");

// Which kernel runs rows of C elements and how it is launched.
struct Plan {
  Kernel* kernel;
  unsigned grid, block;
  bool stream;  // the stream kernels take (rows as long long, scale, vec)
};

Plan plan(int64_t rows, int64_t C, DType dt, int64_t elem_size, bool forward, bool vec) {
  if (vec) {
    const int64_t V = 16 / elem_size;
    const int64_t packs = (C + V - 1) / V;  // >= whole packs of any split of the row
    for (WarpKernels& w : warp_kernels) {
      Kernel& k = forward ? w.fwd : w.bwd;
      if (k.supports(dt) && packs <= 32 * w.P) return {&k, ceil_div(rows, kWarpBlock / 32), kWarpBlock, false};
    }
    if (packs <= int64_t(kMaxBlock) * kBlockP) {
      const unsigned block = ceil_div(packs, kBlockP * 32) * 32;  // whole warps
      return {forward ? &fwd_block : &bwd_block, static_cast<unsigned>(rows), block, false};
    }
  }
  return {forward ? &fwd_stream : &bwd_stream, static_cast<unsigned>(rows), kMaxBlock, true};
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

// Packs per lane (2 or 4) of the persistent-warps kernel for plain 16-bit rows of 33..128 packs that
// all start 16-byte aligned, or 0 when it does not apply.
int rows16_packs(const at::Tensor& x, const at::Tensor& y, int64_t C) {
  if (x.element_size() != 2 || C % 8 != 0) return 0;
  if ((reinterpret_cast<uintptr_t>(x.data_ptr()) & 15) || (reinterpret_cast<uintptr_t>(y.data_ptr()) & 15))
    return 0;
  const int64_t packs = C / 8;
  if (packs > 32 && packs <= 64) return 2;
  if (packs > 64 && packs <= 128) return 4;
  return 0;
}

// Launches the persistent-warps kernel and returns true, or returns false (plan() then).
bool launch_rows16(const at::Tensor& x, at::Tensor& y, int64_t rows, int64_t C, DType dt,
                   const LaunchOn& on) {
  const int P = rows16_packs(x, y, C);
  if (P == 0) return false;
  const float scale2 = static_cast<float>(1.4426950408889634);
  constexpr int warps = kWarpsBlock / 32;
  const int64_t need = ceil_div(rows, warps);  // blocks for one row per warp
  const int64_t grid =
      std::max<int64_t>(std::min<int64_t>(need, int64_t(sm_count(on.device)) * kWarpsPerSm), 1);
  const int64_t tw = grid * warps;  // rows = q * tw + rem: q or q + 1 rows per warp
  const size_t smem = size_t(warps) * kWarpSlots * P * 32 * 16;
  (P == 2 ? fwd_warps_p2 : fwd_warps_p4)
      .launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)), Dim3(kWarpsBlock), smem,
              x.data_ptr(), y.data_ptr(), static_cast<int>(rows / tw), static_cast<int>(rows % tw),
              static_cast<int>(C), scale2);
  return true;
}

at::Tensor forward(const at::Tensor& x_, bool causal, double scale, const char* op) {
  const at::Tensor x = input(x_, op, "x");
  const auto [C, rows] = checked_rows(x, causal, op);
  LaunchOn on(x);
  at::Tensor y = new_output_like(x);
  if (x.numel() == 0) return y;
  const DType dt = dtype_of(x, op);
  if (!causal && launch_rows16(x, y, rows, C, dt, on)) return y;
  const bool vec = same_alignment({&x, &y});
  const Plan p = plan(rows, C, dt, x.element_size(), /*forward=*/true, vec);
  if (p.stream)
    p.kernel->launch(dt, on.device, on.stream, p.grid, p.block, 0, x.data_ptr(), y.data_ptr(),
                     static_cast<long long>(rows), static_cast<int>(C), int(causal),
                     static_cast<float>(scale), int(vec));
  else  // the register kernels take scale * log2(e)
    p.kernel->launch(dt, on.device, on.stream, p.grid, p.block, 0, x.data_ptr(), y.data_ptr(),
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
  const Plan p = plan(rows, C, dt, y.element_size(), /*forward=*/false, vec);
  if (p.stream)
    p.kernel->launch(dt, on.device, on.stream, p.grid, p.block, 0, dy.data_ptr(), y.data_ptr(),
                     dx.data_ptr(), static_cast<long long>(rows), static_cast<int>(C), int(causal),
                     static_cast<float>(scale), int(vec));
  else
    p.kernel->launch(dt, on.device, on.stream, p.grid, p.block, 0, dy.data_ptr(), y.data_ptr(),
                     dx.data_ptr(), static_cast<int>(rows), static_cast<int>(C), int(causal),
                     static_cast<float>(scale));
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
