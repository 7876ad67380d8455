// plans.cpp: kforge._C.plan(op, shape, dtype, ...) -> the launch the op's launcher would make, from
// the same plan_<op> functions the launchers call (src/ops/<op>_plan.h). The device is described by
// its SM count and opt-in shared memory per block (defaults: an H100 SXM), so no GPU is needed.
#include <functional>
#include <limits>
#include <map>

#include "../runtime/torch_launch.h"
#include "colsum_plan.h"
#include "cross_entropy_plan.h"
#include "embedding_plan.h"
#include "gelu_plan.h"
#include "layernorm_plan.h"
#include "permute_plan.h"
#include "rmsnorm_plan.h"
#include "rope_plan.h"
#include "softmax_plan.h"

namespace kforge {
namespace {
namespace py = pybind11;

struct Query {
  std::vector<int64_t> shape;
  int64_t elem_size;
  bool f32;
  bool aligned;  // every tensor 16-byte aligned (false: one is off by an element, the others not)
  int64_t sms, smem_optin;
  py::dict options;
  template <typename T>
  T opt(const char* name, T fallback) const {
    return options.contains(name) ? options[name].cast<T>() : fallback;
  }
};

// "float32" / "torch.bfloat16" / ... -> element size.
int64_t elem_size_of(const std::string& dtype_) {
  std::string d = dtype_.rfind("torch.", 0) == 0 ? dtype_.substr(6) : dtype_;
  if (d == "float32" || d == "float") return 4;
  if (d == "bfloat16" || d == "float16" || d == "half") return 2;
  throw py::value_error("kforge.plan: dtype must be float32, bfloat16 or float16, got " + dtype_);
}

// A 16-bit dtype's code in the kernels' template arguments (CopyOf<N>): 1 bfloat16, 2 float16.
int code16(const std::string& dtype) { return dtype.find("bfloat16") != std::string::npos ? 1 : 2; }

int64_t prod(const std::vector<int64_t>& s, size_t from = 0) {
  int64_t n = 1;
  for (size_t i = from; i < s.size(); ++i) n *= s[i];
  return n;
}

int64_t last(const Query& q) {
  if (q.shape.empty()) throw py::value_error("kforge.plan: shape must have at least one dimension");
  return q.shape.back();
}

py::dict base(const Plan& p, const std::string& kernel) {
  py::dict d;
  d["layout"] = std::string(p.layout);
  d["kernel"] = kernel;
  d["grid"] = py::make_tuple(p.grid, p.grid_y, 1);
  d["block"] = py::make_tuple(p.block_x, p.block_y, 1);
  d["smem"] = p.smem;
  if (!p.error.empty()) throw py::value_error(p.error);
  return d;
}

// The launchers' own input checks, as ValueError (src/ops/<op>.cpp).
void require(bool ok, const std::string& op, const std::string& why) {
  if (!ok) throw py::value_error("kforge.plan: " + op + ": " + why);
}

py::dict layernorm(const Query& q, bool forward) {
  const int64_t C = last(q), N = prod(q.shape) / C;
  require(C <= ln_plan::kMaxC, "layernorm", "last dim must be in [1, 2^30]");
  const int64_t mw = q.opt<int64_t>("max_warps", 0), v = q.opt<int64_t>("variant", 0);
  const LayernormPlan p =
      forward ? plan_layernorm_forward(N, C, q.elem_size, q.aligned, q.sms, mw, v)
              : plan_layernorm_backward(N, C, q.elem_size, q.aligned,
                                        q.opt<bool>("weight", true) || q.opt<bool>("bias", true),
                                        q.sms, q.smem_optin, mw, v);
  // y_dtype (forward): a 16-bit out of a float32 x, stored by the GROUP kernel itself; other layouts
  // run the float32 kernel and convert (src/ops/layernorm.cpp)
  std::string kernel = layernorm_kernel_name(p, forward);
  if (forward && q.options.contains("y_dtype") && !q.options["y_dtype"].is_none()) {
    const std::string t = py::str(q.options["y_dtype"]);
    if (elem_size_of(t) != q.elem_size) {  // (a 16-bit y of a 16-bit x counts as x's own type here)
      require(q.f32 && elem_size_of(t) == 2, "layernorm_forward", "only float32 x may store a bfloat16 / float16 y");
      if (p.layout_id == LayernormLayout::group)
        kernel.insert(kernel.size() - 1, code16(t) == 1 ? ", bf16" : ", half");
    }
  }
  // dresidual / copy_dtype (backward, float32): the 16-byte GROUP kernel adds dres and stores the
  // 16-bit copy itself; other layouts run the plain kernel and torch's add / conversion
  if (!forward) {
    const bool res = q.opt<bool>("dresidual", false);
    int nz = 0;
    if (q.options.contains("copy_dtype") && !q.options["copy_dtype"].is_none()) {
      const std::string t = py::str(q.options["copy_dtype"]);
      require(q.f32 && elem_size_of(t) == 2, "layernorm_backward", "only a float32 dx has a bfloat16 / float16 copy");
      nz = code16(t);
    }
    require(!res || q.f32, "layernorm_backward", "dresidual is taken with a float32 x only");
    if ((res || nz) && p.layout_id == LayernormLayout::group && p.vec)
      kernel = "layernorm_backward_group_kernel<{T}, true, " + std::string(res ? "true" : "false") + ", " +
               std::to_string(nz) + ">";
  }
  py::dict d = base(p, kernel);
  d["vec"] = p.vec;
  return d;
}

int64_t rms_row(const Query& q) {
  const int64_t nd = q.opt<int64_t>("normalized_ndim", 1);
  if (nd < 1 || nd > int64_t(q.shape.size())) throw py::value_error("kforge.plan: bad normalized_ndim");
  const int64_t D = prod(q.shape, q.shape.size() - nd);
  if (D < 1 || D > rms_plan::kMaxChunks * (16 / q.elem_size))
    throw py::value_error("kforge.plan: rmsnorm rows of " + std::to_string(D) + " elements");
  return D;
}

py::dict rmsnorm_fwd(const Query& q, bool res) {
  const int64_t D = rms_row(q), V = 16 / q.elem_size;
  const RmsnormPlan p = plan_rmsnorm_forward(prod(q.shape) / D, static_cast<int>((D + V - 1) / V),
                                             q.aligned && D % V == 0, res);
  // dtype is the stream's (s, residual) type. y_dtype: a 16-bit y of fp32 dtype; x_dtype
  // (add_rmsnorm_forward): a 16-bit x added to the fp32 residual, y then float32 or x's type.
  const auto opt16 = [&](const char* name) -> std::string {
    if (!q.options.contains(name) || q.options[name].is_none()) return "";
    const std::string t = py::str(q.options[name]);
    if (elem_size_of(t) == q.elem_size) return "";
    return code16(t) == 1 ? "bf16" : "half";
  };
  const char* op = res ? "add_rmsnorm_forward" : "rmsnorm_forward";
  const std::string narrow = opt16("y_dtype"), narrow_x = res ? opt16("x_dtype") : "";
  require(narrow.empty() || (q.f32 && (!res || narrow == narrow_x)), op,
          "only float32 x may store a bfloat16 / float16 y (with a residual: float32 residual, y of x's type)");
  require(narrow_x.empty() || q.f32, op, "a 16-bit x takes a float32 residual");
  py::dict d = base(p, rmsnorm_kernel_name(p, true, narrow, narrow_x));
  d["vec"] = p.vec;
  return d;
}

py::dict rmsnorm_bwd(const Query& q) {
  const int64_t D = rms_row(q), V = 16 / q.elem_size;
  const RmsnormPlan p = plan_rmsnorm_backward(
      prod(q.shape) / D, D, q.elem_size, q.f32, q.aligned && D % V == 0,
      q.opt<bool>("cast_before_weight", true), q.opt<bool>("dresidual", false), q.sms,
      q.smem_optin, q.opt<int64_t>("variant", 0));
  // copy_dtype: a bfloat16 / float16 copy of a float32 dx (rmsnorm_backward_copy).
  int copy = 0;
  if (q.options.contains("copy_dtype") && !q.options["copy_dtype"].is_none()) {
    const std::string t = py::str(q.options["copy_dtype"]);
    require(q.f32 && elem_size_of(t) == 2, "rmsnorm_backward", "only a float32 dx has a bfloat16 / float16 copy");
    copy = code16(t);
  }
  // dy_terms (2 or 3) of dy_dtype (bfloat16 default / float16): rmsnorm_backward_sum's ring kernel;
  // "dy_sum": "torch" where the launcher sums the terms with torch before the plan's kernel.
  const int terms = static_cast<int>(q.opt<int64_t>("dy_terms", 0));
  int dy_type = 1;
  if (terms) {
    require(q.f32 && (terms == 2 || terms == 3), "rmsnorm_backward_sum", "2 or 3 dy terms of a float32 x");
    if (q.options.contains("dy_dtype") && !q.options["dy_dtype"].is_none()) {
      const std::string t = py::str(q.options["dy_dtype"]);
      require(elem_size_of(t) == 2, "rmsnorm_backward_sum", "dy terms are bfloat16 / float16");
      dy_type = code16(t);
    }
  }
  const RmsnormPlan pt = terms ? plan_rmsnorm_backward(prod(q.shape) / D, D, q.elem_size, q.f32, q.aligned && D % V == 0,
                                                       q.opt<bool>("cast_before_weight", true),
                                                       q.opt<bool>("dresidual", false), q.sms, q.smem_optin,
                                                       q.opt<int64_t>("variant", 0), terms)
                               : p;
  const bool summed = terms && pt.layout_id == RmsnormLayout::ring && (copy == 0 || copy == dy_type);
  py::dict d = base(summed ? pt : p, rmsnorm_kernel_name(summed ? pt : p, false, "", "", copy, summed ? terms : 0,
                                                         dy_type));
  d["vec"] = p.vec;
  if (terms && !summed) d["dy_sum"] = "torch";
  return d;
}

py::dict softmax(const Query& q, bool forward, bool causal) {
  const int64_t C = last(q), rows = prod(q.shape) / C;
  constexpr int64_t kInt = std::numeric_limits<int>::max();
  require(C <= kInt && rows < kInt, "softmax", "rows and row length must fit an int");
  require(!causal || (q.shape.size() >= 2 && q.shape[q.shape.size() - 2] == C), "causal_softmax",
          "expected scores of shape (..., T, T)");
  const SoftmaxPlan p = plan_softmax(rows, C, q.elem_size, q.f32, forward, causal, q.aligned,
                                     q.aligned, q.sms);
  return base(p, softmax_kernel_name(p, forward));
}

py::dict cross_entropy(const Query& q, const std::string& which) {
  if (q.shape.size() != 2) throw py::value_error("kforge.plan: cross_entropy logits are (N, V)");
  const long long N = q.shape[0], V = q.shape[1];
  require(N <= std::numeric_limits<int>::max(), "cross_entropy", "at most 2^31 - 1 rows");
  const CrossEntropyPlan p =
      which == "backward" ? plan_cross_entropy_backward(N, V, q.elem_size, q.aligned)
                          : plan_cross_entropy_forward(N, V, q.elem_size, q.aligned, which == "forward_backward");
  py::dict d = base(p, cross_entropy_kernel_name(p, which));
  d["vec"] = p.vec;
  if (which == "backward") d["chunks"] = p.chunks, d["chunk_packs"] = p.chunk_packs;
  return d;
}

py::dict gelu(const Query& q, bool forward) {
  const GeluPlan p = plan_gelu(prod(q.shape), q.elem_size, q.aligned, q.sms);
  const std::string approximate = q.opt<std::string>("approximate", "tanh");
  if (approximate != "tanh" && approximate != "none")
    throw py::value_error("kforge.plan: gelu approximate must be \"tanh\" or \"none\"");
  return base(p, gelu_kernel_name(p, forward, approximate == "none"));
}

// q of shape (B, Hq, T, D); k has kv_heads heads (default Hq); tables of q's dtype unless
// f32_tables; interleaved pairs or rotate_half.
py::dict rope(const Query& q) {
  require(q.shape.size() == 4, "rope", "q must be (B, H, T, D)");
  const int64_t B = q.shape[0], Hq = q.shape[1], T = q.shape[2], D = q.shape[3];
  require(D % 2 == 0, "rope", "head dim D must be even");
  const bool interleaved = q.opt<bool>("interleaved", false);
  const int64_t V = 16 / q.elem_size;
  const bool vec = q.aligned && (interleaved ? D : D / 2) % V == 0;
  const RopePlan p = plan_rope(B, T, Hq, q.opt<int64_t>("kv_heads", Hq), D, q.elem_size,
                               interleaved, vec, vec, !q.f32 && q.opt<bool>("f32_tables", false));
  return base(p, rope_kernel_name(p));
}

// x viewed as (N, C): two launches, the partial sums (grid, block) then their fold (final_*).
py::dict colsum(const Query& q) {
  const int64_t C = last(q);
  require(C <= std::numeric_limits<int>::max() / 2, "colsum", "last dim C too large");
  const ColsumPlan p = plan_colsum(prod(q.shape) / C, C, q.elem_size, q.aligned, q.sms);
  py::dict d = base(p, colsum_kernel_name(p, false));
  d["vec"] = p.layout_id == ColsumLayout::vec;
  d["chunks"] = p.chunks, d["rows_per_chunk"] = p.rows_per_chunk;
  d["final_kernel"] = colsum_kernel_name(p, true);
  d["final_grid"] = py::make_tuple(p.final_grid, 1, 1);
  d["final_block"] = py::make_tuple(p.block_x, p.block_y, 1);
  return d;
}

// grad (..., C) of the tokens, num_weights rows of dW (required), int32_indices: the kernel for them.
py::dict embedding(const Query& q) {
  const int64_t C = last(q), N = prod(q.shape) / C;
  require(q.options.contains("num_weights"), "embedding_backward", "num_weights must be given");
  const int64_t V = q.opt<int64_t>("num_weights", 0);
  require(V >= 1, "embedding_backward", "num_weights must be >= 1 (nothing is launched for 0)");
  require(N <= std::numeric_limits<int>::max(), "embedding_backward", "at most 2^31 - 1 tokens");
  require(C <= kEmbeddingMaxC, "embedding_backward", "last dim C too large");
  const EmbeddingPlan p = plan_embedding_backward(N, C, V, q.elem_size, q.aligned, q.sms);
  py::dict d = base(p, embedding_kernel_name(p, q.opt<bool>("int32_indices", false)));
  d["vec"] = p.layout_id == EmbeddingLayout::vec;
  d["rows"] = p.rows, d["items"] = p.items, d["block_items"] = p.block_items;
  return d;
}

// The head copies, from the input their launcher takes: token-major qkv (B, T, 3C) / dout (B, T, C)
// with n_head when to_heads, else head-major dq (B, NH, T, HS) / y. The head-side tensors are
// contiguous unless head_strides gives their (batch, head, token) element strides (inputs only:
// outputs are new contiguous tensors).
py::dict permute(const Query& q, const std::string& op, bool to_heads, int64_t parts) {
  int64_t B, T, NH, HS;
  if (to_heads) {
    require(q.shape.size() == 3, op, parts == 3 ? "qkv must be (B, T, 3C)" : "dout must be (B, T, C)");
    NH = q.opt<int64_t>("n_head", 0);
    require(NH > 0, op, "n_head must be given and positive");
    require(q.shape[2] % (parts * NH) == 0, op,
            parts == 3 ? "last dim is not 3 * n_head * head_size" : "last dim is not a multiple of n_head");
    B = q.shape[0], T = q.shape[1], HS = q.shape[2] / (parts * NH);
  } else {
    require(q.shape.size() == 4, op, std::string(parts == 3 ? "dq" : "y") + " must be (B, NH, T, HS)");
    B = q.shape[0], NH = q.shape[1], T = q.shape[2], HS = q.shape[3];
  }
  constexpr int64_t kInt = std::numeric_limits<int>::max();
  require(B * T <= kInt && parts * NH * HS <= kInt, op, "sizes too large");
  int64_t sb = NH * T * HS, sh = T * HS, st = HS;
  if (q.options.contains("head_strides")) {
    require(!to_heads, op, "head_strides: its heads are new contiguous outputs");
    const auto s = q.options["head_strides"].cast<std::vector<int64_t>>();
    require(s.size() == 3, op, "head_strides is (batch, head, token)");
    sb = s[0], sh = s[1], st = s[2];
  }
  const PermutePlan p =
      plan_permute(to_heads, parts, B, T, NH, HS, sb, sh, st, q.elem_size, q.aligned, q.sms);
  py::dict d = base(p, permute_kernel_name(p));
  d["vec"] = p.vec;
  d["cols"] = p.cols;
  if (p.layout_id == PermuteLayout::lanes)
    d["K"] = p.K, d["lanes"] = p.lanes;
  else
    d["tiles_per_seq"] = p.tiles_per_seq, d["units"] = p.units;
  return d;
}

template <size_t N>
std::vector<std::string> names(const char* const (&a)[N]) {
  return std::vector<std::string>(a, a + N);
}

struct Entry {
  std::vector<std::string> layouts;
  std::function<py::dict(const Query&)> plan;
};

const std::map<std::string, Entry>& table() {
  static const std::map<std::string, Entry> t = {
      {"layernorm_forward", {names(kLayernormForwardLayouts), [](const Query& q) { return layernorm(q, true); }}},
      {"layernorm_backward", {names(kLayernormBackwardLayouts), [](const Query& q) { return layernorm(q, false); }}},
      {"rmsnorm_forward", {names(kRmsnormForwardLayouts), [](const Query& q) { return rmsnorm_fwd(q, false); }}},
      {"add_rmsnorm_forward", {names(kRmsnormForwardLayouts), [](const Query& q) { return rmsnorm_fwd(q, true); }}},
      {"rmsnorm_backward", {names(kRmsnormBackwardLayouts), rmsnorm_bwd}},
      {"softmax_forward", {names(kSoftmaxForwardLayouts), [](const Query& q) { return softmax(q, true, false); }}},
      {"softmax_backward", {names(kSoftmaxBackwardLayouts), [](const Query& q) { return softmax(q, false, false); }}},
      // the persistent-warps forward takes plain softmax only
      {"causal_softmax_forward", {{"warp", "block", "stream"}, [](const Query& q) { return softmax(q, true, true); }}},
      {"causal_softmax_backward", {names(kSoftmaxBackwardLayouts), [](const Query& q) { return softmax(q, false, true); }}},
      {"rope_forward", {names(kRopeLayouts), rope}},
      {"rope_backward", {names(kRopeLayouts), rope}},
      {"gelu_forward", {names(kGeluLayouts), [](const Query& q) { return gelu(q, true); }}},
      {"gelu_backward", {names(kGeluLayouts), [](const Query& q) { return gelu(q, false); }}},
      {"colsum_forward", {names(kColsumLayouts), colsum}},
      {"embedding_backward", {names(kEmbeddingLayouts), embedding}},
      {"split_qkv_forward", {names(kPermuteLayouts), [](const Query& q) { return permute(q, "split_qkv_forward", true, 3); }}},
      {"split_qkv_backward", {names(kPermuteLayouts), [](const Query& q) { return permute(q, "split_qkv_backward", false, 3); }}},
      {"merge_heads_forward", {names(kPermuteLayouts), [](const Query& q) { return permute(q, "merge_heads_forward", false, 1); }}},
      {"merge_heads_backward", {names(kPermuteLayouts), [](const Query& q) { return permute(q, "merge_heads_backward", true, 1); }}},
      {"cross_entropy_forward", {names(kCrossEntropyForwardLayouts), [](const Query& q) { return cross_entropy(q, "forward"); }}},
      {"cross_entropy_forward_backward", {names(kCrossEntropyForwardBackwardLayouts), [](const Query& q) { return cross_entropy(q, "forward_backward"); }}},
      {"cross_entropy_backward", {names(kCrossEntropyBackwardLayouts), [](const Query& q) { return cross_entropy(q, "backward"); }}},
  };
  return t;
}

const Entry& entry(const std::string& op) {
  const auto it = table().find(op);
  if (it == table().end()) throw py::value_error("kforge.plan: no plan for \"" + op + "\"");
  return it->second;
}

}  // namespace

KFORGE_BIND_OP(plans) {
  m.def(
      "plan",
      [](const std::string& op, const std::vector<int64_t>& shape, const py::object& dtype,
         bool aligned, int64_t sms, int64_t smem_optin, const py::kwargs& options) {
        const Entry& e = entry(op);
        const std::string dt = py::str(dtype);
        Query q{shape, elem_size_of(dt), elem_size_of(dt) == 4, aligned, sms, smem_optin, options};
        for (const int64_t s : shape)
          if (s < 0) throw py::value_error("kforge.plan: negative size in shape");
        if (prod(shape) == 0) {  // the launchers launch nothing for empty inputs
          py::dict d;
          d["layout"] = py::none();
          return d;
        }
        return e.plan(q);
      },
      py::arg("op"), py::arg("shape"), py::arg("dtype"), py::arg("aligned") = true,
      py::arg("sms") = 132, py::arg("smem_optin") = 232448,
      "The launch op's launcher makes for a contiguous input of `shape` and `dtype` (float32, "
      "bfloat16, float16; a torch.dtype or its name): a dict of layout, kernel (its name "
      "expression, {T} the element type), grid, block, smem (dynamic shared memory, bytes) and "
      "op-specific template arguments. aligned: every tensor 16-byte aligned (False: one is off by "
      "an element). sms / smem_optin: the device's SM count and opt-in shared memory per block "
      "(defaults: H100 SXM). Options by op: layernorm max_warps, variant, weight, bias (backward: "
      "whether their gradients are wanted), y_dtype (forward: a 16-bit out of float32 dtype), dresidual, "
      "copy_dtype (backward: dx plus the residual's gradient, a 16-bit copy of a float32 dx); rmsnorm normalized_ndim, cast_before_weight, "
      "dresidual, variant, copy_dtype (rmsnorm_backward: a 16-bit copy of a float32 dx), dy_terms and dy_dtype "
      "(rmsnorm_backward: dy as 2 or 3 bfloat16 / float16 terms, rmsnorm_backward_sum), "
      "y_dtype (a 16-bit y of float32 dtype), x_dtype (add_rmsnorm_forward: a "
      "16-bit x added to the float32 residual of dtype); gelu approximate; rope kv_heads, interleaved, f32_tables (q's shape "
      "(B, H, T, D)); split_qkv_forward / merge_heads_backward n_head, split_qkv_backward / "
      "merge_heads_forward head_strides (their head-major input's (batch, head, token) strides; "
      "default contiguous). colsum launches twice: grid / block, then final_kernel on final_grid / "
      "final_block. embedding_backward: shape is grad's, num_weights (required), int32_indices. layout is None where nothing is launched (empty input).");
  m.def(
      "plan_layouts", [](const std::string& op) { return entry(op).layouts; }, py::arg("op"),
      "Every layout `op`'s plan can choose.");
  m.def(
      "_set_testing_override",
      [](const std::string& op, int64_t variant, int64_t max_warps) {
        const auto& all = TestingOverride::testing_overrides();
        const auto it = all.find(op);
        if (it == all.end()) throw py::value_error("kforge: \"" + op + "\" has no testing override");
        TestingOverride& o = *it->second;
        KF_CHECK(variant >= 0 && variant < o.num_variants, o.op, "variant must be in [0, ",
                 o.num_variants - 1, "], got ", variant);
        KF_CHECK(max_warps >= 0, o.op, "max_warps must be >= 0, got ", max_warps);
        KF_CHECK(max_warps == 0 || o.has_max_warps, o.op, "takes no max_warps");
        o.variant.store(variant, std::memory_order_relaxed);
        o.max_warps.store(max_warps, std::memory_order_relaxed);
      },
      py::arg("op"), py::arg("variant") = 0, py::arg("max_warps") = 0,
      "Tests / A/B timing only (use kforge._testing.override): force `op`'s launcher to `variant` "
      "and cap its resident warps per SM at `max_warps` (0, 0: its own choice) until reset.");
  m.def(
      "_testing_override",
      [](const std::string& op) {
        const auto& all = TestingOverride::testing_overrides();
        const auto it = all.find(op);
        if (it == all.end()) throw py::value_error("kforge: \"" + op + "\" has no testing override");
        return py::make_tuple(it->second->get_variant(), it->second->get_max_warps());
      },
      py::arg("op"), "(variant, max_warps) now in force for `op` (0, 0: none).");
  m.def("_testing_override_ops", [] {
    std::vector<std::string> ops;
    for (const auto& [name, o] : TestingOverride::testing_overrides()) ops.push_back(name);
    return ops;
  });
  m.def("plan_ops", [] {
    std::vector<std::string> ops;
    for (const auto& [name, e] : table()) ops.push_back(name);
    return ops;
  });
}

}  // namespace kforge
