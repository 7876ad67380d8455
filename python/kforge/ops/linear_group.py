"""Linear layers of one input as one GEMM each way (attention's q / k / v projections).

A Llama attention projects one normalised input three times, `wq(x)`, `wk(x)`, `wv(x)`: three GEMMs
forward and six backward (three for dx, accumulated, three for the weight gradients). Each GEMM call
costs about 10 us of cuBLASLt's own host time, and these steps are host-bound; with grouped-query
attention two of the three are also narrow (n = n_kv_heads * head_dim), which a GEMM runs less
efficiently than one wide product. Grouped, the same work is one GEMM forward and two backward.

Opt-in: the pattern transform puts it in for the projections only when asked,
`kforge.jit(model, kinds=kforge.transforms.ALL_KINDS + kforge.transforms.OPT_IN_KINDS)`. On an H200 the
plain Llama's bf16 step was no faster with it (14.53 against 14.41 ms) and its peak memory 0.33 GiB
higher, most likely because v, saved for the attention's backward, is a view that keeps the whole
product alive (docs/experiments/users-models.md, "One GEMM for q / k / v").

Model helper (plain PyTorch; the opt-in pattern puts it in for the projections):
    linear_group(x, weights) -> tuple(F.linear(x, w) for w in weights)

Thunder symbols:
    kforge_linear_group(x, weights) -> outputs
        registered with `replaces=linear_group`; decomposes into thunder.torch linears when declined.
    kforge_linear_group_forward(x, weights) -> outputs
        W = the weights stacked by rows (one copy, (N, K) for N = sum of the output widths), one GEMM
        x @ W^T; the outputs are its column blocks (views: rows N elements apart, each row dense).
    kforge_linear_group_backward(grads, x, weights) -> (dx, *dweights)
        dY = the output gradients side by side (one copy, (M, N)), dx = dY @ W and dW = dY^T @ x, one
        GEMM each; the weight gradients are row blocks of dW (contiguous views). W is stacked again
        rather than saved from the forward: nothing beyond x and the weights is kept for the backward.
16-bit GEMMs run on kforge's cuBLASLt plans (kforge.ops.gemm, ATen when a call is off their fast
path); fp32 on torch's GEMMs, whose IEEE fp32 kernels are the faster ones (docs/experiments/users-models.md).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from .._thunder import Claim, OpSpec, operator, same_dtype_device, tensor_problem
from .gemm import SIXTEEN_BIT


def linear_group(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`F.linear(x, w)` for each of `weights` (no bias), as a tuple. Under `kforge.jit` these become
    `kforge_linear_group`: one GEMM forward and two backward for the whole group."""
    return tuple(F.linear(x, w) for w in weights)


def _linear_group_like(x: TensorProxy, weights: Sequence[TensorProxy]) -> tuple:
    return tuple(ltorch.linear(x, w) for w in weights)


def _forward_meta(x: TensorProxy, weights: Sequence[TensorProxy]) -> tuple:
    return tuple(TensorProxy(like=x, shape=(*x.shape[:-1], w.shape[0])) for w in weights)


def _backward_meta(grads: Sequence[TensorProxy], x: TensorProxy, weights: Sequence[TensorProxy]) -> tuple:
    return (TensorProxy(like=x), *(TensorProxy(like=w) for w in weights))


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _C.gemm_mm(a, b) if a.dtype in SIXTEEN_BIT else torch.mm(a, b)


def forward_impl(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The outputs of `linear_group(x, weights)` from one GEMM: column blocks of x @ cat(weights)^T."""
    w = torch.cat(tuple(weights), 0)
    k = x.shape[-1]
    y = _mm(x.reshape(-1, k), w.t()).view(*x.shape[:-1], w.shape[0])
    return tuple(y.split([wi.shape[0] for wi in weights], -1))


def backward_impl(grads: Sequence[torch.Tensor], x: torch.Tensor,
                  weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """(dx, *dweights) of `forward_impl` given the outputs' gradients: two GEMMs."""
    k = x.shape[-1]
    dy = torch.cat(tuple(grads), -1)
    dy = dy.reshape(-1, dy.shape[-1])
    w = torch.cat(tuple(weights), 0)
    dx = _mm(dy, w).view(x.shape)
    dw = _mm(dy.t(), x.reshape(-1, k))
    return (dx, *dw.split([wi.shape[0] for wi in weights], 0))


linear_group_forward = operator("linear_group_forward", meta=_forward_meta, fn=forward_impl)
linear_group_backward = operator("linear_group_backward", meta=_backward_meta, fn=backward_impl)
kforge_linear_group = operator("linear_group", like=_linear_group_like, fn=linear_group, replaces=linear_group)


def _check(x: Any, weights: Any) -> str | None:
    problem = tensor_problem(x, "x")
    if problem:
        return problem
    if x.ndim < 2:
        return f"x of shape {tuple(x.shape)} has no rows (at least 2-D)"
    if not isinstance(weights, (tuple, list)) or len(weights) < 2:
        return "weights must be a tuple of two or more tensors"
    for i, w in enumerate(weights):
        name = f"weights[{i}]"
        problem = tensor_problem(w, name) or same_dtype_device(x, w, name)
        if problem:
            return problem
        if w.ndim != 2 or w.shape[1] != x.shape[-1]:
            return f"{name} of shape {tuple(w.shape)} is not (n, {x.shape[-1]})"
    return None


def _execution(x, weights):
    return linear_group_forward(x, weights)


def _grad(x, weights):
    outs = linear_group_forward(x, weights)
    dx, *dws = linear_group_backward(tuple(get_grad(o) for o in outs), x, weights)
    put_grad(x, dx)
    for w, dw in zip(weights, dws):
        put_grad(w, dw)
    return outs


SPEC = OpSpec("linear_group", (Claim(kforge_linear_group, _check, _execution, _grad),))
