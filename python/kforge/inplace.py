"""In-place updates of tensors only the trace can see, taken out of place (`InPlaceIntermediates`).

Thunder 0.2.6 writes `x /= s` as `copy_(div(x, s), x)`: the quotient is computed, then copied
into x's memory. When x is also saved for the backward (here: the numerator, for the gradient of
s), the backward reads the overwritten x and the gradients come out wrong, silently. Hugging Face's
mixture-of-experts routers do exactly this (`router_top_value /= router_top_value.sum(...)`:
Mixtral, Qwen2/3-MoE, OLMoE); traced by Thunder, their routers' gradients were off by tens of
percent. `x.pow_(2)`, `x.mul_(y)`, ... on a tensor whose old value the backward needs go the same way.

An in-place op whose target the trace created itself, that nothing else aliases (no view of it or
view it is, not a trace input, in no multi-tensor alias group of Thunder's `update_aliases`), and
whose out-of-place form has the same dtype and shape, is rewritten to that out-of-place form: the
trace's later readers already read the op's output (Thunder renamed them), so the only effect of
the in-place write was the overwrite. The copy kernel goes too, and the fusion executor can fuse the
op with its neighbours. Everything else is left to Thunder as it is.

A tensor made by `empty` / `zeros` / `full` and then written slice by slice with `copy_` (slices of
one dim, not overlapping, covering it unless the tensor was filled with a value; nothing reading the
tensor in between) becomes the `cat` of what was copied and of that value where nothing was: Thunder
gives the copied tensors no gradient through `copy_` into a view (Hugging Face's DeepSeek-V3 builds
its keys that way; a zeros tensor written in part got a zero gradient).
"""
from __future__ import annotations

from typing import Any

from thunder.core.transform_common import Transform

from ._thunder import replace_calls

__all__ = ["InPlaceIntermediates", "take_out_of_place"]


def _names(ps) -> list[str]:
    from thunder.core.proxies import TensorProxy

    return [p.name for p in ps if isinstance(p, TensorProxy)]


def _call_args(b: Any) -> tuple[list, dict]:
    """(args, kwargs) of bound symbol `b` as its function's signature takes them: a bound symbol may
    hold keyword-only arguments positionally (`div_(a, b, None)` for rounding_mode=None)."""
    import inspect

    sig = inspect.signature(b.sym.meta)
    bound = sig.bind(*b.args, **b.kwargs)
    args, kwargs = [], {}
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            args += list(value)
        elif kind is inspect.Parameter.VAR_KEYWORD:
            kwargs.update(value)
        elif kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


# Symbols that make a tensor whose old contents nothing reads once slices cover it.
_FRESH = {"new_empty", "empty", "empty_like", "new_zeros", "zeros", "zeros_like", "new_full", "full", "full_like"}


def _slice_of(index: Any, shape: tuple) -> tuple[int, int, int] | None:
    """(dim, start, stop) when `index` (a getitem's) is full slices and Ellipsis but for one step-1
    slice along dim, else None."""
    items = list(index) if isinstance(index, tuple) else [index]
    if sum(i is Ellipsis for i in items) > 1 or not all(i is Ellipsis or isinstance(i, slice) for i in items):
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (len(shape) - len(items) + 1) + items[at + 1:]
    items += [slice(None)] * (len(shape) - len(items))
    if len(items) != len(shape):
        return None
    partial = []
    for d, (sl, n) in enumerate(zip(items, shape)):
        if sl.step not in (None, 1):
            return None
        start, stop, _ = sl.indices(n)
        if (start, stop) != (0, n):
            partial.append((d, start, stop))
    return partial[0] if len(partial) == 1 else None


def _fill_by_slices(trace: Any) -> tuple[Any, int]:
    """(`trace` with each fresh tensor written slice by slice with `copy_` (every slice along one dim,
    together covering it) made the `cat` of what was copied, how many). Thunder 0.2.6 gives the
    copied tensors no gradient at all through such writes (Hugging Face's DeepSeek-V3 builds its
    keys this way: the key path's weights got none of the attention's gradient)."""
    import thunder.torch as ltorch
    from thunder.core import prims
    from thunder.core.proxies import TensorProxy, variableify
    from thunder.core.trace import TraceProvenance, from_trace, tracectx

    bsyms = list(trace.bound_symbols)
    count = 0
    i = 0
    while i < len(bsyms):
        b = bsyms[i]
        outs = [o for o in b.flat_proxy_outs if isinstance(o, TensorProxy)]
        if b.sym.name not in _FRESH or len(outs) != 1:
            i += 1
            continue
        match = _match_fill(bsyms, i, outs[0], prims, TensorProxy, _fill_value(b))
        if match is None:
            i += 1
            continue
        consumed, pieces, dim, final, at = match
        new = from_trace(trace)
        new.push_scope([])
        with tracectx(new):
            parts = []
            for shape, src in pieces:
                if not isinstance(src, TensorProxy):  # a span no copy wrote: the base's fill value
                    parts.append(ltorch.full(shape, src, device=final.device, dtype=final.dtype))
                    continue
                t = src if tuple(src.shape) == shape else ltorch.expand(src, shape)
                parts.append(t if t.dtype == final.dtype else ltorch.to(t, final.dtype))
            out = ltorch.cat(parts, dim)
        made = [m.from_bsym_swap_proxies({variableify(out): final}) for m in new.pop_scope()]
        bsyms = [x for k, x in enumerate(bsyms[:at]) if k not in consumed] + made + bsyms[at:]
        count += 1
        i = 0
    if not count:
        return trace, 0
    out_trace = from_trace(trace)
    out_trace.bound_symbols = bsyms
    out_trace.set_provenance(TraceProvenance(f"kforge: {count} tensor(s) filled slice by slice made a cat"))
    return out_trace, count


def _fill_value(b: Any) -> Any:
    """The value a zeros / full bound symbol fills its tensor with; None for empty (and anything else)."""
    import inspect
    from numbers import Number

    if b.sym.name in ("new_zeros", "zeros", "zeros_like"):
        return 0
    if b.sym.name in ("new_full", "full", "full_like"):
        try:
            value = inspect.signature(b.sym.meta).bind(*b.args, **b.kwargs).arguments.get("fill_value")
        except (TypeError, ValueError):
            return None
        return value if isinstance(value, Number) and not isinstance(value, bool) else None
    return None


def _match_fill(bsyms: list, i: int, base: Any, prims: Any, TensorProxy: type, fill: Any = None):
    """(indices of the bound symbols to drop, [(span shape, copied tensor or the fill value)] in order
    along the dim, dim, the base's last name, where the cat goes) for the fill starting at bsyms[i],
    or None. Spans no copy wrote keep the base's `fill` value (None: an empty base, no such span)."""
    role: dict[str, Any] = {base.name: "base"}
    current = {"base": base.name}
    views: list[dict] = []
    consumed = {i}
    for j in range(i + 1, len(bsyms)):
        b = bsyms[j]
        args = [a for a in b.flat_proxy_args if isinstance(a, TensorProxy)]
        ins = [a.name for a in args]
        touched = [n for n in ins if n in role]
        if b.sym.id == prims.PrimIDs.UPDATE_ALIASES and touched:
            outs = [o.name for o in b.flat_proxy_outs]
            if len(touched) != len(ins) or len(outs) != len(ins):
                return None
            for n, o in zip(ins, outs):
                role[o] = role[n]
                current[role[n]] = o
            consumed.add(j)
            continue
        if b.sym.name == "getitem" and ins[:1] == [current["base"]] and len(touched) == 1:
            where = _slice_of(b.args[1], tuple(base.shape))
            if where is None or len(b.flat_proxy_outs) != 1:
                return None
            k = ("view", len(views))
            views.append({"slice": where, "shape": tuple(b.flat_proxy_outs[0].shape), "src": None})
            role[b.flat_proxy_outs[0].name] = k
            current[k] = b.flat_proxy_outs[0].name
            consumed.add(j)
            continue
        if b.sym.name == "copy_" and touched and ins[0] in role and role[ins[0]] != "base" \
                and current.get(role[ins[0]]) == ins[0] and len(touched) == 1 and isinstance(b.args[1], TensorProxy):
            view = views[role[ins[0]][1]]
            if view["src"] is not None:
                return None
            view["src"] = b.args[1]
            for o in b.flat_proxy_outs:
                role[o.name] = role[ins[0]]
                current[role[ins[0]]] = o.name
            consumed.add(j)
            continue
        if not touched:
            continue
        # the first reader of the filled tensor: it reads the base's latest name only, every slice is
        # written, and the slices partition one dim
        if touched != [current["base"]] * len(touched) or not views or any(v["src"] is None for v in views):
            return None
        dims = {v["slice"][0] for v in views}
        if len(dims) != 1:
            return None
        dim = dims.pop()
        spans = sorted(((v["slice"][1], v["slice"][2], v["shape"], v["src"]) for v in views), key=lambda x: x[0])

        def gap(n: int) -> tuple:
            return tuple(n if d == dim else size for d, size in enumerate(base.shape)), fill

        pieces, edge = [], 0
        for start, stop, shape, src in spans + [(base.shape[dim], base.shape[dim], None, None)]:
            if start < edge or (start > edge and fill is None):
                return None  # overlapping copies, or a span of an empty tensor nothing wrote
            if start > edge:
                pieces.append(gap(start - edge))
            if src is not None:
                pieces.append((shape, src))
            edge = stop
        final = next(a for a in args if a.name == current["base"])
        return consumed, pieces, dim, final, j
    return None


def take_out_of_place(trace: Any) -> tuple[Any, int]:
    """(`trace` with the in-place ops on unaliased intermediates rewritten out of place, how many);
    `trace` itself when none is."""
    import thunder.torch as ltorch
    from thunder.core import prims
    from thunder.core.trace import TraceProvenance, from_trace, tracectx
    from thunder.core.update_aliases import _is_inplace_op, _is_view_creation_op

    trace, filled = _fill_by_slices(trace)
    bsyms = trace.bound_symbols
    if not any(_is_inplace_op(b) for b in bsyms):
        return trace, filled
    # Names of one storage: a tensor and its update_aliases output, an in-place op's target and its
    # output. A class is unsafe when it holds a trace input, a view of another tensor, or a tensor
    # Thunder groups with others in one update_aliases (a view of it exists). Views taken of the
    # op's result afterwards are views of the new tensor: no concern.
    parent: dict[str, str] = {}

    def find(n: str) -> str:
        while parent.get(n, n) != n:
            parent[n] = parent.get(parent[n], parent[n])
            n = parent[n]
        return n

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb

    marked: list[str] = list(_names(trace.args))
    for b in bsyms:
        ins, outs = _names(b.flat_proxy_args), _names(b.flat_proxy_outs)
        if b.sym.id == prims.PrimIDs.UPDATE_ALIASES:
            for n in ins[1:] + outs:  # a group of aliased tensors in, their new names out
                union(ins[0], n)
            if len(ins) > 1 or len(outs) > 1:
                marked += ins
        elif _is_inplace_op(b):
            if ins:
                for o in outs:
                    union(ins[0], o)
        elif _is_view_creation_op(b):
            marked += outs
    unsafe = {find(n) for n in marked}

    scratch = from_trace(trace)  # probes of the out-of-place forms are traced here and dropped
    chosen: dict[int, Any] = {}
    for b in bsyms:
        oop = ltorch._inplace_to_out_of_place.get(b.sym) if _is_inplace_op(b) else None
        ins, outs = _names(b.flat_proxy_args), _names(b.flat_proxy_outs)
        if oop is None or oop[1] != -1 or not ins or len(outs) != 1 or find(ins[0]) in unsafe:
            continue
        sym, out = oop[0], b.flat_proxy_outs[0]
        scratch.push_scope([])
        try:
            args, kwargs = _call_args(b)
            with tracectx(scratch):
                probe = sym(*args, **kwargs)
        except Exception:  # arguments the out-of-place form does not take: leave it
            continue
        finally:
            scratch.pop_scope()
        if getattr(probe, "dtype", None) == out.dtype and tuple(getattr(probe, "shape", ())) == tuple(out.shape):
            chosen[id(b)] = (sym, args, kwargs)  # else the copy converts or broadcasts: not the same value

    def replacement(b: Any):
        if id(b) not in chosen:
            return None
        sym, args, kwargs = chosen[id(b)]
        return lambda: sym(*args, **kwargs)

    out, n = replace_calls(trace, replacement, "kforge: {} in-place op(s) on unaliased intermediates taken out of place")
    if n and filled:
        out.set_provenance(TraceProvenance(f"kforge: {filled} tensor(s) filled slice by slice made a cat, {n} in-place "
                                           "op(s) on unaliased intermediates taken out of place"))
    return out, n + filled


class InPlaceIntermediates(Transform):
    """Rewrites in-place ops on tensors only the trace sees out of place, before Thunder's autograd
    (whose saved tensors the in-place writes would overwrite). Part of every kforge compilation;
    `rewrites` counts what it rewrote per trace."""

    def __init__(self) -> None:
        self.rewrites: list[int] = []

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        new, n = take_out_of_place(computation_trace)
        self.rewrites.append(n)
        return prologue_trace, new, epilogue_trace
