"""kforge.ops.grouped_mm: the grouped products of mixture-of-experts layers and their gradients,
against float64 loops; the symbols that become it (transformers' custom op, torch._grouped_mm /
F.grouped_mm); Hugging Face's MoE models trained one step under kforge.jit against eager (CPU) and
traced as on a GPU; the bf16 CUTLASS path on a GPU."""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import thunder

from kforge.ops.grouped_mm import grouped_mm, grouped_mm_grads

F64 = torch.float64
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run the GPU suite on the GPU machine)")


def reference(a: torch.Tensor, b: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """float64 rows of group e times b[e]; rows past the groups zero."""
    out = torch.zeros(a.shape[0], b.shape[2], dtype=F64)
    start = 0
    for e, n in enumerate(sizes):
        out[start:start + n] = a[start:start + n].double() @ b[e].double()
        start += n
    return out


def make(sizes: list[int], k: int, n: int, extra: int, dtype: torch.dtype, device="cpu", seed=0,
         transposed_b: bool = False):
    """(a, b, offs, dy): S = sum(sizes) + extra rows (the extra past offs[-1], as expert-parallel
    sentinels), b (E, K, N), stored (E, N, K) and transposed when asked (transformers' layout)."""
    g = torch.Generator().manual_seed(seed)
    s = sum(sizes) + extra
    a = torch.randn(s, k, generator=g, dtype=F64)
    b = torch.randn(len(sizes), n, k, generator=g, dtype=F64).transpose(1, 2) if transposed_b else \
        torch.randn(len(sizes), k, n, generator=g, dtype=F64)
    dy = torch.randn(s, n, generator=g, dtype=F64)
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return a.to(device, dtype), b.to(device, dtype), offs.to(device), dy.to(device, dtype)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=6), k=st.integers(1, 17), n=st.integers(1, 13),
       extra=st.integers(0, 3), transposed=st.booleans(), dtype=st.sampled_from([torch.float32, F64]))
def test_matches_float64(sizes, k, n, extra, transposed, dtype):
    a, b, offs, dy = make(sizes, k, n, extra, dtype, transposed_b=transposed)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == F64 else dict(rtol=1e-5, atol=1e-5)
    out = grouped_mm(a, b, offs)
    assert out.shape == (a.shape[0], n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(a, b, sizes), **tol)
    # gradients: autograd of the float64 reference
    ar, br = a.double().clone().requires_grad_(), b.double().clone().requires_grad_()
    reference(ar, br, sizes).backward(dy.double())
    da, db = grouped_mm_grads(dy, a, b, offs)
    assert da.shape == a.shape and db.shape == b.shape and db.dtype == dtype
    torch.testing.assert_close(da.double(), ar.grad, **tol)
    torch.testing.assert_close(db.double(), br.grad, **tol)  # an empty group's weight gradient is zero


def _jit(fn):
    from kforge.transforms import jit

    return jit(fn)


def _symbols(jfn) -> set:
    names = {b.sym.name for b in thunder.last_traces(jfn)[-1].bound_symbols}
    backward = thunder.last_backward_traces(jfn)
    return names | ({b.sym.name for b in backward[-1].bound_symbols} if backward else set())


def test_transformers_custom_op_becomes_kforge_grouped_mm():
    pytest.importorskip("transformers.integrations.moe")
    op = torch.ops.transformers.grouped_mm_fallback

    def experts(x, w, offs):
        return op(x, w, offs=offs).relu()

    a, b, offs, dy = make([3, 0, 5, 2], 6, 7, 2, F64, transposed_b=True)
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    experts(ar, br, offs).backward(dy)
    jfn = _jit(experts)
    aj, bj = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = jfn(aj, bj, offs)
    out.backward(dy)
    torch.testing.assert_close(out, experts(a, b, offs), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(aj.grad, ar.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bj.grad, br.grad, rtol=1e-12, atol=1e-12)
    assert {"kforge_grouped_mm_forward", "kforge_grouped_mm_backward"} <= _symbols(jfn)
    with pytest.raises(Exception, match="not registered"):  # Thunder's own compilations: as they were
        thunder.jit(experts)(a, b, offs)


def test_torch_grouped_mm_with_offs_becomes_kforge_grouped_mm():
    """F.grouped_mm calls torch._grouped_mm(..., offs=...): Thunder 0.2.6's symbol takes offsets= and
    stopped the trace; under kforge it is the experts' product, with its gradient."""
    import torch.nn.functional as F

    if not hasattr(F, "grouped_mm"):
        pytest.skip("torch without F.grouped_mm")

    def experts(x, w, offs):
        return F.grouped_mm(x, w, offs=offs) * 2

    a, b, offs, dy = make([4, 4, 8], 8, 16, 0, torch.float32)  # 16-byte aligned rows: torch's CPU kernel
    ar, br = a.clone().requires_grad_(), b.clone().requires_grad_()
    experts(ar, br, offs).backward(dy)
    jfn = _jit(experts)
    aj, bj = a.clone().requires_grad_(), b.clone().requires_grad_()
    jfn(aj, bj, offs).backward(dy)
    torch.testing.assert_close(aj.grad, ar.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bj.grad, br.grad, rtol=1e-5, atol=1e-5)
    assert {"kforge_grouped_mm_forward", "kforge_grouped_mm_backward"} <= _symbols(jfn)


def test_bad_input_is_named():
    from thunder.core.proxies import TensorProxy  # noqa: F401  (the checker takes proxies)
    from kforge.ops.grouped_mm import _check_torch

    assert "offsets form" in _check_torch(object(), object(), None)
    pytest.importorskip("transformers.integrations.moe")
    a, b = torch.randn(5, 4, dtype=F64), torch.randn(2, 3, 6, dtype=F64)
    with pytest.raises(Exception, match="inner dims differ"):
        _jit(lambda x, w, o: torch.ops.transformers.grouped_mm_fallback(x, w, offs=o))(
            a, b, torch.tensor([2, 5], dtype=torch.int32))


# ---- Hugging Face's MoE models ------------------------------------------------------------------------
# name: (model class, config class, config, grouped products per step (two per MoE layer))
MOE = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2), 4),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                       norm_topk_prob=True), 4),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2), 4),
    # multi-head latent attention (its keys written slice by slice into a new tensor), one dense layer
    # then one MoE layer with a shared expert and group-limited routing
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config",
                    dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=None,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         first_k_dense_replace=1, n_group=1, topk_group=1, num_key_value_heads=4), 2),
}


def make_moe(name, **kwargs):
    """A 2-layer Hugging Face MoE causal LM at micro size (conftest.hf_micro_lm)."""
    from conftest import hf_micro_lm

    cls, cfg_cls, config, _ = MOE[name]
    return hf_micro_lm(cls, cfg_cls, config, **kwargs)


@pytest.mark.parametrize("name", list(MOE))
def test_moe_models_train_a_step_as_eager_does(name):
    """fp32 on the CPU (torch's grouped GEMM has no float64): the loss and every gradient, each within
    1e-4 of its largest entry. The routers renormalise their top-k weights in place, DeepSeek-V3
    writes its keys slice by slice into a new tensor; before kforge.inplace, Thunder's gradients
    were percents to tens of percent off."""
    from conftest import step_matches_eager

    model, inputs, _ = make_moe(name)
    assert any("gate" in n for n, _ in model.named_parameters())
    jm = step_matches_eager(model, inputs, _jit)
    assert {"kforge_grouped_mm_forward", "kforge_grouped_mm_backward"} <= _symbols(jm)


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "autocast"])
@pytest.mark.parametrize("dynamo", [False, True], ids=["jit", "dynamo"])
@pytest.mark.parametrize("name", list(MOE))
def test_moe_models_trace_as_on_a_gpu(name, dynamo, autocast):
    """bf16 weights take F.grouped_mm (torch._grouped_mm), fp32 weights under autocast transformers'
    custom op: both become kforge_grouped_mm, two per MoE layer (gate_up and down) forward and as
    many backward, on thunder.jit and on Thunder's Dynamo path; in bf16 on thunder.jit every fusion
    region's kernels compile."""
    import kforge

    from conftest import fake_cuda_trace

    traced = fake_cuda_trace(functools.partial(make_moe, name), jit=kforge.jit, dtype=torch.bfloat16,
                             autocast=autocast, dynamo=dynamo)
    fwd, bwd = traced.symbols()
    n = MOE[name][3]
    assert fwd["kforge_grouped_mm_forward"] == n and bwd["kforge_grouped_mm_backward"] == n, (dict(fwd), dict(bwd))
    assert fwd["kforge_attention_forward"] == 2
    # DeepSeek's RoPE rotates even / odd slices of one shared key head: no kforge pattern (fused instead)
    assert fwd["kforge_rope_forward"] == (0 if name == "deepseek_v3" else 2), dict(fwd)
    if dynamo or autocast:
        return
    # every generated region, forward and backward, compiles (NVRTC, sm_90): the routing's integer
    # and bool values pass through regions too
    assert traced.compile_regions()


# ---- GPU ------------------------------------------------------------------------------------------------
@GPU
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("sizes, extra", [([64, 0, 200, 8], 0), ([17, 33, 5], 7), ([0, 0, 128], 16)])
def test_gpu_matches_float64(sizes, extra, dtype):
    a, b, offs, dy = make(sizes, 128, 256, extra, dtype, device="cuda", transposed_b=True)
    torch.cuda.synchronize()
    used = slice(0, sum(sizes))  # rows past offs[-1]: unspecified on torch's bf16 kernel
    tol = dict(rtol=2e-2, atol=2e-1) if dtype != torch.float32 else dict(rtol=1e-3, atol=1e-2)
    out = grouped_mm(a, b, offs)
    torch.testing.assert_close(out[used].double().cpu(), reference(a.cpu(), b.cpu(), sizes)[used], **tol)
    ar, br = a.double().cpu().clone().requires_grad_(), b.double().cpu().clone().requires_grad_()
    dyu = dy.double().cpu()
    dyu[sum(sizes):] = 0
    reference(ar, br, sizes).backward(dyu)
    dy[sum(sizes):] = 0
    da, db = grouped_mm_grads(dy, a, b, offs)
    torch.testing.assert_close(da[used].double().cpu(), ar.grad[used], **tol)
    torch.testing.assert_close(db.double().cpu(), br.grad, **tol)


@GPU
@pytest.mark.parametrize("name", list(MOE))
def test_gpu_moe_models_train_a_step_as_eager_does(name):
    """bf16 weights on the GPU (torch's CUTLASS grouped GEMM): loss within 2e-2, every gradient within
    5 % of its largest entry (bf16 routing may pick other experts for near-ties; the tolerance is a
    bf16 one)."""
    model, inputs, _ = make_moe(name, device="cuda", dtype=torch.bfloat16)
    ref = model(**inputs).loss
    ref.backward()
    want = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    import kforge

    loss = kforge.jit(model)(**inputs).loss
    loss.backward()
    torch.testing.assert_close(loss.float(), ref.float(), rtol=2e-2, atol=2e-2)
    for n, p in model.named_parameters():
        if n in want:
            err = (p.grad.float() - want[n]).abs().max().item() / want[n].abs().max().item()
            assert err < 5e-2, (n, err)
