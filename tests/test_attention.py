"""attention: SDPA on cuDNN through kforge (forward and backward against a float64 reference) and the
checker's declines."""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, gpu, proxy, randn


@pytest.fixture
def on_hopper(monkeypatch):
    """The checker's device question answered as on an sm_90 GPU (CPU tests)."""
    from kforge.ops import attention

    monkeypatch.setattr(attention, "_device_problem", lambda q: None)


def test_checker_accepts_and_declines(trace_ctx, on_hopper) -> None:
    from kforge.ops.attention import _check

    q = proxy(2, 4, 128, 64, dtype=torch.bfloat16)
    assert _check(q, q, q, is_causal=True) is None
    assert _check(q, q, q, None, 0.0, False, scale=0.125) is None
    reasons = {
        "fp32": _check(*(proxy(2, 4, 128, 64),) * 3),
        "mask": _check(q, q, q, attn_mask=proxy(128, 128, dtype=torch.bfloat16)),
        "dropout of 1": _check(q, q, q, dropout_p=1.0),
        "negative dropout": _check(q, q, q, dropout_p=-0.1),
        "dropout not a number": _check(q, q, q, dropout_p=True),
        "gqa": _check(q, proxy(2, 2, 128, 64, dtype=torch.bfloat16), proxy(2, 2, 128, 64, dtype=torch.bfloat16)),
        "head dim": _check(*(proxy(2, 4, 128, 160, dtype=torch.bfloat16),) * 3),
        "3-D": _check(*(proxy(4, 128, 64, dtype=torch.bfloat16),) * 3),
        "cpu": _check(*(proxy(2, 4, 128, 64, dtype=torch.bfloat16, device="cpu"),) * 3),
    }
    for what, reason in reasons.items():
        assert reason, f"{what} accepted"
    assert "bf16" in reasons["fp32"] and "mask" in reasons["mask"] and "head dim" in reasons["head dim"]
    assert "0 <= p < 1" in reasons["dropout of 1"] and "not a constant" in reasons["dropout not a number"]
    assert _check(q, q, q, dropout_p=0.1, is_causal=True) is None  # attention dropout: inside cuDNN


def test_declined_under_deterministic_algorithms(trace_ctx, on_hopper, monkeypatch) -> None:
    """torch.use_deterministic_algorithms(True) (not warn-only): declined, as torch's own dispatch
    skips cuDNN attention then; warn-only keeps it."""
    from kforge.ops.attention import _check

    q = proxy(2, 4, 128, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: False)
    assert "deterministic" in _check(q, q, q, is_causal=True)
    monkeypatch.setattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: True)
    assert _check(q, q, q, is_causal=True) is None


def test_dropout_declined_where_cudnn_has_none(trace_ctx, on_hopper, monkeypatch) -> None:
    """cuDNN 9.11 - 9.13 attention has no dropout (torch's dispatch skips them): declined there, with
    the version; p = 0 and other versions are taken."""
    from kforge.ops.attention import _check

    q = proxy(2, 4, 128, 64, dtype=torch.bfloat16)
    reasons = {}
    for version, taken in ((91100, True), (91200, False), (91399, False), (91400, True), (91900, True)):
        monkeypatch.setattr(torch.backends.cudnn, "version", lambda v=version: v)
        reasons[version] = _check(q, q, q, dropout_p=0.1)
        assert (reasons[version] is None) == taken, (version, reasons[version])
        assert _check(q, q, q, dropout_p=0.0) is None
    assert "91399" in reasons[91399]


def test_declined_without_a_gpu(trace_ctx) -> None:
    from kforge.ops.attention import _check

    q = proxy(2, 4, 128, 64, dtype=torch.bfloat16)
    if not torch.cuda.is_available():
        assert "no CUDA device" in _check(q, q, q)


def _reference(q, k, v, is_causal, scale):
    q64, k64, v64 = (t.double() for t in (q, k, v))
    s = q64 @ k64.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        t = q.shape[2]
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v64


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("is_causal,scale", [(True, None), (False, 0.2)])
@pytest.mark.parametrize("heads_major", [True, False])
def test_matches_float64(dtype, is_causal, scale, heads_major) -> None:
    import thunder

    import kforge

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is claimed from sm_90 on")
    b, h, t, d = 2, 3, 197, 64

    def make():
        if heads_major:
            return randn(b, h, t, d, dtype=dtype).requires_grad_()
        return randn(b, t, h, d, dtype=dtype).transpose(1, 2).detach().requires_grad_()  # (B,T,H,D) storage

    q, k, v = make(), make(), make()

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)

    jf = thunder.jit(fn, executors=kforge.executors())
    out = jf(q, k, v)
    assert "kforge_attention_forward" in {s.sym.name for s in thunder.last_traces(jf)[-1].bound_symbols}
    dout = randn(*out.shape, dtype=dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _reference(q64, k64, v64, is_causal, scale)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert_close(out, ref, dtype, "out", tol=tol)
    for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert_close(g, r, dtype, name, tol=tol * 2)


def test_gqa_checker(trace_ctx, on_hopper) -> None:
    """Grouped k / v are accepted when q's heads are n_rep times theirs, declined otherwise."""
    from kforge.ops.attention import _check_attention as _check_gqa

    q = proxy(2, 6, 128, 64, dtype=torch.bfloat16)
    kv = proxy(2, 2, 128, 64, dtype=torch.bfloat16)
    assert _check_gqa(q, kv, kv, 3, True) is None
    assert "n_rep=2" in _check_gqa(q, kv, kv, 2, True)
    assert "positive" in _check_gqa(q, kv, kv, 0, True)
    assert "bf16" in _check_gqa(proxy(2, 6, 128, 64), proxy(2, 2, 128, 64), proxy(2, 2, 128, 64), 3)


def _gqa_model(q, k, v, n_rep, spelling):
    if spelling == "repeat_interleave":
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    else:  # Hugging Face's repeat_kv
        b, h, t, d = k.shape
        k = k[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)
        v = v[:, :, None, :, :].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("spelling", ["repeat_interleave", "hf"])
def test_transform_takes_grouped_heads(spelling, monkeypatch) -> None:
    """SDPA of two expansions becomes kforge_attention of the unexpanded k and v (forward and
    backward traces; no repeat_kv left); an expansion also read elsewhere keeps it."""
    from conftest import fake_cuda_trace
    from kforge.ops import attention

    import kforge

    monkeypatch.setattr(attention, "_device_problem", lambda q: None)

    def make(device="cuda", other_use=False):
        q = torch.randn(2, 6, 64, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 2, 64, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, 2, 64, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
        if other_use:
            def fn(q, k, v):
                ke = k.repeat_interleave(3, dim=1)
                return F.scaled_dot_product_attention(q, ke, v.repeat_interleave(3, dim=1), is_causal=True) + ke
        else:
            def fn(q, k, v):
                return _gqa_model(q, k, v, 3, spelling)
        return fn, (q, k, v), {}

    ft = fake_cuda_trace(make, jit=kforge.jit)
    fwd = {b.sym.name for b in ft.forward.bound_symbols}
    bwd = {b.sym.name for b in ft.backward.bound_symbols}
    assert "kforge_attention_forward" in fwd and "kforge_attention_backward" in bwd, (fwd, bwd)
    assert not any("repeat_kv" in n for n in fwd | bwd), (fwd, bwd)
    att = next(b for b in ft.forward.bound_symbols if b.sym.name == "kforge_attention_forward")
    assert tuple(att.args[1].shape) == (2, 2, 64, 32)
    if spelling == "repeat_interleave":
        ft = fake_cuda_trace(make, jit=kforge.jit, other_use=True)
        att = next(b for b in ft.forward.bound_symbols if b.sym.name == "kforge_attention_forward")
        assert tuple(att.args[1].shape) == (2, 6, 64, 32)


@pytest.mark.parametrize("model", ["nanogpt", "hf_gpt2", "hf_llama"])
def test_attention_dropout_stays_in_kforge_as_on_a_gpu(model, monkeypatch) -> None:
    """With dropout on (fine-tuning), the users' models keep their attention on kforge's cuDNN
    operators, the probability passed through to forward and backward; Hugging Face's causal mask
    still becomes is_causal (no mask built in the trace), grouped heads stay grouped."""
    import importlib

    from conftest import fake_cuda_trace
    from kforge.ops import attention

    import kforge

    monkeypatch.setattr(attention, "_device_problem", lambda q: None)
    make = importlib.import_module(f"kforge.zoo.{model}").make
    ft = fake_cuda_trace(make, jit=kforge.jit, size="micro", batch=2, seq=16, dtype=torch.bfloat16, dropout=0.25)
    fwd = [b for b in ft.forward.bound_symbols if b.sym.name == "kforge_attention_forward"]
    bwd = [b for b in ft.backward.bound_symbols if b.sym.name == "kforge_attention_backward"]
    assert fwd and len(fwd) == len(bwd), [b.sym.name for b in ft.forward.bound_symbols]
    assert all(b.args[5] == 0.25 and b.args[3] is True for b in fwd), [b.args[3:] for b in fwd]
    assert all(b.args[-1] == 0.25 for b in bwd)
    names = {b.sym.name for b in ft.forward.bound_symbols}
    assert not any(n.startswith("sdpa") or n in ("cumsum", "diff") for n in names), names
    if model == "hf_llama":  # 4 query heads over 2 kv heads at micro size: k and v as they are
        assert fwd[0].args[1].shape[1] < fwd[0].args[0].shape[1]


def _cudnn_eager(q, k, v, p, is_causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal)


@gpu
@pytest.mark.parametrize("is_causal", [True, False])
def test_dropout_matches_eager_cudnn_under_the_same_seed(is_causal) -> None:
    """Attention dropout through kforge is eager's cuDNN attention, bit for bit, when both start from
    the same generator state: the same mask in the forward and the same mask regenerated in the
    backward (dq, dk, dv equal). Another seed gives another mask, and p = 0.5 changes the output."""
    import thunder

    import kforge

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is claimed from sm_90 on")
    b, h, t, d, p = 2, 3, 197, 64, 0.5
    q, k, v = (randn(b, h, t, d, dtype=torch.bfloat16).requires_grad_() for _ in range(3))
    dout = randn(b, h, t, d, dtype=torch.bfloat16)

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=is_causal)

    jf = thunder.jit(fn, executors=kforge.executors())
    results = []
    for f in (jf, lambda q, k, v: _cudnn_eager(q, k, v, p, is_causal)):
        torch.manual_seed(1234)
        out = f(q, k, v)
        results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    assert "kforge_attention_forward" in {s.sym.name for s in thunder.last_traces(jf)[-1].bound_symbols}
    for name, a, e in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.equal(a, e), f"{name} differs from eager cuDNN under the same seed"
    torch.manual_seed(4321)
    assert not torch.equal(jf(q, k, v), results[0][0]), "another seed, the same mask"
    ref = _reference(q, k, v, is_causal, None).to(torch.bfloat16)
    assert (results[0][0] - ref).abs().max() > 0.1, "p = 0.5 dropped nothing"


@gpu
def test_dropout_is_unbiased() -> None:
    """Averaged over many draws, attention with dropout p is attention without it (the kept weights
    scaled by 1 / (1 - p)): the mean over 400 seeds within 4 standard errors of the float64 output."""
    import thunder

    import kforge

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is claimed from sm_90 on")
    q, k, v = (randn(1, 2, 64, 64, dtype=torch.bfloat16) for _ in range(3))
    jf = thunder.jit(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True),
                     executors=kforge.executors())
    draws = torch.stack([jf(q, k, v).double() for _ in range(400)])
    mean, sem = draws.mean(0), draws.std(0) / math.sqrt(len(draws))
    ref = _reference(q, k, v, True, None)
    err = ((mean - ref).abs() / (sem + 1e-3)).flatten()
    assert err.quantile(0.99) < 4, f"mean off by {err.max():.1f} standard errors"


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n_rep", [1, 3, 4])
def test_gqa_matches_float64(dtype, n_rep) -> None:
    """cuDNN on grouped heads through kforge.jit: output and dq, dk, dv (summed over each group by
    cuDNN) against float64, with token-major q / k / v as a linear's output gives them; the output
    keeps q's layout."""
    import thunder

    import kforge

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("cuDNN attention is claimed from sm_90 on")
    b, hk, t, d = 2, 2, 133, 64
    h = hk * n_rep

    def make(heads):
        return randn(b, t, heads, d, dtype=dtype).transpose(1, 2).detach().requires_grad_()

    q, k, v = make(h), make(hk), make(hk)
    jf = kforge.jit(lambda q, k, v: _gqa_model(q, k, v, n_rep, "repeat_interleave"))
    out = jf(q, k, v)
    names = [s.sym.name for s in thunder.last_traces(jf)[-1].bound_symbols]
    assert "kforge_attention_forward" in names and not any("repeat_kv" in n for n in names), names
    assert out.stride() == q.stride()
    dout = randn(b, t, h, d, dtype=dtype).transpose(1, 2)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _reference(q64, k64.repeat_interleave(n_rep, 1), v64.repeat_interleave(n_rep, 1), True, None)
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    assert_close(out, ref, dtype, "out", tol=tol)
    for name, g, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert_close(g, r, dtype, name, tol=tol * 2 * n_rep ** 0.5)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "not causal", "runtime", "attends everywhere",
                                       "zeros added"])
def test_transform_turns_a_causal_mask_into_is_causal(mask_kind) -> None:
    """A causal mask built in the trace (boolean True on and below the diagonal, or additive 0 / -inf)
    becomes is_causal=True on kforge's attention; a mask that is not causal is reported with its
    reason and SDPA keeps its mask; one known only at run time is no match (plain SDPA with a mask).
    Both masked cases run Thunder's memory-efficient attention with the mask, as on a GPU. A mask that
    masks nothing (all True, or zeros added) is dropped: attention without a mask, not causal."""
    from conftest import fake_cuda_trace

    import kforge

    t = 48

    def make(device="cuda"):
        q, k, v = (torch.randn(2, 4, t, 32, device=device, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        given = torch.ones(t, t, device=device, dtype=torch.bool)

        def fn(q, k, v, given):
            keep = torch.ones(t, t, device=q.device, dtype=torch.bool).tril()
            if mask_kind == "additive":
                mask = torch.zeros(t, t, device=q.device, dtype=q.dtype).masked_fill(~keep, float("-inf"))
            elif mask_kind == "not causal":
                mask = keep.triu()  # the diagonal only
            elif mask_kind == "runtime":
                mask = given
            elif mask_kind == "attends everywhere":  # Hugging Face's encoders, traced
                mask = torch.ones(2, 1, t, t, device=q.device, dtype=torch.bool)
            elif mask_kind == "zeros added":
                mask = torch.zeros(t, t, device=q.device, dtype=q.dtype)
            else:
                mask = keep[None, None].expand(2, 1, t, t)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        return fn, (q, k, v, given), {}

    ft = fake_cuda_trace(make, jit=kforge.jit)
    fwd = {b.sym.name for b in ft.forward.bound_symbols}
    rewrites = [r for r in ft.fn.llama_patterns.rewrites if r.match.kind == "attention"]
    from thunder.core.proxies import TensorProxy

    # Where kforge leaves the mask, Thunder's sdpa executor runs memory-efficient attention with it
    # (FlashAttention would drop it).
    masked = [b for b in ft.forward.bound_symbols if "efficient_attention" in b.sym.name]
    mask_kept = bool(masked) and all(isinstance(b.args[3], TensorProxy) for b in masked)
    if mask_kind == "runtime":  # plain SDPA with a mask: no match at all
        assert not rewrites and "kforge_attention_forward" not in fwd, (rewrites, fwd)
        assert mask_kept, [str(b) for b in masked] or fwd
        return
    assert len(rewrites) == 1, ft.fn.llama_patterns.rewrites
    if mask_kind in ("bool", "additive", "attends everywhere", "zeros added"):
        causal = mask_kind in ("bool", "additive")
        assert rewrites[0].applied and rewrites[0].match.kwargs["is_causal"] is causal
        assert "kforge_attention_forward" in fwd, fwd
    else:
        assert not rewrites[0].applied
        assert "not causal" in rewrites[0].reason, rewrites[0].reason
        assert "kforge_attention_forward" not in fwd, fwd
        assert mask_kept, [str(b) for b in masked] or fwd


# ---- masks at their broadcast shape (SdpaMaskShape) ---------------------------------------------------
B_, H_, T_, S_, D_ = 2, 4, 24, 40, 32


def _mask(kind: str, device: str = "cpu", dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A mask SDPA broadcasts against (B, H, T, S): boolean (True = attend, every row keeps a key)
    or additive."""
    g = torch.Generator().manual_seed(11)
    keep = torch.rand(B_, H_, T_, S_, generator=g) > 0.3
    keep[..., 0] = True
    shapes = {"(T, S) bool": (T_, S_), "(1, T, S) bool": (1, T_, S_), "(1, 1, T, S) additive": (1, 1, T_, S_),
              "(B, 1, 1, S) padding": (B_, 1, 1, S_), "(1, H, T, S) bool": (1, H_, T_, S_)}
    shape = shapes[kind]
    k = keep[tuple(slice(0, n) for n in (1,) * (4 - len(shape)) + shape)].reshape(shape)
    if "additive" in kind:
        return torch.zeros(shape, dtype=dtype).masked_fill(~k, float("-inf")).to(device)
    return k.to(device)


def _same_as_eager(jf, fn, qkv: tuple, *rest) -> None:
    """jf and fn on copies of float64 q, k, v (and `rest` as given): the same output and, after the
    same random output gradient, the same dq, dk, dv."""
    args = [t.detach().clone().requires_grad_() for t in qkv]
    out, ref = jf(*args, *rest), fn(*qkv, *rest)
    g = torch.randn_like(ref)
    out.backward(g)
    ref.backward(g)
    torch.testing.assert_close(out, ref)
    for a, r, name in zip(args, qkv, "qkv"):
        torch.testing.assert_close(a.grad, r.grad, msg=f"d{name}")


MASKS = ["(T, S) bool", "(1, T, S) bool", "(1, 1, T, S) additive", "(B, 1, 1, S) padding", "(1, H, T, S) bool"]


@pytest.mark.parametrize("kind", MASKS)
def test_masks_expanded_keep_numerics_on_cpu(kind) -> None:
    """kforge.jit of SDPA with a mask of each broadcast shape, float64 on the CPU: the call gets the
    mask expanded to (B, 1 or H, T, S) and output and gradients equal eager's."""
    import thunder

    import kforge

    q = torch.randn(B_, H_, T_, D_, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B_, H_, S_, D_, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = _mask(kind)

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    jf = kforge.jit(fn)
    _same_as_eager(jf, fn, (q, k, v), mask)
    sdpa = [b for b in thunder.last_traces(jf)[0].bound_symbols if "scaled_dot_product" in b.sym.name]
    masks = [b.args[3] if len(b.args) > 3 else b.kwargs["attn_mask"] for b in
             next(t for t in thunder.last_traces(jf) if "broadcast shape" in str(t.get_provenance())).bound_symbols
             if "scaled_dot_product" in b.sym.name]
    assert len(sdpa) == 1 and len(masks) == 1
    assert tuple(masks[0].shape) in ((B_, 1, T_, S_), (B_, H_, T_, S_)), masks[0]


@pytest.mark.parametrize("kind", MASKS)
def test_masked_sdpa_traces_as_on_a_gpu(kind) -> None:
    """Traced as on a GPU: a masked bf16 SDPA of each broadcast shape reaches Thunder's
    memory-efficient attention with the mask (whose meta takes only (B, 1 or H, T, S) masks) instead
    of stopping the trace."""
    from conftest import fake_cuda_trace
    from thunder.core.proxies import TensorProxy

    import kforge

    def make(device="cuda"):
        q = torch.randn(B_, H_, T_, D_, device=device, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B_, H_, S_, D_, device=device, dtype=torch.bfloat16, requires_grad=True)
                for _ in range(2))
        return (lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)), \
            (q, k, v, _mask(kind, device, torch.bfloat16)), {}

    ft = fake_cuda_trace(make, jit=kforge.jit)
    att = [b for b in ft.forward.bound_symbols if "efficient_attention" in b.sym.name]
    assert len(att) == 1 and isinstance(att[0].args[3], TensorProxy), [str(b) for b in ft.forward.bound_symbols]
    assert att[0].args[3].shape[0] == B_


@gpu
@pytest.mark.parametrize("kind", MASKS)
def test_masked_sdpa_matches_eager_on_gpu(kind) -> None:
    """The same on a GPU, bf16: output and gradients against eager within bf16 rounding."""
    import kforge

    q = randn(B_, H_, T_, D_, dtype=torch.bfloat16).requires_grad_()
    k, v = (randn(B_, H_, S_, D_, dtype=torch.bfloat16).requires_grad_() for _ in range(2))
    mask = _mask(kind, "cuda", torch.bfloat16)

    def fn(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    args = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, ref = kforge.jit(fn)(*args, mask), fn(q, k, v, mask)
    g = randn(*ref.shape, dtype=torch.bfloat16)
    out.backward(g)
    ref.backward(g)
    assert_close(out, ref, torch.bfloat16, "out", tol=2e-2)
    for a, r, name in zip(args, (q, k, v), "qkv"):
        assert_close(a.grad, r.grad, torch.bfloat16, f"d{name}", tol=4e-2)


@pytest.mark.parametrize("kind", ["all True (B, 1, T, S)", "zeros added (T, S)", "causal bool"])
def test_mask_rewrites_keep_numerics_on_cpu(kind) -> None:
    """A mask built in the trace that is causal, or masks nothing (also for cross-attention, T != S),
    replaced by is_causal / no mask: float64 output and gradients equal eager's with the mask."""
    import thunder

    import kforge

    t, s = 12, (12 if kind == "causal bool" else 20)

    def fn(q, k, v):
        if kind == "causal bool":
            mask = torch.ones(t, s, dtype=torch.bool).tril()
        elif kind.startswith("all True"):
            mask = torch.ones(2, 1, t, s, dtype=torch.bool)
        else:
            mask = torch.zeros(t, s, dtype=q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q = torch.randn(2, 3, t, 16, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(2, 3, s, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    # kforge declines CPU tensors: with require_claim=False the replacement runs its operator's torch
    # decomposition (SDPA with is_causal, or without a mask).
    from kforge import transforms as kt

    transform = kt.LlamaPatternTransform(kinds=kt.ALL_KINDS, require_claim=False)
    jf = thunder.jit(fn, transforms=[transform], executors=kforge.executors())
    _same_as_eager(jf, fn, (q, k, v))
    assert [r.applied for r in transform.rewrites if r.match.kind == "attention"] == [True]
    assert not [b for b in thunder.last_traces(jf)[-1].bound_symbols if b.sym.name in ("ones", "zeros", "tril")]


def _hf_encoder(kind: str, device: str):
    """(model, inputs) of a small Hugging Face encoder in bf16: ViT, or BERT with or without padding."""
    transformers = pytest.importorskip("transformers")
    from kforge.zoo._build import build

    g = torch.Generator().manual_seed(2)
    if kind == "vit":
        cfg = transformers.ViTConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=256, image_size=32, patch_size=8, num_labels=10,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     attn_implementation="sdpa")
        model = build(transformers.ViTForImageClassification, cfg, device=device, dtype=torch.bfloat16)
        inputs = {"pixel_values": torch.randn(4, 3, 32, 32, generator=g).to(device, torch.bfloat16),
                  "labels": torch.randint(0, 10, (4,), generator=g).to(device)}
        return model.train(), inputs
    cfg = transformers.BertConfig(vocab_size=301, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=256, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    model = build(transformers.BertForMaskedLM, cfg, device=device, dtype=torch.bfloat16)
    idx = torch.randint(1, 301, (4, 48), generator=g)
    if kind == "bert":  # no padding, no attention_mask argument: the mask BERT builds masks nothing
        return model.train(), {"input_ids": idx.to(device), "labels": idx.to(device)}
    mask = torch.ones(4, 48, dtype=torch.long)
    mask[1, 30:] = 0
    return model.train(), {"input_ids": idx.to(device), "attention_mask": mask.to(device),
                           "labels": idx.masked_fill(mask == 0, -100).to(device)}


@pytest.mark.parametrize("kind", ["vit", "bert", "bert padded"])
def test_hf_encoders_trace_and_compile_as_on_a_gpu(kind) -> None:
    """Traced as on a GPU in bf16 under kforge.jit: the attention the GPU test expects is claimed, and
    every generated fusion's source, forward and backward, compiles (NVRTC, sm_90): masks make bool
    regions whose outputs are stored one element per thread."""
    from conftest import fake_cuda_trace

    import kforge

    def make(device="cuda"):
        model, inputs = _hf_encoder(kind, device)
        return model, inputs, {}

    ft = fake_cuda_trace(make, jit=kforge.jit)
    names = {b.sym.name for b in ft.forward.bound_symbols}
    assert any("efficient_attention" in n for n in names) if kind == "bert padded" else \
        "kforge_attention_forward" in names, names
    assert ft.compile_regions()


@gpu
@pytest.mark.parametrize("kind", ["vit", "bert", "bert padded"])
def test_hf_encoders_match_eager_on_gpu(kind) -> None:
    """Hugging Face encoders under kforge.jit in bf16 against eager: loss and every gradient within
    bf16 rounding of the gradient's scale; without padding the (traced, all-attending) mask is dropped
    and kforge's cuDNN attention runs, with padding Thunder's memory-efficient attention takes it."""
    import thunder

    import kforge

    torch.manual_seed(0)
    model, inputs = _hf_encoder(kind, "cuda")
    ref_model, _ = _hf_encoder(kind, "cuda")
    ref_model.load_state_dict(model.state_dict())
    jm = kforge.jit(model)
    loss = jm(**inputs).loss
    ref = ref_model(**inputs).loss
    loss.backward()
    ref.backward()
    names = {b.sym.name for b in thunder.last_traces(jm)[-1].bound_symbols}
    if kind == "bert padded":
        assert any("efficient_attention" in n for n in names), names
    elif torch.cuda.get_device_capability()[0] >= 9:
        assert "kforge_attention_forward" in names, names
    assert_close(loss, ref, torch.bfloat16, "loss", tol=2e-2)
    pairs = [(n, p, r) for (n, p), (_, r) in zip(model.named_parameters(), ref_model.named_parameters())
             if r.grad is not None]
    overall = max(r.grad.float().abs().max().item() for _, _, r in pairs)
    for name, p, r in pairs:
        err = (p.grad.float() - r.grad.float()).abs().max().item()
        if re.search(r"(k_proj|key)\.bias$", name):
            # exactly 0: a key bias shifts each query's scores by one constant, which softmax removes;
            # both sides hold rounding noise, so only its size against the model's gradients is checked
            assert err <= 1e-3 * overall, f"{name}: {err:.3g} against the gradients' scale {overall:.3g}"
            continue
        scale = r.grad.float().abs().max().item() + 1e-6
        assert err <= 0.05 * scale, f"{name}: max error {err:.3g} against gradient scale {scale:.3g}"
