"""kforge.trace_cache: Thunder's compiled programs written by one process, restored by the next.

Two-process tests run a small CPU model (Thunder's torch executor runs it) in subprocesses sharing
a cache directory: the second process must not run Thunder's tracing, and must produce the first
process's outputs and gradients bit for bit; a changed model file, changed inputs or a corrupt
cache file must lead to tracing (and correct results) instead. The GPU-shaped programs of a fake
CUDA trace (kforge operators, fusion kernels, CUDA-graph regions) are serialized and rebuilt without
running them. GPU: a Llama trained under CUDA graphs in a writing, a restoring and a cache-less process.
"""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from conftest import fake_cuda_trace, gpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODEL = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 16)
        self.ln = torch.nn.LayerNorm(16)
        self.l2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.ln(self.l1(x)))
        return torch.softmax(self.l2(h), -1) * 2.0
'''

# The head of the child scripts: Thunder's tracing entry counted (`calls[0]`) by a wrapper installed
# before kforge's own, then kforge imported.
COUNTING = '''
import json, os, sys, warnings
import torch
import thunder

calls = [0]
general_jit = thunder.thunder_general_jit


def counted(*args, **kwargs):
    calls[0] += 1
    return general_jit(*args, **kwargs)


thunder.thunder_general_jit = counted
import kforge
'''

# Runs one training step of the model (two with STEPS=2) and prints what happened as one JSON line.
SCRIPT = COUNTING + '''from kforge import trace_cache

sys.path.insert(0, sys.argv[1])
import model

shape, dtype, out = eval(sys.argv[2]), getattr(torch, sys.argv[3]), sys.argv[4]
torch.manual_seed(0)
net = model.Net().to(dtype)
x = torch.randn(*shape, dtype=dtype)
kwargs = eval(os.environ.get("JIT_KWARGS", "{}"))
runner = None
if os.environ.get("STAND_IN_GRAPHS"):
    # kforge.jit(cudagraphs=True)'s transform with a runner whose "graph" reruns the region into the
    # captured outputs' memory (a CPU stand-in for capture and replay)
    from kforge.cudagraphs import CUDAGraphs, GraphRunner

    class Replay:
        def __init__(self, fn, inputs, outputs):
            self.fn, self.inputs, self.outputs = fn, inputs, outputs

        def replay(self):
            for o, f in zip(self.outputs, self.fn(*self.inputs)):
                # an expanded view is no memory of its own (its base is another output or an input)
                if o is not f and isinstance(o, torch.Tensor) and 0 not in o.stride():
                    o.copy_(f)

    class StandIn(GraphRunner):
        def build_cuda_graph(self, fn, args, mask):
            inputs = tuple(a if m or not isinstance(a, torch.Tensor) else a.clone() for a, m in zip(args, mask))
            outputs = fn(*inputs)
            return Replay(fn, inputs, outputs), inputs, outputs

    graphs = CUDAGraphs()
    graphs.cuda_graph_runner = runner = StandIn()
    kwargs["transforms"] = [graphs]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jnet = (kforge.compile if os.environ.get("DYNAMO") else kforge.jit)(net, **kwargs)
    for _ in range(int(sys.argv[5])):
        net.zero_grad()
        y = jnet(x)
        (y * torch.arange(y.numel(), dtype=dtype).reshape(y.shape)).sum().backward()
ref = model.Net().to(dtype)
ref.load_state_dict(net.state_dict())
y_ref = ref(x)
torch.save({"y": y, "grads": [p.grad for p in net.parameters()]}, out)
warned = [str(w.message) for w in caught if issubclass(w.category, kforge.KforgeCacheWarning)]
from kforge.inspect import inspect

try:
    inspect(jnet)
    inspected = ""
except ValueError as e:
    inspected = str(e)
print(json.dumps({"general_jit_calls": calls[0], "stats": trace_cache.stats(), "warnings": warned,
                  "max_err": (y - y_ref).abs().max().item(), "restored": trace_cache.has_restored(jnet),
                  "inspect_error": inspected, "graphs": None if runner is None else
                  {"stats": runner.stats, "aliased": len(runner.alias_names),
                   "regions": len(runner.python_callables)}}))
'''


def _child(tmp_path, script: str, *args: str, timeout: float = 300, **env: str | None) -> dict:
    """Run `script` (written to tmp_path/run.py) in a fresh Python with `args`, the cache directory
    tmp_path/cache and `env` on top of this process's environment (None: unset); its last stdout
    line, as JSON. The child finds kforge here and everything else where this process found it
    (Thunder may be installed off the default path, as on the GPU machine)."""
    (tmp_path / "run.py").write_text(script)
    path = os.pathsep.join([os.path.join(REPO, "python"), *(p for p in sys.path if p)])
    run_env = {k: v for k, v in {**os.environ, "KFORGE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": path,
                                 **env}.items() if v is not None}
    r = subprocess.run([sys.executable, str(tmp_path / "run.py"), *args], capture_output=True, text=True,
                       env=run_env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture
def project(tmp_path):
    """A model package, the driver script and a cache directory in tmp_path; `run(...)` runs one
    process and returns its JSON report and saved tensors."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "model.py").write_text(textwrap.dedent(MODEL))
    counter = [0]

    def run(shape=(3, 8), dtype="float32", steps=1, **extra_env):
        counter[0] += 1
        out = tmp_path / f"out{counter[0]}.pt"
        report = _child(tmp_path, SCRIPT, str(tmp_path / "pkg"), repr(shape), dtype, str(out), str(steps),
                        **{"KFORGE_TRACE_CACHE": "1", **extra_env})
        return report, torch.load(out)

    run.tmp = tmp_path
    return run


def _entries(tmp) -> list:
    root = tmp / "cache" / "traces"
    return sorted(root.rglob("entry-*.pkl")) if root.exists() else []


def _same(a: dict, b: dict) -> bool:
    return torch.equal(a["y"], b["y"]) and all(torch.equal(p, q) for p, q in zip(a["grads"], b["grads"], strict=True))


def test_second_process_restores_without_tracing(project):
    first, out1 = project(steps=2)
    assert first["general_jit_calls"] == 1 and first["stats"]["saved"] == 1 and first["stats"]["restored"] == 0
    assert len(_entries(project.tmp)) == 1
    second, out2 = project(steps=2)
    assert second["general_jit_calls"] == 0, second
    assert second["stats"]["restored"] == 1 and second["stats"]["traced"] == 0
    assert second["warnings"] == []
    assert _same(out1, out2)
    assert second["max_err"] < 1e-5
    # a restored model has no traces: inspect says why instead of "call it first"
    assert not first["restored"] and first["inspect_error"] == "", first
    assert second["restored"] and "restored from kforge's trace cache" in second["inspect_error"], second


def test_on_by_default(project):
    """Unset (and empty), KFORGE_TRACE_CACHE means on: the second process restores."""
    report, _ = project(KFORGE_TRACE_CACHE=None)
    assert report["stats"]["saved"] == 1 and len(_entries(project.tmp)) == 1
    again, _ = project(KFORGE_TRACE_CACHE="")
    assert again["general_jit_calls"] == 0 and again["stats"]["restored"] == 1


@pytest.mark.parametrize("how", ["env", "argument"])
def test_turned_off(project, how):
    """KFORGE_TRACE_CACHE=0, or kforge.jit(trace_cache=False) over KFORGE_TRACE_CACHE=1: nothing
    written, nothing restored, the traces are there for inspect."""
    extra = dict(KFORGE_TRACE_CACHE="0") if how == "env" else dict(JIT_KWARGS="{'trace_cache': False}")
    for _ in range(2):
        report, _ = project(**extra)
        assert report["general_jit_calls"] == 1 and report["stats"]["saved"] == 0
        assert report["stats"]["restored"] == 0 and report["inspect_error"] == ""
    assert _entries(project.tmp) == []


def test_cuda_graph_regions_are_restored(project):
    """kforge.jit(cudagraphs=True): the graphed regions' programs are written with their static-input
    masks and registered in the second process's runner, whose backward regions still hand out
    their buffers (aliases); two steps give the first process's results bit for bit."""
    first, out1 = project(steps=2, STAND_IN_GRAPHS="1")
    assert first["stats"]["saved"] == 1 and first["graphs"]["regions"] >= 2, first
    assert first["graphs"]["aliased"] >= 1 and first["graphs"]["stats"]["replays"] >= 4
    second, out2 = project(steps=2, STAND_IN_GRAPHS="1")
    assert second["general_jit_calls"] == 0 and second["stats"]["restored"] == 1, second
    assert second["graphs"]["regions"] == first["graphs"]["regions"]
    assert second["graphs"]["aliased"] == first["graphs"]["aliased"]
    assert second["graphs"]["stats"]["replays"] == first["graphs"]["stats"]["replays"]
    assert second["graphs"]["stats"]["retired"] == 0
    assert _same(out1, out2) and second["max_err"] < 1e-5


def test_bad_trace_cache_argument():
    import kforge

    with pytest.raises(TypeError, match="kforge.jit: trace_cache must be True, False or None"):
        kforge.jit(torch.nn.Linear(2, 2), trace_cache="yes")
    with pytest.raises(TypeError, match="kforge.compile: trace_cache must be True, False or None"):
        kforge.compile(torch.nn.Linear(2, 2), trace_cache=1)


def test_changed_model_source_traces_again(project):
    project()
    path = project.tmp / "pkg" / "model.py"
    path.write_text(path.read_text().replace("* 2.0", "* 3.0"))
    report, out = project()
    assert report["general_jit_calls"] == 1 and report["stats"]["restored"] == 0
    assert report["stats"]["skipped_stale"] == 1
    assert report["max_err"] < 1e-5  # the new source's result, not the cached one's
    again, out2 = project()
    assert again["general_jit_calls"] == 0 and _same(out, out2)


@pytest.mark.parametrize("shape,dtype", [((5, 8), "float32"), ((3, 8), "float64")])
def test_changed_inputs_trace_again(project, shape, dtype):
    project()
    report, _ = project(shape=shape, dtype=dtype)
    # the stored entry is restored, its prologue rejects the inputs, Thunder traces
    assert report["stats"]["restored"] == 1 and report["general_jit_calls"] == 1
    assert report["max_err"] < 1e-5
    assert len(_entries(project.tmp)) == 2
    third, _ = project(shape=shape, dtype=dtype)
    assert third["general_jit_calls"] == 0 and third["stats"]["restored"] == 2


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_file_warns_once_and_traces(project, damage):
    _, out1 = project()
    (path,) = _entries(project.tmp)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a pickle" + data[:100])
    report, out2 = project()
    assert report["general_jit_calls"] == 1 and report["stats"]["corrupt"] == 1
    assert len(report["warnings"]) == 1 and "trace cache" in report["warnings"][0], report["warnings"]
    assert _same(out1, out2)
    again, _ = project()  # the retrace replaced the file
    assert again["general_jit_calls"] == 0 and again["warnings"] == []


# ---- kforge.compile (Thunder's Dynamo path) -------------------------------------------------------------
def test_dynamo_second_process_restores_without_tracing(project):
    """kforge.compile: Dynamo runs in both processes, Thunder traces its piece in the first only; two
    steps give the first process's outputs and gradients bit for bit, and inspect names the switch."""
    first, out1 = project(steps=2, DYNAMO="1")
    assert first["general_jit_calls"] == 1 and first["stats"]["saved"] == 1, first
    second, out2 = project(steps=2, DYNAMO="1")
    assert second["general_jit_calls"] == 0 and second["stats"]["restored"] == 1, second
    assert second["warnings"] == [] and _same(out1, out2) and second["max_err"] < 1e-5
    assert "kforge.compile(model, trace_cache=False)" in second["inspect_error"], second


@pytest.mark.parametrize("shape,dtype", [((5, 8), "float32"), ((3, 8), "float64")])
def test_dynamo_changed_inputs_trace_again(project, shape, dtype):
    """Thunder's Dynamo path takes the input checks out of its prologues (Dynamo's guards stand for
    them), so an entry traced for other inputs must never be restored: the piece's example inputs
    are in the key, and other shapes or dtypes trace (with correct results) into an entry of their own."""
    project(DYNAMO="1")
    report, _ = project(shape=shape, dtype=dtype, DYNAMO="1")
    assert report["stats"]["restored"] == 0 and report["general_jit_calls"] == 1, report
    assert report["max_err"] < 1e-5
    assert len(_entries(project.tmp)) == 2
    third, _ = project(shape=shape, dtype=dtype, DYNAMO="1")
    assert third["general_jit_calls"] == 0 and third["stats"]["restored"] == 1, third


def test_dynamo_turned_off(project):
    """kforge.compile(trace_cache=False) over KFORGE_TRACE_CACHE=1: nothing written or restored."""
    for _ in range(2):
        report, _ = project(DYNAMO="1", JIT_KWARGS="{'trace_cache': False}")
        assert report["general_jit_calls"] == 1 and report["stats"]["saved"] == 0, report
    assert _entries(project.tmp) == []


BREAK_SCRIPT = COUNTING + '''from kforge import trace_cache


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return torch.sin(self.b(h)) * 2


torch.manual_seed(0)
net, x = Net(), torch.randn(3, 8)
compiled = kforge.compile(net)
for _ in range(2):
    net.zero_grad()
    y = compiled(x)
    y.sum().backward()
print(json.dumps({"general_jit_calls": calls[0], "stats": trace_cache.stats(), "y": y.tolist(),
                  "grads": [p.grad.tolist() for p in net.parameters()]}))
'''


def test_dynamo_graph_break_pieces_restored(tmp_path):
    """A model Dynamo compiles as two graphs (a graph break; Thunder appends its prologue-pruning
    transform to options shared by both): each graph's piece has its own key, both are restored, and
    two steps give the first process's outputs and gradients exactly."""
    first, second = (_child(tmp_path, BREAK_SCRIPT, KFORGE_TRACE_CACHE="1") for _ in range(2))
    assert first["general_jit_calls"] == 2 and first["stats"]["saved"] == 2, first
    assert second["general_jit_calls"] == 0 and second["stats"]["restored"] == 2, second
    assert second["y"] == first["y"] and second["grads"] == first["grads"]
    assert len(_entries(tmp_path)) == 2


SPLIT_SCRIPT = COUNTING + '''import re
from collections import Counter

import thunder.dynamo.splitter as splitter
import torch.nn.functional as F
from kforge import trace_cache

checked = Counter()
original = splitter.is_node_supported_by_thunder


def counting(node, thunder_options):
    checked[getattr(node.target, "__name__", str(node.target))] += 1
    return original(node, thunder_options)


splitter.is_node_supported_by_thunder = counting


def fn(x, ws):
    for w in ws:
        x = torch.relu(F.linear(x, w)) * 0.5
    x = torch.arctan(x)  # no Thunder symbol: Inductor's, with its reason
    return (F.linear(x, ws[0]) * 0.5).sum()


torch.manual_seed(0)
x = torch.randn(3, 8)
ws = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
compiled = kforge.compile(fn)
with torch.autocast("cpu", dtype=torch.bfloat16, enabled=os.environ.get("AC") == "1"):
    out = compiled(x, ws)
out.backward()
reasons = [re.sub(r" at 0x[0-9a-f]+", "", str(r.info))  # addresses differ between processes
           for info in compiled._backend.subgraph_infos for r in info.split_reasons]
print(json.dumps({"checked": dict(checked), "stats": trace_cache.stats(), "out": out.item(),
                  "grads": [w.grad.tolist() for w in ws], "reasons": reasons}))
'''


def test_dynamo_splitter_verdicts_restored(tmp_path):
    """kforge.compile's second process passes the nodes that passed Thunder's splitter check in the
    first (kept with the trace cache, keyed by the graph) without checking them again; a node that
    failed is checked again and the split names its reason as before; results are the first
    process's. Under another autocast the key differs: every node is checked."""
    first, second = (_child(tmp_path, SPLIT_SCRIPT, KFORGE_TRACE_CACHE="1") for _ in range(2))
    assert first["stats"]["splits_saved"] == 1 and first["stats"]["splits_restored"] == 0, first
    assert sum(first["checked"].values()) > 3, first["checked"]
    assert second["stats"]["splits_restored"] == 1 and second["stats"]["restored"] >= 1, second
    arctan = {k: v for k, v in first["checked"].items() if k == "arctan"}
    assert arctan and {k: v for k, v in second["checked"].items()} == arctan, (first["checked"], second["checked"])
    assert second["reasons"] == first["reasons"] and any("arctan" in r for r in second["reasons"]), second["reasons"]
    assert second["out"] == first["out"] and second["grads"] == first["grads"]
    other = _child(tmp_path, SPLIT_SCRIPT, KFORGE_TRACE_CACHE="1", AC="1")
    assert other["stats"]["splits_restored"] == 0 and sum(other["checked"].values()) > sum(arctan.values()), other


def test_graph_key_reads_the_code_and_the_example_inputs():
    """A Dynamo piece's key: its generated code, its inputs' and held tensors' shapes, strides, dtypes
    and requires_grad; symbolic shapes are refused. Thunder's prologue-pruning transform (no repr of its
    own) is described with its configuration."""
    from thunder.transforms.extraction_only_prologue_transform import ExtractionOnlyPrologueTransform
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kforge import trace_cache

    def piece(example, op=torch.sin):
        g = torch.fx.Graph()
        x = g.placeholder("x")
        x.meta["example_value"] = example
        g.output(g.call_function(op, (x,)))
        return torch.fx.GraphModule(torch.nn.Module(), g)

    with FakeTensorMode():
        a = torch.empty(4, 8)
        keys = [trace_cache._graph_key(piece(e)) for e in
                (a, torch.empty(8, 4).t(), torch.empty(4, 9), a.double(), torch.empty(4, 8, requires_grad=True))]
        keys.append(trace_cache._graph_key(piece(a, torch.cos)))
    assert len(set(keys)) == len(keys), keys
    with FakeTensorMode():
        assert trace_cache._graph_key(piece(torch.empty(4, 8))) == keys[0]  # the same piece again
    def holding(weight):  # a graph that reads a tensor it holds (a get_attr), not an input
        root = torch.nn.Module()
        root.w = torch.nn.Parameter(weight)
        g = torch.fx.Graph()
        g.output(g.call_function(torch.sin, (g.get_attr("w"),)))
        return trace_cache._graph_key(torch.fx.GraphModule(root, g))

    assert holding(torch.randn(4, 8)) == holding(torch.randn(4, 8)) != holding(torch.randn(4, 9))
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        n = mode.shape_env.create_unbacked_symint()
        with pytest.raises(trace_cache.Unserializable, match="symbolic"):
            trace_cache._graph_key(piece(torch.empty(n, 8)))
    on, off = (trace_cache._describe_transform(ExtractionOnlyPrologueTransform(skip_check_on_input_tensors=v))
               for v in (True, False))
    assert on != off and "('skip_check_on_input_tensors', True)" in on, on


# ---- in one process ----------------------------------------------------------------------------------
def test_key_names_what_tracing_depends_on():
    import kforge
    from kforge import trace_cache

    net = torch.nn.Linear(2, 2)
    base = trace_cache.key_parts(kforge.jit(net))
    no_fusion = trace_cache.key_parts(kforge.jit(net, fusion=False))
    assert base != no_fusion and base["executors"] != no_fusion["executors"]
    opts = trace_cache.key_parts(kforge.jit(net, skip_inplace_alias_updates=True))
    assert opts["compile_options"] != base["compile_options"]
    assert base["model"] == "torch.nn.modules.linear.Linear"
    with pytest.raises(trace_cache.Unserializable, match="constant values"):
        trace_cache.key_parts(kforge.jit(net, cache="no caching"))


def test_global_without_recipe_is_refused():
    import thunder

    from kforge import trace_cache

    jfn = thunder.jit(lambda x: x * 2)
    jfn(torch.ones(2))
    entry = thunder.compile_stats(jfn).interpreter_cache[0]
    program = trace_cache._program_of(entry.computation_fn)
    program.__globals__["odd"] = lambda y: y  # a closure no recipe can name
    with pytest.raises(trace_cache.Unserializable, match="'odd'"):
        trace_cache.serialize_program(entry.computation_fn)


def _equivalent(original, rebuilt, original_keys: dict, name: str) -> None:
    """`rebuilt` stands for `original` in another process: the same object for anything named by
    import, a fusion kernel of the same region structure, a program of the same code, an equal value."""
    from kforge import trace_cache
    from kforge.fusion.codegen import schedule
    from kforge.fusion.executor import _Passthrough, _TorchRegion, regions, structural_key
    from kforge.fusion.zero_cotangents import ZeroAware

    if original is rebuilt:
        return
    if type(original).__name__ == "GeneratedKernel":
        keys = {id(fr.kernel): fr.key for fr in regions()}
        assert type(rebuilt) is type(original) and keys[id(rebuilt)] == original_keys[id(original)], name
    elif isinstance(original, ZeroAware):
        assert isinstance(rebuilt, ZeroAware) and rebuilt.positions == original.positions, name
        assert rebuilt.specs == original.specs and rebuilt.nargs == original.nargs, name
        _equivalent(original.fn, rebuilt.fn, original_keys, name)
        for absent, run in rebuilt._variants.items():  # each built as the original would build it
            expect = original.plan(absent)
            if isinstance(run, _Passthrough):
                assert expect is not None and schedule(expect).kind == "passthrough", name
                continue
            got = {id(fr.kernel): fr.key for fr in regions()}.get(id(run))
            assert (expect is None) == (got is None), name
            assert expect is None or got == structural_key(expect), name
    elif isinstance(original, _TorchRegion):
        src = [trace_cache._source(trace_cache._program_of(r.program)) for r in (original, rebuilt)]
        assert isinstance(rebuilt, _TorchRegion) and src[0] == src[1], name
    elif isinstance(original, types.FunctionType):
        assert original.__code__.co_code == rebuilt.__code__.co_code, name
    else:
        assert not isinstance(original, (types.ModuleType, types.BuiltinFunctionType)), name
        assert type(original) is type(rebuilt) and original == rebuilt, name


@pytest.mark.parametrize("zoo", ["plain_llama", "nanogpt", "hf_llama", "nanogpt-autocast"])
def test_fake_gpu_programs_round_trip(zoo):
    """The programs of a Llama traced as on a GPU (kforge operators, fusion kernels, Thunder's torch
    and Python executors): every global is serialized, pickled, and rebuilt to an equivalent object
    after the fusion regions are forgotten, so the kernels are rebuilt from their IR. Hugging Face's
    Llama: the graph Dynamo makes of it, as kforge.compile's pieces are traced. nanoGPT under autocast
    through kforge.jit: the norm calls with a dtype argument (y_dtype, copy_dtype) and the gathered
    input casts."""
    import thunder

    import kforge
    from kforge import trace_cache
    from kforge.fusion.executor import forget_regions, regions
    import importlib

    name, _, autocast = zoo.partition("-")
    kw = dict(jit=kforge.jit, dtype=torch.bfloat16, autocast=True) if autocast else {}
    ft = fake_cuda_trace(importlib.import_module(f"kforge.zoo.{name}").make, size="micro", dynamo=zoo == "hf_llama",
                         **kw)
    if autocast:
        names = {b.sym.name for b in ft.backward.bound_symbols} | {b.sym.name for b in ft.forward.bound_symbols}
        assert {"kforge_layernorm_backward_copy", "kforge_cast_inputs"} <= names, sorted(names)
    entry = thunder.compile_stats(ft.fn).interpreter_cache[0]
    compiled = thunder.compile_data(ft.fn).fn
    record = pickle.loads(pickle.dumps(trace_cache.save_entry(ft.fn, entry)))
    kinds = {r[0] for p in record["programs"].values() for r in p["ctx"].values()}
    assert {"kforge_region", "ref", "module", "compiled"} <= kinds, kinds
    original_keys = {id(fr.kernel): fr.key for fr in regions()}
    forget_regions()
    built: list = []
    for field, rec in record["programs"].items():
        original = trace_cache._program_of(getattr(entry, field)).__globals__
        rebuilt = trace_cache._program_of(trace_cache.rebuild_program(rec, compiled, built))
        assert trace_cache._source(rebuilt) == rec["source"]
        for name in rec["ctx"]:
            if name == "__function_obj" and original[name] is not compiled:  # unread outside the prologue
                assert rebuilt.__globals__[name] is None and name not in rec["source"]
                continue
            _equivalent(original[name], rebuilt.__globals__[name], original_keys, f"{field}: {name}")
    assert built and {fr.key for fr, _ in built} <= set(original_keys.values())


def test_hugging_face_llama_autocast_regions_are_their_kernels_ir():
    """HF Llama under bf16 autocast, traced as on a GPU by kforge.jit: Thunder relabels the rotary
    matmul (fp32 in HF, autocast disabled) bf16 after the fusion pass, so lowering the final trace's
    fusion symbol that reads it fails with "cat of mixed dtypes". The entry is written with the IR
    each kernel was built for, and kforge.inspect describes that region as its kernel."""
    import thunder

    import kforge
    from kforge import trace_cache
    from kforge.fusion import ir as fir
    from kforge.fusion.executor import describe, lower_fusion, regions
    from kforge.zoo import hf_llama

    def make(**kw):
        model, inputs, options = hf_llama.make(**kw)
        return model, inputs, {k: v for k, v in options.items() if k != "mode"}  # kforge.jit, not Dynamo

    ft = fake_cuda_trace(make, jit=kforge.jit, size="micro", batch=2, seq=16, autocast=True)
    kernels = {id(fn): b for t in (ft.forward, ft.backward) for b in t.bound_symbols if b.sym.is_fusion
               for fn in (b._call_ctx or {}).values() if isinstance(fn, kforge._C.GeneratedKernel)}
    relabelled = []
    for b in kernels.values():
        try:
            lower_fusion(b)
        except fir.Unsupported as e:
            relabelled.append((b, str(e)))
    assert relabelled and all(why == "cat of mixed dtypes" for _, why in relabelled), relabelled
    entry = thunder.compile_stats(ft.fn).interpreter_cache[0]
    found = trace_cache._kforge_regions(entry)
    built = {id(fr.kernel): fr.ir for fr in regions()}
    assert set(kernels) <= set(found) and all(found[k][0] is built[k] for k in found)
    pickle.dumps(trace_cache.save_entry(ft.fn, entry))
    for b, _ in relabelled:
        assert describe(b)["kernel"] != "torch fallback" and not describe(b)["schedule"].startswith("torch")


def test_fake_gpu_cuda_graph_programs_round_trip():
    """A Llama traced as on a GPU under kforge.jit(cudagraphs=True): its programs call graphed
    regions, whose own programs call kforge's fusion kernels. Each region is written with its
    static-input mask and the kernels it holds; rebuilt, it is registered in a fresh runner under a
    new name, with the backward regions still aliased."""
    import thunder

    import kforge
    from kforge import trace_cache
    from kforge.cudagraphs import CUDAGraphs
    from kforge.fusion.executor import forget_regions
    from kforge.zoo import plain_llama

    ft = fake_cuda_trace(plain_llama.make, jit=lambda fn: kforge.jit(fn, cudagraphs=True), size="micro",
                         batch=2, seq=16)
    entry = thunder.compile_stats(ft.fn).interpreter_cache[0]
    compiled = thunder.compile_data(ft.fn).fn
    (t,) = [t for t in thunder.compile_data(ft.fn).transforms if isinstance(t, CUDAGraphs)]
    record = pickle.loads(pickle.dumps(trace_cache.save_entry(ft.fn, entry)))
    graphs = [r for p in record["programs"].values() if p for r in p["ctx"].values() if r[0] == "cuda_graph"]
    assert len(graphs) == len(t.runner.python_callables), (len(graphs), len(t.runner.python_callables))
    inner = {r[0] for g in graphs for r in g[1]["ctx"].values()}
    assert "kforge_region" in inner, inner
    assert sum(g[3] for g in graphs) == len(t.runner.alias_names) >= 1
    forget_regions()
    fresh = CUDAGraphs().runner
    fresh.name_counter = 7  # names continue this runner's count, whatever the first process called them
    built: list = []
    for rec in record["programs"].values():
        if rec is not None:
            trace_cache.rebuild_program(rec, compiled, built, fresh)
    assert sorted(fresh.python_callables) == sorted(f"CUDAGraph{7 + i}" for i in range(len(graphs)))
    assert {m for _, m in fresh.python_callables.values()} == {g[2] for g in graphs}
    assert len(fresh.alias_names) == len(t.runner.alias_names) and built


GRAPHED = COUNTING + '''from kforge.cudagraphs import CUDAGraphs
from kforge.zoo import plain_llama

m, _, opts = plain_llama.make(size="micro", batch=2, seq=16)
jm = kforge.jit(m, cudagraphs=True, trace_cache=sys.argv[1] == "1")
opt = torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True)
losses = []
for s in range(4):
    _, inputs, _ = plain_llama.make(size="micro", batch=2, seq=16, seed=s + 1)
    opt.zero_grad(set_to_none=True)
    loss = opts["loss_fn"](jm(*inputs))
    loss.backward()
    opt.step()
    losses.append(loss.float().item())
(t,) = [t for t in thunder.compile_data(jm).transforms if isinstance(t, CUDAGraphs)]
print(json.dumps({"losses": losses, "traced": calls[0], "restored": kforge.trace_cache.stats()["restored"],
                  "runner": t.runner.stats, "aliased": len(t.runner.alias_names)}))
'''


@gpu
def test_graphed_training_restored_on_a_gpu(tmp_path):
    """kforge.jit(cudagraphs=True) on a GPU, bf16 Llama: a process that traces and writes, one that
    restores (no tracing) and one without the cache train the same 4 AdamW steps. The restored
    graphs capture and replay the same kernels: losses agree, backward graphs still alias their
    outputs, none is retired."""
    first, second, plain = (_child(tmp_path, GRAPHED, cache, timeout=600) for cache in ("1", "1", "0"))
    assert first["traced"] >= 1 and first["restored"] == 0
    assert second["traced"] == 0 and second["restored"] >= 1, second
    for rep in (first, second, plain):
        assert rep["runner"]["retired"] == 0 and rep["aliased"] == plain["aliased"] >= 1, rep
        assert rep["losses"] == pytest.approx(plain["losses"], rel=2e-2, abs=2e-2), (rep["losses"], plain["losses"])


HF_SCRIPT = '''
import json
import os
import torch
import kforge
from kforge import trace_cache
from kforge.zoo import hf_llama

m, inputs, opts = hf_llama.make(size="micro", batch=2, seq=16, device="cpu", dtype=torch.float32)
compile = kforge.compile if os.environ.get("DYNAMO") else kforge.jit
loss = opts["loss_fn"](compile(m)(**inputs))
loss.backward()
print(json.dumps({"loss": loss.item(), "grads": [p.grad.double().sum().item() for p in m.parameters()],
                  "stats": trace_cache.stats()}))
'''


@pytest.mark.parametrize("path", ["jit", "dynamo"])
def test_hugging_face_llama_restores(tmp_path, path):
    """transformers' LlamaForCausalLM under kforge.jit: its programs name a memory format, and its
    trace runs dataclasses' generated methods (code from a string, charged to the module that
    defines the dataclass) and the frozen stdlib; under kforge.compile, Thunder traces Dynamo's graph
    of it. The second process restores and gives the first one's loss and gradients exactly."""
    env = dict(KFORGE_TRACE_CACHE="1", DYNAMO="1" if path == "dynamo" else None)
    first, second = (_child(tmp_path, HF_SCRIPT, timeout=600, **env) for _ in range(2))
    assert first["stats"]["saved"] == 1 and first["stats"]["unserializable"] == 0, first["stats"]
    assert second["stats"]["restored"] == 1 and second["stats"]["traced"] == 0, second["stats"]
    assert second["loss"] == first["loss"] and second["grads"] == first["grads"]


def test_source_file_of_generated_and_frozen_code():
    """Which file's hash stands for code the interpreter ran: the file itself; for code compiled
    from a string, the file of the module whose globals it runs in; nothing for the frozen stdlib."""
    import dataclasses

    from kforge.trace_cache import _source_file

    @dataclasses.dataclass
    class Out:
        x: int

    init = Out.__init__
    assert init.__code__.co_filename == "<string>"
    assert _source_file(init.__code__.co_filename, init) == __file__
    assert _source_file("<frozen _collections_abc>", None) == ""
    assert _source_file(__file__, test_source_file_of_generated_and_frozen_code) == __file__
    # no module file to charge it to: the name stays, and the entry is not written (no hash)
    orphan = types.FunctionType(compile("def f():\n    return 1\n", "<string>", "exec").co_consts[0], {})
    assert _source_file("<string>", orphan) == "<string>"


def test_key_directories_are_bounded(tmp_path, monkeypatch):
    """Each kforge / torch / Thunder version, model and option set writes its own key directory;
    past `_MAX_KEYS` the least recently used go when an entry is written, never the one written to,
    and one restored from counts as used."""
    from kforge import trace_cache

    monkeypatch.setattr(trace_cache, "_MAX_KEYS", 4)
    root = tmp_path / "traces"
    dirs = []
    for i in range(7):
        d = root / f"key{i}"
        d.mkdir(parents=True)
        (d / "entry-x.pkl").write_bytes(b"x")
        os.utime(d, ns=(10**18 + i * 10**9,) * 2)
        dirs.append(d)
    os.utime(dirs[0], ns=(10**18 + 100 * 10**9,) * 2)  # restored from recently: kept
    trace_cache._prune_keys(str(root), str(dirs[1]))  # writing to the old key1: kept too
    assert sorted(p.name for p in root.iterdir()) == ["key0", "key1", "key4", "key5", "key6"]
