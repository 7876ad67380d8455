"""SwiGLU (Llama MLP): out = silu(gate) * up, on kforge's swiglu kernels (kernels_src/swiglu.cu).

Model helper (plain PyTorch; `thunder.jit` swaps it for kforge when kforge is an executor):
    swiglu(gate, up) -> silu(gate) * up        (Llama: down_proj(swiglu(gate_proj(x), up_proj(x))))

Thunder symbols:
    kforge_swiglu(gate, up) -> out
        registered with `replaces=swiglu`; decomposes into thunder.torch ops when declined.
    kforge_swiglu_forward(gate, up) -> out
    kforge_swiglu_backward(dout, gate, up) -> (d_gate, d_up)
        the kernels (kforge._C.swiglu_forward / swiglu_backward); backward recomputes silu in the
        same pass. Saved for backward: gate, up.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from .._thunder import Claim, OpSpec, operator, same_dtype_device, tensor_problem


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate and up of one shape. Under `thunder.jit(..., executors=[kforge.executor,
    ...])` calls to this function become `kforge_swiglu` (one kforge kernel each way)."""
    return F.silu(gate) * up


def _swiglu_like(gate: TensorProxy, up: TensorProxy) -> TensorProxy:
    # swiglu written in thunder.torch ops: kforge_swiglu's meta and its decomposition.
    return ltorch.silu(gate) * up


def _forward_meta(gate, up):
    return TensorProxy(like=gate)


def _backward_meta(dout, gate, up):
    return TensorProxy(like=gate), TensorProxy(like=up)


swiglu_forward = operator("swiglu_forward", meta=_forward_meta, fn=_C.swiglu_forward)
swiglu_backward = operator("swiglu_backward", meta=_backward_meta, fn=_C.swiglu_backward)
# fn: what a declined call runs when no gradient is needed (with one, thunder differentiates the
# decomposition instead).
kforge_swiglu = operator("swiglu", like=_swiglu_like, fn=swiglu, replaces=swiglu)


def _check_swiglu(gate: Any, up: Any) -> str | None:
    problem = tensor_problem(gate, "gate") or tensor_problem(up, "up") or same_dtype_device(gate, up, "up")
    if problem:
        return problem
    if tuple(gate.shape) != tuple(up.shape):
        return f"gate {tuple(gate.shape)} and up {tuple(up.shape)} shapes differ (no broadcasting)"
    return None


def _swiglu_execution(gate, up):
    return swiglu_forward(gate, up)


def _swiglu_grad(gate, up):
    out = swiglu_forward(gate, up)
    d_gate, d_up = swiglu_backward(get_grad(out), gate, up)
    put_grad(gate, d_gate)
    put_grad(up, d_up)
    return out


SPEC = OpSpec("swiglu", (Claim(kforge_swiglu, _check_swiglu, _swiglu_execution, _swiglu_grad),))


def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """SwiGLU forward and backward at 8192 tokens x 14336 (Llama 3 8B MLP)."""
    from ..bench.cases import BenchCase

    rows, ffn = 8192, 14336
    es = torch.tensor([], dtype=dtype).element_size()

    def make():
        gate = torch.randn(rows, ffn, device="cuda", dtype=dtype)
        up = torch.randn(rows, ffn, device="cuda", dtype=dtype)
        dout = torch.randn(rows, ffn, device="cuda", dtype=dtype)
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        return gate, up, dout, g, u, swiglu(g, u)

    n = rows * ffn
    shape = f"{rows}x{ffn}"
    return [
        BenchCase("swiglu", "fwd", shape, make,
                  kforge=lambda gate, up, *_: _C.swiglu_forward(gate, up),
                  eager=lambda gate, up, *_: swiglu(gate, up), bytes=3 * n * es),
        BenchCase("swiglu", "bwd", shape, make,
                  kforge=lambda gate, up, dout, *_: _C.swiglu_backward(dout, gate, up),
                  eager=lambda gate, up, dout, g, u, out: torch.autograd.grad(out, (g, u), dout, retain_graph=True),
                  bytes=5 * n * es, compile_ok=False),
    ]
