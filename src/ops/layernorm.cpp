// layernorm launchers (see kernels_src/layernorm.cu): forward -> (out, mean, rstd); backward ->
// (dx, dweight, dbias) with deterministic weight / bias gradients (per-block partials, fixed-order
// reduce). Layouts: GROUP (a row over 32 NW threads, 8 columns a thread; the default where the WARP
// layout used to be taken: C <= 2048 bf16 / half, C <= 1024 fp32 and scalar forward, C <= 1024
// backward), WARP (one warp per row: `variant` 1 and 2), BLOCK (longer rows).
//
// `variant` (A/B timing; every value computes the same results up to summation order):
//   forward:  0 GROUP (default); 1 the previous kernels (WARP / BLOCK); 2 GROUP for bf16 / half,
//             WARP for fp32.
//   backward: 0 (default) RING as 5 for bf16 / half rows of up to 1024 columns; otherwise GROUP,
//             one row a group, the next row prefetched for bf16 / half, and the 16-byte dependent
//             parameter-gradient reduce (the prefetching one where 2C % 4 != 0); 1 the previous kernels (WARP / BLOCK and the
//             previous reduce); 2 GROUP with two rows a group, no prefetch, for bf16 / half and one
//             prefetched row for fp32; 3 as 0 and GROUP also for longer rows (where a row fits a block
//             of 640 / 768 threads, C <= 5120 / 6144) instead of BLOCK; 4..7 RING (rows streamed
//             through S shared-memory row slots per group by cp.async, one block per SM, column
//             sums in registers) and the 16-byte dependent parameter-gradient reduce: 4: 8 columns
//             a thread, S = 8 (bf16 / half) / 4 (fp32); 5: 8 columns, S = 4 / 8; 6: 24 columns (one
//             warp per row at C = 768), S = 4 / 4; 7: 24 columns, S = 8 / 2. Where RING does not
//             apply (no 16-byte units, N >= 2^31, a group's slots over the shared memory) they
//             fall back to variant 0's kernels (with the new reduce where 2C % 4 == 0).
#include <algorithm>
#include <optional>
#include <tuple>

#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

constexpr const char* kFwd = "layernorm_forward";
constexpr const char* kBwd = "layernorm_backward";

Program prog("layernorm");
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
Kernel param_grad_kernel(prog, "layernorm_param_grad_kernel<{T}>");
Kernel param_grad_fast_kernel(prog, "layernorm_param_grad_fast_kernel<{T}>");

// WARP layout (one warp per row), instantiated for these units per lane P: 16-byte units (VEC) or
// single elements (misaligned pointers, C not a multiple of the pack). Backward units are limited
// to 32 columns a lane (P * pack <= 32), so P = 6, 8 exist for float only.
constexpr int kVecP[] = {2, 3, 4, 6, 8};
constexpr int kScalarP[] = {32};
constexpr int kNumVecP = 5, kNumScalarP = 1;
const std::vector<DType> kF32Only = {DType::f32};
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

// GROUP layout: <T, VEC, R rows a group takes at once (, PF: the next chunk prefetched)>.
const std::vector<DType> k16Bit = {DType::bf16, DType::f16};
Kernel fwd_group_vec16(prog, "layernorm_forward_group_kernel<{T}, true, 2>", k16Bit);
Kernel fwd_group_vec32(prog, "layernorm_forward_group_kernel<{T}, true, 1>", kF32Only);
Kernel fwd_group_scalar(prog, "layernorm_forward_group_kernel<{T}, false, 1>");
Kernel bwd_group_vec16(prog, "layernorm_backward_group_kernel<{T}, true, 1, true>", k16Bit);
Kernel bwd_group_vec16_r2(prog, "layernorm_backward_group_kernel<{T}, true, 2, false>", k16Bit);
Kernel bwd_group_vec32(prog, "layernorm_backward_group_kernel<{T}, true, 1, false>", kF32Only);
Kernel bwd_group_vec32_pf(prog, "layernorm_backward_group_kernel<{T}, true, 1, true>", kF32Only);
Kernel bwd_group_scalar(prog, "layernorm_backward_group_kernel<{T}, false, 1, false>");

// RING layout (backward variants 4..7): <T, P units a thread, S row slots a group>; index
// variant - 4. 16-bit: P = 1 (8 columns a thread) S = 8, 4; P = 3 (24 columns) S = 4, 8. fp32: P = 2
// (8 columns) S = 4, 8; P = 6 (24 columns) S = 4, 2.
struct RingShape {
  int P, S;
};
constexpr RingShape kRing16[4] = {{1, 8}, {1, 4}, {3, 4}, {3, 8}};
constexpr RingShape kRing32[4] = {{2, 4}, {2, 8}, {6, 4}, {6, 2}};
Kernel bwd_ring16[4] = {Kernel(prog, "layernorm_backward_ring_kernel<{T}, 1, 8>", k16Bit),
                        Kernel(prog, "layernorm_backward_ring_kernel<{T}, 1, 4>", k16Bit),
                        Kernel(prog, "layernorm_backward_ring_kernel<{T}, 3, 4>", k16Bit),
                        Kernel(prog, "layernorm_backward_ring_kernel<{T}, 3, 8>", k16Bit)};
Kernel bwd_ring32[4] = {Kernel(prog, "layernorm_backward_ring_kernel<{T}, 2, 4>", kF32Only),
                        Kernel(prog, "layernorm_backward_ring_kernel<{T}, 2, 8>", kF32Only),
                        Kernel(prog, "layernorm_backward_ring_kernel<{T}, 6, 4>", kF32Only),
                        Kernel(prog, "layernorm_backward_ring_kernel<{T}, 6, 2>", kF32Only)};
// Parameter-gradient reduce with 16-byte loads (2C % 4 == 0), launched as a dependent.
Kernel param_grad_vec_kernel(prog, "layernorm_param_grad_vec_kernel<{T}>");

// Must match kernels_src/layernorm.cu.
constexpr int kRegElems = 8;
constexpr int kMaxRowsPerBlock = 16;
constexpr int kFwdWarps = 4;
constexpr int kMaxBwdColumns = 32;  // columns a lane of the WARP backward keeps sums for
constexpr int64_t kMaxC = int64_t(1) << 30;  // keeps every in-row index (and 2C) in an int
constexpr int kGroupCols = 8;                // GROUP layout: columns per thread
constexpr int kGroupFwdWarps = 12;           // GROUP forward: warps per block (launch bound) ...
constexpr int kGroupFwdBlocks = 3;           // ... and resident blocks per SM
constexpr int kMaxNamedBarrierGroups = 15;   // groups of several warps sync on bar.sync 1..15
constexpr int64_t kMaxGroupRows = int64_t(1) << 30;  // GROUP kernels index rows with int
enum Variant : int64_t { kDefault = 0, kPrevious = 1, kAlt = 2, kGroupEverywhere = 3, kRingFirst = 4,
                         kRingLast = 7 };
constexpr int kPgX = 4, kPgY = 64;  // layernorm_param_grad_vec_kernel: float4 columns x partial rows
constexpr int kRingStaticSmem = 2 * 64 * 8;  // the ring kernel's reduction scratch (bytes)

// LnWarpCfg<T, VEC, P> of kernels_src/layernorm.cu: rows a forward / backward warp takes at once,
// resident forward blocks per SM, backward warps per SM (the kernels' launch bounds).
struct WarpCfg {
  int fwd_rows, bwd_rows, fwd_blocks, bwd_warps;
};
WarpCfg ln_warp_cfg(bool vec, int P, int64_t elem_size) {
  const int R = P * (vec ? 4 : 1);  // registers for P units
  WarpCfg c;
  c.fwd_rows = std::clamp(24 / R, 1, 4);
  c.bwd_rows = std::clamp(48 / (2 * R), 1, 4);
  c.fwd_blocks = vec ? (P == 2 ? 7 : P == 4 ? 12 : P == 6 ? 9 : 8) : 5;
  c.bwd_warps =
      vec ? (P == 4 && elem_size == 4 ? 24 : P == 8 || (P <= 3 && elem_size == 2) ? 16 : 20) : 12;
  return c;
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
// kGroupCols columns a thread) and the backward's warps per block (its launch bound; mirrors
// ln_group_bwd_warps).
int64_t group_tpr(int64_t C, bool vec, int64_t elem_size) {
  const int64_t V = vec ? 16 / elem_size : 1, P = kGroupCols / V;
  return 32 * cdiv(cdiv(C / V, P), 32);
}
int group_bwd_warps(bool vec, int64_t elem_size, bool is_half, int R, bool PF) {
  return vec && !is_half && R == 1 && (elem_size == 2) == PF ? 24 : 20;
}

// RING layout (kernels_src/layernorm.cu, LnRingCfg): launch bound (threads a block) for P units of
// V elements a thread: the row in registers (P V <= 8) or re-read from shared memory.
int ring_threads(int P, int64_t V) { return P * V <= 8 ? 768 : 512; }

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
  KF_CHECK(variant >= kDefault && variant <= kAlt, kFwd, "variant must be 0, 1 or 2, got ", variant);
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

  // GROUP: blocks of up to kGroupFwdWarps warps (G groups of tpr threads), kGroupFwdBlocks resident
  // per SM, as few groups per SM as keep the same number of rounds; groups loop beyond.
  const int64_t tpr = group_tpr(C, vec, es);
  const bool group = wp.index >= 0 && N <= kMaxGroupRows && tpr <= 32 * kGroupFwdWarps &&
                     (variant == kDefault || (variant == kAlt && es == 4));
  if (group) {
    Kernel& k = !vec ? fwd_group_scalar : es == 2 ? fwd_group_vec16 : fwd_group_vec32;
    const int R = vec && es == 2 ? 2 : 1;
    const int64_t nw = tpr / 32;
    int64_t G = 32 * kGroupFwdWarps / tpr;
    if (nw > 1) G = std::min<int64_t>(G, kMaxNamedBarrierGroups);
    int64_t most = kGroupFwdBlocks * G;  // groups per SM
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(1, max_warps / nw));
    G = std::min(G, most);
    const int64_t chunks = cdiv(N, R);
    const int64_t per_sm = balanced_warps_per_sm(chunks, sms, most);
    const int64_t grid = std::min(cdiv(chunks, G), sms * cdiv(per_sm, G));
    k.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)),
             Dim3(static_cast<unsigned>(tpr), static_cast<unsigned>(G)), 0, x.data_ptr(),
             ptr_or_null(w), ptr_or_null(b), out.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
             static_cast<long long>(N), static_cast<int>(C), static_cast<float>(eps));
    return {out, mean, rstd};
  }

  if (wp.index >= 0) {
    // Warps of fwd_rows rows each, kFwdWarps per block; no more blocks than stay resident (the
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

// dweight / dbias from the G partial rows: the 16-byte dependent reduce where asked for (every
// variant but 1) and 2C % 4 == 0, else the previous ones.
void param_grad(const at::Tensor& partial, std::optional<at::Tensor>& dweight,
                std::optional<at::Tensor>& dbias, int64_t G, int64_t C, DType dt, const LaunchOn& on,
                bool vec, bool previous = false) {
  const void* p = partial.data_ptr();
  void* dw = dweight ? dweight->data_ptr() : nullptr;
  void* db = dbias ? dbias->data_ptr() : nullptr;
  if (vec && C % 2 == 0) {
    param_grad_vec_kernel.launch_dependent(dt, on.device, on.stream, Dim3(ceil_div(2 * C, 4 * kPgX)),
                                           Dim3(kPgX, kPgY), 0, p, dw, db, static_cast<int>(G),
                                           static_cast<int>(C));
    return;
  }
  Kernel& k = previous ? param_grad_kernel : param_grad_fast_kernel;
  k.launch(dt, on.device, on.stream, Dim3(ceil_div(2 * C, 32)), Dim3(32, 32), 0, p, dw, db,
           static_cast<int>(G), static_cast<int>(C));
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
  KF_CHECK(variant >= kDefault && variant <= kRingLast, kBwd, "variant must be in [0, 7], got ",
           variant);
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

  // RING: one block per SM of G groups (tpr threads each), as many groups as the shared memory
  // holds (S row slots of x and dout each; the fold at the end reuses it) and the launch bound
  // allows, as few as keep the same number of rounds; the N rows split into contiguous ranges of q
  // or q + 1 rows, one per group. Rows too long for one group's slots take the paths below.
  // The default for 16-bit rows of up to 1024 columns is RING as variant 5 (S = 4): on the H200
  // (scripts/ab.py, BENCHMARKS.md) 16.1-16.9 us against GROUP's 17.1-17.8 at 8192 x 768 bf16, while
  // for fp32 GROUP stays ahead (22.8-23.7 against RING's 25.4-27.6).
  if (variant == kDefault && es == 2 && C <= 1024) variant = kRingFirst + 1;
  const bool ring_variant = variant >= kRingFirst;
  if (ring_variant && vec && N < (int64_t(1) << 31)) {
    const int64_t V = 16 / es, units = C / V;
    const int vi = static_cast<int>(variant - kRingFirst);
    const RingShape rsh = es == 2 ? kRing16[vi] : kRing32[vi];
    const int64_t rtpr = 32 * cdiv(cdiv(units, rsh.P), 32);
    const int64_t ring_bytes = int64_t(rsh.S) * 2 * units * 16;   // a group's slots
    const int64_t fold_bytes = 2 * rsh.P * V * 4 * rtpr;          // a group's column sums
    const int64_t per_group = std::max(ring_bytes, fold_bytes);
    const int64_t optin = at::cuda::getDeviceProperties(on.device)->sharedMemPerBlockOptin;
    const int64_t budget = optin - kRingStaticSmem;
    int64_t most = std::min<int64_t>(ring_threads(rsh.P, V) / rtpr, budget / per_group);
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(1, max_warps / (rtpr / 32)));
    if (most >= 1) {
      const int64_t G = balanced_warps_per_sm(N, sms, most);
      grid = std::min(sms, cdiv(N, G));
      const int64_t groups = grid * G;
      if (need_dw || need_db) partial = new_output({grid, 2 * C}, x.options().dtype(at::kFloat));
      Kernel& k = es == 2 ? bwd_ring16[vi] : bwd_ring32[vi];
      k.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)),
               Dim3(static_cast<unsigned>(rtpr), static_cast<unsigned>(G)),
               static_cast<size_t>(G * per_group), dout.data_ptr(), x.data_ptr(), ptr_or_null(w),
               mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(), ptr_or_null(partial),
               static_cast<int>(N / groups), static_cast<int>(N % groups), static_cast<int>(C),
               static_cast<int>(need_dw), static_cast<int>(need_db));
      if (partial.defined()) param_grad(partial, dweight, dbias, grid, C, dt, on, /*vec=*/true);
      return {dx, dweight, dbias};
    }
  }

  // GROUP: one block per SM of G groups (tpr threads each), as few groups per SM as keep the same
  // number of rounds. The block's column sums take 64 bytes of shared memory per thread.
  const bool alt = variant == kAlt;
  Kernel& gk = !vec ? bwd_group_scalar
               : es == 2 ? (alt ? bwd_group_vec16_r2 : bwd_group_vec16)
                         : (alt ? bwd_group_vec32_pf : bwd_group_vec32);
  const int gR = vec && es == 2 && alt ? 2 : 1;
  const bool gPF = vec && (es == 2) != alt;
  const int gwarps = group_bwd_warps(vec, es, dt == DType::f16, gR, gPF);
  const int64_t tpr = group_tpr(C, vec, es);
  const bool group = variant != kPrevious && N <= kMaxGroupRows && tpr <= 32 * gwarps &&
                     (wp.index >= 0 || variant == kGroupEverywhere);
  if (group) {
    const int64_t nw = tpr / 32;
    int64_t most = 32 * gwarps / tpr;  // groups per SM
    if (nw > 1) most = std::min<int64_t>(most, kMaxNamedBarrierGroups);
    if (max_warps > 0) most = std::min(most, std::max<int64_t>(1, max_warps / nw));
    const int64_t chunks = cdiv(N, gR);
    const int64_t G = balanced_warps_per_sm(chunks, sms, most);
    grid = std::min(sms, cdiv(chunks, G));
    if (need_dw || need_db) partial = new_output({grid, 2 * C}, x.options().dtype(at::kFloat));
    const size_t smem =
        partial.defined() ? static_cast<size_t>(G * tpr * 2 * kGroupCols * sizeof(float)) : 0;
    gk.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)),
              Dim3(static_cast<unsigned>(tpr), static_cast<unsigned>(G)), smem, dout.data_ptr(),
              x.data_ptr(), ptr_or_null(w), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
              ptr_or_null(partial), static_cast<long long>(N), static_cast<int>(C),
              static_cast<int>(need_dw), static_cast<int>(need_db));
  } else if (wp.index >= 0) {
    // Persistent: at most one block per SM, warps of bwd_rows rows each, as few per SM as keep the
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
  if (partial.defined())
    param_grad(partial, dweight, dbias, grid, C, dt, on, /*vec=*/variant != kPrevious,
               variant == kPrevious);
  return {dx, dweight, dbias};
}

}  // namespace

KFORGE_BIND_OP(layernorm) {
  m.def("layernorm_forward", &layernorm_forward,
        "LayerNorm over the last dim: returns (out, mean, rstd); mean / rstd are float32 (N,). "
        "max_warps (for A/B timing; 0: the kernel's own limit): fewer resident warps per SM on the "
        "one-warp-per-row and GROUP paths. variant (for A/B timing): 0 GROUP layout where rows are "
        "short (a row over 32 NW threads, 8 columns a thread, one or two rows in flight per group "
        "with the next chunk prefetched); 1 one warp per row; 2 (default) GROUP for float32, one "
        "warp per row for bfloat16 / float16 (on an H200 at 8192 x 768: fp32 GROUP 14.2 us against "
        "14.8, bf16 one warp per row 9.1 us against GROUP's 9.9)",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("eps") = 1e-5, pybind11::arg("max_warps") = 0, pybind11::arg("variant") = 2);
  m.def("layernorm_backward", &layernorm_backward,
        "LayerNorm backward: returns (dx, dweight or None, dbias or None); bias is only used to "
        "decide whether dbias is wanted. max_warps (for A/B timing; 0: the kernel's own limit): "
        "fewer warps per SM on the one-warp-per-row and GROUP paths. variant (for A/B timing): 0 "
        "(default) RING as 5 for bfloat16 / float16 rows of up to 1024 columns, otherwise GROUP "
        "layout where rows are short (8 columns a thread, column sums in shared memory, one row a "
        "group, bfloat16 / float16 prefetching the next) and the 16-byte parameter-gradient reduce "
        "launched as a dependent; 1 the previous kernels (one warp per row, previous reduce); 2 "
        "GROUP with two rows a group and no prefetch for bfloat16 / float16, one prefetched row for "
        "float32; 3 as 0, and GROUP also for rows up to 5120 / 6144 columns instead of the "
        "block-per-row kernels; 4..7 RING (persistent groups streaming their rows through S "
        "shared-memory row slots by cp.async, column sums in registers) and the 16-byte "
        "parameter-gradient reduce launched as a dependent: 4: 8 columns a thread, S = 8 for "
        "bfloat16 / float16, 4 for float32; 5: 8 columns, S = 4 / 8; 6: 24 columns (one warp per "
        "row at C = 768), S = 4 / 4; 7: 24 columns, S = 8 / 2; rows RING cannot take (no 16-byte "
        "units, slots over the shared memory) fall back to variant 0's kernels",
        pybind11::arg("dout"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("mean"), pybind11::arg("rstd"), pybind11::arg("max_warps") = 0,
        pybind11::arg("variant") = 0);
}

}  // namespace kforge
