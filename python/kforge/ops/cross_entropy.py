"""cross_entropy: softmax + negative log-likelihood over (N, V) logits with int64 class targets.

Forward (`kforge_cross_entropy_forward`) reads the logits once and returns the loss, the per-row
logsumexp (fp32) and the device-side count of non-ignored targets; backward
(`kforge_cross_entropy_backward`) recomputes softmax from the saved logsumexp in one read of the
logits and one write of the gradient. See kernels_src/cross_entropy.cu for the kernels and for why
the gradient is not computed during the forward pass by default.

With KFORGE_CE_FUSED=1 (opt-in until measured in a training step) the grad transforms take the fused
path where its shared-memory kernel applies (bf16 / fp32 rows of 16 .. 112 KB, mean / sum): the forward
(`kforge_cross_entropy_forward_unit_grad`) writes the gradient for a loss gradient of 1 in the same
launch that computes the loss (one read of the logits instead of two), and the backward
(`kforge_cross_entropy_rescale`) scales it in place by the loss gradient it receives, a launch that
does nothing when that is 1 (loss.backward()). Thunder's backward consumes its saved tensors once, so
the in-place scale never meets the same buffer twice.

Row-strided logits (a column slice of a wider buffer, as kforge's padded linear returns) are read in
place, and their gradient comes back with the same row stride and zeros in the padding.

Claims `thunder.torch.cross_entropy` for 2-D logits (GPT-2's `F.cross_entropy(logits.view(-1, V),
targets.view(-1), ignore_index=-1)` reaches Thunder as (N, V) with (N,)), weight=None,
label_smoothing=0, reduction mean / sum / none, any ignore_index. Targets outside [0, V) that are not
ignore_index give a NaN loss (and NaN gradient rows) instead of PyTorch's device-side assert.

The loss on upcast logits, `F.cross_entropy(logits.float().view(-1, V), targets.view(-1))` (nanoGPT,
Hugging Face's loss), is the helper `cross_entropy_upcast(logits16, targets, ...)`: its operator
`kforge_cross_entropy_upcast` reads the 16-bit logits in place (the kernels compute in fp32 anyway)
and returns the fp32 loss of the fp32 computation, so the (N, V) fp32 copy of the logits (1.6 GB at
GPT-2's B=8, T=1024) and its fp32 gradient are never made; the gradient comes back in the logits'
dtype, as `.float()`'s backward would cast it. `kforge.transforms` rewrites the inline spelling into
the helper. Only the loss gradient itself (one number for mean / sum) is rounded to the logits' dtype
before the kernel scales by it: exact for 1 and powers of two, else 2^-9 relative (bf16), the size of
the rounding every dlogits element gets anyway.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C, _env
from .._thunder import Claim, OpSpec, operator, tensor_problem
from .linear import mark_zero_padded

_REDUCTIONS = ("mean", "sum", "none")


def _forward_meta(logits: TensorProxy, targets: TensorProxy, ignore_index: int, reduction: str):
    n = logits.shape[0]
    loss = TensorProxy(like=logits, shape=(n,) if reduction == "none" else ())
    lse = TensorProxy(like=logits, shape=(n,), dtype=dtypes.float32)
    n_valid = TensorProxy(like=logits, shape=(), dtype=dtypes.float32)
    return loss, lse, n_valid


def _backward_meta(grad: TensorProxy, logits: TensorProxy, targets: TensorProxy, lse: TensorProxy,
                   n_valid: TensorProxy, ignore_index: int, reduction: str) -> TensorProxy:
    return TensorProxy(like=logits)


# (logits, targets, ignore_index, reduction) -> (loss, lse (N,) f32, n_valid () f32)
cross_entropy_forward = operator("cross_entropy_forward", meta=_forward_meta, fn=_C.cross_entropy_forward)
def _mark_padded(dlogits: torch.Tensor) -> torch.Tensor:
    """dlogits in a padded layout (rows of row-strided logits, e.g. from kforge's padded linear: the
    gradient has their row stride, padding zeroed) marked so that the linear's backward takes the
    buffer as its padded gradient without a copy."""
    if dlogits.dim() == 2 and dlogits.stride(0) > dlogits.shape[1]:
        mark_zero_padded(dlogits)
    return dlogits


def _backward(grad: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
              n_valid: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """The launcher, its gradient marked when padded (_mark_padded)."""
    return _mark_padded(_C.cross_entropy_backward(grad, logits, targets, lse, n_valid, ignore_index, reduction))


# (grad, logits, targets, lse, n_valid, ignore_index, reduction) -> dlogits
cross_entropy_backward = operator("cross_entropy_backward", meta=_backward_meta, fn=_backward)


# ---- the fused path: the unit gradient in the forward, scaled in the backward -------------------------
def _unit_grad_meta(logits: TensorProxy, targets: TensorProxy, ignore_index: int, reduction: str):
    return (*_forward_meta(logits, targets, ignore_index, reduction), TensorProxy(like=logits))


def _unit_grad(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str):
    """(loss, lse, n_valid, dlogits for a loss gradient of 1), one fused launch (marked padded by the
    backward's _rescale, which hands it on)."""
    return _C.cross_entropy_forward_unit_grad(logits, targets, ignore_index, reduction)


def _unit_grad_f32_meta(logits: TensorProxy, targets: TensorProxy, ignore_index: int, reduction: str):
    loss, lse, n_valid, dlogits = _unit_grad_meta(logits, targets, ignore_index, reduction)
    return TensorProxy(like=loss, dtype=dtypes.float32), lse, n_valid, dlogits


def _unit_grad_f32(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str):
    """As _unit_grad, with the fp32 loss of 16-bit logits (fp32_loss from the kernel's lse)."""
    _, lse, n_valid, dlogits = _unit_grad(logits, targets, ignore_index, reduction)
    return fp32_loss(logits, targets, lse, n_valid, ignore_index, reduction), lse, n_valid, dlogits


def _rescale(dlogits: torch.Tensor, grad: torch.Tensor, reduction: str) -> torch.Tensor:
    return _mark_padded(_C.cross_entropy_rescale(dlogits, grad, reduction))


# (logits, targets, ignore_index, reduction) -> (loss, lse, n_valid, unit dlogits)
cross_entropy_forward_unit_grad = operator("cross_entropy_forward_unit_grad", meta=_unit_grad_meta, fn=_unit_grad)
# (logits16, targets, ignore_index, reduction) -> (fp32 loss, lse, n_valid, unit dlogits)
cross_entropy_f32_forward_unit_grad = operator("cross_entropy_f32_forward_unit_grad", meta=_unit_grad_f32_meta,
                                               fn=_unit_grad_f32)
# (unit dlogits, grad, reduction) -> dlogits, the same buffer scaled in place
cross_entropy_rescale = operator("cross_entropy_rescale", meta=lambda d, g, reduction: TensorProxy(like=d),
                                 fn=_rescale)


def fused_path(logits: TensorProxy, reduction: str) -> bool:
    """Whether the grad transforms take the fused path for these logits: KFORGE_CE_FUSED on, a scalar
    loss (mean / sum: its gradient is one number), bf16 or fp32 logits, and rows the shared-memory
    kernel holds (else the fused launch re-reads rows from L2 or DRAM and is no faster than forward +
    backward apart). Not fp16: its unit gradient p / n_valid reaches fp16's subnormals (p ~ 1 / V)
    before a loss scale (GradScaler's g) could lift it, where the backward kernel scales in fp32
    first."""
    if reduction == "none" or not _env.flag("KFORGE_CE_FUSED"):
        return False
    if dtypes.to_torch_dtype(logits.dtype) not in (torch.bfloat16, torch.float32):
        return False
    n, v = logits.shape
    if not (isinstance(n, int) and isinstance(v, int)):
        return False
    plan = _C.plan("cross_entropy_forward_backward", [n, v], dtypes.to_torch_dtype(logits.dtype))
    return plan["layout"] == "smem"


# ---- the loss on upcast logits ----------------------------------------------------------------------
def cross_entropy_upcast(logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                         size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                         reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """`F.cross_entropy(logits.float(), target, ...)`: the loss in fp32 of 16-bit logits. Plain
    PyTorch; under `thunder.jit` with kforge it becomes `kforge_cross_entropy_upcast`, which never
    makes the fp32 copy of the logits (see the module docstring)."""
    return F.cross_entropy(logits.float(), target, weight, size_average, ignore_index, reduce, reduction,
                           label_smoothing)


def _upcast_like(logits: TensorProxy, target: TensorProxy, weight: Any = None, size_average: Any = None,
                 ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> TensorProxy:
    # cross_entropy_upcast in thunder.torch ops: the operator's meta and its decomposition.
    return ltorch.cross_entropy(ltorch.to(logits, dtypes.float32), target, weight, size_average, ignore_index,
                                reduce, reduction, label_smoothing)


def fp32_loss(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, n_valid: torch.Tensor,
              ignore_index: int, reduction: str) -> torch.Tensor:
    """The fp32 cross-entropy from the forward kernel's fp32 row logsumexp: row i loses
    lse[i] - logits[i, t_i] (the 16-bit logit is exact in fp32); ignored rows 0, targets outside
    [0, V) NaN (as the kernel); then the mean over n_valid, the sum, or the rows. A few (N,)-sized
    torch ops: the kernel's own loss is rounded to the logits' dtype."""
    v = logits.shape[1]
    in_range = (targets >= 0) & (targets < v)
    picked = logits.gather(1, targets.clamp(0, v - 1).unsqueeze(1)).squeeze(1).float()
    row = (lse - picked).masked_fill(targets == ignore_index, 0.0)
    row = row.masked_fill(~in_range & (targets != ignore_index), float("nan"))
    if reduction == "none":
        return row
    total = row.sum()
    return total / n_valid if reduction == "mean" else total


def _forward_f32(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str):
    """(fp32 loss, lse, n_valid): the forward kernel, then the loss in fp32 from its lse."""
    _, lse, n_valid = _C.cross_entropy_forward(logits, targets, ignore_index, reduction)
    return fp32_loss(logits, targets, lse, n_valid, ignore_index, reduction), lse, n_valid


def _forward_f32_meta(logits: TensorProxy, targets: TensorProxy, ignore_index: int, reduction: str):
    loss, lse, n_valid = _forward_meta(logits, targets, ignore_index, reduction)
    return TensorProxy(like=loss, dtype=dtypes.float32), lse, n_valid


# (logits16, targets, ignore_index, reduction) -> (fp32 loss, lse (N,) f32, n_valid () f32)
cross_entropy_f32_forward = operator("cross_entropy_f32_forward", meta=_forward_f32_meta, fn=_forward_f32)
# fn: what a declined call runs without a gradient (with one, thunder differentiates the decomposition).
kforge_cross_entropy_upcast = operator("cross_entropy_upcast", like=_upcast_like, fn=cross_entropy_upcast,
                                       replaces=cross_entropy_upcast)


def _checker(a: Any, target: Any, weight: Any = None, size_average: Any = None, ignore_index: Any = -100,
             reduce: Any = None, reduction: str = "mean", label_smoothing: float = 0.0) -> str | None:
    """None when kforge takes `ltorch.cross_entropy(a, target, ...)`, else why not."""
    if weight is not None:
        return "class weights are not supported"
    if size_average is not None or reduce is not None:
        return "deprecated size_average / reduce are not supported"
    if not (isinstance(label_smoothing, (int, float)) and label_smoothing == 0):
        return f"label_smoothing={label_smoothing} is not supported"
    if reduction not in _REDUCTIONS:
        return f"reduction={reduction!r} is not supported"
    ignore_type = ignore_index.python_type if isinstance(ignore_index, NumberProxy) else type(ignore_index)
    if ignore_type is not int:
        return f"ignore_index {ignore_index!r} is not an int"
    if not isinstance(ignore_index, NumberProxy) and not -2**63 <= ignore_index < 2**63:
        return f"ignore_index {ignore_index} does not fit int64"
    if (problem := tensor_problem(a, "input")) is not None:
        return problem
    if not isinstance(target, TensorProxy):
        return "target is not a tensor"
    if dtypes.is_float_dtype(target.dtype):
        return "probability (soft) targets are not supported"
    if dtypes.to_torch_dtype(target.dtype) is not torch.int64:
        return f"target dtype {dtypes.to_torch_dtype(target.dtype)} is not int64"
    if target.device != a.device:
        return f"target is on {target.device}, input on {a.device}"
    if a.ndim != 2:
        return f"input is {a.ndim}-D: only (N, V) logits (torch puts classes on dim 1 of N-d input)"
    if target.ndim != 1 or target.shape[0] != a.shape[0]:
        return f"target shape {tuple(target.shape)} does not match input rows {a.shape[0]}"
    if a.shape[0] > 2**31 - 1:
        return f"{a.shape[0]} rows exceed one CUDA grid (2^31 - 1)"
    # Backward: one block per (row, chunk), a chunk at most 256 threads x 2 packs of 16 bytes on the
    # element-wise path (src/ops/cross_entropy.cpp).
    packs = -(-a.shape[1] // (16 // dtypes.to_torch_dtype(a.dtype).itemsize))
    if a.shape[0] * -(-packs // 512) > 2**31 - 1:
        return f"({a.shape[0]}, {a.shape[1]}) logits need more than 2^31 - 1 backward blocks"
    return None


def _execution(a: TensorProxy, target: TensorProxy, weight: Any = None, size_average: Any = None,
               ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
               label_smoothing: float = 0.0) -> TensorProxy:
    loss, _, _ = cross_entropy_forward(a, target, ignore_index, reduction)
    return loss


def _grad(a: TensorProxy, target: TensorProxy, weight: Any = None, size_average: Any = None,
          ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
          label_smoothing: float = 0.0) -> TensorProxy:
    if fused_path(a, reduction):  # saved for backward: the unit gradient
        loss, _, _, unit = cross_entropy_forward_unit_grad(a, target, ignore_index, reduction)
        put_grad(a, cross_entropy_rescale(unit, get_grad(loss), reduction))
        return loss
    # Saved for backward: logits, targets, lse (N floats), n_valid (one float).
    loss, lse, n_valid = cross_entropy_forward(a, target, ignore_index, reduction)
    g = get_grad(loss)
    put_grad(a, cross_entropy_backward(g, a, target, lse, n_valid, ignore_index, reduction))
    return loss


def _upcast_checker(logits: Any, target: Any, weight: Any = None, size_average: Any = None,
                    ignore_index: Any = -100, reduce: Any = None, reduction: str = "mean",
                    label_smoothing: float = 0.0) -> str | None:
    """None when kforge takes `cross_entropy_upcast(logits, target, ...)`, else why not."""
    if isinstance(logits, TensorProxy) and dtypes.to_torch_dtype(logits.dtype) not in (torch.bfloat16, torch.float16):
        return f"logits dtype {dtypes.to_torch_dtype(logits.dtype)} is not 16-bit (nothing to upcast)"
    return _checker(logits, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)


def _upcast_execution(logits: TensorProxy, target: TensorProxy, weight: Any = None, size_average: Any = None,
                      ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                      label_smoothing: float = 0.0) -> TensorProxy:
    loss, _, _ = cross_entropy_f32_forward(logits, target, ignore_index, reduction)
    return loss


def _upcast_grad(logits: TensorProxy, target: TensorProxy, weight: Any = None, size_average: Any = None,
                 ignore_index: int = -100, reduce: Any = None, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> TensorProxy:
    if fused_path(logits, reduction):  # saved for backward: the unit gradient (logits' dtype)
        loss, _, _, unit = cross_entropy_f32_forward_unit_grad(logits, target, ignore_index, reduction)
        g = ltorch.to(get_grad(loss), logits.dtype)
        put_grad(logits, cross_entropy_rescale(unit, g, reduction))
        return loss
    # Saved for backward: the 16-bit logits, targets, lse, n_valid. The fp32 loss gradient is rounded
    # to the logits' dtype for the kernel, which returns dlogits in that dtype (`.float()`'s backward).
    loss, lse, n_valid = cross_entropy_f32_forward(logits, target, ignore_index, reduction)
    g = ltorch.to(get_grad(loss), logits.dtype)
    put_grad(logits, cross_entropy_backward(g, logits, target, lse, n_valid, ignore_index, reduction))
    return loss


SPEC = OpSpec("cross_entropy", (
    Claim(ltorch.cross_entropy, _checker, _execution, _grad),
    Claim(kforge_cross_entropy_upcast, _upcast_checker, _upcast_execution, _upcast_grad),
))


def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """Forward, backward, and forward+backward (separate kernels, the fused launcher, and the
    KFORGE_CE_FUSED path's unit gradient + rescale) at 8192 rows."""
    from ..bench.cases import BenchCase

    shapes = [(8192, 50257)] if quick else [(8192, 50257), (8192, 32000)]
    es = torch.finfo(dtype).bits // 8
    cases: list[BenchCase] = []
    for n, v in shapes:
        shape = f"{n}x{v}"

        def logits_targets(n: int = n, v: int = v) -> tuple[torch.Tensor, torch.Tensor]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            logits = (2 * torch.randn(n, v, device="cuda", generator=gen)).to(dtype)
            targets = torch.randint(0, v, (n,), device="cuda", generator=gen)
            return logits, targets

        def make_bwd(lt=logits_targets):
            logits, targets = lt()
            loss, lse, n_valid = _C.cross_entropy_forward(logits, targets, -100, "mean")
            grad = torch.ones((), device="cuda", dtype=dtype)
            # Eager's backward starts from the log_softmax output autograd saved.
            return grad, logits, targets, lse, n_valid, torch.log_softmax(logits, -1)

        def eager_bwd(grad, logits, targets, lse, n_valid, logp):
            total = n_valid.to(logp.dtype)
            dlogp = torch.ops.aten.nll_loss_backward(grad, logp, targets, None, 1, -100, total)
            return torch.ops.aten._log_softmax_backward_data(dlogp, logp, 1, logp.dtype)

        def eager_fwd_bwd(logits, targets):
            x = logits.detach().requires_grad_(True)
            loss = F.cross_entropy(x, targets)
            return loss, torch.autograd.grad(loss, x)[0]

        def separate(logits, targets):
            loss, lse, n_valid = _C.cross_entropy_forward(logits, targets, -100, "mean")
            grad = torch.ones((), device="cuda", dtype=dtype)
            return loss, _C.cross_entropy_backward(grad, logits, targets, lse, n_valid, -100, "mean")

        def fused(logits, targets):
            grad = torch.ones((), device="cuda", dtype=dtype)
            return _C.cross_entropy_forward_backward(logits, targets, grad, -100, "mean")

        def unit_rescale(logits, targets, g):
            # the executor's KFORGE_CE_FUSED path: the unit gradient, then its in-place scale by g
            loss, _, _, dlogits = _C.cross_entropy_forward_unit_grad(logits, targets, -100, "mean")
            return loss, _C.cross_entropy_rescale(dlogits, g, "mean")

        def with_grad(value: float, lt=logits_targets):
            return (*lt(), torch.full((), value, device="cuda", dtype=dtype))

        def eager_scaled(logits, targets, g):
            x = logits.detach().requires_grad_(True)
            loss = F.cross_entropy(x, targets)
            return loss, torch.autograd.grad(loss, x, g)[0]

        big = n * v * es  # one pass over the logits
        rows = n * (8 + 4)  # targets + lse
        cases += [
            BenchCase("cross_entropy", "fwd", shape, logits_targets,
                      lambda x, t: _C.cross_entropy_forward(x, t, -100, "mean"),
                      lambda x, t: F.cross_entropy(x, t), big + rows),
            BenchCase("cross_entropy", "bwd", shape, make_bwd,
                      lambda g, x, t, lse, nv, logp: _C.cross_entropy_backward(g, x, t, lse, nv, -100, "mean"),
                      eager_bwd, 2 * big + rows),
            # The fused-gradient option: loss and dlogits in one kernel when dloss is known up front.
            BenchCase("cross_entropy", "fwd+bwd", shape + " separate", logits_targets, separate,
                      eager_fwd_bwd, 2 * big + rows, compile_ok=False),
            BenchCase("cross_entropy", "fwd+bwd", shape + " fused", logits_targets, fused,
                      eager_fwd_bwd, 2 * big + rows, compile_ok=False),
            # KFORGE_CE_FUSED's two launches: a loss gradient of 1 (the rescale returns at once), and
            # another (the rescale reads and writes the gradient again)
            # (partial binds this size's with_grad: a lambda would look the name up when called, after
            # the loop has rebound it to the last size's)
            BenchCase("cross_entropy", "fwd+bwd", shape + " unit+rescale g=1", functools.partial(with_grad, 1.0),
                      unit_rescale, eager_scaled, 2 * big + rows, compile_ok=False),
            BenchCase("cross_entropy", "fwd+bwd", shape + " unit+rescale g=0.5", functools.partial(with_grad, 0.5),
                      unit_rescale, eager_scaled, 2 * big + rows, compile_ok=False),
        ]
    return cases
