// swiglu launchers: out = silu(gate) * up and its backward (d_gate, d_up); see kernels_src/swiglu.cu.
#include "../runtime/torch_launch.h"

namespace kforge {
namespace {

Program prog("swiglu");
Kernel fwd(prog, "swiglu_forward_kernel<{T}>");
Kernel bwd(prog, "swiglu_backward_kernel<{T}>");

constexpr int kBlock = 256;

// Grid-stride launch over n elements: enough blocks to fill every SM many times over.
unsigned grid_for(int64_t n, bool vec, int64_t elem_size, int device) {
  return grid_stride_blocks(vec ? n / (16 / elem_size) + 16 : n, kBlock, 32, device);  // + scalar tail
}

void check_same_shape(const at::Tensor& a, const at::Tensor& b, const char* op, const char* an,
                      const char* bn) {
  KF_CHECK(a.sizes() == b.sizes(), op, an, " and ", bn, " shapes differ: ", a.sizes(), " vs ",
           b.sizes());
}

at::Tensor swiglu_forward(const at::Tensor& gate_, const at::Tensor& up_) {
  const char* op = "swiglu_forward";
  const at::Tensor gate = input(gate_, op, "gate");
  const at::Tensor up = input_like(up_, gate, op, "up");
  check_same_shape(gate, up, op, "gate", "up");
  LaunchOn on(gate);
  at::Tensor out = new_output_like(gate);
  const long long n = gate.numel();
  if (n == 0) return out;
  const int vec = aligned16(gate) && aligned16(up) && aligned16(out);
  fwd.launch(dtype_of(gate, op), on.device, on.stream, grid_for(n, vec, gate.element_size(), on.device),
             kBlock, 0, gate.data_ptr(), up.data_ptr(), out.data_ptr(), n, vec);
  return out;
}

std::tuple<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& dout_, const at::Tensor& gate_,
                                                   const at::Tensor& up_) {
  const char* op = "swiglu_backward";
  const at::Tensor gate = input(gate_, op, "gate");
  const at::Tensor up = input_like(up_, gate, op, "up");
  const at::Tensor dout = input_like(dout_, gate, op, "dout");
  check_same_shape(gate, up, op, "gate", "up");
  check_same_shape(gate, dout, op, "gate", "dout");
  LaunchOn on(gate);
  at::Tensor dgate = new_output_like(gate), dup = new_output_like(up);
  const long long n = gate.numel();
  if (n == 0) return {dgate, dup};
  const int vec = aligned16(dout) && aligned16(gate) && aligned16(up) && aligned16(dgate) &&
                  aligned16(dup);
  bwd.launch(dtype_of(gate, op), on.device, on.stream, grid_for(n, vec, gate.element_size(), on.device),
             kBlock, 0, dout.data_ptr(), gate.data_ptr(), up.data_ptr(), dgate.data_ptr(),
             dup.data_ptr(), n, vec);
  return {dgate, dup};
}

}  // namespace

KFORGE_BIND_OP(swiglu) {
  m.def("swiglu_forward", &swiglu_forward, "out = silu(gate) * up (same shapes)", pybind11::arg("gate"),
        pybind11::arg("up"));
  m.def("swiglu_backward", &swiglu_backward,
        "(d_gate, d_up) of swiglu_forward in one pass, silu recomputed from gate",
        pybind11::arg("dout"), pybind11::arg("gate"), pybind11::arg("up"));
}

}  // namespace kforge
