"""linear: `F.linear` for 16-bit weights whose out_features is not a multiple of 8 (GPT-2's lm_head:
768 -> 50257), computed at a padded width.

cuBLAS picks its fast Hopper kernels only when every matrix dimension it is given keeps 16-byte
alignment; an odd output count drops it to a generic kernel. Measured on an H200 (bf16, x 8192 x
768, weight 50257 x 768; `dev/lm_head_probe.py`, BENCHMARKS.md): forward 6.69 ms, the
backward's two GEMMs 4.57 + 4.30 ms; at 50304 outputs 0.89, 0.81 and 0.80 ms. That one layer was
half of a GPT-2 124M training step under eager PyTorch and Thunder.

So kforge pads the weight (and bias) with zero rows to a multiple of `PAD` outputs, runs the GEMM at
the padded width and returns the first out_features columns as a view (row stride = the padded
width): the output is not copied. kforge's cross-entropy reads such logits in place. Backward: the
gradient is padded to the same width (a copy, unless it already lies in a buffer of that width
whose padding kforge's cross-entropy backward zeroed), then dx = g_pad @ w_pad and dw = (g_pad^T @
x)[:out_features], both aligned GEMMs. The padded weight is rebuilt in the backward (0.05 ms)
rather than saved (77 MB at GPT-2's size). No kernels of kforge's own: cuBLAS through torch.

Claims `thunder.torch.linear` (and `prims.linear`, what Thunder's autocast writes) only where it pays: bf16 / fp16 CUDA tensors of one dtype,
out_features >= 1024 and not a multiple of 8, in_features a multiple of 8 (else padding the output
alone does not give aligned GEMMs). fp32 is declined: its cuBLAS kernels do not depend on alignment
(same 12.5 ms at 50257 and 50304).

`torch.addmm` (Hugging Face's Conv1D: GPT-2's attention and MLP layers) becomes `kforge_addmm`: one
GEMM forward and two GEMMs back for 16-bit CUDA operands, its decomposition elsewhere (see the
section below). fp32 layers read by an add get their bias moved into the add (`LinearBiasSplit`).
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
import thunder.torch as ltorch
from thunder.core import prims
from thunder.core import dtypes
from thunder.core.proxies import TensorProxy
from thunder.core.transform_common import Transform
from thunder.core.transforms import get_grad, put_grad, sum_to

from .._thunder import Claim, OpSpec, operator, replace_calls, same_dtype_device, tensor_problem
from ..fusion.matmul_acc import widen_mm  # stdlib and torch only at import: no cycle

PAD = 64           # outputs are padded to a multiple of this (GPT-2: 50257 -> 50304, as llm.c does)
MIN_OUT = 1024     # below this the GEMMs are too small for the padding to matter
_ALIGN = 8         # 16 bytes of a 16-bit type


def padded(n: int) -> int:
    """out_features rounded up to a multiple of PAD."""
    return -(-n // PAD) * PAD


# Buffers whose padding columns kforge's cross-entropy backward zeroed, by data pointer, each with a
# weak reference to the buffer (a live buffer's address cannot be reused, so a live entry is exact).
_zero_padded: dict[int, weakref.ref] = {}


def mark_zero_padded(grad: torch.Tensor) -> None:
    """Records that `grad` (a column slice of a dense buffer) has zeros in the buffer's other columns,
    so `linear_backward` may use the buffer as the padded gradient without a copy."""
    base = grad._base
    if base is None:
        return
    for k in [k for k, r in _zero_padded.items() if r() is None]:
        del _zero_padded[k]
    _zero_padded[base.data_ptr()] = weakref.ref(base)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t with zero rows (dim 0) appended up to `rows`."""
    pad = [0, 0] * (t.dim() - 1) + [0, rows - t.shape[0]]
    return F.pad(t, pad)


def linear_forward_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed at the padded width; a view of the padded output."""
    n = weight.shape[0]
    wp = _pad_rows(weight, padded(n))
    bp = None if bias is None else _pad_rows(bias, padded(n))
    return F.linear(x, wp, bp)[..., :n]


def _padded_grad(g: torch.Tensor, n: int) -> torch.Tensor:
    """g (M, n) as an (M, padded(n)) matrix with zeros (or kforge-zeroed values) past column n."""
    npad = padded(n)
    m = g.shape[0]
    base = g._base
    if (base is not None and g.stride() == (npad, 1) and base.is_contiguous()
            and base.numel() == m * npad and g.data_ptr() == base.data_ptr()):
        ref = _zero_padded.get(base.data_ptr())
        if ref is not None and ref() is base:
            return base.view(m, npad)
    return F.pad(g, (0, npad - n))


def linear_backward_impl(g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool,
                         dw_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dx, dweight, dbias | None) of F.linear at the padded width; dw_dtype float32: dweight stored
    as float32 by the GEMM itself (an fp32 weight under autocast: kforge.fusion.matmul_acc.widen_matmuls)."""
    n, k = weight.shape
    g2 = g.reshape(-1, n)
    gp = _padded_grad(g2, n)
    wp = _pad_rows(weight, padded(n))
    dx = (gp @ wp).reshape(x.shape)
    if dw_dtype == torch.float32:
        dw = widen_mm(gp.t(), x.reshape(-1, k))[:n]
    else:
        dw = (gp.t() @ x.reshape(-1, k))[:n]
    db = g2.sum(0) if has_bias else None
    return dx, dw, db


def _forward_meta(x: TensorProxy, weight: TensorProxy, bias: TensorProxy | None) -> TensorProxy:
    return TensorProxy(like=x, shape=(*x.shape[:-1], weight.shape[0]))


def _backward_meta(g: TensorProxy, x: TensorProxy, weight: TensorProxy, has_bias: bool, dw_dtype: Any = None):
    dw = TensorProxy(like=weight) if dw_dtype is None else TensorProxy(like=weight, dtype=dtypes.to_dtype(dw_dtype))
    return (TensorProxy(like=x), dw, TensorProxy(like=weight, shape=(weight.shape[0],)) if has_bias else None)


# (x, weight, bias | None) -> out (a view of the padded-width output)
linear_forward = operator("linear_forward", meta=_forward_meta, fn=linear_forward_impl)
# (dout, x, weight, has_bias[, dw_dtype]) -> (dx, dweight, dbias | None)
linear_backward = operator("linear_backward", meta=_backward_meta, fn=linear_backward_impl)


def _checker(a: Any, w: Any, bias: Any = None) -> str | None:
    """None when kforge takes `ltorch.linear(a, w, bias)`, else why not."""
    for t, name in ((a, "input"), (w, "weight")):
        if problem := tensor_problem(t, name):
            return problem
    if dtypes.to_torch_dtype(a.dtype) not in (torch.bfloat16, torch.float16):
        return f"{dtypes.to_torch_dtype(a.dtype)}: only 16-bit layers gain from padding"
    if problem := same_dtype_device(a, w, "weight"):
        return problem
    if w.ndim != 2 or a.ndim < 1 or a.shape[-1] != w.shape[1]:
        return f"shapes {tuple(a.shape)} x {tuple(w.shape)} are not a linear layer's"
    n, k = w.shape
    if n < MIN_OUT:
        return f"out_features {n} < {MIN_OUT}: too small for padding to pay"
    if k % _ALIGN:
        return f"in_features {k} is not a multiple of {_ALIGN}"
    if bias is not None:
        if not isinstance(bias, TensorProxy) or bias.ndim != 1 or bias.shape[0] != n:
            return f"bias is not a ({n},) tensor"
        if problem := same_dtype_device(a, bias, "bias"):
            return problem
    return None


def _applies(a: Any, w: Any, bias: Any = None) -> bool:
    """Only 16-bit layers with a misaligned output count are this op's kind: the rest (every
    aligned layer, and fp32 ones, whose cuBLAS kernels do not depend on alignment) stay with torch
    without a decline logged for each."""
    return (isinstance(w, TensorProxy) and w.ndim == 2 and w.shape[0] % _ALIGN != 0
            and dtypes.to_torch_dtype(w.dtype) in (torch.bfloat16, torch.float16))


def _execution(a: TensorProxy, w: TensorProxy, bias: TensorProxy | None = None) -> TensorProxy:
    return linear_forward(a, w, bias)


def _grad(a: TensorProxy, w: TensorProxy, bias: TensorProxy | None = None) -> TensorProxy:
    # Saved for backward: x and the weight (the padded weight is rebuilt there).
    out = linear_forward(a, w, bias)
    dx, dw, db = linear_backward(get_grad(out), a, w, bias is not None)
    put_grad(a, dx)
    put_grad(w, dw)
    if bias is not None:
        put_grad(bias, db)
    return out


# ---- torch.addmm: Hugging Face's Conv1D (GPT-2's attention and MLP layers) ----------------------
# `torch.addmm(bias, x, w)` with w stored (in, out). Thunder 0.2.6 has no symbol of its own for it and
# registers it automatically: an opaque forward, and a backward that calls
# `torch.autograd.functional.vjp`, which runs the forward's GEMM again and costs autograd's
# bookkeeping on every call. With kforge as an executor, `torch.addmm` becomes `kforge_addmm`:
# - 16-bit CUDA, beta = alpha = 1 (what Conv1D calls): the forward is torch.addmm itself (one GEMM
#   with cuBLAS's bias epilogue); the backward is two GEMMs, dx = g @ w^T and dw = x^T @ g (stored
#   as w is, (in, out), so autograd takes it as the parameter's gradient without a copy), and the
#   bias gradient a sum over rows.
# - anything else: the decomposition, beta * input + alpha * (mat1 @ mat2), which Thunder
#   differentiates and kforge's fusion executor fuses. fp32 takes it on purpose: the bias epilogue's
#   fp32 cuBLAS kernel is slower than the plain GEMM plus an add fused with its reader, as for
#   fp32 `F.linear` (LinearBiasSplit below; docs/experiments/linear.md).
# Under torch.autocast, tensors are cast to the autocast dtype first, as torch's autocast does for
# addmm, so the result is 16-bit as in eager.
def _addmm_like(input: TensorProxy, mat1: TensorProxy, mat2: TensorProxy, *, beta: Any = 1,
                alpha: Any = 1) -> TensorProxy:
    # torch.addmm's own checks, then its definition in thunder.torch ops: kforge_addmm's meta and
    # its decomposition. beta = 0 ignores input (NaN / inf in it are not propagated), as in torch.
    from thunder.core import utils

    for t, name in ((input, "input"), (mat1, "mat1"), (mat2, "mat2")):
        utils.check(isinstance(t, TensorProxy), lambda: f"addmm: {name} is {type(t).__name__}, not a tensor")
    utils.check(mat1.ndim == 2 and mat2.ndim == 2,
                lambda: f"addmm: mat1 and mat2 must be matrices, got {mat1.ndim}-D and {mat2.ndim}-D")
    utils.check(mat1.shape[1] == mat2.shape[0],
                lambda: f"addmm: mat1 {tuple(mat1.shape)} and mat2 {tuple(mat2.shape)} cannot be multiplied")
    utils.check(mat1.dtype == mat2.dtype == input.dtype,
                lambda: f"addmm: input, mat1 and mat2 dtypes differ ({input.dtype}, {mat1.dtype}, {mat2.dtype})")
    out = ltorch.matmul(mat1, mat2)
    if alpha != 1:
        out = ltorch.mul(out, alpha)
    if beta == 0:
        return out
    return ltorch.add(out, input if beta == 1 else ltorch.mul(input, beta))


def _addmm_meta(input: TensorProxy, mat1: TensorProxy, mat2: TensorProxy) -> TensorProxy:
    return TensorProxy(like=mat1, shape=(mat1.shape[0], mat2.shape[1]))


# (input, mat1, mat2) -> torch.addmm(input, mat1, mat2): the claimed forward
addmm_forward = operator("addmm_forward", meta=_addmm_meta, fn=torch.addmm)
# fn: what runs when no executor takes the call and no gradient is needed (with one, Thunder
# differentiates the decomposition).
kforge_addmm = operator("addmm", like=_addmm_like, fn=torch.addmm, replaces=torch.addmm)


def _check_addmm(input: Any, mat1: Any, mat2: Any, *, beta: Any = 1, alpha: Any = 1) -> str | None:
    """None when kforge takes `torch.addmm(input, mat1, mat2, beta=, alpha=)` as one GEMM, else why
    not (the decomposition runs instead)."""
    for t, name in ((input, "input"), (mat1, "mat1"), (mat2, "mat2")):
        if problem := tensor_problem(t, name):
            return problem
    if dtypes.to_torch_dtype(mat1.dtype) not in (torch.bfloat16, torch.float16):
        return (f"{dtypes.to_torch_dtype(mat1.dtype)}: the GEMM plus a fused add beats the bias epilogue "
                "outside 16 bits")
    if (problem := same_dtype_device(mat1, mat2, "mat2")) or (problem := same_dtype_device(mat1, input, "input")):
        return problem
    if not (type(beta) in (int, float) and beta == 1 and type(alpha) in (int, float) and alpha == 1):
        return f"beta {beta!r} / alpha {alpha!r}: only beta = alpha = 1 is one GEMM here"
    if mat1.ndim != 2 or mat2.ndim != 2 or mat1.shape[1] != mat2.shape[0]:
        return f"shapes {tuple(mat1.shape)} x {tuple(mat2.shape)} are not a matrix product"
    n, p = mat1.shape[0], mat2.shape[1]
    if input.ndim > 2 or any(s not in (1, full) for s, full in zip(reversed(input.shape), (p, n))):
        return f"input {tuple(input.shape)} does not broadcast to ({n}, {p})"
    return None


def _addmm_execution(input, mat1, mat2, *, beta=1, alpha=1):
    return addmm_forward(input, mat1, mat2)


def _addmm_grad(input, mat1, mat2, *, beta=1, alpha=1):
    # Saved for backward: mat1 and mat2. Each gradient comes out in its input's layout.
    out = addmm_forward(input, mat1, mat2)
    g = get_grad(out)
    put_grad(mat1, ltorch.matmul(g, ltorch.permute(mat2, (1, 0))))
    put_grad(mat2, ltorch.matmul(ltorch.permute(mat1, (1, 0)), g))
    put_grad(input, sum_to(g, tuple(input.shape)))
    return out


def _register_addmm_autocast() -> None:
    """Thunder's autocast rule for kforge_addmm: fp32 tensors cast to the autocast dtype, as torch's
    autocast casts addmm's arguments (its lower-precision list)."""
    from thunder.transforms.autocast import autocast_impls, maybe_downcast_to

    def rule(input, mat1, mat2, *, beta=1, alpha=1, dtype):
        input, mat1, mat2 = maybe_downcast_to(dtype, (input, mat1, mat2))
        return kforge_addmm(input, mat1, mat2, beta=beta, alpha=alpha)

    autocast_impls.setdefault(kforge_addmm.id, rule)


_register_addmm_autocast()


# Under torch.autocast, Thunder's autocast rule writes the cast weight's linear as `prims.linear`
# (not thunder.torch.linear): the same signature and semantics, claimed the same way, else the
# autocast lm_head runs unpadded (GPT-2 124M: three ~5 ms GEMMs per step instead of ~1 ms ones).
SPEC = OpSpec("linear", (Claim(ltorch.linear, _checker, _execution, _grad, applies=_applies),
                         Claim(prims.linear, _checker, _execution, _grad, applies=_applies),
                         Claim(kforge_addmm, _check_addmm, _addmm_execution, _addmm_grad)))


# ---- fp32 linear layers whose output feeds a residual add: the bias goes to the add ---------------
# For fp32 `F.linear(x, w, b)` PyTorch calls cuBLASLt's GEMM with a bias epilogue, whose kernel choice
# differs from the plain GEMM's. At GPT-2's MLP down-projection at B=4, T=64 (x 256 x 3072, w 768 x
# 3072, fp32, H200) it is a SIMT CUTLASS kernel at 99 us against 57 us for the plain GEMM
# (docs/experiments/linear.md); bf16 layers get the fast kernel with or without bias. Where every
# reader of the output is an add / sub / mul that kforge's fusion executor will take, the bias add
# costs nothing there: the layer becomes `linear(x, w) + b` before autograd, and the broadcast add
# fuses with its reader (the bias gradient is the same sum over leading dims either way).
_SPLIT_READERS = frozenset({"torch.add", "torch.sub", "torch.mul"})


def _layer(b: Any) -> tuple[Any, Any, Any]:
    """(x, weight, bias) of an `F.linear` bound symbol, however its arguments were passed."""
    args = list(b.args) + [None] * 3
    return args[0], args[1], args[2] if len(b.args) >= 3 else b.kwargs.get("bias")


class LinearBiasSplit(Transform):
    """A Thunder transform (pre-prologue, on the computation trace): fp32 CUDA `F.linear` layers with
    a bias whose output is read only by adds / subs / muls become `F.linear(x, w) + b`, when kforge's
    fusion executor is in the executor list and no torch.autocast is active. `splits` counts the
    layers rewritten by the last trace."""

    def __init__(self) -> None:
        super().__init__()
        self.splits = 0

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        return prologue_trace, self.rewrite(computation_trace, kwargs.get("executors_list")), epilogue_trace

    def rewrite(self, trace: Any, executors_list: Any = None) -> Any:
        """`trace` with the layers split (or `trace` itself if none is)."""
        from ..fusion import get_fusion_executor
        from ..transforms import _Graph

        self.splits = 0
        if executors_list is None or get_fusion_executor() not in executors_list:
            return trace
        if torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu"):
            return trace  # the layer runs in 16 bits after Thunder's autocast rule
        g = _Graph(trace)

        def replacement(b: Any):
            if not self._splits(b, g):
                return None
            x, w, bias = _layer(b)
            return lambda: ltorch.add(ltorch.linear(x, w, None), bias)

        trace, self.splits = replace_calls(trace, replacement, "kforge linear bias split ({} layers)")
        return trace

    @staticmethod
    def _splits(b: Any, g: Any) -> bool:
        if b.sym.id != ltorch.linear.id:
            return False
        x, w, bias = _layer(b)
        if not all(isinstance(t, TensorProxy) for t in (x, w, bias)) or bias.ndim != 1:
            return False
        if any(dtypes.to_torch_dtype(t.dtype) != torch.float32 or t.device.type != "cuda" for t in (x, w, bias)):
            return False
        out = b.output
        users = g.consumers(out)
        return bool(users) and all(u.sym.id in _SPLIT_READERS for u in users)
