"""gqa: Hugging Face repeat_kv head expansion and its deterministic backward (sum over each group).

GPU: forward (exact copy) and backward against float64 for ratios 1, 4, 8 (and 3), fp32 / bf16, odd
sizes, strided (transposed) and misaligned inputs, thunder.jit traces. CPU: checker declines,
thunder.jit fallback, launcher errors.
"""
from __future__ import annotations

import functools

import pytest
import torch
import thunder
from thunder.core.trace import TraceCtx, tracectx

import kforge
from kforge import _thunder
from kforge.ops import gqa as op
import conftest
from conftest import DTYPES, assert_close, check_jit_matches_eager, gpu, randn

# Proxies in this file are bf16 unless a test says otherwise (conftest.proxy defaults to fp32).
proxy = functools.partial(conftest.proxy, dtype=torch.bfloat16)


def check(x, n_rep, what=""):
    dtype = x.dtype
    B, H, T, D = x.shape
    out = kforge._C.repeat_kv_forward(x, n_rep)
    assert out.shape == (B, H * n_rep, T, D) and out.is_contiguous()
    assert torch.equal(out, torch.repeat_interleave(x, n_rep, dim=1)), f"forward {what}"
    dout = randn(B, H * n_rep, T, D, dtype=dtype)
    dx = kforge._C.repeat_kv_backward(dout, n_rep)
    assert_close(dx, dout.double().view(B, H, n_rep, T, D).sum(2), dtype, f"backward {what}")
    return dout, dx


# (B, Hkv, T, D)
SHAPES = [(2, 4, 16, 128), (1, 8, 1, 64), (2, 2, 1000, 128), (3, 1, 5, 6), (1, 3, 7, 10)]


@gpu
@pytest.mark.parametrize("n_rep", [1, 3, 4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_backward(dtype, shape, n_rep):
    check(randn(*shape, dtype=dtype), n_rep, f"{shape} n_rep={n_rep}")


@gpu
@pytest.mark.parametrize("n_rep", [3, 8])
def test_bench_size(n_rep):
    check(randn(8, 4, 1024, 128, dtype=torch.bfloat16), n_rep, "8x4x1024x128")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_and_misaligned(dtype):
    B, T, H, D = 2, 9, 4, 64
    check(randn(B, T, H, D, dtype=dtype).transpose(1, 2), 4, "transposed (HF k / v views)")
    check(randn(B * H * T * D + 1, dtype=dtype)[1:].view(B, H, T, D), 4, "misaligned")
    check(randn(B, H, T, 2 * D, dtype=dtype)[..., ::2], 2, "strided last dim")
    dout = randn(B, H * 4, T, D + 1, dtype=dtype)[..., 1:]
    dx = kforge._C.repeat_kv_backward(dout, 4)
    assert_close(dx, dout.double().view(B, H, 4, T, D).sum(2), dtype, "strided dout")


@gpu
def test_backward_is_deterministic():
    dout = randn(4, 32, 512, 128, dtype=torch.bfloat16)
    runs = [kforge._C.repeat_kv_backward(dout, 8) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@gpu
def test_gpu_argument_errors():
    with pytest.raises(kforge.KforgeError, match="n_rep must be"):
        kforge._C.repeat_kv_forward(randn(1, 2, 3, 4), 0)
    with pytest.raises(kforge.KforgeError, match=r"\(B, Hkv, T, D\)"):
        kforge._C.repeat_kv_forward(randn(2, 3, 4), 2)
    with pytest.raises(kforge.KforgeError, match="n_rep = 3"):
        kforge._C.repeat_kv_backward(randn(1, 8, 3, 4), 3)


@gpu
@pytest.mark.parametrize("n_rep", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit(dtype, n_rep):
    def fn(k, v):
        return op.repeat_kv(k, n_rep) * 2 + op.repeat_kv(v, n_rep)

    B, T, H, D = 2, 12, 2, 64
    k = randn(B, T, H, D, dtype=dtype).transpose(1, 2).requires_grad_()
    v = randn(B, H, T, D, dtype=dtype).requires_grad_()
    check_jit_matches_eager(fn, [k, v], dtype, "kforge_repeat_kv_forward", "kforge_repeat_kv_backward",
                            ["out", "dk", "dv"])


# ---- CPU ---------------------------------------------------------------------------------------------------
def test_checker():
    (claim,) = op.SPEC.claims
    with tracectx(TraceCtx()):
        x = proxy(2, 4, 16, 128)
        assert claim.checker(x, 4) is None and claim.checker(x, 8) is None
        assert "identity" in claim.checker(x, 1)
        assert "positive Python int" in claim.checker(x, 0)
        assert "positive Python int" in claim.checker(x, True)
        assert "(B, Hkv, T, D)" in claim.checker(proxy(4, 16, 128), 2)
        assert "not CUDA" in claim.checker(proxy(2, 4, 16, 128, device="cpu"), 4)
        assert "float64" in claim.checker(proxy(2, 4, 16, 128, dtype=torch.float64), 4)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("n_rep", [1, 4])
def test_cpu_fallback(n_rep, grad):
    x = torch.randn(2, 3, 5, 8, requires_grad=True)
    jx = x.detach().clone().requires_grad_()
    fn = lambda x: op.repeat_kv(x, n_rep) * torch.arange(3 * n_rep).view(1, -1, 1, 1)  # noqa: E731
    _thunder.reset_declines()
    jf = thunder.jit(fn, executors=[kforge.executor])
    if not grad:
        with torch.no_grad():
            torch.testing.assert_close(jf(jx), fn(x))
        return
    out, ref = jf(jx), fn(x)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(jx.grad, x.grad)
    assert any("not CUDA" in r for r in _thunder.declines()["kforge_repeat_kv"])


def test_helper_is_repeat_interleave():
    x = torch.randn(2, 3, 4, 5)
    for n in (1, 2, 4):
        assert torch.equal(op.repeat_kv(x, n), torch.repeat_interleave(x, n, dim=1))


def test_launcher_rejects_cpu_tensors():
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.repeat_kv_forward(torch.randn(1, 2, 3, 4), 2)
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.repeat_kv_backward(torch.randn(1, 4, 3, 4), 2)
