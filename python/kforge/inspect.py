"""What kforge did to a compiled model: the kforge symbols that run, and what it declined and why.

    from kforge.inspect import inspect
    jmodel = thunder.jit(model, executors=[kforge.executor, *thunder.get_default_executors()])
    loss = jmodel(idx, targets)[1]; loss.backward()     # inspect after at least one call
    print(inspect(jmodel))                                # or inspect(jmodel, show_traces=True)

`inspect` accepts a `thunder.jit` result (function or ThunderModule), a `thunder.dynamo.thunderfx` /
`kforge.transforms.thunderfx` result, a module or function compiled with
`torch.compile(..., backend=ThunderCompiler(...))`, the `ThunderCompiler` itself, or a
`kforge.tieout.TieoutReport`. On the Dynamo path every Thunder-compiled subgraph is inspected.

Where the numbers come from:
- kforge symbols: every `kforge_*` call in the final forward / backward traces
  (`thunder.last_traces(fn)[-1]`, `thunder.last_backward_traces(fn)[-1]`), counted inside fusion
  regions too (`kforge.tieout.symbol_counts`).
- claims and declines: kforge's checkers are asked again, without side effects, about the traces this
  function handed to Thunder's autograd and executor passes (the last forward trace before them, and
  the backward trace autograd built, before the execution passes), walking them
  the way those passes do: a symbol kforge accepts is claimed; one it declines is reported with the
  checker's reason and, unless another executor takes it whole, its decomposition is walked too. So
  the result belongs to this function alone, whatever else was compiled in the process, and it can be
  asked for at any time after the call. (`kforge._thunder.declines()` is the process-wide log of the
  checker calls Thunder made; `recording()` below captures the part of it made inside a block.)
- Llama patterns: for `kforge.transforms.thunderfx` / `kforge.transforms.jit` results, what the
  pattern transform replaced or why it left a match alone.
- layouts: for launchers with several kernel layouts, the layout their dispatch (`kforge._C.plan`,
  the launcher's own function) picks for each call's shape and dtype, taking every tensor as 16-byte
  aligned, on this process's GPU 0 (without one: the plan's default device).
"""
from __future__ import annotations

import contextlib
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

__all__ = ["Decline", "InspectReport", "call_layouts", "inspect", "recording", "thunder_functions", "range_name"]


# ---- finding the Thunder functions behind a compiled object ---------------------------------------
def _thunder_compiler(obj: Any, depth: int = 0) -> Any | None:
    """The ThunderCompiler behind a Dynamo-compiled object, or None. Follows the attributes torch.compile
    leaves on its results (OptimizedModule.dynamo_ctx.callback, the convert-frame wrappers'
    `_torchdynamo_orig_backend`, the final `compiler_fn`) and a compiled function's closure."""
    from thunder.dynamo import ThunderCompiler

    if isinstance(obj, ThunderCompiler):
        return obj
    if obj is None or depth > 8:
        return None
    nexts = [getattr(obj, a, None) for a in ("_backend", "backend", "dynamo_ctx", "callback",
                                                "_torchdynamo_orig_backend", "compiler_fn", "_func")]
    nexts += [c.cell_contents for c in (getattr(obj, "__closure__", None) or ()) if _cell_filled(c)]
    for nxt in nexts:
        if nxt is not None and nxt is not obj:
            found = _thunder_compiler(nxt, depth + 1)
            if found is not None:
                return found
    return None


def _cell_filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def thunder_functions(obj: Any) -> tuple[str, list[Any]]:
    """("jit" or "dynamo", the Thunder-compiled functions behind `obj`). See the module docstring for
    what `obj` may be. Raises TypeError when `obj` is none of those."""
    import thunder

    if hasattr(obj, "compiled") and hasattr(obj, "rows") and hasattr(obj, "mode"):  # a TieoutReport
        obj = obj.backend if getattr(obj, "backend", None) is not None else obj.compiled
    if thunder.compile_stats(obj) is not None:
        return "jit", [obj]
    backend = _thunder_compiler(obj)
    if backend is not None:
        return "dynamo", [fn for info in backend.subgraph_infos for fn in (info.thunder_compiled_fns or [])]
    raise TypeError(
        f"kforge.inspect: {type(obj).__name__} is not a Thunder-compiled function: pass a thunder.jit "
        "result, a thunderfx result or a module/function compiled with torch.compile(backend=ThunderCompiler(...))"
    )


def _final_traces(fn: Any) -> tuple[list, Any | None, Any | None]:
    """(computation traces, final forward trace, final backward trace) of a called Thunder function;
    ([], None, None) when it was never called."""
    import thunder

    try:
        traces = thunder.last_traces(fn)
    except TypeError:
        return [], None, None
    if not traces:
        return [], None, None
    try:
        bwd = thunder.last_backward_traces(fn)
    except TypeError:
        bwd = []
    return traces, traces[-1], (bwd[-1] if bwd else None)


# ---- naming --------------------------------------------------------------------------------------
def range_name(symbol: str) -> str:
    """The op / direction name of a kforge symbol: "kforge_layernorm_forward" -> "kforge.layernorm.forward",
    "kforge_split_qkv" -> "kforge.split_qkv" (a model-helper operator, no direction)."""
    stem = symbol.removeprefix("kforge_")
    for d in ("forward", "backward"):
        if stem.endswith("_" + d):
            return f"kforge.{stem[: -len(d) - 1]}.{d}"
    return f"kforge.{stem}"


def _launches_kernel(symbol: str) -> bool:
    """Whether a kforge operator calls a kforge._C launcher (by convention its name is the launcher's,
    "kforge_<launcher>"); the others are model-helper operators that run torch code when executed."""
    from . import _C

    return callable(getattr(_C, symbol.removeprefix("kforge_"), None))


# ---- launch layouts ------------------------------------------------------------------------------
# Per launcher with a plan: the argument whose shape / dtype the plan takes, and the plan's options
# from the call's other arguments (their positions in the launcher's signature).
def _plan_query(name: str, args: tuple) -> tuple[Any, dict] | None:
    def arg(i: int, default: Any = None) -> Any:
        return args[i] if len(args) > i else default

    if name in ("layernorm_forward", "layernorm_backward", "layernorm_backward_copy", "add_layernorm_forward"):
        # backward: (dout, x, weight, bias, mean, rstd, dresidual, copy_dtype); the add: (x16, residual,
        # weight, bias, eps, y_dtype), planned as the norm of the fp32 residual
        o = 0 if name == "layernorm_forward" else 1
        options = {"weight": arg(o + 1) is not None, "bias": arg(o + 2) is not None}
        if name == "layernorm_forward" and arg(4) is not None:
            options["y_dtype"] = str(args[4])
        if name.startswith("layernorm_backward"):
            options["dresidual"] = arg(6) is not None
            if arg(7) is not None:
                options["copy_dtype"] = str(args[7])
        return args[o], options
    if name in ("rmsnorm_forward", "add_rmsnorm_forward"):
        return args[0], {"normalized_ndim": arg(3 if name == "rmsnorm_forward" else 4, 1)}
    if name == "rmsnorm_backward":
        return args[1], {"normalized_ndim": arg(4, 1), "cast_before_weight": bool(arg(5, True))}
    if name == "add_rmsnorm_backward":  # (dy, dresidual, s, weight, rstd, ndim, cbw): rmsnorm_backward's plan
        return args[2], {"normalized_ndim": arg(5, 1), "cast_before_weight": bool(arg(6, True)),
                         "dresidual": args[1] is not None}
    if name == "rmsnorm_backward_copy":  # (dy, x, weight, rstd, ndim, cbw, dresidual, copy_dtype)
        return args[1], {"normalized_ndim": arg(4, 1), "cast_before_weight": bool(arg(5, True)),
                         "dresidual": arg(6) is not None, "copy_dtype": str(args[7])}
    if name == "rmsnorm_backward_sum":  # (dy0, dy1, dy2, x, weight, rstd, ndim, cbw, dresidual, copy_dtype)
        from thunder.core.dtypes import to_torch_dtype

        options = {"normalized_ndim": arg(6, 1), "cast_before_weight": bool(arg(7, True)),
                   "dresidual": arg(8) is not None, "dy_terms": 2 if args[2] is None else 3,
                   "dy_dtype": str(to_torch_dtype(args[0].dtype))}
        if arg(9) is not None:
            options["copy_dtype"] = str(args[9])
        return args[3], options
    if name in ("cross_entropy_backward", "gelu_backward"):
        return args[1], {}
    if name in ("rope_forward", "rope_backward"):
        q, k, cos = args[0], args[1], args[2]
        return q, {"kv_heads": k.shape[1], "interleaved": bool(arg(5, False)),
                   "f32_tables": cos.dtype != q.dtype}
    if name == "split_qkv_forward":
        return args[0], {"n_head": int(getattr(args[1], "value", args[1]))}
    if name == "split_qkv_backward":  # (dq, dk, dv), None where that output was unused
        return next(a for a in args if a is not None), {}
    if name == "embedding_backward":  # (grad, indices, num_weights, padding_idx)
        import torch
        from thunder.core import dtypes

        return args[0], {"num_weights": int(args[2]),
                         "int32_indices": dtypes.to_torch_dtype(args[1].dtype) is torch.int32}
    if name in ("merge_heads_forward", "merge_heads_backward"):
        return None  # a view, no kernel, where the heads are token-major in memory (ops/permute.py)
    return args[0], {}


def _device_limits() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    p = torch.cuda.get_device_properties(0)
    limits = {"sms": p.multi_processor_count}
    optin = getattr(p, "shared_memory_per_block_optin", None)
    if optin:
        limits["smem_optin"] = optin
    return limits


# Operators whose launcher call is another launcher's plan with options (_plan_query).
_PLANNED_AS = {"add_rmsnorm_backward": "rmsnorm_backward", "rmsnorm_backward_copy": "rmsnorm_backward",
               "rmsnorm_backward_sum": "rmsnorm_backward",
               "layernorm_backward_copy": "layernorm_backward", "add_layernorm_forward": "layernorm_forward",
               "cross_entropy_forward_unit_grad": "cross_entropy_forward_backward",
               "cross_entropy_f32_forward_unit_grad": "cross_entropy_forward_backward"}


def call_layouts(traces: list) -> dict[str, Counter]:
    """kforge symbol -> Counter of the layouts its launcher's plan picks for the calls in `traces`
    (searching inside fusion regions, as `symbol_counts`); symbols without a plan are left out."""
    from . import _C

    planned, limits, out = set(_C.plan_ops()), _device_limits(), {}
    planned |= set(_PLANNED_AS)

    def layout(name: str, args: tuple) -> str | None:
        try:
            from thunder.core.dtypes import to_torch_dtype

            x, options = _plan_query(name, args)
            op = _PLANNED_AS.get(name, name)
            p = _C.plan(op, list(x.shape), to_torch_dtype(x.dtype), **limits, **options)
            # dy terms the launcher sums with torch before the plan's kernel (outside the ring)
            return p["layout"] + (" after torch's sum" if "dy_sum" in p else "")
        except Exception:  # a call the plan cannot read (unusual arguments): no layout shown
            return None

    def walk(bsyms) -> None:
        for b in bsyms:
            name = b.sym.name
            if name.startswith("kforge_"):
                if name.removeprefix("kforge_") in planned:
                    found = layout(name.removeprefix("kforge_"), tuple(b.args))
                    if found:
                        out.setdefault(name, Counter())[found] += 1
            else:
                walk(b.subsymbols)

    for t in traces:
        if t is not None:
            walk(t.bound_symbols)
    return out


# ---- asking the checkers again -------------------------------------------------------------------
# Provenance prefixes of the traces made by Thunder's autograd and execution passes: the trace before
# the first of them is the one whose symbols were offered to the executors.
_LATE_PASSES = ("Grad transform", "Transform for", "Delete Last Used", "Augmented forward", "Split forward")


def _offered_trace(traces: list) -> Any:
    chosen = traces[0]
    for t in traces:
        if any(m in str(t.get_provenance() or "") for m in _LATE_PASSES):
            break
        chosen = t
    return chosen


def _claims() -> dict[Any, tuple[str, Callable, str, Callable | None]]:
    """Thunder symbol id -> (op name, raw checker, symbol name, applies filter) from kforge's op table."""
    from . import _thunder

    out = {}
    for spec in _thunder.specs():
        for claim in spec.claims:
            out[claim.symbol.id] = (spec.name, claim.checker, _thunder._symbol_name(claim.symbol), claim.applies)
    return out


def _check(checker: Callable, bsym: Any) -> str | None:
    from thunder.core.trace import TraceCtx, tracectx

    try:
        with tracectx(TraceCtx()):  # a scratch trace: a checker that makes proxies leaves no trace
            return checker(*bsym.args, **bsym.kwargs)
    except Exception as e:  # same policy as kforge._thunder: a checker error is a decline
        return f"checker error: {type(e).__name__}: {e}"


def _walk_offers(trace: Any, executors: list) -> tuple[Counter, Counter]:
    """(claimed {symbol name: n}, declined {(symbol name, "op: reason"): n}) for `trace`, walked as
    Thunder's executor pass does: python-impl symbols are kept; the first executor that can execute a
    symbol takes it; a symbol nobody takes is replaced by its decomposition."""
    from thunder.extend import FusionExecutor, OperatorExecutor

    from . import _thunder

    kforge_ex = _thunder.get_executor()
    claims = _claims()
    claimed: Counter = Counter()
    declined: Counter = Counter()

    def can(ex: Any, b: Any) -> bool:
        try:
            return bool((isinstance(ex, OperatorExecutor) and ex.can_execute(b)) or
                        (isinstance(ex, FusionExecutor) and ex.can_fuse(b)))
        except Exception:  # another executor's checker failing is not ours to report
            return False

    def walk(bsyms: list) -> None:
        for b in bsyms:
            if b.sym.python_impl is not None:
                continue
            taken = False
            for ex in executors:  # in priority order, as Thunder asks them
                if ex == kforge_ex:
                    entry = claims.get(b.sym.id)
                    if entry is None:
                        continue
                    op, checker, name, applies = entry
                    if applies is not None and _check(lambda *a, **k: None if applies(*a, **k) else "no", b):
                        continue  # not this op's kind of call: kforge is not asked
                    reason = _check(checker, b)
                    if reason is None:
                        claimed[name] += 1
                        taken = True
                        break
                    declined[(name, f"{op}: {reason}")] += 1
                elif can(ex, b):
                    taken = True
                    break
            if not taken:  # nobody runs it whole: Thunder decomposes it
                walk(b.subsymbols)

    walk(trace.bound_symbols)
    return claimed, declined


# ---- the recorded log ----------------------------------------------------------------------------
@contextlib.contextmanager
def recording() -> Iterator[dict[str, dict[str, int]]]:
    """Capture the checker declines Thunder records while the block runs (compilations happen on the
    first call with new inputs): yields a dict, filled on exit with {symbol: {"op: reason": count}}.
    Pass it to `inspect(..., declines=...)` to report exactly what Thunder asked. Nothing is reset, so
    other users of `kforge._thunder.declines()` are unaffected."""
    from . import _thunder

    before = _thunder.declines()
    out: dict[str, dict[str, int]] = {}
    try:
        yield out
    finally:
        for sym, reasons in _thunder.declines().items():
            for reason, n in reasons.items():
                d = n - before.get(sym, {}).get(reason, 0)
                if d > 0:
                    out.setdefault(sym, {})[reason] = d


# ---- the report ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Decline:
    """A Thunder symbol kforge was offered and declined: `reason` is the checker's ("op: why")."""

    symbol: str
    reason: str
    count: int


@dataclass
class InspectReport:
    """What `inspect` found.

    mode:      "jit" (one Thunder function) or "dynamo" (one per Thunder-compiled subgraph).
    forward / backward: kforge symbol -> calls in the final forward / backward traces.
    claimed:   Thunder symbol -> how many of its calls in the program kforge's checker accepts.
    declines:  every symbol kforge declines, with the reason and how many calls (per call in the
               program; Thunder itself asks once per pass, which the `recording()` log counts).
    patterns:  (Llama pattern kind, None if replaced else why not) per match, for pattern-transform runs.
    fusions:   one dict per kforge.fusion region in the final traces ("trace" forward / backward, name,
               ops, schedule, kernel, inputs, outputs).
    left_out:  (prim, reason) -> count: what the fusion executor could take but left to torch, and why.
    forward_traces / backward_traces: the final traces (one per Thunder function).
    saved:     files written by `save_dir=`.
    """

    mode: str
    functions: int
    forward: Counter
    backward: Counter
    claimed: Counter
    declines: list[Decline]
    patterns: list[tuple[str, str | None]] = field(default_factory=list)
    fusions: list[dict] = field(default_factory=list)
    left_out: Counter = field(default_factory=Counter)
    forward_traces: list = field(default_factory=list, repr=False)
    backward_traces: list = field(default_factory=list, repr=False)
    saved: list[str] = field(default_factory=list)

    @property
    def symbols(self) -> Counter:
        """Every kforge symbol, forward and backward together."""
        return self.forward + self.backward

    def symbols_table(self, tablefmt: str = "simple") -> str:
        from tabulate import tabulate

        names = sorted(set(self.forward) | set(self.backward))
        layouts = call_layouts([*self.forward_traces, *self.backward_traces])

        def shown(n: str) -> str:  # "warp" or "group ×3, warp ×1"
            c = layouts.get(n, Counter())
            return c.most_common(1)[0][0] if len(c) == 1 else ", ".join(f"{k} ×{v}" for k, v in c.most_common())

        rows = [(n, range_name(n), self.forward.get(n, 0), self.backward.get(n, 0),
                 "kernel" if _launches_kernel(n) else "helper", shown(n)) for n in names]
        return tabulate(rows, headers=("kforge symbol", "op.direction", "forward", "backward", "runs", "layout"),
                        tablefmt=tablefmt, disable_numparse=True)

    def claims_table(self, tablefmt: str = "simple") -> str:
        from tabulate import tabulate

        return tabulate(sorted(self.claimed.items()), headers=("claimed symbol", "count"), tablefmt=tablefmt)

    def declines_table(self, tablefmt: str = "simple") -> str:
        from tabulate import tabulate

        rows = [(d.symbol, d.count, d.reason) for d in self.declines]
        return tabulate(rows, headers=("declined symbol", "count", "reason"), tablefmt=tablefmt,
                        disable_numparse=True)

    def patterns_table(self, tablefmt: str = "simple") -> str:
        from tabulate import tabulate

        counts = Counter((k, r or "replaced by kforge") for k, r in self.patterns)
        return tabulate([(k, r, n) for (k, r), n in sorted(counts.items())],
                        headers=("Llama pattern", "outcome", "count"), tablefmt=tablefmt)

    def fusions_table(self, tablefmt: str = "simple") -> str:
        from tabulate import tabulate

        rows = []
        for f in self.fusions:
            ops = Counter(f["ops"])
            top = ", ".join(f"{op}×{n}" if n > 1 else op for op, n in ops.most_common(6))
            rows.append((f["trace"], f["name"], f["schedule"], len(f["ops"]), f"{f['inputs']}→{f['outputs']}",
                         f["kernel"], top + (", …" if len(ops) > 6 else "")))
        return tabulate(rows, headers=("trace", "fusion", "schedule", "ops", "in→out", "kernel", "ops (most common)"),
                        tablefmt=tablefmt, disable_numparse=True)

    def left_out_table(self, tablefmt: str = "simple") -> str:
        from tabulate import tabulate

        rows = [(s, n, r) for (s, r), n in sorted(self.left_out.items())]
        return tabulate(rows, headers=("left out of fusions", "count", "why"), tablefmt=tablefmt,
                        disable_numparse=True)

    def summary(self) -> str:
        n_kernel = sum(n for s, n in self.symbols.items() if _launches_kernel(s))
        return (f"kforge: {len(self.symbols)} distinct symbol(s), {n_kernel} kernel call(s) per step "
                f"({sum(self.forward.values())} forward, {sum(self.backward.values())} backward) in "
                f"{self.functions} Thunder function(s) [{self.mode}]; "
                f"{sum(self.claimed.values())} claim(s), {sum(d.count for d in self.declines)} decline(s)"
                + (f"; kforge.fusion: {len(self.fusions)} region(s), "
                   f"{len({f['kernel'] for f in self.fusions})} distinct kernel(s)" if self.fusions else ""))

    def __str__(self) -> str:
        parts = [self.summary(), ""]
        parts.append(self.symbols_table() if self.symbols else "no kforge symbol in the final traces")
        if self.claimed:
            parts += ["", self.claims_table()]
        parts += ["", self.declines_table() if self.declines else "no declines"]
        if self.patterns:
            parts += ["", self.patterns_table()]
        if self.fusions:
            parts += ["", self.fusions_table()]
        if self.left_out:
            parts += ["", self.left_out_table()]
        if self.saved:
            parts += ["", "traces saved: " + ", ".join(self.saved)]
        return "\n".join(parts)


def _fusions(trace: Any, which: str) -> list[dict]:
    """kforge.fusion regions of a final trace (empty when the fusion executor was not used)."""
    out = []
    for b in trace.bound_symbols:
        if b.sym.is_fusion and getattr(b.sym.executor, "name", None) == "kforge_fusion":
            from .fusion.executor import describe

            out.append({"trace": which, **describe(b)})
    return out


def inspect(
    compiled: Any,
    *,
    show_traces: bool = False,
    save_dir: str | os.PathLike | None = None,
    declines: dict[str, dict[str, int]] | None = None,
) -> InspectReport:
    """Report the kforge symbols in the final traces of `compiled` and every op kforge declined, with
    the checker's reason. `compiled` must have been called (and backward run, for backward traces).

    show_traces: print the final forward and backward traces.
    save_dir:    write them there as forward[_i].py / backward[_i].py (i = subgraph, Dynamo path).
    declines:    use this log (from `recording()`) instead of asking the checkers again.
    """
    from .tieout import symbol_counts

    mode, fns = thunder_functions(compiled)
    fwd, bwd, claimed, declined, left_out = Counter(), Counter(), Counter(), Counter(), Counter()
    f_traces, b_traces, fusions = [], [], []
    from . import trace_cache

    restored = False  # a program restored from disk: no traces to report
    for fn in fns:
        traces, f, b = _final_traces(fn)
        if f is None:
            restored = restored or trace_cache.has_restored(fn)
            continue
        fusions += _fusions(f, "forward") + (_fusions(b, "backward") if b is not None else [])
        import thunder

        cd = thunder.compile_data(fn)
        left_out.update(getattr(cd, "_kforge_fusion_left_out", None) or {})
        f_traces.append(f)
        fwd += symbol_counts(f)
        if b is not None:
            b_traces.append(b)
            bwd += symbol_counts(b)
        if declines is None:
            import thunder

            cd = thunder.compile_data(fn)
            executors = list(cd.executors_list) if cd is not None else []
            c, d = _walk_offers(_offered_trace(traces), executors)
            claimed += c
            declined += d
            # The backward trace is offered to the executors too (a linear's bias-gradient sum, the
            # gradient accumulations' adds): walk the one autograd built, before the execution passes.
            try:
                btraces = thunder.last_backward_traces(fn)
            except TypeError:
                btraces = []
            if btraces:
                c, d = _walk_offers(_offered_trace(btraces), executors)
                claimed += c
                declined += d
    if restored:  # also where only some of Dynamo's pieces were restored: the report would omit them
        entry = "kforge.compile" if mode == "dynamo" else "kforge.jit"
        raise ValueError("kforge.inspect: the compiled function runs programs restored from kforge's trace "
                         f"cache, which keeps no traces; compile it with {entry}(model, trace_cache=False) "
                         "(or KFORGE_TRACE_CACHE=0) to inspect it")
    if not f_traces:
        raise ValueError("kforge.inspect: the compiled function has no traces yet; call it first")
    if declines is not None:
        declined = Counter({(s, r): n for s, rs in declines.items() for r, n in rs.items()})
    decline_list = [Decline(s, r, n) for (s, r), n in sorted(declined.items())]

    rewrites = getattr(compiled, "llama_patterns", None)
    patterns = [(r.match.kind, r.reason) for r in getattr(rewrites, "rewrites", [])]

    report = InspectReport(mode, len(f_traces), fwd, bwd, claimed, decline_list, patterns, fusions, left_out,
                           f_traces, b_traces)
    if show_traces:
        for i, t in enumerate(f_traces):
            print(f"# ---- final forward trace{'' if len(f_traces) == 1 else f' {i}'} ----\n{t}")
        for i, t in enumerate(b_traces):
            print(f"# ---- final backward trace{'' if len(b_traces) == 1 else f' {i}'} ----\n{t}")
    if save_dir is not None:
        os.makedirs(save_dir, exist_ok=True)
        for kind, ts in (("forward", f_traces), ("backward", b_traces)):
            for i, t in enumerate(ts):
                path = os.path.join(save_dir, f"{kind}{'' if len(ts) == 1 else f'_{i}'}.py")
                with open(path, "w") as fh:
                    fh.write(str(t))
                report.saved.append(path)
    return report
