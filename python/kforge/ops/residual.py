"""Residual add: `a + b` for two tensors of the same shape and dtype (the transformer residual stream).

Why an op for an add: under Thunder's autodiff a bf16 / fp16 `add` is decomposed to prims, and
without a fusion executor the torch path then runs it as upcast a, upcast b, fp32 add, downcast
(four kernels moving about five times the bytes of one bf16 add), and its backward casts the
gradient to fp32 and back again per branch. `kforge_residual_forward` is one kernel (fp32 math,
rounded once: the same bits as eager PyTorch), and the backward needs none: the gradient flows
unchanged to both inputs. Kernel: kernels_src/residual.cu.

Layout: the output is laid out as eager's `a + b` is: in a's dim order when b has a's shape and a is
dense (a transposed view of attention heads is read in place, b copied into that order only when it
is laid out otherwise), else contiguous. Where Thunder's Dynamo path hands the sum to an Inductor
piece, that piece was compiled for eager's strides.

Claims `thunder.torch.add(a, b)` when a and b are CUDA tensors of one float dtype, alpha is 1, and the
shapes are equal or one is the trailing dims of the other (broadcast along leading dims, as GPT-2's
position embedding is: its gradient is the sum over those dims); other broadcasting, mixed dtypes
and other alphas are declined (torch runs them). Adds of a
number are not offered to kforge at all (`Claim.applies`), so they stay out of the decline log.

With kforge's fusion executor in the executor list (`kforge.jit`, `kforge.executors()`), the add is
declined ("left to kforge.fusion"): fused into its neighbours' generated kernel it costs no launch
and no round trip through memory of its own. `kforge.ops.colsum` does the same.
"""
from __future__ import annotations

from typing import Any

import torch
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from .._thunder import Claim, OpSpec, operator, same_dtype_device, tensor_problem


FUSION_DECLINE = "left to kforge.fusion"


def fusion_in_use() -> bool:
    """Whether the compilation now running has kforge's fusion executor in its executor list (checkers
    run inside Thunder's compile; outside one, or before `kforge.fusion` exists, False)."""
    from thunder.core.compile_data import get_compile_data

    cd = get_compile_data()
    executors = getattr(cd, "executors_list", None) if cd is not None else None
    if not executors:
        return False
    try:
        from ..fusion import get_fusion_executor

        fusion = get_fusion_executor()
    except Exception:  # no fusion module (yet), or one that fails to load: nothing to leave to it
        return False
    return fusion in executors


def _forward_meta(a: TensorProxy, b: TensorProxy) -> TensorProxy:
    return TensorProxy(like=a)


# (a, b) -> a + b
residual_forward = operator("residual_forward", meta=_forward_meta, fn=_C.residual_forward)


def _two_tensors(a: Any, b: Any, *, alpha: Any = 1) -> bool:
    """Adds of a number (`x + 1`, `var + eps`) are not residual adds: not offered to the checker."""
    return isinstance(a, TensorProxy) and isinstance(b, TensorProxy)


def _checker(a: Any, b: Any, *, alpha: Any = 1) -> str | None:
    """None when kforge takes `ltorch.add(a, b, alpha=alpha)`, else why not."""
    if fusion_in_use():
        return FUSION_DECLINE
    if (p := tensor_problem(a, "a")) is not None or (p := tensor_problem(b, "b")) is not None:
        return p
    if isinstance(alpha, TensorProxy) or alpha != 1:
        return f"alpha={alpha!r}: only alpha=1"
    if (p := same_dtype_device(a, b, "b")) is not None:
        return p
    if _suffix(b, a) or _suffix(a, b):
        return None
    return (f"shapes {tuple(a.shape)} and {tuple(b.shape)}: only equal shapes, or one the trailing dims "
            "of the other, are taken (other broadcasting is left to torch)")


def _suffix(small: TensorProxy, big: TensorProxy) -> bool:
    """Whether `small` broadcasts to `big` along leading dims only: its shape is big's last dims."""
    return small.ndim <= big.ndim and tuple(big.shape[big.ndim - small.ndim:]) == tuple(small.shape)


def _ordered(a: TensorProxy, b: TensorProxy) -> tuple[TensorProxy, TensorProxy]:
    """(full-shape operand, operand broadcast over leading dims): addition commutes, bit for bit."""
    return (a, b) if _suffix(b, a) else (b, a)


def _execution(a: TensorProxy, b: TensorProxy, *, alpha: Any = 1) -> TensorProxy:
    return residual_forward(*_ordered(a, b))


def _grad(a: TensorProxy, b: TensorProxy, *, alpha: Any = 1) -> TensorProxy:
    # Nothing saved. d(a + b) = g for the full-shape operand; the broadcast one (e.g. GPT-2's position
    # embedding, (T, C) added to (B, T, C)) gets g summed over the leading dims it was repeated along.
    big, small = _ordered(a, b)
    out = residual_forward(big, small)
    g = get_grad(out)
    put_grad(big, g)
    lead = big.ndim - small.ndim
    put_grad(small, ltorch.sum(g, tuple(range(lead))) if lead else g)
    return out


SPEC = OpSpec("residual", (Claim(ltorch.add, _checker, _execution, _grad, applies=_two_tensors),))


def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """The GPT-2 124M residual stream at B*T = 8192 (8192 x 768) and a 4096-wide model's."""
    from ..bench.cases import BenchCase

    shapes = [(8192, 768)] if quick else [(8192, 768), (8192, 4096)]
    es = torch.finfo(dtype).bits // 8
    cases: list[BenchCase] = []
    for n, c in shapes:

        def inputs(n: int = n, c: int = c) -> tuple[torch.Tensor, torch.Tensor]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            return tuple(torch.randn(n, c, device="cuda", generator=gen).to(dtype) for _ in range(2))

        cases.append(BenchCase("residual", "fwd", f"{n}x{c}", inputs, _C.residual_forward,
                               torch.add, 3 * n * c * es))
    return cases
