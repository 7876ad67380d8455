// torch_launch.h: what op launchers (src/ops/<op>.cpp) use to meet PyTorch.
//
// Tensor checks with clear messages, dtype mapping, PyTorch's current stream, the device guard, and
// self-registration of each op's Python bindings (module.cpp binds every registered op).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <pybind11/pybind11.h>

#include <cstdio>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "program.h"

namespace kforge {

// Message pieces are formatted without iostreams: on the GPU machine's toolchain, locale facets used
// from this module (ostream number formatting, std::regex) crashed, while to_string / snprintf work.
inline std::string to_str(const char* s) { return s; }
inline std::string to_str(const std::string& s) { return s; }
inline std::string to_str(char c) { return std::string(1, c); }
inline std::string to_str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
inline std::string to_str(float v) { return to_str(static_cast<double>(v)); }
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
std::string to_str(T v) {
  return std::to_string(v);
}
// torch's Python names (float32, bfloat16, ...): what users write, not c10's Float / BFloat16.
inline std::string to_str(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Short: return "int16";
    case c10::ScalarType::Char: return "int8";
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Bool: return "bool";
    default: return c10::toString(t);
  }
}
inline std::string to_str(const c10::Device& d) { return d.str(); }
inline std::string to_str(c10::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

// KF_CHECK(cond, "op", "message parts", ...) throws kforge::Error("kforge.op: message").
template <typename... Parts>
[[noreturn]] void fail(const char* op, const Parts&... parts) {
  std::string msg = std::string("kforge.") + op + ": ";
  ((msg += to_str(parts)), ...);
  throw Error(msg);
}
#define KF_CHECK(cond, op, ...)                     \
  do {                                              \
    if (!(cond)) ::kforge::fail(op, __VA_ARGS__);   \
  } while (0)

inline DType dtype_of(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kBFloat16: return DType::bf16;
    case at::kHalf: return DType::f16;
    default: fail(op, "dtype ", t.scalar_type(), " is not supported (float32, bfloat16, float16)");
  }
}

// Checks that `t` is a CUDA tensor of a supported float dtype (any layout).
inline void check_input(const at::Tensor& t, const char* op, const char* name) {
  KF_CHECK(t.defined(), op, name, " is undefined");
  KF_CHECK(t.is_cuda(), op, name, " must be a CUDA tensor, got ", t.device());
  dtype_of(t, op);
}

// check_input(), then `t` contiguous (a copy only when it is not already: Thunder's traces carry no
// strides, so launchers accept any layout).
inline at::Tensor input(const at::Tensor& t, const char* op, const char* name) {
  check_input(t, op, name);
  return t.contiguous();
}

// Checks that `t` is a CUDA tensor on `ref`'s device with `ref`'s dtype (any layout).
inline void check_input_like(const at::Tensor& t, const at::Tensor& ref, const char* op, const char* name) {
  KF_CHECK(t.defined() && t.is_cuda() && t.device() == ref.device(), op, name,
           " must be a CUDA tensor on ", ref.device());
  KF_CHECK(t.scalar_type() == ref.scalar_type(), op, name, " has dtype ", t.scalar_type(),
           ", expected ", ref.scalar_type());
}

// check_input_like(), then `t` contiguous.
inline at::Tensor input_like(const at::Tensor& t, const at::Tensor& ref, const char* op,
                             const char* name) {
  check_input_like(t, ref, op, name);
  return t.contiguous();
}

inline bool aligned16(const at::Tensor& t) {
  return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0;
}

// Test aid: when on, every output a launcher allocates is first filled with NaN (0xFF bytes for
// non-float dtypes), so an element a kernel fails to write shows up. Off in normal use.
inline bool& poison_outputs() {
  static bool on = false;
  return on;
}

// Allocate a launcher output through PyTorch's caching allocator (never cudaMalloc directly).
inline at::Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (poison_outputs()) {
    if (at::isFloatingType(t.scalar_type()))
      t.fill_(std::numeric_limits<double>::quiet_NaN());
    else
      t.view(at::kByte).fill_(0xFF);
  }
  return t;
}
inline at::Tensor new_output_like(const at::Tensor& t) {
  return new_output(t.sizes(), t.options().memory_format(at::MemoryFormat::Contiguous));
}

// Device guard + PyTorch's current stream for the device of `t`. Construct one per launcher call.
struct LaunchOn {
  c10::cuda::CUDAGuard guard;
  int device;
  CUstream stream;
  explicit LaunchOn(const at::Tensor& t)
      : guard(t.device()),
        device(t.get_device()),
        stream(reinterpret_cast<CUstream>(c10::cuda::getCurrentCUDAStream(t.get_device()).stream())) {}
};

inline unsigned ceil_div(int64_t a, int64_t b) { return static_cast<unsigned>((a + b - 1) / b); }

// Multiprocessor count (PyTorch caches device properties, so this is cheap per call).
inline int sm_count(int device) { return at::cuda::getDeviceProperties(device)->multiProcessorCount; }

// Blocks for a grid-stride loop over `work` items of `block` threads: enough to cover them once, at
// most `per_sm` blocks per multiprocessor (the loop covers the rest), and never zero.
inline unsigned grid_stride_blocks(int64_t work, int block, int per_sm, int device) {
  return static_cast<unsigned>(std::max<int64_t>(
      1, std::min<int64_t>((work + block - 1) / block, int64_t(sm_count(device)) * per_sm)));
}

// ---- op bindings --------------------------------------------------------------------------------
using BindFn = void (*)(pybind11::module_&);
inline std::vector<std::pair<const char*, BindFn>>& op_bindings() {
  static std::vector<std::pair<const char*, BindFn>> v;
  return v;
}
struct OpBinder {
  OpBinder(const char* name, BindFn fn) { op_bindings().emplace_back(name, fn); }
};
// KFORGE_BIND_OP(gelu) { m.def("gelu_forward", &gelu_forward, ...); }
#define KFORGE_BIND_OP(name)                                                     \
  static void kforge_bind_##name(pybind11::module_& m);                          \
  static ::kforge::OpBinder kforge_binder_##name(#name, &kforge_bind_##name);    \
  static void kforge_bind_##name(pybind11::module_& m)

}  // namespace kforge
