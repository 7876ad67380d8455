"""In-place updates of tensors only the trace can see, taken out of place (`InPlaceIntermediates`).

Thunder 0.2.6 writes `x /= s` as `copy_(div(x, s), x)`: the quotient is computed, then copied
into x's memory. When x is also saved for the backward (here: the numerator, for the gradient of
s), the backward reads the overwritten x and the gradients come out wrong, silently. Hugging Face's
mixture-of-experts routers do exactly this (`router_top_value /= router_top_value.sum(...)`:
Mixtral, Qwen2/3-MoE, OLMoE); under `thunder.jit` their routers' gradients were off by tens of
percent. `x.pow_(2)`, `x.mul_(y)`, ... on a tensor whose old value the backward needs go the same way.

An in-place op whose target the trace created itself, that nothing else aliases (no view of it or
view it is, not a trace input, in no multi-tensor alias group of Thunder's `update_aliases`), and
whose out-of-place form has the same dtype and shape, is rewritten to that out-of-place form: the
trace's later readers already read the op's output (Thunder renamed them), so the only effect of
the in-place write was the overwrite. The copy kernel goes too, and the fusion executor can fuse the
op with its neighbours. Everything else is left to Thunder as it is.
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


def take_out_of_place(trace: Any) -> tuple[Any, int]:
    """(`trace` with the in-place ops on unaliased intermediates rewritten out of place, how many);
    `trace` itself when none is."""
    import thunder.torch as ltorch
    from thunder.core import prims
    from thunder.core.trace import from_trace, tracectx
    from thunder.core.update_aliases import _is_inplace_op, _is_view_creation_op

    bsyms = trace.bound_symbols
    if not any(_is_inplace_op(b) for b in bsyms):
        return trace, 0
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

    return replace_calls(trace, replacement, "kforge: {} in-place op(s) on unaliased intermediates taken out of place")


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
