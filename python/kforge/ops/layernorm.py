"""layernorm: LayerNorm over the last dim, with optional weight and bias.

Forward (`kforge_layernorm_forward`) returns the output plus per-row mean and rstd (fp32, shape
(N,) for N = numel / C rows); a float32 x may store its output as bf16 / fp16 (`y_dtype`, what the
fusion pass makes of autocast's conversion of the norm's output), and `kforge_add_layernorm_forward`
adds a 16-bit branch to the fp32 stream first. Backward (`kforge_layernorm_backward`) reads dout, x,
weight and the saved stats once and returns dx, dweight and dbias (the last two only when weight /
bias exist), with the parameter gradients accumulated in fp32 and reduced in a fixed order
(reproducible bits); for a float32 x it may add the residual stream's gradient to dx (`dresidual`)
and, as `kforge_layernorm_backward_copy`, store dx's 16-bit copy too (autocast;
kforge.fusion.norm_epilogues).
Kernels: kernels_src/layernorm.cu.

Claims `thunder.torch.layer_norm` when the normalised shape is the last dim only and weight / bias
are None or 1-D of size C with the input's dtype and device.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from .._thunder import Claim, OpSpec, operator, same_dtype_device, tensor_problem

_MAX_C = 2**30  # the launcher keeps in-row indices in 32 bits


def _forward_meta(x: TensorProxy, weight: TensorProxy | None, bias: TensorProxy | None, eps: float,
                  y_dtype: Any = None):
    n = math.prod(x.shape[:-1])
    stats = TensorProxy(like=x, shape=(n,), dtype=dtypes.float32)
    y = TensorProxy(like=x) if y_dtype is None else TensorProxy(like=x, dtype=dtypes.to_dtype(y_dtype))
    return y, stats, TensorProxy(like=stats)


def _add_forward_meta(x: TensorProxy, residual: TensorProxy, weight: TensorProxy | None, bias: TensorProxy | None,
                      eps: float, y_dtype: Any = None):
    # (y, mean, rstd, s = float(x) + residual): kforge.fusion.norm_epilogues.fold_branch_adds
    return (*_forward_meta(residual, weight, bias, eps, y_dtype), TensorProxy(like=residual))


def _backward_meta(dout: TensorProxy, x: TensorProxy, weight: TensorProxy | None, bias: TensorProxy | None,
                   mean: TensorProxy, rstd: TensorProxy, dresidual: TensorProxy | None = None):
    return (TensorProxy(like=x),
            None if weight is None else TensorProxy(like=weight),
            None if bias is None else TensorProxy(like=bias))


def _backward_copy_meta(dout: TensorProxy, x: TensorProxy, weight: TensorProxy | None, bias: TensorProxy | None,
                        mean: TensorProxy, rstd: TensorProxy, dresidual: TensorProxy | None, copy_dtype: Any):
    # (dx, dweight, dbias, dx rounded to copy_dtype): kforge.fusion.norm_epilogues.copy_norm_grads
    return (*_backward_meta(dout, x, weight, bias, mean, rstd),
            TensorProxy(like=x, dtype=dtypes.to_dtype(copy_dtype)))


# (x, weight | None, bias | None, eps[, y_dtype]) -> (out, mean (N,) f32, rstd (N,) f32); y_dtype (a
# float32 x's bf16 / fp16 out, rounded once: kforge.fusion.norm_epilogues.narrow_norm_outputs)
layernorm_forward = operator("layernorm_forward", meta=_forward_meta, fn=_C.layernorm_forward)
# (x 16-bit, residual f32, weight | None, bias | None, eps, y_dtype | None) -> (y, mean, rstd, s): the
# branch's add to the fp32 stream, s = float(x) + residual, then LayerNorm of s (fold_branch_adds)
add_layernorm_forward = operator("add_layernorm_forward", meta=_add_forward_meta, fn=_C.add_layernorm_forward)
# (dout, x, weight | None, bias | None, mean, rstd[, dresidual]) -> (dx, dweight | None, dbias | None);
# dresidual (float32 x): added to dx (kforge.fusion.norm_epilogues.fold_residual_grads)
layernorm_backward = operator("layernorm_backward", meta=_backward_meta, fn=_C.layernorm_backward)
# (dout, x, weight | None, bias | None, mean, rstd, dresidual | None, copy_dtype) -> (dx, dweight | None,
# dbias | None, dx.to(copy_dtype)): a float32 x's gradient stored twice (copy_norm_grads)
layernorm_backward_copy = operator("layernorm_backward_copy", meta=_backward_copy_meta, fn=_C.layernorm_backward_copy)


def _param_problem(p: Any, a: TensorProxy, name: str) -> str | None:
    if p is None:
        return None
    if not isinstance(p, TensorProxy):
        return f"{name} is not a tensor"
    if p.ndim != 1 or p.shape[0] != a.shape[-1]:
        return f"{name} shape {tuple(p.shape)} is not ({a.shape[-1]},)"
    return same_dtype_device(a, p, name)


def _checker(a: Any, normalized_shape: Sequence[int], weight: Any = None, bias: Any = None,
             eps: float = 1e-5) -> str | None:
    """None when kforge takes `ltorch.layer_norm(a, normalized_shape, weight, bias, eps)`, else why not."""
    if (problem := tensor_problem(a, "input")) is not None:
        return problem
    if a.ndim == 0:
        return "input is 0-D"
    shape = tuple(normalized_shape) if isinstance(normalized_shape, Sequence) else (normalized_shape,)
    if len(shape) != 1:
        return f"normalized_shape {shape} spans {len(shape)} dims: only the last dim is supported"
    if shape[0] != a.shape[-1]:
        return f"normalized_shape {shape} does not match the last dim {a.shape[-1]}"
    if a.shape[-1] > _MAX_C:
        return f"last dim {a.shape[-1]} exceeds 2^30"
    for p, name in ((weight, "weight"), (bias, "bias")):
        if (problem := _param_problem(p, a, name)) is not None:
            return problem
    # The launcher raises on eps < 0 (and a NaN eps is no eps): decline those so torch runs them.
    e = eps.value if isinstance(eps, NumberProxy) else eps
    if isinstance(e, bool) or not isinstance(e, (int, float)) or not e >= 0:
        return f"eps={e!r} is not a number >= 0"
    return None


def _execution(a: TensorProxy, normalized_shape: Sequence[int], weight: TensorProxy | None = None,
               bias: TensorProxy | None = None, eps: float = 1e-5) -> TensorProxy:
    out, _, _ = layernorm_forward(a, weight, bias, eps)
    return out


def _grad(a: TensorProxy, normalized_shape: Sequence[int], weight: TensorProxy | None = None,
          bias: TensorProxy | None = None, eps: float = 1e-5) -> TensorProxy:
    # Saved for backward: x, weight, bias (only to know dbias is wanted), mean and rstd (N floats each).
    out, mean, rstd = layernorm_forward(a, weight, bias, eps)
    dx, dweight, dbias = layernorm_backward(get_grad(out), a, weight, bias, mean, rstd)
    put_grad(a, dx)
    if weight is not None:
        put_grad(weight, dweight)
    if bias is not None:
        put_grad(bias, dbias)
    return out


SPEC = OpSpec("layernorm", (Claim(ltorch.layer_norm, _checker, _execution, _grad),))


def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """Forward and backward (with weight and bias) at 8192 rows of 768 (GPT-2) and 4096 channels."""
    from ..bench.cases import BenchCase

    shapes = [(8192, 768)] if quick else [(8192, 768), (8192, 1600), (8192, 4096)]
    es = torch.finfo(dtype).bits // 8
    eps = 1e-5
    cases: list[BenchCase] = []
    for n, c in shapes:
        shape = f"{n}x{c}"

        def fwd_inputs(n: int = n, c: int = c) -> tuple[torch.Tensor, ...]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = (torch.randn(n, c, device="cuda", generator=gen) + 0.5).to(dtype)
            w = (1 + 0.1 * torch.randn(c, device="cuda", generator=gen)).to(dtype)
            b = (0.1 * torch.randn(c, device="cuda", generator=gen)).to(dtype)
            return x, w, b

        def bwd_inputs(fi=fwd_inputs) -> tuple[torch.Tensor, ...]:
            x, w, b = fi()
            _, mean, rstd = _C.layernorm_forward(x, w, b, eps)
            dout = torch.randn_like(x)
            return dout, x, w, b, mean, rstd

        def eager_fwd(x, w, b, c=c):
            return torch.native_layer_norm(x, (c,), w, b, eps)

        def eager_bwd(dout, x, w, b, mean, rstd, c=c):
            return torch.ops.aten.native_layer_norm_backward(
                dout, x, (c,), mean.view(-1, 1), rstd.view(-1, 1), w, b, (True, True, True))

        rows = n * c * es
        params = c * es
        stats = n * 4 * 2
        cases += [
            # Read x, weight, bias; write out, mean, rstd.
            BenchCase("layernorm", "fwd", shape, fwd_inputs,
                      lambda x, w, b: _C.layernorm_forward(x, w, b, eps), eager_fwd,
                      2 * rows + 2 * params + stats),
            # Read dout, x, weight, mean, rstd; write dx, dweight, dbias.
            BenchCase("layernorm", "bwd", shape, bwd_inputs,
                      lambda dout, x, w, b, mean, rstd: _C.layernorm_backward(dout, x, w, b, mean, rstd),
                      eager_bwd, 3 * rows + 3 * params + stats),
        ]
    return cases
