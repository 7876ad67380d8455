"""Find Llama building blocks in Thunder traces and hand them to kforge's operators.

Models that `thunder.jit` cannot trace (Hugging Face `LlamaForCausalLM` in transformers 5.x) reach
Thunder through its Dynamo path, `torch.compile(model, backend=ThunderCompiler(...))`, and there the
Llama steps arrive decomposed into torch ops, never as calls of kforge's helper functions:

    RMSNorm   to(f32) -> pow(2) -> mean(-1, keepdim) -> add(eps) -> rsqrt -> mul -> to(dtype) -> mul(weight)
    RoPE      x * cos + cat((-x[..., D/2:], x[..., :D/2]), -1) * sin, for q and k with the same cos/sin
    SwiGLU    silu(gate) * up
    repeat_kv x[:, :, None].expand(B, H, n, T, D).reshape(B, H * n, T, D)

`find_llama_patterns(trace)` recognises these subgraphs by dataflow (not by position in the trace):
every op, constant and shape is checked, and every intermediate must feed only the next step of its
pattern, so a near miss (another eps wiring, a reduction over another dim, an intermediate read
elsewhere) is left alone. `LlamaPatternTransform` replaces each match with the Thunder operator that
kforge registers for the plain-PyTorch helper (`kforge.ops.rmsnorm.rms_norm`, `kforge.ops.rope.
apply_rope`, `kforge.ops.swiglu.swiglu`, `kforge.ops.gqa.repeat_kv`, swapped in through `replaces=`),
before autograd, so kforge's grad transforms also give the backward. By default a match is rewritten
only where kforge's checker accepts it; anything kforge declines keeps its original ops.

    compiled = kforge.transforms.thunderfx(model)      # torch.compile + Thunder + kforge + this pass
    out = compiled(input_ids=idx, labels=idx)
    compiled.last_traces, compiled.last_backward_traces

Written against lightning-thunder 0.2.6, torch 2.11 and transformers 5.17 (eager and sdpa attention,
fp32 and bf16), whose Dynamo traces are what the patterns describe; tests/test_llama.py pins them on
CPU traces, so a transformers or Thunder release that writes these steps differently fails there.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Number
from typing import Any

import torch
from thunder.core import dtypes
from thunder.core.proxies import NumberProxy, Proxy, TensorProxy, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.core.transform_common import Transform

__all__ = [
    "KINDS",
    "HELPERS",
    "Match",
    "Rewrite",
    "find_llama_patterns",
    "LlamaPatternTransform",
    "thunderfx",
    "jit",
    "executors",
]

# Pattern kinds, in the order matches are reported; each names the helper that replaces it.
KINDS = ("rms_norm", "rope", "swiglu", "repeat_kv")
# kind -> "module:function" of the plain-PyTorch helper whose kforge operator replaces the pattern.
HELPERS: dict[str, str] = {
    "rms_norm": "kforge.ops.rmsnorm:rms_norm",
    "rope": "kforge.ops.rope:apply_rope",
    "swiglu": "kforge.ops.swiglu:swiglu",
    "repeat_kv": "kforge.ops.gqa:repeat_kv",
}

# Thunder symbol ids (thunder.torch) of the ops the patterns are made of.
_TO = "torch.Tensor.to"
_POW = "torch.pow"
_MEAN = "torch.mean"
_ADD = "torch.add"
_RSQRT = "torch.rsqrt"
_MUL = "torch.mul"
_GETITEM = "torch.Tensor.__getitem__"
_NEG = "torch.neg"
_CAT = "torch.cat"
_SILU = "torch.nn.functional.silu"
_UNSQUEEZE = "torch.unsqueeze"
_EXPAND = "torch.Tensor.expand"
_RESHAPE = "torch.reshape"


@dataclass(frozen=True, eq=False)
class Match:
    """One occurrence of a Llama step in a trace.

    kind:    one of KINDS.
    args:    the helper's arguments (proxies and constants), in its signature's order:
             rms_norm (x, weight, eps), rope (q, k, cos, sin), swiglu (gate, up), repeat_kv (x, n_rep).
    outputs: the proxies the rest of the trace reads (rope: (q_embed, k_embed); others one proxy).
    bsyms:   every top-level bound symbol the match replaces.
    """

    kind: str
    args: tuple
    outputs: tuple[TensorProxy, ...]
    bsyms: tuple[BoundSymbol, ...]

    def __repr__(self) -> str:
        def show(a: Any) -> str:
            return a.name if isinstance(a, Proxy) else repr(a)

        return (f"Match({self.kind}({', '.join(map(show, self.args))}) -> "
                f"{', '.join(o.name for o in self.outputs)}, {len(self.bsyms)} ops)")


@dataclass(frozen=True)
class Rewrite:
    """What LlamaPatternTransform did with a match: `reason` is None when it was replaced."""

    match: Match
    reason: str | None

    @property
    def applied(self) -> bool:
        return self.reason is None


# ---- the trace as a dataflow graph ----------------------------------------------------------------
class _Graph:
    """Producers and consumers of the proxies of a trace's top-level bound symbols."""

    def __init__(self, trace: TraceCtx):
        self.bsyms: list[BoundSymbol] = list(trace.bound_symbols)
        self.position: dict[int, int] = {id(b): i for i, b in enumerate(self.bsyms)}
        self._producer: dict[str, BoundSymbol] = {}
        self._consumers: dict[str, list[BoundSymbol]] = {}
        for b in self.bsyms:
            args = {variableify(p): p for p in b.flat_proxy_args}
            for p in args.values():
                self._consumers.setdefault(p.name, []).append(b)
            for o in b.flat_proxy_outs:
                # An op that returns one of its inputs does not produce it.
                if variableify(o) not in args:
                    self._producer.setdefault(o.name, b)

    def producer(self, p: Any, *sym_ids: str) -> BoundSymbol | None:
        """The bound symbol that produced proxy `p`, when its symbol is one of `sym_ids`."""
        if not isinstance(p, TensorProxy):
            return None
        b = self._producer.get(p.name)
        return b if b is not None and b.sym.id in sym_ids else None

    def consumers(self, p: Proxy) -> list[BoundSymbol]:
        """Distinct top-level bound symbols reading `p` (the trace's return included)."""
        return self._consumers.get(p.name, [])

    def only_consumer(self, p: Proxy, *sym_ids: str) -> BoundSymbol | None:
        """The one bound symbol reading `p`, when there is exactly one and its symbol is in `sym_ids`."""
        users = self.consumers(p)
        if len(users) != 1 or users[0].sym.id not in sym_ids:
            return None
        return users[0]


# ---- small predicates on bound symbol arguments -------------------------------------------------------
def _arg(b: BoundSymbol, i: int, name: str, default: Any = None) -> Any:
    """Argument `name` of `b`, passed positionally at index `i` or by keyword."""
    if len(b.args) > i:
        return b.args[i]
    return b.kwargs.get(name, default)


def _const(x: Any) -> bool:
    """A Python number fixed at trace time (a NumberProxy may change between calls)."""
    return isinstance(x, Number) and not isinstance(x, (bool, NumberProxy))


def _torch_dtype(p: TensorProxy) -> torch.dtype:
    return dtypes.to_torch_dtype(p.dtype)


def _is_last_dim(dim: Any, ndim: int) -> bool:
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return _const(dim) and isinstance(dim, int) and dim in (-1, ndim - 1)


def _other(b: BoundSymbol, p: Proxy) -> Any:
    """The operand of binary `b` that is not `p` (None unless `p` is exactly one of the two)."""
    a0, a1 = b.args[0], b.args[1]
    if a0 is p and a1 is not p:
        return a1
    if a1 is p and a0 is not p:
        return a0
    return None


def _is_cast(b: BoundSymbol, dtype: torch.dtype) -> bool:
    """`b` is `Tensor.to` that changes (at most) the dtype, to `dtype`: same shape, same device."""
    src, out = b.args[0], b.output
    return (isinstance(src, TensorProxy) and isinstance(out, TensorProxy) and out.shape == src.shape
            and out.device == src.device and _torch_dtype(out) == dtype
            and b.kwargs.get("memory_format") in (None, torch.preserve_format))


def _is_full_slice(s: Any) -> bool:
    return isinstance(s, slice) and s == slice(None, None, None)


def _last_dim_slice(key: Any, ndim: int) -> slice | None:
    """The slice of `x[key]` when it selects along the last dim only (`x[..., a:b]` or
    `x[:, :, :, a:b]`), else None."""
    if not isinstance(key, tuple):
        key = (key,)
    if len(key) == 2 and key[0] is Ellipsis:
        last = key[1]
    elif len(key) == ndim and all(_is_full_slice(k) for k in key[:-1]):
        last = key[-1]
    else:
        return None
    if not isinstance(last, slice) or last.step not in (None, 1):
        return None
    if not all(v is None or _const(v) for v in (last.start, last.stop)):
        return None
    return last


def _is_half(s: slice, d: int, which: str) -> bool:
    """Slice `s` of a last dim of size `d` is its first (`which="lo"`) or second half."""
    start, stop = s.indices(d)[:2]
    return (start, stop) == ((0, d // 2) if which == "lo" else (d // 2, d))


# ---- the patterns -------------------------------------------------------------------------------------
def _match_rms_norm(g: _Graph, rsqrt: BoundSymbol) -> Match | None:
    """Anchored at `rsqrt(mean(x32 ** 2, -1, keepdim=True) + eps)`."""
    (a,) = rsqrt.args
    add = g.producer(a, _ADD)
    if add is None or _arg(add, 2, "alpha", 1) != 1:
        return None
    var, eps = add.args[0], add.args[1]
    if not isinstance(var, TensorProxy):
        var, eps = eps, var
    if not (isinstance(var, TensorProxy) and _const(eps)):
        return None
    mean = g.producer(var, _MEAN)
    if mean is None or _arg(mean, 2, "keepdim", False) is not True or _arg(mean, 3, "dtype") is not None:
        return None
    sq = mean.args[0]
    if not isinstance(sq, TensorProxy) or not _is_last_dim(_arg(mean, 1, "dim"), sq.ndim):
        return None
    pow_ = g.producer(sq, _POW, _MUL)
    if pow_ is None:
        return None
    x32 = pow_.args[0]
    if pow_.sym.id == _POW and not (_const(pow_.args[1]) and pow_.args[1] == 2):
        return None
    if pow_.sym.id == _MUL and pow_.args[1] is not x32:
        return None
    if not isinstance(x32, TensorProxy) or _torch_dtype(x32) != torch.float32:
        return None

    # x32 * rsqrt(...): the normalised rows in fp32.
    norm = g.only_consumer(rsqrt.output, _MUL)
    if norm is None or _other(norm, rsqrt.output) is not x32:
        return None
    # The input: x itself when already fp32 without a cast, else the source of the fp32 cast.
    up = g.producer(x32, _TO)
    x = up.args[0] if up is not None and _is_cast(up, torch.float32) else x32
    if x is x32:
        up = None
    if not (dtypes.is_float_dtype(x.dtype) and x.ndim >= 1):
        return None

    # Cast back to the input dtype (HF always writes it, a no-op for fp32), then times the weight.
    h = norm.output
    down = g.only_consumer(h, _TO, _MUL)
    if down is not None and down.sym.id == _TO:
        if not _is_cast(down, _torch_dtype(x)):
            return None
        h = down.output
    else:
        if _torch_dtype(x) != torch.float32:
            return None
        down = None
    scale = g.only_consumer(h, _MUL)
    if scale is None:
        return None
    w = _other(scale, h)
    if not (isinstance(w, TensorProxy) and w.ndim == 1 and w.shape[0] == x.shape[-1] and w.device == x.device):
        return None

    bsyms = [b for b in (up, pow_, mean, add, rsqrt, norm, down, scale) if b is not None]
    # Each intermediate feeds only the next step, so removing the pattern changes nothing else.
    inner = {id(b) for b in bsyms}
    for b in bsyms[:-1]:
        if not all(id(c) in inner for c in g.consumers(b.output)):
            return None
    return Match("rms_norm", (x, w, eps), (scale.output,), tuple(bsyms))


def _match_rotate(g: _Graph, cat: BoundSymbol) -> tuple | None:
    """Anchored at `cat((-x[..., D/2:], x[..., :D/2]), -1)` (HF's rotate_half): returns
    (x, bsyms of rotate_half)."""
    tensors = _arg(cat, 0, "tensors")
    if not (isinstance(tensors, (tuple, list)) and len(tensors) == 2):
        return None
    lo_neg, lo = tensors
    neg = g.producer(lo_neg, _NEG)
    hi_get = g.producer(neg.args[0], _GETITEM) if neg is not None else None
    lo_get = g.producer(lo, _GETITEM)
    if hi_get is None or lo_get is None or hi_get.args[0] is not lo_get.args[0]:
        return None
    x = lo_get.args[0]
    d = x.shape[-1] if isinstance(x, TensorProxy) and x.ndim >= 1 else 0
    if d < 2 or d % 2 or not _is_last_dim(_arg(cat, 1, "dim", 0), x.ndim):
        return None
    s_hi, s_lo = _last_dim_slice(_arg(hi_get, 1, "key"), x.ndim), _last_dim_slice(_arg(lo_get, 1, "key"), x.ndim)
    if s_hi is None or s_lo is None or not _is_half(s_hi, d, "hi") or not _is_half(s_lo, d, "lo"):
        return None
    return x, (hi_get, lo_get, neg, cat)


def _rope_tables(g: _Graph, x: TensorProxy, table: Any) -> tuple | None:
    """`table` is HF's `cos.unsqueeze(1)` (or sin), broadcasting over x's heads: (B or 1, 1, T, D).
    Returns (cos as the helper takes it: (B or 1, T, D), the unsqueeze) or None."""
    unsq = g.producer(table, _UNSQUEEZE)
    if unsq is None or _arg(unsq, 1, "dim") not in (1, -3):
        return None
    src = unsq.args[0]
    if not (isinstance(src, TensorProxy) and x.ndim == 4 and src.ndim == 3):
        return None
    b, _, t, d = x.shape
    if src.shape[0] not in (1, b) or tuple(src.shape[1:]) != (t, d) or src.device != x.device:
        return None
    return src, unsq


def _match_rope_one(g: _Graph, cat: BoundSymbol) -> tuple | None:
    """`x * cos + rotate_half(x) * sin` around one rotate_half: (x, cos, sin, out, bsyms)."""
    rot = _match_rotate(g, cat)
    if rot is None:
        return None
    x, rot_bsyms = rot
    mul_sin = g.only_consumer(cat.output, _MUL)
    if mul_sin is None:
        return None
    sin_u = _other(mul_sin, cat.output)
    add = g.only_consumer(mul_sin.output, _ADD)
    if add is None or _arg(add, 2, "alpha", 1) != 1:
        return None
    c = _other(add, mul_sin.output)
    mul_cos = g.producer(c, _MUL)
    if mul_cos is None:
        return None
    cos_u = _other(mul_cos, x)
    if cos_u is None or cos_u is sin_u:
        return None
    cos, sin = _rope_tables(g, x, cos_u), _rope_tables(g, x, sin_u)
    if cos is None or sin is None or add.output.shape != x.shape:
        return None
    bsyms = (*rot_bsyms, mul_sin, mul_cos, add)
    inner = {id(b) for b in bsyms}
    for b in bsyms[:-1]:
        if not all(id(u) in inner for u in g.consumers(b.output)):
            return None
    return x, cos[0], sin[0], add.output, bsyms


def _match_swiglu(g: _Graph, silu: BoundSymbol) -> Match | None:
    """`silu(gate) * up`, gate and up of one shape and dtype."""
    gate = silu.args[0]
    if _arg(silu, 1, "inplace", False) is not False or not isinstance(gate, TensorProxy):
        return None
    mul = g.only_consumer(silu.output, _MUL)
    if mul is None:
        return None
    up = _other(mul, silu.output)
    if not (isinstance(up, TensorProxy) and up.shape == gate.shape and up.dtype == gate.dtype
            and up.device == gate.device):
        return None
    return Match("swiglu", (gate, up), (mul.output,), (silu, mul))


def _match_repeat_kv(g: _Graph, expand: BoundSymbol) -> Match | None:
    """HF repeat_kv: `x[:, :, None].expand(B, H, n, T, D).reshape(B, H * n, T, D)` (or unsqueeze(2))."""
    e = expand.args[0]
    head = g.producer(e, _GETITEM, _UNSQUEEZE)
    if head is None:
        return None
    x = head.args[0]
    if not (isinstance(x, TensorProxy) and x.ndim == 4):
        return None
    if head.sym.id == _UNSQUEEZE:
        if _arg(head, 1, "dim") not in (2, -3):
            return None
    else:
        key = _arg(head, 1, "key")
        if not (isinstance(key, tuple) and 3 <= len(key) <= 5 and key[2] is None
                and all(_is_full_slice(k) for i, k in enumerate(key) if i != 2)):
            return None
    b, h, t, d = x.shape
    f = expand.output
    if f.ndim != 5 or (f.shape[0], f.shape[1], f.shape[3], f.shape[4]) != (b, h, t, d):
        return None
    n_rep = f.shape[2]
    reshape = g.only_consumer(f, _RESHAPE)
    if reshape is None or tuple(reshape.output.shape) != (b, h * n_rep, t, d) or n_rep < 1:
        return None
    if [id(u) for u in g.consumers(e)] != [id(expand)]:
        return None
    return Match("repeat_kv", (x, n_rep), (reshape.output,), (head, expand, reshape))


def find_llama_patterns(trace: TraceCtx, kinds: Iterable[str] = KINDS) -> list[Match]:
    """Every RMSNorm / RoPE (q and k pairs) / SwiGLU / repeat_kv subgraph in `trace`, in trace order.

    Works on any Thunder trace whose top-level bound symbols are torch-level ops (the computation
    trace as a Transform's `transform_traces_pre_prologue` sees it, or `thunder.last_traces(fn)[0]`),
    on any device: recognising a pattern does not depend on kforge accepting it. Matches never share
    an op. RoPE is matched per q/k pair sharing one cos and one sin table (helper
    `apply_rope(q, k, cos, sin)`); a lone rotated tensor is not reported.
    """
    kinds = tuple(kinds)
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"find_llama_patterns: unknown kinds {sorted(unknown)}; choose from {KINDS}")
    g = _Graph(trace)
    found: list[Match] = []
    ropes: dict[tuple[str, str], list[tuple]] = {}
    for b in g.bsyms:
        sid = b.sym.id
        if sid == _RSQRT and "rms_norm" in kinds:
            m = _match_rms_norm(g, b)
        elif sid == _SILU and "swiglu" in kinds:
            m = _match_swiglu(g, b)
        elif sid == _EXPAND and "repeat_kv" in kinds:
            m = _match_repeat_kv(g, b)
        elif sid == _CAT and "rope" in kinds:
            one = _match_rope_one(g, b)
            if one is not None:
                ropes.setdefault((one[1].name, one[2].name), []).append(one)
            continue
        else:
            continue
        if m is not None:
            found.append(m)
    # Pair rotations that share cos and sin, in trace order: (q, k) of one attention call.
    for group in ropes.values():
        for q, k in zip(group[0::2], group[1::2]):
            xq, xk = q[0], k[0]
            if xq is xk or xq.shape[0] != xk.shape[0] or xq.shape[2:] != xk.shape[2:] or xq.dtype != xk.dtype:
                continue
            found.append(Match("rope", (xq, xk, q[1], q[2]), (q[3], k[3]), q[4] + k[4]))
    found.sort(key=lambda m: max(g.position[id(b)] for b in m.bsyms))
    return found


# ---- the rewrite --------------------------------------------------------------------------------------
def _helper(kind: str) -> Callable:
    module, name = HELPERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def _kforge_replacement(kind: str) -> Callable:
    """The Thunder operator kforge registered for the helper of `kind` (through `replaces=`)."""
    from . import _thunder

    ex = _thunder.get_executor()
    helper = _helper(kind)
    op = ex._lookasides.get(helper)  # what thunder.jit itself calls in place of the helper
    if op is None:
        raise LookupError(f"kforge registers no operator replacing {HELPERS[kind]}")
    return op


def _call_helper(kind: str, fn: Callable, args: tuple) -> tuple:
    out = fn(*args)
    return tuple(out) if kind == "rope" else (out,)


def _claimed(bsyms: Sequence[BoundSymbol]) -> str | None:
    """None when kforge executes every kforge operator among `bsyms`, else kforge's reason."""
    from . import _thunder

    ex = _thunder.get_executor()
    ours = [b for b in bsyms if b.sym.executor is ex]
    if not ours:
        return "the replacement holds no kforge operator"
    for b in ours:
        impl = ex.implmap.get(b.sym.id)
        if impl is None or impl.checker is None:
            continue  # an operator without a checker always runs on kforge
        # The op table wraps each checker (functools.wraps); the original returns the reason.
        check = getattr(impl.checker, "__wrapped__", None)
        if check is not None:
            try:
                reason = check(*b.args, **b.kwargs)
            except Exception as e:
                reason = f"checker error: {type(e).__name__}: {e}"
            if reason is not None:
                return f"kforge declines {b.sym.name}: {reason}"
        elif not impl.checker(*b.args, **b.kwargs):
            return f"kforge declines {b.sym.name}"
    return None


class LlamaPatternTransform(Transform):
    """Replace Llama steps found by `find_llama_patterns` with kforge operators, before autograd.

    Pass it to `thunder.jit(..., transforms=[...])` or `ThunderCompiler(transforms=[...])` together
    with `kforge.executor` first in the executor list (`kforge.transforms.thunderfx` does both).

    kinds:         which patterns to replace (default all of KINDS).
    replacements:  kind -> callable taking the helper's arguments (see `Match.args`) and returning its
                   output(s) in a trace; default kforge's operator for the helper.
    require_claim: rewrite only where kforge's checker accepts the replacement (default), so what
                   kforge declines (CPU tensors, unsupported sizes) keeps its original, fusible ops.

    `self.rewrites` lists every match of the traces seen so far and what became of it.
    """

    def __init__(self, *, kinds: Iterable[str] = KINDS, replacements: Mapping[str, Callable] | None = None,
                 require_claim: bool = True):
        self.kinds = tuple(kinds)
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"LlamaPatternTransform: unknown kinds {sorted(unknown)}; choose from {KINDS}")
        self.replacements = dict(replacements or {})
        self.require_claim = require_claim
        self.rewrites: list[Rewrite] = []

    def __repr__(self) -> str:
        return f"kforge.transforms.LlamaPatternTransform(kinds={self.kinds})"

    def _replacement(self, kind: str) -> Callable:
        if kind not in self.replacements:
            self.replacements[kind] = _kforge_replacement(kind)
        return self.replacements[kind]

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        from . import _thunder

        executors_list = kwargs.get("executors_list")
        if self.require_claim and executors_list is not None and _thunder.get_executor() not in executors_list:
            # Nobody would run kforge's operators: keep the trace (record why, once per trace).
            for m in find_llama_patterns(computation_trace, self.kinds):
                self.rewrites.append(Rewrite(m, "kforge is not in the executor list"))
            return prologue_trace, computation_trace, epilogue_trace
        return prologue_trace, self.rewrite(computation_trace), epilogue_trace

    def rewrite(self, trace: TraceCtx) -> TraceCtx:
        """A copy of `trace` with the accepted matches replaced (`trace` itself when none is);
        every match and its outcome is appended to `self.rewrites`."""
        matches = find_llama_patterns(trace, self.kinds)
        if not matches:
            return trace
        g = _Graph(trace)
        new = from_trace(trace)
        at: dict[int, list[BoundSymbol]] = {}  # position -> bound symbols inserted there
        removed: set[int] = set()
        for m in matches:
            reason = self._place(g, new, m, at, removed)
            self.rewrites.append(Rewrite(m, reason))
        if not removed:
            return trace
        bsyms: list[BoundSymbol] = []
        for i, b in enumerate(g.bsyms):
            if id(b) not in removed:
                bsyms.append(b)
            bsyms.extend(at.get(i, ()))
        new.bound_symbols = bsyms
        n = sum(1 for r in self.rewrites[-len(matches):] if r.applied)
        new.set_provenance(TraceProvenance(f"kforge Llama patterns ({n} of {len(matches)} matches replaced)"))
        return new

    def _place(self, g: _Graph, new: TraceCtx, m: Match, at: dict, removed: set) -> str | None:
        """Trace the replacement of `m` into `new` and schedule it; returns why not, or None."""
        # The replacement goes where the last of its outputs was computed: every input is defined by
        # then, and every reader of an output must come after it.
        where = max(g.position[id(b)] for b in m.bsyms if any(o is b.output for o in m.outputs))
        for o in m.outputs:
            if any(g.position[id(u)] <= where for u in g.consumers(o)):
                return "an output is read before the pattern ends"
        try:
            fn = self._replacement(m.kind)
            new.push_scope([])
            try:
                with tracectx(new):
                    outs = _call_helper(m.kind, fn, m.args)
            finally:
                bsyms = new.pop_scope()
        except Exception as e:  # never break tracing over a pattern: keep the original ops
            return f"replacement failed: {type(e).__name__}: {e}"
        flat, _ = tree_flatten(outs)
        if len(flat) != len(m.outputs):
            return f"replacement returned {len(flat)} outputs, the pattern {len(m.outputs)}"
        for o, r in zip(m.outputs, flat):
            if not (isinstance(r, TensorProxy) and r.shape == o.shape and r.dtype == o.dtype and r.device == o.device):
                return f"replacement output {r} does not match {o.name}: {o.shape} {o.dtype} {o.device}"
        if self.require_claim and (reason := _claimed(bsyms)) is not None:
            return reason
        # The replacement's outputs take the pattern's output names, so every reader is unchanged.
        swap = {variableify(r): o for r, o in zip(flat, m.outputs)}
        at.setdefault(where, []).extend(b.from_bsym_swap_proxies(swap) for b in bsyms)
        removed.update(id(b) for b in m.bsyms)
        return None


# ---- the short user-facing calls ----------------------------------------------------------------------
def executors() -> list:
    """kforge first, then Thunder's default executors."""
    import thunder

    from . import _thunder

    return [_thunder.get_executor(), *thunder.get_default_executors()]


def thunderfx(model: Callable, /, *, transforms: Sequence[Transform] = (), **kwargs: Any):
    """`thunder.dynamo.thunderfx(model)` (torch.compile with Thunder as its backend) with kforge first
    in the executor list and `LlamaPatternTransform` applied to every Thunder subgraph.

    For models `thunder.jit` cannot trace, such as Hugging Face's LlamaForCausalLM. Other keyword
    arguments go to torch.compile / thunder.jit (`executors=` overrides the executor list). The
    result is called like the model and trains the model's own parameters; its `last_traces` /
    `last_backward_traces` list the final Thunder traces of every subgraph, and `llama_patterns` is
    the transform (its `rewrites` say what was replaced, or why not).
    """
    from thunder.dynamo import thunderfx as _thunderfx

    kwargs.setdefault("executors", executors())
    patterns = LlamaPatternTransform()
    compiled = _thunderfx(model, transforms=[patterns, *transforms], **kwargs)
    compiled.llama_patterns = patterns
    return compiled


def jit(fn: Callable, /, *, transforms: Sequence[Transform] = (), **kwargs: Any):
    """`thunder.jit(fn)` with kforge first in the executor list and `LlamaPatternTransform`, for
    models Thunder can trace whose Llama steps are written out in torch ops rather than through
    kforge's helpers. The transform is `fn.llama_patterns`."""
    import thunder

    kwargs.setdefault("executors", executors())
    patterns = LlamaPatternTransform()
    jfn = thunder.jit(fn, transforms=[patterns, *transforms], **kwargs)
    jfn.llama_patterns = patterns
    return jfn
