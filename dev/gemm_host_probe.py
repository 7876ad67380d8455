"""Host time of the pieces of one GEMM call on cuBLASLt, measured in C++ (no Python in the loop).

    python3 dev/gemm_host_probe.py [--calls 1000]

Builds a small extension (torch.utils.cpp_extension.load_inline, linked with cuBLASLt) that times,
per call: torch's allocation of the output (at::empty), the lookups kforge.ops.gemm makes before a
launch (device guard, current stream, torch's cuBLASLt handle and workspace, the matmul precision
settings), cublasLtMatmul itself on a plan made once (what a cached plan costs at launch), and
at::mm / at::mm_out through the dispatcher, at a tiny shape (64^3, host-bound) and at the plain
Llama's q-projection shape (8192 x 768 x 768), bf16. Beside them, from Python: kforge._C.gemm_mm,
torch.mm and kforge._C.axpy (a pybind11 launch). The GPU is synchronised before each piece; the
large shape uses fewer calls so the launch queue never fills. Write-up: docs/experiments/users-models.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>
#include <chrono>

namespace {
using clk = std::chrono::steady_clock;

template <class F>
double per_call_us(int n, F&& f) {
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  for (int i = 0; i < 10; ++i) f();
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  const auto t0 = clk::now();
  for (int i = 0; i < n; ++i) f();
  const double us = std::chrono::duration<double, std::micro>(clk::now() - t0).count() / n;
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  return us;
}

#define LT(x) TORCH_CHECK((x) == CUBLAS_STATUS_SUCCESS, #x)
}  // namespace

pybind11::dict probe(at::Tensor a, at::Tensor b, int64_t n) {
  // a (m, k), b (k, n) row-major bf16: D = A @ B as cuBLAS's column-major D^T = B^T A^T.
  pybind11::dict r;
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::Tensor d = at::empty({M, N}, a.options());
  volatile uintptr_t sink = 0;
  r["at::empty (output)"] = per_call_us(n, [&] { sink += (uintptr_t)at::empty({M, N}, a.options()).data_ptr(); });
  r["CUDAGuard"] = per_call_us(n, [&] { c10::cuda::CUDAGuard g(a.device()); });
  r["getCurrentCUDAStream"] = per_call_us(n, [&] { sink += (uintptr_t)c10::cuda::getCurrentCUDAStream(a.get_device()).stream(); });
  r["getCurrentCUDABlasLtHandle"] = per_call_us(n, [&] { sink += (uintptr_t)at::cuda::getCurrentCUDABlasLtHandle(); });
  r["getCUDABlasLtWorkspace"] = per_call_us(n, [&] { sink += (uintptr_t)at::cuda::getCUDABlasLtWorkspace(); });
  r["getCUDABlasLtWorkspaceSize"] = per_call_us(n, [&] { sink += at::cuda::getCUDABlasLtWorkspaceSize(); });
  r["allowBF16ReductionCuBLAS"] = per_call_us(n, [&] { sink += (int)at::globalContext().allowBF16ReductionCuBLAS(); });
  r["data_ptr x3 + sizes/strides"] = per_call_us(n, [&] {
    sink += (uintptr_t)a.data_ptr() + (uintptr_t)b.data_ptr() + (uintptr_t)d.data_ptr() + a.size(0) + a.stride(0) +
            b.size(1) + b.stride(0) + d.stride(0);
  });

  cublasLtHandle_t h = at::cuda::getCurrentCUDABlasLtHandle();
  cublasLtMatmulDesc_t desc;
  LT(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  cublasOperation_t op = CUBLAS_OP_N;
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op, sizeof op));
  LT(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op, sizeof op));
  cublasLtMatrixLayout_t la, lb, ld;
  LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, N, K, N));
  LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K));
  LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, N, M, N));
  cublasLtMatmulPreference_t pref;
  LT(cublasLtMatmulPreferenceCreate(&pref));
  uint64_t wsmax = at::cuda::getCUDABlasLtWorkspaceSize();
  LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsmax, sizeof wsmax));
  cublasLtMatmulHeuristicResult_t res[8];
  int found = 0;
  LT(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, ld, ld, pref, 8, res, &found));
  TORCH_CHECK(found > 0, "no algorithm");
  void* ws = at::cuda::getCUDABlasLtWorkspace();
  const float one = 1.f, zero = 0.f;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(a.get_device()).stream();
  for (int i = 0; i < found; ++i) {
    const auto& algo = res[i].algo;
    const size_t wsz = res[i].workspaceSize;
    r[("cublasLtMatmul, heuristic #" + std::to_string(i) + ", workspace " + std::to_string(wsz)).c_str()] =
        per_call_us(n, [&] {
          LT(cublasLtMatmul(h, desc, &one, b.data_ptr(), la, a.data_ptr(), lb, &zero, d.data_ptr(), ld,
                            d.data_ptr(), ld, &algo, ws, wsz, stream));
        });
    if (i == 2) break;
  }
  r["at::mm"] = per_call_us(n, [&] { sink += (uintptr_t)at::mm(a, b).data_ptr(); });
  r["at::mm_out"] = per_call_us(n, [&] { at::mm_out(d, a, b); });
  return r;
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    ext = load_inline("gemm_host_probe", cpp_sources=SOURCE, functions=["probe"], with_cuda=True,
                      extra_ldflags=["-lcublasLt"], verbose=False)
    import kforge
    from kforge import _C

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for m, k, n, calls in ((64, 64, 64, args.calls), (8192, 768, 768, max(50, args.calls // 10))):
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        r = dict(ext.probe(a, b, calls))

        def py(fn, reps=calls):
            torch.cuda.synchronize()
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            us = (time.perf_counter() - t0) / reps * 1e6
            torch.cuda.synchronize()
            return us

        r["python: kforge._C.gemm_mm"] = py(lambda: _C.gemm_mm(a, b))
        r["python: torch.mm"] = py(lambda: torch.mm(a, b))
        x = torch.randn(1024, device="cuda")
        y = torch.randn(1024, device="cuda")
        r["python: kforge._C.axpy (1024)"] = py(lambda: _C.axpy(x, y, 2.0)) if hasattr(_C, "axpy") else None
        out["shapes"][f"{m}x{k}x{n}"] = r
        print(f"\n## {m} x {k} x {n} bf16, {torch.cuda.get_device_name()}, {calls} calls")
        for name, us in r.items():
            print(f"  {name:55s} {us:8.2f} us" if us is not None else f"  {name:55s}      n/a")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
