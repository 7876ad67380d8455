// guards.h: InputGuard, the comparisons of Thunder's prologue (kforge/prologue.py) in one C++ pass.
#pragma once

#include <pybind11/pybind11.h>

namespace kforge {

// Binds kforge._C.InputGuard.
void bind_guards(pybind11::module_& m);

}  // namespace kforge
