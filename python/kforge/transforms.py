"""Find the mission's steps in Thunder traces, written as users write them, and hand them to kforge.

Users' models reach Thunder with their steps spelled in torch ops, never as calls of kforge's
helpers: under `thunder.jit` (`kforge.jit`) as the user wrote them, under Thunder's Dynamo path
(`kforge.compile`, for models Thunder's own `thunder.jit` cannot trace, e.g. Hugging Face's
LlamaForCausalLM) decomposed by Dynamo. This module finds those subgraphs in a computation trace,
before autograd, and replaces each with the Thunder operator of the kforge helper that computes the
same thing, so kforge's grad transforms give the backward too. Spellings found (all forward and backward):

  kind            spellings                                                       replaced by
  rms_norm        x [.float()] * rsqrt(mean(x*x or x.pow(2), -1, keepdim) + eps),  kforge.ops.rmsnorm.rms_norm (cast,
                  cast back before (HF, Meta's type_as) or after (litgpt,           then weight); F.rms_norm (weight,
                  weight.float()) the weight, or no casts at all                  then cast)
  rope            rotate-half: x * cos + cat(-x2, x1) * sin, halves by chunk or     kforge.ops.rope.apply_rope (q and k
                  slicing; interleaved pairs: llama2.c's real form (reshape,        in one launch)
                  unbind, four products, stack, flatten) and Meta's complex form
                  (view_as_complex * freqs_cis, view_as_real); (B, H, T, D) or
                  (B, T, H, D) heads; cos / sin (T, D), (1, T, D), (B or 1, 1, T,
                  D) (HF's unsqueeze(1)); fp32 tables on 16-bit q / k (autocast)
                  with the result cast back; partial-rotary code at full width
                  (Phi-3: cat([rotated, x[..., D:]]) of an empty pass-through)
  repeat_kv       repeat_interleave(n, dim=1), HF's x[:, :, None].expand().reshape(), kforge.ops.gqa.repeat_kv
                  Meta's on (B, T, H, D) heads
  swiglu          silu(gate) * up, gate / up from one chunk or two projections    kforge.ops.swiglu.swiglu
  split_qkv       qkv.split(C, 2) (or chunk(3)), each .view(B, T, nh, hs)           kforge.ops.permute.split_qkv
                  .transpose(1, 2) [.contiguous()]                                (views; copies if .contiguous())
  merge_heads     y.transpose(1, 2) [.contiguous()] .view / .reshape(B, T, C)      kforge.ops.permute.merge_heads
  causal_softmax  softmax([scale *] att masked by a causal mask built in the       kforge.ops.softmax.causal_softmax
                  trace: masked_fill(mask, -inf) or + additive mask, from tril /
                  triu of ones / full; F.softmax(..., dtype=float32).to(dtype)
  cross_entropy   F.cross_entropy(logits.float().view(-1, V), targets...)         kforge.ops.cross_entropy.
                  (the upcast folded: no fp32 copy of the logits)                 cross_entropy_upcast
  attention       F.scaled_dot_product_attention(q, k', v'[, mask]): k' and v'      kforge.ops.attention.attention
                  repeat_kv matches of one n_rep read only there (the grouped      (cuDNN on grouped heads,
                  heads go in as they are); a causal mask computed in the trace    is_causal)
                  (Hugging Face's, boolean or additive) becomes is_causal, one
                  that masks nothing (HF's encoders) is dropped
  add_rms_norm    s = x + residual, then F.rms_norm / nn.RMSNorm (or a replaced     kforge.ops.rmsnorm.add_rms_norm
                  rms_norm spelling) of s; s may be read elsewhere                 (one kernel each way)
  gelu            0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))) (HF's    F.gelu(x, approximate="tanh" or
                  NewGELU, minGPT's) or with sqrt(2/pi) * x * (1 + 0.044715 * x*x) "none"), which kforge claims
                  (FastGELU, BLOOM's), and 0.5 * x * (1 + erf(x / sqrt(2))) (BERT's),
                  the 0.5 and the product in any grouping, x**3 as pow or x*x*x    (one fp32 rounding where a 16-bit
                                                                                  spelling rounds each step, as
                                                                                  torch.compile computes it)
  linear_group    two or more F.linear of one input, no bias, each output split     kforge.ops.linear_group.
  (opt-in,        into heads by a view / reshape of its last dim (attention's       linear_group (one GEMM forward,
  OPT_IN_KINDS)   q / k / v projections)                                          two backward)

`find_patterns(trace)` recognises these subgraphs by dataflow (not by position in the trace):
every op, constant, shape and dtype is checked, and every intermediate must feed only the next step
of its pattern, so a near miss (another eps wiring, a reduction over another dim, an intermediate
read elsewhere) is no match and keeps its ops. A spelling that is recognised but that kforge cannot
take (a mask whose contents are unknown at trace time, an fp32 result read as fp32) comes back as a
match with its `problem`; `LlamaPatternTransform` replaces the other matches with kforge's
operators, by default only where kforge's checker accepts them, and records every match with its
outcome in `rewrites` (shown by `kforge.inspect`).

    jmodel = kforge.transforms.jit(model)           # thunder.jit + kforge first + every pattern
    compiled = kforge.transforms.thunderfx(model)   # torch.compile + Thunder + kforge + every pattern
    jmodel.llama_patterns.rewrites                  # what was replaced, or why not

On Thunder's Dynamo path the backend is `KforgeThunderCompiler` (below): Thunder's splitter there sees the
ambient torch.autocast (else a model under autocast with fp32 weights is cut at every attention), and the
values it hands to Inductor pieces arrive in the strides Inductor compiled for.

Written against lightning-thunder 0.2.6, torch 2.11 and transformers 5.17, whose traces are what the
patterns describe; the CPU tests pin them (tests/test_transforms.py, tests/test_llama.py), so a
release that writes these steps differently fails there rather than silently falling back.
"""
from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

import torch
from thunder.core import dtypes
from thunder.core.prims import PrimIDs
from thunder.core.proxies import NumberProxy, Proxy, TensorProxy, variableify
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace, tracectx
from thunder.core.transform_common import Transform

__all__ = [
    "KINDS",
    "STEP_KINDS",
    "OPT_IN_KINDS",
    "ALL_KINDS",
    "HELPERS",
    "Match",
    "Rewrite",
    "find_patterns",
    "find_llama_patterns",
    "LlamaPatternTransform",
    "thunderfx",
    "KforgeThunderCompiler",
    "LayoutBoundary",
    "LayoutCopyWarning",
    "jit",
    "executors",
]

# The Llama steps of Hugging Face's Dynamo traces (the transform's default kinds, `find_llama_patterns`).
KINDS = ("rms_norm", "rope", "swiglu", "repeat_kv")
# The other steps of users' models (GPT-2 / nanoGPT and friends).
STEP_KINDS = ("split_qkv", "merge_heads", "causal_softmax", "cross_entropy", "attention", "add_rms_norm", "gelu")
# Everything: what `jit` and `thunderfx` (so `kforge.jit` / `kforge.compile`) look for.
ALL_KINDS = KINDS + STEP_KINDS
# Rewrites kforge can make but leaves out by default (`kinds=ALL_KINDS + OPT_IN_KINDS` asks for them):
# linear_group made the plain Llama's step no faster and its peak memory 9 % higher on an H200
# (docs/experiments/users-models.md, "One GEMM for q / k / v").
OPT_IN_KINDS = ("linear_group",)
# kind -> "module:function" of the plain-PyTorch helper whose kforge operator replaces the pattern.
HELPERS: dict[str, str] = {
    "rms_norm": "kforge.ops.rmsnorm:rms_norm",
    "rope": "kforge.ops.rope:apply_rope",
    "swiglu": "kforge.ops.swiglu:swiglu",
    "repeat_kv": "kforge.ops.gqa:repeat_kv",
    "split_qkv": "kforge.ops.permute:split_qkv",
    "merge_heads": "kforge.ops.permute:merge_heads",
    "causal_softmax": "kforge.ops.softmax:causal_softmax",
    "cross_entropy": "kforge.ops.cross_entropy:cross_entropy_upcast",
    "attention": "kforge.ops.attention:attention",
    "add_rms_norm": "kforge.ops.rmsnorm:add_rms_norm",
    "gelu": "torch.nn.functional:gelu",  # torch's own, which kforge claims
    "linear_group": "kforge.ops.linear_group:linear_group",
}

# Thunder symbol ids (thunder.torch, thunder.core.prims) of the ops the patterns are made of.
_TO = "torch.Tensor.to"
_TYPE_AS = "torch.Tensor.type_as"
_CONVERT = PrimIDs.CONVERT_ELEMENT_TYPE
_CASTS = (_TO, _TYPE_AS, _CONVERT, "Tensor.bfloat16", "Tensor.half", "torch.Tensor.float", "torch.Tensor.type")
_POW = "torch.pow"
_MEAN = "torch.mean"
_ADD = "torch.add"
_SUB = "torch.sub"
_RSQRT = "torch.rsqrt"
_MUL = "torch.mul"
_TRUE_DIV = "torch.true_divide"
_DIV = "torch.div"
_NEG = "torch.neg"
_GETITEM = "torch.Tensor.__getitem__"
_CAT = "torch.cat"
_STACK = "torch.stack"
_CHUNK = "torch.chunk"
_SPLIT = "torch.split"
_UNBIND = "torch.unbind"
_SILU = "torch.nn.functional.silu"
_TANH = "torch.tanh"
_ERF = "torch.erf"
_UNSQUEEZE = "torch.unsqueeze"
_EXPAND = "torch.Tensor.expand"
_RESHAPE = "torch.reshape"
_VIEW = "torch.Tensor.view"
_FLATTEN = "torch.flatten"
_TRANSPOSE = "torch.transpose"
_PERMUTE = "torch.permute"
_CONTIGUOUS = "torch.Tensor.contiguous"
_REPEAT_INTERLEAVE = "torch.repeat_interleave"
_VIEW_AS_COMPLEX = "torch.view_as_complex"
_VIEW_AS_REAL = "torch.view_as_real"
_SOFTMAX = "torch.softmax"
_MASKED_FILL = "torch.masked_fill"
_CROSS_ENTROPY = "torch.nn.functional.cross_entropy"
_DROPOUT = "torch.nn.functional.dropout"
_SDPA = "torch.nn.functional.scaled_dot_product_attention"
_LINEAR = "torch.nn.functional.linear"
_RMS_NORM = "torch.rms_norm"
_KFORGE_RMS_NORM = "kforge_rms_norm"  # kforge.ops.rmsnorm's operator, put in by an rms_norm match
_KFORGE_REPEAT_KV = "kforge_repeat_kv"  # kforge.ops.gqa's operator, put in by a repeat_kv match
# Data movement that commutes with a dtype cast (exactly, element for element).
_MOVES = (_REPEAT_INTERLEAVE, _TRANSPOSE, _PERMUTE, _RESHAPE, _VIEW, _CONTIGUOUS, _UNSQUEEZE, _EXPAND, _FLATTEN)

_16BIT = (torch.bfloat16, torch.float16)
# A masked score at or below this acts as -inf: exp(v - rowmax) is exactly 0 in fp32 for any
# rowmax above -1e30 + 104.
_MASKED = -1e30
# Longest chain of data-movement ops between an fp32 step and its cast back (_downcast_tail).
_MAX_MOVES = 4
# Largest mask the causal check evaluates at trace time (T x T elements).
_MAX_MASK = 1 << 26
# Rounds of matching: a replacement can expose the next pattern (RoPE's fp32 result cast back after
# repeat_interleave becomes kforge's 16-bit rope, then a 16-bit repeat_interleave for repeat_kv, then
# the attention reading both expansions takes the grouped heads).
_ROUNDS = 4


@dataclass(frozen=True, eq=False)
class Match:
    """One occurrence of a step in a trace.

    kind:    one of ALL_KINDS.
    args:    the pattern's inputs in the helper's argument order: rms_norm (x, weight, eps), rope (q, k,
             cos, sin), swiglu (gate, up), repeat_kv (x, n_rep), split_qkv (qkv, n_head), merge_heads
             (y,), causal_softmax (att, scale), cross_entropy (logits16, target, weight, size_average,
             ignore_index, reduce, reduction, label_smoothing), attention (q, k, v, n_rep), add_rms_norm (x, residual,
             weight, eps), gelu (x,).
    outputs: the proxies the rest of the trace reads (rope: (q_embed, k_embed); split_qkv: (q, k, v);
             add_rms_norm: (s, y)).
    bsyms:   every top-level bound symbol the match replaces.
    kwargs:  keyword arguments of the helper (rope: interleaved; split_qkv: copy; rms_norm:
             cast_before_weight=False for litgpt's / F.rms_norm's order; attention: is_causal, scale,
             dropout_p when not 0;
             add_rms_norm: cast_before_weight; gelu: approximate).
    prep:    when set, turns `args` into the helper's arguments inside the trace (a transpose of
             (B, T, H, D) heads, a table reshape, a flatten of the logits).
    post:    when set, turns the helper's outputs (a tuple) into the pattern's (a transpose back, a
             data movement op that came between the step and its downcast).
    problem: set when the spelling is recognised but not replaceable: why (the match is reported,
             never rewritten).
    early:   place the replacement where the first of `bsyms` was (its inputs are all defined there)
             rather than where the last output was made: linear_group, whose first output is read
             before the last projection runs.
    """

    kind: str
    args: tuple
    outputs: tuple[TensorProxy, ...]
    bsyms: tuple[BoundSymbol, ...]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    prep: Callable[..., tuple] | None = None
    post: Callable[[tuple], tuple] | None = None
    problem: str | None = None
    early: bool = False

    def __repr__(self) -> str:
        def show(a: Any) -> str:
            return a.name if isinstance(a, Proxy) else repr(a)

        extra = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        why = f", problem={self.problem!r}" if self.problem else ""
        return (f"Match({self.kind}({', '.join(map(show, self.args))}{extra}) -> "
                f"{', '.join(o.name for o in self.outputs)}, {len(self.bsyms)} ops{why})")


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
    """Producers and consumers of the proxies of a trace's top-level bound symbols. `prims.shape`
    reads no data: it is not a consumer (a rewrite drops the ones left without their input)."""

    def __init__(self, trace: TraceCtx):
        self.bsyms: list[BoundSymbol] = list(trace.bound_symbols)
        self.values: dict[str, torch.Tensor] = {}  # constants computed by _evaluate, shared by matches
        self.position: dict[int, int] = {id(b): i for i, b in enumerate(self.bsyms)}
        self._producer: dict[str, BoundSymbol] = {}
        self._consumers: dict[str, list[BoundSymbol]] = {}
        for b in self.bsyms:
            args = {variableify(p): p for p in b.flat_proxy_args}
            if b.sym.id != PrimIDs.SHAPE:
                for p in args.values():
                    self._consumers.setdefault(p.name, []).append(b)
            for o in b.flat_proxy_outs:
                # An op that returns one of its inputs does not produce it.
                if variableify(o) not in args:
                    self._producer.setdefault(o.name, b)

    def producer(self, p: Any, *sym_ids: Any) -> BoundSymbol | None:
        """The bound symbol that produced proxy `p`, when its symbol is one of `sym_ids` (any if none)."""
        if not isinstance(p, TensorProxy):
            return None
        b = self._producer.get(p.name)
        return b if b is not None and (not sym_ids or b.sym.id in sym_ids) else None

    def consumers(self, p: Proxy) -> list[BoundSymbol]:
        """Distinct top-level bound symbols reading `p` (the trace's return included)."""
        return self._consumers.get(p.name, [])

    def only_consumer(self, p: Proxy, *sym_ids: Any) -> BoundSymbol | None:
        """The one bound symbol reading `p`, when there is exactly one and its symbol is in `sym_ids`."""
        users = self.consumers(p)
        if len(users) != 1 or users[0].sym.id not in sym_ids:
            return None
        return users[0]

    def closed(self, bsyms: Iterable[BoundSymbol], outputs: Iterable[Proxy]) -> bool:
        """Every value `bsyms` produce, but `outputs`, is read by `bsyms` only: removing them changes
        nothing else."""
        bsyms = list(bsyms)
        inner = {id(b) for b in bsyms}
        keep = {o.name for o in outputs}
        for b in bsyms:
            ins = {p.name for p in b.flat_proxy_args}
            for o in b.flat_proxy_outs:
                if o.name in keep or o.name in ins:
                    continue
                if not all(id(c) in inner for c in self.consumers(o)):
                    return False
        return True


# ---- small predicates on bound symbol arguments -------------------------------------------------------
def _arg(b: BoundSymbol, i: int, name: str, default: Any = None) -> Any:
    """Argument `name` of `b`, passed positionally at index `i` or by keyword."""
    if len(b.args) > i:
        return b.args[i]
    return b.kwargs.get(name, default)


def _const(x: Any) -> bool:
    """A Python number fixed at trace time (a NumberProxy may change between calls)."""
    return isinstance(x, Number) and not isinstance(x, (bool, NumberProxy))


def _int(x: Any) -> bool:
    return _const(x) and isinstance(x, int)


def _torch_dtype(p: TensorProxy) -> torch.dtype:
    return dtypes.to_torch_dtype(p.dtype)


def _norm_dim(dim: Any, ndim: int) -> int | None:
    """`dim` as a non-negative index into `ndim` dims (a 1-tuple is its element), or None."""
    if isinstance(dim, (tuple, list)):
        if len(dim) != 1:
            return None
        dim = dim[0]
    if not _int(dim) or not -ndim <= dim < ndim:
        return None
    return dim % ndim


def _is_last_dim(dim: Any, ndim: int) -> bool:
    return ndim >= 1 and _norm_dim(dim, ndim) == ndim - 1


def _other(b: BoundSymbol, p: Proxy) -> Any:
    """The operand of binary `b` that is not `p` (None unless `p` is exactly one of the two)."""
    a0, a1 = b.args[0], b.args[1]
    if a0 is p and a1 is not p:
        return a1
    if a1 is p and a0 is not p:
        return a0
    return None


def _constant_factor(g: _Graph, p: Any) -> tuple[TensorProxy, float, BoundSymbol] | None:
    """(x, c, op) when `p` is x * c or c * x, or x / k (true division, c = 1 / k), of a tensor x and
    a constant."""
    b = g.producer(p, _MUL, _TRUE_DIV, _DIV)
    if b is None or len(b.args) < 2:
        return None
    if b.sym.id == _MUL:
        for x, k in ((b.args[0], b.args[1]), (b.args[1], b.args[0])):
            if isinstance(x, TensorProxy) and _const(k):
                return x, float(k), b
    elif _arg(b, 2, "rounding_mode") is None and isinstance(b.args[0], TensorProxy) and _const(b.args[1]) \
            and b.args[1] != 0:
        return b.args[0], 1.0 / float(b.args[1]), b
    return None


def _shape(p: TensorProxy) -> tuple[int, ...]:
    return tuple(p.shape)


def _pure_cast(b: BoundSymbol | None) -> bool:
    """`b` changes at most the dtype of its first argument (same shape, same device, no layout)."""
    if b is None or b.sym.id not in _CASTS:
        return False
    src, out = b.args[0] if b.args else None, b.output
    return (isinstance(src, TensorProxy) and isinstance(out, TensorProxy) and _shape(out) == _shape(src)
            and out.device == src.device and b.kwargs.get("memory_format") in (None, torch.preserve_format))


def _cast_src(g: _Graph, p: Any) -> tuple[TensorProxy, BoundSymbol] | None:
    """(source, cast) when `p` is a pure dtype cast of source."""
    b = g.producer(p, *_CASTS)
    return (b.args[0], b) if _pure_cast(b) else None


def _cast_to(g: _Graph, p: Proxy, dtype: torch.dtype) -> BoundSymbol | None:
    """The pure cast of `p` to `dtype` that is `p`'s one reader, or None."""
    b = g.only_consumer(p, *_CASTS)
    return b if _pure_cast(b) and _torch_dtype(b.output) == dtype else None


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


def _swaps_1_2(b: BoundSymbol, ndim: int = 4) -> bool:
    """`b` is transpose(1, 2) (any spelling of those dims) or permute(0, 2, 1, 3) of a 4-D tensor."""
    x = b.args[0] if b.args else None
    if not (isinstance(x, TensorProxy) and x.ndim == ndim == 4):
        return False
    if b.sym.id == _TRANSPOSE:
        d0, d1 = _norm_dim(_arg(b, 1, "dim0"), 4), _norm_dim(_arg(b, 2, "dim1"), 4)
        return {d0, d1} == {1, 2}
    if b.sym.id == _PERMUTE:
        dims = b.args[1:] if len(b.args) > 2 else _arg(b, 1, "dims")
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        return isinstance(dims, (tuple, list)) and [_norm_dim(d, 4) for d in dims] == [0, 2, 1, 3]
    return False


def _transpose12(x: TensorProxy) -> TensorProxy:
    import thunder.torch as ltorch

    return ltorch.transpose(x, 1, 2)


def _rebind(b: BoundSymbol, first: TensorProxy) -> TensorProxy:
    """`b`'s op applied again, to `first` in place of its first argument (inside a trace)."""
    return b.sym(first, *b.args[1:], **b.kwargs)


def _downcast_tail(g: _Graph, out: TensorProxy, dtype: torch.dtype):
    """A step computed in fp32 from 16-bit inputs (autocast: 16-bit q times fp32 tables) whose result
    is only cast back to `dtype`, directly or through a chain of data-movement ops (which commute with
    the cast: HF's repeat_kv expand + reshape, a transpose) and identities (a cast to the dtype it
    already has, dropout with p=0). Returns (bsyms, final output, post: the moves applied again to
    the 16-bit result) or None."""
    chain: list[BoundSymbol] = []
    moves: list[BoundSymbol] = []
    p = out
    for _ in range(_MAX_MOVES + 1):
        c = _cast_to(g, p, dtype)
        if c is not None:
            post = None
            if moves:
                def post(r: TensorProxy, moves=tuple(moves)) -> TensorProxy:
                    for m in moves:
                        r = _rebind(m, r)
                    return r
            return (*chain, c), c.output, post
        m = g.only_consumer(p, *_MOVES, _GETITEM, *_CASTS, _DROPOUT)
        if m is None or m.args[0] is not p or not _moves_only(m):
            return None
        if m.sym.id in _CASTS or m.sym.id == _DROPOUT:
            identity = (_pure_cast(m) and m.output.dtype == p.dtype) if m.sym.id in _CASTS else (
                _const(_arg(m, 1, "p", 0.5)) and _arg(m, 1, "p", 0.5) == 0)
            if not identity:
                return None
        else:
            moves.append(m)
        chain.append(m)
        p = m.output
    return None


def _moves_only(m: BoundSymbol) -> bool:
    """`m` only moves or repeats its first argument's elements: no other tensor argument, and an
    indexing key that only slices / inserts dims (no index tensors)."""
    return not any(isinstance(a, TensorProxy) for a in tree_flatten((m.args[1:], m.kwargs))[0])


# ---- RMSNorm ------------------------------------------------------------------------------------------
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
    if not (isinstance(x32, TensorProxy) and dtypes.is_float_dtype(x32.dtype) and x32.ndim >= 1):
        return None

    # x32 * rsqrt(...): the normalised rows.
    norm = g.only_consumer(rsqrt.output, _MUL)
    if norm is None or _other(norm, rsqrt.output) is not x32:
        return None
    # The input: the source of an upcast to fp32 (the round trip), else x32 itself.
    up = None
    src = _cast_src(g, x32)
    if src is not None and _torch_dtype(x32) == torch.float32 and _torch_dtype(src[0]) != torch.float32:
        x, up = src
    else:
        x = x32
    xdt = _torch_dtype(x)

    # Cast back before the weight (HF, Meta's type_as), or after it (litgpt), or no cast at all.
    h = norm.output
    down_before = down_after = wcast = None
    nxt = g.only_consumer(h, *_CASTS, _MUL)
    if nxt is None:
        return None
    if nxt.sym.id != _MUL:
        if not (_pure_cast(nxt) and _torch_dtype(nxt.output) == xdt):
            return None
        down_before, h = nxt, nxt.output
        scale = g.only_consumer(h, _MUL)
        if scale is None:
            return None
        w = _other(scale, h)
    else:
        scale = nxt
        w = _other(scale, h)
        wsrc = _cast_src(g, w)  # litgpt: weight.float()
        if wsrc is not None and [id(c) for c in g.consumers(w)] == [id(scale)]:
            w, wcast = wsrc
        down_after = _cast_to(g, scale.output, xdt)
        if up is not None and down_after is None:
            return None  # a 16-bit input normalised into an fp32 result: not a norm kforge writes
    if not (isinstance(w, TensorProxy) and w.ndim == 1 and w.shape[0] == x.shape[-1] and w.device == x.device):
        return None

    bsyms = [b for b in (up, pow_, mean, add, rsqrt, norm, down_before, wcast, scale, down_after) if b is not None]
    out = bsyms[-1].output
    if not g.closed(bsyms, (out,)):
        return None
    # Where the cast sits only matters for 16-bit inputs: there the weight multiplies the fp32 rows
    # (F.rms_norm's order) unless the cast came first.
    kwargs = {} if down_before is not None or xdt == torch.float32 else {"cast_before_weight": False}
    return Match("rms_norm", (x, w, eps), (out,), tuple(bsyms), kwargs)


# ---- RoPE ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rotation:
    """One rotated tensor (q or k) before pairing: x, its tables, layout and what to replace."""

    variant: str                 # "half", "pairs" (llama2.c) or "complex" (Meta)
    x: TensorProxy               # the rotated tensor, in the model's dtype
    tables: tuple                # (cos, sin) as found, or (freqs_cis,) for "complex"
    layout: str                  # "bhtd" or "bthd"
    out: TensorProxy             # the pattern's output
    bsyms: tuple
    post: Callable | None        # a data-movement op between the rotation and its downcast
    problem: str | None = None


def _table_layout(x: TensorProxy, t: Any, dc: int) -> str | None:
    """How table `t` broadcasts against x (B, A, C, D): "bhtd" for rows per token along dim 2
    ((T, dc), (1, T, dc), (B or 1, 1, T, dc)), "bthd" along dim 1 ((B or 1, T, 1, dc), (T, 1, dc));
    None for anything else (a table per head, a T that is not x's)."""
    if not (isinstance(t, TensorProxy) and t.device == x.device and 2 <= t.ndim <= 4 and x.ndim == 4):
        return None
    s = (1,) * (4 - t.ndim) + _shape(t)
    if s[3] != dc or s[0] not in (1, x.shape[0]):
        return None
    if s[1] == 1 and s[2] == x.shape[2]:
        return "bhtd"
    if s[2] == 1 and s[1] == x.shape[1]:
        return "bthd"
    return None


def _helper_table(t: TensorProxy, layout: str) -> TensorProxy:
    """Table `t` as apply_rope takes it, (T, dc) or (B or 1, T, dc), inside the trace."""
    import thunder.torch as ltorch

    if t.ndim == 2 or (t.ndim == 3 and layout == "bhtd"):
        return t  # (T, dc), (1, T, dc), or HF's (B, T, dc) from before its unsqueeze(1)
    s = (1,) * (4 - t.ndim) + _shape(t)
    rows = s[2] if layout == "bhtd" else s[1]
    return ltorch.reshape(t, (s[0], rows, s[3]))


def _rope_tail(g: _Graph, x: TensorProxy, out: TensorProxy):
    """(tail bsyms, final output, post, problem) for a rotation's result `out`: nothing when it has
    x's dtype; its cast back when fp32 tables made it fp32."""
    if out.dtype == x.dtype:
        return (), out, None, None
    tail = _downcast_tail(g, out, _torch_dtype(x))
    if tail is None:
        return (), out, None, (f"the rotation of {_torch_dtype(x)} {x.name} by {_torch_dtype(out)} tables is "
                               f"{_torch_dtype(out)} and read as such (kforge's rope returns x's dtype)")
    return tail[0], tail[1], tail[2], None


def _match_rotate_half(g: _Graph, cat: BoundSymbol) -> tuple | None:
    """Anchored at `cat((-x2, x1), -1)`, x1 / x2 the halves of x by slicing or chunk(2, -1):
    (x, bsyms of rotate_half)."""
    tensors = _arg(cat, 0, "tensors")
    if not (isinstance(tensors, (tuple, list)) and len(tensors) == 2):
        return None
    neg_out, lo = tensors
    neg = g.producer(neg_out, _NEG)
    if neg is None:
        return None
    hi = neg.args[0]
    chunk = g.producer(hi, _CHUNK)
    if chunk is not None:
        x = chunk.args[0]
        outs = list(chunk.output) if isinstance(chunk.output, (tuple, list)) else []
        if len(outs) != 2 or outs[0] is not lo or outs[1] is not hi or _arg(chunk, 1, "chunks") != 2:
            return None
        if not (isinstance(x, TensorProxy) and x.ndim >= 1 and _is_last_dim(_arg(chunk, 2, "dim", 0), x.ndim)):
            return None
        d = x.shape[-1]
        if d < 2 or d % 2 or lo.shape[-1] != d // 2:
            return None
        halves: tuple = (chunk,)
    else:
        hi_get, lo_get = g.producer(hi, _GETITEM), g.producer(lo, _GETITEM)
        if hi_get is None or lo_get is None or hi_get.args[0] is not lo_get.args[0]:
            return None
        x = lo_get.args[0]
        d = x.shape[-1] if isinstance(x, TensorProxy) and x.ndim >= 1 else 0
        if d < 2 or d % 2:
            return None
        s_hi = _last_dim_slice(_arg(hi_get, 1, "key"), x.ndim)
        s_lo = _last_dim_slice(_arg(lo_get, 1, "key"), x.ndim)
        if s_hi is None or s_lo is None or not _is_half(s_hi, d, "hi") or not _is_half(s_lo, d, "lo"):
            return None
        halves = (hi_get, lo_get)
    if not _is_last_dim(_arg(cat, 1, "dim", 0), x.ndim):
        return None
    return x, (*halves, neg, cat)


def _match_rope_half(g: _Graph, cat: BoundSymbol) -> _Rotation | None:
    """`x * cos + rotate_half(x) * sin` around one rotate_half."""
    rot = _match_rotate_half(g, cat)
    if rot is None:
        return None
    x, rot_bsyms = rot
    if x.ndim != 4:
        return None
    mul_sin = g.only_consumer(cat.output, _MUL)
    if mul_sin is None:
        return None
    sin_t = _other(mul_sin, cat.output)
    add = g.only_consumer(mul_sin.output, _ADD)
    if add is None or _arg(add, 2, "alpha", 1) != 1:
        return None
    c = _other(add, mul_sin.output)
    mul_cos = g.producer(c, _MUL)
    if mul_cos is None:
        return None
    cos_t = _other(mul_cos, x)
    if cos_t is None or cos_t is sin_t:
        return None
    layout = _table_layout(x, cos_t, x.shape[3])
    if layout is None or _table_layout(x, sin_t, x.shape[3]) != layout or _shape(cos_t) != _shape(sin_t):
        return None
    # HF: cos.unsqueeze(1) of (B or 1, T, D) tables; the rotation takes the 3-D tables themselves.
    tables = []
    for t in (cos_t, sin_t):
        unsq = g.producer(t, _UNSQUEEZE)
        src = unsq.args[0] if unsq is not None else None
        if (unsq is not None and _norm_dim(_arg(unsq, 1, "dim"), 4) == 1 and isinstance(src, TensorProxy)
                and src.ndim == 3 and layout == "bhtd"):
            t = src
        tables.append(t)
    if _shape(add.output) != _shape(x):
        return None
    rotated, passed = add.output, _identity_cat(g, add.output)
    if passed:
        rotated = passed[-1].output
    tail, out, post, problem = _rope_tail(g, x, rotated)
    bsyms = (*rot_bsyms, mul_sin, mul_cos, add, *passed, *tail)
    if not g.closed(bsyms, (out,)):
        return None
    return _Rotation("half", x, tuple(tables), layout, out, bsyms, post, problem)


def _identity_cat(g: _Graph, rotated: TensorProxy) -> tuple:
    """Partial-rotary RoPE with nothing left to pass through (Phi-3, StableLM, GPT-NeoX at full
    rotary_dim): `cat([rotated, x[..., rotary_dim:]], -1)` whose second part is empty. Returns
    (the empty slice's bsym if only the cat reads it, the cat) when the cat is `rotated`'s only
    reader and gives back its shape and dtype, else ()."""
    cat = g.only_consumer(rotated, _CAT)
    if cat is None:
        return ()
    tensors = _arg(cat, 0, "tensors")
    if not (isinstance(tensors, (tuple, list)) and len(tensors) == 2 and tensors[0] is rotated):
        return ()
    empty, out = tensors[1], cat.output
    if not (isinstance(empty, TensorProxy) and empty.ndim == rotated.ndim and empty.shape[-1] == 0
            and _is_last_dim(_arg(cat, 1, "dim", 0), rotated.ndim)
            and _shape(out) == _shape(rotated) and out.dtype == rotated.dtype):
        return ()
    sliced = g.producer(empty, _GETITEM)
    if sliced is not None and all(c is cat for c in g.consumers(empty)):
        return sliced, cat
    return (cat,)


def _pairs_input(g: _Graph, xp: Any) -> tuple[TensorProxy, tuple] | None:
    """`xp` = x[.float()].reshape(..., D / 2, 2) (llama2.c / Meta): (x, bsyms)."""
    r = g.producer(xp, _RESHAPE, _VIEW)
    if r is None:
        return None
    x32 = r.args[0]
    if not (isinstance(x32, TensorProxy) and x32.ndim == 4 and x32.shape[3] % 2 == 0
            and _shape(xp) == (*_shape(x32)[:3], x32.shape[3] // 2, 2)):
        return None
    src = _cast_src(g, x32)
    if src is not None and _torch_dtype(x32) == torch.float32 and _torch_dtype(src[0]) in _16BIT:
        return src[0], (src[1], r)
    if _torch_dtype(x32) != torch.float32:
        return None
    return x32, (r,)


def _flattened(g: _Graph, y: TensorProxy, x: TensorProxy) -> BoundSymbol | None:
    """The one reader of (B, A, C, D / 2, 2) `y` that flattens its last two dims back to x's shape."""
    f = g.only_consumer(y, _FLATTEN, _RESHAPE, _VIEW)
    if f is None or _shape(f.output) != _shape(x):
        return None
    if f.sym.id == _FLATTEN and not (_norm_dim(_arg(f, 1, "start_dim", 0), 5) == 3
                                     and _norm_dim(_arg(f, 2, "end_dim", -1), 5) == 4):
        return None
    return f


def _match_rope_pairs(g: _Graph, stack: BoundSymbol) -> _Rotation | None:
    """llama2.c: (xr, xi) = x.float().reshape(..., D / 2, 2).unbind(-1); stack([xr c - xi s,
    xr s + xi c], -1).flatten(3), cast back to x's dtype."""
    tensors = _arg(stack, 0, "tensors")
    if not (isinstance(tensors, (tuple, list)) and len(tensors) == 2):
        return None
    out_r, out_i = tensors
    if not (isinstance(out_r, TensorProxy) and out_r.ndim == 4
            and _norm_dim(_arg(stack, 1, "dim", 0), 5) == 4):
        return None
    sub, add = g.producer(out_r, _SUB), g.producer(out_i, _ADD)
    if sub is None or add is None or _arg(sub, 2, "alpha", 1) != 1 or _arg(add, 2, "alpha", 1) != 1:
        return None
    m1, m2 = g.producer(sub.args[0], _MUL), g.producer(sub.args[1], _MUL)
    m3, m4 = g.producer(add.args[0], _MUL), g.producer(add.args[1], _MUL)
    if None in (m1, m2, m3, m4):
        return None
    unbind = None
    for a in m1.args:
        u = g.producer(a, _UNBIND)
        if u is not None:
            unbind = u
    if unbind is None or not isinstance(unbind.output, (tuple, list)) or len(unbind.output) != 2:
        return None
    xr, xi = unbind.output
    if _norm_dim(_arg(unbind, 1, "dim", 0), 5) != 4:
        return None
    c, s = _other(m1, xr), _other(m2, xi)
    if c is None or s is None or c is s:
        return None
    # xr s + xi c, in either order of the sum.
    prods = {(id(m.args[0]), id(m.args[1])) for m in (m3, m4)} | {(id(m.args[1]), id(m.args[0])) for m in (m3, m4)}
    if not {(id(xr), id(s)), (id(xi), id(c))} <= prods or m3 is m4:
        return None
    inp = _pairs_input(g, unbind.args[0])
    if inp is None:
        return None
    x, in_bsyms = inp
    dc = x.shape[3] // 2
    layout = _table_layout(x, c, dc)
    if layout is None or _table_layout(x, s, dc) != layout or _shape(c) != _shape(s):
        return None
    f = _flattened(g, stack.output, x)
    if f is None:
        return None
    tail, out, post, problem = _rope_tail(g, x, f.output)
    bsyms = (*in_bsyms, unbind, m1, m2, sub, m3, m4, add, stack, f, *tail)
    if not g.closed(bsyms, (out,)):
        return None
    return _Rotation("pairs", x, (c, s), layout, out, bsyms, post, problem)


def _match_rope_complex(g: _Graph, vr: BoundSymbol) -> _Rotation | None:
    """Meta's reference: view_as_real(view_as_complex(x.float().reshape(..., D / 2, 2)) * freqs_cis)
    .flatten(3), cast back to x's dtype (`type_as`)."""
    prod = g.producer(vr.args[0], _MUL)
    if prod is None:
        return None
    vc = None
    for a in prod.args:
        b = g.producer(a, _VIEW_AS_COMPLEX)
        if b is not None:
            vc = b
    if vc is None:
        return None
    f = _other(prod, vc.output)
    inp = _pairs_input(g, vc.args[0])
    if inp is None or not isinstance(f, TensorProxy):
        return None
    x, in_bsyms = inp
    if f.dtype != dtypes.complex64:
        return None
    layout = _table_layout(x, f, x.shape[3] // 2)
    fl = _flattened(g, vr.output, x)
    if layout is None or fl is None:
        return None
    tail, out, post, problem = _rope_tail(g, x, fl.output)
    bsyms = (*in_bsyms, vc, prod, vr, fl, *tail)
    if not g.closed(bsyms, (out,)):
        return None
    return _Rotation("complex", x, (f,), layout, out, bsyms, post, problem)


def _complex_tables(f: TensorProxy) -> tuple[TensorProxy, TensorProxy]:
    """(cos, sin) = (real, imaginary parts) of freqs_cis, inside the trace."""
    import thunder.torch as ltorch

    fr = ltorch.view_as_real(f)
    return fr[..., 0], fr[..., 1]


def _pair_rotations(rots: list[_Rotation]) -> list[Match]:
    """q / k pairs sharing one set of tables, in trace order (the order the rotations were found)."""
    groups: dict[tuple, list[_Rotation]] = {}
    for r in rots:
        groups.setdefault((r.variant, r.layout, *(t.name for t in r.tables)), []).append(r)
    found = []
    for group in groups.values():
        for q, k in zip(group[0::2], group[1::2]):
            xq, xk = q.x, k.x
            if q.layout == "bthd":
                same = xq.shape[0] == xk.shape[0] and xq.shape[1] == xk.shape[1] and xq.shape[3] == xk.shape[3]
            else:
                same = xq.shape[0] == xk.shape[0] and xq.shape[2:] == xk.shape[2:]
            if xq is xk or not same or xq.dtype != xk.dtype:
                continue
            found.append(_rope_match(q, k))
    return found


def _rope_match(q: _Rotation, k: _Rotation) -> Match:
    interleaved = q.variant != "half"
    layout = q.layout

    def prep(xq, xk, *tables):
        if q.variant == "complex":  # args hold freqs_cis twice
            tables = _complex_tables(tables[0])
        cos, sin = (_helper_table(t, layout) for t in tables)
        if layout == "bthd":
            xq, xk = _transpose12(xq), _transpose12(xk)
        return xq, xk, cos, sin

    def post(outs):
        qo, ko = outs
        if layout == "bthd":
            qo, ko = _transpose12(qo), _transpose12(ko)
        return (q.post(qo) if q.post else qo, k.post(ko) if k.post else ko)

    tables = q.tables if len(q.tables) == 2 else (q.tables[0], q.tables[0])
    needs_prep = layout == "bthd" or q.variant == "complex" or any(
        not (t.ndim == 2 or (t.ndim == 3 and layout == "bhtd")) for t in q.tables)
    return Match("rope", (q.x, k.x, *tables), (q.out, k.out), q.bsyms + k.bsyms,
                 {"interleaved": True} if interleaved else {},
                 prep=prep if needs_prep else None,
                 post=post if (layout == "bthd" or q.post or k.post) else None,
                 problem=q.problem or k.problem)


# ---- SwiGLU -------------------------------------------------------------------------------------------
def _match_swiglu(g: _Graph, silu: BoundSymbol) -> Match | None:
    """`silu(gate) * up`, gate and up of one shape and dtype (two projections, or one chunked)."""
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


# ---- GELU spelled out -----------------------------------------------------------------------------------
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_CUBIC = 0.044715


def _is(v: Any, want: float) -> bool:
    """`v` is the constant `want` (as written in Python source: to float32-ish precision)."""
    return _const(v) and math.isclose(float(v), want, rel_tol=1e-6)


def _scaled_by(g: _Graph, p: Any, c: float) -> tuple[TensorProxy, BoundSymbol] | None:
    """(x, op) when `p` is x scaled by the constant `c` (`_constant_factor`)."""
    f = _constant_factor(g, p)
    return (f[0], f[2]) if f is not None and _is(f[1], c) else None


def _cube_of(g: _Graph, p: Any) -> tuple[TensorProxy, tuple[BoundSymbol, ...]] | None:
    """(x, ops) when `p` is x ** 3 (torch.pow / **) or x * x * x in either grouping."""
    b = g.producer(p, _POW)
    if b is not None and isinstance(b.args[0], TensorProxy) and _is(_arg(b, 1, "exponent"), 3.0):
        return b.args[0], (b,)
    outer = g.producer(p, _MUL)
    if outer is None or len(outer.args) != 2:
        return None
    for sq, x in ((outer.args[0], outer.args[1]), (outer.args[1], outer.args[0])):
        inner = g.producer(sq, _MUL)
        if inner is not None and isinstance(x, TensorProxy) and inner.args[0] is x and inner.args[1] is x:
            return x, (inner, outer)
    return None


def _plus_one(g: _Graph, p: TensorProxy) -> BoundSymbol | None:
    """The one reader of `p` when it is 1 + p or p + 1."""
    add = g.only_consumer(p, _ADD)
    if add is None or _arg(add, 2, "alpha", 1) != 1:
        return None
    return add if _is(_other(add, p), 1.0) else None


def _gelu_tail(g: _Graph, x: TensorProxy, onep: TensorProxy) -> tuple[TensorProxy, tuple] | None:
    """(output, ops) of the final product 0.5 * x * onep, in the groupings people write:
    (0.5 * x) * onep, (x * 0.5) * onep, (x * onep) * 0.5, (0.5 * onep) * x."""
    m = g.only_consumer(onep, _MUL)
    if m is None or len(m.args) != 2:
        return None
    other = _other(m, onep)
    if other is x:
        half = g.only_consumer(m.output, _MUL)
        if half is not None and _is(_other(half, m.output), 0.5):
            return half.output, (m, half)
        return None
    if isinstance(other, TensorProxy):
        h = _scaled_by(g, other, 0.5)
        if h is not None and h[0] is x and h[1].sym.id == _MUL:
            return m.output, (h[1], m)
        return None
    if _is(other, 0.5):
        last = g.only_consumer(m.output, _MUL)
        if last is not None and _other(last, m.output) is x:
            return last.output, (m, last)
    return None


def _gelu_match(g: _Graph, x: TensorProxy, core: tuple, fn: BoundSymbol, approximate: str) -> Match | None:
    onep = _plus_one(g, fn.output)
    tail = _gelu_tail(g, x, onep.output) if onep is not None else None
    if tail is None:
        return None
    out, last = tail
    bsyms = (*core, fn, onep, *last)
    if not all(o.shape == x.shape and o.dtype == x.dtype for b in bsyms for o in b.flat_proxy_outs):
        return None  # a broadcast or a type promotion inside: not gelu of x alone
    if not g.closed(bsyms, (out,)):
        return None
    return Match("gelu", (x,), (out,), bsyms, {"approximate": approximate})


def _square_times(g: _Graph, p: Any, k: float) -> tuple[TensorProxy, tuple[BoundSymbol, ...]] | None:
    """(x, ops) when `p` is k * x * x: (k * x) * x, x * (k * x) or k * (x * x)."""
    outer = g.producer(p, _MUL)
    if outer is None or len(outer.args) != 2:
        return None
    for kx, x in ((outer.args[0], outer.args[1]), (outer.args[1], outer.args[0])):
        s = _scaled_by(g, kx, k) if isinstance(x, TensorProxy) else None
        if s is not None and s[0] is x and s[1].sym.id == _MUL:
            return x, (s[1], outer)
    s = _scaled_by(g, p, k)
    if s is not None and s[1].sym.id == _MUL:
        sq = g.producer(s[0], _MUL)
        if sq is not None and len(sq.args) == 2 and sq.args[0] is sq.args[1]:
            return sq.args[0], (sq, s[1])
    return None


def _gelu_tanh_factored(g: _Graph, arg: Any) -> tuple[TensorProxy, tuple[BoundSymbol, ...]] | None:
    """The tanh argument written c * x * (1 + 0.044715 * x * x) (HF's FastGELU, BLOOM's gelu):
    (c * x) * p or (x * c) * p, p = 1 + 0.044715 * x * x."""
    prod = g.producer(arg, _MUL)
    if prod is None or len(prod.args) != 2:
        return None
    for cx, p in ((prod.args[0], prod.args[1]), (prod.args[1], prod.args[0])):
        scaled = _scaled_by(g, cx, _SQRT_2_OVER_PI)
        add = g.producer(p, _ADD)
        if scaled is None or scaled[1].sym.id != _MUL or add is None or _arg(add, 2, "alpha", 1) != 1:
            continue
        x = scaled[0]
        for one, term in ((add.args[0], add.args[1]), (add.args[1], add.args[0])):
            sq = _square_times(g, term, _GELU_CUBIC) if _is(one, 1.0) else None
            if sq is not None and sq[0] is x:
                return x, (scaled[1], *sq[1], add, prod)
    return None


def _match_gelu_tanh(g: _Graph, tanh: BoundSymbol) -> Match | None:
    """`0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))` (GPT-2's and HF's NewGELU), or
    with the argument factored, `sqrt(2 / pi) * x * (1 + 0.044715 * x * x)` (FastGELU, BLOOM)."""
    factored = _gelu_tanh_factored(g, tanh.args[0])
    if factored is not None:
        return _gelu_match(g, factored[0], factored[1], tanh, "tanh")
    scaled = _scaled_by(g, tanh.args[0], _SQRT_2_OVER_PI)
    if scaled is None:
        return None
    inner, scale = scaled
    add = g.producer(inner, _ADD)
    if add is None or _arg(add, 2, "alpha", 1) != 1:
        return None
    for x, term in ((add.args[0], add.args[1]), (add.args[1], add.args[0])):
        k = _scaled_by(g, term, _GELU_CUBIC) if isinstance(x, TensorProxy) else None
        cube = _cube_of(g, k[0]) if k is not None and k[1].sym.id == _MUL else None
        if cube is not None and cube[0] is x:
            return _gelu_match(g, x, (*cube[1], k[1], add, scale), tanh, "tanh")
    return None


def _match_gelu_erf(g: _Graph, erf: BoundSymbol) -> Match | None:
    """`0.5 * x * (1 + erf(x / sqrt(2)))` (BERT's and HF's Python GELU; x * 0.7071... too)."""
    scaled = _scaled_by(g, erf.args[0], 1.0 / math.sqrt(2.0))
    if scaled is None:
        return None
    x, scale = scaled
    return _gelu_match(g, x, (scale,), erf, "none")


# ---- projections of one input --------------------------------------------------------------------------
def _bias_free_linear(b: BoundSymbol) -> tuple[TensorProxy, TensorProxy] | None:
    """(input, weight) of F.linear without a bias, the weight 2-D, else None."""
    x, w = _arg(b, 0, "input"), _arg(b, 1, "weight")
    if _arg(b, 2, "bias") is not None or not isinstance(x, TensorProxy) or not isinstance(w, TensorProxy):
        return None
    return (x, w) if w.ndim == 2 and x.ndim >= 2 else None


def _split_into_heads(g: _Graph, out: TensorProxy) -> bool:
    """`out`'s one reader is a view / reshape that splits its last dim in two (the heads), which a
    column block of a wider product (rows further apart) allows as a view."""
    user = g.only_consumer(out, _VIEW, _RESHAPE)
    if user is None or not isinstance(user.output, TensorProxy):
        return False
    shape = tuple(user.output.shape)
    lead = tuple(out.shape[:-1])
    return (len(shape) == len(lead) + 2 and shape[:len(lead)] == lead
            and shape[-2] * shape[-1] == out.shape[-1])


def _match_linear_group(g: _Graph, lin: BoundSymbol) -> Match | None:
    """Two or more bias-free F.linear of one input whose outputs are each split into heads (a Llama
    attention's q / k / v projections), matched at the first of them. Outputs read any other way (a
    SwiGLU's gate and up, which kforge's swiglu kernel wants dense) are left alone."""
    parts = _bias_free_linear(lin)
    if parts is None:
        return None
    x = parts[0]
    group, weights = [], []
    for b in g.consumers(x):
        p = _bias_free_linear(b) if b.sym.id == _LINEAR else None
        if (p is None or p[0].name != x.name or not isinstance(b.output, TensorProxy)
                or not _split_into_heads(g, b.output) or p[1].dtype != x.dtype or p[1].device != x.device
                or p[1].shape[1] != x.shape[-1] or any(w.name == p[1].name for w in weights)):
            continue
        group.append(b)
        weights.append(p[1])
    if len(group) < 2 or group[0] is not lin:
        return None
    return Match("linear_group", (x, tuple(weights)), tuple(b.output for b in group), tuple(group), early=True)


# ---- GQA ----------------------------------------------------------------------------------------------
def _heads_dim_match(x: TensorProxy, n: int, d: int, out: TensorProxy, bsyms: tuple) -> Match:
    """repeat_kv of 4-D `x` along dim d (1: (B, H, T, D) heads; 2: Meta's (B, T, H, D), transposed
    for the kernel and back)."""
    if d == 1:
        return Match("repeat_kv", (x, n), (out,), bsyms)
    return Match("repeat_kv", (x, n), (out,), bsyms, prep=lambda x, n: (_transpose12(x), n),
                 post=lambda outs: (_transpose12(outs[0]),))


def _match_repeat_kv(g: _Graph, expand: BoundSymbol) -> Match | None:
    """`x[:, :, None].expand(B, H, n, T, D).reshape(B, H * n, T, D)` (HF, or unsqueeze(2)), and
    Meta's `x[:, :, :, None, :].expand(B, T, H, n, D).reshape(B, T, H * n, D)`."""
    e = expand.args[0]
    head = g.producer(e, _GETITEM, _UNSQUEEZE)
    if head is None:
        return None
    x = head.args[0]
    if not (isinstance(x, TensorProxy) and x.ndim == 4):
        return None
    if head.sym.id == _UNSQUEEZE:
        u = _norm_dim(_arg(head, 1, "dim"), 5)
    else:
        key = _arg(head, 1, "key")
        if not (isinstance(key, tuple) and 3 <= len(key) <= 5):
            return None
        nones = [i for i, k in enumerate(key) if k is None]
        if len(nones) != 1 or not all(_is_full_slice(k) for i, k in enumerate(key) if i != nones[0]):
            return None
        u = nones[0]
    if u not in (2, 3):
        return None
    d = u - 1  # the repeated dim of x
    f = expand.output
    xs = _shape(x)
    if f.ndim != 5 or _shape(f)[:u] + _shape(f)[u + 1:] != xs:
        return None
    n_rep = f.shape[u]
    reshape = g.only_consumer(f, _RESHAPE, _VIEW)
    want = xs[:d] + (xs[d] * n_rep,) + xs[d + 1:]
    if reshape is None or _shape(reshape.output) != want or not _int(n_rep) or n_rep < 1:
        return None
    if [id(c) for c in g.consumers(e)] != [id(expand)]:
        return None
    return _heads_dim_match(x, n_rep, d, reshape.output, (head, expand, reshape))


def _match_repeat_interleave(g: _Graph, ri: BoundSymbol) -> Match | None:
    """`x.repeat_interleave(n, dim=1)` of (B, H, T, D) heads (dim 2: (B, T, H, D) heads)."""
    x, n = ri.args[0], _arg(ri, 1, "repeats")
    if not (isinstance(x, TensorProxy) and x.ndim == 4 and _int(n) and n >= 1):
        return None
    if _arg(ri, 3, "output_size") is not None:
        return None
    d = _norm_dim(_arg(ri, 2, "dim"), 4)
    if d not in (1, 2):
        return None
    return _heads_dim_match(x, n, d, ri.output, (ri,))


# ---- attention head split / merge ---------------------------------------------------------------------
def _match_split_qkv(g: _Graph, split: BoundSymbol) -> Match | None:
    """`q, k, v = qkv.split(C, 2)` (or chunk(3, 2)), each `.view(B, T, nh, hs).transpose(1, 2)`,
    all three or none followed by `.contiguous()`."""
    qkv = split.args[0]
    if not (isinstance(qkv, TensorProxy) and qkv.ndim == 3 and qkv.shape[2] % 3 == 0):
        return None
    B, T, C3 = _shape(qkv)
    C = C3 // 3
    if split.sym.id == _SPLIT:
        size = _arg(split, 1, "split_size_or_sections")
        if not (size == C or (isinstance(size, (tuple, list)) and list(size) == [C, C, C])):
            return None
        if not _is_last_dim(_arg(split, 2, "dim", 0), 3):
            return None
    elif _arg(split, 1, "chunks") != 3 or not _is_last_dim(_arg(split, 2, "dim", 0), 3):
        return None
    parts = list(split.output) if isinstance(split.output, (tuple, list)) else []
    if len(parts) != 3:
        return None
    bsyms, outs, n_heads, copies = [split], [], set(), set()
    for p in parts:
        v = g.only_consumer(p, _VIEW, _RESHAPE)
        if v is None or v.output.ndim != 4 or _shape(v.output)[:2] != (B, T):
            return None
        nh, hs = v.output.shape[2], v.output.shape[3]
        t = g.only_consumer(v.output, _TRANSPOSE, _PERMUTE)
        if t is None or not _swaps_1_2(t) or nh * hs != C:
            return None
        c = g.only_consumer(t.output, _CONTIGUOUS)
        if c is not None and c.kwargs.get("memory_format") not in (None, torch.contiguous_format):
            c = None
        bsyms += [v, t] + ([c] if c is not None else [])
        outs.append(c.output if c is not None else t.output)
        n_heads.add(nh)
        copies.add(c is not None)
    if len(n_heads) != 1 or len(copies) != 1:
        return None
    if not g.closed(bsyms, outs):
        return None
    return Match("split_qkv", (qkv, n_heads.pop()), tuple(outs), tuple(bsyms), {"copy": copies.pop()})


def _match_merge_heads(g: _Graph, tr: BoundSymbol) -> Match | None:
    """`y.transpose(1, 2)[.contiguous()].view(B, T, C)` (or reshape) of (B, nh, T, hs) heads."""
    if not _swaps_1_2(tr):
        return None
    y = tr.args[0]
    B, nh, T, hs = _shape(y)
    bsyms = [tr]
    nxt = g.only_consumer(tr.output, _CONTIGUOUS, _VIEW, _RESHAPE)
    if nxt is not None and nxt.sym.id == _CONTIGUOUS:
        if nxt.kwargs.get("memory_format") not in (None, torch.contiguous_format):
            return None
        bsyms.append(nxt)
        nxt = g.only_consumer(nxt.output, _VIEW, _RESHAPE)
    if nxt is None or _shape(nxt.output) != (B, T, nh * hs):
        return None
    bsyms.append(nxt)
    if not g.closed(bsyms, (nxt.output,)):
        return None
    return Match("merge_heads", (y,), (nxt.output,), tuple(bsyms))


# ---- the residual add before an RMSNorm ---------------------------------------------------------------------
def _match_add_rms_norm(g: _Graph, add: BoundSymbol) -> Match | None:
    """`s = x + residual` (same shape and dtype, alpha 1) normalised by `F.rms_norm` / `nn.RMSNorm`
    over the last dim, or by kforge's rms_norm (an earlier round's replacement of Hugging Face's
    spelling): one kernel writes s and the norm, and the backward adds s's other gradient in the
    norm's backward. s may be read elsewhere too (the next residual add)."""
    x, r = add.args[0], add.args[1]
    if not (isinstance(x, TensorProxy) and isinstance(r, TensorProxy)) or _arg(add, 2, "alpha", 1) != 1:
        return None
    if _shape(x) != _shape(r) or x.dtype != r.dtype or x.ndim < 2:
        return None
    s = add.output
    norms = [b for b in g.consumers(s) if b.sym.id in (_RMS_NORM, _KFORGE_RMS_NORM) and b.args[0] is s]
    if len(norms) != 1:
        return None
    norm = norms[0]
    if norm.sym.id == _RMS_NORM:
        shape, w, eps = _arg(norm, 1, "normalized_shape"), _arg(norm, 2, "weight"), _arg(norm, 3, "eps")
        if not (isinstance(shape, (tuple, list)) and len(shape) == 1 and shape[0] == s.shape[-1]):
            return None
        from .ops.rmsnorm import _f_eps  # thunder.torch.rms_norm's eps=None, as kforge's claim reads it

        eps = _f_eps(eps)
        cast_before_weight = False
    else:
        w, eps, cast_before_weight = _arg(norm, 1, "weight"), _arg(norm, 2, "eps", 1e-6), True
    if not isinstance(eps, Number):
        return None
    bsyms = (add, norm)
    if not g.closed(bsyms, (s, norm.output)):
        return None
    return Match("add_rms_norm", (x, r, w, eps), (s, norm.output), bsyms,
                 {"cast_before_weight": cast_before_weight})


# ---- attention: grouped heads, causal masks --------------------------------------------------------------
def _match_attention(g: _Graph, sdpa: BoundSymbol) -> Match | None:
    """`F.scaled_dot_product_attention(q, k', v', mask)` where k' and v' are kforge repeat_kv
    expansions of one n_rep read only here (an earlier round replaced the user's spelling) and / or
    `mask` is computed in the trace from constants and causal (Hugging Face's, boolean or additive)
    or masks nothing (Hugging Face's encoders): the attention takes the grouped k and v as they are,
    with is_causal=True for a causal mask and no mask for one that masks nothing. Neither: no match
    (kforge claims that SDPA as it is)."""
    q, rk, rv = (_arg(sdpa, i, name) for i, name in enumerate(("query", "key", "value")))
    if not all(isinstance(t, TensorProxy) and t.ndim == 4 for t in (q, rk, rv)):
        return None
    dropout_p = _arg(sdpa, 4, "dropout_p", 0.0)
    if not isinstance(dropout_p, Number) or isinstance(dropout_p, bool):
        return None  # a probability known only at run time: SDPA as it is
    mask, is_causal, scale = _arg(sdpa, 3, "attn_mask"), _arg(sdpa, 5, "is_causal", False), _arg(sdpa, 6, "scale")
    if not isinstance(is_causal, bool) or not (scale is None or isinstance(scale, Number)):
        return None
    problem = None
    if mask is not None:
        if is_causal or not isinstance(mask, TensorProxy):
            return None
        problem = _sdpa_mask_problem(g, mask, q.shape[2], rk.shape[2])
        if problem is _UNKNOWN_MASK:
            return None  # a mask made at run time (an input of this graph): plain SDPA with a mask
        if problem is _MASKS_NOTHING:
            problem = None  # attention without a mask, not causal
        else:
            is_causal = True
    if any(_spelled_expansion(g, t) for t in (rk, rv)):
        return None  # the next round, once kforge's repeat_kv stands there: one rewrite for both
    bsyms: tuple[BoundSymbol, ...] = (sdpa,)
    k, v, n_rep = rk, rv, 1
    expansions = [g.producer(t, _KFORGE_REPEAT_KV) for t in (rk, rv)]
    if all(e is not None for e in expansions) and expansions[0] is not expansions[1]:
        (k, nk), (v, nv) = ((_arg(e, 0, "x"), _arg(e, 1, "n_rep")) for e in expansions)
        if nk == nv and _int(nk) and g.closed((*expansions, sdpa), (sdpa.output,)):
            bsyms, n_rep = (*expansions, sdpa), nk
        else:
            k, v = rk, rv
    if n_rep == 1 and mask is None:
        return None
    kwargs = {"is_causal": is_causal, "scale": scale}
    if dropout_p:
        kwargs["dropout_p"] = float(dropout_p)
    return Match("attention", (q, k, v, n_rep), (sdpa.output,), bsyms, kwargs, problem=problem)


def _spelled_expansion(g: _Graph, t: TensorProxy) -> bool:
    """`t` is a user's repeat_kv spelling that a repeat_kv match replaces this round."""
    b = g.producer(t, _REPEAT_INTERLEAVE, _RESHAPE, _VIEW)
    if b is None:
        return False
    if b.sym.id == _REPEAT_INTERLEAVE:
        m = _guarded(_match_repeat_interleave, g, b)
    else:
        expand = g.producer(b.args[0], _EXPAND)
        m = _guarded(_match_repeat_kv, g, expand) if expand is not None else None
    return m is not None and m.problem is None


_UNKNOWN_MASK = "the attention mask is not known at trace time"
# A mask computed in the trace that masks no entry (all True, or all 0 added): what Hugging Face's
# encoders (ViT, BERT without padding) build when tracing, where eager passes none.
_MASKS_NOTHING = "the attention mask masks nothing"


def _sdpa_mask_problem(g: _Graph, mask: TensorProxy, t: int, tk: int) -> str | None:
    """None when SDPA's `mask` is causal: boolean, True (attend) on and below the diagonal, or
    additive, 0 there and -inf above; _MASKS_NOTHING when it masks no entry; else why not (kforge
    attention then declines the mask), or _UNKNOWN_MASK when the trace does not compute it from
    constants."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # real tensors, even under a tracer's fake-tensor mode
        try:
            m = _evaluate(g, mask, g.values)
        except _NotConstant:
            return _UNKNOWN_MASK
        if bool(m.all()) if m.dtype == torch.bool else (m.is_floating_point() and not m.any()):
            return _MASKS_NOTHING
        if t != tk:
            return f"query and key lengths differ ({t}, {tk})"
        if m.dtype == torch.bool:
            return _causal_mask_problem(~m, t, False, -math.inf)
        return _causal_mask_problem(m, t, True)


# ---- causal softmax -----------------------------------------------------------------------------------
class _NotConstant(Exception):
    """A value the mask check cannot compute at trace time; the message says why."""


def _evaluate(g: _Graph, p: Any, memo: dict, depth: int = 0) -> Any:
    """The value of `p` computed on the CPU from the ops that make it in the trace, when every one of
    them depends on constants only (a mask built with torch.ones / full / arange, tril / triu,
    comparisons, views); raises _NotConstant otherwise."""
    if not isinstance(p, Proxy):
        return p
    if not isinstance(p, TensorProxy):
        raise _NotConstant(f"{p.name} is a number known only at run time")
    if p.name in memo:
        return memo[p.name]
    if depth > 32:
        raise _NotConstant("built by too many ops")
    if p.numel > _MAX_MASK:
        raise _NotConstant(f"{p.name} has {p.numel} elements, too many to check at trace time")
    b = g.producer(p)
    if b is None:
        raise _NotConstant(f"{p.name} is an input of the traced function (a model buffer or argument)")
    fn = _EVAL.get(b.sym.id)
    if fn is None:
        raise _NotConstant(f"{p.name} comes from {b.sym.name}, which the check does not evaluate")

    def ev(a: Any) -> Any:
        if isinstance(a, (tuple, list)):
            return type(a)(ev(v) for v in a)
        return _evaluate(g, a, memo, depth + 1)

    args = [ev(a) for a in b.args]
    kwargs = {k: ev(v) for k, v in b.kwargs.items()}
    outs = list(b.flat_proxy_outs)
    try:
        val = fn(*args, **kwargs)
    except Exception as e:  # an op spelled in a way the table does not cover
        raise _NotConstant(f"{b.sym.name} could not be evaluated ({type(e).__name__})") from None
    if len(outs) != 1 or not isinstance(val, torch.Tensor) or tuple(val.shape) != _shape(p):
        raise _NotConstant(f"{b.sym.name} could not be evaluated")
    val = val.to(_torch_dtype(p))
    memo[p.name] = val
    return val


def _constant(g: _Graph, p: Any, memo: dict) -> Any:
    """`_evaluate` with real tensors even while a tracer's fake-tensor or dispatch mode is active."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _evaluate(g, p, memo)


def _td(dtype: Any) -> torch.dtype | None:
    return None if dtype is None else dtypes.to_torch_dtype(dtype)


def _shape_args(args: tuple) -> tuple:
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list)) else tuple(args)


def _cast_eval(a: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return a  # _evaluate casts every result to its proxy's dtype


# The ops a causal mask is built from, evaluated with torch on the CPU (device arguments dropped).
_EVAL: dict[Any, Callable] = {
    "torch.ones": lambda *s, device=None, dtype=None, **k: torch.ones(_shape_args(s), dtype=_td(dtype)),
    "torch.zeros": lambda *s, device=None, dtype=None, **k: torch.zeros(_shape_args(s), dtype=_td(dtype)),
    "torch.full": lambda shape, fill, *a, device=None, dtype=None, **k: torch.full(tuple(shape), fill,
                                                                                  dtype=_td(dtype)),
    "torch.arange": lambda start, end=None, step=1, *, device=None, dtype=None, **k: (
        torch.arange(start, dtype=_td(dtype)) if end is None else torch.arange(start, end, step, dtype=_td(dtype))),
    "torch.ones_like": lambda a, *x, **k: torch.ones_like(a),
    "torch.zeros_like": lambda a, *x, **k: torch.zeros_like(a),
    "Tensor.new_ones": lambda a, *s, dtype=None, device=None, **k: torch.ones(_shape_args(s),
                                                                              dtype=_td(dtype) or a.dtype),
    "torch.tensor": lambda data, *a, dtype=None, device=None, **k: torch.tensor(data, dtype=_td(dtype)),
    "torch.diff": lambda a, n=1, dim=-1, prepend=None, append=None: torch.diff(a, n, dim, prepend, append),
    "torch.cumsum": lambda a, dim, *, dtype=None: torch.cumsum(a, dim, dtype=_td(dtype)),
    "torch.bitwise_and": torch.bitwise_and, "torch.bitwise_or": torch.bitwise_or,
    "torch.tril": lambda a, diagonal=0, *x, fill_value=None: torch.tril(a, diagonal),
    "torch.triu": lambda a, diagonal=0, *x, fill_value=None: torch.triu(a, diagonal),
    "torch.eq": torch.eq, "torch.ne": torch.ne, "torch.lt": torch.lt, "torch.le": torch.le,
    "torch.gt": torch.gt, "torch.ge": torch.ge,
    "torch.logical_not": torch.logical_not, "torch.bitwise_not": torch.bitwise_not,
    "torch.logical_and": torch.logical_and, "torch.logical_or": torch.logical_or,
    "torch.neg": torch.neg,
    "torch.add": lambda a, b, alpha=1: a + alpha * b if alpha != 1 else a + b,
    "torch.sub": lambda a, b, alpha=1: a - alpha * b if alpha != 1 else a - b,
    "torch.mul": lambda a, b: a * b,
    "torch.where": lambda c, a, b: torch.where(c, a, b),
    "torch.masked_fill": lambda a, m, v: a.masked_fill(m, v),
    _VIEW: lambda a, *s: a.reshape(_shape_args(s)),
    _RESHAPE: lambda a, *s: a.reshape(_shape_args(s)),
    _UNSQUEEZE: lambda a, d: a.unsqueeze(d),
    _EXPAND: lambda a, *s: a.expand(_shape_args(s)),
    _GETITEM: lambda a, key: a[key],
    _CONTIGUOUS: lambda a, **k: a,
    **{c: _cast_eval for c in _CASTS},
}


def _causal_mask_problem(mask: torch.Tensor, t: int, additive: bool, value: Any = None) -> str | None:
    """None when every (t, t) slice of `mask` masks exactly the entries above the diagonal of a
    (t, t) score matrix, else what it does instead."""
    if mask.ndim < 2 or tuple(mask.shape[-2:]) != (t, t):
        return f"the mask has shape {tuple(mask.shape)}, not (..., {t}, {t})"
    m = mask  # every (t, t) slice of it must be the causal mask
    above = torch.ones(t, t, dtype=torch.bool).triu(1).expand(mask.shape)
    if additive:
        if not m.is_floating_point():
            return "the additive mask is not floating point"
        masked = m <= _MASKED
        if not ((m == 0) | masked).all():
            return "the additive mask holds values other than 0 and -inf"
    else:
        if m.dtype != torch.bool:
            return "the masked_fill mask is not boolean"
        masked = m
        if not (_const(value) and value <= _MASKED):
            return f"the masked entries are filled with {value!r}, not -inf"
    if not torch.equal(masked, above):
        return "the mask is not causal (it does not mask exactly the entries above the diagonal)"
    return None


def _scale_of(g: _Graph, s: TensorProxy, consumer: BoundSymbol) -> tuple[TensorProxy, float, tuple]:
    """(unscaled scores, scale, bsyms) for scores `s`: `att * c`, `c * att`, `att / c` with a
    constant c, when `s` feeds only `consumer`; else (s, 1.0, ())."""
    f = _constant_factor(g, s)
    if f is None or [id(c) for c in g.consumers(s)] != [id(consumer)]:
        return s, 1.0, ()
    return f[0], f[1], (f[2],)


def _match_causal_softmax(g: _Graph, sm: BoundSymbol) -> Match | None:
    """`softmax([scale *] att masked causally, -1)`: masked_fill(mask, -inf) or + an additive mask,
    the mask computed in the trace from constants; HF's softmax(..., dtype=float32).to(dtype) too."""
    m = sm.args[0]
    if not (isinstance(m, TensorProxy) and m.ndim >= 2 and _is_last_dim(_arg(sm, 1, "dim"), m.ndim)):
        return None
    t = m.shape[-1]
    if m.shape[-2] != t:
        return None
    fill = g.producer(m, _MASKED_FILL)
    add = g.producer(m, _ADD) if fill is None else None
    memo = g.values  # one mask serves every layer: computed once
    if fill is not None:
        s, mask, value = fill.args[0], fill.args[1], _arg(fill, 2, "value")
        masking = fill
    elif add is not None and _arg(add, 2, "alpha", 1) == 1:
        s = mask = None
        for i in (0, 1):  # the additive mask is the operand computable at trace time
            try:
                _constant(g, add.args[i], memo)
            except _NotConstant:
                continue
            mask, s = add.args[i], add.args[1 - i]
        if mask is None:
            return None  # scores plus a run-time tensor: no telling what it is (plain softmax stays)
        value, masking = None, add
    else:
        return None
    if not (isinstance(s, TensorProxy) and isinstance(mask, TensorProxy)):
        return None
    att, scale, scale_bsyms = _scale_of(g, s, masking)
    bsyms = [*scale_bsyms, masking, sm]
    out = sm.output
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes():  # real tensors, even under a tracer's fake-tensor mode
            problem = _causal_mask_problem(_evaluate(g, mask, memo), t, fill is None, value)
    except _NotConstant as e:
        problem = f"the mask is not known at trace time: {e}; the softmax alone runs on kforge"
    post = None
    if out.dtype != att.dtype:  # softmax(..., dtype=float32), or an fp32 additive mask on 16-bit scores
        tail = _downcast_tail(g, out, _torch_dtype(att))
        if tail is not None:
            bsyms += tail[0]
            out, post = tail[1], tail[2]
        elif problem is None:
            problem = (f"the softmax of {_torch_dtype(att)} scores is {_torch_dtype(out)} and read as such "
                       "(kforge's causal softmax returns the scores' dtype)")
    if not g.closed(bsyms, (out,)):
        return None
    return Match("causal_softmax", (att, scale), (out,), tuple(bsyms), problem=problem,
                 post=(lambda outs, post=post: (post(outs[0]),)) if post is not None else None)


# ---- cross-entropy on upcast logits -------------------------------------------------------------------
def _match_cross_entropy(g: _Graph, ce: BoundSymbol) -> Match | None:
    """`F.cross_entropy(logits16.float().view(-1, V), ...)` (the view before or after the cast, or
    2-D logits without one): the cast is folded into kforge's cross-entropy."""
    a = ce.args[0]
    if not (isinstance(a, TensorProxy) and a.ndim == 2 and _torch_dtype(a) == torch.float32):
        return None
    p, bsyms, cast, view = a, [], None, None
    while True:
        b = g.producer(p)
        if b is not None and cast is None and _pure_cast(b) and _torch_dtype(b.args[0]) in _16BIT:
            cast = b
        elif (b is not None and view is None and b.sym.id in (_VIEW, _RESHAPE) and isinstance(b.args[0], TensorProxy)
              and b.args[0].ndim >= 2 and b.args[0].shape[-1] == a.shape[1]):
            view = b
        else:
            break
        bsyms.insert(0, b)
        p = b.args[0]
    if cast is None:
        return None
    x = p  # the 16-bit logits (N, V) or (..., V)
    if not g.closed((*bsyms, ce), (ce.output,)):
        return None
    args = (x, *ce.args[1:])
    prep = None
    if x.ndim != 2:
        def prep(x, *rest, v=a.shape[1]):
            import thunder.torch as ltorch

            return (ltorch.reshape(x, (-1, v)), *rest)
    return Match("cross_entropy", args, (ce.output,), (*bsyms, ce), dict(ce.kwargs), prep=prep)


# ---- finding them all ---------------------------------------------------------------------------------
_MATCHERS: dict[Any, tuple[str, Callable]] = {
    _RSQRT: ("rms_norm", _match_rms_norm),
    _SILU: ("swiglu", _match_swiglu),
    _EXPAND: ("repeat_kv", _match_repeat_kv),
    _REPEAT_INTERLEAVE: ("repeat_kv", _match_repeat_interleave),
    _SPLIT: ("split_qkv", _match_split_qkv),
    _CHUNK: ("split_qkv", _match_split_qkv),
    _TRANSPOSE: ("merge_heads", _match_merge_heads),
    _PERMUTE: ("merge_heads", _match_merge_heads),
    _SOFTMAX: ("causal_softmax", _match_causal_softmax),
    _CROSS_ENTROPY: ("cross_entropy", _match_cross_entropy),
    _SDPA: ("attention", _match_attention),
    _ADD: ("add_rms_norm", _match_add_rms_norm),
    _TANH: ("gelu", _match_gelu_tanh),
    _ERF: ("gelu", _match_gelu_erf),
    _LINEAR: ("linear_group", _match_linear_group),
}
_ROTATIONS: dict[Any, Callable] = {_CAT: _match_rope_half, _STACK: _match_rope_pairs,
                                   _VIEW_AS_REAL: _match_rope_complex}


def _guarded(matcher: Callable, g: _Graph, b: BoundSymbol) -> Any:
    """A matcher's result; None where it fails on a spelling it did not foresee (never break
    tracing over a pattern: the ops stay as they are)."""
    try:
        return matcher(g, b)
    except Exception:
        return None


def _check_kinds(kinds: Iterable[str], who: str) -> tuple[str, ...]:
    kinds = tuple(kinds)
    unknown = set(kinds) - set(ALL_KINDS + OPT_IN_KINDS)
    if unknown:
        raise ValueError(f"{who}: unknown kinds {sorted(unknown)}; choose from {ALL_KINDS + OPT_IN_KINDS}")
    return kinds


def find_patterns(trace: TraceCtx, kinds: Iterable[str] = ALL_KINDS) -> list[Match]:
    """Every step of `kinds` in `trace`, in trace order, near misses with their `problem` included.

    Works on any Thunder trace whose top-level bound symbols are torch-level ops (the computation
    trace as a Transform's `transform_traces_pre_prologue` sees it, or `thunder.last_traces(fn)[0]`),
    on any device: recognising a pattern does not depend on kforge accepting it. Matches never share
    an op (RoPE wins over repeat_kv where a rotation's downcast follows a repeat_interleave). RoPE is
    matched per q / k pair sharing one cos and one sin table (helper `apply_rope(q, k, cos, sin)`);
    a lone rotated tensor is not reported.
    """
    kinds = _check_kinds(kinds, "find_patterns")
    g = _Graph(trace)
    found: list[Match] = []
    rotations: list[_Rotation] = []
    for b in g.bsyms:
        sid = b.sym.id
        if sid in _ROTATIONS and "rope" in kinds:
            r = _guarded(_ROTATIONS[sid], g, b)
            if r is not None:
                rotations.append(r)
            continue
        kind, matcher = _MATCHERS.get(sid, (None, None))
        if kind in kinds:
            m = _guarded(matcher, g, b)
            if m is not None:
                found.append(m)
    found = _pair_rotations(rotations) + found  # first in line for shared ops
    taken: set[int] = set()
    kept = []
    for m in found:
        ids = {id(b) for b in m.bsyms}
        if ids & taken:
            continue
        taken |= ids
        kept.append(m)
    kept.sort(key=lambda m: max(g.position[id(b)] for b in m.bsyms))
    return kept


def find_llama_patterns(trace: TraceCtx, kinds: Iterable[str] = KINDS) -> list[Match]:
    """The replaceable RMSNorm / RoPE (q and k pairs) / SwiGLU / repeat_kv subgraphs of `trace` (or
    of other `kinds`), in trace order: `find_patterns` without the near misses."""
    kinds = _check_kinds(kinds, "find_llama_patterns")
    return [m for m in find_patterns(trace, kinds) if m.problem is None]


# ---- the rewrite --------------------------------------------------------------------------------------
def _helper(kind: str) -> Callable:
    module, name = HELPERS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def _kforge_replacement(kind: str) -> Callable:
    """The Thunder operator kforge registered for the helper of `kind` (through `replaces=`)."""
    from . import _thunder

    if kind == "gelu":  # kforge claims torch's gelu itself: the replacement is Thunder's symbol for it
        import thunder.torch as ltorch

        return ltorch.gelu
    ex = _thunder.get_executor()
    helper = _helper(kind)
    op = ex._lookasides.get(helper)  # what thunder.jit itself calls in place of the helper
    if op is None:
        raise LookupError(f"kforge registers no operator replacing {HELPERS[kind]}")
    if kind == "rms_norm":
        return _rms_norm_replacement(op)
    return op


def _rms_norm_replacement(op: Callable) -> Callable:
    """HF's order (cast, then weight) runs kforge's rms_norm helper operator; the other order is
    exactly `F.rms_norm`, which kforge claims as it is."""

    def replacement(x: TensorProxy, w: TensorProxy, eps: float, cast_before_weight: bool = True):
        if cast_before_weight:
            return op(x, w, eps)
        import thunder.torch as ltorch

        return ltorch.rms_norm(x, (x.shape[-1],), w, eps)

    return replacement


def _claimed(bsyms: Sequence[BoundSymbol]) -> str | None:
    """None when kforge executes every symbol among `bsyms` it has an implementation for (its own
    operators, or torch symbols it claims such as F.rms_norm), else kforge's reason."""
    from . import _thunder

    ex = _thunder.get_executor()
    checked = False
    for b in bsyms:
        impl = ex.implmap.get(b.sym.id)
        if impl is None:
            continue
        checked = True
        if impl.checker is None:
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
    return None if checked else "the replacement holds no kforge operator"


class LlamaPatternTransform(Transform):
    """Replace the steps `find_patterns` finds with kforge operators, before autograd.

    Pass it to `thunder.jit(..., transforms=[...])` or `ThunderCompiler(transforms=[...])` together
    with `kforge.executor` first in the executor list (`jit` and `thunderfx` below do both, for every
    kind).

    kinds:         which patterns to replace (default the Llama steps, KINDS; ALL_KINDS for all).
    replacements:  kind -> callable taking the helper's arguments (see `Match.args`, `Match.kwargs`)
                   and returning its output(s) in a trace; default kforge's operator for the helper.
    require_claim: rewrite only where kforge's checker accepts the replacement (default), so what
                   kforge declines (CPU tensors, unsupported sizes) keeps its original, fusible ops.

    `self.rewrites` lists every match of the traces seen so far and what became of it.
    """

    def __init__(self, *, kinds: Iterable[str] = KINDS, replacements: Mapping[str, Callable] | None = None,
                 require_claim: bool = True):
        self.kinds = _check_kinds(kinds, "LlamaPatternTransform")
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
            for m in find_patterns(computation_trace, self.kinds):
                self.rewrites.append(Rewrite(m, "kforge is not in the executor list"))
            return prologue_trace, computation_trace, epilogue_trace
        return prologue_trace, self.rewrite(computation_trace), epilogue_trace

    def rewrite(self, trace: TraceCtx) -> TraceCtx:
        """A copy of `trace` with the accepted matches replaced (`trace` itself when none is); every
        match and its outcome is appended to `self.rewrites`. Matching runs again on the result
        while replacements expose new matches (at most a few rounds)."""
        reported: set[frozenset] = set()
        for _ in range(_ROUNDS):
            matches = [m for m in find_patterns(trace, self.kinds) if _key(m) not in reported]
            if not matches:
                break
            reported.update(_key(m) for m in matches)
            new = self._rewrite_once(trace, matches)
            if new is trace:
                break
            trace = new
        return trace

    def _rewrite_once(self, trace: TraceCtx, matches: list[Match]) -> TraceCtx:
        g = _Graph(trace)
        new = from_trace(trace)
        at: dict[int, list[BoundSymbol]] = {}  # position -> bound symbols inserted there
        removed: set[int] = set()
        applied = 0
        for m in matches:
            reason = m.problem or self._place(g, new, m, at, removed)
            self.rewrites.append(Rewrite(m, reason))
            applied += reason is None
        if not removed:
            return trace
        # Values the removed ops made that nothing reads any more; prims.shape of them goes too.
        made = {o.name for inserted in at.values() for b in inserted for o in b.flat_proxy_outs}
        gone = {o.name for b in g.bsyms if id(b) in removed for o in b.flat_proxy_outs} - made
        bsyms: list[BoundSymbol] = []
        for i, b in enumerate(g.bsyms):
            dead_shape = b.sym.id == PrimIDs.SHAPE and any(p.name in gone for p in b.flat_proxy_args)
            if id(b) not in removed and not dead_shape:
                bsyms.append(b)
            bsyms.extend(at.get(i, ()))
        new.bound_symbols = bsyms
        new.set_provenance(TraceProvenance(f"kforge Llama patterns ({applied} of {len(matches)} matches replaced)"))
        return new

    def _place(self, g: _Graph, new: TraceCtx, m: Match, at: dict, removed: set) -> str | None:
        """Trace the replacement of `m` into `new` and schedule it; returns why not, or None."""
        # The replacement goes where the last of its outputs was computed: every input is defined by
        # then, and every reader of an output must come after it.
        outs = {o.name for o in m.outputs}
        if m.early:
            where = min(g.position[id(b)] for b in m.bsyms)
            for a in tree_flatten(m.args)[0]:
                made = g.producer(a)
                if made is not None and g.position[id(made)] >= where:
                    return "an input is computed after the pattern starts"
        else:
            where = max(g.position[id(b)] for b in m.bsyms if any(o.name in outs for o in b.flat_proxy_outs))
        inside = {id(b) for b in m.bsyms}  # an output may feed the pattern's own later ops (add_rms_norm's s)
        for o in m.outputs:
            if any(g.position[id(u)] <= where for u in g.consumers(o) if id(u) not in inside):
                return "an output is read before the pattern ends"
        try:
            fn = self._replacement(m.kind)
            new.push_scope([])
            try:
                with tracectx(new):
                    args = m.prep(*m.args) if m.prep is not None else m.args
                    new.push_scope([])
                    try:
                        out = fn(*args, **m.kwargs)
                    finally:
                        helper_bsyms = new.pop_scope()
                    new.peek_scope().extend(helper_bsyms)
                    out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
                    if m.post is not None:
                        out = tuple(m.post(out))
            finally:
                bsyms = new.pop_scope()
        except Exception as e:  # never break tracing over a pattern: keep the original ops
            return f"replacement failed: {type(e).__name__}: {e}"
        flat, _ = tree_flatten(out)
        if len(flat) != len(m.outputs):
            return f"replacement returned {len(flat)} outputs, the pattern {len(m.outputs)}"
        for o, r in zip(m.outputs, flat):
            if not (isinstance(r, TensorProxy) and r.shape == o.shape and r.dtype == o.dtype and r.device == o.device):
                return f"replacement output {r} does not match {o.name}: {o.shape} {o.dtype} {o.device}"
        if self.require_claim and (reason := _claimed(helper_bsyms)) is not None:
            return reason
        # The replacement's outputs take the pattern's output names, so every reader is unchanged.
        swap = {variableify(r): o for r, o in zip(flat, m.outputs)}
        at.setdefault(where, []).extend(b.from_bsym_swap_proxies(swap) for b in bsyms)
        removed.update(id(b) for b in m.bsyms)
        return None


def _key(m: Match) -> frozenset:
    return frozenset(id(b) for b in m.bsyms)


# ---- Thunder's Dynamo path: the splitter under autocast, layouts where the graph is split ------------
# Thunder's splitter (thunder.dynamo.splitter) hands every FX node it cannot run to Inductor. It decides
# by running the node's Thunder symbol on proxies without the ambient torch.autocast, so under
# `torch.autocast` with fp32 weights a linear of a bf16 activation and an fp32 weight, or SDPA of fp32
# rotated q / k and a bf16 v, fail its check ("Expected a.dtype=bfloat16 and w.dtype=float32") and the
# graph is cut at every attention and at the projections of its bf16 results, although thunder.jit
# applies autocast when it traces the piece. Each cut also exposes memory layouts: Inductor compiles
# its piece for the strides of Dynamo's fake values (eager's layouts; an elementwise op keeps its
# input's layout), while Thunder's proxies carry no strides and its executors (kforge's operators and
# generated kernels, nvFuser) may allocate contiguous outputs; Inductor's stride assertion then fails
# ("expected size 8==8, stride 2048==32 at dim=1"). KforgeThunderCompiler fixes the first and guards
# the second.
def _ambient_autocast() -> tuple[str, torch.dtype] | None:
    """(device, dtype) of the torch.autocast the compile runs under, read as thunder.jit reads it (CUDA
    or CPU, not both), or None."""
    cuda, cpu = torch.is_autocast_enabled("cuda"), torch.is_autocast_enabled("cpu")
    if cuda == cpu:
        return None
    device = "cuda" if cuda else "cpu"
    return device, torch.get_autocast_dtype(device)


@contextlib.contextmanager
def _autocast_compile_data(device: str, dtype: torch.dtype):
    """Compile data created meanwhile by the splitter's node check carries the ambient autocast (as
    thunder.jit's own compile data does when it traces under autocast), so symbols apply their autocast
    rules to the proxies."""
    import thunder.common

    base = thunder.common.CompileData

    class _AutocastCompileData(base):
        def __init__(self, *args: Any, **kw: Any):
            super().__init__(*args, **kw)
            self.autocast_stack.push(device, dtypes.to_dtype(dtype), True)

    thunder.common.CompileData = _AutocastCompileData
    try:
        yield
    finally:
        thunder.common.CompileData = base


# Ops Thunder 0.2.6 runs only through its automatic torch fallback, which the splitter hands to
# Inductor (thunder.dynamo.utils.auto_register_ops). transformers' attention mask is built from
# position ids with two of them (packed-sequence detection: diff, then new_ones for the causal
# base): cut there, Thunder gets the mask as a run-time input of a later piece, and attention cannot
# see that it is causal (an explicit mask: no cuDNN). Tiny index tensors: kept in Thunder.
_FALLBACKS_KEPT = ("diff", "new_ones")


def _kept_fallback(node: Any, thunder_options: dict) -> bool:
    if node.op == "call_method":
        return node.target in _FALLBACKS_KEPT
    if node.op != "call_function":
        return False
    if node.target in tuple(getattr(torch, n, None) for n in _FALLBACKS_KEPT):
        return True
    # A torch function kforge's executor replaces with an operator of its own (torch.addmm, Hugging
    # Face's Conv1D) is not Thunder's automatic fallback where kforge is an executor.
    from ._thunder import executor

    return executor in (thunder_options.get("executors") or ()) and node.target in executor._lookasides


class _Uncheckable(Exception):
    """A node argument whose check result may depend on more than its metadata."""


_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.layout,
                   torch.memory_format, type(Ellipsis))


def _node_check_key(node: Any) -> tuple | None:
    """What Thunder's check of an FX node reads, as a hashable key, or None where it reads more.

    The check (thunder.dynamo.utils.is_node_supported_by_thunder) runs the node's Thunder symbol, and
    its grad transform where an input requires grad, on fresh proxies made from each argument's
    example value: shape, dtype, device and requires_grad (proxies carry no strides), and the constant
    arguments as given. Equal keys get equal verdicts. A model's layers repeat the same nodes, and
    each check traces a vjp: on Hugging Face's 12-layer Llama the splitter's checks were most of the
    first step. Arguments read in other ways (a submodule of a get_attr node, an object without an
    example value such as an autocast context) make the node uncacheable."""

    def value(v: Any) -> tuple:
        if isinstance(v, torch.Tensor):
            return ("T", tuple(dim(d) for d in v.shape), v.dtype, v.device, v.layout, v.requires_grad)
        if isinstance(v, tuple):
            return ("tuple", *map(value, v))
        if isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
            return ("sym", dim(v))
        raise _Uncheckable

    def dim(d: Any) -> Any:
        if isinstance(d, torch.SymInt | torch.SymFloat | torch.SymBool):
            if not d.node.has_hint():
                raise _Uncheckable
            return d.node.hint
        return d

    def arg(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            if a.op == "get_attr" or "example_value" not in a.meta:
                raise _Uncheckable
            return ("node", value(a.meta["example_value"]))
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, *map(arg, a))
        if isinstance(a, dict):
            return ("dict", *((k, arg(v)) for k, v in a.items()))
        if isinstance(a, slice):
            return ("slice", arg(a.start), arg(a.stop), arg(a.step))
        if isinstance(a, _CONSTANT_TYPES):
            return (type(a), a)  # 1, 1.0 and True are different arguments
        raise _Uncheckable

    try:
        key = (node.op, node.target, arg(node.args), arg(dict(node.kwargs)))
        hash(key)
    except (_Uncheckable, TypeError):
        return None
    return key


@contextlib.contextmanager
def _splitter_patches(known: frozenset[str] | None = None, passed: set[str] | None = None):
    """While Thunder's splitter runs: the mask builders in _FALLBACKS_KEPT and the torch functions
    kforge's executor replaces (torch.addmm) stay in Thunder, and under torch.autocast a node its
    check rejects is checked again with the autocast applied, and kept in Thunder when that passes; a
    node whose check would repeat one that passed in this graph (`_node_check_key`) passes without
    running it again (Dynamo compiles one frame at a time; the splitter's module global is restored
    afterwards). `known`: names of nodes that passed in an earlier process (the trace cache's
    verdicts for this very graph), passed without a check; `passed` collects the names of the nodes
    that pass here."""
    import thunder.dynamo.splitter as splitter

    ambient = _ambient_autocast()
    original = splitter.is_node_supported_by_thunder
    supported: set[tuple] = set()  # keys of passed checks; the options and autocast are this graph's

    def verdict(node: Any, thunder_options: dict) -> tuple[bool, Any]:
        if known is not None and node.name in known:
            return True, None
        key = _node_check_key(node)
        if key is not None and key in supported:
            return True, None
        ok, reason = original(node, thunder_options)
        if ok:
            if key is not None:
                supported.add(key)
            return ok, reason
        if _kept_fallback(node, thunder_options):
            return True, None
        if ambient is None:
            return ok, reason
        with _autocast_compile_data(*ambient):
            ok_autocast, _ = original(node, thunder_options)
        if ok_autocast and key is not None:
            supported.add(key)
        return (True, None) if ok_autocast else (ok, reason)

    def is_node_supported_by_thunder(node: Any, thunder_options: dict) -> tuple[bool, Any]:
        ok, reason = verdict(node, thunder_options)
        if ok and passed is not None:
            passed.add(node.name)
        return ok, reason

    splitter.is_node_supported_by_thunder = is_node_supported_by_thunder
    try:
        yield
    finally:
        splitter.is_node_supported_by_thunder = original


class LayoutCopyWarning(UserWarning):
    """kforge.compile copied a value Thunder handed to an Inductor piece into the layout Inductor was
    compiled for (one extra copy per call at that split point)."""


def _overlaps(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a layout may address one element twice (a stride 0, or dims of size > 1 interleaved)."""
    reach = 0  # the largest offset the dims of smaller strides reach
    for st, n in sorted((st, n) for n, st in zip(shape, stride) if n > 1):
        if st <= reach:
            return True
        reach += st * (n - 1)
    return False


@dataclass
class LayoutBoundary:
    """A value a Thunder piece of a split Dynamo graph hands to an Inductor piece, and the strides that
    piece was compiled for (those of Dynamo's fake value: eager's layout). `copies` counts the calls in
    which the value arrived in another layout and was copied into this one."""

    source: str              # "thunder_0 output 2"
    target: str              # "inductor_1 input 0"
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    copies: int = 0

    def __str__(self) -> str:
        return (f"{self.source} -> {self.target}: {str(self.dtype).removeprefix('torch.')}{list(self.shape)} "
                f"strides {self.stride}, copied {self.copies}x")


def _same_strides(t: torch.Tensor, stride: Sequence[int]) -> bool:
    """What Inductor's input assertion checks besides the sizes: the strides of dims of size > 1."""
    return all(n == 1 or a == b for n, a, b in zip(t.shape, t.stride(), stride))


class _ToLayout(torch.nn.Module):
    """Inserted by KforgeThunderCompiler between a Thunder piece's output and an Inductor piece: the
    value itself when its strides are those Inductor was compiled for, else a copy in that layout
    (differentiable; counted, and reported once with a LayoutCopyWarning)."""

    def __init__(self, boundary: LayoutBoundary):
        super().__init__()
        self.boundary = boundary

    def forward(self, t: Any) -> Any:
        b = self.boundary
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != b.shape or _same_strides(t, b.stride):
            return t  # the sizes are Dynamo's to guard; a mismatch there is not ours to hide
        out = torch.empty_strided(b.shape, b.stride, dtype=t.dtype, device=t.device)
        out.copy_(t)
        if b.copies == 0:
            import warnings

            warnings.warn(f"kforge.compile: {b.source} reaches {b.target} with strides {tuple(t.stride())}, where "
                          f"Inductor's piece was compiled for {b.stride} (eager's layout); copied into that "
                          "layout, one copy per call", LayoutCopyWarning, stacklevel=2)
        b.copies += 1
        return out


def _static_ints(values: Iterable[Any]) -> tuple[int, ...] | None:
    out = tuple(values)
    return out if all(isinstance(v, int) and not isinstance(v, bool) for v in out) else None


def _guard_layouts(split_gm: torch.fx.GraphModule) -> list[LayoutBoundary]:
    """Route every value a Thunder piece of `split_gm` (Thunder's split of one Dynamo graph) hands to an
    Inductor piece through a `_ToLayout` of the strides that piece was compiled for (its placeholders'
    fake values). Returns the boundaries."""
    import operator

    boundaries: list[LayoutBoundary] = []
    guards: dict[tuple, torch.fx.Node] = {}

    def thunder_source(a: Any) -> str | None:
        if not isinstance(a, torch.fx.Node):
            return None
        if a.op == "call_module" and str(a.target).startswith("thunder_"):
            return f"{a.target} output"
        if (a.op == "call_function" and a.target is operator.getitem and isinstance(a.args[0], torch.fx.Node)
                and a.args[0].op == "call_module" and str(a.args[0].target).startswith("thunder_")):
            return f"{a.args[0].target} output {a.args[1]}"
        return None

    for node in list(split_gm.graph.nodes):
        if node.op != "call_module" or not str(node.target).startswith("inductor_"):
            continue
        graph = getattr(split_gm.get_submodule(str(node.target)), "graph", None)
        if graph is None:
            continue
        placeholders = [p for p in graph.nodes if p.op == "placeholder"]
        if len(placeholders) != len(node.args) or node.kwargs:
            continue
        new_args = list(node.args)
        for i, (a, ph) in enumerate(zip(node.args, placeholders)):
            source = thunder_source(a)
            fake = ph.meta.get("example_value")
            if source is None or not isinstance(fake, torch.Tensor):
                continue
            shape, stride = _static_ints(fake.shape), _static_ints(fake.stride())
            if shape is None or stride is None or _overlaps(shape, stride):
                continue  # symbolic or overlapping layouts: left as they are
            key = (a.name, stride)
            if key not in guards:
                b = LayoutBoundary(source, f"{node.target} input {i}", shape, stride, fake.dtype)
                name = f"kforge_layout_{len(boundaries)}"
                split_gm.add_submodule(name, _ToLayout(b))
                with split_gm.graph.inserting_before(node):
                    guards[key] = split_gm.graph.call_module(name, (a,))
                boundaries.append(b)
            new_args[i] = guards[key]
        node.args = tuple(new_args)
    if boundaries:
        split_gm.graph.lint()
        split_gm.recompile()
    return boundaries


@contextlib.contextmanager
def _pieces_cached(on: bool):
    """While Thunder's Dynamo backend splits a graph: with `on`, each piece it gives to thunder.jit
    gets kforge's trace cache (`kforge.trace_cache.attach`) before its first call."""
    if not on:
        yield
        return
    import thunder.dynamo.compiler as compiler

    from . import trace_cache

    original = compiler._splitter

    def splitter(gm: Any, thunder_jit: Callable, *args: Any, **kwargs: Any) -> Any:
        return original(gm, lambda piece, **options: trace_cache.attach(thunder_jit(piece, **options)),
                        *args, **kwargs)

    compiler._splitter = splitter
    try:
        yield
    finally:
        compiler._splitter = original


def _compiler_class():
    """KforgeThunderCompiler, made on first use (thunder.dynamo is imported only by the Dynamo path)."""
    global _KforgeThunderCompiler
    if _KforgeThunderCompiler is None:
        from thunder.dynamo import ThunderCompiler

        class KforgeThunderCompiler(ThunderCompiler):
            """Thunder's torch.compile backend (`thunder.dynamo.ThunderCompiler`, the same options), with:

            - the splitter seeing the ambient torch.autocast: a node Thunder's check rejects only because
              it ran without autocast (a bf16 activation times an fp32 weight) stays in Thunder, which
              applies autocast when it traces the piece, so a model under autocast with fp32 weights is
              not cut at every projection and attention;
            - at every remaining cut, each value a Thunder piece hands to an Inductor piece passes a
              check of the strides Inductor compiled that piece for (eager's layouts, from Dynamo's fake
              values): a value in another layout (Thunder's proxies carry no strides; kforge's kernels
              and generated kernels allocate contiguous outputs) is copied into it, counted in
              `layout_boundaries` and reported once with a `LayoutCopyWarning`;
            - with `trace_cache=True`, every Thunder piece keeps its compiled programs on disk
              (`kforge.trace_cache`, keyed by the piece's code and example inputs too), so a second
              process runs Dynamo but not Thunder's tracing.
            """

            def __init__(self, *, trace_cache: bool = False, **thunder_options: Any):
                super().__init__(**thunder_options)
                self.layout_boundaries: list[LayoutBoundary] = []
                self.trace_cache = trace_cache

            def __call__(self, gm: torch.fx.GraphModule, sample_args: list):
                key = known = passed = None
                if self.trace_cache:  # the splitter's verdicts of an earlier process, when kept
                    from . import trace_cache

                    try:
                        key = trace_cache.split_key(gm, self.thunder_options, _ambient_autocast())
                        known, passed = trace_cache.load_split(key), set()
                    except trace_cache.Unserializable:
                        key = None
                with _splitter_patches(known, passed), _pieces_cached(self.trace_cache):
                    split = super().__call__(gm, sample_args)
                if key is not None and known is None:
                    trace_cache.save_split(key, passed)
                self.layout_boundaries += _guard_layouts(split)
                return split

        KforgeThunderCompiler.__module__ = __name__
        KforgeThunderCompiler.__qualname__ = "KforgeThunderCompiler"
        _KforgeThunderCompiler = KforgeThunderCompiler
    return _KforgeThunderCompiler


_KforgeThunderCompiler = None


def __getattr__(name: str) -> Any:
    if name == "KforgeThunderCompiler":
        return _compiler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- the short user-facing calls ----------------------------------------------------------------------
def executors() -> list:
    """`kforge.executors()`: kforge's operators, Thunder's attention executors, kforge's fusion
    executor (unless KFORGE_FUSION=0), then Thunder's other defaults."""
    from .frontend import executors as _executors

    return _executors()


def _install_lookasides() -> None:
    """kforge's lookasides in Thunder's interpreter (`kforge.lookasides`), unless KFORGE_LOOKASIDES
    is off, and transformers' MoE custom op mapped to kforge's grouped product (`kforge.ops.grouped_mm`)."""
    from . import _env, lookasides

    if _env.flag("KFORGE_LOOKASIDES"):
        lookasides.install()
    from .ops import grouped_mm

    grouped_mm.map_custom_ops()  # transformers registers its MoE op when its integration is imported


def thunderfx(model: Callable, /, *, transforms: Sequence[Transform] = (), kinds: Iterable[str] = ALL_KINDS,
              gemm: bool | None = None, trace_cache: bool = False, **kwargs: Any):
    """`thunder.dynamo.thunderfx(model)` (torch.compile with Thunder as its backend) with kforge first
    in the executor list and `LlamaPatternTransform(kinds=kinds)` (every step by default) applied to
    every Thunder subgraph; the backend is `KforgeThunderCompiler` (Thunder's, with the two fixes it
    describes: the splitter sees the ambient torch.autocast, and values Thunder hands to Inductor
    arrive in the layout Inductor was compiled for).

    For models `thunder.jit` cannot trace (Hugging Face's LlamaForCausalLM: kforge.jit traces it too). Other keyword
    arguments go to torch.compile / thunder.jit (`executors=` overrides the executor list). The
    result is called like the model and trains the model's own parameters; its `last_traces` /
    `last_backward_traces` list the final Thunder traces of every subgraph, `llama_patterns` is
    the transform (its `rewrites` say what was replaced, or why not), `backend` the compiler (its
    `subgraph_infos` say how Dynamo's graphs were split and why, its `layout_boundaries` what was
    checked and copied at the splits). `gemm` (default: KFORGE_GEMM): GEMMs on kforge's cuBLASLt plans.
    `trace_cache`: every Thunder piece's programs kept on disk (`kforge.trace_cache`).
    """
    from thunder.dynamo.compiler import ThunderFXCompiledObject
    from thunder.dynamo.utils import get_torch_compile_kwargs

    from .fusion.zero_cotangents import ZeroCotangents
    from .inplace import InPlaceIntermediates
    from .ops.attention import SdpaMaskShape
    from .ops.linear import LinearBiasSplit
    from .prologue import BatchedChecks

    _install_lookasides()
    kwargs.setdefault("executors", executors())
    patterns = LlamaPatternTransform(kinds=kinds)
    kwargs["transforms"] = [InPlaceIntermediates(), patterns, SdpaMaskShape(), LinearBiasSplit(),
                            *_gemm_calls(gemm), *transforms, ZeroCotangents(), BatchedChecks()]
    compile_kwargs = get_torch_compile_kwargs(**kwargs)
    backend = _compiler_class()(trace_cache=trace_cache,
                                **{k: v for k, v in kwargs.items() if k not in compile_kwargs})
    compiled = ThunderFXCompiledObject(backend, torch.compile(model, backend=backend, **compile_kwargs))
    compiled.llama_patterns = patterns
    compiled.backend = backend
    return compiled


def _gemm_calls(on: bool | None = None) -> list:
    """[kforge.ops.gemm.GemmCalls()] when `on` (None: KFORGE_GEMM) is true, else []. It goes before the
    caller's transforms, so that CUDA graphs capture the rewritten calls."""
    from .ops import gemm

    return [gemm.GemmCalls()] if (gemm.enabled() if on is None else on) else []


def jit(fn: Callable, /, *, transforms: Sequence[Transform] = (), kinds: Iterable[str] = ALL_KINDS,
        gemm: bool | None = None, **kwargs: Any):
    """`thunder.jit(fn)` with kforge first in the executor list, `LlamaPatternTransform(kinds=kinds)`
    (every step by default) and the prologue's input checks batched (`kforge.prologue`), for models
    Thunder can trace whose steps are written out in torch ops rather than through kforge's helpers.
    The transform is `fn.llama_patterns`. `gemm` (default: KFORGE_GEMM): GEMMs on kforge's cuBLASLt
    plans (`kforge.ops.gemm`)."""
    import thunder

    from .fusion.zero_cotangents import ZeroCotangents
    from .inplace import InPlaceIntermediates
    from .ops.attention import SdpaMaskShape
    from .ops.linear import LinearBiasSplit
    from .prologue import BatchedChecks

    _install_lookasides()
    kwargs.setdefault("executors", executors())
    patterns = LlamaPatternTransform(kinds=kinds)
    transforms = [InPlaceIntermediates(), patterns, SdpaMaskShape(), LinearBiasSplit(), *_gemm_calls(gemm),
                  *transforms, ZeroCotangents(), BatchedChecks()]
    jfn = thunder.jit(fn, transforms=transforms, **kwargs)
    jfn.llama_patterns = patterns
    return jfn
