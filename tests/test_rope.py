"""rope: rotary embedding of q and k in one launch (rotate_half and interleaved layouts).

GPU: forward and backward (dq, dk) against a float64 reference (complex multiplication for the
interleaved layout), every table layout, position_ids, GQA head counts, odd / strided / misaligned
inputs, invalid positions, both kernels (tiled, and per-token for unaligned rows / tables and odd
D / 2), thunder.jit traces; output layouts (token-major in, token-major out; anything else,
contiguous), on a side stream and in a CUDA graph. CPU: checker declines, thunder.jit fallback,
helper semantics (HF and Meta references), launcher errors, NVRTC compiles for sm_80 / sm_90.
"""
from __future__ import annotations

import functools

import pytest
import torch
import thunder
from hypothesis import example, given, settings
from hypothesis import strategies as st
from thunder.core.trace import TraceCtx, tracectx

import kforge
from kforge import _thunder
from kforge.ops import rope as op
import conftest
from conftest import DTYPES, assert_close, check_jit_matches_eager, gpu, randn, symbol_names

# Proxies in this file are bf16 unless a test says otherwise (conftest.proxy defaults to fp32).
proxy = functools.partial(conftest.proxy, dtype=torch.bfloat16)


def reference(x, cos, sin, interleaved, position_ids=None):
    """float64 rope of x (B, H, T, D): HF's x * cos + rotate_half(x) * sin, or Meta's pairs as complex
    numbers times cos + i sin."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    if position_ids is not None:
        cos, sin = cos[position_ids], sin[position_ids]
    if cos.ndim == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if interleaved:
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(xc * torch.complex(cos, sin)).flatten(-2)
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


def tables(kind, B, T, D, interleaved, dtype, device="cuda"):
    """(cos, sin, position_ids) for a table layout: 'bt' (B, T, Dc), '1t' (1, T, Dc), 't' (T, Dc), or
    (P, Dc) tables with position ids 'pos' (B, T), 'pos1' (1, T), 'posT' (T,). Random angles (and, for
    rotate_half, independent halves: the kernel must not assume HF's repeated halves)."""
    dc = D // 2 if interleaved else D
    g = torch.Generator().manual_seed(B * 1000 + T * 10 + D)
    pos = None
    if kind.startswith("pos"):
        P = T + 11
        shape = {"pos": (B, T), "pos1": (1, T), "posT": (T,)}[kind]
        pos = torch.randint(0, P, shape, generator=g).to(device)
        tshape = (P, dc)
    else:
        tshape = {"bt": (B, T, dc), "1t": (1, T, dc), "t": (T, dc)}[kind]
    ang = torch.rand(*tshape, generator=g) * 6.3
    amp = 0.5 + torch.rand(*tshape, generator=g)
    return (amp * ang.cos()).to(device, dtype), (amp * ang.sin()).to(device, dtype), pos


def token_major(B, H, T, D, dtype=torch.float32):
    """Random (B, H, T, D) laid out (B, T, H, D) in memory, as x.view(B, T, H, D).transpose(1, 2) of
    a linear's output leaves a Llama's q and k."""
    return randn(B, T, H, D, dtype=dtype).transpose(1, 2)


def token_major_strides(B, H, T, D):
    return (T * H * D, D, H * D, 1)


def contiguous_strides(B, H, T, D):
    return (H * T * D, T * D, D, 1)


def out_strides(x):
    """The strides rope gives the output for input x (B, H, T, D): x's when x is token-major and not
    also contiguous (T or H of 1), else contiguous (B, H, T, D)'s (a strided last dim, a slice of a
    fused projection or any other permutation included)."""
    if not x.is_contiguous() and x.transpose(1, 2).is_contiguous():
        return token_major_strides(*x.shape)
    return contiguous_strides(*x.shape)


def laid_out_as(x, ref):
    """A copy of x with ref's strides."""
    return torch.empty_strided(ref.shape, ref.stride(), dtype=x.dtype, device=x.device).copy_(x)


def assert_layout(out, x, what):
    """out has the layout rope promises for input x, and fills its whole allocation, every element
    written (outputs start NaN-poisoned; the inputs and tables of these tests are finite)."""
    want = out_strides(x)
    assert out.stride() == want, f"{what}: strides {out.stride()}, want {want} for input {x.stride()}"
    nbytes = out.untyped_storage().nbytes()
    assert out.storage_offset() == 0 and nbytes == out.numel() * out.element_size(), what
    assert torch.isfinite(out.as_strided((out.numel(),), (1,))).all(), f"{what}: unwritten elements"


# The tiled kernel takes 16-byte aligned rows and table rows; the per-token kernel the rest.
# grads="outputs": output gradients in q_rot's / k_rot's layout (what attention's backward hands
# back); "contiguous": contiguous whatever the outputs' layout.
def check(q, k, cos, sin, interleaved, pos, what="", grads="outputs"):
    dtype = q.dtype
    q_in, k_in = q.clone(), k.clone()
    q_rot, k_rot = kforge._C.rope_forward(q, k, cos, sin, pos, interleaved)
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    rq, rk = reference(q64, cos, sin, interleaved, pos), reference(k64, cos, sin, interleaved, pos)
    assert q_rot.dtype == dtype and q_rot.shape == q.shape and k_rot.shape == k.shape
    assert_layout(q_rot, q, f"q_rot {what}")
    assert_layout(k_rot, k, f"k_rot {what}")
    assert torch.equal(q, q_in) and torch.equal(k, k_in), f"{what}: inputs modified"
    assert_close(q_rot, rq, dtype, f"q_rot {what}")
    assert_close(k_rot, rk, dtype, f"k_rot {what}")
    gq, gk = randn(*q.shape, dtype=dtype), randn(*k.shape, dtype=dtype)
    if grads == "outputs":
        gq, gk = laid_out_as(gq, q_rot), laid_out_as(gk, k_rot)
    dq, dk = kforge._C.rope_backward(gq, gk, cos, sin, pos, interleaved)
    assert dq.dtype == dtype and dq.shape == q.shape and dk.shape == k.shape
    assert_layout(dq, gq, f"dq {what}")
    assert_layout(dk, gk, f"dk {what}")
    torch.autograd.backward((rq, rk), (gq.double(), gk.double()))
    assert_close(dq, q64.grad, dtype, f"dq {what}")
    assert_close(dk, k64.grad, dtype, f"dk {what}")


# (B, Hq, Hkv, T, D, table layout). Tiled kernel: head groups of 8 with partial groups (Hq 6, Hkv 1
# or 2, 12 + 3), token tiles crossing a batch boundary (T 1000, 33), a tile larger than the tokens
# (T 1), D 96 (12 / 6 chunks); D / 2 odd (D 6, 10): the per-token kernel.
CASES = [
    (2, 8, 2, 16, 128, "bt"),
    (1, 4, 4, 1, 64, "1t"),      # seq 1, MHA
    (2, 6, 2, 1000, 64, "t"),    # seq 1000
    (3, 4, 1, 7, 96, "pos"),
    (2, 2, 1, 5, 6, "pos1"),     # D / 2 odd: element-wise path
    (1, 3, 1, 9, 10, "posT"),
    (2, 32, 8, 33, 128, "pos"),
    (3, 12, 3, 37, 64, "bt"),
]


def check_random(case, dtype, interleaved, what, table_dtype=None):
    """check() on random q (B, Hq, T, D) and k (B, Hkv, T, D) with tables(kind) of table_dtype (default:
    dtype), for case = (B, Hq, Hkv, T, D, kind)."""
    B, Hq, Hkv, T, D, kind = case
    cos, sin, pos = tables(kind, B, T, D, interleaved, table_dtype or dtype)
    q, k = randn(B, Hq, T, D, dtype=dtype), randn(B, Hkv, T, D, dtype=dtype)
    check(q, k, cos, sin, interleaved, pos, what)


def each_dtype_layout(test):
    """Parametrizes a test over DTYPES x (rotate_half, interleaved)."""
    test = pytest.mark.parametrize("dtype", DTYPES, ids=str)(test)
    return pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])(test)


def each_case(cases):
    """Parametrizes a test over (dtype incl. fp16) x layout x `cases` x table dtype (same / float32)."""
    def wrap(test):
        test = pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)(test)
        test = pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])(test)
        test = pytest.mark.parametrize("case", cases, ids=lambda c: "-".join(map(str, c)))(test)
        return pytest.mark.parametrize("table_dtype", ["same", "float32"])(test)

    return wrap


@gpu
@each_case(CASES)
def test_forward_backward(dtype, interleaved, case, table_dtype):
    check_random(case, dtype, interleaved, str(case),
                 table_dtype=dtype if table_dtype == "same" else torch.float32)


@gpu
@each_dtype_layout
def test_llama_size(dtype, interleaved):
    # The bench size: 4 x 2048 tokens, 32 q heads + 8 kv heads of dim 128, HF (1, T, D) tables.
    check_random((4, 32, 8, 2048, 128, "1t"), dtype, interleaved, "4x2048 32+8 heads")


@gpu
@each_dtype_layout
def test_many_token_tiles_with_position_ids(dtype, interleaved):
    # Many token tiles (3 x 1531 = 4593 tokens: over 100 tiles of <= 32 tokens), tiles crossing
    # batch rows, position ids, a partial last group of q heads (10 = 8 + 2) and of k heads.
    check_random((3, 10, 3, 1531, 128, "pos"), dtype, interleaved, "many tiles")


@gpu
@each_dtype_layout
def test_strided_and_misaligned_inputs(dtype, interleaved):
    B, Hq, Hkv, T, D = 2, 4, 2, 6, 64
    cos, sin, pos = tables("pos", B, T, D, interleaved, dtype)
    # HF layout: (B, T, H, D) projections viewed as (B, H, T, D).
    q = randn(B, T, Hq, D, dtype=dtype).transpose(1, 2)
    k = randn(B, T, Hkv, D, dtype=dtype).transpose(1, 2)
    check(q, k, cos, sin, interleaved, pos, "transposed")
    # Rows starting off 16-byte boundaries: the element-wise path.
    qm = randn(B * Hq * T * D + 1, dtype=dtype)[1:].view(B, Hq, T, D)
    check(qm, k, cos, sin, interleaved, pos, "misaligned q")
    # Non-dense last dim: copied by the launcher.
    qs = randn(B, Hq, T, 2 * D, dtype=dtype)[..., ::2]
    check(qs, k, cos, sin, interleaved, pos, "strided last dim")
    # int32 position ids and misaligned tables: the per-token kernel.
    cbuf = torch.cat((cos.new_zeros(1), cos.flatten()))[1:].view(cos.shape)
    check(q, k, cbuf, sin, interleaved, pos.int(), "int32 ids, misaligned cos")


# (B, Hq, Hkv, T, D, table layout) for token-major q and k: tiled kernel with partial head groups
# and odd T (tiles crossing batch rows), D 96; D / 2 odd (D 6, 10): the per-token element-wise
# kernel. With T or H of 1 token-major is also contiguous, and the output contiguous (k of 1 head,
# T 1).
TOKEN_MAJOR_CASES = [
    (2, 8, 2, 17, 128, "bt"),
    (3, 6, 1, 33, 64, "pos"),
    (2, 12, 3, 7, 96, "1t"),
    (2, 2, 1, 5, 6, "pos1"),
    (1, 3, 1, 9, 10, "posT"),
    (2, 4, 2, 1, 64, "t"),
]


@gpu
@each_case(TOKEN_MAJOR_CASES)
def test_token_major_outputs_stay_token_major(dtype, interleaved, case, table_dtype):
    B, Hq, Hkv, T, D, kind = case
    cos, sin, pos = tables(kind, B, T, D, interleaved, dtype if table_dtype == "same" else torch.float32)
    q, k = token_major(B, Hq, T, D, dtype), token_major(B, Hkv, T, D, dtype)
    # check() asserts the layouts: forward in q's / k's, backward in the output gradients'.
    check(q, k, cos, sin, interleaved, pos, f"token-major {case}")
    check(q, k, cos, sin, interleaved, pos, f"token-major {case}, contiguous grads", grads="contiguous")
    q_rot, k_rot = kforge._C.rope_forward(q, k, cos, sin, pos, interleaved)
    dq, dk = kforge._C.rope_backward(q_rot, k_rot, cos, sin, pos, interleaved)
    for out, H in ((q_rot, Hq), (dq, Hq), (k_rot, Hkv), (dk, Hkv)):
        want = (token_major_strides if T > 1 and H > 1 else contiguous_strides)(B, H, T, D)
        assert out.stride() == want, f"strides {out.stride()}, want {want}"
    # The head merge is a view, as it is of attention's output then.
    assert q_rot.transpose(1, 2).view(B, T, Hq * D).data_ptr() == q_rot.data_ptr()
    # Each output follows its own input: token-major q with contiguous k, and the reverse.
    kc = k.contiguous()
    check(q, kc, cos, sin, interleaved, pos, f"token-major q, contiguous k {case}")
    check(q.contiguous(), k, cos, sin, interleaved, pos, f"contiguous q, token-major k {case}")


@gpu
@each_dtype_layout
def test_token_major_with_misaligned_tables(dtype, interleaved):
    # Token-major rows, tables off 16-byte boundaries: the per-token kernel's 16-byte row path with
    # element-wise table loads; fp32 tables on 16-bit q too.
    B, Hq, Hkv, T, D = 2, 8, 2, 11, 64
    for table_dtype in {dtype, torch.float32}:
        cos, sin, pos = tables("pos", B, T, D, interleaved, table_dtype)
        cbuf = torch.cat((cos.new_zeros(1), cos.flatten()))[1:].view(cos.shape)
        q, k = token_major(B, Hq, T, D, dtype), token_major(B, Hkv, T, D, dtype)
        check(q, k, cbuf, sin, interleaved, pos, f"misaligned cos, {table_dtype} tables")


@gpu
@each_dtype_layout
def test_other_layouts_give_contiguous_outputs(dtype, interleaved):
    B, Hq, Hkv, T, D = 2, 4, 2, 9, 64
    cos, sin, pos = tables("bt", B, T, D, interleaved, dtype)
    # q, k, v split from a fused (B, T, (Hq + 2 Hkv) D) projection: token-major but not dense.
    qkv = randn(B, T, Hq + 2 * Hkv, D, dtype=dtype).transpose(1, 2)
    q, k = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv]
    check(q, k, cos, sin, interleaved, None, "fused qkv slices")
    # Every other token of a longer sequence: not dense.
    q = token_major(B, Hq, 2 * T, D, dtype)[:, :, ::2]
    k = token_major(B, Hkv, T + 3, D, dtype)[:, :, 1:T + 1]
    check(q, k, cos, sin, interleaved, None, "token slices")
    # Dense, but heads outermost ((H, B, T, D) in memory): not token-major.
    q = randn(Hq, B, T, D, dtype=dtype).permute(1, 0, 2, 3)
    k = randn(Hkv, B, T, D, dtype=dtype).permute(1, 0, 2, 3)
    check(q, k, cos, sin, interleaved, None, "heads outermost")
    for x in (q, k):
        assert kforge._C.rope_forward(x, x, cos, sin, None, interleaved)[0].is_contiguous()
    # Contiguous in, contiguous out (the other tests check it for every case too).
    q, k = randn(B, Hq, T, D, dtype=dtype), randn(B, Hkv, T, D, dtype=dtype)
    for out in kforge._C.rope_forward(q, k, cos, sin, None, interleaved):
        assert out.is_contiguous()


@gpu
@pytest.mark.parametrize("D, interleaved", [(128, False), (10, True)], ids=["tiled", "per-token"])
def test_token_major_side_stream_and_cuda_graph_capture(D, interleaved):
    """Token-major outputs on a side stream and from a replayed CUDA graph: same layout, and the
    values of a plain launch (the rotation is linear, so -q rotates to exactly -rope(q))."""
    B, Hq, Hkv, T, dtype = 2, 8, 2, 9, torch.bfloat16
    cos, sin, pos = tables("pos", B, T, D, interleaved, dtype)
    q, k = token_major(B, Hq, T, D, dtype), token_major(B, Hkv, T, D, dtype)
    fq, fk = kforge._C.rope_forward(q, k, cos, sin, pos, interleaved)  # loaded before capture
    bq, bk = kforge._C.rope_backward(fq, fk, cos, sin, pos, interleaved)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = q * 2  # a kernel right before rope's on the same stream
        side = kforge._C.rope_forward(y, k, cos, sin, pos, interleaved)
        side_bwd = kforge._C.rope_backward(*side, cos, sin, pos, interleaved)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cq, ck = kforge._C.rope_forward(q, k, cos, sin, pos, interleaved)
        dq, dk = kforge._C.rope_backward(cq, ck, cos, sin, pos, interleaved)
    q.mul_(-1)  # replay must see the new values
    graph.replay()
    torch.cuda.synchronize()
    for out, H in ((cq, Hq), (ck, Hkv), (dq, Hq), (dk, Hkv), (side[0], Hq), (side_bwd[0], Hq)):
        assert out.stride() == token_major_strides(B, H, T, D)
    assert torch.equal(cq, -fq) and torch.equal(ck, fk)
    assert torch.equal(dq, -bq) and torch.equal(dk, bk)
    assert_close(side[0], 2 * fq.double(), dtype, "side stream q_rot")
    assert_close(side_bwd[0], 2 * bq.double(), dtype, "side stream dq")


@gpu
@each_dtype_layout
def test_invalid_positions_give_nan_rows(dtype, interleaved):
    B, Hq, Hkv, T, D = 1, 2, 1, 4, 16
    cos, sin, _ = tables("t", 1, 8, D, interleaved, torch.float32)  # 8 positions
    pos = torch.tensor([[0, 8, -1, 7]], device="cuda")
    bad = torch.tensor([False, True, True, False], device="cuda")
    contiguous = randn(B, Hq, T, D, dtype=dtype), randn(B, Hkv, T, D, dtype=dtype)
    for q, k in (contiguous, (token_major(B, Hq, T, D, dtype), token_major(B, Hkv, T, D, dtype))):
        for fn in (kforge._C.rope_forward, kforge._C.rope_backward):
            for x, out in zip((q, k), fn(q, k, cos, sin, pos, interleaved)):
                assert out.stride() == out_strides(x)
                assert torch.isnan(out[:, :, bad]).all() and torch.isfinite(out[:, :, ~bad]).all()


@gpu
def test_backward_of_hf_tables_is_rotation_by_minus_theta():
    # With HF's repeated halves, the transpose is the inverse rotation: forward with -sin.
    B, Hq, Hkv, T, D = 2, 4, 2, 8, 64
    ang = torch.rand(1, T, D // 2, device="cuda") * 6
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    g, h = randn(B, Hq, T, D), randn(B, Hkv, T, D)
    dq, dk = kforge._C.rope_backward(g, h, cos, sin)
    fq, fk = kforge._C.rope_forward(g, h, cos, -sin)
    assert_close(dq, fq.double(), torch.float32, "dq")
    assert_close(dk, fk.double(), torch.float32, "dk")


@gpu
def test_gpu_argument_errors():
    q, k = randn(1, 2, 4, 8), randn(1, 1, 4, 8)
    cos, sin, _ = tables("t", 1, 4, 8, False, torch.float32)
    with pytest.raises(kforge.KforgeError, match="even"):
        kforge._C.rope_forward(randn(1, 2, 4, 7), randn(1, 1, 4, 7), cos[:, :7], sin[:, :7])
    with pytest.raises(kforge.KforgeError, match="does not match q"):
        kforge._C.rope_forward(q, randn(1, 1, 5, 8), cos, sin)
    with pytest.raises(kforge.KforgeError, match=r"cos / sin must be"):
        kforge._C.rope_forward(q, k, cos, sin, None, True)  # interleaved wants D / 2 entries
    with pytest.raises(kforge.KforgeError, match="position_ids must be"):
        kforge._C.rope_forward(q, k, cos, sin, torch.zeros(3, dtype=torch.long, device="cuda"))
    with pytest.raises(kforge.KforgeError, match="dtype must be q's"):
        kforge._C.rope_forward(q.bfloat16(), k.bfloat16(), cos.half(), sin.half())
    with pytest.raises(kforge.KforgeError, match="have no rows"):
        kforge._C.rope_forward(q, k, cos[:0], sin[:0], torch.zeros(4, dtype=torch.long, device="cuda"))


# ---- GPU: thunder.jit ----------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("kind", ["1t", "pos"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_thunder_jit(dtype, interleaved, kind):
    B, Hq, Hkv, T, D = 2, 8, 2, 12, 64
    cos, sin, pos = tables(kind, B, T, D, interleaved, dtype)

    def fn(q, k):
        q_rot, k_rot = op.apply_rope(q, k, cos, sin, interleaved, pos)
        return q_rot * 2 + 1, k_rot

    q = randn(B, T, Hq, D, dtype=dtype).transpose(1, 2).requires_grad_()
    k = randn(B, Hkv, T, D, dtype=dtype).requires_grad_()
    check_jit_matches_eager(fn, [q, k], dtype, "kforge_rope_forward", "kforge_rope_backward", ["q", "k", "dq", "dk"])


@gpu
@pytest.mark.parametrize("table_dtype", ["same", "float32"])
@pytest.mark.parametrize("kind", ["1t", "pos"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
def test_thunder_jit_token_major(dtype, interleaved, kind, table_dtype):
    """Through thunder.jit and its autograd: token-major q / k give token-major q_rot / k_rot, and
    token-major output gradients (as attention's backward returns them) give token-major dq / dk,
    seen by hooks on q and k before accumulation."""
    B, Hq, Hkv, T, D = 2, 8, 2, 13, 64
    cos, sin, pos = tables(kind, B, T, D, interleaved, dtype if table_dtype == "same" else torch.float32)
    q = token_major(B, Hq, T, D, dtype).requires_grad_()
    k = token_major(B, Hkv, T, D, dtype).requires_grad_()
    grads = {}
    q.register_hook(lambda g: grads.__setitem__("dq", g))
    k.register_hook(lambda g: grads.__setitem__("dk", g))

    def fn(q, k):
        return op.apply_rope(q, k, cos, sin, interleaved, pos)

    jf = thunder.jit(fn, executors=[kforge.executor])
    q_rot, k_rot = jf(q, k)
    gq, gk = token_major(B, Hq, T, D, dtype), token_major(B, Hkv, T, D, dtype)
    torch.autograd.backward((q_rot, k_rot), (gq, gk))
    assert "kforge_rope_forward" in symbol_names(thunder.last_traces(jf)[-1])
    assert "kforge_rope_backward" in symbol_names(thunder.last_backward_traces(jf)[-1])
    for t, H, what in ((q_rot, Hq, "q_rot"), (k_rot, Hkv, "k_rot"), (grads["dq"], Hq, "dq"),
                       (grads["dk"], Hkv, "dk")):
        assert t.stride() == token_major_strides(B, H, T, D), f"{what}: strides {t.stride()}"
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    rq, rk = reference(q64, cos, sin, interleaved, pos), reference(k64, cos, sin, interleaved, pos)
    torch.autograd.backward((rq, rk), (gq.double(), gk.double()))
    assert_close(q_rot, rq, dtype, "q_rot")
    assert_close(k_rot, rk, dtype, "k_rot")
    assert_close(grads["dq"], q64.grad, dtype, "dq")
    assert_close(grads["dk"], k64.grad, dtype, "dk")
    assert_close(q.grad, q64.grad, dtype, "q.grad")
    assert_close(k.grad, k64.grad, dtype, "k.grad")


# ---- CPU: checker, fallback, helper semantics, launcher errors ------------------------------------------
def test_checker(trace_ctx):
    (claim,) = op.SPEC.claims
    c = claim.checker
    q, k = proxy(2, 8, 16, 128), proxy(2, 2, 16, 128)
    cos, sin = proxy(2, 16, 128), proxy(2, 16, 128)
    assert c(q, k, cos, sin) is None
    assert c(q, k, proxy(16, 128, dtype=torch.float32), proxy(16, 128, dtype=torch.float32)) is None
    assert c(q, k, proxy(1, 16, 64), proxy(1, 16, 64), True) is None
    assert c(q, k, proxy(40, 128), proxy(40, 128), False, proxy(2, 16, dtype=torch.int64)) is None
    assert c(q, k, proxy(40, 64), proxy(40, 64), True, proxy(16, dtype=torch.int32)) is None
    cpu = proxy(2, 8, 16, 128, device="cpu")
    assert "not CUDA" in c(cpu, proxy(2, 2, 16, 128, device="cpu"), cos, sin)
    assert "differs from q" in c(q, proxy(2, 2, 16, 128, dtype=torch.float16), cos, sin)
    assert "differ in B, T or D" in c(q, proxy(2, 2, 15, 128), cos, sin)
    assert "odd" in c(proxy(2, 8, 16, 7), proxy(2, 2, 16, 7), proxy(16, 7), proxy(16, 7))
    assert "(B, H, T, D)" in c(proxy(16, 128), proxy(16, 128), cos, sin)
    assert "is not" in c(q, k, cos, sin, True)  # interleaved tables have D / 2 entries
    assert "is not" in c(q, k, proxy(3, 16, 128), proxy(3, 16, 128))
    assert "float32" in c(q, k, proxy(16, 128, dtype=torch.float16), proxy(16, 128, dtype=torch.float16))
    assert "require grad" in c(q, k, proxy(16, 128, requires_grad=True), proxy(16, 128))
    assert "int64 or int32" in c(q, k, proxy(40, 128), proxy(40, 128), False, proxy(16, dtype=torch.float32))
    assert "position_ids shape" in c(q, k, proxy(40, 128), proxy(40, 128), False, proxy(3, 16, dtype=torch.int64))
    assert "with position_ids" in c(q, k, cos, sin, False, proxy(2, 16, dtype=torch.int64))
    assert "Python bool" in c(q, k, cos, sin, 1)


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_cpu_fallback(interleaved):
    B, Hq, Hkv, T, D = 2, 4, 2, 5, 8
    cos, sin, pos = tables("pos", B, T, D, interleaved, torch.float32, device="cpu")

    def fn(q, k):
        q_rot, k_rot = op.apply_rope(q, k, cos, sin, interleaved, pos)
        return (q_rot.sum(1, keepdim=True) * k_rot).sum()

    q, k = torch.randn(B, Hq, T, D, requires_grad=True), torch.randn(B, Hkv, T, D, requires_grad=True)
    jq, jk = (t.detach().clone().requires_grad_() for t in (q, k))
    _thunder.reset_declines()
    jf = thunder.jit(fn, executors=[kforge.executor])
    out, ref = jf(jq, jk), fn(q, k)
    out.backward()
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(jq.grad, q.grad)
    torch.testing.assert_close(jk.grad, k.grad)
    assert any("not CUDA" in r for r in _thunder.declines()["kforge_apply_rope"])
    assert "kforge_rope_forward" not in symbol_names(thunder.last_traces(jf)[-1])


@pytest.mark.parametrize("interleaved", [False, True], ids=["rotate_half", "interleaved"])
def test_cpu_fallback_without_grad(interleaved):
    # Declined without autograd, the trace keeps kforge_apply_rope and runs the helper itself.
    B, Hq, Hkv, T, D = 2, 4, 2, 5, 8
    cos, sin, _ = tables("1t", B, T, D, interleaved, torch.float32, device="cpu")
    q, k = torch.randn(B, Hq, T, D), torch.randn(B, Hkv, T, D)
    jf = thunder.jit(op.apply_rope, executors=[kforge.executor])
    with torch.no_grad():
        for o, r in zip(jf(q, k, cos, sin, interleaved), op.apply_rope(q, k, cos, sin, interleaved)):
            torch.testing.assert_close(o, r)


def test_helper_rotate_half_is_hf():
    # transformers' apply_rotary_pos_emb with unsqueeze_dim=1, tables as LlamaRotaryEmbedding builds them.
    B, Hq, Hkv, T, D = 2, 4, 2, 6, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    pos = torch.arange(T)[None].expand(B, T)
    freqs = pos[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    q, k = torch.randn(B, Hq, T, D).bfloat16(), torch.randn(B, Hkv, T, D).bfloat16()

    def rotate_half(x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    hq, hk = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    oq, ok = op.apply_rope(q, k, cos, sin)
    assert torch.equal(oq, hq) and torch.equal(ok, hk)


def test_helper_interleaved_is_meta():
    # Meta's llama reference: precompute_freqs_cis + apply_rotary_emb (complex64).
    B, Hq, Hkv, T, D = 2, 4, 2, 6, 16
    freqs = 1.0 / (10000 ** (torch.arange(0, D, 2)[: D // 2].float() / D))
    freqs_cis = torch.polar(torch.ones(T, D // 2), torch.outer(torch.arange(T).float(), freqs))
    q, k = torch.randn(B, Hq, T, D), torch.randn(B, Hkv, T, D)

    def meta(x):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis).flatten(3).type_as(x)

    oq, ok = op.apply_rope(q, k, freqs_cis.real, freqs_cis.imag, interleaved=True)
    torch.testing.assert_close(oq, meta(q))
    torch.testing.assert_close(ok, meta(k))


@pytest.mark.parametrize("arch", [80, 90])
def test_kernels_compile(arch, tmp_path):
    # Every rope kernel (tiled and per-token, tables of q's dtype and fp32) through NVRTC, from an
    # empty cache so that nothing is read back from an earlier compile.
    kforge._C.set_cache(str(tmp_path), True)
    kforge._C.clear_memory_cache()
    try:
        lowered = kforge._C.compile("rope", arch)
    finally:
        kforge._C.set_cache(kforge.cache_dir(), kforge._runtime.disk_cache_enabled())
        kforge._C.clear_memory_cache()
    exprs = kforge._C.name_expressions("rope")
    assert len(lowered) == len(exprs) and all(lowered), (exprs, lowered)
    assert {e.split("<")[0] for e in exprs} == {"rope_kernel", "rope_f32tab_kernel", "rope_tile_kernel",
                                                "rope_tile_f32tab_kernel"}


def test_launcher_rejects_cpu_tensors():
    q, k, c = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(4, 8)
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.rope_forward(q, k, c, c)
    with pytest.raises(kforge.KforgeError, match="must be a CUDA tensor"):
        kforge._C.rope_backward(q, k, c, c, None, False)


# ---- property-based (hypothesis) ----------------------------------------------------------------
_INT_MAX = 2**31 - 1
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _rope_launcher_takes(q, k, cos, sin, pos, interleaved) -> bool:
    """rope_forward's / rope_backward's checks (src/ops/rope.cpp) on shapes, dtypes and devices, in order."""
    def cuda_float(t):
        return t.device.type == "cuda" and t.dtype in _FLOATS

    if not (cuda_float(q) and cuda_float(k) and q.ndim == 4 and k.ndim == 4):
        return False
    if k.device != q.device or k.dtype != q.dtype:
        return False
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, T, D) or D <= 0 or D % 2:
        return False
    if B * T > _INT_MAX or Hq + Hkv > _INT_MAX:
        return False
    dc = D // 2 if interleaved else D
    if cos.device != q.device or sin.device != q.device or cos.dtype != sin.dtype:
        return False
    if cos.dtype not in (q.dtype, torch.float32) or cos.shape != sin.shape:
        return False
    if cos.ndim not in (2, 3) or cos.shape[-1] != dc:
        return False
    if pos is not None:
        ps = tuple(pos.shape)
        return (cos.ndim == 2 and cos.shape[0] > 0 and pos.device == q.device
                and pos.dtype in (torch.int64, torch.int32)
                and (ps == (T,) or (len(ps) == 2 and ps[0] in (1, B) and ps[1] == T)))
    if cos.ndim == 2:
        return cos.shape[0] == T
    return cos.shape[0] in (1, B) and cos.shape[1] == T


class _Meta:
    """What the launcher model reads of a proxy, in torch terms."""

    def __init__(self, p):
        from thunder.core import dtypes

        self.shape, self.ndim = tuple(p.shape), p.ndim
        self.dtype = dtypes.to_torch_dtype(p.dtype)
        self.device = torch.device(p.device.device_str())


_ANY_DTYPE = st.sampled_from([*_FLOATS, torch.float64, torch.int64])
_TABLES = ["bt", "1t", "t", "pos", "pos1", "posT"]
_BREAKS = ["none", "dc", "rows", "batch", "sin_shape", "f32", "f64", "sin_dtype", "cpu", "requires_grad",
           "no_rows", "pos_int16", "pos_shape", "pos_cpu", "pos_3d_table", "not_tensor"]


def _mostly(value, *others):
    """`value` about half the time, else any of value / others: generated arguments stay mostly valid
    (one rule broken at a time), so the rules checked last are reached too."""
    return st.one_of(st.just(value), st.sampled_from([value, *others]))


@settings(max_examples=1000)
@given(dims=st.tuples(*[st.sampled_from([1, 2, 3, 0, 2**16, 2**31])] * 4), D=st.sampled_from([2, 4, 6, 8, 0, 7]),
       q_ndim=_mostly(4, 3), k_break=_mostly("none", "B", "T", "D", "dtype", "cpu", "3d"),
       dtype=st.one_of(st.sampled_from(_FLOATS), _ANY_DTYPE), device=_mostly("cuda", "cpu"),
       interleaved=st.sampled_from([False, True, False, True, 0, 1]), table=st.sampled_from(_TABLES),
       brk=_mostly("none", *_BREAKS))
# What it found in the checker, kept as explicit examples: B * T past 2^31 - 1, a (0, Dc) table.
@example(dims=(1, 1, 1, 2**31), D=2, q_ndim=4, k_break="none", dtype=torch.float32, device="cuda", interleaved=False,
         table="bt", brk="none")
@example(dims=(1, 2, 1, 3), D=8, q_ndim=4, k_break="none", dtype=torch.bfloat16, device="cuda", interleaved=True,
         table="pos", brk="no_rows")
def test_checker_never_accepts_what_the_kernel_cannot_do(dims, D, q_ndim, k_break, dtype, device, interleaved, table, brk):
    """Generated q / k proxies (sizes 0, 1, odd, B * T and Hq + Hkv past 2^31 - 1, odd D), interleaved
    values, table layouts and one broken rule at a time (table width, rows, dtypes, devices, gradient,
    position ids): whatever the checker accepts, the launcher's checks pass (`_rope_launcher_takes`
    mirrors src/ops/rope.cpp), interleaved is a bool, the tables need no gradient and q / k are not
    empty. Fails if a rule goes: before the checker's fix the search found B * T past 2^31 - 1
    accepted, and a (0, Dc) table with position_ids (read off the launcher; an explicit example) was
    accepted too; the launcher rejects both."""
    B, Hq, Hkv, T = dims
    q_shape = (B, Hq, T, D)[:q_ndim]
    k_shape = {"none": (B, Hkv, T, D), "B": (B + 1, Hkv, T, D), "T": (B, Hkv, T + 1, D), "D": (B, Hkv, T, D + 2),
               "3d": (B, Hkv, T), "dtype": (B, Hkv, T, D), "cpu": (B, Hkv, T, D)}[k_break]
    other = torch.float32 if dtype != torch.float32 else torch.bfloat16
    dc = D // 2 if interleaved else D
    P = 0 if brk == "no_rows" else T + 3
    tshape = {"bt": (B, T, dc), "1t": (1, T, dc), "t": (T, dc)}.get(table, (P, dc))
    tshape = {"dc": tshape[:-1] + (dc + 1,), "rows": (tshape[0] + 1,) + tshape[1:],
              "batch": (B + 2,) + tshape[1:] if len(tshape) == 3 else tshape,
              "pos_3d_table": (1,) + tshape}.get(brk, tshape)
    tdtype = {"f32": torch.float32, "f64": torch.float64}.get(brk, dtype)
    tdev = "cpu" if brk == "cpu" else device
    pshape = {"pos": (B, T), "pos1": (1, T), "posT": (T,)}.get(table)
    if pshape is not None and brk == "pos_shape":
        pshape = (B + 2, T)
    with tracectx(TraceCtx()):
        q = conftest.proxy(q_shape, dtype=dtype, device=device)
        k = conftest.proxy(k_shape, dtype=other if k_break == "dtype" else dtype,
                           device="cpu" if k_break == "cpu" else device)
        cos = conftest.proxy(tshape, dtype=tdtype, device=tdev, requires_grad=brk == "requires_grad")
        sin = conftest.proxy(tshape[:-1] + (dc + 2,) if brk == "sin_shape" else tshape,
                             dtype=other if brk == "sin_dtype" else tdtype, device=tdev)
        pos = None if pshape is None else conftest.proxy(
            pshape, dtype=torch.int16 if brk == "pos_int16" else torch.int64,
            device="cpu" if brk == "pos_cpu" else device)
        if brk == "not_tensor":
            sin = 0.5
        if op._check_apply_rope(q, k, cos, sin, interleaved, pos) is not None:
            return
        metas = [_Meta(t) for t in (q, k, cos, sin)] + [None if pos is None else _Meta(pos)]
    assert isinstance(interleaved, bool) and brk != "requires_grad"
    assert 0 not in q_shape and 0 not in k_shape
    assert _rope_launcher_takes(*metas, interleaved), (q_shape, k_shape, tshape, pshape, brk)


# D around the 16-byte chunk of a row (rotate_half: D / 2, interleaved: D a multiple of 4 fp32 / 8
# 16-bit elements: the tiled kernel; the rest, D / 2 odd included: the per-token kernel) and past
# 256 chunks; heads around the tiled kernel's groups of 8; T of 1, odd, a few token tiles.
@gpu
@pytest.mark.sanitize
@settings(max_examples=40, deadline=None)
@given(B=st.sampled_from([1, 2, 3]), Hq=st.sampled_from([1, 3, 8, 9]), Hkv=st.sampled_from([1, 2, 8]),
       T=st.sampled_from([1, 2, 7, 33, 130]), D=st.sampled_from([2, 4, 6, 8, 10, 16, 30, 32, 34, 64, 96, 128]),
       dtype=st.sampled_from(list(_FLOATS)), f32_tables=st.booleans(), interleaved=st.booleans(),
       table=st.sampled_from(_TABLES), view=st.sampled_from(["contiguous", "token_major", "misaligned", "sliced"]),
       seed=st.integers(0, 2**31 - 1))
def test_property_matches_float64(B, Hq, Hkv, T, D, dtype, f32_tables, interleaved, table, view, seed):
    """Generated shapes, dtypes, table layouts and dtypes (q's or fp32), and views of q / k (token-major
    as a linear's output split into heads; one element past a 16-byte boundary; a head-dim slice of a
    wider buffer: strided rows): forward and backward within the dtype's tolerance of float64, with the
    promised output layouts, every element written (check()). Fails on a wrong rotation, a wrong table
    row or an unwritten (NaN-poisoned) element."""
    cos, sin, pos = tables(table, B, T, D, interleaved, torch.float32 if f32_tables else dtype)

    def laid_out(H, s):
        x = randn(B, H, T, D, dtype=dtype, seed=s)
        if view == "token_major":
            return x.transpose(1, 2).contiguous().transpose(1, 2)
        if view == "misaligned":
            return torch.empty(x.numel() + 1, dtype=dtype, device="cuda")[1:].view(x.shape).copy_(x)
        if view == "sliced":
            return torch.empty(B, H, T, D + 2, dtype=dtype, device="cuda")[..., 1:D + 1].copy_(x)
        return x

    check(laid_out(Hq, seed), laid_out(Hkv, seed + 1), cos, sin, interleaved, pos,
          f"{B}x({Hq}+{Hkv})x{T}x{D} {table} {view}")
