"""python -m kforge <verb>: demo, inspect, tieout, profile, bench.

CPU: argument errors, the no-GPU demo (compiles every kernel, exit 0), inspect / tieout of built-in
and user (--model factory) models on CPU tensors (declines "not CUDA", tie-out PASS), a tie-out made to
fail on purpose (--perturb; exit status 1), profile and bench refusing to run without a GPU, bench's
arguments passed through. GPU: the full demo, tie-outs with kforge symbols (and a perturbed one that
fails), inspect listing every GPT-2 kernel symbol, profile's kforge row, the HF Llama route.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import kforge
from conftest import gpu
from kforge.__main__ import main

PKG_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kforge.__file__)))


def run_cli(*args: str, gpu_visible: bool = True, extra_path: str | None = None, timeout: int = 900):
    """`python -m kforge ARGS` in a fresh process; returns (exit status, stdout, stderr)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_path, PKG_ROOT, env.get("PYTHONPATH")) if p)
    if not gpu_visible:
        env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-m", "kforge", *args], capture_output=True, text=True, env=env,
                       timeout=timeout)
    return r.returncode, r.stdout, r.stderr


FACTORIES = textwrap.dedent('''
    import torch
    import torch.nn.functional as F

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(24, 40)
            self.ln = torch.nn.LayerNorm(40)

        def forward(self, x):
            return F.gelu(self.ln(self.fc(x)), approximate="tanh")

    def make(batch=3):
        torch.manual_seed(0)
        return Net(), torch.randn(batch, 24)

    def make_kwargs(device, dtype, seed):
        torch.manual_seed(seed)
        net = Net().to(device=device, dtype=dtype or torch.float32)
        x = torch.randn(5, 24, device=device, dtype=dtype or torch.float32)
        return net, {"x": x}, {"loss_fn": lambda out: out.square().mean()}

    def not_a_model():
        return 42

    def bad_options():
        return Net(), torch.randn(2, 24), {"colour": "red"}

    received = []

    def make_with_defaults(batch=3, seq=5, seed=7, size="s", dtype=None, device="cpu"):
        received.append(dict(batch=batch, seq=seq, seed=seed, size=size, dtype=dtype, device=device))
        torch.manual_seed(seed)
        return Net().to(device), torch.randn(batch, 24, device=device)

    def make_kw(**kw):
        received.append(dict(kw))
        return Net().to(kw["device"]), torch.randn(2, 24, device=kw["device"])
''')


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "kf_user_models.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return str(tmp_path)


# ---- arguments ---------------------------------------------------------------------------------
def test_help_lists_every_verb():
    rc, out, _ = run_cli("--help")
    assert rc == 0
    for verb in ("demo", "inspect", "tieout", "profile", "bench", "package.module:factory"):
        assert verb in out


@pytest.mark.parametrize("argv,message", [
    ([], "required"),
    (["inspect"], "name one model"),
    (["tieout", "gpt2", "--model", "a.b:c"], "name one model"),
    (["inspect", "gpt3"], "invalid choice"),
    (["tieout", "gpt2", "--dtype", "fp8"], "invalid choice"),
    (["profile", "gpt2", "--batch", "0"], "must be positive"),
    (["frobnicate"], "invalid choice"),
])
def test_argument_errors_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["inspect", "gpt2", "--size", "huge", "--device", "cpu"], "unknown gpt2 --size 'huge'; choose from"),
    (["inspect", "llama", "--size", "124M", "--device", "cpu"], "unknown llama --size '124M'"),
    (["tieout", "--model", "kf_user_models", "--device", "cpu"], "package.module:factory"),
    (["tieout", "--model", "kf_no_such_module:make", "--device", "cpu"], "cannot import"),
    (["tieout", "--model", "kf_user_models:nope", "--device", "cpu"], "has no attribute 'nope'"),
    (["tieout", "--model", "kf_user_models:not_a_model", "--device", "cpu"], "must return (model, inputs)"),
    (["tieout", "--model", "kf_user_models:bad_options", "--device", "cpu"], "options must be a dict"),
])
def test_usage_errors_exit_2(argv, message, factories, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


# ---- demo --------------------------------------------------------------------------------------
def test_demo_without_gpu_says_so_and_compiles_every_kernel():
    rc, out, err = run_cli("demo", gpu_visible=False, timeout=1800)
    assert rc == 0, err
    assert "\r" not in err  # stderr is no terminal here: no progress-bar frames in logs
    assert "No CUDA GPU is visible" in out
    assert "Compile every kforge kernel for sm_90" in out
    table = out[out.index("kernel "):]
    for name in kforge.kernel_names():
        assert f"\n{name} " in table, name
    assert f"{len(kforge.kernel_names())} kernels compiled for sm_90" in out



@pytest.mark.parametrize("arch", ["75", "0"])
def test_demo_rejects_arch_below_sm80(arch, capsys):
    """One line naming the minimum, before any compile (was: ptxas's log of sm_80 instructions)."""
    assert main(["demo", "--arch", arch]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == (f"python -m kforge demo: error: --arch {arch}: sm_80 is the minimum "
                           f"architecture kforge supports")


# ---- --device ------------------------------------------------------------------------------------
@pytest.mark.parametrize("verb", ["inspect", "tieout", "profile"])
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_device_cuda_without_a_gpu_is_one_line(verb, device, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([verb, "gpt2", "--size", "micro", "--device", device]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"python -m kforge {verb}: error: --device {device}: no CUDA GPU is visible")


@pytest.mark.parametrize("device,message", [
    ("foo", "--device 'foo' is not a device; use cuda, cuda:N or cpu"),
    ("mps", "--device mps: kforge runs on cuda or cpu"),
])
def test_bad_device_is_a_usage_error(device, message, capsys):
    assert main(["tieout", "gpt2", "--device", device]) == 2
    assert message in capsys.readouterr().err


def test_device_cuda_without_a_gpu_from_a_fresh_process():
    """What a user sees: no torch traceback, exit status 2."""
    rc, out, err = run_cli("tieout", "gpt2", "--size", "micro", "--device", "cuda", gpu_visible=False)
    assert rc == 2, (out, err)
    assert "Traceback" not in err
    assert "python -m kforge tieout: error: --device cuda: no CUDA GPU is visible; use --device cpu" in err

# ---- inspect / tieout on CPU tensors -------------------------------------------------------------
def test_inspect_cpu_gpt2_shows_declines_and_saves_traces(tmp_path, capsys):
    assert main(["inspect", "gpt2", "--size", "micro", "--device", "cpu", "--batch", "2", "--seq", "8",
                 "--save-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gpt2-micro [jit]" in out and "declined symbol" in out
    assert "layernorm: input is on" in out and "not CUDA" in out
    assert "no kforge symbol in the final traces" in out
    assert sorted(os.listdir(tmp_path)) == ["backward.py", "forward.py"]


def test_inspect_user_model_no_grad(factories, capsys):
    assert main(["inspect", "--model", "kf_user_models:make", "--device", "cpu", "--no-grad"]) == 0
    out = capsys.readouterr().out
    assert "layer_norm" in out and "gelu" in out and "not CUDA" in out


def test_tieout_cpu_passes_and_perturbed_tieout_fails(tmp_path, capsys):
    common = ["tieout", "gpt2", "--size", "micro", "--device", "cpu", "--batch", "2", "--seq", "8"]
    assert main(common + ["--json", str(tmp_path / "ok.json")]) == 0
    out = capsys.readouterr().out
    assert "transformer.h.0.attn.c_attn.weight.grad" in out
    # CPU tensors: every kforge claim declines, so the pass is Thunder's fallbacks and says so.
    assert "tie-out PASS (torch fallback only: no kforge kernel ran on CPU tensors)" in out
    rows = json.loads((tmp_path / "ok.json").read_text())
    assert rows["ok"] and all(r["ok"] for r in rows["rows"]) and len(rows["rows"]) >= 10

    # The same model with the compiled copy's parameters scaled by 1 + 1e-2: the check must fail.
    assert main(common + ["--perturb", "1e-2", "--failures-only"]) == 1
    out = capsys.readouterr().out
    assert "tie-out FAIL" in out
    table = [line for line in out.splitlines() if line.endswith("FAIL")]
    assert table and all(" ok" not in line for line in table)  # --failures-only



def test_tieout_help_documents_the_exit_status():
    rc, out, _ = run_cli("tieout", "--help")
    assert rc == 0
    text = " ".join(out.split())
    assert "exit status: 0 every tensor within tolerance; 1 any tensor out of tolerance; 2 a usage error" in text
    assert "PASS (torch fallback only" in text

def test_tieout_failure_exit_status_from_a_fresh_process():
    """What a shell or CI sees: exit status 1 on an out-of-tolerance tie-out."""
    rc, out, err = run_cli("tieout", "gpt2", "--size", "micro", "--device", "cpu", "--batch", "2", "--seq", "8",
                           "--perturb", "1e-3")
    assert rc == 1, (out, err)
    assert "tie-out FAIL" in out


def test_tieout_tolerance_override(factories, capsys):
    """A tolerance below the difference that is really there fails; the default fp32 bound passes it."""
    common = ["tieout", "--model", "kf_user_models:make_kwargs", "--device", "cpu", "--perturb", "1e-6"]
    assert main(common) == 0  # 1e-6 relative is inside the fp32 bound (1e-4)
    assert "tie-out PASS" in capsys.readouterr().out
    assert main(common + ["--rel-tol", "1e-8", "--elem-tol", "1e-8"]) == 1
    assert "tie-out FAIL" in capsys.readouterr().out


def test_tieout_user_factory_with_kwargs_inputs_and_loss_fn(factories, capsys):
    assert main(["tieout", "--model", "kf_user_models:make_kwargs", "--device", "cpu", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "tie-out PASS" in out and "fc.weight.grad" in out and "ln.bias.grad" in out


@pytest.mark.timeout(900)
def test_tieout_hf_llama_jit_on_cpu():
    """`--mode jit`: thunder.jit of transformers' Llama with kforge's lookasides (its output
    collector) ties out against eager on the CPU."""
    rc, out, err = run_cli("tieout", "hf-llama", "--size", "micro", "--device", "cpu", "--mode", "jit",
                           "--batch", "1", "--seq", "8", gpu_visible=False)
    assert rc == 0, err
    assert "tie-out PASS" in out and "mode=jit" in out, out[-2000:]


@pytest.mark.timeout(900)
def test_tieout_hf_gpt2_on_cpu():
    """Hugging Face's GPT-2 from the zoo as a user's factory (Conv1D layers: torch.addmm): the CPU
    tie-out passes and says plainly that no kforge kernel ran."""
    rc, out, err = run_cli("tieout", "--model", "kforge.zoo.hf_gpt2:make", "--size", "micro", "--device", "cpu",
                           "--batch", "1", "--seq", "8", gpu_visible=False)
    assert rc == 0, err
    assert "tie-out PASS" in out and "no kforge kernel ran" in out and "mlp.c_fc.weight.grad" in out, out[-2000:]


@pytest.mark.timeout(900)
def test_inspect_hf_llama_on_cpu_reports_llama_patterns():
    """The Dynamo route of an unmodified transformers Llama (1 layer): every Llama step is found and
    left alone on CPU, with kforge's reason."""
    rc, out, err = run_cli("inspect", "hf-llama", "--size", "micro", "--device", "cpu", "--batch", "1",
                           "--seq", "8", gpu_visible=False)
    assert rc == 0, err
    assert "transformer_engine" not in err  # Thunder's import-time warning, silenced by kforge
    assert "hf-llama-micro [dynamo]" in out
    for kind in ("rms_norm", "rope", "swiglu", "repeat_kv"):
        assert any(line.startswith(kind) and "not CUDA" in line for line in out.splitlines()), (kind, out)


# ---- profile / bench without a GPU ---------------------------------------------------------------
def test_profile_and_bench_need_a_gpu():
    rc, _, err = run_cli("profile", "gpt2", "--size", "micro", gpu_visible=False)
    assert rc == 2 and "needs a CUDA GPU" in err
    rc, _, err = run_cli("bench", "ops", "--quick", gpu_visible=False)
    assert rc == 2 and "needs a CUDA GPU" in err


def test_bench_arguments_pass_through():
    rc, out, _ = run_cli("bench", "--help")
    assert rc == 0 and "python -m kforge.bench" in out and "launch" in out
    rc, _, err = run_cli("bench", "gpt2", "--attention", "nope")
    assert rc == 2 and "invalid choice" in err


# ---- GPU ---------------------------------------------------------------------------------------
@gpu
def test_demo_on_gpu():
    rc, out, err = run_cli("demo", "--steps", "5")
    assert rc == 0, out[-4000:] + err[-4000:]
    assert "tie-out PASS" in out
    assert "kforge_layernorm_forward" in out and "kforge_cross_entropy_backward" in out
    assert "ms/step" in out and "thunder+kforge" in out


@gpu
@pytest.mark.parametrize("model,extra", [("gpt2", []), ("llama", []), ("gpt2", ["--attention", "sdpa", "--dtype", "bf16"])])
def test_tieout_gpu_passes_with_kforge_symbols(model, extra, tmp_path):
    rc, out, err = run_cli("tieout", model, "--size", "tiny", "--batch", "2", "--seq", "64", "--json",
                           str(tmp_path / "r.json"), *extra)
    assert rc == 0, out + err
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["ok"] and sum(data["kforge_symbols"].values()) > 0, data["kforge_symbols"]


@gpu
def test_tieout_gpu_hf_llama_dynamo_path():
    rc, out, err = run_cli("tieout", "hf-llama", "--batch", "2", "--seq", "64")
    assert rc == 0, out + err
    assert "mode=dynamo" in out and "tie-out PASS" in out


@gpu
def test_tieout_gpu_hf_gpt2_claims_conv1d():
    """Hugging Face's GPT-2 on a GPU: the tie-out passes with kforge's addmm (its Conv1D layers),
    layernorm and cross-entropy in the traces."""
    rc, out, err = run_cli("tieout", "--model", "kforge.zoo.hf_gpt2:make", "--size", "tiny", "--batch", "2",
                           "--seq", "64")
    assert rc == 0, out + err
    assert "tie-out PASS" in out, out[-2000:]
    rc, out, err = run_cli("inspect", "--model", "kforge.zoo.hf_gpt2:make", "--size", "tiny", "--batch", "2",
                           "--seq", "64")
    assert rc == 0, err
    # Conv1D's addmm is claimed as kforge_addmm_forward, then called on a cuBLASLt plan (kforge.ops.gemm).
    for sym in ("kforge_gemm_addmm", "kforge_layernorm_forward", "kforge_layernorm_backward",
                "kforge_cross_entropy_backward"):
        assert sym in out, (sym, out)


@gpu
def test_tieout_gpu_perturbed_fails():
    rc, out, err = run_cli("tieout", "gpt2", "--size", "tiny", "--batch", "2", "--seq", "64", "--perturb", "1e-2")
    assert rc == 1, out + err
    assert "tie-out FAIL" in out


@gpu
def test_inspect_gpu_gpt2_lists_every_kernel_symbol():
    rc, out, err = run_cli("inspect", "gpt2", "--size", "tiny", "--batch", "2", "--seq", "64")
    assert rc == 0, err
    for op in ("layernorm", "split_qkv", "causal_softmax", "merge_heads", "gelu", "cross_entropy"):
        for d in ("forward", "backward"):
            assert f"kforge_{op}_{d}" in out, (op, d, out)
    assert "no declines" in out


@gpu
def test_inspect_gpu_hf_llama_claims_llama_kernels():
    rc, out, err = run_cli("inspect", "hf-llama", "--size", "hf-test", "--batch", "2", "--seq", "64")
    assert rc == 0, err
    for sym in ("kforge_rmsnorm_forward", "kforge_rmsnorm_backward", "kforge_rope_forward", "kforge_swiglu_backward"):
        assert sym in out, (sym, out)
    assert "replaced by kforge" in out


@gpu
def test_profile_gpu_gpt2(tmp_path):
    rc, out, err = run_cli("profile", "gpt2", "--size", "tiny", "--steps", "3", "--json", str(tmp_path / "p.json"))
    assert rc == 0, err
    assert "kforge kernels" in out and "matmul" in out
    data = json.loads((tmp_path / "p.json").read_text())
    assert {"kforge.layernorm.forward", "kforge.layernorm.backward"} <= {o["op"] for o in data["by_op"]}
    cats = {c["category"]: c for c in data["by_category"]}
    assert cats["kforge"]["ms"] > 0 and cats["matmul"]["ms"] > 0
    assert {"forward", "backward", "optimizer"} <= {r["region"] for r in data["by_region"]}


@gpu
def test_profile_gpu_under_autocast(tmp_path):
    """--dtype fp32 --autocast bf16: fp32 weights, the step under bf16 autocast, so the GEMMs run in
    bf16 (cuBLASLt's bf16 kernels on kforge's plans) and AdamW updates fp32 weights."""
    rc, out, err = run_cli("profile", "--model", "kforge.zoo.plain_llama:make", "--size", "micro", "--dtype", "fp32",
                           "--autocast", "bf16", "--steps", "2", "--json", str(tmp_path / "p.json"))
    assert rc == 0, err
    data = json.loads((tmp_path / "p.json").read_text())
    ops = {o["op"] for o in data["by_op"]}
    assert "kforge.cast_inputs" in ops, sorted(ops)  # autocast's weight casts: absent without autocast


def test_profile_cudagraphs_option_puts_thunders_graph_transform_in():
    import argparse

    import thunder
    from thunder.transforms.cudagraph import CUDAGraphTransform

    from kforge.__main__ import build_workload, compile_workload, parser

    args = parser().parse_args(["profile", "gpt2", "--size", "tiny", "--device", "cpu", "--cudagraphs"])
    assert args.cudagraphs and isinstance(args, argparse.Namespace)
    w = build_workload(args)
    for backend in ("kforge", "thunder"):
        with_graphs = compile_workload(w, backend, cudagraphs=True)
        assert any(isinstance(t, CUDAGraphTransform) for t in thunder.compile_data(with_graphs).transforms), backend
        plain = compile_workload(w, backend)
        assert not any(isinstance(t, CUDAGraphTransform) for t in thunder.compile_data(plain).transforms), backend


@gpu
def test_profile_gpu_under_cuda_graphs(tmp_path):
    for backend in ("kforge", "torch.compile"):
        rc, out, err = run_cli("profile", "gpt2", "--size", "tiny", "--steps", "3", "--backend", backend,
                               "--cudagraphs", "--json", str(tmp_path / "p.json"))
        assert rc == 0, err
        assert "CUDA graphs]" in out
        cats = {c["category"]: c for c in json.loads((tmp_path / "p.json").read_text())["by_category"]}
        assert cats["matmul"]["ms"] > 0, (backend, cats)


# ---- polish: help texts, usage lines, pipes, progress, one-line errors ----------------------------------
def _all_parsers():
    """(name, parser) of `python -m kforge`, `python -m kforge.bench` and every subcommand of each."""
    import argparse

    from kforge.__main__ import parser as kforge_parser
    from kforge.bench.__main__ import parser as bench_parser

    out = []
    for name, p in (("kforge", kforge_parser()), ("kforge.bench", bench_parser("python -m kforge.bench"))):
        out.append((name, p))
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                out += [(f"{name} {verb}", sp) for verb, sp in action.choices.items()]
    return out


def test_every_option_has_help_text():
    missing = [f"{name} {a.dest}" for name, p in _all_parsers() for a in p._actions
               if not a.help and name != "kforge bench"]  # `kforge bench` hands everything to kforge.bench
    assert not missing, missing


@pytest.mark.parametrize("argv", [["inspect"], ["tieout"], ["profile"], ["bench", "models"]])
def test_verb_help_states_the_factory_contract(argv):
    rc, out, _ = run_cli(*argv, "--help")
    assert rc == 0
    text = " ".join(out.split())
    for words in ("--model package.module:factory", "factory is any callable returning (model, inputs) or "
                  "(model, inputs, options)", "torch.nn.Module", "one tensor, a tuple of positional arguments, "
                  "or a dict of keyword arguments", '"mode"', '"loss_fn"', '"autocast"'):
        assert words in text, (argv, words)


@pytest.mark.parametrize("argv,prog", [(["-m", "kforge", "bench"], "python -m kforge bench"),
                                       (["-m", "kforge.bench"], "python -m kforge.bench")])
def test_bench_usage_line_and_missing_subcommand(argv, prog):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (PKG_ROOT, os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"usage: {prog} "), r.stderr
    assert f"{prog}: error: name a subcommand (one is required): models, ops, gpt2, llama, launch, report" in r.stderr
    r = subprocess.run([sys.executable, *argv, "--help"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {prog} ")


def test_bench_in_process_names_kforge_bench(capsys):
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m kforge bench ") and "name a subcommand (one is required)" in err


@pytest.mark.parametrize("argv", [["demo"], ["demo", "--help"], ["bench", "--help"], ["--help"]])
def test_closed_stdout_pipe_is_no_traceback(argv):
    """`python -m kforge demo | head`: the reader goes away before kforge writes; exit 141, quietly."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_ROOT, env.get("PYTHONPATH")) if p)
    p = subprocess.Popen([sys.executable, "-m", "kforge", *argv], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    p.stdout.close()  # like `head` after its lines
    err = p.stderr.read()
    # argparse's --help ignores a failed write itself (exit 0); kforge's own output exits 141
    assert p.wait(timeout=1800) == (0 if "--help" in argv else 141), err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_demo_output_cut_by_head_from_a_shell():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_ROOT, env.get("PYTHONPATH")) if p)
    r = subprocess.run(f"{sys.executable} -m kforge demo | head -n 2", shell=True, capture_output=True,
                       text=True, env=env, timeout=1800)
    assert r.returncode == 0 and r.stdout.startswith("No CUDA GPU is visible")
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


@pytest.mark.parametrize("arch", ["200", "85", "1000"])
def test_demo_rejects_archs_nvrtc_cannot_compile(arch):
    rc, out, err = run_cli("demo", "--arch", arch, gpu_visible=False)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"python -m kforge demo: error: --arch {arch}: NVRTC ") and "cannot compile for" in err
    assert " 80, " in err and " 90" in err  # what it can compile for


def test_compile_all_rejects_archs_nvrtc_cannot_compile():
    with pytest.raises(ValueError, match="sm_200 is not an architecture this NVRTC compiles for; use one of 80"):
        kforge.compile_all(200)


def test_profile_on_cpu_is_one_line():
    rc, out, err = run_cli("profile", "gpt2", "--size", "micro", "--device", "cpu")
    assert rc == 2 and out == "" and "Traceback" not in err
    assert err == ("python -m kforge profile: error: --device cpu: kforge profile times CUDA kernels; it runs on "
                   "--device cuda (a GPU)\n")


def test_factory_defaults_are_not_overridden(factories, capsys):
    """Options left off the command line are not passed: the factory's own defaults hold (was: seq=None)."""
    import kf_user_models

    kf_user_models.received.clear()
    assert main(["inspect", "--model", "kf_user_models:make_with_defaults", "--device", "cpu", "--no-grad"]) == 0
    assert kf_user_models.received == [dict(batch=3, seq=5, seed=7, size="s", dtype=None,
                                            device=__import__("torch").device("cpu"))]
    assert main(["tieout", "--model", "kf_user_models:make_with_defaults", "--device", "cpu", "--seq", "9",
                 "--batch", "2"]) == 0
    assert kf_user_models.received[-1]["seq"] == 9 and kf_user_models.received[-1]["batch"] == 2
    assert kf_user_models.received[-1]["seed"] == 7
    assert main(["inspect", "--model", "kf_user_models:make_kw", "--device", "cpu", "--no-grad"]) == 0
    assert set(kf_user_models.received[-1]) == {"device"}  # **kw: only what was given (device always)
    capsys.readouterr()


def test_import_silences_thunders_transformer_engine_warning():
    code = "import warnings; warnings.simplefilter('default'); import kforge, thunder; kforge.executors()"
    r = subprocess.run([sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (PKG_ROOT, os.environ.get("PYTHONPATH")) if p)))
    assert r.returncode == 0, r.stderr
    assert "transformer_engine" not in r.stderr, r.stderr


def test_verbose_flag_logs_the_runtime():
    """-vv: NVRTC loaded, and per kernel a compile (INFO) or a cache hit (DEBUG); the user's cache,
    warm from the demo test above, keeps this quick."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PKG_ROOT, env.get("PYTHONPATH")) if p)
    r = subprocess.run([sys.executable, "-m", "kforge", "-vv", "demo"], capture_output=True, text=True, env=env,
                       timeout=1800)
    assert r.returncode == 0, r.stderr
    assert "kforge INFO: kforge: loaded NVRTC " in r.stderr
    for name in kforge.kernel_names():
        assert (f"kforge INFO: kforge: compiled {name} for sm_90 with NVRTC in " in r.stderr
                or f"kforge DEBUG: kforge: {name} sm_90: disk cache hit" in r.stderr), (name, r.stderr)
