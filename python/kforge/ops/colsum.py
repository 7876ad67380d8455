"""Column sum: `x.sum(dims)` over every dim but the last, a linear layer's bias gradient.

Thunder's linear backward writes the bias gradient as `sum(grad_out, (0, 1))`; PyTorch's generic
reduction kernel reaches a fraction of the memory bandwidth on these (N, C) column sums. Here: one
pass with 16-byte loads into per-chunk fp32 partial rows, then a fixed-order sum of the partials
(deterministic: no atomics), rounded once to the input dtype as torch does. Kernels:
kernels_src/colsum.cu.

Claims `thunder.torch.sum(x, dim, keepdim)` when `dim` names every dim but the last (in any order,
negative or not) and no other dtype is asked for (keepdim reshapes the (C,) result); the backward of a claimed forward sum is
the broadcast of the gradient (no kernel). Other sums are not offered to kforge (`Claim.applies`).
With kforge's fusion executor in the executor list the sum is declined ("left to kforge.fusion"),
which reduces it inside a generated kernel together with what produces its input.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from .._thunder import Claim, OpSpec, operator, tensor_problem
from .residual import FUSION_DECLINE, fusion_in_use


def _forward_meta(x: TensorProxy) -> TensorProxy:
    return TensorProxy(like=x, shape=(x.shape[-1],))


# (x) -> x summed over every dim but the last
colsum_forward = operator("colsum_forward", meta=_forward_meta, fn=_C.colsum_forward)


def _leading_dims(x: Any, dim: Any) -> bool:
    """Whether `dim` is exactly x's dims but the last (x at least 2-D)."""
    if not isinstance(x, TensorProxy) or x.ndim < 2 or dim is None:
        return False
    dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, Sequence) else None
    if dims is None or not all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
        return False
    try:
        norm = sorted(d % x.ndim for d in dims)
    except ZeroDivisionError:
        return False
    return norm == list(range(x.ndim - 1))


def _applies(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> bool:
    return _leading_dims(x, dim)


def _checker(x: Any, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> str | None:
    """None when kforge takes `ltorch.sum(x, dim, keepdim, dtype=dtype)`, else why not."""
    if fusion_in_use():
        return FUSION_DECLINE
    if (p := tensor_problem(x, "x")) is not None:
        return p
    if not _leading_dims(x, dim):
        return f"dim={dim!r} is not every dim but the last of a {x.ndim}-D tensor"
    if dtype is not None and dtypes.to_torch_dtype(dtypes.to_dtype(dtype)) != dtypes.to_torch_dtype(x.dtype):
        return f"dtype={dtype} differs from the input dtype"
    if x.shape[-1] > 2**30 - 1:  # the launcher's limit: INT_MAX / 2
        return f"last dim {x.shape[-1]} exceeds 2^30 - 1"
    return None


def _execution(x: TensorProxy, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> TensorProxy:
    out = colsum_forward(x)
    return ltorch.reshape(out, (1,) * (x.ndim - 1) + (x.shape[-1],)) if keepdim else out


def _grad(x: TensorProxy, dim: Any = None, keepdim: bool = False, *, dtype: Any = None) -> TensorProxy:
    out = _execution(x, dim, keepdim)
    put_grad(x, ltorch.expand(get_grad(out), x.shape))
    return out


SPEC = OpSpec("colsum", (Claim(ltorch.sum, _checker, _execution, _grad, applies=_applies),))


def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """GPT-2 124M's bias gradients at B*T = 8192: widths 768, 2304 (c_attn) and 3072 (c_fc)."""
    from ..bench.cases import BenchCase

    widths = [768, 3072] if quick else [768, 2304, 3072]
    es = torch.finfo(dtype).bits // 8
    cases: list[BenchCase] = []
    for c in widths:

        def inputs(c: int = c) -> tuple[torch.Tensor]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            return (torch.randn(8, 1024, c, device="cuda", generator=gen).to(dtype),)

        cases.append(BenchCase("colsum", "fwd", f"8x1024x{c}", inputs, _C.colsum_forward,
                               lambda x: x.sum((0, 1)), 8192 * c * es + c * es))
    return cases
