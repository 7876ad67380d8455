"""kforge.inspect: kforge symbols in the final traces, claims, and declines with the checkers' reasons.

CPU: a GPT-2 jitted on CPU tensors (every claim declined "not CUDA"), the Dynamo path, traces with
CUDA proxies built by hand (claims accepted, fp64 / non-last-dim declines: no GPU needed to ask a
checker), bad arguments. GPU: the manual-attention GPT-2's every kforge forward and backward symbol.
"""
from __future__ import annotations

import os
from collections import Counter

import pytest
import thunder
import torch

import kforge
from conftest import gpu
from kforge.inspect import InspectReport, _walk_offers, inspect, range_name, recording, thunder_functions
from kforge.models import gpt2




def executors() -> list:
    return [kforge.executor, *thunder.get_default_executors()]


def micro_gpt(device: str = "cpu", dtype: torch.dtype = torch.float32):
    cfg = gpt2.GPTConfig.preset("micro")
    return gpt2.GPT(cfg).to(device=device, dtype=dtype), gpt2.random_batch(cfg, 2, 8, device=device)


@pytest.fixture(scope="module")
def cpu_jitted():
    model, (idx, targets) = micro_gpt()
    jm = thunder.jit(model, executors=executors())
    with recording() as log:
        _, loss = jm(idx, targets)
        loss.backward()
    return jm, log


def test_cpu_model_reports_every_decline_with_its_reason(cpu_jitted):
    jm, _ = cpu_jitted
    report = inspect(jm)
    assert isinstance(report, InspectReport) and report.mode == "jit" and report.functions == 1
    assert not report.symbols and not report.claimed, "kforge claimed CPU tensors"
    by_symbol = Counter()
    for d in report.declines:
        assert "not CUDA" in d.reason and "cpu" in d.reason, d
        by_symbol[d.symbol] += d.count
    # One micro GPT-2 layer: ln_1, ln_2, ln_f; one causal softmax, split, merge, GELU, cross-entropy.
    assert by_symbol["layer_norm"] == 3, by_symbol
    for sym in ("gelu", "cross_entropy", "kforge_split_qkv", "kforge_merge_heads", "kforge_causal_softmax"):
        assert by_symbol[sym] == 1, (sym, by_symbol)
    text = str(report)
    assert "declined symbol" in text and "layernorm: input is on" in text and "not CUDA" in text
    assert "no kforge symbol in the final traces" in text


def test_rechecked_declines_agree_with_thunders_own_log(cpu_jitted):
    """The re-asked checkers give the reasons Thunder recorded while compiling this function."""
    jm, log = cpu_jitted
    rechecked = {(d.symbol, d.reason) for d in inspect(jm).declines}
    recorded = {(s, r) for s, rs in log.items() for r in rs}
    assert recorded and rechecked == recorded
    from_log = inspect(jm, declines=log)
    assert {(d.symbol, d.reason) for d in from_log.declines} == recorded
    assert sum(d.count for d in from_log.declines) == sum(n for rs in log.values() for n in rs.values())


def test_recording_captures_only_its_block():
    model, (idx, targets) = micro_gpt()
    jm = thunder.jit(model, executors=executors())
    with recording() as before_call:
        pass
    assert before_call == {}
    with recording() as log:
        jm(idx, targets)
    assert "layer_norm" in log
    with recording() as again:
        jm(idx, targets)  # cached: no compilation, no checker calls
    assert again == {}


def test_traces_printed_and_saved(cpu_jitted, tmp_path, capsys):
    jm, _ = cpu_jitted
    report = inspect(jm, show_traces=True, save_dir=tmp_path / "traces")
    out = capsys.readouterr().out
    assert "# ---- final forward trace ----" in out and "# ---- final backward trace ----" in out
    assert sorted(os.listdir(tmp_path / "traces")) == ["backward.py", "forward.py"]
    fwd = (tmp_path / "traces" / "forward.py").read_text()
    assert fwd == str(thunder.last_traces(jm)[-1]) and "def computation" in fwd
    compile((tmp_path / "traces" / "backward.py").read_text(), "backward.py", "exec")
    assert len(report.saved) == 2


def test_dynamo_path_module_function_and_backend():
    from thunder.dynamo import ThunderCompiler

    torch._dynamo.reset()
    model, (idx, targets) = micro_gpt()
    backend = ThunderCompiler(executors=executors())
    cm = torch.compile(model, backend=backend)
    cm(idx, targets)[1].backward()
    for obj in (cm, backend):
        report = inspect(obj)
        assert report.mode == "dynamo" and report.functions >= 1
        assert any(d.symbol == "layer_norm" and "not CUDA" in d.reason for d in report.declines)

    def step(i, t):
        return model(i, t)[1]

    cf = torch.compile(step, backend=ThunderCompiler(executors=executors()))
    cf(idx, targets).backward()
    assert thunder_functions(cf)[0] == "dynamo"
    assert any(d.symbol == "cross_entropy" for d in inspect(cf).declines)
    torch._dynamo.reset()


def test_tieout_report_is_accepted():
    from kforge.tieout import tieout

    model, batch = micro_gpt()
    report = tieout(model, batch, executors=executors())
    assert report.ok
    assert any(d.symbol == "layer_norm" for d in inspect(report).declines)


def test_not_compiled_or_not_called_is_a_clear_error():
    model, _ = micro_gpt()
    with pytest.raises(TypeError, match="not a Thunder-compiled function"):
        inspect(model)
    with pytest.raises(ValueError, match="call it first"):
        inspect(thunder.jit(model, executors=executors()))


def _cuda_trace(dtype):
    """A trace of layer_norm + softmax over dim 0 and over the last dim on CUDA proxies: checkers only
    look at proxies' metadata, so this runs without a GPU."""
    import thunder.core.devices as devices
    import thunder.torch as ltorch
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx

    trc = TraceCtx()
    dev = devices.Device("cuda:0")
    with tracectx(trc):
        x = TensorProxy(shape=(4, 40), device=dev, dtype=dtype, requires_grad=False)
        w = TensorProxy(shape=(40,), device=dev, dtype=dtype, requires_grad=False)
        y = ltorch.layer_norm(x, (40,), w, w, 1e-5)
        ltorch.softmax(y, 0)
        ltorch.softmax(y, -1)
    return trc


def test_walk_claims_and_declines_on_cuda_proxies():
    from thunder.core import dtypes

    claimed, declined = _walk_offers(_cuda_trace(dtypes.float32), executors())
    # The dim-0 softmax is declined and walked into: its sum over dim 0 of the (4, 40) tensor is a
    # column sum, kforge's colsum.
    assert claimed == Counter({"layer_norm": 1, "_softmax": 1, "sum": 1})
    assert declined == Counter({("_softmax", "softmax: dim=0 is not the last dim"): 1})

    claimed, declined = _walk_offers(_cuda_trace(dtypes.float64), executors())
    assert not claimed
    reasons = {r for (_, r) in declined}
    assert any(r.startswith("layernorm:") and "float64 not supported" in r for r in reasons), reasons
    # fp64 softmax: both calls declined; Thunder's torch executor runs them whole, so no descent.
    assert sum(n for (s, _), n in declined.items() if s == "_softmax") == 2


def test_walk_respects_executor_order():
    """An executor listed before kforge that takes the symbol means kforge is never asked."""
    from thunder.core import dtypes

    torchex = thunder.extend.get_executor("torch")
    claimed, declined = _walk_offers(_cuda_trace(dtypes.float32), [torchex, kforge.executor])
    assert not claimed and not declined


def test_range_name():
    assert range_name("kforge_layernorm_forward") == "kforge.layernorm.forward"
    assert range_name("kforge_causal_softmax_backward") == "kforge.causal_softmax.backward"
    assert range_name("kforge_split_qkv") == "kforge.split_qkv"


# ---- GPU ---------------------------------------------------------------------------------------
GPT2_SYMBOLS = ("layernorm", "split_qkv", "causal_softmax", "merge_heads", "gelu", "cross_entropy")


@gpu
def test_gpt2_manual_attention_every_kforge_symbol_forward_and_backward(tmp_path):
    cfg = gpt2.GPTConfig.preset("tiny")
    model = gpt2.GPT(cfg).cuda()
    idx, targets = gpt2.random_batch(cfg, 2, 64, device="cuda")
    jm = thunder.jit(model, executors=executors())
    jm(idx, targets)[1].backward()
    report = inspect(jm, save_dir=tmp_path)
    for op in GPT2_SYMBOLS:
        assert report.forward[f"kforge_{op}_forward"] >= 1, (op, report.forward)
        assert report.backward[f"kforge_{op}_backward"] >= 1, (op, report.backward)
    assert report.forward["kforge_layernorm_forward"] == 2 * cfg.n_layer + 1
    assert report.backward["kforge_layernorm_backward"] == 2 * cfg.n_layer + 1
    assert report.claimed["layer_norm"] == 2 * cfg.n_layer + 1
    assert not report.declines, report.declines_table()
    assert "kforge_layernorm_forward" in (tmp_path / "forward.py").read_text()
    assert "kforge.layernorm.forward" in report.symbols_table()


@gpu
def test_gpu_declines_name_the_unsupported_dtype():
    model, (idx, targets) = micro_gpt("cuda", torch.float64)
    jm = thunder.jit(model, executors=executors())
    jm(idx, targets)[1].backward()
    report = inspect(jm)
    assert not report.symbols
    assert any(d.symbol == "layer_norm" and "float64 not supported" in d.reason for d in report.declines)


def test_call_layouts_from_the_launchers_plans():
    """The layout column: each kforge call's layout as its launcher's plan picks it (CPU proxies)."""
    import thunder.core.devices as devices
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx

    from kforge.inspect import call_layouts
    from kforge.ops import layernorm as ln_ops

    for dtype, want in ((dtypes.float32, "group"), (dtypes.bfloat16, "warp")):
        trc = TraceCtx()
        dev = devices.Device("cuda:0")
        with tracectx(trc):
            x = TensorProxy(shape=(64, 768), device=dev, dtype=dtype, requires_grad=False)
            w = TensorProxy(shape=(768,), device=dev, dtype=dtype, requires_grad=False)
            ln_ops.layernorm_forward(x, w, w, 1e-5)
        assert call_layouts([trc]) == {"kforge_layernorm_forward": Counter({want: 1})}, dtype
        assert kforge._C.plan("layernorm_forward", [64, 768], dtypes.to_torch_dtype(dtype))["layout"] == want


def test_call_layouts_of_the_norm_backwards():
    """The RMSNorm backward with the residual's gradient, and the one storing a 16-bit copy of dx, show
    rmsnorm_backward's plan for their arguments (the ring for a Llama's rows)."""
    import thunder.core.devices as devices
    import torch
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx

    from kforge.inspect import call_layouts
    from kforge.ops import rmsnorm as rms_ops

    trc = TraceCtx()
    dev = devices.Device("cuda:0")
    with tracectx(trc):
        x = TensorProxy(shape=(8192, 768), device=dev, dtype=dtypes.float32, requires_grad=False)
        w = TensorProxy(shape=(768,), device=dev, dtype=dtypes.float32, requires_grad=False)
        rstd = TensorProxy(shape=(8192,), device=dev, dtype=dtypes.float32, requires_grad=False)
        rms_ops.add_rmsnorm_backward(x, x, x, w, rstd, 1, True)
        rms_ops.rmsnorm_backward_copy(x, x, w, rstd, 1, True, None, torch.bfloat16)
        g = TensorProxy(shape=(8192, 768), device=dev, dtype=dtypes.bfloat16, requires_grad=False)
        rms_ops.rmsnorm_backward_sum(g, g, g, x, w, rstd, 1, True, x, torch.bfloat16)
        # a copy of another type than the terms': torch sums them before the fp32 ring
        rms_ops.rmsnorm_backward_sum(g, g, None, x, w, rstd, 1, True, x, torch.float16)
    want = kforge._C.plan("rmsnorm_backward", [8192, 768], torch.float32, copy_dtype="bfloat16")["layout"]
    assert want == "ring"
    assert call_layouts([trc]) == {"kforge_add_rmsnorm_backward": Counter({"ring": 1}),
                                   "kforge_rmsnorm_backward_copy": Counter({"ring": 1}),
                                   "kforge_rmsnorm_backward_sum": Counter({"ring": 1, "ring after torch's sum": 1})}


def test_call_layouts_of_layernorms_autocast_variants():
    """The branch-adding forward, the narrow forward and the copying backward show LayerNorm's plan
    for the fp32 stream (GROUP for GPT-2's rows: the kernels that do the extra work)."""
    import thunder.core.devices as devices
    import torch
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx

    from kforge.inspect import call_layouts
    from kforge.ops import layernorm as ln_ops

    trc = TraceCtx()
    dev = devices.Device("cuda:0")
    with tracectx(trc):
        def proxy(shape, dtype=dtypes.float32):
            return TensorProxy(shape=shape, device=dev, dtype=dtype, requires_grad=False)
        x, w, st = proxy((8192, 768)), proxy((768,)), proxy((8192,))
        ln_ops.add_layernorm_forward(proxy((8192, 768), dtypes.bfloat16), x, w, w, 1e-5, torch.bfloat16)
        ln_ops.layernorm_forward(x, w, w, 1e-5, torch.bfloat16)
        ln_ops.layernorm_backward_copy(x, x, w, w, st, st, x, torch.bfloat16)
    assert kforge._C.plan("layernorm_backward", [8192, 768], torch.float32, dresidual=True,
                          copy_dtype="bfloat16")["layout"] == "group"
    assert call_layouts([trc]) == {"kforge_add_layernorm_forward": Counter({"group": 1}),
                                   "kforge_layernorm_forward": Counter({"group": 1}),
                                   "kforge_layernorm_backward_copy": Counter({"group": 1})}


def test_call_layouts_of_the_head_copies():
    """split_qkv's n_head comes from the call, its backward's shape from the first given gradient;
    merge_heads shows none (a view, no kernel, where its heads are token-major in memory)."""
    import thunder.core.devices as devices
    from thunder.core import dtypes
    from thunder.core.proxies import TensorProxy
    from thunder.core.trace import TraceCtx, tracectx

    from kforge.inspect import call_layouts
    from kforge.ops import permute as permute_ops

    trc = TraceCtx()
    with tracectx(trc):
        qkv = TensorProxy(shape=(8, 1024, 3 * 768), device=devices.Device("cuda:0"), dtype=dtypes.bfloat16,
                          requires_grad=False)
        q, k, v = permute_ops.split_qkv_forward(qkv, 12)
        permute_ops.split_qkv_backward(None, k, v)
        permute_ops.merge_heads_forward(q)
    assert call_layouts([trc]) == {"kforge_split_qkv_forward": Counter({"lanes": 1}),
                                   "kforge_split_qkv_backward": Counter({"lanes": 1})}
