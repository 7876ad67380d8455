"""attention: SDPA on cuDNN through kforge (forward and backward against a float64 reference) and the
checker's declines."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, gpu, proxy, randn


@pytest.fixture
def on_hopper(monkeypatch):
    """The checker's device question answered as on an sm_90 GPU (CPU tests)."""
    from kforge.ops import attention

    monkeypatch.setattr(attention, "_device_problem", lambda q: None)


def test_checker_accepts_and_declines(trace_ctx, on_hopper) -> None:
    from kforge.ops.attention import _check

    q = proxy(2, 4, 128, 64, dtype=torch.bfloat16)
    assert _check(q, q, q, is_causal=True) is None
    assert _check(q, q, q, None, 0.0, False, scale=0.125) is None
    reasons = {
        "fp32": _check(*(proxy(2, 4, 128, 64),) * 3),
        "mask": _check(q, q, q, attn_mask=proxy(128, 128, dtype=torch.bfloat16)),
        "dropout": _check(q, q, q, dropout_p=0.1),
        "gqa": _check(q, proxy(2, 2, 128, 64, dtype=torch.bfloat16), proxy(2, 2, 128, 64, dtype=torch.bfloat16)),
        "head dim": _check(*(proxy(2, 4, 128, 160, dtype=torch.bfloat16),) * 3),
        "3-D": _check(*(proxy(4, 128, 64, dtype=torch.bfloat16),) * 3),
        "cpu": _check(*(proxy(2, 4, 128, 64, dtype=torch.bfloat16, device="cpu"),) * 3),
    }
    for what, reason in reasons.items():
        assert reason, f"{what} accepted"
    assert "bf16" in reasons["fp32"] and "mask" in reasons["mask"] and "head dim" in reasons["head dim"]


def test_declined_without_a_gpu(trace_ctx) -> None:
    from kforge.ops.attention import _check

    q = proxy(2, 4, 128, 64, dtype=torch.bfloat16)
    if not torch.cuda.is_available():
        assert "no CUDA device" in _check(q, q, q)


def _reference(q, k, v, is_causal, scale):
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        t = q.shape[2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v64


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal,scale", [(True, None), (False, 0.2)])
@pytest.mark.parametrize("heads_major", [True, False])
def test_matches_float64(dtype, is_causal, scale, heads_major) -> None:
    import thunder

    import kforge

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is claimed from sm_90 on")
    b, h, t, d = 2, 3, 197, 64

    def make():
        if heads_major:
            return randn(b, h, t, d, dtype=dtype).requires_grad_()
        return randn(b, t, h, d, dtype=dtype).transpose(1, 2).detach().requires_grad_()  # (B,T,H,D) storage

    q, k, v = make(), make(), make()

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)

    jf = thunder.jit(fn, executors=kforge.executors())
    out = jf(q, k, v)
    assert "kforge_attention_forward" in {s.sym.name for s in thunder.last_traces(jf)[-1].bound_symbols}
    dout = randn(*out.shape, dtype=dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _reference(q64, k64, v64, is_causal, scale)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert_close(out, ref, dtype, "out", tol=tol)
    for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert_close(g, r, dtype, name, tol=tol * 2)
