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
// testing override's `variant` 1 (kforge._testing.override) forces that fallback (never GROUP /
// RING) at any N. The choice itself: plan_layernorm_forward / _backward (layernorm_plan.h).
#include <algorithm>
#include <optional>
#include <tuple>

#include "../runtime/torch_launch.h"
#include "layernorm_plan.h"  // the dispatch: which kernel, grid, block, shared memory

namespace kforge {
namespace {
using namespace kf_layernorm;

constexpr const char* kFwd = "layernorm_forward";
constexpr const char* kBwd = "layernorm_backward";

// variant (1: never GROUP / RING) and max_warps, for tests and A/B timing only.
TestingOverride fwd_override(kFwd, ln_plan::kNumVariants, /*has_max_warps=*/true);
TestingOverride bwd_override(kBwd, ln_plan::kNumVariants, /*has_max_warps=*/true);

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

// WARP layout (one warp per row), instantiated for ln_plan::kVecP / kScalarP units per lane P.
using ln_plan::kNumVecP, ln_plan::kNumScalarP;
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
// A bf16 / half x added to an fp32 residual (add_layernorm_forward, 16-byte units), [y: fp32, bf16,
// half][x: bf16, half].
Kernel fwd_group_add[3][2] = {
    {Kernel(prog, "layernorm_forward_group_kernel<{T}, true, float, bf16>", kF32Only),
     Kernel(prog, "layernorm_forward_group_kernel<{T}, true, float, half>", kF32Only)},
    {Kernel(prog, "layernorm_forward_group_kernel<{T}, true, bf16, bf16>", kF32Only),
     Kernel(prog, "layernorm_forward_group_kernel<{T}, true, bf16, half>", kF32Only)},
    {Kernel(prog, "layernorm_forward_group_kernel<{T}, true, half, bf16>", kF32Only),
     Kernel(prog, "layernorm_forward_group_kernel<{T}, true, half, half>", kF32Only)}};
// fp32 x storing a bf16 / half y, [vec][0: bf16, 1: half] (autocast: kforge.fusion.norm_epilogues).
Kernel fwd_group_narrow[2][2] = {
    {Kernel(prog, "layernorm_forward_group_kernel<{T}, false, bf16>", kF32Only),
     Kernel(prog, "layernorm_forward_group_kernel<{T}, false, half>", kF32Only)},
    {Kernel(prog, "layernorm_forward_group_kernel<{T}, true, bf16>", kF32Only),
     Kernel(prog, "layernorm_forward_group_kernel<{T}, true, half>", kF32Only)}};
Kernel bwd_group_vec(prog, "layernorm_backward_group_kernel<{T}, true>", kF32Only);
Kernel bwd_group_scalar(prog, "layernorm_backward_group_kernel<{T}, false>");
// fp32 16-byte GROUP backward adding dres (RES) and / or storing a bf16 / half copy of dx (NZ 1 / 2),
// [res][nz]; [0][0] unused (bwd_group_vec). Element-wise rows (odd C, misaligned) would spill with
// these: they take the plain kernel and torch's add / conversion after it.
Kernel bwd_group_epilogue[2][3] = {
    {Kernel(prog, "layernorm_backward_group_kernel<{T}, true>", kF32Only),
     Kernel(prog, "layernorm_backward_group_kernel<{T}, true, false, 1>", kF32Only),
     Kernel(prog, "layernorm_backward_group_kernel<{T}, true, false, 2>", kF32Only)},
    {Kernel(prog, "layernorm_backward_group_kernel<{T}, true, true, 0>", kF32Only),
     Kernel(prog, "layernorm_backward_group_kernel<{T}, true, true, 1>", kF32Only),
     Kernel(prog, "layernorm_backward_group_kernel<{T}, true, true, 2>", kF32Only)}};

// RING layout (bf16 / half backward, 16-byte units).
Kernel bwd_ring(prog, "layernorm_backward_ring_kernel<{T}>", k16Bit);

// Parameter-gradient reduce: 16-byte loads (even C) or scalar (odd C).
Kernel param_grad_vec_kernel(prog, "layernorm_param_grad_vec_kernel<{T}>");
Kernel param_grad_kernel(prog, "layernorm_param_grad_kernel<{T}>");

using ln_plan::kMaxC;

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
    const std::optional<at::Tensor>& bias_, double eps, std::optional<at::ScalarType> y_dtype) {
  const at::Tensor x = input(x_, kFwd, "x");
  const auto [N, C] = rows_cols(x, kFwd);
  const at::Tensor w = param(weight_, x, C, kFwd, "weight");
  const at::Tensor b = param(bias_, x, C, kFwd, "bias");
  KF_CHECK(eps >= 0, kFwd, "eps must be >= 0, got ", eps);
  int narrow = -1;  // 0: bf16 y, 1: half y, of an fp32 x
  if (y_dtype && *y_dtype != x.scalar_type()) {
    KF_CHECK(x.scalar_type() == at::kFloat && (*y_dtype == at::kBFloat16 || *y_dtype == at::kHalf), kFwd,
             "y_dtype ", to_str(*y_dtype), " for x of ", to_str(x.scalar_type()),
             ": only float32 x may store a bfloat16 / float16 y");
    narrow = *y_dtype == at::kBFloat16 ? 0 : 1;
  }
  LaunchOn on(x);
  at::Tensor mean = new_output({N}, x.options().dtype(at::kFloat));
  at::Tensor rstd = new_output({N}, x.options().dtype(at::kFloat));
  const DType dt = dtype_of(x, kFwd);
  using L = LayernormLayout;
  const auto plan = [&](bool aligned) {
    return plan_layernorm_forward(N, C, x.element_size(), aligned, sm_count(on.device),
                                  fwd_override.get_max_warps(), fwd_override.get_variant());
  };
  if (N == 0)  // no rows: nothing to plan (the plans divide by the row count)
    return {narrow >= 0 ? new_output(x.sizes(), x.options().dtype(*y_dtype)) : new_output_like(x), mean, rstd};
  const bool inputs_aligned = aligned16(x) && aligned_or_absent(w) && aligned_or_absent(b);
  LayernormPlan p = plan(inputs_aligned);
  // Only the GROUP kernel (fp32 rows of up to 1024 columns) stores a 16-bit y itself; other rows are
  // normalised in fp32 and converted by torch: the same values, one more pass.
  const bool narrow_here = narrow >= 0 && p.layout_id == L::group;
  at::Tensor out = narrow_here ? new_output(x.sizes(), x.options().dtype(*y_dtype)) : new_output_like(x);
  // a 16-bit y of fp32 units moves 8 bytes a unit: its base 8-byte aligned is enough
  const uintptr_t out_mask = narrow_here ? 7 : 15;
  if (inputs_aligned && (reinterpret_cast<uintptr_t>(out.data_ptr()) & out_mask) != 0) p = plan(false);
  KF_CHECK(!narrow_here || p.layout_id == L::group, kFwd, "no GROUP layout for a 16-bit y of this x");

  const L layout = p.layout_id;
  Kernel& k = layout == L::group ? (narrow_here ? fwd_group_narrow[p.vec][narrow]
                                                : (p.vec ? fwd_group_vec : fwd_group_scalar))
              : layout == L::warp
                  ? (p.vec ? fwd_warp_vec[p.warp_index] : fwd_warp_scalar[p.warp_index])
                  : fwd_kernels[p.vec][p.fits];
  const Dim3 grid(static_cast<unsigned>(p.grid)),
      block(static_cast<unsigned>(p.block_x), static_cast<unsigned>(p.block_y));
  if (layout == L::warp)  // the WARP kernels take one more argument (0)
    k.launch(dt, on.device, on.stream, grid, block, 0, x.data_ptr(), ptr_or_null(w), ptr_or_null(b),
             out.data_ptr(), mean.data_ptr(), rstd.data_ptr(), static_cast<long long>(N),
             static_cast<int>(C), static_cast<float>(eps), 0);
  else if (layout == L::group)  // the GROUP kernels take a residual and s (add_layernorm_forward's)
    k.launch(dt, on.device, on.stream, grid, block, 0, x.data_ptr(), ptr_or_null(w), ptr_or_null(b),
             out.data_ptr(), mean.data_ptr(), rstd.data_ptr(), static_cast<long long>(N),
             static_cast<int>(C), static_cast<float>(eps), static_cast<const void*>(nullptr),
             static_cast<void*>(nullptr));
  else
    k.launch(dt, on.device, on.stream, grid, block, 0, x.data_ptr(), ptr_or_null(w), ptr_or_null(b),
             out.data_ptr(), mean.data_ptr(), rstd.data_ptr(), static_cast<long long>(N),
             static_cast<int>(C), static_cast<float>(eps));
  if (narrow >= 0 && !narrow_here) out = out.to(*y_dtype);
  return {out, mean, rstd};
}

// s = float(x) + residual (a bf16 / half x, autocast's branch, added to the fp32 stream as eager's
// upcast and add) and layernorm_forward(s, ..., y_dtype): (y, mean, rstd, s). The 16-byte GROUP
// kernel does both in one pass (kforge.fusion.norm_epilogues.fold_branch_adds); other rows add with
// torch first (the same values).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layernorm_forward(
    const at::Tensor& x_, const at::Tensor& residual_, const std::optional<at::Tensor>& weight_,
    const std::optional<at::Tensor>& bias_, double eps, std::optional<at::ScalarType> y_dtype) {
  constexpr const char* op = "add_layernorm_forward";
  const at::Tensor r = input(residual_, op, "residual");
  const at::Tensor x = input(x_, op, "x");
  KF_CHECK(r.scalar_type() == at::kFloat && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf), op,
           "x of ", to_str(x.scalar_type()), " and residual of ", to_str(r.scalar_type()),
           ": a bfloat16 / float16 x added to a float32 residual");
  KF_CHECK(x.device() == r.device(), op, "x must be a CUDA tensor on ", r.device());
  KF_CHECK(x.sizes() == r.sizes(), op, "residual and x sizes differ: ", r.sizes(), " vs ", x.sizes());
  const auto [N, C] = rows_cols(r, op);
  const at::Tensor w = param(weight_, r, C, op, "weight");
  const at::Tensor b = param(bias_, r, C, op, "bias");
  KF_CHECK(eps >= 0, op, "eps must be >= 0, got ", eps);
  int narrow = -1;
  if (y_dtype && *y_dtype != at::kFloat) {
    KF_CHECK(*y_dtype == at::kBFloat16 || *y_dtype == at::kHalf, op, "y_dtype ", to_str(*y_dtype),
             ": float32, bfloat16 or float16");
    narrow = *y_dtype == at::kBFloat16 ? 0 : 1;
  }
  LaunchOn on(r);
  const auto fallback = [&]() {
    at::Tensor s = at::add(r, x);  // fp32: the upcast and add of eager's type promotion
    auto [y, mean, rstd] = layernorm_forward(s, weight_, bias_, eps, y_dtype);
    return std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>{y, mean, rstd, s};
  };
  if (N == 0) return fallback();
  const LayernormPlan p = plan_layernorm_forward(N, C, 4, aligned16(r) && aligned16(x) && aligned_or_absent(w) &&
                                                              aligned_or_absent(b), sm_count(on.device),
                                                 fwd_override.get_max_warps(), fwd_override.get_variant());
  // 16-byte units only: x's 4 elements a unit move as one 8-byte load (x's base 16-byte aligned here)
  if (p.layout_id != LayernormLayout::group || !p.vec) return fallback();
  at::Tensor s = new_output_like(r);
  at::Tensor y = narrow >= 0 ? new_output(r.sizes(), r.options().dtype(*y_dtype)) : new_output_like(r);
  at::Tensor mean = new_output({N}, r.options().dtype(at::kFloat));
  at::Tensor rstd = new_output({N}, r.options().dtype(at::kFloat));
  const int xi = x.scalar_type() == at::kBFloat16 ? 0 : 1;
  fwd_group_add[narrow + 1][xi].launch(
      DType::f32, on.device, on.stream, Dim3(static_cast<unsigned>(p.grid)),
      Dim3(static_cast<unsigned>(p.block_x), static_cast<unsigned>(p.block_y)), 0, x.data_ptr(),
      ptr_or_null(w), ptr_or_null(b), y.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
      static_cast<long long>(N), static_cast<int>(C), static_cast<float>(eps),
      static_cast<const void*>(r.data_ptr()), s.data_ptr());
  return {y, mean, rstd, s};
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

using BackwardResult = std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>,
                                  std::optional<at::Tensor>>;

// (dx [+ dresidual], dweight, dbias, dx rounded to copy_dtype where asked). dresidual and the copy
// are fp32 x's only (autocast's residual stream: kforge.fusion.norm_epilogues); the 16-byte GROUP
// kernel does them itself, other layouts through torch after the plain kernel (the same values).
BackwardResult backward(const char* op, const at::Tensor& dout_, const at::Tensor& x_,
                        const std::optional<at::Tensor>& weight_, const std::optional<at::Tensor>& bias_,
                        const at::Tensor& mean_, const at::Tensor& rstd_,
                        const std::optional<at::Tensor>& dresidual_, std::optional<at::ScalarType> copy_dtype) {
  const at::Tensor x = input(x_, op, "x");
  const at::Tensor dout = input_like(dout_, x, op, "dout");
  KF_CHECK(dout.sizes() == x.sizes(), op, "dout has shape ", dout.sizes(), ", x has ", x.sizes());
  const auto [N, C] = rows_cols(x, op);
  const at::Tensor w = param(weight_, x, C, op, "weight");
  const at::Tensor b = param(bias_, x, C, op, "bias");  // only its presence matters
  for (const auto& [t, name] : {std::pair{&mean_, "mean"}, std::pair{&rstd_, "rstd"}}) {
    KF_CHECK(t->defined() && t->is_cuda() && t->device() == x.device(), op, name,
             " must be a CUDA tensor on ", x.device());
    KF_CHECK(t->scalar_type() == at::kFloat && t->numel() == N, op, name,
             " must be float32 with one value per row (", N, "), got ", t->scalar_type(), " ",
             t->sizes());
  }
  at::Tensor dres;
  if (dresidual_ && dresidual_->defined()) {
    dres = input_like(*dresidual_, x, op, "dresidual");
    KF_CHECK(dres.sizes() == x.sizes(), op, "dresidual has shape ", dres.sizes(), ", x has ", x.sizes());
  }
  int nz = 0;  // 1: a bf16 copy of dx, 2: a half one
  if (copy_dtype) {
    KF_CHECK(x.scalar_type() == at::kFloat && (*copy_dtype == at::kBFloat16 || *copy_dtype == at::kHalf), op,
             "copy_dtype ", to_str(*copy_dtype), " for x of ", to_str(x.scalar_type()),
             ": only a float32 dx has a bfloat16 / float16 copy");
    nz = *copy_dtype == at::kBFloat16 ? 1 : 2;
  }
  KF_CHECK(!dres.defined() || x.scalar_type() == at::kFloat, op, "dresidual is taken with a float32 x only, got ",
           to_str(x.scalar_type()));
  const at::Tensor mean = mean_.contiguous(), rstd = rstd_.contiguous();
  LaunchOn on(x);
  const DType dt = dtype_of(x, op);
  at::Tensor dx = new_output_like(x);
  std::optional<at::Tensor> dweight, dbias, copy;
  if (w.defined()) dweight = new_output({C}, w.options());
  if (b.defined()) dbias = new_output({C}, b.options());
  if (nz) copy = new_output(x.sizes(), x.options().dtype(*copy_dtype));
  if (N == 0) {  // no rows: the parameter gradients are empty sums
    if (dweight) dweight->zero_();
    if (dbias) dbias->zero_();
    return {dx, dweight, dbias, copy};
  }

  const bool aligned = aligned16(x) && aligned16(dout) && aligned16(dx) && aligned_or_absent(w) &&
                       (!dres.defined() || aligned16(dres)) && (!copy || aligned16(*copy));
  const bool need_dw = w.defined(), need_db = b.defined();
  const int64_t optin = at::cuda::getDeviceProperties(on.device)->sharedMemPerBlockOptin;
  const LayernormPlan p = plan_layernorm_backward(N, C, x.element_size(), aligned, need_dw || need_db,
                                                  sm_count(on.device), optin,
                                                  bwd_override.get_max_warps(),
                                                  bwd_override.get_variant());
  KF_CHECK(p.error.empty(), op, p.error);
  using L = LayernormLayout;
  const L layout = p.layout_id;
  // per-block partial sums [dweight | dbias], one row of 2C floats per block
  at::Tensor partial;
  if (need_dw || need_db) partial = new_output({p.grid, 2 * C}, x.options().dtype(at::kFloat));
  const Dim3 grid(static_cast<unsigned>(p.grid)),
      block(static_cast<unsigned>(p.block_x), static_cast<unsigned>(p.block_y));
  const size_t smem = static_cast<size_t>(p.smem);
  if (layout == L::ring) {
    bwd_ring.launch(dt, on.device, on.stream, grid, block, smem, dout.data_ptr(), x.data_ptr(),
                    ptr_or_null(w), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
                    ptr_or_null(partial), static_cast<int>(p.ring_q), static_cast<int>(p.ring_r),
                    static_cast<int>(C), static_cast<int>(need_dw), static_cast<int>(need_db));
  } else if (layout == L::warp) {  // the WARP kernels take one more argument (0)
    Kernel& k = p.vec ? bwd_warp_vec[p.warp_index] : bwd_warp_scalar[p.warp_index];
    k.launch(dt, on.device, on.stream, grid, block, smem, dout.data_ptr(), x.data_ptr(),
             ptr_or_null(w), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(), ptr_or_null(partial),
             static_cast<long long>(N), static_cast<int>(C), static_cast<int>(need_dw),
             static_cast<int>(need_db), 0);
  } else if (layout == L::group) {  // the GROUP kernels take dres and dz (null unless asked for)
    const bool epilogue = p.vec && (dres.defined() || nz);
    Kernel& k = epilogue ? bwd_group_epilogue[dres.defined()][nz] : p.vec ? bwd_group_vec : bwd_group_scalar;
    k.launch(dt, on.device, on.stream, grid, block, smem, dout.data_ptr(), x.data_ptr(),
             ptr_or_null(w), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(), ptr_or_null(partial),
             static_cast<long long>(N), static_cast<int>(C), static_cast<int>(need_dw),
             static_cast<int>(need_db), epilogue ? ptr_or_null(dres) : nullptr,
             epilogue && copy ? copy->data_ptr() : nullptr);
    if (epilogue) {  // done by the kernel
      dres = at::Tensor();
      nz = 0;
    }
  } else {
    Kernel& k = bwd_kernels[p.vec][p.fits];
    k.launch(dt, on.device, on.stream, grid, block, smem, dout.data_ptr(), x.data_ptr(),
             ptr_or_null(w), mean.data_ptr(), rstd.data_ptr(), dx.data_ptr(), ptr_or_null(partial),
             static_cast<long long>(N), static_cast<int>(C), static_cast<int>(need_dw),
             static_cast<int>(need_db));
  }
  if (partial.defined()) param_grad(partial, dweight, dbias, p.grid, C, dt, on);
  if (dres.defined()) dx.add_(dres);
  if (nz) copy->copy_(dx);
  return {dx, dweight, dbias, copy};
}

std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> layernorm_backward(
    const at::Tensor& dout, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& dresidual) {
  auto [dx, dw, db, copy] = backward(kBwd, dout, x, weight, bias, mean, rstd, dresidual, std::nullopt);
  return {dx, dw, db};
}

BackwardResult layernorm_backward_copy(const at::Tensor& dout, const at::Tensor& x,
                                       const std::optional<at::Tensor>& weight,
                                       const std::optional<at::Tensor>& bias, const at::Tensor& mean,
                                       const at::Tensor& rstd, const std::optional<at::Tensor>& dresidual,
                                       at::ScalarType copy_dtype) {
  return backward("layernorm_backward_copy", dout, x, weight, bias, mean, rstd, dresidual, copy_dtype);
}

}  // namespace

KFORGE_BIND_OP(layernorm) {
  m.def("layernorm_forward", &layernorm_forward,
        "LayerNorm over the last dim: returns (out, mean, rstd); mean / rstd are float32 (N,). The "
        "layout (kforge._C.plan) depends on dtype, row length and alignment only. y_dtype (None: x's): "
        "a float32 x may store out as bfloat16 / float16, rounded once: layernorm_forward(x)[0].to(y_dtype).",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("eps") = 1e-5, pybind11::arg("y_dtype") = pybind11::none());
  m.def("add_layernorm_forward", &add_layernorm_forward,
        "s = float(x) + residual (a bfloat16 / float16 x, a float32 residual: autocast's branch added to "
        "the fp32 stream) and LayerNorm of s: returns (y, mean, rstd, s); y_dtype (None: float32) as "
        "layernorm_forward's.",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("eps") = 1e-5, pybind11::arg("y_dtype") = pybind11::none());
  m.def("layernorm_backward", &layernorm_backward,
        "LayerNorm backward: returns (dx, dweight or None, dbias or None); bias is only used to "
        "decide whether dbias is wanted. dweight / dbias are reduced in a fixed order (reproducible "
        "bits). dresidual (float32 x only): added to dx, the residual stream's gradient.",
        pybind11::arg("dout"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("mean"), pybind11::arg("rstd"), pybind11::arg("dresidual") = pybind11::none());
  m.def("layernorm_backward_copy", &layernorm_backward_copy,
        "layernorm_backward of a float32 x that also stores dx rounded once to copy_dtype (bfloat16 / "
        "float16): returns (dx, dweight or None, dbias or None, dx.to(copy_dtype)); dresidual (None or "
        "x's shape) is added to dx first. Autocast's fp32 residual stream: its gradient and the 16-bit "
        "copy the next matmul reads from one kernel.",
        pybind11::arg("dout"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("bias"),
        pybind11::arg("mean"), pybind11::arg("rstd"), pybind11::arg("dresidual"),
        pybind11::arg("copy_dtype"));
}

}  // namespace kforge
