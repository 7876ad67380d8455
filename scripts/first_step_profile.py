"""Where the first training step of a model under kforge.jit spends its time (trace, transforms,
fusion pass, NVRTC, run): cProfile of step 1, top entries by cumulative time.

    python scripts/first_step_profile.py kforge.zoo.plain_llama:make --size bench [--top 40]
"""
from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import pstats
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("factory", help="package.module:function returning (model, inputs, options)")
    p.add_argument("--size", default="bench", help="size preset passed to the factory")
    p.add_argument("--top", type=int, default=40, help="rows of the profile")
    args = p.parse_args()
    import kforge

    mod, fn = args.factory.split(":")
    model, inputs, opts = getattr(importlib.import_module(mod), fn)(size=args.size, batch=8, seq=1024)
    jm = kforge.jit(model)
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    opts["loss_fn"](jm(*inputs)).backward()
    torch.cuda.synchronize()
    pr.disable()
    print(f"first step {time.perf_counter() - t0:.1f} s; NVRTC compiles {kforge.cache_info()['nvrtc_compiles']}")
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(args.top)
    print(s.getvalue())


if __name__ == "__main__":
    main()
