"""Which cuBLAS kernel F.linear with a bias picks against a plain GEMM (+ a bias add), and the
backward's two GEMMs, at GPT-2 124M's four layer shapes, for M = 256 (B=4, T=64) and 8192 tokens,
fp32 and bf16. CUDA-event median of 50 single calls (small GEMMs include launch latency: read the
kernel names for the choice, the times for its size). Usage: python3 dev/linear_bias_probe.py
"""
import statistics

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


def timeit(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts) * 1000


def kernels(fn):
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name[:60] for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA})


def main():
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for m in (256, 8192):
        for dt in (torch.float32, torch.bfloat16):
            for k, n in ((768, 2304), (768, 768), (768, 3072), (3072, 768)):
                x = torch.randn(m, k, device="cuda", dtype=dt)
                w = torch.randn(n, k, device="cuda", dtype=dt) * 0.02
                b = torch.randn(n, device="cuda", dtype=dt)
                g = torch.randn(m, n, device="cuda", dtype=dt)
                cases = {
                    "F.linear + bias": lambda: F.linear(x, w, b),
                    "x @ w.T": lambda: x @ w.t(),
                    "x @ w.T + b": lambda: x @ w.t() + b,
                    "dx = g @ w": lambda: g @ w,
                    "dw = g.T @ x": lambda: g.t() @ x,
                }
                for name, fn in cases.items():
                    print(f"M={m} {str(dt)[6:]:8s} K={k:4d} N={n:4d} {name:16s} {timeit(fn):8.1f} us  {kernels(fn)}")


if __name__ == "__main__":
    main()
