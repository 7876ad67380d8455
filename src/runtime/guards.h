// guards.h: InputGuard, the comparisons of Thunder's prologue (kforge/prologue.py) in one C++ pass,
// and the functorch test of kforge's autograd link (kforge/lookasides.py).
#pragma once

#include <pybind11/pybind11.h>

namespace kforge {

// Binds kforge._C.InputGuard and kforge._C.has_grad_wrapper.
void bind_guards(pybind11::module_& m);

}  // namespace kforge
