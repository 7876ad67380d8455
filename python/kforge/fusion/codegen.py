"""CUDA source for a region (`ir.RegionIR`), one variant per input layout.

Two schedules:

- pointwise: every output has the same number of elements; thread t handles runs of VEC consecutive
  elements of the outputs' linear order (a grid-stride loop). Each output's coordinates come from the
  linear index; every value is computed at the coordinates its consumer asks for, through the views
  between them (broadcast, transpose, reshape, slice, cat, pad, ...), so views cost index math and no
  memory traffic. Inputs whose element run is contiguous and aligned are read in 16-byte accesses.
- reduction: every reduction of the region reduces the same input shape over the same dims. Values
  before the reductions ("pre") are evaluated per input element, those after ("post") once per output
  element. "inner" when the last dim is reduced (a warp or a block per output row, lanes striding over
  the row), "outer" when it is kept (a thread per output element, looping over the reduced
  elements). When there are too few rows to fill the GPU, the reduced elements are split over
  grid.y and a second kernel combines the partial results in a fixed order (deterministic).

Index math uses `idx_t` (32-bit where every offset fits, else 64-bit). Shapes are compile-time
constants; strides are constants for contiguous inputs and kernel arguments for strided ones.
"""
from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass, field
from numbers import Number
from typing import Any, Sequence

from .ir import FLOATS, DTYPE_BYTES, RegionIR, Unsupported, Value, numel

__all__ = ["KernelSource", "Schedule", "schedule", "generate", "contiguous_strides"]

CTYPE = {"f32": "float", "bf16": "bf16", "f16": "half", "bool": "bool", "i32": "int", "i64": "long long"}
INT32_MAX = 2**31 - 1


def rtype(dtype: str) -> str:
    """The register type a value of `dtype` is computed in."""
    if dtype in FLOATS:
        return "float"
    if dtype == "bool":
        return "bool"
    return "long long"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(out))


def squeezed(shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s for s in shape if s != 1)


def float_literal(x: float) -> str:
    """An fp32 literal that rounds exactly as torch rounds a Python scalar into an fp32 op."""
    if math.isnan(x):
        return "__int_as_float(0x7fc00000)"
    if math.isinf(x):
        return "KF_INF" if x > 0 else "(-KF_INF)"
    f = struct.unpack("f", struct.pack("f", x))[0] if abs(x) < 3.4028235e38 else x
    if math.isinf(f) or abs(x) >= 3.4028235e38 * (1 + 2**-24):
        return "KF_INF" if x > 0 else "(-KF_INF)"
    s = repr(float(struct.unpack("f", struct.pack("f", f))[0]))
    if "e" not in s and "." not in s:
        s += ".0"
    return f"{s}f"


def literal(x: Number, dtype: str) -> str:
    if dtype in FLOATS:
        return float_literal(float(x))
    if dtype == "bool":
        return "true" if x else "false"
    return f"{int(x)}LL"


# ---- coordinates ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Idx:
    """One coordinate as C text. `t` is its value in lane v of a run, `t0` in lane 0. kind: "const"
    (the same in every lane), "lane" (lane 0's value plus v, and lane 0's value a multiple of VEC when
    `aligned`), "other"."""

    t: str
    t0: str
    kind: str = "const"
    aligned: bool = False
    # Set by `unravel`: (lin.t, lin.t0, stride, size, outermost) of the linear index this coordinate
    # was taken from, so `_folded_prefix` can fold an unravel-ravel round trip back into `lin`.
    origin: tuple | None = None

    @staticmethod
    def const(text: str) -> "Idx":
        return Idx(text, text, "const")


ZERO = Idx.const("0")


def _add_const(c: Idx, k: int, vec: int) -> Idx:
    if k == 0:
        return c
    op = "+" if k > 0 else "-"
    return Idx(f"({c.t} {op} {abs(k)})", f"({c.t0} {op} {abs(k)})", c.kind, c.aligned and k % vec == 0)


def _mul_const(c: Idx, k: int) -> Idx:
    if k == 1:
        return c
    if k == 0:
        return ZERO
    return Idx(f"({c.t} * {k})", f"({c.t0} * {k})", "const" if c.kind == "const" else "other")


def _clamp(c: Idx, hi: int) -> Idx:
    """min(max(c, 0), hi): keeps the loads of an unselected cat / pad branch inside the tensor."""
    if hi <= 0:
        return ZERO
    return Idx(f"kf_clampi({c.t}, {hi})", f"kf_clampi({c.t0}, {hi})", "const" if c.kind == "const" else "other")


def _clamp_into(c: Idx, size: int, vec: int) -> Idx:
    """`c` moved into [0, size): the loads of an unselected cat / pad branch stay inside the tensor.
    An aligned lane coordinate is clamped per run (lane 0 into [0, size - vec]), which keeps the run
    whole and its loads vectorisable; the selected branch is never changed by the clamp."""
    if c.kind == "lane" and c.aligned and size % vec == 0 and size >= vec:
        t0 = f"kf_clampi({c.t0}, {size - vec})"
        return Idx(f"({t0} + v)", t0, "lane", True)
    return _clamp(c, size - 1)


def unravel(lin: Idx, shape: Sequence[int], vec: int) -> list[Idx]:
    """Coordinates of linear index `lin` in `shape` (size-1 dims get 0, so equal squeezed shapes give
    the same texts). `lin` is lane 0 of an aligned run when kind is "lane"."""
    out = []
    strides = contiguous_strides(shape)
    nz = [i for i, s in enumerate(shape) if s != 1]
    for i, s in enumerate(shape):
        if s == 1:
            out.append(ZERO)
            continue
        st = strides[i]
        first = i == nz[0]
        t, t0 = lin.t, lin.t0
        if st != 1:
            t, t0 = f"({t} / {st})", f"({t0} / {st})"
        if not first:
            t, t0 = f"({t} % {s})", f"({t0} % {s})"
        if lin.kind == "const":
            kind, aligned = "const", False
        elif lin.kind == "lane" and lin.aligned:
            if st == 1 and s % vec == 0:
                kind, aligned = "lane", True
            elif st % vec == 0:
                kind, aligned = "const", False
            else:
                kind, aligned = "other", False
        else:
            kind, aligned = "other", False
        out.append(Idx(t, t0, kind, aligned, (lin.t, lin.t0, st, s, first)))
    return out


def _folded_prefix(coords: Sequence[Idx], shape: Sequence[int], strides: Sequence[int]) -> tuple[Idx, int] | None:
    """The leading coordinates of a contiguous `shape` that are the leading coordinates of one
    `unravel(lin, ...)` with the same strides, summed as one term: sum c_i * st_i over dims 0..k is
    (lin / st_k) * st_k (lin itself when they are every coordinate). (term, dims consumed) or None.
    Saves the division / modulo chains a same-shape load or store would otherwise spell out."""
    dims = [i for i, s in enumerate(shape) if s != 1]
    if not dims:
        return None
    first = coords[dims[0]].origin
    if first is None or not first[4]:
        return None
    last = None
    for i in dims:
        o = coords[i].origin
        if o is None or o[:2] != first[:2] or o[2] != strides[i] or o[3] != shape[i]:
            break
        last = i
    if last is None:
        return None
    lt, lt0, st = first[0], first[1], strides[last]
    if last == dims[-1] and st == 1:
        return Idx(lt, lt0, coords[last].kind, coords[last].aligned), len(shape)
    c = coords[last]
    # The prefix term is constant along a run when the last folded dim's stride is a multiple of the
    # run (its coordinate was "const" in the run for the same reason).
    kind = "const" if c.kind == "const" else "other"
    return Idx(f"(({lt} / {st}) * {st})", f"(({lt0} / {st}) * {st})", kind), last + 1


def ravel(coords: Sequence[Idx], shape: Sequence[int], vec: int) -> Idx:
    """Linear index of `coords` in `shape`."""
    strides = contiguous_strides(shape)
    terms_t, terms_t0, kinds = [], [], []
    lane_unit = None
    start = 0
    folded = _folded_prefix(coords, shape, strides)
    if folded is not None:
        term, start = folded
        if start == len(shape):
            return term
        terms_t.append(term.t)
        terms_t0.append(term.t0)
        kinds.append(term.kind)
    for c, s, st in zip(coords[start:], shape[start:], strides[start:]):
        if s == 1 or c.t == "0":
            continue
        terms_t.append(c.t if st == 1 else f"{c.t} * {st}")
        terms_t0.append(c.t0 if st == 1 else f"{c.t0} * {st}")
        if c.kind == "lane":
            lane_unit = (st, c.aligned)
        kinds.append(c.kind if c.kind != "lane" or st == 1 else "other")
    if not terms_t:
        return ZERO
    t, t0 = "(" + " + ".join(terms_t) + ")", "(" + " + ".join(terms_t0) + ")"
    if "other" in kinds:
        return Idx(t, t0, "other")
    if lane_unit is None:
        return Idx(t, t0, "const")
    # One lane coordinate with stride 1; the others' strides are multiples of the lane dim's size.
    return Idx(t, t0, "lane", lane_unit[1])


# ---- schedule ---------------------------------------------------------------------------------------
@dataclass
class Schedule:
    """What kernel(s) a region becomes (independent of the input layout)."""

    kind: str                      # "pointwise" or "reduce"
    domain: tuple[int, ...]        # pointwise: the first output's shape; reduce: the reduction input shape
    rdims: tuple[int, ...] = ()    # reduce: reduced dims
    pre: set = field(default_factory=set)   # reduce: ids of values computed per input element
    numel: int = 0                 # pointwise: elements per output; reduce: numel(domain)

    @property
    def kept(self) -> tuple[int, ...]:
        return tuple(s for i, s in enumerate(self.domain) if i not in self.rdims)

    @property
    def reduced(self) -> tuple[int, ...]:
        return tuple(s for i, s in enumerate(self.domain) if i in self.rdims)

    @property
    def inner(self) -> bool:
        return (len(self.domain) - 1) in self.rdims


def schedule(ir: RegionIR) -> Schedule:
    """How `ir` is computed, or Unsupported with the reason it cannot be one kernel (pair).
    "passthrough": every output is one of the region's inputs, nothing to launch."""
    if not ir.outputs:
        raise Unsupported("region has no outputs")
    ir = ir.for_kernel()
    if not ir.outputs:
        return Schedule("passthrough", ())
    reds = ir.reductions
    if not reds:
        n = ir.outputs[0].numel
        for o in ir.outputs:
            if o.numel != n:
                raise Unsupported(f"outputs of {n} and {o.numel} elements in one pointwise region")
        return Schedule("pointwise", ir.outputs[0].shape, numel=n)
    src = reds[0].args[0]
    shape, dims = src.shape, reds[0].attrs["dims"]
    for r in reds:
        if r.args[0].shape != shape or r.attrs["dims"] != dims:
            raise Unsupported("reductions of different shapes or dims in one region")
    # pre: values no reduction feeds
    post: set[int] = set()
    for v in ir.values:
        if v.op == "reduce" or any(isinstance(a, Value) and a.id in post for a in v.args):
            post.add(v.id)
    for r in reds:
        if r.args[0].id in post:
            raise Unsupported("a reduction reads another reduction's result (normalisation pattern)")
    pre = {v.id for v in ir.values if v.id not in post}
    n_in = numel(shape)
    for o in ir.outputs:
        if o.id in post:
            if squeezed(o.shape) != squeezed(reds[0].shape):
                raise Unsupported(f"post-reduction output {o.dtype}{list(o.shape)} is not of the reduced shape "
                                  f"{list(reds[0].shape)}")
        elif squeezed(o.shape) != squeezed(shape) and numel(o.shape) != n_in:
            # (an output of the input's size in another shape is a row-major reshape of it: HF's Conv1D
            # gradient is summed over its (B*T, C) view while the (B, T, C) value goes on)
            raise Unsupported(f"output {o.dtype}{list(o.shape)} is neither of the reduction's input shape "
                              f"{list(shape)} nor of its result")
    return Schedule("reduce", shape, tuple(dims), pre, n_in)


# ---- source generation ------------------------------------------------------------------------------
@dataclass
class KernelSource:
    """A variant: its CUDA source, program name (content hash), launches
    [(kernel name, grid, block, dynamic smem)] and workspace bytes."""

    source: str
    program: str
    launches: list
    workspace: int
    vec: int
    index_bits: int

    def to_spec(self) -> dict:
        return {"source": self.source, "program": self.program, "launches": self.launches,
                "workspace": self.workspace}


class _Emitter:
    """Emits C for values at coordinates, memoised by (value, coordinate texts)."""

    def __init__(self, ir: RegionIR, layout: dict[int, str], vec: int, lane_var: str = "v"):
        self.ir = ir
        self.layout = layout      # input arg index -> "ca" / "cu" / "sa" / "su"
        self.vec = vec
        self.lines: list[str] = []      # the per-lane body (inside the unrolled lane loop)
        self.hoisted: list[str] = []    # before the lane loop (vector loads)
        self.memo: dict[tuple, str] = {}
        self.hmemo: dict[tuple, str] = {}
        self.n = 0
        self.reduce_exprs: dict[int, str] = {}   # post context: reduce value id -> its result expression
        self.reduce_coords: tuple[str, ...] | None = None
        self.reduce_shape: tuple[int, ...] = ()

    def tmp(self, prefix: str = "t") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def emit(self, v: Value, coords: Sequence[Idx]) -> str:
        key = (v.id, tuple(c.t for c in coords))
        hit = self.memo.get(key)
        if hit is not None:
            return hit
        expr = self._value(v, list(coords))
        if v.op in ("const", "scalar"):
            self.memo[key] = expr
            return expr
        name = self.tmp()
        self.lines.append(f"const {rtype(v.dtype)} {name} = {expr};")
        self.memo[key] = name
        return name

    # -- loads ------------------------------------------------------------------------------------------
    def _offset(self, v: Value, coords: Sequence[Idx], lane0: bool) -> str:
        idx = v.attrs["index"]
        contiguous = self.layout[idx][0] == "c"
        strides = contiguous_strides(v.shape) if contiguous else [f"st{idx}_{d}" for d in range(v.ndim)]
        terms = []
        start = 0
        folded = _folded_prefix(coords, v.shape, strides) if contiguous else None
        if folded is not None:
            term, start = folded
            terms.append(term.t0 if lane0 else term.t)
        for c, s, st in zip(coords[start:], v.shape[start:], strides[start:]):
            t = c.t0 if lane0 else c.t
            if s == 1 or t == "0":
                continue
            terms.append(t if st == 1 else f"(idx_t){t} * {st}" if isinstance(st, int) else f"(idx_t){t} * ({st})")
        return " + ".join(terms) if terms else "0"

    def _load(self, v: Value, coords: Sequence[Idx]) -> str:
        idx = v.attrs["index"]
        lay = self.layout[idx]
        ptr = f"in{idx}"
        if self.vec > 1 and lay == "ca" and v.ndim >= 1 and v.shape[-1] % self.vec == 0:
            last = coords[-1]
            if last.kind == "lane" and last.aligned and all(c.kind == "const" for c in coords[:-1]):
                off0 = self._offset(v, coords, lane0=True)
                key = (v.id, off0)
                run = self.hmemo.get(key)
                if run is None:
                    run = self.tmp("r")
                    self.hmemo[key] = run
                    self.hoisted.append(f"const KfRun<{CTYPE[v.dtype]}, {self.vec}> {run} = "
                                        f"kf_load_run<{CTYPE[v.dtype]}, {self.vec}>({ptr} + {off0});")
                return f"kf_elem({run}.v[v])"
        return f"kf_load({ptr} + {self._offset(v, coords, lane0=False)})"

    # -- values -----------------------------------------------------------------------------------------
    def _num(self, x: Any, dtype: str) -> str:
        if isinstance(x, Value):
            return self.emit(x, ())  # scalars and consts
        return literal(x, dtype)

    def _operand(self, a: Any, coords: Sequence[Idx], compute: str) -> str:
        """Operand `a` as a register value of the computation dtype `compute` ("float", "long long",
        "bool")."""
        if isinstance(a, Value):
            e = self.emit(a, () if a.op in ("scalar", "const") else coords)
            have = rtype(a.dtype)
            if have == compute:
                return e
            if compute == "bool":
                return f"({e} != 0)"
            return f"(({compute})({e}))"
        if compute == "float":
            return float_literal(float(a))
        if compute == "bool":
            return "true" if a else "false"
        return f"{int(a)}LL"

    def _value(self, v: Value, coords: list[Idx]) -> str:
        op = v.op
        if op == "input":
            return self._load(v, coords)
        if op == "scalar":
            return f"sc{v.attrs['index']}"
        if op == "const":
            return literal(v.attrs["value"], v.dtype)
        if op == "full":
            if v.args:
                return self._operand(v.args[0], (), rtype(v.dtype))
            return literal(v.attrs["value"], v.dtype)
        if op == "iota":
            start, step = v.attrs["start"], v.attrs["step"]
            c = coords[0].t if coords else "0"
            if rtype(v.dtype) == "float":
                return f"({float_literal(float(start))} + (float)({c}) * {float_literal(float(step))})"
            return f"((long long){int(start)} + (long long)({c}) * {int(step)})"
        if op == "convert":
            return self._convert(v, coords)
        if op == "reduce":
            return self._reduce_ref(v, coords)
        if op in _VIEW_HANDLERS:
            a = v.args[0]
            return self.emit(a, _VIEW_HANDLERS[op](self, v, coords))
        if op == "cat":
            return self._cat(v, coords)
        if op == "pad":
            return self._pad(v, coords)
        return self._elementwise(v, coords)

    def _convert(self, v: Value, coords: list[Idx]) -> str:
        a = v.args[0]
        e = self.emit(a, coords)
        src, dst = rtype(a.dtype), rtype(v.dtype)
        if dst == "float":
            e = e if src == "float" else f"(float)({e})"
            return e if v.dtype == "f32" or _exact_in(a, v.dtype) else f"kf_round<{CTYPE[v.dtype]}>({e})"
        if dst == "bool":
            return f"({e} != 0)" if src != "bool" else e
        if src == "float":
            e = f"(long long)({e})"
        elif src == "bool":
            e = f"(long long)({e})"
        return f"(long long)(int)({e})" if v.dtype == "i32" else e

    def _elementwise(self, v: Value, coords: list[Idx]) -> str:
        op = v.op
        out_r = rtype(v.dtype)
        if op in ("eq", "ne", "lt", "le", "gt", "ge"):
            kinds = {rtype(a.dtype) for a in v.args if isinstance(a, Value)}
            compute = "float" if "float" in kinds else ("long long" if "long long" in kinds else "bool")
            if compute == "bool" and any(not isinstance(a, Value) and not isinstance(a, bool) for a in v.args):
                compute = "long long"
        elif op == "where":
            compute = out_r
        elif op in ("signbit", "isfinite"):
            compute = "float" if rtype(v.args[0].dtype) == "float" else rtype(v.args[0].dtype)
        else:
            compute = out_r
        if op == "where":
            p = self._operand(v.args[0], coords, "bool")
            a = self._operand(v.args[1], coords, compute)
            b = self._operand(v.args[2], coords, compute)
            e = f"({p} ? {a} : {b})"
        else:
            xs = [self._operand(a, coords, compute) for a in v.args]
            e = _math(op, xs, compute, v)
        if out_r == "float" and v.dtype != "f32" and not (
                op in _SELECTING and all(_exact_in(a, v.dtype) for a in _selected(v))):
            e = f"kf_round<{CTYPE[v.dtype]}>({e})"
        if v.dtype == "i32" and out_r == "long long":
            e = f"(long long)(int)({e})"
        return e

    def _cat(self, v: Value, coords: list[Idx]) -> str:
        dim = v.attrs["dim"]
        c = coords[dim]
        parts, off = [], 0
        for p in v.args:
            sz = p.shape[dim]
            pc = list(coords)
            pc[dim] = _clamp_into(_add_const(c, -off, self.vec), sz, self.vec)
            parts.append((off, sz, self.emit(p, pc)))
            off += sz
        # A lane coordinate whose run never straddles a part boundary picks its part once per run.
        ct = c.t0 if c.kind == "lane" and c.aligned and all((o + z) % self.vec == 0 for o, z, _ in parts) else c.t
        e = parts[-1][2]
        for off, sz, pe in reversed(parts[:-1]):
            e = f"(({ct}) < {off + sz} ? {pe} : {e})"
        return e

    def _pad(self, v: Value, coords: list[Idx]) -> str:
        a = v.args[0]
        conds, ac = [], []
        for d, ((lo, hi, dil), c, s) in enumerate(zip(v.attrs["config"], coords, a.shape)):
            if lo == 0 and hi == 0 and dil == 0:
                ac.append(c)
                continue
            raw = _add_const(c, -lo, self.vec)
            if dil == 0:
                # Uniform over an aligned run when the padded extent is whole runs (see _cat).
                rt = raw.t0 if raw.kind == "lane" and raw.aligned and s % self.vec == 0 else raw.t
                conds.append(f"(unsigned long long)({rt}) < {s}ULL")
                ac.append(_clamp_into(raw, s, self.vec))
            else:
                step = dil + 1
                conds.append(f"(({raw.t}) >= 0 && ({raw.t}) % {step} == 0 && ({raw.t}) / {step} < {s})")
                q = Idx(f"(({raw.t}) / {step})", f"(({raw.t0}) / {step})", "other")
                ac.append(_clamp(q, s - 1))
        inner = self.emit(a, ac)
        if not conds:
            return inner
        pad = self._operand(v.attrs["value"], (), rtype(v.dtype))
        if rtype(v.dtype) == "float" and v.dtype != "f32":
            pad = f"kf_round<{CTYPE[v.dtype]}>({pad})"
        return f"(({' && '.join(conds)}) ? {inner} : {pad})"

    def _reduce_ref(self, v: Value, coords: list[Idx]) -> str:
        if v.id not in self.reduce_exprs:
            raise Unsupported("a reduction's result is read before the reduction (codegen order)")
        want = self.reduce_coords
        got = tuple(c.t for c in coords)
        # Size-1 dims carry no information: compare the others.
        if want is not None:
            w = [t for t, s in zip(want, self.reduce_shape) if s != 1]
            g = [t for t, s in zip(got, v.shape) if s != 1]
            if w != g:
                raise Unsupported("a reduction's result is read at another element than its own (the region "
                                  "would need the result of another row)")
        return self.reduce_exprs[v.id]


def _view_broadcast(em: _Emitter, v: Value, coords: list[Idx]) -> list[Idx]:
    a = v.args[0]
    out = []
    for j, bd in enumerate(v.attrs["bdims"]):
        out.append(ZERO if a.shape[j] == 1 else coords[bd])
    return out


def _view_transpose(em: _Emitter, v: Value, coords: list[Idx]) -> list[Idx]:
    perm = v.attrs["perm"]
    out: list[Idx] = [ZERO] * len(perm)
    for i, p in enumerate(perm):
        out[p] = coords[i]
    return out


def _view_squeeze(em: _Emitter, v: Value, coords: list[Idx]) -> list[Idx]:
    a = v.args[0]
    it = iter(coords)
    return [ZERO if i in v.attrs["dims"] else next(it) for i in range(a.ndim)]


def _view_slice(em: _Emitter, v: Value, coords: list[Idx]) -> list[Idx]:
    out = []
    for c, st, sp in zip(coords, v.attrs["start"], v.attrs["step"]):
        out.append(_add_const(_mul_const(c, sp), st, em.vec))
    return out


def _view_flip(em: _Emitter, v: Value, coords: list[Idx]) -> list[Idx]:
    out = []
    for d, (c, s) in enumerate(zip(coords, v.shape)):
        if d in v.attrs["dims"] and s > 1:
            out.append(Idx(f"({s - 1} - {c.t})", f"({s - 1} - {c.t0})", "const" if c.kind == "const" else "other"))
        else:
            out.append(c)
    return out


def _view_reshape(em: _Emitter, v: Value, coords: list[Idx]) -> list[Idx]:
    return reshape_coords(coords, v.shape, v.args[0].shape, em.vec)


def reshape_coords(coords: list[Idx], out_shape: Sequence[int], in_shape: Sequence[int], vec: int) -> list[Idx]:
    """Coordinates in `in_shape` of the element at `coords` of its row-major reshape to `out_shape`."""
    if squeezed(in_shape) == squeezed(out_shape):
        live = [c for c, s in zip(coords, out_shape) if s != 1]
        it = iter(live)
        return [ZERO if s == 1 else next(it) for s in in_shape]
    # Split both shapes into groups of equal element counts; map each group through its linear index.
    out_sh, in_sh = list(out_shape), list(in_shape)
    res: list[Idx] = []
    i = j = 0
    while i < len(out_sh) or j < len(in_sh):
        gi, gj = [i], [j]
        po = out_sh[i] if i < len(out_sh) else 1
        pi = in_sh[j] if j < len(in_sh) else 1
        i += 1
        j += 1
        while po != pi:
            if po < pi:
                gi.append(i)
                po *= out_sh[i]
                i += 1
            else:
                gj.append(j)
                pi *= in_sh[j]
                j += 1
        gi = [k for k in gi if k < len(out_sh)]
        gj = [k for k in gj if k < len(in_sh)]
        # absorb trailing size-1 dims into the group
        while i < len(out_sh) and out_sh[i] == 1 and (j >= len(in_sh) or in_sh[j] != 1):
            gi.append(i)
            i += 1
        while j < len(in_sh) and in_sh[j] == 1 and (i >= len(out_sh) or out_sh[i] != 1):
            gj.append(j)
            j += 1
        lin = ravel([coords[k] for k in gi], [out_sh[k] for k in gi], vec)
        res.extend(unravel(lin, [in_sh[k] for k in gj], vec))
    return res


_VIEW_HANDLERS = {
    "broadcast_in_dim": _view_broadcast,
    "transpose": _view_transpose,
    "squeeze": _view_squeeze,
    "slice": _view_slice,
    "flip": _view_flip,
    "reshape": _view_reshape,
}

_FLOAT_FN = {
    "exp": "expf", "exp2": "exp2f", "expm1": "expm1f", "log": "logf", "log1p": "log1pf", "log2": "log2f",
    "log10": "log10f", "sqrt": "sqrtf", "rsqrt": "rsqrtf", "sin": "sinf", "cos": "cosf", "tan": "tanf",
    "tanh": "tanhf", "sinh": "sinhf", "cosh": "coshf", "asin": "asinf", "acos": "acosf", "atan": "atanf",
    "asinh": "asinhf", "acosh": "acoshf", "atanh": "atanhf", "erf": "erff", "erfc": "erfcf",
    "erfinv": "erfinvf", "lgamma": "lgammaf", "floor": "floorf", "ceil": "ceilf", "round": "rintf",
    "trunc": "truncf",
}


_CALL1 = {"neg": "(-{})", "reciprocal": "(1.0f / {})", "sign": "kf_sign({})"}
# Binary ops that are one call: torch's NaN-propagating max / min, Python's remainder (fused.cuh).
_CALL2 = {"maximum": "kf_max", "minimum": "kf_min", "atan2": "atan2f", "fmod": "fmodf", "remainder": "kf_remainder"}


_SELECTING = ("neg", "abs", "maximum", "minimum", "where")  # results are (+-) one of the operands


def _selected(v: Value) -> tuple:
    """The operands a selecting op's result is taken from (where's condition is not one)."""
    return v.args[1:] if v.op == "where" else v.args


def _exact_in(v: Any, d: str) -> bool:
    """Whether value `v`, as the emitted code holds it in a float register, is exactly a number of
    the 16-bit float dtype `d`: rounding it to `d` then changes nothing (bf16 -> f32 -> neg -> bf16).
    Conservative: False when unsure."""
    if not isinstance(v, Value):
        return False
    op = v.op
    if op == "input":
        return v.dtype == d
    if op in _VIEW_HANDLERS:
        return _exact_in(v.args[0], d)
    if op == "cat":
        return all(_exact_in(p, d) for p in v.args)
    if op in ("scalar", "const", "full", "iota", "reduce", "pad"):
        return False
    if v.dtype == d:
        return True  # a convert or an elementwise op producing `d` rounds to it (or is exact already)
    if v.dtype != "f32":
        return False
    if op == "convert":
        return _exact_in(v.args[0], d)
    if op in _SELECTING:
        return all(_exact_in(a, d) for a in _selected(v))
    return False


def _math(op: str, x: list[str], compute: str, v: Value) -> str:
    f = compute == "float"
    if op in _FLOAT_FN:
        if not f:
            if op in ("floor", "ceil", "round", "trunc"):
                return x[0]
            raise Unsupported(f"{op} on integers")
        return f"{_FLOAT_FN[op]}({x[0]})"
    if op == "abs":
        return f"fabsf({x[0]})" if f else f"({x[0]} < 0 ? -{x[0]} : {x[0]})"
    if op in _CALL1:
        return _CALL1[op].format(x[0])
    if op == "signbit":
        return f"(signbit({x[0]}) != 0)" if f else f"({x[0]} < 0)"
    if op == "isfinite":
        return f"(isfinite({x[0]}) != 0)" if f else "true"
    if op == "bitwise_not":
        return f"(!{x[0]})" if compute == "bool" else f"(~{x[0]})"
    binops = {"add": "+", "sub": "-", "mul": "*", "div": "/", "eq": "==", "ne": "!=", "lt": "<", "le": "<=",
              "gt": ">", "ge": ">="}
    if op in binops:
        return f"({x[0]} {binops[op]} {x[1]})"
    if op in ("bitwise_and", "bitwise_or", "bitwise_xor"):
        sym = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}[op]
        if compute == "bool":
            return f"(bool)((int){x[0]} {sym} (int){x[1]})"
        return f"({x[0]} {sym} {x[1]})"
    if op in _CALL2:
        return f"{_CALL2[op]}({x[0]}, {x[1]})"
    if op == "pow":
        b = v.args[1]
        if not isinstance(b, Value) and isinstance(b, Number):
            # torch computes these exponents exactly this way
            special = {2.0: f"({x[0]} * {x[0]})", 1.0: x[0], 0.5: f"sqrtf({x[0]})", -0.5: f"rsqrtf({x[0]})",
                       -1.0: f"(1.0f / {x[0]})", -2.0: f"(1.0f / ({x[0]} * {x[0]}))", 3.0: f"({x[0]} * {x[0]} * {x[0]})",
                       0.0: "1.0f"}
            if float(b) in special:
                return special[float(b)]
        return f"powf({x[0]}, {x[1]})"
    if op == "lerp":
        return f"kf_lerp({x[0]}, {x[1]}, {x[2]})"
    raise Unsupported(f"no code for {op}")


# ---- whole kernels ----------------------------------------------------------------------------------
_MAX_SPLIT = 64  # partial results per output element a finishing kernel combines
# Blocks of 256 threads per SM a reduction over leading dims is split to reach (docs/fusion.md: 2
# beat 4 and 8 on an H200, for a bf16 bias gradient of 8192 x 3072 and GPT-2's autocast residual +
# bias gradient).
_COLUMN_BLOCKS_PER_SM = 2
_REDUCE_INIT = {"sum": "0.0f", "mean": "0.0f", "amax": "(-KF_INF)", "amin": "KF_INF"}


def _pick_vec(ir: RegionIR, last: int, sizes: Sequence[int]) -> int:
    """Elements per lane run: 16 bytes of the narrowest tensor moved, at most 8, dividing `last`."""
    widths = [DTYPE_BYTES[v.dtype] for v in ir.values if v.op == "input"] + [DTYPE_BYTES[o.dtype] for o in ir.outputs]
    if not widths or last <= 0:
        return 1
    vec = min(8, 16 // min(widths))
    while vec > 1 and any(s % vec for s in sizes):
        vec //= 2
    return max(vec, 1)


def _params(ir: RegionIR, layout: dict[int, str]) -> str:
    """Kernel parameters in the order GeneratedKernel passes them: each tensor input's pointer (and
    strides when strided), every output, every scalar (as double), the workspace."""
    ps = []
    for a in ir.args:
        if a.op == "input":
            i = a.attrs["index"]
            ps.append(f"const {CTYPE[a.dtype]}* __restrict__ in{i}")
            if layout[i][0] == "s":
                ps.extend(f"long long st{i}_{d}" for d in range(a.ndim))
    for j, o in enumerate(ir.outputs):
        ps.append(f"{CTYPE[o.dtype]}* __restrict__ out{j}")
    ps.extend(f"double sc{a.attrs['index']}_arg" for a in ir.args if a.op == "scalar")
    ps.append("float* __restrict__ ws")
    return ", ".join(ps)


def _scalar_prologue(ir: RegionIR) -> list[str]:
    out = []
    for a in ir.args:
        if a.op == "scalar":
            i = a.attrs["index"]
            out.append(f"const {rtype(a.dtype)} sc{i} = ({rtype(a.dtype)})sc{i}_arg;")
    return out


def _index_bits(ir: RegionIR, layout: dict[int, str], wide: bool, extra: int = 0) -> int:
    biggest = max([extra] + [v.numel for v in ir.values if v.op != "scalar"])
    return 64 if wide or biggest > INT32_MAX // 2 else 32


def _parse_key(ir: RegionIR, key: str) -> tuple[dict[int, str], bool]:
    wide = key.endswith("L")
    flags = key.rstrip("L")
    tensors = [a for a in ir.args if a.op == "input"]
    if len(flags) != 2 * len(tensors):
        raise ValueError(f"layout key {key!r} does not fit {len(tensors)} tensor inputs")
    layout = {a.attrs["index"]: flags[2 * k:2 * k + 2] for k, a in enumerate(tensors)}
    return layout, wide


def default_key(ir: RegionIR) -> str:
    """The layout key of all-contiguous, aligned inputs (the common case, compiled ahead)."""
    return "ca" * sum(1 for a in ir.args if a.op == "input")


def _header(name: str, ir: RegionIR, sched: Schedule, key: str) -> list[str]:
    from .ir import format_ir

    lines = [f"// {name}: generated by kforge.fusion ({sched.kind}, layout {key or '-'})"]
    lines += ["// " + l for l in format_ir(ir, names=False).splitlines()]
    lines += ['#include "fused.cuh"', "",
              "KF_DEVICE long long kf_clampi(long long x, long long hi) { return x < 0 ? 0 : (x > hi ? hi : x); }"]
    return lines


def generate(ir: RegionIR, key: str, *, sm_count: int = 132, name: str | None = None) -> KernelSource:
    """The variant of `ir` for layout `key` (see GeneratedKernel in src/runtime/generated.cpp): the
    kernel writes `ir.kernel_outputs()` (inputs returned as is and repeated values are not written)."""
    sched = schedule(ir)
    layout, wide = _parse_key(ir, key)
    ir = ir.for_kernel()
    if sched.kind == "passthrough":
        return KernelSource("", "", [], 0, 1, 32)
    if sched.kind == "pointwise":
        body, launches, ws, vec, bits = _pointwise(ir, sched, layout, wide, sm_count)
    else:
        body, launches, ws, vec, bits = _reduction(ir, sched, layout, wide, sm_count)
    text = "\n".join(body)
    digest = hashlib.sha1(text.encode()).hexdigest()[:16]
    kname = name or f"kf_fusion_{digest}"
    text = text.replace("KF_KERNEL", kname)
    src = "\n".join(_header(kname, ir, sched, key)) + "\n" + text + "\n"
    launches = [(n.replace("KF_KERNEL", kname), g, b, s) for n, g, b, s in launches]
    return KernelSource(src, kname, launches, ws, vec, bits)


def _indent(lines: list[str], n: int) -> list[str]:
    return [" " * n + l for l in lines]


def _pointwise(ir: RegionIR, sched: Schedule, layout: dict, wide: bool, sm_count: int):
    n = sched.numel
    vec = _pick_vec(ir, n, [o.shape[-1] if o.ndim else 1 for o in ir.outputs])
    bits = _index_bits(ir, layout, wide)
    runs = n // vec if n else 0
    em = _Emitter(ir, layout, vec)
    lin = Idx("(e0 + v)", "e0", "lane" if vec > 1 else "other", vec > 1)
    if vec == 1:
        lin = Idx("e0", "e0", "other")
    results = []
    for j, o in enumerate(ir.outputs):
        coords = unravel(lin, o.shape, vec) if o.ndim else []
        results.append(em.emit(o, coords))
    lines = [f"extern \"C\" __global__ void __launch_bounds__(256) KF_KERNEL({_params(ir, layout)}) {{",
             "  kf_wait_prior_grids();",
             f"  typedef {'long long' if bits == 64 else 'int'} idx_t;",
             *_indent(_scalar_prologue(ir), 2),
             f"  for (idx_t r = (idx_t)blockIdx.x * blockDim.x + threadIdx.x; r < {runs}; r += (idx_t)gridDim.x * blockDim.x) {{",
             f"    const idx_t e0 = r * {vec};"]
    lines += _indent(em.hoisted, 4)
    for j, o in enumerate(ir.outputs):
        lines.append(f"    KfRun<{CTYPE[o.dtype]}, {vec}> o{j};")
    lines.append("#pragma unroll")
    lines.append(f"    for (int v = 0; v < {vec}; ++v) {{")
    lines += _indent(em.lines, 6)
    for j, o in enumerate(ir.outputs):
        lines.append(f"      kf_set(o{j}.v[v], {results[j]});")
    lines.append("    }")
    for j, o in enumerate(ir.outputs):
        lines.append(f"    kf_store_run<{CTYPE[o.dtype]}, {vec}>(out{j} + e0, o{j});")
    lines += ["  }", "}"]
    block = 256
    grid = max(1, min(-(-runs // block), sm_count * 32)) if runs else 0
    launches = [("KF_KERNEL", [grid, 1, 1], [block, 1, 1], 0)] if runs else []
    return lines, launches, 0, vec, bits


def _reduction(ir: RegionIR, sched: Schedule, layout: dict, wide: bool, sm_count: int):
    reds = ir.reductions
    shape, rdims = sched.domain, sched.rdims
    kept_dims = [i for i in range(len(shape)) if i not in rdims]
    red_dims = list(rdims)
    rows, cols = numel(sched.kept), numel(sched.reduced)
    inner = sched.inner
    bits = _index_bits(ir, layout, wide, extra=numel(shape))
    last = shape[-1] if shape else 1
    vec = _pick_vec(ir, last, [last])
    pre_outs = [(j, o) for j, o in enumerate(ir.outputs) if o.id in sched.pre]
    post_outs = [(j, o) for j, o in enumerate(ir.outputs) if o.id not in sched.pre]

    # Accumulators: one per reduction (a var and a mean of the same input share a Welford).
    acc_of: dict[int, str] = {}
    welford_of: dict[int, str] = {}
    accs: list[tuple[str, str, Value]] = []   # (name, kind, value)
    for r in reds:
        kind = r.attrs["kind"]
        if kind in ("var", "mean"):
            src = r.args[0].id
            if kind == "mean" and src not in welford_of and not any(
                    x.attrs["kind"] == "var" and x.args[0].id == src for x in reds):
                name = f"a{len(accs)}"
                accs.append((name, "sum", r))
                acc_of[r.id] = name
                continue
            if src not in welford_of:
                welford_of[src] = f"w{len(accs)}"
                accs.append((welford_of[src], "welford", r))
            acc_of[r.id] = welford_of[src]
        else:
            name = f"a{len(accs)}"
            accs.append((name, kind, r))
            acc_of[r.id] = name
    slots = sum(3 if k == "welford" else 1 for _, k, _ in accs)

    # Geometry.
    if inner:
        col_runs = cols // vec
        group = 32 if col_runs <= 256 else 256
        rows_per_block = 256 // group if group == 32 else 1
        blocks_rows = -(-rows // rows_per_block)
        split = 1
        if blocks_rows < 2 * sm_count and col_runs > group * 8:
            split = min(max(1, (2 * sm_count) // max(blocks_rows, 1)), max(1, col_runs // (group * 8)), _MAX_SPLIT)
        grid_x = max(1, min(blocks_rows, sm_count * 32))
    else:
        # A block is BX lanes over kept runs (coalesced) by BY lanes over reduced elements, combined
        # in shared memory in a fixed order.
        kept_runs = rows // vec
        bx = 32 if kept_runs >= 32 else 1 << max(0, (kept_runs - 1).bit_length())
        by = 256 // bx
        while by > 1 and slots * by * bx * vec > 8192:  # at most 32 KiB of shared memory
            by //= 2
        blocks = -(-kept_runs // bx)
        grid_x = max(1, min(blocks, sm_count * 32))
        split = 1
        target = _COLUMN_BLOCKS_PER_SM * sm_count
        if grid_x < target and cols >= 4 * by:
            split = min(-(-target // grid_x), max(1, cols // (4 * by)), _MAX_SPLIT)
    chunk = -(-(cols // vec if inner else cols) // split)

    em = _Emitter(ir, layout, vec)
    # Coordinates of one input element: kept coords from the row, reduced coords from the column.
    if inner:
        row_lin = Idx.const("row")
        col_lin = Idx("(c0 + v)", "c0", "lane" if vec > 1 else "other", vec > 1) if vec > 1 else Idx("c0", "c0", "other")
    else:
        row_lin = Idx("(k0 + v)", "k0", "lane" if vec > 1 else "other", vec > 1) if vec > 1 else Idx("k0", "k0", "other")
        col_lin = Idx.const("c")
    kept_c = unravel(row_lin, sched.kept, vec)
    red_c = unravel(col_lin, sched.reduced, vec)
    coords: list[Idx] = [ZERO] * len(shape)
    for d, c in zip(kept_dims, kept_c):
        coords[d] = c
    for d, c in zip(red_dims, red_c):
        coords[d] = c

    # pre: accumulate every reduction's input, store pre outputs
    acc_updates: list[str] = []
    for name, kind, r in accs:
        x = em.emit(r.args[0], coords)
        if kind == "welford":
            acc_updates.append(f"kf_welford_add({name}{'[v]' if not inner else ''}, {x});")
        elif kind in ("sum", "mean"):
            acc_updates.append(f"{name}{'[v]' if not inner else ''} += {x};")
        else:
            acc_updates.append(f"{name}{'[v]' if not inner else ''} = kf_combine_{kind}({name}{'[v]' if not inner else ''}, {x});")
    pre_stores, run_decls, run_stores = [], [], []
    for j, o in pre_outs:
        x = em.emit(o, _pre_out_coords(coords, shape, o, vec))
        lin = ravel(coords, shape, vec)
        if vec > 1 and lin.kind == "lane" and lin.aligned:
            # the lanes are one aligned run of the output: one 16-byte store after the lane loop
            # (eight scalar stores 32 bytes apart per lane left the store units at a quarter of bandwidth)
            run_decls.append(f"KfRun<{CTYPE[o.dtype]}, {vec}> p{j};")
            pre_stores.append(f"kf_set(p{j}.v[v], {x});")
            run_stores.append(f"kf_store_run<{CTYPE[o.dtype]}, {vec}>(out{j} + {lin.t0}, p{j});")
        else:
            pre_stores.append(f"kf_store(out{j} + {lin.t}, {x});")
    body_pre = em.lines + acc_updates + pre_stores
    hoisted_pre = em.hoisted + run_decls

    def acc_decl(lanes: bool) -> list[str]:
        out = []
        for name, kind, r in accs:
            init = "kf_welford_init()" if kind == "welford" else _REDUCE_INIT[kind if kind != "mean" else "sum"]
            ty = "KfWelford" if kind == "welford" else "float"
            if lanes:
                out.append(f"{ty} {name}[{vec}];")
                out.append("#pragma unroll")
                out.append(f"for (int v = 0; v < {vec}; ++v) {name}[v] = {init};")
            else:
                out.append(f"{ty} {name} = {init};")
        return out

    def finals(get: dict[str, str]) -> dict[int, str]:
        """Final expression of each reduction value from its accumulator expressions."""
        out = {}
        for r in reds:
            a = get[acc_of[r.id]]
            kind = r.attrs["kind"]
            if kind == "var":
                corr = float(r.attrs["correction"])
                e = f"({a}.m2 / ({a}.n - {float_literal(corr)}))"
            elif kind == "mean":
                e = f"{a}.mean" if acc_of[r.id].startswith("w") else f"({a} / {float_literal(float(cols))})"
            else:
                e = a
            if r.dtype != "f32":
                e = f"kf_round<{CTYPE[r.dtype]}>({e})"
            out[r.id] = e
        return out

    def epilogue(row_coords: list[Idx], get: dict[str, str], lane_loop: bool) -> list[str]:
        """Post values at `row_coords` (coordinates of the reduced shape) and their stores."""
        pe = _Emitter(ir, layout, 1)
        pe.reduce_exprs = finals(get)
        pe.reduce_shape = reds[0].shape
        pe.reduce_coords = tuple(c.t for c in row_coords)
        stores = []
        lin = ravel(row_coords, reds[0].shape, 1)
        for j, o in post_outs:
            oc = _post_out_coords(row_coords, reds[0].shape, o)
            x = pe.emit(o, oc)
            stores.append(f"kf_store(out{j} + {lin.t}, {x});")
        if pe.hoisted:
            raise Unsupported("vector loads in an epilogue")
        return pe.lines + stores

    idx = f"typedef {'long long' if bits == 64 else 'int'} idx_t;"
    head = [f"extern \"C\" __global__ void __launch_bounds__(256) KF_KERNEL({_params(ir, layout)}) {{",
            "  kf_wait_prior_grids();", "  " + idx, *_indent(_scalar_prologue(ir), 2)]
    launches = []
    ws_floats = slots * split * rows if split > 1 else 0

    def partial_writes(lane_suffix: str, row_expr: str) -> list[str]:
        out, slot = [], 0
        for name, kind, r in accs:
            src = f"{name}{lane_suffix}"
            if kind == "welford":
                for f_ in ("n", "mean", "m2"):
                    out.append(f"ws[((idx_t){slot} * {split} + blockIdx.y) * {rows} + {row_expr}] = {src}.{f_};")
                    slot += 1
            else:
                out.append(f"ws[((idx_t){slot} * {split} + blockIdx.y) * {rows} + {row_expr}] = {src};")
                slot += 1
        return out

    if inner:
        g = 32 if rows_per_block > 1 else 256
        body = head + [
            "  __shared__ float kf_scratch[96];",
            f"  const int lane = threadIdx.x % {g};",
            f"  const idx_t c_begin = (idx_t)blockIdx.y * {chunk};",
            f"  const idx_t c_end = c_begin + {chunk} < {cols // vec} ? c_begin + {chunk} : {cols // vec};",
            f"  for (idx_t row = (idx_t)blockIdx.x * {rows_per_block} + threadIdx.x / {g}; row < {rows};"
            f" row += (idx_t)gridDim.x * {rows_per_block}) {{",
            *_indent(acc_decl(False), 4),
            f"    for (idx_t cr = c_begin + lane; cr < c_end; cr += {g}) {{",
            f"      const idx_t c0 = cr * {vec};",
            *_indent(hoisted_pre, 6),
            "#pragma unroll",
            f"      for (int v = 0; v < {vec}; ++v) {{",
            *_indent(body_pre, 8),
            "      }",
            *_indent(run_stores, 6),
            "    }",
        ]
        # group reduction
        for name, kind, r in accs:
            if kind == "welford":
                body.append(f"    {name} = {'kf_group_welford<32>' if g == 32 else 'kf_block_welford'}({name}{'' if g == 32 else ', kf_scratch'});")
            else:
                comb = f"[](float a, float b) {{ return kf_combine_{kind if kind != 'mean' else 'sum'}(a, b); }}"
                if g == 32:
                    body.append(f"    {name} = kf_group_reduce<32>({name}, {comb});")
                else:
                    body.append(f"    {name} = kf_block_reduce({name}, kf_scratch, {comb});")
        if split > 1:
            body += ["    if (lane == 0) {", *_indent(partial_writes("", "row"), 6), "    }"]
        else:
            body += ["    if (lane == 0) {", *_indent(epilogue(unravel(Idx.const("row"), sched.kept, 1),
                                                             {n: n for n, _, _ in accs}, False), 6), "    }"]
        body += ["  }", "}"]
        launches.append(("KF_KERNEL", [grid_x, split, 1], [256, 1, 1], 0))
    else:
        kr_total = rows // vec
        smem = []
        slot = 0
        for name, kind, r in accs:
            for f_ in (("n", "mean", "m2") if kind == "welford" else ("",)):
                smem.append((name, f_, slot))
                slot += 1

        def sidx(slot_: int, y: str) -> str:
            return f"kf_red[(({slot_} * {by} + {y}) * {bx} + tx) * {vec} + v]"

        body = head + [
            f"  __shared__ float kf_red[{slots * by * bx * vec}];",
            f"  const int tx = threadIdx.x % {bx}, ty = threadIdx.x / {bx};",
            f"  const idx_t c_begin = (idx_t)blockIdx.y * {chunk};",
            f"  const idx_t c_end = c_begin + {chunk} < {cols} ? c_begin + {chunk} : {cols};",
            f"  for (idx_t kb = (idx_t)blockIdx.x * {bx}; kb < {kr_total}; kb += (idx_t)gridDim.x * {bx}) {{",
            "    const idx_t kr = kb + tx;",
            f"    const bool active = kr < {kr_total};",
            f"    const idx_t k0 = kr * {vec};",
            *_indent(acc_decl(True), 4),
            "    if (active) {",
            f"      for (idx_t c = c_begin + ty; c < c_end; c += {by}) {{",
            *_indent(hoisted_pre, 8),
            "#pragma unroll",
            f"        for (int v = 0; v < {vec}; ++v) {{",
            *_indent(body_pre, 10),
            "        }",
            *_indent(run_stores, 8),
            "      }",
            "    }",
            "#pragma unroll",
            f"    for (int v = 0; v < {vec}; ++v) {{",
            *[f"      {sidx(sl, 'ty')} = {name}[v]{'.' + f_ if f_ else ''};" for name, f_, sl in smem],
            "    }",
            "    __syncthreads();",
            "    if (ty == 0 && active) {",
            "#pragma unroll",
            f"      for (int v = 0; v < {vec}; ++v) {{",
        ]
        for name, kind, r in accs:
            if kind == "welford":
                sl = next(x[2] for x in smem if x[0] == name and x[1] == "n")
                body.append(f"        for (int y = 1; y < {by}; ++y) {name}[v] = kf_welford_merge({name}[v], "
                            f"{{{sidx(sl, 'y')}, {sidx(sl + 1, 'y')}, {sidx(sl + 2, 'y')}}});")
            else:
                sl = next(x[2] for x in smem if x[0] == name)
                comb = kind if kind != "mean" else "sum"
                body.append(f"        for (int y = 1; y < {by}; ++y) {name}[v] = kf_combine_{comb}({name}[v], {sidx(sl, 'y')});")
        if split > 1:
            body += _indent(partial_writes("[v]", "(k0 + v)"), 8)
        else:
            rc = unravel(Idx("(k0 + v)", "k0", "other"), sched.kept, 1)
            body += _indent(epilogue(rc, {n: f"{n}[v]" for n, _, _ in accs}, True), 8)
        body += ["      }", "    }", "    __syncthreads();", "  }", "}"]
        launches.append(("KF_KERNEL", [grid_x, split, 1], [bx * by, 1, 1], 0))

    if split > 1:
        # The finishing kernel: one thread per output element combines the partials in order.
        fin = [f"extern \"C\" __global__ void __launch_bounds__(256) KF_KERNEL_finish({_params(ir, layout)}) {{",
               "  kf_wait_prior_grids();", "  " + idx, *_indent(_scalar_prologue(ir), 2),
               f"  for (idx_t row = (idx_t)blockIdx.x * blockDim.x + threadIdx.x; row < {rows};"
               f" row += (idx_t)gridDim.x * blockDim.x) {{"]
        slot = 0
        for name, kind, r in accs:
            if kind == "welford":
                fin.append(f"    KfWelford {name} = kf_welford_init();")
                fin.append("#pragma unroll 8")
                fin.append(f"    for (int s = 0; s < {split}; ++s) {name} = kf_welford_merge({name}, "
                           f"{{ws[((idx_t){slot} * {split} + s) * {rows} + row], ws[((idx_t){slot + 1} * {split} + s) * {rows} + row], "
                           f"ws[((idx_t){slot + 2} * {split} + s) * {rows} + row]}});")
                slot += 3
            else:
                comb = kind if kind != "mean" else "sum"
                fin.append(f"    float {name} = ws[((idx_t){slot} * {split}) * {rows} + row];")
                fin.append("#pragma unroll 8")
                fin.append(f"    for (int s = 1; s < {split}; ++s) {name} = kf_combine_{comb}({name}, "
                           f"ws[((idx_t){slot} * {split} + s) * {rows} + row]);")
                slot += 1
        fin += _indent(epilogue(unravel(Idx.const("row"), sched.kept, 1), {n: n for n, _, _ in accs}, False), 4)
        fin += ["  }", "}"]
        body += [""] + fin
        fgrid = max(1, min(-(-rows // 256), sm_count * 32))
        launches.append(("KF_KERNEL_finish", [fgrid, 1, 1], [256, 1, 1], 0))
    if rows == 0:
        launches = []
    return body, launches, ws_floats * 4, vec, bits


def _pre_out_coords(coords: list[Idx], shape: Sequence[int], o: Value, vec: int) -> list[Idx]:
    """Coordinates of a pre output at the reduction input's element `coords`: the same squeezed shape,
    or another shape of the same size (a row-major reshape: the same linear index, mapped as the
    region's own reshapes map it, so its loads are the ones the reduction already made)."""
    return reshape_coords(coords, shape, o.shape, vec)


def _post_out_coords(row_coords: list[Idx], rshape: Sequence[int], o: Value) -> list[Idx]:
    live = [c for c, s in zip(row_coords, rshape) if s != 1]
    it = iter(live)
    return [ZERO if s == 1 else next(it) for s in o.shape]
