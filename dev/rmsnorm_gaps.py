"""Where an rmsnorm backward call's time goes: time per call with and without the weight (without
it there is no dweight reduction), and the kernels' durations and the gaps between them over
back-to-back calls (torch.profiler / CUPTI). GPU only: python dev/rmsnorm_gaps.py [variants]
(default 0: the ring kernel, then the dweight kernel; 1 the kernels for what the ring does not take)."""
import sys
import torch
from torch.profiler import profile, ProfilerActivity
from kforge import _C
from kforge._testing import override
from kforge.bench.harness import time_op

rows, D = 8192, 4096
dt = torch.bfloat16
x = torch.randn(rows, D, device="cuda", dtype=dt)
w = torch.randn(D, device="cuda", dtype=dt)
dy = torch.randn(rows, D, device="cuda", dtype=dt)
_, rstd = _C.rmsnorm_forward(x, w, 1e-6)
l2 = torch.cuda.get_device_properties(0).L2_cache_size
sets = [(torch.randn(rows, D, device="cuda", dtype=dt), torch.randn(rows, D, device="cuda", dtype=dt)) for _ in range(3)]
for v in [int(a) for a in sys.argv[1:]] or [0]:
    with override("rmsnorm_backward", variant=v):
        for weight in (w, None):
            us = time_op(lambda a, b: _C.rmsnorm_backward(a, b, weight, rstd), sets)
            print(f"v{v} weight={'yes' if weight is not None else 'None'}: {us:.1f} us/call (time_op)")
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(12):
                _C.rmsnorm_backward(sets[i % 3][0], sets[i % 3][1], w, rstd)
            torch.cuda.synchronize()
    evs = sorted([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "rmsnorm" in e.name],
                 key=lambda e: e.time_range.start)
    prev_end = None
    for e in evs[-8:]:
        s, t = e.time_range.start, e.time_range.end
        gap = f"gap {s - prev_end:6.2f}" if prev_end is not None else "          "
        print(f"  {gap}  dur {t - s:6.2f}  {e.name[:60]}")
        prev_end = t
