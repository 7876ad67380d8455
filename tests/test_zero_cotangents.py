"""kforge.fusion.zero_cotangents: gradients nobody asked for are never materialized.

CPU (CI): regions lowered with an argument taken as zero fold to what eager computes with a zero
tensor there (the reference evaluator on the remaining arguments against eager with real zeros),
`x + 0` leaves no kernel, and the folded sources compile; the backward trace of nanoGPT's
`(logits, loss)` (traced as on a GPU) leaves the logits' cotangent to a zero-aware region, and a
cotangent read by anything else is filled with zeros; Thunder's own backwards are not told None is
fine. GPU: training on one output of several matches eager (loss only, logits only, both), the
zero-aware region runs as a view, a filled cotangent is correct, Thunder without kforge is unchanged.
"""
from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch

from conftest import assert_close, fake_cuda_trace, gpu, randn, traced_region

BF16 = torch.bfloat16


def _lowered(fn: Callable, args: tuple, zeros: tuple[int, ...]):
    """`fn`'s whole trace (Thunder on CPU tensors) lowered with the arguments at `zeros` as 0."""
    region, ins = traced_region(fn, args, zeros=zeros)
    assert len(ins) == len(args)
    return region


# name: (fn(x, g), g's shape relative to x, ops that may remain after folding)
CASES: dict[str, tuple[Callable, Callable, set]] = {
    "add": (lambda x, g: x + g, lambda s: s, set()),
    "add_bf16_round_trip": (lambda x, g: (g.float() + x.float()).to(x.dtype), lambda s: s, set()),
    "add_reshaped": (lambda x, g: g + x.reshape(g.shape), lambda s: (s[0] // 2, 2, *s[1:]), {"reshape"}),
    "sub": (lambda x, g: x - g, lambda s: s, set()),
    "rsub": (lambda x, g: g - x, lambda s: s, {"neg"}),
    "mul": (lambda x, g: x * g + x, lambda s: s, set()),
    "div_of_zero": (lambda x, g: g / (x.abs() + 1) + x, lambda s: s, set()),
    "where": (lambda x, g: torch.where(x > 0, g, g * 3) + x, lambda s: s, set()),
    "sum_into": (lambda x, g: (g * 2).sum(-1) + x.sum(-1), lambda s: s, {"reduce", "convert"}),
    "transposed": (lambda x, g: g.transpose(0, 1) + x.transpose(0, 1), lambda s: s, {"transpose"}),
    "two_outputs": (lambda x, g: (x + g, (g.float() * x.float()).sum()), lambda s: s, set()),
}


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_folded_region_matches_eager_with_zeros(case: str, dtype: torch.dtype) -> None:
    """The region with g absent computes exactly what eager computes with g = zeros, and only the
    ops listed remain (x + 0 is x: nothing is added); its source compiles for sm_90."""
    import kforge
    from kforge.fusion import codegen, reference

    fn, gshape, allowed = CASES[case]
    x = randn(6, 10, dtype=dtype, device="cpu", seed=1)
    g = randn(*gshape(tuple(x.shape)), dtype=dtype, device="cpu", seed=2)
    region = _lowered(fn, (x, g), zeros=(1,))
    assert len(region.args) == 1 and region.args[0].attrs["index"] == 0
    ops = {v.op for v in region.values} - {"input", "full"}
    assert ops <= allowed | {"convert"}, (case, ops)
    assert not ops & {"add", "sub", "mul", "div", "where"}, (case, ops)
    outs = reference.evaluate(region, [x])
    ref = fn(x, torch.zeros_like(g))
    ref = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(outs, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert torch.equal(o, r), (case, (o.float() - r.float()).abs().max())
    if codegen.schedule(region).kind != "passthrough":
        ks = codegen.generate(region, codegen.default_key(region))
        kforge._C.compile_generated(ks.program, ks.source, [launch[0] for launch in ks.launches], 90)


def test_add_of_absent_gradient_is_the_other_term() -> None:
    """Thunder's bf16 add (both sides widened, added, narrowed) with one side absent is its other
    side itself: a passthrough, no kernel."""
    from kforge.fusion import codegen

    x, g = (randn(4, 8, dtype=BF16, device="cpu", seed=i) for i in range(2))
    region = _lowered(lambda x, g: x + g, (x, g), zeros=(1,))
    assert region.output_sources() == [-1]
    assert codegen.schedule(region).kind == "passthrough"
    both = _lowered(lambda x, g: x + g, (x, g), zeros=(0, 1))
    assert not both.args and [v.op for v in both.values] == ["full"]


def test_nonzero_folds_are_left_alone() -> None:
    """Folding needs a zero: x + 1, exp(0) and a pad with 1 stay as they are."""
    import torch.nn.functional as F

    x, g = (randn(4, 8, device="cpu", seed=i) for i in range(2))
    region = _lowered(lambda x, g: torch.exp(g) + x + 1, (x, g), zeros=(1,))
    assert "exp" in {v.op for v in region.values} and "add" in {v.op for v in region.values}
    region = _lowered(lambda x, g: F.pad(g, (0, 1), value=1.0) + F.pad(x, (0, 1)), (x, g), zeros=(1,))
    assert "pad" in {v.op for v in region.values}


def _nanogpt_backward():
    import kforge
    from kforge.zoo import nanogpt

    return fake_cuda_trace(nanogpt.make, jit=kforge.jit, size="micro", batch=2, seq=16, dtype=BF16).backward


def test_backward_trace_leaves_absent_logits_gradient_to_the_fusion() -> None:
    """nanoGPT returns (logits, loss): the backward starts with kforge_fill_cotangents (filling
    nothing: both cotangents are read only by fusion regions), and those regions are zero-aware."""
    from thunder.core.prims import PrimIDs

    from kforge.fusion.zero_cotangents import ZeroAware

    bw = _nanogpt_backward()
    names = [b.sym.name for b in bw.bound_symbols]
    fill = names.index("kforge_fill_cotangents")
    unpack = next(i for i, b in enumerate(bw.bound_symbols)
                  if b.sym.id == PrimIDs.UNPACK_SEQUENCE and b.args[0].name == "cotangents")
    assert fill == unpack - 1
    assert bw.bound_symbols[fill].args[1] == ()
    cots = {p.name for p in bw.bound_symbols[unpack].output}
    aware = [b for b in bw.bound_symbols if isinstance((b._call_ctx or {}).get(b.sym.name), ZeroAware)]
    assert {a.name for b in aware for a in b.args if getattr(a, "name", None) in cots} == cots
    assert "kforge: absent gradients of 2 outputs" in str(bw)
    from kforge.fusion.zero_cotangents import _accepts_none

    assert _accepts_none(bw.python_callable())


def test_cotangent_read_elsewhere_is_filled() -> None:
    """An output whose gradient goes straight into a matmul's backward (not a fusion region) is
    filled with zeros when absent; the other stays None."""
    import kforge

    def make(device="cuda", **kw):
        x = torch.randn(8, 16, device=device, requires_grad=True)
        w = torch.randn(16, 12, device=device, requires_grad=True)
        return (lambda x, w: (x @ w, (x * 2).sum())), (x, w), {}

    bw = fake_cuda_trace(make, jit=kforge.jit).backward
    fill = next(b for b in bw.bound_symbols if b.sym.name == "kforge_fill_cotangents")
    assert fill.args[1] == ((0, (8, 12), "float32", "cuda:0"),)


def test_forward_traces_and_plain_thunder_are_untouched() -> None:
    """The rewrite applies only to backward traces whose cotangents kforge regions read, so Thunder's
    own backwards are not marked as accepting None (autograd keeps materializing their zeros)."""
    import thunder

    from kforge.fusion.zero_cotangents import _accepts_none, rewrite

    x = torch.randn(4, 8, requires_grad=True)
    jf = thunder.jit(lambda x: (x.exp(), x.sum()))
    jf(x)
    assert rewrite(thunder.last_traces(jf)[-1]) is thunder.last_traces(jf)[-1]
    bw = thunder.last_backward_traces(jf)[-1]
    assert not _accepts_none(bw.python_callable())
    assert rewrite(bw) is bw  # no kforge region reads its cotangents: autograd's zeros stay


# ---- GPU ----------------------------------------------------------------------------------------------
def _nanogpt(dtype=torch.float32):
    import kforge
    from kforge.zoo import nanogpt

    m, inputs, _ = nanogpt.make(size="micro", batch=2, seq=16, dtype=dtype)
    return m, kforge.jit(copy.deepcopy(m)), inputs


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@gpu
@pytest.mark.parametrize("use", ["loss", "logits", "both"])
def test_training_on_some_outputs_matches_eager(use: str) -> None:
    """Gradients through the loss only (logits' cotangent absent), the logits only (the loss's
    absent) or both match eager's; with the logits' absent, the zero-aware region ran its folded
    variant."""
    from kforge.fusion.zero_cotangents import ZeroAware

    m, jm, inputs = _nanogpt()

    def objective(logits, loss):
        return {"loss": loss, "logits": (logits.float() ** 2).mean(), "both": loss + 1e-2 * logits.float().sum()}[use]

    ref = objective(*m(*inputs))
    out = objective(*jm(*inputs))
    ref.backward()
    out.backward()
    assert_close(out.detach(), ref.detach(), torch.float32, "objective", tol=1e-5)
    ref_g, g = _grads(m), _grads(jm)
    assert ref_g.keys() == g.keys()
    for n in ref_g:
        assert_close(g[n], ref_g[n], torch.float32, n, tol=1e-4)
    import thunder

    bw = thunder.last_backward_traces(jm)[-1]
    aware = [b._call_ctx[b.sym.name] for b in bw.bound_symbols
             if isinstance((b._call_ctx or {}).get(b.sym.name), ZeroAware)]
    assert aware
    # fp32: the loss's cotangent goes straight into the cross-entropy backward (filled when absent);
    # the logits' is read only by the region that adds it
    assert any(z._variants for z in aware) == (use == "loss")


@gpu
def test_absent_logits_gradient_is_a_view_of_the_loss_gradient() -> None:
    """bf16 nanoGPT trained on the loss: the region that added the logits' zero cotangent returns
    a view of the cross-entropy gradient (no add, no copy), and the gradients match eager's."""
    from kforge.fusion.zero_cotangents import ZeroAware
    import thunder

    m, jm, inputs = _nanogpt(BF16)
    m(*inputs)[1].backward()
    jm(*inputs)[1].backward()
    ref_g, g = _grads(m), _grads(jm)
    for n in ref_g:
        assert_close(g[n], ref_g[n], BF16, n, tol=5e-2)
    bw = thunder.last_backward_traces(jm)[-1]
    variants = [v for b in bw.bound_symbols if isinstance(z := (b._call_ctx or {}).get(b.sym.name), ZeroAware)
                for v in z._variants.values()]
    assert variants and all("fusion" in getattr(v, "name", "") or "none" in getattr(v, "name", "") for v in variants)


@gpu
def test_filled_cotangent_is_zero() -> None:
    """An absent gradient read by a matmul's backward is filled with zeros: x's gradient is the
    sum's alone, as in eager."""
    import kforge

    x = randn(8, 16, seed=1).requires_grad_()
    w = randn(16, 12, seed=2).requires_grad_()
    fn = lambda x, w: (x @ w, (x * x).sum())  # noqa: E731
    jf = kforge.jit(fn)
    _, s = jf(x, w)
    s.backward()
    assert_close(x.grad, 2 * x.detach(), torch.float32, "dx", tol=1e-6)
    assert w.grad is None or not w.grad.any()


@gpu
def test_thunder_without_kforge_still_materializes() -> None:
    """kforge's patch of Thunder's autograd functions changes nothing for a plain thunder.jit: an
    unused output's gradient still arrives as zeros and the step is right."""
    import thunder

    import kforge.fusion.zero_cotangents as zc

    zc.install()
    x = randn(64, 32, seed=3).requires_grad_()
    jf = thunder.jit(lambda x: (x.exp() * 2, (x * 3).sum()))
    _, s = jf(x)
    s.backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
