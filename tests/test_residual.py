"""residual (a + b, same shape and dtype): the launcher against a float64 reference (exact: one
rounding of the fp32 sum, as eager), the 16-byte / scalar-tail paths, and the Thunder claim of
`add` (no casts left in the forward or backward trace).

CPU tests: decline reasons (broadcasting, numbers, alpha, mixed dtypes, CPU tensors, kforge's fusion
executor in the executor list), the fallback to torch on CPU tensors, and the Thunder plumbing with
the launcher swapped for torch.add.
"""
from __future__ import annotations

import pytest
import torch
import thunder
from hypothesis import given, settings
from hypothesis import strategies as st
from thunder.core.trace import TraceCtx, tracectx

import kforge
from conftest import DTYPES, assert_close, gpu, proxy, randn, swap_launchers, symbol_names
from kforge import _thunder
from kforge.ops import residual as rs


def expected(a, b):
    """The fp32 sum rounded once to the storage dtype: what eager computes for bf16 / fp16 too."""
    return (a.float() + b.float()).to(a.dtype)


SHAPES = [(1,), (7,), (1000,), (8, 768), (3, 5, 771), ((1 << 20) + 3,), (8, 1024, 768)]


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_matches_reference_bitwise(dtype, shape):
    a, b = randn(*shape, dtype=dtype, scale=3.0), randn(*shape, dtype=dtype)
    out = kforge._C.residual_forward(a, b)
    assert out.dtype == dtype and out.shape == a.shape
    torch.testing.assert_close(out, expected(a, b), rtol=0, atol=0)
    torch.testing.assert_close(out, a + b, rtol=0, atol=0)  # eager's add: the same bits


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_and_strided_inputs(dtype):
    """A view off a 16-byte boundary takes the scalar path; transposed views are read in place."""
    n = 4099
    a, b = randn(n, dtype=dtype), randn(n, dtype=dtype)
    a_off = torch.empty(n + 1, dtype=dtype, device="cuda")[1:].copy_(a)
    assert a_off.data_ptr() % 16 != 0
    torch.testing.assert_close(kforge._C.residual_forward(a_off, b), expected(a, b), rtol=0, atol=0)
    at, bt = randn(96, 64, dtype=dtype).t(), randn(96, 64, dtype=dtype).t()
    torch.testing.assert_close(kforge._C.residual_forward(at, bt), expected(at, bt), rtol=0, atol=0)


def _heads(*bthd, dtype):
    """(B, H, T, D) heads in (B, T, H, D) memory: a projection's view(B, T, H, D).transpose(1, 2)."""
    b, t, h, d = bthd
    return randn(b, t, h, d, dtype=dtype).transpose(1, 2)


LAYOUTS = {
    "a transposed, b contiguous": lambda dt: (_heads(2, 64, 8, 32, dtype=dt), randn(2, 8, 64, 32, dtype=dt)),
    "a contiguous, b transposed": lambda dt: (randn(2, 8, 64, 32, dtype=dt), _heads(2, 64, 8, 32, dtype=dt)),
    "both transposed alike": lambda dt: (_heads(2, 64, 8, 32, dtype=dt), _heads(2, 64, 8, 32, dtype=dt)),
    "a permuted, odd sizes": lambda dt: (randn(3, 5, 7, 9, dtype=dt).permute(0, 3, 1, 2), randn(3, 9, 5, 7, dtype=dt)),
    "a sliced (not dense)": lambda dt: (randn(8, 100, dtype=dt)[:, :96], randn(8, 96, dtype=dt)),
    "a transposed, size-1 dim": lambda dt: (_heads(1, 64, 8, 32, dtype=dt), randn(1, 8, 64, 32, dtype=dt)),
}


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_output_takes_eager_layout(dtype, layout):
    """The output is laid out as eager's `a + b` (a's dim order when a is dense, as TensorIterator
    does): a value Thunder hands to an Inductor piece of a split Dynamo graph has the strides Inductor
    compiled for. Bits as eager's."""
    a, b = LAYOUTS[layout](dtype)
    out, ref = kforge._C.residual_forward(a, b), a + b
    assert out.stride() == ref.stride(), (out.stride(), ref.stride())
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert a.stride() == LAYOUTS[layout](dtype)[0].stride()  # the inputs were not rewritten


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shapes", [((8, 64, 192), (64, 192)), ((4, 33, 771), (771,)), ((5, 16), (16,)),
                                    ((3, 7, 8), (7, 8))], ids=str)
def test_broadcast_over_leading_dims(dtype, shapes):
    """b of a's trailing dims (GPT-2's position embedding): the 16-byte path when b is whole packs,
    else the scalar one; bit-exact against eager's broadcast add."""
    sa, sb = shapes
    a, b = randn(*sa, dtype=dtype), randn(*sb, dtype=dtype)
    torch.testing.assert_close(kforge._C.residual_forward(a, b), a + b, rtol=0, atol=0)


@gpu
def test_launcher_rejects_bad_arguments():
    a = randn(16)
    with pytest.raises(kforge.KforgeError, match="b has shape"):
        kforge._C.residual_forward(a, randn(15))
    with pytest.raises(kforge.KforgeError, match="trailing dims"):
        kforge._C.residual_forward(randn(4, 6), randn(4, 1))
    with pytest.raises(kforge.KforgeError, match="b has dtype"):
        kforge._C.residual_forward(a, randn(16, dtype=torch.bfloat16))
    with pytest.raises(kforge.KforgeError, match="not supported"):
        kforge._C.residual_forward(a.double(), a.double())


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_uses_kforge_and_drops_the_casts(dtype):
    """A residual x + y under thunder.jit: one kforge kernel forward, the same bits as eager, the
    gradient passed unchanged to both inputs, and no dtype conversions in either trace."""
    x = randn(4, 33, 768, dtype=dtype).requires_grad_(True)
    y = randn(4, 33, 768, dtype=dtype).requires_grad_(True)
    jf = thunder.jit(lambda x, y: x + y, executors=[kforge.executor])
    out = jf(x, y)
    g = randn(*out.shape, dtype=dtype)
    dx, dy = torch.autograd.grad(out, (x, y), g)
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert "kforge_residual_forward" in symbol_names(fwd)
    assert not {"to", "convert_element_type", "add"} & (symbol_names(fwd) | symbol_names(bwd)), (fwd, bwd)
    torch.testing.assert_close(out, x.detach() + y.detach(), rtol=0, atol=0)
    torch.testing.assert_close(dx, g, rtol=0, atol=0)
    torch.testing.assert_close(dy, g, rtol=0, atol=0)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_broadcast_add_and_its_gradient(dtype):
    """tok (B, T, C) + pos (T, C), either order: one kforge kernel; pos's gradient is g summed over B."""
    tok = randn(4, 33, 96, dtype=dtype).requires_grad_(True)
    pos = randn(33, 96, dtype=dtype).requires_grad_(True)
    for fn in (lambda t, p: t + p, lambda t, p: p + t):
        jf = thunder.jit(fn, executors=[kforge.executor])
        out = jf(tok, pos)
        g = randn(*out.shape, dtype=dtype)
        dt, dp = torch.autograd.grad(out, (tok, pos), g)
        assert "kforge_residual_forward" in symbol_names(thunder.last_traces(jf)[-1])
        torch.testing.assert_close(out, tok.detach() + pos.detach(), rtol=0, atol=0)
        torch.testing.assert_close(dt, g, rtol=0, atol=0)
        assert_close(dp, g.double().sum(0), dtype, "dpos")


@gpu
def test_thunder_leaves_other_broadcasting_to_torch_on_gpu():
    _thunder.reset_declines()
    x, b = randn(8, 64), randn(8, 1)
    jfn = thunder.jit(lambda x, b: x + b, executors=[kforge.executor])
    torch.testing.assert_close(jfn(x, b), x + b)
    assert "kforge_residual_forward" not in symbol_names(thunder.last_traces(jfn)[-1])
    assert any("trailing dims" in r for r in _thunder.declines()["add"])


# ---- CPU: declines, fallback, plumbing ----------------------------------------------------------------
def test_cpu_tensors_fall_back_to_torch():
    _thunder.reset_declines()
    a = randn(5, 37, device="cpu").requires_grad_(True)
    b = randn(5, 37, device="cpu").requires_grad_(True)
    jfn = thunder.jit(lambda a, b: a + b, executors=[kforge.executor])
    out = jfn(a, b)
    out.backward(torch.ones_like(out))
    assert "kforge_" not in str(thunder.last_traces(jfn)[-1])
    torch.testing.assert_close(out, a.detach() + b.detach())
    torch.testing.assert_close(a.grad, torch.ones_like(a))
    assert any(r.startswith("residual: ") and "not CUDA" in r for r in _thunder.declines()["add"])


def test_launcher_rejects_cpu_tensors():
    a = randn(16, device="cpu")
    with pytest.raises(kforge.KforgeError, match="residual_forward: a must be a CUDA tensor"):
        kforge._C.residual_forward(a, a)


def test_checker_accepts_and_declines_with_reasons():
    check = rs._checker
    with tracectx(TraceCtx()):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert check(proxy(8, 768, dtype=dtype), proxy(8, 768, dtype=dtype)) is None
            assert check(proxy(8, 768, dtype=dtype), proxy(768, dtype=dtype)) is None  # broadcast
            assert check(proxy(768, dtype=dtype), proxy(8, 768, dtype=dtype)) is None
        a = proxy(8, 768)
        cases = {
            "trailing dims": check(a, proxy(8, 1)),
            "b is not a tensor": check(a, 2.0),
            "a is not a tensor": check(2.0, a),
            "alpha=2": check(a, proxy(8, 768), alpha=2),
            "dtype": check(a, proxy(8, 768, dtype=torch.bfloat16)),
            "not CUDA": check(proxy(8, 768, device="cpu"), proxy(8, 768, device="cpu")),
            "float64": check(proxy(8, 768, dtype=torch.float64), proxy(8, 768, dtype=torch.float64)),
            "empty": check(proxy(0, 768), proxy(0, 768)),
        }
    for expected_reason, reason in cases.items():
        assert reason is not None and expected_reason in reason, (expected_reason, reason)


def fusion_listed(*executors):
    """A compile-data stand-in whose executor list the checkers read (Thunder sets the real one
    during `thunder.jit`'s compile)."""
    from types import SimpleNamespace

    from thunder.core.compile_data import compile_data_and_stats

    return compile_data_and_stats(SimpleNamespace(executors_list=tuple(executors)), None)


def test_left_to_the_fusion_executor_when_it_is_listed():
    fusion = pytest.importorskip("kforge.fusion", reason="kforge.fusion is not in this tree").get_fusion_executor()
    with tracectx(TraceCtx()):
        a, b = proxy(8, 768, dtype=torch.bfloat16), proxy(8, 768, dtype=torch.bfloat16)
        with fusion_listed(kforge.executor, fusion):
            assert rs.fusion_in_use()
            assert rs._checker(a, b) == rs.FUSION_DECLINE == "left to kforge.fusion"
        with fusion_listed(kforge.executor, *thunder.get_default_executors()):
            assert not rs.fusion_in_use() and rs._checker(a, b) is None
        assert not rs.fusion_in_use() and rs._checker(a, b) is None  # outside a compile


def test_fusion_decline_recorded_under_thunder_jit():
    fusion = pytest.importorskip("kforge.fusion", reason="kforge.fusion is not in this tree").get_fusion_executor()
    _thunder.reset_declines()
    a, b = randn(5, 37, device="cpu"), randn(5, 37, device="cpu")
    jfn = thunder.jit(lambda a, b: a + b, executors=[kforge.executor, fusion])
    torch.testing.assert_close(jfn(a, b), a + b)
    assert "residual: left to kforge.fusion" in _thunder.declines()["add"]


def test_fusion_check_survives_a_missing_fusion_module(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "kforge.fusion", None)  # `from ..fusion import ...` raises ImportError
    with tracectx(TraceCtx()):
        a, b = proxy(8, 768), proxy(8, 768)
        with fusion_listed(kforge.executor):
            assert not rs.fusion_in_use() and rs._checker(a, b) is None


@pytest.fixture
def cpu_reference_launchers(monkeypatch):
    swap_launchers(monkeypatch, rs, {rs.residual_forward: lambda a, b: (a.float() + b.float()).to(a.dtype)})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_thunder_plumbing_with_reference_launchers(cpu_reference_launchers, dtype):
    """The claim's meta and grad transform for real: gradients flow unchanged to both inputs (x
    appears twice: its two gradient contributions add up), and a bf16 add leaves no casts."""
    x = randn(3, 40, device="cpu", dtype=dtype).requires_grad_(True)
    y = randn(3, 40, device="cpu", dtype=dtype).requires_grad_(True)

    def fn(x, y):
        return (x + y) + x

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x, y)
    g = randn(3, 40, device="cpu", dtype=dtype)
    dx, dy = torch.autograd.grad(out, (x, y), g)
    fwd, bwd = thunder.last_traces(jfn)[-1], thunder.last_backward_traces(jfn)[-1]
    assert "kforge_residual_forward" in symbol_names(fwd)
    assert not {"to", "convert_element_type"} & (symbol_names(fwd) | symbol_names(bwd)), (fwd, bwd)
    ref = fn(x, y)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close(dy, g, rtol=0, atol=0)
    torch.testing.assert_close(dx, (g.float() + g.float()).to(dtype), rtol=0, atol=0)


def test_thunder_plumbing_broadcast(cpu_reference_launchers):
    """(B, T, C) + (T, C): the broadcast operand's gradient is the sum over B (a torch sum here)."""
    t = randn(3, 5, 8, device="cpu", dtype=torch.float64).requires_grad_(True)
    p = randn(5, 8, device="cpu", dtype=torch.float64).requires_grad_(True)
    jfn = thunder.jit(lambda t, p: p + t, executors=[kforge.executor])
    out = jfn(t, p)
    g = randn(3, 5, 8, device="cpu", dtype=torch.float64)
    dt, dp = torch.autograd.grad(out, (t, p), g)
    assert "kforge_residual_forward" in symbol_names(thunder.last_traces(jfn)[-1])
    torch.testing.assert_close(out, t.detach() + p.detach())
    torch.testing.assert_close(dt, g)
    torch.testing.assert_close(dp, g.sum(0))


# ---- property-based (hypothesis) ----------------------------------------------------------------
_ANY_DTYPE = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
_DIMS = st.lists(st.sampled_from([0, 1, 2, 3, 7, 8]), min_size=0, max_size=3).map(tuple)


@settings(max_examples=200)
@given(a_shape=_DIMS, b_cut=st.integers(-1, 3), b_other=_DIMS, swap=st.booleans(), dtype=_ANY_DTYPE,
       b_dtype=st.sampled_from(["same", "other"]), device=st.sampled_from(["cuda", "cpu"]),
       b_device=st.sampled_from(["same", "other"]), alpha=st.sampled_from([1, 1.0, 2, 0, -1, True]))
def test_checker_never_accepts_what_the_kernel_cannot_do(a_shape, b_cut, b_other, swap, dtype, b_dtype, device,
                                                         b_device, alpha):
    """Generated operand pairs (b a's trailing dims, or an unrelated shape; either order), dtypes, devices
    and alphas: whatever the checker accepts, residual_forward's checks pass for the operands in the
    order _execution passes them (CUDA, one float dtype and device, b of the big operand's shape or its
    trailing dims), both non-empty, alpha 1. Fails if a rule goes (an accepted (8, 1) + (8, 768) would:
    the launcher raises)."""
    b_shape = a_shape[len(a_shape) - b_cut:] if 0 <= b_cut <= len(a_shape) else b_other
    other_dtype = torch.bfloat16 if dtype == torch.float32 else torch.float32
    with tracectx(TraceCtx()):
        a = proxy(a_shape, dtype=dtype, device=device)
        b = proxy(b_shape, dtype=dtype if b_dtype == "same" else other_dtype,
                  device=device if b_device == "same" else ("cpu" if device == "cuda" else "cuda"))
        if swap:
            a, b = b, a
        if rs._checker(a, b, alpha=alpha) is not None:
            return
        big, small = rs._ordered(a, b)
    assert device == "cuda" and b_device == "same" and b_dtype == "same"
    assert dtype in (torch.float32, torch.bfloat16, torch.float16) and alpha == 1
    big_s, small_s = tuple(big.shape), tuple(small.shape)
    assert len(small_s) <= len(big_s) and big_s[len(big_s) - len(small_s):] == small_s
    assert 0 not in big_s and 0 not in small_s


# Lengths around the 16-byte pack (4 fp32 / 8 16-bit elements: b's numel must be a multiple of it for
# the vector path), the scalar tail, and a few thousand elements (more than one step of the grid).
_RS_LAST = st.one_of(st.integers(1, 40), st.sampled_from([8, 16, 2048]).flatmap(lambda e: st.integers(e - 3, e + 3)))


@gpu
@pytest.mark.sanitize
@settings(max_examples=40, deadline=None)
@given(last=_RS_LAST, lead=st.sampled_from([(), (1,), (3,), (2, 5)]), broadcast=st.sampled_from(["none", "last", "all"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       view=st.sampled_from(["contiguous", "misaligned", "transposed"]), seed=st.integers(0, 2**31 - 1))
def test_property_matches_float64(last, lead, broadcast, dtype, view, seed):
    """Generated shapes, broadcasts of b over a's leading dims, dtypes and views (offset by one element:
    the scalar path; a transposed a: copied or read in place): the sum is the fp32 sum rounded once
    (bitwise, as eager) and within the dtype's tolerance of float64. The backward has no kernel of its
    own (the gradient, or its sum over the broadcast dims: colsum's test). Fails on any wrong or
    unwritten (NaN-poisoned) element."""
    shape = (*lead, last)
    b_shape = {"none": shape, "last": shape[-1:], "all": shape[len(lead) // 2:]}[broadcast]
    a, b = randn(*shape, dtype=dtype, seed=seed), randn(*b_shape, dtype=dtype, seed=seed + 1)
    if view == "misaligned":  # one element past a 16-byte boundary: the scalar path
        a = torch.empty(a.numel() + 1, dtype=dtype, device="cuda")[1:].view(shape).copy_(a)
    elif view == "transposed" and len(shape) >= 2:  # a dense permutation (read in place) or a copy
        a = a.transpose(-1, -2).contiguous().transpose(-1, -2)
    out = kforge._C.residual_forward(a, b)
    assert out.shape == a.shape and out.dtype == dtype
    torch.testing.assert_close(out, expected(a, b), rtol=0, atol=0)
    assert_close(out, a.double() + b.double(), dtype, "a + b")
