"""RMSNorm (Llama) on kforge's rmsnorm kernels (kernels_src/rmsnorm.cu).

Model helpers (plain PyTorch; `thunder.jit` swaps them for kforge when kforge is an executor):
    rms_norm(x, weight, eps=1e-6)      Hugging Face LlamaRMSNorm semantics
    add_rms_norm(x, residual, weight, eps=1e-6, *, cast_before_weight=True) -> (s, y)
        a Llama block's residual add and the RMSNorm after it: s = x + residual, y = RMSNorm(s);
        cast_before_weight=True is LlamaRMSNorm's order (rms_norm above), False F.rms_norm's.

Thunder symbols:
    kforge_rms_norm(x, weight, eps=1e-6) -> y
        registered with `replaces=rms_norm`; decomposes into thunder.torch ops when declined.
    kforge_rmsnorm_forward(x, weight, eps, normalized_ndim, cast_before_weight[, y_dtype]) -> (y, rstd)
    kforge_rmsnorm_backward(dy, x, weight, rstd, normalized_ndim, cast_before_weight) -> (dx, dweight)
        the kernels (kforge._C.rmsnorm_forward / rmsnorm_backward); rstd is float32 of shape (rows,),
        weight may be None (then dweight is None). cast_before_weight=True: y = weight * T(x * rstd)
        (HF); False: y = T(x * rstd * weight) (torch F.rms_norm, thunder.torch.rms_norm). y_dtype
        (bf16 / fp16 for fp32 x; only kforge.fusion's norm_epilogues passes it): y stored as that
        type, rounded once from the fp32 result, in place of a conversion kernel.
        Tests force the backward's other kernels with kforge._testing.override("rmsnorm_backward",
        variant=1) (never the shared-memory ring kernel: the kernels for inputs the ring does not
        take); the operators always take the launcher's own choice (kforge._C.plan).
    kforge_add_rms_norm(x, residual, weight, eps=1e-6, *, cast_before_weight=True) -> (s, y)
        registered with `replaces=add_rms_norm`; decomposes into thunder.torch ops when declined.
    kforge_add_rmsnorm_forward(x, residual, weight, eps, normalized_ndim, cast_before_weight[, y_dtype])
        -> (y, rstd, s): kforge._C.add_rmsnorm_forward, the add fused into the forward kernel (s is
        eager's `x + residual`, bit for bit, and is what gets normalised). A bf16 / fp16 x with a
        float32 residual (only kforge.fusion's norm_epilogues passes it: autocast's branch added to
        the fp32 stream) is upcast first, as eager's add; y_dtype as rmsnorm_forward's.
    kforge_add_rmsnorm_backward(dy, ds, s, weight, rstd, normalized_ndim, cast_before_weight)
        -> (dx, dweight): kforge._C.rmsnorm_backward(..., dresidual=ds): dx = the norm's input
        gradient + ds, rounded once; it is the gradient of both x and residual. ds may be None.
    kforge_rmsnorm_backward_sum(dy0, dy1, dy2, x, weight, rstd, normalized_ndim, cast_before_weight,
        dresidual, copy_dtype) -> (dx, dweight, copy): float32 x whose dy is the fp32 sum of two or
        three bf16 / fp16 tensors, ((dy0 + dy1) + dy2) (dy2 may be None), each upcast: what autograd
        sums when a norm's output is read by several 16-bit matmuls under autocast. The ring kernel
        reads the terms (kforge._C.rmsnorm_backward_sum); dresidual and copy_dtype (None: no copy)
        as kforge_rmsnorm_backward_copy's. Only kforge.fusion's norm_epilogues passes it.

Claims: `kforge_rms_norm` (the helper), `thunder.torch.rms_norm` (F.rms_norm) and
`kforge_add_rms_norm` (the add helper), forward and backward. Saved for backward: x, weight, rstd
(the add: s, weight, rstd; x and residual are not kept).

`nn.RMSNorm` under Thunder's Dynamo path: Dynamo inlines `F.rms_norm` (a Python wrapper) into
`torch.rms_norm`, which lightning-thunder 0.2.6 does not map; its splitter then hands the norm (and
the graph around it) to Inductor. Importing this module maps `torch.rms_norm` to
`thunder.torch.rms_norm` (the same signature and semantics), so the norm stays in Thunder and kforge
claims it on both paths.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Number
from typing import Any

import torch
import torch.nn.functional as F
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from .._thunder import Claim, OpSpec, operator, same_dtype_device, tensor_problem

# Longest row the kernels take: 2048 chunks of 16 bytes (16384 bf16/fp16 or 8192 fp32 elements).
MAX_ROW_BYTES = 2048 * 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float = 1e-6) -> torch.Tensor:
    """Hugging Face `LlamaRMSNorm.forward`: statistics in fp32, the normalised x cast back to x's dtype
    *before* the weight multiplies it; the result dtype is torch's promotion of weight and x.

    Under `thunder.jit(..., executors=[kforge.executor, ...])` calls to this function become
    `kforge_rms_norm` (kforge's kernels, or this computation when the checker declines)."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    hidden = hidden.to(input_dtype)
    return hidden if weight is None else weight * hidden


def _rms_norm_like(x: TensorProxy, weight: TensorProxy, eps: float = 1e-6) -> TensorProxy:
    # rms_norm written in thunder.torch ops: kforge_rms_norm's meta and its decomposition.
    hidden = ltorch.to(x, dtypes.float32)
    variance = ltorch.mean(ltorch.pow(hidden, 2), -1, keepdim=True)
    hidden = hidden * ltorch.rsqrt(variance + eps)
    hidden = ltorch.to(hidden, x.dtype)
    return hidden if weight is None else weight * hidden


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None,
                 eps: float = 1e-6, *, cast_before_weight: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama block's residual add and the RMSNorm after it: returns (s, y), s = x + residual and
    y = RMSNorm(s) over the last dim. cast_before_weight=True: Hugging Face LlamaRMSNorm's order (fp32
    statistics, cast back to s's dtype, then the weight); False: torch F.rms_norm / nn.RMSNorm's
    (the weight, then the cast). weight may be None.

    Under `thunder.jit(..., executors=[kforge.executor, ...])` calls to this function become
    `kforge_add_rms_norm` (one kernel for the add and the norm, and one for both their backwards)."""
    s = x + residual
    if not cast_before_weight:
        return s, F.rms_norm(s, (s.shape[-1],), weight, eps)
    return s, rms_norm(s, weight, eps)


def _add_rms_norm_like(x: TensorProxy, residual: TensorProxy, weight: TensorProxy | None,
                       eps: float = 1e-6, *, cast_before_weight: bool = True):
    # add_rms_norm in thunder.torch ops: kforge_add_rms_norm's meta and its decomposition.
    s = ltorch.add(x, residual)
    if not cast_before_weight:
        return s, ltorch.rms_norm(s, (s.shape[-1],), weight, eps)
    return s, _rms_norm_like(s, weight, eps)


# ---- kernel operators --------------------------------------------------------------------------------
def _forward_meta(x, weight, eps, normalized_ndim, cast_before_weight, y_dtype=None):
    rows = math.prod(x.shape[: x.ndim - normalized_ndim])
    y = TensorProxy(like=x) if y_dtype is None else TensorProxy(like=x, dtype=dtypes.to_dtype(y_dtype))
    return y, TensorProxy(like=x, shape=(rows,), dtype=dtypes.float32)


def _backward_meta(dy, x, weight, rstd, normalized_ndim, cast_before_weight):
    return TensorProxy(like=x), None if weight is None else TensorProxy(like=weight)


def _backward_copy_meta(dy, x, weight, rstd, normalized_ndim, cast_before_weight, dresidual, copy_dtype):
    # (dx, dweight, dx rounded to copy_dtype): kforge.fusion.norm_epilogues.copy_norm_grads
    return (*_backward_meta(dy, x, weight, rstd, normalized_ndim, cast_before_weight),
            TensorProxy(like=x, dtype=dtypes.to_dtype(copy_dtype)))


def _backward_sum_meta(dy0, dy1, dy2, x, weight, rstd, normalized_ndim, cast_before_weight, dresidual, copy_dtype):
    # dy = float(dy0) + float(dy1) (+ float(dy2)), 16-bit terms: kforge.fusion.norm_epilogues.sum_norm_grads
    dx, dw = _backward_meta(dy0, x, weight, rstd, normalized_ndim, cast_before_weight)
    return dx, dw, None if copy_dtype is None else TensorProxy(like=x, dtype=dtypes.to_dtype(copy_dtype))


def _backward_sum(dy0, dy1, dy2, x, weight, rstd, normalized_ndim, cast_before_weight, dresidual, copy_dtype):
    terms = [dy0, dy1] if dy2 is None else [dy0, dy1, dy2]
    return _C.rmsnorm_backward_sum(terms, x, weight, rstd, normalized_ndim, cast_before_weight, dresidual, copy_dtype)


def _add_forward_meta(x, residual, weight, eps, normalized_ndim, cast_before_weight, y_dtype=None):
    # s (and y unless y_dtype) have the residual's type: x's, or float32 with a 16-bit x
    y, rstd = _forward_meta(residual, weight, eps, normalized_ndim, cast_before_weight, y_dtype)
    return y, rstd, TensorProxy(like=residual)


def _add_backward_meta(dy, ds, s, weight, rstd, normalized_ndim, cast_before_weight):
    return _backward_meta(dy, s, weight, rstd, normalized_ndim, cast_before_weight)


def _add_backward(dy, ds, s, weight, rstd, normalized_ndim, cast_before_weight):
    # ds None: s has no other consumer (Thunder gave no gradient for it); then dx is the norm's alone.
    return _C.rmsnorm_backward(dy, s, weight, rstd, normalized_ndim, cast_before_weight, dresidual=ds)


rmsnorm_forward = operator("rmsnorm_forward", meta=_forward_meta, fn=_C.rmsnorm_forward)
rmsnorm_backward = operator("rmsnorm_backward", meta=_backward_meta, fn=_C.rmsnorm_backward)
rmsnorm_backward_copy = operator("rmsnorm_backward_copy", meta=_backward_copy_meta, fn=_C.rmsnorm_backward_copy)
rmsnorm_backward_sum = operator("rmsnorm_backward_sum", meta=_backward_sum_meta, fn=_backward_sum)
add_rmsnorm_forward = operator("add_rmsnorm_forward", meta=_add_forward_meta, fn=_C.add_rmsnorm_forward)
add_rmsnorm_backward = operator("add_rmsnorm_backward", meta=_add_backward_meta, fn=_add_backward)
# fn: what a declined call runs when no gradient is needed (with one, thunder differentiates the
# decomposition instead).
kforge_rms_norm = operator("rms_norm", like=_rms_norm_like, fn=rms_norm, replaces=rms_norm)
kforge_add_rms_norm = operator("add_rms_norm", like=_add_rms_norm_like, fn=add_rms_norm,
                               replaces=add_rms_norm)


def _map_torch_rms_norm() -> None:
    """Map `torch.rms_norm` to `thunder.torch.rms_norm` for thunder.jit and Thunder's Dynamo splitter
    (both read the map; the jit's lookaside table was copied from it at import)."""
    fn = getattr(torch, "rms_norm", None)
    sym = getattr(ltorch, "rms_norm", None)
    if fn is None or sym is None or fn in ltorch._torch_to_thunder_function_map:
        return
    from thunder.core import jit_ext

    ltorch._torch_to_thunder_function_map[fn] = sym
    jit_ext._general_jit_lookaside_map[fn] = jit_ext.ensure_recursive_proxies(
        jit_ext.interpreter_needs_wrap(jit_ext.record_source_loc_in_symbol_header(sym)))


_map_torch_rms_norm()


# ---- checkers ---------------------------------------------------------------------------------------
def _eps_problem(eps: Any) -> str | None:
    if eps is None or (isinstance(eps, Number) and not isinstance(eps, bool)):
        return None
    return f"eps must be a Python number, got {type(eps).__name__}"


def _row_problem(x: TensorProxy, shape: tuple[int, ...]) -> str | None:
    """Why rows of the trailing `shape` of x are not normalizable by the kernels, or None."""
    nd = len(shape)
    if nd == 0 or nd > x.ndim or tuple(x.shape[x.ndim - nd :]) != shape:
        return f"normalized shape {shape} is not the trailing shape of input {tuple(x.shape)}"
    n = math.prod(shape)
    limit = MAX_ROW_BYTES // dtypes.to_torch_dtype(x.dtype).itemsize
    if n > limit:
        return f"rows of {n} elements are longer than the kernels take ({limit} for {dtypes.to_torch_dtype(x.dtype)})"
    return None


def _weight_problem(x: TensorProxy, weight: Any, shape: tuple[int, ...]) -> str | None:
    if not isinstance(weight, TensorProxy):
        return f"weight is {type(weight).__name__}, not a tensor"
    if tuple(weight.shape) != shape:
        return f"weight shape {tuple(weight.shape)} is not the normalized shape {shape}"
    return same_dtype_device(x, weight, "weight")


def _check_rms_norm(x: Any, weight: Any, eps: float = 1e-6) -> str | None:
    return (
        tensor_problem(x, "x")
        or (None if x.ndim >= 1 else "x is 0-d")
        or _weight_problem(x, weight, (x.shape[-1],))
        or (_eps_problem(eps) if eps is not None else "eps is None")
        or _row_problem(x, (x.shape[-1],))
    )


def _check_add_rms_norm(x: Any, residual: Any, weight: Any, eps: Any = 1e-6, *,
                        cast_before_weight: Any = True) -> str | None:
    problem = tensor_problem(x, "x") or (None if x.ndim >= 1 else "x is 0-d")
    if problem:
        return problem
    if not isinstance(residual, TensorProxy):
        return f"residual is {type(residual).__name__}, not a tensor"
    if tuple(residual.shape) != tuple(x.shape):
        return f"residual shape {tuple(residual.shape)} differs from x shape {tuple(x.shape)} (no broadcasting)"
    return (
        same_dtype_device(x, residual, "residual")
        or (None if weight is None else _weight_problem(x, weight, (x.shape[-1],)))
        or (_eps_problem(eps) if eps is not None else "eps is None")
        or (None if isinstance(cast_before_weight, bool)
            else f"cast_before_weight must be a bool, got {type(cast_before_weight).__name__}")
        or _row_problem(x, (x.shape[-1],))
    )


def _normalized(normalized_shape: Any) -> tuple[int, ...]:
    if isinstance(normalized_shape, Sequence):
        return tuple(normalized_shape)
    return (normalized_shape,)


# thunder.torch.rms_norm takes eps=None as torch's default: fp32's epsilon (thunder computes bf16/fp16
# inputs in fp32, so their default is fp32's too).
def _f_eps(eps: float | None) -> float:
    return float(torch.finfo(torch.float32).eps) if eps is None else float(eps)


def _check_f_rms_norm(a: Any, normalized_shape: Any, weight: Any = None, eps: Any = None) -> str | None:
    problem = tensor_problem(a, "input")
    if problem:
        return problem
    shape = _normalized(normalized_shape)
    if not all(isinstance(s, int) for s in shape):
        return f"normalized_shape {shape} is not a tuple of ints"
    return (
        _row_problem(a, shape)
        or (None if weight is None else _weight_problem(a, weight, shape))
        or _eps_problem(eps)
    )


# ---- execution and grad transforms -------------------------------------------------------------------
def _rms_norm_execution(x, weight, eps=1e-6):
    return rmsnorm_forward(x, weight, float(eps), 1, True)[0]


def _rms_norm_grad(x, weight, eps=1e-6):
    y, rstd = rmsnorm_forward(x, weight, float(eps), 1, True)
    dx, dweight = rmsnorm_backward(get_grad(y), x, weight, rstd, 1, True)
    put_grad(x, dx)
    put_grad(weight, dweight)
    return y


def _f_rms_norm_execution(a, normalized_shape, weight=None, eps=None):
    return rmsnorm_forward(a, weight, _f_eps(eps), len(_normalized(normalized_shape)), False)[0]


def _f_rms_norm_grad(a, normalized_shape, weight=None, eps=None):
    nd = len(_normalized(normalized_shape))
    y, rstd = rmsnorm_forward(a, weight, _f_eps(eps), nd, False)
    da, dweight = rmsnorm_backward(get_grad(y), a, weight, rstd, nd, False)
    put_grad(a, da)
    if weight is not None:
        put_grad(weight, dweight)
    return y


def _add_rms_norm_execution(x, residual, weight, eps=1e-6, *, cast_before_weight=True):
    y, _, s = add_rmsnorm_forward(x, residual, weight, float(eps), 1, cast_before_weight)
    return s, y


def _add_rms_norm_grad(x, residual, weight, eps=1e-6, *, cast_before_weight=True):
    y, rstd, s = add_rmsnorm_forward(x, residual, weight, float(eps), 1, cast_before_weight)
    dx, dweight = add_rmsnorm_backward(get_grad(y), get_grad(s), s, weight, rstd, 1, cast_before_weight)
    # s = x + residual: both get s's gradient, the norm's dx plus what s's other consumers sent.
    put_grad(x, dx)
    put_grad(residual, dx)
    if weight is not None:
        put_grad(weight, dweight)
    return s, y


_claims = [Claim(kforge_rms_norm, _check_rms_norm, _rms_norm_execution, _rms_norm_grad),
           Claim(kforge_add_rms_norm, _check_add_rms_norm, _add_rms_norm_execution, _add_rms_norm_grad)]
if hasattr(ltorch, "rms_norm"):  # thunder registers it when torch has F.rms_norm
    _claims.append(Claim(ltorch.rms_norm, _check_f_rms_norm, _f_rms_norm_execution, _f_rms_norm_grad))
SPEC = OpSpec("rmsnorm", tuple(_claims))


# ---- benchmarks ---------------------------------------------------------------------------------------
def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """RMSNorm forward and backward at 8192 tokens x 4096 (Llama 3 8B), and 8192 x 768 and the fused
    residual add (add_rms_norm) at 8192 x 4096 unless quick."""
    from ..bench.cases import BenchCase

    eps = 1e-6
    cases = []
    for rows, hidden in [(8192, 4096)] + ([] if quick else [(8192, 768)]):
        es = torch.tensor([], dtype=dtype).element_size()

        def make(rows=rows, hidden=hidden):
            x = torch.randn(rows, hidden, device="cuda", dtype=dtype)
            w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
            dy = torch.randn_like(x)
            _, rstd = _C.rmsnorm_forward(x, w, eps)
            xr, wr = x.detach().requires_grad_(), w.detach().requires_grad_()
            y = rms_norm(xr, wr, eps)  # eager graph, for the eager backward
            return x, w, dy, rstd, xr, wr, y

        shape = f"{rows}x{hidden}"
        cases.append(BenchCase(
            "rmsnorm", "fwd", shape, make,
            kforge=lambda x, w, dy, rstd, *_: _C.rmsnorm_forward(x, w, eps),
            eager=lambda x, w, *_: rms_norm(x, w, eps),
            bytes=2 * rows * hidden * es + hidden * es + rows * 4))
        cases.append(BenchCase(
            "rmsnorm", "bwd", shape, make,
            kforge=lambda x, w, dy, rstd, *_: _C.rmsnorm_backward(dy, x, w, rstd),
            eager=lambda x, w, dy, rstd, xr, wr, y: torch.autograd.grad(y, (xr, wr), dy, retain_graph=True),
            bytes=3 * rows * hidden * es + 2 * hidden * es + rows * 4,
            compile_ok=False))
    if not quick:  # the residual add fused in: one more read and one more write per element each way
        rows, hidden = 8192, 4096
        es = torch.tensor([], dtype=dtype).element_size()

        def make_add():
            x, r, ds, dy = (torch.randn(rows, hidden, device="cuda", dtype=dtype) for _ in range(4))
            w = (1 + 0.1 * torch.randn(hidden, device="cuda")).to(dtype)
            _, rstd, s = _C.add_rmsnorm_forward(x, r, w, eps)
            xr, rr, wr = (t.detach().requires_grad_() for t in (x, r, w))
            out = add_rms_norm(xr, rr, wr, eps)  # eager graph, for the eager backward
            return x, r, w, dy, ds, rstd, s, xr, rr, wr, out

        shape = f"{rows}x{hidden}+residual"
        cases.append(BenchCase(
            "rmsnorm", "fwd", shape, make_add,
            kforge=lambda x, r, w, *_: _C.add_rmsnorm_forward(x, r, w, eps),
            eager=lambda x, r, w, *_: add_rms_norm(x, r, w, eps),
            bytes=4 * rows * hidden * es + hidden * es + rows * 4))
        cases.append(BenchCase(
            "rmsnorm", "bwd", shape, make_add,
            kforge=lambda x, r, w, dy, ds, rstd, s, *_: _C.rmsnorm_backward(dy, s, w, rstd, dresidual=ds),
            eager=lambda x, r, w, dy, ds, rstd, s, xr, rr, wr, out: torch.autograd.grad(
                out, (xr, rr, wr), (ds, dy), retain_graph=True),
            bytes=4 * rows * hidden * es + 2 * hidden * es + rows * 4,
            compile_ok=False))
    return cases
