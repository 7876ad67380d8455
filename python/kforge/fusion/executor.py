"""kforge's fusion executor: a Thunder FusionExecutor whose regions run as generated CUDA kernels.

Placed after kforge's operator executor and Thunder's attention executors (`kforge.executors()`), it
claims every elementwise, view, cat / pad and reduction prim they leave; its fusion pass
(`partition.py`) groups them into regions, and each region becomes one `kforge._C.GeneratedKernel`
(`codegen.py` writes its source per input layout; the runtime compiles it with NVRTC, caches it in
memory and on disk, and launches it on PyTorch's current stream).

Regions with the same structure (ops, shapes, dtypes) share one GeneratedKernel, so the twelve
layers of a model compile each kernel once. The all-contiguous variant of every region is compiled
on a thread pool as soon as the fusion pass ends; a second process loads the CUBINs from disk.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from thunder.core.proxies import TensorProxy, unvariableify
from thunder.core.symbol import BoundSymbol, BoundSymbolTag, Symbol
from thunder.core.trace import TraceCtx, TraceProvenance, from_trace
from thunder.core.transform_common import dce
from thunder.extend import FusionExecutor

from .. import __version__
from . import codegen, ir as fir
from .dedupe import dedupe_views
from .input_casts import gather_input_casts
from .matmul_acc import accumulate_matmuls, widen_matmuls
from .norm_epilogues import (copy_norm_grads, drop_zero_dresiduals, fold_branch_adds, fold_residual_grads,
                             narrow_norm_outputs, sum_norm_grads)
from .partition import Group, partition

__all__ = ["KforgeFusionExecutor", "FusedRegion", "FusionInfo", "regions", "lower_fusion", "describe"]

_TORCH_DTYPE_NAME = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "bool": "bool", "i32": "int32",
                     "i64": "int64"}


@dataclass
class FusedRegion:
    """One region structure and its kernel. `kernel` is called like the region: tensors and numbers
    in, a tuple of tensors out."""

    ir: fir.RegionIR
    key: str
    kernel: Any = None
    sources: dict = field(default_factory=dict)    # layout key -> KernelSource

    @property
    def name(self) -> str:
        return self.kernel.name


class _Passthrough:
    """A region whose every output is one of its inputs (cast round trips, identity views): returns
    them, launches nothing."""

    name = "none (outputs are inputs)"

    def __init__(self, sources: Sequence[int]) -> None:
        self.args = tuple(-s - 1 for s in sources)

    def __call__(self, *args: Any) -> tuple:
        return tuple(args[i] for i in self.args)


@dataclass
class FusionInfo:
    """What one fusion symbol of a trace holds (for kforge.inspect)."""

    name: str
    ops: list[str]
    kernel: str | None
    schedule: str
    reason: str | None = None   # why it runs on torch instead of a generated kernel


_lock = threading.Lock()
_regions: dict[str, FusedRegion] = {}
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pending: dict[str, concurrent.futures.Future] = {}


def regions() -> list[FusedRegion]:
    """Every region structure built in this process."""
    with _lock:
        return list(_regions.values())


def forget_regions() -> None:
    """Drop this process's region structures and their loaded kernels, so that the next trace builds
    and compiles (or loads from the disk cache) its regions afresh; traces built before keep theirs.
    For benchmarks that time a cold first step: the kernel handles these objects hold would otherwise
    skip the compile and the disk cache."""
    with _lock:
        for fut in _pending.values():
            fut.cancel()
        _regions.clear()
        _pending.clear()


def _sm_count(device: int) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def _get_region(ir: fir.RegionIR, device: int) -> FusedRegion:
    from .. import _C

    key = structural_key(ir)
    with _lock:
        hit = _regions.get(key)
        if hit is not None:
            return hit
        fr = FusedRegion(ir, key)

        def generate(layout: str, dev: int) -> dict:
            ks = codegen.generate(fr.ir, layout, sm_count=_sm_count(dev))
            fr.sources[layout] = ks
            fut = _pending.get(ks.program)
            if fut is not None:
                fut.result()  # the same source is compiling on the pool: wait, then hit the cache
            return ks.to_spec()

        args = [(_TORCH_DTYPE_NAME[a.dtype], list(a.shape)) if a.op == "input" else None for a in ir.args]
        outs = [(_TORCH_DTYPE_NAME[o.dtype], list(o.shape)) for o in ir.kernel_outputs()]
        sources = ir.output_sources()
        out_map = [] if sources == list(range(len(sources))) else sources
        plan = fir.view_plan(ir)
        view = None if plan is None else (plan[0], [tuple(list(x) if isinstance(x, tuple) else x for x in st)
                                                    for st in plan[1]])
        digest = key.__hash__() & 0xFFFFFFFF
        fr.kernel = _C.GeneratedKernel(f"fusion_{len(_regions)}_{digest:08x}", args, outs, generate, device,
                                       out_map=out_map, view=view)
        _regions[key] = fr
        return fr


def structural_key(ir: fir.RegionIR) -> str:
    """The region's structure without proxy names: equal keys compute the same function."""
    lines = []
    for v in ir.values:
        args = ",".join(f"%{a.id}" if isinstance(a, fir.Value) else repr(a) for a in v.args)
        lines.append(f"{v.id}:{v.op}:{v.dtype}:{v.shape}:{args}:{sorted(v.attrs.items())}")
    # every output by value id: an input returned as is, or one value returned twice, is part of it
    lines.append("out:" + ",".join(str(o.id) for o in ir.outputs))
    return "\n".join(lines)


def _precompile(frs: Sequence[FusedRegion], device: int) -> None:
    """Compile each region's all-contiguous variant on a thread pool (NVRTC releases the GIL)."""
    global _pool
    import torch

    from .. import _C

    if not torch.cuda.is_available():
        return
    arch = _C.device_arch(device)
    sm = _sm_count(device)
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1)),
                                                          thread_name_prefix="kforge-nvrtc")
        for fr in frs:
            try:
                ks = codegen.generate(fr.ir, codegen.default_key(fr.ir), sm_count=sm)
            except fir.Unsupported:
                continue
            if ks.program in _pending or not ks.launches:
                continue
            _pending[ks.program] = _pool.submit(_C.compile_generated, ks.program, ks.source,
                                                [k for k, *_ in ks.launches], arch)


def _torch_callable(bsyms: Sequence[BoundSymbol], inputs: Sequence[Any], outputs: Sequence[Any]):
    """The region run by Thunder's torch executor (for a region no kernel can express)."""
    from thunder.core import prims
    from thunder.core.codeutils import SigInfo
    from thunder.core.trace import tracectx
    from thunder.executors.passes import transform_for_execution
    from thunder.executors.torchex import ex as torch_ex

    trace = TraceCtx(None)
    trace.args = list(inputs)
    trace.kwargs = {}
    trace.names = {a.name for a in inputs}
    with tracectx(trace):
        for a in inputs:
            prims.unpack_trivial(a, name=a.name)
    trace.bound_symbols += list(bsyms)
    trace.bound_symbols.append(prims.python_return.bind(list(outputs), output=None))
    for b in trace.bound_symbols:
        for o in b.flat_outs:
            if o is not None and hasattr(o, "name"):
                trace.add_name(o.name)
    trace._siginfo = SigInfo("kforge_fusion_fallback")
    trace._siginfo.args = [(a.name, None) for a in inputs]
    extrace = transform_for_execution(trace, executors_list=(torch_ex,))
    return _TorchRegion(extrace.python_callable(include_decorators=False))


class _TorchRegion:
    """A region run by Thunder's torch executor: `program` is its trace's Python program (a class
    rather than a closure, so that kforge.trace_cache can find the program and rebuild it)."""

    def __init__(self, program: Any) -> None:
        self.program = program

    def __call__(self, *args: Any) -> tuple:
        out = self.program(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else (out,)


class KforgeFusionExecutor(FusionExecutor):
    """Generates one CUDA kernel per region of elementwise / view / reduction prims."""

    def __init__(self) -> None:
        super().__init__("kforge_fusion", version=__version__)
        for pid in fir.supported_prim_ids():
            self.register_supported(pid, _checker)
        self.infos: dict[str, FusionInfo] = {}
        self.left_out: dict[str, dict[str, int]] = {}  # prim name -> reason -> count (last passes)
        self._legal_cache: dict[tuple, str | None] = {}
        self.accumulated = 0  # adds the last pass turned into matmul accumulation (addmm)
        self.widened = 0  # conversions to float32 the last pass moved into their matmuls
        self.gathered = 0  # conversions of trace inputs the last pass made in one kforge_cast_inputs
        self.norm_folded = 0  # adds and conversions the last pass moved into RMSNorm kernels
        self.deduped = 0  # repeated view symbols the last pass removed

    def get_fuel(self, amount: int = 1, /) -> bool:
        return True

    def set_fuel(self, value: Any) -> None:
        pass

    # -- the pass ------------------------------------------------------------------------------------
    def _fusible(self, bsym: BoundSymbol) -> bool:
        if bsym.sym.is_fusion or not self.can_fuse(bsym):
            return False
        return any(isinstance(p, TensorProxy) and p.device.type == "cuda"
                   for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs))

    def _legal(self, bsyms: list, inputs: list, outputs: list) -> str | None:
        key = (tuple(id(b) for b in bsyms), tuple(p.name for p in inputs), tuple(p.name for p in outputs))
        if key in self._legal_cache:
            return self._legal_cache[key]
        try:
            region_ir = fir.lower(bsyms, inputs, outputs)
            codegen.generate(region_ir, codegen.default_key(region_ir))
            why = None
        except fir.Unsupported as e:
            why = str(e)
        self._legal_cache[key] = why
        return why

    def fusion_pass(self, trace: TraceCtx) -> TraceCtx:
        t0 = time.perf_counter()
        self._legal_cache = {}
        # Sums of matmul results go into the matmuls (addmm) first, so no region is made of the add.
        # Repeated views (the gradient rules' reshapes) once, so later passes see one reader.
        bsyms, self.deduped = dedupe_views(trace.bound_symbols)
        bsyms, self.accumulated = accumulate_matmuls(bsyms)
        # A 16-bit matmul converted to float32 (autocast's weight gradients) stores float32 itself; so
        # does one read through a reshape by a kforge kernel (new proxies: named in the trace's context,
        # whose names the fused trace inherits).
        from thunder.core.trace import tracectx

        with tracectx(trace):
            bsyms, self.widened = widen_matmuls(bsyms)
        # Residual gradients added by the RMSNorm backward kernels (autocast's fp32 residual stream).
        bsyms, self.norm_folded = fold_residual_grads(bsyms)
        # ... and fp32 norms whose output only a cast to 16 bits reads store that type themselves.
        bsyms, narrowed = narrow_norm_outputs(bsyms)
        # ... and the fp32 stream's add of an upcast 16-bit branch goes into the norm after it.
        bsyms, branched = fold_branch_adds(bsyms)
        # ... and a norm backward's dx that a 16-bit matmul reads too is stored in both types by it.
        bsyms, copied = copy_norm_grads(bsyms)
        # ... and a norm backward whose dy is a sum of upcast 16-bit matmul results reads those.
        bsyms, summed = sum_norm_grads(bsyms)
        # ... and a residual gradient of zeros made for a norm backward alone is not made.
        bsyms, zeros = drop_zero_dresiduals(bsyms)
        self.norm_folded += narrowed + branched + copied + summed + zeros
        # Autocast's weight casts that the forward returns: made together, in one launch.
        bsyms, self.gathered = gather_input_casts(bsyms, _trace_inputs(trace), _returned(trace))
        order, groups, reasons = partition(bsyms, self._fusible, self._legal)
        from thunder.core.compile_data import get_compile_data

        cd = get_compile_data()
        per_fn = None
        if cd is not None:  # kept with the function being compiled, for kforge.inspect
            per_fn = cd.__dict__.setdefault("_kforge_fusion_left_out", {})
        for i, why in reasons.items():
            name = bsyms[i].sym.name
            self.left_out.setdefault(name, {}).setdefault(why, 0)
            self.left_out[name][why] += 1
            if per_fn is not None:
                per_fn[(name, why)] = per_fn.get((name, why), 0) + 1
        new_bsyms: list[BoundSymbol] = []
        counter = 0
        for item in order:
            if isinstance(item, Group):
                new_bsyms.append(self._fuse(item.bsyms, item.inputs, item.outputs, counter))
                counter += 1
            else:
                new_bsyms.append(item)
        fused = from_trace(trace)
        fused.bound_symbols = new_bsyms
        fused = dce(fused)
        self._legal_cache = {}
        ms = (time.perf_counter() - t0) * 1e3
        fused.set_provenance(TraceProvenance(f"kforge fusion: {counter} regions, {self.accumulated} adds and "
                                             f"{self.widened} conversions into matmuls, {self.norm_folded} adds and conversions into norms, "
                                             f"{self.gathered} input casts gathered, {self.deduped} repeated views removed (took {ms:.0f} milliseconds)"))
        self._precompile_trace(fused)
        return fused

    def _precompile_trace(self, trace: TraceCtx) -> None:
        frs, device = [], None
        for b in trace.bound_symbols:
            fr = getattr(b, "_kforge_region", None)
            if fr is not None:
                frs.append(fr)
                device = device if device is not None else _device_of(b)
        if frs and device is not None:
            try:
                _precompile(frs, device)
            except Exception:  # compiling ahead is an optimisation: the first call compiles instead
                pass

    def fuse(self, region: Any, fusion_counter: int) -> BoundSymbol:
        """Thunder's entry (rematerialisation / update_fusion_call_ctx call it again per fusion)."""
        inputs = [unvariableify(x) for x in region.inputs]
        outputs = [unvariableify(x) for x in region.outputs]
        return self._fuse(list(region.bound_symbols), inputs, outputs, fusion_counter)

    def _fuse(self, bsyms: list, inputs: list, outputs: list, counter: int) -> BoundSymbol:
        name = f"kforgeFusion{counter}"
        reason = None
        fr = None
        try:
            region_ir = fir.lower(bsyms, inputs, outputs)
            fn, fr, kind = region_callable(region_ir, _device_index(inputs, outputs))
        except fir.Unsupported as e:
            reason = str(e)
            fn = _torch_callable(bsyms, inputs, outputs)
            kind = "torch"
        sym = Symbol(name=name, meta=None, is_fusion=True, executor=self)
        bsym = BoundSymbol(sym, tuple(inputs), {}, list(outputs), tuple(bsyms), _call_ctx={name: fn})
        if any(BoundSymbolTag.BACKWARD in b.tags for b in bsyms):
            bsym.tags.add(BoundSymbolTag.BACKWARD)
        bsym._kforge_region = fr  # type: ignore[attr-defined]
        if reason is None:
            ops = [v.op for v in region_ir.values if v.op not in ("input", "scalar", "const")]
        else:
            ops = [b.sym.name for b in bsyms]
        self.infos[name] = FusionInfo(name, ops, getattr(fn, "name", None) if reason is None else None, kind, reason)
        return bsym


def region_callable(region_ir: fir.RegionIR, device: int) -> tuple[Any, FusedRegion | None, str]:
    """(what a trace calls for the region, its FusedRegion or None, its schedule kind): the inputs
    themselves for a passthrough, else the region structure's generated kernel. Unsupported when
    no kernel can compute it."""
    kind = codegen.schedule(region_ir).kind
    if kind == "passthrough":
        return _Passthrough(region_ir.output_sources()), None, kind
    fr = _get_region(region_ir, device)
    return fr.kernel, fr, kind


def describe(bsym: BoundSymbol) -> dict:
    """A kforge fusion symbol of a final trace: its name, ops, schedule and kernel (for inspect)."""
    from .codegen import schedule

    fn = (bsym._call_ctx or {}).get(bsym.sym.name)
    kernel = getattr(fn, "name", None)
    built = next((fr for fr in regions() if fr.kernel is fn), None) if fn is not None else None
    try:
        # The IR the kernel was built for: a final trace's symbol can carry proxies that Thunder
        # relabelled after the fusion pass (see trace_cache._kforge_regions).
        region = built.ir if built is not None else lower_fusion(bsym)
        ops = [v.op for v in region.values if v.op not in ("input", "scalar", "const")]
        kind = schedule(region).kind if kernel else "torch"
        if kernel and fir.view_plan(region) is not None:
            kind += " (a view when the input's strides allow)"
    except fir.Unsupported as e:
        ops, kind = [b.sym.name for b in bsym.subsymbols], f"torch ({e})"
    return {"name": bsym.sym.name, "ops": ops, "schedule": kind, "kernel": kernel or "torch fallback",
            "inputs": len(bsym.args), "outputs": len(bsym.output)}


def lower_fusion(bsym: BoundSymbol) -> fir.RegionIR:
    """The IR of a kforge fusion symbol of a final trace."""
    return fir.lower(bsym.subsymbols, [a for a in bsym.args], list(bsym.output))


def _trace_inputs(trace: TraceCtx) -> list:
    from thunder.core.pytree import tree_flatten

    flat, _ = tree_flatten((trace.args, trace.kwargs))
    return [p for p in flat if isinstance(p, TensorProxy)]


def _returned(trace: TraceCtx) -> set[str]:
    """Names of the tensors the trace returns (a forward's outputs and what it saves for backward)."""
    from thunder.core.prims import PrimIDs

    ret = [b for b in trace.bound_symbols if b.sym.id == PrimIDs.RETURN]
    return {p.name for p in ret[-1].flat_proxy_args} if ret else set()


def _device_of(bsym: BoundSymbol) -> int | None:
    for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs):
        if isinstance(p, TensorProxy) and p.device.type == "cuda":
            return p.device.index or 0
    return None


def _device_index(inputs: Sequence[Any], outputs: Sequence[Any]) -> int:
    for p in (*inputs, *outputs):
        if isinstance(p, TensorProxy) and p.device.type == "cuda":
            return p.device.index or 0
    return 0


def _checker(*args: Any, **kwargs: Any) -> bool:
    """Tensors on CUDA of a dtype the kernels handle; creation prims on a CUDA device."""
    from thunder.core.pytree import tree_flatten

    flat, _ = tree_flatten((args, kwargs))
    for x in flat:
        if isinstance(x, TensorProxy):
            if x.device.type != "cuda":
                return False
            try:
                fir.ir_dtype(x.dtype)
            except fir.Unsupported:
                return False
    dev = kwargs.get("device")
    if dev is not None and getattr(dev, "type", None) != "cuda" and getattr(dev, "devicetype", None) is not None:
        import thunder.core.devices as devices

        if dev.devicetype != devices.DeviceType.CUDA:
            return False
    dtype = kwargs.get("dtype")
    if dtype is not None:
        try:
            fir.ir_dtype(dtype)
        except (fir.Unsupported, Exception):
            return False
    return True
