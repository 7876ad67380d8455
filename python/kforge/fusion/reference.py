"""Evaluate a region's IR with torch ops: the meaning of the IR, independent of the code generator.

Each value is computed as the generated kernel computes it (16-bit floats in fp32, rounded to their
dtype after every op), one torch op per IR op. Tests compare it with Thunder's own execution of the
region (is the lowering right?) and with the generated kernels (is the code right?).
"""
from __future__ import annotations

from numbers import Number
from typing import Any, Sequence

import torch

from .ir import FLOATS, RegionIR, Value, torch_dtype

__all__ = ["evaluate"]


def _compute_dtype(d: str) -> torch.dtype:
    return torch.float32 if d in FLOATS else (torch.bool if d == "bool" else torch.int64)


def _round(x: torch.Tensor, d: str) -> torch.Tensor:
    if d in ("bf16", "f16"):
        return x.to(torch_dtype(d)).to(torch.float32)
    return x


def evaluate(ir: RegionIR, args: Sequence[Any]) -> list[torch.Tensor]:
    """The region's outputs for `args` (tensors and numbers, in the region's argument order)."""
    env: dict[int, Any] = {}
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))

    def get(a: Any, compute: torch.dtype) -> Any:
        if isinstance(a, Value):
            x = env[a.id]
            if isinstance(x, torch.Tensor):
                return x.to(compute)
            return x
        return a

    for v in ir.values:
        op = v.op
        cd = _compute_dtype(v.dtype)
        if op == "input":
            env[v.id] = args[v.attrs["index"]].to(_compute_dtype(v.dtype))
        elif op == "scalar":
            env[v.id] = args[v.attrs["index"]]
        elif op == "const":
            env[v.id] = v.attrs["value"]
        elif op == "full":
            val = env[v.args[0].id] if v.args else v.attrs["value"]
            env[v.id] = _round(torch.full(v.shape, val, dtype=cd, device=device), v.dtype)
        elif op == "iota":
            n = v.shape[0]
            env[v.id] = _round((v.attrs["start"] + torch.arange(n, device=device, dtype=torch.float64)
                                * v.attrs["step"]).to(cd), v.dtype)
        elif op == "convert":
            a = env[v.args[0].id]
            x = a.to(torch_dtype(v.dtype)).to(cd)
            env[v.id] = x
        elif op == "broadcast_in_dim":
            a = env[v.args[0].id]
            bd = v.attrs["bdims"]
            shape = [1] * len(v.shape)
            for j, d in enumerate(bd):
                shape[d] = a.shape[j]
            env[v.id] = a.reshape(shape).expand(v.shape)
        elif op == "reshape":
            env[v.id] = env[v.args[0].id].reshape(v.shape)
        elif op == "transpose":
            env[v.id] = env[v.args[0].id].permute(v.attrs["perm"])
        elif op == "squeeze":
            env[v.id] = env[v.args[0].id].reshape(v.shape)
        elif op == "slice":
            a = env[v.args[0].id]
            idx = tuple(slice(st, st + sp * (n - 1) + 1, sp) for st, sp, n in zip(v.attrs["start"], v.attrs["step"], v.shape))
            env[v.id] = a[idx]
        elif op == "flip":
            env[v.id] = env[v.args[0].id].flip(v.attrs["dims"]) if v.attrs["dims"] else env[v.args[0].id]
        elif op == "cat":
            env[v.id] = torch.cat([env[a.id] for a in v.args], v.attrs["dim"])
        elif op == "pad":
            a = env[v.args[0].id]
            val = v.attrs["value"]
            out = torch.full(v.shape, float(val) if a.is_floating_point() else val, dtype=a.dtype, device=device)
            out = _round(out, v.dtype)
            src = []
            dst = []
            ok = True
            for (lo, hi, dil), n_in, n_out in zip(v.attrs["config"], a.shape, v.shape):
                pos = torch.arange(n_in, device=device) * (dil + 1) + lo
                keep = (pos >= 0) & (pos < n_out)
                src.append(torch.nonzero(keep).flatten())
                dst.append(pos[keep])
                ok = ok and len(src[-1]) > 0
            if ok:
                out[torch.meshgrid(*dst, indexing="ij")] = a[torch.meshgrid(*src, indexing="ij")]
            env[v.id] = out
        elif op == "reduce":
            a = env[v.args[0].id].to(torch.float32)
            dims, kind = v.attrs["dims"], v.attrs["kind"]
            if kind == "sum":
                r = a.sum(dims)
            elif kind == "amax":
                r = a.amax(dims)
            elif kind == "amin":
                r = a.amin(dims)
            elif kind == "mean":
                r = a.mean(dims)
            else:
                r = a.var(dims, correction=v.attrs["correction"])
            env[v.id] = _round(r, v.dtype)
        else:
            env[v.id] = _round(_elementwise(op, [get(a, cd if op != "where" else cd) for a in v.args], v, get), v.dtype)
            if v.dtype == "i32":
                env[v.id] = env[v.id].to(torch.int32).to(torch.int64)
    return [_output(env[o.id], o, device) for o in ir.outputs]


def _output(x: Any, o: Value, device: torch.device) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        x = torch.tensor(x, device=device)
    return x.to(torch_dtype(o.dtype)).reshape(o.shape).contiguous()


def _elementwise(op: str, xs: list[Any], v: Value, get) -> Any:
    compare = op in ("eq", "ne", "lt", "le", "gt", "ge")
    if compare or op in ("signbit", "isfinite"):
        srcs = [a for a in v.args if isinstance(a, Value)]
        cd = torch.float32 if any(a.dtype in FLOATS for a in srcs) else torch.int64
        xs = [get(a, cd) for a in v.args]
    if op == "where":
        xs = [get(v.args[0], torch.bool), *xs[1:]]
    t = [x if isinstance(x, torch.Tensor) else x for x in xs]
    fn = {
        "abs": torch.abs, "neg": torch.neg, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1,
        "log": torch.log, "log1p": torch.log1p, "log2": torch.log2, "log10": torch.log10, "sqrt": torch.sqrt,
        "rsqrt": torch.rsqrt, "reciprocal": torch.reciprocal, "sin": torch.sin, "cos": torch.cos,
        "tan": torch.tan, "tanh": torch.tanh, "sinh": torch.sinh, "cosh": torch.cosh, "asin": torch.asin,
        "acos": torch.acos, "atan": torch.atan, "asinh": torch.asinh, "acosh": torch.acosh,
        "atanh": torch.atanh, "erf": torch.erf, "erfc": torch.erfc, "erfinv": torch.erfinv,
        "lgamma": torch.lgamma, "floor": torch.floor, "ceil": torch.ceil, "round": torch.round,
        "trunc": torch.trunc, "sign": torch.sign, "signbit": torch.signbit, "isfinite": torch.isfinite,
        "bitwise_not": torch.bitwise_not,
        "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.true_divide, "pow": torch.pow,
        "maximum": torch.maximum, "minimum": torch.minimum, "atan2": torch.atan2, "fmod": torch.fmod,
        "remainder": torch.remainder, "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le,
        "gt": torch.gt, "ge": torch.ge, "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
        "bitwise_xor": torch.bitwise_xor, "where": torch.where, "lerp": torch.lerp,
    }[op]
    if op == "where":
        cd = _compute_dtype(v.dtype)
        t = [t[0]] + [x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=cd) for x in t[1:]]
    elif op in ("maximum", "minimum", "atan2", "fmod", "remainder", "lerp"):
        ref = next(x for x in t if isinstance(x, torch.Tensor))
        t = [x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=ref.dtype, device=ref.device) for x in t]
    if all(isinstance(x, Number) for x in t):
        return fn(torch.tensor(t[0]), *t[1:]) if len(t) > 1 else fn(torch.tensor(t[0]))
    if isinstance(t[0], Number) and len(t) == 2:
        ref = t[1]
        return fn(torch.tensor(t[0], dtype=ref.dtype, device=ref.device), t[1])
    return fn(*t)
