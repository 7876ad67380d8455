"""linear: F.linear at a padded output width for 16-bit weights with a misaligned out_features.

CPU (the op is torch on both sides, so its arithmetic runs anywhere): forward / backward against a
float64 reference, the output's padded row stride, the padded-gradient rules (a buffer is used in
place only when kforge's cross-entropy marked it), checker and filter, thunder.jit fallback on CPU.
GPU: the same numerics in bf16 / fp16, thunder.jit symbols and gradients against eager, and the
GPT-2 head (linear -> cross_entropy) with kforge's cross-entropy consuming the padded logits.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
import thunder
from thunder.core.trace import TraceCtx, tracectx

import kforge
from kforge import _thunder
from kforge.ops import linear as op
import conftest
from conftest import assert_close, check_jit_matches_eager, gpu, randn, symbol_names

proxy = functools.partial(conftest.proxy, dtype=torch.bfloat16)
HALF = [torch.bfloat16, torch.float16]


def reference(x, w, b, g):
    """float64 out, dx, dw, db of F.linear."""
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = None if b is None else b.double().requires_grad_()
    out = F.linear(x64, w64, b64)
    out.backward(g.double())
    return out.detach(), x64.grad, w64.grad, None if b is None else b64.grad


def check(x, w, b, g, what=""):
    dtype = x.dtype
    n = w.shape[0]
    out = op.linear_forward_impl(x, w, b)
    dx, dw, db = op.linear_backward_impl(g, x, w, b is not None)
    ref_out, ref_dx, ref_dw, ref_db = reference(x, w, b, g)
    # The output is a view of the padded-width result: no copy of the logits.
    assert out.shape == (*x.shape[:-1], n) and out.stride(-2) == op.padded(n) and out.stride(-1) == 1
    assert dw.shape == w.shape and dx.shape == x.shape and dw.is_contiguous()
    tol = 2 * conftest.REL_TOL[dtype] if dtype != torch.float32 else 1e-5
    assert_close(out, ref_out, dtype, f"out {what}", tol=tol)
    assert_close(dx, ref_dx, dtype, f"dx {what}", tol=tol)
    assert_close(dw, ref_dw, dtype, f"dw {what}", tol=tol)
    if b is not None:
        assert_close(db, ref_db, dtype, f"db {what}", tol=tol)
    else:
        assert db is None


# (x shape, out_features): GPT-2's head (rows of 768 -> 50257), a 3-D input, an out_features 4 past
# a multiple of 8, one just above MIN_OUT.
SHAPES = [((64, 768), 50257), ((2, 5, 768), 50257), ((33, 64), 1028), ((7, 16), 1031)]


def shape_id(s):
    return "x".join(map(str, s[0])) + f"-{s[1]}"


# ---- CPU -----------------------------------------------------------------------------------------
def test_padded_width():
    assert op.padded(50257) == 50304 and op.padded(1031) == 1088 and op.padded(1024) == 1024


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES[2:], ids=shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_forward_backward_cpu(dtype, shape, bias):
    xs, n = shape
    x = randn(*xs, dtype=dtype, device="cpu")
    w = randn(n, xs[-1], dtype=dtype, device="cpu", scale=0.1)
    b = randn(n, dtype=dtype, device="cpu") if bias else None
    g = randn(*xs[:-1], n, dtype=dtype, device="cpu")
    check(x, w, b, g, str(shape))


def test_padded_gradient_used_in_place_only_when_marked():
    m, n = 6, 1031
    npad = op.padded(n)
    buf = torch.zeros(m, npad)
    buf[:, :n] = torch.randn(m, n)
    g = buf[:, :n]
    # Not marked: a copy, whatever the buffer holds past column n.
    assert op._padded_grad(g, n).data_ptr() != buf.data_ptr()
    op.mark_zero_padded(g)
    gp = op._padded_grad(g, n)
    assert gp.data_ptr() == buf.data_ptr() and gp.shape == (m, npad)
    # A view of the marked buffer that is not its first n columns is copied.
    assert op._padded_grad(buf[1:, :n], n).data_ptr() != buf.data_ptr()
    # A contiguous gradient is padded by a copy with zeros.
    c = torch.randn(m, n)
    cp = op._padded_grad(c, n)
    assert cp.shape == (m, npad) and torch.equal(cp[:, :n], c) and not cp[:, n:].any()


def test_dead_marks_are_not_trusted():
    m, n = 4, 1031
    buf = torch.zeros(m, op.padded(n))
    op.mark_zero_padded(buf[:, :n])
    ptr = buf.data_ptr()
    del buf
    # The mark died with the buffer: a new one at the same address (allocators reuse memory) is copied.
    assert op._zero_padded[ptr]() is None
    other = torch.full((m, op.padded(n)), float("nan"))
    assert op._padded_grad(other[:, :n], n).data_ptr() != other.data_ptr()


def test_unmarked_buffer_with_nan_padding_gives_finite_gradients():
    m, k, n = 5, 16, 1031
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.1
    buf = torch.full((m, op.padded(n)), float("nan"))
    buf[:, :n] = torch.randn(m, n)
    dx, dw, _ = op.linear_backward_impl(buf[:, :n], x, w, False)
    torch.testing.assert_close(dx, buf[:, :n] @ w)
    torch.testing.assert_close(dw, buf[:, :n].t() @ x)


def test_checker_and_filter():
    claim, prims_claim = op.SPEC.claims  # thunder.torch.linear and prims.linear (autocast's), one checker
    assert (prims_claim.checker, prims_claim.applies) == (claim.checker, claim.applies)
    with tracectx(TraceCtx()):
        x, w = proxy(8192, 768), proxy(50257, 768)
        assert claim.applies(x, w) and claim.checker(x, w) is None
        assert claim.checker(x, w, proxy(50257)) is None
        assert claim.checker(proxy(8192, 768, dtype=torch.float16), proxy(50257, 768, dtype=torch.float16)) is None
        # Aligned widths are not this op's kind at all: no decline is logged for them.
        assert not claim.applies(x, proxy(2304, 768))
        assert not claim.applies(proxy(8, 768, dtype=torch.float32), proxy(50257, 768, dtype=torch.float32))
        assert "16-bit" in claim.checker(proxy(8, 768, dtype=torch.float32), proxy(50257, 768))
        assert "too small" in claim.checker(proxy(8, 768), proxy(101, 768))
        assert "in_features" in claim.checker(proxy(8, 770), proxy(50257, 770))
        assert "not CUDA" in claim.checker(proxy(8, 768, device="cpu"), proxy(50257, 768, device="cpu"))
        assert "dtype" in claim.checker(x, proxy(50257, 768, dtype=torch.float16))
        assert "bias" in claim.checker(x, w, proxy(50256))
        assert "linear layer" in claim.checker(proxy(8, 768), proxy(50257, 512))


def test_cpu_fallback():
    x = torch.randn(4, 768, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(1031, 768) * 0.05).to(torch.bfloat16).requires_grad_()
    jx, jw = (t.detach().clone().requires_grad_() for t in (x, w))
    _thunder.reset_declines()
    jf = thunder.jit(F.linear, executors=[kforge.executor])
    out, ref = jf(jx, jw), F.linear(x, w)
    out.float().sum().backward()
    ref.float().sum().backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(jw.grad, w.grad)
    assert any("not CUDA" in r for r in _thunder.declines()["linear"])


# ---- GPU -----------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_forward_backward(dtype, shape, bias):
    xs, n = shape
    x, w = randn(*xs, dtype=dtype), randn(n, xs[-1], dtype=dtype, scale=0.05)
    b = randn(n, dtype=dtype) if bias else None
    check(x, w, b, randn(*xs[:-1], n, dtype=dtype), str(shape))


@gpu
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_thunder_jit(dtype, bias):
    x = randn(3, 7, 768, dtype=dtype).requires_grad_()
    w = randn(50257, 768, dtype=dtype, scale=0.05).requires_grad_()
    if bias:
        def fn(x, w, b):
            return F.linear(x, w, b) * 2

        args = [x, w, randn(50257, dtype=dtype).requires_grad_()]
    else:
        def fn(x, w):
            return F.linear(x, w) * 2

        args = [x, w]
    check_jit_matches_eager(fn, args, dtype, "kforge_linear_forward", "kforge_linear_backward")


@gpu
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_head_with_cross_entropy_uses_the_padded_logits(dtype):
    """GPT-2's head: linear -> view -> cross_entropy. kforge's cross-entropy reads the padded logits
    in place and returns their gradient in the padded layout, which the linear's backward then uses
    without a copy; loss and gradients match eager."""
    def head(x, w, t):
        logits = F.linear(x, w)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), t.view(-1), ignore_index=-1)

    x = randn(2, 64, 768, dtype=dtype).requires_grad_()
    w = randn(50257, 768, dtype=dtype, scale=0.05).requires_grad_()
    t = torch.randint(0, 50257, (2, 64), device="cuda")
    t[0, :3] = -1
    jx, jw = (a.detach().clone().requires_grad_() for a in (x, w))
    jf = thunder.jit(head, executors=conftest.kforge_executors())
    loss, ref = jf(jx, jw, t), head(x, w, t)
    loss.backward()
    ref.backward()
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert {"kforge_linear_forward", "kforge_cross_entropy_forward"} <= symbol_names(fwd)
    assert {"kforge_linear_backward", "kforge_cross_entropy_backward"} <= symbol_names(bwd)
    tol = 2 * conftest.REL_TOL[dtype]
    assert_close(loss, ref, dtype, "loss", tol=tol)
    assert_close(jx.grad, x.grad, dtype, "dx", tol=tol)
    assert_close(jw.grad, w.grad, dtype, "dw", tol=tol)


@gpu
def test_fp32_and_aligned_layers_stay_with_torch():
    def fn(x, w):
        return F.linear(x, w)

    for dtype, n in ((torch.float32, 50257), (torch.bfloat16, 2304)):
        x, w = randn(4, 768, dtype=dtype), randn(n, 768, dtype=dtype)
        jf = thunder.jit(fn, executors=[kforge.executor])
        torch.testing.assert_close(jf(x, w), fn(x, w))
        assert "kforge_linear_forward" not in symbol_names(thunder.last_traces(jf)[-1])


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_claimed_under_autocast(autocast):
    """Thunder's autocast writes an fp32 layer's linear as prims.linear on the bf16 casts: kforge
    claims it there too (forward and backward), as it claims thunder.torch.linear of bf16 weights."""
    from conftest import fake_cuda_trace

    def make(device="cuda"):
        layer = torch.nn.Linear(64, 1030, bias=False, device=device,
                                dtype=torch.float32 if autocast else torch.bfloat16)
        x = torch.randn(4, 64, device=device, dtype=torch.float32 if autocast else torch.bfloat16)
        return layer, (x,), {"autocast": torch.bfloat16 if autocast else None}

    traced = fake_cuda_trace(make, jit=kforge.jit)
    fwd = [b.sym.name for b in traced.forward.bound_symbols]
    bwd = [b.sym.name for b in traced.backward.bound_symbols]
    assert "kforge_linear_forward" in fwd and "kforge_linear_backward" in bwd, (fwd, bwd)


# ---- fp32 layers read by an add: the bias goes to the add (LinearBiasSplit) ---------------------------
class _Block(torch.nn.Module):
    """x + proj(gelu(fc(x))) with an extra layer whose output is read by a view (not split)."""

    def __init__(self, c: int = 32):
        super().__init__()
        self.fc, self.proj, self.qkv = torch.nn.Linear(c, 4 * c), torch.nn.Linear(4 * c, c), torch.nn.Linear(c, 3 * c)

    def forward(self, x):
        y = x + self.proj(F.gelu(self.fc(x)))
        return y, self.qkv(y).view(*y.shape[:-1], 3, -1)


def _block_factory(dtype=torch.float32, autocast=False, device="cuda", **_):
    from kforge.zoo._build import build

    torch.manual_seed(0)
    m = build(_Block, device=device, dtype=torch.float32 if autocast else dtype)
    x = torch.randn(2, 5, 32, device=device, dtype=torch.float32 if autocast else dtype, requires_grad=True)
    return m, (x,), {"autocast": torch.bfloat16 if autocast else None}


def _linears(trace):
    """(layers with a bias, layers without) among the trace's F.linear / prims.linear symbols."""
    with_bias = without = 0
    for b in trace.bound_symbols:
        if b.sym.name == "linear":
            x, w, bias = op._layer(b)
            with_bias += bias is not None
            without += bias is None
    return with_bias, without


@pytest.mark.parametrize("dtype, autocast, fusion, split", [
    (torch.float32, False, True, 1),    # only proj (read by the residual add); fc feeds gelu, qkv a view
    (torch.bfloat16, False, True, 0),   # 16-bit layers keep cuBLAS's bias epilogue
    (torch.float32, True, True, 0),     # under autocast the layers run in bf16
    (torch.float32, False, False, 0),   # without kforge's fusion executor the add would be a torch kernel
], ids=["fp32", "bf16", "autocast", "no-fusion"])
def test_bias_split_only_where_the_add_fuses(dtype, autocast, fusion, split):
    from kforge.ops.linear import LinearBiasSplit

    def jit(fn):
        jfn = kforge.jit(fn, fusion=fusion)
        (t,) = [t for t in thunder.compile_data(jfn).transforms if isinstance(t, LinearBiasSplit)]
        jit.t = t
        return jfn

    ft = conftest.fake_cuda_trace(functools.partial(_block_factory, dtype=dtype, autocast=autocast), jit=jit)
    assert jit.t.splits == split
    traces = thunder.last_traces(ft.fn)
    # after the pre-prologue transforms: layers with a bias, layers without
    after = next(tr for tr in traces if "linear bias split" in str(tr.get_provenance())) if split else traces[0]
    assert _linears(after) == (3 - split, split)


@gpu
def test_bias_split_layers_match_eager():
    """fp32 on a GPU: the split block's outputs and every gradient against eager (the split changes
    where the bias is added, not the values beyond rounding)."""
    import copy

    from kforge.ops.linear import LinearBiasSplit

    m, (x,), _ = _block_factory(device="cuda")
    jm = kforge.jit(copy.deepcopy(m))
    xj = x.detach().clone().requires_grad_()
    (y, q), (ry, rq) = jm(xj), m(x)
    ((y * 1.5).sum() + q.sum()).backward()
    ((ry * 1.5).sum() + rq.sum()).backward()
    (t,) = [t for t in thunder.compile_data(jm).transforms if isinstance(t, LinearBiasSplit)]
    assert t.splits == 1
    torch.testing.assert_close(y, ry, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xj.grad, x.grad, rtol=1e-5, atol=1e-5)
    for (name, p), rp in zip(jm.named_parameters(), m.parameters()):
        torch.testing.assert_close(p.grad, rp.grad, rtol=1e-4, atol=1e-5, msg=name)
