// layernorm launchers (see kernels_src/layernorm.cu): forward -> (out, mean, rstd); backward ->
// (dx, dweight, dbias) with deterministic weight / bias gradients (per-block partials, fixed-order
// reduce). Layouts by dtype and row length C (16-byte units where C is a multiple of the pack and
// every pointer is aligned, else scalars):
//   forward:  fp32 rows of up to 1024 columns: GROUP (a row over 32 NW threads, 8 columns a
//             thread); bf16 / half rows of up to 2048 (16-byte) / 1024 (scalar) columns: WARP (one
//             warp per row); longer rows: BLOCK (a row over a block).
//   backward: bf16 / half rows of up to 1024 columns with 16-byte units: RING (persistent groups
//             streaming their rows through kRingSlots shared-memory slots); other rows of up to
//             1024 columns: GROUP; longer rows: BLOCK. Then the parameter-gradient reduce: 16-byte
//             loads (even C) or scalar loads (odd C).
// The dtype splits are the H200 timings at 8192 x 768 (scripts/ab.py, BENCHMARKS.md): forward fp32
// GROUP 14.2 us against WARP's 14.8, bf16 WARP 9.1 against GROUP's 9.9; backward bf16 RING 16.1-16.9
// against GROUP's 17.1-17.8, fp32 GROUP 22.8-23.7 against RING's 25.4-27.6.
// Rows past a layout's int row index (GROUP: N > 2^30; RING: N >= 2^31) take WARP instead; the
// launchers' `variant` 1 (tests only) forces that fallback (never GROUP / RING) at any N.
#include <algorithm>
#include <optional>
#include <tuple>

#include "../runtime/torch_launch.h"
#include "launch_params.cuh"  // kernels_src/: the constants layernorm.cu is compiled with

namespace kforge {
namespace {
using namespace kf_layernorm;

constexpr const char* kFwd = "layernorm_forward";
constexpr const char* kBwd = "layernorm_backward";

// The launchers' `variant`: 0 the layouts above; 1 (tests only) never GROUP / RING, the layouts the
// default falls back to past their int row index (WARP where it fits, else BLOCK).
constexpr int64_t kDefault = 0, kNoGroup = 1, kNumVariants = 2;
void check_variant(int64_t variant, const char* op) {
  KF_CHECK(variant >= 0 && variant < kNumVariants, op, "variant must be in [0, ", kNumVariants - 1,
           "], got ", variant);
}

Program prog("layernorm");
const std::vector<DType> kF32Only = {DType::f32};
const std::vector<DType> k16Bit = {DType::bf16, DType::f16};

// BLOCK layout, [vec][fits]: 16-byte units or scalars; row slice held in registers or re-read.
Kernel fwd_kernels[2][2] = {
    {Kernel(prog, "layernorm_forward_kernel<{T}, false, false>"),
     Kernel(prog, "layernorm_forward_kernel<{T}, false, true>")},
    {Kernel(prog, "layernorm_forward_kernel<{T}, true, false>"),
     Kernel(prog, "layernorm_forward_kernel<{T}, true, true>")}};
Kernel bwd_kernels[2][2] = {
    {Kernel(prog, "layernorm_backward_kernel<{T}, false, false>"),
     Kernel(prog, "layernorm_backward_kernel<{T}, false, true>")},
    {Kernel(prog, "layernorm_backward_kernel<{T}, true, false>"),
     Kernel(prog, "layernorm_backward_kernel<{T}, true, true>")}};

// WARP layout (one warp per row), instantiated for these units per lane P: 16-byte units (VEC) or
// single elements (misaligned pointers, C not a multiple of the pack). Backward units are limited
// to 32 columns a lane (P * pack <= 32), so P = 6, 8 exist for float only.
constexpr int kVecP[] = {2, 3, 4, 6, 8};
constexpr int kScalarP[] = {32};
constexpr int kNumVecP = 5, kNumScalarP = 1;
Kernel fwd_warp_vec[kNumVecP] = {
    Kernel(prog, "layernorm_forward_warp_kernel<{T}, true, 2>"),
    Kernel(prog, "layernorm_forward_warp_kernel<{T}, true, 3>"),
    Kernel(prog, "layernorm_forward_warp_kernel<{T}, true, 4>"),
    Kernel(prog, "layernorm_forward_warp_kernel<{T}, true, 6>"),
    Kernel(prog, "layernorm_forward_warp_kernel<{T}, true, 8>")};
Kernel fwd_warp_scalar[kNumScalarP] = {
    Kernel(prog, "layernorm_forward_warp_kernel<{T}, false, 32>")};
Kernel bwd_warp_vec[kNumVecP] = {
    Kernel(prog, "layernorm_backward_warp_kernel<{T}, true, 2>"),
    Kernel(prog, "layernorm_backward_warp_kernel<{T}, true, 3>"),
    Kernel(prog, "layernorm_backward_warp_kernel<{T}, true, 4>"),
    Kernel(prog, "layernorm_backward_warp_kernel<{T}, true, 6>", kF32Only),
    Kernel(prog, "layernorm_backward_warp_kernel<{T}, true, 8>", kF32Only)};
Kernel bwd_warp_scalar[kNumScalarP] = {
    Kernel(prog, "layernorm_backward_warp_kernel<{T}, false, 32>")};

// GROUP layout <T, VEC>: the forward for fp32 only, the backward's 16-byte units for fp32 only
// (bf16 / half take WARP / RING there).
Kernel fwd_group_vec(prog, "layernorm_forward_group_kernel<{T}, true>", kF32Only);
Kernel fwd_group_scalar(prog, "layernorm_forward_group_kernel<{T}, false>", kF32Only);
Kernel bwd_group_vec(prog, "layernorm_backward_group_kernel<{T}, true>", kF32Only);
Kernel bwd_group_scalar(prog, "layernorm_backward_group_kernel<{T}, false>");

// RING layout (bf16 / half backward, 16-byte units).
Kernel bwd_ring(prog, "layernorm_backward_ring_kernel<{T}>", k16Bit);

// Parameter-gradient reduce: 16-byte loads (even C) or scalar (odd C).
Kernel param_grad_vec_kernel(prog, "layernorm_param_grad_vec_kernel<{T}>");
Kernel param_grad_kernel(prog, "layernorm_param_grad_kernel<{T}>");

// Launcher-only limits (the kernels' own numbers: launch_params.cuh).
constexpr int64_t kMaxC = int64_t(1) << 30;  // keeps every in-row index (and 2C) in an int
constexpr int kMaxNamedBarrierGroups = 15;   // groups of several warps sync on bar.sync 1..15
constexpr int64_t kMaxGroupRows = int64_t(1) << 30;  // GROUP kernels index rows with int

// LnWarpCfg<T, VEC, P> of kernels_src/layernorm.cu: rows a forward / backward warp takes at once,
// resident forward blocks per SM, backward warps per SM (the kernels' launch bounds).
struct WarpCfg {
  int fwd_rows, bwd_rows, fwd_blocks, bwd_warps;
};
WarpCfg ln_warp_cfg(bool vec, int P, int64_t elem_size) {
  return {ln_fwd_rows(vec, P), ln_bwd_rows(vec, P), ln_fwd_blocks(vec, P),
          ln_bwd_warps(vec, P, static_cast<int>(elem_size))};
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Warps per SM for `chunks` work items (a chunk: the rows a warp takes at once) on `sms` SMs with at
// most `max_per_sm` warps each: the fewest that still need the same number of rounds (a warp does
// one chunk per round), so the last round is nearly full.
int64_t balanced_warps_per_sm(int64_t chunks, int64_t sms, int64_t max_per_sm) {
  const int64_t rounds = cdiv(chunks, sms * max_per_sm);
  return std::max<int64_t>(1, std::min(max_per_sm, cdiv(chunks, sms * rounds)));
}

// GROUP layout (kernels_src/layernorm.cu): threads per row (a multiple of 32 covering the row at
// kGroupCols columns a thread).
int64_t group_tpr(int64_t C, bool vec, int64_t elem_size) {
  const int64_t V = vec ? 16 / elem_size : 1, P = kGroupCols / V;
  return 32 * cdiv(cdiv(C / V, P), 32);
}

// 16-byte units: C a multiple of the pack (rows then start 16-byte aligned too) and aligned pointers.
bool vec_ok(int64_t C, int64_t elem_size, bool aligned) { return aligned && C % (16 / elem_size) == 0; }

// WARP layout choice: index into kVecP / kScalarP of the smallest P covering a row, or -1 when the
// row is too long for it (BLOCK layout then).
struct WarpPlan {
  int index = -1;
  int P = 0;
};
WarpPlan warp_plan(int64_t C, int64_t elem_size, bool vec, bool backward) {
  WarpPlan plan;
  const int64_t V = vec ? 16 / elem_size : 1;
  const int64_t need = (C / V + 31) / 32;  // units per lane
  const int* ps = vec ? kVecP : kScalarP;
  const int n = vec ? kNumVecP : kNumScalarP;
  for (int i = 0; i < n; ++i) {
    if (ps[i] < need) continue;
    if (backward && ps[i] * V > kMaxBwdColumns) break;
    plan.index = i;
    plan.P = ps[i];
    break;
  }
  return plan;
}

// How a row is split over a block in the BLOCK layout (see kernels_src/layernorm.cu).
struct RowLayout {
  bool vec;   // 16-byte units
  bool fits;  // a thread's units fit in kRegElems registers
  int tpr;    // threads per row (blockDim.x)
};

RowLayout row_layout(int64_t C, int64_t elem_size, bool aligned) {
  RowLayout L;
  L.vec = vec_ok(C, elem_size, aligned);
  const int64_t v = L.vec ? 16 / elem_size : 1, units = C / v, regs = kRegElems / v;
  const int64_t tpr_fit = (ceil_div(units, regs) + 31) / 32 * 32;
  L.fits = tpr_fit <= 512;  // FITS kernels are launch-bounded to 512 threads
  L.tpr = static_cast<int>(L.fits ? tpr_fit : 1024);
  return L;
}

// Optional 1-D parameter of size C, same device / dtype as x; undefined tensor when absent.
at::Tensor param(const std::optional<at::Tensor>& p, const at::Tensor& x, int64_t C, const char* op,
                 const char* name) {
  if (!p.has_value() || !p->defined()) return at::Tensor();
  at::Tensor t = input_like(*p, x, op, name);
  KF_CHECK(t.dim() == 1 && t.size(0) == C, op, name, " must have shape (", C, "), got ", t.sizes());
  return t;
}

// Rows N and row length C of x (normalising the last dim).
std::pair<int64_t, int64_t> rows_cols(const at::Tensor& x, const char* op) {
  KF_CHECK(x.dim() >= 1, op, "x must have at least one dimension");
  const int64_t C = x.size(-1);
  KF_CHECK(C >= 1 && C <= kMaxC, op, "last dim C=", C, " must be in [1, 2^30]");
  return {x.numel() / C, C};
}

const void* ptr_or_null(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }
bool aligned_or_absent(const at::Tensor& t) { return !t.defined() || aligned16(t); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> layernorm_forward(
    const at::Tensor& x_, const std::optional<at::Tensor>& weight_,
    const std::optional<at::Tensor>& bias_, double eps, int64_t max_warps, int64_t variant) {
  const at::Tensor x = input(x_, kFwd, "x");
  const auto [N, C] = rows_cols(x, kFwd);
  const at::Tensor w = param(weight_, x, C, kFwd, "weight");
  const at::Tensor b = param(bias_, x, C, kFwd, "bias");
  KF_CHECK(eps >= 0, kFwd, "eps must be >= 0, got ", eps);
  KF_CHECK(max_warps >= 0, kFwd, "max_warps must be >= 0, got ", max_warps);
  check_variant(variant, kFwd);
  LaunchOn on(x);
  at::Tensor out = new_output_like(x);
  at::Tensor mean = new_output({N}, x.options().dtype(at::kFloat));
  at::Tensor rstd = new_output({N}, x.options().dtype(at::kFloat));
  if (N == 0) return {out, mean, rstd};

  const bool aligned =
      aligned16(x) && aligned16(out) && aligned_or_absent(w) && aligned_or_absent(b);
  const DType dt = dtype_of(x, kFwd);
  const int64_t es = x.element_size();
  const bool vec = vec_ok(C, es, aligned);
  const WarpPlan wp = warp_plan(C, es, vec, /*backward=*/false);
  const int64_t sms = sm_count(on.device);

  // GROUP (fp32): blocks of up to kGroupFwdWarps warps (G groups of tpr threads), kGroupFwdBlocks
  // resident per SM, as few groups per SM as keep the same number of rounds; groups loop beyond.
  const int64_t tpr = group_tpr(C, vec, es);
  const bool group = variant != kNoGroup && es == 4 && wp.index >= 0 && N <= kMaxGroupRows &&
                     tpr <= 32 * kGroupFwdWarps;
  if (group) {
    Kernel& k = vec ? fwd_group_vec : fwd_group_scalar;
    const int64_t nw = tpr / 32;
    int64_t G = 32 * kGroupFwdWarps / tpr;
    if (nw > 1) G = std::min<int64_t>(G, kMaxNamedBarrierGroups);
    int64_t most = kGroupFwdBlocks * G;  // groups per SM
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(1, max_warps / nw));
    G = std::min(G, most);
    const int64_t per_sm = balanced_warps_per_sm(N, sms, most);
    const int64_t grid = std::min(cdiv(N, G), sms * cdiv(per_sm, G));
    k.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)),
             Dim3(static_cast<unsigned>(tpr), static_cast<unsigned>(G)), 0, x.data_ptr(),
             ptr_or_null(w), ptr_or_null(b), out.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
             static_cast<long long>(N), static_cast<int>(C), static_cast<float>(eps));
    return {out, mean, rstd};
  }

  if (wp.index >= 0) {
    // WARP: warps of fwd_rows rows each, kFwdWarps per block; no more blocks than stay resident (the
    // kernel's launch bound), as few per SM as keep the same number of rounds.
    const WarpCfg cfg = ln_warp_cfg(vec, wp.P, es);
    Kernel& k = vec ? fwd_warp_vec[wp.index] : fwd_warp_scalar[wp.index];
    const int64_t chunks = cdiv(N, cfg.fwd_rows);
    int64_t most = int64_t(cfg.fwd_blocks) * kFwdWarps;
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(kFwdWarps, max_warps));
    const int64_t per_sm = balanced_warps_per_sm(chunks, sms, most);
    const int64_t grid = std::min(cdiv(chunks, kFwdWarps), sms * cdiv(per_sm, kFwdWarps));
    k.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)), Dim3(32, kFwdWarps), 0,
             x.data_ptr(), ptr_or_null(w), ptr_or_null(b), out.data_ptr(), mean.data_ptr(),
             rstd.data_ptr(), static_cast<long long>(N), static_cast<int>(C),
             static_cast<float>(eps), 0);
    return {out, mean, rstd};
  }

  const RowLayout L = row_layout(C, es, aligned);
  // Small blocks pack the SMs best; several rows per block when rows are short.
  const int rows = L.fits ? std::clamp(256 / L.tpr, 1, kMaxRowsPerBlock) : 1;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((N + rows - 1) / rows, INT32_MAX));
  fwd_kernels[L.vec][L.fits].launch(dt, on.device, on.stream, Dim3(grid), Dim3(L.tpr, rows), 0,
                                    x.data_ptr(), ptr_or_null(w), ptr_or_null(b), out.data_ptr(),
                                    mean.data_ptr(), rstd.data_ptr(), static_cast<long long>(N),
                                    static_cast<int>(C), static_cast<float>(eps));
  return {out, mean, rstd};
}

// dweight / dbias from the G partial rows (2C floats each): 16-byte loads where 2C % 4 == 0,
// scalar loads for odd C.
void param_grad(const at::Tensor& partial, std::optional<at::Tensor>& dweight,
                std::optional<at::Tensor>& dbias, int64_t G, int64_t C, DType dt,
                const LaunchOn& on) {
  const void* p = partial.data_ptr();
  void* dw = dweight ? dweight->data_ptr() : nullptr;
  void* db = dbias ? dbias->data_ptr() : nullptr;
  if (C % 2 == 0) {
    param_grad_vec_kernel.launch(dt, on.device, on.stream, Dim3(ceil_div(2 * C, 4 * kPgX)),
                                 Dim3(kPgX, kPgY), 0, p, dw, db, static_cast<int>(G),
                                 static_cast<int>(C));
    return;
  }
  param_grad_kernel.launch(dt, on.device, on.stream, Dim3(ceil_div(2 * C, 32)), Dim3(32, 32), 0, p,
                           dw, db, static_cast<int>(G), static_cast<int>(C));
}

std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> layernorm_backward(
    const at::Tensor& dout_, const at::Tensor& x_, const std::optional<at::Tensor>& weight_,
    const std::optional<at::Tensor>& bias_, const at::Tensor& mean_, const at::Tensor& rstd_,
    int64_t max_warps, int64_t variant) {
  const at::Tensor x = input(x_, kBwd, "x");
  const at::Tensor dout = input_like(dout_, x, kBwd, "dout");
  KF_CHECK(dout.sizes() == x.sizes(), kBwd, "dout has shape ", dout.sizes(), ", x has ", x.sizes());
  const auto [N, C] = rows_cols(x, kBwd);
  const at::Tensor w = param(weight_, x, C, kBwd, "weight");
  const at::Tensor b = param(bias_, x, C, kBwd, "bias");  // only its presence matters
  for (const auto& [t, name] : {std::pair{&mean_, "mean"}, std::pair{&rstd_, "rstd"}}) {
    KF_CHECK(t->defined() && t->is_cuda() && t->device() == x.device(), kBwd, name,
             " must be a CUDA tensor on ", x.device());
    KF_CHECK(t->scalar_type() == at::kFloat && t->numel() == N, kBwd, name,
             " must be float32 with one value per row (", N, "), got ", t->scalar_type(), " ",
             t->sizes());
  }
  KF_CHECK(max_warps >= 0, kBwd, "max_warps must be >= 0, got ", max_warps);
  check_variant(variant, kBwd);
  const at::Tensor mean = mean_.contiguous(), rstd = rstd_.contiguous();
  LaunchOn on(x);
  const DType dt = dtype_of(x, kBwd);
  at::Tensor dx = new_output_like(x);
  std::optional<at::Tensor> dweight, dbias;
  if (w.defined()) dweight = new_output({C}, w.options());
  if (b.defined()) dbias = new_output({C}, b.options());
  if (N == 0) {  // no rows: the parameter gradients are empty sums
    if (dweight) dweight->zero_();
    if (dbias) dbias->zero_();
    return {dx, dweight, dbias};
  }

  const bool aligned = aligned16(x) && aligned16(dout) && aligned16(dx) && aligned_or_absent(w);
  const bool need_dw = w.defined(), need_db = b.defined();
  at::Tensor partial;  // per-block partial sums [dweight | dbias], one row of 2C floats per block
  int64_t grid = 0;
  const int64_t es = x.element_size();
  const bool vec = vec_ok(C, es, aligned);
  const WarpPlan wp = warp_plan(C, es, vec, /*backward=*/true);
  const int64_t sms = sm_count(on.device);

  // RING (bf16 / half, 16-byte units, C <= kRingMaxC): one block per SM of G groups (tpr threads
  // each), as many groups as the shared memory holds (kRingSlots row slots of x and dout each, at
  // most 16 KiB; the fold at the end reuses it) and the launch bound allows, as few as keep the
  // same number of rounds; the N rows split into contiguous ranges of q or q + 1 rows, one per
  // group.
  if (variant != kNoGroup && es == 2 && vec && C <= kRingMaxC && N < (int64_t(1) << 31)) {
    const int64_t units = C / 8;
    const int64_t rtpr = 32 * cdiv(units, 32);
    const int64_t ring_bytes = int64_t(kRingSlots) * 2 * units * 16;  // a group's slots
    const int64_t fold_bytes = 2 * 8 * 4 * rtpr;                      // a group's column sums
    const int64_t per_group = std::max(ring_bytes, fold_bytes);
    const int64_t optin = at::cuda::getDeviceProperties(on.device)->sharedMemPerBlockOptin;
    const int64_t budget = optin - kRingStaticSmem;
    int64_t most = std::min<int64_t>(kRingThreads / rtpr, budget / per_group);
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(1, max_warps / (rtpr / 32)));
    KF_CHECK(most >= 1, kBwd, "a row of ", C, " columns needs ", per_group + kRingStaticSmem,
             " bytes of shared memory, the device has ", optin);
    const int64_t G = balanced_warps_per_sm(N, sms, most);
    grid = std::min(sms, cdiv(N, G));
    const int64_t groups = grid * G;
    if (need_dw || need_db) partial = new_output({grid, 2 * C}, x.options().dtype(at::kFloat));
    bwd_ring.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)),
                    Dim3(static_cast<unsigned>(rtpr), static_cast<unsigned>(G)),
                    static_cast<size_t>(G * per_group), dout.data_ptr(), x.data_ptr(),
                    ptr_or_null(w), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                    ptr_or_null(partial), static_cast<int>(N / groups),
                    static_cast<int>(N % groups), static_cast<int>(C), static_cast<int>(need_dw),
                    static_cast<int>(need_db));
    if (partial.defined()) param_grad(partial, dweight, dbias, grid, C, dt, on);
    return {dx, dweight, dbias};
  }

  // GROUP (rows the WARP layout would fit): one block per SM of G groups (tpr threads each), as few
  // groups per SM as keep the same number of rounds. The block's column sums take 64 bytes of
  // shared memory per thread.
  const int gwarps = ln_group_bwd_warps(vec);
  const int64_t tpr = group_tpr(C, vec, es);
  if (variant != kNoGroup && wp.index >= 0 && N <= kMaxGroupRows && tpr <= 32 * gwarps) {
    const int64_t nw = tpr / 32;
    int64_t most = 32 * gwarps / tpr;  // groups per SM
    if (nw > 1) most = std::min<int64_t>(most, kMaxNamedBarrierGroups);
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(1, max_warps / nw));
    const int64_t G = balanced_warps_per_sm(N, sms, most);
    grid = std::min(sms, cdiv(N, G));
    if (need_dw || need_db) partial = new_output({grid, 2 * C}, x.options().dtype(at::kFloat));
    const size_t smem =
        partial.defined() ? static_cast<size_t>(G * tpr * 2 * kGroupCols * sizeof(float)) : 0;
    Kernel& k = vec ? bwd_group_vec : bwd_group_scalar;
    k.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)),
             Dim3(static_cast<unsigned>(tpr), static_cast<unsigned>(G)), smem, dout.data_ptr(),
             x.data_ptr(), ptr_or_null(w), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
             ptr_or_null(partial), static_cast<long long>(N), static_cast<int>(C),
             static_cast<int>(need_dw), static_cast<int>(need_db));
  } else if (wp.index >= 0) {
    // WARP, persistent: at most one block per SM, warps of bwd_rows rows each, as few per SM as keep the
    // same number of rounds. A warp's column sums take 32 * P * pack floats of shared memory for
    // dweight and as many for dbias, which may cap the warps of a block.
    const WarpCfg cfg = ln_warp_cfg(vec, wp.P, es);
    const int64_t chunks = cdiv(N, cfg.bwd_rows);
    const int64_t pack = vec ? 16 / es : 1;
    const int64_t warp_smem = 2 * 32 * wp.P * pack * int64_t(sizeof(float));
    int64_t most = cfg.bwd_warps;
    if (max_warps > 0) most = std::min(most, max_warps);
    if (need_dw || need_db) {
      const int64_t optin = at::cuda::getDeviceProperties(on.device)->sharedMemPerBlockOptin;
      most = std::clamp<int64_t>(optin / warp_smem, 1, most);
    }
    const int64_t warps = balanced_warps_per_sm(chunks, sms, most);
    grid = std::min(sms, cdiv(chunks, warps));
    if (need_dw || need_db) partial = new_output({grid, 2 * C}, x.options().dtype(at::kFloat));
    const size_t smem = partial.defined() ? static_cast<size_t>(warps * warp_smem) : 0;
    Kernel& k = vec ? bwd_warp_vec[wp.index] : bwd_warp_scalar[wp.index];
    k.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)),
             Dim3(32, static_cast<unsigned>(warps)), smem, dout.data_ptr(), x.data_ptr(),
             ptr_or_null(w), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(), ptr_or_null(partial),
             static_cast<long long>(N), static_cast<int>(C), static_cast<int>(need_dw),
             static_cast<int>(need_db), 0);
  } else {
    const RowLayout L = row_layout(C, es, aligned);
    // More rows per block than the forward: each block leaves one partial row of 2C floats, so the
    // grid should be about one wave of resident blocks, each looping over several row groups.
    const int rows = L.fits ? std::clamp(512 / L.tpr, 1, kMaxRowsPerBlock) : 1;
    const int64_t threads = int64_t(L.tpr) * rows;
    // ~1024 resident threads per SM (the FITS backward uses up to 64 registers per thread); at
    // most one partial row per 8 rows, so the scratch never outgrows the input.
    const int64_t max_grid = std::max<int64_t>(
        1, std::min<int64_t>(sms * std::max<int64_t>(1, 1024 / threads), (N + 7) / 8));
    const int64_t groups = (N + rows - 1) / rows;
    const int64_t iters = (groups + max_grid - 1) / max_grid;
    grid = (groups + iters - 1) / iters;  // every block gets `iters` groups (last: fewer)
    if (need_dw || need_db) partial = new_output({grid, 2 * C}, x.options().dtype(at::kFloat));
    // FITS folds the row slots' column sums in shared memory: 2C floats (C <= 4096 there: 32 KiB).
    const size_t smem = L.fits && partial.defined() ? 2 * C * sizeof(float) : 0;
    bwd_kernels[L.vec][L.fits].launch(
        dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)), Dim3(L.tpr, rows), smem,
        dout.data_ptr(), x.data_ptr(), ptr_or_null(w), mean.data_ptr(), rstd.data_ptr(),
        dx.data_ptr(), ptr_or_null(partial), static_cast<long long>(N), static_cast<int>(C),
        static_cast<int>(need_dw), static_cast<int>(need_db));
  }
  if (partial.defined()) param_grad(partial, dweight, dbias, grid, C, dt, on);
  return {dx, dweight, dbias};
}

}  // namespace

KFORGE_BIND_OP(layernorm) {
  m.def("layernorm_forward", &layernorm_forward,
        "LayerNorm over the last dim: returns (out, mean, rstd); mean / rstd are float32 (N,). "
        "max_warps (for A/B timing; 0: the kernel's own limit): fewer resident warps per SM on "
        "rows of up to 1024 columns (2048 for 16-byte-aligned bfloat16 / float16); none on longer "
        "rows. variant: 0 (default) float32 rows of <= 1024 columns over groups of 32-1024 threads "
        "(GROUP); 1 (tests only) never GROUP: those rows take one warp per row (WARP, the layout "
        "the default uses past 2^30 rows); other inputs take the same kernels under every variant",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("eps") = 1e-5, pybind11::arg("max_warps") = 0,
        pybind11::arg("variant") = kDefault);
  m.def("layernorm_backward", &layernorm_backward,
        "LayerNorm backward: returns (dx, dweight or None, dbias or None); bias is only used to "
        "decide whether dbias is wanted. dweight / dbias are reduced in a fixed order (reproducible "
        "bits). max_warps (for A/B timing; 0: the kernel's own limit): fewer warps per SM on rows "
        "of up to 1024 columns; none on longer rows. variant: 0 (default) rows of <= 1024 columns "
        "take the shared-memory ring (RING: bfloat16 / float16 with 16-byte units) or groups of "
        "32-1024 threads (GROUP); 1 (tests only) never RING / GROUP: those rows take one warp per "
        "row (WARP, the layout the default uses past 2^30 rows, 2^31 for RING); longer rows take "
        "the same kernels under every variant",
        pybind11::arg("dout"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("mean"), pybind11::arg("rstd"), pybind11::arg("max_warps") = 0,
        pybind11::arg("variant") = kDefault);
}

}  // namespace kforge
