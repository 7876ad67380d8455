"""racecheck on RMSNorm's plain backward (rmsnorm_backward_kernel) by how its row groups are loaded.

The kernel's row groups synchronise among themselves with named barriers (`bar.sync 1 + y, blockDim.x`)
while they walk their rows, then the whole block folds the dweight sums with __syncthreads. fp32 rows
of D = 4093 (not 16-byte: the plain kernel, K = 4, blockDim (256, 2)) with `rows` rows: 37 gives 19
blocks whose last holds one row for group 0 and none for group 1; 38 gives every group one row; 1 and
2 are the same split in a single block. Each run prints the largest dx / dweight error against a
float64 reference, then checks the kernel's output bitwise over 200 launches.

    compute-sanitizer --tool racecheck --racecheck-report hazard python3 dev/racecheck_rows_probe.py 37
"""
from __future__ import annotations

import sys

import torch

import kforge

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 37
repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 200
D = 4093
g = torch.Generator(device="cuda").manual_seed(rows)
x = torch.randn(rows, D, device="cuda", generator=g)
w = torch.randn(D, device="cuda", generator=g)
dy = torch.randn(rows, D, device="cuda", generator=g)
y, rstd = kforge._C.rmsnorm_forward(x, w, 1e-5, 1, False)
dx, dw = kforge._C.rmsnorm_backward(dy, x, w, rstd, 1, False)

xd, wd, dyd = x.double().requires_grad_(), w.double().requires_grad_(), dy.double()
ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * wd
ref.backward(dyd)
print(f"rows={rows}: dx err {(dx.double() - xd.grad).abs().max().item():.3g}, "
      f"dw err {(dw.double() - wd.grad).abs().max().item():.3g}")
same = all(torch.equal(kforge._C.rmsnorm_backward(dy, x, w, rstd, 1, False)[1], dw) for _ in range(repeats))
print(f"rows={rows}: dweight bitwise equal over {repeats} launches: {same}")
