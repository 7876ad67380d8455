"""CUDA graphs over Thunder's traces: Thunder's `CUDAGraphTransform`, with a runner that hands the
backward's gradients to autograd without a copy and checks each call's arguments without hashing them.

    jmodel = kforge.jit(model, cudagraphs=True)
    jmodel = kforge.jit(model, transforms=[kforge.cudagraphs.CUDAGraphs()])   # the same

What thunder 0.2.6's runner (`thunder/transforms/cudagraph.py`) does, and what this one changes:

- Regions and capture are Thunder's: the forward and the backward trace each become one graph (or a
  few, split where a symbol cannot be captured); the forward's outputs that the backward saves are
  used by the backward graph in place (Thunder tags them static).
- **Gradients.** Thunder returns the backward graph's output buffers themselves. The runner keeps a
  reference to them, so autograd's AccumulateGrad cannot take the tensor as `param.grad` and clones
  it: one device copy per parameter per step (115 copies, 0.27 ms a step on the bench-size Llama on an
  H200; 152 on GPT-2 124M) and as many host calls. Here the backward's outputs are handed out as
  fresh aliases of the buffers, which AccumulateGrad takes as they are. Before the graph writes the
  buffers again, the runner checks (by storage use count) that nobody else holds them. If somebody
  does (gradient accumulation or `zero_grad(set_to_none=False)` keep `param.grad`, which is the last
  step's buffer; or the user kept a view of a gradient), the graph is retired, its buffers are left
  to their holders, and a new graph is captured that returns its buffers as Thunder's does (so
  AccumulateGrad copies or adds, as it did under Thunder's runner). Nothing anyone holds is
  overwritten, and a training loop that zeroes gradients to None never copies them.
- **Arguments.** Thunder builds a descriptor (dtype, sizes, strides) of every argument on every call
  and hashes it to find the graph: hundreds of tensors per call. Here the graph used last is checked
  first, argument by argument (identity, then layout), and only a mismatch takes Thunder's path.

Not changed: like Thunder's, the forward's outputs are the forward graph's buffers, so a forward that
runs again before the backward of its previous call overwrites what that backward saved (as with any
CUDA graph that is not torch.compile's graph trees); train with forward / backward alternating.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from thunder.transforms.cudagraph import CUDAGraphRunner, CUDAGraphTransform

__all__ = ["CUDAGraphs", "GraphRunner"]


def _storage_uses(t: torch.Tensor) -> int:
    """How many tensors share `t`'s storage (+1 for the storage object this call makes)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class _Handout:
    """One captured graph as the runner uses it: the graph, its static inputs and outputs (as
    Thunder's cache holds them), which outputs it hands out as aliases, and their storages' use
    counts while only the runner holds them."""

    __slots__ = ("graph", "inputs", "outputs", "aliased", "aliasing", "baseline")

    def __init__(self, entry: tuple, alias: bool) -> None:
        self.graph, self.inputs, self.outputs = entry
        outs = self.outputs if isinstance(self.outputs, (tuple, list)) else (self.outputs,)
        in_storages = {t.untyped_storage().data_ptr() for t in self.inputs if isinstance(t, torch.Tensor)}
        # Alias only what the graph's own pool holds: an output that is an input (a parameter, a saved
        # tensor) passed through is someone else's memory.
        self.aliased = tuple(alias and isinstance(o, torch.Tensor)
                             and o.untyped_storage().data_ptr() not in in_storages for o in outs)
        self.aliasing = any(self.aliased)
        self.baseline = tuple(_storage_uses(o) if a else 0 for o, a in zip(outs, self.aliased))

    def held(self) -> bool:
        """Whether anything besides the runner holds an aliased output's storage."""
        outs = self.outputs if isinstance(self.outputs, (tuple, list)) else (self.outputs,)
        return any(a and _storage_uses(o) > b for o, a, b in zip(outs, self.aliased, self.baseline))

    def hand_out(self) -> Any:
        if not self.aliasing:
            return self.outputs
        outs = self.outputs
        seq = outs if isinstance(outs, (tuple, list)) else (outs,)
        res = [o.detach() if a else o for o, a in zip(seq, self.aliased)]
        return type(outs)(res) if isinstance(outs, (tuple, list)) else res[0]


class GraphRunner(CUDAGraphRunner):
    """Thunder's CUDAGraphRunner with aliased backward outputs and a per-argument fast path (see the
    module docstring). `alias_names`: the graphs (by Thunder's fusion name) whose outputs are
    handed out as aliases; the transform adds the backward trace's graphs. `stats`: replays, graphs
    retired because their outputs were held, full argument lookups."""

    def __init__(self) -> None:
        super().__init__(share_mem_pool=False)
        self.alias_names: set[str] = set()
        self._last: dict[str, _Handout] = {}
        self.stats = {"replays": 0, "retired": 0, "slow_lookups": 0}

    def call_cuda_graph(self, fn_name: str, *args: Any) -> Any:
        h = self._last.get(fn_name)
        copies = self._fits(h, args) if h is not None else None
        if copies is None:
            h = self._lookup(fn_name, args, rebuild=False)
            copies = self._fits(h, args)
            assert copies is not None, f"{fn_name}: the graph built for these arguments does not fit them"
        if h.aliasing and h.held():
            # Last call's outputs are still held (accumulated gradients, a kept view): leave them to
            # their holders and capture a graph that hands out its buffers as Thunder's runner does.
            self.stats["retired"] += 1
            self.alias_names.discard(fn_name)
            h = self._lookup(fn_name, args, rebuild=True)
            copies = self._fits(h, args)
        for static, arg in copies:
            static.copy_(arg)
        h.graph.replay()
        self.stats["replays"] += 1
        return h.hand_out()

    def _lookup(self, fn_name: str, args: tuple, *, rebuild: bool) -> _Handout:
        """Thunder's path: the full argument descriptor, the graph cache, a capture on a miss (or
        always, with `rebuild`)."""
        self.stats["slow_lookups"] += 1
        key = self.make_cache_key(fn_name, *args)
        entry = None if rebuild else self.cuda_graph_cache.get(key)
        if entry is None:
            self.cuda_graph_cache.pop(key, None)  # a retired graph goes; its held buffers stay valid
            entry = self.build_cuda_graph(self.python_callables[fn_name][0], args,
                                          self.make_static_inputs_mask(fn_name, *args))
            self.cuda_graph_cache[key] = entry
        h = self._last.get(fn_name)
        if h is None or h.graph is not entry[0]:
            h = _Handout(entry, fn_name in self.alias_names)
            self._last[fn_name] = h
        return h

    @staticmethod
    def _fits(h: _Handout, args: tuple) -> list | None:
        """The (static input, argument) pairs to copy before replaying h's graph with `args`, or None
        if an argument's type, dtype, device, shape or strides differ from the captured ones."""
        if len(args) != len(h.inputs):
            return None
        copies = []
        for static, arg in zip(h.inputs, args):
            if static is arg:
                continue
            if isinstance(static, torch.Tensor):
                if (not isinstance(arg, torch.Tensor) or arg.dtype != static.dtype or arg.device != static.device
                        or arg.shape != static.shape or arg.stride() != static.stride()):
                    return None
                if arg.data_ptr() != static.data_ptr():  # a saved tensor Thunder detached is the same memory
                    copies.append((static, arg))
            elif isinstance(arg, torch.Tensor) or type(arg) is not type(static) or arg != static:
                return None
        return copies


class CUDAGraphs(CUDAGraphTransform):
    """Thunder's CUDAGraphTransform with kforge's `GraphRunner`: pass it in `transforms=[...]` of
    `kforge.jit`, `kforge.compile` or `thunder.jit`, or use `kforge.jit(model, cudagraphs=True)`.
    `runner.stats` counts replays, retired graphs and full argument lookups."""

    def __init__(self) -> None:
        super().__init__(share_mem_pool=False)
        self.cuda_graph_runner = GraphRunner()
        self._backward = False

    @property
    def runner(self) -> GraphRunner:
        return self.cuda_graph_runner

    def fuse(self, region: Any, fusion_counter: int) -> Any:
        bsym = super().fuse(region, fusion_counter)
        if self._backward:
            self.cuda_graph_runner.alias_names.add(bsym.sym.name)
        return bsym

    def transform_trace_post_optimization(self, trace: Any, **kwargs: Any) -> Any:
        self._backward = trace.siginfo().name == "backward_fn"
        try:
            return super().transform_trace_post_optimization(trace, **kwargs)
        finally:
            self._backward = False


def with_cudagraphs(transforms: Sequence[Any], cudagraphs: bool) -> list:
    """`transforms` plus a `CUDAGraphs()` at the end when `cudagraphs` (unless one is there)."""
    out = list(transforms)
    if cudagraphs and not any(isinstance(t, CUDAGraphTransform) for t in out):
        out.append(CUDAGraphs())
    return out


def _check(who: str, cudagraphs: object) -> None:
    if not isinstance(cudagraphs, bool):
        raise TypeError(f"{who}: cudagraphs must be True or False, got {cudagraphs!r}")

