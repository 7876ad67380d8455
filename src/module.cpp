// module.cpp: the kforge._C Python module. Runtime bindings here; each op binds itself
// (KFORGE_BIND_OP in src/ops/<op>.cpp) and is added below.
#include <torch/extension.h>

#include "runtime/cuda_api.h"
#include "runtime/generated.h"
#include "runtime/guards.h"
#include "runtime/torch_launch.h"

namespace py = pybind11;
using namespace kforge;

namespace {

// Programs built from Python (tests, user experiments) are kept alive here.
std::vector<std::unique_ptr<Program>>& user_programs() {
  static std::vector<std::unique_ptr<Program>> v;
  return v;
}

py::dict stats_to_dict(const CacheStats& s) {
  py::dict d;
  d["memory_hits"] = s.memory_hits;
  d["memory_misses"] = s.memory_misses;
  d["disk_hits"] = s.disk_hits;
  d["disk_misses"] = s.disk_misses;
  d["disk_corrupt"] = s.disk_corrupt;
  d["nvrtc_compiles"] = s.nvrtc_compiles;
  d["disk_write_failures"] = s.disk_write_failures;
  py::list entries;
  for (const auto& e : s.entries) {
    py::dict x;
    x["name"] = e.name;
    x["arch"] = e.arch;
    x["source"] = e.source;
    x["compile_ms"] = e.compile_ms;
    x["cubin_bytes"] = e.cubin_bytes;
    x["parts"] = e.parts;
    entries.append(x);
  }
  d["entries"] = entries;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "kforge runtime: NVRTC compilation, kernel cache and launchers";

  static py::exception<Error> error(m, "KforgeError", PyExc_RuntimeError);
  static py::exception<CompileError> compile_error(m, "KernelCompileError", error.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const CompileError& e) {
      PyErr_SetString(compile_error.ptr(), e.what());
    } catch (const Error& e) {
      PyErr_SetString(error.ptr(), e.what());
    }
  });

  m.def(
      "configure",
      [](const std::string& kernel_dir, const std::string& cache_dir, bool disk_cache,
         const std::vector<std::string>& nvrtc_paths, bool dependent_launch) {
        Config& c = config();
        c.kernel_dir = kernel_dir;
        c.nvrtc_paths = nvrtc_paths;
        c.dependent_launch = dependent_launch;
        set_disk_cache(cache_dir, disk_cache);
      },
      py::arg("kernel_dir"), py::arg("cache_dir"), py::arg("disk_cache"), py::arg("nvrtc_paths"),
      py::arg("dependent_launch") = true);
  m.def("set_cache", &set_disk_cache, py::arg("cache_dir"), py::arg("disk_cache"));
  m.def(
      "set_log_handler",
      [](py::object fn) {
        // Called by flush_log(), with no runtime lock held; the GIL may be released there.
        static py::object* handler = new py::object();  // leaked: outlives interpreter teardown
        *handler = fn;
        set_log_handler([](int level, const std::string& msg) {
          py::gil_scoped_acquire gil;
          try {
            (*handler)(level, msg);
          } catch (py::error_already_set& e) {
            e.discard_as_unraisable("kforge log handler");
          }
        });
      },
      py::arg("handler"), "handler(level, message): the runtime's log messages and warnings.");
  m.def(
      "set_poison_outputs", [](bool on) { poison_outputs() = on; }, py::arg("on"),
      "Test aid: fill every launcher output with NaN before the kernel writes it.");
  m.def("cache_info", [] { return stats_to_dict(cache_stats()); });
  m.def("clear_memory_cache", &clear_memory_cache);
  m.def("reset_cache_stats", &reset_cache_stats);
  m.def("nvrtc_version", &nvrtc_version);
  m.def("nvrtc_library", &nvrtc_library_path);
  m.def("nvrtc_supported_archs", &nvrtc_supported_archs);
  m.def("device_arch", &device_arch, py::arg("device"));
  m.def("programs", [] {
    std::vector<std::string> names;
    for (Program* p : all_programs()) names.push_back(p->name());
    return names;
  });
  m.def(
      "kernel_coverage",
      [] {
        std::vector<std::tuple<std::string, std::string, bool>> out;
        for (Program* p : all_programs()) {
          std::vector<bool> used = p->resolved_expressions();
          const auto& exprs = p->name_expressions();
          for (size_t i = 0; i < exprs.size(); ++i) out.emplace_back(p->name(), exprs[i], used[i]);
        }
        return out;
      },
      "[(program, name expression, launched)] for every shipped kernel instantiation: launched means "
      "its handle was resolved on some device in this process (on its first launch).");
  m.def(
      "compile",
      [](const std::string& name, int arch) {
        Program* p = find_program(name);
        if (!p) throw Error("kforge: unknown kernel \"" + name + "\"");
        py::gil_scoped_release release;
        return p->compile_for_arch(arch);
      },
      py::arg("name"), py::arg("arch"),
      "Compile (or fetch from cache) a shipped kernel for sm_<arch>; returns lowered names.");
  m.def(
      "name_expressions",
      [](const std::string& name) {
        Program* p = find_program(name);
        if (!p) throw Error("kforge: unknown kernel \"" + name + "\"");
        return p->name_expressions();
      },
      py::arg("name"));
  m.def(
      "compile_source",
      [](const std::string& name, const std::string& kernel_dir,
         const std::vector<std::string>& exprs, int arch, bool fast_math) {
        ProgramOptions o;
        o.fast_math = fast_math;
        user_programs().push_back(std::make_unique<Program>(name, o, false, kernel_dir));
        Program& p = *user_programs().back();
        for (const auto& e : exprs) p.add_expression(e);
        py::gil_scoped_release release;
        return p.compile_for_arch(arch);
      },
      py::arg("name"), py::arg("kernel_dir"), py::arg("name_expressions"), py::arg("arch"),
      py::arg("fast_math") = false,
      "Compile <kernel_dir>/<name>.cu for sm_<arch> (tests and experiments); returns lowered names.");

  bind_generated(m);
  bind_guards(m);
  for (const auto& [name, bind] : op_bindings()) bind(m);
}
