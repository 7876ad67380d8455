"""Autocast's weight casts in one launch.

Under `torch.autocast` a model with fp32 weights casts every weight to bf16 / fp16 in the forward:
one small conversion per weight (85 in a 12-layer Llama), each a region, a kernel launch and its
host-side call. When the forward returns the casts (the training step's backward reads them), they
live from their cast to the backward either way, so all of them can be made at once, where the
first one was: one `kforge_cast_inputs` symbol, `torch._foreach_copy_` into fresh tensors (one
multi-tensor kernel per chunk of tensors instead of a kernel per weight).

A large cast whose result the forward does not return (inference, or a weight used in the forward
only) is left where it is: making it early would keep it alive longer than its use. Small ones
(biases: at most `SMALL` elements) join the others whatever their use: a 16-bit copy of a bias kept
alive through the forward costs a few kB, its own launch about as much host time as a GEMM's.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch
from thunder.core.dtypes import to_torch_dtype

__all__ = ["gather_input_casts", "SMALL"]

# Elements up to which an input's cast is gathered even when only the forward reads it: every bias
# of the zoo's models (3072 for GPT-2's MLP, a vocabulary-sized one 50257 elements) and norm weights.
SMALL = 1 << 16


def cast_all(xs: Sequence[Any], dtype: Any) -> tuple:
    """[x.to(dtype) for x in xs] as multi-tensor copies: kforge_cast_inputs's implementation."""
    dt = dtype if isinstance(dtype, torch.dtype) else to_torch_dtype(dtype)
    outs = [torch.empty_like(x, dtype=dt) for x in xs]
    torch._foreach_copy_(outs, list(xs))
    return tuple(outs)


@functools.cache
def _cast_op() -> Any:
    """kforge_cast_inputs(xs, dtype) -> [x.to(dtype) for x in xs]."""
    from thunder.core.proxies import TensorProxy

    from .._thunder import operator

    def meta(xs: Sequence[TensorProxy], dtype: Any) -> tuple:
        return tuple(TensorProxy(like=x, dtype=dtype) for x in xs)

    return operator("cast_inputs", meta=meta, fn=cast_all)


def _cast_of_input(b: Any, inputs: set, devices: Sequence[str]) -> Any | None:
    """(source dtype, target dtype, device) when `b` only converts a trace input between float dtypes."""
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy

    from .matmul_acc import is_conversion

    if not is_conversion(b):
        return None
    src = b.flat_proxy_args
    out = b.flat_outs[0] if len(b.flat_outs) == 1 else None
    floats = (dtypes.float32, dtypes.bfloat16, dtypes.float16)
    if (len(src) != 1 or not isinstance(src[0], TensorProxy) or not isinstance(out, TensorProxy)
            or src[0].name not in inputs or src[0].dtype not in floats or out.dtype not in floats
            or src[0].dtype == out.dtype or src[0].device.type not in devices):
        return None
    return (src[0].dtype, out.dtype, str(src[0].device))


def _small(p: Any) -> bool:
    """At most SMALL elements, by a static shape (a symbolic one counts as large)."""
    n = 1
    for d in p.shape:
        if not isinstance(d, int):
            return False
        n *= d
    return n <= SMALL


def gather_input_casts(bsyms: Sequence[Any], inputs: Sequence[Any], returned: set[str],
                       devices: Sequence[str] = ("cuda",)) -> tuple[list, int]:
    """`bsyms` with the forward's conversions of trace inputs (`inputs`: the trace's argument
    proxies) whose results live on past the forward, and those of at most `SMALL` elements, made
    together: one `kforge_cast_inputs` per (source dtype, target dtype, device) at the first one's
    place. A result lives on when the trace returns it (`returned`: a forward trace's outputs include
    what it saves) or the backward part of a joint trace reads it. Returns (new bound symbols, number of conversions gathered); nothing
    changes where fewer than two would be gathered."""
    from thunder.core.proxies import TensorProxy
    from thunder.core.symbol import BoundSymbolTag

    names = {p.name for p in inputs if isinstance(p, TensorProxy)}
    in_backward = {p.name for b in bsyms if BoundSymbolTag.BACKWARD in b.tags for p in b.flat_proxy_args}
    groups: dict[Any, list[int]] = {}
    for i, b in enumerate(bsyms):
        if BoundSymbolTag.BACKWARD in b.tags:
            continue
        key = _cast_of_input(b, names, devices)
        if key is None:
            continue
        out = b.flat_outs[0]
        if out.name in returned or out.name in in_backward or _small(out):
            groups.setdefault(key, []).append(i)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    for (_, dst, _), idx in groups.items():
        if len(idx) < 2:
            continue
        srcs = [bsyms[i].flat_proxy_args[0] for i in idx]
        outs = tuple(bsyms[i].flat_outs[0] for i in idx)
        nb = _cast_op().bind(srcs, dst, output=outs)
        for i in idx:
            nb.tags.update(bsyms[i].tags)
        replace[idx[0]] = nb
        drop.update(idx[1:])
    if not replace:
        return list(bsyms), 0
    n = sum(len(idx) for idx in groups.values() if len(idx) >= 2)
    return [replace.get(i, b) for i, b in enumerate(bsyms) if i not in drop], n
