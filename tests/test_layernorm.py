"""layernorm: launchers against a float64 reference (forward, dx, dweight, dbias), the layouts the
launcher picks (16-byte / scalar, registers / re-read), determinism, and the Thunder claim.

CPU tests: the checker's decline reasons, the fallback to torch on CPU tensors, and the Thunder
plumbing (metas, grad transform) with the launchers swapped for a torch reference.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import thunder
from thunder.core.trace import TraceCtx, tracectx

import kforge
from conftest import DTYPES, assert_close, gpu, proxy, randn, swap_launchers
from kforge import _thunder
from kforge.ops import layernorm as ln

EPS = 1e-5
AFFINE = ["weight+bias", "weight", "bias", "none"]


def make_inputs(shape, dtype, affine="weight+bias", device="cuda"):
    """x with a non-zero mean (exercises the two-pass variance), weight near 1, small bias, dout."""
    c = shape[-1]
    x = (randn(*shape, device=device) * 2 + 0.3).to(dtype)
    w = (1 + 0.5 * randn(c, device=device)).to(dtype) if "weight" in affine else None
    b = (0.5 * randn(c, device=device)).to(dtype) if "bias" in affine else None
    dout = randn(*shape, dtype=dtype, device=device)
    return x, w, b, dout


def reference(x, w, b, dout):
    """float64 forward output, mean, rstd and gradients from the same (rounded) inputs."""
    c = x.shape[-1]
    x64 = x.detach().double().requires_grad_(True)
    w64 = None if w is None else w.detach().double().requires_grad_(True)
    b64 = None if b is None else b.detach().double().requires_grad_(True)
    out = F.layer_norm(x64, (c,), w64, b64, EPS)
    out.backward(dout.double())
    rows = x64.detach().reshape(-1, c)
    mean = rows.mean(-1)
    rstd = (rows.var(-1, unbiased=False) + EPS).rsqrt()
    grad = lambda t: None if t is None else t.grad  # noqa: E731
    return out.detach(), mean, rstd, x64.grad, grad(w64), grad(b64)


def check_against_reference(x, w, b, dout, dtype, fwd_variant=0, bwd_variant=0):
    out, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS, variant=fwd_variant)
    dx, dw, db = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, variant=bwd_variant)
    r_out, r_mean, r_rstd, r_dx, r_dw, r_db = reference(x, w, b, dout)
    n = x.numel() // x.shape[-1]
    assert out.dtype == dtype and mean.dtype == rstd.dtype == torch.float32
    assert mean.shape == rstd.shape == (n,)
    assert_close(out, r_out, dtype, "out")
    # The stats are fp32 whatever the input dtype.
    assert_close(mean, r_mean, torch.float32, "mean")
    assert_close(rstd, r_rstd, torch.float32, "rstd")
    # dx = rstd (g - mean(g) - x_hat mean(g x_hat)), g = dout * w: over a few columns the terms
    # cancel, so its error is relative to them (see assert_close).
    g = dout.double() * (1.0 if w is None else w.double())
    assert_close(dx, r_dx, dtype, "dx", scale=(g * r_rstd.reshape(*x.shape[:-1], 1)).norm().item())
    assert (dw is None) == (w is None) and (db is None) == (b is None)
    if w is not None:
        assert dw.dtype == w.dtype
        assert_close(dw, r_dw, dtype, "dweight")
    if b is not None:
        assert db.dtype == b.dtype
        assert_close(db, r_db, dtype, "dbias")


# Shapes pick every layout and instantiation. Variant 0 (the backward default; the forward default,
# 2, runs it for fp32): GROUP layout for rows up to 2048 (bf16) / 1024 (fp32, scalar) columns
# forward and 1024 backward: a row over tpr = 32 NW threads at 8 columns a thread (bf16 16-byte
# units: C / 8 threads, fp32: C / 8, scalar: C / 8 rounded up to 32); forward groups take 2 rows at once (bf16 / half vec) or 1, backward 1 (variant 2: 2 rows for
# bf16 / half, prefetching fp32). NW per shape (bf16 / fp32): (64, 128): 1 (half the threads idle) /
# 1; (5, 100): scalar 1 / 1; (33, 256): 1 / 1; (40, 300): scalar 2 / 2 (threads with one of two fp32
# units); (33, 384): 2 / 2 (odd N: last forward chunk of 2 rows partial); (48, 512): 2 / 2; (20, 640):
# 3 (partial warp) / 3; (1, 768), (8, 768), (8192, 768): 3 / 3 (N=1: one live row of a chunk);
# (16, 1000): 4 / 4; (4096, 1024): 4 / 4; scalar (8 elements a thread) (7, 3): 1, 771: 4;
# forward only (backward BLOCK): bf16 (24, 1536): 6, (12, 2048): 8, (10, 1600): 7.
# Groups looping over several chunks (more chunks than groups, the last round partial): (8192, 768),
# (20000, 768), (4096, 1024), (2000, 771), (3000, 256), (3000, 100). test_max_warps_knob: 1 to 4 groups
# of 3 warps per SM. Variant 3 also takes (24, 1536), (12, 2048), (10, 1600), 4100 / 4099 (NW 17: one
# group per block) backward in the GROUP layout.
# Variant 1 (the previous kernels), WARP layout (one warp per row), fp32 / bf16 units per lane:
#   (64, 128): P=2 / P=2 (bf16: half the lanes idle; 64 rows: last chunk of 3 rows partial);
#   (5, 100): 2 (partial chunks fwd and bwd) / scalar P=32; (33, 256): 2 / 2; (40, 300): 3 (last
#   unit partial) / scalar; (33, 384): 3 (odd N: last chunk of 2 partial) / 2; (48, 512): 4 / 2;
#   (20, 640): 6 (partial) / 3 (partial); (1, 768): 6 / 3 (N=1: one chunk, 1 of 2 rows live);
#   (16, 1000): 8 / 4; (4096, 1024): 8 / 4; (7, 3), 771: scalar P=32.
#   Forward only (the backward takes the BLOCK layout: more than 32 columns a lane): bf16
#   (24, 1536): P=6, (12, 2048): P=8, (10, 1600): P=8 (partial); fp32 takes BLOCK for those.
# BLOCK layout: 4100 (fp32: 16-byte re-read; bf16: scalar re-read), 4099 (scalar re-read), 20000
#   (16-byte re-read); N=300 loops several row groups per block in backward.
# N=1 and 3-D inputs too. AFFINE covers dweight and dbias together, alone, and neither (the
# backward then keeps no column sums at all).
# Backward variants 4..7, RING layout (16-byte units only; tpr = 32 * ceil(C / V / P / 32) threads
# a row, G groups a block; the rows split into contiguous ranges of q or q + 1 per group):
#   bf16 / half P=1 (v4 S=8, v5 S=4) NW: 768: 3 (G=8 at 8192 rows: 7 or 8 rows a group, S=4
#   keeps half of them in slots, refilled), (20000, 768): 19 rows a group, the ring wraps; (1, 768), (8, 768),
#   (2, 5, 768): rows < grid, one group a block); 1000: 4;
#   1024: 4; 1536: 6 and 2048: 8 (more than 4 warps: the looped cross-warp sum); 1600: 7; 4096:
#   16 (G=1 at S=8); 128 / 256: 1 (one warp a row, shuffles only; 128 bf16: half the lanes idle);
#   384: 2; 512: 2; 640: 3 (partial warp).
#   bf16 / half P=3 (v6 S=4, v7 S=8): 768: 1 (warp per row, slot re-read); 1600: 3 (units of a
#   thread partly missing); 4096: 6; 20000 (v7): 27 warps > 16: falls back.
#   fp32 P=2 (v4 S=4, v5 S=8): 768: 3; 1000: 4; 4100: 17 (v4: G=1; v5: slots over the shared memory:
#   falls back); 100: 1, 300: 2 (partial warps). fp32 P=6 (v6 S=4, v7 S=2): 768: 1;
#   4096 / 4100: 6; 20000: 27 > 16 warps: falls back.
#   Fall back to variant 0's kernels: 771, 4099, (7, 3), misaligned / strided views; bf16 100, 300,
#   4100 (C % 8 != 0). The 16-byte parameter-gradient reduce runs where 2C % 4 == 0 (and after the
#   fallbacks), the previous one otherwise (771, 4099, 3).
SHAPES = [(8, 768), (1, 768), (2, 5, 768), (16, 1000), (1000, 771), (7, 3), (3, 4100), (300, 4100),
          (2, 4099), (4, 20000), (8192, 768), (64, 128), (33, 256), (40, 300), (33, 384), (48, 512),
          (20, 640), (4096, 1024), (5, 100), (24, 1536), (12, 2048), (10, 1600), (3000, 256),
          (3000, 100), (2000, 771), (20000, 768), (16, 4096), (300, 4096), (100, 1600)]
# (forward variant, backward variant) pairs besides the default (0, 0); see the bindings' docstrings.
VARIANTS = [(1, 1), (2, 2), (0, 3), (0, 4), (0, 5), (0, 6), (0, 7)]


@gpu
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_matches_float64_reference(dtype, shape, affine):
    check_against_reference(*make_inputs(shape, dtype, affine), dtype)


@gpu
@pytest.mark.parametrize("variants", VARIANTS, ids=lambda v: f"fwd{v[0]}-bwd{v[1]}")
@pytest.mark.parametrize("affine", AFFINE)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_variants_match_float64_reference(dtype, shape, affine, variants):
    check_against_reference(*make_inputs(shape, dtype, affine), dtype, *variants)


@gpu
@pytest.mark.parametrize("variants", [(0, 0)] + VARIANTS, ids=lambda v: f"fwd{v[0]}-bwd{v[1]}")
@pytest.mark.parametrize("shape", [(64, 768), (33, 771), (300, 1024), (12, 2048), (3, 4100)],
                         ids=lambda s: "x".join(map(str, s)))
def test_float16(shape, variants):
    check_against_reference(*make_inputs(shape, torch.float16), torch.float16, *variants)


@gpu
def test_launcher_rejects_unknown_variant():
    x, w, b, dout = make_inputs((4, 8), torch.float32)
    with pytest.raises(kforge.KforgeError, match="variant must be 0, 1 or 2"):
        kforge._C.layernorm_forward(x, w, b, EPS, variant=3)
    _, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS)
    with pytest.raises(kforge.KforgeError, match=r"variant must be in \[0, 7\]"):
        kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, variant=8)


@gpu
@pytest.mark.parametrize("variants", [(0, 0)] + VARIANTS, ids=lambda v: f"fwd{v[0]}-bwd{v[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_and_strided_inputs(dtype, variants):
    """Views 2 / 4 bytes off a 16-byte boundary take the scalar path; strided views are copied."""
    n, c = 64, 768
    x, w, b, dout = make_inputs((n, c), dtype)
    x_off = torch.empty(n * c + 1, dtype=dtype, device="cuda")[1:].view(n, c).copy_(x)
    w_off = torch.empty(c + 1, dtype=dtype, device="cuda")[1:].copy_(w)
    assert x_off.data_ptr() % 16 != 0 and w_off.data_ptr() % 16 != 0
    check_against_reference(x_off, w, b, dout, dtype, *variants)
    check_against_reference(x, w_off, b, dout, dtype, *variants)
    x_t = x.t().contiguous().t()  # same values, column-major
    check_against_reference(x_t, w, b, dout.t().contiguous().t(), dtype, *variants)


@gpu
@pytest.mark.parametrize("variant", [0, 1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("shape,dtype", [((8192, 768), torch.float32), ((8192, 768), torch.bfloat16),
                                         ((2000, 771), torch.bfloat16), ((4096, 4100), torch.float32),
                                         ((1000, 4096), torch.bfloat16)],
                         ids=str)
def test_backward_is_deterministic(shape, dtype, variant):
    x, w, b, dout = make_inputs(shape, dtype)
    _, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS)
    first = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, variant=variant)
    for _ in range(3):
        again = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, variant=variant)
        for a, r in zip(first, again):
            assert torch.equal(a, r)


@gpu
@pytest.mark.parametrize("variants", [(0, 0)] + VARIANTS, ids=lambda v: f"fwd{v[0]}-bwd{v[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_max_warps_knob(dtype, variants):
    """max_warps (A/B timing) only changes how many warps share the rows: per-row results are the
    same bits, the parameter gradients are sums in another grouping (same tolerance)."""
    fv, bv = variants
    x, w, b, dout = make_inputs((8192, 768), dtype)
    out, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS, variant=fv)
    grads = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, variant=bv)
    *_, r_dw, r_db = reference(x, w, b, dout)
    for mw in (2, 4, 8, 12):
        again = kforge._C.layernorm_forward(x, w, b, EPS, mw, variant=fv)
        for a, r in zip(again, (out, mean, rstd)):
            assert torch.equal(a, r)
        dx, dw, db = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, mw, variant=bv)
        assert torch.equal(dx, grads[0])
        assert_close(dw, r_dw, dtype, "dweight")
        assert_close(db, r_db, dtype, "dbias")
    with pytest.raises(kforge.KforgeError, match="max_warps must be >= 0"):
        kforge._C.layernorm_forward(x, w, b, EPS, -1)


@gpu
@pytest.mark.parametrize("variant", [0, 4, 5, 6, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_graph_capture_of_backward(dtype, variant):
    """The backward allocates its partial-sum scratch from PyTorch's allocator: capturable (the
    RING variants' reduce is a dependent launch)."""
    x, w, b, dout = make_inputs((512, 768), dtype)
    _, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS)
    expected = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, variant=variant)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up (compile, load) outside the capture
        kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, variant=variant)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kforge._C.layernorm_backward(dout, x, w, b, mean, rstd, variant=variant)
    graph.replay()
    torch.cuda.synchronize()
    for a, r in zip(captured, expected):
        assert torch.equal(a, r)


@gpu
def test_launcher_rejects_bad_arguments():
    x, w, b, dout = make_inputs((4, 8), torch.float32)
    with pytest.raises(kforge.KforgeError, match="weight must have shape"):
        kforge._C.layernorm_forward(x, torch.ones(9, device="cuda"), b, EPS)
    with pytest.raises(kforge.KforgeError, match="bias has dtype"):
        kforge._C.layernorm_forward(x, w, b.to(torch.bfloat16), EPS)
    _, mean, rstd = kforge._C.layernorm_forward(x, w, b, EPS)
    with pytest.raises(kforge.KforgeError, match="mean must be float32"):
        kforge._C.layernorm_backward(dout, x, w, b, mean.double(), rstd)
    with pytest.raises(kforge.KforgeError, match="dout has shape"):
        kforge._C.layernorm_backward(dout[:2], x, w, b, mean, rstd)


@gpu
@pytest.mark.parametrize("affine", ["weight+bias", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_uses_kforge(dtype, affine):
    shape = (4, 33, 768)
    x, w, b, dout = make_inputs(shape, dtype, affine)
    params = [t for t in (w, b) if t is not None]
    for t in (x, *params):
        t.requires_grad_(True)

    def fn(x, w, b):
        return F.layer_norm(x, (shape[-1],), w, b, EPS)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x, w, b)
    grads = torch.autograd.grad(out, (x, *params), dout)
    assert "kforge_layernorm_forward" in str(thunder.last_traces(jfn)[-1])
    assert "kforge_layernorm_backward" in str(thunder.last_backward_traces(jfn)[-1])
    r_out, _, _, r_dx, r_dw, r_db = reference(x, w, b, dout)
    assert_close(out, r_out, dtype, "out")
    for g, r, what in zip(grads, [r_dx] + [r for r in (r_dw, r_db) if r is not None], ["dx", "dw", "db"]):
        assert_close(g, r, dtype, what)
    # Eager torch agrees too (same tolerance against float64).
    assert_close(fn(x, w, b).detach(), r_out, dtype, "eager out")

    with torch.no_grad():  # inference: the execution transform (forward kernel only)
        jinf = thunder.jit(fn, executors=[kforge.executor])
        assert_close(jinf(x, w, b), r_out, dtype, "inference out")
        assert "kforge_layernorm_forward" in str(thunder.last_traces(jinf)[-1])


@gpu
def test_thunder_leaves_multi_dim_normalized_shape_to_torch():
    x, _, _, _ = make_inputs((8, 4, 64), torch.float32)
    w, b = 1 + 0.5 * randn(4, 64), 0.5 * randn(4, 64)
    _thunder.reset_declines()
    jfn = thunder.jit(lambda x, w, b: F.layer_norm(x, (4, 64), w, b), executors=[kforge.executor])
    out = jfn(x, w, b)
    assert "kforge_layernorm" not in str(thunder.last_traces(jfn)[-1])
    assert any("spans 2 dims" in r for r in _thunder.declines()["layer_norm"])
    assert_close(out, F.layer_norm(x.double(), (4, 64), w.double(), b.double()), torch.float32, "torch")


# ---- CPU: declines, fallback, plumbing ----------------------------------------------------------------
def test_cpu_tensors_fall_back_to_torch():
    _thunder.reset_declines()
    x, w, b, dout = make_inputs((3, 7, 16), torch.float32, device="cpu")
    for t in (x, w, b):
        t.requires_grad_(True)

    def fn(x, w, b):
        return F.layer_norm(x, (16,), w, b, EPS)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x, w, b)
    grads = torch.autograd.grad(out, (x, w, b), dout)
    assert "kforge_" not in str(thunder.last_traces(jfn)[-1])
    ref = fn(x, w, b)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, (x, w, b), dout)):
        torch.testing.assert_close(g, r)
    reasons = _thunder.declines()["layer_norm"]
    assert any(r.startswith("layernorm: ") and "not CUDA" in r for r in reasons), reasons


def test_launchers_reject_cpu_tensors():
    x = randn(4, 8, device="cpu")
    with pytest.raises(kforge.KforgeError, match="layernorm_forward: x must be a CUDA tensor"):
        kforge._C.layernorm_forward(x, None, None, EPS)
    stats = torch.ones(4)
    with pytest.raises(kforge.KforgeError, match="layernorm_backward: x must be a CUDA tensor"):
        kforge._C.layernorm_backward(x, x, None, None, stats, stats)


def test_checker_accepts_and_declines_with_reasons():
    check = ln._checker
    with tracectx(TraceCtx()):
        a = proxy((8, 768))
        w, b = proxy((768,)), proxy((768,))
        assert check(a, (768,), w, b, EPS) is None
        assert check(a, (768,), None, None, EPS) is None
        assert check(a, [768], w, None) is None
        assert check(proxy((768,)), (768,), w, b) is None  # 1-D input: one row
        cases = {
            "not CUDA": check(proxy((8, 768), device="cpu"), (768,), None, None),
            "float64": check(proxy((8, 768), dtype=torch.float64), (768,), None, None),
            "spans 2 dims": check(proxy((8, 4, 192)), (4, 192), None, None),
            "does not match the last dim": check(a, (767,), None, None),
            "weight shape": check(a, (768,), proxy((2, 384)), None),
            "weight dtype": check(a, (768,), proxy((768,), dtype=torch.bfloat16), None),
            "bias is on": check(a, (768,), w, proxy((768,), device="cuda:1")),
            "empty": check(proxy((0, 768)), (768,), None, None),
            "0-D": check(proxy(()), (), None, None),
        }
    for expected, reason in cases.items():
        assert reason is not None and expected in reason, (expected, reason)


# Thunder plumbing without a GPU: the claim's metas and grad transform run for real; only the kforge
# launchers are swapped for a torch reference and the checker accepts CPU tensors.
def _ref_forward(x, w, b, eps):
    c = x.shape[-1]
    rows = x.float().reshape(-1, c)
    mean, rstd = rows.mean(-1), (rows.var(-1, unbiased=False) + eps).rsqrt()
    y = (rows - mean[:, None]) * rstd[:, None]
    y = y * w.float() if w is not None else y
    y = y + b.float() if b is not None else y
    return y.to(x.dtype).reshape(x.shape), mean, rstd


def _ref_backward(dout, x, w, b, mean, rstd):
    c = x.shape[-1]
    rows, g = x.float().reshape(-1, c), dout.float().reshape(-1, c)
    xh = (rows - mean[:, None]) * rstd[:, None]
    gw = g * w.float() if w is not None else g
    dx = rstd[:, None] * (gw - gw.mean(-1, keepdim=True) - xh * (gw * xh).mean(-1, keepdim=True))
    dw = None if w is None else (g * xh).sum(0).to(w.dtype)
    db = None if b is None else g.sum(0).to(b.dtype)
    return dx.to(x.dtype).reshape(x.shape), dw, db


@pytest.fixture
def cpu_reference_launchers(monkeypatch):
    swap_launchers(monkeypatch, ln, {ln.layernorm_forward: _ref_forward, ln.layernorm_backward: _ref_backward})


@pytest.mark.parametrize("affine", AFFINE)
def test_thunder_plumbing_with_reference_launchers(cpu_reference_launchers, affine):
    x, w, b, dout = make_inputs((2, 3, 16), torch.float32, affine, device="cpu")
    params = [t for t in (x, w, b) if t is not None]
    for t in params:
        t.requires_grad_(True)

    def fn(x, w, b):
        return F.layer_norm(x, (16,), w, b, EPS)

    jfn = thunder.jit(fn, executors=[kforge.executor])
    out = jfn(x, w, b)
    grads = torch.autograd.grad(out, params, dout)
    fwd, bwd = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
    assert "kforge_layernorm_forward" in fwd and "kforge_layernorm_backward" in bwd, (fwd, bwd)
    ref = fn(x, w, b)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, params, dout)):
        torch.testing.assert_close(g, r)
