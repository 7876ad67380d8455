// generated.cpp: the one launcher of generated kernels (kforge.fusion).
//
// A GeneratedKernel stands for one fused region of a Thunder trace. Its shapes and dtypes are fixed
// when the region is built; what varies between calls is the layout of the input tensors, so the
// kernel is specialised per layout key: for each tensor input whether it is contiguous ('c') or
// strided ('s': its strides become kernel arguments) and whether its data is 16-byte aligned ('a' /
// 'u'), plus 'L' when a strided input needs 64-bit offsets. On the first call with a new key the
// Python code generator is asked for the variant's source and launch geometry; the source is
// compiled through the same Program path as kernels_src/ (memory + disk cache keyed by its text).
// Every later call stays in C++: check inputs, look the variant up, allocate outputs through
// PyTorch's caching allocator, launch on the current stream. No host synchronisation.
#include "generated.h"

#include <torch/extension.h>
#include <ATen/TensorUtils.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <climits>
#include <mutex>

namespace kforge {

namespace py = pybind11;

namespace {

// Dtype names as Python's str(torch.<dtype>) spells them without the "torch." prefix.
at::ScalarType dtype_from_name(const std::string& n) {
  if (n == "float32") return at::kFloat;
  if (n == "bfloat16") return at::kBFloat16;
  if (n == "float16") return at::kHalf;
  if (n == "bool") return at::kBool;
  if (n == "int64") return at::kLong;
  if (n == "int32") return at::kInt;
  if (n == "float64") return at::kDouble;
  throw Error("kforge.fusion: unsupported dtype " + n);
}

Dim3 to_dim3(const py::handle& h) {
  auto v = h.cast<std::vector<int64_t>>();
  Dim3 d;
  if (v.size() > 0) d.x = static_cast<unsigned>(v[0]);
  if (v.size() > 1) d.y = static_cast<unsigned>(v[1]);
  if (v.size() > 2) d.z = static_cast<unsigned>(v[2]);
  return d;
}

}  // namespace

GeneratedKernel::GeneratedKernel(std::string name, std::vector<ArgSpec> args, std::vector<OutSpec> outs,
                                 py::function generator)
    : name_(std::move(name)), args_(std::move(args)), outs_(std::move(outs)), generator_(std::move(generator)) {
  for (const auto& a : args_) n_tensors_ += a.is_tensor;
}

// Per tensor 2 bits (strided, unaligned), bit 56 for 64-bit offsets, bits 57.. the device: one
// integer compare per call instead of a string (host time per launch is the point of this class).
uint64_t GeneratedKernel::packed_key(const at::Tensor* tensors, size_t n, int device) const {
  uint64_t key = static_cast<uint64_t>(device) << 57;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    const bool contig = t.is_contiguous();
    if (!contig) {
      key |= uint64_t(1) << (2 * i);
      int64_t reach = 0;
      for (int64_t d = 0; d < t.dim(); ++d) reach += (t.size(d) - 1) * std::abs(t.stride(d));
      if (reach > INT_MAX) key |= uint64_t(1) << 56;
    }
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) key |= uint64_t(2) << (2 * i);
  }
  return key;
}

std::string GeneratedKernel::layout_key(const std::vector<at::Tensor>& tensors, int device) const {
  std::string key = "d" + std::to_string(device) + ":";
  bool wide = false;
  for (const auto& t : tensors) {
    const bool contig = t.is_contiguous();
    key += contig ? 'c' : 's';
    key += (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0 ? 'a' : 'u';
    if (!contig) {
      int64_t reach = 0;
      for (int64_t d = 0; d < t.dim(); ++d) reach += (t.size(d) - 1) * std::abs(t.stride(d));
      wide |= reach > INT_MAX;
    }
  }
  if (wide) key += 'L';
  return key;
}

std::shared_ptr<GeneratedVariant> GeneratedKernel::variant(const std::string& key, int device) {
  auto it = variants_.find(key);
  if (it != variants_.end()) return it->second;
  // The generator returns {"source", "program", "launches": [(kernel, grid, block, smem)], "workspace"}.
  py::dict spec = generator_(key.substr(key.find(':') + 1), device);
  auto v = std::make_shared<GeneratedVariant>();
  v->program = Program::from_source(spec["program"].cast<std::string>(), spec["source"].cast<std::string>());
  for (const auto& l : spec["launches"]) {
    auto launch = l.cast<py::tuple>();
    v->kernels.push_back(std::make_unique<Kernel>(*v->program, launch[0].cast<std::string>(),
                                                  std::vector<DType>{DType::f32}));
    v->launches.push_back({v->kernels.back().get(), to_dim3(launch[1]), to_dim3(launch[2]),
                           launch[3].cast<size_t>()});
  }
  v->workspace_bytes = spec["workspace"].cast<int64_t>();
  for (size_t i = 0, t = 0; i < args_.size(); ++i)
    if (args_[i].is_tensor) v->strided.push_back(key[key.find(':') + 1 + 2 * t++] == 's');
  {
    // Compile and load now, with the GIL released: other threads may compile meanwhile.
    py::gil_scoped_release release;
    for (auto& k : v->kernels) k->function(DType::f32, device);
  }
  variants_.emplace(key, v);
  return v;
}

// The region's output as a view of `t`, computed from sizes and strides only (no allocation, no
// exception on the way): false when a reshape would need a copy, as torch's reshape decides it.
bool GeneratedKernel::try_view(const at::Tensor& t, at::Tensor& out) const {
  at::DimVector sizes(t.sizes().begin(), t.sizes().end()), strides(t.strides().begin(), t.strides().end());
  int64_t offset = t.storage_offset();
  for (const auto& s : view_steps_) {
    switch (s.kind) {
      case ViewStep::kPermute: {
        at::DimVector ns(sizes.size()), nt(strides.size());
        for (size_t i = 0; i < s.perm_or_start.size(); ++i) {
          ns[i] = sizes[s.perm_or_start[i]];
          nt[i] = strides[s.perm_or_start[i]];
        }
        sizes = std::move(ns);
        strides = std::move(nt);
        break;
      }
      case ViewStep::kReshape: {
        at::DimVector shape(s.shape.begin(), s.shape.end());
        auto st = at::detail::computeStride(sizes, strides, shape);
        if (!st) return false;
        sizes = std::move(shape);
        strides = std::move(*st);
        break;
      }
      case ViewStep::kSlice:
        for (size_t d = 0; d < sizes.size(); ++d) {
          offset += s.perm_or_start[d] * strides[d];
          strides[d] *= s.step[d];
        }
        sizes.assign(s.shape.begin(), s.shape.end());
        break;
      case ViewStep::kContiguous: {
        if (std::find(sizes.begin(), sizes.end(), 0) != sizes.end()) break;  // no elements: contiguous
        int64_t expected = 1;
        for (size_t d = sizes.size(); d-- > 0;) {
          if (sizes[d] == 1) continue;
          if (strides[d] != expected) return false;
          expected *= sizes[d];
        }
        break;
      }
    }
  }
  out = t.as_strided(sizes, strides, offset);
  return true;
}

py::tuple GeneratedKernel::call(const py::args& args) {
  const char* op = "fusion";
  KF_CHECK(args.size() == args_.size(), op, name_, " takes ", args_.size(), " arguments, got ", args.size());
  std::vector<at::Tensor> tensors;
  tensors.reserve(n_tensors_);
  c10::SmallVector<double, 4> scalars;
  int device = -1;
  for (size_t i = 0; i < args_.size(); ++i) {
    const ArgSpec& spec = args_[i];
    if (!spec.is_tensor) {
      scalars.push_back(args[i].cast<double>());
      continue;
    }
    at::Tensor t = args[i].cast<at::Tensor>();
    KF_CHECK(t.is_cuda(), op, name_, ": input ", i, " must be a CUDA tensor, got ", t.device());
    KF_CHECK(t.scalar_type() == spec.dtype, op, name_, ": input ", i, " has dtype ", t.scalar_type(),
             ", the fusion was built for ", spec.dtype);
    KF_CHECK(t.sizes() == c10::IntArrayRef(spec.sizes), op, name_, ": input ", i, " has shape ", t.sizes(),
             ", the fusion was built for ", c10::IntArrayRef(spec.sizes));
    if (device < 0) device = t.get_device();
    KF_CHECK(t.get_device() == device, op, name_, ": inputs are on cuda:", device, " and ", t.device());
    tensors.push_back(std::move(t));
  }
  if (device < 0) device = default_device_ >= 0 ? default_device_ : static_cast<int>(c10::cuda::current_device());

  if (view_arg_ >= 0) {
    at::Tensor view;
    size_t ti = 0;  // the argument's position among the tensor inputs
    for (int i = 0; i < view_arg_; ++i) ti += args_[i].is_tensor;
    if (try_view(tensors[ti], view)) {
      c10::SmallVector<at::Tensor, 4> one;
      one.push_back(std::move(view));
      return assemble(args, one);
    }
  }

  c10::cuda::CUDAGuard guard(device);
  GeneratedVariant* v;
  if (tensors.size() <= 28) {
    const uint64_t key = packed_key(tensors.data(), tensors.size(), device);
    if (last_ && key == last_key_) {
      v = last_;
    } else {
      auto it = packed_.find(key);
      if (it == packed_.end()) it = packed_.emplace(key, variant(layout_key(tensors, device), device)).first;
      v = it->second.get();
      last_key_ = key;
      last_ = v;
    }
  } else {
    v = variant(layout_key(tensors, device), device).get();
  }

  c10::SmallVector<at::Tensor, 4> outputs;
  for (const auto& o : outs_) {
    at::Tensor t = at::detail::empty_cuda(o.sizes, o.dtype, at::Device(at::kCUDA, device), std::nullopt);
    if (poison_outputs()) {
      if (at::isFloatingType(t.scalar_type()))
        t.fill_(std::numeric_limits<double>::quiet_NaN());
      else
        t.view(at::kByte).fill_(0xFF);
    }
    outputs.push_back(std::move(t));
  }
  if (!v->launches.empty()) {
    at::Tensor workspace;
    if (v->workspace_bytes > 0)
      workspace = at::detail::empty_cuda({v->workspace_bytes}, at::kByte, at::Device(at::kCUDA, device), std::nullopt);
    // Kernel parameters, in the generator's order: per tensor input its pointer (and its strides when
    // strided), every output pointer, every scalar as double, then the workspace pointer.
    c10::SmallVector<void*, 16> ptrs;
    c10::SmallVector<int64_t, 16> strides;
    size_t n_strides = 0;
    for (size_t i = 0; i < tensors.size(); ++i)
      if (v->strided[i]) n_strides += tensors[i].dim();
    ptrs.reserve(tensors.size() + outputs.size() + 1);  // stable addresses: params point into these
    strides.reserve(n_strides);
    c10::SmallVector<void*, 32> params;
    for (size_t i = 0; i < tensors.size(); ++i) {
      ptrs.push_back(tensors[i].data_ptr());
      params.push_back(&ptrs.back());
      if (v->strided[i])
        for (int64_t d = 0; d < tensors[i].dim(); ++d) {
          strides.push_back(tensors[i].stride(d));
          params.push_back(&strides.back());
        }
    }
    for (auto& o : outputs) {
      ptrs.push_back(o.data_ptr());
      params.push_back(&ptrs.back());
    }
    for (auto& sc : scalars) params.push_back(&sc);
    ptrs.push_back(workspace.defined() ? workspace.data_ptr() : nullptr);
    params.push_back(&ptrs.back());
    params.push_back(nullptr);
    CUstream stream = reinterpret_cast<CUstream>(c10::cuda::getCurrentCUDAStream(device).stream());
    for (const auto& l : v->launches)
      l.kernel->launch_raw(DType::f32, device, stream, l.grid, l.block, l.smem, params.data());
  }
  return assemble(args, outputs);
}

py::tuple GeneratedKernel::assemble(const py::args& args, c10::SmallVector<at::Tensor, 4>& kernel_outs) const {
  if (out_map_.empty()) {
    py::tuple result(kernel_outs.size());
    for (size_t i = 0; i < kernel_outs.size(); ++i) result[i] = py::cast(std::move(kernel_outs[i]));
    return result;
  }
  // Outputs that are arguments are returned as the same Python objects; two outputs of one value
  // share its tensor (Thunder never writes into either).
  c10::SmallVector<py::object, 4> kernel_objs;
  for (auto& t : kernel_outs) kernel_objs.push_back(py::cast(std::move(t)));
  py::tuple result(out_map_.size());
  for (size_t i = 0; i < out_map_.size(); ++i) {
    const int64_t m = out_map_[i];
    result[i] = m >= 0 ? kernel_objs[m] : py::object(args[-m - 1]);
  }
  return result;
}

std::vector<std::string> GeneratedKernel::keys() const {
  std::vector<std::string> out;
  for (const auto& kv : variants_) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

void bind_generated(py::module_& m) {
  m.def(
      "compile_generated",
      [](const std::string& name, const std::string& source, const std::vector<std::string>& kernels, int arch) {
        // Kept alive: a later launch of the same source finds it in the memory cache.
        static std::vector<std::unique_ptr<Program>> keep;
        static std::mutex keep_mu;
        auto p = Program::from_source(name, source);
        for (const auto& k : kernels) p->add_expression(k);
        std::vector<std::string> lowered;
        {
          py::gil_scoped_release release;
          lowered = p->compile_for_arch(arch);
        }
        std::lock_guard<std::mutex> lock(keep_mu);
        keep.push_back(std::move(p));
        return lowered;
      },
      py::arg("name"), py::arg("source"), py::arg("kernels"), py::arg("arch"),
      "Compile a generated source for sm_<arch> (no GPU needed; memory and disk cache); returns lowered names.");
  py::class_<GeneratedKernel, std::shared_ptr<GeneratedKernel>>(m, "GeneratedKernel",
      "A fused region's kernel: specialised per input layout, compiled on first use, launched from C++.")
      .def(py::init([](std::string name, py::list args, py::list outs, py::function generator, int device,
                       std::vector<int64_t> out_map, py::object view) {
             std::vector<GeneratedKernel::ArgSpec> a;
             for (const auto& x : args) {
               GeneratedKernel::ArgSpec s;
               if (x.is_none()) {
                 s.is_tensor = false;
               } else {
                 auto t = x.cast<py::tuple>();  // (dtype, sizes)
                 s.dtype = dtype_from_name(t[0].cast<std::string>());
                 s.sizes = t[1].cast<std::vector<int64_t>>();
               }
               a.push_back(std::move(s));
             }
             std::vector<GeneratedKernel::OutSpec> o;
             for (const auto& x : outs) {
               auto t = x.cast<py::tuple>();
               o.push_back({t[1].cast<std::vector<int64_t>>(), dtype_from_name(t[0].cast<std::string>())});
             }
             auto k = std::make_shared<GeneratedKernel>(std::move(name), std::move(a), std::move(o), std::move(generator));
             k->set_default_device(device);
             k->set_out_map(out_map);
             if (!view.is_none()) {
               auto plan = view.cast<py::tuple>();  // (argument index, [(kind, ...), ...])
               std::vector<ViewStep> steps;
               for (const auto& x : plan[1]) {
                 auto st = x.cast<py::tuple>();
                 const auto kind = st[0].cast<std::string>();
                 ViewStep s;
                 if (kind == "permute") {
                   s.kind = ViewStep::kPermute;
                   s.perm_or_start = st[1].cast<std::vector<int64_t>>();
                 } else if (kind == "reshape") {
                   s.kind = ViewStep::kReshape;
                   s.shape = st[1].cast<std::vector<int64_t>>();
                 } else if (kind == "contiguous") {
                   s.kind = ViewStep::kContiguous;
                 } else if (kind == "slice") {
                   s.kind = ViewStep::kSlice;
                   s.perm_or_start = st[1].cast<std::vector<int64_t>>();
                   s.step = st[2].cast<std::vector<int64_t>>();
                   s.shape = st[3].cast<std::vector<int64_t>>();
                 } else {
                   throw Error("kforge.fusion: unknown view step " + kind);
                 }
                 steps.push_back(std::move(s));
               }
               k->set_view_plan(plan[0].cast<int>(), std::move(steps));
             }
             return k;
           }),
           py::arg("name"), py::arg("args"), py::arg("outputs"), py::arg("generator"), py::arg("device") = -1,
           py::arg("out_map") = std::vector<int64_t>{}, py::arg("view") = py::none(),
           "args: per argument (dtype name, sizes) for a tensor or None for a scalar; outputs: (dtype name, "
           "sizes) of what the kernel writes; out_map: per region output its kernel output (>= 0) or "
           "argument -(i + 1); view: (argument, steps) of a movement-only region, a view when strides allow.")
      .def("__call__", &GeneratedKernel::call)
      .def_property_readonly("name", &GeneratedKernel::name)
      .def("keys", &GeneratedKernel::keys, "Layout keys compiled so far (device:per-input flags).");
}

}  // namespace kforge
