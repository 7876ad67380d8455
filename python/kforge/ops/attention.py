"""attention: `F.scaled_dot_product_attention` on cuDNN's fused attention kernels (Hopper and newer).

Eager PyTorch picks cuDNN's SDPA on Hopper; Thunder's sdpa executor runs FlashAttention-2 there, which
is about 1.6x slower per GPT-2 124M step's attention (3.25 vs 2.0 ms at B=8, T=1024, H100). kforge
therefore claims the SDPA call itself and runs torch's cuDNN attention forward and backward ops
(`aten._scaled_dot_product_cudnn_attention[_backward]`): no kernels of kforge's own. What cuDNN's
path does not take (fp32, an explicit mask, grouped heads without expansion, head dims past 128,
devices before sm_90, a dropout probability that is not a constant) is declined with its reason, and
Thunder's sdpa executor takes it (FA2).

Dropout (fine-tuning's attention dropout) runs inside cuDNN's kernels: the forward draws its mask
from torch's CUDA generator (Philox, a seed and an offset cuDNN returns), the backward takes the same
seed and offset and draws the same mask again, so no mask is stored, as eager's cuDNN path does.
`SdpaMaskShape` (in kforge.jit / kforge.compile) hands it masks at their broadcast shape, which its
memory-efficient path needs.

Grouped-query attention: users expand k and v to q's head count before SDPA (`repeat_interleave`,
Hugging Face's `repeat_kv`); cuDNN reads grouped heads natively. `kforge.transforms` rewrites
`sdpa(q, repeat_kv(k, n), repeat_kv(v, n))` into the helper `attention(q, k, v, n)`, whose operator
runs cuDNN on the unexpanded k and v: no expansion kernel in the forward, no group sum in the
backward (cuDNN returns dk and dv per kv head), and k, v saved for backward at their own size. The
same rewrite turns a causal mask built in the trace (Hugging Face passes one) into is_causal=True,
which cuDNN takes and an explicit mask it is not given.

Layouts: cuDNN writes the output (and dq) in q's memory layout and dk / dv in k's / v's, so heads that
arrive token-major ((B, T, H, D) in memory, as a linear's output viewed and transposed) leave
token-major, and the head merge after attention is a view.

Thunder symbols:
    kforge_attention_forward(q, k, v, is_causal, scale, dropout_p) -> (out, logsumexp, philox_seed,
        philox_offset)
    kforge_attention_backward(dout, q, k, v, out, logsumexp, philox_seed, philox_offset, is_causal, scale,
        dropout_p) -> (dq, dk, dv). Saved for backward: q, k, v, out, logsumexp and, with dropout, the
        generator's seed and offset. k and v may have fewer heads than q (a divisor of q's).
    kforge_attention(q, k, v, n_rep, is_causal, scale, dropout_p) -> out
        registered with `replaces=attention`; decomposes into repeat_kv + SDPA when declined.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy
from thunder.core.transform_common import Transform
from thunder.core.transforms import get_grad, put_grad

from .._thunder import Claim, OpSpec, operator, replace_calls, same_dtype_device, tensor_problem

MAX_HEAD_DIM = 128
# cuDNN runtime versions whose attention has no dropout (torch's SDPA dispatch declines them too):
# strictly between these two.
_CUDNN_WITHOUT_DROPOUT = (91100, 91400)


# torch's own binding of the op where it has one: a few us of host time under the op-packet call, in
# a forward that waits for its host.
_cudnn_attention = getattr(torch, "_scaled_dot_product_cudnn_attention",
                           torch.ops.aten._scaled_dot_product_cudnn_attention)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float | None,
             dropout_p: float = 0.0):
    o = _cudnn_attention(q, k, v, None, True, dropout_p, is_causal, False, scale=scale)
    return o[0], o[1], o[6], o[7]


def _backward(dout, q, k, v, out, lse, seed, offset, is_causal: bool, scale: float | None, dropout_p: float = 0.0):
    if dout.stride() != out.stride():  # cuDNN reads dO in O's layout
        dout = torch.empty_like(out).copy_(dout)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, None, None, q.shape[2], k.shape[2], dropout_p, is_causal,
        scale=scale)


def _forward_meta(q, k, v, is_causal, scale, dropout_p=0.0):
    b, h, t, _ = q.shape
    out = TensorProxy(like=q, shape=(b, h, t, v.shape[-1]))
    lse = TensorProxy(like=q, shape=(b, h, t, 1), dtype=dtypes.float32)
    seed = TensorProxy(like=q, shape=(), dtype=dtypes.int64)
    offset = TensorProxy(like=q, shape=(), dtype=dtypes.int64)
    return out, lse, seed, offset


def _backward_meta(dout, q, k, v, out, lse, seed, offset, is_causal, scale, dropout_p=0.0):
    return TensorProxy(like=q), TensorProxy(like=k), TensorProxy(like=v)


_TAGS = (OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,)
attention_forward = operator("attention_forward", meta=_forward_meta, fn=_forward, tags=_TAGS)
attention_backward = operator("attention_backward", meta=_backward_meta, fn=_backward)


def _device_problem(q: TensorProxy) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device to run cuDNN attention on"
    if not torch.backends.cuda.cudnn_sdp_enabled() or not torch.backends.cudnn.is_available():
        return "cuDNN SDPA is disabled or cuDNN is unavailable"
    idx = q.device.index or 0
    major, _ = torch.cuda.get_device_capability(idx)
    if major < 9:
        return f"cuDNN attention is used from sm_90 on (cuda:{idx} is sm_{major}x; FA2 is as fast there)"
    return None


def _check(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
           is_causal: bool = False, *, scale: float | None = None, enable_gqa: bool = False,
           n_rep: int = 1) -> str | None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        problem = tensor_problem(t, name)
        if problem:
            return problem
    problem = same_dtype_device(query, key, "key") or same_dtype_device(query, value, "value")
    if problem:
        return problem
    if dtypes.to_torch_dtype(query.dtype) not in (torch.bfloat16, torch.float16):
        return "cuDNN attention takes bf16 / fp16 only"
    if not (query.ndim == key.ndim == value.ndim == 4):
        return "query, key and value must be 4-D (batch, heads, sequence, head dim)"
    if attn_mask is not None:
        return "an explicit attn_mask"
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool):
        return "dropout_p is not a constant"
    if not 0.0 <= dropout_p < 1.0:
        return f"dropout_p {dropout_p} (cuDNN attention: 0 <= p < 1)"
    if dropout_p > 0.0 and _CUDNN_WITHOUT_DROPOUT[0] < (torch.backends.cudnn.version() or 0) < _CUDNN_WITHOUT_DROPOUT[1]:
        return f"dropout with cuDNN {torch.backends.cudnn.version()} (9.11 - 9.13 have none in attention)"
    if not isinstance(is_causal, bool):
        return "is_causal is not a constant"
    if scale is not None and not isinstance(scale, (int, float)):
        return "scale is not a constant"
    (b, h, t, d), (bk, hk, tk, dk), (bv, hv, tv, dv) = query.shape, key.shape, value.shape
    if (b, h) != (bk, hk * n_rep) or (bk, hk, tk) != (bv, hv, tv):
        grouped = "grouped" if n_rep == 1 else f"n_rep={n_rep} does not match the"
        return f"{grouped} heads ({tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)})"
    if d != dk or d != dv:
        return "query, key and value head dims differ"
    if d % 8 or d > MAX_HEAD_DIM:
        return f"head dim {d} (cuDNN: a multiple of 8, at most {MAX_HEAD_DIM})"
    if is_causal and t != tk:
        return "causal attention with query and key lengths that differ"
    if torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled():
        # as torch's SDPA dispatch: read when the trace is made, as every checker's inputs are
        return "torch.use_deterministic_algorithms(True): cuDNN attention is not deterministic"
    return _device_problem(query)


def _p(dropout_p: float) -> float:
    return float(dropout_p)  # an int 0 reaches the trace as 0.0: one spelling per program


def _execution(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
               enable_gqa=False):
    return attention_forward(query, key, value, is_causal, scale, _p(dropout_p))[0]


def _grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    p = _p(dropout_p)
    out, lse, seed, offset = attention_forward(query, key, value, is_causal, scale, p)
    dq, dk, dv = attention_backward(get_grad(out), query, key, value, out, lse, seed, offset, is_causal, scale, p)
    put_grad(query, dq)
    put_grad(key, dk)
    put_grad(value, dv)
    return out


# ---- the helper the pattern rewrite calls: grouped heads, causal flag -------------------------------
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_rep: int = 1, is_causal: bool = False,
              scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """SDPA of q (B, H, T, D) over k, v (B, H / n_rep, T, D), kv head j serving q heads j * n_rep ..
    (j + 1) * n_rep - 1: `F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep))`,
    with attention dropout `dropout_p`. Plain PyTorch; under `thunder.jit` with kforge, cuDNN attention
    on the grouped heads as they are."""
    from .gqa import repeat_kv

    return F.scaled_dot_product_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


def _attention_like(q: TensorProxy, k: TensorProxy, v: TensorProxy, n_rep: int = 1, is_causal: bool = False,
                    scale: float | None = None, dropout_p: float = 0.0) -> TensorProxy:
    # attention in thunder.torch ops: the operator's meta and its decomposition when declined.
    from .gqa import _repeat_kv_like

    return ltorch.scaled_dot_product_attention(q, _repeat_kv_like(k, n_rep), _repeat_kv_like(v, n_rep), None,
                                               dropout_p, is_causal, scale=scale)


kforge_attention = operator("attention", like=_attention_like, fn=attention, replaces=attention)


def _check_attention(q: Any, k: Any, v: Any, n_rep: Any = 1, is_causal: Any = False, scale: Any = None,
                     dropout_p: Any = 0.0) -> str | None:
    if not isinstance(n_rep, int) or isinstance(n_rep, bool) or n_rep < 1:
        return f"n_rep must be a positive Python int, got {n_rep!r}"
    return _check(q, k, v, None, dropout_p, is_causal, scale=scale, n_rep=n_rep)


def _attention_execution(q, k, v, n_rep=1, is_causal=False, scale=None, dropout_p=0.0):
    return _execution(q, k, v, None, dropout_p, is_causal, scale=scale)


def _attention_grad(q, k, v, n_rep=1, is_causal=False, scale=None, dropout_p=0.0):
    return _grad(q, k, v, None, dropout_p, is_causal, scale=scale)


SPEC = OpSpec("attention", (Claim(ltorch.scaled_dot_product_attention, _check, _execution, _grad),
                            Claim(kforge_attention, _check_attention, _attention_execution, _attention_grad)))


# ---- masks given to SDPA at their broadcast shape -------------------------------------------------
# F.scaled_dot_product_attention broadcasts attn_mask against (B, H, T, S): (T, S), (1, 1, T, S) and
# (B, 1, 1, S) masks are common. Thunder 0.2.6's sdpa executor runs a masked call on its
# memory-efficient kernel, whose meta requires a 4-D mask with the query's batch size: such a model
# stops while tracing ("grad_forward_sdpa: Expected attn_mask tensor to have 4 dimension", "...
# Expected all inputs to have same batch_size"). The mask viewed as 4-D and expanded (a view, no
# copy) to (B, 1 or H, T, S) is the same broadcast.
class SdpaMaskShape(Transform):
    """A Thunder transform (pre-prologue, on the computation trace): every
    `F.scaled_dot_product_attention` of 4-D query / key / value whose attn_mask is not already
    (B, 1 or H, T, S) gets it reshaped to 4-D (leading dims of 1) and expanded to that shape, the
    broadcast SDPA applies anyway. `rewritten` counts the calls changed by the last trace."""

    def __init__(self) -> None:
        super().__init__()
        self.rewritten = 0

    def transform_traces_pre_prologue(self, prologue_trace, computation_trace, epilogue_trace, **kwargs):
        return prologue_trace, self.rewrite(computation_trace), epilogue_trace

    def rewrite(self, trace: Any) -> Any:
        """`trace` with the masks expanded (or `trace` itself if none is)."""
        trace, self.rewritten = replace_calls(trace, self._replacement,
                                              "kforge SDPA masks at their broadcast shape ({} calls)")
        return trace

    def _replacement(self, b: Any):
        target = self._target(b)
        if target is None:
            return None
        mask, shape = target

        def traced():
            args, kwargs = list(b.args), dict(b.kwargs)
            full = mask if mask.ndim == 4 else ltorch.reshape(mask, (1,) * (4 - mask.ndim) + tuple(mask.shape))
            full = ltorch.expand(full, shape)
            if len(args) > 3:
                args[3] = full
            else:
                kwargs["attn_mask"] = full
            return ltorch.scaled_dot_product_attention(*args, **kwargs)

        return traced

    @staticmethod
    def _target(b: Any) -> tuple[TensorProxy, tuple[int, ...]] | None:
        """(mask, the shape to expand it to) for an SDPA call on 4-D tensors whose mask is not at
        that shape and broadcasts to it, else None."""
        if b.sym.id != ltorch.scaled_dot_product_attention.id:
            return None
        qkv = b.args[:3]
        mask = b.args[3] if len(b.args) > 3 else b.kwargs.get("attn_mask")
        if not (len(qkv) == 3 and all(isinstance(t, TensorProxy) and t.ndim == 4 for t in qkv)):
            return None
        if not (isinstance(mask, TensorProxy) and 1 <= mask.ndim <= 4):
            return None
        q, k = qkv[0], qkv[1]
        have = (1,) * (4 - mask.ndim) + tuple(mask.shape)
        heads = have[1] if have[1] in (1, q.shape[1]) else None
        want = (q.shape[0], heads, q.shape[2], k.shape[2])
        if heads is None or any(h not in (1, w) for h, w in zip(have, want)) or have == want and mask.ndim == 4:
            return None
        return mask, want
