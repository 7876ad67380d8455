"""softmax over the last dim and the fused causal attention softmax: launchers against float64
references (forward and backward) on every kernel layout (warp rows, block rows, streamed rows; rows
off a 16-byte boundary; misaligned views), exact zeros above the diagonal, and the Thunder claims.

CPU tests: the causal_softmax helper, decline reasons, the fallback to torch on CPU tensors, launcher
errors, and the Thunder plumbing (metas, grad transforms) with the launchers swapped for torch.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
import thunder
from hypothesis import given, settings
from hypothesis import strategies as st
from thunder.core.trace import TraceCtx, tracectx

import kforge
from conftest import DTYPES, assert_close, gpu, proxy, randn, swap_launchers
from kforge import _thunder
from kforge.ops import softmax as sm
from kforge.ops.softmax import causal_softmax


# ---- references ---------------------------------------------------------------------------------
def causal_mask(T: int, device) -> torch.Tensor:
    """True above the diagonal: the entries row i must not see."""
    return torch.ones(T, T, dtype=torch.bool, device=device).triu(1)


def ref_forward(x: torch.Tensor, causal: bool = False, scale: float = 1.0) -> torch.Tensor:
    x64 = x.double() * scale
    if causal:
        x64 = x64.masked_fill(causal_mask(x.size(-1), x.device), float("-inf"))
    return torch.softmax(x64, -1)


def ref_backward(dy: torch.Tensor, y: torch.Tensor, causal: bool = False, scale: float = 1.0) -> torch.Tensor:
    """float64 scale * y * (dy - sum(dy * y)) from the same (rounded) dy and y; 0 where masked."""
    dy64, y64 = dy.double(), y.double()
    if causal:
        mask = causal_mask(y.size(-1), y.device)
        dy64, y64 = dy64.masked_fill(mask, 0.0), y64.masked_fill(mask, 0.0)  # they must not count
    return scale * y64 * (dy64 - (dy64 * y64).sum(-1, keepdim=True))


def probs(*shape, dtype, causal=False, scale=1.0) -> torch.Tensor:
    """A realistic backward input: softmax rows (rounded to dtype)."""
    return ref_forward(randn(*shape, dtype=dtype, scale=2.0), causal, scale).to(dtype)


def check_plain(x: torch.Tensor, dy: torch.Tensor, y_in: torch.Tensor, dtype) -> None:
    y = kforge._C.softmax_forward(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, ref_forward(x), dtype, f"y {tuple(x.shape)}")
    dx = kforge._C.softmax_backward(dy, y_in)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close(dx, ref_backward(dy, y_in), dtype, f"dx {tuple(x.shape)}")


# ---- plain softmax, GPU -------------------------------------------------------------------------
# Row lengths chosen per layout (V = 4 fp32 / 8 bf16 elements per 16-byte pack): one warp per row
# with 1, 2, 4 packs per lane (<= 32V, 64V, 128V) and 8 for fp32 (<= 256V: 777, 1000, 1024), one
# block per row (<= 2048 packs), streamed rows beyond; odd lengths put every row start off a 16-byte
# boundary (leading and trailing scalars). Tensors of different 16-byte phase stream at any length
# (test_softmax_misaligned_and_strided_views). 16-bit forward rows of a multiple of 8 elements in
# 264..1024 (392, 512, 1000, 1024) take the persistent-warps kernel (also test_softmax_16bit_rows and
# the tests after it).
ROW_LENGTHS = [1, 3, 7, 33, 100, 200, 257, 392, 500, 512, 777, 1000, 1024, 1025, 2049, 8192, 8193, 16384,
               16385, 50257]


@gpu
@pytest.mark.parametrize("C", ROW_LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_softmax_matches_float64_reference(dtype, C):
    rows = 37 if C <= 8193 else 5
    x = randn(rows, C, dtype=dtype, scale=3.0)
    check_plain(x, randn(rows, C, dtype=dtype), probs(rows, C, dtype=dtype), dtype)


HALF_ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # relative, at worst
SUBNORMAL = {torch.bfloat16: 2.0**-126, torch.float16: 2.0**-24}


def assert_rounded(y: torch.Tensor, ref: torch.Tensor, dtype, what: str) -> None:
    """Every element of a 16-bit softmax within half an ulp (plus fp32 noise) of the float64 one."""
    err = (y.double() - ref).abs()
    bad = ~(err <= HALF_ULP[dtype] * 1.01 * ref.abs() + SUBNORMAL[dtype])
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off by more than half an ulp, worst "
                           f"{(err / ref.abs().clamp_min(1e-30)).max().item():.3e} relative")


@gpu
@pytest.mark.parametrize("rows", [1, 2, 7, 37, 64])
@pytest.mark.parametrize("C", [264, 392, 512, 520, 1000, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_softmax_16bit_rows(dtype, C, rows):
    """The persistent-warps kernel for 16-bit rows (C % 8 == 0, 33..128 packs: P = 2 for C <= 512, 4
    above; full and partial slots (C = 520: one pack past 64); few rows leave persistent warps idle)
    against float64; -inf entries and all -inf rows."""
    x = randn(rows, C, dtype=dtype, scale=3.0)
    if rows >= 4:
        x[0, : C // 2] = float("-inf")
        x[1, ::3] = float("-inf")
        x[3] = float("-inf")  # NaN
    y = kforge._C.softmax_forward(x)
    ok = torch.ones(rows, dtype=torch.bool, device="cuda")
    if rows >= 4:
        ok[3] = False
        assert torch.isnan(y[3]).all()
        assert (y[0, : C // 2] == 0).all() and (y[1, ::3] == 0).all()
    ref = ref_forward(x[ok])
    assert_close(y[ok], ref, dtype, f"y {tuple(x.shape)}")
    assert_rounded(y[ok], ref, dtype, f"y {tuple(x.shape)}")
    if rows >= 2:  # a misaligned first row start is not taken by the persistent-warps kernel
        xo = torch.empty(rows * C + 8, dtype=dtype, device="cuda")[8 - 1:-1].view(rows, C).copy_(x)
        assert xo.data_ptr() % 16 != 0
        assert_close(kforge._C.softmax_forward(xo)[ok], ref, dtype, "y misaligned")


@gpu
@pytest.mark.parametrize("C", [264, 520, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_softmax_16bit_many_rows_per_warp(dtype, C):
    """Enough rows that the persistent warps take several each and their ring of row slots wraps
    (32 warps per SM, 2 slots, 5 rows per warp), with a remainder spread unevenly; -inf entries and
    all -inf rows along the way."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = 5 * 2 * 16 * sms + 37
    x = randn(rows, C, dtype=dtype, scale=3.0)
    x[5::89, ::3] = float("-inf")
    x[::97] = float("-inf")
    y = kforge._C.softmax_forward(x)
    ok = torch.ones(rows, dtype=torch.bool, device="cuda")
    ok[::97] = False
    assert torch.isnan(y[~ok]).all()
    ref = ref_forward(x[ok])
    assert_close(y[ok], ref, dtype, f"y {tuple(x.shape)}")
    assert_rounded(y[ok], ref, dtype, f"y {tuple(x.shape)}")


@gpu
def test_softmax_16bit_very_many_rows():
    """140001 rows: the persistent warps take ~33 rows each, their row slots wrapping many times."""
    rows, C, dtype = 140001, 264, torch.bfloat16
    x = randn(rows, C, dtype=dtype, scale=3.0)
    y = kforge._C.softmax_forward(x)
    ref = ref_forward(x)
    assert_close(y, ref, dtype, "y")
    assert_rounded(y, ref, dtype, "y")


@gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_softmax_many_dims_and_rows(dtype):
    shape = (2, 3, 129, 64)  # 774 rows: several warp rows per block, a partial last block
    check_plain(randn(*shape, dtype=dtype, scale=3.0), randn(*shape, dtype=dtype),
                probs(*shape, dtype=dtype), dtype)


@gpu
@pytest.mark.parametrize("C", [64, 1000, 5000, 20000])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_misaligned_and_strided_views(dtype, C):
    """Inputs 1 element off a 16-byte boundary (element-wise packs) and transposed views (copied)."""
    rows = 6

    def off(t):
        buf = torch.empty(t.numel() + 1, dtype=dtype, device="cuda")[1:]
        return buf.view(t.shape).copy_(t)

    x, dy, y = randn(rows, C, dtype=dtype, scale=3.0), randn(rows, C, dtype=dtype), probs(rows, C, dtype=dtype)
    assert off(x).data_ptr() % 16 != 0
    check_plain(off(x), off(dy), y, dtype)
    check_plain(x, dy, off(y), dtype)
    check_plain(x.t().contiguous().t(), dy, y, dtype)


@gpu
@pytest.mark.parametrize("C", [100, 1000, 4100, 50257])
def test_softmax_extremes(C):
    """-inf entries give exact zeros (also when the first packs of a streamed row, or whole warps of a
    block row (C = 4100), are all -inf), large logits do not overflow, an all -inf row is NaN as in
    PyTorch."""
    x = randn(4, C, scale=30.0)
    x[0, : C // 2] = float("-inf")
    x[1, ::3] = float("-inf")
    x[2, -1] = 1e4
    x[3] = float("-inf")
    y = kforge._C.softmax_forward(x)
    ref = torch.softmax(x.double(), -1)
    assert_close(y[:3], ref[:3], torch.float32, "finite rows")
    assert (y[0, : C // 2] == 0).all() and (y[1, ::3] == 0).all()
    assert torch.isnan(y[3]).all()


@gpu
def test_softmax_on_side_stream():
    x = randn(64, 1000)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = kforge._C.softmax_forward(x)
    torch.cuda.current_stream().wait_stream(s)
    assert_close(y, ref_forward(x), torch.float32, "y")


@gpu
def test_softmax_launcher_rejects_bad_arguments():
    x = randn(4, 16)
    with pytest.raises(kforge.KforgeError, match="dy and y sizes differ"):
        kforge._C.softmax_backward(randn(4, 15), x)
    with pytest.raises(kforge.KforgeError, match="dy has dtype"):
        kforge._C.softmax_backward(randn(4, 16, dtype=torch.bfloat16), x)
    with pytest.raises(kforge.KforgeError, match="not supported"):
        kforge._C.softmax_forward(x.double())
    with pytest.raises(kforge.KforgeError, match="0-d"):
        kforge._C.softmax_forward(randn(1).view(()))
    with pytest.raises(kforge.KforgeError, match=r"\(\.\.\., T, T\)"):
        kforge._C.causal_softmax_forward(randn(2, 4, 5), 1.0)
    with pytest.raises(kforge.KforgeError, match=r"\(\.\.\., T, T\)"):
        kforge._C.causal_softmax_backward(randn(4), randn(4), 1.0)
    assert kforge._C.softmax_forward(randn(3, 0)).shape == (3, 0)


# ---- fused causal softmax, GPU --------------------------------------------------------------------
CAUSAL_SHAPES = [(1, 1, 1, 1), (2, 3, 7, 7), (1, 12, 64, 64), (2, 12, 100, 100), (1, 2, 1000, 1000),
                 (1, 12, 1024, 1024), (1, 1, 2049, 2049), (1, 1, 8192, 8192), (1, 1, 8193, 8193)]


def check_causal(preatt, dy, y_in, scale, dtype):
    y = kforge._C.causal_softmax_forward(preatt, scale)
    mask = causal_mask(preatt.size(-1), preatt.device).expand_as(preatt)
    assert y.dtype == dtype and y.shape == preatt.shape
    assert (y[mask] == 0).all(), "forward: masked entries must be exactly 0"
    assert_close(y, ref_forward(preatt, True, scale), dtype, f"y {tuple(preatt.shape)}")
    dx = kforge._C.causal_softmax_backward(dy, y_in, scale)
    assert (dx[mask] == 0).all(), "backward: masked entries must be exactly 0"
    assert_close(dx, ref_backward(dy, y_in, True, scale), dtype, f"dx {tuple(preatt.shape)}")


@gpu
@pytest.mark.parametrize("shape", CAUSAL_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_softmax_matches_float64_reference(dtype, shape):
    scale = 1.0 / math.sqrt(64)
    preatt = randn(*shape, dtype=dtype, scale=8.0)
    dy = randn(*shape, dtype=dtype)
    y_in = probs(*shape, dtype=dtype, causal=True, scale=scale)
    check_causal(preatt, dy, y_in, scale, dtype)


@gpu
@pytest.mark.parametrize("T", [5, 1000, 8193])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_softmax_never_uses_masked_entries(dtype, T):
    """NaN above the diagonal of preatt (forward) and of y and dy (backward) must not leak: those
    entries are neither used nor copied, and the outputs there are exactly 0."""
    scale = 0.37
    mask = causal_mask(T, "cuda")
    preatt = randn(2, T, T, dtype=dtype, scale=4.0).masked_fill(mask, float("nan"))
    dy = randn(2, T, T, dtype=dtype).masked_fill(mask, float("nan"))
    y_in = probs(2, T, T, dtype=dtype, causal=True, scale=scale).masked_fill(mask, float("nan"))
    y = kforge._C.causal_softmax_forward(preatt, scale)
    dx = kforge._C.causal_softmax_backward(dy, y_in, scale)
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    assert (y[:, mask] == 0).all() and (dx[:, mask] == 0).all()
    assert_close(y, ref_forward(preatt.masked_fill(mask, 0.0), True, scale), dtype, "y")
    assert_close(dx, ref_backward(dy.masked_fill(mask, 0.0), y_in.masked_fill(mask, 0.0), True, scale),
                 dtype, "dx")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_causal_softmax_matches_the_helper(dtype):
    """The kernel computes what the model helper computes (the thing it replaces)."""
    preatt = randn(2, 12, 257, 257, dtype=dtype, scale=8.0)
    y = kforge._C.causal_softmax_forward(preatt, 0.125)
    assert_close(y, causal_softmax(preatt.double(), 0.125), dtype, "y vs helper")


# ---- Thunder, GPU ---------------------------------------------------------------------------------
def traces(jfn) -> tuple[str, str]:
    return str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])


@gpu
@pytest.mark.parametrize("spelling", ["torch.softmax", "Tensor.softmax", "F.softmax", "nn.Softmax"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_claims_softmax(dtype, spelling):
    fns = {
        "torch.softmax": lambda x: torch.softmax(x, dim=-1),
        "Tensor.softmax": lambda x: x.softmax(-1),
        "F.softmax": lambda x: F.softmax(x, dim=2),
        "nn.Softmax": torch.nn.Softmax(dim=-1),
    }
    fn = fns[spelling]
    x = randn(4, 33, 1000, dtype=dtype, scale=3.0).requires_grad_(True)
    dy = randn(4, 33, 1000, dtype=dtype)
    jfn = thunder.jit(fn, executors=[kforge.executor])
    y = jfn(x)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    fwd, bwd = traces(jfn)
    assert "kforge_softmax_forward" in fwd and "kforge_softmax_backward" in bwd, (fwd, bwd)
    x64 = x.detach().double().requires_grad_(True)
    r = torch.softmax(x64, -1)
    (rdx,) = torch.autograd.grad(r, (x64,), dy.double())
    assert_close(y, r, dtype, "y")
    # dx from the bf16-rounded y: one more rounding than the reference path.
    assert_close(dx, rdx, dtype, "dx", tol=None if dtype == torch.float32 else 1.5e-2)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_replaces_causal_softmax(dtype):
    B, NH, T, HS = 2, 12, 129, 64
    q = randn(B, NH, T, HS, dtype=dtype).requires_grad_(True)
    k = randn(B, NH, T, HS, dtype=dtype).requires_grad_(True)
    dy = randn(B, NH, T, T, dtype=dtype)
    scale = 1.0 / math.sqrt(HS)

    def fn(q, k):
        return causal_softmax(q @ k.transpose(-2, -1), scale)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    y = jfn(q, k)
    dq, dk = torch.autograd.grad(y, (q, k), dy)
    fwd, bwd = traces(jfn)
    assert "kforge_causal_softmax_forward" in fwd and "kforge_causal_softmax_backward" in bwd, (fwd, bwd)
    assert "masked_fill" not in fwd and "where" not in fwd
    assert (y[:, :, causal_mask(T, "cuda")] == 0).all()
    q64, k64 = (t.detach().double().requires_grad_(True) for t in (q, k))
    r = fn(q64, k64)
    rq, rk = torch.autograd.grad(r, (q64, k64), dy.double())
    tol = None if dtype == torch.float32 else 2e-2  # bf16: the matmuls round too
    assert_close(y, r, dtype, "y", tol=tol)
    assert_close(dq, rq, dtype, "dq", tol=tol)
    assert_close(dk, rk, dtype, "dk", tol=tol)
    with torch.no_grad():  # inference: the execution transform
        jinf = thunder.jit(fn, executors=[kforge.executor])
        assert_close(jinf(q, k), r, dtype, "inference y", tol=tol)
        assert "kforge_causal_softmax_forward" in str(thunder.last_traces(jinf)[-1])


@gpu
def test_thunder_inline_masked_fill_pattern_still_uses_plain_softmax():
    """The inline GPT-2 pattern (masked_fill from a mask buffer, then softmax) cannot be fused (the
    mask is runtime data), but its softmax is still claimed, and the -inf entries come out as 0."""
    T = 65
    bias = torch.tril(torch.ones(T, T, device="cuda")).view(1, 1, T, T)
    att = randn(2, 3, T, T, scale=3.0)

    def fn(att, bias):
        return F.softmax(att.masked_fill(bias == 0, float("-inf")), dim=-1)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    y = jfn(att, bias)
    assert "kforge_softmax_forward" in str(thunder.last_traces(jfn)[-1])
    assert (y[:, :, causal_mask(T, "cuda")] == 0).all()
    assert_close(y, ref_forward(att, True), torch.float32, "y")


@gpu
def test_thunder_declines_other_dims_on_gpu():
    _thunder.reset_declines()
    x = randn(8, 16, 32)
    jfn = thunder.jit(lambda x: torch.softmax(x, dim=1), executors=[kforge.executor])
    torch.testing.assert_close(jfn(x), torch.softmax(x, dim=1))
    assert "kforge_" not in str(thunder.last_traces(jfn)[-1])
    assert any("dim=1 is not the last dim" in r for r in _thunder.declines()["_softmax"])


# ---- CPU: helper, declines, fallback, plumbing ---------------------------------------------------
def test_causal_softmax_helper_is_causal_softmax():
    """The helper (the op's definition) against a per-row loop, with exact zeros above the diagonal."""
    T, scale = 9, 0.3
    att = randn(2, 3, T, T, device="cpu", dtype=torch.float64, scale=3.0)
    y = causal_softmax(att, scale)
    for i in range(T):
        torch.testing.assert_close(y[..., i, : i + 1], torch.softmax(scale * att[..., i, : i + 1], -1))
        assert (y[..., i, i + 1:] == 0).all()


@pytest.mark.parametrize("shape", [(8,), (4, 8), (2, 3, 5, 6), ()])
def test_causal_softmax_rejects_non_square_scores(shape):
    """The helper, its Thunder definition (what runs when kforge declines) and the checker agree: a
    1-D att used to broadcast against the (T, T) mask into a (T, T) result."""
    att = torch.randn(shape)
    with pytest.raises(ValueError, match=r"causal_softmax: att shape .* is not \(\.\.\., T, T\)"):
        causal_softmax(att, 1.0)
    if att.ndim:  # thunder.jit cannot trace a 0-d softmax input either way
        with pytest.raises(ValueError, match="causal_softmax: att shape"):
            thunder.jit(lambda a: causal_softmax(a, 1.0), executors=[kforge.executor])(att)
    with tracectx(TraceCtx()):
        assert "is not (..., T, T)" in sm._causal_checker(proxy(shape), 1.0)


def test_launchers_reject_cpu_tensors():
    x = randn(4, 8, device="cpu")
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.softmax_forward(x)
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.causal_softmax_backward(x, x, 1.0)


def test_checkers_accept_and_decline_with_reasons():
    with tracectx(TraceCtx()):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert sm._softmax_checker(proxy((8, 50257), dtype=dtype), -1) is None
            assert sm._causal_checker(proxy((2, 12, 64, 64), dtype=dtype), 0.125) is None
        assert sm._softmax_checker(proxy((4, 5, 6)), 2) is None
        assert sm._softmax_checker(proxy((4, 5, 6)), -1, dtype=torch.float32) is None
        cases = {
            "dim=1 is not the last dim": sm._softmax_checker(proxy((4, 5, 6)), 1),
            "dim=-2 is not the last dim": sm._softmax_checker(proxy((4, 5, 6)), -2),
            "dtype=torch.float32 differs": sm._softmax_checker(proxy((4, 6), dtype=torch.bfloat16), -1,
                                                               dtype=torch.float32),
            "not CUDA": sm._softmax_checker(proxy((4, 6), device="cpu"), -1),
            "float64": sm._softmax_checker(proxy((4, 6), dtype=torch.float64), -1),
            "empty": sm._softmax_checker(proxy((0, 6)), -1),
            "0-d": sm._softmax_checker(proxy(()), 0),
            "is not (..., T, T)": sm._causal_checker(proxy((2, 3, 4, 5)), 0.5),
            "not a real number": sm._causal_checker(proxy((2, 3, 4, 4)), "0.5"),
            "att is on": sm._causal_checker(proxy((2, 4, 4), device="cpu"), 0.5),
        }
    for expected, reason in cases.items():
        assert reason is not None and expected in reason, (expected, reason)


@pytest.mark.parametrize("which", ["softmax", "causal"])
def test_cpu_tensors_fall_back_to_torch(which):
    _thunder.reset_declines()
    x = randn(2, 3, 6, 6, device="cpu", scale=3.0).requires_grad_(True)
    dy = randn(2, 3, 6, 6, device="cpu")
    fn = (lambda x: torch.softmax(x, -1)) if which == "softmax" else (lambda x: causal_softmax(x, 0.5))
    jfn = thunder.jit(fn, executors=[kforge.executor])
    y = jfn(x)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    assert "kforge_" not in str(thunder.last_traces(jfn)[-1])
    ref = fn(x)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(dx, torch.autograd.grad(ref, (x,), dy)[0])
    key = "_softmax" if which == "softmax" else "kforge_causal_softmax"
    assert any(r.startswith("softmax: ") and "not CUDA" in r for r in _thunder.declines()[key])
    with torch.no_grad():  # inference: the declined operator runs its torch definition
        jinf = thunder.jit(fn, executors=[kforge.executor])
        torch.testing.assert_close(jinf(x), ref)


# Thunder plumbing without a GPU: the claims' metas and grad transforms run for real; only the kforge
# launchers are swapped for torch and the checkers accept CPU tensors.
def _torch_backward(dy, y):
    return y * (dy - (dy * y).sum(-1, keepdim=True))


@pytest.fixture
def cpu_reference_launchers(monkeypatch):
    swap_launchers(monkeypatch, sm, {
        sm.softmax_forward: lambda x: torch.softmax(x, -1),
        sm.softmax_backward: _torch_backward,
        sm.causal_softmax_forward: lambda x, scale: torch.softmax(
            (x * scale).masked_fill(causal_mask(x.size(-1), x.device), float("-inf")), -1),
        sm.causal_softmax_backward: lambda dy, y, scale: scale * _torch_backward(dy, y),
    })


def test_thunder_plumbing_with_reference_launchers(cpu_reference_launchers):
    x = randn(2, 3, 7, 7, device="cpu", dtype=torch.float64, scale=3.0).requires_grad_(True)
    dy = randn(2, 3, 7, 7, device="cpu", dtype=torch.float64)

    def fn(x):
        return causal_softmax(x * 2, 0.3).softmax(-1)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    y = jfn(x)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    fwd, bwd = traces(jfn)
    for name in ("kforge_causal_softmax_forward", "kforge_softmax_forward"):
        assert name in fwd, fwd
    for name in ("kforge_causal_softmax_backward", "kforge_softmax_backward"):
        assert name in bwd, bwd
    ref = fn(x)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(dx, torch.autograd.grad(ref, (x,), dy)[0])


# ---- property-based (hypothesis) ----------------------------------------------------------------
# Row lengths around every switch point of src/ops/softmax.cpp's plan(): warp rows of 1, 2, 4, 8 packs
# a lane (32, 64, 128, 256 packs), block rows up to 2048 packs, streamed beyond; 16-bit rows of 33..128
# packs on 16-byte boundaries take the persistent warps (forward). V = 4 (fp32) or 8 (16-bit).
def _row_lengths(V: int):
    edges = [32 * V, 64 * V, 128 * V, 256 * V, 2048 * V, 33 * 8, 128 * 8]
    return st.one_of(st.integers(1, 70), st.sampled_from(edges).flatmap(lambda e: st.integers(e - 3, e + 3)))


_LAYOUTS = ["contiguous", "offset", "padded_rows"]


def _laid_out(t: torch.Tensor, layout: str, off: int) -> torch.Tensor:
    """t's values as a contiguous tensor, one `off` elements off a 16-byte boundary (another row phase
    than the launcher's fresh outputs: the element-wise stream path), or a view with padded rows
    (non-contiguous: the launcher copies it)."""
    if layout == "offset":
        return torch.empty(t.numel() + off, dtype=t.dtype, device=t.device)[off:].view(t.shape).copy_(t)
    if layout == "padded_rows":
        big = torch.full((*t.shape[:-1], t.shape[-1] + off + 1), float("nan"), dtype=t.dtype, device=t.device)
        return big[..., : t.shape[-1]].copy_(t)
    return t


@gpu
@pytest.mark.sanitize
@pytest.mark.sanitize_race
@settings(max_examples=40)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       rows=st.sampled_from([1, 2, 3, 5, 37]), layout=st.sampled_from(_LAYOUTS), off=st.integers(1, 7))
def test_softmax_property_matches_float64(data, dtype, rows, layout, off):
    """Generated rows (length 1, odd, around every layout switch), layouts and dtypes: forward and
    backward within the file's tolerances of float64. Fails on any wrong element of any layout."""
    C = data.draw(_row_lengths(16 // torch.tensor([], dtype=dtype).element_size()), label="C")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    x = randn(rows, C, dtype=dtype, scale=3.0, seed=seed)
    dy = randn(rows, C, dtype=dtype, seed=seed + 1)
    y_in = ref_forward(randn(rows, C, dtype=dtype, scale=2.0, seed=seed + 2)).to(dtype)
    check_plain(_laid_out(x, layout, off), _laid_out(dy, layout, off), _laid_out(y_in, layout, off), dtype)


@gpu
@pytest.mark.sanitize
@pytest.mark.sanitize_race
@settings(max_examples=30)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       lead=st.sampled_from([(1,), (2,), (1, 3)]), scale=st.floats(1e-3, 4.0), layout=st.sampled_from(_LAYOUTS),
       off=st.integers(1, 7))
def test_causal_softmax_property_matches_float64(data, dtype, lead, scale, layout, off):
    """Generated (..., T, T) scores, scales and layouts: exact zeros above the diagonal and float64
    agreement, forward and backward."""
    V = 16 // torch.tensor([], dtype=dtype).element_size()
    # Warp rows (32V packs), block rows (256V) and 2049 (fp32: a block row of 513 packs); the streamed
    # causal rows (T > 2048V) are the fixed CAUSAL_SHAPES' 8193 (T^2 elements: too big to generate).
    T = data.draw(st.one_of(st.integers(1, 40), st.sampled_from([32 * V, 256 * V, 2049]).flatmap(
        lambda e: st.integers(e - 2, e + 2))), label="T")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    shape = (*lead, T, T)
    preatt = randn(*shape, dtype=dtype, scale=8.0, seed=seed)
    dy = randn(*shape, dtype=dtype, seed=seed + 1)
    y_in = ref_forward(randn(*shape, dtype=dtype, scale=2.0, seed=seed + 2), True, scale).to(dtype)
    check_causal(_laid_out(preatt, layout, off), _laid_out(dy, layout, off), _laid_out(y_in, layout, off),
                 scale, dtype)


# What the launchers (src/ops/softmax.cpp: input(), checked_rows(), dtype_of()) run without raising,
# for the checker properties below.
def _launcher_takes(shape, dtype, device, causal) -> bool:
    if device != "cuda" or dtype not in (torch.float32, torch.bfloat16, torch.float16) or len(shape) == 0:
        return False
    if causal and (len(shape) < 2 or shape[-1] != shape[-2]):
        return False
    C, numel = shape[-1], math.prod(shape)
    return C <= 2**31 - 1 and (C == 0 or numel // C < 2**31 - 1)


_ANY_DTYPE = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.bool])
_DIM_SIZES = st.one_of(st.integers(0, 9), st.sampled_from([2**31 - 2, 2**31 - 1, 2**31, 2**33]))


@settings(max_examples=150)
@given(shape=st.lists(_DIM_SIZES, min_size=0, max_size=4).map(tuple), dtype=_ANY_DTYPE,
       device=st.sampled_from(["cuda", "cpu"]), dim=st.integers(-5, 4),
       want=st.sampled_from([None, torch.float32, torch.bfloat16]))
def test_softmax_checker_never_accepts_what_the_kernel_cannot_do(shape, dtype, device, dim, want):
    """Generated proxies (any rank, empty and 2^31-sized dims, unsupported dtypes, CPU): whatever the
    checker accepts the launcher runs, over the last dim and in the input dtype (the claim's meaning).
    Fails when a checker rule is dropped or loosened past the launcher's checks."""
    with tracectx(TraceCtx()):
        a = proxy(shape, dtype=dtype, device=device)
        if sm._softmax_checker(a, dim, dtype=want) is None:
            assert _launcher_takes(shape, dtype, device, causal=False), (shape, dtype, device)
            assert len(shape) == 0 or dim in (-1, len(shape) - 1)
            assert want is None or want == dtype


@settings(max_examples=150)
@given(shape=st.lists(_DIM_SIZES, min_size=0, max_size=4).map(tuple), dtype=_ANY_DTYPE,
       device=st.sampled_from(["cuda", "cpu"]), scale=st.one_of(st.floats(allow_nan=False), st.integers(-3, 3),
                                                                  st.just("0.5"), st.just(True)))
def test_causal_checker_never_accepts_what_the_kernel_cannot_do(shape, dtype, device, scale):
    with tracectx(TraceCtx()):
        a = proxy(shape, dtype=dtype, device=device)
        if sm._causal_checker(a, scale) is None:
            assert _launcher_takes(shape, dtype, device, causal=True), (shape, dtype, device)
            assert isinstance(scale, (int, float)) and not isinstance(scale, bool)


# ---- faults: nothing outside the rows is read (issue 20: memcheck on an H100 at T = 8193) -----------
def _exact_cuda_buffer(nbytes: int):
    """(tensor of nbytes uint8, free) from a cuMemAlloc of exactly nbytes, outside PyTorch's caching
    allocator: under compute-sanitizer memcheck a read one byte past its end is an error (inside a
    caching-allocator segment it would go unseen)."""
    import ctypes

    torch.cuda.init()
    torch.empty(1, device="cuda")  # the primary context is current on this thread from here on
    cu = ctypes.CDLL("libcuda.so.1")
    ptr = ctypes.c_uint64(0)
    assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(nbytes)) == 0, "cuMemAlloc failed"

    class _Cai:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr.value, False),
                                    "version": 3, "strides": None}

    def free():
        torch.cuda.synchronize()
        cu.cuMemFree_v2(ctypes.c_uint64(ptr.value))

    return torch.as_tensor(_Cai(), device="cuda"), free


def _at_allocation_end(t: torch.Tensor, lead: int, keep: list):
    """A copy of t ending exactly where its allocation ends, after `lead` NaN elements (a read before
    the first row uses NaN: the outputs turn NaN; a read past the last row is out of bounds)."""
    es = t.element_size()
    raw, free = _exact_cuda_buffer((lead + t.numel()) * es)
    keep.append(free)
    buf = raw.view(t.dtype)
    buf[:lead] = float("nan")
    return buf[lead:].view(t.shape).copy_(t)


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("lead", [0, 1, 3])
@pytest.mark.parametrize("T", [7, 1000, 2049, 8193])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_softmax_reads_only_its_rows(dtype, T, lead):
    """Scores, y and dy that end exactly where their cuMemAlloc ends, with NaN in front and above the
    diagonal, 2 batches as in the issue's failing test: outputs finite, exactly 0 above the diagonal,
    float64 agreement. lead = 1, 3 moves every row off its 16-byte phase relative to the launcher's
    outputs (the element-wise stream path) and puts NaN right before row 0. Under compute-sanitizer
    memcheck (scripts/sanitize.sh) a read past the last row is reported; without it, a read before
    the first row or of a masked entry that is used fails the value checks."""
    scale, keep = 0.37, []
    mask = causal_mask(T, "cuda")
    try:
        preatt = _at_allocation_end(randn(2, T, T, dtype=dtype, scale=4.0).masked_fill(mask, float("nan")), lead, keep)
        dy = _at_allocation_end(randn(2, T, T, dtype=dtype).masked_fill(mask, float("nan")), lead, keep)
        y_in = _at_allocation_end(probs(2, T, T, dtype=dtype, causal=True, scale=scale).masked_fill(mask, float("nan")),
                                  lead, keep)
        y = kforge._C.causal_softmax_forward(preatt, scale)
        dx = kforge._C.causal_softmax_backward(dy, y_in, scale)
        torch.cuda.synchronize()
        assert torch.isfinite(y).all() and torch.isfinite(dx).all()
        assert (y[:, mask] == 0).all() and (dx[:, mask] == 0).all()
        assert_close(y, ref_forward(preatt.masked_fill(mask, 0.0), True, scale), dtype, "y")
        assert_close(dx, ref_backward(dy.masked_fill(mask, 0.0), y_in.masked_fill(mask, 0.0), True, scale),
                     dtype, "dx")
    finally:
        for free in keep:
            free()
