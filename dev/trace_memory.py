"""Live tensor bytes through a zoo model's final traces, traced as on a GPU (CPU, no kernels run):
where a training step's activation memory peaks and which tensors make it.

    PYTHONPATH=python:tests python3 dev/trace_memory.py plain_llama --size bench [--autocast] [--top 12]

Walks the forward trace, then the backward trace from the tensors the forward saved for it: each
tensor a symbol makes counts from that symbol until its `del` (or the end of its trace); a view
(reshape, permute, ...) counts nothing and keeps its base live until both are deleted. Parameters,
gradients and optimizer state are not counted (they are the same for every backend), nor what
kernels allocate inside (workspaces, a launcher's temporaries), nor the caching allocator's rounding
and fragmentation: compare the peaks of two traces of the same model, not with measured GiB.
"""
from __future__ import annotations

import argparse
import importlib
import math

import torch


def nbytes(p) -> int:
    from thunder.core import dtypes

    return math.prod(p.shape) * dtypes.to_torch_dtype(p.dtype).itemsize


# Symbols whose tensor output is a view of their first tensor argument (reshape where torch.reshape
# gives a view, as it does for the contiguous tensors these traces reshape): no bytes of their own,
# and they keep that argument's storage alive.
VIEWS = {"torch_prims_reshape_impl", "reshape", "view", "permute", "transpose", "unsqueeze", "squeeze",
         "expand", "shallow_copy", "split", "__getitem__"}


def walk(trace, live: dict[str, tuple[int, str]]) -> tuple[int, str, dict[str, tuple[int, str]]]:
    """(peak bytes, symbol at the peak, what was live then); `live` ({name: (bytes, maker)}) is
    updated to what is live at the trace's end. A view counts nothing itself and keeps its base's
    bytes live until the base and every view of it are deleted."""
    from thunder.core.prims import PrimIDs
    from thunder.core.proxies import TensorProxy

    base = {name: name for name in live}  # tensor name -> the name owning its storage
    users = {name: {name} for name in live}  # storage owner -> names still referring to it
    peak, at, at_peak = sum(v[0] for v in live.values()), "start", dict(live)
    for b in trace.bound_symbols:
        if b.sym.id == PrimIDs.DEL:
            for p in b.flat_proxy_args:
                owner = base.pop(p.name, None)
                if owner is not None:
                    users[owner].discard(p.name)
                    if not users[owner]:
                        live.pop(owner, None)
                        del users[owner]
        elif b.sym.id != PrimIDs.RETURN:
            src = next((a for a in b.flat_proxy_args if isinstance(a, TensorProxy)), None)
            for p in b.flat_proxy_outs:
                if not isinstance(p, TensorProxy) or p.name in base:
                    continue
                if b.sym.name in VIEWS and src is not None and src.name in base:
                    base[p.name] = base[src.name]
                else:
                    base[p.name] = p.name
                    users[p.name] = set()
                    live[p.name] = (nbytes(p), b.sym.name)
                users[base[p.name]].add(p.name)
            cur = sum(v[0] for v in live.values())
            if cur > peak:
                peak, at, at_peak = cur, b.sym.name, dict(live)
    return peak, at, at_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="kforge.zoo module: nanogpt, plain_llama, hf_gpt2, hf_llama")
    ap.add_argument("--size", default="micro")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--autocast", action="store_true", help="fp32 weights under bf16 autocast")
    ap.add_argument("--top", type=int, default=12, help="largest tensors listed at each peak")
    args = ap.parse_args()

    import kforge
    from conftest import fake_cuda_trace
    from thunder.core.proxies import TensorProxy

    make = importlib.import_module(f"kforge.zoo.{args.model}").make
    ft = fake_cuda_trace(make, jit=lambda f: kforge.jit(f, trace_cache=False), size=args.size, batch=args.batch,
                         seq=args.seq, dtype=torch.bfloat16, autocast=args.autocast)
    gib = 2.0**30
    fwd_peak, fwd_at, fwd_live = walk(ft.forward, {})
    saved = {p.name: (nbytes(p), "saved") for p in ft.backward.args[0][0] if isinstance(p, TensorProxy)}
    bwd_peak, bwd_at, bwd_live = walk(ft.backward, dict(saved))
    print(f"forward peak {fwd_peak / gib:.3f} GiB at {fwd_at}; saved for backward {sum(v[0] for v in saved.values()) / gib:.3f} GiB;"
          f" backward peak {bwd_peak / gib:.3f} GiB at {bwd_at}")
    for what, live in (("forward", fwd_live), ("backward", bwd_live)):
        print(f"largest live at the {what} peak:")
        for name, (n, maker) in sorted(live.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"  {n / 2**20:9.1f} MiB  {name}  ({maker})")


if __name__ == "__main__":
    main()
