"""rmsnorm: Hugging Face Llama RMSNorm and F.rms_norm on kforge's kernels.

GPU: forward (y, rstd) and backward (dx, dweight) against float64 references, both rounding
conventions, odd / misaligned / strided inputs, deterministic dweight, side streams and CUDA graphs,
thunder.jit traces.
CPU: checker declines with reasons, thunder.jit falling back to the helper's decomposition, launcher
errors, scripts/ring_timeline.py's patched kernel.
"""
from __future__ import annotations

import functools
import importlib.util
import pathlib
import shutil

import pytest
import torch
import torch.nn.functional as F
import thunder

import kforge
from kforge import _thunder
from kforge.ops import rmsnorm as op
import conftest
from conftest import DTYPES, assert_close, check_jit_matches_eager, gpu, randn, symbol_names

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


def check(x, weight, dy, cast_before_weight, nd=1, what="", variant=0):
    dtype = x.dtype
    what = f"{what} variant {variant}"
    y, rstd = kforge._C.rmsnorm_forward(x, weight, EPS, nd, cast_before_weight)
    dx, dw = kforge._C.rmsnorm_backward(dy, x, weight, rstd, nd, cast_before_weight, variant)
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
# Backward kernels (the launcher's `variant`): 0 the default (the ring where it applies, then
# rmsnorm_dweight_kernel), 1 the kernels for what the ring does not take.
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
    runs = [kforge._C.rmsnorm_backward(dy, x, w, rstd, variant=variant) for _ in range(3)]
    assert all(torch.equal(runs[0][1], r[1]) and torch.equal(runs[0][0], r[0]) for r in runs[1:])


@gpu
@variants
def test_side_stream_and_cuda_graph_capture(variant):
    """The dweight reduction is a dependent launch: the same bits on a side stream right after other
    work, and replayed from a CUDA graph after dy changes."""
    x, dy = randn(3000, 4096, dtype=torch.bfloat16), randn(3000, 4096, dtype=torch.bfloat16)
    w = randn(4096, dtype=torch.bfloat16, scale=0.5) + 1
    _, rstd = kforge._C.rmsnorm_forward(x, w, EPS)
    expected = kforge._C.rmsnorm_backward(dy, x, w, rstd, variant=variant)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dy2 = dy * 2  # a kernel right before the backward on the same stream
        side = [kforge._C.rmsnorm_backward(dy2, x, w, rstd, variant=variant) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(s)
    again = kforge._C.rmsnorm_backward(dy2, x, w, rstd, variant=variant)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kforge._C.rmsnorm_backward(dy, x, w, rstd, variant=variant)
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
def test_helper_checker(trace_ctx):
    check_helper, check_f = (c.checker for c in op.SPEC.claims)
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
    _, check_f = (c.checker for c in op.SPEC.claims)
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
    for v in (-1, 2):
        with pytest.raises(kforge.KforgeError, match=r"variant must be in \[0, 1\]"):
            kforge._C.rmsnorm_backward(torch.randn(2, 8), torch.randn(2, 8), None, torch.randn(2),
                                       variant=v)


def test_ring_timeline_probe_still_patches_and_compiles(tmp_path):
    # scripts/ring_timeline.py finds its places in the ring kernel by anchor text: they still match,
    # and the patched kernel compiles (NVRTC, sm_90), so the probe does not rot when the kernel changes.
    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "ring_timeline.py"
    spec = importlib.util.spec_from_file_location("ring_timeline", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    patched = probe.patched_kernel_dir()
    kforge._C.set_cache(str(tmp_path), False)
    try:
        src = pathlib.Path(patched, "rmsnorm.cu").read_text()
        assert src.count("%%globaltimer") == 4
        names = kforge._C.compile_source("rmsnorm", patched,
                                         ["rmsnorm_backward_ring_kernel<bf16, 4, 3, true, 384>"], 90)
        assert len(names) == 1
    finally:
        kforge._C.set_cache(kforge.cache_dir(), kforge._runtime.disk_cache_enabled())
        shutil.rmtree(patched)


def test_ring_dynamic_probe_still_patches_and_compiles(tmp_path):
    # scripts/ring_dynamic_probe.py (docs/experiments/rmsnorm.md, 5d12b31) replaces the ring kernel's row loop
    # by anchor text: the anchors still match and both patched kernels compile (NVRTC, sm_90).
    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "ring_dynamic_probe.py"
    spec = importlib.util.spec_from_file_location("ring_dynamic_probe", path)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    dynamic, static = probe.write(tmp_path / "probe")
    assert "atomicAdd(&kf_dyn_next" in (dynamic / "rmsnorm.cu").read_text()
    assert "atomicAdd(&kf_dyn_next" not in (static / "rmsnorm.cu").read_text()
    kforge._C.set_cache(str(tmp_path / "cache"), False)
    try:
        for d in (dynamic, static):
            names = kforge._C.compile_source("rmsnorm", str(d),
                                             ["rmsnorm_backward_ring_kernel<bf16, 4, 3, true, 384>"], 90)
            assert len(names) == 1
    finally:
        kforge._C.set_cache(kforge.cache_dir(), kforge._runtime.disk_cache_enabled())
