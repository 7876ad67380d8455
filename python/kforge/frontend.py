"""The one-call entry points: `kforge.jit`, `kforge.compile` and `kforge.executors`.

    import kforge
    jmodel = kforge.jit(model)          # thunder.jit with kforge's executors and pattern transforms
    cmodel = kforge.compile(model)      # the same through torch.compile (Thunder's Dynamo path)
    thunder.jit(model, executors=kforge.executors())   # for those who pass the list themselves

The executor order matters twice in Thunder: it decides which executor claims a symbol, and which
executor's gradient rule is used. kforge's operators come first (they claim the named steps whole,
forward and backward); then Thunder's attention executors (a fusion executor placed before them
would take SDPA apart into matmul + softmax); then kforge's fusion executor, which generates kernels
for every elementwise / view / reduction chain left over; then Thunder's remaining defaults.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import _env

__all__ = ["executors", "jit", "compile"]

_warming = False

# Thunder executors that implement attention itself; they go before the fusion executor.
_ATTENTION_EXECUTORS = ("cudnn", "sdpa", "fa3")


def executors(*, fusion: bool | None = None) -> list:
    """kforge's operator executor, Thunder's attention executors, kforge's fusion executor (unless
    `fusion=False` or the environment sets KFORGE_FUSION=0), then Thunder's other default executors."""
    import thunder

    from . import _thunder
    from .fusion import get_fusion_executor

    _check_fusion("kforge.executors", fusion)

    defaults = list(thunder.get_default_executors())
    attention = [e for e in defaults if e.name in _ATTENTION_EXECUTORS]
    rest = [e for e in defaults if e not in attention]
    out = [_thunder.get_executor(), *attention]
    if _env.flag("KFORGE_FUSION") if fusion is None else fusion:
        out.append(get_fusion_executor())
    return out + rest


def _check_fusion(who: str, fusion: object) -> None:
    if fusion is not None and not isinstance(fusion, bool):
        raise TypeError(f"{who}: fusion must be True, False or None (KFORGE_FUSION decides), "
                        f"got {fusion!r}")


def _check_switch(who: str, name: str, value: object) -> None:
    """TypeError naming `who` and `name` unless `value` is True, False or None (the default)."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{who}: {name} must be True, False or None, got {value!r}")


def _check_args(who: str, fn: object, fusion: object, transforms: object, kwargs: dict) -> None:
    """TypeError naming `who` and the argument for what thunder.jit / torch.compile would reject late
    or obscurely (a model that is not callable, a single transform not in a list, ...)."""
    import torch
    from thunder.core.transform_common import Transform

    if not callable(fn):
        raise TypeError(f"{who}: expected a torch.nn.Module or a function to compile, got {type(fn).__name__}")
    if isinstance(fn, type):
        raise TypeError(f"{who}: got the class {fn.__name__}; pass an instance (e.g. {fn.__name__}(...))")
    _check_fusion(who, fusion)
    if isinstance(transforms, Transform):
        raise TypeError(f"{who}: transforms must be a list of Thunder transforms; wrap the one given in a list: "
                        f"transforms=[{type(transforms).__name__}(...)]")
    if isinstance(transforms, (str, bytes)) or not isinstance(transforms, Sequence):
        raise TypeError(f"{who}: transforms must be a list of Thunder transforms, got {type(transforms).__name__}")
    bad = [type(t).__name__ for t in transforms if not isinstance(t, Transform)]
    if bad:
        raise TypeError(f"{who}: transforms must be Thunder transforms (thunder.core.transform_common.Transform); "
                        f"got {', '.join(bad)}")
    ex = kwargs.get("executors")
    if ex is not None and (isinstance(ex, (str, bytes)) or not isinstance(ex, Sequence)):
        raise TypeError(f"{who}: executors must be a list of Thunder executors (kforge.executors() gives "
                        f"kforge's), got {type(ex).__name__}")
    if isinstance(fn, torch.jit.ScriptModule):
        raise TypeError(f"{who}: got a TorchScript module; pass the plain torch.nn.Module")


def _compile_kernels_in_background() -> None:
    """Compile kforge's kernel sources on a thread pool while Thunder traces (seconds of tracing,
    one NVRTC compile per source; disk-cache hits return at once). Done once per process."""
    global _warming
    if _warming:
        return
    _warming = True
    import concurrent.futures
    import os

    import torch

    from . import _C, kernel_names

    if not torch.cuda.is_available():
        return
    arch = _C.device_arch(torch.cuda.current_device())
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1)),
                                                 thread_name_prefix="kforge-warm")
    for name in kernel_names():
        pool.submit(_C.compile, name, arch)  # releases the GIL while NVRTC runs
    pool.shutdown(wait=False)


def forget_background_compiles() -> None:
    """Let the next kforge.jit / kforge.compile start compiling kforge's kernel sources again, as in a
    fresh process: for benchmarks that time a cold first step after dropping the kernel caches (the
    kernels would otherwise reach the new disk cache only when first launched, some never)."""
    global _warming
    _warming = False


def jit(fn: Callable, /, *, fusion: bool | None = None, cudagraphs: bool = False,
        transforms: Sequence[Any] = (), trace_cache: bool | None = None, gemm: bool | None = None,
        **kwargs: Any):
    """`thunder.jit(fn)` with `kforge.executors()` and kforge's pattern transforms, which find the
    mission's steps (RMSNorm, RoPE, GQA, SwiGLU, ...) as users write them in plain torch ops and hand
    them to kforge's operators. `cudagraphs=True` adds `kforge.cudagraphs.CUDAGraphs()` (forward and
    backward replayed as CUDA graphs: static shapes, forward and backward alternating). Other keyword
    arguments go to `thunder.jit` (`executors=` overrides the list). `fn.llama_patterns` is the
    pattern transform (its `rewrites` say what was replaced). Raises TypeError, naming the argument,
    for a non-callable `fn`, a non-bool `fusion`, `cudagraphs` or `trace_cache`, or `transforms` that
    is not a list of Thunder transforms. `trace_cache` (default: KFORGE_TRACE_CACHE, on): the
    programs Thunder compiles are kept on disk and a later process starts from them instead of
    tracing again (`kforge.trace_cache`); restored programs carry no Thunder traces, so pass False
    to inspect `thunder.last_traces`. `gemm` (default: KFORGE_GEMM, on): the traces' bf16 / fp16 matrix products
    called on kforge's cuBLASLt plans (`kforge.ops.gemm`)."""
    from .cudagraphs import _check, with_cudagraphs
    from .transforms import jit as _jit

    _check_args("kforge.jit", fn, fusion, transforms, kwargs)
    _check("kforge.jit", cudagraphs)
    _check_switch("kforge.jit", "trace_cache", trace_cache)
    _check_switch("kforge.jit", "gemm", gemm)
    _compile_kernels_in_background()
    kwargs.setdefault("executors", executors(fusion=fusion))
    jfn = _jit(fn, transforms=with_cudagraphs(transforms, cudagraphs), gemm=gemm, **kwargs)
    from . import trace_cache as tc

    if tc.enabled() if trace_cache is None else (trace_cache and tc.disk_usable()):
        jfn = tc.attach(jfn)
    return jfn


def compile(model: Callable, /, *, fusion: bool | None = None, cudagraphs: bool = False,
            transforms: Sequence[Any] = (), trace_cache: bool | None = None, gemm: bool | None = None,
            **kwargs: Any):
    """`torch.compile(model)` with Thunder as its backend (Thunder's Dynamo path), `kforge.executors()`
    and the pattern transforms: for models `thunder.jit` cannot trace (Hugging Face's LlamaForCausalLM
    runs either way). `cudagraphs`, `trace_cache` and `gemm` as in `kforge.jit`: with the trace cache,
    every Thunder piece of Dynamo's graphs is restored from disk by a later process, which then runs
    Dynamo but not Thunder's tracing. Other keyword arguments go to Thunder / torch.compile. Raises
    TypeError as `kforge.jit` does for bad arguments."""
    from . import trace_cache as tc
    from .cudagraphs import _check, with_cudagraphs
    from .transforms import thunderfx

    _check_args("kforge.compile", model, fusion, transforms, kwargs)
    _check("kforge.compile", cudagraphs)
    _check_switch("kforge.compile", "trace_cache", trace_cache)
    _check_switch("kforge.compile", "gemm", gemm)
    _compile_kernels_in_background()
    kwargs.setdefault("executors", executors(fusion=fusion))
    cached = tc.enabled() if trace_cache is None else (trace_cache and tc.disk_usable())
    return thunderfx(model, transforms=with_cudagraphs(transforms, cudagraphs), gemm=gemm, trace_cache=cached,
                     **kwargs)
