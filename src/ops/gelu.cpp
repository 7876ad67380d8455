// gelu launchers (tanh approximation, see kernels_src/gelu.cu): forward -> out; backward -> dx,
// recomputed from x.
//
// `variant` (for A/B timing; every value computes gelu to within the tests' tolerances):
//   0  the original layout: grid-stride loop, one 16-byte pack per thread per step, 256-thread blocks,
//      at most 16 blocks per SM, streaming loads, default stores.
//   1  no loop: 128-thread blocks, P = 4 packs per thread (backward: 4 of dout and 4 of x),
//      all loads issued before the math, grid = packs / (P * 128) + 1, streaming loads and stores.
//      Forward 32 registers (16 blocks per SM: 128 KB of loads in flight per SM), backward 48 (10
//      blocks: 160 KB).
//   2  as 1 with default (write-back) stores.
//   3  (default: the fastest on the H200, scripts/ab.py in BENCHMARKS.md) as 1 with 256-thread
//      blocks and P = 2: 32 registers, 8 blocks per SM (forward 64 KB in flight, backward 128 KB).
//   4  as 1 with P = 8: forward 64 registers (8 blocks, 128 KB), backward 128 (4 blocks, 128 KB).
//   5  forward only: as 1 with the hardware tanh.approx for bf16 / fp16 (float32: as 1).
// Misaligned pointers (any of them off a 16-byte boundary) take variant 0's scalar path whatever
// the variant.
#include <algorithm>
#include <limits>

#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

constexpr const char* kFwd = "gelu_forward";
constexpr const char* kBwd = "gelu_backward";

Program prog("gelu", ProgramOptions{/*fast_math=*/true});
// Variant 0 (and the misaligned fallback of every variant).
Kernel fwd(prog, "gelu_forward_kernel<{T}>");
Kernel bwd(prog, "gelu_backward_kernel<{T}>");

// Pack kernels: <T, P, B, MinBlocks, StoreCS[, FastTanh]>, see kernels_src/gelu.cu. MinBlocks (the
// __launch_bounds__ minimum, which caps the registers) is the most resident blocks per SM that ptxas
// reaches without spilling (checked for sm_80 and sm_90 with nvcc --resource-usage). Without a
// minimum ptxas took up to 60 (backward P = 4) registers; with a minimum of 1, up to 239.
struct PackLayout {
  int packs_per_thread, threads;
};
constexpr PackLayout kLayout[] = {{0, 0}, {4, 128}, {4, 128}, {2, 256}, {8, 128}, {4, 128}};
constexpr int kMaxFwdVariant = 5, kMaxBwdVariant = 4;

Kernel fwd_packs[] = {
    Kernel(prog, "gelu_forward_packs_kernel<{T}, 4, 128, 16, true, false>"),
    Kernel(prog, "gelu_forward_packs_kernel<{T}, 4, 128, 16, false, false>"),
    Kernel(prog, "gelu_forward_packs_kernel<{T}, 2, 256, 8, true, false>"),
    Kernel(prog, "gelu_forward_packs_kernel<{T}, 8, 128, 8, true, false>"),
    Kernel(prog, "gelu_forward_packs_kernel<{T}, 4, 128, 16, true, true>", {DType::bf16, DType::f16}),
};
Kernel bwd_packs[] = {
    Kernel(prog, "gelu_backward_packs_kernel<{T}, 4, 128, 10, true>"),
    Kernel(prog, "gelu_backward_packs_kernel<{T}, 4, 128, 10, false>"),
    Kernel(prog, "gelu_backward_packs_kernel<{T}, 2, 256, 8, true>"),
    Kernel(prog, "gelu_backward_packs_kernel<{T}, 8, 128, 4, true>"),
};

// Variant 0's grid: a few resident waves of 256-thread blocks; the kernels' grid-stride loops cover
// the rest, so any numel (including > 2^31) works.
Dim3 elementwise_grid(int64_t n, bool vec, int64_t elem_size, int device) {
  return grid_stride_blocks(vec ? n / (16 / elem_size) : n, 256, 16, device);
}

// Pack kernels' grid: one block per P * B packs, plus one (partial or empty) block that also writes
// the scalar tail.
unsigned packs_grid(int64_t n, int64_t elem_size, const PackLayout& l, const char* op) {
  const int64_t blocks = n / (16 / elem_size) / (int64_t(l.packs_per_thread) * l.threads) + 1;
  KF_CHECK(blocks <= std::numeric_limits<int>::max(), op, "too many elements: ", n);
  return static_cast<unsigned>(blocks);
}

at::Tensor gelu_forward(const at::Tensor& x_, int64_t variant) {
  KF_CHECK(variant >= 0 && variant <= kMaxFwdVariant, kFwd, "variant must be 0 to 5, got ", variant);
  const at::Tensor x = input(x_, kFwd, "x");
  LaunchOn on(x);
  at::Tensor out = new_output_like(x);
  const long long n = x.numel();
  if (n == 0) return out;
  const DType dt = dtype_of(x, kFwd);
  const int vec = aligned16(x) && aligned16(out);
  if (variant == 0 || !vec) {
    fwd.launch(dt, on.device, on.stream, elementwise_grid(n, vec, x.element_size(), on.device),
               Dim3(256), 0, x.data_ptr(), out.data_ptr(), n, vec);
    return out;
  }
  if (variant == 5 && dt == DType::f32) variant = 1;  // the hardware tanh is for 16-bit outputs only
  const PackLayout& l = kLayout[variant];
  const Dim3 grid(packs_grid(n, x.element_size(), l, kFwd));
  fwd_packs[variant - 1].launch(dt, on.device, on.stream, grid, Dim3(l.threads), 0, x.data_ptr(),
                                out.data_ptr(), n);
  return out;
}

at::Tensor gelu_backward(const at::Tensor& dout_, const at::Tensor& x_, int64_t variant) {
  KF_CHECK(variant >= 0 && variant <= kMaxBwdVariant, kBwd,
           "variant must be 0 to 4 (5, the hardware tanh, is forward only), got ", variant);
  const at::Tensor x = input(x_, kBwd, "x");
  const at::Tensor dout = input_like(dout_, x, kBwd, "dout");
  KF_CHECK(dout.sizes() == x.sizes(), kBwd, "dout has shape ", dout.sizes(), ", x has ", x.sizes());
  LaunchOn on(x);
  at::Tensor dx = new_output_like(x);
  const long long n = x.numel();
  if (n == 0) return dx;
  const DType dt = dtype_of(x, kBwd);
  const int vec = aligned16(x) && aligned16(dout) && aligned16(dx);
  if (variant == 0 || !vec) {
    bwd.launch(dt, on.device, on.stream, elementwise_grid(n, vec, x.element_size(), on.device),
               Dim3(256), 0, dout.data_ptr(), x.data_ptr(), dx.data_ptr(), n, vec);
    return dx;
  }
  const PackLayout& l = kLayout[variant];
  const Dim3 grid(packs_grid(n, x.element_size(), l, kBwd));
  bwd_packs[variant - 1].launch(dt, on.device, on.stream, grid, Dim3(l.threads), 0, dout.data_ptr(),
                                x.data_ptr(), dx.data_ptr(), n);
  return dx;
}

}  // namespace

KFORGE_BIND_OP(gelu) {
  m.def("gelu_forward", &gelu_forward,
        "gelu, tanh approximation. variant (for A/B timing): 0 the original grid-stride kernel (one "
        "16-byte pack per thread per step); 1 128-thread blocks, 4 packs per thread with all "
        "loads first, non-persistent grid, streaming loads and stores, 32 registers; 2 as 1 with default "
        "stores; 3 (default) 256-thread blocks, 2 packs per thread; 4 8 packs per thread; 5 as 1 with the hardware "
        "tanh for bfloat16 / float16 (float32: as 1). Misaligned inputs take variant 0's scalar path.",
        pybind11::arg("x"), pybind11::arg("variant") = 3);
  m.def("gelu_backward", &gelu_backward,
        "gradient of the tanh-approximation gelu: dout * gelu'(x). variant (for A/B timing): 0 the "
        "original grid-stride kernel; 1 128-thread blocks, 4 packs of dout and 4 of x per "
        "thread with all loads first, non-persistent grid, streaming loads and stores; 2 as 1 with "
        "default stores; 3 (default) 256-thread blocks, 2 packs per thread; 4 8 packs per thread. Misaligned "
        "inputs take variant 0's scalar path.",
        pybind11::arg("dout"), pybind11::arg("x"), pybind11::arg("variant") = 3);
}

}  // namespace kforge
