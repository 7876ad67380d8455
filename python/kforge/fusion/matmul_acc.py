"""Sums of matmul results accumulated by cuBLAS instead of an add kernel.

The backward of a layer whose input feeds several projections (the q / k / v projections, SwiGLU's
w1 and w3) sums their input gradients: `dX = reshape(g1 @ W1) + reshape(g2 @ W2) (+ ...)`. When
every matmul result is read only by that sum (through reshapes), the fusion pass rewrites it as

    t1 = matmul(g1, W1)                    # the first term as it was
    t2 = kforge_matmul_accumulate(t1, g2, W2)   # t1 += g2 @ W2 in the matmul's epilogue (beta = 1)
    dX = reshape(t2, shape)                # where the add was

so no add kernel runs and no term is written twice. Results round once per accumulation step
instead of once per matmul and once per add: round(round(m1) + m2) where eager computes
round(round(m1) + round(m2)), slightly more accurate. Only 2-D matmuls, every term of the add's
dtype and shape (no broadcast, no type promotion, alpha 1), all on the same side of the
forward / backward split. The accumulation is kforge's operator `kforge_matmul_accumulate`,
`t1.addmm_(g2, W2)` in place: t1 is a fresh matmul result read only by the sum, and an
out-of-place addmm would first copy it to its output (a device-to-device copy per term).

`widen_matmuls` handles the other epilogue autocast leaves in a backward: a 16-bit matmul whose
result only a conversion to float32 reads (every fp32 weight's gradient) becomes one matmul that
stores float32 (`kforge_matmul_widen`, torch.mm with out_dtype): no conversion kernel, no 16-bit
intermediate.

`widen_matmuls` does the same through a reshape, `convert(reshape(g @ W), float32)`, where
the conversion's only reader is a kforge kernel (the last RMSNorm's gradient from the lm_head under
autocast): a float32-output matmul and a reshape, instead of a 16-bit store, a region reading it and
writing float32. A conversion that an elementwise op reads (a term of autocast's fp32 sum of the q /
k / v input gradients) is left alone: in a region its float32 value is never stored, and a widened
product would double what the matmul writes and the region reads. (Accumulating such sums in fp32 by
cuBLAS, beta = 1 into a float32 result, moves about 25 MB more per sum than the 16-bit products and
one region at a 12-layer Llama's B=8, T=1024: docs/experiments/users-models.md.)
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import torch

_log = logging.getLogger("kforge")

__all__ = ["accumulate_matmuls", "widen_matmuls"]


@functools.cache
def _accumulate_op() -> Any:
    """kforge_matmul_accumulate(c, a, w) -> c += a @ w (in place; returns c)."""
    from thunder.core.proxies import TensorProxy

    from .._thunder import operator

    def meta(c: TensorProxy, a: TensorProxy, w: TensorProxy) -> TensorProxy:
        return TensorProxy(like=c)

    return operator("matmul_accumulate", meta=meta, fn=accumulate_mm)


def accumulate_mm(c: Any, a: Any, w: Any) -> Any:
    """c += a @ w in place: kforge_matmul_accumulate's implementation (at module level, so that a
    program calling it can name it: kforge.trace_cache)."""
    return c.addmm_(a, w)


_mm_dtype_unsupported: set = set()  # devices whose torch has no mm.dtype kernel: eager's two steps there


def widen_mm(a: Any, w: Any) -> Any:
    """a @ w stored as float32 for 16-bit a and w: kforge_matmul_widen's implementation."""
    if not a.is_cuda:  # the same arithmetic where there is no mm.dtype kernel
        return torch.mm(a.float(), w.float())
    if a.device not in _mm_dtype_unsupported:
        try:  # cuBLAS: products of the 16-bit inputs summed in fp32, stored as fp32
            return torch.mm(a, w, out_dtype=torch.float32)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            _mm_dtype_unsupported.add(a.device)
            _log.warning("kforge_matmul_widen: torch.mm(out_dtype=float32) failed on %s (%s); "
                         "computing matmul then conversion", a.device, e)
    return torch.mm(a, w).float()


@functools.cache
def _widen_op() -> Any:
    """kforge_matmul_widen(a, w) -> a @ w in float32, for 2-D bf16 / fp16 a and w."""
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy

    from .._thunder import operator

    def meta(a: TensorProxy, w: TensorProxy) -> TensorProxy:
        return TensorProxy(like=a, shape=(a.shape[0], w.shape[1]), dtype=dtypes.float32)

    return operator("matmul_widen", meta=meta, fn=widen_mm)


def is_conversion(b: Any) -> bool:
    """prims.convert_element_type, or a torch-level symbol (`to`, `float`, `bfloat16`, ...) that
    decomposes to exactly that one prim."""
    while b.subsymbols:
        if len(b.subsymbols) != 1:
            return False
        b = b.subsymbols[0]
    return b.sym.name == "convert_element_type"


def _is_widen(b: Any) -> bool:
    """A conversion of one 16-bit float tensor to float32."""
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy

    if not is_conversion(b):
        return False
    src = b.flat_proxy_args
    out = b.flat_outs[0] if len(b.flat_outs) == 1 else None
    return (len(src) == 1 and isinstance(src[0], TensorProxy) and isinstance(out, TensorProxy)
            and src[0].dtype in (dtypes.bfloat16, dtypes.float16) and out.dtype == dtypes.float32
            and tuple(src[0].shape) == tuple(out.shape))


def _is_matmul(b: Any) -> bool:
    from thunder.core.prims import OpTags

    return b.sym.name == "matmul" and len(b.flat_proxy_args) == 2 and (
        b.sym.is_prim and OpTags.MATMUL_OP in (b.sym.tags or ()) or bool(b.subsymbols))


def _is_reshape(b: Any) -> bool:
    return b.sym.name in ("reshape", "view") and len(b.flat_proxy_args) == 1


def _is_add(b: Any) -> bool:
    from thunder.core.proxies import TensorProxy

    if b.sym.name != "add" or len(b.args) != 2 or b.kwargs.get("alpha", None) not in (None, 1):
        return False
    out = b.flat_outs[0] if len(b.flat_outs) == 1 else None
    return (isinstance(out, TensorProxy) and all(isinstance(a, TensorProxy) for a in b.args)
            and all(a.dtype == out.dtype and tuple(a.shape) == tuple(out.shape) for a in b.args))


def _side(b: Any) -> bool:
    from thunder.core.symbol import BoundSymbolTag

    return BoundSymbolTag.BACKWARD in b.tags


class _Trace:
    """Bound symbols with, per proxy name, the index of its producer and the indices of its readers.
    `skip_dels`: `del` statements do not count as readers (traces after Thunder placed them)."""

    def __init__(self, bsyms: Sequence[Any], skip_dels: bool = False) -> None:
        from thunder.core.prims import PrimIDs

        self.bsyms = list(bsyms)
        self.producer: dict[str, int] = {}
        self.readers: dict[str, set[int]] = {}
        for i, b in enumerate(self.bsyms):
            if skip_dels and b.sym.id == PrimIDs.DEL:
                continue
            for p in b.flat_proxy_args:
                self.readers.setdefault(p.name, set()).add(i)
            for o in b.flat_proxy_outs:
                self.producer.setdefault(o.name, i)

    def only_reader(self, name: str, i: int) -> bool:
        return self.readers.get(name, set()) == {i}

    def terms(self, p: Any, reader: int, side: bool, adds: list, views: list) -> list[int] | None:
        """The matmuls whose sum `p` is (read by bound symbol `reader`), or None. Fills `adds` and
        `views` with the bound symbols the rewrite removes."""
        j = self.producer.get(p.name)
        if j is None or not self.only_reader(p.name, reader):
            return None
        b = self.bsyms[j]
        if _side(b) != side:
            return None
        if _is_add(b):
            left = self.terms(b.args[0], j, side, adds, views)
            right = self.terms(b.args[1], j, side, adds, views) if left is not None else None
            if right is None:
                return None
            adds.append(j)
            return left + right
        if _is_reshape(b):
            src = b.flat_proxy_args[0]
            k = self.producer.get(src.name)
            if k is None or not _is_matmul(self.bsyms[k]) or not self.only_reader(src.name, j):
                return None
            if _side(self.bsyms[k]) != side:
                return None
            views.append(j)
            return [k]
        if _is_matmul(b):
            return [j]
        return None


def spliced(tr: _Trace, replace: dict[int, Any], drop: set[int]) -> tuple[list, int]:
    """(tr's bound symbols with `replace`'s in their places and `drop`'s left out, len(drop)): the end of
    a rewrite pass over a _Trace."""
    return [replace.get(i, b) for i, b in enumerate(tr.bsyms) if i not in drop], len(drop)


def _matmul_ok(b: Any, like: Any, devices: Sequence[str]) -> bool:
    a, w = b.flat_proxy_args
    out = b.flat_outs[0]
    return (out.device.type in devices and a.ndim == 2 and w.ndim == 2 and out.ndim == 2 and a.dtype == w.dtype == out.dtype == like.dtype
            and tuple(out.shape) == tuple(like.shape))


def accumulate_matmuls(bsyms: Sequence[Any], devices: Sequence[str] = ("cuda",)) -> tuple[list, int]:
    """`bsyms` (a trace's top-level bound symbols) with every qualifying sum of matmul results on
    `devices` accumulated in place by cuBLAS; returns (new bound symbols, number of adds removed)."""
    from thunder.core import prims

    tr = _Trace(bsyms)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    removed = 0
    for i in reversed(range(len(tr.bsyms))):  # the outermost add of a chain first: it takes the inner ones
        b = tr.bsyms[i]
        if i in drop or i in replace or not _is_add(b):
            continue
        side = _side(b)
        adds: list[int] = []
        views: list[int] = []
        ts = []
        for a in b.args:
            t = tr.terms(a, i, side, adds, views)
            if t is None:
                break
            ts += t
        else:
            if len(set(ts)) != len(ts) or any(k in drop or k in replace for k in ts + adds + views):
                continue
            ts.sort()
            first = tr.bsyms[ts[0]].flat_outs[0]
            if not all(_matmul_ok(tr.bsyms[k], first, devices) for k in ts):
                continue
            acc = first
            for k in ts[1:]:
                mm = tr.bsyms[k]
                a, w = mm.flat_proxy_args
                out = mm.flat_outs[0]  # the matmul's result name now holds the running sum
                nb = _accumulate_op().bind(acc, a, w, output=out)
                nb.tags.update(mm.tags)
                replace[k] = nb
                acc = out
            out = b.flat_outs[0]
            nb = prims.reshape.bind(acc, tuple(out.shape), output=out)
            nb.tags.update(b.tags)
            replace[i] = nb
            drop.update(adds)
            drop.update(views)
            removed += len(adds) + 1
    if not replace:
        return list(bsyms), 0
    out = []
    for i, b in enumerate(tr.bsyms):
        if i in drop:
            continue
        out.append(replace.get(i, b))
    return out, removed


def _kforge_kernel(b: Any) -> bool:
    return b.sym.name.startswith("kforge_")


def _widens_linear_grad(b: Any, dw: Any, devices: Sequence[str]) -> bool:
    """`b` is a `kforge_linear_backward` not yet widened and `dw` its 16-bit weight gradient."""
    from thunder.core import dtypes

    from ..ops.linear import linear_backward

    return (b.sym.id == linear_backward.id and (len(b.args) < 5 or b.args[4] is None)
            and b.output[1] is not None and b.output[1].name == dw.name
            and dw.dtype in (dtypes.bfloat16, dtypes.float16) and dw.device.type in devices)


def widen_matmuls(bsyms: Sequence[Any], devices: Sequence[str] = ("cuda",),
                  stores: Callable[[Any], bool] = _kforge_kernel) -> tuple[list, int]:
    """`bsyms` with every 2-D 16-bit matmul whose result is read only by a conversion to float32
    computed as one float32-output matmul (`kforge_matmul_widen`, cuBLAS's mm with out_dtype); returns
    (new bound symbols, number of conversions removed).

    Under autocast, the gradient of an fp32 weight is `convert(matmul(g^T, x), float32)`: the matmul
    stores bf16 and a kernel re-reads it to write fp32. One matmul storing fp32 skips that kernel, the
    bf16 intermediate and its rounding (the result is the fp32 sum eager rounds to bf16 first).

    Through a reshape, `convert(reshape(matmul), float32)`, only where the conversion's one reader takes
    the float32 value from memory (`stores`: a kforge kernel; see the module docstring): then
    `reshape(kforge_matmul_widen(...))`, the widened product a new proxy, made only inside a trace
    context."""
    from thunder.core import dtypes, prims
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import get_tracectx

    tr = _Trace(bsyms)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    for i, b in enumerate(tr.bsyms):
        if not _is_widen(b):
            continue
        src = b.flat_proxy_args[0]
        j = tr.producer.get(src.name)
        if j is None or j in replace or not tr.only_reader(src.name, i):
            continue
        view, out = None, b.flat_outs[0]
        if _is_reshape(tr.bsyms[j]):
            readers = tr.readers.get(out.name, set())
            if get_tracectx() is None or len(readers) != 1 or not stores(tr.bsyms[next(iter(readers))]):
                continue
            view, src = j, tr.bsyms[j].flat_proxy_args[0]
            j = tr.producer.get(src.name)
            if j is None or j in replace or not tr.only_reader(src.name, view) or _side(tr.bsyms[view]) != _side(b):
                continue
        mm = tr.bsyms[j]
        if view is None and _widens_linear_grad(mm, src, devices) and _side(mm) == _side(b):
            # the padded linear's (lm_head's) weight gradient: its own GEMM stores fp32
            nb = mm.sym.bind(*mm.args[:4], torch.float32, output=(mm.output[0], out, mm.output[2]))
            nb.tags.update(mm.tags)
            replace[j] = nb
            drop.add(i)
            continue
        if not _is_matmul(mm) or _side(mm) != _side(b) or not _matmul_ok(mm, src, devices):
            continue
        a, w = mm.flat_proxy_args
        wide = out if view is None else TensorProxy(like=src, dtype=dtypes.float32)
        nb = _widen_op().bind(a, w, output=wide)
        nb.tags.update(mm.tags)
        replace[j] = nb
        if view is None:
            drop.add(i)
        else:  # the conversion's place: a reshape of the widened product
            nb = prims.reshape.bind(wide, tuple(out.shape), output=out)
            nb.tags.update(b.tags)
            replace[i] = nb
            drop.add(view)
    return spliced(tr, replace, drop)
