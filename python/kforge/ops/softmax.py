"""softmax over the last dim, and the fused causal attention softmax (kernels_src/softmax.cu).

Claims:
- `thunder.torch._softmax` (id "torch.softmax"), which `torch.softmax`, `Tensor.softmax`,
  `torch.nn.functional.softmax` and `nn.Softmax` all trace to, when it normalises the last dim and
  keeps the input dtype. Backward saves y only: dx = y * (dy - sum(dy * y)).
- `kforge_causal_softmax`, the operator that replaces the model helper `causal_softmax(att, scale)`
  below: softmax(scale * att) with a causal mask in one pass; backward dpreatt = scale * y * (dy -
  sum(dy * y)), exactly 0 above the diagonal.

Why a helper for the causal case: an OperatorExecutor claims one symbol at a time, and the inline
pattern `att.masked_fill(bias[:, :, :T, :T] == 0, -inf)` + `softmax` is three symbols whose mask is
a runtime tensor (a model buffer): nothing at trace time proves it is causal, so fusing it would
need a pattern-matching trace transform that guesses. Written inline, the masked_fill stays with
Thunder's other executors and the softmax still runs on kforge's kernel (masked -inf entries give
exact zeros); calling `causal_softmax` gets the single fused kernel in both directions.
"""
from __future__ import annotations

import torch
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from ..bench.cases import BenchCase
from .._thunder import Claim, OpSpec, operator, tensor_problem

_INT_MAX = 2**31 - 1


def _causal_shape_problem(shape: tuple) -> str | None:
    # One rule for the helper, its Thunder definition and the checker: the mask is (T, T), so
    # anything else would broadcast into a wrong shape (a 1-D att of T gives (T, T)) or fail deep
    # inside torch.
    if len(shape) < 2 or shape[-1] != shape[-2]:
        return f"att shape {tuple(shape)} is not (..., T, T)"
    return None


def _check_causal_shape(shape: tuple) -> None:
    if (p := _causal_shape_problem(shape)) is not None:
        raise ValueError(f"causal_softmax: {p}: att must be at least 2-D with equal last two dims")


def causal_softmax(att: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(scale * att) over the last dim of (..., T, T) attention scores, row i keeping its
    first i + 1 entries (the rest are exactly 0). Plain PyTorch, for models to call; under
    `thunder.jit` with the kforge executor it runs as one fused kernel, forward and backward.

    Raises ValueError when att is not at least 2-D with equal last two dims."""
    _check_causal_shape(tuple(att.shape))
    T = att.size(-1)
    mask = torch.ones(T, T, dtype=torch.bool, device=att.device).triu(1)
    return (att * scale).masked_fill(mask, float("-inf")).softmax(dim=-1)


def _causal_softmax_like(att: TensorProxy, scale: float) -> TensorProxy:
    # causal_softmax in Thunder's torch language: what the operator decomposes into when kforge
    # declines it (CPU tensors, ...), so other executors and autodiff can still run it. Sizes may
    # arrive as proxies: check the values they were traced with.
    _check_causal_shape(tuple(d.value if isinstance(d, NumberProxy) else d for d in att.shape))
    T = att.shape[-1]
    mask = ltorch.triu(ltorch.ones(T, T, device=att.device, dtype=dtypes.bool8), 1)
    return ltorch.softmax(ltorch.masked_fill(ltorch.mul(att, scale), mask, -float("inf")), -1)


def _forward_meta(x: TensorProxy) -> TensorProxy:
    return TensorProxy(like=x)


def _backward_meta(dy: TensorProxy, y: TensorProxy) -> TensorProxy:
    return TensorProxy(like=y)


def _causal_forward_meta(preatt: TensorProxy, scale: float) -> TensorProxy:
    return TensorProxy(like=preatt)


def _causal_backward_meta(datt: TensorProxy, att: TensorProxy, scale: float) -> TensorProxy:
    return TensorProxy(like=att)


softmax_forward = operator("softmax_forward", meta=_forward_meta, fn=_C.softmax_forward)
softmax_backward = operator("softmax_backward", meta=_backward_meta, fn=_C.softmax_backward)
causal_softmax_forward = operator(
    "causal_softmax_forward", meta=_causal_forward_meta, fn=_C.causal_softmax_forward
)
causal_softmax_backward = operator(
    "causal_softmax_backward", meta=_causal_backward_meta, fn=_C.causal_softmax_backward
)
causal_softmax_op = operator(
    "causal_softmax", like=_causal_softmax_like, fn=causal_softmax, replaces=causal_softmax
)


# ---- checkers ----------------------------------------------------------------------------------
def _rows_problem(a: TensorProxy) -> str | None:
    if a.ndim == 0:
        return "input is 0-d"
    C = a.shape[-1]
    if C > _INT_MAX or a.numel // C >= _INT_MAX:
        return f"shape {tuple(a.shape)} exceeds 2^31-1 rows or row length"
    return None


def _softmax_checker(a: TensorProxy, dim: int, *, dtype=None) -> str | None:
    if (p := tensor_problem(a, "a")) is not None:
        return p
    if not isinstance(dim, int):
        return f"dim={dim} is not a constant int"
    if a.ndim and dim not in (-1, a.ndim - 1):
        return f"dim={dim} is not the last dim"
    want, have = (None if dtype is None else dtypes.to_torch_dtype(dtype)), dtypes.to_torch_dtype(a.dtype)
    if want is not None and want != have:
        return f"dtype={want} differs from the input dtype {have}"
    return _rows_problem(a)


def _causal_checker(att: TensorProxy, scale: float) -> str | None:
    if (p := tensor_problem(att, "att")) is not None:
        return p
    if (p := _causal_shape_problem(tuple(att.shape))) is not None:
        return p
    if isinstance(scale, bool) or not isinstance(scale, (int, float, NumberProxy)):
        return f"scale is a {type(scale).__name__}, not a real number"
    return _rows_problem(att)


# ---- execution and grad transforms -----------------------------------------------------------
def _softmax_execution(a: TensorProxy, dim: int, *, dtype=None) -> TensorProxy:
    return softmax_forward(a)


def _softmax_grad(a: TensorProxy, dim: int, *, dtype=None) -> TensorProxy:
    y = softmax_forward(a)
    put_grad(a, softmax_backward(get_grad(y), y))
    return y


def _causal_execution(att: TensorProxy, scale: float) -> TensorProxy:
    return causal_softmax_forward(att, scale)


def _causal_grad(att: TensorProxy, scale: float) -> TensorProxy:
    y = causal_softmax_forward(att, scale)
    put_grad(att, causal_softmax_backward(get_grad(y), y, scale))
    return y


SPEC = OpSpec(
    "softmax",
    (
        Claim(ltorch._softmax, _softmax_checker, _softmax_execution, _softmax_grad),
        Claim(causal_softmax_op, _causal_checker, _causal_execution, _causal_grad),
    ),
)


# ---- benchmarks ----------------------------------------------------------------------------------
def bench_cases(dtype: torch.dtype, quick: bool) -> list[BenchCase]:
    """Plain softmax on 8192 rows of 1024 (attention) and 50257 (GPT-2 vocab), and the fused causal
    softmax on GPT-2 124M attention scores (B=8, NH=12, T=1024), forward and backward."""
    es = torch.empty((), dtype=dtype).element_size()

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    def probs(*shape):
        return torch.softmax(rnd(*shape).float(), -1).to(dtype)

    cases = []
    rows = [(8192, 1024)] if quick else [(8192, 1024), (8192, 50257), (8192, 8192)]
    for N, C in rows:
        n = N * C
        cases.append(BenchCase("softmax", "fwd", f"{N}x{C}", lambda N=N, C=C: (rnd(N, C),),
                               _C.softmax_forward, lambda x: torch.softmax(x, -1), 2 * n * es))
        cases.append(BenchCase("softmax", "bwd", f"{N}x{C}", lambda N=N, C=C: (rnd(N, C), probs(N, C)),
                               _C.softmax_backward,
                               lambda dy, y: torch._softmax_backward_data(dy, y, -1, y.dtype),
                               3 * n * es))
    B, NH, T = 8, 12, 1024
    scale = 0.125
    shape = f"causal {B}x{NH}x{T}x{T}"
    full = B * NH * T * T
    half = B * NH * T * (T + 1) // 2  # the entries a causal row reads
    cases.append(BenchCase("softmax", "fwd", shape, lambda: (rnd(B, NH, T, T),),
                           lambda x: _C.causal_softmax_forward(x, scale),
                           lambda x: causal_softmax(x, scale), (half + full) * es))
    cases.append(BenchCase("softmax", "bwd", shape,
                           lambda: (rnd(B, NH, T, T), causal_softmax(rnd(B, NH, T, T), scale)),
                           lambda dy, y: _C.causal_softmax_backward(dy, y, scale),
                           lambda dy, y: scale * torch._softmax_backward_data(dy, y, -1, y.dtype),
                           (2 * half + full) * es))
    return cases
