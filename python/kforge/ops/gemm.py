"""gemm: the matrix products of kforge's traces called on cuBLASLt directly (src/ops/gemm.cpp).

A training step of a 124M-parameter model calls about 250 GEMMs. Through torch each call costs
20-25 us of host time on the GPU machine (`dev/host_profile.py`: torch.matmul, F.linear and addmm
were a third of the host time of a plain Llama step), against ~5 us for one of kforge's launchers,
and those steps are bound by host time. kforge's `_C.gemm_*` functions look a plan up by shape (the
matmul descriptor, layouts and the kernel cuBLASLt's heuristic chose, made on the first call of that
shape) and launch it on PyTorch's current stream with torch's own cuBLASLt handle and workspace.

`GemmCalls`, a post-optimization transform, rewrites the final forward and backward traces:

    torch.matmul(a, b)                   2-D a, b                -> kforge_gemm_mm(a, b)
    F.linear(x, w, bias)                 (what Thunder left to torch) -> kforge_gemm_linear(x, w, bias)
    kforge_matmul_accumulate(c, a, w)    c += a @ w              -> kforge_gemm_addmm_(c, a, w)
    kforge_matmul_widen(a, w)            fp32 result             -> kforge_gemm_mm_widen(a, w)
    kforge_addmm_forward(bias, a, w)     HF's Conv1D             -> kforge_gemm_addmm(bias, a, w)

for CUDA tensors of one float dtype (bf16, fp16, fp32). Each name computes what it replaces with the
same arithmetic (fp32 accumulation; TF32 only where torch allows it); a call whose run-time
strides, alignment or torch settings are off the fast path goes to the ATen op it replaces, inside
the same C++ call. `kforge._C.gemm_stats()` counts both kinds of calls.

Off by default until measured on a GPU: KFORGE_GEMM=1 turns it on for `kforge.jit` / `kforge.compile`.
"""
from __future__ import annotations

from typing import Any

from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.transform_common import Transform

from .. import _C
from .._thunder import OpSpec, operator, tensor_problem

__all__ = ["GemmCalls", "rewrite"]


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

def _cuda_floats(*ts: Any) -> bool:
    """All tensors, on one CUDA device, of one float dtype kforge's plans take (fp32, bf16, fp16)."""
    if not all(isinstance(t, TensorProxy) for t in ts):
        return False
    first = ts[0]
    return (tensor_problem(first) is None
            and all(t.device == first.device and t.dtype == first.dtype for t in ts))


def _replacement(b: Any) -> Any | None:
    """The kforge_gemm_* call that computes `b`, or None to keep it."""
    name = b.sym.name
    ex = getattr(getattr(b.sym, "executor", None), "name", None)
    args = b.args
    out = b.output
    if ex == "torch" and name == "matmul" and len(args) == 2 and not b.kwargs:
        a, w = args
        if _cuda_floats(a, w) and a.ndim == 2 and w.ndim == 2:
            return gemm_mm.bind(a, w, output=out)
    elif ex == "torch" and name == "linear" and len(args) in (2, 3) and not b.kwargs:
        x, w = args[:2]
        bias = args[2] if len(args) == 3 else None
        if (_cuda_floats(x, w, *(() if bias is None else (bias,))) and x.ndim >= 2 and w.ndim == 2
                and (bias is None or bias.ndim == 1)):
            return gemm_linear.bind(x, w, bias, output=out)
    elif ex == "kforge" and name == "kforge_matmul_accumulate":
        c, a, w = args
        if _cuda_floats(c, a, w):
            return gemm_addmm_.bind(c, a, w, output=out)
    elif ex == "kforge" and name == "kforge_matmul_widen":
        a, w = args
        if _cuda_floats(a, w):
            return gemm_mm_widen.bind(a, w, output=out)
    elif ex == "kforge" and name == "kforge_addmm_forward":
        bias, a, w = args
        if _cuda_floats(bias, a, w):
            return gemm_addmm.bind(bias, a, w, output=out)
    return None


def rewrite(trace: Any) -> Any:
    """`trace` with its GEMM calls on kforge's cuBLASLt plans (see the module docstring); `trace`
    itself when it has none."""
    from thunder.core.trace import TraceProvenance, from_trace

    bsyms = []
    count = 0
    for b in trace.bound_symbols:
        nb = _replacement(b)
        if nb is None:
            bsyms.append(b)
            continue
        nb.tags.update(b.tags)
        bsyms.append(nb)
        count += 1
    if not count:
        return trace
    new = from_trace(trace)
    new.bound_symbols = bsyms
    new.set_provenance(TraceProvenance(f"kforge: {count} GEMM calls on cuBLASLt plans"))
    return new


class GemmCalls(Transform):
    """Post-optimization: the final traces' GEMMs called on kforge's cuBLASLt plans (kforge.ops.gemm)."""

    def transform_trace_post_optimization(self, computation_trace: Any, **kwargs: Any) -> Any:
        return rewrite(computation_trace)


def stats() -> dict:
    """{cublaslt: found, fast_calls, aten_calls, plans, plans_without_kernel} since the process started."""
    return dict(_C.gemm_stats())


def enabled() -> bool:
    """Whether kforge.jit / kforge.compile add GemmCalls (KFORGE_GEMM, default off)."""
    from .. import _env

    return _env.flag("KFORGE_GEMM")

