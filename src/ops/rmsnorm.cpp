// rmsnorm launchers: forward (y, rstd), with the residual add fused (y, rstd, s), and backward
// (dx, dweight), optionally plus the residual's gradient; see kernels_src/rmsnorm.cu.
#include <pybind11/stl.h>

#include <optional>

#include "../runtime/torch_launch.h"
#include "rmsnorm_plan.h"  // the dispatch: which kernel, grid, block, shared memory

namespace kforge {
namespace {

Program prog("rmsnorm");
using rms_plan::kFwdK, rms_plan::kBwdThreads, rms_plan::kMaxChunks;

// Forward kernels by RES (the residual add fused), VEC (16-byte accesses; otherwise element-wise, for
// odd sizes and misaligned pointers) and K, the 16-byte chunks of x each thread keeps in registers:
// rmsnorm_forward_kernel<T, K, VEC, RES, Y, X>, the four K of one T and (VEC, RES, Y, X).
const std::vector<DType> kF32 = {DType::f32};
const std::vector<DType> k16 = {DType::bf16, DType::f16};
const std::vector<DType> kAll = {DType::f32, DType::bf16, DType::f16};
#define KF_FWD4(DTYPES, VEC, REST)                                                  \
  {                                                                                 \
    {prog, "rmsnorm_forward_kernel<{T}, 1, " #VEC REST ">", DTYPES},                \
        {prog, "rmsnorm_forward_kernel<{T}, 2, " #VEC REST ">", DTYPES},            \
        {prog, "rmsnorm_forward_kernel<{T}, 4, " #VEC REST ">", DTYPES},            \
        {prog, "rmsnorm_forward_kernel<{T}, 8, " #VEC REST ">", DTYPES}             \
  }
Kernel fwd_kernels[2][2][4] = {{KF_FWD4(kAll, false, ""), KF_FWD4(kAll, true, "")},
                               {KF_FWD4(kAll, false, ", true"), KF_FWD4(kAll, true, ", true")}};
// fp32 x, 16-bit y (autocast's fp32 residual stream; kernels_src/rmsnorm.cu): [bf16 / fp16][VEC][K].
// Instantiated for fp32 T only: compiled with the other fp32 expressions, in their NVRTC parts.
Kernel fwd_narrow_kernels[2][2][4] = {
    {KF_FWD4(kF32, false, ", false, bf16"), KF_FWD4(kF32, true, ", false, bf16")},
    {KF_FWD4(kF32, false, ", false, half"), KF_FWD4(kF32, true, ", false, half")}};
// 16-bit x added to an fp32 residual (autocast's branch into the fp32 stream), y fp32 or x's type:
// [x bf16 / fp16][y float / x's][VEC][K].
Kernel fwd_mixed_kernels[2][2][2][4] = {
    {{KF_FWD4(kF32, false, ", true, float, bf16"), KF_FWD4(kF32, true, ", true, float, bf16")},
     {KF_FWD4(kF32, false, ", true, bf16, bf16"), KF_FWD4(kF32, true, ", true, bf16, bf16")}},
    {{KF_FWD4(kF32, false, ", true, float, half"), KF_FWD4(kF32, true, ", true, float, half")},
     {KF_FWD4(kF32, false, ", true, half, half"), KF_FWD4(kF32, true, ", true, half, half")}}};
#undef KF_FWD4

// Backward kernels: K chunks per thread and row, R rows per group at a time, VEC, CBW
// (cast_before_weight, 16-bit types only: fp32 is the same either way), blocks of at most
// kBwdThreads threads (one per SM, <= 128 registers per thread). R is what fits in registers without
// spilling (checked with NVRTC's ptxas for sm_80 and sm_90): fewer rows for element-wise access and
// for 16-bit types at K = 4 (8 fp32 dweight sums per chunk instead of 4).
// RES: dx plus the residual's gradient (each kernel family below has the same rows with RES). NZ:
// with a bf16 (1) / fp16 (2) copy of dx (fp32 only: the fp32 rows again, with and without RES).
// TAIL: the template arguments after MAXT (RES, NZ), as the kernel's name spells them.
struct BwdKernel {
  int K;
  bool vec, cbw;
  int R;
  bool res;
  int nz;
  Kernel kernel;
};
#define KF_BWD(K, R, VEC, CBW, DTYPES, RES, NZ, TAIL)                                            \
  {                                                                                              \
    K, VEC, CBW, R, RES, NZ, {                                                                   \
      prog, "rmsnorm_backward_kernel<{T}, " #K ", " #R ", " #VEC ", " #CBW ", 512" TAIL ">", DTYPES \
    }                                                                                            \
  }
#define KF_BWD_F32(RES, NZ, TAIL)                                                                 \
  KF_BWD(1, 4, true, false, kF32, RES, NZ, TAIL), KF_BWD(1, 4, false, false, kF32, RES, NZ, TAIL), \
      KF_BWD(2, 4, true, false, kF32, RES, NZ, TAIL), KF_BWD(2, 2, false, false, kF32, RES, NZ, TAIL), \
      KF_BWD(4, 2, true, false, kF32, RES, NZ, TAIL), KF_BWD(4, 1, false, false, kF32, RES, NZ, TAIL)
#define KF_BWD_TABLE(RES, TAIL)                                                                    \
  KF_BWD_F32(RES, 0, TAIL), KF_BWD(1, 4, true, false, k16, RES, 0, TAIL),                          \
      KF_BWD(1, 4, false, false, k16, RES, 0, TAIL), KF_BWD(2, 4, true, false, k16, RES, 0, TAIL),   \
      KF_BWD(2, 2, false, false, k16, RES, 0, TAIL), KF_BWD(4, 1, true, false, k16, RES, 0, TAIL),   \
      KF_BWD(4, 1, false, false, k16, RES, 0, TAIL), KF_BWD(1, 4, true, true, k16, RES, 0, TAIL),    \
      KF_BWD(1, 4, false, true, k16, RES, 0, TAIL), KF_BWD(2, 4, true, true, k16, RES, 0, TAIL),     \
      KF_BWD(2, 2, false, true, k16, RES, 0, TAIL), KF_BWD(4, 1, true, true, k16, RES, 0, TAIL),     \
      KF_BWD(4, 1, false, true, k16, RES, 0, TAIL)
BwdKernel bwd_kernels[] = {KF_BWD_TABLE(false, ""),         KF_BWD_TABLE(true, ", true"),
                           KF_BWD_F32(false, 1, ", false, 1"), KF_BWD_F32(true, 1, ", true, 1"),
                           KF_BWD_F32(false, 2, ", false, 2"), KF_BWD_F32(true, 2, ", true, 2")};
#undef KF_BWD_TABLE
#undef KF_BWD_F32
#undef KF_BWD

// Pipelined backward kernels (16-byte accesses only; rows of at most kPipeMaxChunks chunks; where the
// ring's stages do not fit in shared memory): K chunks per thread and row, P rows in flight, KEEP_G
// (g = dy * w kept in registers through the reduction: 16-bit types), CBW; blocks of kBwdThreads
// threads, one per SM. Each compiles without spills at 128 registers (ptxas for sm_80 and sm_90),
// with no register move waiting on a load in the hot loop (sm_90 SASS).
struct PipeKernel {
  int K, P;
  bool keep_g, cbw, res;
  int nz;
  Kernel kernel;
};
#define KF_PIPE(K, P, KEEP_G, CBW, DTYPES, RES, NZ, TAIL)                                        \
  {                                                                                              \
    K, P, KEEP_G, CBW, RES, NZ, {                                                                \
      prog,                                                                                      \
          "rmsnorm_backward_pipelined_kernel<{T}, " #K ", " #P ", " #KEEP_G ", " #CBW ", 512" TAIL \
          ">",                                                                                   \
          DTYPES                                                                                 \
    }                                                                                            \
  }
#define KF_PIPE_F32(RES, NZ, TAIL) \
  KF_PIPE(1, 8, false, false, kF32, RES, NZ, TAIL), KF_PIPE(2, 4, false, false, kF32, RES, NZ, TAIL)
#define KF_PIPE_TABLE(RES, TAIL)                                                                  \
  KF_PIPE_F32(RES, 0, TAIL), KF_PIPE(1, 4, true, false, k16, RES, 0, TAIL),                         \
      KF_PIPE(2, 2, true, false, k16, RES, 0, TAIL), KF_PIPE(1, 4, true, true, k16, RES, 0, TAIL),    \
      KF_PIPE(2, 2, true, true, k16, RES, 0, TAIL)
PipeKernel pipe_kernels[] = {KF_PIPE_TABLE(false, ""),          KF_PIPE_TABLE(true, ", true"),
                             KF_PIPE_F32(false, 1, ", false, 1"), KF_PIPE_F32(true, 1, ", true, 1"),
                             KF_PIPE_F32(false, 2, ", false, 2"), KF_PIPE_F32(true, 2, ", true, 2")};
#undef KF_PIPE_TABLE
#undef KF_PIPE_F32
#undef KF_PIPE

// Ring backward kernels (16-byte accesses only, rows of at most kRingMaxChunks chunks), one block per
// SM: K chunks per thread and row, S stages of shared memory, blocks of at most NT threads; rows of
// <= 512 chunks 4 chunks per thread in blocks of 384 threads (at D = 4096 bf16: three rows at a
// time), longer rows (bf16 / fp16 D <= 8192, fp32 D <= 4096) 2 chunks per thread, 512 threads; 3
// stages. CBW. Each compiles without spills (ptxas for sm_80 and sm_90).
using rms_plan::RingShape;
struct RingKernel {
  RingShape shape;
  bool cbw, res;
  int nz;
  Kernel kernel;
};
#define KF_RING(K, S, NT, CBW, DTYPES, RES, NZ, TAIL)                                            \
  {                                                                                              \
    {K, S, NT}, CBW, RES, NZ, {                                                                  \
      prog, "rmsnorm_backward_ring_kernel<{T}, " #K ", " #S ", " #CBW ", " #NT TAIL ">", DTYPES  \
    }                                                                                            \
  }
#define KF_RING3(K, S, NT, RES, TAIL)                                                   \
  KF_RING(K, S, NT, false, kF32, RES, 0, TAIL), KF_RING(K, S, NT, false, k16, RES, 0, TAIL), \
      KF_RING(K, S, NT, true, k16, RES, 0, TAIL)
#define KF_RING_F32(RES, NZ, TAIL) \
  KF_RING(4, 3, 384, false, kF32, RES, NZ, TAIL), KF_RING(2, 3, 512, false, kF32, RES, NZ, TAIL)
RingKernel ring_kernels[] = {KF_RING3(4, 3, 384, false, ""),        KF_RING3(2, 3, 512, false, ""),
                             KF_RING3(4, 3, 384, true, ", true"),   KF_RING3(2, 3, 512, true, ", true"),
                             KF_RING_F32(false, 1, ", false, 1"), KF_RING_F32(true, 1, ", true, 1"),
                             KF_RING_F32(false, 2, ", false, 2"), KF_RING_F32(true, 2, ", true, 2")};
#undef KF_RING_F32
#undef KF_RING3
#undef KF_RING

// Ring kernels whose dy is NY 16-bit terms summed in fp32 (fp32 x only; rmsnorm_backward_sum): both
// ring shapes, RES, NY = 2 / 3 terms of YT = 1 (bf16) / 2 (fp16), and no copy of dx or one of the
// terms' type (autocast has one 16-bit type). Each compiles without spills (sm_80 / sm_90).
struct TermsKernel {
  RingShape shape;
  bool res;
  int nz, ny, yt;
  Kernel kernel;
};
#define KF_TERMS(K, S, NT, RES, NZ, NY, YT)                                                              \
  {                                                                                                       \
    {K, S, NT}, RES, NZ, NY, YT, {                                                                        \
      prog, "rmsnorm_backward_ring_kernel<{T}, " #K ", " #S ", false, " #NT ", " #RES ", " #NZ ", " #NY ", " #YT \
            ">", kF32                                                                                     \
    }                                                                                                     \
  }
#define KF_TERMS_NY(K, S, NT, RES, YT)                                                          \
  KF_TERMS(K, S, NT, RES, 0, 2, YT), KF_TERMS(K, S, NT, RES, YT, 2, YT), KF_TERMS(K, S, NT, RES, 0, 3, YT), \
      KF_TERMS(K, S, NT, RES, YT, 3, YT)
#define KF_TERMS_SHAPE(K, S, NT)                                                                       \
  KF_TERMS_NY(K, S, NT, false, 1), KF_TERMS_NY(K, S, NT, true, 1), KF_TERMS_NY(K, S, NT, false, 2), \
      KF_TERMS_NY(K, S, NT, true, 2)
TermsKernel terms_kernels[] = {KF_TERMS_SHAPE(4, 3, 384), KF_TERMS_SHAPE(2, 3, 512)};
#undef KF_TERMS_SHAPE
#undef KF_TERMS_NY
#undef KF_TERMS

// dweight from the partial rows: 16-byte loads (D % 4 == 0) or element-wise.
Kernel dweight_kernels[2] = {{prog, "rmsnorm_dweight_kernel<{T}, false>"},
                             {prog, "rmsnorm_dweight_kernel<{T}, true>"}};

// variant 1 (never the ring: the kernels that take what the ring does not), for tests only.
TestingOverride bwd_override("rmsnorm_backward", rms_plan::kNumVariants, /*has_max_warps=*/false);

// The plan's kernels in the tables above (fail: a plan without its instantiation).
// narrow: -1 for y of the residual stream's type T, else 0 (bf16) / 1 (fp16) y of fp32 T.
// narrow_x: -1 for x of type T, else 0 (bf16) / 1 (fp16) x added to an fp32 residual.
Kernel& forward_kernel(const RmsnormPlan& p, int narrow = -1, int narrow_x = -1) {
  for (int i = 0; i < 4; ++i)
    if (kFwdK[i] == p.K) {
      if (narrow_x >= 0) return fwd_mixed_kernels[narrow_x][narrow >= 0 ? 1 : 0][p.vec ? 1 : 0][i];
      return narrow >= 0 ? fwd_narrow_kernels[narrow][p.vec ? 1 : 0][i]
                         : fwd_kernels[p.res ? 1 : 0][p.vec ? 1 : 0][i];
    }
  fail("rmsnorm_forward", "no kernel for K = ", p.K);
}

// nz: 0, or 1 / 2 for a bf16 / fp16 copy of an fp32 dx. ny / yt: dy as ny 16-bit terms of type yt
// (1 bf16, 2 fp16; the ring only).
Kernel* terms_kernel(const RmsnormPlan& p, int nz, int ny, int yt) {
  for (TermsKernel& k : terms_kernels)
    if (k.shape.K == p.K && k.shape.S == p.S && k.shape.NT == p.NT && k.res == p.res && k.nz == nz &&
        k.ny == ny && k.yt == yt)
      return &k.kernel;
  return nullptr;
}

Kernel& backward_kernel(const RmsnormPlan& p, DType dt, int nz, int ny = 0, int yt = 1) {
  if (ny) {
    if (Kernel* k = p.layout_id == RmsnormLayout::ring ? terms_kernel(p, nz, ny, yt) : nullptr) return *k;
    fail("rmsnorm_backward_sum", "no ring kernel for ", ny, " dy terms (K = ", p.K, ")");
  }
  if (p.layout_id == RmsnormLayout::ring) {
    for (RingKernel& k : ring_kernels)
      if (k.shape.K == p.K && k.shape.S == p.S && k.shape.NT == p.NT && k.cbw == p.cbw &&
          k.res == p.res && k.nz == nz && k.kernel.supports(dt))
        return k.kernel;
  } else if (p.layout_id == RmsnormLayout::pipelined) {
    for (PipeKernel& k : pipe_kernels)
      if (k.K == p.K && k.P == p.P && k.keep_g == p.keep_g && k.cbw == p.cbw && k.res == p.res &&
          k.nz == nz && k.kernel.supports(dt))
        return k.kernel;
  } else {
    for (BwdKernel& k : bwd_kernels)
      if (k.K == p.K && k.R == p.R && k.vec == p.vec && k.cbw == p.cbw && k.res == p.res &&
          k.nz == nz && k.kernel.supports(dt))
        return k.kernel;
  }
  fail("rmsnorm_backward", "no ", p.layout, " kernel for K = ", p.K);
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

// 8-byte aligned: a 16-bit tensor moved four elements at a time beside fp32 chunks.
bool aligned8(const at::Tensor& a) { return (reinterpret_cast<uintptr_t>(a.data_ptr()) & 7) == 0; }

// residual / dresidual: None, or a tensor of x's shape, dtype and device (made contiguous).
std::optional<at::Tensor> same_as_x(const std::optional<at::Tensor>& t, const at::Tensor& x,
                                    const char* op, const char* name) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  at::Tensor c = input_like(*t, x, op, name);
  KF_CHECK(c.sizes() == x.sizes(), op, name, " and x sizes differ: ", c.sizes(), " vs ", x.sizes());
  return c;
}

// y, rstd and, with a residual, s = x + residual (normalised in x's place).
std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>> forward(
    const char* op, const at::Tensor& x_, const std::optional<at::Tensor>& residual_,
    const std::optional<at::Tensor>& weight_, double eps, int64_t normalized_ndim,
    bool cast_before_weight, std::optional<at::ScalarType> y_dtype = std::nullopt) {
  const at::Tensor x = input(x_, op, "x");
  const auto is16 = [](at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; };
  // A 16-bit x added to an fp32 residual (autocast's branch into the fp32 stream): the residual's
  // type is the kernel's T (s, weight, a wide y), and x is upcast before the add, as eager's add.
  const bool mixed = residual_ && residual_->defined() && residual_->scalar_type() == at::kFloat &&
                     is16(x.scalar_type());
  const at::Tensor t = mixed ? input(*residual_, op, "residual") : x;  // T's tensor
  if (mixed) {
    KF_CHECK(t.device() == x.device(), op, "residual must be a CUDA tensor on ", x.device());
    KF_CHECK(t.sizes() == x.sizes(), op, "residual and x sizes differ: ", t.sizes(), " vs ", x.sizes());
  }
  const int64_t D = row_length(x, normalized_ndim, op);
  // residual before weight: a residual of a third type is the problem to name, not the weight
  const auto residual = mixed ? std::optional<at::Tensor>(t) : same_as_x(residual_, x, op, "residual");
  const auto weight = weight_input(weight_, t, D, op);
  int narrow = -1;
  const int narrow_x = mixed ? (x.scalar_type() == at::kBFloat16 ? 0 : 1) : -1;
  if (y_dtype && *y_dtype != t.scalar_type()) {
    KF_CHECK(t.scalar_type() == at::kFloat && is16(*y_dtype) && (!residual || *y_dtype == x.scalar_type()),
             op, "y_dtype ", to_str(*y_dtype), " for x of ", to_str(x.scalar_type()),
             ": only float32 x may store a bfloat16 / float16 y (with a residual: float32 residual, y of x's type)");
    narrow = *y_dtype == at::kBFloat16 ? 0 : 1;
  }
  LaunchOn on(x);
  const int64_t rows = x.numel() / D;
  at::Tensor y = narrow < 0 ? new_output_like(t) : new_output(t.sizes(), t.options().dtype(*y_dtype));
  at::Tensor rstd = new_output({rows}, t.options().dtype(at::kFloat));
  std::optional<at::Tensor> s;
  if (residual) s = new_output_like(t);
  if (rows == 0) return {y, rstd, s};
  const int64_t V = 16 / t.element_size();
  // A 16-bit y or x of fp32 T moves 8 bytes a chunk: 8-byte aligned rows (D % 4 == 0) and base.
  const bool y_ok = narrow < 0 ? aligned16(y) : aligned8(y);
  const bool x_ok = mixed ? aligned8(x) : aligned16(x);
  const bool vec = D % V == 0 && x_ok && y_ok && (!weight || aligned16(*weight)) &&
                   (!residual || (aligned16(*residual) && aligned16(*s)));
  const RmsnormPlan p =
      plan_rmsnorm_forward(rows, static_cast<int>((D + V - 1) / V), vec, residual.has_value());
  KF_CHECK(p.error.empty(), op, p.error);
  const int zero = 0;  // see opaque() in the kernel
  forward_kernel(p, narrow, narrow_x).launch(
      dtype_of(t, op), on.device, on.stream, static_cast<unsigned>(p.grid),
      Dim3(static_cast<unsigned>(p.block_x), static_cast<unsigned>(p.block_y)), 0, x.data_ptr(),
      ptr(weight), y.data_ptr(), rstd.data_ptr(), static_cast<long long>(rows), static_cast<int>(D),
      1.0f / static_cast<float>(D), static_cast<float>(eps), zero, int(cast_before_weight),
      ptr(residual), ptr(s));
  return {y, rstd, s};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_forward(const at::Tensor& x,
                                                   const std::optional<at::Tensor>& weight,
                                                   double eps, int64_t normalized_ndim,
                                                   bool cast_before_weight,
                                                   std::optional<at::ScalarType> y_dtype) {
  auto [y, rstd, s] = forward("rmsnorm_forward", x, std::nullopt, weight, eps, normalized_ndim,
                              cast_before_weight, y_dtype);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rmsnorm_forward(
    const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    double eps, int64_t normalized_ndim, bool cast_before_weight,
    std::optional<at::ScalarType> y_dtype) {
  const char* op = "add_rmsnorm_forward";
  KF_CHECK(residual.defined(), op, "residual is undefined");
  auto [y, rstd, s] =
      forward(op, x, residual, weight, eps, normalized_ndim, cast_before_weight, y_dtype);
  return {y, rstd, *s};
}

// dx, dweight and, with copy_dtype (bf16 / fp16, for fp32 x only), dx rounded once to that type by
// the same kernel.
// terms (rmsnorm_backward_sum; dy_ undefined): dy is their sum in fp32, ((terms[0] + terms[1]) +
// terms[2]), each upcast; the ring kernel reads them, other layouts get torch's sum first.
std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> backward(
    const char* op, const at::Tensor& dy_, const at::Tensor& x_, const std::optional<at::Tensor>& weight_,
    const at::Tensor& rstd_, int64_t normalized_ndim, bool cast_before_weight,
    const std::optional<at::Tensor>& dresidual_, std::optional<at::ScalarType> copy_dtype,
    const std::vector<at::Tensor>& terms_ = {}) {
  const at::Tensor x = input(x_, op, "x");
  at::Tensor dy;
  std::vector<at::Tensor> terms;
  int yt = 1;
  if (terms_.empty()) {
    dy = input_like(dy_, x, op, "dy");
    KF_CHECK(dy.sizes() == x.sizes(), op, "dy and x sizes differ: ", dy.sizes(), " vs ", x.sizes());
  } else {
    KF_CHECK(terms_.size() == 2 || terms_.size() == 3, op, "takes 2 or 3 dy terms, got ", terms_.size());
    KF_CHECK(x.scalar_type() == at::kFloat, op, "x of ", to_str(x.scalar_type()),
             ": the dy terms are 16-bit gradients of a float32 x");
    for (const at::Tensor& t : terms_) {
      at::Tensor c = input(t, op, "dy term");
      KF_CHECK(c.device() == x.device(), op, "dy terms must be CUDA tensors on ", x.device());
      KF_CHECK((c.scalar_type() == at::kBFloat16 || c.scalar_type() == at::kHalf) &&
                   c.scalar_type() == terms_[0].scalar_type(),
               op, "dy terms of ", to_str(c.scalar_type()), " and ", to_str(terms_[0].scalar_type()),
               ": they must be all bfloat16 or all float16");
      KF_CHECK(c.numel() == x.numel(), op, "a dy term has ", c.numel(), " elements, x ", x.numel());
      terms.push_back(std::move(c));
    }
    yt = terms[0].scalar_type() == at::kBFloat16 ? 1 : 2;
  }
  const auto dres = same_as_x(dresidual_, x, op, "dresidual");
  const bool res = dres.has_value();
  const int64_t D = row_length(x, normalized_ndim, op);
  const auto weight = weight_input(weight_, x, D, op);
  const int64_t rows = x.numel() / D;
  KF_CHECK(rstd_.defined() && rstd_.is_cuda() && rstd_.device() == x.device() &&
               rstd_.scalar_type() == at::kFloat && rstd_.numel() == rows,
           op, "rstd must be a float32 CUDA tensor of ", rows, " elements on ", x.device());
  int nz = 0;
  if (copy_dtype) {
    KF_CHECK(x.scalar_type() == at::kFloat && (*copy_dtype == at::kBFloat16 || *copy_dtype == at::kHalf), op,
             "copy_dtype ", to_str(*copy_dtype), " for x of ", to_str(x.scalar_type()),
             ": only a float32 dx has a bfloat16 / float16 copy");
    nz = *copy_dtype == at::kBFloat16 ? 1 : 2;
  }
  const at::Tensor rstd = rstd_.contiguous();
  LaunchOn on(x);
  at::Tensor dx = new_output_like(x);
  std::optional<at::Tensor> dweight, copy;
  if (weight) dweight = new_output_like(*weight);
  if (nz) copy = new_output(x.sizes(), x.options().dtype(*copy_dtype));
  if (rows == 0) {
    if (dweight) dweight->zero_();
    return {dx, dweight, copy};
  }
  const int64_t V = 16 / x.element_size();
  bool terms_ok = true;
  for (const at::Tensor& t : terms) terms_ok = terms_ok && aligned8(t);
  const bool vec = D % V == 0 && aligned16(x) && (terms.empty() ? aligned16(dy) : terms_ok) && aligned16(dx) &&
                   (!weight || aligned16(*weight)) && (!res || aligned16(*dres)) && (!copy || aligned8(*copy));
  const DType dt = dtype_of(x, op);
  const int zero = 0;  // see opaque() in the kernel
  const int64_t optin = at::cuda::getDeviceProperties(on.device)->sharedMemPerBlockOptin;
  const int ny = static_cast<int>(terms.size());
  const RmsnormPlan p = plan_rmsnorm_backward(rows, D, x.element_size(), dt == DType::f32, vec,
                                              cast_before_weight, res, sm_count(on.device), optin,
                                              bwd_override.get_variant(), ny);
  if (ny && (p.layout_id != RmsnormLayout::ring || !terms_kernel(p, nz, ny, yt))) {
    // Outside the ring (or a copy of another type than the terms'): torch sums the terms in the same
    // order, then the fp32 kernels as for any dy (the outputs above are dropped: a rare path).
    at::Tensor sum = terms[0].to(at::kFloat);
    for (int j = 1; j < ny; ++j) sum.add_(terms[j].to(at::kFloat));
    return backward(op, sum.view(x.sizes()), x, weight, rstd_, normalized_ndim, cast_before_weight, dres, copy_dtype);
  }
  Kernel& kernel = backward_kernel(p, dt, nz, ny, yt);
  const unsigned grid = static_cast<unsigned>(p.grid);
  const Dim3 block(static_cast<unsigned>(p.block_x), static_cast<unsigned>(p.block_y));
  const size_t smem = static_cast<size_t>(p.smem);
  std::optional<at::Tensor> partial;
  if (weight) partial = new_output({static_cast<int64_t>(grid), D}, x.options().dtype(at::kFloat));
  const float inv_d = 1.0f / static_cast<float>(D);
  if (p.layout_id == RmsnormLayout::pipelined)  // takes the bf16 / half unpacking masks too
    kernel.launch(dt, on.device, on.stream, grid, block, smem, dy.data_ptr(), x.data_ptr(),
                  ptr(weight), rstd.data_ptr(), dx.data_ptr(), ptr(partial),
                  static_cast<long long>(rows), static_cast<int>(D), inv_d, 0x10000u, 0xffff0000u,
                  zero, ptr(dres), ptr(copy));
  else if (p.layout_id == RmsnormLayout::ring)  // takes up to three dy terms (nullptr: unused)
    kernel.launch(dt, on.device, on.stream, grid, block, smem,
                  ny ? terms[0].data_ptr() : dy.data_ptr(), x.data_ptr(), ptr(weight), rstd.data_ptr(),
                  dx.data_ptr(), ptr(partial), static_cast<long long>(rows), static_cast<int>(D), inv_d,
                  zero, ptr(dres), ptr(copy), ny > 1 ? terms[1].data_ptr() : nullptr,
                  ny > 2 ? terms[2].data_ptr() : nullptr);
  else
    kernel.launch(dt, on.device, on.stream, grid, block, smem, dy.data_ptr(), x.data_ptr(),
                  ptr(weight), rstd.data_ptr(), dx.data_ptr(), ptr(partial),
                  static_cast<long long>(rows), static_cast<int>(D), inv_d, zero, ptr(dres), ptr(copy));
  if (weight)
    dweight_kernels[D % 4 == 0 ? 1 : 0].launch(
        dt, on.device, on.stream, ceil_div(D, 32), Dim3(8, 32), 0, partial->data_ptr(),
        dweight->data_ptr(), static_cast<int>(grid), static_cast<int>(D));
  return {dx, dweight, copy};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> rmsnorm_backward(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const at::Tensor& rstd, int64_t normalized_ndim, bool cast_before_weight,
    const std::optional<at::Tensor>& dresidual) {
  auto [dx, dweight, copy] = backward("rmsnorm_backward", dy, x, weight, rstd, normalized_ndim,
                                      cast_before_weight, dresidual, std::nullopt);
  return {dx, dweight};
}

std::tuple<at::Tensor, std::optional<at::Tensor>, at::Tensor> rmsnorm_backward_copy(
    const at::Tensor& dy, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const at::Tensor& rstd, int64_t normalized_ndim, bool cast_before_weight,
    const std::optional<at::Tensor>& dresidual, at::ScalarType copy_dtype) {
  auto [dx, dweight, copy] = backward("rmsnorm_backward_copy", dy, x, weight, rstd, normalized_ndim,
                                      cast_before_weight, dresidual, copy_dtype);
  return {dx, dweight, *copy};
}

std::tuple<at::Tensor, std::optional<at::Tensor>, std::optional<at::Tensor>> rmsnorm_backward_sum(
    const std::vector<at::Tensor>& dy_terms, const at::Tensor& x, const std::optional<at::Tensor>& weight,
    const at::Tensor& rstd, int64_t normalized_ndim, bool cast_before_weight,
    const std::optional<at::Tensor>& dresidual, std::optional<at::ScalarType> copy_dtype) {
  return backward("rmsnorm_backward_sum", at::Tensor(), x, weight, rstd, normalized_ndim, cast_before_weight,
                  dresidual, copy_dtype, dy_terms);
}

}  // namespace

KFORGE_BIND_OP(rmsnorm) {
  m.def("rmsnorm_forward", &rmsnorm_forward,
        "RMSNorm over the last `normalized_ndim` dims: returns (y, rstd) with rstd float32 of one "
        "element per row. cast_before_weight: y = weight * T(x * rstd) (Hugging Face Llama), else "
        "y = T(x * rstd * weight) (torch F.rms_norm). weight may be None. y_dtype (None: x's): "
        "bfloat16 / float16 for float32 x stores y rounded once from the fp32 result, as "
        "rmsnorm_forward(x)[0].to(y_dtype).",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("normalized_ndim") = 1, pybind11::arg("cast_before_weight") = true,
        pybind11::arg("y_dtype") = pybind11::none());
  m.def("add_rmsnorm_forward", &add_rmsnorm_forward,
        "Residual add fused into rmsnorm_forward: s = x + residual (fp32 add, rounded once to x's "
        "dtype, as eager's add), then RMSNorm of s; returns (y, rstd, s). residual has x's shape, "
        "dtype and device, or is float32 with a bfloat16 / float16 x (autocast's branch added to an "
        "fp32 stream: s = float(x) + residual, weight float32); y_dtype (None: s's type, or x's "
        "16-bit type with a float32 residual) as rmsnorm_forward's.",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("normalized_ndim") = 1, pybind11::arg("cast_before_weight") = true,
        pybind11::arg("y_dtype") = pybind11::none());
  m.def("rmsnorm_backward", &rmsnorm_backward,
        "Backward of rmsnorm_forward from the saved rstd: returns (dx, dweight), dweight None when "
        "weight is None; dweight is reduced in a fixed order (deterministic, the same bits every "
        "run): the shared-memory ring kernel (16-byte accesses, rows of <= 1024 16-byte chunks; "
        "persistent grid of one block per SM) writing one partial dweight row per block, then a "
        "separate reduction kernel; where the ring does not apply, a register-pipelined kernel "
        "(16-byte rows of <= 1024 chunks whose stages do not fit in shared memory) or another for "
        "odd sizes, misaligned pointers and longer rows (kforge._C.plan). dresidual (x's shape and dtype, or None): the "
        "gradient of x from its other consumers (add_rmsnorm_forward's s), added to dx in fp32 "
        "before dx's one rounding.",
        pybind11::arg("dy"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("rstd"),
        pybind11::arg("normalized_ndim") = 1, pybind11::arg("cast_before_weight") = true,
        pybind11::arg("dresidual") = pybind11::none());
  m.def("rmsnorm_backward_copy", &rmsnorm_backward_copy,
        "rmsnorm_backward of a float32 x that also stores dx rounded once to copy_dtype (bfloat16 / "
        "float16): returns (dx, dweight, dx.to(copy_dtype)) from one kernel (autocast's fp32 residual "
        "stream, whose gradient the next 16-bit matmul reads too).",
        pybind11::arg("dy"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("rstd"),
        pybind11::arg("normalized_ndim"), pybind11::arg("cast_before_weight"), pybind11::arg("dresidual"),
        pybind11::arg("copy_dtype"));
  m.def("rmsnorm_backward_sum", &rmsnorm_backward_sum,
        "rmsnorm_backward of a float32 x whose dy is the sum of 2 or 3 bfloat16 / float16 tensors of x's "
        "size (dy_terms), upcast and added in float32 in their order, ((t0 + t1) + t2): autocast's "
        "norm output read by several 16-bit matmuls, whose input gradients autograd sums. The ring "
        "kernel reads the terms (no fp32 dy is written); other layouts sum them with torch first. "
        "dresidual and copy_dtype as in rmsnorm_backward_copy; returns (dx, dweight, copy), each of the "
        "last two None when not asked for.",
        pybind11::arg("dy_terms"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("rstd"),
        pybind11::arg("normalized_ndim") = 1, pybind11::arg("cast_before_weight") = true,
        pybind11::arg("dresidual") = pybind11::none(), pybind11::arg("copy_dtype") = pybind11::none());
}

}  // namespace kforge
