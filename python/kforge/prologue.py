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
have raised. Checks it cannot batch (symbolic shapes, values other than numbers and strings) stay
as they are.

The call is an `InputChecks` object that holds the traced values and specs, so each call passes only
what it reads; its comparisons run in C++ (`kforge._C.InputGuard`) when the extension is there. The
parameters, buffers and submodules the prologue reads by name (one `module.get_parameter(name)` call
each, about 150 for a GPT-2) are read in one call per kind too (`Unpack`).
"""
from __future__ import annotations

import functools
import itertools
import operator
from typing import Any, Sequence

import torch

__all__ = ["BatchedChecks", "InputChecks", "Unpack", "check_all"]

_NAME = "kforge_check_inputs"
# kind: (symbol name, the ThunderModule's dict of that kind by name, its per-name getter)
_UNPACK = {"parameter": ("kforge_unpack_parameters", "_overrides_parameters", "get_parameter"),
           "buffer": ("kforge_unpack_buffers", "_overrides_buffers", "get_buffer"),
           "submodule": ("kforge_unpack_submodules", "_module_cache", "get_submodule")}


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


def _native_guard(values: tuple, specs: tuple, string_values: tuple) -> Any:
    """kforge._C.InputGuard for these values and specs, or None without the extension."""
    try:
        from . import _C
    except ImportError:
        return None
    return _C.InputGuard(values, specs, (torch.Tensor, torch.nn.Parameter), string_values)


class InputChecks:
    """One prologue's batched checks: `checks(numbers, tensors, strings)` raises as Thunder's
    per-item checks do unless `numbers` have the traced `values` (type and value), `tensors` match
    the traced `specs` and `strings` equal the traced `string_values`. The common case (everything
    the same) is one C++ pass; anything else goes to the Python checks (`check_all`). Pickles by its
    values and specs (kforge's trace cache stores prologues)."""

    __slots__ = ("values", "specs", "string_values", "_native")

    def __init__(self, values: Sequence[Any], specs: Sequence[tuple], string_values: Sequence[str] = ()) -> None:
        self.values = tuple(values)
        self.specs = tuple((tuple(shape), device, dtype, requires_grad)
                           for shape, device, dtype, requires_grad in specs)
        self.string_values = tuple(string_values)
        self._native = _native_guard(self.values, self.specs, self.string_values)

    def __reduce__(self) -> tuple:
        return (InputChecks, (self.values, self.specs, self.string_values))

    def __eq__(self, other: object) -> bool:
        return type(other) is InputChecks and self.__reduce__() == other.__reduce__()

    def __hash__(self) -> int:
        return hash(self.__reduce__())

    def __call__(self, numbers: tuple, tensors: tuple, strings: tuple = ()) -> None:
        if self._native is not None and self._native.matches(numbers, tensors, strings):
            return
        check_all(numbers, self.values, tensors, self.specs)
        if len(strings) != len(self.string_values):
            raise RuntimeError(f"Expected {len(self.string_values)} strings, got {len(strings)}")
        for s, v in zip(strings, self.string_values):
            if not s == v:  # Thunder's check_string_value: equality only
                raise RuntimeError(f"Expected '{s}' to be equal to '{v}'")


class Unpack:
    """`module.get_parameter(name)` (kind "parameter"), `get_buffer(name)` ("buffer") or
    `get_submodule(name)` ("submodule") for every name at once: C-level lookups in the dict a
    ThunderModule keeps of that kind by name, and the per-name call for a name it lacks (the second
    name of a tied weight). Pickles by kind and names."""

    __slots__ = ("kind", "names", "_table", "_getter", "_gaps")

    def __init__(self, kind: str, names: Sequence[str]) -> None:
        if kind not in _UNPACK:
            raise ValueError(f"kforge.prologue.Unpack: kind must be one of {sorted(_UNPACK)}, got {kind!r}")
        self.kind, self.names = kind, tuple(names)
        _, self._table, self._getter = _UNPACK[kind]
        self._gaps: list[int] = []  # positions the dict lacked last time: looked up by name

    def __reduce__(self) -> tuple:
        return (Unpack, (self.kind, self.names))

    def __eq__(self, other: object) -> bool:
        return type(other) is Unpack and self.__reduce__() == other.__reduce__()

    def __hash__(self) -> int:
        return hash(self.__reduce__())

    def __call__(self, module: Any) -> tuple:
        known = getattr(module, self._table, None)
        get = getattr(module, self._getter)
        if type(known) is not dict:
            return tuple(map(get, self.names))
        vals = list(map(known.get, self.names, itertools.repeat(_MISSING)))
        for i in self._gaps:
            if vals[i] is _MISSING:
                vals[i] = get(self.names[i])
        if any(map(operator.is_, vals, itertools.repeat(_MISSING))):  # C-level identity tests, no tensor ==
            self._gaps = [i for i, v in enumerate(vals) if v is _MISSING]
            for i in self._gaps:
                vals[i] = get(self.names[i])
        return tuple(vals)


_MISSING = object()


@functools.lru_cache(maxsize=64)
def _expected(specs: tuple) -> list:
    # torch.device(s) == t.device exactly when str(t.device) == s, for the canonical strings Thunder
    # prints ("cpu", "cuda:0"); comparing device objects skips a str() per tensor per call.
    return [(tuple(shape), torch.device(device), dtype, requires_grad) for shape, device, dtype, requires_grad in specs]


@functools.cache
def _symbol(name: str = _NAME) -> Any:
    from thunder.core.prims import OpTags
    from thunder.core.symbol import Symbol

    # A python_impl keeps the symbol as it is when Thunder claims the prologue for its Python
    # executor; each bound symbol's call context names the object the printed prologue calls (an
    # InputChecks / Unpack); DONT_DCE, because the checks return nothing and dead-code elimination
    # would drop them (and the unpacks only they read).
    return Symbol(name=name, id=name, meta=lambda *args: None, is_prim=True, python_impl=_without_context,
                  tags=[OpTags.DONT_DCE])


def _without_context(*args: Any) -> None:
    raise RuntimeError("kforge.prologue: a batched prologue call was run without the object its call context names")


def _unpack_kind(b: Any) -> str | None:
    from thunder.core.prims import PrimIDs

    return {PrimIDs.UNPACK_PARAMETER: "parameter", PrimIDs.UNPACK_BUFFER: "buffer",
            PrimIDs.UNPACK_SUBMODULE: "submodule"}.get(b.sym.id)


def _batched_unpacks(bsyms: list) -> list:
    """`bsyms` with each kind's `module.get_parameter(name)` / `get_buffer(name)` /
    `get_submodule(name)` unpacks as one `Unpack` call where the first of them was (they read only
    the module, which comes before it). Left as they are when they read more than one module or a
    name that is not a plain string."""
    groups: dict[str, list] = {}
    for b in bsyms:
        kind = _unpack_kind(b)
        if kind is not None:
            groups.setdefault(kind, []).append(b)
    out = list(bsyms)
    for kind, group in groups.items():
        modules = {id(b.args[0]) for b in group}
        if len(modules) != 1 or not all(type(b.args[1]) is str for b in group):
            continue
        name = _UNPACK[kind][0]
        call = _symbol(name).bind(group[0].args[0], output=tuple(b.output for b in group))
        call = call.from_bsym(_call_ctx={name: Unpack(kind, [b.args[1] for b in group])})
        drop = {id(b) for b in group[1:]}
        out = [call if b is group[0] else b for b in out if id(b) not in drop]
    return out


def _plain_number(v: Any) -> bool:
    return type(v) in (bool, int, float)


def _batchable(b: Any) -> str | None:
    """'number' / 'string' / 'tensor' for a check this transform can batch, else None."""
    from thunder.core import prims
    from thunder.core.proxies import Proxy

    if b.sym.id == prims.PrimIDs.CHECK_NUMBER_TYPE_AND_VALUE:
        n, v = b.args
        return "number" if isinstance(n, Proxy) and _plain_number(v) else None
    if b.sym.id == prims.PrimIDs.CHECK_STRING_VALUE:
        s, v = b.args
        return "string" if isinstance(s, Proxy) and type(v) is str else None
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
        """Thunder transform: the prologue's tensor, number and string checks as one
        `kforge_check_inputs` call just before the prologue returns (an `InputChecks`), and its
        parameter, buffer and submodule reads as one call per kind (`Unpack`)."""

        def transform_traces_pre_prologue(self, prologue_trc, computation_trc, epilogue_trc, **kwargs):
            groups: dict[str | None, list] = {"number": [], "string": [], "tensor": [], None: []}
            for b in prologue_trc.bound_symbols:
                groups[_batchable(b)].append(b)
            numbers, strings, tensors, rest = groups["number"], groups["string"], groups["tensor"], groups[None]
            if len(numbers) + len(strings) + len(tensors) < 2:
                return prologue_trc, computation_trc, epilogue_trc
            ret = [i for i, b in enumerate(rest) if b.sym.id == PrimIDs.RETURN]
            if len(ret) != 1 or ret[0] != len(rest) - 1:  # not the usual shape: leave it alone
                return prologue_trc, computation_trc, epilogue_trc
            checks = InputChecks(tuple(b.args[1] for b in numbers), tuple(tuple(b.args[1:]) for b in tensors),
                                 tuple(b.args[1] for b in strings))
            check = _symbol().bind(tuple(b.args[0] for b in numbers), tuple(b.args[0] for b in tensors),
                                   tuple(b.args[0] for b in strings), output=None)
            check = check.from_bsym(_call_ctx={_NAME: checks})
            new = from_trace(prologue_trc)
            new.bound_symbols = [*_batched_unpacks(rest[:-1]), check, rest[-1]]
            new.set_provenance(TraceProvenance("kforge: the prologue's checks and parameter reads in one call each"))
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

