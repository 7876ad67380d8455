// cuda_api.h: the CUDA driver and NVRTC, loaded with dlopen at run time.
//
// Nothing is linked at build time, so `import kforge` works on a machine without a driver, and a
// machine with only the driver and a CUDA torch wheel (which ships libnvrtc) can run kforge.
#pragma once

#include <cuda.h>
#include <nvrtc.h>

#include <string>

namespace kforge {

struct DriverApi {
  CUresult (*Init)(unsigned int);
  CUresult (*GetErrorString)(CUresult, const char**);
  CUresult (*GetErrorName)(CUresult, const char**);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DeviceGetCount)(int*);
  CUresult (*DeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*CtxPushCurrent)(CUcontext);
  CUresult (*CtxPopCurrent)(CUcontext*);
  CUresult (*ModuleLoadData)(CUmodule*, const void*);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, CUstream, void**, void**);
  // Optional (null when the driver predates it): launches with attributes, for dependent launches.
  CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
};

struct NvrtcApi {
  nvrtcResult (*Version)(int*, int*);
  const char* (*GetErrorString)(nvrtcResult);
  nvrtcResult (*GetNumSupportedArchs)(int*);
  nvrtcResult (*GetSupportedArchs)(int*);
  nvrtcResult (*CreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                               const char* const*);
  nvrtcResult (*DestroyProgram)(nvrtcProgram*);
  nvrtcResult (*AddNameExpression)(nvrtcProgram, const char*);
  nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetProgramLog)(nvrtcProgram, char*);
  nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetCUBIN)(nvrtcProgram, char*);
  nvrtcResult (*GetLoweredName)(nvrtcProgram, const char*, const char**);
};

// Loaded on first use (thread-safe); throw kforge::Error naming what is missing and where it looked.
const DriverApi& driver();  // also calls cuInit(0) once
const NvrtcApi& nvrtc();
const std::string& nvrtc_path();

// Throws kforge::Error("<what>: <CUDA error name>: <message>") when r != CUDA_SUCCESS.
void check_cu(CUresult r, const std::string& what);

}  // namespace kforge
