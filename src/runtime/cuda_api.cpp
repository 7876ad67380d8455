#include "cuda_api.h"

#include <dlfcn.h>

#include <mutex>

#include "program.h"

namespace kforge {
namespace {

template <typename F>
void bind(void* lib, F& fn, const char* symbol, const std::string& libname) {
  fn = reinterpret_cast<F>(dlsym(lib, symbol));
  if (!fn) throw Error("kforge: symbol " + std::string(symbol) + " not found in " + libname);
}

std::string g_nvrtc_path;

}  // namespace

void check_cu(CUresult r, const std::string& what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = "CUDA_ERROR_UNKNOWN";
  const char* msg = "unknown error";
  driver().GetErrorName(r, &name);
  driver().GetErrorString(r, &msg);
  throw Error(what + ": " + name + ": " + msg);
}

const DriverApi& driver() {
  static DriverApi api;
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!lib) {
      failure = std::string("kforge: no CUDA driver (libcuda.so.1 could not be loaded: ") +
                dlerror() + "); a GPU and its driver are needed to launch kernels";
      return;
    }
    try {
      const std::string n = "libcuda.so.1";
      bind(lib, api.Init, "cuInit", n);
      bind(lib, api.GetErrorString, "cuGetErrorString", n);
      bind(lib, api.GetErrorName, "cuGetErrorName", n);
      bind(lib, api.DeviceGet, "cuDeviceGet", n);
      bind(lib, api.DeviceGetCount, "cuDeviceGetCount", n);
      bind(lib, api.DeviceGetAttribute, "cuDeviceGetAttribute", n);
      bind(lib, api.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", n);
      bind(lib, api.CtxPushCurrent, "cuCtxPushCurrent_v2", n);
      bind(lib, api.CtxPopCurrent, "cuCtxPopCurrent_v2", n);
      bind(lib, api.ModuleLoadData, "cuModuleLoadData", n);
      bind(lib, api.ModuleGetFunction, "cuModuleGetFunction", n);
      bind(lib, api.FuncSetAttribute, "cuFuncSetAttribute", n);
      bind(lib, api.LaunchKernel, "cuLaunchKernel", n);
      api.LaunchKernelEx =
          reinterpret_cast<decltype(api.LaunchKernelEx)>(dlsym(lib, "cuLaunchKernelEx"));
    } catch (const Error& e) {
      failure = e.what();
      return;
    }
    CUresult r = api.Init(0);
    if (r != CUDA_SUCCESS) {
      const char* msg = "unknown error";
      api.GetErrorString(r, &msg);
      failure = std::string("kforge: no usable CUDA device (cuInit failed: ") + msg + ")";
    }
  });
  if (!failure.empty()) throw Error(failure);
  return api;
}

const NvrtcApi& nvrtc() {
  static NvrtcApi api;
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    void* lib = nullptr;
    std::string tried;
    for (const auto& path : config().nvrtc_paths) {
      lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
      if (lib) {
        g_nvrtc_path = path;
        break;
      }
      tried += "\n  " + path + ": " + dlerror();
    }
    if (!lib) {
      failure = "kforge: NVRTC not found. Install a CUDA build of torch (it depends on the "
                "nvidia NVRTC wheel) or the CUDA toolkit, or set KFORGE_NVRTC=/path/libnvrtc.so. "
                "Tried:" + tried;
      return;
    }
    try {
      const std::string& n = g_nvrtc_path;
      bind(lib, api.Version, "nvrtcVersion", n);
      bind(lib, api.GetErrorString, "nvrtcGetErrorString", n);
      bind(lib, api.GetNumSupportedArchs, "nvrtcGetNumSupportedArchs", n);
      bind(lib, api.GetSupportedArchs, "nvrtcGetSupportedArchs", n);
      bind(lib, api.CreateProgram, "nvrtcCreateProgram", n);
      bind(lib, api.DestroyProgram, "nvrtcDestroyProgram", n);
      bind(lib, api.AddNameExpression, "nvrtcAddNameExpression", n);
      bind(lib, api.CompileProgram, "nvrtcCompileProgram", n);
      bind(lib, api.GetProgramLogSize, "nvrtcGetProgramLogSize", n);
      bind(lib, api.GetProgramLog, "nvrtcGetProgramLog", n);
      bind(lib, api.GetCUBINSize, "nvrtcGetCUBINSize", n);
      bind(lib, api.GetCUBIN, "nvrtcGetCUBIN", n);
      bind(lib, api.GetLoweredName, "nvrtcGetLoweredName", n);
    } catch (const Error& e) {
      failure = e.what();
      return;
    }
    // Queued: flushed to logging.getLogger("kforge") once the caller holds no runtime lock.
    int major = 0, minor = 0;
    api.Version(&major, &minor);
    log(kInfo, "kforge: loaded NVRTC " + std::to_string(major) + "." + std::to_string(minor) +
                   " from " + g_nvrtc_path);
    if (!tried.empty()) log(kDebug, "kforge: NVRTC candidates that did not load:" + tried);
  });
  if (!failure.empty()) throw Error(failure);
  return api;
}

const std::string& nvrtc_path() {
  nvrtc();
  return g_nvrtc_path;
}

}  // namespace kforge
