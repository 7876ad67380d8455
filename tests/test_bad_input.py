"""Bad input at every public entry (issue 20): each `kforge._C` launcher and each kforge.ops helper,
given a wrong rank, dtype, shape, device or argument, raises a clear error naming the op and the
problem (KforgeError, a RuntimeError, from the launchers' KF_CHECKs; ValueError from the helpers),
never a wrong shape or a crash.

CPU tests: CPU tensors into every launcher (the device check comes before any GPU work, so it runs
here), the helpers' argument checks. GPU tests: wrong rank / dtype / shapes / mixed devices into the
launchers, where those checks are reached.
"""
from __future__ import annotations

import pytest
import torch

import kforge
from conftest import gpu, randn
from kforge._testing import override
from kforge.ops.gqa import repeat_kv
from kforge.ops.permute import merge_heads, split_qkv
from kforge.ops.rope import apply_rope
from kforge.ops.softmax import causal_softmax

C = kforge._C
# kforge._C functions that are not op launchers (the runtime's own API).
RUNTIME = {"configure", "set_cache", "set_log_handler", "set_poison_outputs", "cache_info",
           "clear_memory_cache", "reset_cache_stats", "nvrtc_version", "nvrtc_library", "nvrtc_supported_archs",
           "device_arch", "programs", "kernel_coverage", "compile", "compile_source", "compile_generated", "name_expressions",
           "plan", "plan_layouts", "plan_ops",  # plans: host arithmetic, no tensors (tests/test_plan.py)
           "has_grad_wrapper"}  # any tuple; its cases in tests/test_lookasides.py


def with_variant(op, variant, call):
    """call() under `op`'s testing override (kforge._testing.override)."""
    with override(op, variant=variant):
        return call()


def _launcher_calls(dev: str) -> dict:
    """{launcher: call with well-formed arguments on `dev`} (shapes and dtypes right, only the device
    is for the test to vary)."""
    x, x3, h = randn(4, 8, device=dev), randn(2, 4, 24, device=dev), randn(1, 2, 4, 8, device=dev)
    t = torch.zeros(4, dtype=torch.long, device=dev)
    f, s, cs = randn(4, device=dev), randn(1, device=dev).view(()), randn(4, 8, device=dev)
    return {
        "axpy": lambda: C.axpy(x, x),
        "colsum_forward": lambda: C.colsum_forward(x),
        "embedding_backward": lambda: C.embedding_backward(x, t, 9),
        "cross_entropy_forward": lambda: C.cross_entropy_forward(x, t),
        "cross_entropy_backward": lambda: C.cross_entropy_backward(s, x, t, f, s),
        "cross_entropy_forward_backward": lambda: C.cross_entropy_forward_backward(x, t, s),
        "cross_entropy_forward_unit_grad": lambda: C.cross_entropy_forward_unit_grad(x, t),
        "cross_entropy_rescale": lambda: C.cross_entropy_rescale(x, s),
        "gelu_forward": lambda: C.gelu_forward(x),
        "gelu_backward": lambda: C.gelu_backward(x, x),
        "repeat_kv_forward": lambda: C.repeat_kv_forward(h, 2),
        "repeat_kv_backward": lambda: C.repeat_kv_backward(h, 2),
        "layernorm_forward": lambda: C.layernorm_forward(x, None, None),
        "layernorm_backward": lambda: C.layernorm_backward(x, x, None, None, f, f),
        "add_layernorm_forward": lambda: C.add_layernorm_forward(x.bfloat16(), x, None, None),
        "layernorm_backward_copy": lambda: C.layernorm_backward_copy(x, x, None, None, f, f, x, torch.bfloat16),
        "split_qkv_forward": lambda: C.split_qkv_forward(x3, 2),
        "split_qkv_backward": lambda: C.split_qkv_backward(h, h, h),
        "merge_heads_forward": lambda: C.merge_heads_forward(h),
        "merge_heads_backward": lambda: C.merge_heads_backward(randn(1, 4, 16, device=dev), 2),
        "merge_heads_forward_view": lambda: C.merge_heads_forward_view(h),
        "merge_heads_backward_view": lambda: C.merge_heads_backward_view(randn(1, 4, 16, device=dev), 2),
        "residual_forward": lambda: C.residual_forward(x, x),
        "rmsnorm_forward": lambda: C.rmsnorm_forward(x, None, 1e-6),
        "add_rmsnorm_forward": lambda: C.add_rmsnorm_forward(x, x, None, 1e-6),
        "rmsnorm_backward": lambda: C.rmsnorm_backward(x, x, None, f),
        "rmsnorm_backward_copy": lambda: C.rmsnorm_backward_copy(x, x, None, f, 1, True, None, torch.bfloat16),
        "rmsnorm_backward_sum": lambda: C.rmsnorm_backward_sum([x.bfloat16(), x.bfloat16()], x, None, f),
        "rope_forward": lambda: C.rope_forward(h, h, cs, cs),
        "rope_backward": lambda: C.rope_backward(h, h, cs, cs),
        "softmax_forward": lambda: C.softmax_forward(x),
        "softmax_backward": lambda: C.softmax_backward(x, x),
        "causal_softmax_forward": lambda: C.causal_softmax_forward(randn(2, 4, 4, device=dev), 1.0),
        "causal_softmax_backward": lambda: C.causal_softmax_backward(randn(2, 4, 4, device=dev),
                                                                     randn(2, 4, 4, device=dev), 1.0),
        "swiglu_forward": lambda: C.swiglu_forward(x, x),
        "swiglu_backward": lambda: C.swiglu_backward(x, x, x),
    }


LAUNCHERS = sorted(_launcher_calls("cpu"))
# kforge.ops.gemm's entries take tensors on any device (off CUDA they are the ATen op they stand for),
# so a CPU tensor is no error for them, and its switches and tables take none: their bad-input cases
# are in tests/test_gemm.py.
ANY_DEVICE = {"gemm_mm", "gemm_mm_widen", "gemm_addmm_", "gemm_addmm", "gemm_addmm_views", "gemm_linear", "gemm_linear_views",
              "gemm_views", "gemm_stats",
              "gemm_set_tune", "gemm_tuning"}


def test_every_launcher_has_a_bad_input_case():
    """A launcher added to kforge._C without a case here fails this test (so it gets one)."""
    public = {n for n in dir(C) if not n.startswith("_") and callable(getattr(C, n))
              and not isinstance(getattr(C, n), type)}
    missing = public - RUNTIME - set(LAUNCHERS) - ANY_DEVICE
    assert not missing, f"launchers without a bad-input case: {sorted(missing)}"


@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_rejects_cpu_tensors(name):
    """The first check of every launcher: a CPU tensor is a KforgeError naming the op and CUDA, before
    any GPU work (this runs on a machine without one)."""
    with pytest.raises(kforge.KforgeError, match=rf"^kforge\.{name}: .*must be a CUDA tensor"):
        _launcher_calls("cpu")[name]()


# ---- helpers (CPU, eager) ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape,n_rep,match", [
    ((2, 4, 8), 2, r"repeat_kv: x has shape \(2, 4, 8\), not \(B, Hkv, T, D\)"),
    ((1, 2, 4, 8, 1), 2, "not \\(B, Hkv, T, D\\)"),
    ((1, 2, 4, 8), 0, "repeat_kv: n_rep must be a positive int, got 0"),
    ((1, 2, 4, 8), -1, "n_rep must be a positive int"),
    ((1, 2, 4, 8), 2.0, "n_rep must be a positive int, got 2.0"),
    ((1, 2, 4, 8), True, "n_rep must be a positive int"),
])
def test_repeat_kv_rejects_bad_arguments(shape, n_rep, match):
    """Used to fail with "not enough values to unpack" (3-D) or return (B, 0, T, D) for n_rep = 0."""
    with pytest.raises(ValueError, match=match):
        repeat_kv(torch.randn(shape), n_rep)


def test_repeat_kv_still_repeats():
    x = torch.randn(2, 3, 5, 4)
    torch.testing.assert_close(repeat_kv(x, 3), torch.repeat_interleave(x, 3, dim=1), rtol=0, atol=0)
    assert repeat_kv(x, 1) is x


@pytest.mark.parametrize("q,k,match", [
    ((2, 4, 8), (2, 4, 8), r"apply_rope: q has shape \(2, 4, 8\), not \(B, H, T, D\)"),
    ((1, 2, 4, 8), (2, 4, 8), r"apply_rope: k has shape"),
    ((1, 2, 4, 7), (1, 2, 4, 7), "must be equal and even"),
    ((1, 2, 4, 8), (1, 2, 4, 6), "must be equal and even"),
])
def test_apply_rope_rejects_bad_heads(q, k, match):
    """A 3-D q used to be rotated over the wrong dims and an odd D gave a result without an error."""
    D = q[-1]
    with pytest.raises(ValueError, match=match):
        apply_rope(torch.randn(q), torch.randn(k), torch.randn(4, D), torch.randn(4, D))


@pytest.mark.parametrize("call,match", [
    (lambda: causal_softmax(torch.randn(8), 1.0), "causal_softmax: att shape"),
    (lambda: split_qkv(torch.randn(2, 4, 32), 4), r"split_qkv: last dim 32"),
    (lambda: split_qkv(torch.randn(4, 24), 2), r"split_qkv: qkv has shape \(4, 24\)"),
    (lambda: merge_heads(torch.randn(4, 2, 8)), r"merge_heads: y has shape \(4, 2, 8\)"),
], ids=["causal_softmax-1d", "split_qkv-last-dim", "split_qkv-2d", "merge_heads-3d"])
def test_helpers_name_the_op_and_the_problem(call, match):
    """The issue's examples (fixed in 91edda4), kept here with the other helpers' checks."""
    with pytest.raises(ValueError, match=match):
        call()


# ---- launchers on the GPU: rank, dtype, shapes, mixed devices ----------------------------------------
def _gpu_cases() -> list:
    """(id, call, message regex): every call is one defect in otherwise well-formed arguments."""
    x, x64, xi = randn(4, 8), randn(4, 8, dtype=torch.float64), torch.ones(4, 8, dtype=torch.int32, device="cuda")
    xb, x_cpu = randn(4, 8, dtype=torch.bfloat16), randn(4, 8, device="cpu")
    h, t = randn(1, 2, 4, 8), torch.zeros(4, dtype=torch.long, device="cuda")
    f, s = randn(4), randn(1).view(())
    cs = randn(4, 8)
    return [
        ("softmax-f64", lambda: C.softmax_forward(x64), r"softmax_forward: dtype .*not supported"),
        ("softmax-int", lambda: C.softmax_forward(xi), r"softmax_forward: dtype .*not supported"),
        ("softmax-0d", lambda: C.softmax_forward(randn(1).view(())), r"softmax_forward: .*0-d"),
        ("softmax_bwd-shape", lambda: C.softmax_backward(randn(4, 7), x), "softmax_backward: dy and y sizes differ"),
        ("softmax_bwd-dtype", lambda: C.softmax_backward(xb, x), "softmax_backward: dy has dtype"),
        ("softmax_bwd-device", lambda: C.softmax_backward(x_cpu, x), "softmax_backward: dy must be a CUDA tensor on"),
        ("causal-not-square", lambda: C.causal_softmax_forward(randn(2, 4, 5), 1.0), r"causal_softmax_forward: .*\(\.\.\., T, T\)"),
        ("causal-1d", lambda: C.causal_softmax_forward(randn(4), 1.0), r"causal_softmax_forward: .*\(\.\.\., T, T\)"),
        ("gelu-approximate", lambda: C.gelu_forward(x, "fast"), r"gelu_forward: approximate must be"),
        ("gelu-int", lambda: C.gelu_forward(xi), r"gelu_forward: dtype .*not supported"),
        ("gelu_bwd-shape", lambda: C.gelu_backward(randn(4, 7), x), "gelu_backward: dout has shape"),
        ("gelu_bwd-device", lambda: C.gelu_backward(x_cpu, x), "gelu_backward: .*CUDA tensor"),
        ("swiglu-shape", lambda: C.swiglu_forward(x, randn(4, 7)), "swiglu_forward: .*shapes differ"),
        ("swiglu-broadcast", lambda: C.swiglu_forward(x, randn(8)), "swiglu_forward: .*shapes differ"),
        ("swiglu-dtype", lambda: C.swiglu_forward(x, xb), "swiglu_forward: .*dtype"),
        ("swiglu_bwd-shape", lambda: C.swiglu_backward(randn(4, 7), x, x), "swiglu_backward: .*shapes differ"),
        ("residual-shape", lambda: C.residual_forward(x, randn(4, 7)), "residual_forward: b has shape"),
        ("residual-longer-b", lambda: C.residual_forward(randn(8), x), "residual_forward: b has shape"),
        ("residual-device", lambda: C.residual_forward(x, x_cpu), "residual_forward: b must be a CUDA tensor on"),
        ("residual-dtype", lambda: C.residual_forward(x, xb), "residual_forward: b has dtype"),
        ("layernorm-weight", lambda: C.layernorm_forward(x, randn(7), None), r"layernorm_forward: weight must have shape \(8\)"),
        ("layernorm-bias-dtype", lambda: C.layernorm_forward(x, None, randn(8, dtype=torch.bfloat16)), "layernorm_forward: bias has dtype"),
        ("layernorm-eps", lambda: C.layernorm_forward(x, None, None, -1e-5), "layernorm_forward: eps must be >= 0"),
        ("add_layernorm-dtypes", lambda: C.add_layernorm_forward(x, x, None, None),
         "add_layernorm_forward: x of float32 and residual of float32: a bfloat16 / float16 x added to a float32 residual"),
        ("layernorm-y-dtype", lambda: C.layernorm_forward(xb, None, None, 1e-5, torch.float16),
         "layernorm_forward: y_dtype .*only float32 x may store a bfloat16 / float16 y"),
        ("layernorm-0d", lambda: C.layernorm_forward(randn(1).view(()), None, None), "layernorm_forward: x must have at least one dimension"),
        ("layernorm-empty-rows", lambda: C.layernorm_forward(randn(4, 0), None, None), r"layernorm_forward: last dim C=0"),
        ("layernorm-variant", lambda: with_variant("layernorm_forward", 7, lambda: C.layernorm_forward(x, None, None)),
         "layernorm_forward: variant must be in"),
        ("layernorm_bwd-stats", lambda: C.layernorm_backward(x, x, None, None, randn(3), f), "layernorm_backward: mean must be float32 with one value per row"),
        ("layernorm_bwd-stats-dtype", lambda: C.layernorm_backward(x, x, None, None, f, f.double()), "layernorm_backward: rstd must be float32"),
        ("layernorm_bwd-shape", lambda: C.layernorm_backward(randn(4, 7), x, None, None, f, f), "layernorm_backward: dout has shape"),
        ("layernorm_bwd-dresidual", lambda: C.layernorm_backward(x, x, None, None, f, f, randn(4, 7)),
         r"layernorm_backward: dresidual has shape \[4, 7\], x has \[4, 8\]"),
        ("layernorm_bwd-dresidual-16", lambda: C.layernorm_backward(xb, xb, None, None, f, f, xb),
         "layernorm_backward: dresidual is taken with a float32 x only"),
        ("layernorm_bwd_copy-dtype", lambda: C.layernorm_backward_copy(x, x, None, None, f, f, None, torch.float64),
         "layernorm_backward_copy: copy_dtype .*only a float32 dx has a bfloat16 / float16 copy"),
        ("rmsnorm-weight", lambda: C.rmsnorm_forward(x, randn(7), 1e-6), "rmsnorm_forward: weight has 7 elements, expected 8"),
        ("rmsnorm-ndim", lambda: C.rmsnorm_forward(x, None, 1e-6, 3), "rmsnorm_forward: normalized_ndim 3 must be in"),
        ("rmsnorm-too-long", lambda: C.rmsnorm_forward(randn(2, 8193), None, 1e-6), "rmsnorm_forward: rows of 8193 elements are too long"),
        ("add_rmsnorm-residual", lambda: C.add_rmsnorm_forward(x, randn(4, 7), None, 1e-6), "add_rmsnorm_forward: residual and x sizes differ"),
        ("rmsnorm_bwd-rstd", lambda: C.rmsnorm_backward(x, x, None, randn(3)), "rmsnorm_backward: rstd must be a float32 CUDA tensor of 4"),
        ("rmsnorm_bwd-shape", lambda: C.rmsnorm_backward(randn(4, 7), x, None, f), "rmsnorm_backward: dy and x sizes differ"),
        ("rmsnorm_bwd_copy-dtype", lambda: C.rmsnorm_backward_copy(x, x, None, f, 1, True, None, torch.float64),
         "rmsnorm_backward_copy: copy_dtype .*only a float32 dx has a bfloat16 / float16 copy"),
        ("rmsnorm_bwd_sum-terms", lambda: C.rmsnorm_backward_sum([xb], x, None, f),
         "rmsnorm_backward_sum: takes 2 or 3 dy terms, got 1"),
        ("rmsnorm_bwd_sum-fp32-terms", lambda: C.rmsnorm_backward_sum([x, x], x, None, f),
         "rmsnorm_backward_sum: dy terms of float32 and float32: they must be all bfloat16 or all float16"),
        ("colsum-0d", lambda: C.colsum_forward(randn(1).view(())), "colsum_forward: x must have at least one dimension"),
        ("embedding-indices-dtype", lambda: C.embedding_backward(x, t.float(), 9), "embedding_backward: indices must be int64 or int32"),
        ("embedding-indices-device", lambda: C.embedding_backward(x, t.cpu(), 9), "embedding_backward: indices must be a CUDA tensor on"),
        ("embedding-shape", lambda: C.embedding_backward(x, t[:3], 9), r"embedding_backward: grad must have shape indices.shape \+ \(C,\)"),
        ("embedding-grad-dtype", lambda: C.embedding_backward(x64, t, 9), r"embedding_backward: dtype .*not supported"),
        ("embedding-num-weights", lambda: C.embedding_backward(x, t, -1), "embedding_backward: num_weights must be >= 0"),
        ("ce-rank", lambda: C.cross_entropy_forward(randn(2, 4, 8), t), r"cross_entropy_forward: logits must be 2-D"),
        ("ce-targets-dtype", lambda: C.cross_entropy_forward(x, t.int()), "cross_entropy_forward: targets must be int64"),
        ("ce-targets-shape", lambda: C.cross_entropy_forward(x, t[:3]), r"cross_entropy_forward: targets must have shape \(4\)"),
        ("ce-targets-device", lambda: C.cross_entropy_forward(x, t.cpu()), "cross_entropy_forward: targets must be a CUDA tensor"),
        ("ce-empty", lambda: C.cross_entropy_forward(randn(0, 8), t[:0]), "cross_entropy_forward: logits must be non-empty"),
        ("ce_bwd-grad", lambda: C.cross_entropy_backward(randn(2), x, t, f, s), "cross_entropy_backward: grad must have one element"),
        ("ce_bwd-lse", lambda: C.cross_entropy_backward(s, x, t, randn(3), s), "cross_entropy_backward: lse must be float32"),
        ("repeat_kv-rank", lambda: C.repeat_kv_forward(randn(2, 4, 8), 2), r"repeat_kv_forward: x must be \(B, Hkv, T, D\)"),
        ("repeat_kv-n_rep", lambda: C.repeat_kv_forward(h, 0), r"repeat_kv_forward: n_rep must be in \[1, 4096\]"),
        ("repeat_kv_bwd-heads", lambda: C.repeat_kv_backward(randn(1, 3, 4, 8), 2), r"repeat_kv_backward: dout must be \(B, Hkv \* n_rep, T, D\)"),
        ("split_qkv-rank", lambda: C.split_qkv_forward(x, 2), r"split_qkv_forward: qkv must be \(B, T, 3C\)"),
        ("split_qkv-heads", lambda: C.split_qkv_forward(randn(2, 4, 24), 5), "split_qkv_forward: last dim 24 is not 3 \\* n_head"),
        ("split_qkv-n_head", lambda: C.split_qkv_forward(randn(2, 4, 24), 0), "split_qkv_forward: n_head must be positive"),
        ("split_qkv_bwd-none", lambda: C.split_qkv_backward(None, None, None), "split_qkv_backward: dq, dk and dv are all None"),
        ("split_qkv_bwd-shape", lambda: C.split_qkv_backward(h, randn(1, 2, 4, 6), h), "split_qkv_backward: dk has shape"),
        ("merge_heads-rank", lambda: C.merge_heads_forward(randn(2, 4, 8)), r"merge_heads_forward: y must be \(B, NH, T, HS\)"),
        ("merge_heads_bwd-heads", lambda: C.merge_heads_backward(randn(1, 4, 10), 3), "merge_heads_backward: last dim 10 is not a multiple of n_head = 3"),
        ("merge_heads_view-rank", lambda: C.merge_heads_forward_view(randn(2, 4, 8)), r"merge_heads_forward_view: y must be \(B, NH, T, HS\)"),
        ("merge_heads_bwd_view-heads", lambda: C.merge_heads_backward_view(randn(1, 4, 10), 3), "merge_heads_backward_view: last dim 10 is not a multiple of n_head = 3"),
        ("rope-rank", lambda: C.rope_forward(randn(2, 4, 8), h, cs, cs), r"rope_forward: q must be \(B, H, T, D\)"),
        ("rope-k", lambda: C.rope_forward(h, randn(1, 2, 5, 8), cs, cs), "rope_forward: k shape .* does not match q"),
        ("rope-odd-D", lambda: C.rope_forward(randn(1, 2, 4, 7), randn(1, 2, 4, 7), randn(4, 7), randn(4, 7)), "rope_forward: head dim D must be even"),
        ("rope-table", lambda: C.rope_forward(h, h, randn(4, 6), randn(4, 6)), r"rope_forward: cos / sin must be"),
        ("rope-table-rows", lambda: C.rope_forward(h, h, randn(5, 8), randn(5, 8)), r"rope_forward: cos / sin \(T, 8\) must have T = 4 rows"),
        ("rope-table-device", lambda: C.rope_forward(h, h, cs.cpu(), cs.cpu()), "rope_forward: cos and sin must be CUDA tensors"),
        ("rope-positions", lambda: C.rope_forward(h, h, cs, cs, torch.zeros(3, dtype=torch.long, device="cuda")), "rope_forward: position_ids must be"),
        ("axpy-shape", lambda: C.axpy(x, randn(4, 7)), "axpy: x and y sizes differ"),
    ]


GPU_CASE_IDS = ["softmax-f64", "softmax-int", "softmax-0d", "softmax_bwd-shape", "softmax_bwd-dtype",
                "softmax_bwd-device", "causal-not-square", "causal-1d", "gelu-approximate", "gelu-int",
                "gelu_bwd-shape", "gelu_bwd-device", "swiglu-shape", "swiglu-broadcast", "swiglu-dtype",
                "swiglu_bwd-shape", "residual-shape", "residual-longer-b", "residual-device", "residual-dtype",
                "layernorm-weight", "layernorm-bias-dtype", "layernorm-eps", "add_layernorm-dtypes", "layernorm-y-dtype", "layernorm-0d",
                "layernorm-empty-rows", "layernorm-variant", "layernorm_bwd-stats", "layernorm_bwd-stats-dtype",
                "layernorm_bwd-shape", "layernorm_bwd-dresidual", "layernorm_bwd-dresidual-16",
                "layernorm_bwd_copy-dtype", "rmsnorm-weight", "rmsnorm-ndim", "rmsnorm-too-long",
                "add_rmsnorm-residual", "rmsnorm_bwd-rstd", "rmsnorm_bwd-shape", "rmsnorm_bwd_copy-dtype",
                "rmsnorm_bwd_sum-terms", "rmsnorm_bwd_sum-fp32-terms", "colsum-0d", "embedding-indices-dtype",
                "embedding-indices-device", "embedding-shape", "embedding-grad-dtype", "embedding-num-weights", "ce-rank",
                "ce-targets-dtype", "ce-targets-shape", "ce-targets-device", "ce-empty", "ce_bwd-grad",
                "ce_bwd-lse", "repeat_kv-rank", "repeat_kv-n_rep", "repeat_kv_bwd-heads", "split_qkv-rank",
                "split_qkv-heads", "split_qkv-n_head", "split_qkv_bwd-none", "split_qkv_bwd-shape",
                "merge_heads-rank", "merge_heads_bwd-heads", "merge_heads_view-rank", "merge_heads_bwd_view-heads",
                "rope-rank", "rope-k", "rope-odd-D", "rope-table",
                "rope-table-rows", "rope-table-device", "rope-positions", "axpy-shape"]


def test_gpu_case_ids_name_every_gpu_case():
    """GPU_CASE_IDS is written out so that collection needs no GPU; a case added to _gpu_cases without
    its id would only fail on a GPU machine, so the ids are compared with the source here."""
    import inspect
    import re

    ids = re.findall(r'^\s*\("([\w-]+)", lambda', inspect.getsource(_gpu_cases), flags=re.M)
    assert sorted(ids) == sorted(GPU_CASE_IDS)


@gpu
@pytest.mark.parametrize("case", GPU_CASE_IDS)
def test_launcher_rejects_bad_input_on_gpu(case):
    """One defect per call: a KforgeError whose message starts with the op's name and says what is
    wrong; the GPU stays usable afterwards (no sticky error from a launch that should not happen)."""
    cases = {cid: (call, match) for cid, call, match in _gpu_cases()}
    assert set(cases) == set(GPU_CASE_IDS)
    call, match = cases[case]
    with pytest.raises(kforge.KforgeError, match=r"^kforge\." + match):
        call()
    torch.cuda.synchronize()


@gpu
@pytest.mark.parametrize("name", LAUNCHERS)
def test_launcher_well_formed_call_runs(name):
    """The well-formed calls the CPU test makes defective run on the GPU (so the CPU test's error is
    the device, not some other defect in the call)."""
    out = _launcher_calls("cuda")[name]()
    torch.cuda.synchronize()
    assert out is not None
