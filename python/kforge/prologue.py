"""Thunder's input checks in one call: the prologue that runs before every step, made cheaper.

Before each call of a jitted module Thunder's prologue checks that the cached trace still applies:
every tensor it reads (each parameter, buffer and input: shape, device, dtype, requires_grad) and
every number it read from the module (each layer's `training`, head counts, eps, ...). A 12-layer
Llama had 115 tensor checks and 501 number checks, each a Python call: about 0.4 ms of host time per
step, and the GPU waits for it whenever the step starts from an idle GPU (a training loop that reads
the loss every step). (kforge.lookasides' `Module.__getattr__` shortcut has since taken out most of
the numbers: those the forward never read.)

`BatchedChecks` replaces those checks with one call that makes the same comparisons over all of them
at once: C-level tuple comparisons in the common case, and, when anything differs, the original
per-item checks in order, so the error (and with it Thunder's cache miss) is the one Thunder would
have raised. Checks it cannot batch (symbolic shapes, non-number values) stay as they are.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

__all__ = ["BatchedChecks", "check_all"]

_NAME = "kforge_check_inputs"


def _same_number(n: Any, v: Any) -> bool:
    """Thunder's number check: the same type and value (NaN equal to NaN)."""
    return type(n) == type(v) and (n == v or (n != n and v != v))


def check_all(numbers: Sequence[Any], values: Sequence[Any], tensors: Sequence[Any],
              specs: Sequence[tuple]) -> None:
    """Raises AssertionError / RuntimeError unless every `numbers[i]` has the type and value of
    `values[i]` and every `tensors[i]` is a torch.Tensor with `specs[i]` = (shape, device string,
    dtype, requires_grad), exactly as Thunder's per-item prologue checks decide."""
    # Fast path: one C-level comparison per property; equal tuples imply equal items (a tuple
    # compares its items by identity, then ==), and the types are compared separately because
    # 1 == 1.0 == True.
    if not (tuple(numbers) == tuple(values) and tuple(map(type, numbers)) == tuple(map(type, values))):
        for n, v in zip(numbers, values):  # NaN, or a real difference: decide item by item
            if not _same_number(n, v):
                raise RuntimeError(f"Expected {n} to be equal to and have the type of {v}")
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        bad = next(t for t in tensors if not isinstance(t, torch.Tensor))
        raise AssertionError(f"expected Tensor, got {type(bad).__name__}")
    got = [(t.shape, t.device, t.dtype, t.requires_grad) for t in tensors]  # torch.Size == tuple
    want = _expected(tuple(specs))
    if got != want:
        for t, (shape, device, dtype, requires_grad) in zip(tensors, specs):
            assert (tuple(t.shape) == tuple(shape) and str(t.device) == device and t.dtype == dtype
                    and t.requires_grad == requires_grad), (
                f"expected tensor with {shape}, {device}, {dtype}, {requires_grad=}, got {tuple(t.shape)}, "
                f"{str(t.device)}, {t.dtype}, {t.requires_grad}")


@functools.lru_cache(maxsize=64)
def _expected(specs: tuple) -> list:
    # torch.device(s) == t.device exactly when str(t.device) == s, for the canonical strings Thunder
    # prints ("cpu", "cuda:0"); comparing device objects skips a str() per tensor per call.
    return [(tuple(shape), torch.device(device), dtype, requires_grad) for shape, device, dtype, requires_grad in specs]


@functools.cache
def _symbol() -> Any:
    from thunder.core.prims import OpTags
    from thunder.core.symbol import Symbol

    def bind_postprocess(bsym: Any) -> None:
        bsym._call_ctx = {_NAME: check_all}

    # A python_impl keeps the symbol as it is when Thunder claims the prologue for its Python
    # executor; the call context names the function the printed prologue calls; DONT_DCE, because
    # it returns nothing and dead-code elimination would drop it (and the unpacks only it reads).
    return Symbol(name=_NAME, id=_NAME, meta=lambda *args: None, is_prim=True, python_impl=check_all,
                  tags=[OpTags.DONT_DCE], _bind_postprocess=bind_postprocess)


def _plain_number(v: Any) -> bool:
    return type(v) in (bool, int, float)


def _batchable(b: Any) -> str | None:
    """'number' / 'tensor' for a check this transform can batch, else None."""
    from thunder.core import prims
    from thunder.core.proxies import Proxy

    if b.sym.id == prims.PrimIDs.CHECK_NUMBER_TYPE_AND_VALUE:
        n, v = b.args
        return "number" if isinstance(n, Proxy) and _plain_number(v) else None
    if b.sym.id == prims.PrimIDs.CHECK_TENSOR_SHAPE_AND_METADATA:
        t, shape, device, dtype, requires_grad = b.args
        plain = (all(type(s) is int for s in shape) and isinstance(device, str) and isinstance(dtype, torch.dtype)
                 and isinstance(requires_grad, bool))
        return "tensor" if isinstance(t, Proxy) and plain else None
    return None


def _transform_class() -> type:
    from thunder.core.prims import PrimIDs
    from thunder.core.trace import TraceProvenance, from_trace
    from thunder.core.transform_common import Transform

    class BatchedChecks(Transform):
        """Thunder transform: the prologue's tensor and number checks as one `kforge_check_inputs`
        call just before the prologue returns (`check_all`)."""

        def transform_traces_pre_prologue(self, prologue_trc, computation_trc, epilogue_trc, **kwargs):
            numbers, tensors, rest = [], [], []
            for b in prologue_trc.bound_symbols:
                kind = _batchable(b)
                (numbers if kind == "number" else tensors if kind == "tensor" else rest).append(b)
            if len(numbers) + len(tensors) < 2:
                return prologue_trc, computation_trc, epilogue_trc
            ret = [i for i, b in enumerate(rest) if b.sym.id == PrimIDs.RETURN]
            if len(ret) != 1 or ret[0] != len(rest) - 1:  # not the usual shape: leave it alone
                return prologue_trc, computation_trc, epilogue_trc
            check = _symbol().bind(tuple(b.args[0] for b in numbers), tuple(b.args[1] for b in numbers),
                                   tuple(b.args[0] for b in tensors), tuple(tuple(b.args[1:]) for b in tensors),
                                   output=None)
            new = from_trace(prologue_trc)
            new.bound_symbols = [*rest[:-1], check, rest[-1]]
            new.set_provenance(TraceProvenance("kforge: the prologue's tensor and number checks in one call"))
            return new, computation_trc, epilogue_trc

    BatchedChecks.__qualname__ = "BatchedChecks"  # defined here so that importing kforge needs no Thunder
    return BatchedChecks


def __getattr__(name: str) -> Any:
    # Thunder is imported when the transform is first asked for, not with kforge.
    if name == "BatchedChecks":
        cls = _transform_class()
        globals()["BatchedChecks"] = cls
        return cls
    raise AttributeError(name)

