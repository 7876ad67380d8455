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

`accumulate_widened_sums` takes the same sums as autocast leaves them: the input gradient of an fp32
tensor that feeds several 16-bit projections (an fp32 norm's output under autocast) is
`convert(reshape(g1 @ W1), f32) + convert(reshape(g2 @ W2), f32) (+ ...)`, each product rounded to
16 bits, upcast by a kernel and added by another. It becomes one float32-output matmul
(`kforge_matmul_widen`) and float32 accumulations of the other products into it
(`kforge_matmul_accumulate` with a float32 c): the sum in fp32 with no 16-bit rounding of its terms,
no conversion and no add kernel. A single term (`convert(reshape(g @ W), f32)`, the last norm's
gradient from the lm_head) becomes a reshape of one widening matmul.

`widen_matmuls` handles the other epilogue autocast leaves in a backward: a 16-bit matmul whose
result only a conversion to float32 reads (every fp32 weight's gradient) becomes one matmul that
stores float32 (`kforge_matmul_widen`, torch.mm with out_dtype): no conversion kernel, no 16-bit
intermediate.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import torch

_log = logging.getLogger("kforge")

__all__ = ["accumulate_matmuls", "accumulate_widened_sums", "widen_matmuls"]


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
    program calling it can name it: kforge.trace_cache). A float32 c with 16-bit a and w (a widened
    sum, `accumulate_widened_sums`) adds the float32-stored product."""
    if c.dtype != a.dtype:
        return c.add_(widen_mm(a, w))
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
            _accumulation(tr, ts, i, replace, widened=False)
            drop.update(adds)
            drop.update(views)
            removed += len(adds) + 1
    new, _ = spliced(tr, replace, drop)
    return new, removed


def _accumulation(tr: _Trace, ts: list[int], root: int, replace: dict[int, Any], widened: bool) -> None:
    """Puts into `replace` the matmuls `ts` (in trace order) as one accumulation and, in the place of
    bound symbol `root` (the sum), a reshape of it to root's shape. Not widened: the first matmul stays
    and each next one adds into the running sum, which keeps the matmuls' result names. Widened: the
    first is a float32-output matmul and the sum is float32, in new proxies (a trace context names them)."""
    from thunder.core import dtypes, prims
    from thunder.core.proxies import TensorProxy

    acc = None if widened else tr.bsyms[ts[0]].flat_outs[0]
    for k in ts if widened else ts[1:]:
        mm = tr.bsyms[k]
        a, w = mm.flat_proxy_args
        out = TensorProxy(like=mm.flat_outs[0], dtype=dtypes.float32) if widened else mm.flat_outs[0]
        nb = _widen_op().bind(a, w, output=out) if acc is None else _accumulate_op().bind(acc, a, w, output=out)
        nb.tags.update(mm.tags)
        replace[k] = nb
        acc = out
    res = tr.bsyms[root].flat_outs[0]
    nb = prims.reshape.bind(acc, tuple(res.shape), output=res)
    nb.tags.update(tr.bsyms[root].tags)
    replace[root] = nb


def widen_matmuls(bsyms: Sequence[Any], devices: Sequence[str] = ("cuda",)) -> tuple[list, int]:
    """`bsyms` with every 2-D 16-bit matmul whose result is read only by a conversion to float32
    computed as one float32-output matmul (`kforge_matmul_widen`, cuBLAS's mm with out_dtype); returns
    (new bound symbols, number of conversions removed).

    Under autocast, the gradient of an fp32 weight is `convert(matmul(g^T, x), float32)`: the matmul
    stores bf16 and a kernel re-reads it to write fp32. One matmul storing fp32 skips that kernel, the
    bf16 intermediate and its rounding (the result is the fp32 sum eager rounds to bf16 first)."""
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
        mm = tr.bsyms[j]
        if not _is_matmul(mm) or _side(mm) != _side(b) or not _matmul_ok(mm, src, devices):
            continue
        a, w = mm.flat_proxy_args
        nb = _widen_op().bind(a, w, output=b.flat_outs[0])
        nb.tags.update(mm.tags)
        replace[j] = nb
        drop.add(i)
    return spliced(tr, replace, drop)


def _widened_terms(tr: _Trace, p: Any, reader: int, side: bool, adds: list, drop: list) -> list[int] | None:
    """The 16-bit matmuls whose upcast sum float32 `p` (read by bound symbol `reader`) is, or None.
    Fills `adds` with the float32 adds and `drop` with the conversions and reshapes the rewrite
    removes."""
    from thunder.core import dtypes

    j = tr.producer.get(p.name)
    if j is None or not tr.only_reader(p.name, reader) or _side(tr.bsyms[j]) != side:
        return None
    b = tr.bsyms[j]
    if _is_add(b) and b.flat_outs[0].dtype == dtypes.float32:
        left = _widened_terms(tr, b.args[0], j, side, adds, drop)
        right = _widened_terms(tr, b.args[1], j, side, adds, drop) if left is not None else None
        if right is None:
            return None
        adds.append(j)
        return left + right
    if not _is_widen(b):
        return None
    src = b.flat_proxy_args[0]
    k = tr.producer.get(src.name)
    if k is None or not tr.only_reader(src.name, j) or _side(tr.bsyms[k]) != side:
        return None
    views = []
    if _is_reshape(tr.bsyms[k]):
        src = tr.bsyms[k].flat_proxy_args[0]
        views, k = [k], tr.producer.get(src.name)
        if k is None or not tr.only_reader(src.name, views[0]) or _side(tr.bsyms[k]) != side:
            return None
    if not _is_matmul(tr.bsyms[k]):
        return None
    drop += [j, *views]
    return [k]


def accumulate_widened_sums(bsyms: Sequence[Any], devices: Sequence[str] = ("cuda",)) -> tuple[list, int]:
    """`bsyms` with every float32 sum of upcast 16-bit matmul results on `devices` (and every single
    upcast reshaped matmul result) computed by one widening matmul and float32 accumulations into it
    (see the module docstring); returns (new bound symbols, number of adds, conversions and reshapes
    removed). Makes proxies: runs inside a trace context (unchanged without one)."""
    from thunder.core import dtypes
    from thunder.core.trace import get_tracectx

    if get_tracectx() is None:
        return list(bsyms), 0
    tr = _Trace(bsyms)
    replace: dict[int, Any] = {}
    drop: set[int] = set()
    removed = 0
    for i in reversed(range(len(tr.bsyms))):  # the outermost add of a chain first: it takes the inner ones
        b = tr.bsyms[i]
        if i in drop or i in replace:
            continue
        root_add = _is_add(b) and b.flat_outs[0].dtype == dtypes.float32
        if not root_add and not _is_widen(b):
            continue
        side = _side(b)
        adds: list[int] = []
        gone: list[int] = []
        if root_add:
            ts: list[int] | None = []
            for a in b.args:
                t = _widened_terms(tr, a, i, side, adds, gone)
                if t is None:
                    ts = None
                    break
                ts += t
        else:  # a single upcast term, through a reshape (without one, widen_matmuls takes it)
            src = b.flat_proxy_args[0]
            k = tr.producer.get(src.name)
            if k is None or not _is_reshape(tr.bsyms[k]):
                continue
            mm_out = tr.bsyms[k].flat_proxy_args[0]
            m = tr.producer.get(mm_out.name)
            ts = None
            if (tr.only_reader(src.name, i) and tr.only_reader(mm_out.name, k) and m is not None
                    and _is_matmul(tr.bsyms[m]) and _side(tr.bsyms[k]) == side == _side(tr.bsyms[m])):
                ts, gone = [m], [k]
        if not ts or len(set(ts)) != len(ts) or any(x in drop or x in replace for x in ts + adds + gone):
            continue
        ts.sort()
        first = tr.bsyms[ts[0]].flat_outs[0]
        if first.dtype not in (dtypes.bfloat16, dtypes.float16) or not all(
                _matmul_ok(tr.bsyms[k], first, devices) for k in ts):
            continue
        _accumulation(tr, ts, i, replace, widened=True)
        drop.update(adds)
        drop.update(gone)
        removed += len(adds) + len(gone) + 1
    new, _ = spliced(tr, replace, drop)
    return new, removed
