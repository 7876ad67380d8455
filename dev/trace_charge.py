"""Where Thunder's interpreter spends a model's trace, charged to the model's own code.

Traces a zoo model as on a GPU on this (GPU-less) machine (tests/conftest.py's fake_cuda_trace,
kforge.jit) and wraps the interpreter's `_run_frame`: the time of each interpreted frame, less that of
the interpreted frames it calls, is charged to the nearest frame on the interpreted stack whose code
lies in the model's source (transformers, torch.nn, kforge.zoo); Thunder's and torch's own frames
below it count as its cost. Prints the interpreter's total, the charged time per model function
(self and inclusive, calls) and the largest uncharged (outside any model frame) functions.

    PYTHONPATH=python:tests python3 dev/trace_charge.py hf-llama --layers 1 [--autocast] [--top 30]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import torch

MODEL_PATHS = ("/transformers/", "/torch/nn/", "/kforge/zoo/")


def _big(mod) -> str:
    """The zoo module's bench size: "bench" (the Llamas) or "124M" (nanoGPT)."""
    return "bench" if "bench" in mod.SIZES else "124M"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["hf-llama", "plain-llama", "nanogpt"])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--autocast", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()

    import importlib

    import kforge
    from conftest import fake_cuda_trace
    from thunder.core import interpreter

    mod = importlib.import_module("kforge.zoo." + a.model.replace("-", "_"))
    sizes = mod.SIZES
    sizes["charge"] = dict(sizes["bench"], n_layer=a.layers)

    self_t: dict[str, float] = collections.defaultdict(float)
    incl_t: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter[str] = collections.Counter()
    stack: list[list] = []  # [name, is_model, start, child_time]
    orig = interpreter._run_frame

    def name_of(code) -> tuple[str, bool]:
        f = code.co_filename
        model = any(p in f for p in MODEL_PATHS)
        return f"{os.path.basename(f)}:{code.co_firstlineno}:{code.co_qualname}", model

    def run_frame(frame, *args, **kwargs):
        nm, model = name_of(frame.code)
        rec = [nm, model, time.perf_counter(), 0.0]
        stack.append(rec)
        try:
            return orig(frame, *args, **kwargs)
        finally:
            stack.pop()
            total = time.perf_counter() - rec[2]
            own = total - rec[3]
            if stack:
                stack[-1][3] += total
            owner = next((r[0] for r in reversed(stack + [rec]) if r[1]), "(outside the model) " + nm)
            self_t[owner] += own
            if model:
                calls[nm] += 1
                if not any(r[0] == nm for r in stack):  # recursion counted once
                    incl_t[nm] += total

    interpreter._run_frame = run_frame
    t0 = time.perf_counter()
    try:
        fake_cuda_trace(mod.make, size="charge", batch=8, seq=1024, autocast=a.autocast, jit=kforge.jit,
                        dynamo=False)
    finally:
        interpreter._run_frame = orig
    wall = time.perf_counter() - t0
    interp = sum(self_t.values())
    print(f"{a.model}, {a.layers} layer(s){', autocast' if a.autocast else ''}: fake trace {wall:.1f} s, "
          f"interpreted frames {interp:.1f} s")
    print(f"\n{'charged s':>9} {'incl s':>7} {'calls':>6}  model function")
    for nm, t in sorted(self_t.items(), key=lambda kv: -kv[1])[: a.top]:
        print(f"{t:9.2f} {incl_t.get(nm, 0.0):7.2f} {calls.get(nm, 0):6d}  {nm}")


if __name__ == "__main__":
    sys.exit(main())
