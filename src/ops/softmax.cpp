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
// Plain 16-bit rows on 16-byte boundaries of 33..128 packs (forward): by default the persistent-warps
// kernel below; the pair-of-rows kernel (one warp per pair of rows, the second row staged through
// shared memory, 4 warps per block: 8 rows) stays for A/B timing (variant 2). P = 2 or 4 packs per
// lane and row.
const std::vector<DType> k16 = {DType::bf16, DType::f16};
Kernel fwd_rows2_p2(prog, "softmax_forward_rows2_kernel<{T}, 2>", k16);
Kernel fwd_rows2_p4(prog, "softmax_forward_rows2_kernel<{T}, 4>", k16);
// The same rows by persistent warps (the default): blocks of 16 warps sized to the GPU, each warp a
// balanced range of rows staged through a ring of S row slots in shared memory (S = 2, or 4 for
// variant 4); P = 2 or 4 packs per lane and row.
constexpr int kWarpsBlock = 512, kWarpsPerSm = 2;
struct WarpsKernels {
  int S;
  Kernel p2, p4;
};
WarpsKernels warps_s2{2, {prog, "softmax_forward_warps_kernel<{T}, 2, 2>", k16},
                      {prog, "softmax_forward_warps_kernel<{T}, 4, 2>", k16}};
WarpsKernels warps_s4{4, {prog, "softmax_forward_warps_kernel<{T}, 2, 4>", k16},
                      {prog, "softmax_forward_warps_kernel<{T}, 4, 4>", k16}};
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

// Packs per lane (2 or 4) of the pair-of-rows and persistent-warps kernels for plain 16-bit rows
// of 33..128 packs that all start 16-byte aligned, or 0 when they do not apply.
int rows16_packs(const at::Tensor& x, const at::Tensor& y, int64_t C) {
  if (x.element_size() != 2 || C % 8 != 0) return 0;
  if ((reinterpret_cast<uintptr_t>(x.data_ptr()) & 15) || (reinterpret_cast<uintptr_t>(y.data_ptr()) & 15))
    return 0;
  const int64_t packs = C / 8;
  if (packs > 32 && packs <= 64) return 2;
  if (packs > 64 && packs <= 128) return 4;
  return 0;
}

// Forward variants (softmax_forward's `variant`, for A/B timing); where the 16-bit rows kernels do
// not apply, every variant takes plan().
enum Variant : int64_t {
  kWarps = 0,       // persistent warps, S = 2, kWarpsPerSm blocks per SM (default)
  kOneWarp = 1,     // never the 16-bit rows kernels: plan() (one warp per row for these rows)
  kPairs = 2,       // pair-of-rows kernel (the previous default)
  kWarpsPairs = 3,  // persistent-warps kernel, S = 2, a grid of <= 2 rows per warp (no balancing)
  kWarpsS4 = 4,     // persistent warps, S = 4, one block per SM (~4 rows per warp at 8192 rows)
  kNumVariants = 5,
};

// Launches the 16-bit rows kernel of `variant` and returns true, or returns false (plan() then).
bool launch_rows16(const at::Tensor& x, at::Tensor& y, int64_t rows, int64_t C, DType dt,
                   const LaunchOn& on, int64_t variant) {
  const int P = variant == kOneWarp ? 0 : rows16_packs(x, y, C);
  if (P == 0) return false;
  const float scale2 = static_cast<float>(1.4426950408889634);
  if (variant == kPairs) {
    Kernel& k = P == 2 ? fwd_rows2_p2 : fwd_rows2_p4;
    k.launch(dt, on.device, on.stream, Dim3(ceil_div(rows, 8)), Dim3(kWarpBlock), 0, x.data_ptr(),
             y.data_ptr(), static_cast<int>(rows), static_cast<int>(C), scale2);
    return true;
  }
  WarpsKernels& w = variant == kWarpsS4 ? warps_s4 : warps_s2;
  constexpr int warps = kWarpsBlock / 32;
  const int64_t need = ceil_div(rows, warps);  // blocks for one row per warp
  int64_t grid;
  if (variant == kWarpsPairs)
    grid = ceil_div(rows, 2 * warps);
  else
    grid = std::min<int64_t>(need, int64_t(sm_count(on.device)) * (variant == kWarpsS4 ? 1 : kWarpsPerSm));
  grid = std::max<int64_t>(grid, 1);
  const int64_t tw = grid * warps;  // rows = q * tw + rem: q or q + 1 rows per warp
  const size_t smem = size_t(warps) * w.S * P * 32 * 16;
  (P == 2 ? w.p2 : w.p4)
      .launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)), Dim3(kWarpsBlock), smem,
              x.data_ptr(), y.data_ptr(), static_cast<int>(rows / tw), static_cast<int>(rows % tw),
              static_cast<int>(C), scale2);
  return true;
}

at::Tensor forward(const at::Tensor& x_, bool causal, double scale, const char* op, int64_t variant = 0) {
  const at::Tensor x = input(x_, op, "x");
  const auto [C, rows] = checked_rows(x, causal, op);
  LaunchOn on(x);
  at::Tensor y = new_output_like(x);
  if (x.numel() == 0) return y;
  const DType dt = dtype_of(x, op);
  if (!causal && launch_rows16(x, y, rows, C, dt, on, variant)) return y;
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

at::Tensor softmax_forward(const at::Tensor& x, int64_t variant) {
  KF_CHECK(variant >= 0 && variant < kNumVariants, "softmax_forward", "variant must be in 0..",
           int64_t(kNumVariants) - 1, ", got ", variant);
  return forward(x, false, 1.0, "softmax_forward", variant);
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
        "y = softmax(x) over the last dim. variant (for A/B timing) picks the kernel for 16-bit rows of "
        "264..1024 elements (a multiple of 8, 16-byte aligned); other rows take the same kernel in every "
        "variant. 0 (default): persistent warps, grid sized to the GPU (2 blocks of 16 warps per SM), a "
        "balanced range of rows per warp, 2 row slots per warp in shared memory; 1: one warp per row; "
        "2: pair-of-rows kernel (one warp per 2 rows, the previous default); 3: the persistent-warps "
        "kernel on a grid of <= 2 rows per warp; 4: persistent warps with 4 row slots, 1 block per SM",
        pybind11::arg("x"), pybind11::arg("variant") = 0);
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
