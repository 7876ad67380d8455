"""What the memory system gives a kernel that reads two tensors and writes one (the traffic of the
rmsnorm / layernorm backward): torch.add(a, b, out=c) and kforge's swiglu forward on tensors of the
bench shapes, timed like `python -m kforge.bench ops`. GPU only: python dev/ceiling.py"""
import torch
from kforge import _C
from kforge.bench.harness import time_op, copy_bandwidth_gbs
l2 = torch.cuda.get_device_properties(0).L2_cache_size
bw = copy_bandwidth_gbs()
print("copy GB/s", round(bw))
for rows, D in [(8192, 4096), (8192, 768)]:
    for dt in [torch.bfloat16, torch.float32]:
        nb = 3 * rows * D * dt.itemsize
        n = max(1, min(16, -(-2 * l2 // nb)))
        sets = [tuple(torch.randn(rows, D, device="cuda", dtype=dt) for _ in range(3)) for _ in range(n)]
        sw = time_op(lambda a, b, c: _C.swiglu_forward(a, b), sets)
        ad = time_op(lambda a, b, c: torch.add(a, b, out=c), sets)
        cp = time_op(lambda a, b, c: c.copy_(a), sets)
        ideal = nb / bw / 1e3
        print(f"{rows}x{D} {dt}: bytes {nb/1e6:.1f} MB  ideal@copyBW {ideal:.1f} us  swiglu {sw:.1f} ({100*ideal/sw:.0f}%)  add {ad:.1f} ({100*ideal/ad:.0f}%)  copy(2/3 bytes) {cp:.1f}")
        del sets
