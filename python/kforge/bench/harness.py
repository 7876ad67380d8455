"""Timing machinery for `python -m kforge.bench`: CUDA-event medians, copy bandwidth, op sweeps,
model training steps, launch overhead, and the Markdown / plot output."""
from __future__ import annotations

import gc
import importlib
import pkgutil
import statistics
import sys
import time
from typing import Any, Callable

import torch
from tqdm import tqdm

from .cases import BenchCase

DTYPES = {"fp32": [torch.float32], "bf16": [torch.bfloat16], "both": [torch.float32, torch.bfloat16]}
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def progress_enabled() -> bool:
    """Progress bars only on a terminal: in a log, tqdm's carriage-return frames are noise."""
    return sys.stderr.isatty()


# ---- timing --------------------------------------------------------------------------------------
def time_cuda(fn: Callable[[], Any], *, warmup: int = 5, reps: int = 30) -> float:
    """Median milliseconds of `fn()` over `reps` runs, each timed with its own pair of CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_op(fn: Callable[..., Any], input_sets: list[tuple], *, rounds: int = 7, calls: int = 48) -> float:
    """Median microseconds per call of `fn` on the GPU alone.

    Each round first queues a sleep kernel long enough for the host to enqueue all `calls` calls
    behind it, so the calls then run back to back and the events between them measure device time,
    not Python launch overhead. The calls rotate over `input_sets`, which together exceed L2, so
    repeated calls do not measure the cache. (CUDA-graph replay would also hide launch overhead, but
    a baseline that cannot be captured leaves the RNG's capture state broken for the rest of the run.)
    """
    n = max(calls, len(input_sets))
    for inputs in input_sets:  # warm-up: compile, load modules, autotune
        fn(*inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()  # host cost of one round, to size the sleep
    for i in range(n):
        fn(*input_sets[i % len(input_sets)])
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    # Twice the host time at a 2 GHz upper bound on the SM clock: at a lower clock it only sleeps longer.
    cycles = int(2 * host_s * 2.0e9) + 1_000_000
    per_call = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        start.record()
        for i in range(n):
            fn(*input_sets[i % len(input_sets)])
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / n)
    return statistics.median(per_call)


def input_sets_for(case: BenchCase, l2_bytes: int) -> list[tuple]:
    """Enough independent input sets that together they exceed twice the L2 cache (at most 16)."""
    n = max(1, min(16, -(-2 * l2_bytes // max(case.bytes, 1))))
    return [case.make_inputs() for _ in range(n)]


def same_size_copy_us(nbytes: int, l2_bytes: int) -> float:
    """Median microseconds of torch's device-to-device `copy_` moving `nbytes` in all (half read,
    half written), timed like the ops: what a plain copy of that many bytes achieves, launch ramp and
    tail included, which the 1 GiB copy bandwidth does not show for small sizes. Not a hard ceiling:
    torch's copy is not the fastest possible copy at small sizes."""
    # fp32 elements, as copy_bandwidth_gbs uses: torch copies 1-byte elements more slowly.
    elems = max(nbytes // 8, 4)
    n = max(1, min(16, -(-2 * l2_bytes // max(nbytes, 1))))
    sets = [(torch.empty(elems, dtype=torch.float32, device="cuda").uniform_(),
             torch.empty(elems, dtype=torch.float32, device="cuda")) for _ in range(n)]
    us = time_op(lambda s, d: d.copy_(s), sets)
    del sets
    return us


def copy_bandwidth_gbs(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), warmup=3, reps=20)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ---- ops -----------------------------------------------------------------------------------------
def op_modules(only: list[str] | None = None) -> list[Any]:
    from .. import ops

    mods = []
    for info in sorted(pkgutil.iter_modules(ops.__path__), key=lambda m: m.name):
        if only and info.name not in only:
            continue
        mod = importlib.import_module(f"{ops.__name__}.{info.name}")
        if hasattr(mod, "bench_cases"):
            mods.append(mod)
    if not only or "fusion" in only:  # generated kernels of typical regions (kforge.fusion.bench)
        mods.append(importlib.import_module("kforge.fusion.bench"))
    return mods


def bench_ops(args) -> dict:
    copy_bw = copy_bandwidth_gbs()
    cases: list[tuple[torch.dtype, BenchCase]] = []
    for mod in op_modules(args.op):
        for dt in DTYPES[args.dtype]:
            cases += [(dt, c) for c in mod.bench_cases(dt, args.quick)]
    rows = []
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    same_copy: dict[int, float] = {}
    for dt, c in tqdm(cases, desc="ops", unit="case", leave=False, disable=not progress_enabled()):
        sets = input_sets_for(c, l2)
        row = dict(op=c.op, dir=c.direction, shape=c.shape, dtype=SHORT[dt], bytes=c.bytes)
        impls: dict[str, Callable] = {"kforge": c.kforge, "eager": c.eager}
        if c.compile_ok and not args.no_compile:
            impls["compile"] = torch.compile(c.eager, dynamic=False)
        for name, fn in impls.items():
            try:
                us = time_op(fn, sets)
                row[f"{name}_us"] = us
                row[f"{name}_gbs"] = c.bytes / (us * 1e-6) / 1e9
            except Exception as e:  # report, keep going: one broken baseline must not stop the sweep
                row[f"{name}_us"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        row["kforge_pct_copy"] = (100 * row["kforge_gbs"] / copy_bw) if row.get("kforge_us") else None
        if c.bytes not in same_copy:
            same_copy[c.bytes] = same_size_copy_us(c.bytes, l2)
        row["copy_same_us"] = same_copy[c.bytes]
        row["kforge_pct_same"] = (100 * row["copy_same_us"] / row["kforge_us"]) if row.get("kforge_us") else None
        rows.append(row)
        del sets
        torch.cuda.empty_cache()
    if args.plot:
        plot_ops(rows, args.plot, copy_bw)
    return {"kind": "ops", "copy_gbs": copy_bw, "rows": rows}


def plot_ops(rows: list[dict], out_dir: str, copy_bw: float) -> list[str]:
    """One PNG per (op, direction, dtype): GB/s per implementation across the benchmarked sizes."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["dir"], r["dtype"]), []).append(r)
    paths = []
    for (op, d, dt), rs in groups.items():
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = list(range(len(rs)))
        for impl in ("kforge", "eager", "compile"):
            ys = [r.get(f"{impl}_gbs") for r in rs]
            if any(y is not None for y in ys):
                ax.plot(xs, [y or float("nan") for y in ys], marker="o", label=impl)
        ax.axhline(copy_bw, color="gray", linestyle="--", label=f"copy {copy_bw:.0f} GB/s")
        ax.set_xticks(xs, [r["shape"] for r in rs], rotation=20, fontsize=8)
        ax.set_ylabel("GB/s")
        ax.set_title(f"{op} {d} ({dt})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"{op}_{d}_{dt}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


# ---- models --------------------------------------------------------------------------------------
def _build_model(which: str, attention: str, small: bool):
    if which == "gpt2":
        from ..models import gpt2

        cfg = gpt2.GPTConfig.preset("tiny" if small else "124M", attention=attention)
        return gpt2.GPT(cfg), cfg, gpt2.random_batch
    from ..models import llama

    cfg = llama.LlamaConfig.preset("tiny" if small else "bench", attention=attention)
    return llama.Llama(cfg), cfg, llama.random_batch


def _wrap(backend: str, model: torch.nn.Module):
    if backend == "eager":
        return model
    if backend == "torch.compile":
        return torch.compile(model)
    import thunder

    if backend == "thunder":
        return thunder.jit(model)
    if backend == "thunder+kforge":
        import kforge

        return thunder.jit(model, executors=[kforge.executor, *thunder.get_default_executors()])
    raise ValueError(f"unknown backend {backend!r}")


def train_step_timing(model_fn: Callable, params, batch, steps: int, warmup: int = 3) -> dict:
    """Median ms per training step (forward + backward + fused AdamW) and peak memory. The model is
    called as llm.c's training loop calls it, `model(idx, targets, return_logits=False)`, for every
    backend: a Thunder-compiled model would otherwise carry a zero gradient for the unused logits."""
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    idx, targets = batch

    def step():
        _, loss = model_fn(idx, targets, return_logits=False)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        loss = step()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
        losses.append(loss.item())
    return {"ms": statistics.median(times), "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
            "warmup_s": warm_s, "final_loss": losses[-1]}


def bench_model(which: str, args) -> dict:
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    attns = ["manual", "sdpa"] if args.attention == "both" else [args.attention]
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    rows = []
    for attn in attns:
        for backend in tqdm(backends, desc=f"{which}/{attn}", leave=False, disable=not progress_enabled()):
            torch.manual_seed(0)
            model, cfg, random_batch = _build_model(which, attn, args.small)
            model = model.to(device="cuda", dtype=dtype)
            seq = min(args.seq, cfg.block_size)
            batch = random_batch(cfg, args.batch, seq, device="cuda")
            row = dict(model=which, attention=attn, backend=backend, batch=args.batch, seq=seq,
                       dtype=args.dtype)
            try:
                row.update(train_step_timing(_wrap(backend, model), list(model.parameters()), batch,
                                             args.steps))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            del model, batch
            gc.collect()
            torch.cuda.empty_cache()
    return {"kind": "model", "rows": rows}


# ---- launch overhead -------------------------------------------------------------------------------
def bench_launch(args) -> dict:
    """Host microseconds per launch from Python: kforge's axpy vs torch.add on 1024 elements, a fusion
    region's generated kernel vs torch.add, and one GEMM call through torch and on kforge's plans."""
    import kforge

    from ..fusion.bench import launch_callables
    from ..ops import gemm

    x, y = torch.randn(1024, device="cuda"), torch.randn(1024, device="cuda")
    calls = [("kforge._C.axpy", lambda: kforge._C.axpy(x, y, 1.0)),
             ("torch.add", lambda: torch.add(x, y, alpha=1.0)), *launch_callables(), *gemm.launch_callables()]
    return {"kind": "launch", "rows": [{"launcher": name, "host_us_per_launch": _host_us(fn)} for name, fn in calls]}


def _host_us(fn: Callable[[], object], n: int = 20000, repeats: int = 5) -> float:
    """Median over `repeats` of the host microseconds per call of `fn` in a loop of `n` calls (the
    GPU drains between loops, so the queue never fills and blocks the host)."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(samples)


# ---- output --------------------------------------------------------------------------------------
def markdown(run: dict) -> str:
    """The Markdown block of one run (command, GPU / versions / commit / date line, table), as
    BENCHMARKS.md shows it; `run` is a record object (`kforge.bench.records`)."""
    from .report import run_markdown

    return run_markdown(run)
