"""kforge.fusion: generated CUDA kernels for everything kforge's operators leave in a trace.

    import kforge
    jmodel = kforge.jit(model)                 # kforge's operators, attention, then this fusion executor
    thunder.jit(model, executors=kforge.executors())

Pipeline, each stage testable alone: Thunder region (bound symbols) -> `ir.lower` -> `RegionIR`
(`ir.format_ir` prints it) -> `codegen.generate(ir, layout)` -> CUDA source -> the runtime's
`GeneratedKernel` (NVRTC, memory + disk cache, launch on the current stream).
Set KFORGE_FUSION=0 to leave the fusion executor out of `kforge.executors()`.
"""
from __future__ import annotations

import functools

__all__ = ["fusion_enabled", "get_fusion_executor"]


def fusion_enabled() -> bool:
    """Whether KFORGE_FUSION leaves the fusion executor on (kforge._env parses it: 0 / false / off /
    no in any case mean off; an unknown value raises)."""
    from .. import _env

    return _env.flag("KFORGE_FUSION")


@functools.cache
def get_fusion_executor():
    """The process's one kforge fusion executor (registered with Thunder on first use)."""
    from thunder.extend import register_executor

    from .executor import KforgeFusionExecutor

    ex = KforgeFusionExecutor()
    register_executor(ex)
    return ex
