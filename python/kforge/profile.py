"""Where the time of a step goes: NVTX ranges around kforge launches, and a kernel-time summary.

    from kforge.profile import profile, nvtx_ranges
    def step():
        loss = jmodel(idx, targets)[1]; loss.backward(); opt.step(); opt.zero_grad()
    report = profile(step, steps=5)       # warms up (compiles) first
    print(report)                          # kernel time per category, op and region

NVTX ranges. Thunder's generated programs call each kforge operator by name
(`kforge_layernorm_forward(...)`), looked up in the program's globals. `nvtx_ranges()` swaps those
entries, in programs already compiled, for wrappers that open an NVTX range named by op and
direction ("kforge.layernorm.forward") around the launch, optionally also a `record_function` range
that the PyTorch profiler sees, and puts the launchers back on exit. Nothing is wrapped outside the
block, so the launch path costs nothing extra when profiling is off; programs compiled inside the
block are not wrapped (warm up first, as `profile` does). Run under `nsys profile -t cuda,nvtx` to see
the ranges in Nsight Systems.

Kernel summary. `profile` runs the step under `torch.profiler` and classifies every device activity:
- kforge:    our kernels, by the `__global__` names in kernels_src/ (the profiler shows the NVRTC
             lowered template names demangled, e.g. "void layernorm_forward_kernel<float>(...)"),
- attention: flash / memory-efficient / cuDNN attention kernels,
- matmul:    cuBLAS / cuBLASLt / CUTLASS GEMMs (gemm, cutlass, nvjet, xmma names),
- fused:     Triton and nvFuser kernels (torch.compile / Thunder fusions),
- optimizer: multi-tensor-apply / fused Adam(W),
- memcpy / memset, and other (elementwise, reductions, embedding, ...).
Each kernel is also given an op label (the kforge range it ran in, else its kernel name) and a region
(forward, backward, optimizer, or the outermost `record_function` range of your own around it).
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import re
import statistics
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from .inspect import range_name, thunder_functions

__all__ = [
    "CATEGORIES",
    "KernelRecord",
    "ProfileReport",
    "categorize",
    "kforge_kernel_names",
    "nvtx_ranges",
    "profile",
    "summarize",
]

CATEGORIES = ("kforge", "attention", "matmul", "fused", "optimizer", "memcpy/memset", "other")
# Checked in this order after the kforge names: attention kernels are often CUTLASS-based (fmha_cutlass).
_PATTERNS = (
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|_mha|mha_", re.I)),
    ("matmul", re.compile(r"gemm|cutlass|cublas|nvjet|xmma|matmul|splitk", re.I)),
    ("fused", re.compile(r"triton|nvfuser|CudaCodeGen", re.I)),
    ("optimizer", re.compile(r"multi_tensor_apply|adam|FusedOptimizer", re.I)),
    ("memcpy/memset", re.compile(r"^mem(cpy|set)", re.I)),
)


# ---- kforge kernel names --------------------------------------------------------------------------
def _global_function_names(source: str) -> list[str]:
    """Names of the `__global__` functions in a CUDA source (skipping `__launch_bounds__(...)` and
    attribute macros between `__global__ void` and the name)."""
    names = []
    for m in re.finditer(r"__global__\b", source):
        rest = source[m.end():m.end() + 400]
        rest = re.sub(r"__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)", " ", rest)
        call = re.search(r"([A-Za-z_]\w*)\s*\(", rest)
        if call:
            names.append(call.group(1))
    return names


@functools.cache
def kforge_kernel_names() -> frozenset[str]:
    """Every kernel function defined in kernels_src/*.cu (e.g. "layernorm_forward_kernel")."""
    from . import kernel_dir

    out: set[str] = set()
    d = kernel_dir()
    for f in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        if f.endswith((".cu", ".cuh")):
            with open(os.path.join(d, f)) as fh:
                out.update(_global_function_names(fh.read()))
    return frozenset(out)


@functools.cache
def _kforge_regex() -> re.Pattern | None:
    names = sorted(kforge_kernel_names(), key=len, reverse=True)
    if not names:
        return None
    # Our kernels live in no namespace: demangled "void gelu_forward_kernel<bf16>(...)", or the
    # mangled "_Z19gelu_forward_kernelI4bf16EvPT_..." (a length digit before, a capital after).
    return re.compile(r"(?<![A-Za-z_:])(" + "|".join(map(re.escape, names)) + r")(?![a-z0-9_])")


def kforge_kernel(name: str) -> str | None:
    """The kforge kernel function a profiler kernel name belongs to, or None."""
    rx = _kforge_regex()
    m = rx.search(name) if rx is not None else None
    return m.group(1) if m else None


def categorize(name: str) -> str:
    """The category (one of CATEGORIES) of a device activity from its profiler name."""
    if kforge_kernel(name) is not None:
        return "kforge"
    for cat, rx in _PATTERNS:
        if rx.search(name):
            return cat
    return "other"


def short_name(name: str, width: int = 60) -> str:
    """A kernel name without "void ", template arguments and parameter list, cut to `width`."""
    s = name.removeprefix("void ").replace("(anonymous namespace)::", "")
    depth, out = 0, []
    for ch in s:
        if ch == "(" and depth == 0:
            break
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    s = "".join(out).strip() or name
    return s if len(s) <= width else s[: width - 1] + "…"


# ---- NVTX ranges around kforge launches ----------------------------------------------------------
def _wrap(label: str, fn: Callable, with_record_function: bool) -> Callable:
    push, pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    if with_record_function:
        rf = torch.profiler.record_function

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with rf(label):
                push(label)
                try:
                    return fn(*args, **kwargs)
                finally:
                    pop()
    else:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            push(label)
            try:
                return fn(*args, **kwargs)
            finally:
                pop()
    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    wrapped._kforge_range = label  # type: ignore[attr-defined]
    return wrapped


def _program_globals(compiled: Iterable[Any]) -> list[dict]:
    """The globals of the computation and backward programs of the given compiled objects, or with
    none given, of every live Thunder-generated program (found through the garbage collector)."""
    import inspect as pyinspect

    import thunder

    dicts: list[dict] = []
    compiled = list(compiled)
    if compiled:
        for obj in compiled:
            for fn in thunder_functions(obj)[1]:
                cs = thunder.compile_stats(fn)
                for entry in getattr(cs, "interpreter_cache", None) or []:
                    for prog in (entry.computation_fn, entry.backward_fn):
                        g = getattr(pyinspect.unwrap(prog), "__globals__", None) if prog is not None else None
                        if g is not None:
                            dicts.append(g)
    else:
        # Thunder builds each program from a fresh globals dict holding "__function_obj" and "thunder".
        dicts = [o for o in gc.get_objects() if type(o) is dict and "__function_obj" in o and "thunder" in o]
    seen: set[int] = set()
    return [d for d in dicts if not (id(d) in seen or seen.add(id(d)))]


@contextlib.contextmanager
def nvtx_ranges(*compiled: Any, record_function: bool = False) -> Iterator[int]:
    """Within the block, every kforge operator call of already-compiled Thunder programs runs inside
    an NVTX range "kforge.<op>.<direction>" (and a `torch.profiler.record_function` range of the same
    name when `record_function=True`). Restricted to the programs of `compiled` objects (anything
    `kforge.inspect.inspect` accepts) when given, else every live Thunder program. Yields how many
    call sites were wrapped; the original launchers are restored on exit."""
    from . import _thunder

    ops = set(_thunder.get_executor().opmap)
    patched: list[tuple[dict, str, Any]] = []
    try:
        for g in _program_globals(compiled):
            for name in [k for k in g if k in ops]:
                fn = g[name]
                if callable(fn) and not hasattr(fn, "_kforge_range"):
                    patched.append((g, name, fn))
                    g[name] = _wrap(range_name(name), fn, record_function)
        yield len(patched)
    finally:
        for g, name, fn in reversed(patched):
            g[name] = fn


# ---- kernel records and the summary ----------------------------------------------------------------
@dataclass(frozen=True)
class KernelRecord:
    """One device activity: its profiler name, duration (µs), category, op label and region."""

    name: str
    us: float
    category: str
    label: str
    region: str


def _region(evt: Any) -> str:
    """The model region of a CPU event: backward (autograd engine), optimizer, the outermost
    user-annotated range (not kforge's own, not ProfilerStep), else forward."""
    chain = []
    while evt is not None:
        chain.append(evt)
        evt = evt.cpu_parent
    chain.reverse()  # outermost first
    for e in chain:
        if e.name.startswith("autograd::engine::evaluate_function"):
            return "backward"
        if e.name.startswith("Optimizer."):
            return "optimizer"
    for e in chain:
        if getattr(e, "is_user_annotation", False) and not e.name.startswith(("kforge.", "ProfilerStep")):
            return e.name
    return "forward"


def _kforge_range(evt: Any) -> str | None:
    while evt is not None:
        if evt.name.startswith("kforge."):
            return evt.name
        evt = evt.cpu_parent
    return None


def kernel_records(events: Iterable[Any]) -> list[KernelRecord]:
    """KernelRecords from a profiler's `events()`: every device (CUDA) kernel, memcpy and memset,
    attributed to the CPU op that launched it where the profiler linked one.

    The profiler also mirrors each `record_function` range onto the device timeline (a "GPU user
    annotation" spanning the kernels launched inside it); those are ranges, not activities, and are
    left out of the records. kforge launches through the driver API, which the profiler does not link
    to a CPU op, so a kforge kernel takes its op label (and, without a parent, its region) from the
    kforge range whose device-side annotation contains it (the n-th "kforge.x" annotation is the n-th "kforge.x"
    CPU range), else region "unattributed"."""
    import bisect

    from torch.autograd import DeviceType

    events = list(events)
    cpu_names = {e.name for e in events if e.device_type == DeviceType.CPU}
    launched_by: dict[str, deque] = defaultdict(deque)  # kernel name -> launching CPU events
    cpu_ranges: dict[str, deque] = defaultdict(deque)  # kforge range name -> its CPU events, in order
    for e in sorted((e for e in events if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start):
        for k in getattr(e, "kernels", ()) or ():
            launched_by[k.name].append(e)
        if e.name.startswith("kforge."):
            cpu_ranges[e.name].append(e)

    def is_annotation(e: Any) -> bool:
        return bool(getattr(e, "is_user_annotation", False)) or e.name in cpu_names

    device = [e for e in events if e.device_type == DeviceType.CUDA]
    # kforge ranges on the device timeline, by start time: (start, end, name, CPU range event or None).
    spans = []
    for e in sorted((e for e in device if is_annotation(e) and e.name.startswith("kforge.")),
                    key=lambda e: e.time_range.start):
        cpu = cpu_ranges[e.name].popleft() if cpu_ranges.get(e.name) else None
        spans.append((e.time_range.start, e.time_range.end, e.name, cpu))
    starts = [sp[0] for sp in spans]

    def containing_span(e: Any):
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i >= 0 and e.time_range.end <= spans[i][1]:
            return spans[i]
        return None

    out = []
    for e in device:
        if is_annotation(e):
            continue
        parent = launched_by[e.name].popleft() if launched_by.get(e.name) else None
        cat = categorize(e.name)
        kf = _kforge_range(parent)
        region = _region(parent) if parent is not None else "unattributed"
        if kf is None and cat == "kforge" and (span := containing_span(e)) is not None:
            kf = span[2]
            if parent is None and span[3] is not None:
                region = _region(span[3])
        label = kf or (range_name_for_kernel(e.name) if cat == "kforge" else short_name(e.name))
        out.append(KernelRecord(e.name, float(e.time_range.elapsed_us()), cat, label, region))
    return out


def range_name_for_kernel(name: str) -> str:
    """A label for a kforge kernel seen without its range: "kforge:<kernel function>"."""
    return f"kforge:{kforge_kernel(name) or short_name(name)}"


@dataclass
class ProfileReport:
    """Kernel time of `steps` profiled steps.

    step_ms: median wall time of one step measured without the profiler (CUDA events on a GPU), or None.
    records: every device activity of the profiled steps.
    """

    steps: int
    step_ms: float | None
    records: list[KernelRecord]
    device: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def kernel_ms(self) -> float:
        """Device time per step, ms."""
        return sum(r.us for r in self.records) / 1e3 / max(self.steps, 1)

    def share(self, category: str = "kforge") -> float:
        """Fraction of device time per step in `category` (0 when nothing ran)."""
        total = sum(r.us for r in self.records)
        return sum(r.us for r in self.records if r.category == category) / total if total else 0.0

    def _group(self, key: Callable[[KernelRecord], Any]) -> list[tuple[Any, int, float]]:
        n: Counter = Counter()
        us: Counter = Counter()
        for r in self.records:
            n[key(r)] += 1
            us[key(r)] += r.us
        return sorted(((k, n[k], us[k]) for k in n), key=lambda t: -t[2])

    def by_category(self) -> list[dict]:
        """[{category, kernels (per step), ms (per step), pct (of kernel time)}], largest first."""
        total = sum(r.us for r in self.records) or 1.0
        s = max(self.steps, 1)
        return [dict(category=k, kernels=n / s, ms=us / 1e3 / s, pct=100 * us / total)
                for k, n, us in self._group(lambda r: r.category)]

    def by_op(self, top: int | None = 20) -> list[dict]:
        """[{op, category, kernels, ms, pct}] per op label, largest first (the `top` largest)."""
        total = sum(r.us for r in self.records) or 1.0
        s = max(self.steps, 1)
        rows = [dict(op=k[0], category=k[1], kernels=n / s, ms=us / 1e3 / s, pct=100 * us / total)
                for k, n, us in self._group(lambda r: (r.label, r.category))]
        return rows if top is None else rows[:top]

    def by_region(self) -> list[dict]:
        """[{region, ms, pct, <category> ms ...}] per region: where kforge's share of each part sits."""
        total = sum(r.us for r in self.records) or 1.0
        s = max(self.steps, 1)
        rows = []
        for region, _, us in self._group(lambda r: r.region):
            row = dict(region=region, ms=us / 1e3 / s, pct=100 * us / total)
            for cat in CATEGORIES:
                row[cat] = sum(r.us for r in self.records if r.region == region and r.category == cat) / 1e3 / s
            rows.append(row)
        return rows

    def table(self, top: int = 20, tablefmt: str = "simple") -> str:
        """Three tables: per category, per region (ms per category) and the `top` ops."""
        from tabulate import tabulate

        parts = []
        cats = self.by_category()
        parts.append(tabulate([(c["category"], f"{c['kernels']:.0f}", f"{c['ms']:.3f}", f"{c['pct']:.1f}")
                               for c in cats],
                              headers=("category", "kernels/step", "ms/step", "% kernel time"),
                              tablefmt=tablefmt, disable_numparse=True))
        present = [c["category"] for c in cats]
        regions = self.by_region()
        parts.append(tabulate([[r["region"], f"{r['ms']:.3f}", f"{r['pct']:.1f}"] + [f"{r[c]:.3f}" for c in present]
                               for r in regions],
                              headers=["region", "ms/step", "%"] + [f"{c} ms" for c in present],
                              tablefmt=tablefmt, disable_numparse=True))
        parts.append(tabulate([(o["op"], o["category"], f"{o['kernels']:.0f}", f"{o['ms']:.3f}", f"{o['pct']:.1f}")
                               for o in self.by_op(top)],
                              headers=("op / kernel", "category", "kernels/step", "ms/step", "% kernel time"),
                              tablefmt=tablefmt, disable_numparse=True))
        return "\n\n".join(parts)

    def summary(self) -> str:
        if not self.records:
            return (f"no device kernels recorded in {self.steps} step(s)"
                    + (f" on {self.device}" if self.device else "") + " (profiling kernels needs a CUDA GPU)")
        step = f", step {self.step_ms:.2f} ms (unprofiled)" if self.step_ms else ""
        busy = f", GPU busy {100 * self.kernel_ms / self.step_ms:.0f}% of the step" if self.step_ms else ""
        return (f"{self.kernel_ms:.2f} ms of kernels per step{step}{busy}; kforge kernels "
                f"{100 * self.share('kforge'):.1f}%, matmul {100 * self.share('matmul'):.1f}%, "
                f"attention {100 * self.share('attention'):.1f}% of kernel time"
                + (f" [{self.device}, {self.steps} steps]" if self.device else ""))

    def to_dict(self) -> dict:
        return dict(steps=self.steps, step_ms=self.step_ms, kernel_ms=self.kernel_ms, device=self.device,
                    by_category=self.by_category(), by_region=self.by_region(), by_op=self.by_op(None),
                    notes=self.notes)

    def __str__(self) -> str:
        out = self.summary()
        if self.records:
            out += "\n\n" + self.table()
        if self.notes:
            out += "\n" + "\n".join(f"note: {n}" for n in self.notes)
        return out


def summarize(records: list[KernelRecord], steps: int, step_ms: float | None = None, device: str = "") -> ProfileReport:
    """A ProfileReport from kernel records (see `kernel_records`)."""
    return ProfileReport(steps, step_ms, list(records), device)


def _time_steps(fn: Callable, args: tuple, kwargs: dict, steps: int) -> float:
    """Median wall ms of one call: CUDA events on a GPU, perf_counter on the CPU."""
    times = []
    cuda = torch.cuda.is_available()
    for _ in range(steps):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn(*args, **kwargs)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            t = time.perf_counter()
            fn(*args, **kwargs)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def profile(
    fn: Callable,
    *args: Any,
    steps: int = 5,
    warmup: int = 2,
    nvtx: bool = True,
    compiled: Iterable[Any] = (),
    trace_file: str | None = None,
    **kwargs: Any,
) -> ProfileReport:
    """Profile `fn(*args, **kwargs)` (typically a whole training step) and summarise its kernels.

    warmup:   calls before measuring (Thunder / torch.compile compile on the first one).
    steps:    calls timed without the profiler (step_ms), then profiled.
    nvtx:     wrap kforge launches in "kforge.<op>.<direction>" NVTX + record_function ranges while
              profiling (see `nvtx_ranges`), so each kforge kernel is labelled with its op.
    compiled: restrict that wrapping to these compiled objects (default: every live Thunder program).
    trace_file: also write the profiler's Chrome trace there (open in Perfetto / chrome://tracing).
    """
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if steps < 1:
        raise ValueError(f"profile: steps must be >= 1, got {steps}")
    cuda = torch.cuda.is_available()
    for _ in range(warmup):
        fn(*args, **kwargs)
    if cuda:
        torch.cuda.synchronize()
    step_ms = _time_steps(fn, args, kwargs, steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    notes = []
    ranges = nvtx_ranges(*compiled, record_function=True) if nvtx else contextlib.nullcontext(0)
    with ranges as n_wrapped:
        if nvtx and not n_wrapped:
            notes.append("no kforge operator in the compiled programs: no kforge ranges")
        with torch_profile(activities=activities, acc_events=True) as prof:
            for _ in range(steps):
                fn(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
    if trace_file:
        prof.export_chrome_trace(trace_file)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    report = summarize(kernel_records(prof.events()), steps, step_ms if cuda else None, device)
    report.notes += notes
    return report
