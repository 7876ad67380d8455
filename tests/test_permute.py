"""split_qkv / merge_heads: the copy kernels against PyTorch's views (exact: they only move data), in
both directions, on 16-byte packs (HS a multiple of the pack) and element-wise (odd HS, misaligned
views): the token lanes with K = 1, 2 and 4 tokens per round, and the 64-bit tiles they fall back to
past 32-bit byte strides; and the Thunder operators that replace the model helpers.

CPU tests: the helpers, decline reasons, the fallback to torch on CPU tensors, launcher errors, and
the Thunder plumbing (metas, grad transforms) with the launchers swapped for torch.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import thunder
from hypothesis import given, settings
from hypothesis import strategies as st
from thunder.core.trace import TraceCtx, tracectx

import conftest
import kforge
from conftest import DTYPES, assert_close, gpu, proxy, randn, swap_launchers
from kforge import _testing, _thunder
from kforge import profile as kp
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


def kernels_run(fn):
    """fn()'s result and the kforge kernel functions it launched (CUDA profiler, kernels_src names)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], acc_events=True) as prof:
        out = fn()
        torch.cuda.synchronize()
    names = {kp.kforge_kernel(e.name) for e in prof.events() if e.device_type == DeviceType.CUDA}
    return out, names - {None}


# GPT-2 124M; HS a multiple of the 16-byte pack for both dtypes (64, 16), for fp32 only (12), or for
# neither (5, 6, 1, 63); T = 1 and odd T. The token lanes' K (tokens per thread and round; 132 SMs,
# either layout direction): K = 1 for the small shapes (and always for T = 1: 5x1 remaps (b, 0) to
# (0, b); 1x1x1x1 the single token); K = 2 (one round) for the 16-bit merge of 4x1024, the 16-bit
# split of 1x1000, the fp32 merge of 2x1024 and the fp32 split of 1x700, and element-wise for the
# merge of 1x500x12x63 and the split of 1x200x12x63; K = 4 in one round for the 16-bit merge of
# 8x1024, over rounds for the splits of 4x1024 / 8x1024 / 2x1030 and element-wise for 4x1024x12x63
# and 1x500x12x63.
SHAPES = [(8, 1024, 12, 64), (1, 1, 1, 1), (2, 5, 3, 8), (3, 7, 12, 64), (2, 33, 4, 6), (2, 17, 5, 12),
          (1, 1000, 12, 64), (2, 9, 16, 5), (1, 3, 2, 16), (2, 1030, 40, 64), (4, 1024, 12, 64),
          (5, 1, 3, 8), (4, 1024, 12, 63), (2, 1024, 12, 64), (1, 700, 12, 64), (1, 500, 12, 63),
          (1, 200, 12, 63)]


@gpu
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_split_and_merge_match_torch(dtype, shape):
    B, T, NH, HS = shape
    C = NH * HS
    qkv = randn(B, T, 3 * C, dtype=dtype)
    outs = kforge._C.split_qkv_forward(qkv, NH)
    for out, ref, name in zip(outs, ref_split(qkv, NH), "qkv"):
        assert_same(out, ref.contiguous(), f"split {name}")
    dq, dk, dv = (randn(B, NH, T, HS, dtype=dtype) for _ in range(3))
    assert_same(kforge._C.split_qkv_backward(dq, dk, dv),
                torch.cat([ref_merge(g) for g in (dq, dk, dv)], -1), "dqkv")
    y = randn(B, NH, T, HS, dtype=dtype)
    assert_same(kforge._C.merge_heads_forward(y), ref_merge(y).contiguous(), "merge")
    dout = randn(B, T, C, dtype=dtype)
    assert_same(kforge._C.merge_heads_backward(dout, NH),
                dout.view(B, T, NH, HS).transpose(1, 2).contiguous(), "dy")


@gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_misaligned_and_strided_inputs(dtype):
    """Views 1 element off a 16-byte boundary take the element-wise path; strided views are copied."""
    B, T, NH, HS = 2, 7, 12, 64

    def off(t):
        return torch.empty(t.numel() + 1, dtype=dtype, device="cuda")[1:].view(t.shape).copy_(t)

    qkv = randn(B, T, 3 * NH * HS, dtype=dtype)
    assert off(qkv).data_ptr() % 16 != 0
    for out, ref in zip(kforge._C.split_qkv_forward(off(qkv), NH), ref_split(qkv, NH)):
        assert_same(out, ref.contiguous(), "split (misaligned)")
    y = randn(B, NH, T, HS, dtype=dtype)
    assert_same(kforge._C.merge_heads_forward(off(y)), ref_merge(y).contiguous(),
                "merge (misaligned)")
    dout = randn(B, T, NH * HS, dtype=dtype)
    assert_same(kforge._C.merge_heads_backward(off(dout), NH),
                dout.view(B, T, NH, HS).transpose(1, 2).contiguous(), "merge backward (misaligned)")
    grads = [randn(B, NH, T, HS, dtype=dtype) for _ in range(3)]
    assert_same(kforge._C.split_qkv_backward(*(off(g) for g in grads)),
                torch.cat([ref_merge(g) for g in grads], -1), "split backward (misaligned)")
    # q, k, v straight from the eager helper: strided views of qkv.
    q, k, v = split_qkv(qkv, NH)
    assert_same(kforge._C.split_qkv_backward(q, k, v), qkv,
                "split backward of strided views")
    assert_same(kforge._C.merge_heads_forward(q), ref_merge(q).contiguous(),
                "merge of a strided view")


@gpu
def test_round_trips_and_missing_gradients():
    B, T, NH, HS = 2, 31, 12, 64
    qkv = randn(B, T, 3 * NH * HS, dtype=torch.bfloat16)
    q, k, v = kforge._C.split_qkv_forward(qkv, NH)
    assert_same(kforge._C.split_qkv_backward(q, k, v), qkv, "split then inverse")
    y = randn(B, NH, T, HS, dtype=torch.bfloat16)
    merged = kforge._C.merge_heads_forward(y)
    assert_same(kforge._C.merge_heads_backward(merged, NH), y, "merge then inverse")
    # An unused output's gradient (None) counts as zeros.
    dqkv = kforge._C.split_qkv_backward(None, k, None)
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
    q0, _, _ = kforge._C.split_qkv_forward(randn(2, 0, 36), 3)
    assert q0.shape == (2, 3, 0, 4)


@gpu
@pytest.mark.parametrize("HS", [64, 5], ids=["vec", "elementwise"])
@pytest.mark.bigmem
def test_more_than_2_31_elements(HS):
    """Past 2^31 elements on both sides, byte strides still < 2^32 (the token lanes: 64-bit base plus
    32-bit products): y (2, 3, T, HS) of > 2^31 bf16 elements, merged to (2, T, 3 HS) (= qkv of one
    head), split back, and both inverses; compared bit for bit (random bit patterns)."""
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

    out = kforge._C.merge_heads_forward(y)  # (B, T, NH * HS)
    assert out.shape == (B, T, NH * HS)
    for b in range(B):
        for h in range(NH):
            assert same(out[b, :, h * HS:(h + 1) * HS], y[b, h]), ("merge", b, h)
    dy = kforge._C.merge_heads_backward(out, NH)
    assert same(dy, y), "merge backward"
    del dy
    # one head of HS per part: q, k, v = y[:, 0], y[:, 1], y[:, 2]
    parts = kforge._C.split_qkv_forward(out, 1)
    for p, t in enumerate(parts):
        assert t.shape == (B, 1, T, HS) and same(t[:, 0], y[:, p]), ("split", p)
    del y
    assert same(kforge._C.split_qkv_backward(*parts), out), "split backward"


@gpu
# ~19 GiB each: two cases cover both tile instantiations (16-byte and element-wise) and both
# element sizes.
@pytest.mark.parametrize("dtype, HS", [(torch.float32, 64), (torch.bfloat16, 5)],
                         ids=["fp32-vec", "bf16-elementwise"])
@pytest.mark.bigmem
def test_tiles_past_32_bit_byte_strides(dtype, HS):
    """A head part whose batch stride is 4 GiB or more does not fit the token lanes' 32-bit byte
    strides: the 64-bit tiles run. dout (2, T, 3 HS) with a batch of one part (T HS elements x 3
    heads) past 2^32 bytes: merge backward (tokens -> heads), then merge forward and split backward
    of its heads as three strided parts (heads -> tokens, one part and three); compared bit for bit
    (random bit patterns). The kernels that ran are read from the CUDA profiler."""
    es = torch.empty((), dtype=dtype).element_size()
    ity = torch.int32 if es == 4 else torch.int16  # same-size integers: exact compares, NaNs included
    B, NH = 2, 3
    T = -(-2**32 // (es * NH * HS))  # batch stride NH T HS elements: >= 2^32 bytes
    n = B * T * NH * HS
    need = 2 * n * es + (2 << 30)  # two tensors at a time, a compare temporary (n / 6 bytes), slack
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB free GPU memory, {free / 2**30:.1f} GiB free")
    y_small = randn(B, NH, 5, HS, dtype=dtype)
    out_small, ran = kernels_run(lambda: kforge._C.merge_heads_forward(y_small))
    assert ran == {"permute_lanes_kernel"}, ran  # the same call on small tensors: the lanes
    assert_same(out_small, ref_merge(y_small).contiguous(), "small merge")
    gen = torch.Generator(device="cuda").manual_seed(0)
    dout = torch.randint(-2**15, 2**15, (B, T, NH * HS * es // 2), dtype=torch.int16, device="cuda",
                         generator=gen).view(dtype)

    def check(tok, heads, what):  # tok (B, T, NH HS) against heads (B, NH, T, HS), head by head
        for b in range(B):
            for h in range(NH):
                part = tok[b, :, h * HS:(h + 1) * HS]
                assert torch.equal(part.view(ity), heads[b, h].view(ity)), (what, b, h)

    dy, ran = kernels_run(lambda: kforge._C.merge_heads_backward(dout, NH))
    assert ran == {"permute_tokens_to_heads_kernel"}, ran
    check(dout, dy, "merge backward")
    del dout
    out, ran = kernels_run(lambda: kforge._C.merge_heads_forward(dy))
    assert ran == {"permute_heads_to_tokens_kernel"}, ran
    check(out, dy, "merge forward")
    del out
    # q, k, v = the three heads of dy: strided parts (same strides) read in place; dqkv is dout again
    dqkv, ran = kernels_run(lambda: kforge._C.split_qkv_backward(dy[:, 0:1], dy[:, 1:2], dy[:, 2:3]))
    assert ran == {"permute_heads_to_tokens_kernel"}, ran
    check(dqkv, dy, "split backward")


# ---- Thunder, GPU ---------------------------------------------------------------------------------
def jit_grads(fn, x, w, n_head, dout, executors=(kforge.executor,)):
    """thunder.jit(fn)(x, w, n_head), its gradients of x and w for dout, and the last forward and
    backward traces as text."""
    jfn = thunder.jit(fn, executors=list(executors))
    out = jfn(x, w, n_head)
    grads = torch.autograd.grad(out, (x, w), dout)
    return out, grads, str(thunder.last_traces(jfn)[-1]), str(thunder.last_backward_traces(jfn)[-1])


def cpu_inputs(dtype=torch.float64):
    """x (2, 5, 12), w (12, 36) (3 heads of 4) and dout on the CPU."""
    return (randn(2, 5, 12, device="cpu", dtype=dtype).requires_grad_(True),
            randn(12, 36, device="cpu", dtype=dtype).requires_grad_(True),
            randn(2, 5, 12, device="cpu", dtype=dtype))


def jit_matches_eager(fn, x, w, dout):
    """jit_grads of fn with 3 heads, output and gradients compared with eager fn; returns the eager
    output and the traces."""
    out, grads, fwd, bwd = jit_grads(fn, x, w, 3, dout)
    ref = fn(x, w, 3)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, torch.autograd.grad(ref, (x, w), dout)):
        torch.testing.assert_close(g, r)
    return ref, fwd, bwd


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
    out, (dx, dw), fwd, bwd = jit_grads(attention_like, x, w, NH, dout)
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
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("HS", [64, 7], ids=lambda h: f"HS{h}")
def test_strided_head_inputs_are_read_in_place(dtype, HS):
    """Token-major (B, NH, T, HS) views - what flash attention's backward returns for q, k, v that
    were views of qkv, and its forward output - are read with their strides; mixed layouts fall back
    to contiguous copies. 16-byte (HS 64) and element (HS 7) paths."""
    B, T, NH = 2, 33, 3
    grads = [randn(B, T, NH, HS, dtype=dtype).transpose(1, 2) for _ in range(3)]
    assert not grads[0].is_contiguous()
    ref = torch.cat([ref_merge(g) for g in grads], -1)
    assert_same(kforge._C.split_qkv_backward(*grads), ref,
                "split backward of token-major grads")
    mixed = [grads[0].contiguous(), grads[1], grads[2]]
    assert_same(kforge._C.split_qkv_backward(*mixed), ref, "split backward of mixed layouts")
    assert_same(kforge._C.split_qkv_backward(None, grads[1], None),
                torch.cat([torch.zeros_like(ref_merge(grads[0])), ref_merge(grads[1]),
                           torch.zeros_like(ref_merge(grads[0]))], -1), "split backward, one given")
    y = randn(B, T, NH, HS, dtype=dtype).transpose(1, 2)
    assert_same(kforge._C.merge_heads_forward(y), ref_merge(y).contiguous(),
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
    out, (dx, dw), fwd, bwd = jit_grads(sdpa_like, x, w, NH, dout,
                                        [kforge.executor, *thunder.get_default_executors()])
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
    merged = kforge._C.merge_heads_forward_view(y_tok)
    assert merged.data_ptr() == y_tok.data_ptr()  # a view
    assert_same(merged, ref_merge(y_tok).contiguous(), "merge view")
    y = randn(B, NH, T, HS, dtype=dtype)  # head-major: the kernel
    merged = kforge._C.merge_heads_forward_view(y)
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


@pytest.mark.parametrize("shape,n_head,message", [
    ((2, 4, 32), 4, r"last dim 32 is not 3 \* n_head \* head_size \(n_head=4\); qkv must be \(B, T, 3C\)"),
    ((4, 36), 2, r"qkv has shape \(4, 36\), not \(B, T, 3C\); its last dim must be 3 \* n_head \* head_size"),
    ((2, 3, 4, 36), 2, r"qkv has shape \(2, 3, 4, 36\), not \(B, T, 3C\)"),
    ((2, 4, 36), 0, "n_head=0 is not a positive int"),
    ((2, 4, 36), -2, "n_head=-2 is not a positive int"),
    ((2, 4, 36), 2.0, "n_head=2.0 is not a positive int"),
    ((2, 4, 36), True, "n_head=True is not a positive int"),
])
def test_split_qkv_rejects_bad_inputs(shape, n_head, message):
    """A clear ValueError from the helper and from its Thunder definition (what runs when kforge
    declines), instead of "too many values to unpack" or a reshape error."""
    qkv = torch.randn(shape)
    with pytest.raises(ValueError, match="split_qkv: " + message):
        split_qkv(qkv, n_head)
    with pytest.raises(ValueError, match="split_qkv: " + message):
        thunder.jit(lambda t: split_qkv(t, n_head), executors=[kforge.executor])(qkv)


@pytest.mark.parametrize("shape", [(2, 3, 4), (2, 3, 4, 5, 6), (8,)])
def test_merge_heads_rejects_non_4d(shape):
    y = torch.randn(shape)
    message = r"merge_heads: y has shape .* not \(B, NH, T, HS\)"
    with pytest.raises(ValueError, match=message):
        merge_heads(y)
    with pytest.raises(ValueError, match=message):
        thunder.jit(merge_heads, executors=[kforge.executor])(y)


def test_bindings_take_no_variant():
    """One kernel choice per input (the launcher's); no A/B `variant` keyword."""
    for name in ("split_qkv_forward", "split_qkv_backward", "merge_heads_forward", "merge_heads_backward"):
        assert "variant" not in getattr(kforge._C, name).__doc__, name
    with pytest.raises(TypeError):
        kforge._C.merge_heads_forward(randn(2, 2, 3, 2, device="cpu"), variant=1)


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
    x, w, dout = cpu_inputs(torch.float32)
    ref, fwd, _ = jit_matches_eager(attention_like, x, w, dout)
    assert "kforge_" not in fwd
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
    _, fwd, bwd = jit_matches_eager(attention_like, *cpu_inputs())
    for name in ("kforge_split_qkv_forward", "kforge_merge_heads_forward"):
        assert name in fwd, fwd
    for name in ("kforge_split_qkv_backward", "kforge_merge_heads_backward"):
        assert name in bwd, bwd


def views_like(x, w, n_head):
    q, k, v = split_qkv(x @ w, n_head, copy=False)
    return merge_heads(q * k + v.sin())


def test_thunder_plumbing_split_views(cpu_reference_launchers):
    """copy=False: the views operator forward (plain torch, runs on CPU), the dqkv op backward."""
    _, fwd, bwd = jit_matches_eager(views_like, *cpu_inputs())
    assert "kforge_split_qkv_views" in fwd and "kforge_split_qkv_forward" not in fwd, fwd
    assert "kforge_split_qkv_backward" in bwd, bwd


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_heads_backward_is_a_view_of_contiguous_dout(dtype):
    """The operator's backward returns dout viewed as token-major heads (eager autograd's result, and
    the layout attention's backward reads dO in); a dout that cannot be viewed so gets the copy
    kernel. Values equal the inverse merge either way."""
    _merge_heads_backward_launch = kforge._C.merge_heads_backward_view
    B, T, NH, HS = 2, 33, 3, 64
    dout = randn(B, T, NH * HS, dtype=dtype)
    dy = _merge_heads_backward_launch(dout, NH)
    assert dy.data_ptr() == dout.data_ptr() and dy.shape == (B, NH, T, HS)
    assert dy.stride() == (T * NH * HS, HS, NH * HS, 1)
    ref = dout.view(B, T, NH, HS).transpose(1, 2)
    assert torch.equal(dy, ref)
    strided = randn(B, T, 2 * NH * HS, dtype=dtype)[..., ::2]
    dy2 = _merge_heads_backward_launch(strided, NH)
    assert dy2.is_contiguous() and dy2.data_ptr() != strided.data_ptr()
    assert torch.equal(dy2, strided.reshape(B, T, NH, HS).transpose(1, 2))


# ---- property-based (hypothesis) ----------------------------------------------------------------
_ANY_DTYPE = st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
# 2^16 and 2^31: B * T or a row past 2^31 - 1 (the launcher's int sizes).
_PM_DIM = st.one_of(st.integers(0, 7), st.sampled_from([12, 2**16, 2**31]))
_INT_MAX = 2**31 - 1


@settings(max_examples=200)
@given(shape=st.lists(_PM_DIM, min_size=2, max_size=5).map(tuple), dtype=_ANY_DTYPE, device=st.sampled_from(["cuda", "cpu"]),
       n_head=st.one_of(st.integers(-1, 5), st.sampled_from([2**31, True, 2.0])), copy=st.booleans())
def test_checker_never_accepts_what_the_kernel_cannot_do(shape, dtype, device, n_head, copy):
    """Generated proxies and n_head values for both claims: whatever split_qkv's checker accepts,
    split_qkv_forward / split_qkv_backward take it (CUDA, float dtype, (B, T, 3C) with C a multiple of
    a positive int n_head, B * T and the row <= 2^31 - 1); whatever merge_heads' checker accepts,
    merge_heads_forward / merge_heads_backward take it ((B, NH, T, HS), B * T and NH * HS <= 2^31 - 1);
    neither accepts an empty tensor. Fails if a rule goes (an accepted (2^16, 2^16, 3) qkv would make
    the launcher raise "sizes too large")."""
    with tracectx(TraceCtx()):
        t = proxy(shape, dtype=dtype, device=device)
        split_ok = pm._split_checker(t, n_head, copy=copy) is None
        merge_ok = pm._merge_checker(t) is None
    if split_ok or merge_ok:
        assert device == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16) and 0 not in shape
    if split_ok:
        assert len(shape) == 3 and type(n_head) is int and n_head > 0
        B, T, C3 = shape
        assert C3 % (3 * n_head) == 0 and B * T <= _INT_MAX and C3 <= _INT_MAX
    if merge_ok:
        assert len(shape) == 4
        B, NH, T, HS = shape
        assert B * T <= _INT_MAX and NH * HS <= _INT_MAX


# Head sizes around the 16-byte pack (4 fp32 / 8 16-bit elements: the vector path when HS is a
# multiple) and element-wise ones; T of 1, odd, past a few token tiles; NH 1 to 12.
@gpu
@pytest.mark.sanitize
@settings(max_examples=40, deadline=None)
@given(B=st.sampled_from([1, 2, 3]), T=st.sampled_from([1, 2, 5, 33, 129]), NH=st.sampled_from([1, 2, 3, 5, 12]),
       HS=st.one_of(st.integers(1, 9), st.sampled_from([15, 16, 17, 63, 64, 65])),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       view=st.sampled_from(["contiguous", "misaligned", "strided"]), tiles=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_property_matches_reference(B, T, NH, HS, dtype, view, tiles, seed):
    """Generated (B, T, NH, HS), dtypes and views (offset by one element: the element-wise path; a
    column slice of a wider buffer / heads of the transposed layout: copied or read in place), in the
    token lanes and (forced, as past 4 GiB) the tiles: split and merge, forward and backward, are
    exact copies (float64 adds nothing to a permutation: every element equal to the explicit indexing
    reference). Fails on any misplaced or unwritten (NaN-poisoned) element."""
    with _testing.override("permute", variant=1 if tiles else 0):
        _check_every_permute(B, T, NH, HS, dtype, view, seed)


def _check_every_permute(B, T, NH, HS, dtype, view, seed):
    C = NH * HS

    def laid_out(x):
        if view == "misaligned":
            return torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:].view(x.shape).copy_(x)
        if view == "strided":  # the last dim a slice of a wider row (qkv, dout); heads token-major (y, dq)
            if x.dim() == 3:
                return torch.empty(*x.shape[:2], x.shape[2] + 5, dtype=dtype, device="cuda")[..., :x.shape[2]].copy_(x)
            return x.transpose(1, 2).contiguous().transpose(1, 2)
        return x

    qkv = laid_out(randn(B, T, 3 * C, dtype=dtype, seed=seed))
    for out, ref, name in zip(kforge._C.split_qkv_forward(qkv, NH), ref_split(qkv, NH), "qkv"):
        assert_same(out, ref.contiguous(), f"split {name}")
    grads = [laid_out(randn(B, NH, T, HS, dtype=dtype, seed=seed + p)) for p in (1, 2, 3)]
    assert_same(kforge._C.split_qkv_backward(*grads), torch.cat([ref_merge(g) for g in grads], -1),
                "split backward")
    y = laid_out(randn(B, NH, T, HS, dtype=dtype, seed=seed + 4))
    assert_same(kforge._C.merge_heads_forward(y), ref_merge(y).contiguous(), "merge")
    dout = laid_out(randn(B, T, C, dtype=dtype, seed=seed + 5))
    assert_same(kforge._C.merge_heads_backward(dout, NH),
                dout.reshape(B, T, NH, HS).permute(0, 2, 1, 3).contiguous(), "merge backward")


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("aligned", [True, False], ids=["vec", "elem"])
def test_tiles_every_instantiation(dtype, aligned):
    """The tiles (the plan's layout past 4 GiB), forced at a small odd shape, both directions, 16-byte
    and element-wise: exact copies, and each of the four tile kernels of this dtype launched."""
    with _testing.override("permute", variant=1):
        _check_every_permute(2, 37, 3, 16, dtype, "contiguous" if aligned else "misaligned", seed=7)
    t = conftest.KERNEL_TYPE[dtype]
    v = "true" if aligned else "false"
    launched = conftest.launched("permute")
    for k in ("permute_tokens_to_heads_kernel", "permute_heads_to_tokens_kernel"):
        assert f"{k}<{t}, {v}>" in launched
