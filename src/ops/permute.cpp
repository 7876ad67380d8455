// permute launchers: split_qkv (B, T, 3C) -> q, k, v (B, NH, T, HS) and merge_heads
// (B, NH, T, HS) -> (B, T, C), forward and backward (see kernels_src/permute.cu). Every copy runs
// the persistent token lanes (permute_lanes_kernel), or the 64-bit tiles where the lanes' 32-bit
// byte strides do not fit (a head part or token row past 4 GiB).
#include <optional>

#include "../runtime/torch_launch.h"
#include "permute_plan.h"  // the dispatch: token lanes or tiles, grid, block

namespace kforge {
namespace {

Program prog("permute");
// By VEC: 16-byte columns (HS and the strides a multiple of the pack, pointers aligned) or one
// element. The tiles (64-bit offsets):
Kernel to_heads_vec(prog, "permute_tokens_to_heads_kernel<{T}, true>");
Kernel to_heads_elem(prog, "permute_tokens_to_heads_kernel<{T}, false>");
Kernel to_tokens_vec(prog, "permute_heads_to_tokens_kernel<{T}, true>");
Kernel to_tokens_elem(prog, "permute_heads_to_tokens_kernel<{T}, false>");
// The token lanes: permute_lanes_kernel<T, VEC, TO_HEADS, K>, K = 1, 2, 4 tokens per round.
#define KF_PERMUTE_LANES(VEC, DIR)                                                   \
  Kernel(prog, "permute_lanes_kernel<{T}, " #VEC ", " #DIR ", 1>"),                  \
      Kernel(prog, "permute_lanes_kernel<{T}, " #VEC ", " #DIR ", 2>"),              \
      Kernel(prog, "permute_lanes_kernel<{T}, " #VEC ", " #DIR ", 4>")
Kernel lanes_kernels[12] = {KF_PERMUTE_LANES(false, false), KF_PERMUTE_LANES(false, true),
                            KF_PERMUTE_LANES(true, false), KF_PERMUTE_LANES(true, true)};
#undef KF_PERMUTE_LANES
// Variant 1 runs the tiles, which the plan keeps for rows or head parts past 4 GiB, at any size:
// tests and the sanitizer runs reach them with small shapes.
TestingOverride permute_override("permute", 2, /*has_max_warps=*/false);

Kernel& lanes_kernel(bool vec, bool to_heads, int k_index) {
  return lanes_kernels[(vec ? 6 : 0) + (to_heads ? 3 : 0) + k_index];
}

// permute_div magic numbers of d (1 <= d < 2^31): s = ceil(log2 d), m = ceil(2^(31 + s) / d).
struct Magic {
  uint32_t m;
  int s;
};
Magic magic(int64_t d) {
  int s = 0;
  while ((int64_t(1) << s) < d) ++s;
  const uint64_t m = ((uint64_t(1) << (31 + s)) + uint64_t(d) - 1) / uint64_t(d);
  return {static_cast<uint32_t>(m), s};
}

// Copies between token-major `tokens` (B, T, parts * NH * HS) and head-major `heads` (parts tensors
// of shape (B, NH, T, HS)): tokens -> heads when `split`, else heads -> tokens; the token lanes or
// the tiles as plan_permute says.
void launch(bool split, const at::Tensor& tokens, const std::vector<at::Tensor>& heads, int64_t B,
            int64_t T, int64_t NH, int64_t HS, const char* op) {
  const int parts = static_cast<int>(heads.size());
  const int64_t row = parts * NH * HS;
  KF_CHECK(B * T <= std::numeric_limits<int>::max() && row <= std::numeric_limits<int>::max(), op,
           "sizes too large: B*T = ", B * T, ", row = ", row);
  if (B * T == 0 || row == 0) return;
  LaunchOn on(tokens);
  // Head-side strides, shared by every part (heads_input made sure), last stride 1.
  const int64_t sb = heads[0].stride(0), sh = heads[0].stride(1), st = heads[0].stride(2);
  bool aligned = aligned16(tokens);
  for (const at::Tensor& h : heads) aligned = aligned && aligned16(h);
  const int64_t es = tokens.element_size();
  const PermutePlan p =
      plan_permute(split, parts, B, T, NH, HS, sb, sh, st, es, aligned, sm_count(on.device),
                   permute_override.get_variant() == 1);
  void* h[3];
  for (int i = 0; i < 3; ++i) h[i] = heads[std::min(i, parts - 1)].data_ptr();  // unused when i >= parts
  const DType dt = dtype_of(tokens, op);
  const Dim3 grid(static_cast<unsigned>(p.grid), static_cast<unsigned>(p.grid_y));
  const Dim3 block(static_cast<unsigned>(p.block_x), static_cast<unsigned>(p.block_y));
  if (p.layout_id == PermuteLayout::lanes) {
    const Magic mc = magic(p.cols), mh = magic(p.hsw), mn = magic(NH);
    // permute_div_hot of seq: shift s - 1 (seq >= 2); seq = 1 only with one token (tf = 0).
    const Magic ms = p.seq >= 2 ? magic(p.seq) : Magic{0, 1};
    const int k_index = p.K == 1 ? 0 : (p.K == 2 ? 1 : 2);
    auto i32 = [](int64_t v) { return static_cast<int>(static_cast<uint32_t>(v)); };  // u32 bits
    lanes_kernel(p.vec, split, k_index)
        .launch(dt, on.device, on.stream, grid, block, 0, tokens.data_ptr(), h[0], h[1], h[2],
                i32(B * T), i32(p.lanes), i32(p.cols), i32(p.hsw), i32(NH), i32(p.seq), i32(mc.m),
                i32(mc.s), i32(mh.m), i32(mh.s), i32(mn.m), i32(mn.s), i32(ms.m), i32(ms.s - 1),
                static_cast<long long>(sh * es), i32(p.sb_bytes), i32(p.st_bytes),
                i32(p.row_bytes));
    return;
  }
  Kernel& k = split ? (p.vec ? to_heads_vec : to_heads_elem) : (p.vec ? to_tokens_vec : to_tokens_elem);
  const int seq = static_cast<int>(T), nh = static_cast<int>(NH), hs = static_cast<int>(HS),
            ncols = static_cast<int>(p.cols);
  const long long tps = p.tiles_per_seq, nunits = p.units, lsb = sb, lsh = sh, lst = st;
  if (split)
    k.launch(dt, on.device, on.stream, grid, block, 0, tokens.data_ptr(), h[0], h[1], h[2], seq, nh,
             hs, ncols, tps, nunits, lsb, lsh, lst);
  else
    k.launch(dt, on.device, on.stream, grid, block, 0, h[0], h[1], h[2], tokens.data_ptr(), seq, nh,
             hs, ncols, tps, nunits, lsb, lsh, lst);
}

// Head-major inputs (the source side of a heads -> tokens copy), as given when the kernel can read
// them in place: every part with the same strides and a unit last stride (contiguous, or e.g. the
// token-major gradients flash attention returns when q, k, v were views of qkv). Otherwise
// contiguous copies. Missing parts (None) must have been replaced by zeros already.
void heads_in_place_or_contiguous(std::vector<at::Tensor>& heads) {
  bool same = true;
  for (const at::Tensor& h : heads)
    same = same && h.stride(3) == 1 && h.strides() == heads[0].strides() && h.size(3) > 0;
  if (same) return;
  for (at::Tensor& h : heads) h = h.contiguous();
}

// (B, T, 3C) -> q, k, v, each (B, NH, T, HS) contiguous.
std::tuple<at::Tensor, at::Tensor, at::Tensor> split_qkv_forward(const at::Tensor& qkv_, int64_t n_head) {
  const char* op = "split_qkv_forward";
  const at::Tensor qkv = input(qkv_, op, "qkv");
  KF_CHECK(qkv.dim() == 3, op, "qkv must be (B, T, 3C), got ", qkv.sizes());
  KF_CHECK(n_head > 0, op, "n_head must be positive, got ", n_head);
  const int64_t B = qkv.size(0), T = qkv.size(1), C3 = qkv.size(2);
  KF_CHECK(C3 % (3 * n_head) == 0, op, "last dim ", C3, " is not 3 * n_head * head_size (n_head = ", n_head, ")");
  const int64_t HS = C3 / (3 * n_head);
  std::vector<at::Tensor> heads;
  for (int p = 0; p < 3; ++p) heads.push_back(new_output({B, n_head, T, HS}, qkv.options()));
  launch(true, qkv, heads, B, T, n_head, HS, op);
  return {heads[0], heads[1], heads[2]};
}

// dq, dk, dv (B, NH, T, HS) -> dqkv (B, T, 3C). A missing gradient (None: that output was unused)
// counts as zeros; at least one must be given.
at::Tensor split_qkv_backward(const std::optional<at::Tensor>& dq_, const std::optional<at::Tensor>& dk_,
                              const std::optional<at::Tensor>& dv_) {
  const char* op = "split_qkv_backward";
  const std::optional<at::Tensor>* given[3] = {&dq_, &dk_, &dv_};
  const char* names[3] = {"dq", "dk", "dv"};
  int first = -1;
  for (int p = 0; p < 3 && first < 0; ++p)
    if (given[p]->has_value() && (*given[p])->defined()) first = p;
  KF_CHECK(first >= 0, op, "dq, dk and dv are all None");
  const at::Tensor& ref = **given[first];
  check_input(ref, op, names[first]);
  KF_CHECK(ref.dim() == 4, op, names[first], " must be (B, NH, T, HS), got ", ref.sizes());
  std::vector<at::Tensor> heads;
  for (int p = 0; p < 3; ++p) {
    if (!(given[p]->has_value() && (*given[p])->defined())) {
      heads.push_back(at::zeros_like(ref));  // ref's strides, so the parts can stay in place
      continue;
    }
    const at::Tensor& g = **given[p];
    check_input_like(g, ref, op, names[p]);
    KF_CHECK(g.sizes() == ref.sizes(), op, names[p], " has shape ", g.sizes(), ", expected ", ref.sizes());
    heads.push_back(g);
  }
  heads_in_place_or_contiguous(heads);
  const int64_t B = ref.size(0), NH = ref.size(1), T = ref.size(2), HS = ref.size(3);
  at::Tensor dqkv = new_output({B, T, 3 * NH * HS}, ref.options());
  launch(false, dqkv, heads, B, T, NH, HS, op);
  return dqkv;
}

// y (B, NH, T, HS) -> (B, T, C).
at::Tensor merge_heads_forward(const at::Tensor& y_, const char* op = "merge_heads_forward") {
  check_input(y_, op, "y");
  KF_CHECK(y_.dim() == 4, op, "y must be (B, NH, T, HS), got ", y_.sizes());
  std::vector<at::Tensor> heads{y_};
  heads_in_place_or_contiguous(heads);
  const at::Tensor& y = heads[0];
  const int64_t B = y.size(0), NH = y.size(1), T = y.size(2), HS = y.size(3);
  at::Tensor out = new_output({B, T, NH * HS}, y.options());
  launch(false, out, heads, B, T, NH, HS, op);
  return out;
}

// dout (B, T, C) -> dy (B, NH, T, HS).
at::Tensor merge_heads_backward(const at::Tensor& dout_, int64_t n_head, const char* op = "merge_heads_backward") {
  const at::Tensor dout = input(dout_, op, "dout");
  KF_CHECK(dout.dim() == 3, op, "dout must be (B, T, C), got ", dout.sizes());
  KF_CHECK(n_head > 0, op, "n_head must be positive, got ", n_head);
  const int64_t B = dout.size(0), T = dout.size(1), C = dout.size(2);
  KF_CHECK(C % n_head == 0, op, "last dim ", C, " is not a multiple of n_head = ", n_head);
  at::Tensor dy = new_output({B, n_head, T, C / n_head}, dout.options());
  launch(true, dout, {dy}, B, T, n_head, C / n_head, op);
  return dy;
}

// The executor's forms: a view where the layout allows one (no kernel), decided here rather than in
// Python, where the checks cost more host time than the view (a step makes 12 of each, and its
// forward waits for its host). y's heads token-major in memory (attention's output in q's layout,
// q a linear's result viewed and transposed) merge as a view; a contiguous dout splits as one, the
// token-major layout attention's backward reads dO in.
at::Tensor merge_heads_forward_view(const at::Tensor& y) {
  if (y.defined() && y.is_cuda() && y.dim() == 4) {
    at::Tensor yt = y.transpose(1, 2);
    if (yt.is_contiguous()) return yt.view({y.size(0), y.size(2), y.size(1) * y.size(3)});
  }
  return merge_heads_forward(y, "merge_heads_forward_view");
}

at::Tensor merge_heads_backward_view(const at::Tensor& dout, int64_t n_head) {
  if (dout.defined() && dout.is_cuda() && dout.dim() == 3 && dout.is_contiguous() && n_head > 0 &&
      dout.size(2) % n_head == 0)
    return dout.view({dout.size(0), dout.size(1), n_head, dout.size(2) / n_head}).transpose(1, 2);
  return merge_heads_backward(dout, n_head, "merge_heads_backward_view");
}

}  // namespace

KFORGE_BIND_OP(permute) {
  m.def("split_qkv_forward", &split_qkv_forward,
        "qkv (B, T, 3C) -> q, k, v, each (B, n_head, T, C / n_head) contiguous.", pybind11::arg("qkv"),
        pybind11::arg("n_head"));
  m.def("split_qkv_backward", &split_qkv_backward,
        "dq, dk, dv (B, NH, T, HS; None counts as zeros) -> dqkv (B, T, 3 NH HS).", pybind11::arg("dq"),
        pybind11::arg("dk"), pybind11::arg("dv"));
  m.def("merge_heads_forward", [](const at::Tensor& y) { return merge_heads_forward(y); },
        "y (B, NH, T, HS) -> (B, T, NH HS) contiguous.", pybind11::arg("y"));
  m.def("merge_heads_backward", [](const at::Tensor& dout, int64_t n_head) { return merge_heads_backward(dout, n_head); },
        "dout (B, T, C) -> dy (B, n_head, T, C / n_head).", pybind11::arg("dout"), pybind11::arg("n_head"));
  m.def("merge_heads_forward_view", &merge_heads_forward_view,
        "merge_heads_forward, or a view of y when its heads are token-major in memory (no kernel).",
        pybind11::arg("y"));
  m.def("merge_heads_backward_view", &merge_heads_backward_view,
        "merge_heads_backward, or a (B, n_head, T, C / n_head) view of a contiguous dout (no kernel).",
        pybind11::arg("dout"), pybind11::arg("n_head"));
}

}  // namespace kforge
