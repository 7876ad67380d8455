// rmsnorm launchers: forward (y, rstd), with the residual add fused (y, rstd, s), and backward
// (dx, dweight), optionally plus the residual's gradient; see kernels_src/rmsnorm.cu.
#include <pybind11/stl.h>

#include <optional>

#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

Program prog("rmsnorm");

// Forward kernels by RES (the residual add fused), VEC (16-byte accesses; otherwise element-wise, for
// odd sizes and misaligned pointers) and K, the 16-byte chunks of x each thread keeps in registers.
constexpr int kFwdK[] = {1, 2, 4, 8};
#define KF_FWD4(VEC, RES)                                              \
  {                                                                    \
    {prog, "rmsnorm_forward_kernel<{T}, 1, " #VEC RES ">"},            \
        {prog, "rmsnorm_forward_kernel<{T}, 2, " #VEC RES ">"},        \
        {prog, "rmsnorm_forward_kernel<{T}, 4, " #VEC RES ">"},        \
        {prog, "rmsnorm_forward_kernel<{T}, 8, " #VEC RES ">"}         \
  }
Kernel fwd_kernels[2][2][4] = {{KF_FWD4(false, ""), KF_FWD4(true, "")},
                               {KF_FWD4(false, ", true"), KF_FWD4(true, ", true")}};
#undef KF_FWD4

// Backward kernels: K chunks per thread and row, R rows per group at a time, VEC, CBW
// (cast_before_weight, 16-bit types only: fp32 is the same either way), blocks of at most
// kBwdThreads threads (one per SM, <= 128 registers per thread). R is what fits in registers without
// spilling (checked with NVRTC's ptxas for sm_80 and sm_90): fewer rows for element-wise access and
// for 16-bit types at K = 4 (8 fp32 dweight sums per chunk instead of 4).
constexpr int kBwdThreads = 512;  // MAXT of every backward kernel name below
const std::vector<DType> kF32 = {DType::f32};
const std::vector<DType> k16 = {DType::bf16, DType::f16};
// RES: dx plus the residual's gradient (each kernel family below has the same rows with RES).
struct BwdKernel {
  int K;
  bool vec, cbw;
  int R;
  bool res;
  Kernel kernel;
};
#define KF_BWD(K, R, VEC, CBW, DTYPES, RES, RESARG)                                                \
  {                                                                                                \
    K, VEC, CBW, R, RES, {                                                                         \
      prog, "rmsnorm_backward_kernel<{T}, " #K ", " #R ", " #VEC ", " #CBW ", 512" RESARG ">", DTYPES \
    }                                                                                              \
  }
#define KF_BWD_TABLE(RES, RESARG)                                                                 \
  KF_BWD(1, 4, true, false, kF32, RES, RESARG), KF_BWD(1, 4, false, false, kF32, RES, RESARG),    \
      KF_BWD(2, 4, true, false, kF32, RES, RESARG), KF_BWD(2, 2, false, false, kF32, RES, RESARG), \
      KF_BWD(4, 2, true, false, kF32, RES, RESARG), KF_BWD(4, 1, false, false, kF32, RES, RESARG), \
      KF_BWD(1, 4, true, false, k16, RES, RESARG), KF_BWD(1, 4, false, false, k16, RES, RESARG),   \
      KF_BWD(2, 4, true, false, k16, RES, RESARG), KF_BWD(2, 2, false, false, k16, RES, RESARG),   \
      KF_BWD(4, 1, true, false, k16, RES, RESARG), KF_BWD(4, 1, false, false, k16, RES, RESARG),   \
      KF_BWD(1, 4, true, true, k16, RES, RESARG), KF_BWD(1, 4, false, true, k16, RES, RESARG),     \
      KF_BWD(2, 4, true, true, k16, RES, RESARG), KF_BWD(2, 2, false, true, k16, RES, RESARG),     \
      KF_BWD(4, 1, true, true, k16, RES, RESARG), KF_BWD(4, 1, false, true, k16, RES, RESARG)
BwdKernel bwd_kernels[] = {KF_BWD_TABLE(false, ""), KF_BWD_TABLE(true, ", true")};
#undef KF_BWD_TABLE
#undef KF_BWD

// Pipelined backward kernels (16-byte accesses only; rows of at most kPipeMaxChunks chunks; where the
// ring's stages do not fit in shared memory): K chunks per thread and row, P rows in flight, KEEP_G
// (g = dy * w kept in registers through the reduction: 16-bit types), CBW; blocks of kBwdThreads
// threads, one per SM. Each compiles without spills at 128 registers (ptxas for sm_80 and sm_90),
// with no register move waiting on a load in the hot loop (sm_90 SASS).
constexpr int kPipeMaxChunks = 1024;
struct PipeKernel {
  int K, P;
  bool keep_g, cbw, res;
  Kernel kernel;
};
#define KF_PIPE(K, P, KEEP_G, CBW, DTYPES, RES, RESARG)                                          \
  {                                                                                              \
    K, P, KEEP_G, CBW, RES, {                                                                    \
      prog,                                                                                      \
          "rmsnorm_backward_pipelined_kernel<{T}, " #K ", " #P ", " #KEEP_G ", " #CBW ", 512" RESARG \
          ">",                                                                                   \
          DTYPES                                                                                 \
    }                                                                                            \
  }
#define KF_PIPE_TABLE(RES, RESARG)                                                          \
  KF_PIPE(1, 8, false, false, kF32, RES, RESARG), KF_PIPE(2, 4, false, false, kF32, RES, RESARG), \
      KF_PIPE(1, 4, true, false, k16, RES, RESARG), KF_PIPE(2, 2, true, false, k16, RES, RESARG), \
      KF_PIPE(1, 4, true, true, k16, RES, RESARG), KF_PIPE(2, 2, true, true, k16, RES, RESARG)
PipeKernel pipe_kernels[] = {KF_PIPE_TABLE(false, ""), KF_PIPE_TABLE(true, ", true")};
#undef KF_PIPE_TABLE
#undef KF_PIPE

// Ring backward kernels (16-byte accesses only, rows of at most kRingMaxChunks chunks), one block per
// SM: K chunks per thread and row, S stages of shared memory, blocks of at most NT threads; rows of
// <= 512 chunks 4 chunks per thread in blocks of 384 threads (at D = 4096 bf16: three rows at a
// time), longer rows (bf16 / fp16 D <= 8192, fp32 D <= 4096) 2 chunks per thread, 512 threads; 3
// stages. CBW. Each compiles without spills (ptxas for sm_80 and sm_90).
constexpr int kRingMaxChunks = 1024;
struct RingShape {
  int K, S, NT;
};
constexpr RingShape kRingShort{4, 3, 384}, kRingLong{2, 3, 512};
struct RingKernel {
  RingShape shape;
  bool cbw, res;
  Kernel kernel;
};
#define KF_RING(K, S, NT, CBW, DTYPES, RES, RESARG)                                                \
  {                                                                                                \
    {K, S, NT}, CBW, RES, {                                                                        \
      prog, "rmsnorm_backward_ring_kernel<{T}, " #K ", " #S ", " #CBW ", " #NT RESARG ">", DTYPES  \
    }                                                                                              \
  }
#define KF_RING3(K, S, NT, RES, RESARG)                                        \
  KF_RING(K, S, NT, false, kF32, RES, RESARG), KF_RING(K, S, NT, false, k16, RES, RESARG), \
      KF_RING(K, S, NT, true, k16, RES, RESARG)
RingKernel ring_kernels[] = {KF_RING3(4, 3, 384, false, ""), KF_RING3(2, 3, 512, false, ""),
                             KF_RING3(4, 3, 384, true, ", true"), KF_RING3(2, 3, 512, true, ", true")};
#undef KF_RING3
#undef KF_RING

// dweight from the partial rows: 16-byte loads (D % 4 == 0) or element-wise.
Kernel dweight_kernels[2] = {{prog, "rmsnorm_dweight_kernel<{T}, false>"},
                             {prog, "rmsnorm_dweight_kernel<{T}, true>"}};

// Longest row, in 16-byte chunks: 16384 bf16/fp16 or 8192 fp32 elements (kforge.ops.rmsnorm's
// checker declines longer rows).
constexpr int kMaxChunks = 2048;

unsigned round32(int64_t n) { return static_cast<unsigned>((n + 31) / 32 * 32); }

struct FwdGeometry {
  Kernel* kernel;
  unsigned tx, ty;  // threads per row, rows per block
};

// Forward: one warp per row (8 rows per block) up to 256 chunks, with the fewest chunks per thread
// that fit; longer rows one block of <= 256 threads each, 8 chunks per thread (4 where that wastes
// fewer threads): the more of a row each thread loads at once, the more bytes each SM has in flight.
FwdGeometry forward_geometry(int nchunk, bool vec, bool res) {
  Kernel* ks = fwd_kernels[res ? 1 : 0][vec ? 1 : 0];
  if (nchunk <= 32 * 8) {
    for (int i = 0; i < 4; ++i)
      if (nchunk <= 32 * kFwdK[i]) return {&ks[i], 32, 8};
  }
  const unsigned tx4 = round32((nchunk + 3) / 4), tx8 = round32((nchunk + 7) / 8);
  if (tx4 <= 256 && 4 * tx4 < 8 * tx8) return {&ks[2], tx4, 1};
  return {&ks[3], tx8, 1};
}

struct BwdGeometry {
  BwdKernel* kernel;
  unsigned tx, groups;  // threads per row (group), groups per block
};

// Backward: chunks per thread K = 1 (one warp per row) up to 32 chunks, K = 2 (rows of <= 256
// threads) up to 512, else K = 4 (<= 512 threads); as many row groups per block as fit.
BwdGeometry backward_geometry(int nchunk, bool vec, bool cbw, bool res, DType dt) {
  const int K = nchunk <= 32 ? 1 : nchunk <= 512 ? 2 : 4;
  cbw = cbw && dt != DType::f32;
  for (BwdKernel& k : bwd_kernels)
    if (k.K == K && k.vec == vec && k.cbw == cbw && k.res == res && k.kernel.supports(dt)) {
      const unsigned tx = round32((nchunk + K - 1) / K);
      return {&k, tx, kBwdThreads / tx};
    }
  fail("rmsnorm_backward", "no kernel for ", nchunk, " chunks");
}

// Backward kernel choices (the launcher's `variant`).
enum BwdVariant : int64_t {
  kDefault = 0,   // the ring where it applies, else the fallbacks
  kFallback = 1,  // never the ring: the kernels that take the inputs the ring does not (tests)
  kNumVariants = 2,
};

// Pipelined backward: K = 1 (one warp per row, 16 rows per block) up to 32 chunks, else K = 2 (rows
// of <= 512 threads). 16-bit types: P = 2 rows in flight (K = 1: 4) keeping g; fp32: P = 8 (K = 1) or
// 4 (K = 2), without g (fp32's unpacking is free, so keeping g saves little). nullptr where the
// pipelined kernels do not apply (element-wise access, longer rows): rmsnorm_backward_kernel takes
// those.
PipeKernel* pipe_kernel(int nchunk, bool vec, bool cbw, bool res, DType dt) {
  if (!vec || nchunk > kPipeMaxChunks) return nullptr;
  const int K = nchunk <= 32 ? 1 : 2;
  const bool f32 = dt == DType::f32;
  const bool keep_g = !f32;
  const int P = f32 ? (K == 1 ? 8 : 4) : (K == 1 ? 4 : 2);
  cbw = cbw && !f32;
  for (PipeKernel& k : pipe_kernels)
    if (k.K == K && k.P == P && k.keep_g == keep_g && k.cbw == cbw && k.res == res &&
        k.kernel.supports(dt))
      return &k;
  fail("rmsnorm_backward", "no pipelined kernel for ", nchunk, " chunks");
}

struct RingPlan {
  Kernel* kernel = nullptr;  // nullptr: the ring kernels do not apply
  unsigned tx = 0, groups = 0, grid = 0;
  size_t smem = 0;
};

// Ring backward: a row group of `groups` rows of tx threads per block, tx = the thread count for K
// chunks each, a multiple of 32 or a power of two below 32 (the kernel's reductions rely on it); the
// stages in dynamic shared memory (see the kernel); a persistent grid of one block per SM (at most
// the row groups). Not applied (kernel nullptr) to element-wise access, rows longer than
// kRingMaxChunks, shared memory beyond the device's limit, or a tensor too large for the kernel's
// 32-bit row step. res: stages of three arrays (x, dy, dres) instead of two; the longest stages need
// an H100's opt-in shared memory (sm_80 takes the pipelined kernel there).
RingPlan ring_plan(int nchunk, bool vec, bool cbw, bool res, DType dt, int64_t rows, int64_t D,
                   int64_t elem, int device) {
  RingPlan p;
  if (!vec || nchunk > kRingMaxChunks) return p;
  const RingShape sh = nchunk > 512 ? kRingLong : kRingShort;
  cbw = cbw && dt != DType::f32;
  RingKernel* rk = nullptr;
  for (RingKernel& k : ring_kernels)
    if (k.shape.K == sh.K && k.shape.S == sh.S && k.shape.NT == sh.NT && k.cbw == cbw &&
        k.res == res && k.kernel.supports(dt))
      rk = &k;
  if (!rk) fail("rmsnorm_backward", "no ring kernel for ", nchunk, " chunks");
  int tx = (nchunk + sh.K - 1) / sh.K;
  if (tx <= 32) {
    int t = 1;
    while (t < tx) t *= 2;
    tx = t;
  } else {
    tx = static_cast<int>(round32(tx));
  }
  const int groups = sh.NT / tx;  // tx <= NT: nchunk <= K * NT for every shape
  const int nseg = tx >= 32 ? tx * groups / 32 : groups;
  const size_t arrays = res ? 3 : 2;
  const size_t smem = size_t(sh.S) * (arrays * groups * tx * sh.K * 16 + size_t(nseg) * 4);
  const size_t static_smem = size_t(2) * sh.NT;  // red[2][NT / 4] floats
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device);
  if (smem + static_smem > prop->sharedMemPerBlockOptin) return p;
  const int64_t ngroups = (rows + groups - 1) / groups;
  const int64_t grid = std::min<int64_t>(ngroups, prop->multiProcessorCount);
  if (grid * groups * D * elem >= (int64_t(1) << 32) ||
      (ngroups + grid - 1) / grid > std::numeric_limits<int>::max() - 16)
    return p;
  p.kernel = &rk->kernel;
  p.tx = static_cast<unsigned>(tx);
  p.groups = static_cast<unsigned>(groups);
  p.grid = static_cast<unsigned>(grid);
  p.smem = smem;
  return p;
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
    bool cast_before_weight) {
  const at::Tensor x = input(x_, op, "x");
  const int64_t D = row_length(x, normalized_ndim, op);
  const auto weight = weight_input(weight_, x, D, op);
  const auto residual = same_as_x(residual_, x, op, "residual");
  LaunchOn on(x);
  const int64_t rows = x.numel() / D;
  at::Tensor y = new_output_like(x);
  at::Tensor rstd = new_output({rows}, x.options().dtype(at::kFloat));
  std::optional<at::Tensor> s;
  if (residual) s = new_output_like(x);
  if (rows == 0) return {y, rstd, s};
  const int64_t V = 16 / x.element_size();
  const bool vec = D % V == 0 && aligned16(x) && aligned16(y) && (!weight || aligned16(*weight)) &&
                   (!residual || (aligned16(*residual) && aligned16(*s)));
  const FwdGeometry g = forward_geometry(static_cast<int>((D + V - 1) / V), vec, residual.has_value());
  KF_CHECK((rows + g.ty - 1) / g.ty <= std::numeric_limits<int>::max(), op, "too many rows: ", rows);
  const int zero = 0;  // see opaque() in the kernel
  g.kernel->launch(dtype_of(x, op), on.device, on.stream, ceil_div(rows, g.ty), Dim3(g.tx, g.ty), 0,
                   x.data_ptr(), ptr(weight), y.data_ptr(), rstd.data_ptr(),
                   static_cast<long long>(rows), static_cast<int>(D), 1.0f / static_cast<float>(D),
                   static_cast<float>(eps), zero, int(cast_before_weight), ptr(residual), ptr(s));
  return {y, rstd, s};
}

std::tuple<at::Tensor, at::Tensor> rmsnorm_forward(const at::Tensor& x,
                                                   const std::optional<at::Tensor>& weight,
                                                   double eps, int64_t normalized_ndim,
                                                   bool cast_before_weight) {
  auto [y, rstd, s] =
      forward("rmsnorm_forward", x, std::nullopt, weight, eps, normalized_ndim, cast_before_weight);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_rmsnorm_forward(
    const at::Tensor& x, const at::Tensor& residual, const std::optional<at::Tensor>& weight,
    double eps, int64_t normalized_ndim, bool cast_before_weight) {
  const char* op = "add_rmsnorm_forward";
  KF_CHECK(residual.defined(), op, "residual is undefined");
  auto [y, rstd, s] = forward(op, x, residual, weight, eps, normalized_ndim, cast_before_weight);
  return {y, rstd, *s};
}

std::tuple<at::Tensor, std::optional<at::Tensor>> rmsnorm_backward(
    const at::Tensor& dy_, const at::Tensor& x_, const std::optional<at::Tensor>& weight_,
    const at::Tensor& rstd_, int64_t normalized_ndim, bool cast_before_weight, int64_t variant,
    const std::optional<at::Tensor>& dresidual_) {
  const char* op = "rmsnorm_backward";
  KF_CHECK(variant >= 0 && variant < kNumVariants, op, "variant must be in [0, ", kNumVariants - 1,
           "], got ", variant);
  const at::Tensor x = input(x_, op, "x");
  const at::Tensor dy = input_like(dy_, x, op, "dy");
  KF_CHECK(dy.sizes() == x.sizes(), op, "dy and x sizes differ: ", dy.sizes(), " vs ", x.sizes());
  const auto dres = same_as_x(dresidual_, x, op, "dresidual");
  const bool res = dres.has_value();
  const int64_t D = row_length(x, normalized_ndim, op);
  const auto weight = weight_input(weight_, x, D, op);
  const int64_t rows = x.numel() / D;
  KF_CHECK(rstd_.defined() && rstd_.is_cuda() && rstd_.device() == x.device() &&
               rstd_.scalar_type() == at::kFloat && rstd_.numel() == rows,
           op, "rstd must be a float32 CUDA tensor of ", rows, " elements on ", x.device());
  const at::Tensor rstd = rstd_.contiguous();
  LaunchOn on(x);
  at::Tensor dx = new_output_like(x);
  std::optional<at::Tensor> dweight;
  if (weight) dweight = new_output_like(*weight);
  if (rows == 0) {
    if (dweight) dweight->zero_();
    return {dx, dweight};
  }
  const int64_t V = 16 / x.element_size();
  const int nchunk = static_cast<int>((D + V - 1) / V);
  const bool vec = D % V == 0 && aligned16(x) && aligned16(dy) && aligned16(dx) &&
                   (!weight || aligned16(*weight)) && (!res || aligned16(*dres));
  const DType dt = dtype_of(x, op);
  const int zero = 0;  // see opaque() in the kernel
  const int sms = sm_count(on.device);
  const int64_t elem = x.element_size();
  // The ring where it applies; elsewhere the pipelined kernel (16-byte rows of <= 1024 chunks),
  // else rmsnorm_backward_kernel.
  const RingPlan ring = variant == kFallback
                            ? RingPlan{}
                            : ring_plan(nchunk, vec, cast_before_weight, res, dt, rows, D, elem,
                                        on.device);
  PipeKernel* pk = ring.kernel ? nullptr : pipe_kernel(nchunk, vec, cast_before_weight, res, dt);
  unsigned grid = ring.grid, tx = ring.tx, groups = ring.groups;
  if (pk) {
    tx = round32((nchunk + pk->K - 1) / pk->K);
    groups = kBwdThreads / tx;
    // Persistent grid: one block per SM, fewer when the rows do not need them; the kernel advances
    // its pointers by a 32-bit step per row and counts a group's rows in an int.
    grid = static_cast<unsigned>(std::min<int64_t>((rows + groups - 1) / groups, sms));
    const int64_t stride = int64_t(grid) * groups;
    if (stride * D * x.element_size() >= (int64_t(1) << 32) ||
        (rows + stride - 1) / stride > std::numeric_limits<int>::max() - 8)
      pk = nullptr;
  }
  Kernel* kernel = ring.kernel ? ring.kernel : pk ? &pk->kernel : nullptr;
  if (!kernel) {
    const BwdGeometry g = backward_geometry(nchunk, vec, cast_before_weight, res, dt);
    tx = g.tx, groups = g.groups, kernel = &g.kernel->kernel;
    const int64_t rows_per_step = int64_t(groups) * g.kernel->R;
    grid = static_cast<unsigned>(std::min<int64_t>((rows + rows_per_step - 1) / rows_per_step, sms));
  }
  std::optional<at::Tensor> partial;
  if (weight) partial = new_output({static_cast<int64_t>(grid), D}, x.options().dtype(at::kFloat));
  const size_t fold_bytes = size_t(tx) * groups * V * sizeof(float);
  const float inv_d = 1.0f / static_cast<float>(D);
  if (ring.kernel)
    kernel->launch(dt, on.device, on.stream, grid, Dim3(tx, groups), ring.smem, dy.data_ptr(),
                   x.data_ptr(), ptr(weight), rstd.data_ptr(), dx.data_ptr(), ptr(partial),
                   static_cast<long long>(rows), static_cast<int>(D), inv_d, zero, ptr(dres));
  else if (pk)
    kernel->launch(dt, on.device, on.stream, grid, Dim3(tx, groups), fold_bytes, dy.data_ptr(),
                   x.data_ptr(), ptr(weight), rstd.data_ptr(), dx.data_ptr(), ptr(partial),
                   static_cast<long long>(rows), static_cast<int>(D), inv_d, 0x10000u, 0xffff0000u,
                   zero, ptr(dres));
  else
    kernel->launch(dt, on.device, on.stream, grid, Dim3(tx, groups), fold_bytes, dy.data_ptr(),
                   x.data_ptr(), ptr(weight), rstd.data_ptr(), dx.data_ptr(), ptr(partial),
                   static_cast<long long>(rows), static_cast<int>(D), inv_d, zero, ptr(dres));
  if (weight)
    dweight_kernels[D % 4 == 0 ? 1 : 0].launch(
        dt, on.device, on.stream, ceil_div(D, 32), Dim3(8, 32), 0, partial->data_ptr(),
        dweight->data_ptr(), static_cast<int>(grid), static_cast<int>(D));
  return {dx, dweight};
}

}  // namespace

KFORGE_BIND_OP(rmsnorm) {
  m.def("rmsnorm_forward", &rmsnorm_forward,
        "RMSNorm over the last `normalized_ndim` dims: returns (y, rstd) with rstd float32 of one "
        "element per row. cast_before_weight: y = weight * T(x * rstd) (Hugging Face Llama), else "
        "y = T(x * rstd * weight) (torch F.rms_norm). weight may be None.",
        pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("normalized_ndim") = 1, pybind11::arg("cast_before_weight") = true);
  m.def("add_rmsnorm_forward", &add_rmsnorm_forward,
        "Residual add fused into rmsnorm_forward: s = x + residual (fp32 add, rounded once to x's "
        "dtype, as eager's add), then RMSNorm of s; returns (y, rstd, s). residual has x's shape, "
        "dtype and device.",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"),
        pybind11::arg("normalized_ndim") = 1, pybind11::arg("cast_before_weight") = true);
  m.def("rmsnorm_backward", &rmsnorm_backward,
        "Backward of rmsnorm_forward from the saved rstd: returns (dx, dweight), dweight None when "
        "weight is None; dweight is reduced in a fixed order (deterministic, the same bits every "
        "run). variant: 0 (default) the shared-memory ring kernel (16-byte accesses, rows of "
        "<= 1024 16-byte chunks; persistent grid of one block per SM) writing one partial dweight "
        "row per block, then a separate reduction kernel; 1 (tests) never the ring: the kernels "
        "that take what the ring does not (a register-pipelined kernel for 16-byte rows of <= 1024 chunks whose stages do not fit in "
        "shared memory, another kernel for odd sizes, misaligned pointers and longer rows; those "
        "inputs take them under every variant). dresidual (x's shape and dtype, or None): the "
        "gradient of x from its other consumers (add_rmsnorm_forward's s), added to dx in fp32 "
        "before dx's one rounding.",
        pybind11::arg("dy"), pybind11::arg("x"), pybind11::arg("weight"), pybind11::arg("rstd"),
        pybind11::arg("normalized_ndim") = 1, pybind11::arg("cast_before_weight") = true,
        pybind11::arg("variant") = static_cast<int64_t>(kDefault),
        pybind11::arg("dresidual") = pybind11::none());
}

}  // namespace kforge
