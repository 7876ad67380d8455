"""The attention head split and merge as single copy kernels (kernels_src/permute.cu).

- `split_qkv(qkv, n_head)`: qkv (B, T, 3C) -> q, k, v, each (B, NH, T, HS) and contiguous, where
  eager PyTorch returns strided views that every later consumer has to gather through.
  `split_qkv(qkv, n_head, copy=False)` is for consumers that read strided heads themselves
  (`F.scaled_dot_product_attention` needs only a unit last-dim stride): kforge then returns the
  views too, with no forward kernel, and its backward still writes dqkv in one kernel (eager
  autograd: a cat plus reshapes).
- `merge_heads(y)`: y (B, NH, T, HS) -> (B, T, C), the `transpose(1, 2).contiguous().view()` copy.
  When y is already token-major in memory (flash attention's output is), the copy is skipped and
  the result is a view, as `.contiguous()` is in eager PyTorch.

Both are plain PyTorch helpers for models to call; the operators `kforge_split_qkv` and
`kforge_merge_heads` are registered with `replaces=` them, so `thunder.jit` with the kforge executor
swaps in the kernels. Nothing is saved for backward: the backward of each copy is the inverse copy
(dqkv from dq, dk, dv; dy from d(B, T, C)). merge_heads' backward is a view when d(B, T, C) is
contiguous, as in eager autograd: attention reads dO in its output's token-major layout.
"""
from __future__ import annotations

import torch
import thunder.torch as ltorch
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from ..bench.cases import BenchCase
from .._thunder import Claim, OpSpec, operator, tensor_problem

_INT_MAX = 2**31 - 1


def _split_problem(shape: tuple, n_head: object) -> str | None:
    # One rule for the helper, its Thunder definition and the checker.
    if len(shape) != 3:
        return f"qkv has shape {tuple(shape)}, not (B, T, 3C)"
    if not isinstance(n_head, int) or isinstance(n_head, bool) or n_head <= 0:
        return f"n_head={n_head!r} is not a positive int"
    if shape[2] % (3 * n_head):
        return f"last dim {shape[2]} is not 3 * n_head * head_size (n_head={n_head})"
    return None


def _check_split(shape: tuple, n_head: object) -> None:
    if (p := _split_problem(shape, n_head)) is not None:
        if p.startswith("qkv"):
            p += "; its last dim must be 3 * n_head * head_size"
        elif p.startswith("last dim"):
            p += "; qkv must be (B, T, 3C) with C = n_head * head_size"
        raise ValueError(f"split_qkv: {p}")


def _merge_problem(shape: tuple) -> str | None:
    if len(shape) != 4:
        return f"y has shape {tuple(shape)}, not (B, NH, T, HS)"
    return None


def _check_merge(shape: tuple) -> None:
    if (p := _merge_problem(shape)) is not None:
        raise ValueError(f"merge_heads: {p} (a 4-D tensor of attention heads)")


def split_qkv(qkv: torch.Tensor, n_head: int, *, copy: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused QKV projection (B, T, 3C) into q, k, v of shape (B, n_head, T, C // n_head).
    Plain PyTorch (views); under `thunder.jit` with the kforge executor, one copy kernel that returns
    contiguous tensors, or with `copy=False` the same strided views (for consumers that take them,
    like scaled_dot_product_attention) and the copy kernel only in the backward.

    Raises ValueError unless qkv is 3-D with a last dim of 3 * n_head * head_size and n_head is a
    positive int."""
    _check_split(tuple(qkv.shape), n_head)
    B, T, C3 = qkv.shape
    C = C3 // 3
    q, k, v = qkv.split(C, dim=2)
    HS = C // n_head
    return tuple(t.view(B, T, n_head, HS).transpose(1, 2) for t in (q, k, v))


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    """Merge attention heads (B, NH, T, HS) back into (B, T, NH * HS). Plain PyTorch; under
    `thunder.jit` with the kforge executor, one copy kernel. Raises ValueError unless y is 4-D."""
    _check_merge(tuple(y.shape))
    B, NH, T, HS = y.shape
    return y.transpose(1, 2).contiguous().view(B, T, NH * HS)


def _value(x: object) -> object:
    return x.value if isinstance(x, NumberProxy) else x


# The helpers in Thunder's torch language: what the operators decompose into when kforge declines
# them, so other executors and autodiff can still run them.
def _split_qkv_like(qkv: TensorProxy, n_head: int, *, copy: bool = True) -> tuple[TensorProxy, TensorProxy, TensorProxy]:
    # Numbers may arrive as proxies (a float n_head does): check the values they were traced with.
    _check_split(tuple(map(_value, qkv.shape)), _value(n_head))
    B, T, C3 = qkv.shape
    C = C3 // 3
    return tuple(
        ltorch.transpose(ltorch.reshape(t, (B, T, n_head, C // n_head)), 1, 2)
        for t in ltorch.split(qkv, C, 2)
    )


def _merge_heads_like(y: TensorProxy) -> TensorProxy:
    _check_merge(tuple(y.shape))  # only the rank matters: sizes may stay proxies
    B, NH, T, HS = y.shape
    return ltorch.reshape(ltorch.contiguous(ltorch.transpose(y, 1, 2)), (B, T, NH * HS))


def _split_forward_meta(qkv: TensorProxy, n_head: int) -> tuple[TensorProxy, TensorProxy, TensorProxy]:
    B, T, C3 = qkv.shape
    shape = (B, n_head, T, C3 // (3 * n_head))
    return tuple(TensorProxy(like=qkv, shape=shape) for _ in range(3))


def _split_backward_meta(dq: TensorProxy | None, dk: TensorProxy | None,
                         dv: TensorProxy | None) -> TensorProxy:
    # A missing cotangent (None: that output was unused) counts as zeros.
    g = next(t for t in (dq, dk, dv) if t is not None)
    B, NH, T, HS = g.shape
    return TensorProxy(like=g, shape=(B, T, 3 * NH * HS))


def _merge_forward_meta(y: TensorProxy) -> TensorProxy:
    B, NH, T, HS = y.shape
    return TensorProxy(like=y, shape=(B, T, NH * HS))


def _merge_backward_meta(dout: TensorProxy, n_head: int) -> TensorProxy:
    B, T, C = dout.shape
    return TensorProxy(like=dout, shape=(B, n_head, T, C // n_head))


def _split_views(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, C3 = qkv.shape
    return qkv.view(B, T, 3, n_head, C3 // (3 * n_head)).permute(2, 0, 3, 1, 4).unbind(0)


# (qkv, n_head) -> (q, k, v)
split_qkv_forward = operator("split_qkv_forward", meta=_split_forward_meta, fn=_C.split_qkv_forward)
# (qkv, n_head) -> (q, k, v) as strided views of qkv: no kernel
split_qkv_views = operator("split_qkv_views", meta=_split_forward_meta, fn=_split_views)
# (dq, dk, dv) -> dqkv
split_qkv_backward = operator("split_qkv_backward", meta=_split_backward_meta, fn=_C.split_qkv_backward)
# (y) -> (B, T, C): the merge copy, or a view when y's heads are already token-major in memory
merge_heads_forward = operator("merge_heads_forward", meta=_merge_forward_meta, fn=_C.merge_heads_forward_view)
# (dout, n_head) -> dy: a view of a contiguous dout, token-major as eager autograd gives it (cuDNN and
# FlashAttention read dO in the forward output's layout, token-major too); the copy kernel otherwise
merge_heads_backward = operator("merge_heads_backward", meta=_merge_backward_meta, fn=_C.merge_heads_backward_view)

split_qkv_op = operator("split_qkv", like=_split_qkv_like, fn=split_qkv, replaces=split_qkv)
merge_heads_op = operator("merge_heads", like=_merge_heads_like, fn=merge_heads, replaces=merge_heads)


# ---- checkers ----------------------------------------------------------------------------------
def _sizes_problem(B: int, T: int, row: int) -> str | None:
    if B * T > _INT_MAX or row > _INT_MAX:
        return f"B*T = {B * T} or row length {row} exceeds 2^31-1"
    return None


def _split_checker(qkv: TensorProxy, n_head: int, *, copy: bool = True) -> str | None:
    if (p := tensor_problem(qkv, "qkv")) is not None:
        return p
    if (p := _split_problem(tuple(qkv.shape), n_head)) is not None:
        return p
    B, T, C3 = qkv.shape
    return _sizes_problem(B, T, C3)


def _merge_checker(y: TensorProxy) -> str | None:
    if (p := tensor_problem(y, "y")) is not None:
        return p
    if (p := _merge_problem(tuple(y.shape))) is not None:
        return p
    B, NH, T, HS = y.shape
    return _sizes_problem(B, T, NH * HS)


# ---- execution and grad transforms -----------------------------------------------------------
def _split_execution(qkv: TensorProxy, n_head: int, *, copy: bool = True):
    return (split_qkv_forward if copy else split_qkv_views)(qkv, n_head)


def _split_grad(qkv: TensorProxy, n_head: int, *, copy: bool = True):
    q, k, v = (split_qkv_forward if copy else split_qkv_views)(qkv, n_head)
    put_grad(qkv, split_qkv_backward(get_grad(q), get_grad(k), get_grad(v)))
    return q, k, v


def _merge_execution(y: TensorProxy) -> TensorProxy:
    return merge_heads_forward(y)


def _merge_grad(y: TensorProxy) -> TensorProxy:
    out = merge_heads_forward(y)
    put_grad(y, merge_heads_backward(get_grad(out), y.shape[1]))
    return out


SPEC = OpSpec(
    "permute",
    (
        Claim(split_qkv_op, _split_checker, _split_execution, _split_grad),
        Claim(merge_heads_op, _merge_checker, _merge_execution, _merge_grad),
    ),
)


# ---- benchmarks ----------------------------------------------------------------------------------
def bench_cases(dtype: torch.dtype, quick: bool) -> list[BenchCase]:
    """split_qkv and merge_heads on GPT-2 124M attention (B=8, T=1024, NH=12, HS=64), forward and
    backward; the eager baselines make the same contiguous copies."""
    B, T, NH, HS = 8, 1024, 12, 64
    C = NH * HS
    es = torch.empty((), dtype=dtype).element_size()

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    def eager_split(qkv):
        return tuple(t.contiguous() for t in split_qkv(qkv, NH))

    def eager_split_bwd(dq, dk, dv):
        return merge_heads(torch.cat((dq, dk, dv), dim=1))  # heads p * NH + h: the qkv layout

    shape = f"{B}x{T}x{NH}x{HS}"
    n = B * T * C
    return [
        BenchCase("permute", "fwd", f"split_qkv {shape}", lambda: (rnd(B, T, 3 * C),),
                  lambda qkv: _C.split_qkv_forward(qkv, NH), eager_split, 2 * 3 * n * es),
        BenchCase("permute", "bwd", f"split_qkv {shape}", lambda: tuple(rnd(B, NH, T, HS) for _ in range(3)),
                  _C.split_qkv_backward, eager_split_bwd, 2 * 3 * n * es),
        BenchCase("permute", "fwd", f"merge_heads {shape}", lambda: (rnd(B, NH, T, HS),),
                  _C.merge_heads_forward, merge_heads, 2 * n * es),
        BenchCase("permute", "bwd", f"merge_heads {shape}", lambda: (rnd(B, T, C),),
                  lambda dout: _C.merge_heads_backward(dout, NH),
                  lambda dout: dout.view(B, T, NH, HS).transpose(1, 2).contiguous(), 2 * n * es),
    ]
