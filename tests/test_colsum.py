"""colsum (sum over every dim but the last: a linear layer's bias gradient): the launcher against a
float64 reference, deterministic results, the 16-byte and scalar paths, and the Thunder claims (the
bias gradient in a linear's backward trace; a forward sum with its broadcast gradient).

CPU tests: which sums are offered and why some are declined (kforge's fusion executor listed among
them), the fallback on CPU tensors, and the Thunder plumbing with the launcher swapped for torch.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import thunder
from hypothesis import example, given, settings
from hypothesis import strategies as st
from thunder.core.trace import TraceCtx, tracectx

import kforge
from conftest import DTYPES, assert_close, gpu, proxy, randn, swap_launchers, symbol_names
from kforge import _thunder
from kforge.ops import colsum as cs


def reference(x):
    return x.double().reshape(-1, x.shape[-1]).sum(0)


# GPT-2 widths, odd widths (scalar path), one row, few rows, many rows (many chunks), 4-D.
SHAPES = [(8, 1024, 768), (8, 1024, 2304), (3, 5, 771), (1, 1), (7, 13), (100003, 24), (2, 3, 4, 4104),
          (5, 8)]


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_matches_float64_reference(dtype, shape):
    x = randn(*shape, dtype=dtype)
    out = kforge._C.colsum_forward(x)
    assert out.dtype == dtype and out.shape == (shape[-1],)
    n = x.numel() // shape[-1]
    # An fp32 sum of n terms of size ~1 has an error growing like sqrt(n) ulps; the output rounds once.
    assert_close(out, reference(x), dtype, "colsum", tol=None if dtype != torch.float32 else 1e-5 * max(1.0, n ** 0.5 / 16))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deterministic_and_strided_and_misaligned(dtype):
    x = randn(8, 1024, 768, dtype=dtype)
    a, b = kforge._C.colsum_forward(x), kforge._C.colsum_forward(x)
    assert torch.equal(a, b)
    off = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:].view(8, 1024, 768).copy_(x)
    assert off.data_ptr() % 16 != 0  # scalar path, same numbers up to summation order
    assert_close(kforge._C.colsum_forward(off), reference(x), dtype, "misaligned")
    xt = randn(768, 1024, dtype=dtype).t()  # a strided view is copied first
    assert_close(kforge._C.colsum_forward(xt), reference(xt), dtype, "strided")


@gpu
def test_side_stream_and_cuda_graph_capture():
    """The final kernel is a dependent launch (Hopper): same results on a side stream, back to back
    with other work, and replayed from a CUDA graph."""
    x = randn(8, 1024, 768, dtype=torch.bfloat16)
    expected = kforge._C.colsum_forward(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2  # a kernel right before the partial kernel on the same stream
        side = [kforge._C.colsum_forward(y) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kforge._C.colsum_forward(x)
        captured2 = kforge._C.colsum_forward(captured.view(1, -1).expand(4, -1).contiguous())
    x.mul_(-1)  # replay must see the new values
    graph.replay()
    torch.cuda.synchronize()
    for out in side:
        assert torch.equal(out, kforge._C.colsum_forward(x * -2))
    assert torch.equal(captured, -expected)
    assert_close(captured2, 4 * reference(captured.view(1, -1)), torch.bfloat16, "chained")


@gpu
def test_launcher_edge_cases():
    empty_rows = randn(0, 5)
    torch.testing.assert_close(kforge._C.colsum_forward(empty_rows), torch.zeros(5, device="cuda"))
    assert kforge._C.colsum_forward(randn(4, 0)).shape == (0,)
    with pytest.raises(kforge.KforgeError, match="not supported"):
        kforge._C.colsum_forward(randn(4, 4).double())


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_claims_the_bias_gradient(dtype):
    """A linear with bias under thunder.jit: its bias gradient (sum over batch and time) is ours."""
    x = randn(4, 33, 96, dtype=dtype).requires_grad_(True)
    w = randn(200, 96, dtype=dtype, scale=0.1).requires_grad_(True)
    b = randn(200, dtype=dtype).requires_grad_(True)
    jf = thunder.jit(lambda x, w, b: F.linear(x, w, b), executors=[kforge.executor])
    out = jf(x, w, b)
    g = randn(*out.shape, dtype=dtype)
    dx, dw, db = torch.autograd.grad(out, (x, w, b), g)
    assert "kforge_colsum_forward" in symbol_names(thunder.last_backward_traces(jf)[-1])
    assert_close(db, reference(g), dtype, "dbias")
    x64, w64, b64 = (t.detach().double().requires_grad_(True) for t in (x, w, b))
    rx, rw, _ = torch.autograd.grad(F.linear(x64, w64, b64), (x64, w64, b64), g.double())
    tol = None if dtype == torch.float32 else 2e-2
    assert_close(dx, rx, dtype, "dx", tol=tol)
    assert_close(dw, rw, dtype, "dw", tol=tol)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_forward_sum_and_its_gradient(dtype):
    x = randn(6, 7, 100, dtype=dtype).requires_grad_(True)
    for keepdim in (False, True):
        jf = thunder.jit(lambda x: x.sum((1, 0), keepdim=keepdim) * 2, executors=[kforge.executor])
        out = jf(x)
        assert out.shape == ((1, 1, 100) if keepdim else (100,))
        g = randn(*out.shape, dtype=dtype)
        (dx,) = torch.autograd.grad(out, (x,), g)
        assert "kforge_colsum_forward" in symbol_names(thunder.last_traces(jf)[-1])
        assert_close(out.reshape(100), 2 * reference(x), dtype, "out")
        torch.testing.assert_close(dx, (2 * g).expand(6, 7, 100).to(dtype), rtol=0, atol=0)


# ---- CPU: offers, declines, fallback, plumbing ------------------------------------------------------
def test_which_sums_are_offered_and_declined():
    with tracectx(TraceCtx()):
        x = proxy(8, 1024, 768, dtype=torch.bfloat16)
        for dim in ((0, 1), (1, 0), [0, 1], (-3, -2), (0, -2)):
            assert cs._applies(x, dim) and cs._checker(x, dim) is None, dim
        assert cs._applies(proxy(5, 7), 0) and cs._checker(proxy(5, 7), 0) is None
        for dim in (None, (0,), (1, 2), (0, 1, 2), 2, (0, 0)):
            assert not cs._applies(x, dim), dim
        assert not cs._applies(proxy(7), 0)  # 1-D: the whole tensor, not a column sum
        cases = {
            "differs from the input dtype": cs._checker(x, (0, 1), dtype=torch.float32),
            "not CUDA": cs._checker(proxy(4, 5, device="cpu"), 0),
            "float64": cs._checker(proxy(4, 5, dtype=torch.float64), 0),
            "empty": cs._checker(proxy(0, 5), 0),
        }
        assert cs._checker(x, (0, 1), dtype=torch.bfloat16) is None
        assert cs._checker(x, (0, 1), True) is None  # keepdim: the (C,) result reshaped
    for expected, reason in cases.items():
        assert reason is not None and expected in reason, (expected, reason)


def test_cpu_tensors_fall_back_to_torch():
    _thunder.reset_declines()
    x = randn(5, 6, 37, device="cpu").requires_grad_(True)
    jf = thunder.jit(lambda x: x.sum((0, 1)), executors=[kforge.executor])
    out = jf(x)
    out.backward(torch.ones_like(out))
    assert "kforge_" not in str(thunder.last_traces(jf)[-1])
    torch.testing.assert_close(out, x.detach().sum((0, 1)))
    assert any(r.startswith("colsum: ") and "not CUDA" in r for r in _thunder.declines()["sum"])


def test_left_to_the_fusion_executor_when_it_is_listed():
    from types import SimpleNamespace

    from thunder.core.compile_data import compile_data_and_stats

    fusion = pytest.importorskip("kforge.fusion", reason="kforge.fusion is not in this tree").get_fusion_executor()
    with tracectx(TraceCtx()):
        x = proxy(8, 1024, 768, dtype=torch.bfloat16)
        with compile_data_and_stats(SimpleNamespace(executors_list=(kforge.executor, fusion)), None):
            assert cs._applies(x, (0, 1)) and cs._checker(x, (0, 1)) == "left to kforge.fusion"
        with compile_data_and_stats(SimpleNamespace(executors_list=(kforge.executor,)), None):
            assert cs._checker(x, (0, 1)) is None
    _thunder.reset_declines()
    x = randn(5, 6, 37, device="cpu")
    jf = thunder.jit(lambda x: x.sum((0, 1)), executors=[kforge.executor, fusion])
    torch.testing.assert_close(jf(x), x.sum((0, 1)))
    assert "colsum: left to kforge.fusion" in _thunder.declines()["sum"]


def test_launcher_rejects_cpu_tensors():
    with pytest.raises(kforge.KforgeError, match="colsum_forward: x must be a CUDA tensor"):
        kforge._C.colsum_forward(randn(4, 4, device="cpu"))


@pytest.fixture
def cpu_reference_launchers(monkeypatch):
    swap_launchers(monkeypatch, cs, {cs.colsum_forward: lambda x: x.reshape(-1, x.shape[-1]).sum(0)})


def test_thunder_plumbing_with_reference_launchers(cpu_reference_launchers):
    x = randn(4, 5, 12, device="cpu", dtype=torch.float64).requires_grad_(True)
    w = randn(7, 12, device="cpu", dtype=torch.float64).requires_grad_(True)
    b = randn(7, device="cpu", dtype=torch.float64).requires_grad_(True)

    def fn(x, w, b):
        return F.linear(x, w, b).sin(), x.sum((0, 1))

    jf = thunder.jit(fn, executors=[kforge.executor])
    out = jf(x, w, b)
    gs = [randn(*o.shape, device="cpu", dtype=torch.float64) for o in out]
    grads = torch.autograd.grad(out, (x, w, b), gs)
    assert "kforge_colsum_forward" in symbol_names(thunder.last_traces(jf)[-1])
    assert "kforge_colsum_forward" in symbol_names(thunder.last_backward_traces(jf)[-1])
    ref = fn(x, w, b)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    for g, r in zip(grads, torch.autograd.grad(ref, (x, w, b), gs)):
        torch.testing.assert_close(g, r)


# ---- property-based (hypothesis) ----------------------------------------------------------------
_ANY_DTYPE = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
# 2^30 - 1 is the launcher's largest C (INT_MAX / 2); 2^30 and past it are not.
_CS_DIM = st.one_of(st.integers(0, 9), st.sampled_from([2**30 - 1, 2**30, 2**30 + 1]))


@settings(max_examples=200)
@given(shape=st.lists(_CS_DIM, min_size=0, max_size=4).map(tuple), dtype=_ANY_DTYPE,
       device=st.sampled_from(["cuda", "cpu"]), keepdim=st.booleans(),
       dim=st.one_of(st.none(), st.integers(-4, 3), st.lists(st.integers(-4, 3), max_size=4)),
       want=st.sampled_from(["none", "same", "float32", "float64"]))
@example(shape=(2, 2**30), dtype=torch.float32, device="cuda", keepdim=False, dim=0, want="none")  # found
def test_checker_never_accepts_what_the_kernel_cannot_do(shape, dtype, device, keepdim, dim, want):
    """Generated proxies and `dim` lists (in range, any order, negative, repeated): whatever `_applies`
    offers and the checker accepts, colsum_forward's checks pass (CUDA, float dtype, >= 1 dim,
    C <= 2^30 - 1) and the sum is the kernel's: over every dim but the last, of a 2-D or larger
    non-empty tensor, in its own dtype. Fails if a rule goes: it found C = 2^30 accepted (the checker
    said "exceeds 2^30" only past it) where the launcher raises "too large"."""
    nd = len(shape)
    dims = [] if dim is None else [dim] if isinstance(dim, int) else dim
    if not all(-nd <= d < nd for d in dims):
        return  # out of range: thunder.torch.sum raises while tracing, before any checker runs
    with tracectx(TraceCtx()):
        x = proxy(shape, dtype=dtype, device=device)
        dt = {"none": None, "same": dtype, "float32": torch.float32, "float64": torch.float64}[want]
        if not cs._applies(x, dim, keepdim, dtype=dt) or cs._checker(x, dim, keepdim, dtype=dt) is not None:
            return
    assert device == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert nd >= 2 and 1 <= shape[-1] <= 2**30 - 1 and 0 not in shape
    assert dim is not None and sorted(d % nd for d in dims) == list(range(nd - 1))
    assert dt is None or dt == dtype


# Rows: 1, odd, around the 32-row slots and 64-row chunks, enough for several chunks; C around the
# 16-byte pack (4 fp32 / 8 16-bit elements: the vector kernel when C is a multiple) and a 32-column tile.
@gpu
@pytest.mark.sanitize
@settings(max_examples=40, deadline=None)
@given(N=st.sampled_from([1, 2, 31, 33, 64, 65, 257, 3001]), C=st.one_of(st.integers(1, 40), st.sampled_from([64, 256]).flatmap(
       lambda e: st.integers(e - 3, e + 3))), split=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       view=st.sampled_from(["contiguous", "misaligned", "transposed"]), seed=st.integers(0, 2**31 - 1))
def test_property_matches_float64(N, C, split, dtype, view, seed):
    """Generated row counts, widths, leading-dim splits, dtypes and views (offset by one element: the
    scalar kernel; a transposed view: copied): the column sum within the dtype's tolerance of the
    float64 sum of the same inputs. The backward is a broadcast (no kernel). Fails on a dropped or
    doubled row, a wrong column, or an unwritten (NaN-poisoned) output."""
    shape = (N, C) if not split or N % 2 else (2, N // 2, C)
    x = randn(*shape, dtype=dtype, seed=seed)
    if view == "misaligned":
        x = torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:].view(shape).copy_(x)
    elif view == "transposed":
        x = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    out = kforge._C.colsum_forward(x)
    assert out.shape == (C,) and out.dtype == dtype
    # The terms' norm: a few rows can cancel to far below them, and fp32 accumulation errors scale with it.
    scale = x.double().abs().sum(dim=tuple(range(x.ndim - 1))).norm().item()
    assert_close(out, reference(x), dtype, "colsum", scale=scale)
