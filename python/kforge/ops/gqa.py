"""Grouped-query attention head expansion (Hugging Face `repeat_kv`) on kforge's gqa kernels
(kernels_src/gqa.cu).

Model helper (plain PyTorch; `thunder.jit` swaps it for kforge when kforge is an executor):
    repeat_kv(x, n_rep)    x (B, Hkv, T, D) -> (B, Hkv * n_rep, T, D), head h reads kv head h // n_rep

Thunder symbols:
    kforge_repeat_kv(x, n_rep) -> out
        registered with `replaces=repeat_kv`; decomposes into thunder.torch ops when declined.
    kforge_repeat_kv_forward(x, n_rep) -> out                 (kforge._C.repeat_kv_forward)
    kforge_repeat_kv_backward(dout, n_rep) -> dx              (kforge._C.repeat_kv_backward)
        backward sums each group's n_rep head gradients in a fixed order (deterministic). Nothing is
        saved for backward.
n_rep = 1 is declined: repeat_kv is then the identity and needs no kernel.
"""
from __future__ import annotations

from typing import Any

import torch
import thunder.torch as ltorch
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from .._thunder import Claim, OpSpec, operator, tensor_problem


def _check_args(shape: tuple, n_rep: object) -> None:
    # One rule for the helper and its Thunder definition: a 3-D x failed with "not enough values to
    # unpack" and n_rep = 0 returned (B, 0, T, D) without a word.
    if isinstance(n_rep, bool) or not isinstance(n_rep, int) or n_rep < 1:
        raise ValueError(f"repeat_kv: n_rep must be a positive int, got {n_rep!r}")
    if len(shape) != 4:
        raise ValueError(f"repeat_kv: x has shape {tuple(shape)}, not (B, Hkv, T, D) (a 4-D tensor of kv heads)")


def _value(x: object) -> object:
    return x.value if isinstance(x, NumberProxy) else x


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Hugging Face `repeat_kv`: (B, Hkv, T, D) -> (B, Hkv * n_rep, T, D), the same as
    `torch.repeat_interleave(x, n_rep, dim=1)`. Under `thunder.jit(..., executors=[kforge.executor,
    ...])` calls to this function become `kforge_repeat_kv`.

    Raises ValueError unless x is 4-D and n_rep a positive int."""
    _check_args(tuple(x.shape), n_rep)
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def _repeat_kv_like(x: TensorProxy, n_rep: int) -> TensorProxy:
    # repeat_kv written in thunder.torch ops: kforge_repeat_kv's meta and its decomposition.
    _check_args(tuple(x.shape), _value(n_rep))
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return ltorch.reshape(ltorch.expand(ltorch.unsqueeze(x, 2), b, h, n_rep, t, d), b, h * n_rep, t, d)


def _forward_meta(x, n_rep):
    b, h, t, d = x.shape
    return TensorProxy(like=x, shape=(b, h * n_rep, t, d))


def _backward_meta(dout, n_rep):
    b, h, t, d = dout.shape
    return TensorProxy(like=dout, shape=(b, h // n_rep, t, d))


repeat_kv_forward = operator("repeat_kv_forward", meta=_forward_meta, fn=_C.repeat_kv_forward)
repeat_kv_backward = operator("repeat_kv_backward", meta=_backward_meta, fn=_C.repeat_kv_backward)
# fn: what a declined call runs when no gradient is needed (with one, thunder differentiates the
# decomposition instead).
kforge_repeat_kv = operator("repeat_kv", like=_repeat_kv_like, fn=repeat_kv, replaces=repeat_kv)


def _check_repeat_kv(x: Any, n_rep: Any) -> str | None:
    problem = tensor_problem(x, "x")
    if problem:
        return problem
    if x.ndim != 4:
        return f"x must be (B, Hkv, T, D), got shape {tuple(x.shape)}"
    if not isinstance(n_rep, int) or isinstance(n_rep, bool) or n_rep < 1:
        return f"n_rep must be a positive Python int, got {n_rep!r}"
    if n_rep == 1:
        return "n_rep=1 is the identity (no kernel needed)"
    if n_rep > 4096:  # the launchers' limit
        return f"n_rep={n_rep} exceeds 4096"
    if x.shape[1] * n_rep > 2**31 - 1:
        return f"{x.shape[1]} x {n_rep} output heads exceed 2^31 - 1"
    if x.shape[2] * x.shape[3] > 2**30:
        return f"a (T, D) slab of {x.shape[2] * x.shape[3]} elements is too large (max 2^30)"
    return None


def _repeat_kv_execution(x, n_rep):
    return repeat_kv_forward(x, n_rep)


def _repeat_kv_grad(x, n_rep):
    out = repeat_kv_forward(x, n_rep)
    put_grad(x, repeat_kv_backward(get_grad(out), n_rep))
    return out


SPEC = OpSpec("gqa", (Claim(kforge_repeat_kv, _check_repeat_kv, _repeat_kv_execution, _repeat_kv_grad),))


def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """repeat_kv forward and backward at 8 x 1024 tokens, 4 kv heads of dim 128 expanded to 32 heads
    (n_rep 8) and, unless quick, to 12 heads (n_rep 3)."""
    from ..bench.cases import BenchCase

    B, T, Hkv, D = 8, 1024, 4, 128
    es = torch.tensor([], dtype=dtype).element_size()
    cases = []
    for n_rep in [8] + ([] if quick else [3]):
        def make(n_rep=n_rep):
            x = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype)
            dout = torch.randn(B, Hkv * n_rep, T, D, device="cuda", dtype=dtype)
            return x, dout, n_rep

        moved = (1 + n_rep) * B * Hkv * T * D * es
        shape = f"{B}x{T}x{Hkv}->{Hkv * n_rep}x{D}"
        cases.append(BenchCase("gqa", "fwd", shape, make,
                               kforge=lambda x, dout, r: _C.repeat_kv_forward(x, r),
                               eager=lambda x, dout, r: repeat_kv(x, r), bytes=moved))
        cases.append(BenchCase("gqa", "bwd", shape, make,
                               kforge=lambda x, dout, r: _C.repeat_kv_backward(dout, r),
                               eager=lambda x, dout, r: dout.unflatten(1, (Hkv, r)).sum(2), bytes=moved))
    return cases
