// rope launchers: rotary embedding of q and k in one launch, forward and backward (the transposed
// rotation); see kernels_src/rope.cu for the table layouts.
#include <pybind11/stl.h>

#include <optional>

#include "../runtime/torch_launch.h"
#include "rope_plan.h"  // the dispatch: tiled or per-token kernel, grid, block

namespace kforge {
namespace {

Program prog("rope");
// The tiled kernel (8 heads per thread, one token tile per block) for 16-byte aligned rows and table
// rows, [rotate_half, interleaved], tables of q's dtype or fp32; the per-token kernel for the rest.
const std::vector<DType> k16 = {DType::bf16, DType::f16};
Kernel tile_same[2] = {Kernel(prog, "rope_tile_kernel<{T}, 8, false>"),
                       Kernel(prog, "rope_tile_kernel<{T}, 8, true>")};
Kernel tile_f32[2] = {Kernel(prog, "rope_tile_f32tab_kernel<{T}, 8, false>", k16),
                      Kernel(prog, "rope_tile_f32tab_kernel<{T}, 8, true>", k16)};
Kernel same_dtype_tables(prog, "rope_kernel<{T}>");
Kernel f32_tables(prog, "rope_f32tab_kernel<{T}>", {DType::bf16, DType::f16});

bool multiple(int64_t v, int64_t m) { return v % m == 0; }

// q / k (or their gradients) as (B, H, T, D) with a dense last dim; other strides are kept (HF passes
// transposed (B, T, H, D) views), so no copy is made for them.
at::Tensor head_rows(const at::Tensor& t, const at::Tensor* ref, const char* op, const char* name) {
  KF_CHECK(t.defined() && t.is_cuda(), op, name, " must be a CUDA tensor, got ",
           t.defined() ? t.device() : at::Device(at::kCPU));
  dtype_of(t, op);
  if (ref)
    KF_CHECK(t.device() == ref->device() && t.scalar_type() == ref->scalar_type(), op, name,
             " must match q's device and dtype (", ref->device(), ", ", ref->scalar_type(), "), got ",
             t.device(), ", ", t.scalar_type());
  KF_CHECK(t.dim() == 4, op, name, " must be (B, H, T, D), got shape ", t.sizes());
  return t.stride(3) == 1 ? t : t.contiguous();
}

// x (B, H, T, D) is token-major: (B, T, H, D) contiguous in memory, viewed as (B, H, T, D), as a
// Llama's q / k are (a linear's output split into heads by a transpose). Size-1 dims: any stride.
bool token_major(const at::Tensor& x) {
  const int64_t H = x.size(1), T = x.size(2), D = x.size(3);
  return x.stride(3) == 1 && (H == 1 || x.stride(1) == D) && (T == 1 || x.stride(2) == H * D) &&
         (x.size(0) == 1 || x.stride(0) == T * H * D);
}

// The output for q / k (or their gradients): in x's layout when x is token-major, else contiguous
// (B, H, T, D). cuDNN attention returns O, dQ and dK in q's layout, so with a token-major rope
// output the head merge of O and the transposes of dQ / dK into the projections' weight gradients
// are views rather than copies.
at::Tensor rows_out(const at::Tensor& x) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3);
  if (!x.is_contiguous() && token_major(x))
    return new_output({B, T, H, D}, x.options()).transpose(1, 2);
  return new_output({B, H, T, D}, x.options());
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q_, const at::Tensor& k_,
                                        const at::Tensor& cos_, const at::Tensor& sin_,
                                        const std::optional<at::Tensor>& position_ids,
                                        bool interleaved, bool inverse, const char* op) {
  const at::Tensor q = head_rows(q_, nullptr, op, "q");
  const at::Tensor k = head_rows(k_, &q, op, "k");
  const int64_t B = q.size(0), Hq = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1);
  KF_CHECK(k.size(0) == B && k.size(2) == T && k.size(3) == D, op, "k shape ", k.sizes(),
           " does not match q shape ", q.sizes(), " in B, T or D");
  KF_CHECK(D > 0 && D % 2 == 0, op, "head dim D must be even, got ", D);
  KF_CHECK(B * T <= std::numeric_limits<int>::max() && Hq + Hkv <= std::numeric_limits<int>::max(),
           op, "too many tokens or heads");

  const int64_t Dc = interleaved ? D / 2 : D;
  KF_CHECK(cos_.defined() && sin_.defined() && cos_.is_cuda() && cos_.device() == q.device() &&
               sin_.device() == cos_.device(),
           op, "cos and sin must be CUDA tensors on ", q.device());
  KF_CHECK(cos_.scalar_type() == sin_.scalar_type() &&
               (cos_.scalar_type() == q.scalar_type() || cos_.scalar_type() == at::kFloat),
           op, "cos / sin dtype must be q's (", q.scalar_type(), ") or float32, got ",
           cos_.scalar_type(), " / ", sin_.scalar_type());
  KF_CHECK(cos_.sizes() == sin_.sizes(), op, "cos and sin shapes differ: ", cos_.sizes(), " vs ",
           sin_.sizes());
  const at::Tensor cos = cos_.contiguous(), sin = sin_.contiguous();
  KF_CHECK((cos.dim() == 2 || cos.dim() == 3) && cos.size(-1) == Dc, op, "cos / sin must be (",
           position_ids ? "P" : "[B or 1,] T", ", ", Dc, ") for ",
           interleaved ? "interleaved" : "rotate_half", " rope with D = ", D, ", got ", cos.sizes());

  int tab_batched = 0;
  int64_t n_pos = 0, pos_sb = 0;
  at::Tensor pos;
  if (position_ids) {
    KF_CHECK(cos.dim() == 2, op, "with position_ids, cos / sin are (P, ", Dc, ") tables, got ",
             cos.sizes());
    n_pos = cos.size(0);
    KF_CHECK(n_pos > 0, op, "cos / sin (P, ", Dc, ") tables have no rows");
    const at::Tensor& p = *position_ids;
    KF_CHECK(p.defined() && p.is_cuda() && p.device() == q.device(), op,
             "position_ids must be a CUDA tensor on ", q.device());
    KF_CHECK(p.scalar_type() == at::kLong || p.scalar_type() == at::kInt, op,
             "position_ids must be int64 or int32, got ", p.scalar_type());
    KF_CHECK((p.dim() == 1 && p.size(0) == T) ||
                 (p.dim() == 2 && (p.size(0) == 1 || p.size(0) == B) && p.size(1) == T),
             op, "position_ids must be (T,), (1, T) or (B, T) with B = ", B, ", T = ", T, ", got ",
             p.sizes());
    pos = p.to(at::kLong).contiguous();
    pos_sb = p.dim() == 2 && p.size(0) > 1 ? T : 0;
  } else if (cos.dim() == 2) {
    KF_CHECK(cos.size(0) == T, op, "cos / sin (T, ", Dc, ") must have T = ", T, " rows, got ",
             cos.sizes());
  } else {
    KF_CHECK((cos.size(0) == 1 || cos.size(0) == B) && cos.size(1) == T, op,
             "cos / sin must be (B or 1, T, ", Dc, ") with B = ", B, ", T = ", T, ", got ",
             cos.sizes());
    tab_batched = cos.size(0) > 1;
  }

  LaunchOn on(q);
  at::Tensor q_out = rows_out(q);
  at::Tensor k_out = rows_out(k);
  if (B * T == 0 || (Hq + Hkv) == 0) return {q_out, k_out};

  // 16-byte chunks need every head row (and, for rotate_half, its second half) to start aligned, in
  // the inputs and in the outputs.
  const int64_t V = 16 / q.element_size();
  bool vec = multiple(interleaved ? D : D / 2, V) && aligned16(q) && aligned16(k) &&
             aligned16(q_out) && aligned16(k_out);
  for (int d = 0; d < 3; ++d)
    vec = vec && multiple(q.stride(d), V) && multiple(k.stride(d), V) &&
          multiple(q_out.stride(d), V) && multiple(k_out.stride(d), V);
  const bool f32tab = cos.scalar_type() != q.scalar_type();
  const int tvec = vec && aligned16(cos) && aligned16(sin) && multiple(Dc * cos.element_size(), 16);

  const DType dt = dtype_of(q, op);
  auto stride = [](const at::Tensor& x, int d) { return static_cast<long long>(x.stride(d)); };
  void* pos_ptr = position_ids ? pos.data_ptr() : nullptr;
  const RopePlan p = plan_rope(B, T, Hq, Hkv, D, q.element_size(), interleaved, vec, tvec, f32tab);
  const Dim3 block(static_cast<unsigned>(p.block_x), static_cast<unsigned>(p.block_y));
  if (p.layout_id == RopeLayout::tile) {
    Kernel& kernel = (f32tab ? tile_f32 : tile_same)[interleaved ? 1 : 0];
    kernel.launch(dt, on.device, on.stream,
                  Dim3(static_cast<unsigned>(p.grid), static_cast<unsigned>(p.grid_y)), block, 0,
                  q.data_ptr(), k.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), cos.data_ptr(),
                  sin.data_ptr(), pos_ptr, static_cast<int>(B * T), static_cast<int>(T),
                  static_cast<int>(Hq), static_cast<int>(Hkv), static_cast<int>(D), stride(q, 0),
                  stride(q, 1), stride(q, 2), stride(k, 0), stride(k, 1), stride(k, 2),
                  stride(q_out, 0), stride(q_out, 1), stride(q_out, 2), stride(k_out, 0),
                  stride(k_out, 1), stride(k_out, 2), tab_batched, static_cast<long long>(n_pos),
                  static_cast<long long>(pos_sb), int(inverse), static_cast<int>(p.ntiles),
                  static_cast<int>(p.q_groups));
    return {q_out, k_out};
  }
  Kernel& kernel = f32tab ? f32_tables : same_dtype_tables;
  kernel.launch(dt, on.device, on.stream, static_cast<unsigned>(p.grid), block, 0, q.data_ptr(),
                k.data_ptr(), q_out.data_ptr(), k_out.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                pos_ptr, static_cast<int>(T), static_cast<int>(Hq), static_cast<int>(Hkv),
                static_cast<int>(D), stride(q, 0), stride(q, 1), stride(q, 2), stride(k, 0),
                stride(k, 1), stride(k, 2), stride(q_out, 0), stride(q_out, 1), stride(q_out, 2),
                stride(k_out, 0), stride(k_out, 1), stride(k_out, 2), tab_batched,
                static_cast<long long>(n_pos),
                static_cast<long long>(pos_sb), int(interleaved), int(inverse), int(vec), tvec);
  return {q_out, k_out};
}

std::tuple<at::Tensor, at::Tensor> rope_forward(const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& cos, const at::Tensor& sin,
                                                const std::optional<at::Tensor>& position_ids,
                                                bool interleaved) {
  return rope(q, k, cos, sin, position_ids, interleaved, /*inverse=*/false, "rope_forward");
}

std::tuple<at::Tensor, at::Tensor> rope_backward(const at::Tensor& dq_out, const at::Tensor& dk_out,
                                                 const at::Tensor& cos, const at::Tensor& sin,
                                                 const std::optional<at::Tensor>& position_ids,
                                                 bool interleaved) {
  return rope(dq_out, dk_out, cos, sin, position_ids, interleaved, /*inverse=*/true, "rope_backward");
}

}  // namespace

KFORGE_BIND_OP(rope) {
  m.def("rope_forward", &rope_forward,
        "Rotary embedding of q (B, Hq, T, D) and k (B, Hkv, T, D) in one launch; returns (q_rot, "
        "k_rot), each in its input's layout when that is token-major ((B, T, H, D) in memory, e.g. "
        "x.view(B, T, H, D).transpose(1, 2)), else contiguous. rotate_half (interleaved=False): "
        "cos / sin have D entries per row; interleaved pairs: D / 2. Rows: (B or 1, T, Dc) or (T, Dc) tables, or a (P, Dc) table "
        "indexed by position_ids (T,) / (1, T) / (B, T).",
        pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("position_ids") = pybind11::none(), pybind11::arg("interleaved") = false);
  m.def("rope_backward", &rope_backward,
        "Gradients (dq, dk) of rope_forward from (dq_rot, dk_rot): the transposed rotation; each in "
        "its input's layout when that is token-major, else contiguous.",
        pybind11::arg("dq_rot"), pybind11::arg("dk_rot"), pybind11::arg("cos"), pybind11::arg("sin"),
        pybind11::arg("position_ids") = pybind11::none(), pybind11::arg("interleaved") = false);
}

}  // namespace kforge
