// permute launchers: split_qkv (B, T, 3C) -> q, k, v (B, NH, T, HS) and merge_heads
// (B, NH, T, HS) -> (B, T, C), forward and backward (see kernels_src/permute.cu). Every copy runs
// the persistent token lanes (permute_lanes_kernel), or the 64-bit tiles where the lanes' 32-bit
// byte strides do not fit (a head part or token row past 4 GiB).
#include "../runtime/torch_launch.h"

#include <optional>

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
Kernel& lanes_kernel(bool vec, bool to_heads, int k_index) {
  return lanes_kernels[(vec ? 6 : 0) + (to_heads ? 3 : 0) + k_index];
}

constexpr int64_t kTokensPerThread = 4;  // kPermuteK in kernels_src/permute.cu
constexpr int64_t kMaxBlockX = 512;      // columns per block
constexpr int64_t kTargetBlock = 256;    // threads per block when a token row is short

constexpr int kLanesBlock = 256;
// Blocks per SM pinned by permute_lanes_min_blocks(K) (__launch_bounds__) in kernels_src/permute.cu.
int lanes_min_blocks(int K) { return K <= 2 ? 8 : 6; }

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

// The token lanes (permute_lanes_kernel); false where their 32-bit byte strides, thread index or
// token counter do not fit (then the tiles run).
bool launch_lanes(bool split, bool vec, const at::Tensor& tokens,
                  const std::vector<at::Tensor>& heads, int64_t B, int64_t T, int64_t NH,
                  int64_t HS, int64_t sb, int64_t sh, int64_t st, const LaunchOn& on,
                  const char* op) {
  const int64_t es = tokens.element_size(), W = vec ? 16 / es : 1;
  const int64_t parts = static_cast<int64_t>(heads.size());
  const int64_t cols = parts * NH * HS / W, hsw = HS / W, ntok = B * T;
  int64_t seq = T;
  if (seq == 1) {  // (b, 0) -> (0, t = b): the token division only ever divides by seq >= 2
    seq = B;
    st = sb;
    sb = 0;
  }
  const int64_t rowB = parts * NH * HS * es, sbB = sb * es, stB = st * es;
  const int64_t u32max = int64_t(std::numeric_limits<uint32_t>::max());
  if (rowB > u32max || sbB > u32max || stB > u32max || sbB < 0 || stB < 0) return false;
  // K: the smallest of 1, 2, 4 that moves every token in one round of one wave, else 4 (rounds).
  const int sms = sm_count(on.device);
  auto lanes_max = [&](int K) {
    return std::max<int64_t>(1, int64_t(sms) * lanes_min_blocks(K) * kLanesBlock / cols);
  };
  int K = 1;
  while (K < 4 && ntok > K * lanes_max(K)) K *= 2;
  const int64_t rounds = (ntok + K * lanes_max(K) - 1) / (K * lanes_max(K));
  const int64_t lanes = (ntok + K * rounds - 1) / (K * rounds);  // <= lanes_max(K)
  const int64_t threads = lanes * cols;
  // 32-bit thread index (< 2^31, permute_div) and token counter (tf0 + K * lanes < 2^32).
  if (threads + kLanesBlock > std::numeric_limits<int>::max() || ntok + K * lanes > u32max)
    return false;
  const Magic mc = magic(cols), mh = magic(hsw), mn = magic(NH);
  // permute_div_hot of seq: shift s - 1 (seq >= 2); seq = 1 only with one token (tf = 0).
  const Magic ms = seq >= 2 ? magic(seq) : Magic{0, 1};
  void* h[3];
  for (int p = 0; p < 3; ++p) h[p] = heads[std::min<int64_t>(p, parts - 1)].data_ptr();
  const int k_index = K == 1 ? 0 : (K == 2 ? 1 : 2);
  const Dim3 grid(ceil_div(threads, kLanesBlock)), block(kLanesBlock);
  auto i32 = [](int64_t v) { return static_cast<int>(static_cast<uint32_t>(v)); };  // u32 bits
  lanes_kernel(vec, split, k_index)
      .launch(dtype_of(tokens, op), on.device, on.stream, grid, block, 0, tokens.data_ptr(), h[0],
              h[1], h[2], i32(ntok), i32(lanes), i32(cols), i32(hsw), i32(NH), i32(seq),
              i32(mc.m), i32(mc.s), i32(mh.m), i32(mh.s), i32(mn.m), i32(mn.s), i32(ms.m),
              i32(ms.s - 1), static_cast<long long>(sh * es), i32(sbB), i32(stB), i32(rowB));
  return true;
}

// Copies between token-major `tokens` (B, T, parts * NH * HS) and head-major `heads` (parts tensors
// of shape (B, NH, T, HS)): tokens -> heads when `split`, else heads -> tokens.
// The token lanes where they fit; else the tiles: the row's `cols` columns in the fewest chunks of
// <= 512 threads (blockIdx.x), as many token lanes per block as fit in 256 threads (blockDim.y;
// fewer for short sequences), 4 tokens per thread; blockIdx.y walks (b, token tile) units: at most
// about two waves of blocks, each block the same number of units.
void launch(bool split, const at::Tensor& tokens, const std::vector<at::Tensor>& heads, int64_t B,
            int64_t T, int64_t NH, int64_t HS, const char* op) {
  const int parts = static_cast<int>(heads.size());
  const int64_t row = parts * NH * HS;
  KF_CHECK(B * T <= std::numeric_limits<int>::max() && row <= std::numeric_limits<int>::max(), op,
           "sizes too large: B*T = ", B * T, ", row = ", row);
  if (B * T == 0 || row == 0) return;
  LaunchOn on(tokens);
  const int64_t V = 16 / tokens.element_size();
  // Head-side strides, shared by every part (heads_input made sure), last stride 1.
  const int64_t sb = heads[0].stride(0), sh = heads[0].stride(1), st = heads[0].stride(2);
  bool vec = HS % V == 0 && aligned16(tokens) && sb % V == 0 && sh % V == 0 && st % V == 0;
  for (const at::Tensor& h : heads) vec = vec && aligned16(h);
  if (launch_lanes(split, vec, tokens, heads, B, T, NH, HS, sb, sh, st, on, op)) return;
  const int64_t cols = vec ? row / V : row;
  const int64_t nchunks = (cols + kMaxBlockX - 1) / kMaxBlockX;
  const int64_t bx = (cols + nchunks - 1) / nchunks;
  // Token lanes: fill ~256 threads, but no more than short sequences need.
  const int64_t by = std::max<int64_t>(
      1, std::min<int64_t>(kTargetBlock / bx, (T + kTokensPerThread - 1) / kTokensPerThread));
  const int64_t tiles_per_seq = (T + kTokensPerThread * by - 1) / (kTokensPerThread * by);
  const int64_t units = B * tiles_per_seq;
  const int64_t per_sm = std::max<int64_t>(1, 2048 / (bx * by));  // resident blocks, at best
  const int64_t cap = std::min<int64_t>(
      65535, std::max<int64_t>(1, int64_t(sm_count(on.device)) * per_sm * 2 / nchunks));
  const int64_t iters = (units + cap - 1) / cap;
  const Dim3 grid(static_cast<unsigned>(nchunks), static_cast<unsigned>((units + iters - 1) / iters));
  const Dim3 block(static_cast<unsigned>(bx), static_cast<unsigned>(by));
  void* h[3];
  for (int p = 0; p < 3; ++p) h[p] = heads[std::min(p, parts - 1)].data_ptr();  // unused when p >= parts
  const DType dt = dtype_of(tokens, op);
  Kernel& k = split ? (vec ? to_heads_vec : to_heads_elem) : (vec ? to_tokens_vec : to_tokens_elem);
  const int seq = static_cast<int>(T), nh = static_cast<int>(NH), hs = static_cast<int>(HS),
            ncols = static_cast<int>(cols);
  const long long tps = tiles_per_seq, nunits = units, lsb = sb, lsh = sh, lst = st;
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
at::Tensor merge_heads_forward(const at::Tensor& y_) {
  const char* op = "merge_heads_forward";
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
at::Tensor merge_heads_backward(const at::Tensor& dout_, int64_t n_head) {
  const char* op = "merge_heads_backward";
  const at::Tensor dout = input(dout_, op, "dout");
  KF_CHECK(dout.dim() == 3, op, "dout must be (B, T, C), got ", dout.sizes());
  KF_CHECK(n_head > 0, op, "n_head must be positive, got ", n_head);
  const int64_t B = dout.size(0), T = dout.size(1), C = dout.size(2);
  KF_CHECK(C % n_head == 0, op, "last dim ", C, " is not a multiple of n_head = ", n_head);
  at::Tensor dy = new_output({B, n_head, T, C / n_head}, dout.options());
  launch(true, dout, {dy}, B, T, n_head, C / n_head, op);
  return dy;
}

}  // namespace

KFORGE_BIND_OP(permute) {
  m.def("split_qkv_forward", &split_qkv_forward,
        "qkv (B, T, 3C) -> q, k, v, each (B, n_head, T, C / n_head) contiguous.", pybind11::arg("qkv"),
        pybind11::arg("n_head"));
  m.def("split_qkv_backward", &split_qkv_backward,
        "dq, dk, dv (B, NH, T, HS; None counts as zeros) -> dqkv (B, T, 3 NH HS).", pybind11::arg("dq"),
        pybind11::arg("dk"), pybind11::arg("dv"));
  m.def("merge_heads_forward", &merge_heads_forward, "y (B, NH, T, HS) -> (B, T, NH HS) contiguous.",
        pybind11::arg("y"));
  m.def("merge_heads_backward", &merge_heads_backward, "dout (B, T, C) -> dy (B, n_head, T, C / n_head).",
        pybind11::arg("dout"), pybind11::arg("n_head"));
}

}  // namespace kforge
