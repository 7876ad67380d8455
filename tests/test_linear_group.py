"""linear_group: bias-free linear layers of one input as one GEMM forward and two backward.

CPU: the forward / backward implementations against float64 autograd (fp32, bf16: the GEMMs fall
back to ATen off the GPU), the checker, the pattern in traces of users' models (q / k / v grouped,
SwiGLU's projections and near misses not). GPU: the same implementations on cuBLASLt plans, the helper
and the pattern under thunder.jit / kforge.jit against eager, generated shapes.
"""
from __future__ import annotations

import collections
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kforge
from kforge.ops import linear_group as op
from kforge.transforms import ALL_KINDS, OPT_IN_KINDS
import conftest
from conftest import assert_close, check_jit_matches_eager, fake_cuda_trace, gpu, randn

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
# The pattern is opt-in (kforge.transforms.OPT_IN_KINDS): every test that wants it asks for it.
jit = functools.partial(kforge.jit, kinds=ALL_KINDS + OPT_IN_KINDS)


def check_impl(m: int, k: int, widths: tuple[int, ...], dtype: torch.dtype, device: str,
               lead: tuple[int, ...] = ()) -> None:
    """forward_impl / backward_impl against float64 autograd of the separate linears."""
    x = randn(*lead, m, k, dtype=dtype, device=device)
    ws = [randn(n, k, dtype=dtype, device=device, scale=k ** -0.5) for n in widths]
    grads = [randn(*lead, m, n, dtype=dtype, device=device) for n in widths]
    outs = op.forward_impl(x, ws)
    dx, *dws = op.backward_impl(grads, x, ws)
    x64 = x.double().requires_grad_()
    w64 = [w.double().requires_grad_() for w in ws]
    ref = [F.linear(x64, w) for w in w64]
    torch.autograd.backward(ref, [g.double() for g in grads])
    assert len(outs) == len(widths) and len(dws) == len(widths)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.dtype == dtype
        assert_close(o, r, dtype, f"output {i}", tol=TOL[dtype])
    assert_close(dx, x64.grad, dtype, "dx", tol=TOL[dtype])
    for i, (dw, w) in enumerate(zip(dws, w64)):
        assert dw.is_contiguous(), f"dweight {i} is a strided view"
        assert_close(dw, w.grad, dtype, f"dweight {i}", tol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(37, 24, (16, 8, 8)), (1, 5, (3, 1)), (64, 48, (48, 16, 16, 8))],
                         ids=lambda s: f"{s[0]}x{s[1]}x{'+'.join(map(str, s[2]))}")
def test_impl_matches_float64_cpu(dtype, shape):
    m, k, widths = shape
    check_impl(m, k, widths, dtype, "cpu", lead=(2,))


def test_outputs_are_column_blocks_of_one_product():
    # What the pattern relies on: each output's last dim splits into heads as a view.
    x, ws = torch.randn(3, 5, 8), [torch.randn(4, 8), torch.randn(2, 8)]
    q, k = op.forward_impl(x, ws)
    assert q.data_ptr() + 4 * q.element_size() == k.data_ptr() and q.stride() == (30, 6, 1)
    assert q.view(3, 5, 2, 2)._base is not None


def test_checker(trace_ctx):
    proxy = functools.partial(conftest.proxy, dtype=torch.bfloat16)
    x = proxy(8, 16, 32)
    ok = (proxy(32, 32), proxy(8, 32))
    assert op._check(x, ok) is None
    assert "two or more" in op._check(x, (proxy(32, 32),))
    assert "is not (n, 32)" in op._check(x, (proxy(32, 32), proxy(8, 31)))
    assert "dtype" in op._check(x, (proxy(32, 32), conftest.proxy(8, 32, dtype=torch.float16)))
    assert "CUDA" in op._check(conftest.proxy(8, 32, device="cpu", dtype=torch.bfloat16), ok)


def _symbols(trace) -> collections.Counter:
    return collections.Counter(b.sym.name for b in trace.bound_symbols)


def test_plain_llama_groups_qkv_not_the_mlp():
    from kforge.zoo import plain_llama

    make = functools.partial(plain_llama.make, size="tiny", dtype=torch.bfloat16, batch=2, seq=64)
    ft = fake_cuda_trace(make, jit=jit)
    fwd, bwd = _symbols(ft.forward), _symbols(ft.backward)
    n = fwd["kforge_linear_group_forward"]
    assert n == plain_llama.SIZES["tiny"]["n_layer"] and bwd["kforge_linear_group_backward"] == n
    # Per layer: q / k / v grouped; wo, w1, w2, w3 and the lm_head stay single GEMMs (the lm_head's
    # with the logits' row view folded in).
    assert fwd["kforge_gemm_linear"] == 4 * n and fwd["kforge_gemm_linear_views"] == 1
    rewrites = [r for r in ft.fn.llama_patterns.rewrites if r.match.kind == "linear_group"]
    assert len(rewrites) == n and all(r.applied for r in rewrites)
    assert all(len(r.match.args[1]) == 3 for r in rewrites)


def test_hf_llama_groups_qkv():
    from kforge.zoo import hf_llama

    # Thunder's Dynamo path: the FX graph's linears and views.
    ft = fake_cuda_trace(functools.partial(hf_llama.make, size="tiny", batch=2, seq=32),
                         jit=functools.partial(kforge.transforms.jit, kinds=ALL_KINDS + OPT_IN_KINDS))
    n = _symbols(ft.forward)["kforge_linear_group_forward"]
    assert n >= 1 and _symbols(ft.backward)["kforge_linear_group_backward"] == n


class _Projections(nn.Module):
    """q / k / v of one input, heads split by view, plus near misses the pattern leaves alone."""

    def __init__(self, c: int, hq: int, hkv: int, d: int, *, bias: bool = False, mlp: bool = False):
        super().__init__()
        self.hq, self.hkv, self.d = hq, hkv, d
        self.wq = nn.Linear(c, hq * d, bias=bias)
        self.wk = nn.Linear(c, hkv * d, bias=False)
        self.wv = nn.Linear(c, hkv * d, bias=False)
        self.mlp = mlp

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.hq, self.d).transpose(1, 2)
        k = self.wk(x).view(B, T, self.hkv, self.d).transpose(1, 2)
        v = self.wv(x)
        v = F.silu(v) if self.mlp else v.view(B, T, self.hkv, self.d).transpose(1, 2)
        return q, k, v


def _kinds(build) -> list:
    from kforge.zoo._build import build as zoo_build

    def make(device="cuda"):
        model = zoo_build(build, device=device, dtype=torch.bfloat16)
        return model, (torch.randn(2, 8, 32, device=device, dtype=torch.bfloat16),), {}

    ft = fake_cuda_trace(make, jit=jit)
    return [(r.match.kind, len(r.match.args[1]), r.applied) for r in ft.fn.llama_patterns.rewrites
            if r.match.kind == "linear_group"]


def test_opt_in():
    from kforge.zoo import plain_llama

    make = functools.partial(plain_llama.make, size="tiny", dtype=torch.bfloat16, batch=2, seq=64)
    assert "linear_group" not in ALL_KINDS
    ft = fake_cuda_trace(make, jit=kforge.jit)
    assert _symbols(ft.forward)["kforge_linear_group_forward"] == 0


def test_pattern_and_near_misses():
    mk = functools.partial(_Projections, 32, 4, 2, 8)
    assert _kinds(mk) == [("linear_group", 3, True)]
    # v read by something else than a head split: q and k still grouped.
    assert _kinds(functools.partial(mk, mlp=True)) == [("linear_group", 2, True)]
    # a bias on q: k and v grouped.
    assert _kinds(functools.partial(mk, bias=True)) == [("linear_group", 2, True)]


# ---- GPU ------------------------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1024, 768, (768, 256, 256)), (37, 40, (24, 8, 8)), (1, 8, (8, 8))],
                         ids=lambda s: f"{s[0]}x{s[1]}x{'+'.join(map(str, s[2]))}")
def test_impl_matches_float64(dtype, shape):
    m, k, widths = shape
    check_impl(m, k, widths, dtype, "cuda", lead=(3,))


@gpu
@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 300), k=st.integers(1, 200), widths=st.lists(st.integers(1, 96), min_size=2, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_generated_shapes(m, k, widths, dtype):
    check_impl(m, k, tuple(widths), dtype, "cuda")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_helper_under_thunder_jit(dtype):
    def fn(x, wq, wk, wv):
        return op.linear_group(x, (wq, wk, wv))

    args = [randn(2, 33, 64, dtype=dtype).requires_grad_()] + [
        (randn(n, 64, dtype=dtype) * 0.125).requires_grad_() for n in (64, 16, 16)]
    check_jit_matches_eager(fn, args, dtype, "kforge_linear_group_forward", "kforge_linear_group_backward")


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_projections_under_kforge_jit(dtype):
    torch.manual_seed(0)
    model = _Projections(48, 6, 2, 8).cuda().to(dtype)
    ref_model = _Projections(48, 6, 2, 8).cuda().to(dtype)
    ref_model.load_state_dict(model.state_dict())
    x = randn(2, 19, 48, dtype=dtype).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    jm = jit(model)
    outs, refs = jm(x), ref_model(x_ref)
    gs = [randn(*o.shape, dtype=dtype) for o in refs]
    torch.autograd.backward(outs, gs)
    torch.autograd.backward(refs, gs)
    import thunder

    assert "kforge_linear_group_forward" in str(thunder.last_traces(jm)[-1])
    for o, r in zip(outs, refs):
        assert_close(o, r.double(), dtype, "output", tol=2 * TOL[dtype])
    assert_close(x.grad, x_ref.grad.double(), dtype, "dx", tol=2 * TOL[dtype])
    for (name, p), (_, pr) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert_close(p.grad, pr.grad.double(), dtype, f"grad {name}", tol=2 * TOL[dtype])
