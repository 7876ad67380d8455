"""`python -m kforge bench models`: training steps of models written the way people write them.

The zoo's models (kforge.zoo: nanoGPT's GPT-2, a plain Llama, Hugging Face's LlamaForCausalLM) and
anyone's `--model package.module:factory`, each in one or more set-ups (bf16 weights; fp32 weights
under `torch.autocast(bfloat16)`; fp32), on each backend:

  eager          the model as written
  torch.compile  `torch.compile(model)` (`mode="reduce-overhead"` with --cudagraphs)
  thunder        `thunder.jit(model)` with Thunder's defaults; `thunder.dynamo.thunderfx(model)` for
                 models on the Dynamo path (factory option mode="dynamo", e.g. hf-llama)
  kforge         `kforge.jit(model)`; `kforge.compile(model)` on the Dynamo path (with --cudagraphs:
                 `cudagraphs=True`, kforge.cudagraphs' runner; thunder gets
                 `transforms=[thunder.transforms.cudagraph.CUDAGraphTransform()]`)
  kforge+gemm    kforge with `gemm=True` / `gemm=False` (matrix products on kforge's cuBLASLt plans,
  kforge-gemm    kforge.ops.gemm, on by default): an A/B of that switch in one run
  kforge+group   kforge with the opt-in linear_group pattern (q / k / v projections as one GEMM,
                 kforge.ops.linear_group): an A/B of that pattern
  kforge+tune    kforge with GEMM tuning on / off (kforge.ops.gemm.set_tune; KFORGE_GEMM_TUNE, on by
  kforge-tune    default): each of their steps switches it, the other kforge rows' steps set it as the
                 environment does: an A/B of tuning in one run
  kforge+cefused kforge with KFORGE_CE_FUSED=1 while it traces: cross-entropy's gradient written by
                 the forward kernel and scaled in the backward (kforge.ops.cross_entropy), an A/B of
                 that path against the kforge row

Per row: median ms of CUDA-event-timed full steps (forward, backward, fused AdamW) with their 10th and
90th percentiles, peak memory over a few steps taken alone, the first step's wall time (trace + compile + one step; by default every row starts
from empty kforge / Inductor / Triton disk caches), the final loss, and the error text of a backend
that fails (the run goes on); kforge rows also count the first step's GEMM calls that took a plan
and those that fell back to ATen (`gemm_calls`), tuned kforge rows each tuned shape's candidates'
times and choice (`gemm_tuning`). --second-process times the first step of kforge and
torch.compile again in a fresh process that finds the row's disk caches warm.

The backends of one (model, set-up) are built and warmed up one after the other, stay alive together,
and their timed steps alternate in blocks (`interleave`): the GPU machine's host speed drifts from
minute to minute, and most of these steps are close to host-bound, so rows timed one after the other
compare different hosts. --sequential times each row alone.

The factory contract is `python -m kforge tieout --model`'s: a callable taking whichever of size,
batch, seq, device, dtype, autocast and seed its signature names, returning (model, inputs) or
(model, inputs, options); options may hold "loss_fn" (output -> scalar loss), "autocast" (the dtype
to run the step under torch.autocast, or None) and "mode" ("jit" or "dynamo").
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import inspect as pyinspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable

BACKENDS = ("eager", "torch.compile", "thunder", "kforge", "kforge+gemm", "kforge-gemm", "kforge+group", "kforge+tune",
            "kforge-tune", "kforge+cefused")
# Environment a backend's trace is made under (read by the grad transforms while the first step traces).
TRACE_ENV = {"kforge+cefused": {"KFORGE_CE_FUSED": "1"}}
DEFAULT_BACKENDS = ("eager", "torch.compile", "thunder", "kforge")  # the A/B rows: asked for by name
SETUPS = ("bf16", "autocast", "fp32")
# Default --size per zoo model: the sizes of issue 18's table.
DEFAULT_SIZE = {"nanogpt": "124M", "plain-llama": "bench", "hf-llama": "bench", "hf-gpt2": "124M",
                "hf-mixtral": "bench"}
# --dry builds every model at this size on the CPU.
DRY_SIZE = "micro"
OPTION_KEYS = {"loss_fn", "autocast", "mode"}
# Timed steps of each backend are taken in this many alternating blocks (see `interleave`).
ROUNDS = 5
# Steps whose peak memory a row reports when its backends are timed interleaved (taken alone, right
# after the warm-up).
PEAK_STEPS = 3
# The llm.c notebook's small case (--preset small).
PRESETS: dict[str, dict[str, Any]] = {
    "small": dict(models=["nanogpt"], size="124M", batch=4, seq=64, setup="fp32", cudagraphs=True),
}


class UsageError(ValueError):
    """A `bench models` command line that cannot run (unknown model or backend, bad sizes)."""


class FactoryError(UsageError):
    """A --model factory that breaks the contract (bad spec, wrong return value, unknown option)."""


@dataclass
class ModelCase:
    """One model to benchmark: a zoo name or a factory spec, and the size preset to ask it for."""

    label: str
    spec: str
    size: str | None = None
    dropout: float | None = None  # passed to the factory when set (--dropout)


@dataclass
class Built:
    """A freshly built model with the inputs of one step and how to run it."""

    model: Any
    inputs: Any  # tuple of positional arguments or dict of keyword arguments
    loss_fn: Callable[[Any], Any]
    autocast: Any = None  # torch dtype of the autocast region, or None
    mode: str = "jit"
    extra: dict = field(default_factory=dict)

    def call(self, fn: Callable) -> Any:
        return fn(**self.inputs) if isinstance(self.inputs, dict) else fn(*self.inputs)


# ---- factories -----------------------------------------------------------------------------------
def load_factory(spec: str) -> Callable:
    """`package.module:attr[.attr]` -> the callable it names; FactoryError says what is wrong."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise FactoryError(f"--model must look like package.module:factory, got {spec!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise FactoryError(f"--model {spec}: cannot import {mod_name!r}: {e}") from e
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise FactoryError(f"--model {spec}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise FactoryError(f"--model {spec}: {attr!r} is not callable")
    return obj


def zoo_case(name: str, size: str | None = None) -> ModelCase:
    from ..zoo import MODELS

    if name not in MODELS:
        raise UsageError(f"unknown zoo model {name!r}; choose from {', '.join(MODELS)}")
    return ModelCase(name, MODELS[name], size or DEFAULT_SIZE.get(name))


def to_device(x: Any, device: Any) -> Any:
    """Tensors in `x` (nested tuples / lists / dicts) moved to `device`."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    return x


def default_loss(out: Any) -> Any:
    """The scalar to backpropagate when a factory names no loss_fn: a `loss` attribute or key, the
    output itself when it is a scalar, else the first scalar tensor of a tuple / list output."""
    import torch

    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, dict):
        loss = out.get("loss")
    if loss is None and isinstance(out, torch.Tensor) and out.numel() == 1:
        loss = out
    if loss is None and isinstance(out, (tuple, list)):
        loss = next((o for o in out if isinstance(o, torch.Tensor) and o.numel() == 1), None)
    if loss is None:
        raise FactoryError("cannot find a scalar loss in the model's output; return options "
                           "{'loss_fn': output -> loss} from the factory")
    return loss.reshape(())


def build(case: ModelCase, setup: str, *, batch: int, seq: int, device: Any, seed: int = 0,
          path: str | None = None) -> Built:
    """Call the case's factory for `setup` (bf16 weights; fp32 weights + bf16 autocast; fp32) and
    check what it returns. Factories that take no device / dtype get their model moved / cast here."""
    import torch

    if setup not in SETUPS:
        raise UsageError(f"unknown set-up {setup!r}; choose from {', '.join(SETUPS)}")
    factory = load_factory(case.spec)
    device = torch.device(device)
    weights = torch.bfloat16 if setup == "bf16" else torch.float32
    amp = torch.bfloat16 if setup == "autocast" else None
    params = pyinspect.signature(factory).parameters
    takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
    takes_autocast = takes_all or "autocast" in params
    offered: dict[str, Any] = dict(batch=batch, seq=seq, device=device, seed=seed)
    # A factory that knows about autocast gets the compute dtype and autocast=True, as the zoo's do;
    # one that does not gets the weights' dtype and the bench opens the autocast region itself.
    if takes_autocast:
        offered.update(dtype=amp or weights, autocast=amp is not None)
    else:
        offered["dtype"] = weights
    if case.size is not None:
        offered["size"] = case.size
    if case.dropout is not None:
        if not (takes_all or "dropout" in params):
            raise FactoryError(f"{case.label}: the factory takes no dropout (--dropout {case.dropout:g})")
        offered["dropout"] = case.dropout
    kw = {k: v for k, v in offered.items() if takes_all or k in params}
    out = factory(**kw)
    if not (isinstance(out, tuple) and len(out) in (2, 3)):
        raise FactoryError(f"--model {case.spec}: the factory must return (model, inputs) or "
                           f"(model, inputs, options), got {type(out).__name__}")
    model, inputs, options = out[0], out[1], (out[2] if len(out) == 3 else {})
    if not isinstance(model, torch.nn.Module):
        raise FactoryError(f"--model {case.spec}: the factory returned {type(model).__name__}, not an nn.Module")
    if not isinstance(options, dict) or set(options) - OPTION_KEYS:
        raise FactoryError(f"--model {case.spec}: options must be a dict with keys among "
                           f"{', '.join(sorted(OPTION_KEYS))}, got {options!r}")
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if isinstance(inputs, list):
        inputs = tuple(inputs)
    if not isinstance(inputs, (tuple, dict)):
        raise FactoryError(f"--model {case.spec}: inputs must be a tensor, a tuple or a dict, "
                           f"got {type(inputs).__name__}")
    if "device" not in kw:
        model, inputs = model.to(device), to_device(inputs, device)
    if "dtype" not in kw:
        model = model.to(dtype=weights)
    mode = path or options.get("mode", "jit")  # --path overrides the factory's choice
    if mode not in ("jit", "dynamo"):
        raise FactoryError(f"--model {case.spec}: mode must be 'jit' or 'dynamo', got {mode!r}")
    autocast = options["autocast"] if "autocast" in options else amp
    return Built(model, inputs, options.get("loss_fn") or default_loss, autocast, mode)


# ---- backends ------------------------------------------------------------------------------------
def cudagraph_transform() -> Any:
    """Thunder 0.2.6's CUDA-graph transform (thunder/transforms/cudagraph.py)."""
    from thunder.transforms.cudagraph import CUDAGraphTransform

    return CUDAGraphTransform()


def wrap(backend: str, model: Any, mode: str = "jit", *, cudagraphs: bool = False) -> Any:
    """The callable that runs `model` on `backend` (see the module docstring)."""
    import torch

    if backend == "eager":
        return model
    if backend == "torch.compile":
        return torch.compile(model, mode="reduce-overhead") if cudagraphs else torch.compile(model)
    extra = {"transforms": [cudagraph_transform()]} if cudagraphs else {}
    if backend == "thunder":
        if mode == "dynamo":
            from thunder.dynamo import thunderfx

            return thunderfx(model, **extra)
        import thunder

        return thunder.jit(model, **extra)
    if backend in ("kforge", "kforge+gemm", "kforge-gemm", "kforge+group", "kforge+tune", "kforge-tune",
                   "kforge+cefused"):
        import kforge
        from kforge.transforms import ALL_KINDS, OPT_IN_KINDS

        # kforge's runner (kforge.cudagraphs): Thunder's transform, gradients handed out without a copy.
        # kforge±gemm: GEMMs on kforge's cuBLASLt plans (kforge.ops.gemm) or on torch's, for A/B in one run;
        # kforge+group: the opt-in linear_group pattern added to the default kinds.
        gemm = {"kforge+gemm": True, "kforge-gemm": False}.get(backend)
        kinds = ALL_KINDS + OPT_IN_KINDS if backend == "kforge+group" else ALL_KINDS
        return (kforge.compile(model, cudagraphs=cudagraphs, gemm=gemm, kinds=kinds) if mode == "dynamo"
                else kforge.jit(model, cudagraphs=cudagraphs, gemm=gemm, kinds=kinds))
    raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def path_of(backend: str, mode: str) -> str | None:
    """How Thunder reached the model: "jit" (thunder.jit) or "dynamo" (Thunder's Dynamo path);
    None for eager and torch.compile."""
    if backend in ("eager", "torch.compile"):
        return None
    return "dynamo" if mode == "dynamo" else "jit"


def _gemm_calls() -> dict[str, int]:
    """{"plan": calls on kforge's cuBLASLt plans, "aten": calls that fell back} since the process started."""
    from kforge.ops import gemm

    st = gemm.stats()
    return {"plan": st["fast_calls"], "aten": st["aten_calls"]}


# ---- caches --------------------------------------------------------------------------------------
def cold_caches(root: str, key: str, *, drop_memory: bool = True) -> dict[str, str]:
    """Point kforge's, Inductor's and Triton's disk caches at fresh directories under root/key and
    (drop_memory) drop the in-memory compile state: Dynamo's, Inductor's, kforge's kernel cache, fusion
    regions and the once-per-process background compile of kforge's kernel sources, so the next first step compiles from nothing. drop_memory=False leaves compiled
    models that are still to be timed intact. Returns the environment that gives a second process the
    same (then warm) directories."""
    import torch

    base = os.path.join(root, key)
    env = {"KFORGE_CACHE_DIR": os.path.join(base, "kforge"),
           "TORCHINDUCTOR_CACHE_DIR": os.path.join(base, "inductor"),
           "TRITON_CACHE_DIR": os.path.join(base, "triton")}
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    os.environ.update(env)  # Inductor and Triton read these at each compile
    import kforge

    if drop_memory:
        torch._dynamo.reset()
        with contextlib.suppress(Exception):
            from torch._inductor.utils import clear_caches

            clear_caches()
        kforge._C.clear_memory_cache()
        from kforge import frontend
        from kforge.fusion import executor as fusion_executor

        fusion_executor.forget_regions()
        frontend.forget_background_compiles()
    kforge._C.set_cache(env["KFORGE_CACHE_DIR"], True)
    return env


def _nvrtc_compiles() -> int | None:
    try:
        import kforge

        return int(kforge.cache_info()["nvrtc_compiles"])
    except Exception:  # no extension: nothing to count
        return None


# ---- one row -------------------------------------------------------------------------------------
def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def first_step_phases(fn: Any) -> dict[str, float]:
    """Where a thunder.jit function's first call went, from Thunder's compile statistics (seconds):
    `first_trace_s` the interpreter running the model's Python (acquiring the initial trace);
    `first_transforms_s` from there to the forward's first run (the transforms, fusion passes,
    autodiff, prologue); `first_forward_s` that run (kernels compiled or loaded on first launch).
    The rest of `first_s` is wrapping, the backward's and the optimizer's first runs. Empty for
    anything that is not a thunder.jit function (eager, torch.compile, the Dynamo path)."""
    try:
        import thunder

        cs = thunder.compile_stats(fn)
        t0, t1 = cs.last_trace_tracing_start, cs.last_trace_tracing_stop
        e0, e1 = cs.last_trace_host_execution_start, cs.last_trace_host_execution_stop
    except Exception:  # not a Thunder-compiled function
        return {}
    if cs is None or cs.cache_misses != 1 or min(t0, t1, e0, e1) < 0 or not t0 <= t1 <= e0 <= e1:
        return {}
    return {"first_trace_s": (t1 - t0) / 1e9, "first_transforms_s": (e0 - t1) / 1e9,
            "first_forward_s": (e1 - e0) / 1e9}


@contextlib.contextmanager
def _environ(env: dict[str, str]):
    """os.environ updated with `env` inside, restored after."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Trainer:
    """One backend's wrapped model with its fused AdamW, ready to take training steps.

    `start()` wraps the model and takes the first step (wall time: trace + compile + one step) and the
    untimed warm-up steps; `timed(n)` then takes n steps timed each with CUDA events. Several trainers
    can be alive at once, so that `bench models` can alternate between them (see `interleave`)."""

    def __init__(self, built: Built, backend: str, *, cudagraphs: bool = False) -> None:
        import torch

        self.built, self.backend = built, backend
        params = [p for p in built.model.parameters() if p.requires_grad]
        self.device = params[0].device if params else torch.device("cpu")
        self.opt = torch.optim.AdamW(params, lr=1e-4, fused=self.device.type == "cuda")
        self.autocast = (torch.autocast(self.device.type, dtype=built.autocast) if built.autocast is not None
                         else contextlib.nullcontext())
        self.cudagraphs = cudagraphs
        self.mark_step = cudagraphs and backend == "torch.compile"
        # GEMM tuning is a process-wide switch (tuned and untuned plans are kept apart): each kforge
        # step sets it: on for kforge+tune, off for kforge-tune, as the environment says for the others.
        self.tune: bool | None = None
        if backend.startswith("kforge"):
            from kforge import _env

            self.tune = {"kforge+tune": True, "kforge-tune": False}.get(backend, _env.flag("KFORGE_GEMM_TUNE"))
        self.fn: Any = None
        self.times: list[float] = []
        self.losses: list[float] = []

    def step(self) -> Any:
        import torch

        if self.mark_step:  # a new iteration for CUDA-graph trees: earlier outputs may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        if self.tune is not None:
            from kforge.ops import gemm

            gemm.set_tune(self.tune)
        with self.autocast:
            loss = self.built.loss_fn(self.built.call(self.fn))
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def start(self, warmup: int) -> dict[str, Any]:
        """Wrap, first step (timed on the wall clock), then `warmup - 1` untimed steps."""
        row: dict[str, Any] = {}
        compiles0 = _nvrtc_compiles()
        gemm0 = _gemm_calls() if self.backend.startswith("kforge") else None
        _sync(self.device)
        with _environ(TRACE_ENV.get(self.backend, {})):
            t0 = time.perf_counter()
            self.fn = wrap(self.backend, self.built.model, self.built.mode, cudagraphs=self.cudagraphs)
            loss = self.step().float().item()  # .item() waits for the step
            row["first_s"] = time.perf_counter() - t0
        row.update(first_step_phases(self.fn))
        if gemm0 is not None:  # the first step's GEMM calls: on a plan, or fallen back to ATen
            row["gemm_calls"] = {k: v - gemm0[k] for k, v in _gemm_calls().items()}
        if self.tune:  # each tuned shape's candidates' times and the kernel kept (kforge.ops.gemm)
            from kforge.ops import gemm

            row["gemm_tuning"] = gemm.tuning()
        compiles1 = _nvrtc_compiles()
        if self.backend.startswith("kforge") and compiles0 is not None and compiles1 is not None:
            row["nvrtc_compiles"] = compiles1 - compiles0
        row["first_loss"] = loss
        for _ in range(max(warmup - 1, 0)):
            self.step()
        _sync(self.device)
        return row

    def timed(self, n: int) -> list[float]:
        """n steps, each timed with CUDA events and waited for (ms); appended to `self.times`."""
        import torch

        out = []
        for _ in range(n):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            loss_t = self.step()
            e.record()
            e.synchronize()
            out.append(s.elapsed_time(e))
            # Read before the next step: a CUDA-graph output is overwritten by the next replay.
            self.losses.append(loss_t.float().item())
        self.times += out
        return out

    def peak_gib(self, n: int, others: int, others_reserved: int | None = None) -> float:
        """Peak memory of n timed steps, less `others` bytes: what the other live trainers held when
        this one was built (they are idle meanwhile, so it stays constant). With `others_reserved`
        (CUDA-graph rows: what the others had reserved, cache emptied), at least what this trainer
        keeps reserved once the allocator's cache is emptied: a replay allocates nothing, so its
        activations live in the graphs' private pools, which `max_memory_allocated` does not see."""
        import torch

        _sync(self.device)
        torch.cuda.reset_peak_memory_stats()
        self.timed(n)
        peak = torch.cuda.max_memory_allocated() - others
        if others_reserved is not None:
            torch.cuda.empty_cache()  # frees cached blocks, not the private pools of live graphs
            peak = max(peak, torch.cuda.memory_reserved() - others_reserved)
        return peak / 2**30

    def summary(self) -> dict[str, Any]:
        t = self.times
        q = statistics.quantiles(t, n=10, method="inclusive") if len(t) >= 2 else [t[0]] * 9
        return dict(ms=statistics.median(t), ms_min=min(t), ms_p10=q[0], ms_p90=q[-1], timed_steps=len(t),
                    final_loss=self.losses[-1])


def train_row(built: Built, backend: str, *, steps: int, warmup: int, cudagraphs: bool = False,
              timed: bool = True, first_only: bool = False) -> dict[str, Any]:
    """Wrap `built.model` for `backend` and train it alone: the first step (wrap + trace + compile +
    one step, wall time), `warmup - 1` more untimed steps, then `steps` steps timed each with CUDA
    events (median ms/step; peak memory over them). `timed=False` (the CPU dry run) stops after two
    steps, `first_only` after the first."""
    import torch

    tr = Trainer(built, backend, cudagraphs=cudagraphs)
    row = tr.start(0 if first_only else (1 if not timed else warmup))
    if first_only:
        return row
    if not timed:
        row["final_loss"] = tr.step().float().item()
        return row
    torch.cuda.reset_peak_memory_stats()
    tr.timed(steps)
    row.update(tr.summary(), peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    return row


def interleave(trainers: list[Trainer], steps: int, rounds: int) -> list[str | None]:
    """Time `steps` steps of every trainer in `rounds` alternating blocks (A B C, C B A, A B C ...), so
    that a drift in the host's speed (other processes on the machine, clocks) falls on every backend
    alike instead of on whichever row ran while it lasted. Returns each trainer's error text (None:
    it ran); a trainer that fails is not stepped again."""
    rounds = max(1, min(rounds, steps))
    per = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
    errors: list[str | None] = [None] * len(trainers)
    for r, n in enumerate(per):
        order = list(range(len(trainers)))
        for i in (order if r % 2 == 0 else order[::-1]):  # no backend always right after another
            if errors[i] is None:
                try:
                    trainers[i].timed(n)
                except Exception as e:
                    errors[i] = _error(e)
    return errors


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:400]


def second_process(case: ModelCase, setup: str, backend: str, *, batch: int, seq: int, device: str,
                   cudagraphs: bool, env: dict[str, str], timeout: float = 1800,
                   path: str | None = None) -> dict[str, Any]:
    """The first step of `backend` again, in a fresh Python process with the row's cache directories
    (`env`): what a second training run pays when the disk caches are warm."""
    spec = dict(label=case.label, spec=case.spec, size=case.size, dropout=case.dropout, setup=setup,
                backend=backend, batch=batch, seq=seq, device=device, cudagraphs=cudagraphs, path=path)
    child_env = dict(os.environ, **env)
    # The child imports the factory as this process did: same sys.path.
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:
        r = subprocess.run([sys.executable, "-m", "kforge.bench.models", "--child", json.dumps(spec)],
                           capture_output=True, text=True, env=child_env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error_2nd": f"second process: timed out after {timeout:.0f} s"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("{"):
            out = json.loads(line)
            res = {f"{k}_2nd": v for k, v in out.items() if k.startswith("first_")}
            res["nvrtc_compiles_2nd"] = out.get("nvrtc_compiles")
            res["traces_restored_2nd"] = out.get("traces_restored")
            res["traced_2nd"] = out.get("traced")
            if out.get("error"):
                res["error_2nd"] = out["error"]
            return {k: v for k, v in res.items() if v is not None}
    return {"error_2nd": f"second process: exit status {r.returncode}: {(r.stderr or r.stdout)[-300:]}"}


def _child(spec_json: str) -> int:
    """Entry point of the second process: build, first step, print one JSON line."""
    import warnings

    warnings.filterwarnings("ignore", message="transformer_engine module not found")
    spec = json.loads(spec_json)
    case = ModelCase(spec["label"], spec["spec"], spec["size"], spec.get("dropout"))
    res: dict[str, Any] = {}
    try:
        built = build(case, spec["setup"], batch=spec["batch"], seq=spec["seq"], device=spec["device"],
                      path=spec.get("path"))
        row = train_row(built, spec["backend"], steps=0, warmup=1, cudagraphs=spec["cudagraphs"],
                        first_only=True)
        # first_loss too: the same seed gives the first process's loss (a restored program included)
        res = {k: v for k, v in row.items() if k.startswith("first_")}
        res["nvrtc_compiles"] = row.get("nvrtc_compiles")
        if "kforge.trace_cache" in sys.modules:
            stats = sys.modules["kforge.trace_cache"].stats()
            # traced: Thunder traced anyway (a restored entry its prologue rejected, or none stored)
            res["traces_restored"], res["traced"] = stats["restored"], stats["traced"]
    except Exception as e:  # reported by the parent in the row
        res = {"error": _error(e)}
    print(json.dumps(res))
    return 0


# ---- the run -------------------------------------------------------------------------------------
@dataclass
class ModelsConfig:
    """Everything `bench models` was asked to do, after the preset and defaults are applied."""

    cases: list[ModelCase]
    setups: list[str]
    backends: list[str]
    batch: int = 8
    seq: int = 1024
    steps: int = 10
    warmup: int = 3
    cudagraphs: bool = False
    path: str | None = None
    second_process: bool = False
    trace_cache: bool = True
    dry: bool = False
    cold: bool = True
    preset: str | None = None
    sequential: bool = False
    rounds: int = ROUNDS


def resolve(args: Any) -> ModelsConfig:
    """Combine the command line with --preset: options given explicitly win over the preset, the
    preset over the defaults. --dry builds every zoo model at its micro size on the CPU."""
    preset = PRESETS[args.preset] if getattr(args, "preset", None) else {}

    def pick(name: str, default: Any) -> Any:
        v = getattr(args, name, None)
        return v if v is not None else preset.get(name, default)

    names = list(args.names or [])
    from_preset = not names and not args.model_specs
    if from_preset:
        names = preset.get("models", ["nanogpt", "plain-llama", "hf-llama"])
    # --size applies to every model; a preset's size only to the preset's own models; --dry
    # builds the zoo's models at their micro size unless --size says otherwise.
    size = args.size
    zoo_size = size or (DRY_SIZE if args.dry else (preset.get("size") if from_preset else None))
    cases = [zoo_case(n, zoo_size) for n in names]
    for spec in args.model_specs or []:
        load_factory(spec)  # fail on a bad spec before anything runs
        cases.append(ModelCase(spec, spec, size))
    dropout = getattr(args, "dropout", None)
    if dropout is not None:
        if not 0.0 <= dropout < 1.0:
            raise UsageError(f"--dropout must be in [0, 1), got {dropout}")
        for case in cases:
            case.dropout = dropout
    setup = pick("setup", "both")
    setups = {"both": ["bf16", "autocast"], "all": list(SETUPS)}.get(setup, [setup])
    backends = [b.strip() for b in (args.backends or ",".join(DEFAULT_BACKENDS)).split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise UsageError(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    dry = bool(args.dry)
    sizes = dict(batch=pick("batch", 2 if dry else 8), seq=pick("seq", 16 if dry else 1024),
                 steps=pick("steps", 10), warmup=pick("warmup", 3))
    for k, v in sizes.items():
        if v < 1:
            raise UsageError(f"--{k} must be at least 1, got {v}")
    return ModelsConfig(
        cases=cases, setups=setups, backends=backends, **sizes,
        cudagraphs=bool(args.cudagraphs or preset.get("cudagraphs", False)),
        path=getattr(args, "path", None), second_process=bool(args.second_process), dry=dry, cold=not args.warm_caches,
        trace_cache=bool(getattr(args, "trace_cache", True)),
        preset=getattr(args, "preset", None), sequential=bool(getattr(args, "sequential", False)))


def bench_models(cfg: ModelsConfig, *, progress: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """Run every (model, set-up, backend) of `cfg`; returns the run's rows ("kind": "models").
    Each row builds the model afresh from its factory; a backend that fails leaves its error in its
    row and the run continues. By default the backends of one (model, set-up) are timed interleaved
    (`interleave`); `cfg.sequential` times each row alone, one after the other."""
    import torch
    from tqdm import tqdm

    device = "cpu" if cfg.dry else "cuda"
    if not cfg.dry and not torch.cuda.is_available():
        raise RuntimeError("bench models needs a CUDA GPU (--dry builds and steps every model on the CPU)")
    cudagraphs = cfg.cudagraphs
    if cfg.dry and cudagraphs:
        cudagraph_transform()  # the import path is checked; capturing graphs needs a GPU
        cudagraphs = False
        if log:
            log("--dry: CUDA graphs need a GPU; the rows run without them")
    # read by kforge.jit here and in the second processes; a dry run has no row cache directories
    os.environ["KFORGE_TRACE_CACHE"] = "1" if cfg.trace_cache and not cfg.dry else "0"
    cache_root = tempfile.mkdtemp(prefix="kforge-bench-") if cfg.cold and not cfg.dry else None
    bar = tqdm(total=len(cfg.cases) * len(cfg.setups) * len(cfg.backends), desc="models", unit="row",
               disable=not progress, leave=False)
    rows: list[dict[str, Any]] = []
    for case in cfg.cases:
        for setup in cfg.setups:
            group = _bench_group(case, setup, cfg, device=device, cudagraphs=cudagraphs, cache_root=cache_root,
                                 first_index=len(rows), log=log, bar=bar)
            rows += group
    bar.close()
    if cache_root:
        shutil.rmtree(cache_root, ignore_errors=True)  # compiled artefacts of every row: up to GBs
    return {"kind": "models", "dry": cfg.dry, "rows": rows,
            "config": dict(setups=cfg.setups, backends=cfg.backends, batch=cfg.batch, seq=cfg.seq,
                           steps=cfg.steps, warmup=cfg.warmup, cudagraphs=cfg.cudagraphs, path=cfg.path,
                           second_process=cfg.second_process, cold_caches=cfg.cold, preset=cfg.preset,
                           trace_cache=cfg.trace_cache,
                           timing="sequential" if cfg.sequential or cfg.dry else f"interleaved x{cfg.rounds}")}


def _bench_group(case: ModelCase, setup: str, cfg: ModelsConfig, *, device: str, cudagraphs: bool,
                 cache_root: str | None, first_index: int, log: Callable[[str], None] | None,
                 bar: Any) -> list[dict[str, Any]]:
    """The rows of one (model, set-up): every backend built, first-stepped and warmed up in turn
    (from cold caches), then timed, interleaved unless sequential; then the second processes."""
    import torch

    interleaved = not cfg.sequential and not cfg.dry
    rows: list[dict[str, Any]] = []
    live: list[tuple[dict[str, Any], Trainer]] = []
    envs: list[dict[str, str]] = []

    def drop(tr: Trainer | None) -> None:
        if tr is not None:
            tr.built = tr.fn = tr.opt = None  # type: ignore[assignment]
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    for backend in cfg.backends:
        row: dict[str, Any] = dict(model=case.label, size=case.size, setup=setup, backend=backend,
                                   cudagraphs=cudagraphs and backend != "eager", batch=cfg.batch, seq=cfg.seq)
        if case.dropout is not None:
            row["dropout"] = case.dropout
        if row["cudagraphs"] and backend.startswith("kforge"):
            row["graph_runner"] = "kforge.cudagraphs"  # earlier records: Thunder's CUDAGraphTransform
        env: dict[str, str] = {}
        tr: Trainer | None = None
        try:
            if cache_root:
                # Compiled models still to be timed keep their in-memory state; a group starts from none.
                env = cold_caches(cache_root, f"{first_index + len(rows):03d}", drop_memory=not live)
            # What the idle trainers of this group hold, counted out of this row's peak.
            others = torch.cuda.memory_allocated() if not cfg.dry else 0
            others_reserved = None
            if row["cudagraphs"] and not cfg.dry:
                torch.cuda.empty_cache()
                others_reserved = torch.cuda.memory_reserved()
                row["peak_counts_graph_pools"] = True  # records before this field: allocated bytes only
            torch.manual_seed(0)
            built = build(case, setup, batch=cfg.batch, seq=cfg.seq, device=device, path=cfg.path)
            if path_of(backend, built.mode):
                row["path"] = path_of(backend, built.mode)
            if isinstance(built.inputs, dict):
                shapes = [tuple(v.shape) for v in built.inputs.values() if isinstance(v, torch.Tensor)]
            else:
                shapes = [tuple(v.shape) for v in built.inputs if isinstance(v, torch.Tensor)]
            if shapes and len(shapes[0]) == 2:  # (B, T) token ids: the sequence the factory clipped to
                row["batch"], row["seq"] = shapes[0]
            if cfg.dry:
                row.update(train_row(built, backend, steps=cfg.steps, warmup=cfg.warmup,
                                     cudagraphs=row["cudagraphs"], timed=False))
            else:
                tr = Trainer(built, backend, cudagraphs=row["cudagraphs"])
                built = None
                row.update(tr.start(cfg.warmup))
                if interleaved:
                    row["peak_gib"] = tr.peak_gib(PEAK_STEPS, others, others_reserved)
                    tr.times.clear()
                    live.append((row, tr))
                    tr = None
                else:
                    row["peak_gib"] = tr.peak_gib(cfg.steps, others, others_reserved)
                    row.update(tr.summary())
        except Exception as e:  # one failing backend must not stop the run
            row["error"] = _error(e)
        finally:
            built = None  # noqa: F841 - drop the model before the next row allocates
            drop(tr)
        if not interleaved:
            torch._dynamo.reset()  # compiled code holds the row's model
            _finish_row(row, case, setup, cfg, device=device, env=env, log=log)
        rows.append(row)
        envs.append(env)
        bar.update(1)
    if interleaved:
        trainers = [t for _, t in live]
        errors = interleave(trainers, cfg.steps, cfg.rounds)
        for (row, tr), err in zip(live, errors):
            if err is not None:
                row["error"] = err
            elif tr.times:
                row.update(tr.summary())
        for _, tr in live:
            drop(tr)
        live.clear()
        torch._dynamo.reset()
        gc.collect()
        for row, env in zip(rows, envs):
            _finish_row(row, case, setup, cfg, device=device, env=env, log=log)
    return rows


def _finish_row(row: dict[str, Any], case: ModelCase, setup: str, cfg: ModelsConfig, *, device: str,
                env: dict[str, str], log: Callable[[str], None] | None) -> None:
    """The row's second process (when asked for) and its log line."""
    if cfg.second_process and row["backend"] in ("kforge", "torch.compile") and "error" not in row and not cfg.dry:
        row.update(second_process(case, setup, row["backend"], batch=cfg.batch, seq=cfg.seq, device=device,
                                  cudagraphs=row["cudagraphs"], env=env, path=cfg.path))
    if log:
        log(_row_line(row))


def _row_line(r: dict[str, Any]) -> str:
    what = f"{r['model']} {r['setup']} {backend_label(r)}"
    if r.get("error"):
        return f"{what}: {r['error'][:160]}"
    ms = f"{r['ms']:.2f} ms/step, " if r.get("ms") is not None else ""
    phases = ""
    if r.get("first_trace_s") is not None:
        phases = (f" (trace {r['first_trace_s']:.1f} s, transforms {r['first_transforms_s']:.1f} s, "
                  f"first forward {r['first_forward_s']:.1f} s)")
    return (f"{what}: {ms}first step {r.get('first_s', 0):.1f} s{phases}, "
            f"loss {r.get('final_loss', float('nan')):.4f}")


def backend_label(row: dict[str, Any]) -> str:
    """The backend as the tables name it: with --cudagraphs, torch.compile (reduce-overhead),
    thunder + CUDAGraphTransform and kforge + kforge.cudagraphs (rows recorded before kforge had its
    own runner: kforge + CUDAGraphTransform)."""
    b = row["backend"]
    if not row.get("cudagraphs"):
        return b
    if b == "torch.compile":
        return "torch.compile (reduce-overhead)"
    return f"{b} + {row.get('graph_runner', 'CUDAGraphTransform')}"


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m kforge.bench.models",
                                description="internal: the second process of `bench models --second-process`")
    p.add_argument("--child", required=True, metavar="JSON", help="the row to time: model, set-up, backend, sizes")
    sys.exit(_child(p.parse_args().child))
