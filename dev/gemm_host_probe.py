"""Host time of one GEMM call, by form: torch's (mm, matmul, F.linear) against kforge's cuBLASLt plans
(`_C.gemm_mm`, `gemm_linear`, `gemm_views` as the backward calls them), beside the pieces such a call is
made of (an output allocation, a reshape and a transpose). Shapes are tiny (64 x 64 x 64 by default)
so that each kernel takes less GPU time than its call takes host time: the loop is then bound by the
host, and its time per call is the host cost of the call. Each form is timed in rounds of `--calls`
back-to-back calls (perf_counter, no synchronisation inside a round); the median round is printed
with the wall time once the GPU has caught up (wall close to enqueue: the host was the bound).

GPU only: python3 dev/gemm_host_probe.py [--m 64 --k 64 --n 64] [--dtype bf16] [--calls 2000] [--rounds 7]
"""
import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kforge import _C
from kforge.ops import gemm


def per_call_us(fn, calls: int, rounds: int) -> tuple[float, float]:
    """(median enqueue us per call, wall us per call of that round)."""
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    rows = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        rows.append((1e6 * (t1 - t0) / calls, 1e6 * (t2 - t0) / calls))
    return sorted(rows)[len(rows) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=64, help="rows of the product (tokens: B * T)")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gemm_host_probe: needs a CUDA GPU")
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    m, k, n = args.m, args.k, args.n
    b_, t_ = 2, m // 2  # (B, T, features) activations, as the traces carry them
    x = torch.randn(b_, t_, k, device="cuda", dtype=dt)  # a layer's input
    w = torch.randn(n, k, device="cuda", dtype=dt)  # its weight (out, in)
    g = torch.randn(b_, t_, n, device="cuda", dtype=dt)  # the gradient of its output
    a2, w2 = x.view(-1, k), w.t()
    forms = {
        "torch.empty (the output's allocation)": lambda: torch.empty((m, n), device="cuda", dtype=dt),
        "x.reshape(-1, k).t() (two views)": lambda: x.reshape(-1, k).t(),
        "torch.mm(x2, w.t())": lambda: torch.mm(a2, w2),
        "torch.matmul(x2, w.t())": lambda: torch.matmul(a2, w2),
        "F.linear(x, w)": lambda: F.linear(x, w),
        "torch.matmul(g2.t(), x2) (weight grad, views in Python)": lambda: torch.matmul(
            torch.reshape(g, (-1, n)).t(), torch.reshape(x, (-1, k))),
        "_C.gemm_mm(x2, w.t())": lambda: _C.gemm_mm(a2, w2),
        "_C.gemm_linear(x, w, None)": lambda: _C.gemm_linear(x, w, None),
        "_C.gemm_views(g, n, T, x, k, F) (weight grad)": lambda: _C.gemm_views(g, n, True, x, k, False, None,
                                                                              False, None),
        "_C.gemm_views(g, n, F, w, k, F, out=(B, T, k)) (input grad)": lambda: _C.gemm_views(
            g, n, False, w, k, False, None, False, (b_, t_, k)),
    }
    print(f"{torch.cuda.get_device_name()} · torch {torch.__version__} · (m, k, n) = ({m}, {k}, {n}) {args.dtype}, "
          f"{args.calls} calls x {args.rounds} rounds")
    before = gemm.stats()
    width = max(len(name) for name in forms)
    for name, fn in forms.items():
        enq, wall = per_call_us(fn, args.calls, args.rounds)
        print(f"  {name:<{width}}  enqueue {enq:6.2f} us/call  wall {wall:6.2f} us/call")
    after = gemm.stats()
    print(f"plan calls {after['fast_calls'] - before['fast_calls']}, ATen fallbacks "
          f"{after['aten_calls'] - before['aten_calls']} (all plan calls expected)")


if __name__ == "__main__":
    main()
