"""kforge's Thunder executor, built from the op table.

Each op module `kforge.ops.<op>` defines `SPEC = OpSpec(...)`: the Thunder operators it registers
(through `operator`) and the torch symbols it claims (`Claim` rows: symbol, checker, execution and
grad transforms). This module owns the one `OperatorExecutor` and turns the table into
`register_implementation` calls; nothing here is op-specific.

Checkers return None to accept, or a short reason string to decline ("fp64 not supported"). Declines
are recorded (symbol name -> reason -> count) so `kforge.inspect` can say why an op fell back to torch.
"""
from __future__ import annotations

import collections
import functools
import importlib
import pkgutil
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch
from thunder.extend import OperatorExecutor, register_executor

from . import __version__

executor = OperatorExecutor("kforge", version=__version__)
register_executor(executor)

Checker = Callable[..., "str | None"]


def operator(name: str, **kwargs: Any):
    """`executor.register_operator("kforge_<name>", ...)`: every kforge symbol starts with `kforge_`."""
    return executor.register_operator(f"kforge_{name}", **kwargs)


@dataclass(frozen=True)
class Claim:
    """One torch-level symbol kforge takes over.

    symbol:    the Thunder symbol claimed (e.g. `thunder.torch.layer_norm`), or an operator registered
               with `replaces=` for a model helper function.
    checker:   same signature as the symbol; returns None to accept or a reason string to decline.
    execution: execution_transform, used when no gradient is needed (forward kernels only).
    grad:      grad_transform (forward op, `get_grad`, backward op, `put_grad`), or None when the op
               has no backward of its own.
    applies:   optional cheap filter, same signature: False when the call is not this op's kind at
               all (`x + 1` for the residual add of two tensors), declined without a logged reason so
               the decline log stays about calls kforge could have taken.
    """

    symbol: Any
    checker: Checker
    execution: Callable
    grad: Callable | None = None
    applies: Callable[..., bool] | None = None


@dataclass(frozen=True)
class OpSpec:
    """An op's row of the executor table: its name (kernels_src/<name>.cu, src/ops/<name>.cpp,
    kforge/ops/<name>.py, tests/test_<name>.py) and the symbols it claims."""

    name: str
    claims: tuple[Claim, ...]


# ---- decline bookkeeping (read by kforge.inspect) --------------------------------------------------
_declines: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
_accepts: collections.Counter = collections.Counter()
_lock = threading.Lock()


def declines() -> dict[str, dict[str, int]]:
    """{symbol name: {reason: count}} for every checker that declined since the last reset."""
    with _lock:
        return {k: dict(v) for k, v in _declines.items()}


def reset_declines() -> None:
    with _lock:
        _declines.clear()
        _accepts.clear()


def _symbol_name(sym: Any) -> str:
    return getattr(sym, "name", None) or getattr(sym, "__name__", None) or str(sym)


def _wrap_checker(name: str, op: str, checker: Checker,
                  applies: Callable[..., bool] | None = None) -> Callable[..., bool]:
    @functools.wraps(checker)
    def check(*args: Any, **kwargs: Any) -> bool:
        try:
            if applies is not None and not applies(*args, **kwargs):
                return False
            reason = checker(*args, **kwargs)
        except Exception as e:  # a checker bug must decline, never break tracing
            reason = f"checker error: {type(e).__name__}: {e}"
        with _lock:
            if reason is None:
                _accepts[name] += 1
            else:
                _declines[name][f"{op}: {reason}"] += 1
        return reason is None

    return check


# ---- common checker pieces (shared by the op modules) ---------------------------------------------
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def tensor_problem(t: Any, name: str = "input") -> str | None:
    """Why kforge cannot take tensor proxy `t`, or None: it must be a CUDA tensor of fp32/bf16/fp16."""
    from thunder.core.proxies import TensorProxy
    import thunder.core.devices as devices
    from thunder.core import dtypes

    if not isinstance(t, TensorProxy):
        return f"{name} is not a tensor"
    if t.device.devicetype != devices.DeviceType.CUDA:
        return f"{name} is on {t.device.device_str()}, not CUDA"
    tdt = dtypes.to_torch_dtype(t.dtype)
    if tdt not in SUPPORTED_DTYPES:
        return f"{name} dtype {tdt} not supported (float32, bfloat16, float16)"
    if t.numel == 0:
        return f"{name} is empty"
    return None


def same_dtype_device(a: Any, b: Any, name: str) -> str | None:
    """None when proxy `b` has `a`'s dtype and device, else the reason."""
    from thunder.core import dtypes

    if b.device != a.device:
        return f"{name} is on {b.device}, input on {a.device}"
    if dtypes.to_torch_dtype(b.dtype) != dtypes.to_torch_dtype(a.dtype):
        return f"{name} dtype {dtypes.to_torch_dtype(b.dtype)} differs from input dtype {dtypes.to_torch_dtype(a.dtype)}"
    return None


# ---- rewriting calls in a trace (kforge's pre-prologue transforms) ---------------------------------
def replace_calls(trace: Any, replacement: Callable[[Any], "Callable[[], Any] | None"],
                  provenance: str) -> tuple[Any, int]:
    """(`trace` with every bound symbol `b` for which `replacement(b)` returns a function replaced by
    the ops that function traces, how many were replaced); `trace` itself when none is. The
    replacement's output takes the call's output name, so every reader is unchanged. `provenance`
    names the new trace, `{}` standing for the count."""
    from thunder.core.proxies import variableify
    from thunder.core.trace import TraceProvenance, from_trace, tracectx

    new = from_trace(trace)
    bsyms: list[Any] = []
    count = 0
    for b in trace.bound_symbols:
        make = replacement(b)
        if make is None:
            bsyms.append(b)
            continue
        new.push_scope([])
        with tracectx(new):
            out = make()
        made = new.pop_scope()
        swap = {variableify(out): b.output}
        bsyms.extend(m.from_bsym_swap_proxies(swap) for m in made)
        count += 1
    if not count:
        return trace, 0
    new.bound_symbols = bsyms
    new.set_provenance(TraceProvenance(provenance.format(count)))
    return new, count


# ---- building the executor from the table ----------------------------------------------------------
@functools.cache
def specs() -> tuple[OpSpec, ...]:
    """Import every `kforge.ops.<op>` module and register its claims (once)."""
    from . import ops

    out = []
    for info in sorted(pkgutil.iter_modules(ops.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{ops.__name__}.{info.name}")
        spec = getattr(mod, "SPEC", None)
        if spec is None:
            continue
        for claim in spec.claims:
            name = _symbol_name(claim.symbol)
            executor.register_implementation(
                claim.symbol,
                checker=_wrap_checker(name, spec.name, claim.checker, claim.applies),
                execution_transform=claim.execution,
                grad_transform=claim.grad,
            )
        out.append(spec)
    return tuple(out)


def get_executor() -> OperatorExecutor:
    specs()
    return executor
