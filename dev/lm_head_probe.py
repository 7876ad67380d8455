"""Why kforge pads GPT-2's lm_head (python/kforge/ops/linear.py): cuBLAS GEMM time of the lm_head
(x 8192 x 768, weight V x 768) at V = 50257 against the padded 50304, forward and both backward
GEMMs, and what kforge's padded linear costs end to end. Medians of 20 CUDA-event timings.

    python dev/lm_head_probe.py
"""
import torch
import torch.nn.functional as F

from kforge.ops.linear import linear_backward_impl, linear_forward_impl, padded


def median_ms(f, n: int = 20) -> float:
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        s.record()
        f()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[n // 2]


def main() -> None:
    m, k, v = 8192, 768, 50257
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        x = torch.randn(m, k, device="cuda", dtype=dt)
        for n in (v, padded(v)):
            w = torch.randn(n, k, device="cuda", dtype=dt)
            g = torch.randn(m, n, device="cuda", dtype=dt)
            print(f"{str(dt):15s} N={n}: F.linear {median_ms(lambda: F.linear(x, w)):.3f} ms, "
                  f"g @ w {median_ms(lambda: g @ w):.3f} ms, g.t() @ x {median_ms(lambda: g.t() @ x):.3f} ms")
        w = torch.randn(v, k, device="cuda", dtype=dt)
        g = torch.randn(m, v, device="cuda", dtype=dt)
        print(f"{str(dt):15s} kforge padded linear at N={v}: forward "
              f"{median_ms(lambda: linear_forward_impl(x, w, None)):.3f} ms, backward (contiguous grad, "
              f"padded by a copy) {median_ms(lambda: linear_backward_impl(g, x, w, False)):.3f} ms")


if __name__ == "__main__":
    main()
