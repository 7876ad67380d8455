"""Time a zoo model's trace as on a GPU on this (GPU-less) machine, with kforge's lookasides as
installed, or with some of them left out.

    PYTHONPATH=python:tests python3 dev/trace_time.py hf-llama [--layers N] [--autocast] [--without getattr,fields,...]

--without takes the names of `kforge.lookasides` entries to leave out: call, wrapped_call, getattr,
fields, contains (tuple / list), next, globals (the global-name lookup), dis. Prints the fake
trace's wall time and the prologue's number of lines.
"""
from __future__ import annotations

import argparse
import dataclasses
import dis
import importlib
import time

import torch


def _big(mod) -> str:
    """The zoo module's bench size: "bench" (the Llamas) or "124M" (nanoGPT)."""
    return "bench" if "bench" in mod.SIZES else "124M"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=["hf-llama", "plain-llama", "nanogpt"])
    ap.add_argument("--layers", type=int, default=None, help="default: the bench size's")
    ap.add_argument("--autocast", action="store_true")
    ap.add_argument("--without", default="")
    a = ap.parse_args()

    import thunder
    from conftest import fake_cuda_trace

    import kforge
    from kforge import lookasides

    names = {"call": torch.nn.Module._call_impl, "wrapped_call": torch.nn.Module._wrapped_call_impl,
             "getattr": torch.nn.Module.__getattr__, "fields": dataclasses.fields,
             "contains": tuple.__contains__, "next": next}
    drop = [w for w in a.without.split(",") if w]
    entries = lookasides._our_entries()
    gone = {names[w] for w in drop if w in names} | ({list.__contains__} if "contains" in drop else set())
    lookasides._entries = {k: v for k, v in entries.items() if k not in gone}
    if "globals" in drop:
        from thunder.core import interpreter

        lookasides._globals_lookup = interpreter.globals_lookup  # Thunder's: install() keeps it
    if "dis" in drop:
        lookasides._DIS = dis
    mod = importlib.import_module("kforge.zoo." + a.model.replace("-", "_"))
    size = _big(mod)
    if a.layers is not None:
        mod.SIZES["timed"] = dict(mod.SIZES[_big(mod)], n_layer=a.layers)
        size = "timed"
    t0 = time.perf_counter()
    ft = fake_cuda_trace(mod.make, size=size, batch=8, seq=1024, autocast=a.autocast, jit=kforge.jit, dynamo=False)
    wall = time.perf_counter() - t0
    pro = str(thunder.last_prologue_traces(ft.fn)[-1])
    print(f"{a.model} {size}{' autocast' if a.autocast else ''} without [{a.without}]: "
          f"fake trace {wall:.1f} s, prologue {len(pro.splitlines())} lines")


if __name__ == "__main__":
    main()
