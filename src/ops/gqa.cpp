// gqa launchers: repeat_kv head expansion (B, Hkv, T, D) -> (B, Hkv * n_rep, T, D) and its backward
// (fixed-order sum over each group); see kernels_src/gqa.cu.
#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

Program prog("gqa");
Kernel fwd(prog, "gqa_forward_kernel<{T}>");
Kernel bwd(prog, "gqa_backward_kernel<{T}>");

constexpr int kBlock = 256;

// (x-blocks, y-blocks) covering `slabs` slabs of `chunks` chunks each, about 32 blocks per SM.
Dim3 grid_for(int64_t slabs, int64_t chunks, int device) {
  const int64_t gy = std::min<int64_t>(slabs, 65535);
  const int64_t want = std::max<int64_t>(1, sm_count(device) * 32 / gy);
  const int64_t gx = std::max<int64_t>(1, std::min<int64_t>((chunks + kBlock - 1) / kBlock, want));
  return Dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}

void check_n_rep(int64_t n_rep, const char* op) {
  KF_CHECK(n_rep >= 1 && n_rep <= 4096, op, "n_rep must be in [1, 4096], got ", n_rep);
}

constexpr int64_t kFwdChunksPerThread = 4;  // kGqaFwdK in kernels_src/gqa.cu

// `reps`: output heads each unit writes from one load of x: n_rep (0 = default) reads x once; 1
// writes the output in address order, re-reading x from L2 (kept selectable for benchmarking).
at::Tensor gqa_forward(const at::Tensor& x_, int64_t n_rep, int64_t reps) {
  const char* op = "repeat_kv_forward";
  check_n_rep(n_rep, op);
  KF_CHECK(reps >= 0, op, "reps must be >= 0 (0: n_rep), got ", reps);
  KF_CHECK(x_.defined() && x_.is_cuda(), op, "x must be a CUDA tensor");
  dtype_of(x_, op);
  KF_CHECK(x_.dim() == 4, op, "x must be (B, Hkv, T, D), got shape ", x_.sizes());
  // Strides in B, Hkv and T are kept (a transposed (B, T, Hkv, D) view needs no copy).
  const at::Tensor x = x_.stride(3) == 1 ? x_ : x_.contiguous();
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  KF_CHECK(T * D <= (int64_t(1) << 30) && H * n_rep <= std::numeric_limits<int>::max(), op,
           "a (T, D) slab of ", T * D, " elements is too large (max 2^30)");
  LaunchOn on(x);
  at::Tensor out = new_output({B, H * n_rep, T, D}, x.options());
  if (out.numel() == 0) return out;
  const int64_t V = 16 / x.element_size();
  bool vec = D % V == 0 && aligned16(x);
  for (int d = 0; d < 3; ++d) vec = vec && x.stride(d) % V == 0;
  const int64_t per_rep = (reps == 0 || reps > n_rep) ? n_rep : reps;
  const int64_t groups = (n_rep + per_rep - 1) / per_rep;
  // 256 threads per block, fewer (whole warps) when a slab is short (decoding: T = 1).
  const int64_t per_slab = T * D / (vec ? V : 1), warp_tile = 32 * kFwdChunksPerThread;
  const int64_t threads = 32 * std::min<int64_t>(kBlock / 32, (per_slab + warp_tile - 1) / warp_tile);
  const int64_t tile = threads * kFwdChunksPerThread;
  const int64_t tiles = (per_slab + tile - 1) / tile;
  const int64_t units = B * H * groups * tiles;
  // About two waves of blocks, each block the same number of units.
  const int64_t cap = int64_t(sm_count(on.device)) * 2 * std::min<int64_t>(32, 2048 / threads);
  const int64_t iters = (units + cap - 1) / cap;
  const unsigned grid = static_cast<unsigned>((units + iters - 1) / iters);
  fwd.launch(dtype_of(x, op), on.device, on.stream, Dim3(grid), Dim3(static_cast<unsigned>(threads)),
             0, x.data_ptr(), out.data_ptr(), static_cast<int>(H), static_cast<int>(n_rep),
             static_cast<int>(per_rep), static_cast<int>(T), static_cast<int>(D),
             static_cast<long long>(x.stride(0)), static_cast<long long>(x.stride(1)),
             static_cast<long long>(x.stride(2)), static_cast<int>(tiles),
             static_cast<long long>(units), int(vec));
  return out;
}

at::Tensor gqa_backward(const at::Tensor& dout_, int64_t n_rep) {
  const char* op = "repeat_kv_backward";
  check_n_rep(n_rep, op);
  const at::Tensor dout = input(dout_, op, "dout");
  KF_CHECK(dout.dim() == 4 && dout.size(1) % n_rep == 0, op,
           "dout must be (B, Hkv * n_rep, T, D) with n_rep = ", n_rep, ", got shape ", dout.sizes());
  const int64_t B = dout.size(0), H = dout.size(1) / n_rep, T = dout.size(2), D = dout.size(3);
  KF_CHECK(T * D <= (int64_t(1) << 30), op, "a (T, D) slab of ", T * D,
           " elements is too large (max 2^30)");
  LaunchOn on(dout);
  at::Tensor dx = new_output({B, H, T, D}, dout.options());
  if (dx.numel() == 0) return dx;
  const int64_t V = 16 / dout.element_size();
  const int vec = (T * D) % V == 0 && aligned16(dout) && aligned16(dx);
  const Dim3 grid = grid_for(B * H, T * D / (vec ? V : 1), on.device);
  bwd.launch(dtype_of(dout, op), on.device, on.stream, grid, kBlock, 0, dout.data_ptr(),
             dx.data_ptr(), static_cast<int>(n_rep), static_cast<long long>(T * D),
             static_cast<long long>(B * H), vec);
  return dx;
}

}  // namespace

KFORGE_BIND_OP(gqa) {
  m.def("repeat_kv_forward", &gqa_forward,
        "HF repeat_kv: x (B, Hkv, T, D) -> (B, Hkv * n_rep, T, D), head h reading kv head h // n_rep",
        pybind11::arg("x"), pybind11::arg("n_rep"),
        // Output heads written per load of x (0: all n_rep, x read once; 1: output in address order).
        pybind11::arg("reps") = 0);
  m.def("repeat_kv_backward", &gqa_backward,
        "dx (B, Hkv, T, D): each kv head's n_rep output gradients summed in order (deterministic)",
        pybind11::arg("dout"), pybind11::arg("n_rep"));
}

}  // namespace kforge
