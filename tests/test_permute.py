"""split_qkv / merge_heads: the copy kernels against PyTorch's views (exact: they only move data), in
both directions, on 16-byte packs (HS a multiple of the pack) and element-wise (odd HS, misaligned
views), and the Thunder operators that replace the model helpers.

CPU tests: the helpers, decline reasons, the fallback to torch on CPU tensors, launcher errors, and
the Thunder plumbing (metas, grad transforms) with the launchers swapped for torch.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
import thunder
from thunder.core.trace import TraceCtx, tracectx

import kforge
from conftest import DTYPES, assert_close, gpu, proxy, randn, swap_launchers
from kforge import _thunder
from kforge.ops import permute as pm
from kforge.ops.permute import merge_heads, split_qkv


def ref_split(qkv: torch.Tensor, n_head: int) -> list[torch.Tensor]:
    """q, k, v (B, NH, T, HS) by explicit indexing: q[b, h, t, s] = qkv[b, t, h * HS + s]."""
    B, T, C3 = qkv.shape
    C = C3 // 3
    return [qkv[:, :, p * C:(p + 1) * C].reshape(B, T, n_head, C // n_head).permute(0, 2, 1, 3)
            for p in range(3)]


def ref_merge(y: torch.Tensor) -> torch.Tensor:
    B, NH, T, HS = y.shape
    return y.permute(0, 2, 1, 3).reshape(B, T, NH * HS)


def assert_same(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """A copy is exact: same shape, dtype, contiguous, every element equal."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (what, out.shape, ref.shape)
    assert out.is_contiguous(), what
    assert torch.equal(out, ref), f"{what}: {(out.double() - ref.double()).abs().max()} max difference"


# GPT-2 124M; HS a multiple of the 16-byte pack for both dtypes (64, 16), for fp32 only (12), or for
# neither (5, 6, 1, 63); T = 1 and odd T. 40 heads of 64: token rows of 320 to 1920 16-byte columns, cut
# into up to four column chunks (blockIdx.x), and for the fp32 split (132 SMs) twice as many token
# tiles as blocks (the grid-stride loop); 8x1024x12x64: the fp32 split in two column chunks.
# Variants 1-3 (token lanes, K tokens per thread and round; 132 SMs): K = 1 for the small shapes (and
# always for T = 1: 5x1 remaps (b, 0) to (0, b); 1x1x1x1 the single token); K = 2 in one round for
# the bf16 merge of 4x1024 and bf16 split of 1x1000 (v1, v3), over rounds for v3 at 8x1024; K = 4
# in one round for the bf16 merge of 8x1024 (v1), over rounds for the splits of 4x1024 / 8x1024 /
# 2x1030 and element-wise for 4x1024x12x63 (v1); K = 8 for every shape with v2 (over rounds for the
# 8x1024 and 2x1030 splits).
SHAPES = [(8, 1024, 12, 64), (1, 1, 1, 1), (2, 5, 3, 8), (3, 7, 12, 64), (2, 33, 4, 6), (2, 17, 5, 12),
          (1, 1000, 12, 64), (2, 9, 16, 5), (1, 3, 2, 16), (2, 1030, 40, 64), (4, 1024, 12, 64),
          (5, 1, 3, 8), (4, 1024, 12, 63)]

# The launchers' `variant` (every value must give the same result): 0 the tiled kernel, 1 token lanes
# with K <= 4 (default), 2 lanes with K = 8, 3 lanes with K <= 2.
VARIANTS = [0, 1, 2, 3]
variants = pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"v{v}")


@gpu
@variants
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_split_and_merge_match_torch(dtype, shape, variant):
    B, T, NH, HS = shape
    C = NH * HS
    qkv = randn(B, T, 3 * C, dtype=dtype)
    outs = kforge._C.split_qkv_forward(qkv, NH, variant=variant)
    for out, ref, name in zip(outs, ref_split(qkv, NH), "qkv"):
        assert_same(out, ref.contiguous(), f"split {name}")
    dq, dk, dv = (randn(B, NH, T, HS, dtype=dtype) for _ in range(3))
    assert_same(kforge._C.split_qkv_backward(dq, dk, dv, variant=variant),
                torch.cat([ref_merge(g) for g in (dq, dk, dv)], -1), "dqkv")
    y = randn(B, NH, T, HS, dtype=dtype)
    assert_same(kforge._C.merge_heads_forward(y, variant=variant), ref_merge(y).contiguous(), "merge")
    dout = randn(B, T, C, dtype=dtype)
    assert_same(kforge._C.merge_heads_backward(dout, NH, variant=variant),
                dout.view(B, T, NH, HS).transpose(1, 2).contiguous(), "dy")


@gpu
@variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_misaligned_and_strided_inputs(dtype, variant):
    """Views 1 element off a 16-byte boundary take the element-wise path; strided views are copied."""
    B, T, NH, HS = 2, 7, 12, 64

    def off(t):
        return torch.empty(t.numel() + 1, dtype=dtype, device="cuda")[1:].view(t.shape).copy_(t)

    qkv = randn(B, T, 3 * NH * HS, dtype=dtype)
    assert off(qkv).data_ptr() % 16 != 0
    for out, ref in zip(kforge._C.split_qkv_forward(off(qkv), NH, variant=variant), ref_split(qkv, NH)):
        assert_same(out, ref.contiguous(), "split (misaligned)")
    y = randn(B, NH, T, HS, dtype=dtype)
    assert_same(kforge._C.merge_heads_forward(off(y), variant=variant), ref_merge(y).contiguous(),
                "merge (misaligned)")
    dout = randn(B, T, NH * HS, dtype=dtype)
    assert_same(kforge._C.merge_heads_backward(off(dout), NH, variant=variant),
                dout.view(B, T, NH, HS).transpose(1, 2).contiguous(), "merge backward (misaligned)")
    grads = [randn(B, NH, T, HS, dtype=dtype) for _ in range(3)]
    assert_same(kforge._C.split_qkv_backward(*(off(g) for g in grads), variant=variant),
                torch.cat([ref_merge(g) for g in grads], -1), "split backward (misaligned)")
    # q, k, v straight from the eager helper: strided views of qkv.
    q, k, v = split_qkv(qkv, NH)
    assert_same(kforge._C.split_qkv_backward(q, k, v, variant=variant), qkv,
                "split backward of strided views")
    assert_same(kforge._C.merge_heads_forward(q, variant=variant), ref_merge(q).contiguous(),
                "merge of a strided view")


@gpu
@variants
def test_round_trips_and_missing_gradients(variant):
    B, T, NH, HS = 2, 31, 12, 64
    qkv = randn(B, T, 3 * NH * HS, dtype=torch.bfloat16)
    q, k, v = kforge._C.split_qkv_forward(qkv, NH, variant=variant)
    assert_same(kforge._C.split_qkv_backward(q, k, v, variant=variant), qkv, "split then inverse")
    y = randn(B, NH, T, HS, dtype=torch.bfloat16)
    merged = kforge._C.merge_heads_forward(y, variant=variant)
    assert_same(kforge._C.merge_heads_backward(merged, NH, variant=variant), y, "merge then inverse")
    # An unused output's gradient (None) counts as zeros.
    dqkv = kforge._C.split_qkv_backward(None, k, None, variant=variant)
    C = NH * HS
    assert_same(dqkv[..., C:2 * C].contiguous(), qkv[..., C:2 * C].contiguous(), "dk part")
    assert (dqkv[..., :C] == 0).all() and (dqkv[..., 2 * C:] == 0).all()


@gpu
def test_launchers_reject_bad_arguments():
    qkv = randn(2, 5, 36)
    with pytest.raises(kforge.KforgeError, match=r"\(B, T, 3C\)"):
        kforge._C.split_qkv_forward(qkv.view(10, 36), 3)
    with pytest.raises(kforge.KforgeError, match="not 3 \\* n_head"):
        kforge._C.split_qkv_forward(qkv, 5)
    with pytest.raises(kforge.KforgeError, match="n_head must be positive"):
        kforge._C.split_qkv_forward(qkv, 0)
    q = randn(2, 3, 5, 4)
    with pytest.raises(kforge.KforgeError, match="all None"):
        kforge._C.split_qkv_backward(None, None, None)
    with pytest.raises(kforge.KforgeError, match="dk has shape"):
        kforge._C.split_qkv_backward(q, randn(2, 3, 5, 5), q)
    with pytest.raises(kforge.KforgeError, match="dv has dtype"):
        kforge._C.split_qkv_backward(q, q, q.bfloat16())
    with pytest.raises(kforge.KforgeError, match=r"\(B, NH, T, HS\)"):
        kforge._C.merge_heads_forward(qkv)
    with pytest.raises(kforge.KforgeError, match="not a multiple of n_head"):
        kforge._C.merge_heads_backward(qkv, 5)
    with pytest.raises(kforge.KforgeError, match="not supported"):
        kforge._C.merge_heads_forward(q.double())
    for bad in (-1, len(VARIANTS)):
        with pytest.raises(kforge.KforgeError, match="variant must be"):
            kforge._C.merge_heads_forward(q, variant=bad)
        with pytest.raises(kforge.KforgeError, match="variant must be"):
            kforge._C.split_qkv_backward(q, q, q, variant=bad)
    q0, _, _ = kforge._C.split_qkv_forward(randn(2, 0, 36), 3)
    assert q0.shape == (2, 3, 0, 4)


@gpu
@variants
@pytest.mark.parametrize("HS", [64, 5], ids=["vec", "elementwise"])
def test_more_than_2_31_elements(HS, variant):
    """64-bit offsets on both sides: y (2, 3, T, HS) of > 2^31 bf16 elements, merged to (2, T, 3 HS)
    (= qkv of one head), split back, and both inverses; compared bit for bit (random bit patterns)."""
    B, NH = 2, 3
    T = 2**31 // (B * NH * HS) + 1
    n = B * NH * T * HS
    assert n > 2**31
    need = 3 * 2 * n + n + (2 << 30)  # three bf16 tensors at a time, a bool compare temporary, slack
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free GPU memory, {free / 2**30:.1f} GiB free")
    gen = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randint(-2**15, 2**15, (B, NH, T, HS), dtype=torch.int16, device="cuda", generator=gen)
    y = y.view(torch.bfloat16)

    def same(a, b):  # bit for bit: random patterns include NaNs
        return torch.equal(a.view(torch.int16), b.view(torch.int16))

    out = kforge._C.merge_heads_forward(y, variant=variant)  # (B, T, NH * HS)
    assert out.shape == (B, T, NH * HS)
    for b in range(B):
        for h in range(NH):
            assert same(out[b, :, h * HS:(h + 1) * HS], y[b, h]), ("merge", b, h)
    dy = kforge._C.merge_heads_backward(out, NH, variant=variant)
    assert same(dy, y), "merge backward"
    del dy
    # one head of HS per part: q, k, v = y[:, 0], y[:, 1], y[:, 2]
    parts = kforge._C.split_qkv_forward(out, 1, variant=variant)
    for p, t in enumerate(parts):
        assert t.shape == (B, 1, T, HS) and same(t[:, 0], y[:, p]), ("split", p)
    del y
    assert same(kforge._C.split_qkv_backward(*parts, variant=variant), out), "split backward"


# ---- Thunder, GPU ---------------------------------------------------------------------------------
def attention_like(x, w, n_head):
    """The helpers as the reference GPT-2 uses them, with something differentiable in between."""
    q, k, v = split_qkv(x @ w, n_head)
    return merge_heads(q * k + v.sin())


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit_replaces_split_and_merge(dtype):
    B, T, NH, HS = 2, 65, 12, 64
    C = NH * HS
    x = randn(B, T, C, dtype=dtype).requires_grad_(True)
    w = randn(C, 3 * C, dtype=dtype, scale=C ** -0.5).requires_grad_(True)
    dout = randn(B, T, C, dtype=dtype)
    jfn = thunder.jit(attention_like, executors=[kforge.executor])
    out = jfn(x, w, NH)
    dx, dw = torch.autograd.grad(out, (x, w), dout)
    fwd, bwd = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
    for name in ("kforge_split_qkv_forward", "kforge_merge_heads_forward"):
        assert name in fwd, fwd
    for name in ("kforge_split_qkv_backward", "kforge_merge_heads_backward"):
        assert name in bwd, bwd
    x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
    ref = attention_like(x64, w64, NH)
    rx, rw = torch.autograd.grad(ref, (x64, w64), dout.double())
    tol = None if dtype == torch.float32 else 2e-2  # bf16: the matmuls and products round too
    assert_close(out, ref, dtype, "out", tol=tol)
    assert_close(dx, rx, dtype, "dx", tol=tol)
    assert_close(dw, rw, dtype, "dw", tol=tol)


@gpu
@variants
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("HS", [64, 7], ids=lambda h: f"HS{h}")
def test_strided_head_inputs_are_read_in_place(dtype, HS, variant):
    """Token-major (B, NH, T, HS) views - what flash attention's backward returns for q, k, v that
    were views of qkv, and its forward output - are read with their strides; mixed layouts fall back
    to contiguous copies. 16-byte (HS 64) and element (HS 7) paths."""
    B, T, NH = 2, 33, 3
    grads = [randn(B, T, NH, HS, dtype=dtype).transpose(1, 2) for _ in range(3)]
    assert not grads[0].is_contiguous()
    ref = torch.cat([ref_merge(g) for g in grads], -1)
    assert_same(kforge._C.split_qkv_backward(*grads, variant=variant), ref,
                "split backward of token-major grads")
    mixed = [grads[0].contiguous(), grads[1], grads[2]]
    assert_same(kforge._C.split_qkv_backward(*mixed, variant=variant), ref, "split backward of mixed layouts")
    assert_same(kforge._C.split_qkv_backward(None, grads[1], None, variant=variant),
                torch.cat([torch.zeros_like(ref_merge(grads[0])), ref_merge(grads[1]),
                           torch.zeros_like(ref_merge(grads[0]))], -1), "split backward, one given")
    y = randn(B, T, NH, HS, dtype=dtype).transpose(1, 2)
    assert_same(kforge._C.merge_heads_forward(y, variant=variant), ref_merge(y).contiguous(),
                "merge of a token-major view")


def sdpa_like(x, w, n_head):
    """The SDPA variant of the reference GPT-2: views into SDPA, merge of its output."""
    q, k, v = split_qkv(x @ w, n_head, copy=False)
    return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))


@gpu
def test_thunder_jit_sdpa_split_is_views_and_merge_of_token_major_output_is_a_view():
    """copy=False: no forward copy kernel (the views operator), the dqkv kernel in the backward; the
    merge of flash attention's token-major output is a view. Numbers vs a float64 reference."""
    B, T, NH, HS = 2, 65, 12, 64
    C = NH * HS
    dtype = torch.bfloat16
    x = randn(B, T, C, dtype=dtype).requires_grad_(True)
    w = randn(C, 3 * C, dtype=dtype, scale=C ** -0.5).requires_grad_(True)
    dout = randn(B, T, C, dtype=dtype)
    jfn = thunder.jit(sdpa_like, executors=[kforge.executor, *thunder.get_default_executors()])
    out = jfn(x, w, NH)
    dx, dw = torch.autograd.grad(out, (x, w), dout)
    fwd, bwd = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
    assert "kforge_split_qkv_views" in fwd and "kforge_split_qkv_forward" not in fwd, fwd
    assert "kforge_merge_heads_forward" in fwd, fwd
    for name in ("kforge_split_qkv_backward", "kforge_merge_heads_backward"):
        assert name in bwd, bwd
    x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
    ref = sdpa_like(x64, w64, NH)
    rx, rw = torch.autograd.grad(ref, (x64, w64), dout.double())
    assert_close(out, ref, dtype, "out", tol=2e-2)
    assert_close(dx, rx, dtype, "dx", tol=2e-2)
    assert_close(dw, rw, dtype, "dw", tol=2e-2)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_views_and_merge_launch_layouts(dtype):
    B, T, NH, HS = 2, 33, 3, 64
    qkv = randn(B, T, 3 * NH * HS, dtype=dtype)
    for got, ref in zip(pm._split_views(qkv, NH), ref_split(qkv, NH)):
        assert got.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()  # views, no copy
        assert got.shape == ref.shape and got.stride() == ref.stride() and torch.equal(got, ref)
    y_tok = randn(B, T, NH, HS, dtype=dtype).transpose(1, 2)  # token-major (B, NH, T, HS), like flash output
    merged = pm._merge_heads_launch(y_tok)
    assert merged.data_ptr() == y_tok.data_ptr()  # a view
    assert_same(merged, ref_merge(y_tok).contiguous(), "merge view")
    y = randn(B, NH, T, HS, dtype=dtype)  # head-major: the kernel
    merged = pm._merge_heads_launch(y)
    assert merged.data_ptr() != y.data_ptr() and merged.is_contiguous()
    assert_same(merged, ref_merge(y).contiguous(), "merge copy")


# ---- CPU: helpers, declines, fallback, plumbing --------------------------------------------------
def test_helpers_are_the_head_split_and_merge():
    B, T, NH, HS = 2, 5, 3, 4
    qkv = randn(B, T, 3 * NH * HS, device="cpu")
    q, k, v = split_qkv(qkv, NH)
    for p, t in enumerate((q, k, v)):
        for h in range(NH):
            torch.testing.assert_close(t[:, h], qkv[:, :, p * NH * HS + h * HS:p * NH * HS + (h + 1) * HS],
                                       rtol=0, atol=0)
    torch.testing.assert_close(merge_heads(q), qkv[..., :NH * HS], rtol=0, atol=0)


def test_bindings_document_their_variants():
    for name in ("split_qkv_forward", "split_qkv_backward", "merge_heads_forward", "merge_heads_backward"):
        doc = getattr(kforge._C, name).__doc__
        assert re.search(r"variant: [^=]*= 1\)", doc) and all(f" {v} " in doc for v in VARIANTS), (name, doc)


def test_launchers_reject_cpu_tensors():
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.split_qkv_forward(randn(2, 3, 12, device="cpu"), 2)
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.merge_heads_forward(randn(2, 2, 3, 2, device="cpu"))


def test_checkers_accept_and_decline_with_reasons():
    with tracectx(TraceCtx()):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert pm._split_checker(proxy((8, 1024, 2304), dtype=dtype), 12) is None
            assert pm._merge_checker(proxy((8, 12, 1024, 64), dtype=dtype)) is None
        cases = {
            "not (B, T, 3C)": pm._split_checker(proxy((8, 2304)), 12),
            "not 3 * n_head * head_size": pm._split_checker(proxy((2, 3, 30)), 4),
            "not a positive int": pm._split_checker(proxy((2, 3, 36)), 0),
            "not CUDA": pm._split_checker(proxy((2, 3, 36), device="cpu"), 2),
            "float64": pm._split_checker(proxy((2, 3, 36), dtype=torch.float64), 2),
            "empty": pm._merge_checker(proxy((2, 3, 0, 4))),
            "not (B, NH, T, HS)": pm._merge_checker(proxy((2, 3, 4))),
        }
    for expected, reason in cases.items():
        assert reason is not None and expected in reason, (expected, reason)


def test_cpu_tensors_fall_back_to_torch():
    _thunder.reset_declines()
    x = randn(2, 5, 12, device="cpu").requires_grad_(True)
    w = randn(12, 36, device="cpu").requires_grad_(True)
    dout = randn(2, 5, 12, device="cpu")
    jfn = thunder.jit(attention_like, executors=[kforge.executor])
    out = jfn(x, w, 3)
    grads = torch.autograd.grad(out, (x, w), dout)
    assert "kforge_" not in str(thunder.last_traces(jfn)[-1])
    ref = attention_like(x, w, 3)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, (x, w), dout)):
        torch.testing.assert_close(g, r)
    declines = _thunder.declines()
    for key in ("kforge_split_qkv", "kforge_merge_heads"):
        assert any(r.startswith("permute: ") and "not CUDA" in r for r in declines[key]), declines
    with torch.no_grad():  # inference: the declined operators run their torch definitions
        jinf = thunder.jit(attention_like, executors=[kforge.executor])
        torch.testing.assert_close(jinf(x, w, 3), ref)


# Thunder plumbing without a GPU: the operators' metas and grad transforms run for real; only the
# kforge launchers are swapped for torch and the checkers accept CPU tensors.
@pytest.fixture
def cpu_reference_launchers(monkeypatch):
    swap_launchers(monkeypatch, pm, {
        pm.split_qkv_forward: lambda qkv, nh: tuple(t.contiguous() for t in ref_split(qkv, nh)),
        pm.split_qkv_backward: lambda dq, dk, dv: torch.cat([ref_merge(g) for g in (dq, dk, dv)], -1),
        pm.merge_heads_forward: lambda y: ref_merge(y).contiguous(),
        pm.merge_heads_backward: lambda d, nh: d.view(d.shape[0], d.shape[1], nh, -1).transpose(1, 2).contiguous(),
    })


def test_thunder_plumbing_with_reference_launchers(cpu_reference_launchers):
    x = randn(2, 5, 12, device="cpu", dtype=torch.float64).requires_grad_(True)
    w = randn(12, 36, device="cpu", dtype=torch.float64).requires_grad_(True)
    dout = randn(2, 5, 12, device="cpu", dtype=torch.float64)
    jfn = thunder.jit(attention_like, executors=[kforge.executor])
    out = jfn(x, w, 3)
    grads = torch.autograd.grad(out, (x, w), dout)
    fwd, bwd = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
    for name in ("kforge_split_qkv_forward", "kforge_merge_heads_forward"):
        assert name in fwd, fwd
    for name in ("kforge_split_qkv_backward", "kforge_merge_heads_backward"):
        assert name in bwd, bwd
    ref = attention_like(x, w, 3)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, (x, w), dout)):
        torch.testing.assert_close(g, r)


def views_like(x, w, n_head):
    q, k, v = split_qkv(x @ w, n_head, copy=False)
    return merge_heads(q * k + v.sin())


def test_thunder_plumbing_split_views(cpu_reference_launchers):
    """copy=False: the views operator forward (plain torch, runs on CPU), the dqkv op backward."""
    x = randn(2, 5, 12, device="cpu", dtype=torch.float64).requires_grad_(True)
    w = randn(12, 36, device="cpu", dtype=torch.float64).requires_grad_(True)
    dout = randn(2, 5, 12, device="cpu", dtype=torch.float64)
    jfn = thunder.jit(views_like, executors=[kforge.executor])
    out = jfn(x, w, 3)
    grads = torch.autograd.grad(out, (x, w), dout)
    fwd, bwd = str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])
    assert "kforge_split_qkv_views" in fwd and "kforge_split_qkv_forward" not in fwd, fwd
    assert "kforge_split_qkv_backward" in bwd, bwd
    ref = views_like(x, w, 3)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, (x, w), dout)):
        torch.testing.assert_close(g, r)
