"""kforge's lookasides for Thunder's interpreter: module calls and attribute reads without the hook
and containment bookkeeping, Tensor methods without Thunder's DTensor dispatch wrapper being
interpreted, and shorter roads through the interpreter's global-name and containment machinery.

`thunder.jit` runs the model's Python in its own interpreter, about 40 us per bytecode instruction on a
development CPU. Every `module(x)` goes through `torch.nn.Module._call_impl`, whose first statement
tests eight hook dictionaries for emptiness. Interpreted, each test is Thunder's `bool` and `len`
lookasides, Python functions of Thunder's own that the interpreter runs too, each global name in them
(`hasattr`, `getattr`, `len`, `isinstance`) two interpreted dictionary lookups: about 100 ms per
module call, more than half the time `thunder.jit` needs to trace a plain-PyTorch Llama
(docs/experiments/users-models.md, "The first step: Thunder's interpreter").

The lookaside here replaces `_call_impl` for the interpreter with what it does when no hook is
set: `self.forward(*args, **kwargs)`, the attribute read and the call interpreted as before (so the
provenance of `forward`, of the arguments and of everything the forward reads is unchanged, and with
it the prologue and every trace). It takes that shortcut only when the module has no hooks, no global
module hooks are registered, `torch.jit` is not tracing, Thunder's sharp-edge checks are off
(the default; they would have warned about the hook dictionaries) and the interpreter is not recording
its history; otherwise it interprets `_call_impl` itself, instruction by instruction, as Thunder does.
It is active only for compilations that use kforge's executor (`kforge.jit`, `kforge.compile`,
`thunder.jit(executors=kforge.executors())`); other `thunder.jit` calls in the process see Thunder's
own behaviour. `kforge.jit` / `kforge.compile` install it (`KFORGE_LOOKASIDES=0`: not);
`uninstall()` takes it out again. `Module.__call__` (`_wrapped_call_impl`, which only re-packs the
arguments for `_call_impl` unless torch.compile has wrapped the module) has one too: to `_call_impl`'s
lookaside directly, about a tenth of the trace time of Hugging Face's Llama, whose layers pass a
dozen keyword arguments through every module call.

A second group of lookasides runs Thunder's DTensor dispatch wrappers opaquely. Thunder 0.2.6 sends
17 torch functions and Tensor methods (`transpose`, `reshape`, `linear`, `add`, `mul`, `exp`, ...)
through a small Python wrapper that flattens the arguments to decide between the single-device and
the DTensor symbol. Called as a function (`torch.transpose(x, 1, 2)`) the wrapper already runs
opaquely; called as a method (`x.transpose(1, 2)`, how models are written) the interpreter finds it
in the Tensor-method table and interprets it, `tree_flatten` and all: 15 % of the trace time of a
plain Llama or nanoGPT. Run opaquely, the wrapper makes the same decision on the same values and
records the same symbol; the traces differ in their source comments only, which now name the
model's line instead of the wrapper's (`dtensor_torch_and_prims.py`). The same conditions as above
apply (kforge's executor, default sharp edges, no interpreter history); otherwise the wrapper is
interpreted as Thunder does.

A third group lets `thunder.jit` trace Hugging Face models whose forward collects requested outputs
through transformers' `CompileableContextVar`: in kforge's compilations its methods take the
collector as the interpreter's own value instead of writing it into a module-global object (see
`_context_var_lookaside`).

`dataclasses.fields` runs opaquely in kforge's compilations: transformers' ModelOutput reads its
class's fields on every attribute it sets, and interpreted that cost about 2 s of a Hugging Face
Llama's trace. The prologue then no longer checks the `dataclasses` module's own constant that the
interpreted function read; the computation and backward traces are the same.

`Module.__getattr__` (every read of a parameter, buffer or submodule: `self.q_proj`, `self.weight`)
goes straight to the read it ends in, `self.__dict__[store][name]`, interpreted as before. Its
containment tests (`"_parameters" in self.__dict__`, `name in _parameters`, ...), interpreted, made
the interpreter wrap every entry of the dictionaries they test, about 400 values a call: a third of
a plain Llama's trace time. Those wrapped entries were also registered with the prologue, which
checked every number and flag of every module the forward touched (`training`, `in_features`,
`eps`, ...) whether the forward read it or not. It now checks what the forward reads (Dropout's
`self.training` included), as for any other object; the computation and backward traces are the
same. Traced as on a GPU on a development CPU, at the bench sizes: plain Llama about 21.5 s ->
15.8 s (prologue 815 -> 297 lines), nanoGPT 13.9 -> 9.5 s, Hugging Face's Llama 52.5 -> 41.1 s.

Two pieces of the interpreter's own machinery take a shorter road to the same result in kforge's
compilations. A containment test on a tuple or list (`name in func.__code__.co_varnames`,
`key in names`) whose key and items are plain strings, ints, bools or None is answered at once,
where Thunder interprets `any(i == key for i in seq)` (about 0.4 s for one test against 40 names;
transformers' `merge_with_config_defaults` makes four per forward). And every global name the
interpreter loads (`len`, `getattr`, `type`, a module's own globals) is read with one call of
`dict.__getitem__` on the wrapped dictionary instead of an interpreted `lambda d, k: d[k]` and the
helper frame behind its subscript: the same wrapped value and provenance, about 1.3 ms less per
builtin, a third of the interpreter's time on Hugging Face's Llama. `install()` replaces Thunder's
`interpreter.globals_lookup` with it (its own function everywhere else); traces are unchanged.
With both, the bench-size Hugging Face Llama traces (as on a GPU, development CPU) in about 28 s
against 41 s. Likewise `next` on the iterator Thunder makes for a tuple or list (every `for` loop
over one) steps it directly instead of interpreting its `__next__`, and on a dictionary's key
iterator calls Thunder's own lookaside at once: about 19-24 s against 25-29 s.

One lookaside changes what is traced, not how fast: `F.multi_head_attention_forward`
(`nn.MultiheadAttention`, and with it `nn.TransformerEncoderLayer` / `DecoderLayer`). Thunder 0.2.6
registers it automatically as one opaque symbol whose backward cannot be derived for it: training
such a model stops in the trace. In kforge's compilations the interpreter runs torch's own Python for
it instead (replacing Thunder's entry while installed; Thunder's elsewhere): in-projection linears,
SDPA (kforge's cuDNN attention where it applies, e.g. a causal encoder) and the out-projection, with
the masks, dropout and head-averaged weights torch computes. Likewise a tensor's dtype compares as
torch's in kforge's compilations (`x.dtype == torch.float32` is False under Thunder's own
thunder.jit for a float32 tensor, so code that branches on it took the other branch). And a module
the forward constructs (Hugging Face's heads make `CrossEntropyLoss()` there) may register buffers:
Thunder stops on that write, which nothing outside the trace can see; kforge's compilations leave
it out. Hugging Face's gradient checkpointing traces too: `requires_grad_(True)` on a traced tensor
(its embedding hook) is the tensor itself, and a checkpoint with use_reentrant=True, which Thunder
refuses, is traced as one without.

A fourth piece is not a lookaside: Thunder's interpreter disassembles a function's code
(`dis.get_instructions`) every time it runs the function, about 25,000 times to trace a one-layer Hugging
Face's Llama, and the disassembly is a function of the code object alone. `install()` gives the
interpreter's module a `dis` that keeps each code object's instructions (a weak reference to the code);
traces are unchanged. Traced as on a GPU on a development CPU, the zoo's bench-size models took
22.3 s instead of 25.9 (plain Llama), 18.8 instead of 21.7 (nanoGPT), 53.8 instead of 55.8 (HF Llama).
It applies to every `thunder.jit` of the process while installed, since it changes no result.

A fifth is not about tracing but about every call of a compiled function: Thunder's two autograd
Functions (`thunder.executors.torch_autograd`) are linked by a dummy tensor on the meta device made
with `torch.randn`, which on the meta device runs torch's Python reference decomposition, about
0.26 ms a training step on a development CPU. `install()` gives that module a `torch` whose meta
`randn` is `torch.empty` (a meta tensor has no values); everything else is torch itself. It applies
to every `thunder.jit` of the process while installed, since it changes no result.
"""
from __future__ import annotations

import dataclasses
import dis as _dis
import functools
import threading
import types
import weakref
from typing import Any

import torch
import torch.nn.modules.module as _module

__all__ = ["install", "installed", "uninstall"]

_DISPATCH_QUALNAME = "dispatch_to_impl.<locals>.wrapper"  # thunder/torch/experimental/dtensor_torch_and_prims.py

_CALL_IMPL = torch.nn.Module._call_impl
_WRAPPED_CALL_IMPL = torch.nn.Module._wrapped_call_impl  # Module.__call__


def _copy_of(fn: types.FunctionType) -> types.FunctionType:
    """A function object with `fn`'s code, globals, defaults and names, but not `fn` itself: the
    interpreter runs it as it would run `fn`, without finding the lookaside registered for `fn`."""
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    out.__kwdefaults__, out.__qualname__, out.__module__ = fn.__kwdefaults__, fn.__qualname__, fn.__module__
    return out


_CALL_IMPL_INTERPRETED = _copy_of(_CALL_IMPL)
_WRAPPED_CALL_IMPL_INTERPRETED = _copy_of(_WRAPPED_CALL_IMPL)
_GETATTR = torch.nn.Module.__getattr__
_GETATTR_INTERPRETED = _copy_of(_GETATTR)
_MEMBER_STORES = ("_parameters", "_buffers", "_modules")  # Module.__getattr__'s order


def _hookless(module: torch.nn.Module) -> bool:
    """`_call_impl`'s own test for its shortcut to `forward`, on the real (unwrapped) objects."""
    return not (module._backward_hooks or module._backward_pre_hooks or module._forward_hooks
                or module._forward_pre_hooks or _module._global_backward_pre_hooks
                or _module._global_backward_hooks or _module._global_forward_hooks
                or _module._global_forward_pre_hooks or torch._C._get_tracing_state())


def _kforge_executor_in_use() -> bool:
    """Whether the compilation under way (if any) has kforge's executor in its list."""
    from thunder.core.compile_data import get_compile_data

    from ._thunder import executor

    cd = get_compile_data()
    return cd is not None and executor in cd.executors_list


def _kforge_compilation() -> bool:
    """Whether the compilation being traced uses kforge's executor and Thunder's defaults for sharp
    edges and interpreter history (False where no trace is under way)."""
    from thunder.core.interpreter import get_interpreterruntimectx
    from thunder.core.jit_ext import get_jit_ctx
    from thunder.core.options import SHARP_EDGES_OPTIONS

    if not _kforge_executor_in_use():
        return False
    try:
        return (get_jit_ctx().sharp_edges is SHARP_EDGES_OPTIONS.ALLOW
                and not get_interpreterruntimectx()._record_history)
    except LookupError:  # Thunder's passes after the interpreter, or Python outside any trace
        return False


def _call_impl_lookaside(self, *args, **kwargs):
    """The interpreter's `Module._call_impl(self, *args, **kwargs)`; every argument is Thunder's
    WrappedValue (the value and its provenance)."""
    from thunder.core.interpreter import INTERPRETER_SIGNALS, _interpret_call, unwrap, wrap_const

    if not (_hookless(unwrap(self)) and _kforge_compilation()):
        return _interpret_call(_CALL_IMPL_INTERPRETED, self, *args, **kwargs)
    forward = _interpret_call(getattr, self, wrap_const("forward"))
    if forward is INTERPRETER_SIGNALS.EXCEPTION_RAISED:
        return forward
    return _interpret_call(forward, *args, **kwargs)


def _wrapped_call_impl_lookaside(self, *args, **kwargs):
    """The interpreter's `Module.__call__` (`_wrapped_call_impl`): straight to `_call_impl`'s
    lookaside when the module is not torch.compile'd, saving an interpreted frame that re-packs the
    arguments (Hugging Face's layers pass a dozen keyword arguments through every module call)."""
    from thunder.core.interpreter import _interpret_call, unwrap

    if unwrap(self).__dict__.get("_compiled_call_impl") is None and _kforge_compilation():
        return _call_impl_lookaside(self, *args, **kwargs)
    return _interpret_call(_WRAPPED_CALL_IMPL_INTERPRETED, self, *args, **kwargs)


def _member_read(module, store, name):
    """Interpreted: the read `Module.__getattr__` ends in, with its provenance."""
    return module.__dict__[store][name]


def _module_getattr_lookaside(self, name):
    """The interpreter's `Module.__getattr__(self, name)` (a parameter, buffer or submodule: what is
    not in the instance's own `__dict__`): the read it ends in, `self.__dict__[store][name]`,
    interpreted as before, without the containment tests that lead to it. Those tests made the
    interpreter wrap every entry of the dictionaries they test afresh (about 400 values a call), and
    each wrapped number went into the prologue's checks whether the forward read it or not. Where no
    store holds the name (AttributeError) or outside kforge's compilations, `__getattr__` is
    interpreted as Thunder does."""
    from thunder.core.interpreter import _interpret_call, unwrap, wrap_const

    d, uname = unwrap(self).__dict__, unwrap(name)
    store = next((s for s in _MEMBER_STORES if s in d and uname in d[s]), None)
    if store is None or not _kforge_compilation():
        return _interpret_call(_GETATTR_INTERPRETED, self, name)
    return _interpret_call(_member_read, self, wrap_const(store), name)


_PLAIN = (str, int, bool, type(None))  # compared by value alone; no float (NaN is not == itself)


def _sequence_contains_lookaside(self, key):
    """The interpreter's `key in seq` for a tuple or list: Thunder interprets `any(i == key for i in
    seq)`, a generator frame and an interpreted comparison per item (about 0.4 s for one test of a
    name against a 40-entry `co_varnames`, which transformers' `merge_with_config_defaults` does four
    times per forward). Where the key and every item are plain strings, ints, bools or None (equal
    only by value), the answer is the same computed at once, recorded as a containment test on the
    two values as Thunder records one on a dict. Anything else, or outside kforge's compilations,
    is Thunder's own."""
    from thunder.core.interpreter import ProvenanceRecord, PseudoInst, SequenceWrapperMethods, unwrap, wrap

    useq, ukey = unwrap(self), unwrap(key)
    if type(ukey) in _PLAIN and all(type(i) in _PLAIN for i in useq) and _kforge_compilation():
        return wrap(ukey in useq, provenance=ProvenanceRecord(PseudoInst.CONTAINS_OP,
                                                             inputs=[self.provenance, key.provenance]))
    return SequenceWrapperMethods.__contains__(self, key)


def _dict_getitem_lookaside(self, key):
    """`dict.__getitem__` in the interpreter. Thunder's reads `self.value[key]`, which for a dict
    subclass with its own `__getitem__` runs that method again: `super().__getitem__(key)` inside it
    returned the subclass's processed item, not the stored one. transformers' activation table
    (`ACT2FN[name]`, a `ClassInstantier` whose `__getitem__` instantiates the stored class) then
    called the new module with no input, which stopped Mamba, Mamba2 and Jamba in the trace ("forward()
    missing 1 required positional argument"). In kforge's compilations a subclass's item is read with
    dict's own method, as a constant of the trace: the prologue would replay a read by `mapping[key]`,
    the subclass's method again. Plain dicts, and everything outside kforge's compilations, are
    Thunder's."""
    from thunder.core.interpreter import MutMappingWrapperMethods, do_raise, unwrap, wrap_const

    mapping = unwrap(self)
    if type(mapping).__getitem__ is dict.__getitem__ or not _kforge_compilation():
        return MutMappingWrapperMethods.__getitem__(self, key)
    try:
        return wrap_const(dict.__getitem__(mapping, unwrap(key)))
    except Exception as e:
        return do_raise(e)


def _next_lookaside(iterator, *default):
    """The interpreter's `next(iterator[, default])`, which every `for` loop runs per item. On the
    iterator Thunder makes for a tuple or list (its `SequenceIter`) Thunder interprets
    `SequenceIter.__next__`: a `len`, three attribute reads, an attribute store through its setattr
    lookasides, and the frames that lead there, about 10 ms an item on a development CPU (a
    sixth of the trace time of a Hugging Face Llama). Here the step is taken directly: the item
    wrapper the sequence's own `__getitem__` returns, and the position advanced on the iterator
    and in its attribute wrappers, as the interpreted store leaves them. On a dictionary's key
    iterator (`for k in d`, `**kwargs` merges) Thunder's own `MappingKeysIterator.__next__`, a
    lookaside already, is called at once instead of through three interpreted frames (about 2 ms
    an item). Reversed iterators, other iterators, `next` with a default on a key iterator, or a
    compilation without kforge's executor: Thunder's `next`."""
    from thunder.core.interpreter import (INTERPRETER_SIGNALS, MappingKeysIterator, SequenceIter,
                                          SequenceWrapperMethods, WrappedValue, do_raise, unwrap,
                                          wrap_const)

    it = unwrap(iterator)
    if (type(it) is MappingKeysIterator and not default and isinstance(iterator, WrappedValue)
            and _kforge_compilation()):
        return MappingKeysIterator.__next__(iterator)  # the lookaside Thunder's frames lead to
    if (type(it) is SequenceIter and isinstance(iterator, WrappedValue) and it.is_reversed is False
            and "__dict__" not in iterator.attribute_wrappers and _kforge_compilation()):
        seq = iterator.attribute_wrappers.get("s")
        if isinstance(seq, WrappedValue) and type(unwrap(seq)) in (tuple, list) and unwrap(seq) is it.s:
            pos = it.next_pos
            if pos >= len(it.s):
                return default[0] if default else do_raise(StopIteration())
            item = SequenceWrapperMethods.__getitem__(seq, wrap_const(pos))
            if item is not INTERPRETER_SIGNALS.EXCEPTION_RAISED:
                object.__setattr__(it, "next_pos", pos + 1)
                iterator.attribute_wrappers["next_pos"] = wrap_const(pos + 1)
            return item
    from thunder.core import interpreter

    return interpreter._next_lookaside(iterator, *default)  # Thunder's own


def _dispatch_wrappers() -> list:
    """Thunder's DTensor dispatch wrappers, from its torch-function and Tensor-method tables."""
    import importlib

    import thunder.torch as ttorch

    methods = importlib.import_module("thunder.torch.langctx")._method_name_to_fn_map
    found: dict[int, object] = {}
    for fn in (*ttorch._torch_to_thunder_function_map.values(), *methods.values()):
        if getattr(fn, "__qualname__", "") == _DISPATCH_QUALNAME:
            found[id(fn)] = fn
    return list(found.values())


def _opaque_in_kforge(fn, opaque, kind: str):
    """A lookaside for `fn`: `opaque` (fn as one opaque call) in kforge's compilations, `fn`
    interpreted as Thunder does elsewhere."""
    from thunder.core.interpreter import _interpret_call

    interpreted = _copy_of(fn)

    def lookaside(*args, **kwargs):
        if _kforge_compilation():
            return opaque(*args, **kwargs)
        return _interpret_call(interpreted, *args, **kwargs)

    lookaside.__qualname__ = f"kforge.lookasides.{kind}[{getattr(fn, '__qualname__', '?')}]"
    return lookaside


def _dispatch_lookaside(wrapper):
    """The interpreter's call of one dispatch wrapper: opaque (as Thunder runs the function form),
    the source location of the model's line recorded in the symbol's header as for any torch
    function; interpreted, as Thunder would, outside kforge's compilations."""
    from thunder.core.jit_ext import (ensure_recursive_proxies, interpreter_needs_wrap,
                                      record_source_loc_in_symbol_header)

    opaque = ensure_recursive_proxies(interpreter_needs_wrap(record_source_loc_in_symbol_header(wrapper)))
    return _opaque_in_kforge(wrapper, opaque, "dispatch")


# Hugging Face's CompileableContextVar (transformers.utils.output_capturing): the collector of
# requested hidden states / attentions. Its methods take a "compiling" branch when
# torch.compiler.is_compiling(), which Thunder's interpreter answers True, and write the collector
# into attributes of a module-global object: a side effect Thunder's epilogue cannot replay
# (`thunder.jit` of LlamaForCausalLM fails on it). In kforge's compilations the collector is kept
# as the interpreter's own value on a per-thread stack for the duration of the forward that set it:
# what a context variable does, with nothing written outside the trace. A collector that asks for
# outputs is refused (the capturing hooks' appends do not reach the traced result).
_collector = threading.local()


def _collector_stack() -> list:
    stack = getattr(_collector, "stack", None)
    if stack is None:
        stack = _collector.stack = []
    return stack


def _context_var_methods() -> dict:
    """{CompileableContextVar method: "set" / "get" / "reset"}; empty until the process has
    imported transformers (a model of its is built before it is compiled), or in a transformers
    without that class."""
    import sys

    if "transformers" not in sys.modules:
        return {}
    try:
        import importlib

        mod = importlib.import_module("transformers.utils.output_capturing")
    except Exception:  # another version's layout: nothing to stand in for
        return {}
    cls = getattr(mod, "CompileableContextVar", None)
    if cls is None:
        return {}
    return {cls.set: "set", cls.get: "get", cls.reset: "reset"}


def _context_var_lookaside(original, method: str):
    from thunder.core.interpreter import _interpret_call, do_raise, unwrap, wrap_const

    interpreted = _copy_of(original)

    def lookaside(self, *args):
        if not _kforge_compilation():
            return _interpret_call(interpreted, self, *args)
        stack = _collector_stack()
        if method == "set":
            if unwrap(args[0]):
                # Outputs requested: the capturing hooks would not reach the trace's result (a model
                # output without them); refuse rather than return an incomplete answer.
                return do_raise(NotImplementedError(
                    "kforge.jit: transformers' output capture (output_hidden_states / output_attentions / "
                    "...) is not traced by thunder.jit; call the model without it, or use kforge.compile"))
            stack.append(args[0])
            return wrap_const(None)  # the token reset receives
        if method == "get":
            return stack[-1] if stack else wrap_const(None)
        if stack:
            stack.pop()
        return wrap_const(None)

    lookaside.__qualname__ = f"kforge.lookasides.context_var[{original.__qualname__}]"
    return lookaside


# torch functions written in Python that Thunder 0.2.6 registers automatically as opaque symbols,
# whose automatic backward cannot differentiate them: in kforge's compilations the interpreter runs
# torch's own Python instead, so every op inside becomes Thunder's (and kforge's) symbol and autograd
# is Thunder's. `F.multi_head_attention_forward` (`nn.MultiheadAttention`, `nn.TransformerEncoder` /
# `Decoder` layers): its automatic registration stops every training trace ("keyword argument that
# requires gradient" -- the float attn_mask counts as one), and its backward would run the forward
# again through torch.autograd.functional.vjp. Interpreted, it is in-projection linears, SDPA (which
# kforge's attention claims where cuDNN takes it) and the out-projection.
_OVERRIDDEN: dict = {}  # the function -> Thunder's own lookaside for it, taken at install()


def _interpreted_in_kforge(fn):
    """A lookaside for `fn` that has Thunder's interpreter run fn's Python in kforge's compilations,
    and calls Thunder's own lookaside for it elsewhere."""
    from thunder.core.interpreter import _interpret_call

    interpreted = _copy_of(fn)

    def lookaside(*args, **kwargs):
        if _kforge_compilation() or fn not in _OVERRIDDEN:
            return _interpret_call(interpreted, *args, **kwargs)
        return _OVERRIDDEN[fn](*args, **kwargs)

    lookaside.__qualname__ = f"kforge.lookasides.interpreted[{fn.__qualname__}]"
    return lookaside


_overrides: dict | None = None  # function -> kforge's lookaside, replacing Thunder's while installed

# Thunder's interpreter gives a tensor's `.dtype` as Thunder's dtype object, which compares unequal to
# every torch dtype: under thunder.jit `x.dtype == torch.float32` is False for a float32 tensor and
# `mask.dtype != torch.bool` True for a bool mask, so a model that branches on a dtype silently takes
# the other branch (torch's own `F._canonical_mask` then rejects every bool mask:
# nn.TransformerEncoder with src_key_padding_mask). Compare ops run natively in the interpreter (not
# interpreted), on Thunder's dtype class's __eq__; while installed, in kforge's compilations, a torch
# dtype on the other side is taken as Thunder's dtype for it (`!=` is __eq__ negated, and
# `torch.float32 == x.dtype` reaches it reflected). Elsewhere the comparison is Thunder's.
_DTYPE_EQ = None  # thunder.core.dtypes.dtype.__eq__, taken at the first install()

# A module constructed inside the forward (Hugging Face's heads: `loss_fct = CrossEntropyLoss()`)
# registers its buffers there (`register_buffer("weight", None)` writes its `_buffers`). Thunder
# 0.2.6 records that write like one to a module of the model and, looking for the model's module
# that owns it, stops on an assertion (thunder_general_jit -> process_recorded_modifications). The
# object was made during the trace and is not reachable from the model or the inputs: nothing
# outside the trace can see the write, and the epilogue has nothing to replay. In kforge's
# compilations such writes are left out before Thunder processes the rest.
_PROCESS_MODIFICATIONS = None  # thunder.core.jit_ext.process_recorded_modifications, taken at install()
_MEMBER_DICTS = ("_buffers", "_parameters", "_modules")


def _dict_of(modified, names: tuple[str, ...]):
    """The provenance of the object whose attribute `modified` (a wrapped dict) is, when that
    attribute is one of `names` (`__dict__`, a module's `_buffers`, ...), else None."""
    from thunder.core.interpreter import PseudoInst

    p = getattr(modified, "provenance", None)
    if (p is not None and p.inst is PseudoInst.LOAD_ATTR and len(p.inputs) == 2
            and p.inputs[1].inst is PseudoInst.CONSTANT and p.inputs[1].value in names):
        return p.inputs[0]
    return None


def _made_in_trace(modified) -> bool:
    """Whether `modified` (a wrapped dict) is a member dictionary of a module the traced code itself
    constructed: its owner is the result of a `__new__` call made during the trace. (A module reached
    any other way, an opaque call included, may be the model's: its writes stay with Thunder.)"""
    from thunder.core.interpreter import PseudoInst

    owner = _dict_of(modified, _MEMBER_DICTS)
    if owner is None:
        return False
    if owner.inst is PseudoInst.NEW:
        return True
    callee = owner.inputs[0] if owner.inst is PseudoInst.OPAQUE and owner.inputs else None
    return (callee is not None and callee.inst is PseudoInst.CONSTANT
            and getattr(callee.value, "__name__", None) == "__new__")


def _replay_string_attributes(ctx, epilogue_trace) -> None:
    """Attributes of the model's objects set to a string in forward (Hugging Face's classification
    heads: `self.config.problem_type = "single_label_classification"` at the first call with labels)
    are set by the epilogue, as Thunder sets numbers; Thunder 0.2.6 asserts on anything else."""
    from thunder.core import prims
    from thunder.core.interpreter import PseudoInst
    from thunder.core.trace import tracectx

    for modified, mods in list(ctx._additional_outputs.items()):
        owner = _dict_of(modified, ("__dict__",))
        if owner is None or not isinstance(modified.value, dict):
            continue
        last = {}
        for inst, *args in mods:
            if inst is PseudoInst.STORE_SUBSCR:
                last[args[1].value] = args[2].value
        strings = {k: v for k, v in last.items() if isinstance(v, str)}
        if not strings:
            continue
        if hasattr(owner, "proxy"):  # as Thunder: an object the epilogue cannot name is not written
            with tracectx(epilogue_trace):
                for name, value in strings.items():
                    epilogue_trace.bound_symbols.append(prims.pack_attr.bind(owner.proxy, name, value, output=None))
        rest = [m for m in mods if not (m[0] is PseudoInst.STORE_SUBSCR and m[2].value in strings)]
        if rest:
            ctx._additional_outputs[modified] = rest
        else:
            del ctx._additional_outputs[modified]


def _process_recorded_modifications(ctx, epilogue_trace):
    if _kforge_executor_in_use():  # the interpreter is done here: only the compile data is left
        for modified in [m for m in ctx._additional_outputs if _made_in_trace(m)]:
            del ctx._additional_outputs[modified]
        _replay_string_attributes(ctx, epilogue_trace)
    return _PROCESS_MODIFICATIONS(ctx, epilogue_trace)


def _dtype_eq(self, other) -> bool:
    if isinstance(other, torch.dtype) and _kforge_compilation():
        from thunder.core.dtypes import to_dtype

        other = to_dtype(other)
    return _DTYPE_EQ(self, other)


# `Tensor.requires_grad_` has no Thunder method (a traced tensor's `x.requires_grad_` is "Unknown
# attribute"). Hugging Face's gradient checkpointing registers a forward hook on the input embeddings
# that calls `output.requires_grad_(True)` (so reentrant checkpoints see a tensor that requires grad
# when the embeddings are frozen): `gradient_checkpointing_enable()` models stopped in the trace. In a
# Thunder trace every value computed from a parameter that requires grad gets its gradient anyway, so
# `requires_grad_(True)` is the tensor itself in kforge's compilations; `requires_grad_(False)` (a
# detach in place) is refused by name. Outside kforge's compilations the call raises Thunder's error.
def _requires_grad_(a, requires_grad=True):
    if not _kforge_compilation():
        raise AttributeError("Unknown attribute requires_grad_")
    if requires_grad is not True:
        raise NotImplementedError("kforge.jit: Tensor.requires_grad_(False) inside the traced function is not "
                                  "supported; use .detach()")
    return a


# `torch.utils.checkpoint.checkpoint(..., use_reentrant=True)` (Hugging Face's
# `gradient_checkpointing_enable()` with use_reentrant=True): Thunder 0.2.6 refuses it (and its
# refusal itself fails: "exceptions must derive from BaseException"). In a Thunder trace the two
# kinds differ in nothing the trace computes (Thunder's checkpoint marks the region for recomputation
# in the backward either way; the inputs' requires-grad bookkeeping that reentrant checkpoints need is
# autograd's, and Hugging Face sets it up with `requires_grad_` above), so kforge's compilations take
# it as use_reentrant=False.
def _checkpoint_lookaside(function, *args, **kwargs):
    from thunder.core.interpreter import unwrap, wrap_const

    if "use_reentrant" in kwargs and unwrap(kwargs["use_reentrant"]) and _kforge_compilation():
        kwargs["use_reentrant"] = wrap_const(False)
    return _OVERRIDDEN[torch.utils.checkpoint.checkpoint](function, *args, **kwargs)


_checkpoint_lookaside.__qualname__ = "kforge.lookasides.checkpoint"


def _our_overrides() -> dict:
    global _overrides
    if _overrides is None:
        import torch.nn.functional as F
        import torch.utils.checkpoint

        _overrides = {F.multi_head_attention_forward: _interpreted_in_kforge(F.multi_head_attention_forward),
                      torch.utils.checkpoint.checkpoint: _checkpoint_lookaside}
    return _overrides


def _caching_dis() -> types.ModuleType:
    """A stand-in for the `dis` module whose get_instructions(code) is remembered per code object;
    everything else, and any other call form, is the real module's."""
    memo: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
    shim = types.ModuleType("dis", "kforge.lookasides: dis with get_instructions(code) remembered")
    shim.__dict__.update({k: v for k, v in _dis.__dict__.items() if not k.startswith("__")})

    def get_instructions(x, **kwargs):
        if kwargs or not isinstance(x, types.CodeType):
            return _dis.get_instructions(x, **kwargs)
        insts = memo.get(x)
        if insts is None:  # equal code objects (same bytecode, constants, names, lines) share it
            insts = memo[x] = tuple(_dis.get_instructions(x))
        return iter(insts)

    shim.get_instructions = get_instructions
    return shim


_DIS = _caching_dis()


def _autograd_link_torch() -> types.ModuleType:
    """`torch` as thunder.executors.torch_autograd sees it: the real module, except that a tensor
    asked of `randn` on the meta device is made by `empty`. Thunder links its two autograd Functions
    with such a tensor (`torch.randn(1, device="meta", requires_grad=True)` in the forward, another in
    the backward); a meta tensor holds no values, so the two are the same tensor, but meta `randn` runs
    torch's Python reference decomposition: 220 and 40 us a step against 2 us on a development CPU."""
    shim = types.ModuleType("torch", "kforge.lookasides: torch, with meta randn made by empty")

    def randn(*size: Any, **kwargs: Any) -> torch.Tensor:
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "meta" and "generator" not in kwargs:
            return torch.empty(*size, **kwargs)
        return torch.randn(*size, **kwargs)

    def missing(name: str) -> Any:  # a module's __getattr__: torch's attribute, kept on first use
        value = getattr(torch, name)
        setattr(shim, name, value)
        return value

    shim.randn = randn
    shim.__getattr__ = missing
    return shim


_AUTOGRAD_TORCH = _autograd_link_torch()


@functools.cache
def _output_link() -> type:
    """Thunder's ThunderOutputFunction (thunder.executors.torch_autograd) as its autograd link calls
    it, but given only the arguments that an output is or views. Thunder passes it every argument of
    the call (each parameter of the model) so that an output which is an argument as it came in does
    not make autograd move a leaf into the graph; the function reads none of them and returns None
    for each. An autograd Function's apply costs about 1.5 us an argument on a development CPU (its
    Python wrapper unwraps each, the engine then makes an edge for each): for a GPT-2's 150
    parameters about 0.2 ms a step, between the forward's last kernel and the backward's first."""
    from thunder.executors.torch_autograd import ThunderOutputFunction

    class ThunderOutputLink(ThunderOutputFunction):
        _kforge_thunders = ThunderOutputFunction  # for code that patches Thunder's class itself

        @classmethod
        def apply(cls, dummy: Any, side_channel: Any, *args: Any) -> Any:
            outs = side_channel.get("fw") if isinstance(side_channel, dict) else None
            if not isinstance(outs, (tuple, list)):
                return super().apply(dummy, side_channel, *args)
            ids = set()
            for o in outs:
                if isinstance(o, torch.Tensor):
                    ids.add(id(o))
                    if o._base is not None:  # a view's _base is its storage's root tensor
                        ids.add(id(o._base))
            return super().apply(dummy, side_channel, *[a for a in args if id(a) in ids])

    ThunderOutputLink.__module__ = __name__
    return ThunderOutputLink


@functools.cache
def _forward_link() -> type:
    """Thunder's ThunderFunction (thunder.executors.torch_autograd), whose apply takes every argument
    of the call, with torch's unwrapping of dead functorch wrappers (a Python call per argument, 0.7
    us each on a development CPU) skipped where it has nothing to do: no functorch transform active and
    no argument a functorch grad wrapper (`kforge._C.has_grad_wrapper`, one C++ pass)."""
    from thunder.executors.torch_autograd import ThunderFunction

    try:
        from ._C import has_grad_wrapper
    except ImportError:
        has_grad_wrapper = None

    class ThunderFunctionLink(ThunderFunction):
        _kforge_thunders = ThunderFunction  # for code that patches Thunder's class itself

        @classmethod
        def apply(cls, *args: Any) -> Any:
            if has_grad_wrapper is None or torch._C._are_functorch_transforms_active() or has_grad_wrapper(args):
                return super().apply(*args)  # torch.autograd.Function.apply, which unwraps
            return super(torch.autograd.Function, cls).apply(*args)  # the C++ apply it then calls

    ThunderFunctionLink.__module__ = __name__
    return ThunderFunctionLink


_GLOBALS_LOOKUP = None  # Thunder's interpreter.globals_lookup, taken at the first install()


def _globals_lookup(globals_dict, name):
    """Thunder's `globals_lookup` (every LOAD_GLOBAL the interpreter runs) with each dictionary read
    made as one call of `dict.__getitem__` on the wrapped dictionary, where Thunder interprets a
    `lambda d, k: d[k]` for it (a frame, a BINARY_SUBSCR and the frame of its `__getitem__` helper):
    the same lookaside answers, with the same provenance. A builtin (`len`, `getattr`, `type`, ...,
    two reads: `__builtins__`, then the name) cost about 1.3 ms, a third of the trace time of a
    Hugging Face Llama layer. Anything but plain dictionaries, a name that is nowhere (NameError), or
    a compilation without kforge's executor: Thunder's own function."""
    from thunder.core.interpreter import WrappedValue, _interpret_call, unwrap, wrap_const

    ug, uname = unwrap(globals_dict), unwrap(name)
    if (isinstance(globals_dict, WrappedValue) and type(ug) is dict and type(uname) is str
            and _kforge_compilation()):
        if uname in ug:
            return _interpret_call(dict.__getitem__, globals_dict, name)
        ub = ug.get("__builtins__")
        if type(ub) is dict and uname in ub:
            builtins = _interpret_call(dict.__getitem__, globals_dict, wrap_const("__builtins__"))
            return _interpret_call(dict.__getitem__, builtins, name)
    return _GLOBALS_LOOKUP(globals_dict, name)


def _methods() -> dict:
    """Thunder's Tensor-method table (name -> function) for traced tensors."""
    import importlib

    return importlib.import_module("thunder.torch.langctx")._method_name_to_fn_map


def _interpreter_module():
    import thunder.core.interpreter as interpreter

    return interpreter


def _opaque_lookaside(fn):
    """`fn` run by the interpreter as one opaque call (as it runs builtins) in kforge's compilations.
    For pure functions of Python objects that hold no tensor."""
    from thunder.core.jit_ext import interpreter_needs_wrap

    return _opaque_in_kforge(fn, interpreter_needs_wrap(fn), "opaque")


_entries: dict | None = None  # the function each lookaside stands in for -> the lookaside


def _our_entries() -> dict:
    global _entries
    if _entries is None:
        _entries = {_CALL_IMPL: _call_impl_lookaside, _WRAPPED_CALL_IMPL: _wrapped_call_impl_lookaside,
                    _GETATTR: _module_getattr_lookaside, tuple.__contains__: _sequence_contains_lookaside,
                    list.__contains__: _sequence_contains_lookaside, next: _next_lookaside,
                    dict.__getitem__: _dict_getitem_lookaside}
        for w in _dispatch_wrappers():
            _entries[w] = _dispatch_lookaside(w)
        # A dataclass's field list (transformers' ModelOutput reads it on every attribute it sets).
        _entries[dataclasses.fields] = _opaque_lookaside(dataclasses.fields)
        from thunder.core.jit_ext import interpreter_needs_wrap

        _entries[_requires_grad_] = interpreter_needs_wrap(_requires_grad_)  # run as one call
    for original, method in _context_var_methods().items():  # once transformers is imported
        if original not in _entries:
            _entries[original] = _context_var_lookaside(original, method)
    tag = _dynamo_module_tag()
    if tag is not None and tag not in _entries:
        _entries[tag] = _opaque_lookaside(tag)
    return _entries


def _dynamo_module_tag() -> Any:
    """torch._dynamo's `GenerationTracker.tag` (the function), once the process has imported Dynamo;
    else None. Dynamo patches `nn.Module.__init__` to record every module made after its import in a
    process-wide weak dictionary. A forward that makes a module (Hugging Face's BERT builds its
    `CrossEntropyLoss` there) would have that write interpreted: Thunder wraps every entry of the
    dictionary first (every module of the process), and a module collected meanwhile removes its entry
    during that loop ("dictionary changed size during iteration", seen once in a run of the suite).
    The write is Dynamo's bookkeeping, nothing the trace needs: it runs as one opaque call."""
    import sys

    guard = sys.modules.get("torch._dynamo.mutation_guard")
    tracker = getattr(guard, "GenerationTracker", None)
    tag = getattr(tracker, "tag", None)
    return getattr(tag, "__func__", None)


def _patches() -> list[tuple[Any, str, Any, str]]:
    """(owner, attribute, kforge's value, the module global keeping Thunder's) for every attribute of
    Thunder's that install() replaces: Thunder's value is taken at the first install() and put back
    by uninstall()."""
    from thunder.core import dtypes, jit_ext
    from thunder.executors import torch_autograd

    interpreter = _interpreter_module()
    return [(interpreter, "dis", _DIS, "_THUNDERS_DIS"),
            (interpreter, "globals_lookup", _globals_lookup, "_GLOBALS_LOOKUP"),
            (dtypes.dtype, "__eq__", _dtype_eq, "_DTYPE_EQ"),
            (jit_ext, "process_recorded_modifications", _process_recorded_modifications, "_PROCESS_MODIFICATIONS"),
            (torch_autograd, "torch", _AUTOGRAD_TORCH, "_THUNDERS_TORCH"),
            (torch_autograd, "ThunderOutputFunction", _output_link(), "_THUNDERS_OUTPUT_FUNCTION"),
            (torch_autograd, "ThunderFunction", _forward_link(), "_THUNDERS_FUNCTION")]


_THUNDERS_DIS = None  # the interpreter module's `dis`, taken at the first install()
_THUNDERS_TORCH = None  # thunder.executors.torch_autograd's `torch`, taken at the first install()
_THUNDERS_OUTPUT_FUNCTION = None  # its ThunderOutputFunction, taken at the first install()
_THUNDERS_FUNCTION = None  # its ThunderFunction, taken at the first install()


def install() -> bool:
    """Registers kforge's lookasides with Thunder's interpreter (once per process): module calls and
    attribute reads, the DTensor dispatch wrappers, transformers' context variable, containment tests,
    `next`, the global-name lookup and the remembered disassembly; the autograd link's meta tensor made
    by `torch.empty`, its output half given only the arguments an output is and its forward half
    applied without torch's functorch unwrapping where there is nothing to unwrap; in place of
    Thunder's own entries, `F.multi_head_attention_forward` interpreted and reentrant checkpoints
    traced as non-reentrant; dtype comparisons as torch's; writes to modules made during the trace left out;
    `Tensor.requires_grad_`; a dict subclass's stored items read with dict's own method. False where
    something else already holds one of the other entries (that one stays as it is; the others are
    registered)."""
    from thunder.core.jit_ext import _general_jit_lookaside_map

    ok = True
    for fn, lookaside in _our_entries().items():
        ok &= _general_jit_lookaside_map.setdefault(fn, lookaside) is lookaside
    for fn, lookaside in _our_overrides().items():
        if _general_jit_lookaside_map.get(fn) is not lookaside:
            if fn in _general_jit_lookaside_map:
                _OVERRIDDEN.setdefault(fn, _general_jit_lookaside_map[fn])
            _general_jit_lookaside_map[fn] = lookaside
    ok &= _methods().setdefault("requires_grad_", _requires_grad_) is _requires_grad_
    kept = globals()
    for owner, attr, ours, keep in _patches():
        current = getattr(owner, attr)
        if kept[keep] is None and current is not ours:
            kept[keep] = current
        if current is kept[keep]:
            setattr(owner, attr, ours)
        ok &= getattr(owner, attr) is ours
    return ok


def installed() -> bool:
    """Whether every lookaside of kforge's is registered."""
    from thunder.core.jit_ext import _general_jit_lookaside_map

    return (all(_general_jit_lookaside_map.get(fn) is la
                for fn, la in (*_our_entries().items(), *_our_overrides().items()))
            and _methods().get("requires_grad_") is _requires_grad_
            and all(getattr(owner, attr) is ours for owner, attr, ours, _ in _patches()))


def uninstall() -> None:
    """Removes kforge's lookasides; Thunder interprets those functions again (the next trace onwards)."""
    from thunder.core.jit_ext import _general_jit_lookaside_map

    for fn, lookaside in _our_entries().items():
        if _general_jit_lookaside_map.get(fn) is lookaside:
            del _general_jit_lookaside_map[fn]
    for fn, lookaside in _our_overrides().items():
        if _general_jit_lookaside_map.get(fn) is lookaside:
            if fn in _OVERRIDDEN:
                _general_jit_lookaside_map[fn] = _OVERRIDDEN[fn]
            else:
                del _general_jit_lookaside_map[fn]
    if _methods().get("requires_grad_") is _requires_grad_:
        del _methods()["requires_grad_"]
    kept = globals()
    for owner, attr, ours, keep in _patches():
        if getattr(owner, attr) is ours:
            setattr(owner, attr, kept[keep])
