"""linear: F.linear at a padded output width for 16-bit weights with a misaligned out_features.

CPU (the op is torch on both sides, so its arithmetic runs anywhere): forward / backward against a
float64 reference, the output's padded row stride, the padded-gradient rules (a buffer is used in
place only when kforge's cross-entropy marked it), checker and filter, thunder.jit fallback on CPU.
GPU: the same numerics in bf16 / fp16, thunder.jit symbols and gradients against eager, and the
GPT-2 head (linear -> cross_entropy) with kforge's cross-entropy consuming the padded logits.

torch.addmm (Hugging Face's Conv1D) becomes kforge_addmm: CPU checks its decomposition against torch
(every beta / alpha / broadcast the decomposition takes, errors as torch's), its checker, and a
Hugging Face GPT-2 traced as on a GPU; the GPU checks the claimed GEMMs against a float64 reference,
autocast included.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
import thunder
from hypothesis import example, given, settings
from hypothesis import strategies as st
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
    claim, prims_claim = op.SPEC.claims[:2]  # thunder.torch.linear and prims.linear (autocast's), one checker
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
    # the fp32 weight's gradient: the backward's GEMM stores fp32 itself (widen_matmuls), no region
    # converts it; a bf16 weight's stays bf16
    lb = next(b for b in traced.backward.bound_symbols if b.sym.name == "kforge_linear_backward")
    want = thunder.dtypes.float32 if autocast else thunder.dtypes.bfloat16
    assert lb.output[1].dtype == want, str(lb)
    for b in traced.backward.bound_symbols:
        if b.sym.name.startswith("kforgeFusion"):
            assert lb.output[1].name not in {p.name for p in b.flat_proxy_args}, str(b)


@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_backward_stores_an_fp32_weight_gradient(dtype, bias):
    """linear_backward(..., dw_dtype=float32): dweight is the padded GEMM's sum stored as fp32 (no
    16-bit rounding), within fp32 accumulation of float64 where the plain backward's is within its
    16-bit rounding; dx and dbias are the plain backward's, bit for bit."""
    x = randn(3, 5, 64, dtype=dtype, device="cpu")
    w = randn(1030, 64, dtype=dtype, device="cpu", scale=0.1)
    g = randn(3, 5, 1030, dtype=dtype, device="cpu")
    dx, dw, db = op.linear_backward_impl(g, x, w, bias, torch.float32)
    dx0, dw0, db0 = op.linear_backward_impl(g, x, w, bias)
    assert dw.dtype == torch.float32 and dw.shape == w.shape and dw.is_contiguous()
    assert torch.equal(dx, dx0) and (db is None) == (not bias) and (db is None or torch.equal(db, db0))
    ref = g.double().reshape(-1, 1030).t() @ x.double().reshape(-1, 64)
    assert_close(dw, ref, torch.float32, "dw fp32")
    assert_close(dw0, ref.to(dtype), dtype, "dw 16-bit")


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


# ---- torch.addmm (Hugging Face's Conv1D) ---------------------------------------------------------------
def _addmm_reference(input, mat1, mat2, g, beta=1, alpha=1):
    """float64 out and gradients (input, mat1, mat2) of torch.addmm."""
    a = [t.detach().double().requires_grad_() for t in (input, mat1, mat2)]
    out = torch.addmm(*a, beta=beta, alpha=alpha)
    out.backward(g.double())
    return out.detach(), *(t.grad for t in a)


def _addmm_names(jf) -> tuple[list[str], list[str]]:
    return ([b.sym.name for b in thunder.last_traces(jf)[-1].bound_symbols],
            [b.sym.name for b in thunder.last_backward_traces(jf)[-1].bound_symbols])


@pytest.mark.parametrize("beta,alpha", [(1, 1), (0.5, 2.0), (0, 1), (1, -0.25)])
@pytest.mark.parametrize("bias_shape", [(13,), (1, 13), (5, 1), (5, 13), ()], ids=str)
def test_addmm_decomposition_cpu(bias_shape, beta, alpha):
    """On the CPU kforge declines the GEMM and the decomposition runs: values and every gradient
    match torch's float64 addmm, and Thunder's auto-registered addmm (whose backward recomputes the
    forward through torch.autograd.functional.vjp) is gone from both traces."""
    input = torch.randn(bias_shape, dtype=torch.float64, requires_grad=True)
    mat1 = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    mat2 = torch.randn(7, 13, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, 13, dtype=torch.float64)

    def fn(i, a, b):
        return torch.addmm(i, a, b, beta=beta, alpha=alpha)

    jf = kforge.jit(fn)
    args = [t.detach().clone().requires_grad_() for t in (input, mat1, mat2)]
    out = jf(*args)
    out.backward(g)
    ref = _addmm_reference(input, mat1, mat2, g, beta, alpha)
    torch.testing.assert_close(out, ref[0])
    for got, want, name in zip(args, ref[1:], ("input", "mat1", "mat2")):
        if beta == 0 and name == "input":
            assert got.grad is None or not got.grad.any(), "beta = 0: input gets no gradient"
            continue
        torch.testing.assert_close(got.grad, want, msg=f"grad {name}")
    fwd, bwd = _addmm_names(jf)
    assert not [n for n in fwd + bwd if "addmm" in n and not n.startswith("kforge_")], (fwd, bwd)
    assert "matmul" in fwd and bwd.count("matmul") == 2


def test_addmm_errors_as_torch_does():
    """What torch.addmm rejects, kforge_addmm rejects with a message naming addmm and the problem."""
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with pytest.raises(RuntimeError):
        torch.addmm(torch.randn(3, dtype=torch.float64), a, b)
    for bad, what in (((torch.randn(3, dtype=torch.float64), a, b), "dtypes differ"),
                      ((torch.randn(3), torch.randn(2, 4, 8), b), "matrices"),
                      ((torch.randn(3), a, torch.randn(7, 3)), "cannot be multiplied")):
        with pytest.raises(RuntimeError, match=f"addmm: .*{what}"):
            kforge.jit(lambda i, x, y: torch.addmm(i, x, y))(*bad)


def test_addmm_checker():
    claim = next(c for c in op.SPEC.claims if c.symbol is op.kforge_addmm)
    with tracectx(TraceCtx()):
        x, w, bias = proxy(128, 768), proxy(768, 2304), proxy(2304)
        assert claim.checker(bias, x, w) is None
        assert claim.checker(proxy(1, 2304), x, w) is None and claim.checker(proxy(128, 2304), x, w) is None
        assert claim.checker(proxy(128, 1), x, w) is None
        assert claim.checker(proxy(2304, dtype=torch.float16), proxy(128, 768, dtype=torch.float16),
                             proxy(768, 2304, dtype=torch.float16)) is None
        f32 = functools.partial(proxy, dtype=torch.float32)
        assert "16 bits" in claim.checker(f32(2304), f32(128, 768), f32(768, 2304))
        assert "beta" in claim.checker(bias, x, w, beta=0.5)
        assert "beta" in claim.checker(bias, x, w, alpha=2)
        assert "beta" in claim.checker(bias, x, w, beta=True)
        assert "not CUDA" in claim.checker(proxy(2304, device="cpu"), proxy(128, 768, device="cpu"),
                                           proxy(768, 2304, device="cpu"))
        assert "dtype" in claim.checker(proxy(2304, dtype=torch.float16), x, w)
        assert "not a matrix product" in claim.checker(bias, x, proxy(767, 2304))
        assert "not a matrix product" in claim.checker(bias, proxy(2, 128, 768), w)
        assert "broadcast" in claim.checker(proxy(2303), x, w)
        assert "broadcast" in claim.checker(proxy(3, 128, 2304), x, w)
        assert "not a tensor" in claim.checker(1.0, x, w)


_ADDMM_DIM = st.one_of(st.integers(0, 5), st.sampled_from([7, 64]))
_ADDMM_SHAPE = st.lists(_ADDMM_DIM, min_size=0, max_size=3).map(tuple)
_ADDMM_DTYPE = st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int64])
_ADDMM_SCALAR = st.sampled_from([1, 1.0, 0, 0.5, -1, True, 2])


@settings(max_examples=300)
@given(shapes=st.tuples(_ADDMM_SHAPE, _ADDMM_SHAPE, _ADDMM_SHAPE),
       dtypes=st.one_of(st.tuples(*[st.sampled_from([torch.bfloat16, torch.float16])] * 3),
                        st.tuples(_ADDMM_DTYPE, _ADDMM_DTYPE, _ADDMM_DTYPE)),
       device=st.sampled_from(["cuda", "cuda", "cpu"]), beta=_ADDMM_SCALAR, alpha=_ADDMM_SCALAR)
@example(shapes=((64,), (7, 5), (5, 64)), dtypes=(torch.bfloat16,) * 3, device="cuda", beta=1, alpha=1)
def test_addmm_checker_never_accepts_what_torch_addmm_cannot_do(shapes, dtypes, device, beta, alpha):
    """Generated proxies (0-D to 3-D, empty, broadcastable or not), dtypes, devices and beta / alpha:
    whatever the addmm checker accepts, torch.addmm takes (on meta tensors of those shapes and dtypes,
    giving (n, p)), in 16 bits on CUDA, with beta = alpha = 1 -- the only call its grad transform
    differentiates."""
    claim = next(c for c in op.SPEC.claims if c.symbol is op.kforge_addmm)
    with tracectx(TraceCtx()):
        args = [conftest.proxy(sh, dtype=dt, device=device) for sh, dt in zip(shapes, dtypes)]
        if claim.checker(*args, beta=beta, alpha=alpha) is not None:
            return
    assert device == "cuda" and set(dtypes) <= {torch.bfloat16, torch.float16} and len(set(dtypes)) == 1
    assert type(beta) in (int, float) and beta == 1 and type(alpha) in (int, float) and alpha == 1
    input, mat1, mat2 = (torch.empty(sh, dtype=dt, device="meta") for sh, dt in zip(shapes, dtypes))
    assert torch.addmm(input, mat1, mat2).shape == (mat1.shape[0], mat2.shape[1])


def _hf_gpt2(dtype, autocast):
    """A two-layer Hugging Face GPT2LMHeadModel factory (its attention and MLP layers are Conv1D,
    torch.addmm), dropout off."""
    transformers = pytest.importorskip("transformers")
    from kforge.zoo._build import build

    cfg = transformers.GPT2Config(vocab_size=512, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                  attn_implementation="sdpa", bos_token_id=0, eos_token_id=0)

    def make(device="cuda", seed=0):
        torch.manual_seed(seed)
        model = build(transformers.GPT2LMHeadModel, cfg, device=device, dtype=None if autocast else dtype)
        model.train()
        idx = torch.randint(0, cfg.vocab_size, (2, 32), device=device)
        return model, {"input_ids": idx, "labels": idx}, {"autocast": dtype if autocast else None}

    return make


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_hf_gpt2_conv1d_layers_claimed(autocast):
    """Traced as on a GPU: every Conv1D layer of Hugging Face's GPT-2 is one kforge_addmm_forward on
    16-bit operands; the backward computes each weight's gradient as mat1^T @ g, in the weight's own
    (in, out) shape, and nothing of Thunder's auto-registered addmm is left."""
    from conftest import fake_cuda_trace

    # gemm=False: the claim itself, before kforge.ops.gemm renames it (tests/test_gemm.py covers that).
    traced = fake_cuda_trace(_hf_gpt2(torch.bfloat16, autocast), jit=functools.partial(kforge.jit, gemm=False),
                             dynamo=False)
    fwd = [b for b in traced.forward.bound_symbols if b.sym.name == "kforge_addmm_forward"]
    assert len(fwd) == 4 * 2  # c_attn, attn.c_proj, c_fc, mlp.c_proj per layer
    for b in fwd:
        assert all(t.dtype == thunder.dtypes.bfloat16 for t in b.args), [t.dtype for t in b.args]
    names = [b.sym.name for b in traced.forward.bound_symbols + traced.backward.bound_symbols]
    assert not [n for n in names if "addmm" in n and n != "kforge_addmm_forward"], names
    weights = {tuple(b.args[2].shape) for b in fwd}
    # (autocast: kforge_matmul_widen, the GEMM that stores the fp32 parameter's gradient directly)
    made = {tuple(b.output.shape) for b in traced.backward.bound_symbols
            if b.sym.name in ("matmul", "kforge_matmul_widen")}
    assert weights <= made, (weights, made)


def test_hf_gpt2_dynamo_path_keeps_conv1d_in_thunder():
    """kforge.compile (Thunder's Dynamo path) of Hugging Face's GPT-2 on the CPU: the splitter keeps
    torch.addmm in Thunder (not Inductor, where Thunder's automatic fallback would send it), and loss
    and gradients equal eager's."""
    pytest.importorskip("transformers")
    from kforge.zoo import hf_gpt2

    model, inputs, _ = hf_gpt2.make(size="micro", batch=2, seq=16, device="cpu", dtype=torch.float32)
    ref = model(**inputs).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    compiled = kforge.compile(model)
    loss = compiled(**inputs).loss
    loss.backward()
    reasons = [r.info for info in compiled.backend.subgraph_infos for r in info.split_reasons]
    assert compiled.backend.subgraph_infos and not [r for r in reasons if "addmm" in r], reasons
    torch.testing.assert_close(loss, ref)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n, atol=1e-6, rtol=1e-5)


@gpu
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("bias_shape", [(96,), (1, 96), (37, 96)], ids=str)
@pytest.mark.parametrize("gemm", [False, True], ids=["torch-gemm", "kforge-gemm"])
def test_addmm_forward_backward(dtype, bias_shape, gemm):
    """kforge_addmm on CUDA: forward and gradients against float64, the weight's gradient contiguous
    in its (in, out) layout; its GEMMs on torch's matmul, or all on kforge's cuBLASLt plans (gemm)."""
    input = randn(*bias_shape, dtype=dtype).requires_grad_()
    mat1 = randn(37, 72, dtype=dtype).requires_grad_()
    mat2 = randn(72, 96, dtype=dtype, scale=0.1).requires_grad_()
    g = randn(37, 96, dtype=dtype)
    jf = kforge.jit(lambda i, a, b: torch.addmm(i, a, b), gemm=gemm)
    out = jf(input, mat1, mat2)
    out.backward(g)
    fwd, bwd = _addmm_names(jf)
    if gemm:
        assert "kforge_gemm_addmm" in fwd and "matmul" not in bwd and "kforge_gemm_views" in bwd, (fwd, bwd)
    else:
        assert "kforge_addmm_forward" in fwd and bwd.count("matmul") == 2, (fwd, bwd)
    ref = _addmm_reference(input, mat1, mat2, g)
    tol = 2 * conftest.REL_TOL[dtype]
    assert out.dtype == dtype
    assert_close(out, ref[0], dtype, "out", tol=tol)
    for t, want, name in zip((input, mat1, mat2), ref[1:], ("input", "mat1", "mat2")):
        assert_close(t.grad, want, dtype, f"grad {name}", tol=tol)
    assert mat2.grad.is_contiguous()


@gpu
@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
def test_hf_gpt2_matches_eager(autocast):
    """Hugging Face's GPT-2 under kforge.jit against eager: loss and every parameter's gradient."""
    make = _hf_gpt2(torch.bfloat16, autocast)
    model, inputs, options = make()
    ref_model, _, _ = make()
    ctx = (lambda: torch.autocast("cuda", torch.bfloat16)) if autocast else __import__("contextlib").nullcontext
    jm = kforge.jit(model)
    with ctx():
        loss = jm(**inputs).loss
        ref = ref_model(**inputs).loss
    loss.backward()
    ref.backward()
    names = symbol_names(thunder.last_traces(jm)[-1])
    # Conv1D's addmm on a plan, its result's view folded in where one follows (every one under autocast)
    assert names & {"kforge_gemm_addmm", "kforge_gemm_addmm_views"} and "addmm" not in names, names
    assert_close(loss, ref, torch.bfloat16, "loss", tol=2 * conftest.REL_TOL[torch.bfloat16])
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        # bf16 rounding differs between the two programs: compare against the gradient's own scale.
        scale = q.grad.float().abs().max().item() + 1e-6
        err = (p.grad.float() - q.grad.float()).abs().max().item()
        assert err <= 0.05 * scale, f"{name}: max error {err:.3g} against gradient scale {scale:.3g}"
        assert p.grad.stride() == q.grad.stride(), name
