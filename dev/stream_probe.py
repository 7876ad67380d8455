"""How fast can any kernel stream a given number of bytes on this GPU, at the sizes of the bench's
small kernels? Hand-written copy (1 read + 1 write) and add (2 reads + 1 write) kernels, 16-byte
units, several launch shapes, with and without programmatic dependent launch (PDL: each call may be
scheduled while the previous one drains, and waits on griddepcontrol.wait before touching memory),
timed like `python -m kforge.bench ops` (back-to-back calls, inputs rotated through more than L2).
GPU only (builds with nvcc through torch.utils.cpp_extension): python dev/stream_probe.py"""
import torch
from torch.utils.cpp_extension import load_inline

from kforge.bench.harness import copy_bandwidth_gbs, same_size_copy_us, time_op

SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime.h>

template <int NIN, int U, int PDL>
__global__ void __launch_bounds__(256) stream_k(const int4* __restrict__ a, const int4* __restrict__ b,
                                                int4* __restrict__ c, long long n) {
  if (PDL >= 1) asm volatile("griddepcontrol.wait;" ::: "memory");
  if (PDL >= 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const long long stride = (long long)gridDim.x * 256 * U;
  for (long long i = (long long)blockIdx.x * 256 * U + threadIdx.x; i < n; i += stride) {
    int4 va[U], vb[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long j = i + u * 256;
      if (j < n) { va[u] = __ldcs(a + j); if (NIN == 2) vb[u] = __ldcs(b + j); }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long j = i + u * 256;
      if (j < n) {
        int4 r = va[u];
        if (NIN == 2) {  // bf16x8 add, done as float to cost what a real kernel costs
          unsigned* pa = reinterpret_cast<unsigned*>(&r);
          const unsigned* pb = reinterpret_cast<const unsigned*>(&vb[u]);
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            float lo = __uint_as_float(pa[k] << 16) + __uint_as_float(pb[k] << 16);
            float hi = __uint_as_float(pa[k] & 0xffff0000u) + __uint_as_float(pb[k] & 0xffff0000u);
            pa[k] = (__float_as_uint(lo) >> 16) | (__float_as_uint(hi) & 0xffff0000u);
          }
        }
        __stcs(c + j, r);
      }
    }
  }
}

template <int NIN, int U, int PDL>
void launch(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& c, long long grid) {
  const long long n = c.numel() * c.element_size() / 16;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3((unsigned)grid);
  cfg.blockDim = dim3(256);
  cfg.stream = at::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = PDL ? 1 : 0;
  auto err = cudaLaunchKernelEx(&cfg, stream_k<NIN, U, PDL>, (const int4*)a.data_ptr(),
                                (const int4*)b.data_ptr(), (int4*)c.data_ptr(), n);
  TORCH_CHECK(err == cudaSuccess, cudaGetErrorString(err));
}

void run(torch::Tensor a, torch::Tensor b, torch::Tensor c, int64_t nin, int64_t u, int64_t pdl, int64_t grid) {
#define KF_CASE(NI, UU, P) if (nin == NI && u == UU && pdl == P) return launch<NI, UU, P>(a, b, c, grid);
#define KF_U(NI, P) KF_CASE(NI, 1, P) KF_CASE(NI, 2, P) KF_CASE(NI, 4, P) KF_CASE(NI, 8, P)
  KF_U(1, 0) KF_U(1, 1) KF_U(1, 2) KF_U(2, 0) KF_U(2, 1) KF_U(2, 2)
  TORCH_CHECK(false, "no such instantiation");
}

int64_t max_blocks(int64_t nin, int64_t u) {
  int nb = 0;
#define KF_OCC(NI, UU) if (nin == NI && u == UU) cudaOccupancyMaxActiveBlocksPerMultiprocessor(&nb, stream_k<NI, UU, 0>, 256, 0);
  KF_OCC(1, 1) KF_OCC(1, 2) KF_OCC(1, 4) KF_OCC(1, 8) KF_OCC(2, 1) KF_OCC(2, 2) KF_OCC(2, 4) KF_OCC(2, 8)
  return nb;
}
"""

mod = load_inline("stream_probe", cpp_sources="void run(torch::Tensor a, torch::Tensor b, torch::Tensor c, int64_t nin, int64_t u, int64_t pdl, int64_t grid);\nint64_t max_blocks(int64_t nin, int64_t u);",
                  cuda_sources=SRC, functions=["run", "max_blocks"], extra_cuda_cflags=["-O3", "-arch=sm_90"],
                  verbose=False)

bw = copy_bandwidth_gbs()
props = torch.cuda.get_device_properties(0)
sms, l2 = props.multi_processor_count, props.L2_cache_size
print(f"{props.name}: copy bandwidth {bw:.0f} GB/s (1 GiB torch copy_), {sms} SMs, L2 {l2 >> 20} MiB")
# (label, inputs, bytes of each tensor): the bench's layernorm fwd / permute (25.2 MB moved), layernorm
# bwd (37.7), rmsnorm fwd (134) and bwd (201) traffic.
for label, nin, each in [("copy 8192x768 bf16", 1, 8192 * 768 * 2), ("add 8192x768 bf16", 2, 8192 * 768 * 2),
                         ("copy 8192x4096 bf16", 1, 8192 * 4096 * 2), ("add 8192x4096 bf16", 2, 8192 * 4096 * 2)]:
    moved = each * (nin + 1)
    nsets = max(1, min(16, -(-2 * l2 // moved)))
    sets = [tuple(torch.randn(each // 2, device="cuda", dtype=torch.bfloat16) for _ in range(3)) for _ in range(nsets)]
    ideal = moved / bw / 1e3
    tc = same_size_copy_us(moved, l2)
    print(f"\n{label}: {moved / 1e6:.1f} MB moved, at copy bandwidth {ideal:.2f} us; torch copy_ of as many bytes {tc:.2f} us ({100 * ideal / tc:.0f}%)")
    n16 = each // 16
    best = {}
    for u in (1, 2, 4, 8):
        full = -(-n16 // (256 * u))
        occ = mod.max_blocks(nin, u)
        for gname, grid in [("full", full), ("1/SM", sms), ("occ/SM", min(full, sms * occ))]:
            cells = []
            for pdl in (0, 1, 2):
                us = time_op(lambda a, b, c: mod.run(a, b, c, nin, u, pdl, grid), sets)
                best[pdl] = min(best.get(pdl, 1e9), us)
                cells.append(f"pdl{pdl} {us:6.2f} us {100 * ideal / us:4.0f}%")
            print(f"  U={u} grid {gname:6s}={grid:6d}: " + " | ".join(cells), flush=True)
    for (a, b, c) in sets[:1]:  # the kernel is right: c == a (+ b)
        mod.run(a, b, c, nin, 4, 2, sms)
        if nin == 1:
            assert torch.equal(c, a), label
        else:  # the kernel truncates to bf16, torch rounds: one bf16 ulp apart at most
            torch.testing.assert_close(c.float(), a.float() + b.float(), rtol=1.6e-2, atol=1e-6)
    print("  best: " + " | ".join(f"pdl{p} {t:.2f} us ({100 * ideal / t:.0f}%)" for p, t in best.items()))
    del sets
    torch.cuda.empty_cache()
