"""rmsnorm: Hugging Face Llama RMSNorm and F.rms_norm on kforge's kernels.

GPU: forward (y, rstd) and backward (dx, dweight) against float64 references, both rounding
conventions, odd / misaligned / strided inputs, deterministic dweight, side streams and CUDA graphs,
thunder.jit traces.
CPU: checker declines with reasons, thunder.jit falling back to the helper's decomposition, launcher
errors. (The dev/ probes' patched kernels: dev/tests.)
"""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
import thunder
from thunder.core.trace import TraceCtx, tracectx

import kforge
from kforge import _thunder
from kforge._testing import override
from kforge.ops import rmsnorm as op
import conftest
from conftest import DTYPES, assert_close, check_jit_matches_eager, gpu, randn, swap_launchers, symbol_names

EPS = 1e-5

# Proxies in this file are bf16 unless a test says otherwise (conftest.proxy defaults to fp32).
proxy = functools.partial(conftest.proxy, dtype=torch.bfloat16)


def reference(x, weight, eps, dy, nd=1):
    """float64 (y, rstd, dx, dweight) of y = x * rsqrt(mean(x^2) + eps) * weight over the last nd dims."""
    x64 = x.detach().double().requires_grad_()
    w64 = None if weight is None else weight.detach().double().requires_grad_()
    dims = tuple(range(x.ndim - nd, x.ndim))
    rstd = torch.rsqrt(x64.pow(2).mean(dims, keepdim=True) + eps)
    y = x64 * rstd * (1.0 if w64 is None else w64)
    y.backward(dy.double())
    return y.detach(), rstd.detach().reshape(-1), x64.grad, None if w64 is None else w64.grad


def rms_backward(dy, x, weight, rstd, nd=1, cast_before_weight=True, variant=0, dresidual=None):
    """kforge._C.rmsnorm_backward under the launcher's testing override (variant 1: never the ring)."""
    with override("rmsnorm_backward", variant=variant):
        return kforge._C.rmsnorm_backward(dy, x, weight, rstd, nd, cast_before_weight, dresidual=dresidual)


def check(x, weight, dy, cast_before_weight, nd=1, what="", variant=0):
    dtype = x.dtype
    what = f"{what} variant {variant}"
    y, rstd = kforge._C.rmsnorm_forward(x, weight, EPS, nd, cast_before_weight)
    dx, dw = rms_backward(dy, x, weight, rstd, nd, cast_before_weight, variant)
    ry, rrstd, rdx, rdw = reference(x, weight, EPS, dy, nd)
    assert y.dtype == dtype and rstd.dtype == torch.float32 and dx.dtype == dtype
    assert_close(y, ry, dtype, f"y {what}")
    assert_close(rstd, rrstd, torch.float32, f"rstd {what}")
    # dx = rstd (g - x_hat mean(g x_hat)), g = dy * w: over a few columns the terms cancel, so
    # its error is relative to them (see assert_close).
    g = dy.double() * (1.0 if weight is None else weight.double())
    rows_shape = (*x.shape[: x.ndim - nd], *([1] * nd))
    assert_close(dx, rdx, dtype, f"dx {what}", scale=(g * rrstd.reshape(rows_shape)).norm().item())
    if weight is None:
        assert dw is None
    else:
        assert dw.dtype == dtype
        if cast_before_weight and dtype != torch.float32:
            # Hugging Face's dweight is sum(dy * T(x * rstd)) with x_hat rounded to T in fp32
            # arithmetic (as its forward multiplies by the weight): the same rounding here, from the
            # kernel's rstd (checked above), so a term whose rounding flips with rstd's last bit
            # does not count as an error.
            xhat_t = (x.float() * rstd.reshape(rows_shape)).to(dtype).double()
            dims = tuple(range(x.ndim - nd))
            rdw = (dy.double() * xhat_t).sum(dims)
        assert_close(dw, rdw, dtype, f"dweight {what}")


def check_random(shape, dtype, cast_before_weight, variant):
    """check() on random x, dy of `shape` and a weight around 1."""
    x = randn(*shape, dtype=dtype)
    w = randn(shape[-1], dtype=dtype, scale=0.5) + 1
    dy = randn(*shape, dtype=dtype)
    check(x, w, dy, cast_before_weight, what=str(shape), variant=variant)


# ---- GPU: kernels against float64 ---------------------------------------------------------------------
# Chosen so every kernel instantiation runs (see forward_geometry / ring_plan / pipe_kernel /
# backward_geometry in src/ops/rmsnorm.cpp): forward one warp per row with K = 1, 2, 4, 8 chunks per
# thread ((2, 256), (3, 512), (17, 768), (5, 2048)) and one block per row with K = 4 ((4, 2056),
# bf16 (3, 5, 4100)) and K = 8 ((8, 4096)).
# Backward, the ring kernel (variant 0): rows of <= 512 chunks on 4 chunks per
# thread, several row groups per block ((8, 4096) bf16 and (5, 2048) fp32: 512 chunks, three rows of
# 128 threads; (17, 768) bf16: 96 chunks, twelve rows of 32), groups of less than a warp ((2, 256)
# bf16: 32 chunks on 8 threads; (1000, 64) bf16: 8 chunks on 2; (5, 3) is element-wise), chunks
# past the row's end ((4, 2056) bf16: 257 chunks on 96 threads); longer rows (513..1024 chunks:
# (3, 8192) bf16, (8, 4096) fp32, (4, 2056) fp32, (5, 6000) bf16: 750 chunks on 384 threads) on 2
# chunks per thread, one row per block. Grids of 1..11 blocks here; test_ring_rows and
# test_dweight_partial_rows cover more.
# Where the ring does not apply, under every variant, rmsnorm_backward_kernel: element-wise for odd
# sizes ((3, 5, 4100) bf16, (5, 3)) and misaligned pointers, and rows of > 1024 chunks ((3, 8192) and
# (5, 6000) fp32, test_longest_rows), K = 1, 2, 4. Variant 1 never takes the ring: the pipelined
# kernel (only where the ring's stages do not fit in shared memory otherwise) with K = 1 (one warp
# per row: (2, 256) bf16, (1000, 64) with lanes past the row's end) and K = 2 in groups of 1 warp
# ((3, 512) bf16), 2, 4, 8 warps (bf16 (17, 768), (5, 2048), (8, 4096)), 12 warps with padded slots
# (bf16 (5, 6000)), 16 warps ((3, 8192) bf16, (8, 4096) fp32), and with chunks past the row's end
# ((4, 2056): bf16 257 chunks on 160 threads, fp32 514 on 288).
SHAPES = [(8, 4096), (3, 5, 4100), (2, 256), (17, 768), (1, 1, 4096), (1000, 64), (5, 3), (4, 2056),
          (3, 512), (5, 2048), (3, 8192), (5, 6000)]
# Backward kernels (the launcher's testing `variant`, see rms_backward): 0 the default (the ring
# where it applies, then rmsnorm_dweight_kernel), 1 the kernels for what the ring does not take
# (2, the plain kernel for 16-byte rows too, runs in the property and every-instantiation tests).
VARIANTS = [0, 1]
variants = pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"v{v}")


@gpu
@variants
@pytest.mark.parametrize("cast_before_weight", [True, False], ids=["hf", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_backward(dtype, shape, cast_before_weight, variant):
    check_random(shape, dtype, cast_before_weight, variant)


@gpu
@variants
@pytest.mark.parametrize("cast_before_weight", [True, False], ids=["hf", "torch"])
@pytest.mark.parametrize("shape", [(8, 4096), (3, 5, 4100), (17, 768), (5, 3), (6, 16384), (1000, 64),
                                   (3, 8192), (4, 2056)],
                         ids=lambda s: "x".join(map(str, s)))
def test_float16(shape, cast_before_weight, variant):
    # fp16 has its own unpacking / rounding code in the kernels (cvt.f32.f16, cvt.rn.f16x2.f32).
    check_random(shape, torch.float16, cast_before_weight, variant)


@gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("D", [64, 768, 4096, 6000], ids=lambda d: f"D{d}")
def test_pipelined_rows_per_group(D, dtype):
    # The pipelined backward (variant 1): a group's rows first, first + stride, ... with P rows in
    # flight; row counts that give the groups 1..6 rows (fewer than P, not a multiple of P, some
    # groups one row fewer), so every buffer is the last one used and the loads past the end are
    # clamped.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    es = torch.tensor([], dtype=dtype).element_size()
    nchunk = D * es // 16
    tx = 32 if nchunk <= 32 else -(-nchunk // 2 // 32) * 32
    groups = 512 // tx
    for n in range(1, 7):
        rows = sms * groups * (n - 1) + (sms * groups * 2) // 3 + 1
        x, dy = randn(rows, D, dtype=dtype), randn(rows, D, dtype=dtype)
        w = randn(D, dtype=dtype, scale=0.5) + 1
        check(x, w, dy, True, what=f"{rows}x{D}", variant=1)
        check(x, w, dy, False, what=f"{rows}x{D}", variant=1)


@gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("D", [8, 64, 768, 4096, 4100, 8192], ids=lambda d: f"D{d}")
def test_ring_rows(D, dtype):
    # The ring kernel's persistent grid (one block per SM, blocks of 1..384 rows at a time) with row
    # counts from 1 to several times the grid: fewer rows than blocks, a partial last row group
    # (zero-filled rows), blocks with fewer row groups than stages, one more, many more. D=8: 1 or 2
    # chunks (groups of 1 thread); D=4100: bf16 / fp16 take rmsnorm_backward_kernel (D % 8 != 0);
    # D=8192 fp32: rows of 2048 chunks do too.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows in sorted({1, 2, 3, 7, sms - 1, sms + 1, 2 * sms + 5, 3 * sms + 1, 5 * sms * 2 + 7,
                        9 * sms * 3 + 2}):
        if rows * D > 12_000_000:
            continue
        x, dy = randn(rows, D, dtype=dtype), randn(rows, D, dtype=dtype)
        w = randn(D, dtype=dtype, scale=0.5) + 1
        check(x, w, dy, True, what=f"{rows}x{D}")
        if rows in (1, 3 * sms + 1):
            check(x, w, dy, False, what=f"{rows}x{D}")
            check(x, None, dy, True, what=f"{rows}x{D} no weight")


@gpu
@pytest.mark.parametrize("G", [1, 2, 9, 20, 40, 100, 131, 132, 133, 264, 300, 1000],
                         ids=lambda g: f"G{g}")
@pytest.mark.parametrize("D", [4096, 768, 4100, 3], ids=lambda d: f"D{d}")
def test_dweight_partial_rows(G, D):
    # fp32 rows: as many partial rows as the backward grid has blocks (min(G, the SMs) at D = 4096,
    # one row per block; D = 768: six rows per block), added by rmsnorm_dweight_kernel: 16-byte loads for D % 4 == 0 (4096, 768; 4100 through
    # rmsnorm_backward_kernel, rows of > 1024 chunks), element-wise otherwise (D = 3).
    x, dy = randn(G, D), randn(G, D)
    w = randn(D, scale=0.5) + 1
    for variant in VARIANTS:
        check(x, w, dy, True, what=f"{G}x{D}", variant=variant)


@gpu
@variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_many_rows_odd_size(dtype, variant):
    # Element-wise kernels (D % 8 != 0 for bf16) over many rows: the persistent backward grid loops.
    x, dy = randn(1000, 4100, dtype=dtype), randn(1000, 4100, dtype=dtype)
    check(x, randn(4100, dtype=dtype, scale=0.5) + 1, dy, True, what="1000x4100", variant=variant)


@gpu
@variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_longest_rows(dtype, variant):
    D = op.MAX_ROW_BYTES // torch.tensor([], dtype=dtype).element_size()
    x, dy = randn(3, D, dtype=dtype), randn(3, D, dtype=dtype)
    check(x, randn(D, dtype=dtype), dy, True, what=f"D={D}", variant=variant)
    with pytest.raises(kforge.KforgeError, match="too long"):
        kforge._C.rmsnorm_forward(randn(2, D + 1, dtype=dtype), None, EPS)


@gpu
@variants
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_llama_size_many_rows(dtype, variant):
    # 8192 x 4096 (the bench size): the persistent backward grid walks many rows per block.
    x, dy = randn(8192, 4096, dtype=dtype), randn(8192, 4096, dtype=dtype)
    w = randn(4096, dtype=dtype, scale=0.5) + 1
    check(x, w, dy, True, what="8192x4096", variant=variant)
    check(x, w, dy, False, what="8192x4096", variant=variant)


@gpu
@variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_weight_and_multidim(dtype, variant):
    x, dy = randn(6, 5, 32, dtype=dtype), randn(6, 5, 32, dtype=dtype)
    check(x, None, dy, False, what="no weight", variant=variant)
    check(x, randn(5, 32, dtype=dtype), dy, False, nd=2, what="normalized (5, 32)", variant=variant)
    check(x, None, dy, True, nd=3, what="normalized (6, 5, 32)", variant=variant)
    x, dy = randn(300, 4096, dtype=dtype), randn(300, 4096, dtype=dtype)
    check(x, None, dy, True, what="no weight, 300x4096", variant=variant)


@gpu
@variants
@pytest.mark.parametrize("D", [64, 512, 1024, 2048, 4096], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_and_strided_inputs(dtype, D, variant):
    # Misaligned rows take the element-wise kernels: every chunk count K of both directions.
    buf = randn(37 * D + 1, dtype=dtype)
    x = buf[1:].view(37, D)  # 2-byte / 4-byte offset: the element-wise path
    w = randn(D, dtype=dtype)
    check(x, w, randn(37, D, dtype=dtype), True, what=f"misaligned D={D}", variant=variant)
    check(x, w, randn(37, D, dtype=dtype), False, what=f"misaligned D={D}", variant=variant)
    # Only dy misaligned (x aligned): the element-wise path too.
    dyb = randn(37 * D + 1, dtype=dtype)
    check(randn(37, D, dtype=dtype), w, dyb[1:].view(37, D), True, what=f"misaligned dy D={D}",
          variant=variant)
    if D != 4096:
        return
    xt = randn(D, 6, dtype=dtype).t()  # non-contiguous: copied by the launcher
    check(xt, randn(D, dtype=dtype), randn(6, D, dtype=dtype), True, what="transposed", variant=variant)


@gpu
def test_hf_rounding_matches_the_helper():
    # cast_before_weight rounds x * rstd to bf16 before the weight, as HF does: the kernel and the eager
    # helper then differ only by fp32 rounding noise, while F.rms_norm's convention differs more.
    x = randn(64, 4096, dtype=torch.bfloat16)
    w = randn(4096, dtype=torch.bfloat16, scale=3)
    hf = op.rms_norm(x, w, EPS).double()
    y_hf, _ = kforge._C.rmsnorm_forward(x, w, EPS, 1, True)
    y_f, _ = kforge._C.rmsnorm_forward(x, w, EPS, 1, False)
    assert (y_hf.double() - hf).abs().gt(0).float().mean() < 0.01
    assert (y_f.double() - hf).abs().gt(0).float().mean() > 0.05
    assert_close(y_f, F.rms_norm(x.double(), (4096,), w.double(), EPS), torch.bfloat16)


@gpu
@variants
@pytest.mark.parametrize("shape", [(4096, 4096), (500, 768)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dweight_is_deterministic(dtype, shape, variant):
    # Three runs, the same bits (the blocks finish in a different order every run; the reduction's
    # order does not depend on it).
    x, dy = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    w = randn(shape[-1], dtype=dtype)
    _, rstd = kforge._C.rmsnorm_forward(x, w, EPS)
    runs = [rms_backward(dy, x, w, rstd, variant=variant) for _ in range(3)]
    assert all(torch.equal(runs[0][1], r[1]) and torch.equal(runs[0][0], r[0]) for r in runs[1:])


@gpu
@variants
def test_side_stream_and_cuda_graph_capture(variant):
    """The dweight reduction is a dependent launch: the same bits on a side stream right after other
    work, and replayed from a CUDA graph after dy changes."""
    x, dy = randn(3000, 4096, dtype=torch.bfloat16), randn(3000, 4096, dtype=torch.bfloat16)
    w = randn(4096, dtype=torch.bfloat16, scale=0.5) + 1
    _, rstd = kforge._C.rmsnorm_forward(x, w, EPS)
    expected = rms_backward(dy, x, w, rstd, variant=variant)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dy2 = dy * 2  # a kernel right before the backward on the same stream
        side = [rms_backward(dy2, x, w, rstd, variant=variant) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(s)
    again = rms_backward(dy2, x, w, rstd, variant=variant)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = rms_backward(dy, x, w, rstd, variant=variant)
    dy.mul_(-1)  # replay must see the new values
    graph.replay()
    torch.cuda.synchronize()
    for dx, dw in side:
        assert torch.equal(dx, again[0]) and torch.equal(dw, again[1])
    assert torch.equal(captured[0], -expected[0]) and torch.equal(captured[1], -expected[1])
    check(x, w, -dy, True, what="after replay", variant=variant)


@gpu
def test_gpu_argument_errors():
    x, w = randn(4, 64), randn(64)
    with pytest.raises(kforge.KforgeError, match="weight has 63 elements"):
        kforge._C.rmsnorm_forward(x, w[:63], EPS)
    with pytest.raises(kforge.KforgeError, match="weight has dtype"):
        kforge._C.rmsnorm_forward(x, w.bfloat16(), EPS)
    y, rstd = kforge._C.rmsnorm_forward(x, w, EPS)
    with pytest.raises(kforge.KforgeError, match="rstd must be a float32"):
        kforge._C.rmsnorm_backward(y, x, w, rstd[:3])
    with pytest.raises(kforge.KforgeError, match="normalized_ndim"):
        kforge._C.rmsnorm_forward(x, w, EPS, 3)


# ---- GPU: thunder.jit ----------------------------------------------------------------------------------
def _jit_check(fn, args, dtype):
    """thunder.jit(fn) with kforge: the kforge rmsnorm kernels appear in the forward and backward
    traces, and the output and the gradients of `args` match eager torch."""
    check_jit_matches_eager(fn, args, dtype, "kforge_rmsnorm_forward", "kforge_rmsnorm_backward")


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_helper(dtype):
    x = randn(2, 7, 4096, dtype=dtype).requires_grad_()
    w = (randn(4096, dtype=dtype, scale=0.5) + 1).requires_grad_()
    _jit_check(lambda x, w: op.rms_norm(x, w, 1e-6) * 2, [x, w], dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_f_rms_norm(dtype):
    x = randn(2, 5, 768, dtype=dtype).requires_grad_()
    w = randn(768, dtype=dtype).requires_grad_()
    _jit_check(lambda x, w: F.rms_norm(x, (768,), w, 1e-6), [x, w], dtype)
    _jit_check(lambda x: F.rms_norm(x, (5, 768)), [x], dtype)  # eps=None, no weight


# ---- CPU: checkers, fallback, launcher errors -----------------------------------------------------------
def _checker(symbol):
    (claim,) = (c for c in op.SPEC.claims if c.symbol is symbol)
    return claim.checker


def test_helper_checker(trace_ctx):
    check_helper = _checker(op.kforge_rms_norm)
    x, w = proxy(8, 4096), proxy(4096)
    assert check_helper(x, w, 1e-6) is None
    assert "not CUDA" in check_helper(proxy(8, 4096, device="cpu"), proxy(4096, device="cpu"), 1e-6)
    assert "float64" in check_helper(proxy(8, 16, dtype=torch.float64), proxy(16, dtype=torch.float64))
    assert "weight dtype" in check_helper(x, proxy(4096, dtype=torch.float32))
    assert "weight shape" in check_helper(x, proxy(4095))
    assert "not a tensor" in check_helper(x, None)
    assert "longer than" in check_helper(proxy(2, 16385), proxy(16385))
    assert check_helper(proxy(2, 8192, dtype=torch.float32), proxy(8192, dtype=torch.float32)) is None
    assert "longer than" in check_helper(proxy(2, 8193, dtype=torch.float32), proxy(8193, dtype=torch.float32))
    assert "eps" in check_helper(x, w, None)
    assert "empty" in check_helper(proxy(0, 4096), w)


def test_f_rms_norm_checker(trace_ctx):
    check_f = _checker(thunder.torch.rms_norm)
    x = proxy(2, 5, 64)
    assert check_f(x, (64,), proxy(64), 1e-5) is None
    assert check_f(x, [5, 64]) is None
    assert check_f(x, 64, None, None) is None
    assert "trailing shape" in check_f(x, (5,))
    assert "weight shape" in check_f(x, (5, 64), proxy(64))
    assert "weight dtype" in check_f(x, (64,), proxy(64, dtype=torch.float32))


def _jit_cpu(fn, *args):
    _thunder.reset_declines()
    jargs = [a.detach().clone().requires_grad_() for a in args]
    jf = thunder.jit(fn, executors=[kforge.executor])
    out = jf(*jargs)
    ref = fn(*args)
    out.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for a, j in zip(args, jargs):
        torch.testing.assert_close(j.grad, a.grad)
    names = symbol_names(thunder.last_traces(jf)[-1]) | symbol_names(thunder.last_backward_traces(jf)[-1])
    assert not any(n.startswith("kforge_rmsnorm") for n in names)
    return _thunder.declines()


def test_cpu_fallback_helper():
    x, w = torch.randn(3, 7, 40, requires_grad=True), torch.randn(40, requires_grad=True)
    declines = _jit_cpu(lambda x, w: op.rms_norm(x, w, 1e-6), x, w)
    assert any("not CUDA" in r for r in declines["kforge_rms_norm"])


def test_cpu_fallback_without_grad():
    # Declined without autograd, the trace keeps kforge_rms_norm and runs the helper itself.
    x, w = torch.randn(3, 7, 40), torch.randn(40)
    jf = thunder.jit(lambda x, w: op.rms_norm(x, w, 1e-6), executors=[kforge.executor])
    with torch.no_grad():
        torch.testing.assert_close(jf(x, w), op.rms_norm(x, w, 1e-6))
        torch.testing.assert_close(thunder.jit(lambda x: F.rms_norm(x, (40,)), executors=[kforge.executor])(x),
                                   F.rms_norm(x, (40,)))


def test_cpu_fallback_f_rms_norm():
    x, w = torch.randn(3, 7, 40, requires_grad=True), torch.randn(40, requires_grad=True)
    declines = _jit_cpu(lambda x, w: F.rms_norm(x, (40,), w, 1e-6), x, w)
    assert any("not CUDA" in r for r in declines["rms_norm"])


def test_helper_is_hf_llama_rmsnorm():
    # HF LlamaRMSNorm: fp32 statistics, cast back to the input dtype, then the weight.
    x = torch.randn(4, 64).bfloat16()
    w = (torch.randn(64) * 3).bfloat16()
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16()
    assert torch.equal(op.rms_norm(x, w, EPS), hf)
    assert op.rms_norm(x, w.float(), EPS).dtype == torch.float32  # torch promotion


def test_launcher_rejects_cpu_tensors():
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.rmsnorm_forward(torch.randn(2, 8), torch.randn(8), EPS)
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.rmsnorm_backward(torch.randn(2, 8), torch.randn(2, 8), None, torch.randn(2))


def test_launcher_rejects_unknown_variant():
    for v in (-1, 3):
        with pytest.raises(kforge.KforgeError, match=r"variant must be in \[0, 2\]"):
            rms_backward(torch.randn(2, 8), torch.randn(2, 8), None, torch.randn(2),
                                       variant=v)


# ---- residual add fused into the norm (add_rms_norm) -----------------------------------------------------
def reference_add(x, residual, weight, eps, dy, ds, nd=1):
    """float64 (s, y, rstd, dx, dweight) of s = x + residual, y = RMSNorm(s) over the last nd dims, and
    the gradient of s (of x and of residual) for output gradients dy (of y) and ds (of s; None: 0)."""
    s = (x + residual).detach()  # eager's rounded add: what the norm reads
    ry, rrstd, rdx, rdw = reference(s, weight, eps, dy, nd)
    return s, ry, rrstd, rdx if ds is None else rdx + ds.double(), rdw


def check_add(x, residual, weight, dy, ds, cast_before_weight, nd=1, what="", variant=0):
    """add_rmsnorm_forward and rmsnorm_backward(dresidual=ds) against float64; s bitwise eager's add,
    y / rstd bitwise the unfused kernel's on s, dweight bitwise the unfused backward's (variant 1)."""
    dtype = x.dtype
    what = f"{what} variant {variant} {'hf' if cast_before_weight else 'torch'}"
    y, rstd, s = kforge._C.add_rmsnorm_forward(x, residual, weight, EPS, nd, cast_before_weight)
    dx, dw = rms_backward(dy, s, weight, rstd, nd, cast_before_weight, variant, dresidual=ds)
    rs, ry, rrstd, rdx, rdw = reference_add(x, residual, weight, EPS, dy, ds, nd)
    assert s.dtype == y.dtype == dx.dtype == dtype and rstd.dtype == torch.float32
    assert s.shape == y.shape == dx.shape == x.shape and s.is_contiguous()
    assert torch.equal(s, rs), f"s is not eager's x + residual bit for bit ({what})"
    y0, rstd0 = kforge._C.rmsnorm_forward(rs, weight, EPS, nd, cast_before_weight)
    assert torch.equal(y, y0) and torch.equal(rstd, rstd0), f"y / rstd differ from the norm of s ({what})"
    assert_close(y, ry, dtype, f"y {what}")
    assert_close(rstd, rrstd, torch.float32, f"rstd {what}")
    g = dy.double() * (1.0 if weight is None else weight.double())
    rows_shape = (*x.shape[: x.ndim - nd], *([1] * nd))
    terms = (g * rrstd.reshape(rows_shape)).norm().item() + (0.0 if ds is None else ds.double().norm().item())
    assert_close(dx, rdx, dtype, f"dx {what}", scale=terms)
    if weight is None:
        assert dw is None
        return
    assert dw.dtype == dtype
    if cast_before_weight and dtype != torch.float32:  # x_hat rounded to T first: see check()
        xhat_t = (s.float() * rstd.reshape(rows_shape)).to(dtype).double()
        rdw = (dy.double() * xhat_t).sum(tuple(range(x.ndim - nd)))
    assert_close(dw, rdw, dtype, f"dweight {what}")
    if variant == 1 and (ds is None or ds.data_ptr() % 16 == 0):
        # The same kernel with and without dres (variant 1 never takes the ring, whose stages with
        # dres may not fit where those without do): the dweight path is unchanged, bit for bit.
        _, dw0 = rms_backward(dy, s, weight, rstd, nd, cast_before_weight, variant)
        assert torch.equal(dw, dw0), f"dweight differs from the unfused backward's ({what})"


def check_add_random(shape, dtype, cast_before_weight, variant, ds=True, weight=True):
    x, r = randn(*shape, dtype=dtype), randn(*shape, dtype=dtype)
    w = randn(shape[-1], dtype=dtype, scale=0.5) + 1 if weight else None
    dy = randn(*shape, dtype=dtype)
    check_add(x, r, w, dy, randn(*shape, dtype=dtype) if ds else None, cast_before_weight,
              what=str(shape), variant=variant)


# Every forward K (1, 2, 4, 8; one warp per row and one block per row), element-wise and 16-byte, and
# every backward kernel (ring with 4 and 2 chunks per thread, groups below a warp, chunks past the row;
# pipelined under variant 1; rmsnorm_backward_kernel for odd sizes and rows of > 1024 chunks): the
# SHAPES above, plus the Llama widths 768..8192 (SmolLM 576, 960; Llama 3 2048 / 3072 / 4096 / 8192;
# 5120) over odd row counts.
RES_SHAPES = SHAPES + [(7, 576), (9, 960), (33, 3072), (3, 5120), (129, 2048), (5, 8), (3, 1, 16), (11, 24)]


@gpu
@variants
@pytest.mark.parametrize("cast_before_weight", [True, False], ids=["hf", "torch"])
@pytest.mark.parametrize("shape", RES_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_add_forward_backward(dtype, shape, cast_before_weight, variant):
    check_add_random(shape, dtype, cast_before_weight, variant)


@gpu
@variants
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_add_without_dresidual_or_weight(dtype, variant):
    # dresidual=None is the unfused backward bit for bit; no weight (dweight None) with and without it.
    for shape in [(17, 768), (5, 4100), (3, 8192), (2, 6, 64)]:
        x, r, dy = (randn(*shape, dtype=dtype) for _ in range(3))
        w = randn(shape[-1], dtype=dtype, scale=0.5) + 1
        _, rstd, s = kforge._C.add_rmsnorm_forward(x, r, w, EPS)
        a = rms_backward(dy, s, w, rstd, variant=variant, dresidual=None)
        b = rms_backward(dy, s, w, rstd, variant=variant)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        check_add_random(shape, dtype, True, variant, ds=False)
        check_add_random(shape, dtype, False, variant, weight=False)
        check_add_random(shape, dtype, True, variant, weight=False)


@gpu
@variants
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_add_multidim_rows(dtype, variant):
    x, r, dy, ds = (randn(6, 5, 32, dtype=dtype) for _ in range(4))
    check_add(x, r, randn(5, 32, dtype=dtype), dy, ds, False, nd=2, what="normalized (5, 32)", variant=variant)
    check_add(x, r, None, dy, ds, True, nd=3, what="normalized (6, 5, 32)", variant=variant)


@gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("D", [8, 768, 2048, 4096, 8192], ids=lambda d: f"D{d}")
def test_add_ring_and_pipelined_rows(D, dtype):
    # The persistent backward grids with a third array per row (dres): row counts from 1 to several
    # times the grid (partial last row groups, blocks with fewer row groups than stages), both kernels.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for rows in sorted({1, 3, sms - 1, sms + 1, 3 * sms + 1, 5 * sms * 2 + 7, 9 * sms * 3 + 2}):
        if rows * D > 6_000_000:
            continue
        x, r, dy, ds = (randn(rows, D, dtype=dtype) for _ in range(4))
        w = randn(D, dtype=dtype, scale=0.5) + 1
        for variant in VARIANTS:
            check_add(x, r, w, dy, ds, True, what=f"{rows}x{D}", variant=variant)


@gpu
@variants
@pytest.mark.parametrize("D", [64, 768, 2048, 4096], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_add_misaligned_and_strided(dtype, D, variant):
    # One misaligned tensor sends the call to the element-wise kernels: residual alone (forward), dres
    # alone (backward), x; a transposed residual / dres / x is copied by the launcher.
    rows = 37
    w = randn(D, dtype=dtype, scale=0.5) + 1

    def off(t):  # the same values one element into a fresh buffer: 2- or 4-byte aligned only
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
        buf[1:].copy_(t.reshape(-1))
        return buf[1:].view(t.shape)

    x, r, dy, ds = (randn(rows, D, dtype=dtype) for _ in range(4))
    for xs, rs_, dss in [(x, off(r), ds), (x, r, off(ds)), (off(x), r, ds),
                         (x, r.t().contiguous().t(), ds), (x, r, ds.t().contiguous().t())]:
        assert xs.data_ptr() % 16 or rs_.data_ptr() % 16 or dss.data_ptr() % 16 or not rs_.is_contiguous() \
            or not dss.is_contiguous()
        check_add(xs, rs_, w, dy, dss, True, what=f"D={D}", variant=variant)
        check_add(xs, rs_, w, dy, dss, False, what=f"D={D}", variant=variant)
    xt, rt = randn(D, 6, dtype=dtype).t(), randn(D, 6, dtype=dtype).t()
    check_add(xt, rt, w, randn(6, D, dtype=dtype), randn(6, D, dtype=dtype), True, what="transposed",
              variant=variant)


@gpu
@variants
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_add_longest_rows_and_llama_size(dtype, variant):
    D = op.MAX_ROW_BYTES // torch.tensor([], dtype=dtype).element_size()
    check_add_random((3, D), dtype, True, variant)
    check_add_random((8192, 4096), dtype, True, variant)
    check_add_random((2048, 8192), dtype, False, variant)


@gpu
@variants
def test_add_is_deterministic_on_streams_and_graphs(variant):
    # Same bits every run, on a side stream right after other work, and replayed from a CUDA graph.
    x, r, dy, ds = (randn(3000, 4096, dtype=torch.bfloat16) for _ in range(4))
    w = randn(4096, dtype=torch.bfloat16, scale=0.5) + 1

    def step():
        y, rstd, s = kforge._C.add_rmsnorm_forward(x, r, w, EPS)
        return (y, rstd, s, *rms_backward(dy, s, w, rstd, variant=variant, dresidual=ds))

    first = step()
    assert all(all(torch.equal(a, b) for a, b in zip(first, step())) for _ in range(2))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.mul_(1.0)  # a kernel right before the launch on the same stream
        on_side = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    ds.mul_(-1)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(first, on_side))
    assert all(torch.equal(a, b) for a, b in zip(first[:3], captured[:3]))
    assert not torch.equal(first[3], captured[3])  # dx saw the new ds
    check_add(x, r, w, dy, ds, True, what="after replay", variant=variant)
    torch.testing.assert_close(captured[3], rms_backward(dy, first[2], w, first[1],
                                                                       variant=variant, dresidual=ds)[0],
                               rtol=0, atol=0)


@gpu
def test_add_argument_errors():
    x, r, w = randn(4, 64), randn(4, 64), randn(64)
    with pytest.raises(kforge.KforgeError, match="residual and x sizes differ"):
        kforge._C.add_rmsnorm_forward(x, r[:3], w, EPS)
    with pytest.raises(kforge.KforgeError, match="residual has dtype"):
        kforge._C.add_rmsnorm_forward(x, r.bfloat16(), w, EPS)
    y, rstd, s = kforge._C.add_rmsnorm_forward(x, r, w, EPS)
    with pytest.raises(kforge.KforgeError, match="dresidual and x sizes differ"):
        kforge._C.rmsnorm_backward(y, s, w, rstd, dresidual=randn(4, 32))
    with pytest.raises(kforge.KforgeError, match="dresidual has dtype"):
        kforge._C.rmsnorm_backward(y, s, w, rstd, dresidual=y.half())


try:
    from hypothesis import HealthCheck, given, settings, strategies as st
except ImportError:  # pragma: no cover
    given = None


if given is not None:
    @gpu
    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(rows=st.integers(1, 300), D=st.one_of(st.integers(1, 160), st.sampled_from([760, 768, 776, 1016, 1024,
                                                                                         1032, 2040, 2048, 2056,
                                                                                         4088, 4096, 4104, 8184,
                                                                                         8192])),
           dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), cbw=st.booleans(),
           variant=st.sampled_from(VARIANTS), with_ds=st.booleans(), with_w=st.booleans(),
           seed=st.integers(0, 2**31 - 1))
    def test_add_generated(rows, D, dtype, cbw, variant, with_ds, with_w, seed):
        # Widths around the vector width (4 / 8 elements) and the layout switch points (K = 1..8,
        # warp / block per row, 512 / 1024 chunks), row counts around the grids.
        if D > op.MAX_ROW_BYTES // torch.tensor([], dtype=dtype).element_size():
            D //= 2
        x, r, dy, ds = (randn(rows, D, dtype=dtype, seed=seed + i) for i in range(4))
        w = randn(D, dtype=dtype, scale=0.5, seed=seed + 4) + 1 if with_w else None
        check_add(x, r, w, dy, ds if with_ds else None, cbw, what=f"{rows}x{D}", variant=variant)


# ---- add_rms_norm under thunder.jit (GPU) -----------------------------------------------------------------
class _TwoNorms(torch.nn.Module):
    """The two residual adds of a Llama block, attention and MLP stood in for by cheap ops: s of the
    first add_rms_norm is read again by the second (so its gradient is the norm's plus the next add's)."""

    def __init__(self, D, dtype, device, cast_before_weight):
        super().__init__()
        self.cbw = cast_before_weight
        self.w1 = torch.nn.Parameter(randn(D, dtype=dtype, device=device, scale=0.5) + 1)
        self.w2 = torch.nn.Parameter(randn(D, dtype=dtype, device=device, scale=0.5) + 1)

    def forward(self, x, attn):
        h, y = op.add_rms_norm(x, attn, self.w1, EPS, cast_before_weight=self.cbw)
        out, y2 = op.add_rms_norm(h, y.sin(), self.w2, EPS, cast_before_weight=self.cbw)
        return out, y2


def _float64_grads(module, args, outs_grads):
    ref = _TwoNorms(args[0].shape[-1], torch.float64, args[0].device, module.cbw)
    ref.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    rargs = [a.detach().double().requires_grad_() for a in args]
    routs = ref(*rargs)
    torch.autograd.backward(routs, [g.double() for g in outs_grads])
    return routs, [a.grad for a in rargs], [ref.w1.grad, ref.w2.grad]


@gpu
@pytest.mark.parametrize("cast_before_weight", [True, False], ids=["hf", "torch"])
@pytest.mark.parametrize("shape", [(2, 7, 768), (3, 5, 2048), (1, 9, 4096)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_thunder_add_rms_norm_module(dtype, shape, cast_before_weight):
    module = _TwoNorms(shape[-1], dtype, "cuda", cast_before_weight)
    args = [randn(*shape, dtype=dtype).requires_grad_(), randn(*shape, dtype=dtype).requires_grad_()]
    jm = thunder.jit(module, executors=[kforge.executor])
    outs = jm(*args)
    grads = [randn(*o.shape, dtype=dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    fwd = symbol_names(thunder.last_traces(jm)[-1])
    bwd = symbol_names(thunder.last_backward_traces(jm)[-1])
    assert "kforge_add_rmsnorm_forward" in fwd and "kforge_add_rmsnorm_backward" in bwd
    assert "add" not in fwd and "kforge_rmsnorm_forward" not in fwd  # the adds went into the kernels
    routs, rgrads, rwgrads = _float64_grads(module, args, grads)
    # Each output / gradient is a few roundings of the dtype from float64 (the 16-bit weight gradient
    # of the HF order rounds x_hat as eager does): within twice the file's tolerance.
    tol = 2 * conftest.REL_TOL[dtype]
    for o, r, name in zip(outs, routs, ["out", "y2"]):
        assert_close(o, r, dtype, name, tol=tol)
    for a, r, name in zip(args, rgrads, ["grad x", "grad attn"]):
        assert_close(a.grad, r, dtype, name, tol=tol)
    for p, r, name in zip((module.w1, module.w2), rwgrads, ["grad w1", "grad w2"]):
        assert_close(p.grad, r, dtype, name, tol=tol)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_add_rms_norm_s_unused(dtype):
    # Only y is used: s gets no gradient of its own, dx is the norm's alone (x and residual alike).
    x = randn(4, 9, 1024, dtype=dtype).requires_grad_()
    r = randn(4, 9, 1024, dtype=dtype).requires_grad_()
    w = (randn(1024, dtype=dtype, scale=0.5) + 1).requires_grad_()
    check_jit_matches_eager(lambda x, r, w: op.add_rms_norm(x, r, w, EPS)[1] * 2, [x, r, w], dtype,
                            "kforge_add_rmsnorm_forward", "kforge_add_rmsnorm_backward")
    check_jit_matches_eager(lambda x, r, w: op.add_rms_norm(x, r, w, EPS, cast_before_weight=False),
                            [x, r, w], dtype, "kforge_add_rmsnorm_forward", "kforge_add_rmsnorm_backward")


# ---- add_rms_norm on CPU: checker, fallback, the claim's wiring, launcher errors, NVRTC ---------------------
def test_add_checker(trace_ctx):
    check = _checker(op.kforge_add_rms_norm)
    x, r, w = proxy(8, 4096), proxy(8, 4096), proxy(4096)
    assert check(x, r, w, 1e-6) is None
    assert check(x, r, w, 1e-6, cast_before_weight=False) is None
    assert check(x, r, None, 1e-5) is None
    assert check(proxy(3, 5, 768, dtype=torch.float16), proxy(3, 5, 768, dtype=torch.float16),
                 proxy(768, dtype=torch.float16), 1e-6) is None
    f32 = functools.partial(proxy, dtype=torch.float32)
    assert check(f32(2, 8192), f32(2, 8192), f32(8192), 1e-6) is None
    declines = {
        "not CUDA": check(proxy(8, 64, device="cpu"), proxy(8, 64, device="cpu"), proxy(64, device="cpu"), 1e-6),
        "float64": check(proxy(8, 16, dtype=torch.float64), proxy(8, 16, dtype=torch.float64), None, 1e-6),
        "residual shape (1, 4096) differs": check(x, proxy(1, 4096), w, 1e-6),
        "residual shape (4096,) differs": check(x, proxy(4096), w, 1e-6),
        "residual dtype": check(x, f32(8, 4096), w, 1e-6),
        "residual is on": check(x, proxy(8, 4096, device="cuda:1"), w, 1e-6),
        "residual is float": check(x, 1.0, w, 1e-6),
        "weight dtype": check(x, r, f32(4096), 1e-6),
        "weight shape": check(x, r, proxy(4095), 1e-6),
        "eps is None": check(x, r, w, None),
        "eps must be a Python number": check(x, r, w, True),
        "cast_before_weight must be a bool": check(x, r, w, 1e-6, cast_before_weight=1),
        "longer than": check(proxy(2, 16392), proxy(2, 16392), proxy(16392), 1e-6),
        "longer than the kernels take (8192": check(f32(2, 8196), f32(2, 8196), f32(8196), 1e-6),
        "empty": check(proxy(0, 4096), proxy(0, 4096), w, 1e-6),
        "x is 0-d": check(proxy(()), proxy(()), None, 1e-6),
    }
    for want, got in declines.items():
        assert got is not None and want in got, (want, got)


def test_add_helper_semantics():
    # s is eager's add; y is rms_norm of s (HF order) or F.rms_norm of s (torch order), bit for bit.
    x, r = torch.randn(5, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    w = (torch.randn(64) * 3).bfloat16()
    s, y = op.add_rms_norm(x, r, w, EPS)
    assert torch.equal(s, x + r) and torch.equal(y, op.rms_norm(x + r, w, EPS))
    s, y = op.add_rms_norm(x, r, w, EPS, cast_before_weight=False)
    assert torch.equal(s, x + r) and torch.equal(y, F.rms_norm(x + r, (64,), w, EPS))
    assert not torch.equal(y, op.rms_norm(x + r, w, EPS))  # the two orders round differently
    _, y = op.add_rms_norm(x, r, None, EPS)
    xf = (x + r).float()
    assert torch.equal(y, (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16())


def _jit_add_cpu(fn, *args):
    """thunder.jit(fn) with kforge on CPU tensors: outputs and gradients equal eager's, no kforge rmsnorm
    kernel in the traces; returns the declines."""
    _thunder.reset_declines()
    jargs = [a.detach().clone().requires_grad_() for a in args]
    rargs = [a.detach().clone().requires_grad_() for a in args]
    jf = thunder.jit(fn, executors=[kforge.executor])
    out, ref = jf(*jargs), fn(*rargs)
    gs = [torch.randn_like(o) for o in ref]
    torch.autograd.backward(out, gs)
    torch.autograd.backward(ref, gs)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    for j, r in zip(jargs, rargs):
        torch.testing.assert_close(j.grad, r.grad)
    names = symbol_names(thunder.last_traces(jf)[-1]) | symbol_names(thunder.last_backward_traces(jf)[-1])
    assert not any(n.startswith(("kforge_rmsnorm", "kforge_add_rmsnorm")) for n in names)
    return _thunder.declines()


@pytest.mark.parametrize("cast_before_weight", [True, False], ids=["hf", "torch"])
def test_add_cpu_fallback(cast_before_weight):
    # Declined (CPU tensors): Thunder differentiates the decomposition; both orders match eager.
    x, r, w = torch.randn(3, 7, 40), torch.randn(3, 7, 40), torch.randn(40)
    declines = _jit_add_cpu(lambda x, r, w: op.add_rms_norm(x, r, w, 1e-6, cast_before_weight=cast_before_weight),
                            x, r, w)
    assert any("not CUDA" in reason for reason in declines["kforge_add_rms_norm"])


def test_add_cpu_fallback_without_grad():
    x, r, w = torch.randn(3, 7, 40), torch.randn(3, 7, 40), torch.randn(40)
    for cbw in (True, False):
        jf = thunder.jit(lambda x, r, w: op.add_rms_norm(x, r, w, 1e-6, cast_before_weight=cbw),
                         executors=[kforge.executor])
        with torch.no_grad():
            for a, b in zip(jf(x, r, w), op.add_rms_norm(x, r, w, 1e-6, cast_before_weight=cbw)):
                torch.testing.assert_close(a, b)


def _torch_add_forward(x, residual, weight, eps, nd, cast_before_weight, y_dtype=None):
    """add_rmsnorm_forward's results in torch (CPU stand-in for the kernel): (y, rstd, s)."""
    s = x + residual
    rstd = torch.rsqrt(s.double().pow(2).mean(-1) + eps).float()
    _, y = op.add_rms_norm(x, residual, weight, eps, cast_before_weight=cast_before_weight)
    return (y if y_dtype is None else y.to(y_dtype)), rstd.reshape(-1), s


def _torch_add_backward(seen):
    def backward(dy, ds, s, weight, rstd, nd, cast_before_weight):
        seen.append(ds is None)
        with torch.enable_grad():  # Thunder runs the backward under no_grad
            s_ = s.detach().double().requires_grad_()
            w_ = None if weight is None else weight.detach().double().requires_grad_()
            y = s_ * torch.rsqrt(s_.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 if w_ is None else w_)
            grads = torch.autograd.grad(y, [s_] + ([] if w_ is None else [w_]), dy.double())
        dx = grads[0] + (0 if ds is None else ds.double())
        return dx.to(s.dtype), None if w_ is None else grads[1].to(weight.dtype)
    return backward


@pytest.fixture
def add_reference_launchers(monkeypatch):
    seen = []
    swap_launchers(monkeypatch, op, {op.add_rmsnorm_forward: _torch_add_forward,
                                     op.add_rmsnorm_backward: _torch_add_backward(seen)})
    return seen


@pytest.mark.parametrize("cast_before_weight", [True, False], ids=["hf", "torch"])
def test_add_claim_wiring_with_reference_launchers(add_reference_launchers, cast_before_weight):
    # The claim's metas, execution and grad transforms run for real on CPU (the kernels swapped for
    # torch): the forward saves s, weight, rstd; the backward gives x and residual the same gradient,
    # the norm's plus s's own from its other consumer (the second add_rms_norm reads s).
    D = 24

    def fn(x, attn, w1, w2):
        h, y = op.add_rms_norm(x, attn, w1, 1e-6, cast_before_weight=cast_before_weight)
        out, y2 = op.add_rms_norm(h, y.sin(), w2, 1e-6, cast_before_weight=cast_before_weight)
        return out, y2

    # fp32: the HF helper computes in fp32 whatever the input dtype; the stand-ins in float64.
    args = [torch.randn(3, 5, D), torch.randn(3, 5, D), torch.randn(D) + 1, torch.randn(D) + 1]
    jargs = [a.clone().requires_grad_() for a in args]
    rargs = [a.clone().requires_grad_() for a in args]
    jf = thunder.jit(fn, executors=[kforge.executor])
    out, ref = jf(*jargs), fn(*rargs)
    gs = [torch.randn_like(o) for o in ref]
    torch.autograd.backward(out, gs)
    torch.autograd.backward(ref, gs)
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert "kforge_add_rmsnorm_forward" in symbol_names(fwd)
    assert "kforge_add_rmsnorm_backward" in symbol_names(bwd)
    assert "add" not in symbol_names(fwd)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r)
    for j, r in zip(jargs, rargs):
        torch.testing.assert_close(j.grad, r.grad)
    # The first norm's s is read by the second add: its gradient arrives (not None). The second's s
    # is an output: its gradient is the output's.
    assert add_reference_launchers == [False, False]
    # Saved for backward: s, weight and rstd, never x or residual.
    saved = {p.name for p in fwd.output[1][0] if hasattr(p, "name")}
    assert not {a.name for a in fwd.args[:2]} & saved, saved
    assert {"w1", "w2"} <= saved


def test_add_claim_wiring_s_unused(add_reference_launchers):
    # Only y is used: s gets no gradient of its own (Thunder 0.2.6 passes zeros; None is taken too);
    # dx is then the norm's alone.
    x, r, w = torch.randn(4, 16), torch.randn(4, 16), torch.randn(16)
    jargs = [a.clone().requires_grad_() for a in (x, r, w)]
    rargs = [a.clone().requires_grad_() for a in (x, r, w)]
    fn = lambda x, r, w: op.add_rms_norm(x, r, w, 1e-6)[1].cos()  # noqa: E731
    jf = thunder.jit(fn, executors=[kforge.executor])
    jf(*jargs).sum().backward()
    fn(*rargs).sum().backward()
    assert "kforge_add_rmsnorm_backward" in symbol_names(thunder.last_backward_traces(jf)[-1])
    assert len(add_reference_launchers) == 1
    for j, rr in zip(jargs, rargs):
        torch.testing.assert_close(j.grad, rr.grad)


def test_add_launcher_rejects_cpu_tensors():
    with pytest.raises(kforge.KforgeError, match="add_rmsnorm_forward: x must be a CUDA tensor"):
        kforge._C.add_rmsnorm_forward(torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), EPS)
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.rmsnorm_backward(torch.randn(2, 8), torch.randn(2, 8), None, torch.randn(2),
                                   dresidual=torch.randn(2, 8))


# Every kernel family instantiated with the fused residual (RES), per the launcher's tables.
RES_FAMILIES = {"rmsnorm_forward_kernel": 4 * 2 * 3, "rmsnorm_backward_kernel": 6 + 12 * 2,
                "rmsnorm_backward_pipelined_kernel": 2 + 4 * 2, "rmsnorm_backward_ring_kernel": 2 * (1 + 2 * 2)}


def _res_expressions():
    exprs = kforge._C.name_expressions("rmsnorm")
    return [e for e in exprs if e.endswith(", true>") and e.count(",") >= 3
            and not (e.startswith("rmsnorm_forward_kernel") and e.count(",") == 2)
            and (not e.startswith(("rmsnorm_backward_kernel", "rmsnorm_backward_pipelined")) or e.count(",") == 6)
            and (not e.startswith("rmsnorm_backward_ring") or e.count(",") == 5)]


def test_residual_kernels_are_instantiated():
    exprs = _res_expressions()
    for family, n in RES_FAMILIES.items():
        got = [e for e in exprs if e.startswith(family + "<")]
        assert len(got) == n, (family, got)
    assert len(exprs) == sum(RES_FAMILIES.values())


@pytest.mark.parametrize("arch", [80, 90])
def test_residual_kernels_compile(arch, tmp_path):
    # NVRTC on CPU: every RES instantiation of the launcher's tables compiles for sm_80 and sm_90.
    exprs = _res_expressions()
    kforge._C.set_cache(str(tmp_path), False)
    try:
        names = kforge._C.compile_source("rmsnorm", kforge._runtime.kernel_dir(), exprs, arch)
        assert len(names) == len(exprs) and len(set(names)) == len(exprs)
    finally:
        kforge._C.set_cache(kforge.cache_dir(), kforge._runtime.disk_cache_enabled())


# ---- property-based (hypothesis) ----------------------------------------------------------------
# Row lengths D around the launcher's switch points (src/ops/rmsnorm.cpp): 16-byte chunks (D a multiple
# of V = 4 fp32 / 8 16-bit) or not, the ring's limit of 1024 chunks, the longest rows (2048 chunks),
# small odd rows.
def _rms_D(V: int):
    return st.one_of(st.integers(1, 40), st.sampled_from([32 * V, 256 * V, 1024 * V, 2048 * V]).flatmap(
        lambda e: st.integers(e - 3, e)), st.sampled_from([1024 * V + 1, 1024 * V + V]))


@gpu
@pytest.mark.sanitize
@pytest.mark.sanitize_race
@settings(max_examples=30)
@given(data=st.data(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       rows=st.sampled_from([1, 3, 37, 300]), cast_before_weight=st.booleans(), variant=st.sampled_from([0, 1, 2]),
       weight=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_property_matches_float64(data, dtype, rows, cast_before_weight, variant, weight, strided, seed):
    """Generated rows (lengths around every switch point), dtypes, weight or none, both casts, both
    variants and strided inputs: check() (forward y, rstd; backward dx, dweight against float64)."""
    D = data.draw(_rms_D(16 // torch.tensor([], dtype=dtype).element_size()), label="D")
    x = randn(rows, D, dtype=dtype, seed=seed)
    if strided:  # padded rows: the launcher copies the view
        x = torch.empty(rows, D + 3, dtype=dtype, device="cuda")[:, :D].copy_(x)
    w = randn(D, dtype=dtype, scale=0.5, seed=seed + 1) + 1 if weight else None
    check(x, w, randn(rows, D, dtype=dtype, seed=seed + 2), cast_before_weight, what=f"({rows}, {D})", variant=variant)


# ---- checker property (hypothesis) ---------------------------------------------------------------------
_ANY_DTYPE = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
# Rows of 2048 16-byte chunks are the launchers' longest: 8192 fp32 / 16384 16-bit elements.
_RMS_DIM = st.one_of(st.integers(0, 5), st.sampled_from([8192, 8193, 16384, 16385]))


@settings(max_examples=200)
@given(shape=st.lists(_RMS_DIM, min_size=0, max_size=3).map(tuple), dtype=_ANY_DTYPE,
       device=st.sampled_from(["cuda", "cpu"]), nd=st.integers(-1, 3),
       w=st.sampled_from(["none", "ok", "short", "dtype", "cpu"]),
       eps=st.sampled_from([1e-6, 0.0, None, 1, True, "1e-5", float("nan")]), helper=st.booleans())
def test_checker_never_accepts_what_the_kernel_cannot_do(shape, dtype, device, nd, w, eps, helper):
    """Generated proxies, normalized shapes (trailing or not), weights and eps values, for the
    torch.nn.functional.rms_norm claim and the model helper's (`helper`: last dim, weight required):
    whatever the checker accepts, rmsnorm_forward / rmsnorm_backward take it (CUDA, float dtype, a
    trailing normalized shape of D in [1, 2048 * 16 / itemsize] elements, weight of that shape and x's
    dtype and device) and eps is a number or None (the helper: a number). Fails if a rule goes (a row
    of 8193 fp32 elements accepted would make the launcher raise "too long")."""
    normalized = shape[len(shape) - nd:] if 0 < nd <= len(shape) else (shape[-1] + 1,) if shape and nd == -1 else ()
    if helper:
        normalized = shape[-1:]
    wshape = {"short": (*normalized[:-1], normalized[-1] + 1) if normalized else (1,)}.get(w, normalized)
    with tracectx(TraceCtx()):
        x = conftest.proxy(shape, dtype=dtype, device=device)
        weight = None if w == "none" else conftest.proxy(
            wshape, dtype=torch.float64 if w == "dtype" else dtype, device="cpu" if w == "cpu" else device)
        if helper:
            if op._check_rms_norm(x, weight, eps) is not None:
                return
        elif op._check_f_rms_norm(x, normalized, weight, eps) is not None:
            return
    assert device == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16)
    assert 1 <= len(normalized) <= len(shape) and tuple(shape[len(shape) - len(normalized):]) == tuple(normalized)
    D = math.prod(normalized)
    assert 1 <= D <= 2048 * 16 // dtype.itemsize and 0 not in shape
    assert w in ("none", "ok") and not (helper and w == "none")
    assert (eps is None and not helper) or (isinstance(eps, (int, float)) and not isinstance(eps, bool))


# ---- every instantiation, at the smallest input that picks it ---------------------------------------
_PLAN_DTYPES = {str(t).removeprefix("torch."): (t, name) for t, name in conftest.KERNEL_TYPE.items()}
# Row lengths around every plan switch (chunks per thread, warp / block, ring shapes, the longest rows).
_PLAN_D = sorted({*range(1, 41), *(b + d for b in (64, 128, 256, 512, 768, 1024, 2048, 4096, 8192)
                                   for d in (-1, 0, 1)), 2056, 4100, 6000, 12288, 16384})


@functools.lru_cache(maxsize=None)
def smallest_case_per_kernel() -> dict:
    """{name expression: (op, rows, D, dtype name, aligned, cast_before_weight, dresidual or y's dtype
    name, variant)}:
    for every instantiation the launchers' plans can pick (kforge._C.plan, host arithmetic: no GPU),
    the smallest input that picks it. rmsnorm_dweight_kernel<T, D % 4 == 0> runs after every
    backward outside the ring when there is a weight."""
    found: dict = {}

    def keep(name, case):
        if name not in found or case[1] * case[2] < found[name][1] * found[name][2]:
            found[name] = case

    for (dt, (_, tname)), D, rows, aligned, cbw in itertools.product(
            _PLAN_DTYPES.items(), _PLAN_D, (1, 3, 64), (True, False), (True, False)):
        shape = [rows, D]
        if D * _PLAN_DTYPES[dt][0].itemsize > 2048 * 16:  # longer than any kernel takes
            continue
        for opname in ("rmsnorm_forward", "add_rmsnorm_forward"):
            p = kforge._C.plan(opname, shape, dt, aligned=aligned, cast_before_weight=cbw)
            keep(p["kernel"].replace("{T}", tname), (opname, rows, D, dt, aligned, cbw, False, 0))
        if dt == "float32":  # autocast's fp32 stream: the case's `res` slot names the 16-bit types
            for y in ("bfloat16", "float16"):
                p = kforge._C.plan("rmsnorm_forward", shape, dt, aligned=aligned, cast_before_weight=cbw, y_dtype=y)
                keep(p["kernel"], ("rmsnorm_forward", rows, D, dt, aligned, cbw, y, 0))
                for y_dtype in (None, y):  # a 16-bit x added to the fp32 residual; y fp32 or x's type
                    p = kforge._C.plan("add_rmsnorm_forward", shape, dt, aligned=aligned, cast_before_weight=cbw,
                                       x_dtype=y, y_dtype=y_dtype)
                    keep(p["kernel"], ("add_rmsnorm_forward", rows, D, dt, aligned, cbw, (y, y_dtype), 0))
        for res, variant in itertools.product((False, True), range(3)):
            p = kforge._C.plan("rmsnorm_backward", shape, dt, aligned=aligned, cast_before_weight=cbw,
                               dresidual=res, variant=variant)
            case = ("rmsnorm_backward", rows, D, dt, aligned, cbw, res, variant)
            keep(p["kernel"].replace("{T}", tname), case)
            if p["layout"] != "ring":
                keep(f"rmsnorm_dweight_kernel<{tname}, {'true' if D % 4 == 0 else 'false'}>", case)
            if dt == "float32":  # with a 16-bit copy of dx: the case's `res` slot is ("copy", type, res)
                for copy in ("bfloat16", "float16"):
                    p = kforge._C.plan("rmsnorm_backward", shape, dt, aligned=aligned, cast_before_weight=cbw,
                                       dresidual=res, variant=variant, copy_dtype=copy)
                    keep(p["kernel"].replace("{T}", tname),
                         ("rmsnorm_backward", rows, D, dt, aligned, cbw, ("copy", copy, res), variant))
                # dy as 16-bit terms (rmsnorm_backward_sum): ("terms", n, type, copy type or None, res)
                for n, ty in itertools.product((2, 3), ("bfloat16", "float16")):
                    for copy in (None, ty):
                        p = kforge._C.plan("rmsnorm_backward", shape, dt, aligned=aligned, cast_before_weight=cbw,
                                           dresidual=res, variant=variant, copy_dtype=copy, dy_terms=n, dy_dtype=ty)
                        if "dy_sum" not in p:  # summed by torch first: the plain kernels, counted above
                            keep(p["kernel"].replace("{T}", tname),
                                 ("rmsnorm_backward", rows, D, dt, aligned, cbw, ("terms", n, ty, copy, res), variant))
    return found


def test_every_instantiation_is_picked_by_some_plan():
    """CPU: each of rmsnorm.cu's name expressions is the plan's choice for some input (under a
    testing variant at least), so the sanitizer runs and the test below can reach it. An
    instantiation no plan picks is dead weight in every NVRTC compile."""
    exprs = {e for p, e, _ in kforge._C.kernel_coverage() if p == "rmsnorm"}
    found = smallest_case_per_kernel()
    assert set(found) <= exprs, sorted(set(found) - exprs)
    assert exprs <= set(found), sorted(exprs - set(found))
    assert max(c[1] * c[2] for c in found.values()) <= 16384  # small enough for the sanitizers


def _instantiation_cases():
    try:
        return sorted(smallest_case_per_kernel().items())
    except Exception:  # collection must not fail where the extension cannot load; the test above reports it
        return []


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("expr,case", _instantiation_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_instantiation_matches_float64(expr, case):
    """Each instantiation at the smallest input its plan picks it for: forward and backward against
    float64 (check / check_add), and the kernel the plan names is the one that launched (a launcher
    dispatching elsewhere than its plan fails here)."""
    opname, rows, D, dt, aligned, cbw, res, variant = case
    dtype = _PLAN_DTYPES[dt][0]

    def laid_out(t):  # one element off 16 bytes: the element-wise paths
        return t if aligned else torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].view(t.shape).copy_(t)

    x, dy = laid_out(randn(rows, D, dtype=dtype, seed=1)), laid_out(randn(rows, D, dtype=dtype, seed=2))
    w = randn(D, dtype=dtype, scale=0.5, seed=3) + 1
    if isinstance(res, tuple) and res[0] == "terms":  # dy as 16-bit terms: the fp32 kernel on their sum
        _, n, ty, copy_dtype, with_res = res
        terms = [laid_out(randn(rows, D, seed=10 + j).to(getattr(torch, ty))) for j in range(n)]
        copy_dtype = copy_dtype and getattr(torch, copy_dtype)
        dres = laid_out(randn(rows, D, seed=5)) if with_res else None
        rstd = kforge._C.rmsnorm_forward(x, w, 1e-5, 1, cbw)[1]
        dx, dw, copy = kforge._C.rmsnorm_backward_sum(terms, x, w, rstd, 1, cbw, dres, copy_dtype)
        dy32 = sum_terms(terms)
        dx32, dw32 = rms_backward(dy32, x, w, rstd, 1, cbw, variant, dresidual=dres)
        assert torch.equal(dx, dx32), expr  # per row the same arithmetic as on the summed dy
        torch.testing.assert_close(dw, dw32, rtol=1e-5, atol=1e-5, msg=expr)  # rows per block may differ
        assert copy is None if copy_dtype is None else torch.equal(copy, dx32.to(copy_dtype)), expr
        check(x, w, dy32, cbw, what=expr, variant=variant)
    elif isinstance(res, tuple) and res[0] == "copy":  # dx's 16-bit copy: the plain kernel's dx, rounded
        copy_dtype, dres = getattr(torch, res[1]), laid_out(randn(rows, D, seed=5)) if res[2] else None
        rstd = kforge._C.rmsnorm_forward(x, w, 1e-5, 1, cbw)[1]
        with override("rmsnorm_backward", variant=variant):
            dx, dw, copy = kforge._C.rmsnorm_backward_copy(dy, x, w, rstd, 1, cbw, dres, copy_dtype)
        dx32, dw32 = rms_backward(dy, x, w, rstd, 1, cbw, variant, dresidual=dres)
        assert torch.equal(dx, dx32) and torch.equal(dw, dw32), expr
        assert copy.dtype == copy_dtype and torch.equal(copy, dx32.to(copy_dtype)), expr
        check_add(x, laid_out(randn(rows, D, seed=4)), w, dy, dres, cbw, what=expr, variant=variant)
    elif isinstance(res, tuple):  # a 16-bit x added to the fp32 residual: the fp32 kernel on the upcast x
        x16, y_dtype = getattr(torch, res[0]), res[1] and getattr(torch, res[1])
        x16 = laid_out(randn(rows, D, seed=1).to(x16))  # one element off 8 bytes when not aligned
        r = laid_out(randn(rows, D, seed=4))
        y, rstd, s = kforge._C.add_rmsnorm_forward(x16, r, w, 1e-5, 1, cbw, y_dtype=y_dtype)
        # the same plan (rows, chunks, vector access): the same reduction order, so the same bits
        y32, rstd32, s32 = kforge._C.add_rmsnorm_forward(laid_out(x16.float()), r, w, 1e-5, 1, cbw)
        assert torch.equal(s, s32) and torch.equal(rstd, rstd32), expr
        assert torch.equal(y, y32 if y_dtype is None else y32.to(y_dtype)), expr
    elif isinstance(res, str):  # rmsnorm_forward's 16-bit y of fp32 x: that type of the fp32 kernel's y
        y_dtype = getattr(torch, res)
        y, rstd = kforge._C.rmsnorm_forward(x, w, 1e-5, 1, cbw, y_dtype=y_dtype)
        y32, rstd32 = kforge._C.rmsnorm_forward(x, w, 1e-5, 1, cbw)
        assert y.dtype == y_dtype and torch.equal(y, y32.to(y_dtype)) and torch.equal(rstd, rstd32), expr
    elif opname == "add_rmsnorm_forward" or res:
        check_add(x, laid_out(randn(rows, D, dtype=dtype, seed=4)), w, dy,
                  laid_out(randn(rows, D, dtype=dtype, seed=5)) if res else None, cbw, what=expr, variant=variant)
    else:
        check(x, w, dy, cbw, what=expr, variant=variant)
    assert expr in conftest.launched("rmsnorm"), f"{expr} did not launch for {case}"


# ---- a 16-bit y of fp32 x (autocast's residual stream; kforge.fusion.norm_epilogues) ------------------
@gpu
@pytest.mark.parametrize("y_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cast_before_weight", [True, False], ids=["hf", "torch"])
@pytest.mark.parametrize("shape", [(8192, 768), (37, 4096), (3, 5, 4100), (17, 6), (1, 8192), (1000, 64), (9, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_forward_stores_a_narrow_y(shape, cast_before_weight, y_dtype):
    """rmsnorm_forward(fp32 x, y_dtype=bf16 / fp16): y is bit for bit the fp32 kernel's y converted by
    torch (one rounding of the same fp32 value), rstd the same; 8-byte stores (D % 4 == 0) and
    element-wise ones (odd D); within the 16-bit type's rounding of float64."""
    x = randn(*shape, seed=3)
    w = 1 + 0.1 * randn(shape[-1], seed=4)
    y, rstd = kforge._C.rmsnorm_forward(x, w, 1e-5, 1, cast_before_weight, y_dtype=y_dtype)
    y32, rstd32 = kforge._C.rmsnorm_forward(x, w, 1e-5, 1, cast_before_weight)
    assert y.dtype == y_dtype and y.shape == x.shape and y.is_contiguous()
    assert torch.equal(y, y32.to(y_dtype)) and torch.equal(rstd, rstd32)
    ref = F.rms_norm(x.double(), (shape[-1],), w.double(), 1e-5)
    assert_close(y, ref.to(y_dtype), y_dtype, "narrow y")


@gpu
def test_forward_narrow_y_misaligned_input_and_bad_requests():
    """A misaligned x (element-wise path) still gives the converted fp32 result; y_dtype for 16-bit x,
    a float64 y or a residual add is refused naming the op."""
    base = randn(65 * 768 + 1, seed=5)
    x = base[1:].view(65, 768)  # 4-byte offset: no 16-byte loads
    w = randn(768, seed=6)
    y, _ = kforge._C.rmsnorm_forward(x, w, 1e-6, 1, False, y_dtype=torch.bfloat16)
    assert torch.equal(y, kforge._C.rmsnorm_forward(x.clone(), w, 1e-6, 1, False)[0].bfloat16())
    with pytest.raises(kforge.KforgeError, match="rmsnorm_forward.*only float32 x"):
        kforge._C.rmsnorm_forward(x.bfloat16(), w.bfloat16(), 1e-6, 1, False, y_dtype=torch.float16)
    with pytest.raises(kforge.KforgeError, match="rmsnorm_forward.*only float32 x"):
        kforge._C.rmsnorm_forward(x, w, 1e-6, 1, False, y_dtype=torch.float64)
    y, _ = kforge._C.rmsnorm_forward(x, w, 1e-6, 1, False, y_dtype=torch.float32)  # x's own type: as before
    assert y.dtype == torch.float32


BWD_NORMS = ("kforge_rmsnorm_backward", "kforge_add_rmsnorm_backward", "kforge_rmsnorm_backward_copy",
             "kforge_rmsnorm_backward_sum")


def test_autocast_norms_store_bf16_themselves():
    """The fake-traced plain Llama under autocast (kforge.jit): every RMSNorm of the fp32 residual
    stream stores bf16 itself (no region converts a norm's output) and, but the first, adds the bf16
    branch to the stream itself; every norm backward but the last one's adds the residual's gradient
    (kforge.fusion.norm_epilogues)."""
    from kforge.zoo import plain_llama

    ft = conftest.fake_cuda_trace(plain_llama.make, jit=kforge.jit, size="micro", batch=2, seq=16, autocast=True)
    names = [b.sym.name for b in ft.forward.bound_symbols]
    norms = [b for b in ft.forward.bound_symbols if b.sym.name in ("kforge_rmsnorm_forward", "kforge_add_rmsnorm_forward")]
    y_dtype = {"kforge_rmsnorm_forward": 5, "kforge_add_rmsnorm_forward": 6}
    assert len(norms) == 3 and all(b.args[y_dtype[b.sym.name]] == torch.bfloat16
                                   and b.output[0].dtype == thunder.dtypes.bfloat16 for b in norms), [str(b) for b in norms]
    # the stream's add of each bf16 branch is in the norm after it (every norm but the first layer's)
    assert names.count("kforge_add_rmsnorm_forward") == 2, names
    for b in norms:
        if b.sym.name == "kforge_add_rmsnorm_forward":
            x, residual = b.args[:2]
            assert x.dtype == thunder.dtypes.bfloat16 and residual.dtype == b.output[2].dtype == thunder.dtypes.float32
    outs = {b.output[0].name for b in norms}
    for b in ft.forward.bound_symbols:
        if b.sym.name.startswith("kforgeFusion"):
            assert not outs & {p.name for p in b.flat_proxy_args}, str(b)
    # In the backward, the stream's gradient, which the branch's bf16 matmul reads too, comes in bf16
    # from the norm backward itself (a copy): every norm backward but the first layer's attention
    # norm's, whose dx only the embedding reads. Every norm's but the last adds the residual's
    # gradient. The layer's two norms read their dy as the bf16 input gradients of the matmuls after
    # them (kforge_rmsnorm_backward_sum: w1 / w3, then q / k / v); the last norm's comes from the
    # lm_head alone (kforge_rmsnorm_backward_copy).
    bwd_norms = [b for b in ft.backward.bound_symbols if b.sym.name in BWD_NORMS]
    names = [b.sym.name for b in bwd_norms]
    assert names == ["kforge_rmsnorm_backward_copy"] + ["kforge_rmsnorm_backward_sum"] * 2, names
    last, ffn, attn = bwd_norms
    assert last.args[6] is None and last.args[7] == torch.bfloat16  # (dy, x, w, rstd, nd, cbw, dres, copy)
    assert last.output[2].dtype == thunder.dtypes.bfloat16
    # (dy0, dy1, dy2, x, weight, rstd, nd, cbw, dresidual, copy_dtype)
    assert ffn.args[2] is None and ffn.args[8] is not None and ffn.args[9] == torch.bfloat16, str(ffn)
    assert ffn.output[2].dtype == thunder.dtypes.bfloat16
    assert attn.args[2] is not None and attn.args[8] is not None and attn.args[9] is None, str(attn)
    for b in (ffn, attn):
        terms = [t for t in b.args[:3] if t is not None]
        assert all(t.dtype == thunder.dtypes.bfloat16 for t in terms) and b.args[3].dtype == thunder.dtypes.float32
        # each term is a matmul's output as it left the matmul (no conversion, add or region between)
        producers = {o.name: c.sym.name for c in ft.backward.bound_symbols for o in c.flat_proxy_outs}
        assert {producers[t.name] for t in terms} == {"kforge_gemm_views"}, [producers[t.name] for t in terms]
    for b in bwd_norms:
        assert b.output[0].dtype == thunder.dtypes.float32
    dxs = {b.output[0].name for b in bwd_norms}
    for b in ft.backward.bound_symbols:
        if b.sym.name.startswith("kforgeFusion"):
            assert not dxs & {p.name for p in b.flat_proxy_args}, str(b)


def test_hf_llama_autocast_norms_store_bf16_themselves():
    """The fake-traced Hugging Face Llama under autocast: every norm stores bf16 itself, the last one
    too (its output reaches the lm_head through a slice, a shallow copy, before autocast's cast), and
    no region reads a norm's output or a norm backward's dx."""
    from kforge.zoo import hf_llama

    ft = conftest.fake_cuda_trace(hf_llama.make, jit=kforge.jit, size="micro", batch=2, seq=16, autocast=True)
    norms = [b for b in ft.forward.bound_symbols if b.sym.name in ("kforge_rmsnorm_forward", "kforge_add_rmsnorm_forward")]
    assert len(norms) == 3 and all(b.output[0].dtype == thunder.dtypes.bfloat16 for b in norms), [str(b) for b in norms]
    bwd_norms = [b for b in ft.backward.bound_symbols if b.sym.name in BWD_NORMS]
    names = [b.sym.name for b in bwd_norms]  # the last norm's copy, then the layer's two, summing their dy
    assert names == ["kforge_rmsnorm_backward_copy"] + ["kforge_rmsnorm_backward_sum"] * 2, [str(b) for b in bwd_norms]
    assert [sum(t is not None for t in b.args[:3]) for b in bwd_norms[1:]] == [2, 3]
    for tr, made in ((ft.forward, {b.output[0].name for b in norms}), (ft.backward, {b.output[0].name for b in bwd_norms})):
        for b in tr.bound_symbols:
            if b.sym.name.startswith("kforgeFusion"):
                assert not made & {p.name for p in b.flat_proxy_args}, str(b)


@gpu
@pytest.mark.parametrize("copy_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dres", [False, True], ids=["plain", "dresidual"])
@pytest.mark.parametrize("variant", [0, 1, 2], ids=lambda v: f"v{v}")
@pytest.mark.parametrize("shape", [(8192, 768), (37, 4096), (3, 5, 4100), (17, 6), (1, 8192), (1000, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_backward_stores_a_16_bit_copy_of_dx(shape, variant, dres, copy_dtype):
    """rmsnorm_backward_copy (fp32 x): dx and dweight bit for bit rmsnorm_backward's under the same plan,
    and the copy bit for bit dx.to(copy_dtype) (one rounding of the same fp32 value), for every kernel
    family (ring, pipelined, row groups; 16-byte and element-wise access)."""
    x, dy = randn(*shape, seed=1), randn(*shape, seed=2)
    w = 1 + 0.1 * randn(shape[-1], seed=3)
    ds = randn(*shape, seed=4) if dres else None
    rstd = kforge._C.rmsnorm_forward(x, w, EPS, 1, True)[1]
    with override("rmsnorm_backward", variant=variant):
        dx, dw, copy = kforge._C.rmsnorm_backward_copy(dy, x, w, rstd, 1, True, ds, copy_dtype)
    dx32, dw32 = rms_backward(dy, x, w, rstd, 1, True, variant, dresidual=ds)
    assert torch.equal(dx, dx32) and torch.equal(dw, dw32)
    assert copy.dtype == copy_dtype and copy.shape == x.shape and copy.is_contiguous()
    assert torch.equal(copy, dx32.to(copy_dtype))


@gpu
def test_backward_copy_misaligned_input_and_bad_requests():
    """A misaligned x (element-wise kernels) still gives dx's rounded copy; a copy of a 16-bit dx, or of
    another type than bf16 / fp16, is refused naming the op."""
    base = randn(65 * 768 + 1, seed=5)
    x, dy, w = base[1:].view(65, 768), randn(65, 768, seed=6), randn(768, seed=7)
    rstd = kforge._C.rmsnorm_forward(x, w, EPS, 1, False)[1]
    dx, dw, copy = kforge._C.rmsnorm_backward_copy(dy, x, w, rstd, 1, False, None, torch.bfloat16)
    assert torch.equal(copy, dx.bfloat16()) and torch.equal(dx, kforge._C.rmsnorm_backward(dy, x, w, rstd, 1, False)[0])
    with pytest.raises(kforge.KforgeError, match="rmsnorm_backward_copy.*only a float32 dx"):
        kforge._C.rmsnorm_backward_copy(dy.bfloat16(), x.bfloat16(), w.bfloat16(), rstd, 1, False, None, torch.float16)
    with pytest.raises(kforge.KforgeError, match="rmsnorm_backward_copy.*only a float32 dx"):
        kforge._C.rmsnorm_backward_copy(dy, x, w, rstd, 1, False, None, torch.float64)


def sum_terms(terms):
    """Eager's sum of upcast 16-bit gradients: ((t0 + t1) + t2) in fp32, shaped as the first."""
    total = terms[0].float()
    for t in terms[1:]:
        total = total + t.float().view(total.shape)
    return total


@gpu
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("term_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("dres", [False, True], ids=["plain", "dresidual"])
@pytest.mark.parametrize("copy", [None, "same", "other"])
@pytest.mark.parametrize("shape", [(8192, 768), (37, 4096), (3, 5, 4100), (17, 6), (1, 8192), (1000, 64), (130, 3, 256)],
                         ids=lambda s: "x".join(map(str, s)))
def test_backward_sums_16_bit_dy_terms(shape, copy, dres, term_dtype, n):
    """rmsnorm_backward_sum (fp32 x, dy the fp32 sum of 2 or 3 upcast 16-bit terms): dx and the copy bit
    for bit rmsnorm_backward_copy's on torch's sum (the ring reads the terms; odd rows, a copy of the
    other 16-bit type and other layouts sum with torch first), dweight within fp32 reassociation (the
    ring may take fewer rows a block with the terms' larger stages); against float64 too (outputs
    start poisoned: conftest)."""
    x = randn(*shape, seed=1)
    w = 1 + 0.1 * randn(shape[-1], seed=3)
    # the terms as matmuls return them: (rows, D) whatever x's shape
    terms = [randn(math.prod(shape[:-1]), shape[-1], seed=10 + j, scale=1.5).to(term_dtype) for j in range(n)]
    ds = randn(*shape, seed=4) if dres else None
    other = torch.float16 if term_dtype == torch.bfloat16 else torch.bfloat16
    copy_dtype = {None: None, "same": term_dtype, "other": other}[copy]
    rstd = kforge._C.rmsnorm_forward(x, w, EPS, 1, True)[1]
    dx, dw, out_copy = kforge._C.rmsnorm_backward_sum(terms, x, w, rstd, 1, True, ds, copy_dtype)
    dy = sum_terms(terms).view(shape)
    dx32, dw32 = rms_backward(dy, x, w, rstd, 1, True, dresidual=ds)
    assert dx.shape == x.shape and torch.equal(dx, dx32)
    torch.testing.assert_close(dw, dw32, rtol=1e-5, atol=1e-4)
    if copy_dtype is None:
        assert out_copy is None
    else:
        assert out_copy.dtype == copy_dtype and torch.equal(out_copy, dx32.to(copy_dtype))
    _, _, rdx, rdw = reference(x, w, EPS, dy, 1)
    if ds is not None:
        rdx = rdx + ds.double()
    assert_close(dx, rdx, torch.float32, "dx", scale=(dy.double() * w.double()).norm().item())
    assert_close(dw, rdw, torch.float32, "dweight")


@gpu
@pytest.mark.sanitize
@pytest.mark.sanitize_race
@settings(max_examples=40)
@given(data=st.data(), rows=st.sampled_from([1, 3, 37, 300, 1031]), n=st.sampled_from([2, 3]),
       term_dtype=st.sampled_from([torch.bfloat16, torch.float16]), dres=st.booleans(),
       copy=st.sampled_from([None, "same", "other"]), weight=st.booleans(), offset=st.sampled_from([0, 0, 1, 4]),
       seed=st.integers(0, 2**31 - 1))
def test_backward_sum_generated(data, rows, n, term_dtype, dres, copy, weight, offset, seed):
    """Generated rows (fp32 lengths around every switch point), 2 / 3 terms of either 16-bit type, with
    or without the residual's gradient, a copy and a weight, and a term offset by 1 or 4 elements (off 8
    bytes: torch's sum; 8 bytes: still the ring): dx and the copy bit for bit the fp32 kernel's on
    torch's sum, dweight within reassociation."""
    D = data.draw(_rms_D(4), label="D")
    x = randn(rows, D, seed=seed)
    w = randn(D, scale=0.5, seed=seed + 1) + 1 if weight else None
    terms = [randn(rows, D, seed=seed + 2 + j).to(term_dtype) for j in range(n)]
    if offset:
        terms[-1] = torch.empty(rows * D + offset, dtype=term_dtype, device="cuda")[offset:].view(rows, D).copy_(terms[-1])
    ds = randn(rows, D, seed=seed + 9) if dres else None
    copy_dtype = {None: None, "same": term_dtype,
                  "other": torch.float16 if term_dtype == torch.bfloat16 else torch.bfloat16}[copy]
    rstd = kforge._C.rmsnorm_forward(x, w, EPS, 1, True)[1]
    dx, dw, out_copy = kforge._C.rmsnorm_backward_sum(terms, x, w, rstd, 1, True, ds, copy_dtype)
    dx32, dw32 = rms_backward(sum_terms(terms), x, w, rstd, 1, True, dresidual=ds)
    assert torch.equal(dx, dx32), f"{rows}x{D}"
    if w is None:
        assert dw is None
    else:
        torch.testing.assert_close(dw, dw32, rtol=1e-5, atol=1e-4)
    assert (out_copy is None) if copy_dtype is None else torch.equal(out_copy, dx32.to(copy_dtype))


@gpu
def test_backward_sum_kernels_and_fallbacks():
    """The ring reads the terms where it applies (the plan's kernel launches); a term off 8 bytes, a
    term of another layout (transposed) and rows the ring does not take are summed by torch first,
    with the same dx; bad requests are refused naming the op."""
    x, w = randn(64, 768, seed=1), randn(768, seed=2)
    rstd = kforge._C.rmsnorm_forward(x, w, EPS, 1, True)[1]
    terms = [randn(64, 768, seed=3 + j).bfloat16() for j in range(3)]
    want = rms_backward(sum_terms(terms), x, w, rstd)[0]
    name = kforge._C.plan("rmsnorm_backward", [64, 768], "float32", dy_terms=3, dy_dtype="bfloat16")["kernel"]
    assert name.endswith(", false, 0, 3, 1>"), name
    assert torch.equal(kforge._C.rmsnorm_backward_sum(terms, x, w, rstd)[0], want)
    assert name.replace("{T}", "float") in conftest.launched("rmsnorm")
    off = torch.empty(64 * 768 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(64, 768).copy_(terms[1])
    assert torch.equal(kforge._C.rmsnorm_backward_sum([terms[0], off, terms[2]], x, w, rstd)[0], want)
    t = terms[2].t().contiguous().t()  # made contiguous by the launcher: the same values
    assert torch.equal(kforge._C.rmsnorm_backward_sum([terms[0], terms[1], t], x, w, rstd)[0], want)
    with pytest.raises(kforge.KforgeError, match="rmsnorm_backward_sum: takes 2 or 3 dy terms"):
        kforge._C.rmsnorm_backward_sum(terms[:1], x, w, rstd)
    with pytest.raises(kforge.KforgeError, match="rmsnorm_backward_sum: dy terms of float16 and bfloat16"):
        kforge._C.rmsnorm_backward_sum([terms[0], terms[1].half()], x, w, rstd)
    with pytest.raises(kforge.KforgeError, match="rmsnorm_backward_sum: x of bfloat16"):
        kforge._C.rmsnorm_backward_sum(terms[:2], x.bfloat16(), w.bfloat16(), rstd)
    with pytest.raises(kforge.KforgeError, match="rmsnorm_backward_sum: a dy term has 48000 elements"):
        kforge._C.rmsnorm_backward_sum([terms[0], terms[1][:, :750]], x, w, rstd)


def test_plan_names_the_dy_terms_kernels():
    """CPU: kforge._C.plan names the NY / YT instantiation for dy_terms, takes fewer rows a block where
    three terms' stages would not fit at 8192 x 768 with the residual's gradient, and says where
    torch sums the terms (a row the ring does not take, a copy of the other 16-bit type)."""
    p = kforge._C.plan("rmsnorm_backward", [8192, 768], "float32", dresidual=True, copy_dtype="bfloat16", dy_terms=3)
    assert p["kernel"] == "rmsnorm_backward_ring_kernel<{T}, 4, 3, false, 384, true, 1, 3, 1>", p
    assert p["block"] == (64, 5, 1) and p["smem"] <= 232448 - 768, p
    p = kforge._C.plan("rmsnorm_backward", [8192, 768], "float32", dresidual=True, dy_terms=2, dy_dtype="float16")
    assert p["kernel"].endswith(", true, 0, 2, 2>") and p["block"] == (64, 6, 1) and "dy_sum" not in p, p
    for kw in (dict(dy_terms=3, copy_dtype="float16"), dict(dy_terms=2, aligned=False)):
        assert kforge._C.plan("rmsnorm_backward", [8192, 768], "float32", **kw)["dy_sum"] == "torch"
    with pytest.raises(ValueError, match="2 or 3 dy terms of a float32 x"):
        kforge._C.plan("rmsnorm_backward", [8192, 768], "bfloat16", dy_terms=2)
    with pytest.raises(ValueError, match="2 or 3 dy terms"):
        kforge._C.plan("rmsnorm_backward", [8192, 768], "float32", dy_terms=4)


def test_plan_names_the_copy_kernels():
    """CPU: kforge._C.plan names the NZ instantiation for copy_dtype and refuses it for a 16-bit dx."""
    p = kforge._C.plan("rmsnorm_backward", [8192, 768], "float32", copy_dtype="bfloat16")
    assert p["kernel"].endswith(", 1>") and p["kernel"].startswith("rmsnorm_backward_ring_kernel<")
    p = kforge._C.plan("rmsnorm_backward", [8192, 768], "float32", copy_dtype="float16", dresidual=True)
    assert p["kernel"].endswith(", true, 2>")
    with pytest.raises(ValueError, match="only a float32 dx"):
        kforge._C.plan("rmsnorm_backward", [8192, 768], "bfloat16", copy_dtype="float16")


@gpu
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(8192, 768), (3, 5, 4100), (17, 6), (1000, 64)], ids=lambda s: "x".join(map(str, s)))
def test_add_of_a_16_bit_x_to_an_fp32_residual(shape, x_dtype):
    """add_rmsnorm_forward(bf16 / fp16 x, fp32 residual): s is eager's `residual + x.float()` bit for
    bit, y (fp32, or x's type) and rstd within fp32 / 16-bit rounding of float64; the gradients of
    the norm on s are those of the fp32 path."""
    x = randn(*shape, dtype=x_dtype, seed=7)
    r = randn(*shape, seed=8)
    w = 1 + 0.1 * randn(shape[-1], seed=9)
    for y_dtype in (None, x_dtype):
        y, rstd, s = kforge._C.add_rmsnorm_forward(x, r, w, 1e-5, 1, False, y_dtype=y_dtype)
        assert s.dtype == torch.float32 and torch.equal(s, r + x.float())
        assert y.dtype == (y_dtype or torch.float32) and rstd.dtype == torch.float32
        ref = F.rms_norm((r.double() + x.double()), (shape[-1],), w.double(), 1e-5)
        assert_close(y, ref.to(y.dtype), y.dtype, f"y ({y_dtype})")
    with pytest.raises(kforge.KforgeError, match="add_rmsnorm_forward.*y_dtype"):
        kforge._C.add_rmsnorm_forward(x, r, w, 1e-5, 1, False,
                                      y_dtype=torch.float16 if x_dtype == torch.bfloat16 else torch.bfloat16)
    with pytest.raises(kforge.KforgeError, match="add_rmsnorm_forward.*y_dtype"):
        kforge._C.add_rmsnorm_forward(x.float(), r, w, 1e-5, 1, False, y_dtype=x_dtype)
    with pytest.raises(kforge.KforgeError, match="residual has dtype"):
        kforge._C.add_rmsnorm_forward(x, r.to(x_dtype).half() if x_dtype == torch.bfloat16 else r.bfloat16(), w, 1e-5)
    with pytest.raises(kforge.KforgeError, match="weight has dtype"):
        kforge._C.add_rmsnorm_forward(x, r, w.to(x_dtype), 1e-5)


# ---- norm_epilogues.sum_norm_grads: which sums become dy terms (CPU, on hand-made traces) -------------
def _sum_trace(build):
    """Bound symbols of a trace made by `build(g, conv, x, w, rstd)` under a tracectx, where g are four
    bf16 (64, 768) proxies and conv(t) records an upcast to float32; build returns dy, and the trace
    ends with kforge_rmsnorm_backward(dy, x, w, rstd)."""
    import thunder.core.devices as devices
    from thunder.core import dtypes, prims
    from thunder.core.proxies import TensorProxy

    trc = TraceCtx()
    dev = devices.Device("cuda:0")
    with tracectx(trc):
        def proxy(shape, dtype):
            return TensorProxy(shape=shape, device=dev, dtype=dtype, requires_grad=False)

        g = [proxy((64, 768), dtypes.bfloat16) for _ in range(4)]
        x, w, rstd = proxy((4, 16, 768), dtypes.float32), proxy((768,), dtypes.float32), proxy((64,), dtypes.float32)
        dy = build(g, lambda t: prims.convert_element_type(t, dtypes.float32), x, w, rstd)
        op.rmsnorm_backward(dy, x, w, rstd, 1, True)
    return trc.bound_symbols, g


@pytest.mark.parametrize("form,want", [
    ("left", [0, 1, 2]),          # (g0 + g1) + g2
    ("right", [1, 2, 0]),         # g0 + (g1 + g2) = (g1 + g2) + g0: the same fp32 adds
    ("two", [0, 1]),
    ("reshaped", [0, 1, 2]),      # each term reshaped to x's shape before its upcast
    ("four", None),               # (g0 + g1) + (g2 + g3): no left fold of three or fewer
    ("shared-upcast", None),      # an upcast read by something else too
    ("one", None),                # a single term: nothing to sum
    ("fp32-term", None),          # a term already float32
])
def test_sum_norm_grads_takes_left_folds_of_upcast_16_bit_terms(form, want):
    """kforge.fusion.norm_epilogues.sum_norm_grads: a norm backward whose dy is the fp32 sum of two or
    three upcast 16-bit tensors becomes kforge_rmsnorm_backward_sum with the terms in an order whose
    left fold adds exactly as the trace did; near misses keep the trace as it was."""
    import thunder.torch as ltorch
    from thunder.core import prims

    from kforge.fusion.norm_epilogues import sum_norm_grads

    def build(g, conv, x, w, rstd):
        if form == "left":
            return ltorch.add(ltorch.add(conv(g[0]), conv(g[1])), conv(g[2]))
        if form == "right":
            return ltorch.add(conv(g[0]), ltorch.add(conv(g[1]), conv(g[2])))
        if form == "two":
            return ltorch.add(conv(g[0]), conv(g[1]))
        if form == "reshaped":
            r = [conv(prims.reshape(t, (4, 16, 768))) for t in g[:3]]
            return ltorch.add(ltorch.add(r[0], r[1]), r[2])
        if form == "four":
            return ltorch.add(ltorch.add(conv(g[0]), conv(g[1])), ltorch.add(conv(g[2]), conv(g[3])))
        if form == "shared-upcast":
            c = conv(g[1])
            ltorch.mul(c, 2.0)
            return ltorch.add(conv(g[0]), c)
        if form == "one":
            return conv(g[0])
        return ltorch.add(conv(g[0]), conv(conv(g[1])))  # fp32-term: an upcast of an fp32 tensor

    bsyms, g = _sum_trace(build)
    out, removed = sum_norm_grads(bsyms)
    sums = [b for b in out if b.sym.name == "kforge_rmsnorm_backward_sum"]
    if want is None:
        assert not sums and removed == 0 and len(out) == len(bsyms)
        return
    assert len(sums) == 1, [b.sym.name for b in out]
    terms = [t.name for t in sums[0].args[:3] if t is not None]
    assert terms == [g[i].name for i in want]
    # nothing of the sum is left: no add, no conversion, no reshape of a term
    assert all(b.sym.name in ("kforge_rmsnorm_backward_sum",) for b in out), [b.sym.name for b in out]
    assert sums[0].output[0].name == [b for b in bsyms if b.sym.name == "kforge_rmsnorm_backward"][0].output[0].name


def test_no_zero_residual_gradient_is_made():
    """The fake-traced bf16 plain Llama: the last add_rms_norm's s is read by nothing else, so Thunder
    gives it a zero gradient; the norm backward takes None instead (kforge.fusion.norm_epilogues.
    drop_zero_dresiduals): no zeros are written, and the kernel reads no dres."""
    from kforge.zoo import plain_llama

    ft = conftest.fake_cuda_trace(plain_llama.make, jit=kforge.jit, size="micro", batch=2, seq=16)
    made = [s.sym.name for b in ft.backward.bound_symbols
            for s in (b.subsymbols if b.sym.name.startswith("kforgeFusion") else [b])]
    assert not {"zeros", "full", "full_like"} & set(made), made
    norms = [b for b in ft.backward.bound_symbols if b.sym.name == "kforge_add_rmsnorm_backward"]
    assert [b.args[1] is None for b in norms] == [True] + [False] * (len(norms) - 1), [str(b) for b in norms]
