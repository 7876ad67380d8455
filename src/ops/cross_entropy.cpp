// cross_entropy launchers (see kernels_src/cross_entropy.cu): forward -> (loss, lse, n_valid),
// backward -> dlogits, and the fused forward + gradient for callers that know dloss up front.
// Logits whose rows are ld >= V elements apart (unit column stride) are read in place, and dlogits
// gets the same row stride; other layouts are made contiguous (ld = V).
#include <algorithm>
#include <limits>
#include <tuple>

#include "../runtime/torch_launch.h"
#include "cross_entropy_plan.h"  // the dispatch: grid, block, packs or elements

namespace kforge {
namespace {

Program prog("cross_entropy");
Kernel fwd(prog, "cross_entropy_forward_kernel<{T}, false>");
Kernel fused(prog, "cross_entropy_forward_kernel<{T}, true>");
Kernel fused_smem(prog, "cross_entropy_fused_smem_kernel<{T}>");
// Backward, one block per (row, chunk) item: 16-byte packs with default caching (measured 5-6 %
// faster than evict-first on an H200 at 8192 x 50257) when logits and dlogits share their address
// modulo 16, else element-wise.
Kernel bwd_vec(prog, "cross_entropy_backward_kernel<{T}, true>");
Kernel bwd_scalar(prog, "cross_entropy_backward_kernel<{T}, false>");
Kernel reduce(prog, "cross_entropy_reduce_kernel<{T}>");
Kernel rescale(prog, "cross_entropy_rescale_kernel<{T}>");

enum class Reduction { none, mean, sum };

Reduction parse_reduction(const std::string& r, const char* op) {
  if (r == "mean") return Reduction::mean;
  if (r == "sum") return Reduction::sum;
  if (r == "none") return Reduction::none;
  fail(op, "reduction must be \"mean\", \"sum\" or \"none\", got \"", r, "\"");
}

void* ptr(const at::Tensor& t) { return t.defined() ? t.data_ptr() : nullptr; }

struct Problem {
  at::Tensor logits, targets;
  DType dt;
  long long N, V;
  long long ld;  // elements between the starts of consecutive logits (and dlogits) rows, >= V
};

Problem check_problem(const at::Tensor& logits_, const at::Tensor& targets_, const char* op) {
  Problem p;
  check_input(logits_, op, "logits");
  p.dt = dtype_of(logits_, op);
  KF_CHECK(logits_.dim() == 2, op, "logits must be 2-D (N, V), got shape ", logits_.sizes());
  p.N = logits_.size(0);
  p.V = logits_.size(1);
  // Rows of unit column stride that do not overlap are read where they are: the padded lm_head's
  // logits[:, :V] view of an (N, ld) buffer costs no copy. A single row may have any stride(0) (it
  // is never used) and is taken as contiguous, ld = V.
  const bool unit_cols = p.V == 1 || logits_.stride(1) == 1;
  if (unit_cols && (p.N == 1 || logits_.stride(0) >= p.V)) {
    p.logits = logits_;
    p.ld = p.N == 1 ? p.V : logits_.stride(0);
  } else {
    p.logits = logits_.contiguous();
    p.ld = p.V;
  }
  KF_CHECK(p.N > 0 && p.V > 0, op, "logits must be non-empty, got shape ", p.logits.sizes());
  KF_CHECK(p.N <= std::numeric_limits<int>::max(), op, "at most 2^31 - 1 rows (one block each), got ", p.N);
  // Rows are split at 16-byte boundaries counted in whole elements.
  KF_CHECK(reinterpret_cast<uintptr_t>(p.logits.data_ptr()) % p.logits.element_size() == 0, op,
           "logits data pointer is not aligned to its element size");
  KF_CHECK(targets_.defined() && targets_.is_cuda() && targets_.device() == p.logits.device(), op,
           "targets must be a CUDA tensor on ", p.logits.device());
  KF_CHECK(targets_.scalar_type() == at::kLong, op, "targets must be int64, got ", targets_.scalar_type());
  KF_CHECK(targets_.dim() == 1 && targets_.size(0) == p.N, op, "targets must have shape (", p.N,
           "), got ", targets_.sizes());
  p.targets = targets_.contiguous();
  return p;
}

// The gradient of the loss: N values for "none", one for "mean" / "sum"; `ref`'s dtype (the logits').
at::Tensor check_grad(const at::Tensor& grad_, const at::Tensor& ref, long long N, Reduction red, const char* op) {
  const at::Tensor g = input_like(grad_, ref, op, "grad");
  if (red == Reduction::none)
    KF_CHECK(g.numel() == N, op, "grad must have N = ", N, " elements for reduction \"none\", got shape ",
             g.sizes());
  else
    KF_CHECK(g.numel() == 1, op, "grad must have one element for reduction \"mean\" / \"sum\", got shape ",
             g.sizes());
  return g;
}

at::Tensor check_f32(const at::Tensor& t, const Problem& p, int64_t numel, const char* op, const char* name) {
  KF_CHECK(t.defined() && t.is_cuda() && t.device() == p.logits.device(), op, name,
           " must be a CUDA tensor on ", p.logits.device());
  KF_CHECK(t.scalar_type() == at::kFloat && t.numel() == numel, op, name, " must be float32 with ", numel,
           " elements, got ", t.scalar_type(), " ", t.sizes());
  return t.contiguous();
}

// dlogits with the logits' row stride: the (N, V) view of an (N, ld) buffer whose padding columns
// [V, ld) the kernels set to 0. The padded lm_head's backward multiplies the whole (N, ld) gradient
// by its weight, whose padding rows are zero: finite zeros there keep that GEMM exact (poison or
// stale memory could hold NaN / inf, and 0 * NaN = NaN).
at::Tensor new_dlogits(const Problem& p) {
  return new_output({p.N, p.ld}, p.logits.options()).narrow(1, 0, p.V);
}

// Single-block count of non-ignored targets into n_valid, plus the mean / sum of row_loss into loss
// when both are given.
void launch_reduce(const Problem& p, const LaunchOn& on, const at::Tensor& row_loss, const at::Tensor& loss,
                   const at::Tensor& n_valid, long long ignore_index, Reduction red) {
  reduce.launch(p.dt, on.device, on.stream, Dim3(1), Dim3(1024), 0, ptr(row_loss), ptr(p.targets),
                ptr(loss), ptr(n_valid), p.N, ignore_index, static_cast<int>(red == Reduction::mean));
}

std::vector<int64_t> loss_shape(const Problem& p, Reduction red) {
  return red == Reduction::none ? std::vector<int64_t>{p.N} : std::vector<int64_t>{};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits,
                                                                     const at::Tensor& targets,
                                                                     int64_t ignore_index,
                                                                     const std::string& reduction) {
  const char* op = "cross_entropy_forward";
  const Reduction red = parse_reduction(reduction, op);
  const Problem p = check_problem(logits, targets, op);
  LaunchOn on(p.logits);
  const auto f32 = p.logits.options().dtype(at::kFloat);
  at::Tensor loss = new_output(loss_shape(p, red), p.logits.options());
  at::Tensor lse = new_output({p.N}, f32);
  at::Tensor n_valid = new_output({}, f32);
  at::Tensor row_loss = red == Reduction::none ? at::Tensor() : new_output({p.N}, f32);
  const long long ii = ignore_index;
  void* const null = nullptr;
  const CrossEntropyPlan plan = plan_cross_entropy_forward(p.N, p.V, p.logits.element_size());
  fwd.launch(p.dt, on.device, on.stream, Dim3(static_cast<unsigned>(plan.grid)),
             Dim3(static_cast<unsigned>(plan.block_x)), 0,
             ptr(p.logits), ptr(p.targets), ptr(lse), ptr(row_loss),
             red == Reduction::none ? ptr(loss) : null, null, null, 0LL, null, p.V, p.ld, ii, 0);
  launch_reduce(p, on, row_loss, red == Reduction::none ? at::Tensor() : loss, n_valid, ii, red);
  return {loss, lse, n_valid};
}

at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& logits, const at::Tensor& targets,
                                  const at::Tensor& lse_, const at::Tensor& n_valid_, int64_t ignore_index,
                                  const std::string& reduction) {
  const char* op = "cross_entropy_backward";
  const Reduction red = parse_reduction(reduction, op);
  const Problem p = check_problem(logits, targets, op);
  const at::Tensor g = check_grad(grad, p.logits, p.N, red, op);
  const at::Tensor lse = check_f32(lse_, p, p.N, op, "lse");
  const at::Tensor n_valid = check_f32(n_valid_, p, 1, op, "n_valid");
  LaunchOn on(p.logits);
  at::Tensor dlogits = new_dlogits(p);
  // 16-byte packs need logits and dlogits rows to sit at the same offset from a 16-byte boundary
  // (same base phase; both have row stride ld).
  const bool vec = (reinterpret_cast<uintptr_t>(ptr(p.logits)) & 15) == (reinterpret_cast<uintptr_t>(ptr(dlogits)) & 15);
  const CrossEntropyPlan plan = plan_cross_entropy_backward(p.N, p.V, p.logits.element_size(), vec);
  KF_CHECK(plan.error.empty(), op, plan.error);
  const long long grad_stride = red == Reduction::none ? 1LL : 0LL;
  void* const nv = red == Reduction::mean ? ptr(n_valid) : nullptr;
  const long long ii = ignore_index;
  (plan.vec ? bwd_vec : bwd_scalar)
      .launch(p.dt, on.device, on.stream, Dim3(static_cast<unsigned>(plan.grid)),
              Dim3(static_cast<unsigned>(plan.block_x)), 0, ptr(g), grad_stride, nv, ptr(p.logits),
              ptr(p.targets), ptr(lse), ptr(dlogits), p.V, p.ld, ii, static_cast<int>(plan.chunks),
              static_cast<int>(plan.chunk_packs));
  return dlogits;
}

// Forward and gradient in one launch (the register or shared-memory kernel, by the plan): loss, lse,
// n_valid and dlogits for the loss gradient g, or for dloss = 1 when g is undefined.
struct FusedOut {
  at::Tensor loss, lse, n_valid, dlogits;
};
FusedOut launch_fused(const Problem& p, const at::Tensor& g, long long ignore_index, Reduction red) {
  LaunchOn on(p.logits);
  const auto f32 = p.logits.options().dtype(at::kFloat);
  FusedOut o;
  o.loss = new_output(loss_shape(p, red), p.logits.options());
  o.dlogits = new_dlogits(p);
  o.lse = new_output({p.N}, f32);
  o.n_valid = new_output({}, f32);
  at::Tensor row_loss = red == Reduction::none ? at::Tensor() : new_output({p.N}, f32);
  const long long ii = ignore_index;
  void* const null = nullptr;
  // The mean's 1/n_valid is needed by every row's gradient: count first.
  if (red == Reduction::mean) launch_reduce(p, on, at::Tensor(), at::Tensor(), o.n_valid, ii, red);
  const bool same_phase =
      (reinterpret_cast<uintptr_t>(ptr(p.logits)) & 15) == (reinterpret_cast<uintptr_t>(ptr(o.dlogits)) & 15);
  const CrossEntropyPlan plan =
      plan_cross_entropy_forward(p.N, p.V, p.logits.element_size(), same_phase, true);
  const Dim3 grid(static_cast<unsigned>(plan.grid)), block(static_cast<unsigned>(plan.block_x));
  void* const loss_none = red == Reduction::none ? ptr(o.loss) : null;
  void* const nv = red == Reduction::mean ? ptr(o.n_valid) : null;
  const long long grad_stride = red == Reduction::none ? 1LL : 0LL;
  if (plan.layout_id == CrossEntropyLayout::smem)
    fused_smem.launch(p.dt, on.device, on.stream, grid, block, static_cast<size_t>(plan.smem), ptr(p.logits),
                      ptr(p.targets), ptr(o.lse), ptr(row_loss), loss_none, ptr(o.dlogits), ptr(g), grad_stride,
                      nv, p.V, p.ld, ii);
  else
    fused.launch(p.dt, on.device, on.stream, grid, block, 0, ptr(p.logits), ptr(p.targets), ptr(o.lse),
                 ptr(row_loss), loss_none, ptr(o.dlogits), ptr(g), grad_stride, nv, p.V, p.ld, ii,
                 static_cast<int>(plan.vec));
  if (red != Reduction::none) launch_reduce(p, on, row_loss, o.loss, o.n_valid, ii, red);
  return o;
}

std::tuple<at::Tensor, at::Tensor> cross_entropy_forward_backward(const at::Tensor& logits,
                                                                  const at::Tensor& targets,
                                                                  const at::Tensor& grad, int64_t ignore_index,
                                                                  const std::string& reduction) {
  const char* op = "cross_entropy_forward_backward";
  const Reduction red = parse_reduction(reduction, op);
  const Problem p = check_problem(logits, targets, op);
  const at::Tensor g = check_grad(grad, p.logits, p.N, red, op);
  FusedOut o = launch_fused(p, g, ignore_index, red);
  return {o.loss, o.dlogits};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> cross_entropy_forward_unit_grad(
    const at::Tensor& logits, const at::Tensor& targets, int64_t ignore_index, const std::string& reduction) {
  const char* op = "cross_entropy_forward_unit_grad";
  const Reduction red = parse_reduction(reduction, op);
  const Problem p = check_problem(logits, targets, op);
  FusedOut o = launch_fused(p, at::Tensor(), ignore_index, red);
  // The fused kernels count n_valid only where the mean needs it; "none" returns it too, as
  // cross_entropy_forward does.
  if (red == Reduction::none)
    launch_reduce(p, LaunchOn(p.logits), at::Tensor(), at::Tensor(), o.n_valid, ignore_index, red);
  return {o.loss, o.lse, o.n_valid, o.dlogits};
}

// dlogits (the unit gradient above) scaled in place by the loss gradient; returns dlogits.
at::Tensor cross_entropy_rescale(const at::Tensor& dlogits, const at::Tensor& grad, const std::string& reduction) {
  const char* op = "cross_entropy_rescale";
  const Reduction red = parse_reduction(reduction, op);
  check_input(dlogits, op, "dlogits");
  const DType dt = dtype_of(dlogits, op);
  KF_CHECK(dlogits.dim() == 2, op, "dlogits must be 2-D (N, V), got shape ", dlogits.sizes());
  const long long N = dlogits.size(0), V = dlogits.size(1);
  // In place: the unit gradient's own layout, rows ld >= V elements apart with unit column stride.
  KF_CHECK(V == 1 || dlogits.stride(1) == 1, op, "dlogits must have unit column stride, got strides ",
           dlogits.strides());
  const long long ld = N == 1 ? V : dlogits.stride(0);
  KF_CHECK(ld >= V, op, "dlogits rows must not overlap, got strides ", dlogits.strides());
  KF_CHECK(reinterpret_cast<uintptr_t>(dlogits.data_ptr()) % dlogits.element_size() == 0, op,
           "dlogits data pointer is not aligned to its element size");
  const at::Tensor g = check_grad(grad, dlogits, N, red, op);
  if (N == 0 || V == 0) return dlogits;
  LaunchOn on(dlogits);
  const long long grid = std::min<long long>(N, static_cast<long long>(sm_count(on.device)) * 4);
  rescale.launch(dt, on.device, on.stream, Dim3(static_cast<unsigned>(grid)), Dim3(256), 0, ptr(dlogits), ptr(g),
                 red == Reduction::none ? 1LL : 0LL, N, V, ld);
  return dlogits;
}

}  // namespace

KFORGE_BIND_OP(cross_entropy) {
  namespace py = pybind11;
  m.def("cross_entropy_forward", &cross_entropy_forward,
        "Cross entropy of logits (N, V) and int64 targets (N,). Returns (loss, lse, n_valid): loss in the "
        "logits dtype, shape () for mean/sum or (N,) for none; lse = per-row logsumexp (N,) float32; "
        "n_valid = count of targets != ignore_index, () float32. Out-of-range targets give NaN losses. "
        "Logits with unit column stride and row stride >= V are read in place (no copy).",
        py::arg("logits"), py::arg("targets"), py::arg("ignore_index") = -100, py::arg("reduction") = "mean");
  m.def("cross_entropy_backward", &cross_entropy_backward,
        "dlogits = (softmax(logits) - onehot(targets)) * dloss from the forward's lse and n_valid; grad is "
        "the loss gradient ((N,) for none, one element otherwise). Ignored rows get 0, out-of-range rows NaN. "
        "dlogits has the logits' row stride ld (read-in-place logits) and is the [:, :V] view of an (N, ld) "
        "buffer whose padding columns are 0.",
        py::arg("grad"), py::arg("logits"), py::arg("targets"), py::arg("lse"), py::arg("n_valid"),
        py::arg("ignore_index") = -100, py::arg("reduction") = "mean");
  m.def("cross_entropy_forward_backward", &cross_entropy_forward_backward,
        "Fused forward + backward for a loss gradient known up front: returns (loss, dlogits), reading the "
        "logits once from DRAM (its second read of each row is meant to hit L2). dlogits is laid out as in "
        "cross_entropy_backward.",
        py::arg("logits"), py::arg("targets"), py::arg("grad"), py::arg("ignore_index") = -100,
        py::arg("reduction") = "mean");
  m.def("cross_entropy_forward_unit_grad", &cross_entropy_forward_unit_grad,
        "Forward and the gradient for dloss = 1 in one launch: returns (loss, lse, n_valid, dlogits), laid "
        "out as cross_entropy_forward's and cross_entropy_backward's. cross_entropy_rescale scales dlogits "
        "by the real loss gradient later.",
        py::arg("logits"), py::arg("targets"), py::arg("ignore_index") = -100, py::arg("reduction") = "mean");
  m.def("cross_entropy_rescale", &cross_entropy_rescale,
        "Scales a unit gradient from cross_entropy_forward_unit_grad in place by the loss gradient grad ((N,) "
        "for none, one element otherwise; the dlogits dtype) and returns it. Rows whose grad is 1 are left "
        "alone (a scalar grad of 1: no pass over dlogits); zeros stay zeros.",
        py::arg("dlogits"), py::arg("grad"), py::arg("reduction") = "mean");
}

}  // namespace kforge
