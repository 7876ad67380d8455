"""Grouped matrix products of mixture-of-experts layers (no kernel of its own).

A mixture-of-experts layer sorts its (token, expert) pairs by expert and multiplies each expert's
rows by that expert's weight: `out[r] = a[r] @ b[e]` for the rows r of group e, the groups
delimited by `offs` (cumulative row counts, int32, one per expert). Hugging Face's MoE models
(Mixtral, Qwen2/3-MoE, OLMoE, ...) call it through `torch.nn.functional.grouped_mm` /
`torch._grouped_mm` for bf16 weights and through their own custom op,
`torch.ops.transformers.grouped_mm_fallback`, otherwise: always under Thunder, which answers
"compiling" to transformers' check, for fp32 weights (fp32 training, autocast). Thunder 0.2.6 knows
no such custom op (the trace stopped: "transformers.grouped_mm_fallback is not registered") and has
no gradient for `_grouped_mm` (a training trace stopped there too).

Thunder symbols:
    kforge_grouped_mm(a, b, offs) -> out
        a (S, K), b (E, K, N), offs (E,) integer: out (S, N) in a's dtype. transformers' custom op
        and `torch._grouped_mm(a, b, offs=offs)` (2-D by 3-D, no bias, no out_dtype) become it.
    kforge_torch_grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None)
        what `torch._grouped_mm` (and F.grouped_mm) become under kforge: Thunder 0.2.6's own symbol
        takes `offsets=` and rejected torch's `offs=`. The experts' form decomposes to
        kforge_grouped_mm, the others to Thunder's symbol.
    kforge_grouped_mm_forward(a, b, offs) -> out
    kforge_grouped_mm_backward(g, a, b, offs) -> (da, db)
        da = grouped g @ b[e]^T (S, K); db[e] = a[group e]^T @ g[group e] (E, K, N), zero for an
        empty group.

Execution: `torch._grouped_mm` (CUTLASS grouped GEMMs, no host sync) for bf16 CUDA tensors whose
rows are 16-byte aligned and int32 offsets, as torch documents it; elsewhere (fp32 / fp16, the CPU, odd widths) one
`torch.mm` per non-empty group, which reads the offsets on the host once per call, as transformers'
own fallback does. Rows past offs[-1] (expert-parallel sentinels) are written as zeros there and
left unspecified by torch's kernel; transformers masks them either way.
"""
from __future__ import annotations

from typing import Any

import torch
import thunder.torch as ltorch
from thunder.core import dtypes, utils
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .._thunder import Claim, OpSpec, operator

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# ---- execution ----------------------------------------------------------------------------------------
def _aligned(t: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule: one of the last two dims contiguous, the other's stride a
    multiple of 16 bytes, and a 16-byte aligned start."""
    unit = 16 // t.element_size()
    s, n = t.stride(), t.shape
    row_major = s[-1] == 1 and s[-2] >= max(1, n[-1]) and s[-2] % unit == 0
    col_major = s[-2] == 1 and s[-1] >= max(1, n[-2]) and s[-1] % unit == 0
    return (row_major or col_major) and t.data_ptr() % 16 == 0


def _fast(offs: torch.Tensor, *ts: torch.Tensor) -> bool:
    return offs.dtype == torch.int32 and all(t.is_cuda and t.dtype == torch.bfloat16 and _aligned(t) for t in ts)


def _bounds(offs: torch.Tensor) -> list[tuple[int, int, int]]:
    """[(group, start, end)] of the non-empty groups: the one host read of the offsets."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out.append((e, start, end))
        start = max(start, end)
    return out


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[r] = a[r] @ b[e] for the rows r of group e (a (S, K), b (E, K, N), offs (E,) cumulative)."""
    if _fast(offs, a, b):
        return torch._grouped_mm(a, b, offs=offs)
    out = torch.zeros(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
    for e, s, t in _bounds(offs):
        torch.mm(a[s:t], b[e], out=out[s:t])
    return out


def grouped_mm_grads(g: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     offs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of `grouped_mm(a, b, offs)` for the output gradient g."""
    bt, at = b.transpose(-2, -1), a.t()
    if _fast(offs, g, bt, at):
        # the weight gradient is the 2-D by 2-D form: a^T (K, S) and g (S, N) split along S
        return torch._grouped_mm(g, bt, offs=offs), torch._grouped_mm(at, g, offs=offs)
    da = torch.zeros_like(a, memory_format=torch.contiguous_format)
    db = torch.zeros(b.shape, dtype=b.dtype, device=b.device)
    for e, s, t in _bounds(offs):
        torch.mm(g[s:t], bt[e], out=da[s:t])
        torch.mm(at[:, s:t], g[s:t], out=db[e])
    return da, db


# ---- Thunder symbols ----------------------------------------------------------------------------------
def _shape_problem(a: Any, b: Any, offs: Any) -> str | None:
    for t, name in ((a, "a"), (b, "b"), (offs, "offs")):
        if not isinstance(t, TensorProxy):
            return f"{name} is {type(t).__name__}, not a tensor"
    if a.ndim != 2 or b.ndim != 3 or offs.ndim != 1:
        return f"a {tuple(a.shape)}, b {tuple(b.shape)}, offs {tuple(offs.shape)} are not (S, K), (E, K, N), (E,)"
    if a.shape[1] != b.shape[1]:
        return f"a {tuple(a.shape)} and b {tuple(b.shape)}: inner dims differ"
    if offs.shape[0] != b.shape[0]:
        return f"offs has {offs.shape[0]} groups, b {b.shape[0]}"
    if not dtypes.is_integer_dtype(offs.dtype):
        return f"offs dtype {dtypes.to_torch_dtype(offs.dtype)} is not an integer type"
    if dtypes.to_torch_dtype(a.dtype) not in _FLOATS or a.dtype != b.dtype:
        return f"a and b dtypes {dtypes.to_torch_dtype(a.dtype)}, {dtypes.to_torch_dtype(b.dtype)}: not one float type"
    if not (a.device == b.device == offs.device):
        return f"a, b and offs are on {a.device}, {b.device}, {offs.device}"
    return None


def _grouped_mm_like(a: TensorProxy, b: TensorProxy, offs: TensorProxy) -> TensorProxy:
    # kforge_grouped_mm's meta and its decomposition (what a declined call runs: torch._grouped_mm)
    problem = _shape_problem(a, b, offs)
    utils.check(problem is None, lambda: f"grouped_mm: {problem}")
    return ltorch._grouped_mm(a, b, offs)


def _forward_meta(a: TensorProxy, b: TensorProxy, offs: TensorProxy) -> TensorProxy:
    return TensorProxy(like=a, shape=(a.shape[0], b.shape[2]))


def _backward_meta(g: TensorProxy, a: TensorProxy, b: TensorProxy, offs: TensorProxy) -> tuple:
    return TensorProxy(like=a), TensorProxy(like=b)


grouped_mm_forward = operator("grouped_mm_forward", meta=_forward_meta, fn=grouped_mm)
grouped_mm_backward = operator("grouped_mm_backward", meta=_backward_meta, fn=grouped_mm_grads)
kforge_grouped_mm = operator("grouped_mm", like=_grouped_mm_like, fn=grouped_mm)


def _torch_like(mat_a: TensorProxy, mat_b: TensorProxy, offs: TensorProxy | None = None,
                bias: TensorProxy | None = None, out_dtype: Any = None) -> TensorProxy:
    # torch._grouped_mm in torch's own signature (F.grouped_mm calls it with offs=, which Thunder
    # 0.2.6's symbol, taking offsets=, rejects): the experts' form is kforge_grouped_mm, the others
    # Thunder's symbol.
    same = out_dtype is None or dtypes.to_dtype(out_dtype) == mat_a.dtype
    if offs is not None and bias is None and same and _shape_problem(mat_a, mat_b, offs) is None:
        return kforge_grouped_mm(mat_a, mat_b, offs)
    return ltorch._grouped_mm(mat_a, mat_b, offs, bias, out_dtype)


def map_custom_ops() -> bool:
    """Make transformers' `grouped_mm_fallback` custom op (its packet and overload) kforge_grouped_mm
    in compilations with kforge's executor (an executor lookaside: Thunder's own compilations keep
    their behaviour); True when it exists. transformers registers the op when its MoE integration is
    imported, so kforge's compilations call this again."""
    ns = getattr(torch.ops, "transformers", None)
    try:
        packet = getattr(ns, "grouped_mm_fallback") if ns is not None else None
    except (AttributeError, RuntimeError):
        packet = None
    if packet is None:
        return False
    from .._thunder import executor

    for fn in (packet, packet.default):
        executor._lookasides.setdefault(fn, kforge_grouped_mm)
    return True


map_custom_ops()
if hasattr(torch, "_grouped_mm") and hasattr(ltorch, "_grouped_mm"):
    kforge_torch_grouped_mm = operator("torch_grouped_mm", like=_torch_like, fn=torch._grouped_mm,
                                       replaces=torch._grouped_mm)


# ---- claims -------------------------------------------------------------------------------------------
def _check(a: Any, b: Any, offs: Any) -> str | None:
    return _shape_problem(a, b, offs)


def _check_torch(a: Any, b: Any, offsets: Any = None, bias: Any = None, dtype: Any = None) -> str | None:
    if offsets is None or bias is not None:
        return "only the offsets form without a bias is a grouped product of experts here"
    if dtype is not None and dtype != getattr(a, "dtype", None):
        return f"out dtype {dtype} differs from the inputs'"
    return _shape_problem(a, b, offsets)


def _execution(a, b, offs):
    return grouped_mm_forward(a, b, offs)


def _grad(a, b, offs):
    # Saved for backward: a, b and offs (the inputs; nothing is recomputed).
    out = grouped_mm_forward(a, b, offs)
    da, db = grouped_mm_backward(get_grad(out), a, b, offs)
    put_grad(a, da)
    put_grad(b, db)
    return out


def _torch_execution(a, b, offsets=None, bias=None, dtype=None):
    return grouped_mm_forward(a, b, offsets)


def _torch_grad(a, b, offsets=None, bias=None, dtype=None):
    return _grad(a, b, offsets)


_claims = [Claim(kforge_grouped_mm, _check, _execution, _grad)]
if hasattr(ltorch, "_grouped_mm"):  # thunder registers it for torch >= 2.8
    _claims.append(Claim(ltorch._grouped_mm, _check_torch, _torch_execution, _torch_grad))
SPEC = OpSpec("grouped_mm", tuple(_claims))
