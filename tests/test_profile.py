"""kforge.profile: NVTX / record_function ranges around kforge launches, kernel classification and the
per-category / region / op summary.

CPU: kernel names parsed from kernels_src, classification of real-world kernel names, the range
wrapping of a Thunder-built program (seen by the PyTorch CPU profiler, restored afterwards), the
attribution of kernels to ops and regions from a synthetic profiler event tree, the report tables.
GPU: a GPT-2 training step profiled end to end: every kforge kernel symbol of the traces appears as a
labelled kforge range, with forward, backward and optimizer regions.
"""
from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest
import thunder
import torch
from torch.autograd import DeviceType

import kforge
from conftest import gpu
from kforge import profile as kp
from kforge.inspect import inspect, range_name
from kforge.models import gpt2


def test_kernel_names_are_every_global_function_in_kernels_src():
    names = kp.kforge_kernel_names()
    for n in ("layernorm_forward_kernel", "layernorm_backward_kernel", "gelu_forward_kernel",
              "cross_entropy_forward_kernel", "softmax_forward_kernel", "rope_kernel", "swiglu_backward_kernel"):
        assert n in names, sorted(names)
    src = "".join(open(os.path.join(kforge.kernel_dir(), f)).read()
                  for f in os.listdir(kforge.kernel_dir()) if f.endswith((".cu", ".cuh")))
    for n in names:  # each is a kernel defined in the sources (CONTRIBUTING: <name>_kernel)
        assert n.endswith("_kernel") and re.search(rf"\b{n}\s*\(", src), n


def test_global_function_parser_skips_launch_bounds_and_macros():
    src = """
    template <typename T> __global__ void __launch_bounds__(256, (1024 / 256)) first_kernel(T* x) {}
    __global__ void KF_BOUNDS second_kernel(float* y);
    extern "C" __global__ void third(int n) {}
    """
    assert kp._global_function_names(src) == ["first_kernel", "second_kernel", "third"]


@pytest.mark.parametrize("name,category", [
    ("void layernorm_forward_kernel<float>(float*, float*, float*, float const*, int)", "kforge"),
    ("void softmax_forward_kernel<bf16, true>(bf16*, bf16 const*, long long, int, float)", "kforge"),
    ("_Z19gelu_forward_kernelI4bf16EvPT_PKS1_x", "kforge"),  # not demangled
    ("void rope_kernel<bf16, 1>(bf16*, bf16*, float const*, float const*, int)", "kforge"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(int, float, ...)", "other"),
    ("void mylib::gelu_forward_kernel<float>(float*)", "other"),  # namespaced: not ours
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "matmul"),
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(...)", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn", "matmul"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>, true>(...)", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3", "attention"),
    ("triton_red_fused__log_softmax_backward_data_0", "fused"),
    ("nvfuser_pointwise_f0_c1_r0_g0", "fused"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedAdamMathFunctor<float, 4>>(...)", "optimizer"),
    ("Memcpy DtoD (Device -> Device)", "memcpy/memset"),
    ("Memset (Device)", "memcpy/memset"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, ...)", "other"),
])
def test_categorize(name, category):
    assert kp.categorize(name) == category


def test_short_name():
    assert kp.short_name("void layernorm_forward_kernel<float>(float*, int)") == "layernorm_forward_kernel"
    assert kp.short_name("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<A<B>>(C)") == \
        "at::native::multi_tensor_apply_kernel"
    assert len(kp.short_name("x" * 200, width=40)) == 40


def _fake_program():
    """A program built the way Thunder builds its generated code (fresh globals holding
    "__function_obj" and "thunder"), calling a kforge operator by name."""
    from thunder.core.baseutils import build_callable

    kforge.executor  # builds the op table
    calls = []

    def launcher(x):
        calls.append(x)
        return x * 2

    ctx = {"__function_obj": None, "thunder": thunder, "kforge_gelu_forward": launcher, "other_fn": launcher}
    prog = build_callable("computation", "def computation(x):\n  return kforge_gelu_forward(x) + other_fn(x)\n",
                          "thunder.kforge_test", ctx)
    return prog, launcher, calls


def test_nvtx_ranges_wrap_kforge_calls_and_restore_them():
    prog, launcher, calls = _fake_program()
    with kp.nvtx_ranges(record_function=True) as n:
        assert n >= 1
        wrapped = prog.__globals__["kforge_gelu_forward"]
        assert wrapped is not launcher and wrapped.__wrapped__ is launcher
        assert prog.__globals__["other_fn"] is launcher  # only kforge operators are wrapped
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = prog(torch.ones(3))
    assert torch.equal(out, torch.full((3,), 4.0)) and len(calls) == 2
    names = [e.name for e in prof.events()]
    assert names.count("kforge.gelu.forward") == 1, names
    assert prog.__globals__["kforge_gelu_forward"] is launcher  # restored
    # Outside the block nothing is wrapped: the launch path has no extra Python frame.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        prog(torch.ones(3))
    assert "kforge.gelu.forward" not in [e.name for e in prof.events()]


def test_nvtx_ranges_restore_on_error():
    prog, launcher, _ = _fake_program()
    with pytest.raises(RuntimeError, match="boom"):
        with kp.nvtx_ranges():
            raise RuntimeError("boom")
    assert prog.__globals__["kforge_gelu_forward"] is launcher


def test_nvtx_ranges_restricted_to_given_compiled_functions():
    cfg = gpt2.GPTConfig.preset("micro")
    jm = thunder.jit(gpt2.GPT(cfg), executors=[kforge.executor, *thunder.get_default_executors()])
    jm(*gpt2.random_batch(cfg, 2, 8))
    prog, launcher, _ = _fake_program()
    with kp.nvtx_ranges(jm) as n:  # CPU tensors: kforge declined everything, nothing to wrap
        assert n == 0
        assert prog.__globals__["kforge_gelu_forward"] is launcher  # not one of jm's programs
    with pytest.raises(TypeError, match="not a Thunder-compiled function"):
        with kp.nvtx_ranges(torch.nn.Linear(2, 2)):
            pass


def _evt(name, parent=None, device=DeviceType.CPU, us=0.0, user=False, kernels=(), start=0.0):
    e = SimpleNamespace(name=name, cpu_parent=parent, device_type=device, is_user_annotation=user,
                        kernels=[SimpleNamespace(name=k, duration=0) for k in kernels],
                        time_range=SimpleNamespace(elapsed_us=lambda us=us: us, start=start, end=start + us))
    return e


def test_kernel_records_attribute_ops_and_regions():
    ln = "void layernorm_forward_kernel<float>(float*, int)"
    lnb = "void layernorm_backward_kernel<float>(float*, int)"
    gemm = "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n"
    adam = "void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>(...)"
    step = _evt("ProfilerStep#1", user=True)
    fwd_range = _evt("kforge.layernorm.forward", parent=step, user=True, kernels=[ln])
    mm = _evt("aten::mm", parent=step, kernels=[gemm])
    engine = _evt("autograd::engine::evaluate_function: ThunderFunctionBackward")
    bwd_range = _evt("kforge.layernorm.backward", parent=engine, user=True, kernels=[lnb])
    opt = _evt("Optimizer.step#AdamW.step")
    adam_op = _evt("aten::_fused_adamw_", parent=opt, kernels=[adam])
    mine = _evt("my_attention_block", user=True)
    mm2 = _evt("aten::mm", parent=mine, kernels=[gemm])
    events = [step, fwd_range, mm, engine, bwd_range, opt, adam_op, mine, mm2,
              _evt(ln, device=DeviceType.CUDA, us=10), _evt(gemm, device=DeviceType.CUDA, us=30),
              _evt(lnb, device=DeviceType.CUDA, us=20), _evt(adam, device=DeviceType.CUDA, us=5),
              _evt(gemm, device=DeviceType.CUDA, us=30),
              _evt("void layernorm_forward_kernel<bf16>(bf16*)", device=DeviceType.CUDA, us=5)]  # no launching op
    recs = kp.kernel_records(events)
    got = [(r.category, r.label, r.region, r.us) for r in recs]
    assert got == [
        ("kforge", "kforge.layernorm.forward", "forward", 10.0),
        ("matmul", "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n", "forward", 30.0),
        ("kforge", "kforge.layernorm.backward", "backward", 20.0),
        ("optimizer", "at::native::multi_tensor_apply_kernel", "optimizer", 5.0),
        ("matmul", "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n", "my_attention_block", 30.0),
        ("kforge", "kforge:layernorm_forward_kernel", "unattributed", 5.0),
    ], got

    report = kp.summarize(recs, steps=2, step_ms=0.1, device="test")
    assert report.kernel_ms == pytest.approx(0.05)
    assert report.share("kforge") == pytest.approx(35 / 100)
    assert report.share("matmul") == pytest.approx(60 / 100)
    cats = {c["category"]: c for c in report.by_category()}
    assert cats["kforge"]["kernels"] == 1.5 and cats["kforge"]["ms"] == pytest.approx(0.0175)
    assert sum(c["pct"] for c in cats.values()) == pytest.approx(100)
    regions = {r["region"]: r for r in report.by_region()}
    assert regions["backward"]["kforge"] == pytest.approx(0.01) and regions["forward"]["matmul"] == pytest.approx(0.015)
    assert report.by_op(top=1)[0]["op"] == "sm90_xmma_gemm_f32f32_f32f32_f32_tn_n"
    text = str(report)
    for s in ("kforge kernels 35.0%", "matmul 60.0%", "GPU busy 50%", "kforge.layernorm.backward", "my_attention_block"):
        assert s in text, text
    json.dumps(report.to_dict())


def test_count_outside_matmul_and_attention():
    """The fusion executor's measure: kernels per step that are neither matmuls nor attention. Helper
    kernels inside a kforge attention range count as attention; memsets are counted apart, each
    labelled with the op that launched it (a split-K GEMM's workspace fill is not a stray zeros)."""
    gemm = "nvjet_sm90_tst_64x64_64x13_2x4_h_bz_splitK_NTT"
    helper = "void at::native::vectorized_elementwise_kernel<4, convert_dq>(...)"
    fusion = "kf_fusion_0123456789abcdef"
    attn_range = _evt("kforge.attention.backward", user=True, kernels=[helper])
    mm = _evt("aten::mm", kernels=[gemm, "Memset (Device)"])
    zeros = _evt("aten::zero_", kernels=["Memset (Device)"])
    fuse = _evt("kforge_fusion", kernels=[fusion])
    events = [attn_range, mm, zeros, fuse,
              _evt(helper, device=DeviceType.CUDA, us=3), _evt("Memset (Device)", device=DeviceType.CUDA, us=1),
              _evt(gemm, device=DeviceType.CUDA, us=9), _evt("Memset (Device)", device=DeviceType.CUDA, us=1),
              _evt(fusion, device=DeviceType.CUDA, us=2)]
    recs = kp.kernel_records(events)
    labels = [r.label for r in recs if r.category == "memcpy/memset"]
    assert labels == ["Memset (aten::mm)", "Memset (aten::zero_)"], labels
    out = kp.summarize(recs, steps=1).outside_matmul_attention()
    assert out["kernels"] == 1 and out["by_category"] == {"kforge.fusion": 1}, out
    assert out["memcpy_memset"] == 2 and out["memcpy_memset_by_op"]["Memset (aten::zero_)"] == 1, out
    assert "outside matmul and attention: 1 (kforge.fusion 1); memcpy / memset: 2" in kp.summarize(recs, steps=1).summary()


def test_kernel_records_skip_device_annotations_and_place_unlinked_kforge_kernels():
    """record_function ranges mirrored on the device timeline are not kernels (they would count twice);
    a kforge kernel the profiler did not link to a CPU op takes its label and region from the kforge
    range whose device-side annotation contains it."""
    lnb = "void layernorm_backward_kernel<bf16, true, true>(bf16*, int)"
    gelu = "void gelu_forward_kernel<bf16>(bf16*)"
    engine = _evt("autograd::engine::evaluate_function: ThunderFunctionBackward")
    bwd_range = _evt("kforge.layernorm.backward", parent=engine, user=True, start=100)
    fwd_range = _evt("kforge.gelu.forward", user=True, start=10)
    opt = _evt("Optimizer.step#AdamW.step", user=True, start=300)
    events = [engine, bwd_range, fwd_range, opt,
              # device side: the three annotations (one without is_user_annotation: matched by name)
              _evt("kforge.gelu.forward", device=DeviceType.CUDA, us=20, user=True, start=1000),
              _evt("kforge.layernorm.backward", device=DeviceType.CUDA, us=50, start=2000),
              _evt("Optimizer.step#AdamW.step", device=DeviceType.CUDA, us=80, user=True, start=3000),
              _evt(gelu, device=DeviceType.CUDA, us=15, start=1002),
              _evt(lnb, device=DeviceType.CUDA, us=40, start=2005),
              _evt(lnb, device=DeviceType.CUDA, us=5, start=2500)]  # outside every range
    got = [(r.label, r.region, r.us) for r in kp.kernel_records(events)]
    assert got == [
        ("kforge.gelu.forward", "forward", 15.0),
        ("kforge.layernorm.backward", "backward", 40.0),
        ("kforge:layernorm_backward_kernel", "unattributed", 5.0),
    ], got


def test_kernel_records_keep_triton_kernels_named_like_their_cpu_range():
    """Inductor opens a CPU range named after each Triton kernel it launches. The kernel on the device
    timeline has that same name and no annotation flag: it is a kernel (category "fused"), not a
    device-side copy of a range, while an unflagged annotation of a kforge range is still skipped."""
    tri = "triton_poi_fused_add_mul_0"
    launch = _evt(tri, start=5)
    rng = _evt("kforge.gelu.forward", start=10)
    events = [launch, rng,
              _evt(tri, device=DeviceType.CUDA, us=7, start=1000),
              _evt("kforge.gelu.forward", device=DeviceType.CUDA, us=20, start=2000),
              _evt("void gelu_forward_kernel<bf16>(bf16*)", device=DeviceType.CUDA, us=15, start=2002)]
    got = [(r.category, r.us) for r in kp.kernel_records(events)]
    assert got == [("fused", 7.0), ("kforge", 15.0)], got


def test_profile_on_cpu_runs_and_reports_no_kernels():
    calls = []
    report = kp.profile(lambda a: calls.append(a), 1, steps=3, warmup=1)
    assert len(calls) == 1 + 3 + 3  # warm-up, timed, profiled
    assert report.records == []
    if not torch.cuda.is_available():
        assert report.step_ms is None  # with a GPU the step is still timed with CUDA events
    assert "no device kernels" in report.summary()
    with pytest.raises(ValueError, match="steps"):
        kp.profile(lambda: None, steps=0)


# ---- GPU ---------------------------------------------------------------------------------------
@gpu
def test_gpt2_training_step_profile():
    torch.manual_seed(0)
    cfg = gpt2.GPTConfig.preset("tiny")
    model = gpt2.GPT(cfg).cuda()
    idx, targets = gpt2.random_batch(cfg, 4, 64, device="cuda")
    jm = thunder.jit(model, executors=[kforge.executor, *thunder.get_default_executors()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        jm(idx, targets)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    report = kp.profile(step, steps=3, warmup=2)
    print(report)
    assert report.step_ms and report.step_ms > 0 and report.kernel_ms > 0
    assert 0 < report.share("kforge") < 1 and report.share("matmul") > 0
    symbols = inspect(jm).symbols
    # Every op's kernels are recognised as kforge kernels. (On torch 2.11 the profiler does not link
    # driver-API (cuLaunchKernel) launches to CPU ops; they are placed in their op's range by the
    # range's device-side annotation, see kforge.profile.kernel_records.)
    kernels = {kp.kforge_kernel(r.name) for r in report.records if r.category == "kforge"}
    for op in ("layernorm", "gelu", "cross_entropy", "softmax", "permute"):
        assert any(op in k for k in kernels), (op, kernels)
    labels = {r.label for r in report.records if r.category == "kforge"}
    for op in ("layernorm.forward", "layernorm.backward", "gelu.backward", "cross_entropy.forward"):
        assert f"kforge.{op}" in labels, labels
    # Device-side copies of record_function ranges are not counted as kernels.
    assert not any(r.name.startswith(("kforge.", "Optimizer.step", "ProfilerStep")) for r in report.records)
    regions = {r.region for r in report.records}
    assert {"forward", "backward", "optimizer"} <= regions, regions
    # Per step: at least one kernel per kforge symbol call of the traces.
    n_kforge = sum(1 for r in report.records if r.category == "kforge") / 3
    assert n_kforge >= sum(n for s, n in symbols.items() if hasattr(kforge._C, s.removeprefix("kforge_")))
    # The launchers are restored: no program of jm keeps a wrapper.
    for g in kp._program_globals([jm]):
        assert not any(hasattr(v, "_kforge_range") for v in g.values())


@gpu
def test_torch_compile_kernels_are_counted():
    """torch.compile's Triton kernels appear in the profile as "fused" kernels (Inductor names a CPU
    range after each kernel it launches; those kernels were once taken for annotations and dropped)."""
    x = torch.randn(4096, 1024, device="cuda")
    fn = torch.compile(lambda x: (x * 2 + 1).relu().sum(-1))
    report = kp.profile(fn, x, steps=3, warmup=2)
    assert report.share("fused") > 0, report.summary()
