// generated.h: GeneratedKernel, the launcher of kernels generated at run time (kforge.fusion).
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include <c10/util/SmallVector.h>

#include "torch_launch.h"

namespace kforge {

struct GeneratedLaunch {
  Kernel* kernel;
  Dim3 grid, block;
  size_t smem;
};

// One layout specialisation: its program, kernels and launches (in order), workspace bytes, and
// which tensor inputs take their strides as arguments.
struct GeneratedVariant {
  std::unique_ptr<Program> program;
  std::vector<std::unique_ptr<Kernel>> kernels;
  std::vector<GeneratedLaunch> launches;
  int64_t workspace_bytes = 0;
  std::vector<bool> strided;
};

// One step of a movement-only region applied to sizes / strides / offset: a permute, a reshape (a
// view only where torch's reshape would not copy), or a slice (start and step per dim).
struct ViewStep {
  // kContiguous: the view so far must be contiguous (a .contiguous() in the trace), else no view.
  enum Kind { kPermute, kReshape, kSlice, kContiguous } kind;
  std::vector<int64_t> perm_or_start, step, shape;
};

class GeneratedKernel {
 public:
  struct ArgSpec {
    bool is_tensor = true;
    at::ScalarType dtype = at::kFloat;
    std::vector<int64_t> sizes;
  };
  struct OutSpec {
    std::vector<int64_t> sizes;
    at::ScalarType dtype;
  };

  GeneratedKernel(std::string name, std::vector<ArgSpec> args, std::vector<OutSpec> outs,
                  pybind11::function generator);
  // Runs the region on its inputs (tensors and numbers, in the region's order); returns its outputs.
  pybind11::tuple call(const pybind11::args& args);
  const std::string& name() const { return name_; }
  std::vector<std::string> keys() const;
  void set_default_device(int d) { default_device_ = d; }
  // Region output i is kernel output out_map[i] (>= 0) or argument -(out_map[i] + 1) returned as is.
  void set_out_map(std::vector<int64_t> m) { out_map_ = std::move(m); }
  // A movement-only region: its output is argument `arg` through `steps` when the strides allow.
  void set_view_plan(int arg, std::vector<ViewStep> steps) {
    view_arg_ = arg;
    view_steps_ = std::move(steps);
  }

 private:
  std::string layout_key(const std::vector<at::Tensor>& tensors, int device) const;
  uint64_t packed_key(const at::Tensor* tensors, size_t n, int device) const;
  std::shared_ptr<GeneratedVariant> variant(const std::string& key, int device);
  bool try_view(const at::Tensor& t, at::Tensor& out) const;
  pybind11::tuple assemble(const pybind11::args& args, c10::SmallVector<at::Tensor, 4>& kernel_outs) const;

  std::string name_;
  std::vector<ArgSpec> args_;
  std::vector<OutSpec> outs_;
  pybind11::function generator_;
  size_t n_tensors_ = 0;
  int default_device_ = -1;
  std::unordered_map<std::string, std::shared_ptr<GeneratedVariant>> variants_;
  std::unordered_map<uint64_t, std::shared_ptr<GeneratedVariant>> packed_;  // same variants, by packed key
  uint64_t last_key_ = 0;
  GeneratedVariant* last_ = nullptr;  // the variant of the previous call (nearly always this one)
  std::vector<int64_t> out_map_;      // empty: region outputs are the kernel outputs
  int view_arg_ = -1;
  std::vector<ViewStep> view_steps_;
};

void bind_generated(pybind11::module_& m);

}  // namespace kforge
