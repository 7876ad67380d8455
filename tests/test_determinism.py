"""Determinism across ops: every kforge launcher, forward and backward, gives bitwise the same outputs
when run again on the same inputs (issue 20).

No kernel in kernels_src/ uses atomics: the reductions that span blocks (layernorm's and rmsnorm's
weight / bias gradients, colsum, repeat_kv's backward, cross-entropy's mean / sum) write one partial
row per block and fold the partials in a fixed order, so their bits do not depend on which block
finishes first. Each case below is sized so that those reductions span many blocks (where atomics or
an order that depends on timing would show) and runs three times; any differing bit fails, and the
message names the op, the output and how many elements differ.

GPU tests; they skip on CPU with the reason.
"""
from __future__ import annotations

import pytest
import torch

import kforge
from conftest import gpu, randn
from kforge._testing import override

pytestmark = gpu

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def with_variant(op, variant, call):
    """call() under `op`'s testing override (kforge._testing.override)."""
    with override(op, variant=variant):
        return call()


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's raw bits (NaN payloads and -0.0 included) as an integer tensor."""
    return t.detach().contiguous().view(_INT[t.element_size()])


def flatten(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in flatten(o)] if isinstance(out, (tuple, list)) else []


def _cases(dtype):
    """{name: (fn, inputs)}: fn(*inputs) runs one launcher; inputs are made once per test."""
    C = kforge._C

    def ln_inputs():
        x = (randn(4096, 1024) * 2 + 0.3).to(dtype)
        w, b = (1 + 0.5 * randn(1024)).to(dtype), (0.5 * randn(1024)).to(dtype)
        _, mean, rstd = C.layernorm_forward(x, w, b, 1e-5)
        return randn(4096, 1024, dtype=dtype), x, w, b, mean, rstd

    def ln_long_inputs():  # BLOCK layout: several row groups per block in the backward
        x = (randn(300, 4100) * 2 + 0.3).to(dtype)
        w, b = (1 + 0.5 * randn(4100)).to(dtype), (0.5 * randn(4100)).to(dtype)
        _, mean, rstd = C.layernorm_forward(x, w, b, 1e-5)
        return randn(300, 4100, dtype=dtype), x, w, b, mean, rstd

    def rms_inputs(shape, variant):
        x = randn(*shape, dtype=dtype)
        w = (1 + 0.3 * randn(shape[-1])).to(dtype)
        _, rstd = C.rmsnorm_forward(x, w, 1e-6)
        return randn(*shape, dtype=dtype), x, w, rstd, variant

    def ce_inputs(reduction):
        n, v = 1024, 8193
        logits = randn(n, v, dtype=dtype, scale=3.0)
        t = torch.randint(0, v, (n,), device="cuda")
        t[::7] = -100
        g = randn(n, dtype=dtype) if reduction == "none" else randn(1, dtype=dtype).view(())
        loss, lse, n_valid = C.cross_entropy_forward(logits, t, -100, reduction)
        return logits, t, g, lse, n_valid, reduction

    def rope_inputs():
        B, T, D = 2, 257, 128
        q, k = randn(B, 8, T, D, dtype=dtype), randn(B, 2, T, D, dtype=dtype)
        ang = randn(T, D // 2, device="cuda").abs()
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dtype), torch.cat((ang.sin(), ang.sin()), -1).to(dtype)
        return q, k, cos, sin

    def qkv_grads():
        return randn(4, 12, 129, 64, dtype=dtype), randn(4, 12, 129, 64, dtype=dtype), randn(4, 12, 129, 64, dtype=dtype)

    return {
        "layernorm_forward": (lambda x, w, b: C.layernorm_forward(x, w, b, 1e-5),
                              lambda: ((randn(4096, 1024) * 2 + 0.3).to(dtype), (1 + 0.5 * randn(1024)).to(dtype),
                                       (0.5 * randn(1024)).to(dtype))),
        "layernorm_backward": (lambda *a: C.layernorm_backward(*a), ln_inputs),
        "layernorm_backward_block": (lambda *a: C.layernorm_backward(*a), ln_long_inputs),
        "layernorm_backward_warp": (lambda *a: with_variant("layernorm_backward", 1, lambda: C.layernorm_backward(*a)),
                                    ln_inputs),
        "rmsnorm_forward": (lambda x, w: C.rmsnorm_forward(x, w, 1e-6),
                            lambda: (randn(4096, 768, dtype=dtype), (1 + 0.3 * randn(768)).to(dtype))),
        "add_rmsnorm_forward": (lambda x, r, w: C.add_rmsnorm_forward(x, r, w, 1e-6),
                                lambda: (randn(4096, 768, dtype=dtype), randn(4096, 768, dtype=dtype),
                                         (1 + 0.3 * randn(768)).to(dtype))),
        "rmsnorm_backward": (lambda dy, x, w, rstd, v: with_variant("rmsnorm_backward", v, lambda: C.rmsnorm_backward(dy, x, w, rstd)),
                             lambda: rms_inputs((4096, 768), 0)),
        "rmsnorm_backward_v1": (lambda dy, x, w, rstd, v: with_variant("rmsnorm_backward", v, lambda: C.rmsnorm_backward(dy, x, w, rstd)),
                                lambda: rms_inputs((4096, 768), 1)),
        "rmsnorm_backward_odd": (lambda dy, x, w, rstd, v: with_variant("rmsnorm_backward", v, lambda: C.rmsnorm_backward(dy, x, w, rstd)),
                                 lambda: rms_inputs((3001, 771), 0)),
        "colsum_forward": (C.colsum_forward, lambda: (randn(20000, 771, dtype=dtype),)),
        "colsum_forward_even": (C.colsum_forward, lambda: (randn(8, 1024, 768, dtype=dtype),)),
        "cross_entropy_forward_mean": (lambda lg, t: C.cross_entropy_forward(lg, t, -100, "mean"),
                                       lambda: ce_inputs("mean")[:2]),
        "cross_entropy_forward_sum": (lambda lg, t: C.cross_entropy_forward(lg, t, -100, "sum"),
                                      lambda: ce_inputs("sum")[:2]),
        "cross_entropy_backward": (lambda lg, t, g, lse, nv, red: C.cross_entropy_backward(g, lg, t, lse, nv, -100, red),
                                   lambda: ce_inputs("mean")),
        "cross_entropy_forward_backward": (lambda lg, t, g, lse, nv, red: C.cross_entropy_forward_backward(lg, t, g, -100, red),
                                           lambda: ce_inputs("mean")),
        "cross_entropy_forward_unit_grad": (lambda lg, t: C.cross_entropy_forward_unit_grad(lg, t, -100, "mean"),
                                            lambda: ce_inputs("mean")[:2]),
        # in place: each run scales a fresh copy of the same unit gradient
        "cross_entropy_rescale": (lambda d, g: C.cross_entropy_rescale(d.clone(), g, "none"),
                                  lambda: (C.cross_entropy_forward_unit_grad(*ce_inputs("none")[:2], -100, "none")[3],
                                           ce_inputs("none")[2])),
        "gelu_forward": (C.gelu_forward, lambda: (randn(8, 1024, 3072, dtype=dtype),)),
        "gelu_backward": (C.gelu_backward, lambda: (randn(8, 1024, 771, dtype=dtype), randn(8, 1024, 771, dtype=dtype))),
        "swiglu_forward": (C.swiglu_forward, lambda: (randn(4, 1000, 2753, dtype=dtype), randn(4, 1000, 2753, dtype=dtype))),
        "swiglu_backward": (C.swiglu_backward, lambda: tuple(randn(4, 1000, 2753, dtype=dtype) for _ in range(3))),
        "residual_forward": (C.residual_forward, lambda: (randn(8, 1024, 768, dtype=dtype), randn(768, dtype=dtype))),
        "softmax_forward": (C.softmax_forward, lambda: (randn(4096, 1000, dtype=dtype, scale=3.0),)),
        "softmax_forward_stream": (C.softmax_forward, lambda: (randn(64, 50257, dtype=dtype, scale=3.0),)),
        "softmax_backward": (C.softmax_backward,
                             lambda: (randn(64, 50257, dtype=dtype), torch.softmax(randn(64, 50257), -1).to(dtype))),
        "causal_softmax_forward": (lambda x: C.causal_softmax_forward(x, 0.125),
                                   lambda: (randn(2, 12, 257, 257, dtype=dtype, scale=8.0),)),
        "causal_softmax_backward": (lambda dy, y: C.causal_softmax_backward(dy, y, 0.125),
                                    lambda: (randn(2, 12, 257, 257, dtype=dtype),
                                             C.causal_softmax_forward(randn(2, 12, 257, 257, dtype=dtype), 0.125))),
        "repeat_kv_forward": (lambda x: C.repeat_kv_forward(x, 4), lambda: (randn(2, 8, 257, 128, dtype=dtype),)),
        "repeat_kv_backward": (lambda d: C.repeat_kv_backward(d, 4), lambda: (randn(2, 32, 257, 128, dtype=dtype),)),
        "split_qkv_forward": (lambda x: C.split_qkv_forward(x, 12), lambda: (randn(4, 129, 3 * 768, dtype=dtype),)),
        "split_qkv_backward": (C.split_qkv_backward, qkv_grads),
        "merge_heads_forward": (C.merge_heads_forward, lambda: (randn(4, 12, 129, 64, dtype=dtype),)),
        "merge_heads_backward": (lambda d: C.merge_heads_backward(d, 12), lambda: (randn(4, 129, 768, dtype=dtype),)),
        "merge_heads_forward_view": (C.merge_heads_forward_view, lambda: (randn(4, 12, 129, 64, dtype=dtype),)),
        "merge_heads_backward_view": (lambda d: C.merge_heads_backward_view(d[..., ::2], 6),
                                      lambda: (randn(4, 129, 768, dtype=dtype),)),
        "rope_forward": (C.rope_forward, rope_inputs),
        "rope_backward": (C.rope_backward, rope_inputs),
    }


CASE_NAMES = list(_cases(torch.float32))


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_bitwise_equal_run_to_run(dtype, name):
    """Three runs of one launcher on the same inputs: every output bitwise equal to the first run's.
    Fails on any differing bit (atomics, a timing-dependent reduction order, an uninitialised read)."""
    fn, make = _cases(dtype)[name]
    inputs = make()
    first = [bits(t).clone() for t in flatten(fn(*inputs))]
    assert first, f"{name}: no tensor outputs"
    for run in (2, 3):
        # Other work in between changes which SMs are busy and what the caches hold.
        torch.randn(1 << 22, device="cuda").sum()
        again = [bits(t) for t in flatten(fn(*inputs))]
        assert len(again) == len(first)
        for k, (a, b) in enumerate(zip(first, again)):
            assert a.shape == b.shape, f"{name} output {k}: shape {tuple(b.shape)} != {tuple(a.shape)}"
            diff = int((a != b).sum())
            assert diff == 0, f"{name} ({dtype}) output {k}: {diff} of {a.numel()} elements differ in run {run}"
