"""swiglu: out = silu(gate) * up and its one-pass backward (d_gate, d_up).

GPU: forward and backward against float64 for fp32 / bf16, any numel (odd sizes, misaligned
pointers, > 2^31-element offsets), thunder.jit traces. CPU: checker declines, thunder.jit fallback,
launcher errors.
"""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
import thunder
from thunder.core.trace import TraceCtx, tracectx

import kforge
from kforge import _thunder
from kforge.ops import swiglu as op
import conftest
from conftest import DTYPES, assert_close, check_jit_matches_eager, gpu, randn

# Proxies in this file are bf16 unless a test says otherwise (conftest.proxy defaults to fp32).
proxy = functools.partial(conftest.proxy, dtype=torch.bfloat16)


def check(gate, up, dout, what=""):
    dtype = gate.dtype
    out = kforge._C.swiglu_forward(gate, up)
    d_gate, d_up = kforge._C.swiglu_backward(dout, gate, up)
    g64 = gate.detach().double().requires_grad_()
    u64 = up.detach().double().requires_grad_()
    ref = F.silu(g64) * u64
    ref.backward(dout.double())
    assert out.dtype == dtype and d_gate.dtype == dtype and d_up.dtype == dtype
    assert_close(out, ref, dtype, f"out {what}")
    assert_close(d_gate, g64.grad, dtype, f"d_gate {what}")
    assert_close(d_up, u64.grad, dtype, f"d_up {what}")


SHAPES = [(8, 14336), (1, 1), (3, 7), (5, 1000), (2, 3, 4099), (1, 11008)]


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_backward(dtype, shape):
    # gate spans both tails of the sigmoid.
    check(randn(*shape, dtype=dtype, scale=4), randn(*shape, dtype=dtype), randn(*shape, dtype=dtype),
          str(shape))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_size(dtype):
    n = (8192, 14336)
    check(randn(*n, dtype=dtype, scale=3), randn(*n, dtype=dtype), randn(*n, dtype=dtype), "8192x14336")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_and_strided(dtype):
    n = 4096 + 5
    g = randn(n + 1, dtype=dtype)[1:]  # off 16-byte boundaries: the scalar loop
    check(g, randn(n, dtype=dtype), randn(n, dtype=dtype), "misaligned gate")
    gt = randn(64, 96, dtype=dtype).t()  # non-contiguous: copied by the launcher
    check(gt, randn(96, 64, dtype=dtype), randn(96, 64, dtype=dtype), "transposed gate")


@gpu
def test_saturated_inputs():
    g = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0], device="cuda")
    u, d = torch.ones_like(g), torch.ones_like(g)
    out = kforge._C.swiglu_forward(g, u)
    d_gate, d_up = kforge._C.swiglu_backward(d, g, u)
    assert torch.isfinite(out).all() and torch.isfinite(d_gate).all() and torch.isfinite(d_up).all()
    torch.testing.assert_close(out, F.silu(g))


@gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory < 40 * 2**30,
                    reason="needs 40 GiB of GPU memory")
@pytest.mark.bigmem
def test_more_than_2_pow_31_elements():
    n = 2**31 + 24  # packs and scalars past the 32-bit offset range
    g = torch.full((n,), 1.5, device="cuda", dtype=torch.bfloat16)
    u = torch.full((n,), -2.0, device="cuda", dtype=torch.bfloat16)
    g[-3:] = 4.0
    out = kforge._C.swiglu_forward(g, u)
    expect = (F.silu(torch.tensor([1.5, 4.0])) * -2.0).bfloat16().cuda()
    torch.testing.assert_close(out[[0, 2**31 - 1, n - 1]], expect[[0, 0, 1]])
    del out
    d_gate, d_up = kforge._C.swiglu_backward(u, g, u)  # dout = up
    assert torch.isfinite(d_gate[-8:]).all()
    torch.testing.assert_close(d_up[[0, n - 1]], expect[[0, 1]])


@gpu
def test_gpu_argument_errors():
    with pytest.raises(kforge.KforgeError, match="shapes differ"):
        kforge._C.swiglu_forward(randn(4, 8), randn(4, 9))
    with pytest.raises(kforge.KforgeError, match="dtype"):
        kforge._C.swiglu_forward(randn(4, 8), randn(4, 8, dtype=torch.bfloat16))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit(dtype):
    def fn(gate, up):
        return op.swiglu(gate, up) * 3

    g, u = randn(4, 9, 1000, dtype=dtype, scale=3).requires_grad_(), randn(4, 9, 1000, dtype=dtype).requires_grad_()
    check_jit_matches_eager(fn, [g, u], dtype, "kforge_swiglu_forward", "kforge_swiglu_backward",
                            ["out", "d_gate", "d_up"])


# ---- CPU ---------------------------------------------------------------------------------------------------
def test_checker():
    (claim,) = op.SPEC.claims
    with tracectx(TraceCtx()):
        assert claim.checker(proxy(8, 14336), proxy(8, 14336)) is None
        assert "not CUDA" in claim.checker(proxy(8, 16, device="cpu"), proxy(8, 16, device="cpu"))
        assert "float64" in claim.checker(proxy(8, 16, dtype=torch.float64), proxy(8, 16, dtype=torch.float64))
        assert "up dtype" in claim.checker(proxy(8, 16), proxy(8, 16, dtype=torch.float32))
        assert "broadcasting" in claim.checker(proxy(8, 16), proxy(1, 16))
        assert "empty" in claim.checker(proxy(0, 16), proxy(0, 16))


def test_cpu_fallback():
    g, u = torch.randn(3, 50, requires_grad=True), torch.randn(3, 50, requires_grad=True)
    jg, ju = (t.detach().clone().requires_grad_() for t in (g, u))
    _thunder.reset_declines()
    jf = thunder.jit(op.swiglu, executors=[kforge.executor])
    out, ref = jf(jg, ju), op.swiglu(g, u)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(jg.grad, g.grad)
    torch.testing.assert_close(ju.grad, u.grad)
    assert any("not CUDA" in r for r in _thunder.declines()["kforge_swiglu"])


def test_cpu_fallback_without_grad():
    g, u = torch.randn(3, 50), torch.randn(3, 50)
    jf = thunder.jit(op.swiglu, executors=[kforge.executor])
    with torch.no_grad():
        torch.testing.assert_close(jf(g, u), op.swiglu(g, u))


def test_launcher_rejects_cpu_tensors():
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.swiglu_forward(torch.randn(4), torch.randn(4))
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.swiglu_backward(torch.randn(4), torch.randn(4), torch.randn(4))


# ---- property-based (hypothesis) ----------------------------------------------------------------
@gpu
@pytest.mark.sanitize
@settings(max_examples=30)
@given(n=st.one_of(st.integers(1, 40), st.sampled_from([4, 8, 2048, 4096, 11008]).flatmap(lambda e: st.integers(e - 3, e + 3))),
       rows=st.sampled_from([1, 2, 7]), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       layout=st.sampled_from(["contiguous", "offset", "transposed"]), seed=st.integers(0, 2**31 - 1))
def test_property_matches_float64(n, rows, dtype, layout, seed):
    """Generated sizes around the 16-byte packs, dtypes, misaligned (offset) and transposed views:
    check() (out, d_gate, d_up against float64)."""
    gate, up = randn(rows, n, dtype=dtype, scale=3.0, seed=seed), randn(rows, n, dtype=dtype, seed=seed + 1)
    dout = randn(rows, n, dtype=dtype, seed=seed + 2)
    if layout == "offset":
        gate = torch.empty(gate.numel() + 1, dtype=dtype, device="cuda")[1:].view(rows, n).copy_(gate)
    elif layout == "transposed":
        up = up.t().contiguous().t()
    check(gate, up, dout, f"({rows}, {n}) {layout}")


_ANY_DTYPE = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
_SHAPES = st.lists(st.sampled_from([0, 1, 2, 3, 8]), min_size=0, max_size=3).map(tuple)


@settings(max_examples=150)
@given(shape=_SHAPES, up_shape=st.one_of(st.none(), _SHAPES), dtype=_ANY_DTYPE, up_dtype=_ANY_DTYPE,
       device=st.sampled_from(["cuda", "cpu"]), up_device=st.sampled_from(["cuda", "cpu"]))
def test_checker_never_accepts_what_the_kernel_cannot_do(shape, up_shape, dtype, up_dtype, device, up_device):
    """Generated gate / up proxies (same or other shape, dtype, device): whatever the checker accepts,
    swiglu_forward / swiglu_backward take it (CUDA, one float dtype and device, equal shapes: no
    broadcasting) and it is not empty. Fails if a rule goes (a (3, 1) up for a (3, 8) gate would be
    accepted and the launcher raise "shapes differ")."""
    up_shape = shape if up_shape is None else up_shape
    with tracectx(TraceCtx()):
        gate = conftest.proxy(shape, dtype=dtype, device=device)
        up = conftest.proxy(up_shape, dtype=up_dtype, device=up_device)
        if op._check_swiglu(gate, up) is not None:
            return
    assert device == up_device == "cuda" and dtype == up_dtype
    assert dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert up_shape == shape and 0 not in shape
