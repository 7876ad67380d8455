"""Locating kernel sources, NVRTC and the cache directory, and configuring kforge._C with them.

The runtime's messages go to `logging.getLogger("kforge")` (which NVRTC was loaded: INFO; each NVRTC
compile and its milliseconds: INFO; memory / disk cache hits and cache writes: DEBUG) and its
warnings to `warnings.warn` as `KforgeCacheWarning`. Environment variables are read by `kforge._env`.
"""
from __future__ import annotations

import glob
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from . import _env

logger = logging.getLogger("kforge")
logger.addHandler(logging.NullHandler())  # a library configures no output; applications do


class KforgeCacheWarning(RuntimeWarning):
    """A kernel cache file was unusable (truncated, corrupted) and has been recompiled, or the cache
    directory could not be written (read-only, not creatable, full) and kforge runs without it."""


# The kernels use sm_80 PTX (cvt.rn.bf16.f32 for bf16 stores): older targets fail in ptxas.
MIN_ARCH = 80


def check_arch(arch: object, who: str, supported: Sequence[int] | None = None) -> int:
    """`arch` as an int when kforge can compile for sm_<arch>, else ValueError naming `who`.
    `supported`: the architectures NVRTC compiles for (`_C.nvrtc_supported_archs()`), if known."""
    if isinstance(arch, bool) or not isinstance(arch, int):
        raise ValueError(f"{who}: arch must be an int such as {MIN_ARCH} (sm_{MIN_ARCH}), got {arch!r}")
    if arch < MIN_ARCH:
        raise ValueError(f"{who}: sm_{arch} is not supported; sm_{MIN_ARCH} is the minimum architecture "
                         f"kforge supports")
    if supported is not None and arch not in supported:
        ok = ", ".join(str(a) for a in supported if a >= MIN_ARCH)
        raise ValueError(f"{who}: sm_{arch} is not an architecture this NVRTC compiles for; use one of {ok}")
    return arch


def supported_archs(C) -> list[int] | None:
    """The architectures the loaded NVRTC compiles for, or None when NVRTC cannot be loaded (the
    compile that follows then raises the runtime's own "NVRTC not found" error)."""
    try:
        return list(C.nvrtc_supported_archs())
    except C.KforgeError:
        return None


def kernel_dir() -> str:
    """Directory holding the kernel sources (`<name>.cu`, headers)."""
    env = _env.text("KFORGE_KERNEL_DIR")
    if env:
        return env
    here = Path(__file__).resolve().parent
    installed = here / "kernels_src"  # copied in by setup.py's build_py
    if installed.is_dir():
        return str(installed)
    return str(here.parent.parent / "kernels_src")  # editable install / source checkout


def cache_dir() -> str:
    """Disk cache directory: $KFORGE_CACHE_DIR, else ~/.cache/kforge (XDG_CACHE_HOME honoured)."""
    env = _env.text("KFORGE_CACHE_DIR")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kforge")


def disk_cache_enabled() -> bool:
    """Whether KFORGE_DISK_CACHE leaves the disk cache on (the default)."""
    return _env.flag("KFORGE_DISK_CACHE")


def _pathfinder_nvrtc() -> str | None:
    """The libnvrtc that NVIDIA's `cuda.pathfinder` (installed with CUDA builds of torch) finds: the
    nvidia wheels of this environment, conda, $CUDA_HOME / $CUDA_PATH. None when it is absent or
    finds nothing; the hand-written search follows either way."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return None
    try:
        path = load_nvidia_dynamic_lib("nvrtc").abs_path
    except Exception as e:  # not found, unsupported platform, probe failure: the search list follows
        logger.debug("cuda.pathfinder found no NVRTC (%s: %s)", type(e).__name__, e)
        return None
    logger.debug("cuda.pathfinder found NVRTC at %s", path)
    return path


def nvrtc_candidates() -> list[str]:
    """libnvrtc candidates, best first: $KFORGE_NVRTC, the one `cuda.pathfinder` finds, the one the
    CUDA torch wheel ships (matching torch's CUDA), one already on the loader path, then the CUDA
    toolkit."""
    out: list[str] = []
    env = _env.text("KFORGE_NVRTC")
    if env:
        out.append(env)
    else:  # an explicit choice needs no search
        found = _pathfinder_nvrtc()
        if found:
            out.append(found)
    major = None
    try:
        import torch

        if torch.version.cuda:
            major = torch.version.cuda.split(".")[0]
    except Exception:  # torch missing or broken: still try the toolkit
        pass
    pats = [f"libnvrtc.so.{major}"] if major else []
    pats.append("libnvrtc.so.*[0-9]")
    for sp in sys.path:
        for sub in ("nvidia/cu*/lib", "nvidia/cuda_nvrtc/lib"):
            for pat in pats:
                out.extend(sorted(glob.glob(os.path.join(sp, sub, pat))))
    if major:
        out.append(f"libnvrtc.so.{major}")
    out.append("libnvrtc.so")
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            out.extend(sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*"))))
    seen: set[str] = set()
    return [p for p in out if not (p in seen or seen.add(p))]


def _on_runtime_message(level: int, message: str) -> None:
    # Called by the runtime once it holds none of its locks (src/runtime/program.h, flush_log).
    if level >= logging.WARNING:
        warnings.warn(message, KforgeCacheWarning, stacklevel=2)
    else:
        logger.log(level, message)


def configure(C) -> None:
    """Hand the runtime its kernel directory, cache, NVRTC candidates and switches, and route its
    messages to logging / warnings. Raises `kforge._env.KforgeEnvError` for a malformed variable."""
    disk, dependent = disk_cache_enabled(), _env.flag("KFORGE_DEPENDENT_LAUNCH")
    C.set_log_handler(_on_runtime_message)
    C.configure(kernel_dir(), cache_dir(), disk, nvrtc_candidates(), dependent_launch=dependent)
