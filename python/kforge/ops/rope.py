"""Rotary position embedding of q and k in one launch, on kforge's rope kernel (kernels_src/rope.cu).

Model helper (plain PyTorch; `thunder.jit` swaps it for kforge when kforge is an executor):
    apply_rope(q, k, cos, sin, interleaved=False, position_ids=None) -> (q_rot, k_rot)

q is (B, Hq, T, D), k is (B, Hkv, T, D) (Hq != Hkv for GQA), D even. cos / sin layouts:
- interleaved=False, "rotate_half" (Hugging Face Llama, GPT-NeoX, litgpt): D entries per token,
  out = x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]).
  HF's LlamaRotaryEmbedding returns exactly these tables, (B, T, D), the D/2 angles repeated twice.
- interleaved=True (Meta's reference Llama, llama2.c): D/2 entries per token, one angle per pair
  (x[2i], x[2i+1]) rotated as a complex number; cos / sin are freqs_cis.real / freqs_cis.imag.
Table rows: without position_ids, cos / sin are (B or 1, T, Dc) or (T, Dc) (Dc = D or D/2); with
position_ids ((T,), (1, T) or (B, T) integers), they are (P, Dc) tables of P positions and token
(b, t) uses row position_ids[b, t]. Tables are q's dtype or float32; results have q's / k's dtype.

Thunder symbols:
    kforge_apply_rope(q, k, cos, sin, interleaved=False, position_ids=None) -> (q_rot, k_rot)
        registered with `replaces=apply_rope`; decomposes into thunder.torch ops when declined.
    kforge_rope_forward(q, k, cos, sin, position_ids, interleaved) -> (q_rot, k_rot)
    kforge_rope_backward(dq_rot, dk_rot, cos, sin, position_ids, interleaved) -> (dq, dk)
        the kernel (kforge._C.rope_forward / rope_backward); backward is the transposed rotation
        (rotation by -theta). Saved for backward: cos, sin, position_ids.
Each output takes its input's layout when that is token-major ((B, T, H, D) in memory, as
`x.view(B, T, H, D).transpose(1, 2)` of a linear's output leaves q and k), else it is contiguous
(B, H, T, D): cuDNN attention then returns O, dQ and dK token-major too, so the head merge and the
transposes before the weight-gradient matmuls are views. Thunder proxies carry no strides, so the
metas and the checker assume no layout. No gradient flows to cos / sin: the checker declines tables
that require grad.
"""
from __future__ import annotations

from typing import Any

import torch
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import NumberProxy, TensorProxy
from thunder.core.transforms import get_grad, put_grad

from .. import _C
from .._thunder import Claim, OpSpec, operator, tensor_problem


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Meta's reference: x as complex pairs times (cos + i sin), in fp32 (fp64 stays fp64), cast back.
    ct = torch.promote_types(x.dtype, torch.float32)
    xp = x.to(ct).reshape(*x.shape[:-1], -1, 2)
    x0, x1 = xp[..., 0], xp[..., 1]
    c, s = cos.to(ct), sin.to(ct)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(x.dtype)


def _check_heads(q_shape: tuple, k_shape: tuple) -> None:
    # One rule for the helper and its Thunder definition: a 3-D q was rotated over the wrong dims and
    # an odd D rotated 3 + 4 halves of 7 without an error.
    for name, shape in (("q", q_shape), ("k", k_shape)):
        if len(shape) != 4:
            raise ValueError(f"apply_rope: {name} has shape {tuple(shape)}, not (B, H, T, D)")
    if q_shape[-1] % 2 or q_shape[-1] != k_shape[-1]:
        raise ValueError(f"apply_rope: head dims of q {tuple(q_shape)} and k {tuple(k_shape)} must be equal and even")


def _values(shape) -> tuple:
    return tuple(d.value if isinstance(d, NumberProxy) else d for d in shape)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False,
               position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q (B, Hq, T, D) and k (B, Hkv, T, D); returns (q_rot, k_rot) in q's / k's
    dtype. See the module docstring for the cos / sin layouts of the two modes.

    Under `thunder.jit(..., executors=[kforge.executor, ...])` calls to this function become
    `kforge_apply_rope` (one kforge launch for q and k, or this computation when declined).

    Raises ValueError unless q and k are 4-D with one even head dim D."""
    _check_heads(tuple(q.shape), tuple(k.shape))
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.ndim == 3:  # (B or 1, T, Dc): broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleaved:
        return _rotate_pairs(q, cos, sin), _rotate_pairs(k, cos, sin)
    return ((q * cos + _rotate_half(q) * sin).to(q.dtype),
            (k * cos + _rotate_half(k) * sin).to(k.dtype))


# apply_rope written in thunder.torch ops: kforge_apply_rope's meta and its decomposition.
def _rope_like(q, k, cos, sin, interleaved=False, position_ids=None):
    _check_heads(_values(q.shape), _values(k.shape))
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.ndim == 3:
        cos, sin = ltorch.unsqueeze(cos, 1), ltorch.unsqueeze(sin, 1)

    def rotate(x):
        if interleaved:
            ct = dtypes.float64 if x.dtype == dtypes.float64 else dtypes.float32
            xp = ltorch.reshape(ltorch.to(x, ct), *x.shape[:-1], x.shape[-1] // 2, 2)
            x0, x1 = xp[..., 0], xp[..., 1]
            c, s = ltorch.to(cos, ct), ltorch.to(sin, ct)
            out = ltorch.stack((x0 * c - x1 * s, x0 * s + x1 * c), -1)
            return ltorch.to(ltorch.flatten(out, -2), x.dtype)
        h = x.shape[-1] // 2
        rot = ltorch.cat((-x[..., h:], x[..., :h]), -1)
        return ltorch.to(x * cos + rot * sin, x.dtype)

    return rotate(q), rotate(k)


# ---- kernel operators --------------------------------------------------------------------------------
def _rope_meta(q, k, cos, sin, position_ids, interleaved):
    return TensorProxy(like=q), TensorProxy(like=k)


rope_forward = operator("rope_forward", meta=_rope_meta, fn=_C.rope_forward)
rope_backward = operator("rope_backward", meta=_rope_meta, fn=_C.rope_backward)
# fn: what a declined call runs when no gradient is needed (with one, thunder differentiates the
# decomposition instead).
kforge_apply_rope = operator("apply_rope", like=_rope_like, fn=apply_rope, replaces=apply_rope)


# ---- checker ---------------------------------------------------------------------------------------
def _table_problem(q: TensorProxy, cos: Any, sin: Any, interleaved: bool, position_ids: Any) -> str | None:
    if not (isinstance(cos, TensorProxy) and isinstance(sin, TensorProxy)):
        return "cos / sin are not tensors"
    if cos.device != q.device or sin.device != q.device:
        return f"cos / sin are on {cos.device} / {sin.device}, q on {q.device}"
    if cos.dtype != sin.dtype or cos.dtype not in (q.dtype, dtypes.float32):
        return f"cos / sin dtypes {cos.dtype} / {sin.dtype} are not q's ({q.dtype}) or float32"
    if tuple(cos.shape) != tuple(sin.shape):
        return f"cos shape {tuple(cos.shape)} differs from sin shape {tuple(sin.shape)}"
    if cos.requires_grad or sin.requires_grad:
        return "cos / sin require grad (kforge computes no gradient for the tables)"
    B, _, T, D = q.shape
    dc = D // 2 if interleaved else D
    want = f"(P, {dc}) with position_ids" if position_ids is not None else f"(B or 1, T, {dc}) or (T, {dc})"
    if cos.ndim not in (2, 3) or cos.shape[-1] != dc:
        return f"cos / sin shape {tuple(cos.shape)} is not {want}"
    if position_ids is not None:
        if not isinstance(position_ids, TensorProxy):
            return "position_ids is not a tensor"
        if position_ids.device != q.device:
            return f"position_ids is on {position_ids.device}, q on {q.device}"
        if position_ids.dtype not in (dtypes.int64, dtypes.int32):
            return f"position_ids dtype {position_ids.dtype} is not int64 or int32"
        ps = tuple(position_ids.shape)
        if not (ps == (T,) or (len(ps) == 2 and ps[0] in (1, B) and ps[1] == T)):
            return f"position_ids shape {ps} is not (T,), (1, T) or (B, T) for B={B}, T={T}"
        if cos.ndim != 2:
            return f"cos / sin shape {tuple(cos.shape)} is not {want}"
        if cos.shape[0] == 0:
            return "cos / sin (P, Dc) tables have no rows"
    elif (cos.ndim == 2 and cos.shape[0] != T) or (cos.ndim == 3 and (cos.shape[0] not in (1, B) or cos.shape[1] != T)):
        return f"cos / sin shape {tuple(cos.shape)} is not {want} for B={B}, T={T}"
    return None


def _check_apply_rope(q: Any, k: Any, cos: Any, sin: Any, interleaved: Any = False,
                      position_ids: Any = None) -> str | None:
    problem = tensor_problem(q, "q") or tensor_problem(k, "k")
    if problem:
        return problem
    if k.device != q.device or k.dtype != q.dtype:
        return f"k ({k.dtype}, {k.device}) differs from q ({q.dtype}, {q.device})"
    if q.ndim != 4 or k.ndim != 4:
        return f"q / k must be (B, H, T, D), got {tuple(q.shape)} / {tuple(k.shape)}"
    if (q.shape[0], q.shape[2], q.shape[3]) != (k.shape[0], k.shape[2], k.shape[3]):
        return f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in B, T or D"
    if q.shape[3] % 2:
        return f"head dim {q.shape[3]} is odd"
    if not isinstance(interleaved, bool):
        return f"interleaved must be a Python bool, got {type(interleaved).__name__}"
    if q.shape[0] * q.shape[2] > 2**31 - 1 or q.shape[1] + k.shape[1] > 2**31 - 1:
        return f"B*T = {q.shape[0] * q.shape[2]} tokens or {q.shape[1] + k.shape[1]} heads exceed 2^31 - 1"
    return _table_problem(q, cos, sin, interleaved, position_ids)


# ---- execution and grad transforms -------------------------------------------------------------------
def _apply_rope_execution(q, k, cos, sin, interleaved=False, position_ids=None):
    return rope_forward(q, k, cos, sin, position_ids, interleaved)


def _apply_rope_grad(q, k, cos, sin, interleaved=False, position_ids=None):
    q_rot, k_rot = rope_forward(q, k, cos, sin, position_ids, interleaved)
    dq, dk = rope_backward(get_grad(q_rot), get_grad(k_rot), cos, sin, position_ids, interleaved)
    put_grad(q, dq)
    put_grad(k, dk)
    return q_rot, k_rot


SPEC = OpSpec("rope", (Claim(kforge_apply_rope, _check_apply_rope, _apply_rope_execution, _apply_rope_grad),))


# ---- benchmarks ---------------------------------------------------------------------------------------
def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """RoPE of q and k at 4 x 2048 tokens, 32 q heads + 8 kv heads of dim 128 (Llama 3 8B), HF
    rotate_half tables; the interleaved layout too unless quick."""
    from ..bench.cases import BenchCase

    B, T, Hq, Hkv, D = 4, 2048, 32, 8, 128
    es = torch.tensor([], dtype=dtype).element_size()
    cases = []
    for interleaved in [False] + ([] if quick else [True]):
        dc = D // 2 if interleaved else D

        def make(interleaved=interleaved, dc=dc):
            q = torch.randn(B, Hq, T, D, device="cuda", dtype=dtype)
            k = torch.randn(B, Hkv, T, D, device="cuda", dtype=dtype)
            ang = torch.rand(1, T, dc, device="cuda") * 6.28
            return q, k, ang.cos().to(dtype), ang.sin().to(dtype), interleaved

        moved = 2 * (B * (Hq + Hkv) * T * D) * es + 2 * T * dc * es
        shape = f"{B}x{T}x({Hq}+{Hkv})x{D}" + (" interleaved" if interleaved else "")
        cases.append(BenchCase(
            "rope", "fwd", shape, make,
            kforge=lambda q, k, c, s, il: _C.rope_forward(q, k, c, s, None, il),
            eager=lambda q, k, c, s, il: apply_rope(q, k, c, s, il), bytes=moved))
        cases.append(BenchCase(
            "rope", "bwd", shape, make,
            kforge=lambda q, k, c, s, il: _C.rope_backward(q, k, c, s, None, il),
            eager=lambda q, k, c, s, il: apply_rope(q, k, c, -s, il), bytes=moved))
    return cases
