"""Shared test machinery: the GPU marker, per-dtype tolerances, references and poisoned outputs;
Thunder helpers (proxies for checker tests, launchers swapped for torch on CPU, jit-vs-eager checks);
and the model tie-out helpers that the GPT-2 and Llama tests share.

Thunder and kforge are imported inside the helpers, so collecting tests that need neither stays cheap.
"""
from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch

# kforge.jit's trace cache (on by default) would hand a later test the programs an earlier one traced,
# without their traces, and skip the tracing the test is there to exercise: off for the suite;
# tests/test_trace_cache.py turns it on in its own processes.
os.environ["KFORGE_TRACE_CACHE"] = "0"

HAS_GPU = torch.cuda.is_available()
NO_GPU_REASON = "needs a CUDA GPU (run the GPU suite on the GPU machine)"

# Use as a decorator / pytestmark on every test that launches a kernel.
gpu = pytest.mark.skipif(not HAS_GPU, reason=NO_GPU_REASON)


def pytest_configure(config):
    global _REPORTS_RESULTS
    # not the PYTEST_XDIST_WORKER variable: a test's own pytest subprocess inherits it
    _REPORTS_RESULTS = not hasattr(config, "workerinput")
    config.addinivalue_line("markers", "bigmem: needs 10+ GiB of GPU memory (tensors past 2^31 elements)")
    config.addinivalue_line("markers", "xdist_group(name): tests pytest-xdist runs on one worker")
    # scripts/sanitize.sh runs `-m sanitize` under compute-sanitizer (10-100x slower kernels): small
    # odd shapes that still reach every kernel layout; `sanitize_race` is the smaller racecheck subset.
    config.addinivalue_line("markers", "sanitize: small-shape test selected for the compute-sanitizer runs")
    config.addinivalue_line("markers", "sanitize_race: the subset of `sanitize` small enough for racecheck")


# Hypothesis: the default profile is derandomized and keeps no example database, so every run (CI,
# the GPU machine) draws the same examples and a failure reproduces; HYPOTHESIS_PROFILE=explore
# draws fresh random examples (and more of them) when hunting for new failures.
try:
    from hypothesis import HealthCheck, settings as _hyp_settings

    # function_scoped_fixture: the autouse fixtures below (poisoned outputs, cached GPU memory) are
    # the same for every example, so sharing them across the examples of one test is intended.
    _hyp_settings.register_profile("kforge", derandomize=True, database=None, deadline=None,
                                   print_blob=True, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                           HealthCheck.too_slow])
    _hyp_settings.register_profile("explore", parent=_hyp_settings.get_profile("kforge"),
                                   derandomize=False)
    _hyp_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "kforge"))
except ImportError:  # hypothesis is in requirements.txt; the tests that use it import it themselves
    pass


# memcheck and initcheck (scripts/sanitize.sh) run with PyTorch's caching allocator off, so that every
# tensor is its own cudaMalloc. Capturing a CUDA graph needs that allocator (PyTorch's cudaMalloc
# during capture invalidates it), so a test that captures one skips there, saying why, whatever its
# name (the selections' name filters missed test_add_is_deterministic_on_streams_and_graphs).
NO_CACHING_ALLOCATOR = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1"
if NO_CACHING_ALLOCATOR and HAS_GPU:
    def _no_graph_capture(*args, **kwargs):
        pytest.skip("CUDA graph capture needs PyTorch's caching allocator (PYTORCH_NO_CUDA_MEMORY_CACHING=1)")

    torch.cuda.graph.__enter__ = _no_graph_capture
    torch.cuda.CUDAGraph.capture_begin = _no_graph_capture


# scripts/sanitize.sh sets KERNEL_COVERAGE_FILE to a file per run: which shipped kernel
# instantiations this process launched, and for each the first test that launched it, so the matrix
# can say which ones no selection reached and run the tests that reach them all (its `cover`
# selection, SANITIZE_NODEIDS_FILE below) under the slower tools.
_FIRST_TEST: dict = {}
# Kernels' element type names (kernels_src/common.cuh), as name expressions spell them.
KERNEL_TYPE = {torch.float32: "float", torch.bfloat16: "bf16", torch.float16: "half"}


def launched(program: str | None = None) -> set:
    """Name expressions launched in this process: (program, expression) pairs, or the expressions of
    `program` alone (kforge._C.kernel_coverage)."""
    try:
        import kforge._C as C
    except ImportError:
        return set()
    rows = C.kernel_coverage()
    if program is None:
        return {(p, e) for p, e, u in rows if u}
    return {e for p, e, u in rows if u and p == program}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not os.environ.get("KERNEL_COVERAGE_FILE"):
        yield
        return
    before = launched()
    yield
    for key in launched() - before:
        _FIRST_TEST.setdefault(key, item.nodeid)


def pytest_unconfigure(config):
    path = os.environ.get("KERNEL_COVERAGE_FILE")
    if not path:
        return
    import json

    try:
        import kforge._C as C
    except ImportError:
        return
    rows = [{"program": p, "expression": e, "launched": bool(u), "first_test": _FIRST_TEST.get((p, e))}
            for p, e, u in C.kernel_coverage()]
    with open(path, "w") as f:
        json.dump(rows, f)


# Test durations, for ordering the GPU suite (scripts/gpu_run.sh suite). TEST_DURATIONS_FILE: each
# test's seconds (setup + call + teardown) are appended there, "seconds<TAB>node id" a line, by the
# process that reports results (the controller under pytest-xdist). tests/gpu_durations.txt, in the
# same format, is what a GPU suite recorded: when it is there, the collected tests run longest first
# (tests it does not list count as its mean), so that with pytest-xdist the slow ones start at once
# rather than trail after the rest. TEST_ORDER_BY_DURATION=0 keeps the collection order;
# TEST_ORDER_DURATIONS names another durations file to order by.
_DURATIONS: dict[str, float] = {}
DURATIONS_FILE = os.path.join(os.path.dirname(__file__), "gpu_durations.txt")


_REPORTS_RESULTS = True  # false in a pytest-xdist worker (its controller writes the durations)


def pytest_runtest_logreport(report):
    path = os.environ.get("TEST_DURATIONS_FILE")
    if not path or not _REPORTS_RESULTS:
        return
    _DURATIONS[report.nodeid] = _DURATIONS.get(report.nodeid, 0.0) + report.duration
    if report.when == "teardown":
        with open(path, "a") as f:
            f.write(f"{_DURATIONS.pop(report.nodeid):.3f}\t{report.nodeid}\n")


def recorded_durations(path: str = DURATIONS_FILE) -> dict[str, float]:
    """{node id: seconds} from a durations file (the last line of a node id wins; bad lines skipped)."""
    out: dict[str, float] = {}
    try:
        with open(path) as f:
            for line in f:
                seconds, _, nodeid = line.rstrip("\n").partition("\t")
                try:
                    out[nodeid] = float(seconds)
                except ValueError:
                    continue
    except OSError:
        pass
    out.pop("", None)
    return out


def longest_first(items: list, durations: dict[str, float]) -> list:
    """`items` by recorded duration, longest first; unrecorded ones count as the mean; ties keep
    their collection order (the same order in every process, as pytest-xdist requires)."""
    if not durations:
        return list(items)
    mean = sum(durations.values()) / len(durations)
    return sorted(items, key=lambda it: -durations.get(it.nodeid, mean))


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th of N parts of the collected tests (1-based; each test in exactly one "
                          "part, by a hash of its node id): the GPU suite in several calls of bounded time")


def _shard(spec: str) -> tuple[int, int]:
    try:
        i, n = (int(v) for v in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {spec!r}: expected I/N, e.g. 2/3") from None
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard {spec!r}: I must be between 1 and N")
    return i, n


def in_shard(nodeid: str, i: int, n: int) -> bool:
    """Whether test `nodeid` belongs to part `i` of `n` (the same answer in every process)."""
    import zlib

    return zlib.crc32(nodeid.encode()) % n == i - 1


def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if spec:
        i, n = _shard(spec)
        config.hook.pytest_deselected(items=[it for it in items if not in_shard(it.nodeid, i, n)])
        items[:] = [it for it in items if in_shard(it.nodeid, i, n)]
    # SANITIZE_NODEIDS_FILE (scripts/sanitize.sh's `cover` selection): only the tests listed there,
    # one node id a line (ids hold spaces and brackets a shell -k expression would mangle).
    # Read once and dropped: the tests that start pytest or sanitize.sh in a subprocess must not
    # inherit the filter (their own selections would come out empty).
    keep_file = os.environ.pop("SANITIZE_NODEIDS_FILE", None)
    if keep_file:
        with open(keep_file) as f:
            keep = {line.strip() for line in f if line.strip()}
        selected = [it for it in items if it.nodeid in keep]
        config.hook.pytest_deselected(items=[it for it in items if it.nodeid not in keep])
        items[:] = selected
    if os.environ.get("TEST_ORDER_BY_DURATION", "1") != "0":
        items[:] = longest_first(items, recorded_durations(os.environ.get("TEST_ORDER_DURATIONS", DURATIONS_FILE)))
    # Under pytest-xdist with --dist loadgroup the bigmem tests share one worker, so they run one at a
    # time instead of several at once exhausting the GPU's memory for every other worker.
    for item in items:
        if item.get_closest_marker("bigmem"):
            item.add_marker(pytest.mark.xdist_group("bigmem"))


# Relative error ||out - ref|| / ||ref|| against a float64 reference computed from the same
# (rounded) inputs. fp32 kernels accumulate in fp32: well under 1e-5 for these sizes; bf16/fp16
# results carry one output rounding (2^-8 / 2^-11 relative) plus fp32 accumulation.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}
# Element-wise bound used alongside REL_TOL, in units of the output dtype's epsilon times |ref|.
DTYPES = [torch.float32, torch.bfloat16]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf in `out` where `ref` is finite gives inf.
    Computed in chunks of 2^24 elements: whole float64 copies of a (2, 8193, 8193) pair ran an H100
    out of memory under compute-sanitizer."""
    o, r = out.reshape(-1), ref.reshape(-1)
    num = den = 0.0
    step = 1 << 24
    for i in range(0, o.numel(), step):
        o64, r64 = o[i:i + step].double(), r[i:i + step].double()
        if not torch.isfinite(o64[torch.isfinite(r64)]).all():
            return float("inf")
        num += (o64 - r64).square().sum().item()
        den += r64.square().sum().item()
    num, den = math.sqrt(num), math.sqrt(den)
    return num / den if den > 0 else num


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "",
                 tol: float | None = None, scale: float | None = None) -> None:
    """Relative-error check with the per-dtype tolerance (or `tol`); shapes must match exactly.

    `scale`: the norm of the terms `ref` is a difference of, where that can be far larger than
    `ref` itself (a normalisation's dx over a handful of columns cancels): the error is then
    measured against max(||ref||, scale), since the inputs' rounding is relative to the terms."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    limit = REL_TOL[dtype] if tol is None else tol
    # Below the dtype's smallest normal number there is no relative precision to ask for (fp16
    # subnormals start at 6.1e-5): measure against at least that magnitude per element.
    floor = max(torch.finfo(dtype).tiny * out.numel() ** 0.5, scale or 0.0)
    ref_norm = ref.double().norm().item()
    if 0 < ref_norm < floor and math.isfinite(err):
        err = err * ref_norm / floor
    assert err <= limit, f"{what}: relative error {err:.3e} > {limit:.1e} ({dtype})"


def randn(*shape, dtype=torch.float32, device="cuda", scale=1.0, seed=None) -> torch.Tensor:
    """Random normal test data (never zeros), generated in fp32 then cast."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


@pytest.fixture(autouse=True, scope="session")
def _poison_outputs():
    """Every output a kforge launcher allocates starts as NaN, so unwritten elements fail tests."""
    import kforge

    kforge._C.set_poison_outputs(True)
    yield
    kforge._C.set_poison_outputs(False)


@pytest.fixture(autouse=True)
def _release_cached_gpu_memory():
    """Hands the test's cached GPU memory back to the driver afterwards: under pytest-xdist every
    worker is a process with its own caching allocator, and one that kept the peak of a large test
    reserved left the other workers out of memory."""
    yield
    if HAS_GPU and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# ---- Thunder: checkers, and the claims' wiring without a GPU ------------------------------------------
def proxy(*shape, dtype=torch.float32, device="cuda:0", requires_grad=False):
    """A Thunder TensorProxy for checker tests (no GPU needed, whatever the device).

    The shape is ints or one tuple: `proxy(8, 768)`, `proxy((8, 768))`, `proxy(())` for 0-D. `dtype`
    (a torch or thunder dtype), `device` and `requires_grad` are keywords. Test files whose checkers
    mostly see another dtype bind it: `proxy = functools.partial(conftest.proxy, dtype=torch.bfloat16)`.
    Create proxies inside a trace context (the `trace_ctx` fixture, or `with tracectx(TraceCtx()):`).
    """
    from thunder.core import devices, dtypes
    from thunder.core.proxies import TensorProxy

    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    if not all(isinstance(n, int) for n in shape):
        raise TypeError(f"proxy: the shape is ints or one tuple of ints, got {shape!r} (dtype is a keyword)")
    return TensorProxy(shape=shape, device=devices.Device(device), dtype=dtypes.to_dtype(dtype),
                       requires_grad=requires_grad)


@pytest.fixture
def trace_ctx():
    """Runs the test inside a fresh Thunder trace context (where proxies can be made and checked)."""
    from thunder.core.trace import TraceCtx, tracectx

    with tracectx(TraceCtx()):
        yield


def symbol_names(trace) -> set[str]:
    """Names of the symbols a Thunder trace binds at its top level."""
    return {b.sym.name for b in trace.bound_symbols}


def call_ctx(sym) -> dict:
    """The {name: fn} dict that Thunder's register_operator binds into every call of operator `sym`:
    `call_ctx(sym)[sym.name]` is what the operator runs (a kforge launcher)."""
    for cell in sym._bind_postprocess.__closure__ or ():
        if isinstance(cell.cell_contents, dict) and sym.name in cell.cell_contents:
            return cell.cell_contents
    raise AssertionError(f"no call context for {sym.name}")


def swap_launchers(monkeypatch, op_module, swaps: dict) -> None:
    """Thunder plumbing without a GPU: each kforge operator in `swaps` ({symbol: torch stand-in}) runs
    its stand-in instead of its launcher, and `op_module.tensor_problem` passes CPU tensors, so the
    module's checkers accept CPU inputs while the claims' metas and grad transforms run for real.

    `monkeypatch` undoes both at teardown. If Thunder binds some operator differently (see `call_ctx`),
    the AssertionError comes before anything is swapped.
    """
    from thunder.core import devices

    contexts = {sym: call_ctx(sym) for sym in swaps}
    for sym, fn in swaps.items():
        monkeypatch.setitem(contexts[sym], sym.name, fn)
    real = op_module.tensor_problem
    monkeypatch.setattr(op_module, "tensor_problem",
                        lambda t, name="input": None if t.device.devicetype == devices.DeviceType.CPU else real(t, name))


def check_jit_matches_eager(fn, args, dtype, forward_symbol: str, backward_symbol: str,
                            names: list[str] | None = None) -> None:
    """thunder.jit(fn) with kforge against eager `fn`, each on its own copy of `args` (same strides,
    same `requires_grad`): `forward_symbol` is in the final forward trace and `backward_symbol` in the
    final backward trace, and after backward of the same random output gradients, the outputs (one
    tensor or a tuple) and then the gradients of the args that require grad match eager within
    2 * REL_TOL[dtype] (both sides round). `names` labels those in failure messages (default
    "output", "grad <arg index>")."""
    import thunder

    import kforge

    ref_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    jit_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    jf = thunder.jit(fn, executors=[kforge.executor])
    out, ref = jf(*jit_args), fn(*ref_args)
    outs, refs = (tuple(out), tuple(ref)) if isinstance(ref, tuple) else ((out,), (ref,))
    grads = [randn(*r.shape, dtype=r.dtype, device=r.device) for r in refs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(refs, grads)
    assert forward_symbol in symbol_names(thunder.last_traces(jf)[-1])
    assert backward_symbol in symbol_names(thunder.last_backward_traces(jf)[-1])
    grad_of = [i for i, a in enumerate(args) if a.requires_grad]
    got = [*outs, *(jit_args[i].grad for i in grad_of)]
    want = [*refs, *(ref_args[i].grad for i in grad_of)]
    if names is None:
        names = [f"output {k}" for k in range(len(outs))] if len(outs) > 1 else ["output"]
        names += [f"grad {i}" for i in grad_of]
    assert len(names) == len(got), f"{len(names)} names for {len(got)} outputs and gradients"
    for o, r, name in zip(got, want, names):
        assert_close(o, r, dtype, name, tol=2 * REL_TOL[dtype])


# ---- model tie-outs (GPT-2, Llama) --------------------------------------------------------------------
def kforge_executors() -> list:
    """kforge first, then Thunder's defaults: what the model tests jit with."""
    import thunder

    import kforge

    return [kforge.executor, *thunder.get_default_executors()]


def tieout_failures(report) -> str:
    """A tie-out report's failing rows and summary, for an assertion message."""
    return f"\n{report.table(failures_only=True)}\n{report.summary()}"


def assert_cpu_tieout_falls_back(model, batch):
    """tieout(model, batch) under kforge on CPU tensors: every kforge checker declines, Thunder runs
    torch, and eager is matched. Returns the report."""
    from kforge.tieout import tieout

    report = tieout(model, batch, executors=kforge_executors())
    assert report.ok, tieout_failures(report)
    assert not report.kforge_symbols, f"kforge ran on CPU tensors: {dict(report.kforge_symbols)}"
    return report


def assert_loss_ignores_targets_and_is_causal(model, idx, targets, t: int = 7) -> None:
    """A language model's `model(idx, targets) -> (logits, loss)`: targets of -1 are left out of the
    mean cross-entropy, and changing token `t` leaves the logits of earlier positions alone (and
    changes later ones)."""
    import torch.nn.functional as F

    assert (targets == -1).any()
    logits, loss = model(idx, targets)
    vocab_size = logits.shape[-1]
    keep = targets.view(-1) != -1
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, vocab_size)[keep], targets.view(-1)[keep]))
    idx2 = idx.clone()
    idx2[:, t] = (idx2[:, t] + 1) % vocab_size
    logits2, _ = model(idx2)
    torch.testing.assert_close(logits2[:, :t], logits[:, :t], rtol=0, atol=0)
    assert not torch.allclose(logits2[:, t:], logits[:, t:])


def assert_rejects_bad_token_shapes(model, block_size: int) -> None:
    """A sequence longer than `block_size` and token ids that are not (B, T) raise ValueError."""
    with pytest.raises(ValueError, match="exceeds block_size"):
        model(torch.zeros(1, block_size + 1, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        model(torch.zeros(4, dtype=torch.long))


# ---- tracing as on a GPU, without one ------------------------------------------------------------------
class FakeTrace:
    """What `fake_cuda_trace` traced: the compiled function `fn` (for `kforge.inspect`, `.llama_patterns`),
    the computation trace Thunder's transforms saw first, and the final forward / backward traces."""

    def __init__(self, fn, computation, forward, backward):
        self.fn, self.computation, self.forward, self.backward = fn, computation, forward, backward

    def compile_regions(self, arch: int = 90) -> int:
        """Compiles (NVRTC, sm_`arch`) the kernels of every kforge.fusion region of the forward and
        backward traces; returns how many regions launch a kernel."""
        from kforge import _C
        from kforge.fusion import codegen, executor as fx

        compiled = 0
        for trace in (self.forward, self.backward):
            for b in trace.bound_symbols if trace is not None else ():
                if b.sym.name.startswith("kforgeFusion"):
                    region = fx.lower_fusion(b)
                    ks = codegen.generate(region, codegen.default_key(region))
                    if ks.launches:
                        _C.compile_generated(ks.program, ks.source, [launch[0] for launch in ks.launches], arch)
                        compiled += 1
        return compiled

    def symbols(self) -> tuple:
        """(forward, backward) Counters of the kforge symbols, fusion regions included."""
        from kforge.tieout import symbol_counts

        return symbol_counts(self.forward), symbol_counts(self.backward) if self.backward is not None else None


def _hopper_capability(device=None) -> tuple[int, int]:
    return (9, 0)  # a plain function, which Dynamo and Thunder's interpreter trace as they would torch's


@contextlib.contextmanager
def as_on_a_gpu():
    """What tracing CUDA models without a GPU needs patched: SDPA's flash / efficient checks, autocast's CUDA
    checks, kforge attention's device check and the device capability (an sm_90 GPU), module parameters converted by `.to()`
    under fake tensors. Restored afterwards."""
    import contextlib
    from unittest import mock

    overwrite = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        with contextlib.ExitStack() as stack:
            # As on a GPU: FlashAttention takes no attn_mask, memory-efficient attention takes one.
            stack.enter_context(mock.patch.object(torch.backends.cuda, "can_use_flash_attention",
                                                  side_effect=lambda p, debug=False: p.attn_mask is None and p.query.dtype in (torch.float16, torch.bfloat16),
                                                  create=True))
            stack.enter_context(mock.patch.object(torch.backends.cuda, "can_use_efficient_attention",
                                                  return_value=True, create=True))
            stack.enter_context(mock.patch("torch.cuda.amp.common.amp_definitely_not_available", return_value=False))
            stack.enter_context(mock.patch("torch.cuda.is_bf16_supported", return_value=True))
            # transformers' MoE layers pick torch's grouped GEMM by the capability (sm_80+)
            stack.enter_context(mock.patch("torch.cuda.get_device_capability", new=_hopper_capability))
            # kforge's cuDNN attention asks the device for sm_90: answer as a Hopper GPU would.
            stack.enter_context(mock.patch("kforge.ops.attention._device_problem", return_value=None))
            yield
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(overwrite)


def traced_region(fn, args: tuple, *, zeros: tuple = ()):
    """(the fusion IR of `fn`'s whole computation trace, traced by Thunder on the given CPU tensors,
    the trace's tensor inputs). `zeros`: positions of those inputs lowered as the constant 0."""
    import thunder
    from thunder.core import prims
    from thunder.core.proxies import TensorProxy

    from kforge.fusion import ir as fir

    jf = thunder.jit(fn)
    jf(*args)
    tr = thunder.last_traces(jf)[0]
    skip = (prims.PrimIDs.UNPACK_TRIVIAL, prims.PrimIDs.RETURN, prims.PrimIDs.UNPACK_SEQUENCE)
    bsyms = [b for b in tr.bound_symbols if b.sym.id not in skip]
    ins = [a for a in tr.args if isinstance(a, TensorProxy)]
    out = tr.output if isinstance(tr.output, (tuple, list)) else (tr.output,)
    outs = [o for o in out if isinstance(o, TensorProxy)]
    return fir.lower(bsyms, ins, outs, zeros=zeros), ins


def undeleted_tensors(trace) -> dict[str, str]:
    """{name: producing symbol} of the tensors a final trace makes and neither returns nor deletes:
    each holds its memory until the trace's function returns (a pass that replaced calls and dropped
    their `del`s)."""
    from thunder.core.prims import PrimIDs
    from thunder.core.proxies import TensorProxy

    made, gone = {}, set()
    for b in trace.bound_symbols:
        if b.sym.id in (PrimIDs.DEL, PrimIDs.RETURN):
            gone |= {p.name for p in b.flat_proxy_args}
        else:
            made.update({p.name: b.sym.name for p in b.flat_proxy_outs if isinstance(p, TensorProxy)})
    return {k: v for k, v in made.items() if k not in gone}


def fake_cuda_trace(make, /, *, jit=None, dynamo: bool | None = None, **make_kwargs) -> FakeTrace:
    """Trace `make`'s function as Thunder would on a GPU, without one: forward and backward traces
    are built, no kernel runs.

    make:   a zoo factory contract, `make(device="cuda", **make_kwargs) -> (fn, inputs, options)`:
            inputs a tuple (positional) or a dict (keyword arguments); options may hold "autocast"
            (a dtype: the call runs under `torch.autocast("cuda", dtype)`) and "mode" ("dynamo":
            Thunder's Dynamo path). It runs inside a FakeTensorMode, so it builds models and tensors
            on "cuda" as usual (fake: shapes, dtypes and devices only).
    jit:    fn -> compiled function (default `kforge.transforms.jit`: kforge first, every pattern).
    dynamo: trace the FX graph Dynamo makes of `fn` (what ThunderCompiler hands Thunder when nothing
            splits it) instead of `fn` itself; default: options' mode.

    Works around what a GPU-less machine lacks: SDPA's flash check, autocast's CUDA checks, module
    parameters converted by `.to()` under fake tensors. Everything is restored afterwards.
    """
    import contextlib

    import thunder
    from torch._subclasses.fake_tensor import FakeTensorMode

    if jit is None:
        from kforge.transforms import jit
    with as_on_a_gpu(), contextlib.ExitStack() as stack:
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=False))
        fn, inputs, options = make(device="cuda", **make_kwargs)
        args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
        ac = options.get("autocast")
        autocast = (lambda: torch.autocast("cuda", ac)) if ac is not None else contextlib.nullcontext
        if options.get("mode") == "dynamo" if dynamo is None else dynamo:
            fn, args, kwargs = _dynamo_graph(fn, args, kwargs, autocast)
        jfn = jit(fn)
        with autocast():
            thunder.compile_data(jfn).get_computation_and_inputs(*args, **kwargs)
    traces = thunder.last_traces(jfn)
    backward = thunder.last_backward_traces(jfn)
    return FakeTrace(jfn, traces[0], traces[-1], backward[-1] if backward else None)


def _dynamo_graph(fn, args, kwargs, autocast):
    """(the one FX graph Dynamo makes of fn(*args, **kwargs), its inputs as fresh fake tensors, {})."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm

    torch._dynamo.reset()
    try:
        with autocast():
            torch.compile(fn, backend=capture)(*args, **kwargs)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"Dynamo made {len(graphs)} graphs of the model, not one"
    gm, example = graphs[0]
    inputs = [torch.empty_strided(e.shape, e.stride(), dtype=e.dtype, device=e.device, requires_grad=e.requires_grad)
              if isinstance(e, torch.Tensor) else e for e in example]
    return gm, tuple(inputs), {}


def hf_micro_lm(model_class: str, config_class: str, config: dict, *, device="cpu", dtype=torch.float32,
                autocast=False, batch=2, seq=32, **_):
    """(model, {"input_ids", "labels"}, options) of a 2-layer Hugging Face causal LM at micro size
    (hidden 64, 4 heads / 2 key-value heads, vocab 97; random weights), as the zoo builds its HF
    models, `config` overriding those; options' mode "dynamo" as the zoo's HF models."""
    transformers = pytest.importorskip("transformers")
    from kforge.zoo._build import hf_causal_lm

    cfg = getattr(transformers, config_class)(**{
        **dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=seq, use_cache=False, attn_implementation="sdpa",
               tie_word_embeddings=False, pad_token_id=None), **config})
    torch.manual_seed(0)
    model, inputs, options = hf_causal_lm(getattr(transformers, model_class), cfg, positions=seq, batch=batch,
                                          seq=seq, device=device, dtype=dtype, autocast=autocast, seed=0)
    return model, inputs, {**options, "mode": "dynamo"}


def step_matches_eager(model, inputs, jit, *, rtol: float = 1e-4):
    """One training step of `model(**inputs).loss` under `jit(model)` against eager: the loss within
    1e-5 and every gradient within `rtol` of its largest entry. Returns the compiled model."""
    ref = model(**inputs).loss
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compiled = jit(model)
    loss = compiled(**inputs).loss
    loss.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        if n in want:
            err = (p.grad - want[n]).abs().max().item() / max(want[n].abs().max().item(), 1e-30)
            assert err < rtol, (n, err)
    return compiled
