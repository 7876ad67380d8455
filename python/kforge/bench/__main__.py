"""python -m kforge.bench {ops,gpt2,llama,launch} — benchmarks on a CUDA GPU.

Kernel times are medians of CUDA-event timings of back-to-back calls queued behind a sleep kernel
(so host launch overhead is not counted), over input sets rotated through more memory than L2 holds;
bandwidth is reported against the
device-to-device copy bandwidth measured in the same run. Model steps are medians of whole training
steps (forward, backward, fused AdamW). Every run prints a Markdown block (device, torch version,
date, command) ready to paste into BENCHMARKS.md unchanged; --json writes the raw numbers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

from . import harness


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m kforge.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    ops = sub.add_parser("ops", help="each kernel's GB/s vs copy bandwidth, eager and torch.compile")
    ops.add_argument("--op", action="append", help="only these ops (repeatable)")
    ops.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "both"])
    ops.add_argument("--quick", action="store_true", help="fewer sizes")
    ops.add_argument("--no-compile", action="store_true", help="skip torch.compile columns")
    ops.add_argument("--plot", metavar="DIR", help="write PNG charts of GB/s vs size per op")
    for name in ("gpt2", "llama"):
        m = sub.add_parser(name, help=f"{name} training step: ms/step and peak memory per backend")
        m.add_argument("--batch", type=int, default=8)
        m.add_argument("--seq", type=int, default=1024)
        m.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"])
        m.add_argument("--steps", type=int, default=10)
        m.add_argument("--attention", default="both", choices=["manual", "sdpa", "both"])
        m.add_argument("--backends", default="eager,thunder,thunder+kforge,torch.compile",
                       help="comma-separated subset of eager,thunder,thunder+kforge,torch.compile")
        m.add_argument("--small", action="store_true", help="a small model (smoke test)")
    sub.add_parser("launch", help="host time per kernel launch from Python")
    for sp in sub.choices.values():
        sp.add_argument("--json", metavar="FILE", help="write raw results as JSON")
        sp.add_argument("--markdown", metavar="FILE", help="append the Markdown block to FILE")
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("kforge.bench needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    header = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.date.today().isoformat(),
        "command": "python -m kforge.bench " + " ".join(shlex.quote(a) for a in argv),
        # The kforge commit measured: KFORGE_COMMIT (set where the checkout has no .git), else git.
        "commit": os.environ.get("KFORGE_COMMIT") or _git_commit(),
    }
    if args.what == "ops":
        result = harness.bench_ops(args)
    elif args.what in ("gpt2", "llama"):
        result = harness.bench_model(args.what, args)
    else:
        result = harness.bench_launch(args)
    md = harness.markdown(header, result)
    print(md)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(md + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header, **result}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
