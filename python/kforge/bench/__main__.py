"""python -m kforge.bench (also: python -m kforge bench) — benchmarks, and the record they keep.

Measuring (CUDA GPU):
  models    users' models (kforge.zoo: nanogpt, plain-llama, hf-llama, hf-gpt2, hf-mixtral; --model pkg.mod:factory):
            ms/step, peak memory, first step, loss per set-up and backend (eager, torch.compile,
            thunder, kforge); --second-process, --preset small (CUDA graphs, B=4 T=64); --dry on CPU
  ops       each kernel's time and GB/s against copy bandwidth, eager and torch.compile
  gpt2      kforge's reference GPT-2 training step per backend
  llama     kforge's reference Llama training step per backend
  launch    host time per kernel launch from Python
Record:
  report    regenerate BENCHMARKS.md and docs/plots from benchmarks/records.jsonl
  import-md one-time: the tables of the hand-kept BENCHMARKS.md into the record

Every measuring run prints its Markdown block and appends one JSON line to the record
(benchmarks/records.jsonl; --record FILE elsewhere, --no-record not at all). Kernel times are
medians of CUDA-event timings of back-to-back calls queued behind a sleep kernel (host launch
overhead not counted), over input sets rotated through more memory than L2 holds; model steps are
medians of whole training steps (forward, backward, fused AdamW). Set KFORGE_COMMIT where the
checkout has no .git, so the record names the commit measured.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings

from .. import _cli
from . import records

SUBCOMMANDS = ("models", "ops", "gpt2", "llama", "launch", "report", "import-md")
MEASURING = ("models", "ops", "gpt2", "llama", "launch")
FACTORY_HELP = _cli.factory_contract(
    ("size", "batch", "seq", "device", "dtype", "seed", "autocast", "dropout"),
    "batch and seq are the\n            benchmark's (--batch, --seq), size is passed when --size is "
    "given, dropout when --dropout is,\n            autocast (a bool) says whether the step runs under "
    "bf16 autocast")


def invoked_as() -> str:
    """How the user called us, for usage lines and the record: `python -m kforge bench` when the
    process's main module is kforge's, else `python -m kforge.bench`."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return "python -m kforge bench" if getattr(spec, "name", "") == "kforge.__main__" else "python -m kforge.bench"


def _add_record_args(sp: argparse.ArgumentParser) -> None:
    g = sp.add_argument_group("output")
    g.add_argument("--record", metavar="FILE", default=None,
                   help=f"append the run to this JSONL record (default: {records.RECORD_NAME} of the checkout)")
    g.add_argument("--no-record", action="store_true", help="do not append the run to the record")
    g.add_argument("--json", metavar="FILE", help="also write the run object as JSON to FILE")
    g.add_argument("--markdown", metavar="FILE", help="also append the printed Markdown block to FILE")


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of `python -m kforge.bench`."""
    prog = prog or invoked_as()
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", metavar="{" + ",".join(SUBCOMMANDS) + "}",
                           help="what to run (each has --help)")

    m = sub.add_parser("models", help="users' models: ms/step, memory, first step per set-up and backend",
                       description="Training steps of models written as people write them. "
                       "Backends: eager, torch.compile, thunder (thunder.jit / thunderfx), kforge "
                       "(kforge.jit / kforge.compile).",
                       epilog=FACTORY_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_argument("names", nargs="*", metavar="MODEL",
                   help="zoo models to run: nanogpt, plain-llama, hf-llama, hf-gpt2, hf-mixtral (default: the first three, unless --model)")
    m.add_argument("--model", dest="model_specs", action="append", metavar="PKG.MODULE:FACTORY",
                   help="your own model's factory (repeatable); contract below")
    m.add_argument("--preset", choices=["small"],
                   help="small: the llm.c notebook's case, nanogpt 124M, B=4 T=64, fp32, --cudagraphs")
    m.add_argument("--size", help="size preset passed to every factory (zoo: 124M / bench, tiny, micro; "
                                  "default: nanogpt and hf-gpt2 124M, plain-llama, hf-llama and hf-mixtral bench)")
    m.add_argument("--dropout", type=float, metavar="P",
                   help="dropout probability passed to every factory (zoo: nanogpt's and hf-gpt2's embedding, "
                        "attention and residual dropout, hf-llama's and hf-mixtral's attention dropout; plain-llama has none); "
                        "default: each factory's own (the zoo's: off)")
    m.add_argument("--setup", choices=["bf16", "autocast", "fp32", "both", "all"],
                   help="bf16 weights; fp32 weights + torch.autocast(bf16); fp32; both = bf16 and autocast "
                        "(default); all = the three")
    m.add_argument("--backends", metavar="LIST",
                   help="comma-separated subset of eager,torch.compile,thunder,kforge,kforge+gemm,kforge-gemm,"
                        "kforge+group,kforge+tune,kforge-tune,kforge+cefused (default: the first four; kforge+gemm / kforge-gemm are "
                        "kforge.jit(gemm=True / False), kforge+group kforge with the opt-in linear_group pattern, "
                        "kforge+tune / kforge-tune kforge with GEMM tuning on / off (KFORGE_GEMM_TUNE), "
                        "kforge+cefused kforge traced with KFORGE_CE_FUSED=1, for A/B timing)")
    m.add_argument("--batch", type=int, help="batch size (default 8; --dry 2)")
    m.add_argument("--seq", type=int, help="sequence length, clipped to the model's context (default 1024; --dry 16)")
    m.add_argument("--steps", type=int, help="timed steps per row (default 10)")
    m.add_argument("--warmup", type=int, help="untimed steps before them, the first included (default 3)")
    m.add_argument("--cudagraphs", action="store_true",
                   help="torch.compile mode='reduce-overhead'; thunder with Thunder's CUDAGraphTransform; "
                        "kforge with kforge.jit(cudagraphs=True)")
    m.add_argument("--path", choices=["jit", "dynamo"],
                   help="how thunder and kforge reach every model: jit = thunder.jit / kforge.jit, dynamo = "
                        "Thunder's Dynamo path (thunderfx / kforge.compile); default: each factory's own "
                        "(zoo: hf-llama and hf-mixtral dynamo, the others jit)")
    m.add_argument("--second-process", action="store_true",
                   help="time the first step of kforge and torch.compile again in a fresh process (warm disk caches)")
    m.add_argument("--no-trace-cache", dest="trace_cache", action="store_false",
                   help="KFORGE_TRACE_CACHE=0 for every row: --second-process traces again instead of "
                        "restoring Thunder's programs from kforge.jit's disk cache (kforge.trace_cache, on "
                        "by default)")
    m.add_argument("--sequential", action="store_true",
                   help="time each row alone, one after the other (default: the backends of one model and "
                        "set-up stay alive together and their timed steps alternate in 5 blocks, so that "
                        "drifts in host speed fall on all of them alike)")
    m.add_argument("--warm-caches", action="store_true",
                   help="keep the usual kforge / Inductor / Triton disk caches (default: fresh ones per row)")
    m.add_argument("--dry", action="store_true",
                   help="CPU, no timing: build every zoo model at its micro size and train two steps per "
                        "backend, to check the wiring (not recorded)")
    _add_record_args(m)

    o = sub.add_parser("ops", help="each kernel's GB/s vs copy bandwidth, eager and torch.compile")
    o.add_argument("--op", action="append", help="only these ops (repeatable; default: every op with bench cases)")
    o.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "both"], help="dtypes to time (default bf16)")
    o.add_argument("--quick", action="store_true", help="fewer sizes")
    o.add_argument("--no-compile", action="store_true", help="skip the torch.compile columns")
    o.add_argument("--plot", metavar="DIR", help="also write PNG charts of GB/s vs size per op to DIR")
    _add_record_args(o)

    for name in ("gpt2", "llama"):
        g = sub.add_parser(name, help=f"kforge's reference {name} training step: ms/step and peak memory per backend")
        g.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
        g.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
        g.add_argument("--dtype", default="bf16", choices=["fp32", "bf16"], help="parameter dtype (default bf16)")
        g.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
        g.add_argument("--attention", default="both", choices=["manual", "sdpa", "both"],
                       help="manual (matmul + causal softmax) or sdpa attention (default both)")
        g.add_argument("--backends", default="eager,thunder,thunder+kforge,torch.compile",
                       help="comma-separated subset of eager,thunder,thunder+kforge,torch.compile")
        g.add_argument("--small", action="store_true", help="a small model (smoke test)")
        _add_record_args(g)

    la = sub.add_parser("launch", help="host time per kernel launch from Python")
    _add_record_args(la)

    r = sub.add_parser("report", help="regenerate BENCHMARKS.md and docs/plots from the record")
    root = records.repo_root() or os.getcwd()
    r.add_argument("--record", metavar="FILE", action="append",
                   help=f"record file(s) to read (repeatable; default: {records.RECORD_NAME})")
    r.add_argument("--output", metavar="FILE", default=os.path.join(root, "BENCHMARKS.md"),
                   help="the Markdown file to write (default: BENCHMARKS.md of the checkout)")
    r.add_argument("--plots", metavar="DIR", default=os.path.join(root, "docs", "plots"),
                   help="where the charts go (default: docs/plots of the checkout)")
    r.add_argument("--no-plots", action="store_true", help="write the Markdown only")
    r.add_argument("--experiments", metavar="DIR", default=os.path.join(root, "docs", "experiments"),
                   help="the experiment notes to link (default: docs/experiments of the checkout)")
    r.add_argument("--check", action="store_true",
                   help="write nothing; exit status 1 if the Markdown differs from what the record gives")

    im = sub.add_parser("import-md", help="one-time: the tables of a hand-kept BENCHMARKS.md into the record")
    im.add_argument("source", help="the BENCHMARKS.md to read")
    im.add_argument("--record", metavar="FILE", default=None,
                    help=f"the record to append to (default: {records.RECORD_NAME} of the checkout)")
    im.add_argument("--from-commit", metavar="SHA",
                    help="the commit the file is from (default: git's last commit of it)")
    im.add_argument("--dry-run", action="store_true", help="print what would be imported; append nothing")
    return p


def _record_path(arg: str | None) -> str:
    return arg or records.default_record_path()


def _need_matplotlib(prog: str, what: str, instead: str) -> bool:
    """False (after one line on stderr) when charts are asked for and matplotlib, an optional extra,
    is not installed."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        return True
    print(f"{prog} {what}: error: charts need matplotlib: pip install 'kforge[plot]' (or {instead})",
          file=sys.stderr)
    return False


def _measure(args: argparse.Namespace, argv: list[str], prog: str) -> int:
    import torch

    from . import harness

    dry = args.what == "models" and args.dry
    if args.what == "ops" and args.plot and not _need_matplotlib(prog, "ops", "leave out --plot"):
        return 2
    cfg = None
    if args.what == "models":  # usage errors first: they need no GPU to find
        from . import models

        try:
            cfg = models.resolve(args)
        except models.UsageError as e:
            print(f"{prog} models: error: {e}", file=sys.stderr)
            return 2
    if not dry and not torch.cuda.is_available():
        print(f"{prog} {args.what} needs a CUDA GPU; none is visible"
              + (" (--dry checks the wiring on the CPU)." if args.what == "models" else "."), file=sys.stderr)
        return 2
    command = f"{prog} " + " ".join(shlex.quote(a) for a in argv)
    header = records.run_header(command, device="cpu" if dry else "cuda")
    if cfg is not None:
        result = models.bench_models(cfg, progress=harness.progress_enabled(),
                                     log=lambda s: print(s, file=sys.stderr, flush=True))
    elif args.what == "ops":
        result = harness.bench_ops(args)
    elif args.what in ("gpt2", "llama"):
        result = harness.bench_model(args.what, args)
    else:
        result = harness.bench_launch(args)
    run = {**header, **result}
    md = harness.markdown(run)
    print(md)
    if args.markdown:
        with open(args.markdown, "a", encoding="utf-8") as f:
            f.write(md + "\n")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(run, f, indent=1, default=str)
    if dry:
        print("(dry run: not recorded)", file=sys.stderr)
    elif not args.no_record:
        path = _record_path(args.record)
        records.append(path, run)
        print(f"recorded in {path}; `{prog} report` regenerates BENCHMARKS.md", file=sys.stderr)
    return 0


def _report(args: argparse.Namespace, prog: str) -> int:
    from . import report

    paths = args.record or [records.default_record_path()]
    runs = records.load(paths)
    if not runs:
        print(f"{prog} report: no runs in {', '.join(paths)}", file=sys.stderr)
        return 2
    plots_dir = None if (args.no_plots or args.check) else args.plots
    if plots_dir is not None and not _need_matplotlib(prog, "report", "--no-plots"):
        return 2
    text, plots = report.render(runs, doc_path=args.output, plots_dir=plots_dir, exp_dir=args.experiments,
                                record_path=paths[0])
    if args.check:
        current = open(args.output, encoding="utf-8").read() if os.path.exists(args.output) else ""
        if current != text:
            print(f"{args.output} differs from what {', '.join(paths)} gives; run `{prog} report`", file=sys.stderr)
            return 1
        print(f"{args.output} is up to date with {', '.join(paths)}")
        return 0
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    n_tables = len(report.current_tables(runs))
    print(f"wrote {args.output} ({n_tables} tables from {len(runs)} runs) and {len(plots)} charts")
    return 0


def _import_md(args: argparse.Namespace, prog: str) -> int:
    from . import legacy

    from_commit = args.from_commit
    if from_commit is None:
        import subprocess

        try:
            r = subprocess.run(["git", "log", "-1", "--format=%h", "--", os.path.basename(args.source)],
                               capture_output=True, text=True, timeout=10,
                               cwd=os.path.dirname(os.path.abspath(args.source)))
            from_commit = r.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            from_commit = None
    with open(args.source, encoding="utf-8") as f:
        runs = legacy.parse(f.read(), source=os.path.basename(args.source), from_commit=from_commit)
    if not runs:
        print(f"{prog} import-md: no `### \\`python -m kforge.bench ...\\`` tables in {args.source} "
              "(a generated BENCHMARKS.md has none: its figures are in the record already)", file=sys.stderr)
        return 2
    path = _record_path(args.record)
    existing = records.load(path)
    new = [r for r in legacy.oldest_first(runs, os.path.dirname(os.path.abspath(args.source)))
           if not legacy.already_imported(existing, r)]
    for r in new:
        print(f"{'would import' if args.dry_run else 'import'}: {r['kind']} {len(r['rows'])} rows, "
              f"{r['gpu']} kforge {r['commit']} — {r['command']}")
    if len(new) < len(runs):
        print(f"({len(runs) - len(new)} tables already in {path})")
    if not args.dry_run:
        records.extend(path, new)
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Entry point of `python -m kforge.bench` and of `python -m kforge bench`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = prog or invoked_as()
    warnings.filterwarnings("ignore", message="transformer_engine module not found")
    p = parser(prog)
    args = p.parse_args(argv)
    if args.what is None:
        p.print_usage(sys.stderr)
        print(f"{prog}: error: name a subcommand (one is required): {', '.join(SUBCOMMANDS)} "
              f"(`{prog} <subcommand> --help` for its options)", file=sys.stderr)
        return 2
    if args.what in MEASURING:
        return _measure(args, argv, prog)
    if args.what == "report":
        return _report(args, prog)
    return _import_md(args, prog)


if __name__ == "__main__":
    sys.exit(_cli.run(main))
