"""Embedding weight gradient: `torch.ops.aten.embedding_backward` in one deterministic kernel.

Thunder's grad of `F.embedding` writes the weight gradient as `torch.ops.aten.embedding_backward(g,
indices, num_weights, padding_idx, scale_grad_by_freq, sparse)`, which PyTorch runs as a sort of the
indices and about 19 small kernels (radix sort, unique, scans, segment sums, scatter). Here: one
launch in which each block owns a tile of vocabulary rows, lists the tokens that fall in it (in token
order) and sums their gradient rows in fp32 registers, writing every row of the (num_weights, C)
result once: rows without tokens are zeros, tokens equal to padding_idx add nothing. The sum order is
fixed by the indices alone (ascending token; a frequent token's row in eight runs added in order), so
results are bitwise reproducible, on any GPU. Kernel: kernels_src/embedding.cu.

Claims `thunder.torch.embedding_backward` in backward traces (it has no gradient of its own); the
forward gather stays Thunder's. A non-contiguous grad is copied to contiguous by the launcher.
Indices outside [0, num_weights) add nothing (torch's kernel asserts on the device instead).
Declined: not CUDA, grad dtype other than fp32 / bf16 / fp16, indices neither int64 nor int32,
scale_grad_by_freq, sparse, grad's shape other than indices.shape + (C,).
"""
from __future__ import annotations

from typing import Any

import torch
import thunder.torch as ltorch
from thunder.core import dtypes
from thunder.core.proxies import NumberProxy, TensorProxy

from .. import _C
from .._thunder import Claim, OpSpec, operator, tensor_problem

_INDEX_DTYPES = (torch.int64, torch.int32)
# The launcher's widest row (src/ops/embedding_plan.h, kEmbeddingMaxC): 65535 column chunks of 256.
_MAX_C = 65535 * 256


def _backward_meta(grad: TensorProxy, indices: TensorProxy, num_weights: int, padding_idx: int) -> TensorProxy:
    return TensorProxy(like=grad, shape=(num_weights, grad.shape[-1]))


# (grad (*S, C), indices S, num_weights, padding_idx) -> dW (num_weights, C) in grad's dtype
embedding_backward = operator("embedding_backward", meta=_backward_meta, fn=_C.embedding_backward)


def _int_value(x: Any) -> Any:
    """A Python int's value, also through a NumberProxy; None when `x` is not an int."""
    if isinstance(x, NumberProxy):
        x = x.value
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _checker(grad: Any, indices: Any, num_weights: Any, padding_idx: Any, scale_grad_by_freq: Any,
             sparse: Any) -> str | None:
    """None when kforge takes `ltorch.embedding_backward(...)` with these arguments, else why not."""
    if (p := tensor_problem(grad, "grad")) is not None:
        return p
    if not isinstance(indices, TensorProxy):
        return "indices is not a tensor"
    if dtypes.to_torch_dtype(indices.dtype) not in _INDEX_DTYPES:
        return f"indices dtype {dtypes.to_torch_dtype(indices.dtype)} is not int64 or int32"
    if indices.device != grad.device:
        return f"indices is on {indices.device}, grad on {grad.device}"
    if scale_grad_by_freq:
        return "scale_grad_by_freq=True is not supported"
    if sparse:
        return "sparse=True is not supported"
    if grad.ndim != indices.ndim + 1 or tuple(grad.shape[:-1]) != tuple(indices.shape):
        return f"grad shape {tuple(grad.shape)} is not indices shape {tuple(indices.shape)} + (C,)"
    v, pad = _int_value(num_weights), _int_value(padding_idx)
    if v is None or v < 1:
        return f"num_weights={num_weights!r} is not a positive int"
    if pad is None:
        return f"padding_idx={padding_idx!r} is not an int"
    if indices.numel > 2**31 - 1:  # the launcher's limit: tokens are ints in the kernel
        return f"{indices.numel} tokens exceed 2^31 - 1"
    if grad.shape[-1] > _MAX_C:
        return f"last dim {grad.shape[-1]} exceeds {_MAX_C}"
    return None


def _execution(grad: TensorProxy, indices: TensorProxy, num_weights: int, padding_idx: int,
               scale_grad_by_freq: bool, sparse: bool) -> TensorProxy:
    return embedding_backward(grad, indices, _int_value(num_weights), _int_value(padding_idx))


SPEC = OpSpec("embedding", (Claim(ltorch.embedding_backward, _checker, _execution),))


def bench_cases(dtype: torch.dtype, quick: bool) -> list:
    """Token-embedding gradients at B*T = 8192, C = 768: Llama's 32000 and GPT-2's padded 50304 rows."""
    from ..bench.cases import BenchCase

    vocabs = [32000] if quick else [32000, 50304]
    n, c, es = 8192, 768, torch.finfo(dtype).bits // 8
    cases: list[BenchCase] = []
    for v in vocabs:

        def inputs(v: int = v) -> tuple[torch.Tensor, torch.Tensor]:
            gen = torch.Generator(device="cuda").manual_seed(0)
            g = torch.randn(8, n // 8, c, device="cuda", generator=gen).to(dtype)
            return g, torch.randint(0, v, (8, n // 8), device="cuda", generator=gen)

        def eager(g: torch.Tensor, idx: torch.Tensor, v: int = v) -> torch.Tensor:
            return torch.ops.aten.embedding_backward(g, idx, v, -1, False, False)

        # grad read once, indices read once, dW written once
        cases.append(BenchCase("embedding", "bwd", f"{n}x{c}->{v}", inputs,
                               lambda g, idx, v=v: _C.embedding_backward(g, idx, v),
                               eager, n * c * es + n * 8 + v * c * es))
    return cases
