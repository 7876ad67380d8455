// guards.cpp: InputGuard. Before every call of a jitted module Thunder's prologue checks that the
// cached trace still applies: every number it read has the traced type and value, every tensor the
// traced shape, device, dtype and requires_grad, every string the traced one. For a GPT-2 that is
// about 80 numbers, 13 strings and 150 tensors, and the Python comparisons cost about 100 us of host
// time per call, during which the GPU waits when a step starts from an idle GPU. Here they are one
// pass over the three tuples.
//
// matches() answers only "certainly the same": a difference, a NaN, a tensor subclass or a tensor
// without plain sizes returns false, and the Python checks (kforge.prologue.check_all) decide and
// raise Thunder's error.
#include "runtime/guards.h"

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <string>
#include <vector>

namespace py = pybind11;

namespace kforge {
namespace {

struct TensorSpec {
  std::vector<int64_t> shape;
  c10::Device device;
  c10::ScalarType dtype;
  bool requires_grad;
};

class InputGuard {
 public:
  // values: the traced numbers; specs: (shape, device string, torch.dtype, requires_grad) per tensor;
  // tensor_types: the Python types taken as plain tensors (torch.Tensor, nn.Parameter); strings: the
  // traced strings (compared for equality only, as Thunder does).
  InputGuard(py::tuple values, py::sequence specs, py::sequence tensor_types, py::tuple strings)
      : values_(std::move(values)), strings_(std::move(strings)) {
    for (py::handle v : strings_) {
      if (!PyUnicode_CheckExact(v.ptr())) throw py::type_error("InputGuard: strings must hold str");
    }
    for (py::handle t : tensor_types) {
      if (!PyType_Check(t.ptr())) throw py::type_error("InputGuard: tensor_types must hold types");
      types_.push_back(reinterpret_cast<PyTypeObject*>(t.ptr()));
    }
    types_holder_ = py::reinterpret_borrow<py::object>(tensor_types);
    specs_.reserve(py::len(specs));
    for (py::handle s : specs) {
      auto spec = py::reinterpret_borrow<py::sequence>(s);
      if (py::len(spec) != 4) throw py::value_error("InputGuard: a spec is (shape, device, dtype, requires_grad)");
      py::object dtype = spec[2];
      if (!THPDtype_Check(dtype.ptr())) throw py::type_error("InputGuard: a spec's dtype must be a torch.dtype");
      specs_.push_back(TensorSpec{spec[0].cast<std::vector<int64_t>>(), c10::Device(spec[1].cast<std::string>()),
                                  reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type, spec[3].cast<bool>()});
    }
  }

  bool matches(py::handle numbers, py::handle tensors, py::handle strings) const {
    PyObject* nums = numbers.ptr();
    PyObject* ts = tensors.ptr();
    PyObject* strs = strings.ptr();
    if (!PyTuple_Check(nums) || !PyTuple_Check(ts) || !PyTuple_Check(strs)) return false;
    const Py_ssize_t ns = PyTuple_GET_SIZE(strs);
    if (ns != PyTuple_GET_SIZE(strings_.ptr())) return false;
    for (Py_ssize_t i = 0; i < ns; ++i) {
      PyObject* got = PyTuple_GET_ITEM(strs, i);
      PyObject* want = PyTuple_GET_ITEM(strings_.ptr(), i);
      // a str subclass may define its own ==: the Python checks decide
      if (got != want && (!PyUnicode_CheckExact(got) || PyUnicode_Compare(got, want) != 0)) return false;
    }
    const Py_ssize_t n = PyTuple_GET_SIZE(nums);
    if (n != PyTuple_GET_SIZE(values_.ptr())) return false;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* got = PyTuple_GET_ITEM(nums, i);
      PyObject* want = PyTuple_GET_ITEM(values_.ptr(), i);
      if (got == want) continue;
      if (Py_TYPE(got) != Py_TYPE(want)) return false;  // 1 == 1.0 == True: types first
      const int eq = PyObject_RichCompareBool(got, want, Py_EQ);
      if (eq != 1) {
        if (eq < 0) PyErr_Clear();
        return false;
      }
    }
    if (PyTuple_GET_SIZE(ts) != static_cast<Py_ssize_t>(specs_.size())) return false;
    for (size_t i = 0; i < specs_.size(); ++i) {
      PyObject* o = PyTuple_GET_ITEM(ts, static_cast<Py_ssize_t>(i));
      bool plain = false;
      for (PyTypeObject* t : types_) plain = plain || Py_TYPE(o) == t;
      if (!plain) return false;
      const at::Tensor& t = THPVariable_Unpack(o);
      const TensorSpec& s = specs_[i];
      if (t.is_nested() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
      if (t.scalar_type() != s.dtype || t.device() != s.device || t.requires_grad() != s.requires_grad) return false;
      const c10::IntArrayRef sizes = t.sizes();
      if (sizes.size() != s.shape.size() || !std::equal(sizes.begin(), sizes.end(), s.shape.begin())) return false;
    }
    return true;
  }

 private:
  py::tuple values_;
  py::tuple strings_;
  std::vector<TensorSpec> specs_;
  std::vector<PyTypeObject*> types_;
  py::object types_holder_;  // keeps the types alive
};

// Whether any of `args` is a functorch grad wrapper (torch.func.grad / vjp's wrapped tensors): only
// then has torch's autograd.Function.apply anything to unwrap (its unwrap_dead_wrappers), a Python
// call per argument that kforge's autograd link skips otherwise (kforge/lookasides.py).
bool has_grad_wrapper(py::handle args) {
  PyObject* t = args.ptr();
  if (!PyTuple_Check(t)) return true;  // not what the link passes: take torch's path
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t); ++i) {
    PyObject* o = PyTuple_GET_ITEM(t, i);
    if (THPVariable_Check(o) && THPVariable_Unpack(o).key_set().has(c10::DispatchKey::FuncTorchGradWrapper)) {
      return true;
    }
  }
  return false;
}

}  // namespace

void bind_guards(py::module_& m) {
  m.def("has_grad_wrapper", &has_grad_wrapper, py::arg("args"),
        "Whether any item of the tuple `args` is a functorch grad-wrapped tensor (True for a non-tuple).");
  py::class_<InputGuard>(m, "InputGuard",
                         "The comparisons of Thunder's prologue checks in one pass (kforge.prologue.InputChecks).")
      .def(py::init<py::tuple, py::sequence, py::sequence, py::tuple>(), py::arg("values"), py::arg("specs"),
           py::arg("tensor_types"), py::arg("strings"))
      .def("matches", &InputGuard::matches, py::arg("numbers"), py::arg("tensors"), py::arg("strings"),
           "True when every number has the type and value of its traced value, every tensor is a plain "
           "tensor with its spec's shape, device, dtype and requires_grad and every string is a str equal "
           "to its traced one; False when anything may differ.");
}

}  // namespace kforge
