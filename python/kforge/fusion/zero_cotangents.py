"""Outputs nobody differentiates cost nothing in the backward.

A model that returns `(logits, loss)` and is trained on `loss` alone leaves the logits without a
gradient. PyTorch's autograd hands a `torch.autograd.Function` a zero tensor for such an output
(`materialize_grads`), so Thunder's backward fills a (B, T, vocab) buffer with zeros (0.3 ms for
GPT-2 at B=8, T=1024), adds it to the cross-entropy gradient (1 ms: three full passes) and hands the
sum, which lost the padded row stride of kforge's linear, to the lm_head backward (another 1 ms
copy). Eager autograd does none of it: it never runs a gradient that does not exist.

`ZeroCotangents`, the last post-optimization transform of `kforge.jit` / `kforge.compile`, rewrites
the final backward trace so an absent gradient may arrive as None:

- a cotangent read only by kforge fusion regions is left as None; each such region is wrapped in a
  `ZeroAware` callable that, when an argument is None, runs the region lowered with that argument
  as the constant 0 (`ir.lower(..., zeros=...)`): `g + 0` folds to `g`, so the region above becomes
  a view of the cross-entropy gradient and launches nothing;
- every other absent cotangent is filled with zeros by `kforge_fill_cotangents`, the trace's first
  step (what autograd would have materialized).

`install()` patches the forward of Thunder's autograd functions so they turn `materialize_grads` off
only for a backward built from such a trace (one holding `kforge_fill_cotangents`); every other
Thunder function behaves exactly as before.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Sequence

from thunder.core.transform_common import Transform

__all__ = ["ZeroCotangents", "ZeroAware", "install"]

_FILL = "kforge_fill_cotangents"


def _fill(cotangents: list, spec: tuple) -> None:
    """Replace the absent (None) cotangents listed in `spec` ((index, shape, dtype, device), ...) by
    zeros, in place: the backward reads them from this list."""
    import torch

    for i, shape, dtype, device in spec:
        if cotangents[i] is None:
            cotangents[i] = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)


@functools.cache
def _fill_op() -> Any:
    from .._thunder import operator

    def meta(cotangents: Any, spec: tuple) -> None:
        return None

    return operator("fill_cotangents", meta=meta, fn=_fill)


class ZeroAware:
    """A fusion region's callable that accepts None (an all-zero tensor never materialized) for the
    arguments at `positions`. With no None it calls the region's kernel; otherwise the region lowered
    with those arguments as 0 (a view, a passthrough or a smaller kernel), built once per pattern."""

    def __init__(self, fn: Any, bsym: Any, positions: Sequence[int]) -> None:
        self.fn, self.bsym, self.positions = fn, bsym, tuple(positions)
        self.name = getattr(fn, "name", None)
        self._variants: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        if bsym is not None:
            from thunder.core.dtypes import to_torch_dtype

            # what zeros for an absent argument look like (kept apart from the proxies, so that
            # kforge.trace_cache can rebuild this object without the trace)
            self.nargs = len(bsym.args)
            self.specs = {i: (tuple(bsym.args[i].shape), to_torch_dtype(bsym.args[i].dtype),
                              bsym.args[i].device.device_str()) for i in self.positions}

    def plan(self, absent: tuple) -> Any:
        """The region IR with the arguments `absent` as 0, or None when no kernel can run it (the
        region then runs on zeros made for them)."""
        from . import codegen, ir as fir

        b = self.bsym
        try:
            region = fir.lower(b.subsymbols, list(b.args), list(b.output), zeros=absent)
            codegen.schedule(region)
            return region
        except fir.Unsupported:
            return None

    def __call__(self, *args: Any) -> Any:
        absent = tuple(i for i in self.positions if args[i] is None)
        if not absent:
            return self.fn(*args)
        run = self._variants.get(absent)
        if run is None:
            with self._lock:
                run = self._variants.get(absent) or self._variants.setdefault(absent, self._specialize(absent))
        return run(*(a for i, a in enumerate(args) if i not in absent))

    def _specialize(self, absent: tuple) -> Any:
        from .executor import _device_index, region_callable

        region = self.plan(absent)
        if region is None:
            return self._materializing(absent)
        return region_callable(region, _device_index(self.bsym.args, self.bsym.output))[0]

    def _materializing(self, absent: tuple) -> Any:
        """The region as traced, with zeros made for the absent arguments (what autograd would do)."""
        import torch

        specs = {i: self.specs[i] for i in absent}
        n = self.nargs

        def run(*present: Any) -> Any:
            it = iter(present)
            full = [torch.zeros(specs[i][0], dtype=specs[i][1], device=specs[i][2]) if i in specs else next(it)
                    for i in range(n)]
            return self.fn(*full)

        return run


def _is_kforge_fusion(b: Any) -> bool:
    from .executor import KforgeFusionExecutor

    return bool(b.sym.is_fusion) and isinstance(b.sym.executor, KforgeFusionExecutor) and bool(b._call_ctx)


def _cotangent_unpack(trace: Any) -> tuple[int, Any] | None:
    """(position, bsym) of the backward trace's `... = cotangents` unpack; None in a forward trace."""
    from thunder.core.prims import PrimIDs

    for i, b in enumerate(trace.bound_symbols):
        if b.sym.id == PrimIDs.UNPACK_SEQUENCE and getattr(b.args[0], "name", None) == "cotangents":
            return i, b
    return None


_BOOKKEEPING = ("del", "python_del", "clear_mutable_collection")


def rewrite(trace: Any) -> Any:
    """The backward `trace` with absent cotangents allowed (see the module's docstring); the trace
    itself when it is not a backward trace or its shapes are not static."""
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceProvenance, from_trace

    found = _cotangent_unpack(trace)
    if found is None:
        return trace
    at, unpack = found
    cots = {p.name: i for i, p in enumerate(unpack.output) if isinstance(p, TensorProxy)}
    if not cots or any(not all(isinstance(s, int) for s in unpack.output[i].shape) for i in cots.values()):
        return trace
    readers: dict[str, list[int]] = {n: [] for n in cots}
    bsyms = trace.bound_symbols
    for j in range(at + 1, len(bsyms)):
        if bsyms[j].sym.name in _BOOKKEEPING:
            continue
        for p in bsyms[j].flat_proxy_args:
            if p.name in readers:
                readers[p.name].append(j)
    tolerant = {n for n, js in readers.items() if all(_is_kforge_fusion(bsyms[j]) for j in js)}
    if not tolerant:
        return trace  # nothing to skip: autograd's materialized zeros are what the fill would make
    wrapped = {j for n in tolerant for j in readers[n]}
    new = list(bsyms[:at])
    fill = tuple((i, tuple(unpack.output[i].shape), _dtype_name(unpack.output[i]), unpack.output[i].device.device_str())
                 for n, i in cots.items() if n not in tolerant)
    new.append(_fill_op().bind(unpack.args[0], fill, output=None))
    for j in range(at, len(bsyms)):
        b = bsyms[j]
        if j in wrapped:
            positions = [k for k, a in enumerate(b.args) if getattr(a, "name", None) in tolerant]
            name = b.sym.name
            b = b.from_bsym(_call_ctx={name: ZeroAware(b._call_ctx[name], b, positions)})
        new.append(b)
    out = from_trace(trace)
    out.bound_symbols = new
    out.set_provenance(TraceProvenance(f"kforge: absent gradients of {len(tolerant)} outputs never "
                                       f"materialized, {len(fill)} filled with zeros when absent"))
    return out


def _dtype_name(p: Any) -> str:
    from thunder.core.dtypes import to_torch_dtype

    return str(to_torch_dtype(p.dtype)).split(".")[-1]


class ZeroCotangents(Transform):
    """kforge's last post-optimization transform: lets a backward skip gradients nobody asked for."""

    def transform_trace_post_optimization(self, computation_trace: Any, **kwargs: Any) -> Any:
        install()
        return rewrite(computation_trace)


def _accepts_none(backward: Any) -> bool:
    """Whether `backward` (a backward trace's python callable) was built from a rewritten trace."""
    ok = getattr(backward, "_kforge_accepts_none", None)
    if ok is None:
        import inspect

        # the trace's function is wrapped (no_grad, no_autocast): its globals hold the trace's symbols
        g = getattr(inspect.unwrap(backward), "__globals__", {})
        ok = _FILL in g and getattr(g[_FILL], "__name__", "") == _fill.__name__
        try:
            backward._kforge_accepts_none = ok
        except AttributeError:
            pass
    return ok


_KEY = "kforge_accepts_none"
_installed = False


def install() -> None:
    """Let Thunder's autograd functions pass None for absent gradients to a rewritten backward."""
    global _installed
    if _installed:
        return
    from thunder.executors import torch_autograd as ta

    # Thunder's own classes, also where kforge.lookasides has put its subclasses in the module (which
    # inherit the patched forwards)
    out_cls = getattr(ta.ThunderOutputFunction, "_kforge_thunders", ta.ThunderOutputFunction)
    fn_cls = getattr(ta.ThunderFunction, "_kforge_thunders", ta.ThunderFunction)
    fn_forward = fn_cls.forward
    out_forward = out_cls.forward

    def forward(ctx, return_none, compiled_backward, side_channel, *rest):
        accepts = _accepts_none(compiled_backward)
        if accepts and side_channel is None:
            ctx.set_materialize_grads(False)   # one function carries the outputs: its gradients
        res = fn_forward(ctx, return_none, compiled_backward, side_channel, *rest)
        if accepts and side_channel is not None:
            side_channel[_KEY] = True          # the output function carries them: tell it
        return res

    def output_forward(ctx, dummy, side_channel, *args):
        if side_channel.pop(_KEY, False):
            ctx.set_materialize_grads(False)
        return out_forward(ctx, dummy, side_channel, *args)

    fn_cls.forward = staticmethod(forward)
    out_cls.forward = staticmethod(output_forward)
    _installed = True
