"""Repeated views and conversions computed once.

Thunder's gradient rules restate views: the backward of a linear reshapes its output gradient to 2-D
once for the input gradient and again, identically, for the weight gradient. Each such reshape or
permute is a torch call in the final trace (about 60 per step of a 12-layer Llama's backward).
Autocast restates conversions: every linear casts its input, so the q, k and v projections cast
the same RMSNorm output to bf16 three times, and each copy is saved for its weight's gradient
(36 extra launches and 432 MiB of saved bf16 in a 12-layer, 768-wide Llama at B=8, T=1024).

`dedupe_views` keeps the first of identical symbols of these two kinds (same symbol, same input,
same arguments, same side of the forward / backward split) and points later readers at its result.
Only views and conversions: a view aliases its input whichever copy is kept, and a conversion's
fresh result is read, never written, in Thunder's functional traces.
"""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["dedupe_views"]


def dedupe_views(bsyms: Sequence[Any]) -> tuple[list, int]:
    """(bsyms without repeated view or conversion symbols, number removed)."""
    from thunder.core.proxies import variableify

    from .matmul_acc import is_conversion
    from .partition import is_view_bsym

    first: dict[Any, Any] = {}  # the view's right-hand side -> its first result
    swap: dict[Any, Any] = {}   # a removed view's result -> the first result
    out = []
    for b in bsyms:
        if swap:
            b = b.from_bsym_swap_proxies(swap, skip_inputs=False, skip_output=True)
        # shallow_copy is left alone: it exists to give a tensor a second, distinct name.
        if (len(b.flat_outs) == 1 and len(b.flat_proxy_args) == 1 and b.sym.name != "shallow_copy"
                and (is_view_bsym(b) or is_conversion(b))):
            rhs = (b.rhs, id(b._executor))  # symbol, arguments, the backward flag; who runs it
            kept = first.get(rhs)
            if kept is not None:
                swap[variableify(b.flat_outs[0])] = kept
                continue
            first[rhs] = b.flat_outs[0]
        out.append(b)
    return out, len(swap)
