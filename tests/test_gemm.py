"""gemm (src/ops/gemm.cpp, kforge.ops.gemm): matrix products on cuBLASLt plans cached per shape.

GPU: every entry point against float64 references for fp32 / bf16 / fp16, both storage orders of
each operand, odd shapes (m = 1, odd m, n and k that fall back), strided and offset views, bias,
in-place accumulation, fp32 under torch's TF32 setting, CUDA graph capture and side streams,
bitwise determinism, generated shapes (hypothesis), and users' models trained with KFORGE_GEMM=1
tying out against eager.

CPU: the ATen fallbacks (same results as torch), errors naming the op, the flag, and the rewrite of
fake-GPU traces (every GEMM of the zoo's Llama under autocast and of Hugging Face's GPT-2 on a plan).
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kforge
from conftest import assert_close, fake_cuda_trace, gpu, randn, undeleted_tensors
from kforge.ops import gemm

_C = kforge._C
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GEMM_NAMES = {"kforge_gemm_mm", "kforge_gemm_mm_widen", "kforge_gemm_addmm_", "kforge_gemm_addmm", "kforge_gemm_linear",
              "kforge_gemm_linear_views", "kforge_gemm_addmm_views", "kforge_gemm_views"}


def _stats_delta(before: dict) -> dict:
    after = gemm.stats()
    return {k: after[k] - before[k] for k in ("fast_calls", "aten_calls")}


def _operand(rows: int, cols: int, row_major: bool, dtype, device="cuda", seed=None) -> torch.Tensor:
    """A (rows, cols) matrix stored row-major, or column-major (the transpose of a row-major one)."""
    if row_major:
        return randn(rows, cols, dtype=dtype, device=device, seed=seed)
    return randn(cols, rows, dtype=dtype, device=device, seed=seed).t()


def _ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() @ b.double()


# ---- CPU ------------------------------------------------------------------------------------------
def test_cpu_tensors_take_the_aten_ops():
    """Off CUDA every entry is the ATen op it stands for: the same result, counted as an ATen call."""
    a, b = torch.randn(5, 3, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    bias, c = torch.randn(4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    x, w = torch.randn(2, 5, 3), torch.randn(4, 3)
    before = gemm.stats()
    assert torch.equal(_C.gemm_mm(a, b), a @ b)
    assert torch.equal(_C.gemm_addmm(bias, a, b), torch.addmm(bias, a, b))
    expect = c.clone().addmm_(a, b)
    assert _C.gemm_addmm_(c, a, b) is not None and torch.equal(c, expect)
    assert torch.equal(_C.gemm_linear(x, w, torch.ones(4)), F.linear(x, w, torch.ones(4)))
    assert torch.equal(_C.gemm_linear(x, w), F.linear(x, w))
    conv = _C.gemm_addmm_views(torch.ones(4), x, 3, w.t(), [2, 5, 4])
    assert torch.equal(conv, torch.addmm(torch.ones(4), x.view(-1, 3), w.t()).view(2, 5, 4))
    heads = _C.gemm_linear_views(x, w, None, [2, 5, 2, 2], [0, 2, 1, 3])
    assert torch.equal(heads, F.linear(x, w).reshape(2, 5, 2, 2).permute(0, 2, 1, 3))
    widened = _C.gemm_mm_widen(a.bfloat16(), b.bfloat16())
    assert widened.dtype == torch.float32
    assert torch.equal(widened, a.bfloat16().float() @ b.bfloat16().float())
    assert _stats_delta(before) == {"fast_calls": 0, "aten_calls": 8}


BAD_INPUT = {
    "gemm_mm": (lambda: _C.gemm_mm(torch.randn(5, 3), torch.randn(4, 2)), "mm: shapes [5, 3] and [4, 2] cannot be multiplied"),
    "gemm_mm_widen": (lambda: _C.gemm_mm_widen(torch.randn(5), torch.randn(5, 2)),
                      "mm_widen: operands must be matrices, got 1-D and 2-D"),
    "gemm_addmm": (lambda: _C.gemm_addmm(torch.randn(2), torch.randn(5, 3), torch.randn(2, 3)),
                   "addmm: shapes [5, 3] and [2, 3] cannot be multiplied"),
    "gemm_addmm_": (lambda: _C.gemm_addmm_(torch.randn(5, 3), torch.randn(5, 3), torch.randn(3, 4)),
                    "addmm_: accumulator of shape [5, 3]"),
    "gemm_linear": (lambda: _C.gemm_linear(torch.randn(2, 5), torch.randn(4, 3)), "linear: input [2, 5] and weight [4, 3]"),
    "gemm_linear_views": (lambda: _C.gemm_linear_views(torch.randn(2, 6), torch.randn(4, 6), None, [2, 2, 3], None),
                          "linear_views: out_shape [2, 2, 3] does not hold the product of shape [2, 4]"),
    "gemm_addmm_views": (lambda: _C.gemm_addmm_views(torch.randn(4), torch.randn(2, 5), 3, torch.randn(3, 4), None),
                         "views: an operand of shape [2, 5] is not rows of 3 elements"),
    "gemm_views": (lambda: _C.gemm_views(torch.randn(2, 5), 3, False, torch.randn(3, 4), 4, False, None, False, None),
                   "views: an operand of shape [2, 5] is not rows of 3 elements"),
}


def test_every_entry_has_a_bad_input_case():
    from test_bad_input import ANY_DEVICE

    # gemm_stats and gemm_tuning take no arguments; gemm_set_tune's case is test_set_tune_takes_bools
    assert set(BAD_INPUT) == ANY_DEVICE - {"gemm_stats", "gemm_tuning", "gemm_set_tune"}


@pytest.mark.parametrize("call, message", [
    *BAD_INPUT.values(),
    (lambda: _C.gemm_mm(torch.randn(2, 5, 3), torch.randn(3, 2)), "mm: operands must be matrices, got 3-D and 2-D"),
    (lambda: _C.gemm_linear_views(torch.randn(2, 6), torch.randn(4, 3), None, [2, 4], None),
     "linear: input [2, 6] and weight [4, 3]"),
    (lambda: _C.gemm_linear_views(torch.randn(2, 6), torch.randn(4, 6), None, [2, 2, 2], [0, 0, 1]),
     "linear_views: perm [0, 0, 1] is not a permutation of 3 dimensions"),
    (lambda: _C.gemm_linear_views(torch.randn(2, 6), torch.randn(4, 6), None, [2, 2, 2], [0, 1]),
     "linear_views: perm [0, 1] is not a permutation of 3 dimensions"),
    (lambda: _C.gemm_linear_views(torch.randn(2, 6), torch.randn(4, 6), None, [2, -1, 2], None),
     "linear_views: out_shape [2, -1, 2] does not hold"),
])
def test_bad_shapes_name_the_op(call, message):
    with pytest.raises(kforge.KforgeError, match="kforge.gemm: " + message.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_flag_adds_the_transform(monkeypatch):
    from kforge.transforms import _gemm_calls

    monkeypatch.delenv("KFORGE_GEMM", raising=False)  # on by default
    assert [type(t) for t in _gemm_calls()] == [gemm.GemmCalls]
    monkeypatch.setenv("KFORGE_GEMM", "0")
    assert _gemm_calls() == []
    assert [type(t) for t in _gemm_calls(True)] == [gemm.GemmCalls]
    monkeypatch.setenv("KFORGE_GEMM", "1")
    assert [type(t) for t in _gemm_calls()] == [gemm.GemmCalls] and _gemm_calls(False) == []


def test_gemm_argument_must_be_a_bool():
    with pytest.raises(TypeError, match="kforge.jit: gemm must be True, False or None, got 'yes'"):
        kforge.jit(torch.nn.Linear(2, 2), gemm="yes")
    with pytest.raises(TypeError, match="kforge.compile: gemm must be True, False or None, got 1"):
        kforge.compile(torch.nn.Linear(2, 2), gemm=1)


def test_launch_bench_calls_compute_what_they_name():
    """`bench launch`'s GEMM rows (run here on CPU tensors, where the plan entries are the ATen ops):
    each kforge call gives what its torch counterpart gives."""
    calls = dict(gemm.launch_callables(m=6, k=8, n=4, device="cpu"))
    out = {name: fn() for name, fn in calls.items()}
    by = {name.split(" (")[0].split(",")[0]: v for name, v in out.items()}
    assert torch.equal(by["kforge._C.gemm_mm"], by["torch.mm"])
    assert torch.equal(by["kforge._C.gemm_linear"], by["F.linear"])
    wgrad = [v for name, v in out.items() if "weight gradient" in name]
    assert len(wgrad) == 2 and wgrad[0].shape == (4, 8) and torch.equal(wgrad[0], wgrad[1])
    (igrad,) = [v for name, v in out.items() if "input gradient" in name]
    assert igrad.shape == (2, 3, 8)


def test_cpu_traces_are_left_alone():
    """The rewrite takes CUDA tensors only: a CPU model's traces come back unchanged."""
    import thunder

    lin = torch.nn.Linear(8, 4)
    jf = thunder.jit(lambda x: lin(x).relu() @ torch.ones(4, 3))
    jf(torch.randn(2, 8))
    tr = thunder.last_traces(jf)[-1]
    assert gemm.rewrite(tr) is tr


def _gemm_census(trace) -> Counter:
    """kforge_gemm_* calls, and GEMMs left to torch or to kforge's older names, in one trace."""
    c = Counter()
    for b in trace.bound_symbols:
        ex = getattr(getattr(b.sym, "executor", None), "name", None)
        if b.sym.name == "kforge_gemm_views":  # by what it computes: c += A @ B, fp32 A @ B, A @ B
            c["views: accumulate" if b.args[6] is not None else "views: widen" if b.args[7] else "views"] += 1
        elif b.sym.name in GEMM_NAMES:
            c[b.sym.name] += 1
        elif (ex == "torch" and b.sym.name in ("matmul", "linear", "addmm")) or b.sym.name in (
                "kforge_matmul_accumulate", "kforge_matmul_widen", "kforge_addmm_forward"):
            c["left: " + b.sym.name] += 1
    return c


@pytest.mark.parametrize("model, setup, expect", [
    # linears (forward; q / k / v and the logits with their head split or row view folded in), matmuls
    # and the q / k / v and w1 / w3 input-gradient sums (backward), every backward GEMM with its views
    # folded in
    ("plain_llama", dict(dtype=torch.bfloat16, autocast=False),
     {"kforge_gemm_linear", "kforge_gemm_linear_views", "views", "views: accumulate"}),
    # autocast: the fp32 weights' gradients stored as fp32 (widen)
    ("plain_llama", dict(dtype=torch.bfloat16, autocast=True),
     {"kforge_gemm_linear", "kforge_gemm_linear_views", "views", "views: widen"}),
    # Conv1D's addmm forward (c_attn's and c_fc's with the view of their result folded in), its
    # backward's matmuls; the tied lm_head (97 outputs: not padded)
    ("hf_gpt2", dict(dtype=torch.bfloat16, autocast=False),
     {"kforge_gemm_addmm", "kforge_gemm_addmm_views", "views", "kforge_gemm_linear"}),
    # autocast: every addmm takes the view of its result; the fp32 weights' gradients widened
    ("hf_gpt2", dict(dtype=torch.bfloat16, autocast=True),
     {"kforge_gemm_addmm_views", "views", "views: widen", "kforge_gemm_linear"}),
])
def test_every_gemm_of_a_fake_gpu_trace_is_rewritten(monkeypatch, model, setup, expect):
    import importlib

    # switched on by the environment, or (GPT-2) by kforge.jit's argument
    gemm_arg = True if model == "hf_gpt2" else None
    if gemm_arg is None:
        monkeypatch.setenv("KFORGE_GEMM", "1")
    make = importlib.import_module(f"kforge.zoo.{model}").make
    ft = fake_cuda_trace(make, jit=lambda f: kforge.jit(f, trace_cache=False, gemm=gemm_arg), size="micro", batch=2,
                         seq=16, **setup)
    fwd, bwd = _gemm_census(ft.forward), _gemm_census(ft.backward)
    left = {k: v for k, v in (fwd + bwd).items() if k.startswith("left")}
    assert not left, left
    assert set(fwd + bwd) == expect, (fwd, bwd)
    from thunder.core.symbol import BoundSymbolTag

    for b in ft.backward.bound_symbols:
        if b.sym.name in GEMM_NAMES:
            assert BoundSymbolTag.BACKWARD in b.tags, b  # CUDA graphs split the backward on this tag
    # every tensor a trace makes and does not return is deleted after its last use, folded views'
    # results (now the GEMMs' own outputs) included: one left alive holds its memory to the end
    for trace in (ft.forward, ft.backward):
        assert not undeleted_tensors(trace), undeleted_tensors(trace)
    if model == "plain_llama":  # every view around the backward's GEMMs folded into them
        assert not [b for b in ft.backward.bound_symbols if b.sym.name == "reshape"], ft.backward
        # and the forward's head splits: no view call left there but the embedding's
        views = [b.sym.name for b in ft.forward.bound_symbols
                 if b.sym.name in ("permute", "reshape", "torch_prims_reshape_impl")]
        assert not views, views
        heads = [b for b in ft.forward.bound_symbols if b.sym.name == "kforge_gemm_linear_views"]
        assert sorted(b.args[4] for b in heads if b.args[4] is not None) == [(0, 2, 1, 3)] * 3, heads


def test_fp32_gemms_stay_torchs():
    """fp32 models traced as on a GPU keep torch's GEMMs (cuBLASLt's heuristic kernel for IEEE fp32 was
    slower than torch's choice, see gemm.SIXTEEN_BIT); their 16-bit counterparts are rewritten."""
    from kforge.zoo import nanogpt

    census = {}
    for dtype in (torch.float32, torch.bfloat16):
        ft = fake_cuda_trace(nanogpt.make, jit=lambda f: kforge.jit(f, trace_cache=False), size="micro", batch=2,
                             seq=16, dtype=dtype)
        census[dtype] = _gemm_census(ft.forward) + _gemm_census(ft.backward)
    fp32, bf16 = census[torch.float32], census[torch.bfloat16]
    assert fp32 and all(k.startswith("left: ") for k in fp32), fp32
    assert bf16 and not [k for k in bf16 if k.startswith("left: ")], bf16


def test_rewritten_backward_keeps_what_cuda_graphs_look_for():
    """The rewrite mends `del`s in place: Thunder's CUDA-graph transform finds the backward's unpacking
    of saved tensors by position, and kforge.jit(cudagraphs=True, gemm=True) graphs the whole step."""
    from kforge.zoo import plain_llama

    ft = fake_cuda_trace(plain_llama.make, jit=lambda f: kforge.jit(f, trace_cache=False, gemm=True, cudagraphs=True),
                         size="micro", batch=2, seq=16, dtype=torch.bfloat16)
    for tr in (ft.forward, ft.backward):
        assert [b.sym.name for b in tr.bound_symbols if b.sym.name.startswith("CUDAGraph")] != [], tr
        assert not [b for b in tr.bound_symbols if b.sym.name.startswith("kforge_gemm")], "a GEMM outside the graph"


@pytest.mark.parametrize("model", ["plain_llama", "hf_gpt2", "nanogpt"])
def test_rewritten_traces_train_like_eager_on_the_cpu(model):
    """GemmCalls(devices=("cpu",), dtypes=(torch.float32,)) rewrites a CPU model's traces as it does CUDA ones (every call then
    takes its ATen op), so the rewrite itself, views folded and `del`s placed again, runs here: one
    training step against eager, fp32."""
    import importlib

    import thunder

    make = importlib.import_module(f"kforge.zoo.{model}").make
    m, inputs, opts = make(size="micro", batch=2, seq=16, device="cpu", dtype=torch.float32)
    eager = copy.deepcopy(m)
    jm = kforge.jit(m, trace_cache=False, transforms=[gemm.GemmCalls(devices=("cpu",), dtypes=(torch.float32,))])

    def step(fn):
        loss = opts["loss_fn"](fn(**inputs) if isinstance(inputs, dict) else fn(*inputs))
        loss.backward()
        return loss

    before = gemm.stats()
    loss, ref = step(jm), step(eager)
    assert_close(loss.detach(), ref.detach(), torch.float32, "loss")
    ref_grads = dict(eager.named_parameters())
    for n, p in m.named_parameters():
        assert_close(p.grad, ref_grads[n].grad, torch.float32, f"{n}.grad")
    bwd = thunder.last_backward_traces(jm)[-1]
    names = Counter(b.sym.name for b in bwd.bound_symbols)
    assert names["kforge_gemm_views"] > 0 and names["reshape"] == 0, names
    if model == "plain_llama":  # q / k / v's head splits folded into their calls
        heads = [b.args[4] for b in thunder.last_traces(jm)[-1].bound_symbols
                 if b.sym.name == "kforge_gemm_linear_views" and b.args[4] is not None]
        assert heads == [(0, 2, 1, 3)] * 3, heads
    assert _stats_delta(before)["aten_calls"] >= names["kforge_gemm_views"]


# ---- GPU: the entry points ----------------------------------------------------------------------
SHAPES = [(1, 8, 8), (3, 64, 40), (257, 136, 72), (64, 768, 2304)]  # (m, k, n): k, n multiples of 8


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a_row, b_row", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_mm_matches_float64(dtype, a_row, b_row, m, k, n):
    a, b = _operand(m, k, a_row, dtype), _operand(k, n, b_row, dtype)
    before = gemm.stats()
    out = _C.gemm_mm(a, b)
    assert out.dtype == dtype and out.is_contiguous()
    assert_close(out, _ref(a, b), dtype, f"mm {m}x{k}x{n}")
    # k and n keep 16-byte rows; a column-major a has m-element columns, which must too
    fast = int(a_row or m == 1 or m * a.element_size() % 16 == 0)
    assert _stats_delta(before) == {"fast_calls": fast, "aten_calls": 1 - fast}


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", SHAPES)
def test_addmm_bias_and_accumulate_match_float64(dtype, m, k, n):
    a, b = randn(m, k, dtype=dtype), randn(k, n, dtype=dtype)
    bias = randn(n, dtype=dtype)
    assert_close(_C.gemm_addmm(bias, a, b), _ref(a, b) + bias.double(), dtype, "addmm")
    c = randn(m, n, dtype=dtype)
    ref = c.double() + _ref(a, b)
    ptr = c.data_ptr()
    out = _C.gemm_addmm_(c, a, b)
    assert out.data_ptr() == ptr
    assert_close(c, ref, dtype, "addmm_")


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float64(dtype, bias):
    x, w = randn(2, 33, 96, dtype=dtype), randn(136, 96, dtype=dtype)
    b = randn(136, dtype=dtype) if bias else None
    before = gemm.stats()
    out = _C.gemm_linear(x, w, b)
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert out.shape == (2, 33, 136)
    assert_close(out, ref, dtype, "linear")
    assert _stats_delta(before) == {"fast_calls": 1, "aten_calls": 0}


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_widen_stores_the_fp32_sum(dtype):
    a, b = randn(100, 256, dtype=dtype), randn(256, 72, dtype=dtype)
    out = _C.gemm_mm_widen(a, b)
    assert out.dtype == torch.float32
    assert_close(out, _ref(a, b), torch.float32, "widen", tol=1e-5)  # no 16-bit rounding of the result


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_views_match_float64(dtype):
    """The folded backward of a linear layer: dx = g @ W viewed as (B, T, in), dW = g^T @ x with g and x
    given as (B, T, features), q / k / v sums accumulated, autocast's fp32 weight gradients widened."""
    B, T, n, k = 2, 37, 96, 64
    g, x, w = randn(B, T, n, dtype=dtype), randn(B, T, k, dtype=dtype), randn(n, k, dtype=dtype)
    g2, x2 = g.reshape(-1, n).double(), x.reshape(-1, k).double()
    dx = _C.gemm_views(g, n, False, w, k, False, None, False, (B, T, k))
    assert dx.shape == (B, T, k)
    assert_close(dx, (g2 @ w.double()).view(B, T, k), dtype, "dx")
    dw = _C.gemm_views(g, n, True, x, k, False, None, False, None)
    assert_close(dw, g2.t() @ x2, dtype, "dw")
    acc = randn(B * T, k, dtype=dtype)
    ref = acc.double() + g2 @ w.double()
    out = _C.gemm_views(g, n, False, w, k, False, acc, False, (B, T, k))
    assert out.data_ptr() == acc.data_ptr()
    assert_close(out, ref.view(B, T, k), dtype, "accumulated")
    if dtype == torch.bfloat16:
        wide = _C.gemm_views(g, n, True, x, k, False, None, True, None)
        assert wide.dtype == torch.float32
        assert_close(wide, g2.t() @ x2, torch.float32, "widened", tol=1e-5)


@gpu
@pytest.mark.parametrize("case", ["odd k", "odd n", "offset a", "strided rows", "general strides", "empty"])
def test_off_the_fast_path_still_right(case):
    """What the plans do not take goes to ATen inside the same call, with the same result."""
    dt = torch.bfloat16
    m, k, n = 40, 64, 48
    a, b = randn(m, k, dtype=dt), randn(k, n, dtype=dt)
    fast = 0
    if case == "odd k":
        a, b = randn(m, 63, dtype=dt), randn(63, n, dtype=dt)
    elif case == "odd n":
        b = randn(k, 47, dtype=dt)
    elif case == "offset a":
        a = randn(m * k + 1, dtype=dt)[1:].view(m, k)
    elif case == "strided rows":  # ld 72 > k: a fast-path view (16-byte aligned rows)
        a = randn(m, 72, dtype=dt)[:, :k]
        fast = 1
    elif case == "general strides":
        a = randn(m, k, 2, dtype=dt)[:, :, 0]
    else:
        a, b = randn(0, k, dtype=dt), randn(k, n, dtype=dt)
    before = gemm.stats()
    out = _C.gemm_mm(a, b)
    if out.numel():
        assert_close(out, _ref(a, b), dt, case)
    assert out.shape == (a.shape[0], b.shape[1])
    assert _stats_delta(before) == {"fast_calls": fast, "aten_calls": 1 - fast}


@gpu
def test_fp32_follows_torchs_tf32_setting():
    """IEEE fp32 unless torch allows TF32: full precision is ~1e-7 relative here, TF32 ~3e-4 (10-bit
    mantissas), so 1e-5 tells them apart."""
    a, b = randn(256, 1024, dtype=torch.float32), randn(1024, 256, dtype=torch.float32)
    ref = _ref(a, b)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert_close(_C.gemm_mm(a, b), ref, torch.float32, "ieee", tol=1e-5)
        torch.backends.cuda.matmul.allow_tf32 = True
        out = _C.gemm_mm(a, b)
        assert_close(out, ref, torch.float32, "tf32", tol=5e-3)
        assert_close(out, a @ b, torch.float32, "tf32 vs torch", tol=5e-3)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_views_match_float64(dtype, bias):
    """A linear's head split in its call: float64-right, the same values and strides as the linear's
    result viewed and permuted by torch, a view of one fresh buffer (no copy)."""
    b_, t, h, d, k = 3, 37, 4, 24, 40
    x = randn(b_, t, k, dtype=dtype, device="cuda", seed=1)
    w = randn(h * d, k, dtype=dtype, device="cuda", seed=2)
    bb = randn(h * d, dtype=dtype, device="cuda", seed=3) if bias else None
    y = _C.gemm_linear_views(x, w, bb, [b_, t, h, d], [0, 2, 1, 3])
    ref = F.linear(x.double(), w.double(), None if bb is None else bb.double()).view(b_, t, h, d).transpose(1, 2)
    assert y.shape == (b_, h, t, d) and y.stride() == (t * h * d, d, h * d, 1), y.stride()
    assert_close(y, ref, dtype, "linear_views")
    assert torch.equal(y, _C.gemm_linear(x, w, bb).view(b_, t, h, d).permute(0, 2, 1, 3))
    flat = _C.gemm_linear_views(x, w, bb, [b_ * t, h * d], None)
    assert flat.shape == (b_ * t, h * d) and flat.is_contiguous() and torch.equal(flat, y.transpose(1, 2).reshape(-1, h * d))


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_addmm_views_match_float64(dtype):
    """Conv1D's projection with its views in the call: x (B, T, k) as rows, bias + x @ w, viewed as
    (B, T, n): float64-right and the same values as the plain addmm viewed by torch."""
    b_, t, k, n = 3, 37, 40, 72
    x = randn(b_, t, k, dtype=dtype, device="cuda", seed=1)
    w = randn(k, n, dtype=dtype, device="cuda", seed=2)
    bias = randn(n, dtype=dtype, device="cuda", seed=3)
    y = _C.gemm_addmm_views(bias, x, k, w, [b_, t, n])
    ref = (x.double().view(-1, k) @ w.double() + bias.double()).view(b_, t, n)
    assert y.shape == (b_, t, n) and y.is_contiguous()
    assert_close(y, ref, dtype, "addmm_views")
    assert torch.equal(y, _C.gemm_addmm(bias, x.view(-1, k), w).view(b_, t, n))
    assert _C.gemm_addmm_views(bias, x, k, w, None).shape == (b_ * t, n)


@gpu
def test_bitwise_deterministic():
    a, b = randn(1000, 768, dtype=torch.bfloat16), randn(768, 3072, dtype=torch.bfloat16)
    assert torch.equal(_C.gemm_mm(a, b), _C.gemm_mm(a, b))
    g, x = randn(8192, 768, dtype=torch.bfloat16).t(), randn(8192, 2048, dtype=torch.bfloat16)
    assert torch.equal(_C.gemm_mm(g, x), _C.gemm_mm(g, x))  # a long k: split-K territory


@gpu
def test_side_stream_and_graph_capture():
    dt = torch.bfloat16
    a, b, bias = randn(128, 256, dtype=dt), randn(256, 192, dtype=dt), randn(192, dtype=dt)
    ref = _ref(a, b) + bias.double()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = _C.gemm_addmm(bias, a, b)
    torch.cuda.current_stream().wait_stream(s)
    assert_close(out, ref, dt, "side stream")
    _C.gemm_addmm(bias, a, b)  # the plan exists before capture, as after a warm-up step
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = _C.gemm_addmm(bias, a, b)
    a.copy_(randn(128, 256, dtype=dt))
    g.replay()
    torch.cuda.synchronize()
    assert_close(captured, _ref(a, b) + bias.double(), dt, "replayed with new a")


@gpu
@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 300), k=st.integers(1, 300), n=st.integers(1, 300),
       a_row=st.booleans(), b_row=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_generated_shapes_match_float64(m, k, n, a_row, b_row, dtype):
    a, b = _operand(m, k, a_row, dtype, seed=m * 7 + k), _operand(k, n, b_row, dtype, seed=n)
    assert_close(_C.gemm_mm(a, b), _ref(a, b), dtype, f"{m}x{k}x{n}")


# ---- GPU: tuning (KFORGE_GEMM_TUNE) ------------------------------------------------------------------
@pytest.fixture
def tuned_plans():
    """Tuning on with no plan made yet; afterwards as it was (KFORGE_GEMM_TUNE), plans dropped."""
    was = gemm.stats()["tune"]
    gemm.set_tune(True, forget=True)
    yield
    gemm.set_tune(was, forget=True)


def _tuned(m: int, k: int, n: int) -> list[dict]:
    return [t for t in gemm.tuning() if (t["m"], t["k"], t["n"]) == (m, k, n)]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", [(257, 136, 72), (1024, 768, 2048), (2048, 2048, 768)])
def test_tuned_plans_match_float64(tuned_plans, dtype, m, k, n):
    """Every entry on a tuned plan: float64-right, the accumulator added to once (the candidates are
    timed into a scratch output), the same bits call after call, the choice listed with its times."""
    a, b = _operand(m, k, True, dtype), _operand(k, n, False, dtype)
    bias, c = randn(n, dtype=dtype), randn(m, n, dtype=dtype)
    out = _C.gemm_mm(a, b)
    assert_close(out, _ref(a, b), dtype, f"tuned mm {m}x{k}x{n}")
    assert torch.equal(_C.gemm_mm(a, b), out)
    assert_close(_C.gemm_addmm(bias, a, b), _ref(a, b) + bias.double(), dtype, "tuned addmm")
    ref = c.double() + _ref(a, b)
    _C.gemm_addmm_(c, a, b)
    assert_close(c, ref, dtype, "tuned addmm_ (added once)")
    tuned = _tuned(m, k, n)
    assert len(tuned) == 3, gemm.tuning()  # mm, bias, accumulate: three plans
    for t in tuned:
        times = t["times_us"]
        if not times:  # a single candidate: nothing to time
            assert t["chosen"] == 0, t
            continue
        assert 0 <= t["chosen"] < len(times) and times[t["chosen"]] >= 0, t
        assert times[t["chosen"]] <= min(x for x in times if x >= 0) / 0.97 + 1e-3, t
    st_ = gemm.stats()
    assert st_["tune"] and st_["tuned"] >= 3 and st_["plans_without_kernel"] == 0


@gpu
def test_tuning_waits_for_a_call_outside_graph_capture(tuned_plans):
    """A plan first made during capture is not tuned there (timing synchronises, which capture
    forbids): the graph replays the heuristic's kernel, right; the next call outside capture tunes."""
    dt = torch.bfloat16
    a, b = randn(384, 256, dtype=dt), randn(256, 320, dtype=dt)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = _C.gemm_mm(a, b)
    assert not _tuned(384, 256, 320) and gemm.stats()["plans"] >= 1
    a.copy_(randn(384, 256, dtype=dt))
    g.replay()
    torch.cuda.synchronize()
    assert_close(captured, _ref(a, b), dt, "captured, untuned")
    assert_close(_C.gemm_mm(a, b), _ref(a, b), dt, "tuned after capture")
    assert len(_tuned(384, 256, 320)) == 1


@gpu
def test_tuning_off_runs_the_heuristics_first(tuned_plans):
    """With tuning off no candidate is timed: the plan runs what torch's cuBLASLt path would."""
    gemm.set_tune(False, forget=True)
    dt = torch.bfloat16
    a, b = randn(200, 128, dtype=dt), randn(128, 96, dtype=dt)
    assert_close(_C.gemm_mm(a, b), _ref(a, b), dt, "untuned")
    assert not gemm.tuning() and gemm.stats()["tuned"] == 0


def test_set_tune_takes_bools():
    with pytest.raises(TypeError, match="set_tune"):
        gemm.set_tune(1)
    for bad in (1, None, "on"):  # pybind11 would read 1 as True and None as False
        with pytest.raises(TypeError):
            _C.gemm_set_tune(bad)
    before = gemm.stats()["tune"]
    gemm.set_tune(before)
    assert gemm.stats()["tune"] is before


# ---- GPU: users' models with the flag on ----------------------------------------------------------
@gpu
@pytest.mark.parametrize("model, autocast", [("plain_llama", False), ("plain_llama", True), ("hf_gpt2", False),
                                             ("nanogpt", False), ("nanogpt", True)])
def test_users_models_tie_out_with_gemm_plans(monkeypatch, model, autocast):
    """One training step with KFORGE_GEMM=1 against eager: loss and every gradient within kforge's bf16
    tie-out tolerances, every GEMM of the traces on a plan, and plans actually launched."""
    import importlib

    import thunder

    from kforge.tieout import TOLERANCES, compare

    monkeypatch.setenv("KFORGE_GEMM", "1")
    make = importlib.import_module(f"kforge.zoo.{model}").make
    m, inputs, opts = make(size="tiny", batch=2, seq=64, device="cuda", dtype=torch.bfloat16, autocast=autocast)
    eager = copy.deepcopy(m)
    compiled = kforge.jit(m, trace_cache=False)

    def step(fn):
        ctx = torch.autocast("cuda", torch.bfloat16) if autocast else torch.autocast("cuda", enabled=False)
        with ctx:
            out = fn(**inputs) if isinstance(inputs, dict) else fn(*inputs)
            loss = opts["loss_fn"](out)
        loss.backward()
        return loss

    before = gemm.stats()
    loss, ref = step(compiled), step(eager)
    tol = TOLERANCES[torch.bfloat16]
    rows = [compare("loss", loss.float(), ref.float(), tol)]
    ref_grads = dict(eager.named_parameters())
    rows += [compare(f"{n}.grad", p.grad, ref_grads[n].grad, tol) for n, p in m.named_parameters()]
    bad = [r for r in rows if not r.ok]
    assert not bad, "\n".join(f"{r.name}: rel {r.rel:.3e} (tol {r.tol:.1e}) {r.note}" for r in bad)
    census = _gemm_census(thunder.last_traces(compiled)[-1]) + _gemm_census(thunder.last_backward_traces(compiled)[-1])
    assert census and not any(k.startswith("left") for k in census), census
    assert _stats_delta(before)["fast_calls"] >= sum(census.values()) // 2, (gemm.stats(), census)


def test_programs_with_gemm_calls_round_trip_the_trace_cache():
    """kforge.trace_cache writes and rebuilds programs that call the plans: each kforge_gemm_* global
    comes back as the same launcher of kforge._C."""
    import pickle

    import thunder

    from kforge import trace_cache
    from kforge.zoo import plain_llama

    ft = fake_cuda_trace(plain_llama.make, jit=lambda f: kforge.jit(f, trace_cache=False, gemm=True), size="micro")
    entry = thunder.compile_stats(ft.fn).interpreter_cache[0]
    compiled = thunder.compile_data(ft.fn).fn
    record = pickle.loads(pickle.dumps(trace_cache.save_entry(ft.fn, entry)))
    seen = set()
    for rec in record["programs"].values():
        rebuilt = trace_cache._program_of(trace_cache.rebuild_program(rec, compiled, []))
        for name in rec["ctx"]:
            if name.startswith("kforge_gemm"):
                assert rebuilt.__globals__[name] is getattr(_C, name[len("kforge_"):]), name
                seen.add(name)
    assert {"kforge_gemm_linear", "kforge_gemm_linear_views", "kforge_gemm_views"} <= seen, seen


_RECORD_RUN = """
import json, torch, kforge
from kforge.ops import gemm
from kforge import _C
out = []
for m, k, n in [(1024, 768, 2048), (2048, 2048, 768), (257, 136, 72)]:
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    out.append(_C.gemm_mm(a, b).float().sum().item())
print(json.dumps({"tuning": gemm.tuning(), "stats": gemm.stats()}))
"""


@gpu
def test_tuning_choices_come_back_from_the_record(tmp_path):
    """A second process with tuning on takes every timed shape's kernel from the first one's tuning
    record (the same index, not timed), and a process without the record file times again."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "KFORGE_GEMM_TUNE": "1", "KFORGE_CACHE_DIR": str(tmp_path / "cache")}

    def run():
        r = subprocess.run([sys.executable, "-c", _RECORD_RUN], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    first = run()
    timed = {(t["m"], t["n"], t["k"]): t["chosen"] for t in first["tuning"] if t["times_us"]}
    assert timed and not any(t["restored"] for t in first["tuning"]), first
    records = list((tmp_path / "cache").glob("gemm-tuning-*.txt"))
    assert len(records) == 1 and len(records[0].read_text().splitlines()) == len(timed)
    second = run()
    again = {(t["m"], t["n"], t["k"]): t for t in second["tuning"]}
    for shape, chosen in timed.items():
        assert again[shape]["restored"] and not again[shape]["times_us"], again[shape]
        assert again[shape]["chosen"] == chosen, (shape, chosen, again[shape])
    assert second["stats"]["tuned_restored"] == len(timed)
    records[0].unlink()
    third = run()
    assert not any(t["restored"] for t in third["tuning"]) and third["stats"]["tuned_restored"] == 0
