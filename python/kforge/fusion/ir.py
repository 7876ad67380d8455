"""The fusion IR: a region of a Thunder trace as a list of ops over named values.

A region's bound symbols (Thunder prims, or composites whose sub-symbols are prims) are lowered to
`Value`s in topological order. Every value has a static shape and a dtype ("f32", "bf16", "f16",
"bool", "i32", "i64"); its op is one of:

- input / scalar          a tensor argument of the region / a number that changes between calls
- const                   a number fixed at trace time (held in attrs["value"])
- elementwise ops         unary / binary / ternary, named as Thunder's prims ("add", "exp", "where")
- convert                 convert_element_type (attrs["dtype"])
- views                   broadcast_in_dim, reshape, transpose, squeeze, slice, flip
- cat, pad                index maps with a selection (a copy in torch, free inside a kernel)
- full, iota              generated values
- reduce                  attrs["kind"] in sum / amax / amin / var / mean over attrs["dims"]

Number semantics follow Thunder's torch executor: a 16-bit float op computes in fp32 and rounds its
result to its own dtype, so every convert in a chain is honoured, and a chain of ops costs one pass.

`lower(bsyms, inputs, outputs)` builds a `RegionIR`; it raises `Unsupported` with a reason for
anything it cannot express. `format_ir(ir)` prints it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Number
from typing import Any, Collection, Iterable, Sequence

__all__ = ["Unsupported", "Value", "RegionIR", "lower", "format_ir", "DTYPE_BYTES", "torch_dtype", "ir_dtype",
           "UNARY", "BINARY", "TERNARY", "VIEW_OPS", "REDUCE_KINDS", "numel", "lossless", "view_plan", "fold_zeros"]


class Unsupported(Exception):
    """A region (or bound symbol) the fusion cannot compile; the message says why."""


DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "bool": 1, "i32": 4, "i64": 8}
FLOATS = ("f32", "bf16", "f16")

# Elementwise prims by arity. The value names the result dtype rule: "same" (the operands' dtype),
# "bool" (comparisons and predicates), "float" (defined on floats only).
UNARY = {
    "abs": "same", "neg": "same", "exp": "float", "exp2": "float", "expm1": "float", "log": "float",
    "log1p": "float", "log2": "float", "log10": "float", "sqrt": "float", "rsqrt": "float",
    "reciprocal": "float", "sin": "float", "cos": "float", "tan": "float", "tanh": "float",
    "sinh": "float", "cosh": "float", "asin": "float", "acos": "float", "atan": "float",
    "asinh": "float", "acosh": "float", "atanh": "float", "erf": "float", "erfc": "float",
    "erfinv": "float", "lgamma": "float", "floor": "same", "ceil": "same", "round": "same",
    "trunc": "same", "sign": "same", "signbit": "bool", "isfinite": "bool", "bitwise_not": "same",
}
BINARY = {
    "add": "same", "sub": "same", "mul": "same", "div": "float", "pow": "float", "maximum": "same",
    "minimum": "same", "atan2": "float", "fmod": "float", "remainder": "float", "eq": "bool", "ne": "bool",
    "lt": "bool", "le": "bool", "gt": "bool", "ge": "bool", "bitwise_and": "same", "bitwise_or": "same",
    "bitwise_xor": "same",
}
TERNARY = {"where": "same", "lerp": "float"}
VIEW_OPS = ("broadcast_in_dim", "reshape", "transpose", "squeeze", "slice", "flip", "copy")
REDUCE_KINDS = ("sum", "amax", "amin", "var", "mean")


def numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def ir_dtype(thunder_dtype: Any) -> str:
    """Our dtype name for a Thunder dtype; Unsupported for the rest (fp64, fp8, complex, ...)."""
    from thunder.core import dtypes

    import torch

    t = dtypes.to_torch_dtype(thunder_dtype)
    m = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.bool: "bool",
         torch.int32: "i32", torch.int64: "i64"}
    if t not in m:
        raise Unsupported(f"dtype {t} is not supported (float32, bfloat16, float16, bool, int32, int64)")
    return m[t]


def torch_dtype(d: str):
    import torch

    return {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "bool": torch.bool,
            "i32": torch.int32, "i64": torch.int64}[d]


@dataclass(eq=False)
class Value:
    """One SSA value of a region. `args` holds Values and Python numbers."""

    id: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    args: tuple = ()
    attrs: dict = field(default_factory=dict)
    name: str = ""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return numel(self.shape)

    def __repr__(self) -> str:
        return f"%{self.id}"


@dataclass
class RegionIR:
    """A region: its arguments (tensor `input`s and runtime `scalar`s, in call order), every value in
    topological order, and the values it returns."""

    args: list[Value]
    values: list[Value]
    outputs: list[Value]

    def consumers(self) -> dict[int, list[Value]]:
        out: dict[int, list[Value]] = {v.id: [] for v in self.values}
        for v in self.values:
            for a in v.args:
                if isinstance(a, Value):
                    out[a.id].append(v)
        return out

    @property
    def reductions(self) -> list[Value]:
        return [v for v in self.values if v.op == "reduce"]

    def output_sources(self) -> list[int]:
        """Per region output, where it comes from: k >= 0 the kernel's k-th output, -(i + 1) region
        argument i returned as is (a cast round trip or a view that simplified away). Two outputs of
        the same value share one kernel output."""
        kernel: dict[int, int] = {}
        out = []
        for o in self.outputs:
            if o.op == "input":
                out.append(-(o.attrs["index"] + 1))
            else:
                out.append(kernel.setdefault(o.id, len(kernel)))
        return out

    def kernel_outputs(self) -> list[Value]:
        """The values a kernel writes: the computed outputs, each once, in order of first appearance."""
        seen: dict[int, Value] = {}
        for o in self.outputs:
            if o.op != "input":
                seen.setdefault(o.id, o)
        return list(seen.values())

    def for_kernel(self) -> "RegionIR":
        """This region with the outputs a kernel writes (itself when they are the outputs already)."""
        ko = self.kernel_outputs()
        if len(ko) == len(self.outputs):
            return self
        return prune(RegionIR(self.args, self.values, ko))


def _fmt_arg(a: Any) -> str:
    if isinstance(a, Value):
        return repr(a)
    return repr(a)


def format_ir(ir: RegionIR, names: bool = True) -> str:
    """The region as text, one value per line (what `kforge.inspect` and tests print). names=False
    leaves out the trace's proxy names (generated sources: equal structures then have equal text,
    so a cached kernel is found whatever the proxies were called)."""
    lines = []
    outs: dict[int, list[int]] = {}
    for i, v in enumerate(ir.outputs):
        outs.setdefault(v.id, []).append(i)
    for v in ir.values:
        attrs = ", ".join(f"{k}={val}" for k, val in v.attrs.items())
        args = ", ".join(_fmt_arg(a) for a in v.args)
        body = f"{v.op}({args}{', ' if args and attrs else ''}{attrs})"
        tail = "  -> " + ", ".join(f"out{i}" for i in outs[v.id]) if v.id in outs else ""
        name = f"  # {v.name}" if v.name and names else ""
        lines.append(f"%{v.id}: {v.dtype}{list(v.shape)} = {body}{tail}{name}")
    return "\n".join(lines)


# ---- lowering -------------------------------------------------------------------------------------
class _Builder:
    def __init__(self) -> None:
        self.values: list[Value] = []
        self.env: dict[str, Value] = {}

    def add(self, op: str, shape: Sequence[int], dtype: str, args: tuple = (), attrs: dict | None = None,
            name: str = "") -> Value:
        v = Value(len(self.values), op, tuple(int(s) for s in shape), dtype, tuple(args), dict(attrs or {}), name)
        self.values.append(v)
        return v

    def const(self, x: Number, dtype: str) -> Value:
        return self.add("const", (), dtype, attrs={"value": x})


def _shape(p: Any) -> tuple[int, ...]:
    shape = tuple(p.shape)
    if not all(isinstance(s, int) for s in shape):
        raise Unsupported(f"{p.name} has a symbolic shape {shape}")
    return shape


def _number_dtype(x: Number) -> str:
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "i64"
    if isinstance(x, float):
        return "f32"
    raise Unsupported(f"number {x!r} of type {type(x).__name__} is not supported")


class _Lowerer:
    def __init__(self, inputs: Sequence[Any], zeros: Collection[int] = ()):
        from thunder.core.proxies import NumberProxy, TensorProxy

        self.b = _Builder()
        self.args: list[Value] = []
        for i, p in enumerate(inputs):
            if i in zeros:
                if not isinstance(p, TensorProxy):
                    raise Unsupported(f"argument {i} taken as zero is not a tensor")
                self.b.env[p.name] = self.b.add("full", _shape(p), ir_dtype(p.dtype), attrs={"value": 0}, name=p.name)
                continue
            if isinstance(p, TensorProxy):
                v = self.b.add("input", _shape(p), ir_dtype(p.dtype), attrs={"index": len(self.args)}, name=p.name)
            elif isinstance(p, NumberProxy):
                pt = p.python_type
                if pt not in (int, float, bool):
                    raise Unsupported(f"scalar argument {p.name} of type {pt}")
                v = self.b.add("scalar", (), {int: "i64", float: "f32", bool: "bool"}[pt],
                               attrs={"index": len(self.args)}, name=p.name)
            else:
                raise Unsupported(f"region argument {p!r} is neither a tensor nor a number")
            self.args.append(v)
            self.b.env[p.name] = v

    # -- argument access ----------------------------------------------------------------------------
    def val(self, a: Any, like: Value | None = None) -> Value | Number:
        """A Value for proxy `a`, or the Python number itself."""
        from thunder.core.proxies import NumberProxy, Proxy

        if isinstance(a, NumberProxy):
            if a.name in self.b.env:
                return self.b.env[a.name]
            value = getattr(a, "value", None)
            if isinstance(value, Number):
                return value
            raise Unsupported(f"number {a.name} is not a region argument")
        if isinstance(a, Proxy):
            if a.name not in self.b.env:
                raise Unsupported(f"{a.name} is used before it is defined in the region")
            return self.b.env[a.name]
        if isinstance(a, Number):
            return a
        raise Unsupported(f"argument {a!r} of type {type(a).__name__}")

    def tensor(self, a: Any) -> Value:
        v = self.val(a)
        if not isinstance(v, Value) or v.op == "scalar":
            raise Unsupported(f"expected a tensor, got {a!r}")
        return v

    # -- bound symbols --------------------------------------------------------------------------------
    def bsym(self, bsym: Any) -> None:
        from thunder.core.prims import PrimIDs

        sid = bsym.sym.id
        handler = _HANDLERS.get(sid) if isinstance(sid, PrimIDs) else _COMPOSITES.get(sid)
        outs = handler(self, bsym) if handler is not None else None
        if outs is None:  # no handler, or a composite's handler passed: lower its decomposition
            if bsym.subsymbols:
                for s in bsym.subsymbols:
                    self.bsym(s)
                return
            raise Unsupported(f"{bsym.sym.name} has no fusion lowering")
        flat = [o for o in bsym.flat_outs]
        if not isinstance(outs, tuple):
            outs = (outs,)
        if len(outs) != len(flat):
            raise Unsupported(f"{bsym.sym.name}: {len(flat)} outputs, lowered {len(outs)}")
        from thunder.core.proxies import Proxy, TensorProxy

        for p, v in zip(flat, outs):
            if not isinstance(p, Proxy):
                continue
            if isinstance(p, TensorProxy):
                shape, dtype = _shape(p), ir_dtype(p.dtype)
                if isinstance(v, Value) and (v.shape != shape or v.dtype != dtype):
                    raise Unsupported(f"{bsym.sym.name}: lowered {v.dtype}{list(v.shape)} for {p.name} "
                                      f"{dtype}{list(shape)}")
                if not isinstance(v, Value):
                    v = self.b.add("full", shape, dtype, attrs={"value": v})
                if not v.name:
                    v.name = p.name
            self.b.env[p.name] = v


# ---- per-prim lowering ------------------------------------------------------------------------------
def _out(bsym: Any) -> Any:
    return bsym.flat_outs[0]


def _elementwise(arity: int, rule: str):
    def lower(L: _Lowerer, bsym: Any) -> Value | Number:
        op = bsym.sym.name
        args = [L.val(a) for a in bsym.args[:arity]]
        out = _out(bsym)
        from thunder.core.proxies import TensorProxy

        if not isinstance(out, TensorProxy):
            raise Unsupported(f"{op} on numbers only")
        shape, dtype = _shape(out), ir_dtype(out.dtype)
        for a in args:
            if isinstance(a, Value) and a.op != "scalar" and a.shape != shape:
                raise Unsupported(f"{op}: operand {a.dtype}{list(a.shape)} for result {list(shape)}")
        tensor_dtypes = {a.dtype for a in args if isinstance(a, Value) and a.op != "scalar"}
        if op == "where":
            tensor_dtypes = {a.dtype for a in args[1:] if isinstance(a, Value) and a.op != "scalar"}
        if rule == "float" and (dtype not in FLOATS or tensor_dtypes - set(FLOATS)):
            raise Unsupported(f"{op} on {sorted(tensor_dtypes | {dtype})}: only on floating dtypes")
        if dtype in ("i32", "i64") and op in ("div", "pow", "fmod", "remainder"):
            raise Unsupported(f"integer {op}")
        vals = tuple(a if isinstance(a, Value) else _check_number(a) for a in args)
        return L.b.add(op, shape, dtype, vals)

    return lower


def _check_number(x: Number) -> Number:
    _number_dtype(x)
    return x


def _convert(L: _Lowerer, bsym: Any) -> Value | Number:
    a = L.val(bsym.args[0])
    out = _out(bsym)
    from thunder.core.proxies import TensorProxy

    if not isinstance(out, TensorProxy):
        if isinstance(a, Value):
            raise Unsupported("convert_element_type of a run-time number")
        from thunder.core import dtypes

        # a constant converted at trace time: Thunder's dtypes for numbers are Python types
        pt = dtypes.dtype_to_numbertype(bsym.args[1]) if not isinstance(bsym.args[1], type) else bsym.args[1]
        return pt(a)
    if not isinstance(a, Value):
        raise Unsupported("convert_element_type of a number to a tensor")
    dtype = ir_dtype(out.dtype)
    if a.dtype == dtype:
        return a
    if a.op == "convert" and a.args[0].dtype == dtype and lossless(dtype, a.dtype):
        return a.args[0]  # widened and narrowed back: exactly the value it started as
    return L.b.add("convert", a.shape, dtype, (a,), {"dtype": dtype})


def lossless(src: str, dst: str) -> bool:
    """Every `src` value converts to `dst` and back unchanged (so the round trip is the identity)."""
    if src == dst or src == "bool":
        return True  # bool -> number -> bool: 0 / 1 and back through != 0
    return (src, dst) in {("bf16", "f32"), ("f16", "f32"), ("i32", "i64")}


def _broadcast_in_dim(L: _Lowerer, bsym: Any) -> Value:
    a = L.tensor(bsym.args[0])
    shape, bdims = tuple(bsym.args[1]), tuple(bsym.args[2])
    if len(bdims) != a.ndim:
        raise Unsupported("broadcast_in_dim: broadcast_dimensions do not match the operand")
    return L.b.add("broadcast_in_dim", shape, a.dtype, (a,), {"bdims": bdims})


def _reshape(L: _Lowerer, bsym: Any) -> Value:
    a = L.tensor(bsym.args[0])
    shape = _shape(_out(bsym))
    if numel(shape) != a.numel:
        raise Unsupported("reshape changes the number of elements")
    if shape == a.shape:
        return a
    return L.b.add("reshape", shape, a.dtype, (a,))


def _transpose(L: _Lowerer, bsym: Any) -> Value:
    a = L.tensor(bsym.args[0])
    perm = tuple(int(p) for p in bsym.args[1])
    if perm == tuple(range(a.ndim)):
        return a
    return L.b.add("transpose", tuple(a.shape[p] for p in perm), a.dtype, (a,), {"perm": perm})


def _squeeze(L: _Lowerer, bsym: Any) -> Value:
    a = L.tensor(bsym.args[0])
    dims = tuple(sorted(int(d) % max(a.ndim, 1) for d in bsym.args[1]))
    if not dims:
        return a
    return L.b.add("squeeze", _shape(_out(bsym)), a.dtype, (a,), {"dims": dims})


def _slice(L: _Lowerer, bsym: Any) -> Value:
    a = L.tensor(bsym.args[0])
    start = tuple(bsym.args[1])
    steps = tuple(bsym.args[3]) if len(bsym.args) > 3 and bsym.args[3] is not None else (1,) * a.ndim
    shape = _shape(_out(bsym))
    if shape == a.shape and all(s == 0 for s in start):
        return a
    return L.b.add("slice", shape, a.dtype, (a,), {"start": tuple(map(int, start)), "step": tuple(map(int, steps))})


def _flip(L: _Lowerer, bsym: Any) -> Value:
    a = L.tensor(bsym.args[0])
    dims = tuple(sorted(int(d) % a.ndim for d in bsym.args[1]))
    return L.b.add("flip", a.shape, a.dtype, (a,), {"dims": dims})


def _copy(L: _Lowerer, bsym: Any) -> Value:
    return L.tensor(bsym.args[0])


def _stride_order(L: _Lowerer, bsym: Any) -> Value:
    a = L.tensor(bsym.args[0])
    order = tuple(int(d) for d in bsym.args[1])
    if order != tuple(range(a.ndim - 1, -1, -1)):
        raise Unsupported(f"stride_order {order}: only the contiguous order (a kernel's outputs are contiguous)")
    # A computed value is written contiguous by the kernel anyway. A value that is only movement of
    # an input may become a view of it (`view_plan`) or the input itself: marked, so the launcher
    # returns a view only where that view is contiguous, as torch's contiguous() returns self.
    m = a
    while m.op in VIEW_OPS:
        m = m.args[0]
    if m.op == "input":
        return L.b.add("reshape", a.shape, a.dtype, (a,), {"contiguous": True})
    return a


def _cat(L: _Lowerer, bsym: Any) -> Value:
    parts = [L.tensor(t) for t in bsym.args[0]]
    out = _out(bsym)
    shape, dtype = _shape(out), ir_dtype(out.dtype)
    dim = int(bsym.args[1]) % len(shape)
    if any(p.dtype != dtype for p in parts):
        raise Unsupported("cat of mixed dtypes")
    parts = [p for p in parts if p.shape[dim] > 0]
    if len(parts) == 1:
        return parts[0]
    return L.b.add("cat", shape, dtype, tuple(parts), {"dim": dim})


def _pad(L: _Lowerer, bsym: Any) -> Value:
    a = L.tensor(bsym.args[0])
    value = L.val(bsym.args[1])
    if isinstance(value, Value):
        raise Unsupported("pad with a run-time padding value")
    config = tuple((int(lo), int(hi), int(d)) for lo, hi, d in bsym.args[2])
    if any(d < 0 for _, _, d in config):
        raise Unsupported("pad with negative interior padding")
    return L.b.add("pad", _shape(_out(bsym)), a.dtype, (a,), {"value": value, "config": config})


def _full(L: _Lowerer, bsym: Any) -> Value:
    out = _out(bsym)
    value = L.val(bsym.args[1])
    if isinstance(value, Value):
        if value.op != "scalar":
            raise Unsupported("full with a tensor value")
        return L.b.add("full", _shape(out), ir_dtype(out.dtype), (value,))
    return L.b.add("full", _shape(out), ir_dtype(out.dtype), attrs={"value": value})


def _iota(L: _Lowerer, bsym: Any) -> Value:
    out = _out(bsym)
    start, step = bsym.kwargs.get("start"), bsym.kwargs.get("step")
    if not all(isinstance(x, Number) for x in (start, step)):
        raise Unsupported("iota with run-time start or step")
    return L.b.add("iota", _shape(out), ir_dtype(out.dtype), attrs={"start": start, "step": step})


def _reduction(kind: str):
    def lower(L: _Lowerer, bsym: Any) -> Value | tuple:
        a = L.tensor(bsym.args[0])
        dims = tuple(sorted({int(d) % a.ndim for d in bsym.args[1]})) if a.ndim else ()
        if a.dtype not in FLOATS:
            raise Unsupported(f"{kind} of {a.dtype}: only floating dtypes are reduced")
        if not dims:
            raise Unsupported(f"{kind} over no dims")
        kept = tuple(s for i, s in enumerate(a.shape) if i not in dims)
        if kind in ("sum", "amax", "amin") and all(a.shape[d] == 1 for d in dims):
            # over size-1 dims only: the values themselves (the backward of an unsqueeze + expand)
            return L.b.add("reshape", kept, a.dtype, (a,)) if kept != a.shape else a
        if kind in ("var", "var_mean"):
            corr = bsym.kwargs.get("correction", 1)
            if not isinstance(corr, Number):
                raise Unsupported("var with a run-time correction")
            var = L.b.add("reduce", kept, a.dtype, (a,), {"kind": "var", "dims": dims, "correction": corr})
            if kind == "var":
                return var
            mean = L.b.add("reduce", kept, a.dtype, (a,), {"kind": "mean", "dims": dims})
            return var, mean
        return L.b.add("reduce", kept, a.dtype, (a,), {"kind": kind, "dims": dims})

    return lower


def _build_handlers() -> dict:
    from thunder.core.prims import PrimIDs

    h: dict = {}
    for name, rule in UNARY.items():
        h[getattr(PrimIDs, name.upper())] = _elementwise(1, rule)
    for name, rule in BINARY.items():
        h[getattr(PrimIDs, name.upper())] = _elementwise(2, rule)
    for name, rule in TERNARY.items():
        h[getattr(PrimIDs, name.upper())] = _elementwise(3, rule)
    h.update({
        PrimIDs.CONVERT_ELEMENT_TYPE: _convert,
        PrimIDs.BROADCAST_IN_DIM: _broadcast_in_dim,
        PrimIDs.RESHAPE: _reshape,
        PrimIDs.VIEW: _reshape,
        PrimIDs.TRANSPOSE: _transpose,
        PrimIDs.SQUEEZE: _squeeze,
        PrimIDs.SLICE: _slice,
        PrimIDs.FLIP: _flip,
        PrimIDs.CLONE: _copy,
        PrimIDs.SHALLOW_COPY: _copy,
        PrimIDs.CAT: _cat,
        PrimIDs.STRIDE_ORDER: _stride_order,
        PrimIDs.PAD: _pad,
        PrimIDs.FULL: _full,
        PrimIDs.IOTA: _iota,
        PrimIDs.SUM: _reduction("sum"),
        PrimIDs.AMAX: _reduction("amax"),
        PrimIDs.AMIN: _reduction("amin"),
        PrimIDs.VAR: _reduction("var"),
        PrimIDs.VAR_MEAN: _reduction("var_mean"),
    })
    return h


def _relu(L: _Lowerer, bsym: Any) -> Value | None:
    """torch.relu as torch computes it: NaN stays NaN. Thunder's decomposition, where(a > 0, a, 0),
    would turn a NaN into 0 where torch (and Thunder's torch executor) return NaN."""
    a = L.tensor(bsym.args[0])
    out = _out(bsym)
    shape, dtype = _shape(out), ir_dtype(out.dtype)
    inplace = bsym.kwargs.get("inplace", bsym.args[1] if len(bsym.args) > 1 else False)
    if inplace or a.shape != shape or a.dtype != dtype:
        return None
    return L.b.add("maximum", shape, dtype, (a, 0.0 if dtype in FLOATS else 0))


# Composite torch symbols lowered whole, where their Thunder decomposition differs from torch.
_COMPOSITES: dict = {"torch.relu": _relu}

_HANDLERS: dict = {}


def supported_prim_ids() -> set:
    """PrimIDs the fusion can lower."""
    if not _HANDLERS:
        _HANDLERS.update(_build_handlers())
    return set(_HANDLERS)


def lower(bsyms: Iterable[Any], inputs: Sequence[Any], outputs: Sequence[Any], *,
          zeros: Collection[int] = ()) -> RegionIR:
    """Lower a region: `bsyms` in topological order, `inputs` the proxies it reads (tensors and number
    proxies, in call order), `outputs` the proxies it returns. The tensor inputs at positions `zeros`
    are taken as all zeros: they leave the call signature, and `fold_zeros` simplifies what they
    reach (a gradient that was never materialized)."""
    if not _HANDLERS:
        _HANDLERS.update(_build_handlers())
    L = _Lowerer(inputs, zeros)
    for b in bsyms:
        L.bsym(b)
    outs = []
    for p in outputs:
        v = L.b.env.get(p.name)
        if v is None:
            raise Unsupported(f"output {p.name} is not computed by the region")
        if v.op == "scalar":
            raise Unsupported(f"output {p.name} is a number")
        outs.append(v)
    ir = prune(RegionIR(L.args, L.b.values, outs))
    return fold_zeros(ir) if zeros else ir


def _is_zero(a: Any) -> bool:
    return isinstance(a, Value) and a.op == "full" and not a.args and a.attrs.get("value") == 0


def fold_zeros(ir: RegionIR) -> RegionIR:
    """`ir` with all-zero values propagated: x + 0 -> x, x - 0 -> x, 0 - x -> -x, x * 0 and 0 / x -> 0;
    casts, views, pads with 0, reductions and selections of zeros -> zeros. What eager autograd gets
    by never running a gradient that does not exist, so 0 * inf folds to 0 as it does there."""
    rep: dict[int, Value] = {}
    next_id = max((v.id for v in ir.values), default=-1) + 1
    values: list[Value] = []

    def new(op: str, like: Value, args: tuple = (), attrs: dict | None = None) -> Value:
        nonlocal next_id
        v = Value(next_id, op, like.shape, like.dtype, args, dict(attrs or {}), like.name)
        next_id += 1
        values.append(v)
        return v

    def same(a: Any, v: Value) -> bool:  # `a` can stand for `v` as it is
        return isinstance(a, Value) and a.op != "scalar" and a.shape == v.shape and a.dtype == v.dtype

    for v in ir.values:
        v.args = tuple(rep.get(a.id, a) if isinstance(a, Value) else a for a in v.args)
        a = v.args
        z = [_is_zero(x) for x in a]
        r: Value | None = None
        if v.op in ("convert", "neg", "reshape", "transpose", "squeeze", "slice", "flip", "broadcast_in_dim",
                    "copy") and z[0]:
            r = new("full", v, attrs={"value": 0})
        elif v.op == "pad" and z[0] and v.attrs.get("value") == 0:
            r = new("full", v, attrs={"value": 0})
        elif v.op == "reduce" and z[0]:
            r = new("full", v, attrs={"value": 0})
        elif v.op in ("cat",) and all(z):
            r = new("full", v, attrs={"value": 0})
        elif v.op == "add" and any(z):
            r = (new("full", v, attrs={"value": 0}) if all(z) else
                 a[0] if z[1] and same(a[0], v) else a[1] if z[0] and same(a[1], v) else None)
        elif v.op == "sub" and any(z):
            r = (new("full", v, attrs={"value": 0}) if all(z) else
                 a[0] if z[1] and same(a[0], v) else new("neg", v, (a[1],)) if z[0] and same(a[1], v) else None)
        elif v.op == "mul" and any(z) or v.op == "div" and z[0]:
            r = new("full", v, attrs={"value": 0})
        elif v.op == "where" and z[1] and z[2]:
            r = new("full", v, attrs={"value": 0})
        elif v.op == "convert" and isinstance(a[0], Value):
            src = a[0]  # a round trip exposed by a fold (x + 0 between the casts): its source
            if src.dtype == v.dtype:
                r = src
            elif src.op == "convert" and src.args[0].dtype == v.dtype and lossless(v.dtype, src.dtype):
                r = src.args[0]
        if r is None:
            values.append(v)
        else:
            rep[v.id] = r
    outs = [rep.get(o.id, o) for o in ir.outputs]
    return prune(RegionIR(ir.args, values, outs))


def prune(ir: RegionIR) -> RegionIR:
    """Drop values no output depends on (arguments stay: they are the call signature)."""
    live: set[int] = set()
    stack = list(ir.outputs)
    while stack:
        v = stack.pop()
        if v.id in live:
            continue
        live.add(v.id)
        stack.extend(a for a in v.args if isinstance(a, Value))
    keep = [v for v in ir.values if v.id in live or v.op in ("input", "scalar")]
    return RegionIR(ir.args, keep, ir.outputs)


def view_plan(ir: RegionIR) -> tuple[int, list[tuple]] | None:
    """How the region's one computed output is a view of one input, when every op between them only
    moves elements (transpose, reshape, squeeze, unsqueeze-like broadcast, slice): (argument index,
    steps), steps ("permute", perm) / ("reshape", shape) / ("slice", start, step, shape) applied in
    order to the input's sizes and strides, ("contiguous",) where the view must be contiguous there
    (a `.contiguous()` in the trace). Whether each reshape is a view depends on the run-time
    strides (the launcher checks, as torch's reshape does); None when the region computes anything."""
    ko = ir.kernel_outputs()
    if len(ko) != 1:
        return None
    steps: list[tuple] = []
    v = ko[0]
    while v.op != "input":
        a = v.args[0] if v.args else None
        if v.op == "transpose":
            steps.append(("permute", tuple(v.attrs["perm"])))
        elif v.op in ("reshape", "squeeze"):
            steps.append(("contiguous",) if v.attrs.get("contiguous") else ("reshape", v.shape))
        elif v.op == "broadcast_in_dim":
            bd = v.attrs["bdims"]
            if (any(a.shape[j] != v.shape[d] for j, d in enumerate(bd))
                    or any(v.shape[d] != 1 for d in range(v.ndim) if d not in bd)):
                return None  # an expansion: a stride-0 output would be a different kind of tensor
            steps.append(("reshape", v.shape))
        elif v.op == "slice":
            if any(s < 1 for s in v.attrs["step"]):
                return None
            steps.append(("slice", tuple(v.attrs["start"]), tuple(v.attrs["step"]), v.shape))
        else:
            return None
        v = a
    steps.reverse()
    return v.attrs["index"], steps
