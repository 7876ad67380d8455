"""embedding (the weight gradient of an embedding lookup, torch.ops.aten.embedding_backward): the
launcher against a float64 index_add_ reference, every row written (rows without tokens exactly
zero), padding_idx, out-of-range indices ignored, bitwise determinism, the scalar / vector and int32 /
int64 paths agreeing bitwise, CUDA graph capture, and a small model trained under kforge.jit.

CPU tests: NVRTC compiles every instantiation for sm_80 / sm_90, the plan (launch configuration),
what the checker takes and declines, the claim in fake-GPU traces of the zoo's Llama and nanoGPT, and
the Thunder plumbing with the launcher swapped for torch.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import thunder
from hypothesis import given, settings
from hypothesis import strategies as st
from thunder.core.trace import TraceCtx, tracectx

import conftest
import kforge
from conftest import (DTYPES, REL_TOL, assert_close, fake_cuda_trace, gpu, proxy, randn, swap_launchers,
                      symbol_names)
from kforge.ops import embedding as emb

_C = kforge._C
ALL_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ATEN = "torch.ops.aten.embedding_backward"
OURS = "kforge_embedding_backward"


def make_indices(shape: tuple, V: int, dist: str, seed: int = 0, device: str = "cuda") -> torch.Tensor:
    """int64 indices in [0, V): "uniform", "repeats" (a handful of values), "same" (one value),
    "zipf" (a few very frequent values and a long tail)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    if dist == "uniform":
        t = torch.randint(0, V, (n,), generator=g)
    elif dist == "repeats":
        t = torch.randint(0, V, (min(V, 5),), generator=g)[torch.randint(0, min(V, 5), (n,), generator=g)]
    elif dist == "same":
        t = torch.full((n,), V // 2, dtype=torch.long)
    else:  # zipf-like: rank r drawn with probability ~ 1 / (r + 1)
        w = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
        t = torch.multinomial(w, n, replacement=True, generator=g)
    return t.view(shape).to(device)


def reference(grad: torch.Tensor, idx: torch.Tensor, V: int, padding_idx: int = -1) -> torch.Tensor:
    """float64 sum of grad's rows per index; tokens at padding_idx or outside [0, V) add nothing."""
    C = grad.shape[-1]
    g, i = grad.reshape(-1, C).double(), idx.reshape(-1)
    keep = (i >= 0) & (i < V) & (i != padding_idx)
    return torch.zeros(V, C, dtype=torch.float64, device=grad.device).index_add_(0, i[keep], g[keep])


def check(out: torch.Tensor, grad: torch.Tensor, idx: torch.Tensor, V: int, padding_idx: int = -1,
          what: str = "dW") -> None:
    """out against the float64 reference: the dtype's tolerance relative to the norm of the summed
    magnitudes (a row's terms can cancel), and rows that no token reaches exactly zero."""
    dtype = grad.dtype
    assert out.shape == (V, grad.shape[-1]) and out.dtype == dtype, (out.shape, out.dtype)
    ref = reference(grad, idx, V, padding_idx)
    scale = reference(grad.abs(), idx, V, padding_idx).norm().item()
    # fp32: each element is a sum of up to N terms in fp32, error growing like sqrt(terms) ulps.
    i = idx.reshape(-1)
    most = int(torch.bincount(i[(i >= 0) & (i < V)], minlength=1).max().item()) if i.numel() else 0
    tol = REL_TOL[dtype] * (max(1.0, most ** 0.5 / 16) if dtype == torch.float32 else 1.0)
    assert_close(out, ref, dtype, what, tol=tol, scale=scale)
    untouched = ref.abs().sum(1) == 0
    reached = torch.zeros(V, dtype=torch.bool, device=out.device)
    ok = (i >= 0) & (i < V) & (i != padding_idx)
    reached[i[ok]] = True
    assert torch.equal(out[~reached], torch.zeros_like(out[~reached])), f"{what}: rows without tokens not zero"
    assert untouched[~reached].all()


# ---- GPU: the launcher ----------------------------------------------------------------------------
# (index shape, C, V, distribution): GPT-2 / Llama sizes (several blocks' rows, one wave), 2-D
# position indices, odd C (the element-wise path), V not a multiple of any row tile, one token,
# repeats, one index for every token (past the 4096-token list: a crowded row summed in rounds), a
# tiny vocabulary, rows of 128+ tokens (split over the warps), a skewed vocabulary past the list
# (ranges of rows, split and crowded rows), a crowded row of 9 items (two column chunks).
CASES = [
    ((8, 1024), 768, 32000, "uniform"),
    ((8, 1024), 768, 50304, "zipf"),
    ((1024,), 768, 1024, "uniform"),
    ((4, 33), 67, 1000, "repeats"),
    ((3, 5), 1, 10, "uniform"),
    ((7, 11), 3, 1001, "uniform"),
    ((2, 300), 1000, 777, "zipf"),
    ((1,), 768, 5, "uniform"),
    ((1,), 1, 1, "uniform"),
    ((257,), 64, 3, "same"),
    ((5000,), 8, 10, "same"),
    ((4, 2500), 768, 50, "same"),
    ((64, 256), 384, 65, "uniform"),
    ((3, 2049), 40, 200, "repeats"),
    ((700,), 300, 3, "uniform"),
    ((4, 8192), 64, 1000, "zipf"),
    ((10000,), 1100, 2, "same"),
]


@gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-C{c[1]}-V{c[2]}-{c[3]}")
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_matches_float64_reference(dtype, case):
    shape, C, V, dist = case
    idx = make_indices(shape, V, dist, seed=1)
    grad = randn(*shape, C, dtype=dtype, seed=2)
    check(_C.embedding_backward(grad, idx, V), grad, idx, V)


@gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_padding_idx_and_out_of_range_indices(dtype):
    """Tokens at padding_idx leave its row zero (as torch); indices outside [0, V) add nothing (torch
    would raise on the device; the kernel never writes out of bounds)."""
    V, C = 300, 72
    idx = make_indices((6, 200), V, "repeats", seed=3)
    idx[0, :50] = 7
    idx[1, :10] = -1
    idx[1, 10:20] = V
    idx[1, 20:30] = -5
    grad = randn(6, 200, C, dtype=dtype, seed=4)
    for pad in (-1, 7, 0, V - 1):
        out = _C.embedding_backward(grad, idx, V, pad)
        check(out, grad, idx, V, pad, f"padding_idx={pad}")
        if pad >= 0:
            assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    # torch's own op (in-range indices only), on the fp32 values of the same inputs: both sum in
    # fp32, in different orders, and round once.
    ok = (idx >= 0) & (idx < V)
    theirs = torch.ops.aten.embedding_backward(grad[ok].float(), idx[ok], V, 7, False, False)
    assert_close(_C.embedding_backward(grad[ok], idx[ok], V, 7).float(), theirs, dtype, "vs torch",
                 tol=2 * REL_TOL[dtype])


@gpu
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("dist", ["uniform", "zipf", "same"])
def test_deterministic_and_paths_agree_bitwise(dtype, dist):
    """Two runs are bitwise equal; so are int32 indices, a misaligned grad (the element-wise path) and
    a non-contiguous grad (copied first): every path adds each element's terms in token order."""
    V, C = 4099, 256
    idx = make_indices((8, 640), V, dist, seed=5)
    grad = randn(8, 640, C, dtype=dtype, seed=6)
    a, b = _C.embedding_backward(grad, idx, V), _C.embedding_backward(grad, idx, V)
    assert torch.equal(a, b)
    assert torch.equal(_C.embedding_backward(grad, idx.int(), V), a)
    off = torch.empty(grad.numel() + 1, dtype=dtype, device="cuda")[1:].view(grad.shape).copy_(grad)
    assert off.data_ptr() % 16 != 0
    assert torch.equal(_C.embedding_backward(off, idx, V), a)
    strided = grad.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    assert torch.equal(_C.embedding_backward(strided, idx, V), a)
    idx_strided = idx.t().contiguous().t()
    assert torch.equal(_C.embedding_backward(grad, idx_strided, V), a)
    check(a, grad, idx, V)


@gpu
def test_empty_inputs():
    grad = randn(0, 16)
    idx = torch.zeros(0, dtype=torch.long, device="cuda")
    assert torch.equal(_C.embedding_backward(grad, idx, 9), torch.zeros(9, 16, device="cuda"))
    assert _C.embedding_backward(randn(4, 0), torch.zeros(4, dtype=torch.long, device="cuda"), 9).shape == (9, 0)
    assert _C.embedding_backward(randn(4, 16), torch.zeros(4, dtype=torch.long, device="cuda"), 0).shape == (0, 16)


@gpu
def test_side_stream_and_cuda_graph_capture():
    """No host sync, no allocation outside the caching allocator: captured in a CUDA graph and
    replayed on new values; on a side stream right behind another kernel."""
    V, C = 32000, 768
    idx = make_indices((8, 1024), V, "uniform", seed=7)
    grad = randn(8, 1024, C, dtype=torch.bfloat16, seed=8)
    expected = _C.embedding_backward(grad, idx, V)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g2 = grad * 2  # a kernel right before ours on the same stream
        side = [_C.embedding_backward(g2, idx, V) for _ in range(3)]
    torch.cuda.current_stream().wait_stream(s)
    _C.embedding_backward(grad, idx, V)  # compiled and loaded before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _C.embedding_backward(grad, idx, V)
    grad.mul_(-1)
    idx.copy_(idx.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    for out in side:
        assert torch.equal(out, _C.embedding_backward(-2 * grad, idx.flip(0), V))
    assert torch.equal(captured, _C.embedding_backward(grad, idx, V))
    assert not torch.equal(captured, expected)  # replay computed the new values
    check(captured, grad, idx, V)


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiny_model_trains_like_eager(dtype):
    """kforge.jit of an embedding (with padding_idx) and a linear head: the embedding's gradient is
    kforge's, and three SGD steps keep loss and weights with eager's."""
    V, C = 300, 64

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, C, padding_idx=0)
            self.head = nn.Linear(C, V)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(idx))

    torch.manual_seed(0)
    ref = Tiny().to("cuda", dtype)
    model = copy.deepcopy(ref)
    jm = kforge.jit(model)
    opt_ref, opt = torch.optim.SGD(ref.parameters(), lr=0.5), torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        idx = make_indices((4, 33), V, "zipf", seed=10 + step)
        idx[0, :5] = 0
        target = make_indices((4, 33), V, "uniform", seed=20 + step)
        losses = []
        for m, o in ((ref, opt_ref), (jm, opt)):
            o.zero_grad()
            loss = F.cross_entropy(m(idx).float().view(-1, V), target.view(-1))
            loss.backward()
            losses.append(loss.detach())
        assert_close(losses[1], losses[0], dtype, f"loss {step}", tol=2 * REL_TOL[dtype])
        assert_close(model.emb.weight.grad, ref.emb.weight.grad, dtype, f"emb grad {step}", tol=2 * REL_TOL[dtype])
        assert torch.equal(model.emb.weight.grad[0], torch.zeros_like(model.emb.weight.grad[0]))
        opt_ref.step()
        opt.step()
    assert OURS in symbol_names(thunder.last_backward_traces(jm)[-1])
    assert ATEN not in symbol_names(thunder.last_backward_traces(jm)[-1])
    for p, r in zip(model.parameters(), ref.parameters()):
        assert_close(p.detach(), r.detach(), dtype, "weights", tol=2 * REL_TOL[dtype])


@gpu
@settings(max_examples=40, deadline=None)
@given(n=st.sampled_from([1, 2, 31, 2047, 2048, 2049, 4097, 9000]), C=st.one_of(st.integers(1, 20), st.sampled_from(
       [64, 67, 768, 1000])), V=st.one_of(st.integers(1, 40), st.sampled_from([127, 128, 129, 1000, 50304])),
       dist=st.sampled_from(["uniform", "repeats", "same", "zipf"]), pad=st.sampled_from([-1, 0, 1]),
       dtype=st.sampled_from(ALL_DTYPES), split=st.booleans(), i32=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_property_matches_float64(n, C, V, dist, pad, dtype, split, i32, seed):
    """Generated token counts (around the 2048-index scan steps and the 4096-token list), widths
    (the 16-byte and element-wise paths), int64 and int32 indices, vocabularies (around the row
    tiles), distributions and padding: within tolerance of float64, every row written. Fails on a
    dropped or doubled token, a wrong row or column, or an unwritten (NaN-poisoned) element."""
    shape = (2, n // 2) if split and n % 2 == 0 else (n,)
    idx = make_indices(shape, V, dist, seed=seed)
    idx = idx.int() if i32 else idx
    grad = randn(*shape, C, dtype=dtype, seed=seed + 1)
    check(_C.embedding_backward(grad, idx, V, pad), grad, idx, V, pad)


# ---- CPU: compile, plan, checker, traces ------------------------------------------------------------
@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile(arch, tmp_path):
    """Every instantiation (fp32 / bf16 / fp16 x int64 / int32 indices x 16-byte / element-wise)
    through NVRTC from an empty cache."""
    _C.set_cache(str(tmp_path), True)
    _C.clear_memory_cache()
    try:
        lowered = _C.compile("embedding", arch)
    finally:
        _C.set_cache(kforge.cache_dir(), kforge._runtime.disk_cache_enabled())
        _C.clear_memory_cache()
    exprs = _C.name_expressions("embedding")
    assert len(lowered) == len(exprs) == 12 and all(lowered), (exprs, lowered)
    for t in ("float", "bf16", "half"):
        for i in ("long long", "int"):
            for v in ("true", "false"):
                assert f"embedding_backward_kernel<{t}, {i}, {v}>" in exprs


PLAN_GRID = [(n, c, v) for n in (1, 8192, 65536) for c in (1, 3, 64, 67, 768, 1000, 4096)
             for v in (1, 7, 65, 1000, 1024, 32000, 50304)]


def test_plan_covers_every_row_and_column():
    """(tiles, chunks) blocks of `rows` rows (8..128, a power of two) and `block_items` items of 32
    lanes cover dW; 16-byte units exactly when grad is aligned and C a multiple of the pack; the
    kernel named is one the launcher instantiates."""
    exprs = set(_C.name_expressions("embedding"))
    for (n, c, v), dtype, aligned, sms in ((q, d, a, s) for q in PLAN_GRID for d in ("float32", "bfloat16")
                                           for a in (True, False) for s in (1, 132)):
        p = _C.plan("embedding_backward", [n, c], dtype, aligned=aligned, sms=sms, num_weights=v)
        pack = 4 if dtype == "float32" else 8
        assert p["vec"] == (aligned and c % pack == 0) and p["layout"] == ("vec" if p["vec"] else "scalar")
        rows, items, bi = p["rows"], p["items"], p["block_items"]
        assert rows in (8, 16, 32, 64, 128) and 1 <= bi <= min(items, 8), p  # an item per warp at most
        assert items == -(-(c // pack if p["vec"] else c) // 32)
        tiles, chunks, z = p["grid"]
        assert (tiles - 1) * rows < v <= tiles * rows and (chunks - 1) * bi < items <= chunks * bi and z == 1, p
        assert p["block"] == (256, 1, 1) and p["smem"] == 0
        for t in ("float", "bf16"):
            assert p["kernel"].replace("{T}", t) in exprs
    assert _C.plan("embedding_backward", [8, 5], "float16", num_weights=3, int32_indices=True)["kernel"] == \
        "embedding_backward_kernel<{T}, int, false>"


def test_plan_known_choices():
    """One wave of blocks on an H100 (132 SMs) that each scan the 8192 indices once: Llama's 32000
    rows in 500 blocks of 64, GPT-2's 50304 in 393 of 128; small vocabularies split the columns."""
    p = _C.plan("embedding_backward", [8, 1024, 768], "bfloat16", num_weights=32000)
    assert (p["layout"], p["rows"], p["grid"], p["block_items"]) == ("vec", 64, (500, 1, 1), 3)
    p = _C.plan("embedding_backward", [8, 1024, 768], "bfloat16", num_weights=50304)
    assert (p["rows"], p["grid"]) == (128, (393, 1, 1))
    p = _C.plan("embedding_backward", [1024, 768], "bfloat16", num_weights=1024)
    assert (p["rows"], p["grid"], p["block_items"]) == (8, (128, 3, 1), 1)
    p = _C.plan("embedding_backward", [8192, 4096], "float32", num_weights=32000)
    assert (p["rows"], p["grid"], p["items"], p["block_items"]) == (128, (250, 4, 1), 32, 8)
    with pytest.raises(ValueError, match="num_weights must be given"):
        _C.plan("embedding_backward", [4, 4], "float32")
    with pytest.raises(ValueError, match="2\\^31 - 1 tokens"):
        _C.plan("embedding_backward", [1 << 31, 1], "float32", num_weights=4)
    # gridDim.y: 65535 chunks of 8 items of 32 columns, the element-wise path's widest row
    assert _C.plan("embedding_backward", [2, 65535 * 256], "float32", num_weights=4, aligned=False)["grid"][1] == 65535
    with pytest.raises(ValueError, match="last dim C too large"):
        _C.plan("embedding_backward", [2, 65535 * 256 + 1], "float32", num_weights=4)


def test_checker_accepts_and_declines():
    with tracectx(TraceCtx()):
        g = proxy(8, 1024, 768, dtype=torch.bfloat16)
        i = proxy(8, 1024, dtype=torch.int64)
        assert emb._checker(g, i, 32000, -1, False, False) is None
        assert emb._checker(g, i, 32000, 5, False, False) is None  # padding_idx
        assert emb._checker(g, proxy(8, 1024, dtype=torch.int32), 32000, -1, False, False) is None
        assert emb._checker(proxy(16, 64, dtype=torch.float16), proxy(16, dtype=torch.int64), 10, -1, False, False) is None
        assert emb._checker(proxy(64), proxy((), dtype=torch.int64), 10, -1, False, False) is None  # one token
        cases = {
            "not CUDA": emb._checker(proxy(4, 8, device="cpu"), proxy(4, dtype=torch.int64, device="cpu"), 9, -1, False, False),
            "float64": emb._checker(proxy(4, 8, dtype=torch.float64), proxy(4, dtype=torch.int64), 9, -1, False, False),
            "is not int64 or int32": emb._checker(g, proxy(8, 1024, dtype=torch.int16), 32000, -1, False, False),
            "indices is on": emb._checker(g, proxy(8, 1024, dtype=torch.int64, device="cpu"), 32000, -1, False, False),
            "scale_grad_by_freq": emb._checker(g, i, 32000, -1, True, False),
            "sparse": emb._checker(g, i, 32000, -1, False, True),
            "is not indices shape": emb._checker(g, proxy(8, 1000, dtype=torch.int64), 32000, -1, False, False),
            "+ (C,)": emb._checker(proxy(8192, 768), i, 32000, -1, False, False),
            "num_weights": emb._checker(g, i, 0, -1, False, False),
            "padding_idx": emb._checker(g, i, 32000, None, False, False),
            "empty": emb._checker(proxy(0, 8), proxy(0, dtype=torch.int64), 9, -1, False, False),
            "indices is not a tensor": emb._checker(g, 3, 32000, -1, False, False),
        }
    for expected, reason in cases.items():
        assert reason is not None and expected in reason, (expected, reason)


@pytest.mark.parametrize("model,calls", [("plain_llama", 1), ("nanogpt", 2)])
def test_fake_gpu_trace_claims_the_weight_gradient(model, calls):
    """Traced as on a GPU: every embedding's weight gradient (nanoGPT: tokens (B, T) and positions
    (T,)) is kforge's, and torch's sort-based embedding_backward is gone from the backward trace."""
    import importlib

    make = importlib.import_module(f"kforge.zoo.{model}").make
    traced = fake_cuda_trace(make, size="micro", batch=2, seq=16)
    _, bwd = traced.symbols()
    assert bwd[OURS] == calls, dict(bwd)
    names = [b.sym.name for b in traced.backward.bound_symbols]
    assert ATEN not in names and "embedding_backward" not in names
    for b in traced.backward.bound_symbols:
        if b.sym.name == OURS:
            g, i, v, pad = b.args
            assert g.shape[:-1] == i.shape and pad == -1 and v >= 1
    # kforge.inspect lists it with the other kernels, with its plan's layout (C = 64, bf16: 16-byte)
    from kforge.inspect import call_layouts, inspect

    assert inspect(traced.fn).backward[OURS] == calls
    assert call_layouts([traced.backward])[OURS] == Counter({"vec": calls})


def test_launcher_rejects_cpu_tensors():
    with pytest.raises(kforge.KforgeError, match="embedding_backward: grad must be a CUDA tensor"):
        _C.embedding_backward(torch.randn(4, 8), torch.zeros(4, dtype=torch.long), 9)


@pytest.fixture
def cpu_reference_launchers(monkeypatch):
    def ref(grad, indices, num_weights, padding_idx):
        return torch.ops.aten.embedding_backward(grad, indices, num_weights, padding_idx, False, False)

    swap_launchers(monkeypatch, emb, {emb.embedding_backward: ref})


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_thunder_plumbing_with_reference_launchers(cpu_reference_launchers, padding_idx):
    """thunder.jit with kforge's executor on CPU tensors (checker's device test relaxed, launcher
    swapped for torch): the weight gradient goes through kforge's operator and matches eager."""
    w = randn(20, 12, device="cpu", dtype=torch.float64).requires_grad_(True)
    idx = make_indices((3, 7), 20, "repeats", device="cpu")
    idx[0, 0] = 3

    def fn(idx, w):
        return F.embedding(idx, w, padding_idx=padding_idx).sin()

    jf = thunder.jit(fn, executors=[kforge.executor])
    out = jf(idx, w)
    g = randn(*out.shape, device="cpu", dtype=torch.float64)
    (dw,) = torch.autograd.grad(out, (w,), g)
    names = symbol_names(thunder.last_backward_traces(jf)[-1])
    assert OURS in names and ATEN not in names
    (ref,) = torch.autograd.grad(fn(idx, w), (w,), g)
    torch.testing.assert_close(dw, ref)
    if padding_idx is not None:
        assert torch.equal(dw[padding_idx], torch.zeros_like(dw[padding_idx]))


def test_cpu_tensors_fall_back_to_torch():
    from kforge import _thunder

    _thunder.reset_declines()
    w = randn(20, 12, device="cpu").requires_grad_(True)
    idx = make_indices((3, 7), 20, "uniform", device="cpu")
    jf = thunder.jit(lambda idx, w: F.embedding(idx, w), executors=[kforge.executor])
    out = jf(idx, w)
    out.backward(torch.ones_like(out))
    assert "kforge_" not in str(thunder.last_backward_traces(jf)[-1])
    torch.testing.assert_close(w.grad, torch.zeros_like(w).index_add_(0, idx.view(-1), torch.ones(21, 12)))
    assert any(r.startswith("embedding: ") and "not CUDA" in r for r in _thunder.declines()["embedding_backward"])


# ---- property-based (hypothesis) ----------------------------------------------------------------
_DIM = st.one_of(st.integers(0, 5), st.sampled_from([65535 * 256, 65535 * 256 + 1, 2**31 - 1, 2**31]))


@settings(max_examples=200)
@given(ishape=st.lists(_DIM, min_size=0, max_size=3).map(tuple), C=_DIM, extra=st.sampled_from([0, 0, 1, -1]),
       gdtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]),
       idtype=st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32]),
       gdev=st.sampled_from(["cuda", "cpu"]), idev=st.sampled_from(["cuda", "cuda", "cpu"]),
       V=st.sampled_from([0, 1, 50304, -1]), pad=st.sampled_from([-1, 0, 7, None]),
       scale=st.booleans(), sparse=st.booleans())
def test_checker_never_accepts_what_the_launcher_refuses(ishape, C, extra, gdtype, idtype, gdev, idev, V, pad,
                                                         scale, sparse):
    """Generated grad / indices proxies and arguments: whatever the checker accepts passes every check
    of embedding_backward's launcher (CUDA on one device, float grad, int64 / int32 indices, grad
    shape indices.shape + (C,), num_weights >= 1, at most 2^31 - 1 tokens, C <= 65535 * 256) and is
    the kernel's case (no scale_grad_by_freq, dense)."""
    gshape = ishape + (C,) if extra == 0 else (ishape + (C, 2) if extra == 1 else ishape[:-1] + (C,))
    with tracectx(TraceCtx()):
        g, i = proxy(gshape, dtype=gdtype, device=gdev), proxy(ishape, dtype=idtype, device=idev)
        if emb._checker(g, i, V, pad, scale, sparse) is not None:
            return
    n = 1
    for s in ishape:
        n *= s
    assert gdev == idev == "cuda" and gdtype in ALL_DTYPES and idtype in (torch.int64, torch.int32)
    assert gshape == ishape + (C,) and 1 <= n <= 2**31 - 1 and 1 <= C <= 65535 * 256
    assert V >= 1 and isinstance(pad, int) and not scale and not sparse


@gpu
@pytest.mark.sanitize
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("i32", [False, True], ids=["int64", "int32"])
@pytest.mark.parametrize("C", [67, 64], ids=["elem", "vec"])
def test_every_instantiation(dtype, i32, C):
    """int64 / int32 indices x element-wise / 16-byte rows x dtype: within tolerance of float64, and
    that instantiation launched."""
    idx = make_indices((3, 41), 50, "repeats", seed=3)
    idx = idx.int() if i32 else idx
    grad = randn(3, 41, C, dtype=dtype, seed=4)
    check(_C.embedding_backward(grad, idx, 50, -1), grad, idx, 50, -1)
    t = conftest.KERNEL_TYPE[dtype]
    expr = f"embedding_backward_kernel<{t}, {'int' if i32 else 'long long'}, {'true' if C == 64 else 'false'}>"
    assert expr in conftest.launched("embedding"), expr
