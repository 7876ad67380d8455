"""gemm: the matrix products of kforge's traces called on cuBLASLt directly (src/ops/gemm.cpp).

A training step of a 124M-parameter model calls about 250 GEMMs. Through torch each call costs
20-25 us of host time on the GPU machine (`dev/host_profile.py`: torch.matmul, F.linear and addmm
were a third of the host time of a plain Llama step), and those steps are bound by host time.
kforge's `_C.gemm_*` functions look a plan up by shape (the matmul descriptor, layouts and the kernel
cuBLASLt's heuristic chose, made on the first call of that shape) and launch it on PyTorch's current
stream with torch's own cuBLASLt handle and workspace. Measured (H200, cProfile): 19 us a plan call
against 22-26 us through torch, most of what is left being cuBLASLt's launch and the output's
allocation; with the views folded in, a plain Llama step makes about half as many Python calls.

`GemmCalls`, a post-optimization transform, rewrites the final forward and backward traces:

    torch.matmul(a, b)                   2-D a, b                -> kforge_gemm_mm(a, b)
    F.linear(x, w, bias)                 (what Thunder left to torch) -> kforge_gemm_linear(x, w, bias)
    kforge_matmul_accumulate(c, a, w)    c += a @ w              -> kforge_gemm_addmm_(c, a, w)
    kforge_matmul_widen(a, w)            fp32 result             -> kforge_gemm_mm_widen(a, w)
    kforge_addmm_forward(bias, a, w)     HF's Conv1D             -> kforge_gemm_addmm(bias, a, w)

for CUDA tensors of one 16-bit dtype (bf16, fp16; fp32 GEMMs stay torch's), then folds the views around the backward's
GEMMs into them (`kforge_gemm_views`: Thunder writes each linear layer's backward as reshapes and a
transpose around two matmuls, ~2 us of host time per view call), and the head split after a forward
linear (`reshape` to (B, T, H, D), `permute` to (B, H, T, D)) into its call (`kforge_gemm_linear_views`;
Conv1D's views around its addmm likewise, `kforge_gemm_addmm_views`).
Each name computes what it
replaces with the same arithmetic (fp32 accumulation; TF32 only where torch allows it); a call
whose run-time strides, alignment or torch settings are off the fast path goes to the ATen op it
replaces, inside the same C++ call. `stats()` counts both kinds of calls.

On by default in kforge.jit / kforge.compile; `gemm=False` or KFORGE_GEMM=0 leaves the GEMMs to torch.

Tuning (on by default; KFORGE_GEMM_TUNE=0 when this module is imported, or `set_tune(False)`, turns it
off; on an H200 it took 0.25-0.35 ms off a plain Llama step bound by its GEMMs, nothing off one bound by
its host): a plan asks the heuristic for up to 8 kernels, times each on its first call's operands (five
launches after a warm-up, into the call's own output or, when it accumulates, a zeroed scratch; the
stream is drained before and synchronised after, once per shape, never during CUDA-graph capture,
without holding the plans' lock) and keeps the fastest, the heuristic's first unless another is 3 %
faster. A failure while timing (no memory for the scratch) keeps the first. torch's cuBLASLt path runs
the heuristic's first, so tuning can only change which of cuBLASLt's kernels a shape gets: the same
arithmetic, but possibly another summation order, so results may differ in rounding from untuned calls.
Each choice is appended to a tuning record in kforge's cache directory (per GPU model and cuBLASLt
version); a later process takes a shape's kernel from it without timing, while cuBLASLt still offers
that kernel, so the kernel (and the rounding) stays the same from one process to the next. `tuning()`
lists each tuned shape's candidates' times and the choice.
"""
from __future__ import annotations

from typing import Any

import torch
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.transform_common import Transform

from .. import _C
from .._thunder import OpSpec, operator

__all__ = ["GemmCalls", "enabled", "rewrite", "set_tune", "stats", "tuning"]


def _mm_meta(a: TensorProxy, b: TensorProxy) -> TensorProxy:
    return TensorProxy(like=a, shape=(a.shape[0], b.shape[1]))


def _widen_meta(a: TensorProxy, b: TensorProxy) -> TensorProxy:
    return TensorProxy(like=a, shape=(a.shape[0], b.shape[1]), dtype=dtypes.float32)


def _addmm__meta(c: TensorProxy, a: TensorProxy, b: TensorProxy) -> TensorProxy:
    return TensorProxy(like=c)


def _addmm_meta(bias: TensorProxy, a: TensorProxy, b: TensorProxy) -> TensorProxy:
    return TensorProxy(like=a, shape=(a.shape[0], b.shape[1]))


def _linear_meta(x: TensorProxy, w: TensorProxy, bias: TensorProxy | None = None) -> TensorProxy:
    return TensorProxy(like=x, shape=(*x.shape[:-1], w.shape[0]))


gemm_mm = operator("gemm_mm", meta=_mm_meta, fn=_C.gemm_mm)
gemm_mm_widen = operator("gemm_mm_widen", meta=_widen_meta, fn=_C.gemm_mm_widen)
gemm_addmm_ = operator("gemm_addmm_", meta=_addmm__meta, fn=_C.gemm_addmm_)
gemm_addmm = operator("gemm_addmm", meta=_addmm_meta, fn=_C.gemm_addmm)
gemm_linear = operator("gemm_linear", meta=_linear_meta, fn=_C.gemm_linear)

# No torch symbol is claimed: the names enter traces through GemmCalls, after every other pass.
SPEC = OpSpec("gemm", ())

# The operand dtypes GemmCalls takes by default. fp32 GEMMs stay torch's: on an H200, cuBLASLt's
# heuristic kernel for IEEE fp32 made nanoGPT 124M's graphed fp32 step (B=4, T=64) 1.4 ms slower than
# torch's cuBLAS choice (10.70 vs 9.27 ms), and fp32 steps are bound by GEMM time, not host time.
# The fp32 entries stay right and tested for direct calls.
SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def _floats_on(on: tuple[tuple[str, ...], tuple[torch.dtype, ...]], *ts: Any) -> bool:
    """All tensors, on one device of a type in on[0], of one dtype in on[1], none empty."""
    if not all(isinstance(t, TensorProxy) for t in ts):
        return False
    first = ts[0]
    devices, taken = on
    return (first.device.type in devices and dtypes.to_torch_dtype(first.dtype) in taken and first.numel != 0
            and all(t.device == first.device and t.dtype == first.dtype for t in ts))


def _executor(b: Any) -> str | None:
    """The name of the executor that runs bound symbol `b` in a final trace."""
    return getattr(getattr(b.sym, "executor", None), "name", None)


def _replacement(b: Any, on: tuple[tuple[str, ...], tuple[torch.dtype, ...]]) -> Any | None:
    """The kforge_gemm_* call that computes `b`, or None to keep it."""
    name = b.sym.name
    ex = _executor(b)
    args = b.args
    out = b.output
    if ex == "torch" and name == "matmul" and len(args) == 2 and not b.kwargs:
        a, w = args
        if _floats_on(on, a, w) and a.ndim == 2 and w.ndim == 2:
            return gemm_mm.bind(a, w, output=out)
    elif ex == "torch" and name == "linear" and len(args) in (2, 3) and not b.kwargs:
        x, w = args[:2]
        bias = args[2] if len(args) == 3 else None
        if (_floats_on(on, x, w, *(() if bias is None else (bias,))) and x.ndim >= 2 and w.ndim == 2
                and (bias is None or bias.ndim == 1)):
            return gemm_linear.bind(x, w, bias, output=out)
    elif ex == "kforge" and name in _KFORGE_GEMMS and _floats_on(on, *args):
        return _KFORGE_GEMMS[name].bind(*args, output=out)
    return None


# kforge's own GEMM names and the plan calls that take them, argument for argument.
_KFORGE_GEMMS = {
    "kforge_matmul_accumulate": gemm_addmm_,   # (c, a, w): c += a @ w
    "kforge_matmul_widen": gemm_mm_widen,      # (a, w): fp32 a @ w
    "kforge_addmm_forward": gemm_addmm,        # (bias, a, w): Conv1D
}


# ---- folding the views around a GEMM into its call ---------------------------------------------------
# Thunder's backward of a linear layer is `reshape(g, (-1, n))`, `permute(.., (1, 0))`, `matmul`,
# `reshape(result, shape)`: three or four view calls of ~2 us of host time each around every GEMM.
# Views read only by GEMMs (and a reshape that is a GEMM result's only reader) become arguments of
# `kforge_gemm_views`, which makes the same views in C++ (torch.reshape's rules: a view where one
# exists, else a copy, exactly as the dropped call would have made).
_RESHAPES = ("reshape", "torch_prims_reshape_impl")


def _views_meta(a: TensorProxy, ka: int, ta: bool, b: TensorProxy, kb: int, tb: bool, c: TensorProxy | None,
                widen: bool, out_shape: tuple | None) -> TensorProxy:
    rows = a.numel // ka if not ta else ka
    cols = kb if not tb else b.numel // kb
    shape = tuple(out_shape) if out_shape is not None else (rows, cols)
    if c is not None:
        return TensorProxy(like=c, shape=shape)
    return TensorProxy(like=a, shape=shape, dtype=dtypes.float32 if widen else a.dtype)


gemm_views = operator("gemm_views", meta=_views_meta, fn=_C.gemm_views)


def _linear_views_meta(x: TensorProxy, w: TensorProxy, bias: TensorProxy | None, out_shape: tuple,
                       perm: tuple | None) -> TensorProxy:
    shape = tuple(out_shape) if perm is None else tuple(out_shape[d] for d in perm)
    return TensorProxy(like=x, shape=shape)


gemm_linear_views = operator("gemm_linear_views", meta=_linear_views_meta, fn=_C.gemm_linear_views)


def _addmm_views_meta(bias: TensorProxy, a: TensorProxy, ka: int, b: TensorProxy, out_shape: tuple | None) -> TensorProxy:
    shape = tuple(out_shape) if out_shape is not None else (a.numel // ka, b.shape[1])
    return TensorProxy(like=a, shape=shape)


gemm_addmm_views = operator("gemm_addmm_views", meta=_addmm_views_meta, fn=_C.gemm_addmm_views)
_FOLDABLE = ("kforge_gemm_mm", "kforge_gemm_addmm_", "kforge_gemm_mm_widen")


def _is_reshape(b: Any) -> bool:
    return (b.sym.name in _RESHAPES and _executor(b) == "torch"
            and len(b.flat_proxy_args) == 1 and isinstance(b.output, TensorProxy))


def _is_transpose(b: Any) -> bool:
    return (b.sym.name == "permute" and _executor(b) == "torch"
            and len(b.args) == 2 and isinstance(b.args[0], TensorProxy) and b.args[0].ndim == 2
            and tuple(b.args[1]) == (1, 0))


def _fold_views(bsyms: list) -> tuple[list, int]:
    """(bsyms with views folded into their GEMMs, number of view calls removed).

    A 2-D reshape or transpose is folded when every reader of its result is a GEMM (or a folded
    transpose read only by GEMMs): the gradient of a linear layer, `reshape(g, (-1, n))`, is read by
    both the input's and the weight's GEMM, and one layer input by the q, k and v weight GEMMs."""
    from ..fusion.matmul_acc import _Trace

    tr = _Trace(bsyms, skip_dels=True)
    producer, readers = tr.producer, tr.readers
    gemms = {i for i, b in enumerate(bsyms) if b.sym.name in _FOLDABLE}

    def read_by(name: str, ok: set[int]) -> bool:
        rs = readers.get(name, set())
        return bool(rs) and rs <= ok

    transposes = {i for i, b in enumerate(bsyms) if _is_transpose(b) and read_by(b.output.name, gemms)}
    # (a reshape read by a transpose that stays, read by something else too, stays as well)
    reshapes = {i for i, b in enumerate(bsyms) if _is_reshape(b) and b.output.ndim == 2
                and read_by(b.output.name, gemms | transposes)}
    drop: set[int] = set()
    replace: dict[int, Any] = {}
    for i in sorted(gemms):
        b = bsyms[i]
        c, operands = (b.args[0], b.args[1:]) if b.sym.name == "kforge_gemm_addmm_" else (None, b.args)
        parts = []
        folded = False
        for t in operands:
            src, cols, trans = t, t.shape[1], False
            j = producer.get(src.name)
            if j in transposes:
                drop.add(j)
                folded = True
                src, trans = bsyms[j].args[0], True
                cols = src.shape[1]
                j = producer.get(src.name)
            if j in reshapes:
                drop.add(j)
                folded = True
                src = bsyms[j].flat_proxy_args[0]
            parts += [src, cols, trans]
        out, out_shape = b.output, None
        rs = sorted(readers.get(out.name, ()))
        if len(rs) == 1 and _is_reshape(bsyms[rs[0]]) and rs[0] not in reshapes:  # not another GEMM's operand
            r = bsyms[rs[0]]
            drop.add(rs[0])
            folded = True
            out, out_shape = r.output, tuple(r.output.shape)
        if not folded:
            continue
        nb = gemm_views.bind(*parts, c, b.sym.name == "kforge_gemm_mm_widen", out_shape, output=out)
        nb.tags.update(b.tags)
        replace[i] = nb
    return _splice(bsyms, replace, drop)


def _is_permute(b: Any) -> bool:
    return (b.sym.name == "permute" and _executor(b) == "torch" and len(b.args) == 2
            and isinstance(b.args[0], TensorProxy) and not b.kwargs)


def _fold_linear_views(bsyms: list) -> tuple[list, int]:
    """(bsyms with the views of a forward linear's result folded into its call, view calls removed).

    The head split after a projection, `reshape(y, (B, T, H, D))` then `permute(.., (0, 2, 1, 3))`,
    is two Python calls each for q, k and v in a forward that waits for its host; a reshape that is
    the linear's only reader (and a permute that is that reshape's only reader) become arguments of
    `kforge_gemm_linear_views`, which makes the same views in C++. Hugging Face's Conv1D likewise:
    `x.view(-1, k)` before its addmm and `.view(*lead, n)` after it go into `kforge_gemm_addmm_views`."""
    from ..fusion.matmul_acc import _Trace

    tr = _Trace(bsyms, skip_dels=True)
    readers = tr.readers
    drop: set[int] = set()
    replace: dict[int, Any] = {}

    def only_reader(name: str, test) -> int | None:
        rs = readers.get(name, set())
        if len(rs) != 1:
            return None
        (j,) = rs
        return j if test(bsyms[j]) else None

    for i, b in enumerate(bsyms):
        if b.sym.name == "kforge_gemm_addmm":
            nb = _addmm_views(b, i, bsyms, tr, only_reader, drop)
            if nb is not None:
                replace[i] = nb
            continue
        if b.sym.name != "kforge_gemm_linear":
            continue
        r = only_reader(b.output.name, _is_reshape)
        if r is None or r in drop or not all(type(d) is int for d in bsyms[r].output.shape):
            continue
        out, perm = bsyms[r].output, None
        drop.add(r)
        q = only_reader(out.name, _is_permute)
        if q is not None:
            drop.add(q)
            out, perm = bsyms[q].output, tuple(int(d) for d in bsyms[q].args[1])
        x, w = b.args[:2]
        bias = b.args[2] if len(b.args) > 2 else None
        nb = gemm_linear_views.bind(x, w, bias, tuple(bsyms[r].output.shape), perm, output=out)
        nb.tags.update(b.tags)
        replace[i] = nb
    return _splice(bsyms, replace, drop)


def _addmm_views(b: Any, i: int, bsyms: list, tr: Any, only_reader: Any, drop: set[int]) -> Any | None:
    """`kforge_gemm_addmm_views` for Conv1D's `addmm(bias, reshape(x, (-1, k)), w)` and the reshape of its
    result, where each view is read by this call alone (the indices of the views it takes are added to
    `drop`); None where neither view can go."""
    bias, a, w = b.args
    src, ka = a, a.shape[1]
    j = tr.producer.get(a.name)
    took = []
    if j is not None and j not in drop and _is_reshape(bsyms[j]) and tr.readers.get(a.name, set()) == {i}:
        src = bsyms[j].flat_proxy_args[0]
        took.append(j)
    out, out_shape = b.output, None
    r = only_reader(b.output.name, _is_reshape)
    if r is not None and r not in drop and all(type(d) is int for d in bsyms[r].output.shape):
        out, out_shape = bsyms[r].output, tuple(bsyms[r].output.shape)
        took.append(r)
    if not took:
        return None
    drop.update(took)
    nb = gemm_addmm_views.bind(bias, src, ka, w, out_shape, output=out)
    nb.tags.update(b.tags)
    return nb


def _splice(bsyms: list, replace: dict[int, Any], drop: set[int]) -> tuple[list, int]:
    """(bsyms with the calls at `replace`'s indices replaced and those at `drop` removed, `del`s mended;
    the number removed)."""
    if not replace:
        return bsyms, 0
    # Names no longer made: those of the dropped and replaced calls that no replacement makes. A
    # folded view's result is now the GEMM's own output: its `del` stays (else it lives to the end).
    made = {p.name for nb in replace.values() for p in nb.flat_proxy_outs}
    gone = {p.name for i in (*drop, *replace) for p in bsyms[i].flat_proxy_outs} - made
    kept = [replace.get(i, b) for i, b in enumerate(bsyms) if i not in drop]
    return _place_dels(kept, gone), len(drop)


def _place_dels(bsyms: list, gone: set[str]) -> list:
    """`bsyms` with their `del`s mended after folding: names no longer made dropped, and a name now read
    after its `del` deleted after its last reader instead. Everything else keeps its place (Thunder's
    CUDA-graph transform finds the backward's unpacking by position)."""
    from thunder.core import prims
    from thunder.core.prims import PrimIDs

    last: dict[str, int] = {}
    for i, b in enumerate(bsyms):
        if b.sym.id != PrimIDs.DEL:
            for p in (*b.flat_proxy_args, *b.flat_proxy_outs):
                last[p.name] = i
    moved: dict[int, list] = {}
    out = []
    for i, b in enumerate(bsyms):
        if b.sym.id == PrimIDs.DEL:
            names = b.flat_proxy_args
            keep = []
            for p in names:
                if p.name in gone:
                    continue
                if last.get(p.name, -1) > i:
                    moved.setdefault(last[p.name], []).append(p)
                else:
                    keep.append(p)
            if len(keep) == len(names):
                out.append(b)
            elif keep:
                out.append(prims.python_del.bind(*keep, output=None))
        else:
            out.append(b)
        if i in moved:
            out.append(prims.python_del.bind(*moved.pop(i), output=None))
    return out


def rewrite(trace: Any, devices: tuple[str, ...] = ("cuda",),
            operand_dtypes: tuple[torch.dtype, ...] = SIXTEEN_BIT) -> Any:
    """`trace` with its GEMM calls on kforge's cuBLASLt plans and the views around them folded into
    those calls (see the module docstring), for operands on `devices` of one of `operand_dtypes`; `trace`
    itself when it has no GEMM to take."""
    from thunder.core.trace import TraceProvenance, from_trace

    on = (tuple(devices), tuple(operand_dtypes))
    bsyms = []
    count = 0
    for b in trace.bound_symbols:
        nb = _replacement(b, on)
        if nb is None:
            bsyms.append(b)
            continue
        nb.tags.update(b.tags)
        bsyms.append(nb)
        count += 1
    if not count:
        return trace
    bsyms, folded = _fold_views(bsyms)
    bsyms, folded_fwd = _fold_linear_views(bsyms)
    folded += folded_fwd
    new = from_trace(trace)
    new.bound_symbols = bsyms
    new.set_provenance(TraceProvenance(f"kforge: {count} GEMM calls on cuBLASLt plans, {folded} views folded "
                                       f"into them"))
    return new


class GemmCalls(Transform):
    """Post-optimization: the final traces' GEMMs called on kforge's cuBLASLt plans (kforge.ops.gemm).
    `devices`: device types whose tensors are taken (CUDA; tests take the CPU, where every call is
    torch's own op). `dtypes`: operand dtypes taken (default bf16 and fp16; float32 GEMMs stay torch's,
    see SIXTEEN_BIT)."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",), dtypes: tuple[torch.dtype, ...] = SIXTEEN_BIT) -> None:
        self.devices = tuple(devices)
        self.dtypes = tuple(dtypes)

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}(devices={self.devices!r}, dtypes={self.dtypes!r})"

    def transform_trace_post_optimization(self, computation_trace: Any, **kwargs: Any) -> Any:
        return rewrite(computation_trace, self.devices, self.dtypes)


def stats() -> dict:
    """{cublaslt: found, fast_calls, aten_calls, plans, plans_without_kernel, tune: on, tuned: plans
    tuned, tuned_changed: of those, plans running another kernel than the heuristic's first,
    tuned_restored: of those, plans whose kernel came from the tuning record} since the process
    started."""
    return dict(_C.gemm_stats())


def set_tune(on: bool, forget: bool = False) -> None:
    """Tuning on or off (see the module's docstring) for the calls from now on: tuned and untuned plans
    are kept apart, so switching back and forth re-tunes nothing. `forget` drops every plan and turns
    the tuning record off for the process, so that each shape's next call makes (and, tuning, times)
    its plan anew and nothing is written to the cache directory (tests)."""
    if not isinstance(on, bool) or not isinstance(forget, bool):
        raise TypeError(f"kforge.ops.gemm.set_tune: on and forget must be bool, got {on!r}, {forget!r}")
    _C.gemm_set_tune(on, forget)


def tuning() -> list[dict]:
    """Per tuned plan: m, n, k, leading dimensions and operand layouts, bias, accumulate, cuBLAS data
    and compute types, device, the candidates' times in microseconds in the heuristic's order (-1:
    could not launch; empty: a single candidate, timing failed and the first is kept, or restored)
    and `chosen`, the index of the one its calls run. `restored`: the choice was read from the tuning
    record (`gemm-tuning-<GPU>-sm<XY>-cublaslt<version>.txt` in kforge's cache directory, where each
    timed choice is appended; a shape's first line wins), so the processes on that machine run the
    same kernel for the shape."""
    return [dict(d) for d in _C.gemm_tuning()]


def _tune_from_env() -> None:
    from .. import _env

    _C.gemm_set_tune(_env.flag("KFORGE_GEMM_TUNE"), False)


_tune_from_env()


def launch_callables(m: int = 64, k: int = 64, n: int = 64, device: str = "cuda") -> list[tuple[str, Any]]:
    """(name, call) pairs for `bench launch`: one GEMM call in each form a trace makes it, through torch
    and on kforge's plans, with the pieces such a call is made of (an output's allocation, the two views
    of a linear layer's backward). bf16, (m, k, n) tiny by default, so that a kernel takes less GPU time
    than its call takes host time: the loop measures the host."""
    import torch.nn.functional as F

    bt = (2, m // 2)  # activations as traces carry them: (B, T, features)
    x = torch.randn(*bt, k, device=device, dtype=torch.bfloat16)  # a linear layer's input
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)  # its weight (out, in)
    g = torch.randn(*bt, n, device=device, dtype=torch.bfloat16)  # its output's gradient
    x2, wt = x.view(-1, k), w.t()
    shape = f"({m} x {k} x {n} bf16)"
    return [
        (f"torch.empty ({m}, {n}) bf16: an output", lambda: torch.empty((m, n), device=device, dtype=torch.bfloat16)),
        ("reshape + t(): two views", lambda: torch.reshape(x, (-1, k)).t()),
        (f"torch.mm {shape}", lambda: torch.mm(x2, wt)),
        (f"torch.matmul {shape}", lambda: torch.matmul(x2, wt)),
        (f"F.linear {shape}", lambda: F.linear(x, w)),
        ("torch.matmul, weight gradient with its views", lambda: torch.matmul(torch.reshape(g, (-1, n)).t(),
                                                                                torch.reshape(x, (-1, k)))),
        (f"kforge._C.gemm_mm {shape}", lambda: _C.gemm_mm(x2, wt)),
        (f"kforge._C.gemm_linear {shape}", lambda: _C.gemm_linear(x, w, None)),
        ("kforge._C.gemm_views, weight gradient", lambda: _C.gemm_views(g, n, True, x, k, False, None, False, None)),
        ("kforge._C.gemm_views, input gradient", lambda: _C.gemm_views(g, n, False, w, k, False, None, False,
                                                                       (*bt, k))),
    ]


def enabled() -> bool:
    """Whether kforge.jit / kforge.compile add GemmCalls (KFORGE_GEMM, default on)."""
    from .. import _env

    return _env.flag("KFORGE_GEMM")

