"""gelu: the tanh approximation (GPT-2's `F.gelu(x, approximate="tanh")`) and the exact erf form
(`nn.GELU()` / `F.gelu(x)`, nanoGPT's), one kernel source with a mode flag.

Forward (`kforge_gelu_forward(x, approximate)`) saves nothing of its own: backward
(`kforge_gelu_backward(dout, x, approximate)`) recomputes gelu'(x) from the input, so only x is kept
for the backward pass. Both kernels move 16 bytes per thread per access (2 packs per thread, all
loaded before the math) with a scalar tail, misaligned inputs take a scalar kernel, and offsets are
64-bit (any numel). fp32 math in both modes. Kernels: kernels_src/gelu.cu.

Claims `thunder.torch.gelu` for approximate="tanh" and approximate="none".
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from .._thunder import Claim, OpSpec, operator, tensor_problem


APPROXIMATIONS = ("tanh", "none")  # torch's `approximate` values; "none" is the exact erf gelu


def _forward_meta(x: TensorProxy, approximate: str) -> TensorProxy:
    return TensorProxy(like=x)


def _backward_meta(dout: TensorProxy, x: TensorProxy, approximate: str) -> TensorProxy:
    return TensorProxy(like=x)


# (x, approximate) -> out
gelu_forward = operator("gelu_forward", meta=_forward_meta, fn=_C.gelu_forward)
# (dout, x, approximate) -> dx
gelu_backward = operator("gelu_backward", meta=_backward_meta, fn=_C.gelu_backward)


def _checker(a: Any, *, approximate: str = "none") -> str | None:
    """None when kforge takes `ltorch.gelu(a, approximate=...)`, else why not."""
    if approximate not in APPROXIMATIONS:
        return f"approximate={approximate!r} is not one of {APPROXIMATIONS}"
    if (p := tensor_problem(a, "input")) is not None:
        return p
    # The launcher's grid: one block per 2 x 256 packs of 16 bytes, plus one (src/ops/gelu.cpp).
    if a.numel // (16 // dtypes.to_torch_dtype(a.dtype).itemsize) // 512 + 1 > 2**31 - 1:
        return f"{a.numel} elements exceed one launch grid"
    return None


def _execution(a: TensorProxy, *, approximate: str = "none") -> TensorProxy:
    return gelu_forward(a, approximate)


def _grad(a: TensorProxy, *, approximate: str = "none") -> TensorProxy:
    # Saved for backward: x only (gelu' is recomputed from it).
    out = gelu_forward(a, approximate)
    put_grad(a, gelu_backward(get_grad(out), a, approximate))
    return out


SPEC = OpSpec("gelu", (Claim(ltorch.gelu, _checker, _execution, _grad),))


def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """Forward and backward on GPT-2's MLP activation (8192 x 3072) and a 4096-wide model's (x 16384),
    tanh approximation; the exact (erf) gelu at GPT-2's shape unless quick."""
    from ..bench.cases import BenchCase

    shapes = [(8192, 3072)] if quick else [(8192, 3072), (8192, 16384)]
    es = torch.finfo(dtype).bits // 8
    cases: list[BenchCase] = []
    for n, c in shapes:
        shape = f"{n}x{c}"

        def fwd_inputs(n: int = n, c: int = c) -> tuple[torch.Tensor]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            return (torch.randn(n, c, device="cuda", generator=gen).to(dtype),)

        def bwd_inputs(n: int = n, c: int = c) -> tuple[torch.Tensor, torch.Tensor]:
            gen = torch.Generator(device="cuda").manual_seed(1)
            dout = torch.randn(n, c, device="cuda", generator=gen).to(dtype)
            return dout, torch.randn(n, c, device="cuda", generator=gen).to(dtype)

        size = n * c * es
        cases += [
            BenchCase("gelu", "fwd", shape, fwd_inputs, _C.gelu_forward,
                      lambda x: F.gelu(x, approximate="tanh"), 2 * size),
            BenchCase("gelu", "bwd", shape, bwd_inputs, _C.gelu_backward,
                      lambda dout, x: torch.ops.aten.gelu_backward(dout, x, approximate="tanh"), 3 * size),
        ]
        if not quick and (n, c) == shapes[0]:
            cases += [
                BenchCase("gelu", "fwd", shape + " erf", fwd_inputs, lambda x: _C.gelu_forward(x, "none"),
                          F.gelu, 2 * size),
                BenchCase("gelu", "bwd", shape + " erf", bwd_inputs, lambda dout, x: _C.gelu_backward(dout, x, "none"),
                          lambda dout, x: torch.ops.aten.gelu_backward(dout, x), 3 * size),
            ]
    return cases
