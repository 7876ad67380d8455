"""kforge: llm.c-style CUDA kernels, compiled at run time with NVRTC, as a Lightning Thunder executor.

`import kforge` works without a GPU; kernels compile without one (see `compile_all`), and launching
needs a CUDA device. The runtime logs to `logging.getLogger("kforge")` (NVRTC loaded, compile times,
cache hits); environment variables are listed in `kforge._env`.
"""
from __future__ import annotations

import warnings as _warnings

# Thunder warns on import when NVIDIA's optional transformer_engine is absent; kforge never uses it,
# and the line reads like a broken install. Filtered before anything of kforge imports thunder.
_warnings.filterwarnings("ignore", message="transformer_engine module not found", category=UserWarning)

import torch  # noqa: E402  (loads LibTorch before the extension)

from . import _C  # noqa: E402
from ._runtime import MIN_ARCH, KforgeCacheWarning, cache_dir, kernel_dir  # noqa: E402
from ._runtime import check_arch as _check_arch, configure as _configure  # noqa: E402
from ._runtime import supported_archs as _supported_archs  # noqa: E402
from ._version import __version__  # noqa: E402

_configure(_C)

KforgeError = _C.KforgeError
KernelCompileError = _C.KernelCompileError

__all__ = [
    "KforgeError",
    "KernelCompileError",
    "KforgeCacheWarning",
    "cache_info",
    "compile_all",
    "kernel_names",
    "executor",
    "fusion_executor",
    "executors",
    "jit",
    "compile",
    "thunderfx",
    "kernel_dir",
    "cache_dir",
    "MIN_ARCH",
    "__version__",
]


def cache_info() -> dict:
    """Kernel cache statistics: memory and disk hits/misses, corrupt files seen, NVRTC compiles, and
    one entry per compiled program (name, arch, where it came from, compile ms, CUBIN bytes)."""
    return _C.cache_info()


def kernel_names() -> list[str]:
    """Names of every kernel source the runtime knows (one per `kernels_src/<name>.cu`)."""
    return list(_C.programs())


def compile_all(arch: int | None = None) -> dict[str, float]:
    """Compile every shipped kernel for `sm_<arch>` (default: the current GPU's, else 90); no GPU is
    needed. Returns {kernel name: compile ms (0 when it came from a cache)}. Raises ValueError for
    an arch below `MIN_ARCH` (80) or one the loaded NVRTC cannot compile for, before any compile."""
    if arch is None:
        arch = _C.device_arch(torch.cuda.current_device()) if torch.cuda.is_available() else 90
    arch = _check_arch(arch, "kforge.compile_all")
    arch = _check_arch(arch, "kforge.compile_all", _supported_archs(_C))
    before = {(e["name"], e["arch"]) for e in cache_info()["entries"]}
    for name in kernel_names():
        _C.compile(name, arch)
    out = {}
    for e in cache_info()["entries"]:
        if e["arch"] == f"sm_{arch}":
            out[e["name"]] = e["compile_ms"] if e["source"] == "nvrtc" and (e["name"], e["arch"]) not in before else 0.0
    return out


def __getattr__(name: str):
    # The Thunder executor is built on first access, so `import kforge` stays light (no thunder import).
    if name == "executor":
        from ._thunder import get_executor

        return get_executor()
    if name == "fusion_executor":
        from .fusion import get_fusion_executor

        return get_fusion_executor()
    if name in ("executors", "jit", "compile"):
        from . import frontend

        return getattr(frontend, name)
    if name == "thunderfx":  # Thunder's Dynamo path with kforge first and the Llama trace patterns on
        from .transforms import thunderfx

        return thunderfx
    raise AttributeError(f"module 'kforge' has no attribute {name!r}")
