"""Thunder's compiled programs on disk, so that a second process skips tracing (on by default for
`kforge.jit`; `kforge.jit(model, trace_cache=False)` or KFORGE_TRACE_CACHE=0 turns it off).

The first call of a `thunder.jit` function runs Thunder's interpreter over the model's Python and
then its transforms: seconds to tens of seconds for a Llama, spent again by every new process. What
that produces is a cache entry (`thunder.CacheEntry`): four Python programs (prologue, computation,
backward, epilogue) printed from the final traces, plus the objects their globals name (torch
functions, executors' implementations, kforge's launchers and fusion kernels). This module writes
each new entry as the programs' source and, per global, a recipe that rebuilds it in another process:

    module              `import name`
    ref                 an object reachable by import: module + qualified name, checked to be the same object
    value               a pickled plain value (numbers, dtypes, devices, builtin functions)
    program             another Thunder-built program (a fusion region run by torch), recursively
    kforge_region       a kforge fusion kernel: its region IR, rebuilt with `region_callable`
    kforge_torch_region a kforge fusion region run by torch: its program
    kforge_zero_aware   a kforge fusion region that accepts absent gradients: its kernel and the
                        region IR for each subset of absent arguments
    cuda_graph          a region of Thunder's CUDAGraphTransform (kforge.jit(cudagraphs=True)): its
                        program and static-input mask, registered in the restoring function's runner
    compiled            the model or function being compiled (the prologue reads its parameters)

An entry with any other kind of global is not written (the reason is logged). In a new process
`attach` rebuilds the entries whose key matches and appends them to Thunder's own cache
(`thunder.compile_stats(fn).interpreter_cache`), so Thunder's lookup runs each restored prologue
first, exactly as for an entry traced in this process: the prologue checks every input's shape,
dtype, device and requires_grad, the module attributes tracing read, and the autocast / grad /
default dtype state; on any difference Thunder traces as usual and the new entry is written too.

What the prologue cannot see is in the key, checked before restoring: the Python, torch, Thunder
and kforge versions, a hash of kforge's own sources, the executors (names, versions) and transforms
(their repr), the compile options, kforge's environment switches, torch's backend flags (TF32, SDPA
backends), the GPU (name, compute capability), and the content hash of every source file whose code
Thunder's interpreter ran while tracing the entry (recorded by wrapping the interpreter's frame
set-up; code compiled from a string, such as a dataclass's generated `__init__`, counts as its
module's file; the frozen stdlib as Python's version). A changed model file, a new kforge,
another GPU: the entry is skipped and the model traced.
An unreadable or corrupt file: one `KforgeCacheWarning`, then tracing; the file is replaced.

Restored entries carry no traces: `thunder.last_traces(fn)` is empty after a restored first call
(`kforge.inspect` says so; jit with `trace_cache=False` to see them). Not covered: `kforge.compile`
(Thunder's Dynamo path traces each of Dynamo's graphs in every process).
"""
from __future__ import annotations

import contextvars
import functools
import hashlib
import importlib
import inspect
import linecache
import logging
import os
import pickle
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from . import _env
from ._runtime import KforgeCacheWarning, cache_dir

__all__ = ["enabled", "disk_usable", "attach", "has_restored", "key_parts", "save_entry", "serialize_program",
           "rebuild_program", "Unserializable", "stats", "traces_dir"]

logger = logging.getLogger("kforge")

# Bumped whenever the file layout or a recipe changes meaning: older files are then skipped.
_FORMAT = 1
# Entries kept per model and key; the oldest beyond this are removed when a new one is written.
_MAX_ENTRIES = 8
# Key directories kept under traces/ (each kforge, torch or Thunder version, model and option set
# makes its own); the least recently written or restored beyond this are removed on a write.
_MAX_KEYS = 32

_stats = {"traced": 0, "restored": 0, "saved": 0, "skipped_stale": 0, "corrupt": 0, "unserializable": 0}
_lock = threading.Lock()
_recording: contextvars.ContextVar[set | None] = contextvars.ContextVar("kforge_trace_files", default=None)
_hooked = False
# Thunder CompileStats objects that hold entries restored from disk (they carry no traces).
_restored_into: "weakref.WeakSet[Any]" = weakref.WeakSet()
_unwritable_warned = False


class Unserializable(Exception):
    """A program global no recipe can rebuild in another process; the message names it."""


def enabled() -> bool:
    """Whether kforge.jit keeps Thunder's compiled programs on disk by default: KFORGE_TRACE_CACHE
    (default on) and KFORGE_DISK_CACHE (kforge's disk cache, default on) both on."""
    return _env.flag("KFORGE_TRACE_CACHE") and disk_usable()


def disk_usable() -> bool:
    """Whether kforge's disk cache is on (KFORGE_DISK_CACHE): the trace cache lives in it."""
    from ._runtime import disk_cache_enabled

    return disk_cache_enabled()


def stats() -> dict[str, int]:
    """Counters since the process started: Thunder traces run (`traced`, counted once `attach` has
    run), entries restored / saved, files skipped as stale or corrupt, entries not writable."""
    with _lock:
        return dict(_stats)


def _count(name: str, n: int = 1) -> None:
    with _lock:
        _stats[name] += n


def has_restored(fn: Any) -> bool:
    """Whether the thunder.jit function `fn` was given entries restored from disk (which have no
    traces: `thunder.last_traces(fn)` is empty after a restored call)."""
    try:
        import thunder

        return thunder.compile_stats(fn) in _restored_into
    except Exception:  # not a Thunder function
        return False


def traces_dir() -> str:
    """Where the entries live: <kforge cache dir>/traces."""
    return os.path.join(cache_dir(), "traces")


# ---- which source files tracing ran ----------------------------------------------------------------
def _install_hooks() -> None:
    """Wrap Thunder's tracing entry (to count traces and collect the files whose code its interpreter
    runs) and the interpreter's frame set-up (to see each interpreted function's file). Once per
    process; the per-frame cost is one ContextVar read, and only while tracing."""
    global _hooked
    with _lock:
        if _hooked:
            return
        _hooked = True
    import thunder
    import thunder.core.interpreter as interp

    run_frame = interp._setup_frame_and_run_python_function

    @functools.wraps(run_frame)
    def setup_frame(compilectx, runtimectx, wrapped_fn, /, *args, **kwargs):
        files = _recording.get()
        if files is not None:
            fn = getattr(wrapped_fn, "value", wrapped_fn)
            code = getattr(fn, "__code__", None)
            if code is not None:
                files.add(_source_file(code.co_filename, fn))
        return run_frame(compilectx, runtimectx, wrapped_fn, *args, **kwargs)

    general_jit = thunder.thunder_general_jit

    @functools.wraps(general_jit)
    def traced(fn, args, kwargs, /, *rest, **options):
        from thunder.core.compile_data import get_compile_data

        _count("traced")
        files: set[str] = set()
        token = _recording.set(files)
        try:
            return general_jit(fn, args, kwargs, *rest, **options)
        finally:
            _recording.reset(token)
            cd = get_compile_data()
            if cd is not None:  # read when the entry this trace becomes is saved
                cd._kforge_traced_files = files

    interp._setup_frame_and_run_python_function = setup_frame
    thunder.thunder_general_jit = traced


_FROZEN = "<frozen "  # the stdlib modules built into the interpreter: sys.version is in the key


def _source_file(filename: str, fn: Any) -> str:
    """The file whose content decides code run from `filename`: itself; for code compiled from a
    string (dataclasses' generated `__init__`, `<string>`), the file of the module whose globals it
    runs in, which holds what it was generated from; "" for the interpreter's frozen stdlib."""
    if filename.startswith(_FROZEN):
        return ""
    if filename.startswith("<") and not linecache.getlines(filename):
        module_file = (getattr(fn, "__globals__", None) or {}).get("__file__")
        if isinstance(module_file, str):
            return module_file
    return filename


@functools.lru_cache(maxsize=4096)
def _file_hash_at(path: str, mtime_ns: int, size: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _file_hash(path: str) -> str | None:
    """sha256 of a source file's bytes; for code whose file is not on disk (a notebook cell), of the
    source linecache holds; None when there is neither."""
    try:
        st = os.stat(path)
    except OSError:
        lines = linecache.getlines(path)
        return hashlib.sha256("".join(lines).encode()).hexdigest() if lines else None
    return _file_hash_at(path, st.st_mtime_ns, st.st_size)


@functools.cache
def _kforge_tree_hash() -> str:
    """One hash over kforge's Python sources and extension: kforge's version string does not change
    with every commit, and kforge's transforms and checkers decide what the traces hold."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "__pycache__")
        for n in sorted(names):
            if n.endswith((".py", ".so")):
                p = os.path.join(d, n)
                h.update(os.path.relpath(p, root).encode() + b"\0" + (_file_hash(p) or "").encode())
    return h.hexdigest()


def _files_of(cd: Any, entry: Any) -> dict[str, str | None]:
    """{path: content hash} of the files whose code tracing ran, plus the compiled model's own file
    and those the first traces name as the origin of their symbols (in case the interpreter hook
    saw nothing, e.g. tracing started before `attach`). Raises Unserializable when one of them has
    no source (code compiled from a string)."""
    files = set(getattr(cd, "_kforge_traced_files", ()) or ()) - {""}
    target = cd.fn
    for obj in (target, type(target)):
        try:
            files.add(inspect.getfile(obj))
        except (TypeError, OSError):
            pass
    for traces in (entry.computation_traces[:1], entry.prologue_traces[:1]):
        for t in traces:
            for b in t.bound_symbols:
                if getattr(b, "source_filename", None):
                    files.add(b.source_filename)
    out = {p: _file_hash(p) for p in sorted(files)}
    unknown = [p for p, h in out.items() if h is None]
    if unknown:  # code that ran without a source to hash: a change to it could not be detected
        raise Unserializable(f"tracing ran code without a source file: {', '.join(unknown)}")
    return out


# ---- the key ---------------------------------------------------------------------------------------
def _describe_transform(t: Any) -> str:
    r = repr(t)
    if " at 0x" in r:  # the default repr: says nothing about the configuration
        raise Unserializable(f"transform {type(t).__qualname__} has no repr that states its configuration")
    return f"{type(t).__module__}.{type(t).__qualname__}: {r}"


def _plain(x: Any) -> bool:
    if isinstance(x, (bool, int, float, str, type(None))):
        return True
    if isinstance(x, (tuple, list)):
        return all(_plain(y) for y in x)
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    return False


def _backend_flags() -> dict[str, Any]:
    """torch switches that change which kernels Thunder's and kforge's checkers choose."""
    import torch

    b = torch.backends
    out: dict[str, Any] = {"float32_matmul_precision": torch.get_float32_matmul_precision(),
                           "cudnn_allow_tf32": b.cudnn.allow_tf32, "cudnn_enabled": b.cudnn.enabled}
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled"):
        fn = getattr(b.cuda, name, None)
        out[name] = fn() if fn is not None else None
    out["matmul_allow_tf32"] = b.cuda.matmul.allow_tf32
    return out


def _device() -> str:
    import torch

    if not torch.cuda.is_available():
        return "no cuda"
    i = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(i)
    return f"{p.name} sm_{p.major}{p.minor} {p.multi_processor_count} SMs, torch cuda {torch.version.cuda}"


def key_parts(fn: Any) -> dict[str, Any]:
    """What, besides the inputs the prologue checks, decides the programs tracing `fn` (a thunder.jit
    function) produces. Raises Unserializable when part of it cannot be stated reproducibly."""
    import thunder
    import torch

    from . import __version__, lookasides

    cd = thunder.compile_data(fn)
    if cd is None:
        raise Unserializable("not a thunder.jit function")
    if str(cd.cache_option) != "CACHE_OPTIONS.CONSTANT_VALUES":
        raise Unserializable(f"cache option {cd.cache_option} (only constant values is supported)")
    if getattr(cd.fn, "use_ddp", False) or getattr(cd.fn, "use_fsdp", False):
        raise Unserializable("distributed (DDP / FSDP) modules")
    if not _plain(cd.compile_options):
        raise Unserializable(f"compile options that are not plain values: {sorted(cd.compile_options)}")
    target = cd.fn
    model = target if isinstance(target, types.FunctionType) else type(target)
    return {
        "format": _FORMAT,
        "python": sys.version,
        "torch": torch.__version__,
        "thunder": getattr(thunder, "__version__", "?"),
        "kforge": __version__,
        "kforge_sources": _kforge_tree_hash(),
        "model": f"{model.__module__}.{model.__qualname__}",
        "executors": [(e.name, str(getattr(e, "version", None))) for e in cd.executors_list
                      if not e.name.startswith("__ad_hoc_executor")],  # Thunder's per-jit executor
        "transforms": [_describe_transform(t) for t in cd.transforms],
        "compile_options": sorted(cd.compile_options.items()),
        "sharp_edges": str(cd.sharp_edges),
        "disable_torch_autograd": bool(cd.disable_torch_autograd_support),
        "debug_options": repr(cd.debug_options),
        "kforge_env": {k: os.environ.get(k, "") for k in sorted(_env.KNOBS) if _env.KNOBS[k].kind == "flag"},
        "kforge_lookasides": lookasides.installed(),
        "backends": _backend_flags(),
        "device": _device(),
    }


def _key_digest(parts: dict[str, Any]) -> str:
    return hashlib.sha256(repr(sorted(parts.items())).encode()).hexdigest()[:32]


# ---- programs ----------------------------------------------------------------------------------------
def _program_of(fn: Callable) -> types.FunctionType:
    """The function Thunder compiled from a trace's source, under its decorators (no_grad,
    no_autocast) and timing wrappers (closures)."""
    stack, seen = [fn], set()
    while stack:
        g = stack.pop()
        if id(g) in seen:
            continue
        seen.add(id(g))
        code = getattr(g, "__code__", None)
        if code is not None and code.co_filename.startswith("thunder.") and code.co_filename in linecache.cache:
            return g
        if getattr(g, "__wrapped__", None) is not None:
            stack.append(g.__wrapped__)
        for cell in getattr(g, "__closure__", None) or ():
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if callable(v):
                stack.append(v)
    raise Unserializable(f"{fn!r} is not a program Thunder built from a trace")


def _source(program: types.FunctionType) -> str:
    return "".join(linecache.cache[program.__code__.co_filename][2])


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _ref(v: Any) -> tuple | None:
    mod = getattr(v, "__module__", None)
    if not isinstance(mod, str):
        return None
    for name in (getattr(v, "__qualname__", None), getattr(v, "__name__", None)):
        if isinstance(name, str) and "<" not in name:
            try:
                if _resolve(mod, name) is v:
                    return ("ref", mod, name)
            except Exception:  # not importable that way: try the next spelling / recipe
                pass
    return None


def _value_ok(v: Any) -> bool:
    """Plain values whose pickle rebuilds an equal object (builtin functions pickle by name)."""
    import enum

    import torch

    from .fusion.executor import _Passthrough
    from .prologue import InputChecks, Unpack

    if _plain(v) or isinstance(v, (torch.dtype, torch.device, torch.memory_format, torch.layout, enum.Enum,
                                   types.BuiltinFunctionType, _Passthrough, InputChecks, Unpack)):
        try:
            pickle.loads(pickle.dumps(v))
            return True
        except Exception:
            return False
    return False


def _kforge_regions(entry: Any) -> dict[int, tuple[Any, int]]:
    """id(fusion kernel) -> (its region IR, device index), from the fusion symbols of the entry's
    forward / backward traces (the symbols that call a GeneratedKernel; later passes copy them
    with their call context)."""
    from . import _C
    from .fusion.executor import _device_of, lower_fusion, regions

    out: dict[int, tuple[Any, int]] = {}
    # The IR each kernel was built for. A final trace's fusion symbol can carry proxies that Thunder
    # relabelled after the fusion pass: under autocast, HF Llama's rotary matmul, which it computes
    # with autocast disabled, reads bf16 there though it runs in fp32 (the kernel checks its inputs'
    # dtypes), so lowering that symbol again fails ("cat of mixed dtypes").
    built = {id(fr.kernel): fr for fr in regions()}

    def walk(bsyms: Iterable[Any]) -> None:
        for b in bsyms:
            if not b.sym.is_fusion:
                continue
            for v in (b._call_ctx or {}).values():
                if isinstance(v, _C.GeneratedKernel) and id(v) not in out:
                    fr = built.get(id(v))
                    out[id(v)] = (fr.ir if fr is not None else lower_fusion(b), _device_of(b) or 0)
            walk(b.subsymbols)  # a CUDA-graph region holds the fusion symbols it captures

    for traces in (entry.computation_traces, entry.backward_traces):
        for t in reversed(traces):
            walk(t.bound_symbols)
    return out


def serialize_program(fn: Callable, compiled: Any = None, regions: dict | None = None,
                      executors: Iterable[Any] = ()) -> dict[str, Any]:
    """{"name", "source", "ctx": {global name: recipe}} for a Thunder-built program `fn` (wrapped or
    not). `compiled`: the model or function being compiled (the prologue's `__function_obj`);
    `regions`: what `_kforge_regions` found; `executors`: the executor list (for operators whose
    implementation has no importable name). Raises Unserializable naming the first global no recipe
    covers."""
    executors = tuple(executors)
    program = _program_of(fn)
    source = _source(program)
    ctx: dict[str, tuple] = {}
    for name, v in program.__globals__.items():
        if name in ("__builtins__", program.__name__, "thunder"):
            continue
        ctx[name] = _recipe(name, v, source, compiled, regions or {}, executors)
    return {"name": program.__name__, "source": source, "ctx": ctx}


def _op_impl(executor: Any, name: str) -> Any:
    """The implementation an executor's operator `name` puts in the programs that call it: the `fn`
    given to `register_operator`, held in the call context its bind hook sets (Thunder 0.2.6 keeps
    it nowhere else)."""
    sym = getattr(executor, "opmap", {}).get(name)
    hook = getattr(sym, "_bind_postprocess", None)
    code = getattr(hook, "__code__", None)
    if code is None or "call_ctx" not in code.co_freevars:
        return None
    call_ctx = hook.__closure__[code.co_freevars.index("call_ctx")].cell_contents
    return (call_ctx or {}).get(name)


def _executor_op(name: str, v: Any, executors: Iterable[Any]) -> tuple | None:
    """("executor_op", executor, name) when `v` is what executor's operator `name` runs (Thunder's
    torch executor registers some operators with lambdas, which have no importable name)."""
    for ex in executors:
        if _op_impl(ex, name) is v:
            return ("executor_op", ex.name, name)
    return None


def _recipe(name: str, v: Any, source: str, compiled: Any, regions: dict, executors: tuple = ()) -> tuple:
    from .fusion.executor import _TorchRegion
    from .fusion.zero_cotangents import ZeroAware

    if name == "__function_obj":
        # Thunder sets it to the trace's function; of the printed programs only the prologue reads it
        if compiled is not None and v is compiled:
            return ("compiled",)
        if "__function_obj" in source:
            raise Unserializable("a program reads __function_obj, which is not the compiled object")
        return ("value", pickle.dumps(None))
    if isinstance(v, types.ModuleType):
        return ("module", v.__name__)
    if id(v) in regions:
        ir, device = regions[id(v)]
        return ("kforge_region", pickle.dumps(ir), device)
    if isinstance(v, ZeroAware):
        return _zero_aware_recipe(v, source, compiled, regions, executors)
    if isinstance(v, _TorchRegion):
        return ("kforge_torch_region", serialize_program(v.program, compiled, regions, executors))
    graph = _graph_call(v)
    if graph is not None:
        runner, fn_name = graph
        program, mask = runner.python_callables[fn_name]
        return ("cuda_graph", serialize_program(program, compiled, regions, executors), mask,
                fn_name in getattr(runner, "alias_names", ()))
    ref = _ref(v)
    if ref is not None:
        return ref
    op = _executor_op(name, v, executors)
    if op is not None:
        return op
    if _value_ok(v):
        return ("value", pickle.dumps(v))
    if isinstance(v, types.FunctionType):
        try:
            return ("program", serialize_program(v, compiled, regions, executors))
        except Unserializable:
            pass
    what = getattr(v, "__qualname__", None) or type(v).__qualname__
    raise Unserializable(f"global {name!r} ({type(v).__module__}.{what}) has no recipe")


def _graph_call(v: Any) -> tuple[Any, str] | None:
    """(runner, region name) when `v` is the callable Thunder's CUDAGraphTransform puts in a program
    for one graphed region (a closure over its runner and the region's name), else None."""
    if not isinstance(v, types.FunctionType) or not v.__closure__:
        return None
    from thunder.transforms.cudagraph import CUDAGraphRunner

    cells = dict(zip(v.__code__.co_freevars, (c.cell_contents for c in v.__closure__)))
    runner, name = cells.get("self"), cells.get("fn_name")
    if isinstance(runner, CUDAGraphRunner) and isinstance(name, str) and name in runner.python_callables:
        return runner, name
    return None


def _graph_runner(fn: Any) -> Any:
    """The CUDA-graph runner of the thunder.jit function `fn`'s CUDAGraphTransform, or None."""
    import thunder
    from thunder.transforms.cudagraph import CUDAGraphTransform

    cd = thunder.compile_data(fn)
    runners = [t.cuda_graph_runner for t in (cd.transforms if cd is not None else ()) or ()
               if isinstance(t, CUDAGraphTransform)]
    return runners[0] if len(runners) == 1 else None


_MAX_ZERO_POSITIONS = 4  # a plan per subset of the arguments that may be absent: 15 at most


def _zero_aware_recipe(v: Any, source: str, compiled: Any, regions: dict, executors: tuple) -> tuple:
    """A fusion region that accepts absent (None) gradients: its kernel, and for every subset of
    the arguments that may be absent the region IR with them as 0 (what it would lower lazily)."""
    import itertools

    from .fusion.executor import _device_index

    if v.bsym is None or len(v.positions) > _MAX_ZERO_POSITIONS:
        raise Unserializable(f"zero-aware region {v.name} with {len(v.positions)} optional arguments")
    inner = _recipe("region", v.fn, source, compiled, regions, executors)
    plans = {}
    for k in range(1, len(v.positions) + 1):
        for absent in itertools.combinations(v.positions, k):
            ir = v.plan(absent)
            plans[absent] = None if ir is None else pickle.dumps(ir)
    return ("kforge_zero_aware", inner, v.positions, v.nargs, pickle.dumps(v.specs), plans,
            _device_index(v.bsym.args, v.bsym.output))


def _rebuild(recipe: tuple, compiled: Any, built_regions: list, runner: Any = None) -> Any:
    kind = recipe[0]
    if kind == "module":
        return importlib.import_module(recipe[1])
    if kind == "ref":
        return _resolve(recipe[1], recipe[2])
    if kind == "value":
        return pickle.loads(recipe[1])
    if kind == "compiled":
        return compiled
    if kind == "executor_op":
        from thunder.extend import get_executor

        ex = get_executor(recipe[1])
        impl = None if ex is None else _op_impl(ex, recipe[2])
        if impl is None:
            raise LookupError(f"executor {recipe[1]!r} has no operator {recipe[2]!r} in this process")
        return impl
    if kind == "program":
        return rebuild_program(recipe[1], compiled, built_regions, runner)
    if kind == "kforge_region":
        from .fusion.executor import region_callable

        fn, fr, _ = region_callable(pickle.loads(recipe[1]), recipe[2])
        if fr is not None:
            built_regions.append((fr, recipe[2]))
        return fn
    if kind == "kforge_zero_aware":
        from .fusion.executor import region_callable
        from .fusion.zero_cotangents import ZeroAware

        _, inner, positions, nargs, specs, plans, device = recipe
        za = ZeroAware(_rebuild(inner, compiled, built_regions, runner), None, positions)
        za.nargs, za.specs = nargs, pickle.loads(specs)
        for absent, ir in plans.items():
            za._variants[absent] = (za._materializing(absent) if ir is None
                                    else region_callable(pickle.loads(ir), device)[0])
        return za
    if kind == "kforge_torch_region":
        from .fusion.executor import _TorchRegion

        return _TorchRegion(rebuild_program(recipe[1], compiled, built_regions, runner))
    if kind == "cuda_graph":
        if runner is None:
            raise LookupError("the entry has CUDA-graph regions, the function no CUDAGraphTransform")
        _, program, mask, alias = recipe
        # A fresh name in this runner: its own traces (other shapes) number their regions from the
        # same counter, and the program reaches the region through its own global, not this name.
        name = f"CUDAGraph{runner.name_counter}"
        runner.name_counter += 1
        runner.python_callables[name] = (rebuild_program(program, compiled, built_regions, runner), mask)
        if alias and hasattr(runner, "alias_names"):
            runner.alias_names.add(name)

        def graphed(*args: Any) -> Any:
            return runner.call_cuda_graph(name, *args)

        graphed.__name__ = graphed.__qualname__ = f"{name}_fn"
        return graphed
    raise ValueError(f"unknown recipe kind {kind!r}")


_restored_counter = 0


def rebuild_program(record: dict[str, Any], compiled: Any = None, built_regions: list | None = None,
                    runner: Any = None) -> Callable:
    """The program `serialize_program` described, compiled from its source with its globals rebuilt.
    `built_regions` collects the (FusedRegion, device) of kforge fusion kernels made on the way;
    `runner`: the CUDA-graph runner that replays graphed regions (their programs are registered in it)."""
    global _restored_counter
    import thunder

    built_regions = [] if built_regions is None else built_regions
    ctx = {name: _rebuild(r, compiled, built_regions, runner) for name, r in record["ctx"].items()}
    ctx["thunder"] = thunder
    with _lock:
        _restored_counter += 1
        filename = f"thunder.{record['name']}_restored_{_restored_counter}"
    source = record["source"]
    # registered like Thunder's own programs, so that tracebacks (and _program_of) find the source
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), ctx)
    fn = ctx[record["name"]]
    if "prologue" in record["name"]:
        del ctx[record["name"]]  # as Thunder does: the prologue's globals hold the module, not itself
    return fn


# ---- entries -----------------------------------------------------------------------------------------
def save_entry(fn: Any, entry: Any) -> dict[str, Any]:
    """The file contents for one Thunder cache entry of `fn`: key parts, traced files' hashes and
    the four programs. Raises Unserializable when any part has no recipe."""
    import thunder

    cd = thunder.compile_data(fn)
    regions = _kforge_regions(entry)
    programs = {}
    for field in ("prologue_fn", "computation_fn", "epilogue_fn", "backward_fn"):
        prog = getattr(entry, field)
        programs[field] = None if prog is None else serialize_program(prog, cd.fn, regions, cd.executors_list)
    return {"format": _FORMAT, "key": key_parts(fn), "files": _files_of(cd, entry), "programs": programs,
            "return_none_instead_of_grads": bool(entry.return_none_instead_of_grads)}


def _entry_path(directory: str, record: dict[str, Any]) -> str:
    # named after the prologue (which states the inputs it accepts): a retrace for the same inputs
    # replaces a stale or corrupt file instead of adding one
    # (its header comment holds the time the pass took: left out)
    source = record["programs"]["prologue_fn"]["source"]
    code = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith("#"))
    digest = hashlib.sha256(code.encode()).hexdigest()[:24]
    return os.path.join(directory, f"entry-{digest}.pkl")


def _write(path: str, record: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}.{threading.get_ident()}"
    with open(tmp, "wb") as f:
        pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)  # readers see the old file or the whole new one


def _prune(directory: str) -> None:
    files = sorted((os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".pkl")),
                   key=lambda p: os.stat(p).st_mtime_ns)
    for p in files[:-_MAX_ENTRIES]:
        _remove(p)


def _prune_keys(root: str, keep: str) -> None:
    """Remove the key directories under `root` beyond the `_MAX_KEYS` most recently used (a
    directory's mtime: set when an entry is written or restored), never `keep`."""
    import shutil

    try:
        dirs = [os.path.join(root, n) for n in os.listdir(root)]
        dirs = sorted((d for d in dirs if os.path.isdir(d)), key=lambda d: os.stat(d).st_mtime_ns)
    except OSError:
        return
    for d in dirs[:-_MAX_KEYS]:
        if os.path.abspath(d) != os.path.abspath(keep):
            shutil.rmtree(d, ignore_errors=True)


def _touch(directory: str) -> None:
    try:
        os.utime(directory)
    except OSError:  # a read-only cache still restores
        pass


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _stale(record: dict[str, Any], key: dict[str, Any]) -> str | None:
    """Why a stored entry does not apply here, or None."""
    if record.get("format") != _FORMAT:
        return f"format {record.get('format')} (this kforge writes {_FORMAT})"
    if record["key"] != key:
        diff = sorted(k for k in set(key) | set(record["key"]) if key.get(k) != record["key"].get(k))
        return f"key differs in {', '.join(diff)}"
    for path, digest in record["files"].items():
        if _file_hash(path) != digest:
            return f"{path} changed since it was traced"
    return None


def _timed_prologue(pro: Callable, cs: Any) -> Callable:
    ref = weakref.ref(cs)

    @functools.wraps(pro)
    def prologue(*args: Any, **kwargs: Any) -> Any:
        import time

        stats = ref()
        if stats is not None:  # Thunder's prologue timing, which kforge.profile and its users read
            stats.last_prologue_execution_start = time.perf_counter_ns()
        try:
            return pro(*args, **kwargs)
        finally:
            if stats is not None:
                stats.last_prologue_execution_stop = time.perf_counter_ns()

    return prologue


def _restore_record(record: dict[str, Any], fn: Any) -> Any:
    import thunder

    from .fusion.zero_cotangents import _FILL, install

    cd, cs = thunder.compile_data(fn), thunder.compile_stats(fn)
    runner = _graph_runner(fn)
    progs = {k: None if r is None else rebuild_program(r, cd.fn, None, runner) for k, r in record["programs"].items()}
    bwd = record["programs"]["backward_fn"]
    if bwd is not None and _FILL in bwd["ctx"]:
        install()  # what ZeroCotangents sets up when it rewrites a backward during tracing
    # No compiling ahead here: the first process compiled every kernel its steps launched, and each
    # loads from the disk cache at its first launch. Regions it never launched (a zero-aware
    # region's inner kernel when its variants ran) would only be compiled for nothing.
    return thunder.CacheEntry(_timed_prologue(progs["prologue_fn"], cs), [], progs["computation_fn"], [],
                              progs["epilogue_fn"], [], progs["backward_fn"], [],
                              record["return_none_instead_of_grads"])


def _load(fn: Any, directory: str, key: dict[str, Any]) -> list:
    entries = []
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".pkl"))
    except OSError:
        return entries
    for n in names:
        path = os.path.join(directory, n)
        try:
            with open(path, "rb") as f:
                record = pickle.load(f)
            why = _stale(record, key)
        except Exception as e:  # truncated, corrupted, written by an incompatible kforge
            _count("corrupt")
            warnings.warn(f"kforge trace cache: {path} is unusable ({type(e).__name__}: {e}); removed, "
                          f"tracing instead", KforgeCacheWarning, stacklevel=3)
            _remove(path)  # warned once, not in every process that follows
            continue
        if why is not None:
            _count("skipped_stale")
            logger.debug("kforge trace cache: skipping %s: %s", path, why)
            continue
        try:
            entries.append(_restore_record(record, fn))
        except Exception as e:  # a recipe that no longer resolves (renamed function, ...)
            _count("corrupt")
            warnings.warn(f"kforge trace cache: {path} could not be rebuilt ({type(e).__name__}: {e}); "
                          f"tracing instead", KforgeCacheWarning, stacklevel=3)
            continue
        logger.info("kforge trace cache: restored %s", path)
        _count("restored")
    return entries


def _save_new(fn: Any, entries: Iterable[Any], directory: str) -> None:
    for entry in entries:
        try:
            record = save_entry(fn, entry)
        except Unserializable as e:
            _count("unserializable")
            logger.info("kforge trace cache: not writing an entry of %s: %s", directory, e)
            continue
        try:
            _write(_entry_path(directory, record), record)
            _prune(directory)
            _touch(directory)
            _prune_keys(os.path.dirname(directory), directory)
        except OSError as e:
            global _unwritable_warned
            with _lock:
                first, _unwritable_warned = not _unwritable_warned, True
            if first:  # once per process, not once per traced entry
                warnings.warn(f"kforge trace cache: cannot write under {directory} ({e}); running without it",
                              KforgeCacheWarning, stacklevel=3)
            return
        _count("saved")


def attach(fn: Any) -> Any:
    """Give the thunder.jit function `fn` (a ThunderModule or function; called before its first
    call) the disk cache: the stored entries that apply are appended to Thunder's cache now, and
    every entry Thunder traces from here on is written. Returns what to use in place of `fn` (`fn`
    itself for a module, a wrapper carrying `fn`'s attributes for a function)."""
    import thunder
    from thunder.core.module import ThunderModule

    _install_hooks()
    cs = thunder.compile_stats(fn)
    try:
        key = key_parts(fn)
    except Unserializable as e:
        logger.info("kforge trace cache: not used for %r: %s", fn, e)
        return fn
    directory = os.path.join(traces_dir(), _key_digest(key))
    restored = _load(fn, directory, key)
    if restored:
        _touch(directory)  # in use: the last to be pruned
        cs.interpreter_cache.extend(restored)
        _restored_into.add(cs)

    def saving(call: Callable) -> Callable:
        @functools.wraps(call)
        def run(*args: Any, **kwargs: Any) -> Any:
            n = len(cs.interpreter_cache)
            out = call(*args, **kwargs)
            if len(cs.interpreter_cache) > n:  # Thunder traced: keep what it made
                try:
                    _save_new(fn, cs.interpreter_cache[n:], directory)
                except Exception as e:  # the cache is an optimisation: never fail the call
                    warnings.warn(f"kforge trace cache: saving failed ({type(e).__name__}: {e})",
                                  KforgeCacheWarning, stacklevel=2)
            return out

        return run

    if isinstance(fn, ThunderModule):
        fn._forward_fn = saving(fn._forward_fn)
        return fn
    return saving(fn)
