"""python -m kforge <verb>: the everyday commands.

  demo      compile every kernel; on a GPU also run GPT-2 through thunder.jit + kforge and print the
            claimed symbols, the tie-out and ms/step against eager
  inspect   which kforge symbols a model's traces hold, and what kforge declined and why
  tieout    eager vs Thunder + kforge: outputs, loss and every parameter gradient against tolerance
            (exit status 0 when all are within tolerance, 1 when anything is out of tolerance; on
            CPU tensors no kforge kernel runs and the summary says so: "PASS (torch fallback only)")
  profile   kernel time per category / region / op of a training step (GPU)
  bench     python -m kforge.bench (models, ops, gpt2, llama, launch, report); arguments are passed
            through (`python -m kforge bench --help`)

Models for inspect / tieout / profile:
  gpt2       kforge.models.gpt2.GPT, thunder.jit            --size tiny (default), micro, 124M, 350M, ...
  llama      kforge.models.llama.Llama, thunder.jit         --size tiny (default), micro, hf-test, bench
  hf-llama   transformers LlamaForCausalLM, Thunder's Dynamo path with kforge's Llama patterns
             (kforge.transforms.thunderfx)                 --size hf-test (default), micro, tiny, bench
  --model package.module:factory    your own model (contract: `python -m kforge tieout --help`)

-v before the verb logs what the runtime does (NVRTC loaded, compile times); -vv adds cache hits.

Examples:
  python -m kforge demo
  python -m kforge inspect gpt2 --size tiny --show-traces
  python -m kforge tieout llama --dtype bf16
  python -m kforge tieout --model mypkg.models:make_model --device cuda
  python -m kforge profile gpt2 --size 124M --batch 8 --seq 1024 --dtype bf16
  python -m kforge bench ops --quick
"""
from __future__ import annotations

import argparse
import inspect as pyinspect
import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import _cli

MODELS = ("gpt2", "llama", "hf-llama")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp64": "float64"}
DEFAULT_SIZE = {"gpt2": "tiny", "llama": "tiny", "hf-llama": "hf-test"}
DEFAULT_BATCH, DEFAULT_SEED = 4, 0  # built-in models; a --model factory keeps its own defaults
# The keywords a --model factory may be called with (its signature decides which).
FACTORY_KEYWORDS = ("device (torch.device)", "dtype (torch.dtype)", "batch", "seq", "seed", "size")
FACTORY_HELP = _cli.factory_contract(
    FACTORY_KEYWORDS,
    "an option left off\n            the command line is not passed where the factory has a default of "
    "its own\n            (where it has none: batch 4, seed 0, the others None)",
    model_note=";\n            without a device / dtype keyword, kforge moves the model and "
                                 "inputs to --device\n            and, given --dtype, casts the floating parameters")


class UsageError(Exception):
    """A bad command line that argparse cannot see (unknown preset, bad factory): exit status 2."""


# ---- workloads -----------------------------------------------------------------------------------
@dataclass
class Workload:
    """A model and the inputs of one step. mode: "jit" (thunder.jit) or "dynamo" (Thunder's Dynamo
    path; `kforge.transforms.thunderfx` for inspect / profile)."""

    name: str
    model: Any
    inputs: Any  # tuple of positional arguments or dict of keyword arguments
    mode: str = "jit"
    loss_fn: Callable | None = None
    autocast: Any = None  # a dtype: the step runs under torch.autocast("cuda", dtype)
    # Extra keyword arguments of a training step (profile): the built-in models skip returning
    # logits there, as llm.c's training loop does.
    train_kwargs: dict = field(default_factory=dict)

    def call(self, fn: Callable, **extra: Any) -> Any:
        import contextlib

        import torch

        ctx = torch.autocast("cuda", dtype=self.autocast) if self.autocast is not None else contextlib.nullcontext()
        with ctx:
            if isinstance(self.inputs, dict):
                return fn(**self.inputs, **extra)
            return fn(*self.inputs, **extra)


def _torch_dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, DTYPES[name])


def _device(name: str | None):
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _check_device_arg(name: str | None, verb: str) -> None:
    """UsageError unless --device names cpu or a visible CUDA GPU: checked before any model is built,
    so a bad device is one line, not a torch traceback from deep inside model construction."""
    import torch

    if name is None:
        return
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name!r} is not a device; use cuda, cuda:N or cpu") from None
    if dev.type == "cpu":
        if verb == "profile":
            raise UsageError(f"--device {name}: kforge profile times CUDA kernels; it runs on --device cuda (a GPU)")
        return
    if dev.type != "cuda":
        raise UsageError(f"--device {name}: kforge runs on cuda or cpu")
    if not torch.cuda.is_available():
        hint = "kforge profile needs one" if verb == "profile" else "use --device cpu (or leave --device out)"
        raise UsageError(f"--device {name}: no CUDA GPU is visible; {hint}")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")


def _check_arch_arg(arch: int, given: bool) -> None:
    """UsageError for an architecture kforge cannot compile for (--arch, or the GPU's own): below
    sm_80, or not in the loaded NVRTC's list."""
    from ._runtime import MIN_ARCH

    what = f"--arch {arch}" if given else f"this GPU is sm_{arch}"
    if arch < MIN_ARCH:
        raise UsageError(f"{what}: sm_{MIN_ARCH} is the minimum architecture kforge supports")
    import kforge
    from ._runtime import supported_archs

    archs = supported_archs(kforge._C)
    if archs is not None and arch not in archs:
        ok = ", ".join(str(a) for a in archs if a >= MIN_ARCH)
        raise UsageError(f"{what}: NVRTC {kforge._C.nvrtc_version()} cannot compile for sm_{arch}; "
                         f"it compiles for {ok}")


def _load_factory(spec: str) -> Callable:
    """The callable `package.module:factory` names (one parser for this CLI and kforge.bench)."""
    from .bench.models import FactoryError, load_factory

    try:
        return load_factory(spec)
    except FactoryError as e:
        raise UsageError(str(e)) from e


def _user_workload(args: argparse.Namespace) -> Workload:
    import torch

    factory = _load_factory(args.model_spec)
    device, dtype = _device(args.device), _torch_dtype(args.dtype)
    # Options left off the command line are None: the factory's own defaults hold (see FACTORY_HELP).
    offered = dict(device=device, dtype=dtype, batch=args.batch, seq=args.seq, seed=args.seed, size=args.size)
    params = pyinspect.signature(factory).parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    # An option the command line left unset (None) goes only where the factory has no default of its
    # own: batch and seed then take the built-in models' defaults, the others None.
    required = {k for k, p in params.items() if p.default is pyinspect.Parameter.empty}
    fallback = dict(batch=DEFAULT_BATCH, seed=DEFAULT_SEED)
    kw = {k: (fallback.get(k) if v is None else v) for k, v in offered.items()
          if (takes_all or k in params) and (v is not None or k in required)}
    out = factory(**kw)
    if not (isinstance(out, tuple) and len(out) in (2, 3)):
        raise UsageError(f"--model {args.model_spec}: the factory must return (model, inputs) or "
                         f"(model, inputs, options), got {type(out).__name__}")
    model, inputs, options = out[0], out[1], (out[2] if len(out) == 3 else {})
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--model {args.model_spec}: the factory returned {type(model).__name__}, not an nn.Module")
    if not isinstance(options, dict) or set(options) - {"mode", "loss_fn", "autocast"}:
        raise UsageError(f"--model {args.model_spec}: options must be a dict with keys mode / loss_fn / autocast, "
                         f"got {options!r}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(inputs, (tuple, list, dict)):
        raise UsageError(f"--model {args.model_spec}: inputs must be a tensor, a tuple or a dict, got {type(inputs).__name__}")
    if "device" not in kw:
        from .bench.models import to_device

        model, inputs = model.to(device), to_device(inputs, device)
    if "dtype" not in kw and dtype is not None:
        model = model.to(dtype=dtype)
    mode = options.get("mode", args.mode or "jit")
    if mode not in ("jit", "dynamo"):
        raise UsageError(f"--model {args.model_spec}: mode must be 'jit' or 'dynamo', got {mode!r}")
    return Workload(args.model_spec, model, tuple(inputs) if isinstance(inputs, list) else inputs, mode,
                    options.get("loss_fn"), options.get("autocast"))


def build_workload(args: argparse.Namespace) -> Workload:
    """The model and inputs a command line names (built-in model or --model factory)."""
    import torch

    if args.model_spec:
        return _user_workload(args)
    which = args.model
    device = _device(args.device)
    dtype = _torch_dtype(args.dtype) or torch.float32
    size = args.size or DEFAULT_SIZE[which]
    args = argparse.Namespace(**{**vars(args), "batch": DEFAULT_BATCH if args.batch is None else args.batch,
                                 "seed": DEFAULT_SEED if args.seed is None else args.seed})
    if which == "gpt2":
        from .models import gpt2

        if size not in gpt2.PRESETS:
            raise UsageError(f"unknown gpt2 --size {size!r}; choose from {', '.join(gpt2.PRESETS)}")
        cfg = gpt2.GPTConfig.preset(size, attention=args.attention)
        model = gpt2.GPT(cfg, seed=args.seed).to(device=device, dtype=dtype)
        seq = min(args.seq or 256, cfg.block_size)
        return Workload(f"gpt2-{size}", model, gpt2.random_batch(cfg, args.batch, seq, seed=args.seed, device=device),
                        args.mode or "jit", train_kwargs={"return_logits": False})
    from .models import llama

    if size not in llama.PRESETS:
        raise UsageError(f"unknown {which} --size {size!r}; choose from {', '.join(llama.PRESETS)}")
    cfg = llama.LlamaConfig.preset(size, attention=args.attention)
    seq = min(args.seq or 256, cfg.block_size)
    idx, targets = llama.random_batch(cfg, args.batch, seq, seed=args.seed, device=device)
    if which == "llama":
        model = llama.Llama(cfg, seed=args.seed).to(device=device, dtype=dtype)
        return Workload(f"llama-{size}", model, (idx, targets), args.mode or "jit",
                        train_kwargs={"return_logits": False})
    attn = {"manual": "eager", "sdpa": "sdpa"}[args.attention]
    model = llama.hf_llama(cfg, attn_implementation=attn, seed=args.seed, dtype=dtype, device=device)
    # HF shifts the labels itself: labels = input_ids.
    # Thunder's Dynamo path by default; --mode jit: thunder.jit, which traces it with kforge's lookasides
    return Workload(f"hf-llama-{size}", model, {"input_ids": idx, "labels": idx}, args.mode or "dynamo")


def compile_workload(w: Workload, backend: str = "kforge", *, cudagraphs: bool = False) -> Any:
    """The model compiled for `backend` as `bench models` wraps it (`kforge.bench.models.wrap`):
    kforge (kforge.jit, or kforge.compile on the Dynamo path), thunder (Thunder's defaults),
    torch.compile, or eager. `cudagraphs`: torch.compile's mode="reduce-overhead"; Thunder's
    CUDAGraphTransform for thunder; kforge.cudagraphs for kforge."""
    from .bench.models import wrap

    return wrap(backend, w.model, w.mode, cudagraphs=cudagraphs)


def loss_of(out: Any, loss_fn: Callable | None = None):
    """The scalar to backpropagate, chosen as kforge.tieout chooses it."""
    from .tieout import _pick_loss

    return _pick_loss(out, loss_fn)[2]


# ---- verbs ---------------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from .inspect import inspect

    w = build_workload(args)
    compiled = compile_workload(w)
    if args.no_grad:
        with torch.no_grad():
            w.call(compiled)
    else:
        loss_of(w.call(compiled, **w.train_kwargs), w.loss_fn).backward()
    report = inspect(compiled, show_traces=args.show_traces, save_dir=args.save_dir)
    print(f"{w.name} [{w.mode}]")
    print(report)
    return 0


def _tolerances(args: argparse.Namespace):
    from .tieout import TOLERANCES, Tolerance

    if args.rel_tol is None and args.elem_tol is None:
        return None
    return {dt: Tolerance(rel=t.rel if args.rel_tol is None else args.rel_tol,
                          elem=t.elem if args.elem_tol is None else args.elem_tol)
            for dt, t in TOLERANCES.items()}


def cmd_tieout(args: argparse.Namespace) -> int:
    import torch

    from .tieout import tieout

    w = build_workload(args)
    extra: dict[str, Any] = {}
    if args.perturb:
        def perturb(m: torch.nn.Module, rel: float = args.perturb) -> None:
            # Scale every floating parameter of the compiled copy: a deliberate, known difference.
            for p in m.parameters():
                if p.is_floating_point():
                    p.mul_(1 + rel)
        extra["perturb_compiled"] = perturb
    from .transforms import LlamaPatternTransform

    extra["transforms"] = [LlamaPatternTransform()]
    report = tieout(w.model, w.inputs, mode=w.mode, tolerances=_tolerances(args), loss_fn=w.loss_fn, **extra)
    print(f"{w.name} [{w.mode}]" + (f", compiled copy perturbed by {args.perturb:g}" if args.perturb else ""))
    print(report.table(failures_only=args.failures_only) if report.rows else "no rows")
    print(report.summary())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ok=report.ok, mode=report.mode, kforge_symbols=dict(report.kforge_symbols),
                           rows=[dict(name=r.name, dtype=str(r.dtype), shape=list(r.shape), max_abs=r.max_abs,
                                      max_abs_tol=r.max_abs_tol, rel=r.rel, rel_tol=r.tol, ok=r.ok, note=r.note)
                                 for r in report.rows]), f, indent=1)
    return 0 if report.ok else 1


def _train_step(w: Workload, compiled: Any, *, mark_step: bool = False) -> Callable[[], None]:
    """One training step of `compiled`; `mark_step`: a new iteration for torch.compile's CUDA-graph
    trees first (reduce-overhead)."""
    import torch

    from .tieout import adamw

    opt = adamw(list(w.model.parameters()), lr=1e-4)

    def step() -> None:
        if mark_step:
            torch.compiler.cudagraph_mark_step_begin()
        loss_of(w.call(compiled, **w.train_kwargs), w.loss_fn).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from .profile import profile

    if not torch.cuda.is_available():
        print("kforge profile needs a CUDA GPU; none is visible.", file=sys.stderr)
        return 2
    w = build_workload(args)
    if args.autocast:
        # Weights as --dtype / the factory made them; the step runs under torch.autocast.
        w.autocast = _torch_dtype(args.autocast)
    compiled = compile_workload(w, args.backend, cudagraphs=args.cudagraphs)
    mark = args.cudagraphs and args.backend == "torch.compile"
    report = profile(_train_step(w, compiled, mark_step=mark), steps=args.steps, warmup=args.warmup, trace_file=args.trace)
    graphs = ", CUDA graphs" if args.cudagraphs else ""
    print(f"{w.name} [{args.backend}, {w.mode}{graphs}]: forward + backward + AdamW step")
    print(report.summary())
    print()
    print(report.table(top=args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
    return 0


# ---- demo ----------------------------------------------------------------------------------------
def _compile_kernels(arch: int, fresh: bool) -> list[tuple]:
    """Compile every kernel for sm_<arch> with a progress bar (fresh: bypassing the memory and disk
    caches, so NVRTC runs for each); rows for the table."""
    from tqdm import tqdm

    import kforge
    from ._runtime import disk_cache_enabled

    rows = []
    if fresh:
        kforge._C.clear_memory_cache()
        kforge._C.set_cache(kforge.cache_dir(), False)
    try:
        for name in tqdm(kforge.kernel_names(), desc=f"NVRTC sm_{arch}", unit="kernel",
                         disable=not _cli.progress_enabled()):
            t = time.perf_counter()
            kforge._C.compile(name, arch)
            rows.append([name, (time.perf_counter() - t) * 1e3])
    finally:
        if fresh:
            kforge._C.set_cache(kforge.cache_dir(), disk_cache_enabled())
    out = []
    for name, wall in rows:
        entries = [e for e in kforge.cache_info()["entries"] if e["name"] == name and e["arch"] == f"sm_{arch}"]
        entry = entries[-1] if entries else {}
        out.append((name, entry.get("source", "?"), f"{entry.get('compile_ms', 0.0):.0f}", f"{wall:.0f}",
                    f"{entry.get('cubin_bytes', 0) / 1024:.0f}"))
    return out


def cmd_demo(args: argparse.Namespace) -> int:
    import torch
    from tabulate import tabulate

    import kforge

    gpu = torch.cuda.is_available()
    given = args.arch is not None
    arch = args.arch if given else (kforge._C.device_arch(torch.cuda.current_device()) if gpu else 90)
    _check_arch_arg(arch, given)
    if not gpu:
        print("No CUDA GPU is visible. kforge compiles its kernels without one (NVRTC, below); running\n"
              "them, and the GPT-2 part of this demo, needs an NVIDIA GPU (sm_80 or newer).\n")
    print(f"== 1. Compile every kforge kernel for sm_{arch} (cache: {kforge.cache_dir()})")
    rows = _compile_kernels(arch, args.fresh)
    print(tabulate(rows, headers=("kernel", "from", "NVRTC ms", "wall ms", "CUBIN KiB"), disable_numparse=True))
    if not args.fresh and any(r[1] != "nvrtc" for r in rows):
        print("(\"disk\": compiled by an earlier run and loaded from the cache; --fresh recompiles with NVRTC)")
    if not gpu:
        print(f"\n{len(rows)} kernels compiled for sm_{arch}. Run `python -m kforge demo` on a GPU machine for the rest.")
        return 0

    from .bench.harness import train_step_timing
    from .inspect import inspect
    from .models import gpt2
    from .tieout import default_executors, tieout

    import thunder

    print(f"\n== 2. GPT-2 ({args.attention} attention) through thunder.jit with kforge first: tie-out vs eager")
    cfg = gpt2.GPTConfig.preset("tiny", attention=args.attention)
    small = gpt2.GPT(cfg).cuda()
    batch = gpt2.random_batch(cfg, 4, cfg.block_size, device="cuda")
    report = tieout(small, batch)
    print(f"fp32, {cfg.n_layer} layers, C={cfg.n_embd}, vocab {cfg.vocab_size}, B=4, T={cfg.block_size}")
    print(report)

    print("\n== 3. What kforge claimed (final forward / backward traces) and declined")
    print(inspect(report.compiled))

    dtype = _torch_dtype(args.dtype)
    cfg = gpt2.GPTConfig(block_size=args.seq, n_layer=args.layers, attention=args.attention)
    print(f"\n== 4. Training step, GPT-2 width {cfg.n_embd}, {cfg.n_layer} layers, B={args.batch}, T={args.seq}, "
          f"{args.dtype}, fused AdamW: eager vs thunder.jit + kforge")
    timings = []
    for name in ("eager", "thunder+kforge"):
        torch.manual_seed(0)
        model = gpt2.GPT(cfg).to(device="cuda", dtype=dtype)
        fn = model if name == "eager" else thunder.jit(model, executors=default_executors())
        batch = gpt2.random_batch(cfg, args.batch, args.seq, device="cuda")
        t = time.perf_counter()
        r = train_step_timing(fn, list(model.parameters()), batch, args.steps)
        timings.append((name, r["ms"], r["peak_gib"], time.perf_counter() - t))
        del model, fn
        torch.cuda.empty_cache()
    eager_ms = timings[0][1]
    print(tabulate([(n, f"{ms:.2f}", f"{eager_ms / ms:.2f}x", f"{gib:.2f}", f"{s:.0f}") for n, ms, gib, s in timings],
                   headers=("backend", "ms/step", "speed vs eager", "peak GiB", "wall s (incl. compile)"),
                   disable_numparse=True))
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, thunder {thunder.__version__}")
    return 0 if report.ok else 1


# ---- argument parsing ----------------------------------------------------------------------------
def _add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("model", nargs="?", choices=MODELS, help="a built-in model (or use --model)")
    g.add_argument("--model", dest="model_spec", metavar="PKG.MODULE:FACTORY",
                   help="your own model: a factory returning (model, inputs[, options]); contract below")
    g.add_argument("--size", help="preset: gpt2 tiny|micro|124M|350M|774M|1558M; llama / hf-llama "
                                  "tiny|micro|hf-test|bench")
    g.add_argument("--dtype", choices=DTYPES, help="parameter dtype (default fp32; --model: as the factory makes it)")
    g.add_argument("--batch", type=int, help=f"batch size (default {DEFAULT_BATCH}; --model: the factory's default)")
    g.add_argument("--seq", type=int, help="sequence length (default min(256, block size); --model: the factory's "
                                           "default)")
    g.add_argument("--attention", choices=("manual", "sdpa"), default="manual",
                   help="manual (matmul + causal softmax: every kforge kernel) or sdpa")
    g.add_argument("--device", help="cuda (default when a GPU is visible) or cpu")
    g.add_argument("--mode", choices=("jit", "dynamo"),
                   help="thunder.jit (default) or Thunder's Dynamo path (hf-llama: always dynamo)")
    g.add_argument("--seed", type=int, help=f"seed of the weights and inputs (default {DEFAULT_SEED}; --model: "
                                            "the factory's default)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kforge", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-v", "--verbose", action="count", default=0,
                   help="log the runtime's work to stderr: -v NVRTC and compile times, -vv also cache hits")
    sub = p.add_subparsers(dest="verb", required=True, metavar="{demo,inspect,tieout,profile,bench}",
                           help="the command (each has --help)")
    raw = argparse.RawDescriptionHelpFormatter

    d = sub.add_parser("demo", help="compile every kernel; on a GPU run GPT-2 with kforge (tie-out, symbols, ms/step)")
    d.add_argument("--arch", type=int, help="sm_XY to compile for, 80 or newer (default: the GPU's, else 90)")
    d.add_argument("--fresh", action="store_true", help="bypass the kernel caches: every kernel through NVRTC")
    d.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16", help="timing dtype (default bf16)")
    d.add_argument("--layers", type=int, default=4, help="GPT-2 layers for the timing (default 4, width 768)")
    d.add_argument("--batch", type=int, default=8, help="batch size of the timing (default 8)")
    d.add_argument("--seq", type=int, default=256, help="sequence length of the timing (default 256)")
    d.add_argument("--steps", type=int, default=10, help="timed steps per backend (default 10)")
    d.add_argument("--attention", choices=("manual", "sdpa"), default="manual",
                   help="GPT-2's attention: manual (matmul + causal softmax, default) or sdpa")

    i = sub.add_parser("inspect", help="kforge symbols in the traces, declines with reasons",
                       description="Which kforge symbols a model's final traces hold, what kforge declined "
                                   "and why, the pattern rewrites and the fusion regions.",
                       epilog=FACTORY_HELP, formatter_class=raw)
    _add_model_args(i)
    i.add_argument("--show-traces", action="store_true", help="print the final forward / backward traces")
    i.add_argument("--save-dir", metavar="DIR", help="write the final traces there")
    i.add_argument("--no-grad", action="store_true", help="forward only (inference traces)")

    t = sub.add_parser(
        "tieout", help="eager vs Thunder + kforge; exit 1 when out of tolerance",
        description="Eager vs Thunder + kforge: outputs, loss and every parameter gradient against tolerance.",
        epilog="exit status: 0 every tensor within tolerance; 1 any tensor out of tolerance; 2 a usage error\n"
               "(bad arguments, --device cuda without a GPU). A pass where kforge claimed nothing (CPU\n"
               "tensors: kforge's kernels need CUDA) still exits 0, and its summary says\n"
               "\"PASS (torch fallback only: no kforge kernel ran ...)\": it tested Thunder's fallbacks,\n"
               "not kforge.\n\n" + FACTORY_HELP, formatter_class=raw)
    _add_model_args(t)
    t.add_argument("--rel-tol", type=float, help="override the relative tolerance of every dtype")
    t.add_argument("--elem-tol", type=float, help="override the element tolerance of every dtype")
    t.add_argument("--perturb", type=float, metavar="REL",
                   help="scale the compiled copy's parameters by 1+REL first (shows that the check fails)")
    t.add_argument("--failures-only", action="store_true", help="print only the rows out of tolerance")
    t.add_argument("--json", metavar="FILE", help="write the rows as JSON")

    pr = sub.add_parser("profile", help="kernel time per category / region / op of a training step (GPU)",
                        description="Kernel time of a training step (forward, backward, AdamW) per category "
                                    "(kforge, matmul, attention, the rest), region and op; needs a CUDA GPU.",
                        epilog=FACTORY_HELP, formatter_class=raw)
    _add_model_args(pr)
    pr.add_argument("--backend", choices=("kforge", "thunder", "torch.compile", "eager"), default="kforge",
                    help="what compiles the step (default kforge)")
    pr.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    pr.add_argument("--warmup", type=int, default=2, help="steps run before them, compiling included (default 2)")
    pr.add_argument("--top", type=int, default=20, help="rows of the per-op table")
    pr.add_argument("--cudagraphs", action="store_true",
                    help="torch.compile mode='reduce-overhead'; thunder with Thunder's CUDAGraphTransform; "
                         "kforge with kforge.jit(cudagraphs=True)")
    pr.add_argument("--autocast", choices=("bf16", "fp16"),
                    help="run the step under torch.autocast of this dtype (with --dtype fp32: fp32 weights + "
                         "autocast, the usual mixed-precision set-up)")
    pr.add_argument("--trace", metavar="FILE", help="also write a Chrome trace (Perfetto)")
    pr.add_argument("--json", metavar="FILE", help="write the summary as JSON")

    sub.add_parser("bench", help="benchmarks: python -m kforge.bench {models,ops,gpt2,llama,launch,report} ...",
                   add_help=False)
    return p


BENCH_PROG = "python -m kforge bench"


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m kforge`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = 0
    while argv and argv[0] in ("-v", "-vv", "--verbose"):  # before `bench`, whose parser is its own
        verbose += 2 if argv.pop(0) == "-vv" else 1
    if argv and argv[0] == "bench":  # everything after `bench` belongs to kforge.bench's own parser
        from .bench.__main__ import main as bench_main

        _cli.setup_logging(verbose)
        return bench_main(argv[1:], prog=BENCH_PROG)
    p = parser()
    args = p.parse_args(argv)
    _cli.setup_logging(verbose + args.verbose)
    if args.verb in ("inspect", "tieout", "profile"):
        sp = p._subparsers._group_actions[0].choices[args.verb]  # the verb's parser, for its usage line
        if bool(args.model) == bool(args.model_spec):
            sp.error(f"{args.verb}: name one model: {' | '.join(MODELS)} or --model package.module:factory")
        if (args.batch is not None and args.batch < 1) or (args.seq is not None and args.seq < 1):
            sp.error(f"{args.verb}: --batch and --seq must be positive")
    import kforge

    try:
        if args.verb == "demo" and args.arch is not None:
            _check_arch_arg(args.arch, True)  # before the imports and the banner
        _check_device_arg(getattr(args, "device", None), args.verb)
        return {"demo": cmd_demo, "inspect": cmd_inspect, "tieout": cmd_tieout, "profile": cmd_profile}[args.verb](args)
    except UsageError as e:
        print(f"python -m kforge {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except kforge.KforgeError as e:  # the runtime's errors name the kernel and the problem already
        print(f"python -m kforge {args.verb}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(_cli.run(main))
