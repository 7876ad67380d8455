"""gqa: Hugging Face repeat_kv head expansion and its deterministic backward (sum over each group).

GPU: forward (exact copy) and backward against float64 for ratios 1, 4, 8 (and 3), fp32 / bf16, odd
sizes, strided (transposed) and misaligned inputs, thunder.jit traces. CPU: checker declines,
thunder.jit fallback, launcher errors.
"""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
import thunder
from thunder.core.trace import TraceCtx, tracectx

import kforge
from kforge import _thunder
from kforge.ops import gqa as op
import conftest
from conftest import DTYPES, assert_close, check_jit_matches_eager, gpu, randn

# Proxies in this file are bf16 unless a test says otherwise (conftest.proxy defaults to fp32).
proxy = functools.partial(conftest.proxy, dtype=torch.bfloat16)


def check(x, n_rep, what="", reps=(0,)):
    """Forward (for each `reps`: output heads written per load of x, 0 = all) and backward."""
    dtype = x.dtype
    B, H, T, D = x.shape
    for r in reps:
        out = kforge._C.repeat_kv_forward(x, n_rep, r)
        assert out.shape == (B, H * n_rep, T, D) and out.is_contiguous()
        assert torch.equal(out, torch.repeat_interleave(x, n_rep, dim=1)), f"forward {what} reps={r}"
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
@pytest.mark.parametrize("n_rep", [1, 3, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_rep_groups(dtype, shape, n_rep):
    """The forward's other layouts: one output head per load of x (output in address order, x
    re-read), and groups of two heads (the last group short when n_rep is odd)."""
    x = randn(*shape, dtype=dtype)
    for reps in (1, 2, n_rep + 1):
        out = kforge._C.repeat_kv_forward(x, n_rep, reps)
        assert torch.equal(out, torch.repeat_interleave(x, n_rep, dim=1)), f"{shape} n_rep={n_rep} reps={reps}"


@gpu
@pytest.mark.parametrize("n_rep", [3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bench_size(dtype, n_rep):
    # With reps=1 (8 * 4 slabs * n_rep groups * 16 or 32 tiles) and for the 8x8x4096 case (64 slabs x
    # 64 / 128 tiles) there are more units than blocks (132 SMs): the grid-stride loop.
    check(randn(8, 4, 1024, 128, dtype=dtype), n_rep, "8x4x1024x128", reps=(0, 1))
    check(randn(8, 8, 4096, 128, dtype=dtype), 2, "8x8x4096x128")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_and_misaligned(dtype):
    B, T, H, D = 2, 9, 4, 64
    check(randn(B, T, H, D, dtype=dtype).transpose(1, 2), 4, "transposed (HF k / v views)", reps=(0, 1))
    check(randn(B * H * T * D + 1, dtype=dtype)[1:].view(B, H, T, D), 4, "misaligned", reps=(0, 1))
    check(randn(B, H, T, 2 * D, dtype=dtype)[..., ::2], 2, "strided last dim")
    check(randn(B, 100, H, D + 6, dtype=dtype).transpose(1, 2)[..., 3:3 + D], 3, "transposed, offset rows",
          reps=(0, 1))
    dout = randn(B, H * 4, T, D + 1, dtype=dtype)[..., 1:]
    dx = kforge._C.repeat_kv_backward(dout, 4)
    assert_close(dx, dout.double().view(B, H, 4, T, D).sum(2), dtype, "strided dout")


@gpu
@pytest.mark.parametrize("D", [256, 255], ids=["vec", "elementwise"])
@pytest.mark.bigmem
def test_more_than_2_31_elements(D):
    """64-bit offsets: out (1, 9, 2^20, D) bf16 passes 2^31 elements (heads 8 and up start past it),
    for both forward layouts; the backward of out (3 equal copies) is exactly 3 x."""
    B, H, T, n_rep = 1, 3, 2**20, 3
    n = B * H * T * D
    assert n * n_rep > 2**31
    need = 2 * (2 * n + n * n_rep) + n * n_rep + (2 << 30)  # x, dx, out in bf16, a compare temporary, slack
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free GPU memory, {free / 2**30:.1f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(B, H, T, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    for reps in (0, 1):
        out = kforge._C.repeat_kv_forward(x, n_rep, reps)
        for j in range(H * n_rep):
            assert torch.equal(out[0, j], x[0, j // n_rep]), (reps, j)
        del out
    dx = kforge._C.repeat_kv_backward(kforge._C.repeat_kv_forward(x, n_rep), n_rep)
    for h in range(H):  # x + x + x is exact in fp32
        assert torch.equal(dx[0, h], (x[0, h].float() * 3).bfloat16()), h


@gpu
def test_backward_is_deterministic():
    dout = randn(4, 32, 512, 128, dtype=torch.bfloat16)
    runs = [kforge._C.repeat_kv_backward(dout, 8) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@gpu
def test_gpu_argument_errors():
    with pytest.raises(kforge.KforgeError, match="n_rep must be"):
        kforge._C.repeat_kv_forward(randn(1, 2, 3, 4), 0)
    with pytest.raises(kforge.KforgeError, match="reps must be"):
        kforge._C.repeat_kv_forward(randn(1, 2, 3, 4), 2, -1)
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


# ---- property-based (hypothesis) ----------------------------------------------------------------
@gpu
@pytest.mark.sanitize
@settings(max_examples=30)
@given(B=st.integers(1, 3), H=st.integers(1, 5), T=st.sampled_from([1, 2, 7, 33, 257]),
       D=st.one_of(st.integers(1, 12), st.sampled_from([64, 128]).flatmap(lambda e: st.integers(e - 2, e + 2))),
       n_rep=st.integers(1, 6), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       token_major=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_property_matches_reference(B, H, T, D, n_rep, dtype, token_major, seed):
    """Generated (B, Hkv, T, D) (D around the 16-byte packs, odd), n_rep, dtypes and token-major views
    (a transposed (B, T, Hkv, D) buffer, read in place): forward exact, backward against float64."""
    x = randn(B, H, T, D, dtype=dtype, seed=seed)
    if token_major:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    check(x, n_rep, f"{(B, H, T, D)} n_rep={n_rep}", reps=(0, 1))


_ANY_DTYPE = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
# 2^15 + 1: a (T, D) slab past 2^30 elements; 2^20: Hkv * n_rep past 2^31 - 1 for n_rep >= 2^11.
_GQA_DIM = st.one_of(st.integers(0, 5), st.sampled_from([2**15, 2**15 + 1, 2**20]))


@settings(max_examples=300)
@given(shape=st.one_of(st.tuples(*[_GQA_DIM] * 4), st.lists(_GQA_DIM, min_size=3, max_size=5).map(tuple)),
       dtype=st.one_of(st.sampled_from([torch.float32, torch.bfloat16]), _ANY_DTYPE),
       device=st.sampled_from(["cuda", "cuda", "cpu"]),
       n_rep=st.sampled_from([-1, 0, 1, 2, 3, 7, 2048, 4096, 4097, 8192, 2**20, True, 2.0, "2"]))
# What it found in the checker, kept as explicit examples.
@example(shape=(1, 1, 1, 1), dtype=torch.float32, device="cuda", n_rep=4097)
@example(shape=(1, 2**20, 1, 1), dtype=torch.float32, device="cuda", n_rep=2048)
def test_checker_never_accepts_what_the_kernel_cannot_do(shape, dtype, device, n_rep):
    """Generated proxies (3-D to 5-D, empty, long slabs, many heads) and n_rep values: whatever the
    checker accepts, repeat_kv_forward / repeat_kv_backward take it (CUDA, float dtype, 4-D, n_rep an
    int in [1, 4096], T * D <= 2^30, Hkv * n_rep <= 2^31 - 1), n_rep is not 1 (the identity) and x is
    not empty. Fails if a rule goes: it found n_rep = 4097 and Hkv * n_rep past 2^31 - 1 accepted, which
    the launcher rejects."""
    with tracectx(TraceCtx()):
        x = conftest.proxy(shape, dtype=dtype, device=device)
        if op._check_repeat_kv(x, n_rep) is not None:
            return
    assert device == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert len(shape) == 4 and 0 not in shape
    assert type(n_rep) is int and 2 <= n_rep <= 4096
    B, H, T, D = shape
    assert T * D <= 2**30 and H * n_rep <= 2**31 - 1
